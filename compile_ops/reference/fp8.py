"""The FP8 recipe, exactly: the CPU path and the test oracle of the fp8 family.

Rowwise e4m3 (torchao's ``PerRow`` recipe for ``Float8DynamicActivation
Float8WeightConfig``, the one users run on Flux today): every row of an
activation (a token) and every output channel of a weight has its own fp32
scale. Per row, because DiT activations carry a few outlier tokens and
channels: one scale per tensor would spend e4m3's 3 mantissa bits of every
other token on them.

Why e4m3 (float8_e4m3fn: 4 exponent bits, 3 mantissa bits, largest finite
value 448, no infinity): forward activations and weights need precision more
than range once each row is scaled to fill [-448, 448]; e5m2 (2 mantissa bits,
range to 57344) is the gradients' format. Why fp32 scales: ``torch._scaled_mm``
takes fp32 scales, and a bf16 scale would add up to 2^-9 relative error to
every element of its row on top of e4m3's 2^-4. Why 1e-12 as the floor:
torchao's choice; with it an all-zero row quantizes to zeros with a tiny,
finite, positive scale instead of 0 / 0.

Per row ``x [K]``:

- ``amax = max |x_i|`` over the row's values that are not NaN, in fp32, at
  least ``AMAX_FLOOR``: an all-zero (or all-NaN) row gets a finite scale.
- ``q = e4m3(clamp(x * (448 / amax), -448, 448))``, rounded to nearest even:
  ``448 / amax`` is one IEEE fp32 division, the product one fp32 rounding, so
  a kernel doing the same two operations writes the same bytes. The clamp
  takes up the product's rounding past 448 and keeps NaN (so does the GPU's
  saturating convert).
- ``scale = amax / 448`` (fp32), the factor that dequantizes: ``x ~ q * scale``.

Non-finite values never give a finite result, as in the unquantized Linear
(rows being independent, they never reach another row either):

- NaN: left out of its row's amax, so the row's other values keep the scale
  they have without it; its code is NaN, and so is every output of its row
  in a GEMM.
- +-inf: counted, so its row's amax and scale are +inf and ``448 / amax`` is
  0: the codes are ``inf * 0 = NaN`` at the infinities and +-0 at the finite
  values. ``q * scale`` is NaN across the row (``0 * inf``), and so is every
  output of the row in a GEMM (or output column, for a weight row), where
  the unquantized product gives +-inf or NaN. NaN rather than +-inf, because
  e4m3fn has no infinity and one scale per row cannot hold an infinity and
  the row's finite values both; saturating the infinity to the row's largest
  finite value instead would turn an overflow into a finite output.

A GEMM of two such operands is ``(q_x * scale_x[:, None]) @ (q_w * scale_w[:, None]).T``
accumulated in fp32, plus the bias, cast to the output dtype: what
``torch._scaled_mm`` computes with rowwise scales.
"""

from typing import Optional

import torch

from compile_ops.reference.glu import apply_activation

#: The largest finite float8_e4m3fn value.
E4M3_MAX = 448.0
#: Below this amax a row counts as zero (torchao's floor): its scale stays finite.
AMAX_FLOOR = 1e-12


def quantize_fp8_rows(x: torch.Tensor, activation: str = "none", head: Optional[torch.Tensor] = None) -> tuple:
    """``x [..., K]`` -> ``(q [..., K] float8_e4m3fn, scale [...] float32)``.

    ``activation`` (``"none"`` or a name of ``meta.glu.ACTIVATIONS``): quantize
    ``act(x)`` computed in fp32 and rounded to x's dtype, the tensor the
    unquantized activation would have written (the kernel's tanh, erf and exp
    are not torch's: its bytes may differ from these by a rounding).
    ``head [..., K_head]``: quantize ``cat([head, act(x)], -1)`` (q is
    ``[..., K_head + K]``, one scale per row of the concatenation).

    A row holding +-inf (after the activation) gets scale +inf and codes NaN
    at the infinities, +-0 elsewhere; a NaN is left out of its row's scale and
    stays NaN (the module docstring says why)."""
    if activation != "none":
        x = apply_activation(x.float(), activation).to(x.dtype)
    if head is not None:
        x = torch.cat([head, x], dim=-1)
    xf = x.float()
    amax = (
        torch.where(torch.isnan(xf), 0.0, xf.abs()).amax(-1, keepdim=True)
        if x.shape[-1]
        else xf.new_zeros((*x.shape[:-1], 1))
    )
    amax = amax.clamp(min=AMAX_FLOOR)
    # Tensors on both sides of each division: torch computes ``python_float / tensor``
    # as a multiply by the reciprocal (1 ulp off in a quarter of cases), and on CUDA
    # ``tensor / python_float`` too; the kernel divides exactly.
    inverse = amax.new_full((), E4M3_MAX) / amax
    q = (xf * inverse).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, (amax / amax.new_full((), E4M3_MAX)).squeeze(-1)


def fp8_linear(
    q_x: torch.Tensor,
    scale_x: torch.Tensor,
    q_w: torch.Tensor,
    scale_w: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``q_x [M, K]``, ``scale_x [M]``, ``q_w [N, K]``, ``scale_w [N]``, ``bias [N]``
    -> ``[M, N]`` in ``out_dtype``, summed in fp32. An infinite scale (a row
    that held +-inf) dequantizes its row to NaN (``0 * inf``, ``NaN * inf``):
    the output row (or column, for W) is NaN."""
    out = (q_x.float() * scale_x[:, None].float()) @ (q_w.float() * scale_w[:, None].float()).T
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_rows_lora(
    result: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float = 1.0,
    scaling_tensor: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One LoRA adapter on FP8 rows: ``result + B(h)``, ``result [..., N]``,
    ``q [..., K]`` float8_e4m3fn, ``scale [...]`` fp32, ``lora_a [r, K]`` and
    ``lora_b [N, r]`` in the adapters' dtype; ``[..., N]`` in result's dtype.

    The roundings, in order (the kernels make the same ones):

    1. ``down = q @ A.T``, the codes read as they are (not dequantized) and
       summed in fp32: each product is exact for 16-bit adapters (a 4-bit
       code times a 16-bit value), rounded once in fp32 for fp32 adapters.
    2. ``h = down * (scale * s)`` in fp32, ``s = fp32(scaling) * fp32(scaling_tensor)``
       (``scaling_tensor`` absent: ``fp32(scaling)``): the row's scale and the
       adapter's scaling applied once to the rank-r product, not to the K
       dequantized values; then rounded ONCE to the adapters' dtype (what
       ``lora_a``'s output would be).
    3. ``result + h @ B.T``: the up projection summed in fp32 (products exact
       for 16-bit adapters), added to result read in fp32, rounded once to
       result's dtype.

    Non-finite values: a NaN code or scale makes its row's h NaN, so the
    output row is NaN (as the dequantized rows ``q * scale`` would make it);
    a scale of +inf multiplies the row's ``down`` (``quantize_fp8_rows``
    writes such rows with NaN codes, so they are NaN throughout); NaN and
    +-inf in result stay where they are."""
    lead, k, n = q.shape[:-1], q.shape[-1], lora_b.shape[0]
    m = scale.numel()  # rows by count: reshape(-1, 0) of an empty row is ambiguous
    down = q.reshape(m, k).float() @ lora_a.float().T  # [M, r] fp32
    s = torch.tensor(float(scaling), dtype=torch.float32, device=q.device)
    if scaling_tensor is not None:
        s = s * scaling_tensor.float()
    factor = scale.reshape(-1, 1).float() * s
    h = (down * factor).to(lora_a.dtype)
    out = result.reshape(m, n).float() + h.float() @ lora_b.float().T
    return out.to(result.dtype).reshape(*lead, n)
