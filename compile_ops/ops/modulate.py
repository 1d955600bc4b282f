"""The AdaLN modulation family as ``torch.ops.fused`` ops.

``modulate``, ``norm_modulate``, ``gated_residual`` and
``gated_residual_norm_modulate`` run one forward kernel with different
constexpr flags, and share the backward op ``fused.modulate_backward``
(``kernels/modulate.py``).

The ops with a norm return its row statistics too, as ``aten.native_layer_norm``
does: ``fused.norm_modulate -> (out, mean, rstd)`` and
``fused.gated_residual_norm_modulate -> (residual_out, out, mean, rstd)``
(fp32, ``x.shape[:-1]``; the mean is empty for RMSNorm). They are not
differentiable; the backward reads them instead of recomputing them, which
takes two dependent row reductions off its critical path. The public functions
return only what a model uses.
"""

import functools
from typing import Optional

import torch
import triton
from torch import Tensor

from compile_ops import meta, reference
from compile_ops._library import fused_op, launcher, multiprocessor_count
from compile_ops.kernels.modulate import modulate_bwd_kernel
from compile_ops.meta._validate import accumulation_dtype
from compile_ops.meta.modulate import Broadcast, static_int
from compile_ops.ops._launch import acc_dtype, as_rows, column_sum, contiguous_param, grad_or_none
from compile_ops.ops.fp8 import FP8Rows, refuse_gradient
from compile_ops.ops.modulate_launch import NORM_CODES, broadcast_args, broadcasts, launch_forward, segments
from compile_ops.ops.norm import BACKWARD_PROGRAMS_PER_SM, LaunchConfig
from compile_ops.ops.norm import backward_config as norm_backward_config

#: The backward's pieces of a segment are at least this many rows long.
MIN_PIECE_ROWS = 16


@functools.lru_cache(maxsize=None)
def backward_config(n: int, accumulators: int, single_rows: bool) -> LaunchConfig:
    """Two rows per step up to 2048 wide, one wider, and about 32 values per
    thread per tensor: the kernel keeps up to three modulation accumulators
    (dscale, dshift, dgate) besides the norm's. From the forward+backward sweep
    (bench/results/sweep-modulate-h100.json, docs/notes/modulate.md): two rows
    a step at 4 warps spill at 8192 wide. Narrow rows take the norm backward's
    tiles; one row per step when every row has its own modulation row
    (per-token)."""
    block_n = triton.next_power_of_2(n)
    block_m = norm_backward_config(n, accumulators).block_m if block_n < 2048 else 2 if block_n == 2048 else 1
    if single_rows:
        block_m = 1
    return LaunchConfig(block_m, block_n, False, max(4, min(16, block_m * block_n // 1024)))


def _segment_sums_to(m: Tensor, b: Broadcast, sums: Tensor, seg_rows, tokens) -> Tensor:
    """The gradient of ``m`` from per-segment sums ``[B * tokens / seg_rows, C]``."""
    x_shape, aligned = b.x_shape, b.aligned_shape
    batch, n = x_shape[0], x_shape[-1]
    # Sum the segments of each run of m (seg_rows divides run), then the runs
    # over the dims where m broadcasts. A run is a product of trailing token
    # dims of m's view of x: find where they start.
    per_run = sums.reshape(batch, tokens // b.run, b.run // seg_rows, n).sum(2)
    start, run = len(x_shape) - 1, 1
    while run != b.run:
        start -= 1
        run = run * x_shape[start]
    view = per_run.reshape(tuple(x_shape[:start]) + (n,))
    return view.sum_to_size(tuple(aligned[:start]) + (aligned[-1],)).reshape(m.shape).to(m.dtype)


# ---------------------------------------------------------------- forward ops


@fused_op("modulate", fake=meta.modulate.modulate, reference=reference.modulate.modulate)
def _modulate_op(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    out = meta.modulate.modulate(x, scale, shift)
    launch_forward("modulate", x, None, None, scale, shift, None, None, "none", 0.0, out)
    return out


@fused_op(
    "norm_modulate", fake=meta.modulate.norm_modulate, reference=reference.modulate.norm_modulate, autocast="fp32"
)
def _norm_modulate_op(
    x: Tensor, scale: Tensor, shift: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], norm: str, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    out, mean, rstd = meta.modulate.norm_modulate(x, scale, shift, weight, bias, norm, eps)
    launch_forward("norm_modulate", x, None, None, scale, shift, weight, bias, norm, eps, out, mean=mean, rstd=rstd)
    return out, mean, rstd


@fused_op("gated_residual", fake=meta.modulate.gated_residual, reference=reference.modulate.gated_residual)
def _gated_residual_op(residual: Tensor, x: Tensor, gate: Tensor) -> Tensor:
    residual_out = meta.modulate.gated_residual(residual, x, gate)
    launch_forward("gated_residual", x, residual, gate, None, None, None, None, "none", 0.0, None, residual_out)
    return residual_out


@fused_op(
    "gated_residual_norm_modulate",
    fake=meta.modulate.gated_residual_norm_modulate,
    reference=reference.modulate.gated_residual_norm_modulate,
    autocast="fp32",
)
def _gated_residual_norm_modulate_op(
    residual: Tensor,
    x: Tensor,
    gate: Tensor,
    scale: Tensor,
    shift: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    norm: str,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    residual_out, out, mean, rstd = meta.modulate.gated_residual_norm_modulate(
        residual, x, gate, scale, shift, weight, bias, norm, eps
    )
    launch_forward(
        "gated_residual_norm_modulate",
        x,
        residual,
        gate,
        scale,
        shift,
        weight,
        bias,
        norm,
        eps,
        out,
        residual_out,
        mean,
        rstd,
    )
    return residual_out, out, mean, rstd


# ---------------------------------------------------------------- FP8 output mode (inference)


@fused_op("norm_modulate_fp8", fake=meta.modulate.norm_modulate_fp8, reference=reference.modulate.norm_modulate_fp8)
def _norm_modulate_fp8_op(
    x: Tensor, scale: Tensor, shift: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], norm: str, eps: float
) -> tuple[Tensor, Tensor]:
    # The unquantized op's output gives the dtype the values round to before
    # quantizing. No row statistics (inference): every tensor the kernel gets
    # is an input or an output, so eager calls replay a launch plan.
    out, _, _ = meta.modulate.norm_modulate(x, scale, shift, weight, bias, norm, eps)
    q, q_scale = meta.modulate.fp8_rows(out)
    launch_forward(
        "norm_modulate_fp8",
        x,
        None,
        None,
        scale,
        shift,
        weight,
        bias,
        norm,
        eps,
        q,
        out_scale=q_scale,
        out_dtype=out.dtype,
    )
    return q, q_scale


@fused_op(
    "gated_residual_norm_modulate_fp8",
    fake=meta.modulate.gated_residual_norm_modulate_fp8,
    reference=reference.modulate.gated_residual_norm_modulate_fp8,
)
def _gated_residual_norm_modulate_fp8_op(
    residual: Tensor,
    x: Tensor,
    gate: Tensor,
    scale: Tensor,
    shift: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    norm: str,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    residual_out, out, _, _ = meta.modulate.gated_residual_norm_modulate(
        residual, x, gate, scale, shift, weight, bias, norm, eps
    )
    q, q_scale = meta.modulate.fp8_rows(out)  # as norm_modulate_fp8: out's dtype, no row statistics
    launch_forward(
        "gated_residual_norm_modulate_fp8",
        x,
        residual,
        gate,
        scale,
        shift,
        weight,
        bias,
        norm,
        eps,
        q,
        residual_out,
        out_scale=q_scale,
        out_dtype=out.dtype,
    )
    return residual_out, q, q_scale


# ---------------------------------------------------------------- backward op


@fused_op("modulate_backward", fake=meta.modulate.modulate_backward, reference=reference.modulate.modulate_backward)
def _modulate_backward_op(
    grad_out: Optional[Tensor],
    grad_h: Optional[Tensor],
    h: Tensor,
    mean: Optional[Tensor],
    rstd: Optional[Tensor],
    x_branch: Optional[Tensor],
    gate: Optional[Tensor],
    scale: Optional[Tensor],
    shift: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    norm: str,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward of every op of the family (:func:`compile_ops.meta.modulate.modulate_backward`).

    ``h`` is the norm's input (x, or residual_out of a gated residual); for a
    gated residual without norm or modulation it only gives the shape.
    """
    grads = meta.modulate.modulate_backward(
        grad_out, grad_h, h, mean, rstd, x_branch, gate, scale, shift, weight, bias, norm, eps
    )
    d_h, d_xb, d_gate, d_scale, d_shift, d_weight, d_bias = grads
    h2 = as_rows(h)
    n_rows, n = h2.shape
    if static_int(n_rows) == 0:
        for g in grads:
            g.zero_()
        return grads
    b = broadcasts("modulate_backward", h, gate=gate, scale=scale, shift=shift)
    present = {k: v for k, v in b.items() if v is not None}
    tokens, seg_rows, n_segments = segments(h, b)
    max_programs = multiprocessor_count(h) * BACKWARD_PROGRAMS_PER_SM
    # Pieces per segment: enough to fill the persistent grid when segments are
    # few (per-sample modulation: B segments of L rows). A static count, so
    # that the partial-sum buffers have static sizes under torch.compile.
    static_segments = static_int(n_segments)
    chunks = max(1, triton.cdiv(max_programs, static_segments)) if static_segments else 1
    static_seg_rows = static_int(seg_rows)
    if static_seg_rows is not None:  # no near-empty pieces when segments are short
        chunks = max(1, min(chunks, static_seg_rows // MIN_PIECE_ROWS))
    chunk_rows = triton.cdiv(seg_rows, chunks)
    programs = torch.sym_min(max_programs, n_segments * chunks)

    acc = accumulation_dtype(h)
    modulated, gated = scale is not None, gate is not None
    accumulators = 2 * modulated + gated + (weight is not None) + (bias is not None)
    cfg = backward_config(int(n), accumulators, single_rows=static_seg_rows == 1)

    def partial_buffer(m: Optional[Tensor], grad: Tensor) -> Optional[Tensor]:
        """Where the kernel writes ``m``'s per-piece sums: the gradient itself when
        that is all there is to it, else fp32 ``[chunks, n_segments * C]``."""
        if m is None:
            return None
        if chunks == 1 and m.numel() == n_segments * n:
            return grad
        return torch.empty((chunks, n_segments * n), dtype=acc, device=h.device)

    partials = {
        "gate": partial_buffer(gate, d_gate),
        "scale": partial_buffer(scale, d_scale),
        "shift": partial_buffer(shift, d_shift),
    }
    dw_partial = torch.empty((max_programs, n), dtype=acc, device=h.device) if weight is not None else None
    db_partial = torch.empty((max_programs, n), dtype=acc, device=h.device) if bias is not None else None
    dy2 = None if grad_out is None else as_rows(grad_out)
    dh2 = None if grad_h is None else as_rows(grad_h)
    xb2 = None if x_branch is None else as_rows(x_branch)

    def strides(t2):
        return (0, 0) if t2 is None else (t2.stride(0), t2.stride(1))

    launcher(modulate_bwd_kernel)[(programs,)](
        dy2,
        dh2,
        h2,
        mean if norm == "layernorm" else None,
        rstd,
        xb2,
        gate,
        scale,
        contiguous_param(weight),
        contiguous_param(bias),
        d_h if grad_out is not None else None,
        d_xb if gated else None,
        partials["gate"],
        partials["scale"],
        partials["shift"],
        dw_partial,
        db_partial,
        n_rows,
        n,
        tokens,
        seg_rows,
        chunk_rows,
        chunks,
        n_segments,
        programs,
        *strides(dy2),
        *strides(dh2),
        *strides(h2),
        *strides(xb2),
        *broadcast_args(b["gate"]),
        *broadcast_args(b["scale"]),
        eps,
        HAS_DY=grad_out is not None,
        HAS_DH=grad_h is not None,
        GATED=gated,
        NORM=NORM_CODES[norm],
        MODULATED=modulated,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        HAS_STATS=rstd is not None,
        ACC_DTYPE=acc_dtype(h),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
    )
    reduced = {}
    for name, m, grad in (("gate", gate, d_gate), ("scale", scale, d_scale), ("shift", shift, d_shift)):
        partial = partials[name]
        if m is None or partial is grad:
            continue
        if chunks == 1:
            sums = partial.view(n_segments, n)
        else:
            direct = m.numel() == n_segments * n
            sums = grad if direct else torch.empty((n_segments, n), dtype=acc, device=h.device)
            column_sum(partial, chunks, sums)
            if direct:
                continue
        # Broadcast over more than a segment (batch-broadcast, per-channel, mixed
        # forms): the rest of the reduction is a small torch sum, also deterministic.
        reduced[name] = _segment_sums_to(m, present[name], sums, seg_rows, tokens)
    if weight is not None:
        column_sum(dw_partial, programs, d_weight)
    if bias is not None:
        column_sum(db_partial, programs, d_bias)
    return (
        d_h,
        d_xb,
        reduced.get("gate", d_gate),
        reduced.get("scale", d_scale),
        reduced.get("shift", d_shift),
        d_weight,
        d_bias,
    )


# ---------------------------------------------------------------- autograd


def _setup_modulate(ctx, inputs, output):
    x, scale, shift = inputs
    ctx.save_for_backward(x, scale, shift)


def _backward_modulate(ctx, grad):
    x, scale, shift = ctx.saved_tensors
    dx, _, _, d_scale, d_shift, _, _ = _modulate_backward_op(
        grad, None, x, None, None, None, None, scale, shift, None, None, "none", 0.0
    )
    return dx, d_scale, d_shift


def _setup_norm_modulate(ctx, inputs, output):
    x, scale, shift, weight, bias, norm, eps = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    # The row statistics, a few bytes per row, spare the backward two dependent
    # row reductions (the slowest part of a LayerNorm backward).
    ctx.save_for_backward(x, mean, rstd, scale, shift, weight, bias)
    ctx.norm, ctx.eps = norm, eps


def _backward_norm_modulate(ctx, grad, _grad_mean, _grad_rstd):
    x, mean, rstd, scale, shift, weight, bias = ctx.saved_tensors
    dx, _, _, d_scale, d_shift, d_weight, d_bias = _modulate_backward_op(
        grad, None, x, mean, rstd, None, None, scale, shift, weight, bias, ctx.norm, ctx.eps
    )
    return dx, d_scale, d_shift, grad_or_none(d_weight, weight), grad_or_none(d_bias, bias), None, None


def _setup_gated_residual(ctx, inputs, output):
    residual, x, gate = inputs
    ctx.save_for_backward(x, gate)
    ctx.residual_dtype = residual.dtype


def _backward_gated_residual(ctx, grad):
    x, gate = ctx.saved_tensors
    _, dx, d_gate, _, _, _, _ = _modulate_backward_op(
        None, grad, x, None, None, x, gate, None, None, None, None, "none", 0.0
    )
    return grad.to(ctx.residual_dtype), dx, d_gate


def _setup_gated_residual_norm_modulate(ctx, inputs, output):
    residual, x, gate, scale, shift, weight, bias, norm, eps = inputs
    residual_out, _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    # The norm's input is residual_out: saving it avoids recomputing residual + gate * x.
    ctx.save_for_backward(residual_out, mean, rstd, x, gate, scale, shift, weight, bias)
    ctx.norm, ctx.eps, ctx.residual_dtype = norm, eps, residual.dtype


def _backward_gated_residual_norm_modulate(ctx, grad_residual_out, grad_out, _grad_mean, _grad_rstd):
    h, mean, rstd, x, gate, scale, shift, weight, bias = ctx.saved_tensors
    d_h, dx, d_gate, d_scale, d_shift, d_weight, d_bias = _modulate_backward_op(
        grad_out, grad_residual_out, h, mean, rstd, x, gate, scale, shift, weight, bias, ctx.norm, ctx.eps
    )
    return (
        d_h.to(ctx.residual_dtype),
        dx,
        d_gate,
        d_scale,
        d_shift,
        grad_or_none(d_weight, weight),
        grad_or_none(d_bias, bias),
        None,
        None,
    )


_modulate_op.register_autograd(_backward_modulate, setup_context=_setup_modulate)
_norm_modulate_op.register_autograd(_backward_norm_modulate, setup_context=_setup_norm_modulate)
_gated_residual_op.register_autograd(_backward_gated_residual, setup_context=_setup_gated_residual)
_gated_residual_norm_modulate_op.register_autograd(
    _backward_gated_residual_norm_modulate, setup_context=_setup_gated_residual_norm_modulate
)


# ---------------------------------------------------------------- public functions


def modulate(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """AdaLN modulation: ``x * (1 + scale) + shift``.

    Args:
        x: ``[B, *tokens, C]``, fp16/bf16/fp32/fp64, any strides, C <= 16384.
        scale: broadcasts to x: ``[B, C]`` or ``[B, 1, C]`` per sample, ``[B, L, C]``
            per token, ``[B, F, 1, C]`` per frame (x read as ``[B, F, L/F, C]``),
            ``[C]``, 0-dim, or any shape torch broadcasts to x's; any strides.
            Its gradient is reduced over the broadcast dims deterministically.
        shift: broadcasts to x, as scale.

    Returns:
        ``[B, *tokens, C]``, contiguous, in torch's promoted dtype of the inputs;
        computed in fp32 and rounded once.
    """
    return _modulate_op(x, scale, shift)


def norm_modulate(
    x: Tensor,
    scale: Tensor,
    shift: Tensor,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    norm: str = "layernorm",
    eps: float = 1e-6,
) -> Tensor:
    """LayerNorm or RMSNorm then modulation, in one pass: ``norm(x) * (1 + scale) + shift``.

    Args:
        x: ``[B, *tokens, C]``, fp16/bf16/fp32/fp64, any strides, C <= 16384.
        scale, shift: broadcast to x as ``scale`` of :func:`modulate` does.
        weight: ``[C]`` or None (``elementwise_affine=False``, the DiT case).
        bias: ``[C]`` or None.
        norm: ``"layernorm"`` or ``"rmsnorm"``.
        eps: added to the variance (mean square for RMS), ``>= 0``.

    Returns:
        ``[B, *tokens, C]``, contiguous, in the promoted dtype of the norm's
        output (x's, or the weight's when fp16/bf16) and scale/shift.
    """
    return _norm_modulate_op(x, scale, shift, weight, bias, norm, eps)[0]


def gated_residual(residual: Tensor, x: Tensor, gate: Tensor) -> Tensor:
    """AdaLN-Zero's gated residual: ``residual + gate * x``.

    Args:
        residual: ``[B, *tokens, C]``, the residual stream (may be fp32 while x is bf16).
        x: ``[B, *tokens, C]``, the branch output (attention or MLP).
        gate: broadcasts to x as ``scale`` of :func:`modulate` does.

    Returns:
        ``[B, *tokens, C]``, contiguous, in the promoted dtype of the inputs.
    """
    return _gated_residual_op(residual, x, gate)


def gated_residual_norm_modulate(
    residual: Tensor,
    x: Tensor,
    gate: Tensor,
    scale: Tensor,
    shift: Tensor,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    norm: str = "layernorm",
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """The seam between the two halves of a DiT block, in one pass:
    ``h = residual + gate * x; return h, norm(h) * (1 + scale) + shift``.

    Args:
        residual: ``[B, *tokens, C]``, the residual stream.
        x: ``[B, *tokens, C]``, the branch output to add, gated.
        gate, scale, shift: broadcast to x as ``scale`` of :func:`modulate` does.
        weight, bias: ``[C]`` or None, the norm's affine parameters.
        norm: ``"layernorm"`` or ``"rmsnorm"``.
        eps: ``>= 0``.

    Returns:
        ``(residual_out, out)``: ``residual_out`` as :func:`gated_residual`
        gives it, and ``out`` exactly :func:`norm_modulate` of residual_out.
    """
    residual_out, out, _, _ = _gated_residual_norm_modulate_op(residual, x, gate, scale, shift, weight, bias, norm, eps)
    return residual_out, out


def norm_modulate_fp8(
    x: Tensor,
    scale: Tensor,
    shift: Tensor,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    norm: str = "layernorm",
    eps: float = 1e-6,
) -> FP8Rows:
    """:func:`norm_modulate` with its output quantized per row to e4m3 in the same
    kernel (the FP8 output mode, for an FP8 Linear that reads it; inference only).

    Args: as :func:`norm_modulate` (``x [B, *tokens, C]``; scale/shift broadcast
    to x; weight/bias ``[C]`` or None).

    Returns:
        ``FP8Rows(q [B, *tokens, C] float8_e4m3fn, scale [B, *tokens] fp32)``:
        the bytes of ``quantize_fp8_rows(norm_modulate(...))``, without writing
        and re-reading the bf16 output. Non-finite values as there: a row
        whose output holds +-inf (an overflow of the output dtype included)
        gets an infinite scale and dequantizes to NaN; a NaN stays NaN.
    """
    refuse_gradient("norm_modulate_fp8", x, scale, shift, weight, bias)
    return FP8Rows(*_norm_modulate_fp8_op(x, scale, shift, weight, bias, norm, eps))


def gated_residual_norm_modulate_fp8(
    residual: Tensor,
    x: Tensor,
    gate: Tensor,
    scale: Tensor,
    shift: Tensor,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    norm: str = "layernorm",
    eps: float = 1e-6,
) -> tuple[Tensor, FP8Rows]:
    """:func:`gated_residual_norm_modulate` with ``out`` quantized per row to e4m3
    in the same kernel (inference only).

    Args: as :func:`gated_residual_norm_modulate`.

    Returns:
        ``(residual_out [B, *tokens, C], FP8Rows(q [B, *tokens, C], scale [B, *tokens]))``:
        the rows are the bytes of ``quantize_fp8_rows`` of the unquantized
        ``out``, non-finite rule included (a row holding +-inf dequantizes to
        NaN, a NaN stays NaN).
    """
    refuse_gradient("gated_residual_norm_modulate_fp8", residual, x, gate, scale, shift, weight, bias)
    residual_out, q, q_scale = _gated_residual_norm_modulate_fp8_op(
        residual, x, gate, scale, shift, weight, bias, norm, eps
    )
    return residual_out, FP8Rows(q, q_scale)
