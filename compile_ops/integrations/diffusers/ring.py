"""The steps of diffusers' ring attention for compile_ops' sparse layouts, 8-bit
precisions and key lengths.

diffusers' ring template (``TemplatedRingAttention``) keeps each rank's query
shard and calls the forward op once per key shard, in the order
``(r + i) % R`` (step i, ring rank r of R), merging the steps' outputs by
their log-sum-exp; its backward visits the shards in the same order. Under
ring x Ulysses (unified) the template runs after Ulysses' all-to-all: diffusers
splits the sequence evenly over the flattened (ring, ulysses) mesh and the
all-to-all gathers one ring rank's U consecutive chunks. Either way ring
shard s is the global token range ``[s * Ls, (s + 1) * Ls)``, Ls the query
length the template hands the op. Each step then needs:

- key lengths: the shard's own, ``clamp(length - s * Ls, 0, Ls)``;
- a sparse layout: the listed blocks that fall in the key shard, renumbered
  from the shard's first block (the shards must be whole 128-token blocks),
  and the layout's token permutation applied shard by shard (it must keep
  each shard's tokens inside the shard); TopK's lists come from the rank's
  queries and every shard's keys (an all-gather of k, once per call);
- 8-bit attention: the kernel smooths k by the mean of the keys it is given
  (the shard's) and its lse is that of the smoothed scores,
  ``lse(scale * q . (k - mean))``; the merge weighs shards by the lse of
  ``scale * q . k``, so ``scale * q . mean`` is added back;
- a row that sees no key in the first step (its own shard) gets a finite lse
  below anything a visible key can give (:func:`floor_empty_rows`) instead of
  -inf: diffusers' merge computes ``-inf - logsigmoid(-inf)`` = NaN for it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from compile_ops.meta._validate import softmax_scale
from compile_ops.meta.attention import SPARSE_BLOCK
from compile_ops.ops.attention import attention
from compile_ops.ops.block_sparse import (
    BlockSparseMask,
    block_index_from_mask,
    block_means,
    block_sparse_attention,
    topk_from_block_means,
)
from compile_ops.reference.block_sparse import block_mask_from_lists

#: How far below the lowest lse a visible key can give the first step's empty
#: rows are put: e**-30 of weight leaves the merge's sigmoid at exactly 1 in fp32.
LSE_FLOOR_MARGIN = 30.0
#: The attribute of a layout that caches its :class:`RingLayout` per (ring degree, ring rank).
_PLANS = "_compile_ops_ring_layouts"


@dataclasses.dataclass
class ShardLists:
    """One ring step's sparse attention: the query shard's token order and
    the key shard's (``[Ls]`` int64 local positions, None: natural order)
    with their inverses, and the block lists over the shard's blocks
    (``block_index [B or 1, H or 1, nb, nb]``, ``block_count [B or 1, H or 1, nb]``)."""

    query_perm: Optional[Tensor]
    query_inverse: Optional[Tensor]
    key_perm: Optional[Tensor]
    key_inverse: Optional[Tensor]
    block_index: Tensor
    block_count: Tensor


@dataclasses.dataclass
class RingLayout:
    """A sparse layout as one ring rank sees it: its query shard, the
    permutation of every shard (``perms``/``inverses``: R local ``[Ls]``
    orders, or None), the lists of each key shard (``lists``, or None for
    TopK's, chosen per call: ``topk``), and whether a query block of the
    shard lists no block of its own shard (``own_rows_empty``)."""

    ring_degree: int
    query_shard: int
    shard_tokens: int
    perms: Optional[list]
    inverses: Optional[list]
    lists: Optional[list]
    topk: object
    own_rows_empty: bool

    def step(self, key_shard: int, topk_mask: Optional[Tensor] = None) -> ShardLists:
        """The lists of the step that holds ``key_shard``; ``topk_mask``
        ``[B, H, nb, R * nb]`` bool: the query shard's rows of TopK's block
        mask (:meth:`topk_rows`), for a TopK layout."""
        if self.lists is not None:
            index, count = self.lists[key_shard]
        else:
            nb = self.shard_tokens // SPARSE_BLOCK
            index, count = block_index_from_mask(topk_mask.narrow(-1, key_shard * nb, nb))
        q_perm, q_inverse = self._order(self.query_shard)
        k_perm, k_inverse = self._order(key_shard)
        return ShardLists(q_perm, q_inverse, k_perm, k_inverse, index, count)

    def permuted(self, tokens: Tensor, shard: int) -> Tensor:
        """``tokens [B, Ls, ...]`` of ``shard`` in the layout's order (natural where it has none)."""
        return tokens if self.perms is None else tokens.index_select(1, self.perms[shard])

    def topk_rows(self, query: Tensor, all_key_means: Tensor) -> Tensor:
        """TopK's block mask rows ``[B, H, nb, R * nb]`` bool of the query
        shard ``query [B, Ls, H, D]`` against the block means of every key
        ``all_key_means [B, H, R * nb, D]`` (:func:`block_means` of each
        shard, in ring order), both in the layout's order (:meth:`permuted`):
        the rows one process chooses (shards are whole blocks, so these are
        the whole sequence's block means)."""
        key_length = self.ring_degree * self.shard_tokens
        scale = softmax_scale("compile_ops.topk_block_index", query, None)  # its default, as one process uses it
        q_means = block_means(query, seq_dim=1)
        index, count = topk_from_block_means(
            q_means, all_key_means, key_length, self.topk.coverage, self.topk.sink_blocks, scale
        )
        return block_mask_from_lists(index, count, index.shape[-1])

    def _order(self, shard: int) -> tuple:
        return (None, None) if self.perms is None else (self.perms[shard], self.inverses[shard])


def layout_parts(layout) -> tuple:
    """``(perm, block_index, block_count, topk)`` of a sparse ``Layout``
    (``compile_ops.integrations.sparse_attention``) or of the attention
    backend's layout of a :class:`BlockSparseMask`."""
    mask = getattr(layout, "mask", None)
    if isinstance(mask, BlockSparseMask):
        return None, mask.block_index, mask.block_count, None
    return layout.perm, layout.index, layout.count, layout.topk


def _refuse_misaligned(owner: str, ring_degree: int, shard_tokens: int, total: Optional[int] = None) -> None:
    total = ring_degree * shard_tokens if total is None else total
    raise ValueError(
        f"{owner}: sparse attention under ring attention needs each ring shard to be whole "
        f"{SPARSE_BLOCK}-token blocks, but the sequence of {total} tokens splits into shards of "
        f"{total / ring_degree:g} tokens under ring_degree={ring_degree}. Use a sequence length "
        f"divisible by {ring_degree * SPARSE_BLOCK}, or ContextParallelConfig(ulysses_degree=...) "
        "(every key on each rank, for a subset of heads)"
    )


def ring_layout(
    layout, ring_degree: int, query_shard: int, shard_tokens: int, owner: str = "compile_ops"
) -> RingLayout:
    """``layout`` (a sparse ``Layout`` or the backend's mask layout, over the
    whole sequence of ``ring_degree * shard_tokens`` tokens) as ring rank
    ``query_shard`` sees it, built once and cached on the layout; raises,
    naming what runs, where the shards are not whole blocks or the layout's
    permutation moves tokens between shards."""
    plans = getattr(layout, _PLANS, None)
    plan = None if plans is None else plans.get((ring_degree, query_shard))
    if plan is None:
        plan = _build(layout, ring_degree, query_shard, shard_tokens, owner)
        if plans is None:
            plans = {}
            object.__setattr__(layout, _PLANS, plans)  # also on frozen dataclasses
        plans[(ring_degree, query_shard)] = plan
    if plan.shard_tokens != shard_tokens:
        _refuse_misaligned(owner, ring_degree, shard_tokens)
    return plan


def _build(layout, ring_degree: int, query_shard: int, shard_tokens: int, owner: str) -> RingLayout:
    perm, index, count, topk = layout_parts(layout)
    total = ring_degree * shard_tokens
    if (
        shard_tokens % SPARSE_BLOCK
        or (perm is not None and perm.numel() != total)
        or (index is not None and index.shape[-2] * SPARSE_BLOCK != total)
    ):
        _refuse_misaligned(owner, ring_degree, shard_tokens, None if perm is None else perm.numel())
    perms = inverses = None
    if perm is not None:
        shards = perm.view(ring_degree, shard_tokens)
        home = torch.arange(ring_degree, device=perm.device).unsqueeze(1)
        if not bool((torch.div(shards, shard_tokens, rounding_mode="floor") == home).all()):
            raise ValueError(
                f"{owner}: the sparse layout's token order (SlidingTile's and TopK's tiles) moves tokens "
                f"between ring shards: under ring_degree={ring_degree} each rank holds {shard_tokens} "
                f"consecutive tokens of the {total}, and a tile crosses a shard's boundary. Use tiles that "
                "stay inside a shard (shards of whole tiles of frames, the tile dividing height and width), "
                "Radial (no reordering), or ContextParallelConfig(ulysses_degree=...) (every key on each rank)"
            )
        perms = list((shards - home * shard_tokens).unbind(0))
        inverses = [torch.argsort(p) for p in perms]
    lists, own_rows_empty = None, topk is not None
    if index is not None:
        nb = shard_tokens // SPARSE_BLOCK
        rows = block_mask_from_lists(index, count, index.shape[-2]).narrow(-2, query_shard * nb, nb)
        lists = [block_index_from_mask(rows.narrow(-1, s * nb, nb)) for s in range(ring_degree)]
        own_rows_empty = bool((lists[query_shard][1] == 0).any())
    return RingLayout(ring_degree, query_shard, shard_tokens, perms, inverses, lists, topk, own_rows_empty)


def shard_lengths(kv_lengths: Tensor, key_shard: int, shard_tokens: int) -> Tensor:
    """The key lengths ``[B]`` (over the whole sequence) as key shard
    ``key_shard`` of ``shard_tokens`` tokens sees them: ``[B]``, in [0, shard_tokens]."""
    return (kv_lengths - key_shard * shard_tokens).clamp(0, shard_tokens).to(kv_lengths.dtype)


def smoothing_shift(query: Tensor, key: Tensor, scale: float) -> Tensor:
    """``scale * q . mean(k)`` ``[B, Hq, Lq]`` fp32 of ``query [B, Lq, Hq, D]``
    and ``key [B, Lk, Hk, D]`` (mean over the Lk keys, Hk dividing Hq): what
    8-bit attention's smoothing took off each score of a row, so its lse plus
    this is the lse of the unsmoothed scores."""
    mean = key.mean(1, dtype=torch.float32).repeat_interleave(query.shape[2] // key.shape[2], 1)
    return scale * (query.float() * mean.unsqueeze(1)).sum(-1).transpose(1, 2)


def _all_blocks(query: Tensor, key: Tensor) -> tuple:
    """Lists naming every key block for every query block: ``[1, 1, NQ, NK]``, ``[1, 1, NQ]``."""
    nq, nk = -(-query.shape[1] // SPARSE_BLOCK), -(-key.shape[1] // SPARSE_BLOCK)
    index = torch.arange(nk, dtype=torch.int32, device=query.device).expand(1, 1, nq, nk)
    return index, torch.full((1, 1, nq), nk, dtype=torch.int32, device=query.device)


def attend_shard(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    scale: float,
    precision: str = "exact",
    lists: Optional[ShardLists] = None,
    kv_lengths: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """One ring step: attention of a query shard to one key shard.

    Args:
        query: ``[B, Lq, H, D]``, the rank's query shard (natural order).
        key, value: ``[B, Lk, Hk, D]``, the step's key shard (natural order).
        scale: the softmax scale.
        precision: ``"exact"``, ``"int8"`` or ``"int8_fp8"`` (inference).
        lists: the step's :class:`ShardLists` (:meth:`RingLayout.step`), or None: dense.
        kv_lengths: ``[B]`` the shard's key lengths (:func:`shard_lengths`), or None.

    Returns:
        ``(out [B, Lq, H, D] in q's dtype, lse [B, Lq, H] fp32)``: the lse of
        ``scale * q . k`` over the visible listed keys (-inf for none).
    """
    if lists is not None and lists.query_perm is not None:
        query = query.index_select(1, lists.query_perm)
    if lists is not None and lists.key_perm is not None:
        key, value = (t.index_select(1, lists.key_perm) for t in (key, value))
    if lists is None and precision == "exact":
        out, lse = attention(query, key, value, scale, seq_dim=1, kv_lengths=kv_lengths, return_lse=True)
    else:
        index, count = _all_blocks(query, key) if lists is None else (lists.block_index, lists.block_count)
        eight_bit = {} if precision == "exact" else dict(precision=precision)
        out, lse = block_sparse_attention(
            query, key, value, index, count, scale, seq_dim=1, kv_lengths=kv_lengths, return_lse=True, **eight_bit
        )
    if precision != "exact":
        lse = lse + smoothing_shift(query, key, scale)
    lse = lse.transpose(1, 2)
    if lists is not None and lists.query_inverse is not None:
        out, lse = (t.index_select(1, lists.query_inverse) for t in (out, lse))
    return out, lse


def floor_empty_rows(lse: Tensor, query: Tensor, key_norm: Tensor, scale: float) -> Tensor:
    """``lse [B, Lq, H]`` with each -inf (a row that saw no key) replaced by
    ``-(scale * |q| * key_norm + LSE_FLOOR_MARGIN)``: below the lse any visible key
    gives the row (each score is at least ``-scale * |q| * |k|``), yet finite,
    so that diffusers' merge adds the next shards without a NaN. ``query
    [B, Lq, H, D]``; ``key_norm``: a bound of every key's norm (a 0-d tensor)."""
    floor = -(scale * torch.linalg.vector_norm(query.float(), dim=-1) * key_norm + LSE_FLOOR_MARGIN)
    return torch.where(torch.isneginf(lse), floor, lse)


def _ring_group(config):
    return config.context_parallel_config._ring_mesh.get_group()


def _wait(tensor: Tensor) -> Tensor:
    wait = getattr(tensor, "wait", None)
    return tensor if wait is None else wait()


def _all_key_means(key: Tensor, config) -> Tensor:
    """Every ring shard's key block means ``[B, H, R * nb, D]`` fp32 in ring order, from
    each rank's ``key [B, Ls, H, D]``: TopK's estimate needs only these, a 64th of
    the keys' bytes (128 tokens of 16 bits a block against one fp32 mean)."""
    from torch.distributed import _functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # the name in older torch
    means = block_means(key, seq_dim=1).contiguous()
    return _wait(gather(means, gather_dim=2, group=_ring_group(config)))


def _key_norm_bound(key: Tensor, config) -> Tensor:
    """The largest key norm over every ring shard (a 0-d fp32 tensor)."""
    from torch.distributed import _functional_collectives as funcol

    local = torch.linalg.vector_norm(key.float(), dim=-1).amax()
    return _wait(funcol.all_reduce(local, "max", group=_ring_group(config)))


@dataclasses.dataclass
class _RingCall:
    """What one ring call's steps share (kept on diffusers' autograd ctx)."""

    config: object
    layout: Optional[RingLayout]
    topk_mask: Optional[Tensor]
    kv_lengths: Optional[Tensor]
    scale: float
    forward_step: int = 0
    backward_step: int = 0

    def step_inputs(self, step: int, shard_tokens: int) -> tuple:
        cp = self.config.context_parallel_config
        shard = (cp._ring_local_rank + step) % cp.ring_degree
        lists = None if self.layout is None else self.layout.step(shard, self.topk_mask)
        lengths = None if self.kv_lengths is None else shard_lengths(self.kv_lengths, shard, shard_tokens)
        return lists, lengths


def forward_step(
    ctx,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    scale: Optional[float],
    config,
    first: bool,
    *,
    precision: str,
    layout,
    kv_lengths: Optional[Tensor],
    owner: str = "compile_ops",
) -> tuple[Tensor, Tensor]:
    """diffusers' ring forward-op step: ``(out [B, Ls, H, D], lse [B, Ls, H]
    fp32)`` of ``query [B, Ls, H, D]`` with the step's ``key``/``value``
    shard. ``first``: the template's first step (its ``_save_ctx``), which
    holds the rank's own shard; later calls are the next steps in ring order.
    ``layout``: a sparse layout over the whole sequence, or None;
    ``kv_lengths [B]``: key lengths over the whole sequence, or None;
    ``config``: the model's ``ParallelConfig``."""
    shard_tokens = query.shape[1]
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if first:
        cp = config.context_parallel_config
        plan = None
        if layout is not None:
            plan = ring_layout(layout, cp.ring_degree, cp._ring_local_rank, shard_tokens, owner)
        topk_mask = None
        if plan is not None and plan.topk is not None:  # the own shard: permute, then gather every shard's key means
            own = plan.query_shard
            topk_mask = plan.topk_rows(plan.permuted(query, own), _all_key_means(plan.permuted(key, own), config))
        ctx.compile_ops_ring = _RingCall(config, plan, topk_mask, kv_lengths, scale)
    else:
        ctx.compile_ops_ring.forward_step += 1
    call = ctx.compile_ops_ring
    lists, lengths = call.step_inputs(call.forward_step, shard_tokens)
    out, lse = attend_shard(query, key, value, scale, precision, lists, lengths)
    if first and (kv_lengths is not None or (call.layout is not None and call.layout.own_rows_empty)):
        lse = floor_empty_rows(lse, query, _key_norm_bound(key, config), scale)
    return out, lse


def backward_step(
    ctx, grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """diffusers' ring backward-op step: ``(dq, dk, dv)`` ``[B, Ls, H, D]`` of
    the step's key shard, from the merged ``out [B, Ls, H, D]`` and ``lse
    [B, Ls, H]`` (exact attention; the template visits the shards in the
    forward's order)."""
    call = ctx.compile_ops_ring
    step = call.backward_step
    call.backward_step = (step + 1) % call.config.context_parallel_config.ring_degree
    lists, lengths = call.step_inputs(step, query.shape[1])
    grad_out, out = grad_out.to(query.dtype), out.to(query.dtype)
    lse = lse.float()
    if lists is None:
        return torch.ops.fused.attention_backward(
            grad_out.contiguous(),
            query,
            key,
            value,
            out,
            lse.transpose(1, 2).contiguous(),
            call.scale,
            False,
            1,
            lengths,
        )
    if lists.query_perm is not None:
        query, grad_out, out, lse = (t.index_select(1, lists.query_perm) for t in (query, grad_out, out, lse))
    if lists.key_perm is not None:
        key, value = (t.index_select(1, lists.key_perm) for t in (key, value))
    dq, dk, dv = torch.ops.fused.block_sparse_attention_backward(
        grad_out.contiguous(),
        query,
        key,
        value,
        out,
        lse.transpose(1, 2).contiguous(),
        lists.block_index,
        lists.block_count,
        call.scale,
        False,
        1,
        lengths,
    )
    if lists.query_inverse is not None:
        dq = dq.index_select(1, lists.query_inverse)
    if lists.key_inverse is not None:
        dk, dv = (t.index_select(1, lists.key_inverse) for t in (dk, dv))
    return dq, dk, dv
