"""compile_ops' Ulysses exchange: one all-to-all for q, k and v, none of the receive-side copies.

diffusers' Ulysses template moves q, k and v in three all-to-alls, each with a
contiguous copy before it (heads to the front) and after it (the sequence
back together), and the output likewise: four collectives and eight copies of
a q-sized tensor per attention call.

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
attention's own backward. Inference calls on long shards exchange their
heads in two halves, issuing the second half's all-to-all before the first
half's attention, so that the transfer runs during that attention instead of
before it (:data:`PIPELINE_MIN_BYTES`). Tokens that every rank holds whole
(HunyuanVideo's text under compile_ops' plan) stay out of the all-to-all:
each rank attends its heads of them once, and their output is gathered.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from compile_ops.integrations.diffusers.attention_kernel import needs_gradient

#: Inference calls whose q shard (this rank's ``[B, S, H, D]``) holds at least
#: this many bytes, and whose heads a rank splits in two, pipeline the exchange
#: (two halves of the heads); below it a call is too short for the overlap to
#: pay for the two extra collectives' launches.
PIPELINE_MIN_BYTES = 32 * 2**20


def _waited(t: Tensor) -> Tensor:
    """An all-to-all's result, waited for in eager (a compiled graph places its own wait)."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def ulysses_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    group,
    world: int,
    attend: Callable[[Tensor, Tensor, Tensor], Tensor],
    replicated_tail: int = 0,
    rank: int = 0,
) -> Tensor:
    """Attention of this rank's sequence shard under Ulysses-``world``.

    Args:
        query, key, value: ``[B, S + T, H, D]``: this rank's S tokens of the
            sequence (the ranks' shards in rank order make the whole
            sharded sequence), then T = ``replicated_tail`` tokens every rank
            holds whole (HunyuanVideo's text under compile_ops' plan); one
            shape for the three, H divisible by ``world``.
        group: the Ulysses process group (diffusers' ``_ulysses_mesh``'s).
        world: the group's size (the Ulysses degree).
        attend: ``attend(q, k, v)`` -> ``[B, P * S + T, H / P, D]``: attention
            over the whole sequence for this rank's heads, on
            ``[B, P * S + T, H / P, D]`` q, k, v (strided where T is 0).
        replicated_tail: T, the tokens at the end that are not sharded.
        rank: this rank's place in ``group`` (its heads, of the replicated tail's).

    Returns:
        ``[B, S + T, H, D]``: this rank's tokens, then the replicated tail's, every head.
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
    if replicated_tail:
        return _with_replicated_tail(query, key, value, group, world, attend, replicated_tail, rank)
    if (
        heads % 2 == 0
        and query.numel() * query.element_size() >= PIPELINE_MIN_BYTES
        and not needs_gradient(query, key, value)
    ):
        return _pipelined(query, key, value, group, world, attend)
    return _sent_back(attend(*_received(query, key, value, group, world)), group, world, h)


def _qkv_views(received: Tensor, world: int, s: int, b: int, heads: int, d: int) -> tuple:
    """q, k, v ``[B, P * S, heads, D]`` as views of an all-to-all's received
    ``[P, S, B, 3, heads, D]`` buffer: token p * S + s sits at a uniform stride."""
    received = received.view(world, s, b, 3, heads, d)
    return tuple(received[:, :, :, i].flatten(0, 1).transpose(0, 1) for i in range(3))


def _by_token_rank(out: Tensor, world: int) -> Tensor:
    """``[B, P * S, heads, D]`` attention outputs as the ``[P, S, B, heads, D]``
    send buffer of the way back: chunk p holds the rows of rank p's tokens."""
    b, length, heads, d = out.shape
    return out.reshape(b, world, length // world, heads, d).permute(1, 2, 0, 3, 4).contiguous()


def _received(query: Tensor, key: Tensor, value: Tensor, group, world: int) -> tuple:
    """``[B, P * S, H/P, D]`` q, k, v of this rank's heads over every rank's
    tokens: views of one all-to-all's buffer."""
    b, s, h, d = query.shape
    heads = h // world
    # [P, S, B, 3, H/P, D]: one copy of q, k and v (heads to the front), one collective.
    send = torch.stack([t.view(b, s, world, heads, d).permute(2, 1, 0, 3, 4) for t in (query, key, value)], dim=3)
    received = _waited(funcol.all_to_all_single_autograd(send.flatten(), None, None, group))
    return _qkv_views(received, world, s, b, heads, d)


def _sent_back(out: Tensor, group, world: int, h: int) -> Tensor:
    """This rank's tokens, every head, ``[B, S, H, D]``, of ``[B, P * S, H/P, D]``
    attention outputs (this rank's heads over every rank's tokens)."""
    b, length, heads, d = out.shape
    s = length // world
    back = _waited(funcol.all_to_all_single_autograd(_by_token_rank(out, world).flatten(), None, None, group))
    # [P (heads now), S, B, H/P, D] -> [B, S, H, D].
    return back.view(world, s, b, heads, d).permute(2, 1, 0, 3, 4).reshape(b, s, h, d)


def _with_replicated_tail(query, key, value, group, world: int, attend, tail: int, rank: int) -> Tensor:
    """:func:`ulysses_attention` with ``tail`` tokens at the end that every rank
    holds whole: only the sharded tokens travel; each rank appends its heads'
    slice of the tail's q, k, v to the whole sharded sequence, and the tail's
    output is gathered over the ranks' heads (every rank gets all of it)."""
    b, length, h, d = query.shape
    heads = h // world
    mine = slice(rank * heads, (rank + 1) * heads)
    sharded = _received(*(t[:, :-tail] for t in (query, key, value)), group, world)
    joint = [torch.cat([part, t[:, -tail:, mine]], dim=1) for part, t in zip(sharded, (query, key, value))]
    out = attend(*joint)
    tokens = _sent_back(out[:, :-tail], group, world, h)
    gathered = _waited(funcol.all_gather_tensor_autograd(out[:, -tail:].contiguous(), 0, group))
    # [P * B, T, H/P, D] (rank-major) -> [B, T, H, D]: rank p's heads are p * H/P onwards.
    tail_out = gathered.view(world, b, tail, heads, d).permute(1, 2, 0, 3, 4).reshape(b, tail, h, d)
    return torch.cat([tokens, tail_out], dim=1)


def _pipelined(query: Tensor, key: Tensor, value: Tensor, group, world: int, attend) -> Tensor:
    """:func:`ulysses_attention` for inference, the heads exchanged in two
    halves: both halves' all-to-alls are issued before the first half's
    attention, and each is waited for only where its half is used. Through
    the functional collectives' ops, whose waits stay where they are written
    (funcol's wrappers wait right after issuing while a graph is traced)."""
    b, s, h, d = query.shape
    heads = h // world
    half = heads // 2
    # [2, P, S, B, 3, H/2P, D]: each half's send buffer contiguous.
    send = torch.stack([t.view(b, s, world, 2, half, d).permute(3, 2, 1, 0, 4, 5) for t in (query, key, value)], dim=4)
    name = group.group_name
    sizes = [send[0].numel() // world] * world
    pending = [torch.ops._c10d_functional.all_to_all_single(send[g].flatten(), sizes, sizes, name) for g in range(2)]
    returning = []
    for g in range(2):
        received = torch.ops._c10d_functional.wait_tensor(pending[g])
        chunks = _by_token_rank(attend(*_qkv_views(received, world, s, b, half, d)), world)
        out_sizes = [chunks.numel() // world] * world
        returning.append(torch.ops._c10d_functional.all_to_all_single(chunks.flatten(), out_sizes, out_sizes, name))
    # [2, P (heads now), S, B, H/2P, D] -> [B, S, P, 2, H/2P, D]: head p * H/P + g * H/2P + j.
    back = torch.stack([torch.ops._c10d_functional.wait_tensor(t).view(world, s, b, half, d) for t in returning])
    return back.permute(3, 2, 1, 0, 4, 5).reshape(b, s, h, d)
