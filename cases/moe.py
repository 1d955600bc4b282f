"""Inputs of the moe family's ops: moe_route and moe_route_backward.

An op's arguments are ``(x [T, H], router weight [E, H], top_k, renormalize)``;
:func:`make_moe` makes a row's ``make_inputs`` for one gate (E, k,
renormalized or not), :func:`moe_edges` is its ``edge_inputs``.
"""

import torch

from cases._tensors import tensor
from compile_ops import reference


def _router(num_experts, h, dtype, device, g):
    """A router weight ``[E, H]`` scaled so that the logits of N(0, 1) tokens are about N(0, 1)."""
    return tensor((num_experts, h), dtype, device, g, scale=h**-0.5)


def make_moe(num_experts, top_k, renormalize):
    """x ``[L, C]``: one sequence's tokens (B is not used, so that the
    sequence dim is the token dim the compile test marks dynamic)."""

    def make_inputs(shape, dtype, device, requires_grad):
        _, length, c = shape
        return (
            tensor((length, c), dtype, device, requires_grad),
            _router(num_experts, c, dtype, device, requires_grad),
            top_k,
            renormalize,
        )

    return make_inputs


def moe_edges(dtype, device, requires_grad):
    """Tokens not a multiple of the routing block (32), E not a power of 2,
    k = 1 and k = E, strided rows, E past 64 (the narrower H chunks), zero tokens."""
    g = requires_grad

    def x(t, h):
        return tensor((t, h), dtype, device, g)

    row_slice = tensor((6, 40), dtype, device)[:, 4:20].detach().requires_grad_(g)  # row stride 40
    return [
        (x(37, 8), _router(5, 8, dtype, device, g), 2, True),
        (x(9, 16), _router(17, 16, dtype, device, g), 1, False),
        (row_slice, _router(3, 16, dtype, device, g), 3, True),
        (x(5, 16), _router(130, 16, dtype, device, g), 2, True),
        (x(0, 16), _router(4, 16, dtype, device, g), 2, True),
    ]


def moe_backward_edges(dtype, device, requires_grad):
    """moe_route_backward's cases: the first edges' forward outputs with random
    gradients, and expanded gradients."""
    cases = []
    for x, w, top_k, renormalize in moe_edges(dtype, device, False)[:3]:
        probs, weights, experts, _, _ = reference.moe.moe_route(x, w, top_k, renormalize)
        cases.append(
            (
                tensor(probs.shape, probs.dtype, device),
                tensor(weights.shape, weights.dtype, device),
                x,
                w,
                probs,
                experts,
                renormalize,
            )
        )
    # Expanded (stride-0) gradients, as probs.sum().backward() produces.
    grad_probs, grad_weights, x, w, probs, experts, _ = cases[0]
    cases.append(
        (
            torch.ones((), dtype=probs.dtype, device=device).expand(probs.shape),
            torch.ones((), dtype=probs.dtype, device=device).expand(experts.shape),
            x,
            w,
            probs,
            experts,
            False,
        )
    )
    return cases
