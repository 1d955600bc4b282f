"""DTensor plumbing that the op wrappers need, below every op (imports no op).

``compile_ops/_library.py`` wraps each op's autograd formula with
:func:`remember_output_layouts` / :func:`gradients_as_dtensors`, and the
attention and RoPE wrappers call :func:`sequence_parallel` and
:func:`replicated_like`. The sharding *rules* of the ops live above ``ops/``
in ``compile_ops/distributed.py``, which ``compile_ops/__init__.py``
registers; keeping this module free of op imports is what lets the arrows run
one way: ``_dtensor`` <- ``_library`` <- ``ops`` <- ``distributed``.

Two things DTensor needs from the op wrappers: tensors that a wrapper builds
itself must be DTensors too (:func:`replicated_like`), and the plain zeros that
autograd materializes as the gradient of an unused DTensor output must become
DTensor zeros (:func:`gradients_as_dtensors`).
"""

from typing import Callable, Optional

import torch

# ---------------------------------------------------------------- tensors the op wrappers build


def _dtensor_type():
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def layout_of(t: torch.Tensor) -> Optional[tuple]:
    """``(mesh, placements)`` of a DTensor; None for any other tensor (the
    eager fast path pays one type check)."""
    if type(t) is torch.Tensor:
        return None
    dtensor = _dtensor_type()
    return (t.device_mesh, t.placements) if dtensor is not None and isinstance(t, dtensor) else None


def remember_output_layouts(setup_context: Callable) -> Callable:
    """Wrap an op's ``setup_context`` to record the layout of each DTensor
    output, for :func:`gradients_as_dtensors`."""

    def setup(ctx, inputs, output):
        setup_context(ctx, inputs, output)
        layouts = [layout_of(o) for o in (output if isinstance(output, tuple) else (output,))]
        ctx.output_layouts = layouts if any(layouts) else None

    return setup


def gradients_as_dtensors(backward: Callable) -> Callable:
    """Wrap an op's ``backward``: the gradient autograd materializes for an
    output nothing used (``y, h = add_rmsnorm(...)`` with h unused) is a plain
    zeros tensor even when that output is a DTensor, and DTensor refuses a
    plain tensor next to DTensors in the backward op. Make it DTensor zeros in
    the output's layout."""

    def wrapped(ctx, *grads):
        layouts = getattr(ctx, "output_layouts", None)
        if layouts is not None:
            grads = tuple(
                _dtensor_zeros(g.shape, g.dtype, layout)
                if layout is not None and g is not None and layout_of(g) is None
                else g
                for g, layout in zip(grads, layouts)
            )
        return backward(ctx, *grads)

    return wrapped


def _dtensor_zeros(shape, dtype: torch.dtype, layout: tuple) -> torch.Tensor:
    from torch.distributed.tensor import zeros

    mesh, placements = layout
    return zeros(shape, dtype=dtype, device_mesh=mesh, placements=placements)


def replicated_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t``, a tensor an op wrapper builds itself (the grid RoPE constants),
    as a replicated DTensor on ``like``'s mesh when ``like`` is a DTensor."""
    layout = layout_of(like)
    if layout is None:
        return t
    from torch.distributed.tensor import DTensor, Replicate

    mesh = layout[0]
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


# ---------------------------------------------------------------- sequence-parallel attention


def sequence_parallel(attend: Callable, q, k, v, seq_dim: int):
    """``attend(q, k, v) -> (out, lse)`` (or ``-> out``: 8-bit attention) for q/k/v sharded on the sequence, without
    gathering them: the DeepSpeed-Ulysses exchange. One all-to-all each moves
    q, k and v from sequence shards to head shards (every rank then holds whole
    sequences for its heads, which attention's rule runs locally), and one
    each moves out and lse back to sequence shards. Other calls, and sequence-
    sharded ones that cannot switch (a head count that does not divide by the
    ranks, k/v laid out unlike q, heads already sharded), run ``attend`` as
    they are; DTensor then gathers what the rule needs.

    Args:
        attend: the attention op, options bound.
        q, k, v: ``[B, H, L, D]`` (``seq_dim=2``) or ``[B, L, H, D]`` (``seq_dim=1``).
        seq_dim: 1 or 2.
    """
    layout = layout_of(q)
    if layout is None or seq_dim not in (1, 2) or q.ndim != 4 or any(layout_of(t) != layout for t in (k, v)):
        return attend(q, k, v)
    from torch.distributed.tensor import Shard

    mesh, placements = layout
    heads_dim = 3 - seq_dim
    over = [i for i, p in enumerate(placements) if p == Shard(seq_dim)]
    ranks = 1
    for i in over:
        ranks *= mesh.size(i)
    if not over or Shard(heads_dim) in placements or q.shape[heads_dim] % ranks or k.shape[heads_dim] % ranks:
        return attend(q, k, v)

    by_heads = [Shard(heads_dim) if i in over else p for i, p in enumerate(placements)]
    result = attend(*(t.redistribute(mesh, by_heads) for t in (q, k, v)))
    if not isinstance(result, tuple):
        return result.redistribute(mesh, placements)
    out, lse = result
    # lse is [B, H, L] in both layouts: its sequence is dim 2.
    lse_by_sequence = [Shard(2) if i in over else p for i, p in enumerate(lse.placements)]
    return out.redistribute(mesh, placements), lse.redistribute(mesh, lse_by_sequence)
