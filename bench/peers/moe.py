"""Peers of the MoE routing family: the routing a model writes in PyTorch.

``PEERS[op_name][provider] = callable`` taking the op's arguments as built by
``cases.OpSpec.make_inputs`` (``x [1, T, H]``, the router weight ``[E, H]``,
``top_k``, ``renormalize``).

- ``composite_eager`` / ``composite_compiled``: :func:`composite` and it under
  ``torch.compile``: ``F.linear``, fp32 softmax, ``torch.topk``, the
  renormalization, counts by a scatter-add of ones (``bincount`` needs a host
  sync for its output size, which would also break the compiled graph), and the
  tokens grouped by expert by a stable argsort of the flattened experts (the
  flat layout, ``T * k`` ids: the same information as the op's padded ``[E, T]``
  rows).
"""

import torch
import torch.nn.functional as F

#: The registry rows of the family that have benchmark shapes.
SPECS = ("moe_route", "moe_route_hidream")


def composite(x, router_weight, top_k: int, renormalize: bool = True):
    """The routing a model writes in PyTorch: ``(probs [T, E] fp32, weights [T, k],
    experts [T, k], counts [E], token_ids [T * k])``, ``token_ids`` grouped by
    expert (expert e's tokens, ascending, at ``counts[:e].sum()`` on)."""
    probs = torch.softmax(F.linear(x, router_weight).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = experts.flatten()
    counts = torch.zeros(router_weight.shape[0], dtype=torch.int64, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    token_ids = torch.argsort(flat, stable=True) // top_k
    return probs, weights, experts, counts, token_ids


PEERS = {name: {"composite_eager": composite, "composite_compiled": torch.compile(composite)} for name in SPECS}
