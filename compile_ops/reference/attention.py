"""Pure-PyTorch attention: the implementation off-GPU and the test oracle.

Materializes the ``[Lq, Lk]`` scores (the kernels never do), in fp32 (fp64 for
fp64 inputs). The backward is written out (references run below autograd).
Causal masking is SDPA's ``is_causal``: query i sees keys ``j <= i`` (top-left
aligned when Lq != Lk). A query row with no visible key gives 0 and an lse of
-inf.
"""

from typing import Optional

import torch

from compile_ops.meta._validate import accumulation_dtype
from compile_ops.meta.attention import INT8_KEY_BLOCK
from compile_ops.reference.fp8 import AMAX_FLOOR


def _bhld(t: torch.Tensor, seq_dim: int, acc) -> torch.Tensor:
    return (t if seq_dim == 2 else t.transpose(1, 2)).to(acc)


def _heads_of_q(t: torch.Tensor, hq: int) -> torch.Tensor:
    """k or v ``[B, Hk, L, D]`` repeated to q's ``Hq`` heads (GQA)."""
    return t.repeat_interleave(hq // t.shape[1], dim=1)


def visible(lq: int, lk: int, causal: bool, kv_lengths: Optional[torch.Tensor], batch: int, device) -> torch.Tensor:
    """``[B, 1, Lq, Lk]`` bool: which keys each query attends to."""
    keys = torch.arange(lk, device=device)
    mask = torch.ones(batch, 1, lq, lk, dtype=torch.bool, device=device)
    if kv_lengths is not None:
        mask = mask & (keys[None, :] < kv_lengths.to(device)[:, None])[:, None, None, :]
    if causal:
        mask = mask & (keys[None, :] <= torch.arange(lq, device=device)[:, None])
    return mask


def _probabilities(q, k, scale, causal, kv_lengths, allowed, lse=None):
    """``(p, lse)`` of ``[B, H, Lq, D]`` q and GQA-expanded k, with empty rows
    0 / -inf; ``allowed`` (block-sparse attention's token mask, broadcastable
    to ``[B, H, Lq, Lk]``) or None. A given ``lse [B, H, Lq]`` normalizes the
    rows instead of their own: the backward's contract, where the lse may span
    more keys than k holds (ring attention's merged lse with one key shard)."""
    s = q @ k.transpose(-1, -2) * scale
    mask = visible(q.shape[2], k.shape[2], causal, kv_lengths, q.shape[0], q.device)
    if allowed is not None:
        mask = mask & allowed
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1) if lse is None else lse.to(s.dtype)
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0)[..., None])
    return p, lse


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[torch.Tensor] = None,
    allowed: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``; ``allowed``: an extra token mask (block-sparse attention)."""
    acc = accumulation_dtype(q)
    qf, kf, vf = (_bhld(t, seq_dim, acc) for t in (q, k, v))
    hq = qf.shape[1]
    p, lse = _probabilities(qf, _heads_of_q(kf, hq), scale, causal, kv_lengths, allowed)
    out = p @ _heads_of_q(vf, hq)
    out = out if seq_dim == 2 else out.transpose(1, 2)
    # The lse is a statistic for the backward, not differentiable (as the op declares).
    return out.to(q.dtype), lse.detach()


def attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[torch.Tensor] = None,
    allowed: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dv = P^T dO``, ``dS = P (dO V^T - rowsum(dO O))``, ``dq = scale dS K``,
    ``dk = scale dS^T Q``; k and v gradients summed over their q heads."""
    acc = accumulation_dtype(q)
    qf, kf, vf, do, o = (_bhld(t, seq_dim, acc) for t in (q, k, v, grad_out, out))
    hq, hk = qf.shape[1], kf.shape[1]
    ke, ve = _heads_of_q(kf, hq), _heads_of_q(vf, hq)
    p, _ = _probabilities(qf, ke, scale, causal, kv_lengths, allowed, lse)
    delta = (do * o).sum(-1, keepdim=True)
    ds = p * (do @ ve.transpose(-1, -2) - delta)
    dq = ds @ ke * scale
    dk = (ds.transpose(-1, -2) @ qf * scale).unflatten(1, (hk, hq // hk)).sum(2)
    dv = (p.transpose(-1, -2) @ do).unflatten(1, (hk, hq // hk)).sum(2)

    def back(t, like):
        return (t if seq_dim == 2 else t.transpose(1, 2)).to(like.dtype)

    return back(dq, q), back(dk, k), back(dv, v)


# ---------------------------------------------------------------- 8-bit attention (inference)

#: The largest INT8 magnitude a quantized q or k value takes (symmetric: -127..127).
INT8_MAX = 127.0


def quantize_int8(x: torch.Tensor, block: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 of ``x [B, H, L, D]`` (fp32) with one scale per ``block``
    consecutive positions (1: per token): ``scale = amax / 127`` over the block's
    rows (:func:`quantization_scale`: an all-zero block's values stay 0),
    ``q = round_half_even(x * (1 / scale))`` clamped to [-127, 127]. Returns
    ``(q int8 [B, H, L, D], scale fp32 [B, H, ceil(L / block)])``."""
    b, h, length, _ = x.shape
    amax = x.abs().amax(-1)
    if block > 1:  # whole blocks, then the partial last one
        whole = length // block * block
        parts = [_dense(amax.narrow(-1, 0, whole)).view(b, h, whole // block, block).amax(-1)]
        if whole < length:
            parts.append(amax.narrow(-1, whole, length - whole).amax(-1, keepdim=True))
        amax = torch.cat(parts, dim=-1)
    scale, inverse = quantization_scale(amax, INT8_MAX)
    q = torch.round(x * _per_row(inverse, block, length).unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantization_scale(amax: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit operands' scale for a block's (or channel's) largest
    magnitude ``amax`` (fp32), and its reciprocal: ``scale = max(amax / top,
    tiny)`` (fp32's smallest normal: an all-zero block keeps its zeros, and
    ``1 / scale`` stays finite) and ``inverse = 1 / scale``, both correctly
    rounded: tensor-by-tensor divisions are IEEE on CPU and CUDA, while a
    tensor divided by a Python number is, on CUDA, a multiplication by its
    rounded reciprocal (1 ulp off ``amax / 127`` for some rows:
    docs/notes/attention-8bit.md), so ``top`` is made a tensor first. The values are then
    multiplied by ``inverse``, not divided by ``scale``: the kernels do one
    multiplication per value where a correctly rounded division costs a
    dozen instructions (it made the quantizing passes arithmetic-bound)."""
    scale = (amax / torch.full_like(amax, top)).clamp(min=torch.finfo(torch.float32).tiny)
    return scale, torch.ones_like(scale) / scale


def dequantize_int8(q8: torch.Tensor, scale: torch.Tensor, block: int = 1) -> torch.Tensor:
    """fp32 values of :func:`quantize_int8`'s ``(q8 [B, H, L, D], scale)``."""
    return q8.float() * _per_row(scale, block, q8.shape[2]).unsqueeze(-1)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous (a clone, not ``.contiguous()`` or a copying reshape,
    which cannot be fake-traced for CUDA on a CPU-only torch build; for the
    same reason this family slices with ``narrow``, not ``t[..., :n]``)."""
    return t.clone(memory_format=torch.contiguous_format)


def _per_row(scale: torch.Tensor, block: int, length: int) -> torch.Tensor:
    """Block scales ``[B, H, blocks]`` repeated for each of the ``length`` rows."""
    repeated = _dense(scale.unsqueeze(-1).expand(*scale.shape, block))
    return repeated.view(*scale.shape[:2], scale.shape[2] * block).narrow(-1, 0, length)


def smooth_quantize_qk(q: torch.Tensor, k: torch.Tensor, seq_dim: int) -> tuple:
    """The quantization of ``precision="int8"`` attention, exactly: k smoothed
    by subtracting its mean over the sequence (all Lk positions, padded keys
    too), per (batch, k head, channel), in fp32 (softmax is blind to it: every
    score of a query moves by the same ``q . mean``); then q quantized per
    token and the smoothed k per block of :data:`INT8_KEY_BLOCK` keys
    (:func:`quantize_int8`). Returns ``(q_int8, q_scale [B, H, Lq], k_int8,
    k_scale [B, Hk, ceil(Lk / INT8_KEY_BLOCK)])``: the int8 tensors in the
    inputs' layout, the scales fp32 contiguous."""
    qf, kf = (t.float() if seq_dim == 2 else t.float().transpose(1, 2) for t in (q, k))  # [B, H, L, D] views
    kf = kf - kf.mean(dim=2, keepdim=True)
    q8, q_scale = quantize_int8(qf)
    k8, k_scale = quantize_int8(kf, INT8_KEY_BLOCK)
    if seq_dim == 1:
        q8, k8 = q8.transpose(1, 2), k8.transpose(1, 2)
    # The kernel indexes the scales as contiguous (a clone: traceable on fake CUDA tensors).
    q_scale, k_scale = (
        s if s.is_contiguous() else s.clone(memory_format=torch.contiguous_format) for s in (q_scale, k_scale)
    )
    return q8, q_scale, k8, k_scale


def attention_int8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """8-bit attention's specification: exact attention (fp32) of the
    dequantized q and smoothed k of :func:`smooth_quantize_qk` with v as it
    is; out in q's dtype and layout. The kernel computes the same scores up
    to fp32 rounding (integer products are exact) and differs from this only
    as the 16-bit kernel differs from :func:`attention`."""
    return attention_qk8(*smooth_quantize_qk(q, k, seq_dim), v, scale, causal, seq_dim, kv_lengths)[0]


def _dequantized_qk(
    q8: torch.Tensor, q_scale: torch.Tensor, k8: torch.Tensor, k_scale: torch.Tensor, seq_dim: int
) -> tuple:
    """fp32 ``[B, H, L, D]`` views of :func:`smooth_quantize_qk`'s q and k."""
    q_hat, k_hat = (t if seq_dim == 2 else t.transpose(1, 2) for t in (q8, k8))
    return dequantize_int8(q_hat, q_scale), dequantize_int8(k_hat, k_scale, INT8_KEY_BLOCK)


def attention_qk8(
    q8: torch.Tensor,
    q_scale: torch.Tensor,
    k8: torch.Tensor,
    k_scale: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[torch.Tensor] = None,
    pv_fp8: bool = False,
    fp8_rows: bool = False,
) -> tuple:
    """8-bit attention from q and k already quantized as
    :func:`smooth_quantize_qk` specifies (``fused.qk_rope_int8`` writes them
    straight from the projections): :func:`attention_int8`'s computation,
    :func:`attention_int8_fp8`'s with ``pv_fp8``, and
    :func:`attention_int8_fp8_rows`'s with ``fp8_rows`` too, on these
    operands. Returns ``(out in q's layout and v's dtype, empty)``, or the
    FP8 rows ``(values [B, Lq, Hq, D], scales [B, Lq])``."""
    no_scale = v.new_empty((0,), dtype=torch.float32)
    out, _, v_scale = _attention_8bit_fp32(q8, q_scale, k8, k_scale, v, scale, causal, seq_dim, kv_lengths, pv_fp8)
    if not fp8_rows:
        return (out if seq_dim == 2 else out.transpose(1, 2)).to(v.dtype), no_scale
    return _fp8_rows(out, v_scale)


def _fp8_rows(out: torch.Tensor, v_scale: torch.Tensor) -> tuple:
    """:func:`attention_int8_fp8_rows`'s rounding of the fp32 ``out [B, Hq, Lq, D]``
    by the bound from v's channel scales ``[B, Hk, D]``: ``(values [B, Lq, Hq, D],
    row_scale [B, Lq])``."""
    row_scale = fp8_rows_scale(v_scale)
    inverse = torch.ones_like(row_scale) / row_scale  # a tensor division: IEEE, as the kernel's div_rn
    values = (out * inverse[:, None, None, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.transpose(1, 2).contiguous(), row_scale[:, None].expand(-1, out.shape[2]).contiguous()


#: e4m3's largest finite value: V's per-channel scale maps the channel's amax there.
FP8_MAX = 448.0
#: FP8 P V rounds ``2**P_FP8_SHIFT * p`` (p <= 1) to e4m3, not p: the factor is
#: free in the kernel (a term of the exponent) and keeps probabilities down to
#: 2**-14 normal numbers, where p itself would turn subnormal below 2**-6.
P_FP8_SHIFT = 8
#: The keys of one step of the online softmax whose running max the rounded
#: probabilities are relative to: the kernel's key tile under FP8 P V.
FP8_PV_TILE = 128


def quantize_v_fp8(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 of ``v [B, H, L, D]`` (fp32) with one scale per (batch, head,
    channel) over the sequence: ``scale = amax / 448`` (:func:`quantization_scale`),
    values ``v * (1 / scale)`` rounded to nearest even (at most 448 and an
    fp32 ulp, which rounds to 448: nothing saturates). Returns
    ``(e4m3 [B, H, L, D], scale fp32 [B, H, D])``."""
    scale, inverse = fp8_channel_scales(v)
    return (v * inverse.unsqueeze(2)).to(torch.float8_e4m3fn), scale


def fp8_channel_scales(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_v_fp8`'s scales ``[B, H, D]`` of ``v [B, H, L, D]`` (fp32)
    and their reciprocals."""
    return quantization_scale(v.abs().amax(2), FP8_MAX)


def attention_int8_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """8-bit attention with FP8 P V, specified step by step as the kernel
    computes it: q and smoothed k of :func:`smooth_quantize_qk`, v of
    :func:`quantize_v_fp8`, and an online softmax over key tiles of
    :data:`FP8_PV_TILE`: per tile, the running max ``m`` of the raw scores,
    ``p = 2**P_FP8_SHIFT * exp((s - m) * scale)`` rounded to e4m3 for the
    product with the e4m3 v (summed in fp32), the row sums ``l`` of the
    unrounded p, both rescaled as the max grows; ``out = acc * v_scale / l``
    in q's dtype and layout (0 for a query with no visible key). The kernel
    differs from this by fp32 rounding (its exponents are fmas, its FP8 dot
    accumulates a tile with fewer bits), which moves a rare p across an e4m3
    rounding boundary."""
    return attention_qk8(*smooth_quantize_qk(q, k, seq_dim), v, scale, causal, seq_dim, kv_lengths, pv_fp8=True)[0]


#: The FP8 output rows' scale is this many times v's largest channel scale:
#: |out| <= max |v| for a convex combination of v's rows, and the e4m3
#: rounding of p can lift the weights' sum to 1 + 2**-4; a factor of 2 leaves
#: room for that at the cost of one binade at the bottom of e4m3's range.
FP8_ROWS_HEADROOM = 2.0


def attention_int8_fp8_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[torch.Tensor] = None,
    allowed: Optional[torch.Tensor] = None,
) -> tuple:
    """:func:`attention_int8_fp8` with its output written as the e4m3 rows an
    FP8 output projection reads (``compile_ops/reference/fp8.py``'s operand
    format: values and one fp32 scale per row), instead of in q's dtype.

    The scale is not the row's own amax (a row of the projection's input
    spans every head, and the kernel holds one head): it is a bound known
    before attention runs. Every output channel is a convex combination of
    the dequantized v's channel, so ``|out| <= 448 * v_scale`` of that channel
    and head; per batch element ``b``,
    ``row_scale = FP8_ROWS_HEADROOM * max_{h, c} v_scale[b, h, c]``, and
    ``values = e4m3(clamp(out * (1 / row_scale), -448, 448))`` with the
    reciprocal one fp32 division and ``out`` the fp32 result before
    :func:`attention_int8_fp8`'s cast. e4m3 is a floating-point format, so a
    bound above the row's amax costs no relative precision until values fall
    below 2**-6 of it (e4m3's subnormals): out's values sit at most a factor
    (row amax / v's amax) lower than a per-row scale would put them.

    ``allowed``: as :func:`attention_8bit` (block-sparse attention's listed
    blocks; the bound is v's over every key, listed or not).

    Returns ``(values [B, Lq, Hq, D] float8_e4m3fn, row_scale [B, Lq] fp32)``:
    the ``[B, Lq, Hq * D]`` rows of the projection, whatever ``seq_dim``."""
    quantized = smooth_quantize_qk(q, k, seq_dim)
    out, _, v_scale = _attention_8bit_fp32(*quantized, v, scale, causal, seq_dim, kv_lengths, True, allowed)
    return _fp8_rows(out, v_scale)


def fp8_rows_scale(v_scale: torch.Tensor) -> torch.Tensor:
    """:func:`attention_int8_fp8_rows`'s scale per batch element ``[B]`` from v's
    channel scales ``[B, Hk, D]``: ``FP8_ROWS_HEADROOM * max(v_scale[b])``, at
    least ``FP8_ROWS_HEADROOM * AMAX_FLOOR / 448`` (the FP8 recipe's floor: an
    all-zero v gives zeros with a finite reciprocal, not 0 * inf)."""
    return FP8_ROWS_HEADROOM * v_scale.flatten(1).amax(1).clamp(min=AMAX_FLOOR / FP8_MAX)


def attention_8bit(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[torch.Tensor] = None,
    pv_fp8: bool = False,
    allowed: Optional[torch.Tensor] = None,
) -> tuple:
    """``(out, lse)``: :func:`attention_int8` (``pv_fp8``: :func:`attention_int8_fp8`)
    with ``allowed``, an extra token mask broadcastable to ``[B, Hq, Lq, Lk]``
    (block-sparse attention's listed blocks), or None. The quantization is
    the dense one (k's mean and scales over every key, listed or not); only
    the attention is restricted, as a masked key is an invisible one. out in
    q's dtype and layout; lse ``[B, Hq, Lq]`` fp32, the log-sum-exp of the
    8-bit scores ``scale * q_hat . k_hat`` over the visible allowed keys
    (-inf for none), what the kernel writes beside out."""
    quantized = smooth_quantize_qk(q, k, seq_dim)
    out, lse, _ = _attention_8bit_fp32(*quantized, v, scale, causal, seq_dim, kv_lengths, pv_fp8, allowed)
    return (out if seq_dim == 2 else out.transpose(1, 2)).to(v.dtype), lse


def _attention_8bit_fp32(
    q8: torch.Tensor,
    q_scale: torch.Tensor,
    k8: torch.Tensor,
    k_scale: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int,
    kv_lengths: Optional[torch.Tensor],
    pv_fp8: bool,
    allowed: Optional[torch.Tensor] = None,
) -> tuple:
    """8-bit attention on quantized q and k in fp32 ``[B, Hq, Lq, D]``, before
    the cast: ``(out, lse, v's channel scales [B, Hk, D] or None)``. P V in
    fp32 of v as it is (:func:`attention_int8`), or ``pv_fp8``
    (:func:`_attention_int8_fp8_fp32`); ``allowed`` as :func:`attention_8bit`."""
    if pv_fp8:
        return _attention_int8_fp8_fp32(q8, q_scale, k8, k_scale, v, scale, causal, seq_dim, kv_lengths, allowed)
    q_hat, k_hat = _dequantized_qk(q8, q_scale, k8, k_scale, seq_dim)
    out, lse = attention(q_hat, k_hat, _bhld(v, seq_dim, torch.float32), scale, causal, 2, kv_lengths, allowed)
    return out, lse, None


def _attention_int8_fp8_fp32(
    q8: torch.Tensor,
    q_scale: torch.Tensor,
    k8: torch.Tensor,
    k_scale: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int,
    kv_lengths: Optional[torch.Tensor],
    allowed: Optional[torch.Tensor] = None,
) -> tuple:
    """:func:`attention_int8_fp8`'s ``out [B, Hq, Lq, D]`` in fp32, before the
    cast, the lse of its scores ``[B, Hq, Lq]`` and v's channel scales
    ``[B, Hk, D]``, from the quantized q and k; ``allowed`` as
    :func:`attention_8bit` (a tile whose keys are all masked leaves m, l and
    the accumulator as they were: what a kernel that skips it computes)."""
    q_hat, k_hat = _dequantized_qk(q8, q_scale, k8, k_scale, seq_dim)
    v8, v_scale = quantize_v_fp8(_bhld(v, seq_dim, torch.float32))
    hq = q_hat.shape[1]
    k_hat, v_hat, v_scale_q = (_heads_of_q(t, hq) for t in (k_hat, v8.float(), v_scale))
    s = q_hat @ k_hat.transpose(-1, -2)
    mask = visible(s.shape[2], s.shape[3], causal, kv_lengths, s.shape[0], s.device)
    if allowed is not None:
        mask = mask & allowed
    s = s.masked_fill(~mask, float("-inf"))
    c = scale * 1.4426950408889634  # log2(e): the kernel's exp2 form
    m = s.new_full(s.shape[:3], float("-inf"))
    l = s.new_zeros(s.shape[:3])
    acc = s.new_zeros(*s.shape[:3], v_hat.shape[-1])
    for start in range(0, s.shape[3], FP8_PV_TILE):
        tile = s.narrow(3, start, min(FP8_PV_TILE, s.shape[3] - start))
        m_new = torch.maximum(m, tile.amax(-1))
        m_shift = m_new.masked_fill(torch.isneginf(m_new), 0.0)  # no visible key yet: p = 0, not NaN
        p = torch.exp2((tile - m_shift.unsqueeze(-1)) * c + P_FP8_SHIFT)
        alpha = torch.exp2((m - m_shift) * c)
        l = l * alpha + p.sum(-1)
        p8 = p.to(torch.float8_e4m3fn).float()
        acc = acc * alpha.unsqueeze(-1) + p8 @ v_hat.narrow(2, start, tile.shape[3])
        m = m_new
    out = acc * v_scale_q.unsqueeze(2) / l.masked_fill(l == 0, 1.0).unsqueeze(-1)
    return out, torch.logsumexp(s * scale, dim=-1), v_scale
