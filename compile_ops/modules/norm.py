"""``RMSNorm`` and ``LayerNorm`` modules that drop in for ``torch.nn`` and diffusers.

Parameter names (``weight``, ``bias``) and constructor arguments follow
``torch.nn.RMSNorm`` / ``torch.nn.LayerNorm`` and diffusers' ``RMSNorm``, so
state dicts load unchanged.
"""

import numbers
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from compile_ops.meta._validate import check_floating_input, checked_arguments
from compile_ops.ops.norm import layernorm, rmsnorm


def _hidden_size(normalized_shape: Union[int, Sequence[int]]) -> int:
    if isinstance(normalized_shape, numbers.Integral):
        return int(normalized_shape)
    shape = tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(
            f"normalized_shape must name one (the last) dim, got {shape}: "
            "the fused norms normalize over the last dim only"
        )
    return int(shape[0])


class RMSNorm(nn.Module):
    """Drop-in for ``torch.nn.RMSNorm(dim, eps, elementwise_affine)`` and diffusers'
    ``RMSNorm(dim, eps, elementwise_affine, bias)``.

    Input ``[..., dim]``; output as :func:`compile_ops.rmsnorm` (fp32 statistics,
    output in the weight's dtype when the weight is fp16/bf16, else x's).
    ``eps=None`` means ``torch.finfo(x.dtype).eps``, as in torch.
    """

    @checked_arguments
    def __init__(
        self,
        dim: Union[int, Sequence[int]],
        eps: Optional[float] = None,
        elementwise_affine: bool = True,
        bias: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.dim = _hidden_size(dim)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        factory = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.ones(self.dim, **factory)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(self.dim, **factory)) if elementwise_affine and bias else None

    def forward(self, x: Tensor) -> Tensor:
        if self.eps is None:  # torch.finfo would raise first
            check_floating_input("compile_ops.RMSNorm", "x", x)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return rmsnorm(x, self.weight, eps, self.bias)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class LayerNorm(nn.Module):
    """Drop-in for ``torch.nn.LayerNorm(normalized_shape, eps, elementwise_affine, bias)``.

    Input ``[..., normalized_shape]``; output as :func:`compile_ops.layernorm`.
    """

    @checked_arguments
    def __init__(
        self,
        normalized_shape: Union[int, Sequence[int]],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.dim = _hidden_size(normalized_shape)
        self.normalized_shape = (self.dim,)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        factory = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.ones(self.dim, **factory)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(self.dim, **factory)) if elementwise_affine and bias else None

    def forward(self, x: Tensor) -> Tensor:
        return layernorm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
