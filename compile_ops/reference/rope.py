"""Pure-PyTorch RoPE family: the implementation off-GPU and the test oracle.

Computed in fp32 (fp64 for fp64 inputs) and rounded once; the same formula as
diffusers' ``apply_rotary_emb(use_real=True)``: ``x * cos + rotate(x) * sin``.
"""

from typing import Optional

import torch

from compile_ops.meta import rope as meta
from compile_ops.meta._validate import accumulation_dtype
from compile_ops.reference.attention import smooth_quantize_qk


def _pairs(t: torch.Tensor, r: int, interleaved: bool):
    """The first and second members of each rotated pair of ``t[..., :r]``."""
    if interleaved:
        return t[..., 0:r:2], t[..., 1:r:2]
    return t[..., : r // 2], t[..., r // 2 : r]


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


def _rotate(
    xf: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    r: int,
    half: bool,
    interleaved: bool,
    seq_dim: int,
    inverse: bool,
) -> torch.Tensor:
    """The rotation of ``xf`` (already in the accumulation dtype), not rounded."""
    c = _table(cos, r, half, interleaved, seq_dim, xf.dtype)
    s = _table(sin, r, half, interleaved, seq_dim, xf.dtype)
    x1, x2 = _pairs(xf, r, interleaved)
    c1, c2 = _pairs(c, r, interleaved)
    s1, s2 = _pairs(s, r, interleaved)
    if inverse:  # the transpose of the rotation: the backward
        y1, y2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    else:
        y1, y2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    return torch.cat((_merge(y1, y2, interleaved), xf[..., r:]), dim=-1)


def _untable(t: torch.Tensor, like: torch.Tensor, r: int, half: bool, interleaved: bool, seq_dim: int) -> torch.Tensor:
    """The transpose of :func:`_table`: a full-width gradient against x's
    layout summed to the table ``like``'s shape (over heads, over the batch
    of a shared table, over the two entries of a half table's pair)."""
    t = t.sum(3 - seq_dim)
    if half:
        first, second = _pairs(t, r, interleaved)
        t = first + second
    if like.dim() == 2:
        return t.sum(0)
    return t.sum(0, keepdim=True) if like.shape[0] != t.shape[0] else t


def table_grads(
    grad: torch.Tensor,
    xf: torch.Tensor,
    cos: torch.Tensor,
    r: int,
    half: bool,
    interleaved: bool,
    seq_dim: int,
    inverse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of cos and sin through :func:`_rotate` of ``xf`` (in the
    accumulation dtype), in that dtype and cos's shape, given the rotation's
    output gradient ``grad``. The rotation is ``x * c + rotate(x) * s`` with
    ``rotate(x) = (-x2, x1)`` per pair, so ``dc = g * x`` and ``ds = g *
    rotate(x)``; the inverse's sine term is ``rotate^T(x * s)``, so ``ds =
    rotate(g) * x``. Written out rather than differentiated: an op's
    backward runs below autograd."""
    g = grad[..., :r].to(xf.dtype)
    x = xf[..., :r]
    x1, x2 = _pairs(x, r, interleaved)
    g1, g2 = _pairs(g, r, interleaved)
    ds = _merge(-g2 * x1, g1 * x2, interleaved) if inverse else _merge(-g1 * x2, g2 * x1, interleaved)
    return (_untable(g * x, cos, r, half, interleaved, seq_dim), _untable(ds, cos, r, half, interleaved, seq_dim))


def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    seq_dim: int,
    rotary_dim: Optional[int] = None,
    inverse: bool = False,
) -> torch.Tensor:
    r, half = meta.check_rope("rope", x, cos, sin, seq_dim, rotary_dim)
    return _rotate(x.to(accumulation_dtype(x)), cos, sin, r, half, interleaved, seq_dim, inverse).to(x.dtype)


def rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    seq_dim: int,
    rotary_dim: Optional[int] = None,
    inverse: bool = False,
):
    meta.check_qk("rope_qk", q, k, seq_dim)
    return (
        rope(q, cos, sin, interleaved, seq_dim, rotary_dim, inverse),
        rope(k, cos, sin, interleaved, seq_dim, rotary_dim, inverse),
    )


def grid_tables(spec_or_constants, length: int, height: int, width: int, dtype=torch.float64):
    """cos and sin ``[length, P]`` (one entry per pair, a half table for
    :func:`rope`) of a grid RoPE over ``length = frames * height * width``
    tokens, computed in float64 from a :class:`~compile_ops.meta.rope.GridRope`
    or from its ``constants()``."""
    if isinstance(spec_or_constants, meta.GridRope):
        consts = spec_or_constants.constants()
    else:
        consts = spec_or_constants.detach()  # stays on its device: CUDA-graph capturable
    c = consts.double()
    slope, intercept, axis = c[0] + c[1] + c[2], c[3] + c[4], c[5].long()
    token = torch.arange(length, dtype=torch.int64, device=c.device)
    frame_size = height * width
    idx = torch.stack((token // frame_size, (token % frame_size) // width, token % width), dim=-1)
    pos = idx[:, axis.clamp(min=0)].double()  # [length, P]
    angle = torch.where(axis >= 0, pos * slope + intercept, torch.zeros((), dtype=torch.float64, device=c.device))
    return angle.cos().to(dtype), angle.sin().to(dtype)


def rope_grid(
    q: torch.Tensor,
    k: torch.Tensor,
    constants: torch.Tensor,
    height: int,
    width: int,
    interleaved: bool,
    seq_dim: int,
    inverse: bool = False,
):
    meta.check_qk("rope_grid", q, k, seq_dim)
    r = meta.check_grid("rope_grid", q, constants, height, width, seq_dim)
    cos, sin = grid_tables(constants, q.shape[seq_dim], height, width)
    return rope_qk(q, k, cos, sin, interleaved, seq_dim, r, inverse)


def _norm_dims(x: torch.Tensor, weight: torch.Tensor, seq_dim: int) -> tuple:
    """``(dims the RMSNorm reduces over, the weight shaped to broadcast)``:
    the head dim for a ``[D]`` weight, heads and head dim for ``[H * D]``."""
    if not meta.norm_spans_heads(weight, x):
        return (-1,), weight
    h_dim = 3 - seq_dim
    return (h_dim, 3), weight.reshape(x.shape[h_dim], *([1] * (2 - h_dim)), x.shape[3])


def _rstd_xhat(x: torch.Tensor, dims: tuple, eps: float) -> tuple:
    xf = x.to(accumulation_dtype(x))
    rstd = torch.rsqrt(xf.square().mean(dims, keepdim=True) + eps)
    return rstd, xf * rstd


def normalized(x: torch.Tensor, weight: torch.Tensor, eps: float, seq_dim: int) -> torch.Tensor:
    """RMSNorm with weight of ``x`` over each head (``[D]`` weight) or over
    all heads of a position (``[H * D]``), in the accumulation dtype, not
    rounded: what :func:`qk_norm_rope` rotates."""
    dims, w = _norm_dims(x, weight, seq_dim)
    xhat = _rstd_xhat(x, dims, eps)[1]
    return xhat * w.to(xhat.dtype)


def _norm_rope(x, weight, cos, sin, eps, r, half, interleaved, seq_dim):
    return _rotate(normalized(x, weight, eps, seq_dim), cos, sin, r, half, interleaved, seq_dim, False).to(x.dtype)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    interleaved: bool,
    seq_dim: int,
    rotary_dim: Optional[int] = None,
):
    """RMSNorm with weight (per head, or over all heads of a position for
    ``[H * D]`` weights), then RoPE, in fp32 and rounded once."""
    meta.qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, interleaved, seq_dim, rotary_dim)
    r, half = meta.table_layout(q, cos, rotary_dim)
    return (
        _norm_rope(q, q_weight, cos, sin, eps, r, half, interleaved, seq_dim),
        _norm_rope(k, k_weight, cos, sin, eps, r, half, interleaved, seq_dim),
    )


def qk_rope_int8(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: Optional[torch.Tensor],
    k_weight: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    interleaved: bool,
    seq_dim: int,
    rotary_dim: Optional[int] = None,
) -> tuple:
    """8-bit attention's q and k straight from the projections: :func:`qk_norm_rope`
    (weights given) or :func:`rope_qk` (both None), rounded to q's dtype as
    those ops return it, then ``reference.attention.smooth_quantize_qk``
    (k less its mean over the sequence; q INT8 per token, k per block of
    128 keys). Exactly the composition of the two ops."""
    meta.qk_rope_int8(q, k, q_weight, k_weight, cos, sin, eps, interleaved, seq_dim, rotary_dim)
    if q_weight is None:
        q, k = rope_qk(q, k, cos, sin, interleaved, seq_dim, rotary_dim)
    else:
        q, k = qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, interleaved, seq_dim, rotary_dim)
    return smooth_quantize_qk(q, k, seq_dim)


def qk_norm_rope_backward(
    grad_q,
    grad_k,
    q,
    k,
    q_weight,
    k_weight,
    cos,
    sin,
    eps: float,
    interleaved: bool,
    seq_dim: int,
    rotary_dim: Optional[int] = None,
):
    """Gradients of :func:`qk_norm_rope`, written out (an op's implementation runs
    below autograd): dz = rotation^T(dy); dw = sum over rows of dz * xhat;
    dx = rstd * (w dz - xhat * mean(w dz * xhat))."""
    meta.qk_norm_rope_backward(
        grad_q, grad_k, q, k, q_weight, k_weight, cos, sin, eps, interleaved, seq_dim, rotary_dim
    )
    r, half = meta.table_layout(q, cos, rotary_dim)
    grads = []
    for g, x, w in ((grad_q, q, q_weight), (grad_k, k, k_weight)):
        dims, w_shaped = _norm_dims(x, w, seq_dim)
        rstd, xhat = _rstd_xhat(x, dims, eps)
        dz = _rotate(g.to(xhat.dtype), cos, sin, r, half, interleaved, seq_dim, True)
        wdz = dz * w_shaped.to(xhat.dtype)
        dx = rstd * (wdz - xhat * (wdz * xhat).mean(dims, keepdim=True))
        # dw: dz * xhat summed over every dim the weight does not have.
        dw = (dz * xhat).sum([d for d in range(4) if d not in [dd % 4 for dd in dims]]).reshape(w.shape)
        grads.append((dx.to(x.dtype), dw.to(w.dtype)))
    (dq, dq_weight), (dk, dk_weight) = grads
    return dq, dk, dq_weight, dk_weight
