"""Inputs of the norm family's ops: rmsnorm, add_rmsnorm, layernorm and norm_backward.

An ``*_args`` builder ``build(x, affine, dtype, device, g)`` turns an activation
``x [..., C]`` into an op's arguments (``affine``: with weight and bias);
:func:`make_norm` and :func:`norm_edges` make the row's ``make_inputs`` and
``edge_inputs`` of one.
"""

import torch

from cases._tensors import param, tensor


def norm_edges(build):
    """Edge-case argument tuples shared by the norm ops; ``build(x, with_affine)``
    turns an activation into the op's arguments."""

    def edges(dtype, device, requires_grad):
        g = requires_grad
        base = tensor((2, 3, 16), dtype, device, g)
        strided = tensor((4, 40), dtype, device)[:, 4:20].detach().requires_grad_(g)  # row stride 40
        return [
            build(base, True, dtype, device, g),
            build(base, False, dtype, device, g),
            build(tensor((0, 16), dtype, device, g), True, dtype, device, g),  # zero rows
            build(tensor((7,), dtype, device, g), True, dtype, device, g),  # one row, odd width
            build(strided, True, dtype, device, g),
            build(tensor((3, 5, 33), dtype, device, g), True, dtype, device, g),  # width not a block multiple
        ]

    return edges


def rmsnorm_args(x, affine, dtype, device, g, eps=1e-6):
    """``(x, weight [C] or None, eps)``."""
    c = x.shape[-1]
    return (x, param(c, dtype, device, g) if affine else None, eps)


def layernorm_args(x, affine, dtype, device, g, eps=1e-5):
    """``(x, weight [C], bias [C], eps)``, weight and bias None without ``affine``."""
    c = x.shape[-1]
    if not affine:
        return (x, None, None, eps)
    return (x, param(c, dtype, device, g), (0.1 * tensor((c,), dtype, device)).requires_grad_(g), eps)


def add_rmsnorm_args(x, affine, dtype, device, g, eps=1e-6):
    """``(x, residual like x, weight [C] or None, eps)``."""
    residual = tensor(x.shape, dtype, device, g)
    c = x.shape[-1]
    return (x, residual, param(c, dtype, device, g) if affine else None, eps)


def norm_backward_edges(dtype, device, requires_grad):
    """norm_backward's cases, each as RMS and as LayerNorm: with and without weight
    and bias, zero rows, and an expanded gradient."""
    out = []
    for x, w, b in [
        (tensor((2, 3, 16), dtype, device), True, True),
        (tensor((5, 24), dtype, device), False, False),
        (tensor((0, 16), dtype, device), True, True),
    ]:
        c = x.shape[-1]
        dy = tensor(x.shape, dtype, device)
        for is_rms in (True, False):
            out.append(
                (
                    dy,
                    None if is_rms else tensor(x.shape, dtype, device),
                    x,
                    param(c, dtype, device, False) if w else None,
                    param(c, dtype, device, False) if b else None,
                    1e-6,
                    is_rms,
                )
            )
    # An expanded (stride-0) gradient, as y.sum().backward() produces.
    x = tensor((3, 16), dtype, device)
    out.append(
        (
            torch.ones((), dtype=dtype, device=device).expand(3, 16),
            None,
            x,
            param(16, dtype, device, False),
            None,
            1e-6,
            True,
        )
    )
    return out


def make_norm(build):
    """``make_inputs`` of a norm op: ``build``'s arguments, with affine parameters,
    around a ``[B, L, C]`` activation."""

    def make_inputs(shape, dtype, device, requires_grad):
        return build(tensor(shape, dtype, device, requires_grad), True, dtype, device, requires_grad)

    return make_inputs
