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
(``attention_sm90_key_tiles._key_step``): only the other consumer overlaps
this one's softmax.

``INT8_FP8``: the 8-bit operands of ``attn_fwd_kernel``'s ``INT8`` +
``PV_FP8`` mode with q given in int8, the same formulas (biased int32
scores, one row factor per tile, ``2**8 p`` rounded to e4m3, a fresh FP8
product per tile added to the fp32 accumulator), and the same results bit
for bit, dense or block-sparse (a listed block's tile takes that block's k
scale). Built, not routed: its P goes through shared memory
(``attention_sm90_key_tiles._next_carry``), and it is not ahead of
``attn_fwd_kernel`` (``ops.attention_tiles.SM90_CORE_PRECISIONS``).

The consumers' pass over an item's key tiles is
``kernels/attention_sm90_key_tiles.py``; what the forward and the backward
share, ``kernels/attention_sm90_common.py``. The five-product backward is
``kernels/attention_sm90_backward.py``. Gluon
does not run under the interpreter: the CPU tests compile every variant for
sm_90 (tests/test_sm90_compile.py), the GPU tests compare them with the
portable kernel.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from compile_ops.kernels.attention_common import (
    INT8_BIAS_BITS,
    P_FP8_SHIFT,
    block_list,
    dealt_rank,
    fp8_value_positions,
    query_program,
    tile_start,
)
from compile_ops.kernels.attention_sm90_common import LOG2E, WGMMA_ROWS, tma_box
from compile_ops.kernels.attention_sm90_key_tiles import key_tiles

_LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _loader(args, CAUSAL: gl.constexpr, SPARSE: gl.constexpr, HAS_KV_LEN: gl.constexpr, HEAVY_FIRST: gl.constexpr):
    """The producer warp, over this program's work items: each item's q rows
    (once both consumers' last Q K^T of the previous item is done), then
    every key tile's K and V (the listed blocks' tiles, block-sparse) into
    the ring, which runs on across items."""
    (
        q_desc,
        k_desc,
        v_desc,
        q_smem,
        k_smem,
        v_smem,
        p_smems,
        q_bar,
        q_empty,
        k_ready,
        k_empty,
        v_ready,
        v_empty,
        work,
        OUT,
        LSE,
        sol,
        lq,
        scale,
        Q_SCALE,
        K_SCALE,
        V_SCALE,
    ) = args
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    GROUP = work[7]
    it = 0  # key tiles loaded so far: the ring's position
    item = 0
    for w in range(gl.program_id(0), _work_items(work), gl.num_programs(0)):
        b, h, _, q_start, _, blocks, n_tiles, _, _, _ = _work_item(
            w, work, BLOCK_N, CAUSAL, SPARSE, HAS_KV_LEN, HEAVY_FIRST
        )
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
            tma.async_copy_global_to_shared(k_desc, [b, hk, row, 0], k_ready.index(stage), tma_box(k_smem.index(stage)))
            mbarrier.wait(v_empty.index(stage), phase ^ 1)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            if v_smem.dtype == gl.float8e4nv:  # FP8 P V's transposed V: [D, BLOCK_N] tiles along the keys
                tma.async_copy_global_to_shared(
                    v_desc, [b, hk, 0, row], v_ready.index(stage), tma_box(v_smem.index(stage))
                )
            else:
                tma.async_copy_global_to_shared(
                    v_desc, [b, hk, row, 0], v_ready.index(stage), tma_box(v_smem.index(stage))
                )
        it += n_tiles
        item += 1


@gluon.jit
def _consumer(
    args,
    HALF: gl.constexpr,
    CAUSAL: gl.constexpr,
    SPARSE: gl.constexpr,
    HAS_KV_LEN: gl.constexpr,
    HEAVY_FIRST: gl.constexpr,
):
    """One consumer warp group, over this program's work items: query rows
    ``q_start + 64 * HALF`` to 64 past it, through the item's key tiles, then
    their output rows and log-sum-exp."""
    (
        q_desc,
        k_desc,
        v_desc,
        q_smem,
        k_smem,
        v_smem,
        p_smems,
        q_bar,
        q_empty,
        k_ready,
        k_empty,
        v_ready,
        v_empty,
        work,
        OUT,
        LSE,
        sol,
        lq,
        scale,
        Q_SCALE,
        K_SCALE,
        V_SCALE,
    ) = args
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    D: gl.constexpr = q_smem.shape[1]
    INT8_FP8: gl.constexpr = k_smem.dtype == gl.int8
    K_STEP: gl.constexpr = 32 if INT8_FP8 else 16  # a wgmma's K: 32 bytes of 8-bit operands, 16 of 16-bit
    H = work[6]
    GROUP = work[7]
    Lk = work[8]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, K_STEP]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, K_STEP]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    qk_scale = scale * LOG2E
    q_rows = q_smem.slice(WGMMA_ROWS * HALF, WGMMA_ROWS)
    p_smem = p_smems.slice(WGMMA_ROWS * HALF, WGMMA_ROWS)
    it = 0  # key tiles consumed so far: the ring's position
    item = 0
    for w in range(gl.program_id(0), _work_items(work), gl.num_programs(0)):
        b, h, bh, q_start, kv_len, blocks, n_tiles, n_full, masked_start, out_off = _work_item(
            w, work, BLOCK_N, CAUSAL, SPARSE, HAS_KV_LEN, HEAVY_FIRST
        )
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
            o, m, l = key_tiles(
                it,
                o,
                m,
                l,
                q_rows,
                row_q,
                k_scales,
                blocks,
                k_smem,
                v_smem,
                p_smem,
                q_empty,
                k_ready,
                k_empty,
                v_ready,
                v_empty,
                s_init,
                o_zero,
                qk_scale,
                n_tiles,
                n_full,
                kv_len - masked_start,
                diagonal,
                SPARSE,
                s_layout,
                p_layout,
                o_rows,
            )
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
        gl.store(
            OUT + out_off + rows.to(gl.int64)[:, None] * sol + cols[None, :],
            out.to(OUT.dtype.element_ty),
            mask=(rows < lq)[:, None],
        )
        lse_row = first_row + gl.arange(0, WGMMA_ROWS, layout=s_rows)
        lse = gl.where(empty, float("-inf"), m * scale + log2_l * _LN2)  # attn_fwd_kernel's formula
        gl.store(LSE + bh.to(gl.int64) * lq + lse_row, lse, mask=lse_row < lq)


@gluon.jit
def _consumer_low(
    args, CAUSAL: gl.constexpr, SPARSE: gl.constexpr, HAS_KV_LEN: gl.constexpr, HEAVY_FIRST: gl.constexpr
):
    _consumer(args, 0, CAUSAL, SPARSE, HAS_KV_LEN, HEAVY_FIRST)


@gluon.jit
def _consumer_high(
    args, CAUSAL: gl.constexpr, SPARSE: gl.constexpr, HAS_KV_LEN: gl.constexpr, HEAVY_FIRST: gl.constexpr
):
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
        tile, bh, KV_LEN, H, GROUP, Lk, sob, soh, 0, 0, 0, 0, 2 * WGMMA_ROWS, BLOCK_N, CAUSAL, HAS_KV_LEN
    )
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
def attn_fwd_sm90_kernel(
    Q,
    K,
    V,
    OUT,
    LSE,
    KV_LEN,
    BLOCKS,
    COUNTS,
    Q_SCALE,
    K_SCALE,
    V_SCALE,
    sqb,
    sqh,
    sql,
    skb,
    skh,
    skl,
    svb,
    svh,
    svl,
    sob,
    soh,
    sol,
    sbb,
    sbh,
    sbr,
    scb,
    sch,
    scr,
    BH,
    H,
    GROUP,
    Lq,
    Lk,
    scale,
    heads_per_group,
    D: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    INT8_FP8: gl.constexpr,
    CAUSAL: gl.constexpr,
    HAS_KV_LEN: gl.constexpr,
    SPARSE: gl.constexpr,
    HEAVY_FIRST: gl.constexpr,
    num_warps: gl.constexpr,
):
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

    ``INT8_FP8`` (dense or ``SPARSE``): Q and K int8, ``Q_SCALE [B, H, Lq]`` q's per-token
    scales, ``K_SCALE [B, H / GROUP, ceil(Lk / BLOCK_N)]`` one per key tile;
    V e4m3 ``[B, H / GROUP, D, Lk16]`` (``fp8_values_transposed``'s layout) with a unit key stride (``svl`` the
    stride between channels) and ``V_SCALE [B, H / GROUP, D]`` its channel
    scales (fp32 contiguous); OUT in q's original dtype (``attn_fwd_kernel``'s
    INT8 + PV_FP8 with q given). Otherwise the three scale pointers are
    unused (pass None)."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warp group")
    gl.static_assert(
        BLOCK_N == 2 * WGMMA_ROWS or not (SPARSE or INT8_FP8),
        "a key tile is a listed block, and INT8_FP8's key tile is its k scale's block",
    )
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
        v_desc = tma.make_tensor_descriptor(
            V, [B, H // GROUP, D, fp8_value_positions(Lk)], [svb, svh, svl, 1], [1, 1, D, BLOCK_N], box
        )
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
    work = (
        gl.cdiv(Lq, 2 * WGMMA_ROWS),
        BH,
        heads_per_group,
        KV_LEN,
        BLOCKS,
        COUNTS,
        H,
        GROUP,
        Lk,
        sob,
        soh,
        (sbb, sbh, sbr, scb, sch, scr),
        LSE,
    )
    args = (
        q_desc,
        k_desc,
        v_desc,
        q_smem,
        k_smem,
        v_smem,
        p_smems,
        q_bar,
        q_empty,
        k_ready,
        k_empty,
        v_ready,
        v_empty,
        work,
        OUT,
        LSE,
        sol,
        Lq,
        scale,
        Q_SCALE,
        K_SCALE,
        V_SCALE,
    )
    gl.warp_specialize(
        [
            (_consumer_low, (args, CAUSAL, SPARSE, HAS_KV_LEN, HEAVY_FIRST)),
            (_consumer_high, (args, CAUSAL, SPARSE, HAS_KV_LEN, HEAVY_FIRST)),
            (_loader, (args, CAUSAL, SPARSE, HAS_KV_LEN, HEAVY_FIRST)),
        ],
        [4, 1],
        [CONSUMER_REGS, 24],
    )
