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
backend runs it. Context parallelism is declared: under a parallel config
(``model.enable_parallelism``) diffusers passes ``_parallel_config`` and the
call runs through its Ulysses/ring templates with the fused ops on each rank's
share (``integrations/diffusers/context_parallel.py``).
"""

from __future__ import annotations

import dataclasses

import torch

from compile_ops.ops.attention import attention
from compile_ops.ops.block_sparse import BlockSparseMask, block_sparse_attention

#: The name users pass to ``set_attention_backend`` / ``attention_backend``.
BACKEND = "compile_ops"


def compile_ops_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config=None,
):
    """diffusers' backend signature: ``query [B, Lq, Hq, D]``, ``key``/``value``
    ``[B, Lk, Hk, D]`` (Hk dividing Hq), ``attn_mask`` broadcastable to
    ``[B, Hq, Lq, Lk]`` (bool or additive), a :class:`BlockSparseMask`
    (block lists over ``ceil(Lq / 128)`` query blocks) or None -> ``[B, Lq, Hq, D]``,
    and with ``return_lse`` the log-sum-exp ``[B, Lq, Hq]`` fp32 (fused kernels
    only). ``_parallel_config``: diffusers' ``ParallelConfig`` under context
    parallelism (q, k, v are then this rank's sequence shard), else None."""
    sparse = isinstance(attn_mask, BlockSparseMask)
    if sparse and dropout_p != 0.0:
        raise ValueError(f"compile_ops attention backend: dropout_p must be 0 with a BlockSparseMask, got {dropout_p}")
    if attn_mask is not None and not sparse and not isinstance(attn_mask, torch.Tensor):
        raise TypeError(
            f"compile_ops attention backend: attn_mask must be a tensor, a compile_ops.BlockSparseMask "
            f"or None, got {type(attn_mask).__name__}"
        )
    fused = attn_mask is None or sparse
    if return_lse and not (fused and dropout_p == 0.0):
        raise ValueError(
            "compile_ops attention backend: return_lse=True needs the fused kernels: no tensor "
            "attn_mask and dropout_p=0"
        )
    if _parallel_config is not None and getattr(_parallel_config, "context_parallel_config", None) is not None:
        return _context_parallel(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, _parallel_config
        )
    if sparse:
        out = block_sparse_attention(
            query,
            key,
            value,
            attn_mask.block_index,
            attn_mask.block_count,
            scale=scale,
            causal=is_causal,
            seq_dim=1,
            return_lse=return_lse,
        )
    elif fused and dropout_p == 0.0:
        out = attention(query, key, value, scale=scale, causal=is_causal, seq_dim=1, return_lse=return_lse)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (query, key, value)),
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out.transpose(1, 2)
    if return_lse:
        return out[0], out[1].transpose(1, 2)
    return out


@dataclasses.dataclass(frozen=True)
class _MaskLayout:
    """A head-independent :class:`BlockSparseMask` in the shape of a sparse
    ``Layout`` (what :func:`parallel_attention` runs under Ulysses)."""

    mask: BlockSparseMask

    def attend(self, query, key, value, kv_lengths=None, scale=None, precision="exact"):
        return block_sparse_attention(
            query,
            key,
            value,
            self.mask.block_index,
            self.mask.block_count,
            scale=scale,
            seq_dim=1,
            kv_lengths=kv_lengths,
            precision=precision,
        )


def _context_parallel(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, config):
    """:func:`compile_ops_attention` under context parallelism: the fused
    kernels through :func:`parallel_attention`; a tensor mask or dropout
    through diffusers' own SDPA forward/backward ops, as its ``native`` backend."""
    from diffusers.models import attention_dispatch

    from compile_ops.integrations.diffusers.context_parallel import parallel_attention

    if isinstance(attn_mask, torch.Tensor) or dropout_p != 0.0:
        out = attention_dispatch._templated_context_parallel_attention(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            scale,
            enable_gqa,
            return_lse,
            forward_op=attention_dispatch._native_attention_forward_op,
            backward_op=attention_dispatch._native_attention_backward_op,
            _parallel_config=config,
        )
        return out
    if return_lse:
        raise ValueError(
            "compile_ops attention backend: return_lse=True is not offered under context parallelism "
            "(diffusers' templates merge the shards' lse themselves)"
        )
    layout = None
    if attn_mask is not None:
        if attn_mask.block_index.shape[1] != 1:
            raise ValueError(
                "compile_ops attention backend: under context parallelism a BlockSparseMask must be "
                "head-independent (block_index [B or 1, 1, NQ, W]); each rank attends a subset of "
                f"heads, got block_index {tuple(attn_mask.block_index.shape)}"
            )
        layout = _MaskLayout(attn_mask)
    # is_causal: diffusers' templates refuse it under context parallelism.
    return parallel_attention(
        query,
        key,
        value,
        config,
        layout=layout,
        scale=scale,
        causal=is_causal,
        kernel="fused",
        owner="compile_ops attention backend",
    )


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
        _AttentionBackendRegistry.register(member, supports_context_parallel=True)(compile_ops_attention)
    _AttentionBackendRegistry._supports_context_parallel.add(BACKEND)  # a registration by an older compile_ops
