"""The Hopper (sm_90) attention backward, in Gluon: five products a tile pair, FlashAttention-3's structure.

``attn_bwd_sm90_kernel``: a loader warp and two consumer warp groups of 64
keys sharing steps of 64 queries (128 at D = 64), with dq added by TMA
reductions in the order the programs run: the
``set_attention_backward(deterministic=False)`` option, dense, causal, with
key lengths or over block lists, faster than the deterministic passes
(docs/notes/attention.md). Without dQ it is the deterministic backward's
dk/dv pass (four products), for dense non-causal calls persistent: one
program per SM over the key tiles. It shares the forward core's warp-group
rows and TMA boxes (``kernels/attention_sm90_common.py``). Its parts: the
work items and their query steps (``kernels/attention_sm90_backward_schedule.py``),
a consumer group's pass over an item (dS, dK and dV:
``kernels/attention_sm90_dkdv.py``) and its share of dQ
(``kernels/attention_sm90_dq.py``).

Gluon does not run under the interpreter: the CPU tests compile every
variant for sm_90 (tests/test_sm90_compile.py), the GPU tests compare them
with the deterministic passes.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from compile_ops.kernels.attention_sm90_backward_schedule import bwd_program, bwd_step, bwd_work
from compile_ops.kernels.attention_sm90_common import WGMMA_ROWS, tma_box
from compile_ops.kernels.attention_sm90_dkdv import bwd_consume_item
from compile_ops.kernels.attention_sm90_dq import DQ_PIECE


@gluon.jit
def _bwd_load_item(
    args,
    w,
    it,
    item,
    CAUSAL: gl.constexpr,
    HAS_KV_LEN: gl.constexpr,
    HEAVY_FIRST: gl.constexpr,
    SPARSE: gl.constexpr,
    SPLIT: gl.constexpr,
):
    """The producer warp's part of work index w (its program's ``item``-th,
    whose steps are the ring's from ``it`` on), returning its step count:
    the item's K and V tiles (once both consumers are done with the last
    item's: ``kv_empty``), then each step's q and dO tiles and the step's
    rows of the statistics (lse, delta), every query head of the GQA group
    in turn, into the ring."""
    (
        q_desc,
        k_desc,
        v_desc,
        do_desc,
        lse_desc,
        delta_desc,
        k_smem,
        v_smem,
        q_smem,
        do_smem,
        lse_smem,
        delta_smem,
        dq_args,
        kv_bars,
        ready,
        empty,
        DK,
        DV,
        KV_LEN,
        lists,
        split,
        H,
        GROUP,
        Lq,
        Lk,
        scale,
        heads_per_group,
        sdkb,
        sdkh,
        sdkl,
        sdvb,
        sdvh,
        sdvl,
    ) = args
    STAGES: gl.constexpr = q_smem.shape[0]
    STEP: gl.constexpr = q_smem.shape[1]
    kv_bar, kv_empty = kv_bars
    program = bwd_program(
        w,
        KV_LEN,
        lists,
        split,
        H // GROUP,
        GROUP,
        heads_per_group,
        Lq,
        Lk,
        CAUSAL,
        HAS_KV_LEN,
        HEAVY_FIRST,
        SPARSE,
        SPLIT,
        STEP,
    )
    b, hk, tile, _, _, _, _, _, from_step, count = program
    mbarrier.wait(kv_empty, (item & 1) ^ 1)
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, tile * 2 * WGMMA_ROWS, 0], kv_bar, tma_box(k_smem))
    tma.async_copy_global_to_shared(v_desc, [b, hk, tile * 2 * WGMMA_ROWS, 0], kv_bar, tma_box(v_smem))
    for i in range(count):  # the item's (from_step + i)-th step, the ring's (it + i)-th
        h, m0 = bwd_step(from_step + i, program, GROUP, split[0], not CAUSAL, SPARSE, STEP)
        stage = (it + i) % STAGES
        mbarrier.wait(empty.index(stage), (((it + i) // STAGES) & 1) ^ 1)
        mbarrier.expect(
            ready.index(stage),
            q_desc.block_type.nbytes
            + do_desc.block_type.nbytes
            + lse_desc.block_type.nbytes
            + delta_desc.block_type.nbytes,
        )
        tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], ready.index(stage), tma_box(q_smem.index(stage)))
        tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], ready.index(stage), tma_box(do_smem.index(stage)))
        tma.async_copy_global_to_shared(lse_desc, [b * H + h, m0], ready.index(stage), lse_smem.index(stage))
        tma.async_copy_global_to_shared(delta_desc, [b * H + h, m0], ready.index(stage), delta_smem.index(stage))
    return count


@gluon.jit
def _bwd_loader(
    args,
    CAUSAL: gl.constexpr,
    HAS_KV_LEN: gl.constexpr,
    HEAVY_FIRST: gl.constexpr,
    SPARSE: gl.constexpr,
    SPLIT: gl.constexpr,
    PERSISTENT: gl.constexpr,
):
    """The producer warp of the backward (:func:`_bwd_load_item`): its
    program's work index, or (PERSISTENT) every ``num_programs``-th from
    it, the ring running on across them."""
    if PERSISTENT:
        it = 0
        item = 0
        for w in range(gl.program_id(0), bwd_work(args, SPLIT), gl.num_programs(0)):
            it += _bwd_load_item(args, w, it, item, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, SPLIT)
            item += 1
    else:
        _bwd_load_item(args, gl.program_id(0), 0, 0, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, SPLIT)


@gluon.jit
def _bwd_consumer(
    args,
    W: gl.constexpr,
    CAUSAL: gl.constexpr,
    HAS_KV_LEN: gl.constexpr,
    HEAVY_FIRST: gl.constexpr,
    SPARSE: gl.constexpr,
    MASKED_KEYS: gl.constexpr,
    DQ: gl.constexpr,
    SPLIT: gl.constexpr,
    PERSISTENT: gl.constexpr,
):
    """Consumer warp group W of the backward (:func:`bwd_consume_item`):
    its program's work index, or (PERSISTENT) every ``num_programs``-th
    from it, with the ring running on across them."""
    if PERSISTENT:
        it = 0
        item = 0
        for w in range(gl.program_id(0), bwd_work(args, SPLIT), gl.num_programs(0)):
            it += bwd_consume_item(
                args, w, it, item, W, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, MASKED_KEYS, DQ, SPLIT
            )
            item += 1
    else:
        bwd_consume_item(
            args, gl.program_id(0), 0, 0, W, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, MASKED_KEYS, DQ, SPLIT
        )


@gluon.jit
def _bwd_consumer_low(
    args,
    CAUSAL: gl.constexpr,
    HAS_KV_LEN: gl.constexpr,
    HEAVY_FIRST: gl.constexpr,
    SPARSE: gl.constexpr,
    MASKED_KEYS: gl.constexpr,
    DQ: gl.constexpr,
    SPLIT: gl.constexpr,
    PERSISTENT: gl.constexpr,
):
    _bwd_consumer(args, 0, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, MASKED_KEYS, DQ, SPLIT, PERSISTENT)


@gluon.jit
def _bwd_consumer_high(
    args,
    CAUSAL: gl.constexpr,
    HAS_KV_LEN: gl.constexpr,
    HEAVY_FIRST: gl.constexpr,
    SPARSE: gl.constexpr,
    MASKED_KEYS: gl.constexpr,
    DQ: gl.constexpr,
    SPLIT: gl.constexpr,
    PERSISTENT: gl.constexpr,
):
    _bwd_consumer(args, 1, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, MASKED_KEYS, DQ, SPLIT, PERSISTENT)


@gluon.jit
def attn_bwd_sm90_kernel(
    Q,
    K,
    V,
    DO,
    LSE_ROWS,
    DELTA,
    DQ_ACC,
    DK,
    DV,
    PARTIALS,
    KV_LEN,
    BLOCKS,
    COUNTS,
    sqb,
    sqh,
    sql,
    skb,
    skh,
    skl,
    svb,
    svh,
    svl,
    sdb,
    sdh,
    sdl,
    sdkb,
    sdkh,
    sdkl,
    sdvb,
    sdvh,
    sdvl,
    sbb,
    sbh,
    sbr,
    scb,
    sch,
    scr,
    stats_row,
    B,
    H,
    GROUP,
    Lq,
    Lk,
    scale,
    heads_per_group,
    whole,
    parts,
    D: gl.constexpr,
    STEP: gl.constexpr,
    STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    CAUSAL: gl.constexpr,
    HAS_KV_LEN: gl.constexpr,
    HEAVY_FIRST: gl.constexpr,
    SPARSE: gl.constexpr,
    MASKED_KEYS: gl.constexpr,
    DQ: gl.constexpr,
    SPLIT: gl.constexpr,
    PERSISTENT: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The attention backward in five products a (key tile, query step): dK
    and dV of 128 keys of one (batch, k head) per program, and (DQ) dQ added
    into DQ_ACC by TMA reductions in whatever order the programs run (not
    bit for bit the same from run to run; ``ops.attention_sm90`` takes it only
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
    (``ops.attention_tiles.causal_order``).

    Q, DO ``[B, H, Lq, D]`` and K, V, DK, DV ``[B, H / GROUP, Lk, D]`` 16-bit,
    any layout through the (batch, head, position) strides, a unit stride
    along D, TMA-aligned (Q, K, V, DO); LSE_ROWS and DELTA ``[B * H,
    stats_row]`` fp32 (``attn_bwd_row_stats_kernel``'s padded rows); DQ_ACC
    ``[B * H, stats_row, D]`` fp32, zeroed, receives dS K (dq less its
    scale) with DQ. Items are (key tile, batch and k head), ``cdiv(Lk, 128) * B * H /
    GROUP`` of them: the first ``whole`` one program each, the others
    ``parts`` programs each (``bwd_program``), whose dk and dv go to
    PARTIALS ``[items - whole, parts, 2, 128, D]`` fp32 for
    ``kernels.attention_backward.attn_bwd_parts_kernel`` (SPLIT: dense, not causal,
    no key lengths; else every item is whole, and ``whole``, ``parts`` and
    PARTIALS are unused).
    STEP: the query rows of a step, 64, or 128 at D = 64 without block
    lists (``ops.attention_sm90.backward_step``). PERSISTENT (without DQ, dense,
    not causal): fewer programs than work indices, each taking every
    ``num_programs``-th (one per SM: the descriptors the kernel builds on
    the device take 768 bytes of scratch per program).
    Launch ``whole + (items - whole) * parts`` programs (or fewer, PERSISTENT) with ``num_warps=4``
    and ``maxnreg=168`` (the forward core's budgets: CONSUMER_REGS for both
    consumer groups, 24 for the loader)."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warp group")
    gl.static_assert((D == 64) or (D == 128), "D = 64 or 128 (ops.attention_sm90.takes_sm90_backward)")
    # A consumer's S^T and dP^T are 64 keys x STEP queries: 128-query steps fit its registers beside dK and
    # dV at D = 64 (32 registers each), not at D = 128 (64 each), nor with block lists (ptxas spills in the
    # step loop).
    gl.static_assert(
        (STEP == 64) or ((STEP == 128) and (D == 64) and not SPARSE), "64-query steps, or 128 at D = 64, dense"
    )
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
    k_desc = tma.make_tensor_descriptor(K, [B, Hk, Lk, D], [skb, skh, skl, 1], [1, 1, 2 * WGMMA_ROWS, D], box)
    v_desc = tma.make_tensor_descriptor(V, [B, Hk, Lk, D], [svb, svh, svl, 1], [1, 1, 2 * WGMMA_ROWS, D], box)
    lse_desc = tma.make_tensor_descriptor(LSE_ROWS, [B * H, stats_row], [stats_row, 1], [1, STEP], stats)
    delta_desc = tma.make_tensor_descriptor(DELTA, [B * H, stats_row], [stats_row, 1], [1, STEP], stats)
    # Shared memory, 198 KB at D = 128 (2 stages of 64 queries): K and V 64 KB, q and dO 32 KB a stage, dS^T
    # twice 16 KB, dQ 32 KB; at D = 64 with 128-query steps, 194 KB: K and V 32 KB, q and dO 32 KB a stage,
    # dS^T twice 32 KB, dQ 32 KB. Without DQ, no dS^T and dQ buffers: 134 KB at D = 128.
    k_smem = gl.allocate_shared_memory(K.dtype.element_ty, [2 * WGMMA_ROWS, D], matrix)
    v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [2 * WGMMA_ROWS, D], matrix)
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
        dqa_desc = tma.make_tensor_descriptor(
            DQ_ACC, [B * H, stats_row, D], [stats_row * D, D, 1], [1, STEP, DQ_PIECE], pieces
        )
        ds_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2, 2 * WGMMA_ROWS, STEP], matrix)
        dq_smem = gl.allocate_shared_memory(gl.float32, [D // DQ_PIECE, STEP, DQ_PIECE], piece)  # D / 64 a group
        ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2):
            mbarrier.init(ds_full.index(s), count=2)  # both halves of dS^T written
        dq_args = (dqa_desc, ds_smem, dq_smem, ds_full)
    else:
        dq_args = ()
    # (key tiles, [whole, parts, PARTIALS,] B): the split's arguments only where the partitions read them
    # (Triton 3.6's lowering fails on a partition argument that no partition reads).
    if SPLIT:
        split = (gl.cdiv(Lk, 2 * WGMMA_ROWS), whole, parts, PARTIALS, B)
    else:
        split = (gl.cdiv(Lk, 2 * WGMMA_ROWS), B)
    args = (
        q_desc,
        k_desc,
        v_desc,
        do_desc,
        lse_desc,
        delta_desc,
        k_smem,
        v_smem,
        q_smem,
        do_smem,
        lse_smem,
        delta_smem,
        dq_args,
        (kv_bar, kv_empty),
        ready,
        empty,
        DK,
        DV,
        KV_LEN,
        (BLOCKS, COUNTS, sbb, sbh, sbr, scb, sch, scr),
        split,
        H,
        GROUP,
        Lq,
        Lk,
        scale,
        heads_per_group,
        sdkb,
        sdkh,
        sdkl,
        sdvb,
        sdvh,
        sdvl,
    )
    gl.warp_specialize(
        [
            (_bwd_consumer_low, (args, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, MASKED_KEYS, DQ, SPLIT, PERSISTENT)),
            (_bwd_consumer_high, (args, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, MASKED_KEYS, DQ, SPLIT, PERSISTENT)),
            (_bwd_loader, (args, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, SPLIT, PERSISTENT)),
        ],
        [4, 1],
        [CONSUMER_REGS, 24],
    )
