"""compile_ops' Ulysses exchange: one all-to-all for q, k and v, none of the receive-side copies.

diffusers' Ulysses template moves q, k and v in three all-to-alls, each with a
contiguous copy before it (heads to the front) and after it (the sequence
back together), and the output likewise: four collectives and eight copies of
a q-sized tensor per attention call. Its communication and copies, not the
attention, are what a sparse video step spends on a second GPU.

Here the send buffer holds q, k and v side by side, laid out
``[P, S, B, 3, H / P, D]`` (P ranks, S tokens a rank): chunk p, the heads
rank p attends, is contiguous, and after the all-to-all the received buffer
is ``[P, S, B, 3, H / P, D]`` with the sequence chunks in rank order. Each of
q, k and v is then a strided view ``[B, P * S, H / P, D]`` of it (token
stride ``B * 3 * H / P * D``, uniform across chunks), which the fused kernels
read as they are. The output goes back in one all-to-all from its own
layout (for B = 1 a plain view) and one copy puts the heads back in order.

The exchange is differentiable (functional collectives with autograd), so a
training step's backward runs the same collectives in reverse around the
attention's own backward.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor


def _waited(t: Tensor) -> Tensor:
    """An all-to-all's result, waited for in eager (a compiled graph places its own wait)."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def ulysses_attention(
    query: Tensor, key: Tensor, value: Tensor, group, world: int, attend: Callable[[Tensor, Tensor, Tensor], Tensor]
) -> Tensor:
    """Attention of this rank's sequence shard under Ulysses-``world``.

    Args:
        query, key, value: ``[B, S, H, D]``, this rank's S tokens of the
            sequence (the ranks' shards in rank order make the whole
            sequence); one shape for the three, H divisible by ``world``.
        group: the Ulysses process group (diffusers' ``_ulysses_mesh``'s).
        world: the group's size (the Ulysses degree).
        attend: ``attend(q, k, v)`` -> ``[B, P * S, H / P, D]``: attention
            over the whole sequence for this rank's heads, on ``[B, P * S, H / P, D]``
            (strided) q, k, v.

    Returns:
        ``[B, S, H, D]``: this rank's tokens, every head.
    """
    if not (query.shape == key.shape == value.shape):
        raise ValueError(
            "compile_ops Ulysses attention: q, k and v must have one shape [B, S, H, D] "
            f"(self-attention over one sequence), got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    b, s, h, d = query.shape
    if h % world:
        raise ValueError(
            f"compile_ops Ulysses attention: the {h} heads must divide by ulysses_degree={world} "
            "(each rank attends H / ulysses_degree heads); choose a degree that divides the head count"
        )
    heads = h // world
    # [P, S, B, 3, H/P, D]: one copy of q, k and v (heads to the front), one collective.
    send = torch.stack([t.view(b, s, world, heads, d).permute(2, 1, 0, 3, 4) for t in (query, key, value)], dim=3)
    received = _waited(funcol.all_to_all_single_autograd(send.flatten(), None, None, group))
    received = received.view(world, s, b, 3, heads, d)
    # [P, S, B, H/P, D] -> [B, P * S, H/P, D]: token p * S + s sits at a uniform stride.
    q, k, v = (received[:, :, :, i].flatten(0, 1).transpose(0, 1) for i in range(3))
    out = attend(q, k, v)
    # Back to each token's rank: chunk p holds the output rows of rank p's tokens.
    chunks = out.reshape(b, world, s, heads, d).permute(1, 2, 0, 3, 4).contiguous()
    back = _waited(funcol.all_to_all_single_autograd(chunks.flatten(), None, None, group))
    # [P (heads now), S, B, H/P, D] -> [B, S, H, D].
    return back.view(world, s, b, heads, d).permute(2, 1, 0, 3, 4).reshape(b, s, h, d)
