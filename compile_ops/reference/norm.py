"""Pure-PyTorch norm family: the implementation off-GPU and the test oracle.

Statistics are computed in fp32 (fp64 for fp64 inputs), as the kernels do.
"""

from typing import Optional

import torch

from compile_ops.meta._validate import accumulation_dtype
from compile_ops.meta.norm import output_dtype


def _affine(xhat, weight, bias):
    if weight is not None:
        xhat = xhat * weight.to(xhat.dtype)
    if bias is not None:
        xhat = xhat + bias.to(xhat.dtype)
    return xhat


def rmsnorm(
    x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    xf = x.to(accumulation_dtype(x))
    xhat = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return _affine(xhat, weight, bias).to(output_dtype(x, weight))


def layernorm(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    xf = x.to(accumulation_dtype(x))
    xc = xf - xf.mean(-1, keepdim=True)
    xhat = xc * torch.rsqrt(xc.square().mean(-1, keepdim=True) + eps)
    return _affine(xhat, weight, bias).to(output_dtype(x, weight))


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor], eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # The sum is rounded to residual's dtype before it is normalized, so that
    # out == rmsnorm(residual_out) exactly, as the kernel does.
    acc = accumulation_dtype(x) if residual.dtype != torch.float64 else torch.float64
    residual_out = (x.to(acc) + residual.to(acc)).to(residual.dtype)
    out = rmsnorm(residual_out, weight, eps)
    return out.to(output_dtype(x, weight)), residual_out


def norm_backward(
    grad_out: torch.Tensor,
    grad_residual: Optional[torch.Tensor],
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    is_rms: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Closed-form gradients of ``norm(x) * weight + bias`` (plus grad_residual added to dx)."""
    acc = accumulation_dtype(x)
    xf, dy = x.to(acc), grad_out.to(acc)
    n = x.shape[-1]
    xc = xf if is_rms else xf - xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt(xc.square().mean(-1, keepdim=True) + eps)
    xhat = xc * rstd
    wdy = dy * weight.to(acc) if weight is not None else dy
    c1 = (xhat * wdy).sum(-1, keepdim=True) / n
    dx = wdy - xhat * c1
    if not is_rms:
        dx = dx - wdy.sum(-1, keepdim=True) / n
    dx = dx * rstd
    if grad_residual is not None:
        dx = dx + grad_residual.to(acc)
    dweight = x.new_empty((0,)) if weight is None else (dy * xhat).reshape(-1, n).sum(0).to(weight.dtype)
    dbias = x.new_empty((0,)) if bias is None else dy.reshape(-1, n).sum(0).to(bias.dtype)
    return dx.to(x.dtype), dweight, dbias
