"""Shape, dtype and broadcast rules of the AdaLN modulation family, and its validation.

Torch only: these are the fake implementations of the ``fused.*`` modulation
ops and allocate the launchers' outputs, so the rules hold on every path.

How scale, shift and gate ("modulation tensors") broadcast against x
``[B, *tokens, C]`` (``L`` = the product of the token dims):

- 0-dim: one value for everything.
- ``[C]``: per channel.
- ``[B, C]`` (or ``[1, C]``): per sample, as diffusers' ``scale[:, None]``.
- ``x.dim()`` dims: torch broadcasting (each dim 1 or x's), e.g. ``[B, 1, C]``
  per sample or ``[B, L, C]`` per token; the last dim is C or 1.
- ``[B, F, 1, C]`` against a 3-D x ``[B, L, C]``: per frame, x read as
  ``[B, F, L/F, C]`` (L must be a multiple of F).

The kernels see row ``r = b * L + t`` of x and find a modulation row at
``b * stride_batch + (t // group) * stride_group + (t % group) * stride_in_group``
(:class:`Broadcast`), so the token dims of the expanded tensor must collapse
to at most two levels; every form above does.
"""

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from compile_ops.meta._validate import accumulation_dtype, check_eps, check_floating, check_same_device, fail
from compile_ops.meta.norm import check_affine, output_dtype, output_dtype_for

#: Values of the ``norm`` argument.
NORMS = ("layernorm", "rmsnorm")
#: Hidden sizes up to this stay in registers: one read of x per pass. The
#: largest DiT hidden size is 5120 (Wan 14B).
MAX_HIDDEN = 16384


@dataclass(frozen=True)
class Broadcast:
    """Where row ``r = b * tokens + t`` of x finds its modulation row, and which rows share it."""

    stride_batch: int
    stride_group: int
    stride_in_group: int
    stride_col: int
    group: int
    """Tokens per group: ``t // group`` indexes ``stride_group``, ``t % group`` ``stride_in_group``."""
    run: int
    """Consecutive tokens of a sample that share one modulation row (a product of trailing token dims)."""
    aligned_shape: tuple
    """The tensor's shape aligned dim for dim with ``x_shape`` (1 where it broadcasts)."""
    x_shape: tuple
    """x's shape as the broadcast reads it (``[B, F, L/F, C]`` for a per-frame tensor on a 3-D x)."""


def _aligned(op: str, argname: str, m: torch.Tensor, x: torch.Tensor):
    """``(x_shape, aligned_shape, aligned_strides)`` of ``m`` against ``x``."""
    nx = x.dim()
    forms = "0-dim, [C], [B, C], a shape that broadcasts to x's, or [B, F, 1, C] per frame for a 3-D x"
    if m.dim() == 0:
        return tuple(x.shape), (1,) * nx, (0,) * nx
    if m.dim() == 1:
        return tuple(x.shape), (1,) * (nx - 1) + (m.shape[0],), (0,) * (nx - 1) + (m.stride(0),)
    if m.dim() == 2 and nx > 2:
        return (
            tuple(x.shape),
            (m.shape[0],) + (1,) * (nx - 2) + (m.shape[1],),
            (m.stride(0),) + (0,) * (nx - 2) + (m.stride(1),),
        )
    if m.dim() == nx:
        return tuple(x.shape), tuple(m.shape), tuple(m.stride())
    if nx == 3 and m.dim() == 4:
        frames, tokens = m.shape[1], x.shape[1]
        if frames == 0 or tokens % frames != 0:
            fail(
                op,
                f"{argname} of shape {tuple(m.shape)} is per frame ([B, F, 1, C]) but x's "
                f"{tokens} tokens do not split into F={frames} frames",
            )
        return (x.shape[0], frames, tokens // frames, x.shape[2]), tuple(m.shape), tuple(m.stride())
    fail(op, f"{argname} of shape {tuple(m.shape)} does not broadcast to x of shape {tuple(x.shape)}: expected {forms}")


def broadcast_on_x(op: str, argname: str, m: torch.Tensor, x: torch.Tensor) -> Broadcast:
    """Validate that ``m`` broadcasts to ``x`` and describe how (see the module docstring)."""
    x_shape, shape, strides = _aligned(op, argname, m, x)
    for d, (size, want) in enumerate(zip(shape, x_shape)):
        if size != 1 and size != want:
            fail(
                op,
                f"{argname} of shape {tuple(m.shape)} does not broadcast to x of shape "
                f"{tuple(x.shape)}: its dim {d} (aligned to x as {shape}) has size {size}, "
                f"expected 1 or {want}",
            )
    # A broadcast dim reads the same element for every index: stride 0.
    strides = tuple(0 if size == 1 else s for size, s in zip(shape, strides))

    token_sizes, token_strides = x_shape[1:-1], strides[1:-1]
    levels = []  # (size, stride), outermost first, adjacent dims merged where they step evenly
    for size, stride in zip(token_sizes, token_strides):
        if size == 1:
            continue
        if levels and levels[-1][1] == size * stride:
            levels[-1] = (levels[-1][0] * size, stride)
        else:
            levels.append((size, stride))
    if len(levels) > 2:
        fail(
            op,
            f"{argname} of shape {tuple(m.shape)} broadcasts over x's token dims "
            f"{tuple(token_sizes)} in a pattern of {len(levels)} levels; at most 2 are "
            f"supported (per sample, per token, per frame): expand or reshape it",
        )
    if len(levels) == 2:
        group, stride_group, stride_in_group = levels[1][0], levels[0][1], levels[1][1]
    elif len(levels) == 1:
        group, stride_group, stride_in_group = levels[0][0], 0, levels[0][1]
    else:
        group, stride_group, stride_in_group = 1, 0, 0

    run = 1
    for size, stride in zip(reversed(token_sizes), reversed(token_strides)):
        if size != 1 and stride != 0:
            break
        run = run * size
    return Broadcast(strides[0], stride_group, stride_in_group, strides[-1], group, run, shape, x_shape)


def promoted_dtype(*tensors: torch.Tensor, norm_dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """What torch's type promotion gives for an arithmetic expression of ``tensors``
    (and of a norm's output of dtype ``norm_dtype``, never 0-dim): 0-dim tensors
    do not raise the dtype of dimensioned ones of the same (float) kind."""
    dtypes = [t.dtype for t in tensors if t.dim() > 0] + ([norm_dtype] if norm_dtype is not None else [])
    return functools.reduce(torch.promote_types, dtypes or [t.dtype for t in tensors])


def check_x(op: str, x: torch.Tensor) -> None:
    check_floating(op, "x", x)
    if x.dim() < 2:
        fail(op, f"x must be [B, ..., C] (at least 2 dims, hidden dim last), got shape {tuple(x.shape)}")
    if x.shape[-1] == 0:
        fail(op, f"x must have a non-empty last (hidden) dim, got shape {tuple(x.shape)}")
    if x.shape[-1] > MAX_HIDDEN:
        fail(op, f"x has hidden size {x.shape[-1]}; this family supports up to {MAX_HIDDEN}")


def check_modulation(op: str, x: torch.Tensor, **tensors: torch.Tensor) -> dict:
    """Check each named modulation tensor against x; ``{name: Broadcast}``."""
    out = {}
    for argname, m in tensors.items():
        check_floating(op, argname, m)
        check_same_device(op, x, **{argname: m})
        out[argname] = broadcast_on_x(op, argname, m, x)
    return out


def check_norm(op: str, norm: str) -> None:
    if norm not in NORMS:
        fail(op, f"norm must be one of {NORMS}, got {norm!r}")


def check_like_x(op: str, argname: str, t: torch.Tensor, x: torch.Tensor) -> None:
    check_floating(op, argname, t)
    if t.shape != x.shape:
        fail(op, f"{argname} must have the shape of x {tuple(x.shape)}, got {tuple(t.shape)}")
    check_same_device(op, x, **{argname: t})


# ---------------------------------------------------------------- the ops' fakes


def modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    op = "modulate"
    check_x(op, x)
    check_modulation(op, x, scale=scale, shift=shift)
    return x.new_empty(x.shape, dtype=promoted_dtype(x, scale, shift))


def row_stats(x: torch.Tensor, norm: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, rstd)`` outputs: fp32 (fp64 for fp64 x) of shape ``x.shape[:-1]``,
    the mean of shape ``(0,)`` for RMSNorm (it has none), like
    ``aten.native_layer_norm``'s. The backward reuses them."""
    acc = accumulation_dtype(x)
    rstd = x.new_empty(x.shape[:-1], dtype=acc)
    return (rstd.new_empty((0,)) if norm == "rmsnorm" else x.new_empty(x.shape[:-1], dtype=acc)), rstd


def norm_modulate(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    norm: str,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, mean, rstd)``; see :func:`row_stats`."""
    op = "norm_modulate"
    check_x(op, x)
    check_modulation(op, x, scale=scale, shift=shift)
    check_affine(op, "weight", weight, x)
    check_affine(op, "bias", bias, x)
    check_norm(op, norm)
    check_eps(op, eps)
    out = x.new_empty(x.shape, dtype=promoted_dtype(scale, shift, norm_dtype=output_dtype(x, weight)))
    return (out, *row_stats(x, norm))


def gated_residual(residual: torch.Tensor, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    op = "gated_residual"
    check_x(op, x)
    check_like_x(op, "residual", residual, x)
    check_modulation(op, x, gate=gate)
    return x.new_empty(x.shape, dtype=promoted_dtype(residual, x, gate))


def gated_residual_norm_modulate(
    residual: torch.Tensor,
    x: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    norm: str,
    eps: float,
) -> tuple[torch.Tensor, ...]:
    """``(residual_out, out, mean, rstd)``; ``out`` has :func:`norm_modulate`'s
    dtype for an input in residual_out's dtype, the statistics are residual_out's."""
    op = "gated_residual_norm_modulate"
    check_x(op, x)
    check_like_x(op, "residual", residual, x)
    check_modulation(op, x, gate=gate, scale=scale, shift=shift)
    check_affine(op, "weight", weight, x)
    check_affine(op, "bias", bias, x)
    check_norm(op, norm)
    check_eps(op, eps)
    h_dtype = promoted_dtype(residual, x, gate)
    residual_out = x.new_empty(x.shape, dtype=h_dtype)
    out = x.new_empty(x.shape, dtype=promoted_dtype(scale, shift, norm_dtype=output_dtype_for(h_dtype, weight)))
    return (residual_out, out, *row_stats(residual_out, norm))


def fp8_rows(out: torch.Tensor) -> tuple:
    """``(q, scale)`` of the FP8 output mode for an output like ``out``."""
    return out.new_empty(out.shape, dtype=torch.float8_e4m3fn), out.new_empty(out.shape[:-1], dtype=torch.float32)


def norm_modulate_fp8(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    norm: str,
    eps: float,
) -> tuple:
    """``(q [..., C] float8_e4m3fn, scale [...] float32)`` of :func:`norm_modulate`'s output."""
    return fp8_rows(norm_modulate(x, scale, shift, weight, bias, norm, eps)[0])


def gated_residual_norm_modulate_fp8(
    residual: torch.Tensor,
    x: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    norm: str,
    eps: float,
) -> tuple:
    """``(residual_out, q, scale)``: :func:`gated_residual_norm_modulate`'s ``out`` quantized."""
    residual_out, out, _, _ = gated_residual_norm_modulate(residual, x, gate, scale, shift, weight, bias, norm, eps)
    return (residual_out, *fp8_rows(out))


def modulate_backward(
    grad_out: Optional[torch.Tensor],
    grad_h: Optional[torch.Tensor],
    h: torch.Tensor,
    mean: Optional[torch.Tensor],
    rstd: Optional[torch.Tensor],
    x_branch: Optional[torch.Tensor],
    gate: Optional[torch.Tensor],
    scale: Optional[torch.Tensor],
    shift: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    norm: str,
    eps: float,
):
    """``(d_h, d_x_branch, d_gate, d_scale, d_shift, d_weight, d_bias)``, each in the
    dtype and shape of its input, or shape ``(0,)`` where that input is None.
    ``d_h`` is ``(0,)`` when there is no ``grad_out`` (a gated residual alone,
    whose ``d_residual`` is ``grad_h`` itself). ``mean``/``rstd`` are h's row
    statistics as the forward op returned them, or None to recompute them."""
    op = "modulate_backward"
    check_x(op, h)
    if (rstd is None) != (mean is None):
        fail(op, "mean and rstd come together (as the forward returned them) or not at all")
    if rstd is not None:
        if norm == "none":
            fail(op, "mean/rstd were given but norm is 'none'")
        want_mean, want_rstd = row_stats(h, norm)
        for argname, t, want in (("mean", mean, want_mean), ("rstd", rstd, want_rstd)):
            if t.shape != want.shape or t.dtype != want.dtype or t.device != h.device or not t.is_contiguous():
                fail(
                    op,
                    f"{argname} must be contiguous {want.dtype} of shape {tuple(want.shape)} on {h.device} "
                    f"(the forward's row statistics of h), got {t.dtype} {tuple(t.shape)} on {t.device}",
                )
    if grad_out is None and grad_h is None:
        fail(op, "grad_out and grad_h are both None; at least one gradient is needed")
    for argname, t in (("grad_out", grad_out), ("grad_h", grad_h), ("x_branch", x_branch)):
        if t is not None:
            check_like_x(op, argname, t, h)
    if (gate is None) != (x_branch is None):
        fail(op, "gate and x_branch come together (the gated residual) or not at all")
    if (scale is None) != (shift is None):
        fail(op, "scale and shift come together or not at all")
    if grad_out is None and (scale is not None or norm != "none"):
        fail(op, "grad_out is required when there is a norm or a modulation")
    if grad_out is not None and scale is None and norm == "none":
        fail(op, "grad_out was given but there is neither a norm nor a modulation to apply it to")
    check_modulation(op, h, **{k: v for k, v in (("gate", gate), ("scale", scale), ("shift", shift)) if v is not None})
    check_affine(op, "weight", weight, h)
    check_affine(op, "bias", bias, h)
    if norm != "none":
        check_norm(op, norm)
    elif weight is not None or bias is not None:
        fail(op, "weight and bias belong to a norm, but norm is 'none'")
    check_eps(op, eps)

    def like(t):
        return h.new_empty((0,)) if t is None else t.new_empty(t.shape)

    d_h = h.new_empty((0,)) if grad_out is None else h.new_empty(h.shape)
    return (d_h, like(x_branch), like(gate), like(scale), like(shift), like(weight), like(bias))


def segment_rows(tokens, *broadcasts: Broadcast):
    """Rows per segment: consecutive rows of a sample that share one row of every
    modulation tensor (the backward reduces per segment). The gcd of the tensors'
    runs; under torch.compile, where runs may be symbolic, the common run when
    they are all equal, else single rows (correct, slower)."""
    runs = [b.run for b in broadcasts] or [tokens]
    static = [static_int(r) for r in runs]
    if all(r is not None for r in static):
        return math.gcd(*static)
    if all(r == runs[0] for r in runs[1:]):
        return runs[0]
    return 1


def static_int(v) -> Optional[int]:
    """``v`` as an int when it is one (or a SymInt of constant value), else None."""
    return int(v) if is_concrete_int(v) else None


def tokens_of(x: torch.Tensor):
    return math.prod(x.shape[1:-1])
