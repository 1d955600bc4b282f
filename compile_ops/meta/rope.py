"""Shape, dtype and layout rules of the RoPE family, and its validation (torch only).

x is ``[B, L, H, D]`` (``seq_dim=1``) or ``[B, H, L, D]`` (``seq_dim=2``, SDPA's
and diffusers' ``apply_rotary_emb`` default), any strides. The first
``rotary_dim`` (default D) channels are rotated in pairs, the rest pass through.
cos/sin are ``[L, T]`` or per batch ``[B, L, T]`` with ``T = rotary_dim`` (a
full table, as diffusers builds it: each angle twice) or ``T = rotary_dim / 2``
(one entry per pair). Pairs are ``(i, i + R/2)`` (half-split, diffusers'
``use_real_unbind_dim=-2``) or ``(2i, 2i + 1)`` (``interleaved``, ``-1``: Flux,
CogVideoX, HunyuanVideo).
"""
from typing import Optional

import torch

from compile_ops.meta._validate import check_floating, check_same_device, fail


def rotary_dim_of(op: str, x: torch.Tensor, rotary_dim: Optional[int]):
    d = x.shape[-1]
    if rotary_dim is None:
        if d % 2:
            fail(op, f"x's head dim D={d} is odd; pass an even rotary_dim to rotate part of it")
        return d
    if not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool) or rotary_dim % 2 \
            or not 0 < rotary_dim <= d:
        fail(op, f"rotary_dim must be an even int in [2, D={d}], got {rotary_dim!r}")
    return rotary_dim


def check_rope(op: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_dim: int,
               rotary_dim: Optional[int]) -> tuple[int, bool]:
    """Validate; ``(rotary_dim, half_table)``."""
    check_floating(op, "x", x)
    if x.dim() != 4:
        fail(op, f"x must be [B, L, H, D] or [B, H, L, D] (4 dims), got shape {tuple(x.shape)}")
    if seq_dim not in (1, 2) or isinstance(seq_dim, bool):
        fail(op, f"seq_dim must be 1 ([B, L, H, D]) or 2 ([B, H, L, D]), got {seq_dim!r}")
    r = rotary_dim_of(op, x, rotary_dim)
    length = x.shape[seq_dim]
    for argname, t in (("cos", cos), ("sin", sin)):
        check_floating(op, argname, t)
        check_same_device(op, x, **{argname: t})
        if t.dim() not in (2, 3):
            fail(op, f"{argname} must be [L, T] or [B, L, T], got shape {tuple(t.shape)}")
        if t.shape[-2] != length:
            fail(op, f"{argname} has {t.shape[-2]} positions but x has L={length} along seq_dim={seq_dim}")
        if t.dim() == 3 and t.shape[0] not in (1, x.shape[0]):
            fail(op, f"{argname} of shape {tuple(t.shape)} is per batch but x has B={x.shape[0]}")
        if t.shape[-1] not in (r, r // 2):
            fail(op, f"{argname} must have rotary_dim={r} (a full table) or {r // 2} (one entry "
                     f"per pair) columns, got {t.shape[-1]}")
    if cos.shape != sin.shape:
        fail(op, f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    return table_layout(x, cos, rotary_dim)


def table_layout(x: torch.Tensor, cos: torch.Tensor, rotary_dim: Optional[int]) -> tuple[int, bool]:
    """``(rotary_dim, half_table)`` of arguments :func:`check_rope` accepted."""
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    return r, cos.shape[-1] == r // 2


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, seq_dim: int,
         rotary_dim: Optional[int] = None, inverse: bool = False) -> torch.Tensor:
    check_rope("rope", x, cos, sin, seq_dim, rotary_dim)
    return x.new_empty(x.shape)
