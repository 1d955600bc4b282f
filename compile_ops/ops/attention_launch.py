"""The attention launchers: :func:`launch_forward` and :func:`launch_backward`
fill the outputs of every attention op (dense, block-sparse, 8-bit) from
its fake, on the Triton kernels or, where ``ops/attention_sm90.py`` takes the
call, the sm_90 Gluon kernels; traced calls of the forward under a register
cap or on block-sparse 8-bit attention's Gluon forward go through the opaque
``fused_gluon.attention_forward_capped_``."""

from typing import Optional

import torch
import triton
from torch import Tensor

from compile_ops import reference
from compile_ops._library import (
    has_tma,
    launch_untraced,
    launcher,
    on_eager_fast_path,
    refuse_interpreted_bf16_dots,
)
from compile_ops.kernels.attention import attn_fwd_kernel
from compile_ops.kernels.attention_backward import (
    STATS_ROW_ALIGN,
    attn_bwd_dkdv_kernel,
    attn_bwd_dq_from_acc_kernel,
    attn_bwd_dq_kernel,
    attn_bwd_row_stats_kernel,
)
from compile_ops.kernels.attention_sm90 import attn_fwd_sm90_kernel
from compile_ops.kernels.attention_sm90_8bit import attn8_fwd_sm90_kernel
from compile_ops.ops._launch import acc_dtype, dot_precision, unit_last_stride
from compile_ops.ops.attention_args import attention_sizes, bhl_strides, block_list_args, take_tma
from compile_ops.ops.attention_sm90 import (
    can_run_gluon,
    launch_sm90_8bit,
    launch_sm90_backward,
    launch_sm90_core,
    takes_sm90_8bit,
    takes_sm90_backward,
    takes_sm90_core,
    takes_sm90_dkdv,
)
from compile_ops.ops.attention_tiles import LAUNCH_ORDER, causal_order, dkdv_tiles, dq_tiles, forward_tiles


def launch_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool,
    seq_dim: int,
    kv_lengths: Optional[Tensor],
    blocks: Optional[tuple] = None,
    int8_scales: Optional[tuple] = None,
    v_scale: Optional[Tensor] = None,
    fp8_rows: Optional[tuple] = None,
    tokens: Optional[Tensor] = None,
) -> None:
    """Fill ``out`` and ``lse`` (from the fake). ``blocks``: block-sparse
    attention's ``(index [B, H, Lq blocks, width], count [B, H, Lq blocks])``.
    ``int8_scales``: 8-bit attention's ``(q_scale [B, H, Lq], k_scale [B, Hk,
    ceil(Lk / INT8_KEY_BLOCK)])``, q and k being int8 (the rest follows v's
    dtype unless ``v_scale``); q_scale None: q is 16-bit, and the kernel
    rounds it per token as it loads it (``QUANTIZE_Q``). ``v_scale`` (with ``int8_scales``): FP8 P V,
    v being e4m3 ``[B, Hk, D, Lk16]`` with a unit key stride
    (``attention_8bit.fp8_values_transposed``) and ``v_scale [B, Hk, D]`` its channel
    scales; out's dtype is then q's original one (``out``'s). ``fp8_rows``
    (with ``v_scale``): ``(row_scale [B], out_scale [B, Lq])`` fp32, out being
    e4m3 ``[B, Lq, Hq, D]`` whatever seq_dim: the output written as the FP8
    rows of ``reference.attention.attention_int8_fp8_rows``. ``tokens``
    ``[Lq]`` (8-bit self-attention, not causal, q quantized): q, k and v come
    in this token order, and query row r's output and lse rows go to token
    ``tokens[r]``'s row (``attn_fwd_kernel``'s SCATTER)."""
    refuse_interpreted_bf16_dots("attention", q=q, k=k, v=v)
    sizes = attention_sizes(q, k, causal, seq_dim, kv_lengths)
    if out.numel() == 0:
        return
    pv_fp8 = v_scale is not None
    q, k = (unit_last_stride(t) for t in (q, k))  # D is unit-stride in every layout models use
    if not pv_fp8:
        v = unit_last_stride(v)
    int8 = int8_scales is not None
    assert int8 or not pv_fp8, "FP8 P V is a mode of 8-bit attention"
    assert pv_fp8 or fp8_rows is None, "FP8 output rows are a mode of FP8 P V"
    consts = sizes.consts
    if int8:  # the accumulators and a 16-bit PV dot follow out (fp32 for e4m3 rows); an int8 dot needs K (= D) >= 32
        consts = dict(
            consts,
            ACC=acc_dtype(out),
            DOT_PRECISION=dot_precision(out.dtype),
            FMA_EXPONENT=True,
            BLOCK_D=max(32, consts["BLOCK_D"]),
        )
    q_scale, k_scale = int8_scales if int8 else (None, None)
    precision = "int8_fp8" if pv_fp8 else "int8" if int8 else "exact"
    v_seq_dim = 2 if pv_fp8 else seq_dim  # the transposed v: its channels take the position stride
    if pv_fp8 and v.stride(3) != 1:
        raise ValueError(
            f"launch_forward: FP8 P V takes v as [B, Hk, D, Lk16] with unit key stride, got strides {tuple(v.stride())}"
        )
    core = forward_tiles(int(sizes.d), out.dtype, True, precision, can_run_gluon(q))
    assert tokens is None or not causal, "a token order is for self-attention without a causal mask"
    assert tokens is None or (int8_scales is not None and int8_scales[0] is not None), "q comes quantized, in order"
    if tokens is None and takes_sm90_core(
        core, sizes, q, k, v, seq_dim, v_seq_dim, blocks, int8 and q_scale is None, fp8_rows
    ):
        lists = blocks if blocks is not None else (None, None)
        scales = (q_scale, k_scale, v_scale) if pv_fp8 else (None, None, None)
        if on_eager_fast_path():  # launched as is, recorded for launch plans
            launch_sm90_core(
                launcher(attn_fwd_sm90_kernel), q, k, v, out, lse, scale, causal, seq_dim, kv_lengths, *lists, *scales
            )
        else:
            torch.ops.fused_gluon.attention_forward_sm90_(
                q, k, v, out, lse, float(scale), causal, seq_dim, kv_lengths, *lists, *scales
            )
        return
    # attn_fwd_kernel's own tiles; a register cap only where an opaque op may launch them
    t = forward_tiles(int(sizes.d), out.dtype, has_tma(q), precision, register_cap=can_run_gluon(q))
    sm90_8bit = takes_sm90_8bit(sizes, q, k, v, seq_dim, blocks, int8 and q_scale is None, pv_fp8)
    if (sm90_8bit or t.maxnreg is not None) and not on_eager_fast_path():
        torch.ops.fused_gluon.attention_forward_capped_(
            q,
            k,
            v,
            out,
            lse,
            float(scale),
            causal,
            seq_dim,
            kv_lengths,
            *(blocks or (None, None)),
            *(int8_scales or (None, None)),
            v_scale,
            *(fp8_rows or (None, None)),
            tokens,
        )
        return
    if sm90_8bit:
        launch_sm90_8bit(
            launcher(attn8_fwd_sm90_kernel),
            q,
            k,
            v,
            out,
            lse,
            scale,
            seq_dim,
            blocks,
            q_scale,
            k_scale,
            v_scale,
            fp8_rows,
            tokens,
        )
        return
    # One k scale per tile: its key tiles divide the scale blocks (all tiles are powers of two up to 128).
    assert not int8 or reference.attention.INT8_KEY_BLOCK % t.block_n == 0, t
    # The rounded probabilities are relative to the running max of the specification's tiles.
    assert not pv_fp8 or t.block_n == reference.attention.FP8_PV_TILE, t
    tma = take_tma(t.tma, (seq_dim, q, k), (v_seq_dim, v))
    index, count, *list_strides = block_list_args(blocks)
    # The block list past Triton's pipeliner (kernels.attention_common.tile_start):
    # with the Hopper loop's TMA, by inline PTX (so not under the interpreter),
    # and only for lists with an entry that clamped reads may land on.
    list_by_asm = blocks is not None and tma and q.is_cuda and index.shape[-1] > 0
    row_scale, out_scale = fp8_rows if fp8_rows is not None else (None, None)
    grid = (triton.cdiv(sizes.lq, t.block_m), sizes.b * sizes.h)
    order, group = causal_order(k, sizes.lk, grid[1]) if causal and blocks is None else LAUNCH_ORDER
    launcher(attn_fwd_kernel)[grid](
        q,
        k,
        v,
        out,
        lse,
        kv_lengths,
        index,
        count,
        q_scale,
        k_scale,
        v_scale,
        row_scale,
        out_scale,
        tokens,
        *bhl_strides(q, seq_dim),
        *bhl_strides(k, seq_dim),
        *bhl_strides(v, v_seq_dim),
        *bhl_strides(out, 1 if fp8_rows is not None else seq_dim),
        *list_strides,
        sizes.h,
        sizes.h // sizes.hk,
        sizes.lq,
        sizes.lk,
        float(scale),
        group,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
        SPARSE=blocks is not None,
        TMA=tma,
        DOT_ACC=t.dot_acc,
        WARP_SPECIALIZE=t.warp_specialize,
        INT8=int8,
        INT8_KEY_BLOCK=reference.attention.INT8_KEY_BLOCK,
        PV_FP8=pv_fp8,
        OUT_FP8=fp8_rows is not None,
        LIST_BY_ASM=list_by_asm,
        QUANTIZE_Q=int8 and q_scale is None,
        SCATTER=tokens is not None,
        **order,
        **consts,
        **({"maxnreg": t.maxnreg} if t.maxnreg is not None else {}),
    )


@torch.library.custom_op("fused_gluon::attention_forward_capped_", mutates_args=("out", "lse"))
def _attention_forward_capped(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool,
    seq_dim: int,
    kv_lengths: Optional[Tensor] = None,
    block_index: Optional[Tensor] = None,
    block_count: Optional[Tensor] = None,
    q_scale: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
    row_scale: Optional[Tensor] = None,
    out_scale: Optional[Tensor] = None,
    tokens: Optional[Tensor] = None,
) -> None:
    """:func:`launch_forward` of a call whose ``attn_fwd_kernel`` tiles carry a
    register cap, or that runs ``attn8_fwd_sm90_kernel`` (Gluon), as an op of
    its own for traced calls: Inductor's launch configs keep a user kernel's
    warps and stages, not its ``maxnreg``, and cannot trace a Gluon kernel, so
    a compiled graph calls this op, which launches the kernel as an eager call
    does. Not a public op (as ``fused_gluon.attention_forward_sm90_``)."""
    launch_untraced(
        launch_forward,
        q,
        k,
        v,
        out,
        lse,
        scale,
        causal,
        seq_dim,
        kv_lengths,
        (block_index, block_count) if block_index is not None else None,
        (q_scale, k_scale) if k_scale is not None else None,  # q_scale None: q is 16-bit
        v_scale=v_scale,
        fp8_rows=(row_scale, out_scale) if row_scale is not None else None,
        tokens=tokens,
    )


@_attention_forward_capped.register_fake
def _(*args, **kwargs):
    return None  # it fills out and lse in place


def launch_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    scale: float,
    causal: bool,
    seq_dim: int,
    kv_lengths: Optional[Tensor],
    blocks: Optional[tuple] = None,
    key_blocks: Optional[tuple] = None,
) -> None:
    """Fill dq, dk, dv (from the fake). Block-sparse: ``blocks`` as the forward,
    ``key_blocks`` the transposed lists (per key block, the query blocks that
    list it: ``[B, H, Lk blocks, width]`` / ``[B, H, Lk blocks]``)."""
    refuse_interpreted_bf16_dots("attention_backward", q=q, k=k, v=v, grad_out=grad_out)
    sizes = attention_sizes(q, k, causal, seq_dim, kv_lengths)
    if dq.numel() == 0 or dk.numel() == 0:  # no queries or no keys: all gradients are 0
        dq.zero_(), dk.zero_(), dv.zero_()
        return
    q, k, v, out, grad_out = (unit_last_stride(x) for x in (q, k, v, out, grad_out))
    lse = lse.contiguous()
    d, consts = int(sizes.d), sizes.consts
    sparse = blocks is not None
    # Per-query statistics in padded rows (kernels.attention_backward.STATS_ROW_ALIGN): delta and the lse.
    stats_row = triton.cdiv(sizes.lq, STATS_ROW_ALIGN.value) * STATS_ROW_ALIGN.value
    delta, lse_rows = (lse.new_empty((sizes.b * sizes.h, stats_row)) for _ in range(2))
    five_products = takes_sm90_backward(sizes, q, k, v, grad_out, seq_dim)
    # The deterministic backward's dk/dv by the same kernel without dQ (dense calls).
    sm90_dkdv = not five_products and takes_sm90_dkdv(sizes, q, k, v, grad_out, seq_dim, sparse)
    # The five-product backward's dq sums, zeroed by the statistics pass.
    dq_acc = lse.new_empty((sizes.b * sizes.h, stats_row, d)) if five_products else None
    rows = 64
    launcher(attn_bwd_row_stats_kernel)[(stats_row // rows, sizes.b * sizes.h)](
        out,
        grad_out,
        lse,
        delta,
        lse_rows,
        sizes.h,
        sizes.lq,
        *bhl_strides(out, seq_dim),
        *bhl_strides(grad_out, seq_dim),
        D=d,
        BLOCK_D=consts["BLOCK_D"],
        BLOCK_M=rows,
        ACC=consts["ACC"],
        DQ_ACC=dq_acc,
        num_warps=4,
    )
    if five_products or sm90_dkdv:
        if on_eager_fast_path():  # launched as is, recorded for launch plans
            launch_sm90_backward(
                launcher,
                grad_out,
                q,
                k,
                v,
                lse_rows,
                delta,
                dq_acc,
                dk,
                dv,
                scale,
                causal,
                seq_dim,
                kv_lengths,
                *(key_blocks or (None, None)),
            )
        else:
            torch.ops.fused_gluon.attention_backward_sm90_(
                grad_out,
                q,
                k,
                v,
                lse_rows,
                delta,
                dq_acc,
                dk,
                dv,
                float(scale),
                causal,
                seq_dim,
                kv_lengths,
                *(key_blocks or (None, None)),
            )
    if five_products:
        launcher(attn_bwd_dq_from_acc_kernel)[(triton.cdiv(sizes.lq, rows), sizes.b * sizes.h)](
            dq_acc,
            dq,
            sizes.h,
            sizes.lq,
            *bhl_strides(dq, seq_dim),
            float(scale),
            D=d,
            BLOCK_D=consts["BLOCK_D"],
            BLOCK_M=rows,
            num_warps=4,
        )
        return
    strides = (
        *bhl_strides(q, seq_dim),
        *bhl_strides(k, seq_dim),
        *bhl_strides(v, seq_dim),
        *bhl_strides(grad_out, seq_dim),
    )
    if not sm90_dkdv:
        t = dkdv_tiles(d, q.dtype, sparse, has_tma(q))
        assert STATS_ROW_ALIGN.value % t.block_m == 0, t  # the statistics rows hold whole query tiles
        tma = take_tma(t.tma, (seq_dim, q, grad_out))
        index, count, *list_strides = block_list_args(key_blocks)
        # A dk/dv row reads q and dO of its whole GQA group of heads.
        order, group = (
            causal_order(q, sizes.lq * (sizes.h // sizes.hk), sizes.b * sizes.hk)
            if causal and not sparse
            else LAUNCH_ORDER
        )
        launcher(attn_bwd_dkdv_kernel)[(triton.cdiv(sizes.lk, t.block_n), sizes.b * sizes.hk)](
            q,
            k,
            v,
            grad_out,
            lse_rows,
            delta,
            dk,
            dv,
            kv_lengths,
            index,
            count,
            *strides,
            *bhl_strides(dk, seq_dim),
            *bhl_strides(dv, seq_dim),
            *list_strides,
            sizes.b,
            sizes.hk,
            sizes.h // sizes.hk,
            sizes.lq,
            sizes.lk,
            float(scale),
            group,
            BLOCK_M=t.block_m,
            BLOCK_N=t.block_n,
            num_warps=t.num_warps,
            num_stages=t.num_stages,
            SPARSE=sparse,
            TMA=tma,
            **order,
            **consts,
        )
    t = dq_tiles(d, q.dtype, sparse, has_tma(q))
    assert STATS_ROW_ALIGN.value % t.block_m == 0, t
    tma = take_tma(t.tma, (seq_dim, k, v))
    index, count, *list_strides = block_list_args(blocks)
    order, group = causal_order(k, sizes.lk, sizes.b * sizes.h) if causal and not sparse else LAUNCH_ORDER
    launcher(attn_bwd_dq_kernel)[(triton.cdiv(sizes.lq, t.block_m), sizes.b * sizes.h)](
        q,
        k,
        v,
        grad_out,
        lse_rows,
        delta,
        dq,
        kv_lengths,
        index,
        count,
        *strides,
        *bhl_strides(dq, seq_dim),
        *list_strides,
        sizes.b,
        sizes.h,
        sizes.h // sizes.hk,
        sizes.lq,
        sizes.lk,
        float(scale),
        group,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
        SPARSE=sparse,
        TMA=tma,
        **order,
        **consts,
    )
