"""Pure-PyTorch AdaLN modulation family: the implementation off-GPU and the test oracle.

Everything is computed in fp32 (fp64 for fp64 inputs) and rounded once, as the
kernels do; residual_out is rounded to its dtype before it is normalized.
"""

from typing import Optional

import torch

from compile_ops.meta import modulate as meta
from compile_ops.meta._validate import accumulation_dtype
from compile_ops.reference.fp8 import quantize_fp8_rows
from compile_ops.reference.norm import _affine


def expand_to_x(m: torch.Tensor, x: torch.Tensor, op: str = "modulate") -> torch.Tensor:
    """``m`` broadcast to x's shape by the family's rules (a view unless per-frame on a 3-D x)."""
    b = meta.broadcast_on_x(op, "m", m, x)
    return m.reshape(b.aligned_shape).expand(b.x_shape).reshape(x.shape)


def reduce_to(full: torch.Tensor, m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The gradient of ``m`` from the gradient of its expansion to x's shape."""
    b = meta.broadcast_on_x("modulate_backward", "m", m, x)
    # copy=True: with nothing to reduce, sum_to_size returns its input, which may be an op input.
    return full.reshape(b.x_shape).sum_to_size(b.aligned_shape).reshape(m.shape).to(m.dtype, copy=True)


def _normalize(h: torch.Tensor, norm: str, eps: float):
    """``(xhat, mean, rstd)`` in h's (accumulation) dtype; the statistics keep the last dim."""
    mean = torch.zeros_like(h[..., :1]) if norm == "rmsnorm" else h.mean(-1, keepdim=True)
    xc = h - mean
    rstd = torch.rsqrt(xc.square().mean(-1, keepdim=True) + eps)
    return xc * rstd, mean, rstd


def _stats_outputs(mean, rstd, norm):
    """The forward ops' ``(mean, rstd)`` outputs: fp32/fp64, not differentiable."""
    mean = mean.new_empty((0,)) if norm == "rmsnorm" else mean.squeeze(-1).detach()
    return mean, rstd.squeeze(-1).detach()


def _modulated(y, x, scale, shift):
    return y * (1 + expand_to_x(scale, x).to(y.dtype)) + expand_to_x(shift, x).to(y.dtype)


def modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    dtype = meta.promoted_dtype(x, scale, shift)
    return _modulated(x.to(accumulation_dtype(x, scale, shift)), x, scale, shift).to(dtype)


def norm_modulate(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    norm: str,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, mean, rstd)`` (see :func:`compile_ops.meta.modulate.row_stats`)."""
    meta.check_norm("norm_modulate", norm)
    dtype = meta.promoted_dtype(scale, shift, norm_dtype=meta.output_dtype(x, weight))
    # Statistics in fp32 (fp64 for fp64 x) whatever scale's dtype, as the kernels.
    xhat, mean, rstd = _normalize(x.to(accumulation_dtype(x)), norm, eps)
    out = _modulated(_affine(xhat.to(accumulation_dtype(x, scale, shift)), weight, bias), x, scale, shift).to(dtype)
    return (out, *_stats_outputs(mean, rstd, norm))


def gated_residual(residual: torch.Tensor, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    acc = accumulation_dtype(residual, x, gate)
    out = residual.to(acc) + expand_to_x(gate, x).to(acc) * x.to(acc)
    return out.to(meta.promoted_dtype(residual, x, gate))


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
    """``(residual_out, out, mean, rstd)``."""
    residual_out = gated_residual(residual, x, gate)
    return (residual_out, *norm_modulate(residual_out, scale, shift, weight, bias, norm, eps))


def norm_modulate_fp8(x, scale, shift, weight, bias, norm, eps) -> tuple:
    """``(q, scale)``: :func:`norm_modulate`'s output, quantized per row (``reference/fp8.py``)."""
    return quantize_fp8_rows(norm_modulate(x, scale, shift, weight, bias, norm, eps)[0])


def gated_residual_norm_modulate_fp8(residual, x, gate, scale, shift, weight, bias, norm, eps) -> tuple:
    """``(residual_out, q, scale)``: the seam with its normed output quantized per row."""
    residual_out, out, _, _ = gated_residual_norm_modulate(residual, x, gate, scale, shift, weight, bias, norm, eps)
    return (residual_out, *quantize_fp8_rows(out))


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
    """Closed-form gradients of ``out = modulate(norm(h) * weight + bias)`` (each
    part optional) and of ``h = residual + gate * x_branch`` when gated; see
    :func:`compile_ops.meta.modulate.modulate_backward` for the outputs."""
    acc = accumulation_dtype(h)
    n = h.shape[-1]

    def empty():
        return h.new_empty((0,))

    d_scale = d_shift = d_weight = d_bias = None
    if grad_out is not None:
        dy = grad_out.to(acc)
        hf = h.to(acc)
        xhat = rstd = None
        y = hf
        if norm != "none":
            if rstd is not None:  # the forward's statistics
                rstd = rstd.to(acc).unsqueeze(-1)
                xhat = (hf if norm == "rmsnorm" else hf - mean.to(acc).unsqueeze(-1)) * rstd
            else:
                xhat, _, rstd = _normalize(hf, norm, eps)
            y = _affine(xhat, weight, bias)
        dn = dy
        if scale is not None:
            d_scale = reduce_to(dy * y, scale, h)
            d_shift = reduce_to(dy, shift, h)
            dn = dy * (1 + expand_to_x(scale, h).to(acc))
        if norm != "none":
            rows = dn.reshape(-1, n)
            if weight is not None:
                d_weight = (rows * xhat.reshape(-1, n)).sum(0).to(weight.dtype)
            if bias is not None:
                d_bias = rows.sum(0).to(bias.dtype)
            wdn = dn * weight.to(acc) if weight is not None else dn
            d_h = wdn - xhat * (xhat * wdn).mean(-1, keepdim=True)
            if norm == "layernorm":
                d_h = d_h - wdn.mean(-1, keepdim=True)
            d_h = d_h * rstd
        else:
            d_h = dn
        if grad_h is not None:
            d_h = d_h + grad_h.to(acc)
    else:
        d_h = grad_h.to(acc)
    d_x_branch = d_gate = None
    if gate is not None:
        d_x_branch = (d_h * expand_to_x(gate, h).to(acc)).to(x_branch.dtype)
        d_gate = reduce_to(d_h * x_branch.to(acc), gate, h)
    return (
        empty() if grad_out is None else d_h.to(h.dtype),
        *(empty() if t is None else t for t in (d_x_branch, d_gate, d_scale, d_shift, d_weight, d_bias)),
    )
