"""Pure-PyTorch RoPE family: the implementation off-GPU and the test oracle.

Computed in fp32 (fp64 for fp64 inputs) and rounded once; the same formula as
diffusers' ``apply_rotary_emb(use_real=True)``: ``x * cos + rotate(x) * sin``.
"""
from typing import Optional

import torch

from compile_ops.meta import rope as meta


def _pairs(t: torch.Tensor, r: int, interleaved: bool):
    """The first and second members of each rotated pair of ``t[..., :r]``."""
    if interleaved:
        return t[..., 0:r:2], t[..., 1:r:2]
    return t[..., : r // 2], t[..., r // 2: r]


def _merge(first: torch.Tensor, second: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack((first, second), dim=-1).flatten(-2)
    return torch.cat((first, second), dim=-1)


def _table(t: torch.Tensor, r: int, half: bool, interleaved: bool, seq_dim: int, acc) -> torch.Tensor:
    """cos or sin as a full-width ``[B', L, r]`` table placed against x's layout."""
    t = t.to(acc)
    if half:
        t = _merge(t, t, interleaved)
    if t.dim() == 2:
        t = t[None]
    return t[:, :, None, :] if seq_dim == 1 else t[:, None, :, :]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, seq_dim: int,
         rotary_dim: Optional[int] = None, inverse: bool = False) -> torch.Tensor:
    r, half = meta.check_rope("rope", x, cos, sin, seq_dim, rotary_dim)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = _table(cos, r, half, interleaved, seq_dim, acc)
    s = _table(sin, r, half, interleaved, seq_dim, acc)
    xf = x.to(acc)
    x1, x2 = _pairs(xf, r, interleaved)
    c1, c2 = _pairs(c, r, interleaved)
    s1, s2 = _pairs(s, r, interleaved)
    if inverse:  # the transpose of the rotation: the backward
        y1, y2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    else:
        y1, y2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    return torch.cat((_merge(y1, y2, interleaved), xf[..., r:]), dim=-1).to(x.dtype)
