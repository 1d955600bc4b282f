"""Pure-PyTorch block-sparse attention and block-list conversion: the
implementation off-GPU and the test oracle.

Block-sparse attention is dense attention (``reference.attention``) with a
token mask expanded from the block lists; the lists' form is described in
``meta/block_sparse.py``.
"""

from typing import Optional

import torch

from compile_ops.meta.attention import SPARSE_BLOCK, dims
from compile_ops.reference import attention as dense


def ascending(index: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Each row's first ``count`` entries sorted ascending (the attention
    kernels' order: the listed tiles that need a mask are then one run, as in
    the dense loop); entries past the count become the dtype's largest value.
    ``index [B1, H1, NQ, W]``, ``count [B1, H1, NQ]``; contiguous out."""
    slots = torch.arange(index.shape[-1], device=index.device)
    unused = torch.iinfo(index.dtype).max
    return torch.where(slots < count.unsqueeze(-1), index, unused).sort(-1).values.contiguous()


def block_mask_from_lists(block_index: torch.Tensor, block_count: torch.Tensor, num_key_blocks: int) -> torch.Tensor:
    """``[B, H, NQ, NK]`` bool: the listed blocks (the inverse of ``block_index_from_mask``)."""
    width = block_index.shape[-1]
    # unsqueeze and narrow rather than [..., None] and [..., :n]: the Triton
    # branch runs this, and Ellipsis indexing cannot be fake-traced for CUDA
    # on a CPU-only torch (tests/test_ops_registry.py does).
    listed = torch.arange(width, device=block_index.device) < block_count.unsqueeze(-1)
    # Entries past the count go to a spare column that is cut off.
    target = torch.where(listed, block_index.long(), num_key_blocks)
    mask = torch.zeros((*block_index.shape[:-1], num_key_blocks + 1), dtype=torch.bool, device=block_index.device)
    return mask.scatter(-1, target, True).narrow(-1, 0, num_key_blocks)


def block_index_from_mask(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``mask [..., NQ, NK]`` bool -> ``(index [..., NQ, NK] int32, count [..., NQ] int32)``:
    each row lists its True blocks first, in ascending order."""
    count = mask.sum(-1, dtype=torch.int32)
    # A stable sort of the False flags puts the True blocks first, in order
    # (logical_not: a bool ~ cannot be fake-traced for CUDA on a CPU-only torch).
    index = torch.sort(torch.logical_not(mask).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return index, count


def token_mask(block_index: torch.Tensor, block_count: torch.Tensor, lq: int, lk: int) -> torch.Tensor:
    """``[B, H, Lq, Lk]`` bool: the tokens of the listed blocks."""
    blocks = block_mask_from_lists(block_index, block_count, (lk + SPARSE_BLOCK - 1) // SPARSE_BLOCK)
    tokens = blocks.repeat_interleave(SPARSE_BLOCK, -2).repeat_interleave(SPARSE_BLOCK, -1)
    return tokens[..., :lq, :lk]


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    block_count: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[torch.Tensor] = None,
    precision: str = "exact",
    token_order: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of attention over the tokens of the listed blocks.

    ``token_order [Lq]`` (self-attention): the lists, the key blocks of the
    8-bit quantization and ``kv_lengths`` are over the tokens taken in this
    order (q, k and v permuted by it along the sequence), and the output and
    lse rows are put back at their tokens' places.

    ``precision="exact"``: ``reference.attention.attention`` under the
    blocks' token mask. ``"int8"`` / ``"int8_fp8"``: the dense 8-bit
    specification (``reference.attention.attention_int8`` /
    ``attention_int8_fp8``) step by step, with the same token mask added
    to its visibility mask: q rounded per token; k smoothed by its mean over
    all Lk keys and rounded per block of 128 keys, listed or not (the
    quantization does not depend on the lists, so every listed block's keys
    are what dense 8-bit attention sees); with FP8 P V, v in e4m3 per channel
    over every key, and the online softmax over 128-key tiles, of which the
    unlisted ones, all masked, change nothing. The lse is that of the 8-bit
    scores (``reference.attention.attention_8bit``). A query that sees no
    key gives 0 and an lse of -inf, in every precision."""
    if token_order is not None:
        q, k, v = (t.index_select(seq_dim, token_order) for t in (q, k, v))
        out, lse = block_sparse_attention(
            q, k, v, block_index, block_count, scale, causal, seq_dim, kv_lengths, precision
        )
        return tuple(torch.empty_like(t).index_copy_(d, token_order, t) for t, d in ((out, seq_dim), (lse, 2)))
    allowed = token_mask(block_index, block_count, dims(q, seq_dim)[2], dims(k, seq_dim)[2])
    if precision == "exact":
        return dense.attention(q, k, v, scale, causal, seq_dim, kv_lengths, allowed)
    return dense.attention_8bit(q, k, v, scale, causal, seq_dim, kv_lengths, precision == "int8_fp8", allowed)


def block_sparse_attention_int8_fp8_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    block_count: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[torch.Tensor] = None,
    token_order: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_sparse_attention` with ``precision="int8_fp8"``, its output
    written as the e4m3 rows an FP8 output projection reads: the dense
    ``reference.attention.attention_int8_fp8_rows`` (the rows' scale a bound
    from v's channel scales over every key) under the listed blocks' token
    mask, and with ``token_order`` the rows put back at their tokens' places.
    Returns ``(values [B, Lq, Hq, D] float8_e4m3fn, row_scale [B, Lq] fp32)``."""
    if token_order is not None:
        q, k, v = (t.index_select(seq_dim, token_order) for t in (q, k, v))
        values, row_scale = block_sparse_attention_int8_fp8_rows(
            q, k, v, block_index, block_count, scale, causal, seq_dim, kv_lengths
        )
        codes = values.view(torch.uint8)  # CPU has no e4m3 index_copy
        codes = torch.empty_like(codes).index_copy_(1, token_order, codes)
        return codes.view(values.dtype), torch.empty_like(row_scale).index_copy_(1, token_order, row_scale)
    allowed = token_mask(block_index, block_count, dims(q, seq_dim)[2], dims(k, seq_dim)[2])
    return dense.attention_int8_fp8_rows(q, k, v, scale, causal, seq_dim, kv_lengths, allowed)


def block_sparse_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    block_index: torch.Tensor,
    block_count: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    allowed = token_mask(block_index, block_count, dims(q, seq_dim)[2], dims(k, seq_dim)[2])
    return dense.attention_backward(grad_out, q, k, v, out, lse, scale, causal, seq_dim, kv_lengths, allowed)
