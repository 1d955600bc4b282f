"""Inputs of the rope family's ops: rope, rope_qk, rope_grid, qk_norm_rope (and its
backward) and qk_rope_int8.

``make_<op>(shape, dtype, device, requires_grad)`` is a row's ``make_inputs``:
q/k from an activation shape ``[B, L, C]`` split into heads
(:func:`~cases._tensors.split_heads`); ``<op>_edges(dtype, device,
requires_grad)`` its ``edge_inputs``.
"""

import math

import torch

from cases._tensors import int8_dtype, param, split_heads, tensor
from compile_ops.meta import rope as meta_rope


def _rope_tables(length, t, dtype, device, per_batch=0):
    """Angle tables like diffusers' (fp32 whatever x's dtype, unless fp64)."""
    tdtype = torch.float64 if dtype == torch.float64 else torch.float32
    angles = torch.rand(((per_batch,) if per_batch else ()) + (length, t), device=device, dtype=tdtype) * 6.3
    return angles.cos(), angles.sin()


def rope_edges(dtype, device, requires_grad):
    """rope on x ``[B, H, L, D]`` and ``[B, L, H, D]``: both pair layouts, full
    and half tables, strided x, per-batch tables, partial rotary, zero rows (inverse)."""
    g = requires_grad

    def x(shape):
        return tensor(shape, dtype, device, g)

    bhld = x((2, 3, 5, 16))
    blhd_view = tensor((2, 5, 3, 16), dtype, device).transpose(1, 2).detach().requires_grad_(g)
    return [
        (bhld, *_rope_tables(5, 16, dtype, device), False, 2, None, False),  # half-split, full table
        (bhld, *_rope_tables(5, 8, dtype, device), True, 2, None, False),  # interleaved, half table
        (x((2, 5, 3, 16)), *_rope_tables(5, 16, dtype, device), True, 1, None, False),  # [B, L, H, D]
        (blhd_view, *_rope_tables(5, 16, dtype, device, 2), False, 2, None, False),  # strided, per batch
        (x((1, 2, 7, 24)), *_rope_tables(7, 16, dtype, device), True, 2, 16, False),  # partial rotary
        (x((0, 2, 7, 16)), *_rope_tables(7, 16, dtype, device), False, 2, None, True),  # zero rows, inverse
    ]


def make_rope(shape, dtype, device, requires_grad):
    """x ``[B, H, L, D]``, interleaved with a full table (Flux)."""
    b, length, h, d = split_heads(shape)
    x = tensor((b, h, length, d), dtype, device, requires_grad)
    return (x, *_rope_tables(length, d, dtype, device), True, 2, None, False)


def make_rope_qk(shape, dtype, device, requires_grad):
    """q, k ``[B, L, H, D]`` as a projection makes them (diffusers' attention
    processors rotate them in that layout), half-split with a full table (the
    convention the anchors and Liger's kernel use)."""
    b, length, h, d = split_heads(shape)
    q, k = (tensor((b, length, h, d), dtype, device, requires_grad) for _ in range(2))
    return (q, k, *_rope_tables(length, d, dtype, device), False, 1, None, False)


def rope_qk_edges(dtype, device, requires_grad):
    """rope_qk's cases: fewer k heads than q (GQA), both layouts and pair
    conventions, strided q, partial rotary, zero rows."""
    g = requires_grad

    def x(shape):
        return tensor(shape, dtype, device, g)

    blhd_view = tensor((2, 5, 3, 16), dtype, device).transpose(1, 2).detach().requires_grad_(g)
    return [
        (x((2, 3, 5, 16)), x((2, 1, 5, 16)), *_rope_tables(5, 16, dtype, device), True, 2, None, False),  # GQA
        (x((2, 5, 3, 16)), x((2, 5, 2, 16)), *_rope_tables(5, 8, dtype, device), False, 1, None, False),
        (blhd_view, x((2, 3, 5, 16)), *_rope_tables(5, 16, dtype, device, 2), False, 2, None, True),
        (x((1, 2, 7, 24)), x((1, 2, 7, 24)), *_rope_tables(7, 16, dtype, device), True, 2, 16, False),
        (x((0, 2, 7, 16)), x((0, 2, 7, 16)), *_rope_tables(7, 16, dtype, device), False, 2, None, False),
    ]


def _grid_constants(d, device):
    return meta_rope.grid_rope("wan", d).constants(device)


def _video_grid(length):
    """A (height, width) of a DiT latent that tiles ``length`` tokens: Flux's
    1024x1024 image, Wan's 480p x 81 frames, else one row of gcd(length, 4096)
    tokens per frame (one token for the odd lengths of the compile test, so the
    grid stays the same while the length varies)."""
    return {4608: (64, 72), 32760: (30, 52)}.get(length, (1, math.gcd(length, 4096)))


def make_rope_grid(shape, dtype, device, requires_grad):
    """q, k ``[B, H, L, D]`` with Wan's 3D RoPE."""
    b, length, h, d = split_heads(shape)
    q, k = (tensor((b, h, length, d), dtype, device, requires_grad) for _ in range(2))
    return (q, k, _grid_constants(d, device), *_video_grid(length), True, 2, False)


def rope_grid_edges(dtype, device, requires_grad):
    """rope_grid's cases: Wan's and LTX's grids (LTX's padding pairs), GQA, a
    head dim past the rotated channels."""
    g = requires_grad

    def x(shape):
        return tensor(shape, dtype, device, g)

    ltx = meta_rope.grid_rope("ltx", 16).constants(device)
    return [
        (x((2, 3, 24, 16)), x((2, 1, 24, 16)), _grid_constants(16, device), 3, 4, True, 2, False),
        (x((1, 24, 2, 16)), x((1, 24, 2, 16)), ltx, 2, 3, True, 1, True),  # padding pairs
        (x((1, 2, 12, 20)), x((1, 2, 12, 20)), _grid_constants(16, device), 2, 2, False, 2, False),  # tail
    ]


def make_qk_norm_rope(shape, dtype, device, requires_grad):
    """q, k ``[B, L, H, D]`` as Flux norms them, interleaved, full table."""
    b, length, h, d = split_heads(shape)
    q, k = (tensor((b, length, h, d), dtype, device, requires_grad) for _ in range(2))
    q_w, k_w = (param(d, dtype, device, requires_grad) for _ in range(2))
    return (q, k, q_w, k_w, *_rope_tables(length, d, dtype, device), 1e-6, True, 1, None)


def qk_norm_rope_edges(dtype, device, requires_grad):
    """qk_norm_rope's cases: GQA, strided q with per-batch half tables, partial
    rotary in ``[B, L, H, D]``, zero rows, norms over the heads."""
    g = requires_grad

    def x(shape):
        return tensor(shape, dtype, device, g)

    def w(d):
        return param(d, dtype, device, g)

    blhd_view = tensor((2, 5, 3, 16), dtype, device).transpose(1, 2).detach().requires_grad_(g)
    return [
        (x((2, 3, 5, 16)), x((2, 1, 5, 16)), w(16), w(16), *_rope_tables(5, 16, dtype, device), 1e-6, True, 2, None),
        (blhd_view, x((2, 3, 5, 16)), w(16), w(16), *_rope_tables(5, 8, dtype, device, 2), 1e-5, False, 2, None),
        (x((1, 7, 2, 24)), x((1, 7, 2, 24)), w(24), w(24), *_rope_tables(7, 16, dtype, device), 1e-6, True, 1, 16),
        (x((0, 2, 7, 16)), x((0, 2, 7, 16)), w(16), w(16), *_rope_tables(7, 16, dtype, device), 1e-6, False, 2, None),
        # norms over all heads ([H * D] weights: Wan's); GQA with one k head, whose [D] weight fits either
        (x((1, 6, 3, 16)), x((1, 6, 3, 16)), w(48), w(48), *_rope_tables(6, 16, dtype, device), 1e-6, True, 1, None),
        (x((2, 3, 5, 16)), x((2, 1, 5, 16)), w(48), w(16), *_rope_tables(5, 16, dtype, device), 1e-6, False, 2, None),
    ]


def make_qk_rope_int8(shape, dtype, device, requires_grad):
    """:func:`make_qk_norm_rope`'s q, k in 16 bits (8-bit attention's inputs)."""
    return (*make_qk_norm_rope(shape, int8_dtype(dtype), device, False)[:-4], 1e-6, True, 1, None)


def qk_rope_int8_edges(dtype, device, requires_grad):
    """The qk_norm_rope edges in 16 bits with keys offset per channel (what the
    smoothing removes), and each once more as a plain rotation (no weights)."""
    cases = []
    for q, k, q_w, k_w, *rest in qk_norm_rope_edges(int8_dtype(dtype), device, False):
        k = (k + torch.linspace(-3, 3, k.shape[-1], device=device).to(k.dtype)).to(k.dtype)
        cases += [(q, k, q_w, k_w, *rest), (q, k, None, None, *rest)]
    return cases


def qk_norm_rope_backward_edges(dtype, device, requires_grad):
    """:func:`qk_norm_rope_edges` with gradients of q and k in front."""
    cases = []
    for args in qk_norm_rope_edges(dtype, device, False):
        q, k = args[:2]
        grads = (
            tensor(q.shape, dtype, device),
            tensor(k.shape, dtype, device).transpose(-1, -2).contiguous().transpose(-1, -2),
        )  # a gradient with a non-unit channel stride
        cases.append((*grads, *args))
    return cases
