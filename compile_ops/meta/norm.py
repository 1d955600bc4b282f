"""Shape, dtype and stride rules of the norm family, and its input validation.

Torch only. These functions are the fake (meta) implementations of the
``fused.*`` norm ops *and* allocate the outputs of the Triton launchers, so the
rules below hold on every path. Every check runs before any launch and names
the argument it rejects.
"""

from typing import Optional

import torch

from compile_ops.meta._validate import check_eps, check_floating, check_same_device, fail

_HALF = (torch.float16, torch.bfloat16)


def check_x(op: str, x: torch.Tensor) -> None:
    check_floating(op, "x", x)
    if x.dim() < 1:
        fail(op, "x must have at least 1 dim (the normalized hidden dim last), got a 0-dim tensor")
    if x.shape[-1] == 0:
        fail(op, f"x must have a non-empty last (hidden) dim, got shape {tuple(x.shape)}")


def check_affine(op: str, argname: str, p: Optional[torch.Tensor], x: torch.Tensor) -> None:
    if p is None:
        return
    check_floating(op, argname, p)
    if p.shape != x.shape[-1:]:
        fail(op, f"{argname} must have shape ({x.shape[-1]},) to match the last dim of x, got {tuple(p.shape)}")
    check_same_device(op, x, **{argname: p})


def output_dtype(x: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.dtype:
    """diffusers' casting rule: statistics in fp32, then the weight's dtype when
    the weight is fp16/bf16, else the input's dtype."""
    return output_dtype_for(x.dtype, weight)


def output_dtype_for(dtype: torch.dtype, weight: Optional[torch.Tensor]) -> torch.dtype:
    """:func:`output_dtype` for an input of ``dtype``."""
    if weight is not None and weight.dtype in _HALF:
        return weight.dtype
    return dtype


def rmsnorm(
    x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    check_x("rmsnorm", x)
    check_affine("rmsnorm", "weight", weight, x)
    check_affine("rmsnorm", "bias", bias, x)
    check_eps("rmsnorm", eps)
    return x.new_empty(x.shape, dtype=output_dtype(x, weight))


def layernorm(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    check_x("layernorm", x)
    check_affine("layernorm", "weight", weight, x)
    check_affine("layernorm", "bias", bias, x)
    check_eps("layernorm", eps)
    return x.new_empty(x.shape, dtype=output_dtype(x, weight))


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor], eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, residual_out)``: ``residual_out = x + residual`` in residual's dtype,
    ``out = rmsnorm(residual_out)`` in the dtype of :func:`output_dtype` of x."""
    check_x("add_rmsnorm", x)
    check_floating("add_rmsnorm", "residual", residual)
    if residual.shape != x.shape:
        fail("add_rmsnorm", f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    if torch.promote_types(x.dtype, residual.dtype) != residual.dtype:
        # residual_out = x + residual is stored in residual's dtype: a narrower one would round the sum
        # below torch's type promotion (fp32 x + fp16 residual is fp32 in torch).
        fail(
            "add_rmsnorm",
            f"residual must be at least as precise as x (the sum is kept in residual's dtype), "
            f"got residual {residual.dtype} and x {x.dtype}",
            TypeError,
        )
    check_same_device("add_rmsnorm", x, residual=residual)
    check_affine("add_rmsnorm", "weight", weight, x)
    check_eps("add_rmsnorm", eps)
    return (x.new_empty(x.shape, dtype=output_dtype(x, weight)), x.new_empty(x.shape, dtype=residual.dtype))


def norm_backward(
    grad_out: torch.Tensor,
    grad_residual: Optional[torch.Tensor],
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    is_rms: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias)``; dx in x's dtype, dweight/dbias in the parameter's
    dtype, or shape ``(0,)`` where that parameter is None."""
    op = "norm_backward"
    check_x(op, x)
    for argname, g in (("grad_out", grad_out), ("grad_residual", grad_residual)):
        if g is None:
            continue
        check_floating(op, argname, g)
        if g.shape != x.shape:
            fail(op, f"{argname} must have the shape of x {tuple(x.shape)}, got {tuple(g.shape)}")
        check_same_device(op, x, **{argname: g})
    check_affine(op, "weight", weight, x)
    check_affine(op, "bias", bias, x)
    check_eps(op, eps)

    def grad_of(p):
        return x.new_empty((0,)) if p is None else p.new_empty(p.shape)

    return x.new_empty(x.shape), grad_of(weight), grad_of(bias)
