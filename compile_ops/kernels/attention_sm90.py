"""The Hopper (sm_90) attention forward core, in Gluon: warp-specialized, FlashAttention-3's structure.

Why a second forward next to ``attention.py``'s ``attn_fwd_kernel``: that
kernel is written in ``triton.language``, whose compiler issues the TMA
loads from the warps that run the softmax (four CTA barriers a key step)
and waits for every wgmma right after issuing it. Triton 3.6's own warp
specialization of that loop gave wrong results at random and no speed
(bench/notes.md). Gluon lets the kernel say what FlashAttention-3 does:

- work items of 128 queries of one (batch, head), dealt out round robin to
  the programs (one per SM for dense attention: persistent), each program
  in three partitions:
  - a 1-warp loader (24 registers): each item's q, once both consumers are
    done with the last item's (a "q empty" mbarrier), then every key tile's
    K and V into a ring of ``STAGES`` shared-memory buffers that runs on
    across items, each buffer guarded by a "ready" mbarrier (its TMA bytes
    arrived) and an "empty" one (both consumers are done with it). So the
    next item's loads run under this item's last product and epilogue, and
    the three TMA descriptors (4-D, over whole tensors) are written once
    per program, not per item: 1.01-1.06x a program per item, most at the
    short lengths (1x24x4608: 0.91x cuDNN per item, 0.96x persistent; H100,
    bench/notes.md, "A persistent sm_90 core");
  - two consumer warp groups of 64 query rows each (``CONSUMER_REGS``
    registers), sharing every K/V tile; neither waits for the other, so the
    warp schedulers run one's softmax under the other's products;
- inside a consumer, step j issues S_j = Q K_j^T and then O += P_j-1 V_j-1
  and waits for S_j alone, so S_j's softmax can start while the product
  runs. In the SASS ptxas hoists the product's wait above the softmax's
  exponentials all the same; a wait pinned below them (predicated on the
  row sums) changed nothing at 16 bits and cost 5-7% in INT8_FP8 (H200,
  bench/notes.md): the other consumer's products fill the tensor cores
  while this one's softmax runs.

Measured (bench/notes.md, "The sm_90 core" and after): 0.95-1.11x cuDNN's
forward where the ``triton.language`` kernel was 0.88-1.01x; block-sparse,
causal and key lengths 1.05-1.17x that kernel. Its output is the portable
kernel's bit for bit (same 128 x 128 tiles, products, order of additions
and formulas).

What it takes (``ops/attention.py`` routes everything else to the
portable kernel): 16-bit q/k/v with a unit stride along D (a power of
two; the package sends D = 128, and D = 64 where it is ahead), 16-byte
aligned bases and batch, head and row strides (TMA), ``Lk >= 1``; dense or
block-sparse, causal or not, with key lengths or not, its items in
``attn_fwd_kernel``'s program order (``query_tile``: causal items longest
first). Its tiles are 128 queries by ``BLOCK_N`` keys: 128, the
block-sparse lists' blocks, or (dense, D = 64) 256, a multiple of the
query tile, so at most one key tile of an item needs a mask: the one at
the unmasked keys' end (kv_len's ragged tile, the causal diagonal, or
both). With 256-key tiles a tile's scores and the previous tile's P do not
fit in a consumer's registers side by side (ptxas spilled 660 bytes), so
each key step folds the previous P V in before it issues the next Q K^T
(``_key_step``): only the other consumer overlaps this one's softmax.
That form at D = 64 ran 1.07-1.09x the portable kernel (bench/notes.md).

``INT8_FP8``: the 8-bit operands of ``attn_fwd_kernel``'s ``INT8`` +
``PV_FP8`` mode with q given in int8, the same formulas (biased int32
scores, one row factor per tile, ``2**8 p`` rounded to e4m3, a fresh FP8
product per tile added to the fp32 accumulator), and the same results bit
for bit, dense only. Measured, not routed: its P goes through shared
memory (:func:`_next_carry`), and it is not ahead of ``attn_fwd_kernel``
(``ops.attention.SM90_CORE_PRECISIONS``).

``attn_bwd_sm90_kernel`` (end of the module): the backward in five
products a tile pair, FlashAttention-3's structure too (a loader warp, two
consumer warp groups of 64 keys sharing steps of 64 queries, 128 at D = 64), with dq added by
TMA reductions in the order the programs run: the
``set_attention_backward(deterministic=False)`` option, dense, causal,
with key lengths or over block lists: 1.05-1.12x the deterministic passes
forward+backward, causal 1.10-1.19x, block-sparse 1.11-1.26x (H100,
bench/notes.md, "A five-product backward in Gluon" and after). Without
dQ it is the deterministic backward's dk/dv pass (four products), for
dense non-causal calls persistent: one program per SM over the key tiles.

Gluon does not run under the interpreter: the CPU tests compile every
variant for sm_90 (tests/test_sm90_compile.py), the GPU tests compare them
with the portable kernel (the backward: with the deterministic passes).
"""
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from compile_ops.kernels.attention_common import (INT8_BIAS, INT8_BIAS_BITS, P_FP8_SHIFT, block_list, dealt_rank,
                                                  kv_len_of, query_program, tile_start)

_LOG2E = gl.constexpr(1.4426950408889634)
_LN2 = gl.constexpr(0.6931471805599453)
#: Query rows per consumer warp group: one wgmma's M.
_ROWS = gl.constexpr(64)
#: dQ's fp32 channels per TMA reduction in the backward: 128-byte rows, the reductions' 128-byte swizzle.
_DQ_PIECE = gl.constexpr(32)


@gluon.jit
def _loader(args, CAUSAL: gl.constexpr, SPARSE: gl.constexpr, HAS_KV_LEN: gl.constexpr,
            HEAVY_FIRST: gl.constexpr):
    """The producer warp, over this program's work items: each item's q rows
    (once both consumers' last Q K^T of the previous item is done), then
    every key tile's K and V (the listed blocks' tiles, block-sparse) into
    the ring, which runs on across items."""
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, p_smems, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
     work, OUT, LSE, sol, lq, scale, Q_SCALE, K_SCALE, V_SCALE) = args
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    GROUP = work[7]
    it = 0  # key tiles loaded so far: the ring's position
    item = 0
    for w in range(gl.program_id(0), _work_items(work), gl.num_programs(0)):
        b, h, _, q_start, _, blocks, n_tiles, _, _, _ = _work_item(w, work, BLOCK_N, CAUSAL, SPARSE, HAS_KV_LEN,
                                                                   HEAVY_FIRST)
        b = b.to(gl.int32)
        hk = (h // GROUP).to(gl.int32)
        mbarrier.wait(q_empty, (item & 1) ^ 1)
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h.to(gl.int32), q_start, 0], q_bar, _box(q_smem))
        for j in range(n_tiles):
            stage = (it + j) % STAGES
            phase = ((it + j) // STAGES) & 1
            # Read before the wait for a free buffer, which hides the list read's latency.
            row = tile_start(j, blocks, BLOCK_N, BLOCK_N, SPARSE)
            # A fresh mbarrier counts as having completed the phase before its first,
            # so the first STAGES waits on "empty" pass at once.
            mbarrier.wait(k_empty.index(stage), phase ^ 1)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [b, hk, row, 0], k_ready.index(stage),
                                            _box(k_smem.index(stage)))
            mbarrier.wait(v_empty.index(stage), phase ^ 1)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            if v_smem.dtype == gl.float8e4nv:  # FP8 P V's transposed V: [D, BLOCK_N] tiles along the keys
                tma.async_copy_global_to_shared(v_desc, [b, hk, 0, row], v_ready.index(stage),
                                                _box(v_smem.index(stage)))
            else:
                tma.async_copy_global_to_shared(v_desc, [b, hk, row, 0], v_ready.index(stage),
                                                _box(v_smem.index(stage)))
        it += n_tiles
        item += 1


@gluon.jit
def _box(buffer):
    """A ``[rows, cols]`` shared-memory matrix as the ``[1, 1, rows, cols]`` box of a 4-D TMA descriptor."""
    return buffer.reshape([1, 1, buffer.shape[0], buffer.shape[1]])


@gluon.jit
def _softmax(s, m, l, row, qk_scale, key_limit, diagonal, MASKED: gl.constexpr, INT8_FP8: gl.constexpr,
             s_layout: gl.constexpr):
    """One key tile's online-softmax step in base 2 (``attn_fwd_kernel``'s
    formulas): ``(p, m_new, l_new, alpha)``. ``MASKED`` (the one tile past the
    unmasked ones): its key c is visible to query row r of this consumer
    iff ``c < key_limit`` (the keys up to kv_len) and ``c <= r + diagonal``
    (causal: the query's position less the tile's first key; a tile's width
    where nothing is causal). ``INT8_FP8``: ``s`` holds the biased int32
    scores' bits, ``row`` the tile's factor per row (q's scale times the
    tile's k scale), and p is ``2**8`` times the probability."""
    if INT8_FP8:
        s = s.to(gl.float32, bitcast=True)
    if MASKED:
        cols = gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s_layout))
        rows = gl.arange(0, s.shape[0], layout=gl.SliceLayout(1, s_layout))
        visible = (cols < key_limit)[None, :] & (cols[None, :] <= (rows + diagonal)[:, None])
        s = gl.where(visible, s, float("-inf"))
    if INT8_FP8:  # row > 0: the largest biased score is the largest score
        m_new = gl.maximum(m, (gl.max(s, 1) - INT8_BIAS) * row)
    else:
        m_new = gl.maximum(m, gl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf: shift by 0, so that exp2 gives 0, not NaN.
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    if INT8_FP8:  # exp2((s - BIAS) * row * c - m * c + 8) as one fma per score
        factor = row * qk_scale
        shift = factor * INT8_BIAS + m_shift * qk_scale - P_FP8_SHIFT
        p = gl.exp2(s * factor[:, None] - shift[:, None])
        alpha = gl.exp2((m - m_shift) * qk_scale)
    else:
        m_scaled = m_shift * qk_scale
        p = gl.exp2(s * qk_scale - m_scaled[:, None])
        alpha = gl.exp2(m * qk_scale - m_scaled)
    l = l * alpha + gl.sum(p, 1)
    return p, m_new, l, alpha


@gluon.jit
def _scores(c, q_rows, k_smem, k_ready, s_init):
    """Issue Q K^T for the c-th key tile through the ring once its keys have
    arrived (asynchronous)."""
    STAGES: gl.constexpr = k_smem.shape[0]
    stage = c % STAGES
    mbarrier.wait(k_ready.index(stage), (c // STAGES) & 1)
    return warpgroup_mma(q_rows, k_smem.index(stage).permute((1, 0)), s_init,
                         use_acc=k_smem.dtype == gl.int8, is_async=True)


@gluon.jit
def _next_carry(p, alpha, v_smem, p_smem, p_layout: gl.constexpr):
    """What a key step hands the next one, once its product is done. 16-bit:
    P in registers, the next product's A operand. INT8_FP8: the tile's alpha,
    with ``2**8 p`` rounded to e4m3 stored to this consumer's shared buffer
    (the next product's A operand) and ordered before its reads (async
    proxy). In registers, an 8-bit P takes Triton's conversion from the
    scores' layout, byte permutes and warp shuffles (161 ``shfl`` in the
    kernel's PTX), and the core ran 0.76-0.85x ``attn_fwd_kernel`` so,
    against 0.93-1.00x through shared memory (H200, bench/notes.md, "The
    sm_90 core's front ends")."""
    if v_smem.dtype == gl.float8e4nv:
        p_smem.store(p.to(gl.float8e4nv))
        fence_async_shared()
        return alpha
    else:
        return gl.convert_layout(p.to(v_smem.dtype), p_layout)


@gluon.jit
def _pv_issue(carry, o, o_zero, v_smem, p_smem, stage):
    """Issue P V for the tile in ``stage`` (asynchronous): 16-bit, P the
    carry and the rescaled O the accumulator; INT8_FP8, P from ``p_smem``
    into a fresh product (``attn_fwd_kernel``'s two-level accumulation: FP8
    MMAs keep fewer accumulator bits than fp32)."""
    if v_smem.dtype == gl.float8e4nv:
        return warpgroup_mma(p_smem, v_smem.index(stage).permute((1, 0)), o_zero, use_acc=False,
                             is_async=True)
    else:
        return warpgroup_mma(carry, v_smem.index(stage), o, is_async=True)


@gluon.jit
def _pv_fold(token, carry, o, v_smem, o_rows: gl.constexpr):
    """Wait for the product ``_pv_issue`` started and fold it into O: the
    16-bit product is O itself; INT8_FP8's is added to O rescaled by the
    product's tile's alpha (the carry)."""
    if v_smem.dtype == gl.float8e4nv:
        return o * gl.convert_layout(carry, o_rows)[:, None] + warpgroup_mma_wait(0, deps=[token])
    else:
        # P (the carry) is named so that its registers live until the product is done.
        o, carry = warpgroup_mma_wait(0, deps=[token, carry])
        return o


@gluon.jit
def _key_step(j, c, carry, o, m, l, q_rows, row_q, k_scales, k_smem, v_smem, p_smem, k_ready, k_empty, v_ready,
              v_empty, s_init, o_zero, qk_scale, key_limit, diagonal, MASKED: gl.constexpr,
              s_layout: gl.constexpr, p_layout: gl.constexpr, o_rows: gl.constexpr):
    """Key tile j >= 1 of one consumer's work item, the c-th through the ring:
    S_j and P_j-1 V_j-1 issued back to back, S_j's softmax while the product
    runs, then the product folded in (with 256-key tiles, P_j-1 V_j-1 first
    and folded in, then S_j: the module's docstring says why). Returns
    ``(carry, o, m, l)`` for tile j + 1 (:func:`_next_carry`): 16-bit, O
    comes back at S_j's running max; INT8_FP8, at S_j-1's (the next step
    rescales it by alpha_j, the carry, before adding P_j V_j)."""
    STAGES: gl.constexpr = k_smem.shape[0]
    INT8_FP8: gl.constexpr = k_smem.dtype == gl.int8
    stage = c % STAGES
    prev = (c - 1) % STAGES
    # Wide key tiles (BLOCK_N 256): S_j's scores and P_j-1 do not fit in the registers side by side (the
    # accumulator of an issued product and its register operand stay allocated until it is waited for), so
    # P_j-1 V_j-1 is done before S_j is issued; the other consumer's products fill the tensor cores meanwhile.
    SERIAL: gl.constexpr = k_smem.shape[1] > 2 * _ROWS
    if SERIAL:
        mbarrier.wait(v_ready.index(prev), ((c - 1) // STAGES) & 1)
        o = _pv_fold(_pv_issue(carry, o, o_zero, v_smem, p_smem, prev), carry, o, v_smem, o_rows)
        mbarrier.arrive(v_empty.index(prev), count=1)
        s = warpgroup_mma_wait(0, deps=[_scores(c, q_rows, k_smem, k_ready, s_init)])
    else:
        s_token = _scores(c, q_rows, k_smem, k_ready, s_init)
        mbarrier.wait(v_ready.index(prev), ((c - 1) // STAGES) & 1)
        o_token = _pv_issue(carry, o, o_zero, v_smem, p_smem, prev)
        s = warpgroup_mma_wait(1, deps=[s_token])  # wgmma groups complete in order: S_j is done
    mbarrier.arrive(k_empty.index(stage), count=1)
    row = row_q
    if INT8_FP8:
        row = row_q * gl.load(k_scales + j)
    p, m, l, alpha = _softmax(s, m, l, row, qk_scale, key_limit, diagonal, MASKED, INT8_FP8, s_layout)
    if not SERIAL:
        o = _pv_fold(o_token, carry, o, v_smem, o_rows)
        mbarrier.arrive(v_empty.index(prev), count=1)
    if not INT8_FP8:
        o = o * gl.convert_layout(alpha, o_rows)[:, None]
    return _next_carry(p, alpha, v_smem, p_smem, p_layout), o, m, l


@gluon.jit
def _key_tiles(it, o, m, l, q_rows, row_q, k_scales, k_smem, v_smem, p_smem, q_empty, k_ready, k_empty, v_ready,
               v_empty, s_init, o_zero, qk_scale, n_tiles, n_full, key_limit, diagonal, s_layout: gl.constexpr,
               p_layout: gl.constexpr, o_rows: gl.constexpr):
    """One consumer's pass over its work item's ``n_tiles >= 1`` key tiles,
    the last ``n_tiles - n_full`` (0 or 1) masked, the ring's ``it``-th
    onwards: ``(o, m, l)``. Once its last Q K^T is done it frees q for the
    loader (``q_empty``), which loads the next item's q under the last P V."""
    STAGES: gl.constexpr = k_smem.shape[0]
    INT8_FP8: gl.constexpr = k_smem.dtype == gl.int8
    # Key tile 0: no product in flight yet to overlap with.
    s = warpgroup_mma_wait(0, deps=[_scores(it, q_rows, k_smem, k_ready, s_init)])
    mbarrier.arrive(k_empty.index(it % STAGES), count=1)
    row = row_q
    if INT8_FP8:
        row = row_q * gl.load(k_scales)
    if n_full == 0:  # the only tile is the masked one
        p, m, l, alpha = _softmax(s, m, l, row, qk_scale, key_limit, diagonal, True, INT8_FP8, s_layout)
    else:
        p, m, l, alpha = _softmax(s, m, l, row, qk_scale, key_limit, diagonal, False, INT8_FP8, s_layout)
    carry = _next_carry(p, alpha, v_smem, p_smem, p_layout)
    for j in range(1, n_full):
        carry, o, m, l = _key_step(j, it + j, carry, o, m, l, q_rows, row_q, k_scales, k_smem, v_smem, p_smem,
                                   k_ready, k_empty, v_ready, v_empty, s_init, o_zero, qk_scale, key_limit, diagonal,
                                   False, s_layout, p_layout, o_rows)
    if n_tiles > n_full and n_full > 0:  # the masked tile after unmasked ones
        carry, o, m, l = _key_step(n_full, it + n_full, carry, o, m, l, q_rows, row_q, k_scales, k_smem, v_smem,
                                   p_smem, k_ready, k_empty, v_ready, v_empty, s_init, o_zero, qk_scale, key_limit,
                                   diagonal, True, s_layout, p_layout, o_rows)
    mbarrier.arrive(q_empty, count=1)  # every Q K^T of this item is done
    last = it + n_tiles - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    o = _pv_fold(_pv_issue(carry, o, o_zero, v_smem, p_smem, last % STAGES), carry, o, v_smem, o_rows)
    mbarrier.arrive(v_empty.index(last % STAGES), count=1)
    return o, m, l


@gluon.jit
def _consumer(args, HALF: gl.constexpr, CAUSAL: gl.constexpr, SPARSE: gl.constexpr, HAS_KV_LEN: gl.constexpr,
              HEAVY_FIRST: gl.constexpr):
    """One consumer warp group, over this program's work items: query rows
    ``q_start + 64 * HALF`` to 64 past it, through the item's key tiles, then
    their output rows and log-sum-exp."""
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, p_smems, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
     work, OUT, LSE, sol, lq, scale, Q_SCALE, K_SCALE, V_SCALE) = args
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    D: gl.constexpr = q_smem.shape[1]
    INT8_FP8: gl.constexpr = k_smem.dtype == gl.int8
    K_STEP: gl.constexpr = 32 if INT8_FP8 else 16  # a wgmma's K: 32 bytes of 8-bit operands, 16 of 16-bit
    H = work[6]
    GROUP = work[7]
    Lk = work[8]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, K_STEP])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, K_STEP])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    qk_scale = scale * _LOG2E
    q_rows = q_smem.slice(_ROWS * HALF, _ROWS)
    p_smem = p_smems.slice(_ROWS * HALF, _ROWS)
    it = 0  # key tiles consumed so far: the ring's position
    item = 0
    for w in range(gl.program_id(0), _work_items(work), gl.num_programs(0)):
        b, h, bh, q_start, kv_len, _, n_tiles, n_full, masked_start, out_off = _work_item(
            w, work, BLOCK_N, CAUSAL, SPARSE, HAS_KV_LEN, HEAVY_FIRST)
        first_row = q_start + _ROWS * HALF
        o_zero = gl.zeros([_ROWS, D], gl.float32, o_layout)
        if INT8_FP8:  # the biased int32 scores (see attn_fwd_kernel's INT8)
            s_init = gl.full([_ROWS, BLOCK_N], INT8_BIAS_BITS, gl.int32, s_layout)
        else:
            s_init = gl.zeros([_ROWS, BLOCK_N], gl.float32, s_layout)
        if INT8_FP8:
            kv_row = b * (H // GROUP) + h // GROUP  # the scales' (batch, k head) row
            k_scales = K_SCALE + kv_row * gl.cdiv(Lk, BLOCK_N)
            rows = first_row + gl.arange(0, _ROWS, layout=s_rows)
            # Rows past Lq get a factor of 1 (never 0: a masked score times 0 would be NaN); they are not stored.
            row_q = gl.load(Q_SCALE + bh.to(gl.int64) * lq + rows, mask=rows < lq, other=1.0)
        else:
            k_scales = LSE  # a stand-in, never read
            row_q = gl.full([_ROWS], 1.0, gl.float32, s_rows)
        o = o_zero
        m = gl.full([_ROWS], float("-inf"), gl.float32, s_rows)
        l = gl.zeros([_ROWS], gl.float32, s_rows)
        mbarrier.wait(q_bar, item & 1)
        # The masked tile's bounds: keys from kv_len on, and (causal) keys past each row's position.
        diagonal = BLOCK_N
        if CAUSAL:
            diagonal = first_row - masked_start
        if n_tiles > 0:
            o, m, l = _key_tiles(it, o, m, l, q_rows, row_q, k_scales, k_smem, v_smem, p_smem, q_empty, k_ready,
                                 k_empty, v_ready, v_empty, s_init, o_zero, qk_scale, n_tiles, n_full,
                                 kv_len - masked_start, diagonal, s_layout, p_layout, o_rows)
        else:
            mbarrier.arrive(q_empty, count=1)
        it += n_tiles
        item += 1

        # A row that saw no key (an empty block list, kv_len 0) gets 0 and an lse of -inf.
        empty = l == 0.0
        l = gl.where(empty, 1.0, l)
        out = o / gl.convert_layout(l, o_rows)[:, None]
        log2_l = gl.log2(l)
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        if INT8_FP8:  # V's channel scales; l sums 2**8 p
            kv_row = b * (H // GROUP) + h // GROUP  # again: one register fewer across the key tiles
            out = out * gl.load(V_SCALE + kv_row * D + cols)[None, :]
            log2_l = log2_l - P_FP8_SHIFT
        rows = first_row + gl.arange(0, _ROWS, layout=o_rows)
        gl.store(OUT + out_off + rows.to(gl.int64)[:, None] * sol + cols[None, :], out.to(OUT.dtype.element_ty),
                 mask=(rows < lq)[:, None])
        lse_row = first_row + gl.arange(0, _ROWS, layout=s_rows)
        lse = gl.where(empty, float("-inf"), m * scale + log2_l * _LN2)  # attn_fwd_kernel's formula
        gl.store(LSE + bh.to(gl.int64) * lq + lse_row, lse, mask=lse_row < lq)


@gluon.jit
def _consumer_low(args, CAUSAL: gl.constexpr, SPARSE: gl.constexpr, HAS_KV_LEN: gl.constexpr,
                  HEAVY_FIRST: gl.constexpr):
    _consumer(args, 0, CAUSAL, SPARSE, HAS_KV_LEN, HEAVY_FIRST)


@gluon.jit
def _consumer_high(args, CAUSAL: gl.constexpr, SPARSE: gl.constexpr, HAS_KV_LEN: gl.constexpr,
                   HEAVY_FIRST: gl.constexpr):
    _consumer(args, 1, CAUSAL, SPARSE, HAS_KV_LEN, HEAVY_FIRST)


@gluon.jit
def _listed_below(blocks, count, bound):
    """How many of the ``count`` ascending block indices at ``blocks`` are
    below ``bound``: a binary search (a dozen list reads at most)."""
    lo = 0
    hi = count
    while lo < hi:
        mid = (lo + hi) // 2
        below = gl.load(blocks + mid) < bound
        lo = gl.where(below, mid + 1, lo)
        hi = gl.where(below, hi, mid)
    return lo


@gluon.jit
def _work_items(work):
    """How many work items (query tiles of 128 rows, of every (batch, head)) a launch has."""
    n_q_tiles = work[0]
    BH = work[1]
    return n_q_tiles * BH


@gluon.jit
def _work_item(w, work, BLOCK_N, CAUSAL, SPARSE, HAS_KV_LEN, HEAVY_FIRST):
    """Work item w's set-up, the same in every partition: ``(batch, head,
    batch * H + head, first query, kv_len, its list of key blocks, key tiles,
    unmasked key tiles, first key of the masked tile, OUT's offset)``. Items
    are numbered in ``attn_fwd_kernel``'s launch order (``query_tile``: x
    fastest, causal dealt out longest first), so a persistent program's
    items and a one-item program's launch order agree."""
    n_q_tiles, BH, heads_per_group, KV_LEN, BLOCKS, COUNTS, H, GROUP, Lk, sob, soh, list_strides, stand_in = work
    if HEAVY_FIRST:
        rank, bh = dealt_rank(w, n_q_tiles, BH, heads_per_group)
        tile = n_q_tiles - 1 - rank
    else:
        tile = w % n_q_tiles
        bh = w // n_q_tiles
    # Given OUT's strides as q's, query_program's q offset is OUT's; q, k and v are read by descriptor coordinates.
    b, h, out_off, _k_off, _v_off, q_start, kv_len, unmasked_end, end = query_program(
        tile, bh, KV_LEN, H, GROUP, Lk, sob, soh, 0, 0, 0, 0, 2 * _ROWS, BLOCK_N, CAUSAL, HAS_KV_LEN)
    # Tiles of BLOCK_N = 2 * _ROWS = the list's blocks: at most one tile needs a mask, the one at the
    # unmasked keys' end (the ragged tile of kv_len, or the causal diagonal, or both).
    if SPARSE:
        sbb, sbh, sbr, scb, sch, scr = list_strides
        blocks, count = block_list(BLOCKS, COUNTS, b, h, q_start // BLOCK_N, sbb, sbh, sbr, scb, sch, scr)
        count = count.to(gl.int32)  # int32 or int64 lists
        if CAUSAL or HAS_KV_LEN:
            n_full = _listed_below(blocks, count, unmasked_end // BLOCK_N)
            n_tiles = _listed_below(blocks, count, gl.cdiv(end, BLOCK_N))
        else:  # every listed block is below cdiv(Lk, BLOCK_N): only the ragged last one may need a mask
            n_tiles = count
            n_full = count
            if Lk % BLOCK_N != 0 and count > 0:
                n_full = count - (gl.load(blocks + count - 1) == Lk // BLOCK_N).to(gl.int32)
    else:
        blocks = stand_in  # never read
        n_full = unmasked_end // BLOCK_N
        n_tiles = gl.cdiv(end, BLOCK_N)
    masked_start = unmasked_end
    if SPARSE and n_tiles > n_full:
        masked_start = tile_start(n_full, blocks, BLOCK_N, BLOCK_N, SPARSE)
    return b, h, bh, q_start, kv_len, blocks, n_tiles, n_full, masked_start, out_off


@gluon.jit
def attn_fwd_sm90_kernel(Q, K, V, OUT, LSE, KV_LEN, BLOCKS, COUNTS, Q_SCALE, K_SCALE, V_SCALE,
                         sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sob, soh, sol, sbb, sbh, sbr, scb, sch, scr,
                         BH, H, GROUP, Lq, Lk, scale, heads_per_group, D: gl.constexpr, BLOCK_N: gl.constexpr,
                         STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, INT8_FP8: gl.constexpr,
                         CAUSAL: gl.constexpr, HAS_KV_LEN: gl.constexpr, SPARSE: gl.constexpr,
                         HEAVY_FIRST: gl.constexpr, num_warps: gl.constexpr):
    """OUT = softmax(scale Q K^T) V and LSE (natural log), by work items of
    128 queries of one (batch, head): ``cdiv(Lq, 128) * BH`` of them, dealt
    out to the programs of a 1-D grid round robin (a grid of one program per
    SM makes the core persistent; one per item gives each program one). Each
    item is what ``attn_fwd_kernel`` computes with the same arguments
    (``query_tile``'s order, ``CAUSAL``, ``KV_LEN`` [B] with ``HAS_KV_LEN``,
    and with ``SPARSE`` the 128-key blocks that BLOCKS/COUNTS list for its
    query block, ascending).

    Q ``[B, H, Lq, D]``, K and V ``[B, H / GROUP, Lk, D]``, OUT like Q, with
    ``BH = B * H``: any layout through the (batch, head, position) strides
    ``s*b, s*h, s*l``, a unit stride along D, 16-byte aligned bases and
    strides (TMA descriptors, one per tensor for the launch, built here over
    the 4-D tensors, so tiles past Lq / Lk read zeros). LSE ``[B * H, Lq]``
    fp32. ``Lk >= 1``. Launch with ``num_warps=4`` (the default partition,
    consumer 0); the consumer and loader partitions add 5 warps, and
    ``maxnreg`` bounds the kernel's registers so that 24 + 2 *
    ``CONSUMER_REGS`` per thread fit 3 warp groups.

    ``INT8_FP8`` (dense): Q and K int8, ``Q_SCALE [B, H, Lq]`` q's per-token
    scales, ``K_SCALE [B, H / GROUP, ceil(Lk / BLOCK_N)]`` one per key tile;
    V e4m3 ``[B, H / GROUP, D, Lk]`` with a unit key stride (``svl`` the
    stride between channels) and ``V_SCALE [B, H / GROUP, D]`` its channel
    scales (fp32 contiguous); OUT in q's original dtype (``attn_fwd_kernel``'s
    INT8 + PV_FP8 with q given). Otherwise the three scale pointers are
    unused (pass None)."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warp group")
    gl.static_assert(not (SPARSE and INT8_FP8), "8-bit operands are dense")
    gl.static_assert(BLOCK_N == 2 * _ROWS or not (SPARSE or INT8_FP8),
                     "a key tile is a listed block, and INT8_FP8's key tile is its k scale's block")
    # A key tile a multiple of the query tile: the causal diagonal of an item falls in one key tile.
    gl.static_assert(BLOCK_N % (2 * _ROWS) == 0, "a key tile spans whole query tiles")
    # Every operand's rows are 128 bytes or more (D >= 64 16-bit, D = 128 8-bit, BLOCK_N = 128 e4m3): 128-byte swizzle.
    bits: gl.constexpr = 8 if INT8_FP8 else 16
    box: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=bits, rank=4)
    matrix: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=bits, rank=2)
    B = BH // H
    q_desc = tma.make_tensor_descriptor(Q, [B, H, Lq, D], [sqb, sqh, sql, 1], [1, 1, 2 * _ROWS, D], box)
    k_desc = tma.make_tensor_descriptor(K, [B, H // GROUP, Lk, D], [skb, skh, skl, 1], [1, 1, BLOCK_N, D], box)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2 * _ROWS, D], matrix)
    k_smem = gl.allocate_shared_memory(K.dtype.element_ty, [STAGES, BLOCK_N, D], matrix)
    if INT8_FP8:
        v_desc = tma.make_tensor_descriptor(V, [B, H // GROUP, D, Lk], [svb, svh, svl, 1], [1, 1, D, BLOCK_N], box)
        v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [STAGES, D, BLOCK_N], matrix)
        p_smems = gl.allocate_shared_memory(gl.float8e4nv, [2 * _ROWS, BLOCK_N], matrix)
    else:
        v_desc = tma.make_tensor_descriptor(V, [B, H // GROUP, Lk, D], [svb, svh, svl, 1], [1, 1, BLOCK_N, D], box)
        v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [STAGES, BLOCK_N, D], matrix)
        p_smems = q_smem  # a stand-in: 16-bit P stays in registers
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=2)  # released by both consumers
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    # Tuples hold run-time values only: an assignment turns a constexpr into a tensor, so the
    # partitions take the flags as constexpr arguments of their own.
    work = (gl.cdiv(Lq, 2 * _ROWS), BH, heads_per_group, KV_LEN, BLOCKS, COUNTS, H, GROUP, Lk, sob, soh,
            (sbb, sbh, sbr, scb, sch, scr), LSE)
    args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, p_smems, q_bar, q_empty, k_ready, k_empty, v_ready,
            v_empty, work, OUT, LSE, sol, Lq, scale, Q_SCALE, K_SCALE, V_SCALE)
    gl.warp_specialize([(_consumer_low, (args, CAUSAL, SPARSE, HAS_KV_LEN, HEAVY_FIRST)),
                        (_consumer_high, (args, CAUSAL, SPARSE, HAS_KV_LEN, HEAVY_FIRST)),
                        (_loader, (args, CAUSAL, SPARSE, HAS_KV_LEN, HEAVY_FIRST))], [4, 1], [CONSUMER_REGS, 24])


# ---------------------------------------------------------------- backward (five products, dq added)


@builtin
def _tma_add(tensor_desc, coord, src, _semantic=None):
    """Add the shared-memory tile ``src`` into the global tile of ``tensor_desc``
    at ``coord`` (a TMA bulk reduction, ``cp.reduce.async.bulk.tensor ...
    add``, asynchronous, committed as a bulk group like a TMA store): Gluon
    3.6 builds the operation but exports no function for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _bwd_program(w, KV_LEN, lists, split, Hk, GROUP, heads_per_group, Lq, Lk, CAUSAL: gl.constexpr,
                 HAS_KV_LEN: gl.constexpr, HEAVY_FIRST: gl.constexpr, SPARSE: gl.constexpr, SPLIT: gl.constexpr,
                 STEP: gl.constexpr):
    """Work index w's ``(batch, k head, key tile, kv_len, first query step,
    query steps per q head, query steps, its lists, first step, steps)``,
    the same in every partition. Its item's 128 keys are seen by
    the queries of steps (of STEP rows, 64 or 128) from the first: every one, or
    (causal) those from the tile's first key on; or (SPARSE) the steps
    of each query block whose list holds the tile, for each q head of the
    GQA group (``lists``: the transposed lists, ``(index, count, 3 index
    strides, 3 count strides)``; its lists: the group's first q head's list
    and count, as pointers, with the head strides to the next head's); none
    when the tile starts at or past kv_len (its dk and dv are 0).

    Items are (key tile, batch and k head), key tiles fastest. ``split``:
    ``(key tiles, B)``, or with SPLIT (the launch splits its last items,
    which are of equal work: dense, not causal, no key lengths) ``(key
    tiles, whole, parts, PARTIALS, B)``: work indices from ``whole`` on take
    the items from ``whole`` on in ``parts`` parts each, part k the
    item's steps ``k * steps // parts`` up to the next part's, and write
    their dk and dv to the part slot ``(item - whole) * parts + k`` for
    ``attn_bwd_parts_kernel`` to add up: the launch's
    last round split so that it ends with the others
    (``ops.attention.backward_tail_split``). HEAVY_FIRST (causal, dense):
    items taken longest first, the first key tiles of a group of heads
    before their second (``kernels.attention._dealt_rank``, as the
    deterministic dk/dv pass)."""
    tile, bhk = _bwd_item(w, split, Hk, heads_per_group, HEAVY_FIRST, SPLIT)
    b = bhk // Hk
    hk = bhk % Hk
    kv_len = kv_len_of(KV_LEN, b, Lk, HAS_KV_LEN)
    PER_TILE: gl.constexpr = 2 * _ROWS // STEP  # query steps a 128-row block holds
    n_steps = gl.cdiv(Lq, STEP)
    seen = tile * 2 * _ROWS < kv_len  # some key of the tile is within kv_len
    first_step = 0
    if CAUSAL and not SPARSE:
        first_step = gl.minimum(tile * PER_TILE, n_steps)  # query i sees keys j <= i: rows from the tile's first key
    first_step = gl.where(seen, first_step, n_steps)
    n_steps -= first_step
    total = GROUP * n_steps
    row_lists = (0, 0, 0, 0)  # dense: none
    if SPARSE:  # (causal: the listed blocks above the diagonal are masked, not skipped)
        # Only the group's first q head's list and count pointers, and the steps to the next head's, stay
        # live through the loop (ptxas spilled set-up values inside it while all eight list arguments did).
        BLOCKS, COUNTS, sbb, sbh, sbr, scb, sch, scr = lists
        first_list = BLOCKS + b * sbb + hk * GROUP * sbh + tile * sbr
        first_count = COUNTS + b * scb + hk * GROUP * sch + tile * scr
        total = 0
        for g in range(GROUP):
            total += PER_TILE * gl.load(first_count + g * sch).to(gl.int32)  # int32 or int64 lists
        total = gl.where(seen, total, 0)
        row_lists = (first_list, sbh, first_count, sch)
    first = 0
    count = total
    if SPLIT:
        _, whole, parts, _, _ = split
        part = (w - whole) % parts
        first = gl.where(w >= whole, part * total // parts, 0)
        count = gl.where(w >= whole, (part + 1) * total // parts, total) - first
    return b, hk, tile, kv_len, first_step, n_steps, total, row_lists, first, count


@gluon.jit
def _bwd_item(w, split, Hk, heads_per_group, HEAVY_FIRST: gl.constexpr, SPLIT: gl.constexpr):
    """Work index w's item as ``(key tile, batch * Hk + k head)``
    (``_bwd_program``)."""
    n_tiles = split[0]
    B = split[-1]
    item = w
    if SPLIT:
        _, whole, parts, _, _ = split
        item = gl.where(item >= whole, whole + (item - whole) // parts, item)
    if HEAVY_FIRST:
        return dealt_rank(item, n_tiles, B * Hk, heads_per_group)
    else:
        return item % n_tiles, item // n_tiles


@gluon.jit
def _bwd_work(args, SPLIT: gl.constexpr):
    """How many work indices a launch has (``args``: the partitions'
    argument tuple, ``attn_bwd_sm90_kernel``'s): its items, or with SPLIT
    the whole ones and the parts of the others (``_bwd_program``). A launch
    of that many programs gives each one; fewer programs (one per SM: the
    persistent dk/dv pass) take them round robin."""
    (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
     delta_smem, dq_args, kv_bars, ready, empty, DK, DV, KV_LEN, lists, split, H, GROUP, Lq,
     Lk, scale, heads_per_group, sdkb, sdkh, sdkl, sdvb, sdvh, sdvl) = args
    items = split[0] * split[-1] * (H // GROUP)
    if SPLIT:
        _, whole, parts, _, _ = split
        items = whole + (items - whole) * parts
    return items


@gluon.jit
def _bwd_step(i, program, GROUP, n_tiles, STAGGER: gl.constexpr, SPARSE: gl.constexpr, STEP: gl.constexpr):
    """The (q head, first query) of a program's i-th step: every q head of
    its GQA group in turn, STEP queries a step from ``first_step`` (SPARSE:
    the steps of each listed query block in turn). STAGGER
    (non-causal): each program starts at its own point of that cycle
    (spread evenly over the programs of a k head), so that they do not add
    into the same dq rows at the same time: 1.03x, 1.06x and 1.03x
    forward+backward at 4608, 16384 and 32760 tokens against every program
    starting at 0 (H100, bench/notes.md). Causal programs start at their
    own diagonals, 128 queries apart, so they need no stagger."""
    b, hk, tile, _, first_step, n_steps, total, row_lists, _, _ = program
    j = i
    if STAGGER:
        j = (i + tile * total // n_tiles) % total
    if SPARSE:
        # The q head whose steps hold j: past each head whose PER_TILE * count steps j is at or past
        # (heads with an empty list pass at once; once j falls short it stays short).
        first_list, list_step, first_count, count_step = row_lists
        g = 0
        PER_TILE: gl.constexpr = 2 * _ROWS // STEP
        for _ in range(GROUP - 1):
            steps = PER_TILE * gl.load(first_count + g * count_step).to(gl.int32)
            past = j >= steps
            j = gl.where(past, j - steps, j)
            g = gl.where(past, g + 1, g)
        block = gl.load(first_list + g * list_step + j // PER_TILE).to(gl.int32)
        return hk * GROUP + g, block * 2 * _ROWS + (j % PER_TILE) * STEP
    else:
        return hk * GROUP + j // n_steps, (first_step + j % n_steps) * STEP


@gluon.jit
def _bwd_load_item(args, w, it, item, CAUSAL: gl.constexpr, HAS_KV_LEN: gl.constexpr, HEAVY_FIRST: gl.constexpr,
                   SPARSE: gl.constexpr, SPLIT: gl.constexpr):
    """The producer warp's part of work index w (its program's ``item``-th,
    whose steps are the ring's from ``it`` on), returning its step count:
    the item's K and V tiles (once both consumers are done with the last
    item's: ``kv_empty``), then each step's q and dO tiles and the step's
    rows of the statistics (lse, delta), every query head of the GQA group
    in turn, into the ring."""
    (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
     delta_smem, dq_args, kv_bars, ready, empty, DK, DV, KV_LEN, lists, split, H, GROUP, Lq,
     Lk, scale, heads_per_group, sdkb, sdkh, sdkl, sdvb, sdvh, sdvl) = args
    STAGES: gl.constexpr = q_smem.shape[0]
    STEP: gl.constexpr = q_smem.shape[1]
    kv_bar, kv_empty = kv_bars
    program = _bwd_program(w, KV_LEN, lists, split, H // GROUP, GROUP, heads_per_group, Lq, Lk, CAUSAL, HAS_KV_LEN,
                           HEAVY_FIRST, SPARSE, SPLIT, STEP)
    b, hk, tile, _, _, _, _, _, from_step, count = program
    mbarrier.wait(kv_empty, (item & 1) ^ 1)
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, tile * 2 * _ROWS, 0], kv_bar, _box(k_smem))
    tma.async_copy_global_to_shared(v_desc, [b, hk, tile * 2 * _ROWS, 0], kv_bar, _box(v_smem))
    for i in range(count):  # the item's (from_step + i)-th step, the ring's (it + i)-th
        h, m0 = _bwd_step(from_step + i, program, GROUP, split[0], not CAUSAL, SPARSE, STEP)
        stage = (it + i) % STAGES
        mbarrier.wait(empty.index(stage), (((it + i) // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(stage), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                        + lse_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], ready.index(stage), _box(q_smem.index(stage)))
        tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], ready.index(stage), _box(do_smem.index(stage)))
        tma.async_copy_global_to_shared(lse_desc, [b * H + h, m0], ready.index(stage), lse_smem.index(stage))
        tma.async_copy_global_to_shared(delta_desc, [b * H + h, m0], ready.index(stage), delta_smem.index(stage))
    return count


@gluon.jit
def _bwd_loader(args, CAUSAL: gl.constexpr, HAS_KV_LEN: gl.constexpr, HEAVY_FIRST: gl.constexpr,
                SPARSE: gl.constexpr, SPLIT: gl.constexpr, PERSISTENT: gl.constexpr):
    """The producer warp of the backward (:func:`_bwd_load_item`): its
    program's work index, or (PERSISTENT) every ``num_programs``-th from
    it, the ring running on across them."""
    if PERSISTENT:
        it = 0
        item = 0
        for w in range(gl.program_id(0), _bwd_work(args, SPLIT), gl.num_programs(0)):
            it += _bwd_load_item(args, w, it, item, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, SPLIT)
            item += 1
    else:
        _bwd_load_item(args, gl.program_id(0), 0, 0, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, SPLIT)


@gluon.jit
def _bwd_dq_step(dq_args, k_smem, dq_zero, head_row, m0, buf, i, W: gl.constexpr):
    """Consumer group W's share of one step's dQ (the five-product kernel's
    DQ): once both groups' halves of dS^T are in ``ds_smem`` (``ds_full``),
    dQ's channels ``D / 2 * W`` on = dS K over the tile's 128 keys, added
    into DQ_ACC's rows ``m0`` on of (batch, q head) row ``head_row`` by TMA
    reductions of STEP x 32 (``_DQ_PIECE`` channels each: two at D = 128, one
    at D = 64; the next step rewrites their buffers once the reductions
    have read them; a second set of buffers measured no faster,
    bench/notes.md)."""
    dqa_desc, ds_smem, dq_smem, ds_full = dq_args
    D: gl.constexpr = k_smem.shape[1]
    STEP: gl.constexpr = ds_smem.shape[2]
    HALF: gl.constexpr = D // 2  # this group's dQ channels, from HALF * W
    PIECES: gl.constexpr = HALF // _DQ_PIECE
    mbarrier.wait(ds_full.index(buf), (i // 2) & 1)
    ds_t = ds_smem.index(buf).permute((1, 0))  # dS: [STEP queries, 128 keys]
    first = warpgroup_mma(ds_t, k_smem.slice(HALF * W, _DQ_PIECE, dim=1), dq_zero, use_acc=False, is_async=True)
    if PIECES == 2:
        second = warpgroup_mma(ds_t, k_smem.slice(HALF * W + _DQ_PIECE, _DQ_PIECE, dim=1), dq_zero,
                               use_acc=False, is_async=True)
        first, second = warpgroup_mma_wait(0, deps=[first, second])
    else:
        first = warpgroup_mma_wait(0, deps=[first])
    tma.store_wait(0)  # the step before's reductions have read dq_smem
    gl.thread_barrier()
    dq_smem.index(PIECES * W).store(first)
    if PIECES == 2:
        dq_smem.index(PIECES * W + 1).store(second)
    fence_async_shared()
    gl.thread_barrier()
    _tma_add(dqa_desc, [head_row, m0, HALF * W], dq_smem.index(PIECES * W).reshape([1, STEP, _DQ_PIECE]))
    if PIECES == 2:
        _tma_add(dqa_desc, [head_row, m0, HALF * W + _DQ_PIECE],
                 dq_smem.index(PIECES * W + 1).reshape([1, STEP, _DQ_PIECE]))


@gluon.jit
def _bwd_consume_item(args, w, it, item, W: gl.constexpr, CAUSAL: gl.constexpr, HAS_KV_LEN: gl.constexpr,
                      HEAVY_FIRST: gl.constexpr, SPARSE: gl.constexpr, MASKED_KEYS: gl.constexpr, DQ: gl.constexpr,
                      SPLIT: gl.constexpr):
    """Consumer warp group W's part of work index w (its program's
    ``item``-th, whose steps are the ring's from ``it`` on), returning its
    step count: keys ``64 W`` to ``64 W + 63`` of
    the item's tile, through every step of STEP queries (64; 128 at D = 64, dense). S^T and dP^T (64
    keys x STEP queries) issued together; P^T and dS^T from them, in registers,
    the A operands of dV += P^T dO and dK += dS^T Q; with DQ, dS^T into this
    group's half of a shared [128 keys, STEP queries] tile and its share of
    dQ (``_bwd_dq_step``). Masks: keys past
    kv_len (MASKED_KEYS: the tile may hold some) and, causal, keys past the
    query on the steps that cross the diagonal (two of 64 queries, one of
    128; block lists may add steps above it, masked whole)."""
    (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
     delta_smem, dq_args, kv_bars, ready, empty, DK, DV, KV_LEN, lists, split, H, GROUP, Lq,
     Lk, scale, heads_per_group, sdkb, sdkh, sdkl, sdvb, sdvh, sdvl) = args
    STAGES: gl.constexpr = q_smem.shape[0]
    STEP: gl.constexpr = q_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, STEP, 16])
    d_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
    k_rows = k_smem.slice(_ROWS * W, _ROWS)
    v_rows = v_smem.slice(_ROWS * W, _ROWS)
    qk_scale = scale * _LOG2E
    s_zero = gl.zeros([_ROWS, STEP], gl.float32, s_layout)
    if DQ:  # the dQ products' (unused) accumulator: _bwd_dq_step's products start from zero
        piece_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, _DQ_PIECE, 16])
        dq_zero = gl.zeros([STEP, _DQ_PIECE], gl.float32, piece_layout)
    step_query = gl.arange(0, STEP, layout=gl.SliceLayout(0, s_layout))
    kv_bar, kv_empty = kv_bars
    program = _bwd_program(w, KV_LEN, lists, split, H // GROUP, GROUP, heads_per_group, Lq, Lk, CAUSAL,
                           HAS_KV_LEN, HEAVY_FIRST, SPARSE, SPLIT, STEP)
    b, hk, tile, kv_len, _, _, _, _, from_step, count = program
    dk = gl.zeros([_ROWS, D], gl.float32, d_layout)
    dv = gl.zeros([_ROWS, D], gl.float32, d_layout)
    first_key = tile * 2 * _ROWS + _ROWS * W
    key = first_key + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, s_layout))
    if MASKED_KEYS and STEP > _ROWS:  # (below: masked keys with 128-query steps)
        key_bias = gl.where(key < kv_len, 0.0, float("-inf"))
    mbarrier.wait(kv_bar, item & 1)
    for i in range(count):
        h, m0 = _bwd_step(from_step + i, program, GROUP, split[0], not CAUSAL, SPARSE, STEP)
        c = it + i  # the ring's step
        stage = c % STAGES
        mbarrier.wait(ready.index(stage), (c // STAGES) & 1)
        qs = q_smem.index(stage)
        dos = do_smem.index(stage)
        s_token = warpgroup_mma(k_rows, qs.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_token = warpgroup_mma(v_rows, dos.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=[s_token])
        # The step's statistics as [1, STEP] rows in the scores' layout, read as late as they are needed
        # (registers): lse is +inf past Lq and for rows that saw no key, so that their P is 0.
        lse2 = lse_smem.index(stage).load(s_layout) * _LOG2E
        if MASKED_KEYS and STEP > _ROWS:
            # Masked keys (past kv_len, where they read as zeros past Lk) give scores, not probabilities
            # of 0: with 128-query steps, a -inf bias of theirs (exp2 gives 0; lse is +inf past Lq:
            # still -inf), since the branch below made ptxas spill P (148 accesses in the loop).
            p = gl.exp2(st * qk_scale + (key_bias[:, None] - lse2))
        else:
            p = gl.exp2(st * qk_scale - lse2)
        # With 64-query steps, their P rows are set to 0 on the steps and in the groups that hold some.
        if MASKED_KEYS and STEP == _ROWS:
            if first_key + _ROWS > kv_len:
                p = gl.where(key[:, None] < kv_len, p, 0.0)
        if CAUSAL:  # and keys past the query, on the steps that cross this group's diagonal (or above it)
            if m0 < first_key + _ROWS:
                p = gl.where(key[:, None] <= (m0 + step_query)[None, :], p, 0.0)
        if STEP > _ROWS:
            # 128-query steps (D = 64): dV += P^T dO waits for dS, so that P's 16-bit operand is not live
            # beside P, dP and dS (64 + 64 + 32 + 32 registers past dK and dV: ptxas spilled in the loop).
            dp = warpgroup_mma_wait(0, deps=[dp_token])
            ds = (p * (dp - delta_smem.index(stage).load(s_layout))).to(q_smem.dtype)
            p_op = gl.convert_layout(p.to(q_smem.dtype), op_layout)
            dv_token = warpgroup_mma(p_op, dos, dv, is_async=True)
        else:
            p_op = gl.convert_layout(p.to(q_smem.dtype), op_layout)
            dv_token = warpgroup_mma(p_op, dos, dv, is_async=True)
            dp = warpgroup_mma_wait(1, deps=[dp_token])
            ds = (p * (dp - delta_smem.index(stage).load(s_layout))).to(q_smem.dtype)
        ds_op = gl.convert_layout(ds, op_layout)
        dk_token = warpgroup_mma(ds_op, qs, dk, is_async=True)
        buf = c % 2  # ds_smem's buffer: the other one may still be read by the other group's dQ product
        if DQ:
            dq_args[1].index(buf).slice(_ROWS * W, _ROWS).store(ds)  # (dqa_desc, ds_smem, dq_smem, ds_full)
            fence_async_shared()
            mbarrier.arrive(dq_args[3].index(buf), count=1)
        dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=[dv_token, dk_token, p_op, ds_op])
        mbarrier.arrive(empty.index(stage), count=1)  # this step's q, dO and statistics are done with
        if DQ:
            _bwd_dq_step(dq_args, k_smem, dq_zero, b * H + h, m0, buf, c, W)
    mbarrier.arrive(kv_empty, count=1)  # every product that reads this item's K and V is done
    if DQ:
        tma.store_wait(0)  # shared memory must outlive the reductions that read it
    # dK = scale dS^T Q; dV = P^T dO.
    keys = first_key + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, d_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, d_layout))
    stored = (keys < Lk)[:, None]
    if SPLIT:  # a part of an item, or a whole one
        _, whole, _, PARTIALS, _ = split
        slot = w - whole
        # A part's fp32 sums go to its slot of PARTIALS, [dk | dv] x [128 keys, D]; a whole item's to DK, DV.
        at = (_ROWS * W + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, d_layout)))[:, None] * D + cols[None, :]
        own = PARTIALS + gl.maximum(slot, 0).to(gl.int64) * (2 * 2 * _ROWS * D) + at
        gl.store(own, dk * scale, mask=slot >= 0)
        gl.store(own + 2 * _ROWS * D, dv, mask=slot >= 0)
        stored = stored & (slot < 0)
    keys = keys.to(gl.int64)[:, None]
    gl.store(DK + b.to(gl.int64) * sdkb + hk.to(gl.int64) * sdkh + keys * sdkl + cols[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=stored)
    gl.store(DV + b.to(gl.int64) * sdvb + hk.to(gl.int64) * sdvh + keys * sdvl + cols[None, :],
             dv.to(DV.dtype.element_ty), mask=stored)
    return count


@gluon.jit
def _bwd_consumer(args, W: gl.constexpr, CAUSAL: gl.constexpr, HAS_KV_LEN: gl.constexpr, HEAVY_FIRST: gl.constexpr,
                  SPARSE: gl.constexpr, MASKED_KEYS: gl.constexpr, DQ: gl.constexpr, SPLIT: gl.constexpr,
                  PERSISTENT: gl.constexpr):
    """Consumer warp group W of the backward (:func:`_bwd_consume_item`):
    its program's work index, or (PERSISTENT) every ``num_programs``-th
    from it, with the ring running on across them."""
    if PERSISTENT:
        it = 0
        item = 0
        for w in range(gl.program_id(0), _bwd_work(args, SPLIT), gl.num_programs(0)):
            it += _bwd_consume_item(args, w, it, item, W, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, MASKED_KEYS, DQ,
                                    SPLIT)
            item += 1
    else:
        _bwd_consume_item(args, gl.program_id(0), 0, 0, W, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, MASKED_KEYS, DQ,
                          SPLIT)


@gluon.jit
def _bwd_consumer_low(args, CAUSAL: gl.constexpr, HAS_KV_LEN: gl.constexpr, HEAVY_FIRST: gl.constexpr,
                      SPARSE: gl.constexpr, MASKED_KEYS: gl.constexpr, DQ: gl.constexpr, SPLIT: gl.constexpr,
                      PERSISTENT: gl.constexpr):
    _bwd_consumer(args, 0, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, MASKED_KEYS, DQ, SPLIT, PERSISTENT)


@gluon.jit
def _bwd_consumer_high(args, CAUSAL: gl.constexpr, HAS_KV_LEN: gl.constexpr, HEAVY_FIRST: gl.constexpr,
                       SPARSE: gl.constexpr, MASKED_KEYS: gl.constexpr, DQ: gl.constexpr, SPLIT: gl.constexpr,
                       PERSISTENT: gl.constexpr):
    _bwd_consumer(args, 1, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, MASKED_KEYS, DQ, SPLIT, PERSISTENT)


@gluon.jit
def attn_bwd_sm90_kernel(Q, K, V, DO, LSE_ROWS, DELTA, DQ_ACC, DK, DV, PARTIALS, KV_LEN, BLOCKS, COUNTS, sqb, sqh,
                         sql, skb, skh, skl, svb, svh, svl, sdb, sdh, sdl, sdkb, sdkh, sdkl, sdvb, sdvh, sdvl, sbb, sbh,
                         sbr, scb, sch, scr, stats_row, B, H, GROUP, Lq, Lk, scale, heads_per_group, whole, parts,
                         D: gl.constexpr, STEP: gl.constexpr,
                         STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, CAUSAL: gl.constexpr,
                         HAS_KV_LEN: gl.constexpr, HEAVY_FIRST: gl.constexpr, SPARSE: gl.constexpr,
                         MASKED_KEYS: gl.constexpr, DQ: gl.constexpr, SPLIT: gl.constexpr,
                         PERSISTENT: gl.constexpr, num_warps: gl.constexpr):
    """The attention backward in five products a (key tile, query step): dK
    and dV of 128 keys of one (batch, k head) per program, and (DQ) dQ added
    into DQ_ACC by TMA reductions in whatever order the programs run (not
    bit for bit the same from run to run; ``ops.attention`` takes it only
    when asked: ``ATOMIC_DQ``). Without DQ, four products: dK and dV alone,
    in the same order on every run (the deterministic backward's dk/dv pass
    on sm_90; DQ_ACC unused). Dense or (SPARSE) block-sparse: BLOCKS ``[B, H,
    cdiv(Lk, 128), W]`` / COUNTS ``[B, H, cdiv(Lk, 128)]`` int32 or int64 are
    the transposed lists (per q head and key block, the ascending query
    blocks that list it; strides ``sbb, sbh, sbr`` / ``scb, sch, scr``);
    causal or not (CAUSAL: query i sees keys j <= i), with key lengths or
    not (HAS_KV_LEN: KV_LEN ``[B]``, keys past ``KV_LEN[b]`` ignored); any
    Lq (LSE_ROWS is +inf past it and for rows that see no key) and Lk.
    MASKED_KEYS: a tile may hold keys past kv_len (Lk is not a multiple of
    128, or key lengths are given), which are masked. HEAVY_FIRST with
    ``heads_per_group``: dense causal programs longest first
    (``ops.attention.causal_order``).

    Q, DO ``[B, H, Lq, D]`` and K, V, DK, DV ``[B, H / GROUP, Lk, D]`` 16-bit,
    any layout through the (batch, head, position) strides, a unit stride
    along D, TMA-aligned (Q, K, V, DO); LSE_ROWS and DELTA ``[B * H,
    stats_row]`` fp32 (``attn_bwd_row_stats_kernel``'s padded rows); DQ_ACC
    ``[B * H, stats_row, D]`` fp32, zeroed, receives dS K (dq less its
    scale) with DQ. Items are (key tile, batch and k head), ``cdiv(Lk, 128) * B * H /
    GROUP`` of them: the first ``whole`` one program each, the others
    ``parts`` programs each (``_bwd_program``), whose dk and dv go to
    PARTIALS ``[items - whole, parts, 2, 128, D]`` fp32 for
    ``kernels.attention.attn_bwd_parts_kernel`` (SPLIT: dense, not causal,
    no key lengths; else every item is whole, and ``whole``, ``parts`` and
    PARTIALS are unused).
    STEP: the query rows of a step, 64, or 128 at D = 64 without block
    lists (``ops.attention.backward_step``). PERSISTENT (without DQ, dense,
    not causal): fewer programs than work indices, each taking every
    ``num_programs``-th (one per SM: the descriptors the kernel builds on
    the device take 768 bytes of scratch per program).
    Launch ``whole + (items - whole) * parts`` programs (or fewer, PERSISTENT) with ``num_warps=4``
    and ``maxnreg=168`` (the forward core's budgets: CONSUMER_REGS for both
    consumer groups, 24 for the loader)."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warp group")
    gl.static_assert((D == 64) or (D == 128), "D = 64 or 128 (ops.attention._takes_sm90_backward)")
    # A consumer's S^T and dP^T are 64 keys x STEP queries: 128-query steps fit its registers beside dK and
    # dV at D = 64 (32 registers each), not at D = 128 (64 each), nor with block lists (ptxas spilled 154
    # accesses in the step loop).
    gl.static_assert((STEP == 64) or ((STEP == 128) and (D == 64) and not SPARSE),
                     "64-query steps, or 128 at D = 64, dense")
    gl.static_assert(not (SPLIT and (CAUSAL or HAS_KV_LEN or SPARSE)), "only items of equal work are split")
    gl.static_assert(not (PERSISTENT and (DQ or CAUSAL or SPARSE)), "the dense, non-causal dk/dv pass persists")
    box: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    matrix: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    stats: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    piece: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    pieces: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=3)
    Hk = H // GROUP
    q_desc = tma.make_tensor_descriptor(Q, [B, H, Lq, D], [sqb, sqh, sql, 1], [1, 1, STEP, D], box)
    do_desc = tma.make_tensor_descriptor(DO, [B, H, Lq, D], [sdb, sdh, sdl, 1], [1, 1, STEP, D], box)
    k_desc = tma.make_tensor_descriptor(K, [B, Hk, Lk, D], [skb, skh, skl, 1], [1, 1, 2 * _ROWS, D], box)
    v_desc = tma.make_tensor_descriptor(V, [B, Hk, Lk, D], [svb, svh, svl, 1], [1, 1, 2 * _ROWS, D], box)
    lse_desc = tma.make_tensor_descriptor(LSE_ROWS, [B * H, stats_row], [stats_row, 1], [1, STEP], stats)
    delta_desc = tma.make_tensor_descriptor(DELTA, [B * H, stats_row], [stats_row, 1], [1, STEP], stats)
    # Shared memory, 198 KB at D = 128 (2 stages of 64 queries): K and V 64 KB, q and dO 32 KB a stage, dS^T
    # twice 16 KB, dQ 32 KB; at D = 64 with 128-query steps, 194 KB: K and V 32 KB, q and dO 32 KB a stage,
    # dS^T twice 32 KB, dQ 32 KB. Without DQ, no dS^T and dQ buffers: 134 KB at D = 128.
    k_smem = gl.allocate_shared_memory(K.dtype.element_ty, [2 * _ROWS, D], matrix)
    v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [2 * _ROWS, D], matrix)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, STEP, D], matrix)
    do_smem = gl.allocate_shared_memory(DO.dtype.element_ty, [STAGES, STEP, D], matrix)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, STEP], stats)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, STEP], stats)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(kv_empty, count=2)  # released by both consumers
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # released by both consumers
    # dQ's descriptor and buffers only where the partitions read them (Triton 3.6's lowering fails on a
    # partition argument that no partition reads).
    if DQ:
        dqa_desc = tma.make_tensor_descriptor(DQ_ACC, [B * H, stats_row, D], [stats_row * D, D, 1],
                                              [1, STEP, _DQ_PIECE], pieces)
        ds_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2, 2 * _ROWS, STEP], matrix)
        dq_smem = gl.allocate_shared_memory(gl.float32, [D // _DQ_PIECE, STEP, _DQ_PIECE], piece)  # D / 64 a group
        ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2):
            mbarrier.init(ds_full.index(s), count=2)  # both halves of dS^T written
        dq_args = (dqa_desc, ds_smem, dq_smem, ds_full)
    else:
        dq_args = ()
    # (key tiles, [whole, parts, PARTIALS,] B): the split's arguments only where the partitions read them
    # (Triton 3.6's lowering fails on a partition argument that no partition reads).
    if SPLIT:
        split = (gl.cdiv(Lk, 2 * _ROWS), whole, parts, PARTIALS, B)
    else:
        split = (gl.cdiv(Lk, 2 * _ROWS), B)
    args = (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
            delta_smem, dq_args, (kv_bar, kv_empty), ready, empty, DK, DV, KV_LEN,
            (BLOCKS, COUNTS, sbb, sbh, sbr, scb, sch, scr), split, H, GROUP, Lq, Lk, scale, heads_per_group, sdkb, sdkh,
            sdkl, sdvb, sdvh, sdvl)
    gl.warp_specialize(
        [(_bwd_consumer_low, (args, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, MASKED_KEYS, DQ, SPLIT, PERSISTENT)),
         (_bwd_consumer_high, (args, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, MASKED_KEYS, DQ, SPLIT, PERSISTENT)),
         (_bwd_loader, (args, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, SPLIT, PERSISTENT))], [4, 1],
        [CONSUMER_REGS, 24])
