"""compile_ops attention under diffusers' context parallelism (``model.enable_parallelism``).

diffusers runs context-parallel attention through templates that take a
backend's forward and backward ops: Ulysses (an all-to-all trades sequence
shards for head shards, then each rank attends over the whole sequence on its
heads), ring (each rank keeps its query shard and visits every rank's key
shard, merging the partial outputs by their log-sum-exp) and the two at once
(unified). :func:`parallel_attention` hands those templates forward/backward
ops that run the fused kernels, so a patched processor keeps its kernel choice
under a parallel config:

- exact attention: ``fused.attention`` (the Hopper core on sm_90), or SDPA
  where ``attention_kernel`` picks it and no log-sum-exp is needed; the lse
  the ring merge needs and ``fused.attention_backward`` for training;
- the 8-bit precisions and sparse layouts under Ulysses: each rank holds every
  token of its heads, so they apply unchanged (sparse layouts are
  head-independent). Under ring (and unified) a rank sees one key shard at a
  time: :mod:`.ring` gives each step its slice of the block lists and key
  lengths and the lse of the unsmoothed 8-bit scores.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from compile_ops.integrations.diffusers import ring
from compile_ops.integrations.diffusers.attention_kernel import needs_gradient, sdpa_is_faster
from compile_ops.integrations.diffusers.ulysses import ulysses_attention
from compile_ops.ops.attention import attention


def context_parallel(config) -> Optional[object]:
    """The ``ContextParallelConfig`` of a processor's ``_parallel_config``
    (diffusers' ``ParallelConfig``), or None: no parallel config, or tensor
    parallelism only."""
    return None if config is None else getattr(config, "context_parallel_config", None)


def parallel_path(config) -> str:
    """How attention is split across ranks under ``config`` (a ``ParallelConfig`` or None), in words."""
    cp = context_parallel(config)
    if cp is None:
        return "one rank"
    parts = [f"Ulysses-{cp.ulysses_degree}"] if cp.ulysses_degree > 1 else []
    parts += [f"ring-{cp.ring_degree}"] if cp.ring_degree > 1 else []
    return " x ".join(parts) or "one rank"


def check_parallel_mode(
    config, precision: str, sparse: bool, kv_lengths: bool, owner: str, replicated_text: bool = False
) -> None:
    """Raise unless attention in ``precision`` (and a ``sparse`` layout, key
    lengths) can run under ``config``'s context parallelism. Every mode runs
    under Ulysses and ring; a sparse layout and key lengths need each ring
    shard's place in the sequence, which ``ring_anything``'s uneven shards do
    not give. (Layouts whose shards are not whole blocks, or whose token order
    crosses shards, are refused by :func:`.ring.ring_layout`.) A layer whose
    text every rank holds whole (``replicated_text``: HunyuanVideo under
    compile_ops' plan) runs under even Ulysses only: ring, and the uneven
    exchange of ``ulysses_anything``, would send the text's keys once a rank."""
    cp = context_parallel(config)
    if cp is not None and replicated_text and (cp.ring_degree > 1 or cp.ulysses_anything):
        what = "ring attention" if cp.ring_degree > 1 else "ContextParallelConfig(ulysses_anything=True)"
        raise ValueError(
            f"{owner}: {what} cannot run this model's attention: every rank holds the whole text "
            "(compile_ops' context-parallel plan shards the video tokens only), which it would send once "
            "a rank. Use ContextParallelConfig(ulysses_degree=...) with a video token count divisible by it"
        )
    if cp is None or cp.ring_degree <= 1 or not cp.ring_anything:
        return
    wanted = ["a sparse attention= layout"] if sparse else []
    wanted += ["a text padding mask"] if kv_lengths else []
    if wanted:
        raise ValueError(
            f"{owner}: {' and '.join(wanted)} cannot run under ContextParallelConfig(ring_anything=True): "
            "its shards have uneven lengths, so a shard's place in the sequence (which blocks and keys "
            "it holds) is not known. Use ring_anything=False with a sequence length divisible by the "
            "parallel degree (sparse layouts: by 128 x ring_degree), or ContextParallelConfig(ulysses_degree=...)"
        )


def parallel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    config,
    *,
    precision: str = "exact",
    layout=None,
    kv_lengths: Optional[Tensor] = None,
    scale: Optional[float] = None,
    causal: bool = False,
    kernel: str = "auto",
    owner: str = "compile_ops",
    replicated_tail: int = 0,
) -> Tensor:
    """Attention of this rank's shard under diffusers' context parallelism.

    Args:
        query, key, value: ``[B, L_local, H, D]``, this rank's sequence shard
            (``L_local`` = the whole sequence / the parallel degree); H divides
            by the Ulysses degree.
        config: the model's diffusers ``ParallelConfig`` with a context-parallel config.
        precision: ``"exact"``, ``"int8"`` or ``"int8_fp8"`` (inference).
        layout: a sparse ``Layout`` (``compile_ops.integrations.sparse_attention``)
            over the whole sequence, or None.
        kv_lengths: ``[B]`` key lengths over the whole sequence, or None.
        scale: the softmax scale; None: ``1 / sqrt(D)``.
        causal: passed on to diffusers' templates (which refuse it).
        kernel: ``patch(attention_kernel=...)``: where exact attention needs no
            log-sum-exp and no gradient, "auto" or "sdpa" may run SDPA.
        owner: the caller, for error messages.
        replicated_tail: tokens at the end of q, k, v that every rank holds
            whole (not sharded; Ulysses only): they join the sequence once.

    Returns:
        ``[B, L_local, H, D]`` in q's dtype.
    """
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    check_parallel_mode(config, precision, layout is not None, kv_lengths is not None, owner, replicated_tail > 0)
    # Decided here: inside diffusers' autograd function q, k and v do not require grad, and a
    # call that will be differentiated keeps the fused kernel, whose lse the fused backward reads.
    kernel = "fused" if needs_gradient(query, key, value) else kernel
    forward_op = functools.partial(
        _forward_op, precision=precision, layout=layout, kv_lengths=kv_lengths, kernel=kernel, owner=owner
    )
    cp = context_parallel(config)
    if cp.ring_degree == 1 and not cp.ulysses_anything and query.shape == key.shape == value.shape:
        # Ulysses alone, even shards: our exchange (one all-to-all for q, k and v; see .ulysses),
        # with autograd through the collectives and the fused op's own backward. Uneven shards
        # (ulysses_anything) take diffusers' template, which exchanges their sizes first.
        return ulysses_attention(
            query,
            key,
            value,
            cp._ulysses_mesh.get_group(),
            cp.ulysses_degree,
            lambda q, k, v: forward_op(None, q, k, v, None, 0.0, causal, scale, False, False, _save_ctx=False),
            replicated_tail,
            cp._ulysses_mesh.get_local_rank() if replicated_tail else 0,
        )
    return _templated_context_parallel_attention(
        query,
        key,
        value,
        None,
        0.0,
        causal,
        scale,
        False,
        False,
        forward_op=forward_op,
        backward_op=_backward_op,
        _parallel_config=config,
    )


def _forward_op(
    ctx,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask,
    dropout_p: float,
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    return_lse: bool,
    _save_ctx: bool = True,
    _parallel_config=None,
    *,
    precision: str,
    layout,
    kv_lengths: Optional[Tensor],
    kernel: str,
    owner: str = "compile_ops",
):
    """diffusers' forward-op contract: ``[B, L, H, D]`` q, k, v (a rank's share
    after Ulysses' all-to-all, or one ring step's key shard) -> out, and with
    ``return_lse`` the lse ``[B, L, H]`` fp32; saves what :func:`_backward_op` reads."""
    lse = None
    if _ring_step(_parallel_config, precision, layout, kv_lengths):
        out, lse = ring.forward_step(
            ctx,
            query,
            key,
            value,
            scale,
            _parallel_config,
            _save_ctx,
            precision=precision,
            layout=layout,
            kv_lengths=kv_lengths,
            owner=owner,
        )
    elif layout is not None:
        out = layout.attend(query, key, value, kv_lengths, scale, precision)
    elif precision != "exact":
        out = attention(query, key, value, scale, is_causal, seq_dim=1, kv_lengths=kv_lengths, precision=precision)
    elif (
        not return_lse
        and kv_lengths is None  # key lengths stay on the fused kernel, which takes them without a mask
        and (kernel == "sdpa" or (kernel == "auto" and sdpa_is_faster(query, key, value)))
    ):
        out = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (query, key, value)), is_causal=is_causal, scale=scale
        ).transpose(1, 2)
    else:
        out, lse = attention(query, key, value, scale, is_causal, seq_dim=1, kv_lengths=kv_lengths, return_lse=True)
        lse = lse.transpose(1, 2)
    if _save_ctx:
        ctx.save_for_backward(query, key, value, out, lse, kv_lengths)
        ctx.compile_ops_mode = (precision, layout, is_causal, scale)
    return (out, lse) if return_lse else out


def _ring_step(config, precision: str, layout, kv_lengths) -> bool:
    """Whether a ring step (``config`` with ring_degree > 1) needs :mod:`.ring`:
    8-bit, sparse or with key lengths (exact dense steps run as one call)."""
    cp = context_parallel(config)
    return (
        cp is not None and cp.ring_degree > 1 and (precision != "exact" or layout is not None or kv_lengths is not None)
    )


def _backward_op(
    ctx,
    grad_out: Tensor,
    *args,
    query: Optional[Tensor] = None,
    key: Optional[Tensor] = None,
    value: Optional[Tensor] = None,
    out: Optional[Tensor] = None,
    lse: Optional[Tensor] = None,
    **kwargs,
):
    """diffusers' backward-op contract: ``(dq, dk, dv)`` ``[B, L, H, D]`` of the
    saved call, or of the q/k/v/out/lse a ring step passes (the merged output
    and lse of the whole ring with that step's key shard)."""
    saved_query, saved_key, saved_value, saved_out, saved_lse, kv_lengths = ctx.saved_tensors
    precision, layout, is_causal, scale = ctx.compile_ops_mode
    query, key, value = (
        s if t is None else t for s, t in ((saved_query, query), (saved_key, key), (saved_value, value))
    )
    out, lse = saved_out if out is None else out, saved_lse if lse is None else lse
    if precision != "exact":
        raise RuntimeError(
            f"compile_ops attention: attention_precision={precision!r} is inference only and has no "
            "gradient; patch with attention_precision='exact' to train"
        )
    if _ring_step(getattr(ctx, "_parallel_config", None), precision, layout, kv_lengths):
        return ring.backward_step(ctx, grad_out, query, key, value, out, lse)
    if layout is not None or lse is None:
        # Sparse layouts, and calls that ran SDPA: recompute with autograd (the forward saved no lse).
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (query, key, value)]
            if layout is not None:
                again = layout.attend(*inputs, kv_lengths, scale)
            else:
                again = torch.nn.functional.scaled_dot_product_attention(
                    *(t.transpose(1, 2) for t in inputs), is_causal=is_causal, scale=scale
                ).transpose(1, 2)
            return torch.autograd.grad(again, inputs, grad_out)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    lse = lse.float().transpose(1, 2).contiguous()
    return torch.ops.fused.attention_backward(
        grad_out.to(query.dtype).contiguous(),
        query,
        key,
        value,
        out.to(query.dtype),
        lse,
        scale,
        is_causal,
        1,
        kv_lengths,
    )
