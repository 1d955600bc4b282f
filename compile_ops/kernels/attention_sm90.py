"""The Hopper (sm_90) attention forward core, in Gluon: warp-specialized, FlashAttention-3's structure.

Why a second forward next to ``attention.py``'s ``attn_fwd_kernel``: that
kernel is written in ``triton.language``, whose compiler issues the TMA
loads from the warps that run the softmax (four CTA barriers a key step)
and waits for every wgmma right after issuing it, and whose own warp
specialization of that loop (Triton 3.6) does not compute it reliably.
Gluon lets the kernel say what FlashAttention-3 does:

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
    per program, not per item;
  - two consumer warp groups of 64 query rows each (``CONSUMER_REGS``
    registers), sharing every K/V tile; neither waits for the other, so the
    warp schedulers run one's softmax under the other's products;
- inside a consumer, step j issues S_j = Q K_j^T and then O += P_j-1 V_j-1
  and waits for S_j alone, so S_j's softmax can start while the product
  runs. ptxas hoists the product's wait above the softmax's exponentials
  all the same, and pinning it below them does not pay: the other
  consumer's products fill the tensor cores while this one's softmax runs.

It is faster than the ``triton.language`` kernel (docs/notes/attention.md),
and its output is the portable kernel's bit for bit (same 128 x 128 tiles,
products, order of additions and formulas).

What it takes (``ops/attention_sm90.py`` routes everything else to the
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
fit in a consumer's registers side by side (ptxas spills), so each key
step folds the previous P V in before it issues the next Q K^T
(``_key_step``): only the other consumer overlaps this one's softmax.

``INT8_FP8``: the 8-bit operands of ``attn_fwd_kernel``'s ``INT8`` +
``PV_FP8`` mode with q given in int8, the same formulas (biased int32
scores, one row factor per tile, ``2**8 p`` rounded to e4m3, a fresh FP8
product per tile added to the fp32 accumulator), and the same results bit
for bit, dense only. Built, not routed: its P goes through shared memory
(:func:`_next_carry`), and it is not ahead of ``attn_fwd_kernel``
(``ops.attention_tiles.SM90_CORE_PRECISIONS``).

The five-product backward is ``kernels/attention_sm90_backward.py``. Gluon
does not run under the interpreter: the CPU tests compile every variant for
sm_90 (tests/test_sm90_compile.py), the GPU tests compare them with the
portable kernel.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from compile_ops.kernels.attention_common import (
    INT8_BIAS,
    INT8_BIAS_BITS,
    P_FP8_SHIFT,
    block_list,
    dealt_rank,
    query_program,
    tile_start,
)

LOG2E = gl.constexpr(1.4426950408889634)
_LN2 = gl.constexpr(0.6931471805599453)
#: Query rows per consumer warp group: one wgmma's M.
WGMMA_ROWS = gl.constexpr(64)


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
        tma.async_copy_global_to_shared(q_desc, [b, h.to(gl.int32), q_start, 0], q_bar, tma_box(q_smem))
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
                                            tma_box(k_smem.index(stage)))
            mbarrier.wait(v_empty.index(stage), phase ^ 1)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            if v_smem.dtype == gl.float8e4nv:  # FP8 P V's transposed V: [D, BLOCK_N] tiles along the keys
                tma.async_copy_global_to_shared(v_desc, [b, hk, 0, row], v_ready.index(stage),
                                                tma_box(v_smem.index(stage)))
            else:
                tma.async_copy_global_to_shared(v_desc, [b, hk, row, 0], v_ready.index(stage),
                                                tma_box(v_smem.index(stage)))
        it += n_tiles
        item += 1


@gluon.jit
def tma_box(buffer):
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
    scores' layout, byte permutes and warp shuffles, which is slower than
    the round trip through shared memory (docs/notes/attention.md)."""
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
    SERIAL: gl.constexpr = k_smem.shape[1] > 2 * WGMMA_ROWS
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
    qk_scale = scale * LOG2E
    q_rows = q_smem.slice(WGMMA_ROWS * HALF, WGMMA_ROWS)
    p_smem = p_smems.slice(WGMMA_ROWS * HALF, WGMMA_ROWS)
    it = 0  # key tiles consumed so far: the ring's position
    item = 0
    for w in range(gl.program_id(0), _work_items(work), gl.num_programs(0)):
        b, h, bh, q_start, kv_len, _, n_tiles, n_full, masked_start, out_off = _work_item(
            w, work, BLOCK_N, CAUSAL, SPARSE, HAS_KV_LEN, HEAVY_FIRST)
        first_row = q_start + WGMMA_ROWS * HALF
        o_zero = gl.zeros([WGMMA_ROWS, D], gl.float32, o_layout)
        if INT8_FP8:  # the biased int32 scores (see attn_fwd_kernel's INT8)
            s_init = gl.full([WGMMA_ROWS, BLOCK_N], INT8_BIAS_BITS, gl.int32, s_layout)
        else:
            s_init = gl.zeros([WGMMA_ROWS, BLOCK_N], gl.float32, s_layout)
        if INT8_FP8:
            kv_row = b * (H // GROUP) + h // GROUP  # the scales' (batch, k head) row
            k_scales = K_SCALE + kv_row * gl.cdiv(Lk, BLOCK_N)
            rows = first_row + gl.arange(0, WGMMA_ROWS, layout=s_rows)
            # Rows past Lq get a factor of 1 (never 0: a masked score times 0 would be NaN); they are not stored.
            row_q = gl.load(Q_SCALE + bh.to(gl.int64) * lq + rows, mask=rows < lq, other=1.0)
        else:
            k_scales = LSE  # a stand-in, never read
            row_q = gl.full([WGMMA_ROWS], 1.0, gl.float32, s_rows)
        o = o_zero
        m = gl.full([WGMMA_ROWS], float("-inf"), gl.float32, s_rows)
        l = gl.zeros([WGMMA_ROWS], gl.float32, s_rows)
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
        rows = first_row + gl.arange(0, WGMMA_ROWS, layout=o_rows)
        gl.store(OUT + out_off + rows.to(gl.int64)[:, None] * sol + cols[None, :], out.to(OUT.dtype.element_ty),
                 mask=(rows < lq)[:, None])
        lse_row = first_row + gl.arange(0, WGMMA_ROWS, layout=s_rows)
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
        tile, bh, KV_LEN, H, GROUP, Lk, sob, soh, 0, 0, 0, 0, 2 * WGMMA_ROWS, BLOCK_N, CAUSAL, HAS_KV_LEN)
    # Tiles of BLOCK_N = 2 * WGMMA_ROWS = the list's blocks: at most one tile needs a mask, the one at the
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
    gl.static_assert(BLOCK_N == 2 * WGMMA_ROWS or not (SPARSE or INT8_FP8),
                     "a key tile is a listed block, and INT8_FP8's key tile is its k scale's block")
    # A key tile a multiple of the query tile: the causal diagonal of an item falls in one key tile.
    gl.static_assert(BLOCK_N % (2 * WGMMA_ROWS) == 0, "a key tile spans whole query tiles")
    # Every operand's rows are 128 bytes or more (D >= 64 16-bit, D = 128 8-bit, BLOCK_N = 128 e4m3): 128-byte swizzle.
    bits: gl.constexpr = 8 if INT8_FP8 else 16
    box: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=bits, rank=4)
    matrix: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=bits, rank=2)
    B = BH // H
    q_desc = tma.make_tensor_descriptor(Q, [B, H, Lq, D], [sqb, sqh, sql, 1], [1, 1, 2 * WGMMA_ROWS, D], box)
    k_desc = tma.make_tensor_descriptor(K, [B, H // GROUP, Lk, D], [skb, skh, skl, 1], [1, 1, BLOCK_N, D], box)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2 * WGMMA_ROWS, D], matrix)
    k_smem = gl.allocate_shared_memory(K.dtype.element_ty, [STAGES, BLOCK_N, D], matrix)
    if INT8_FP8:
        v_desc = tma.make_tensor_descriptor(V, [B, H // GROUP, D, Lk], [svb, svh, svl, 1], [1, 1, D, BLOCK_N], box)
        v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [STAGES, D, BLOCK_N], matrix)
        p_smems = gl.allocate_shared_memory(gl.float8e4nv, [2 * WGMMA_ROWS, BLOCK_N], matrix)
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
    work = (gl.cdiv(Lq, 2 * WGMMA_ROWS), BH, heads_per_group, KV_LEN, BLOCKS, COUNTS, H, GROUP, Lk, sob, soh,
            (sbb, sbh, sbr, scb, sch, scr), LSE)
    args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, p_smems, q_bar, q_empty, k_ready, k_empty, v_ready,
            v_empty, work, OUT, LSE, sol, Lq, scale, Q_SCALE, K_SCALE, V_SCALE)
    gl.warp_specialize([(_consumer_low, (args, CAUSAL, SPARSE, HAS_KV_LEN, HEAVY_FIRST)),
                        (_consumer_high, (args, CAUSAL, SPARSE, HAS_KV_LEN, HEAVY_FIRST)),
                        (_loader, (args, CAUSAL, SPARSE, HAS_KV_LEN, HEAVY_FIRST))], [4, 1], [CONSUMER_REGS, 24])
