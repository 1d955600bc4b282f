"""Inputs of the attention family's ops: attention, its backward, and the 8-bit modes
(attention_int8, attention_int8_fp8, attention_int8_fp8_rows, attention_qk8).

An op's arguments are ``(q, k, v, scale, causal, seq_dim, kv_lengths)`` (the
8-bit modes' q and k may come quantized); ``make_*(shape, dtype, device,
requires_grad)`` make a row's ``make_inputs`` from an activation shape
``[B, L, C]`` split into heads, ``*_edges`` its ``edge_inputs``.
"""

import torch

from cases._tensors import int8_dtype, split_heads, tensor
from compile_ops import reference


def qkv(b, hq, hk, lq, lk, d, seq_dim, dtype, device, g, scale=1.0):
    """q ``[b, hq, lq, d]``, k and v ``[b, hk, lk, d]`` (``seq_dim`` 2), or with
    the head and sequence dims swapped (``seq_dim`` 1)."""

    def t(h, length):
        shape = (b, h, length, d) if seq_dim == 2 else (b, length, h, d)
        return tensor(shape, dtype, device, g, scale)

    return t(hq, lq), t(hk, lk), t(hk, lk)


def attention_edges(dtype, device, requires_grad):
    """Both layouts, GQA with Lq != Lk and a padded head dim, padded keys, a
    strided q, no queries; small, because gradcheck and opcheck run every edge
    on the reference path."""
    g = requires_grad
    q_view = tensor((1, 4, 2, 8), dtype, device).transpose(1, 2).detach().requires_grad_(g)  # strided [B, H, L, D]
    kv_lengths = torch.tensor([5, 2], dtype=torch.int32, device=device)
    return [
        (*qkv(1, 2, 2, 4, 4, 8, 2, dtype, device, g), 0.35, False, 2, None),
        (*qkv(1, 2, 1, 3, 5, 12, 1, dtype, device, g), 0.3, True, 1, None),  # GQA, Lq != Lk, D padded
        (*qkv(2, 1, 1, 3, 5, 8, 2, dtype, device, g), 0.35, False, 2, kv_lengths),  # padded keys
        (q_view, *qkv(1, 2, 2, 4, 4, 8, 2, dtype, device, g)[1:], 0.35, True, 2, None),
        (*qkv(1, 2, 2, 0, 4, 8, 2, dtype, device, g), 0.35, False, 2, None),  # no queries
    ]


def make_attention(shape, dtype, device, requires_grad):
    """q, k, v ``[B, H, L, D]`` (SDPA's layout), non-causal self-attention."""
    b, length, h, d = split_heads(shape)
    return (*qkv(b, h, h, length, length, d, 2, dtype, device, requires_grad), d**-0.5, False, 2, None)


def attention_int8_edges(dtype, device, requires_grad):
    """The attention edges in a 16-bit dtype, keys offset by a per-channel
    constant (what the smoothing removes), no gradient (inference only)."""
    return [(q, offset_keys(k), *rest) for q, k, *rest in attention_edges(int8_dtype(dtype), device, False)]


def offset_keys(k):
    """k offset by a per-channel constant in its dtype: what 8-bit attention's smoothing removes."""
    return (k + torch.linspace(-3, 3, k.shape[-1], device=k.device).to(k.dtype)).to(k.dtype)


def make_attention_int8(shape, dtype, device, requires_grad):
    """q, k, v ``[B, L, H, D]`` (the models' layout), non-causal self-attention, 16-bit."""
    b, length, h, d = split_heads(shape)
    return (*qkv(b, h, h, length, length, d, 1, int8_dtype(dtype), device, False), d**-0.5, False, 1, None)


def _quantized_qk_args(q, k, v, scale, causal, seq_dim, kv_lengths, pv_fp8, fp8_rows):
    """fused.attention_qk8's arguments: q and k quantized by the specification."""
    return (
        *reference.attention.smooth_quantize_qk(q, k, seq_dim),
        v,
        scale,
        causal,
        seq_dim,
        kv_lengths,
        pv_fp8,
        fp8_rows,
    )


def attention_qk8_edges(dtype, device, requires_grad):
    """The 8-bit edges with q and k quantized, in the three P V / output modes in turn."""
    modes = ((False, False), (True, False), (True, True))
    return [
        _quantized_qk_args(*case, *modes[i % 3]) for i, case in enumerate(attention_int8_edges(dtype, device, False))
    ]


def make_attention_qk8(shape, dtype, device, requires_grad):
    """:func:`make_attention_int8`'s inputs with q and k quantized, FP8 P V."""
    return _quantized_qk_args(*make_attention_int8(shape, dtype, device, False), True, False)


def attention_backward_edges(dtype, device, requires_grad):
    """:func:`attention_edges` with a gradient and the forward's output and
    log-sum-exp."""
    cases = []
    for q, k, v, scale, causal, seq_dim, kv_lengths in attention_edges(dtype, device, False):
        out, lse = reference.attention.attention(q, k, v, scale, causal, seq_dim, kv_lengths)
        cases.append((tensor(q.shape, dtype, device), q, k, v, out, lse, scale, causal, seq_dim, kv_lengths))
    return cases
