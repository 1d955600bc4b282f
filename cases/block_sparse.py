"""Inputs of the block_sparse family's ops: block_sparse_attention (its exact
and 8-bit precisions) and its backward.

An op's arguments are attention's with the block lists after v: ``(q, k, v,
block_index, block_count, scale, causal, seq_dim, kv_lengths)``, and the
8-bit precisions' ``precision`` after them (and, in one case, its ``token_order``).
"""

import torch

from cases._tensors import int8_dtype, split_heads, tensor
from cases.attention import offset_keys, qkv
from compile_ops import reference


def _banded_lists(n_q_blocks, n_k_blocks, device, batch=1, heads=1, width=None):
    """Block lists where query block i attends to key blocks 0 (a sink), i - 1
    and i + 1 (clipped), ascending, padded to ``width`` with entries past
    the count set to 0."""
    i = torch.arange(n_q_blocks, device=device)[:, None]
    j = torch.arange(n_k_blocks, device=device)[None, :]
    mask = (j == 0) | ((i - j).abs() == 1)
    index, count = reference.block_sparse.block_index_from_mask(mask.expand(batch, heads, -1, -1))
    width = n_k_blocks if width is None else width
    return index[..., :width].contiguous(), count.clamp(max=width).contiguous()


def block_sparse_edges(dtype, device, requires_grad):
    """Lengths past one block, GQA with per-head lists and padded keys, a query
    block that lists nothing, no queries."""
    g = requires_grad
    kv_lengths = torch.tensor([200, 1], dtype=torch.int32, device=device)
    empty_rows = (
        torch.zeros(1, 1, 2, 2, dtype=torch.int32, device=device),
        torch.tensor([[[1, 0]]], dtype=torch.int32, device=device),
    )  # the second query block lists nothing
    return [
        (*qkv(1, 1, 1, 130, 140, 4, 2, dtype, device, g), *_banded_lists(2, 2, device), 0.5, False, 2, None),
        (
            *qkv(2, 2, 1, 150, 260, 8, 1, dtype, device, g),
            *_banded_lists(2, 3, device, 2, 2, width=2),
            0.35,
            True,
            1,
            kv_lengths,
        ),  # GQA, per-head lists
        (*qkv(1, 1, 1, 140, 70, 8, 2, dtype, device, g), *empty_rows, 0.35, False, 2, None),
        (*qkv(1, 2, 2, 0, 4, 8, 2, dtype, device, g), *_banded_lists(0, 1, device), 0.35, False, 2, None),
    ]


def _banded_self_attention(shape, dtype, device, requires_grad, seq_dim):
    """Non-causal self-attention over ``shape [B, L, C]`` split into heads,
    with banded block lists shared by every head."""
    b, length, h, d = split_heads(shape)
    n = (length + 127) // 128
    return (
        *qkv(b, h, h, length, length, d, seq_dim, dtype, device, requires_grad),
        *_banded_lists(n, n, device),
        d**-0.5,
        False,
        seq_dim,
        None,
    )


def make_block_sparse(shape, dtype, device, requires_grad):
    """q, k, v ``[B, H, L, D]`` with banded block lists shared by every head."""
    return _banded_self_attention(shape, dtype, device, requires_grad, 2)


def block_sparse_8bit_edges(precision):
    """``edge_inputs`` of the 8-bit ``precision``: the block-sparse edges in a
    16-bit dtype, keys offset by a per-channel constant (what the smoothing
    removes), no gradient (inference only)."""

    def edges(dtype, device, requires_grad):
        cases = [
            (q, offset_keys(k), *rest, precision)
            for q, k, *rest in block_sparse_edges(int8_dtype(dtype), device, False)
        ]
        # Self-attention in a token order (a layout's tiles) at D = 128: a partial last block, key lengths.
        g = torch.Generator().manual_seed(5)
        q, k, v, index, count, scale, causal, seq_dim, _ = _banded_self_attention(
            (2, 300, 256), int8_dtype(dtype), device, False, 1
        )
        order = torch.randperm(300, generator=g).to(device)
        lengths = torch.tensor([300, 211], dtype=torch.int32, device=device)
        cases.append((q, offset_keys(k), v, index, count, scale, causal, seq_dim, lengths, precision, order))
        return cases

    return edges


def make_block_sparse_8bit(precision):
    """``make_inputs`` of the 8-bit ``precision``: :func:`make_block_sparse`'s
    banded lists on 16-bit q, k, v ``[B, L, H, D]`` (the models' layout), no gradient."""

    def make(shape, dtype, device, requires_grad):
        return (*_banded_self_attention(shape, int8_dtype(dtype), device, False, 1), precision)

    return make


def make_block_sparse_fp8_rows(shape, dtype, device, requires_grad):
    """``make_inputs`` of the FP8-rows op: :func:`make_block_sparse_8bit`'s
    inputs, whose precision (``"int8_fp8"``) the op implies."""
    return make_block_sparse_8bit("int8_fp8")(shape, dtype, device, requires_grad)[:-1]


def block_sparse_fp8_rows_edges(dtype, device, requires_grad):
    """The ``"int8_fp8"`` edges (:func:`block_sparse_8bit_edges`) without the
    precision argument, the token-order case included."""
    return [case[:9] + case[10:] for case in block_sparse_8bit_edges("int8_fp8")(dtype, device, False)]


def block_sparse_backward_edges(dtype, device, requires_grad):
    """:func:`block_sparse_edges` with a gradient and the forward's output and
    log-sum-exp."""
    cases = []
    for q, k, v, index, count, scale, causal, seq_dim, kv_lengths in block_sparse_edges(dtype, device, False):
        out, lse = reference.block_sparse.block_sparse_attention(
            q, k, v, index, count, scale, causal, seq_dim, kv_lengths
        )
        cases.append(
            (tensor(q.shape, dtype, device), q, k, v, out, lse, index, count, scale, causal, seq_dim, kv_lengths)
        )
    return cases
