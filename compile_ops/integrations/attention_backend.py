"""compile_ops as a diffusers attention backend: ``model.set_attention_backend("compile_ops")``.

diffusers' newer attention processors call ``dispatch_attention_fn``, which
looks the backend up in its registry by an ``AttentionBackendName`` member.
:func:`register_diffusers_backend` adds a ``COMPILE_OPS = "compile_ops"``
member to that enum (diffusers has no public way to add one) and registers
:func:`compile_ops_attention` under it, so every diffusers model whose
processors go through the dispatcher can run ``fused.attention``, not only
the five whose processors :func:`compile_ops.patch` replaces (Flux, Wan,
SD3, LTX-Video and HunyuanVideo: ``diffusers.processors.processor_rules``;
those keep their fused q/k-norm and rotary embedding and ignore the backend
setting).

An ``attn_mask`` that is a :class:`~compile_ops.BlockSparseMask` runs
``fused.block_sparse_attention`` over its block lists (the way a FlexAttention
``BlockMask`` selects diffusers' ``flex`` kernel). What the fused ops do not
take (a tensor mask, dropout) goes to torch's SDPA, as diffusers' ``native``
backend runs it. Context parallelism
is not declared: diffusers refuses the backend on a model with a parallel
config, naming the backends that support one.
"""
from __future__ import annotations

import torch

from compile_ops.ops.attention import attention
from compile_ops.ops.block_sparse import BlockSparseMask

#: The name users pass to ``set_attention_backend`` / ``attention_backend``.
BACKEND = "compile_ops"


def compile_ops_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                          scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """diffusers' backend signature: ``query [B, Lq, Hq, D]``, ``key``/``value``
    ``[B, Lk, Hk, D]`` (Hk dividing Hq), ``attn_mask`` broadcastable to
    ``[B, Hq, Lq, Lk]`` (bool or additive), a :class:`BlockSparseMask`
    (block lists over ``ceil(Lq / 128)`` query blocks) or None -> ``[B, Lq, Hq, D]``."""
    if isinstance(attn_mask, BlockSparseMask):
        if dropout_p != 0.0:
            raise ValueError(f"compile_ops attention backend: dropout_p must be 0 with a BlockSparseMask, "
                             f"got {dropout_p}")
        return attn_mask.attend(query, key, value, scale=scale, causal=is_causal, seq_dim=1)
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"compile_ops attention backend: attn_mask must be a tensor, a compile_ops.BlockSparseMask "
                        f"or None, got {type(attn_mask).__name__}")
    if attn_mask is None and dropout_p == 0.0:
        return attention(query, key, value, scale=scale, causal=is_causal, seq_dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (query, key, value)), attn_mask=attn_mask, dropout_p=dropout_p,
        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return out.transpose(1, 2)


def register_diffusers_backend() -> None:
    """Register ``"compile_ops"`` in diffusers' attention dispatch (idempotent;
    :func:`compile_ops.patch` calls it). Needs diffusers 0.35+ (the dispatcher)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    if BACKEND not in AttentionBackendName._value2member_map_:
        member = str.__new__(AttentionBackendName, BACKEND)
        member._name_, member._value_ = BACKEND.upper(), BACKEND
        AttentionBackendName._member_map_[member._name_] = member
        AttentionBackendName._value2member_map_[BACKEND] = member
        AttentionBackendName._member_names_.append(member._name_)
    member = AttentionBackendName(BACKEND)
    if member not in _AttentionBackendRegistry._backends:
        _AttentionBackendRegistry.register(member)(compile_ops_attention)
