"""One consumer warp group's part of a work item in the Hopper (sm_90)
attention backward (``kernels/attention_sm90_backward.py``): dK and dV of its
64 keys over the item's query steps, from S^T, dP^T, P^T and dS^T in
registers, and with dQ, dS^T handed to the dQ products
(``kernels/attention_sm90_dq.py``).
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

from compile_ops.kernels.attention_sm90_backward_schedule import bwd_program, bwd_step
from compile_ops.kernels.attention_sm90_common import LOG2E, WGMMA_ROWS
from compile_ops.kernels.attention_sm90_dq import DQ_PIECE, bwd_dq_step


@gluon.jit
def bwd_consume_item(
    args,
    w,
    it,
    item,
    W: gl.constexpr,
    CAUSAL: gl.constexpr,
    HAS_KV_LEN: gl.constexpr,
    HEAVY_FIRST: gl.constexpr,
    SPARSE: gl.constexpr,
    MASKED_KEYS: gl.constexpr,
    DQ: gl.constexpr,
    SPLIT: gl.constexpr,
):
    """Consumer warp group W's part of work index w (its program's
    ``item``-th, whose steps are the ring's from ``it`` on), returning its
    step count: keys ``64 W`` to ``64 W + 63`` of
    the item's tile, through every step of STEP queries (64; 128 at D = 64, dense). S^T and dP^T (64
    keys x STEP queries) issued together; P^T and dS^T from them, in registers,
    the A operands of dV += P^T dO and dK += dS^T Q; with DQ, dS^T into this
    group's half of a shared [128 keys, STEP queries] tile and its share of
    dQ (``bwd_dq_step``). Masks: keys past
    kv_len (MASKED_KEYS: the tile may hold some) and, causal, keys past the
    query on the steps that cross the diagonal (two of 64 queries, one of
    128; block lists may add steps above it, masked whole)."""
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
    D: gl.constexpr = q_smem.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, STEP, 16])
    d_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
    k_rows = k_smem.slice(WGMMA_ROWS * W, WGMMA_ROWS)
    v_rows = v_smem.slice(WGMMA_ROWS * W, WGMMA_ROWS)
    qk_scale = scale * LOG2E
    s_zero = gl.zeros([WGMMA_ROWS, STEP], gl.float32, s_layout)
    if DQ:  # the dQ products' (unused) accumulator: bwd_dq_step's products start from zero
        piece_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ_PIECE, 16]
        )
        dq_zero = gl.zeros([STEP, DQ_PIECE], gl.float32, piece_layout)
    step_query = gl.arange(0, STEP, layout=gl.SliceLayout(0, s_layout))
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
    b, hk, tile, kv_len, _, _, _, _, from_step, count = program
    dk = gl.zeros([WGMMA_ROWS, D], gl.float32, d_layout)
    dv = gl.zeros([WGMMA_ROWS, D], gl.float32, d_layout)
    first_key = tile * 2 * WGMMA_ROWS + WGMMA_ROWS * W
    key = first_key + gl.arange(0, WGMMA_ROWS, layout=gl.SliceLayout(1, s_layout))
    if MASKED_KEYS and STEP > WGMMA_ROWS:  # (below: masked keys with 128-query steps)
        key_bias = gl.where(key < kv_len, 0.0, float("-inf"))
    mbarrier.wait(kv_bar, item & 1)
    for i in range(count):
        h, m0 = bwd_step(from_step + i, program, GROUP, split[0], not CAUSAL, SPARSE, STEP)
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
        lse2 = lse_smem.index(stage).load(s_layout) * LOG2E
        if MASKED_KEYS and STEP > WGMMA_ROWS:
            # Masked keys (past kv_len, where they read as zeros past Lk) give scores, not probabilities
            # of 0: with 128-query steps, a -inf bias of theirs (exp2 gives 0; lse is +inf past Lq:
            # still -inf), since the branch below makes ptxas spill P in the loop.
            p = gl.exp2(st * qk_scale + (key_bias[:, None] - lse2))
        else:
            p = gl.exp2(st * qk_scale - lse2)
        # With 64-query steps, their P rows are set to 0 on the steps and in the groups that hold some.
        if MASKED_KEYS and STEP == WGMMA_ROWS:
            if first_key + WGMMA_ROWS > kv_len:
                p = gl.where(key[:, None] < kv_len, p, 0.0)
        if CAUSAL:  # and keys past the query, on the steps that cross this group's diagonal (or above it)
            if m0 < first_key + WGMMA_ROWS:
                p = gl.where(key[:, None] <= (m0 + step_query)[None, :], p, 0.0)
        if STEP > WGMMA_ROWS:
            # 128-query steps (D = 64): dV += P^T dO waits for dS, so that P's 16-bit operand is not live
            # beside P, dP and dS (64 + 64 + 32 + 32 registers past dK and dV: ptxas would spill in the loop).
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
            dq_args[1].index(buf).slice(WGMMA_ROWS * W, WGMMA_ROWS).store(ds)  # (dqa_desc, ds_smem, dq_smem, ds_full)
            fence_async_shared()
            mbarrier.arrive(dq_args[3].index(buf), count=1)
        dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=[dv_token, dk_token, p_op, ds_op])
        mbarrier.arrive(empty.index(stage), count=1)  # this step's q, dO and statistics are done with
        if DQ:
            bwd_dq_step(dq_args, k_smem, dq_zero, b * H + h, m0, buf, c, W)
    mbarrier.arrive(kv_empty, count=1)  # every product that reads this item's K and V is done
    if DQ:
        tma.store_wait(0)  # shared memory must outlive the reductions that read it
    # dK = scale dS^T Q; dV = P^T dO.
    keys = first_key + gl.arange(0, WGMMA_ROWS, layout=gl.SliceLayout(1, d_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, d_layout))
    stored = (keys < Lk)[:, None]
    if SPLIT:  # a part of an item, or a whole one
        _, whole, _, PARTIALS, _ = split
        slot = w - whole
        # A part's fp32 sums go to its slot of PARTIALS, [dk | dv] x [128 keys, D]; a whole item's to DK, DV.
        at = (WGMMA_ROWS * W + gl.arange(0, WGMMA_ROWS, layout=gl.SliceLayout(1, d_layout)))[:, None] * D + cols[
            None, :
        ]
        own = PARTIALS + gl.maximum(slot, 0).to(gl.int64) * (2 * 2 * WGMMA_ROWS * D) + at
        gl.store(own, dk * scale, mask=slot >= 0)
        gl.store(own + 2 * WGMMA_ROWS * D, dv, mask=slot >= 0)
        stored = stored & (slot < 0)
    keys = keys.to(gl.int64)[:, None]
    gl.store(
        DK + b.to(gl.int64) * sdkb + hk.to(gl.int64) * sdkh + keys * sdkl + cols[None, :],
        (dk * scale).to(DK.dtype.element_ty),
        mask=stored,
    )
    gl.store(
        DV + b.to(gl.int64) * sdvb + hk.to(gl.int64) * sdvh + keys * sdvl + cols[None, :],
        dv.to(DV.dtype.element_ty),
        mask=stored,
    )
    return count
