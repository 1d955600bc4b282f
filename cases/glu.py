"""Inputs of the glu family's ops: geglu, swiglu and glu_backward.

An op's arguments are ``(x [..., 2H], *options, gate_first)``; :func:`make_glu`
and :func:`glu_edges` make a row's ``make_inputs`` and ``edge_inputs`` from
its options (geglu's ``approximate``).
"""

import torch

from cases._tensors import tensor


def glu_edges(*options):
    """Edge cases of a gated activation; ``options`` follow x in the op's arguments
    (``gate_first`` last, and flipped on some cases)."""

    def edges(dtype, device, requires_grad):
        g = requires_grad

        def x(shape):
            return tensor(shape, dtype, device, g, scale=2.0)

        row_slice = tensor((4, 40), dtype, device, scale=2.0)[:, 4:20].detach().requires_grad_(g)  # row stride 40
        channel_strided = tensor((16, 3), dtype, device, scale=2.0).t().detach().requires_grad_(g)
        return [
            (x((2, 3, 16)), *options, False),
            (x((2, 3, 16)), *options, True),  # vLLM's order
            (x((0, 16)), *options, False),  # zero rows
            (x((10,)), *options, True),  # 1-D, H = 5
            (row_slice, *options, False),
            (channel_strided, *options, True),  # copied to unit column stride
            (x((3, 5, 66)), *options, False),  # H = 33, not a block multiple
        ]

    return edges


def make_glu(*options):
    """``make_inputs`` of a gated activation: x of the activation shape ``[B, L, 2H]``."""

    def make_inputs(shape, dtype, device, requires_grad):
        return (tensor(shape, dtype, device, requires_grad, scale=2.0), *options, False)

    return make_inputs


def glu_backward_edges(dtype, device, requires_grad):
    """glu_backward's cases: ``(grad [..., H], x [..., 2H], activation, gate_first)``."""
    cases = []
    # Every edge case, spread over the three activations (all of them on all
    # cases would triple opcheck's time for no new path).
    for i, activation in enumerate(("gelu", "gelu_tanh", "silu")):
        for x, gate_first in glu_edges()(dtype, device, False)[i::2]:
            dy = tensor((*x.shape[:-1], x.shape[-1] // 2), dtype, device)
            cases.append((dy, x, activation, gate_first))
    # An expanded (stride-0) gradient, as y.sum().backward() produces.
    x = tensor((3, 16), dtype, device)
    cases.append((torch.ones((), dtype=dtype, device=device).expand(3, 8), x, "gelu", False))
    return cases
