"""Flash attention as ``torch.ops.fused`` ops, and the family's public functions.

``fused.attention`` returns the output and the log-sum-exp; autograd saves
q, k, v, the output and the lse (O(L) extra memory) and calls
``fused.attention_backward``. ``fused.attention_int8``,
``attention_int8_fp8``, ``attention_int8_fp8_rows`` and ``attention_qk8``
are 8-bit inference.

The family's other modules: ``ops/attention_launch.py`` launches the
kernels for every op: ``kernels/attention.py``'s forward and the three
Triton passes of ``kernels/attention_backward.py`` (deterministic,
bit-identical across runs), except where ``ops/attention_sm90.py`` routes a
call to the sm_90 Gluon kernels: the warp-specialized forward core for
every call it computes (the portable kernel's results, bit for bit;
traced calls reach it through the opaque op
``fused_gluon.attention_forward_sm90_``), and the five-product backward,
whose dq is summed by TMA reductions in the order the GPU runs its
programs, once :func:`set_attention_backward` asks for it.
``ops/attention_8bit.py`` makes 8-bit attention's operands;
``ops/attention_tiles.py`` and ``ops/attention_args.py`` hold the launches'
configurations and arguments.
"""

from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

from compile_ops import _dtensor, meta, reference
from compile_ops._library import clear_launch_plans, fused_op, register_no_gradient, require_fp8_mma
from compile_ops.meta._validate import check_floating_input, checked_arguments, softmax_scale
from compile_ops.ops import attention_sm90
from compile_ops.ops.attention_8bit import launch_eight_bit, quantized_operands
from compile_ops.ops.attention_launch import launch_backward, launch_forward
from compile_ops.ops.fp8 import FP8Rows, refuse_gradient

# ---------------------------------------------------------------- ops


@fused_op("attention", fake=meta.attention.attention, reference=reference.attention.attention, autocast="lower")
def _attention_op(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, seq_dim: int = 2, kv_lengths: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    out, lse = meta.attention.attention(q, k, v, scale, causal, seq_dim, kv_lengths)
    launch_forward(q, k, v, out, lse, scale, causal, seq_dim, kv_lengths)
    return out, lse


@fused_op(
    "attention_backward", fake=meta.attention.attention_backward, reference=reference.attention.attention_backward
)
def _attention_backward_op(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = meta.attention.attention_backward(grad_out, q, k, v, out, lse, scale, causal, seq_dim, kv_lengths)
    launch_backward(grad_out, q, k, v, out, lse, dq, dk, dv, scale, causal, seq_dim, kv_lengths)
    return dq, dk, dv


def _setup_attention(ctx, inputs, output):
    q, k, v, scale, causal, seq_dim, kv_lengths = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, kv_lengths)
    ctx.args = (scale, causal, seq_dim)


def _backward_attention(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, kv_lengths = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(grad_out, q, k, v, out, lse, *ctx.args, kv_lengths)
    return dq, dk, dv, None, None, None, None


_attention_op.register_autograd(_backward_attention, setup_context=_setup_attention)


@fused_op(
    "attention_int8", fake=meta.attention.attention_int8, reference=reference.attention.attention_int8, autocast="lower"
)
def _attention_int8_op(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, seq_dim: int = 2, kv_lengths: Optional[Tensor] = None
) -> Tensor:
    out = meta.attention.attention_int8(q, k, v, scale, causal, seq_dim, kv_lengths)
    launch_eight_bit(quantized_operands(q, k, v, seq_dim, pv_fp8=False), v, out, scale, causal, seq_dim, kv_lengths)
    return out


register_no_gradient(
    _attention_int8_op,
    "fused.attention_int8 is inference only (its q and k are rounded to 8 "
    "bits, which has no useful gradient): train with precision='exact', or run the call under "
    "torch.no_grad()",
)


@fused_op(
    "attention_int8_fp8",
    fake=meta.attention.attention_int8_fp8,
    reference=reference.attention.attention_int8_fp8,
    autocast="lower",
)
def _attention_int8_fp8_op(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, seq_dim: int = 2, kv_lengths: Optional[Tensor] = None
) -> Tensor:
    out = meta.attention.attention_int8_fp8(q, k, v, scale, causal, seq_dim, kv_lengths)
    require_fp8_mma(q, "precision='int8_fp8' attention (P V in FP8)")
    launch_eight_bit(quantized_operands(q, k, v, seq_dim, pv_fp8=True), v, out, scale, causal, seq_dim, kv_lengths)
    return out


register_no_gradient(
    _attention_int8_fp8_op,
    "fused.attention_int8_fp8 is inference only (q, k, v and the "
    "probabilities are rounded to 8 bits): train with precision='exact', or run the call under "
    "torch.no_grad()",
)


@fused_op(
    "attention_int8_fp8_rows",
    fake=meta.attention.attention_int8_fp8_rows,
    reference=reference.attention.attention_int8_fp8_rows,
    autocast="lower",
)
def _attention_int8_fp8_rows_op(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, seq_dim: int = 2, kv_lengths: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    values, out_scale = meta.attention.attention_int8_fp8_rows(q, k, v, scale, causal, seq_dim, kv_lengths)
    require_fp8_mma(q, "FP8 output rows of 8-bit attention")
    launch_eight_bit(
        quantized_operands(q, k, v, seq_dim, pv_fp8=True),
        v,
        values,
        scale,
        causal,
        seq_dim,
        kv_lengths,
        out_scale=out_scale,
    )
    return values, out_scale


register_no_gradient(
    _attention_int8_fp8_rows_op,
    "fused.attention_int8_fp8_rows is inference only (its output "
    "is e4m3): train with precision='exact', or run the call under torch.no_grad()",
)


@fused_op("attention_qk8", fake=meta.attention.attention_qk8, reference=reference.attention.attention_qk8)
def _attention_qk8_op(
    q: Tensor,
    q_scale: Tensor,
    k: Tensor,
    k_scale: Tensor,
    v: Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[Tensor] = None,
    pv_fp8: bool = False,
    fp8_rows: bool = False,
) -> tuple[Tensor, Tensor]:
    out, out_scale = meta.attention.attention_qk8(
        q, q_scale, k, k_scale, v, scale, causal, seq_dim, kv_lengths, pv_fp8, fp8_rows
    )
    if pv_fp8:
        require_fp8_mma(q, "8-bit attention with P V in FP8")
    operands = (q, q_scale, k, k_scale) + quantized_operands(None, None, v, seq_dim, pv_fp8)
    launch_eight_bit(operands, v, out, scale, causal, seq_dim, kv_lengths, out_scale if fp8_rows else None)
    return out, out_scale


register_no_gradient(
    _attention_qk8_op,
    "fused.attention_qk8 is inference only (its q and k are INT8): train "
    "with precision='exact', or run the call under torch.no_grad()",
)


# ---------------------------------------------------------------- public functions


class Int8QK(NamedTuple):
    """q and k of 8-bit attention, already quantized as
    ``reference.attention.smooth_quantize_qk`` specifies: what
    ``rope_qk(..., quantize=True)`` and ``qk_norm_rope(..., quantize=True)``
    write straight from the projections (no 16-bit q or k in memory), and
    what :func:`attention` and :func:`attention_fp8_rows` take as ``q`` (with
    ``k=None``) in place of 16-bit q and k."""

    q: Tensor
    """int8, q's shape and layout."""
    q_scale: Tensor
    """``[B, Hq, Lq]`` fp32: one scale per query."""
    k: Tensor
    """int8, k's shape and layout: k less its mean over the sequence."""
    k_scale: Tensor
    """``[B, Hk, ceil(Lk / 128)]`` fp32: one scale per block of 128 keys."""


def _given_quantized(name: str, q, k) -> bool:
    """Whether a call passes :class:`Int8QK` as q (and then k must be None)."""
    if not isinstance(q, Int8QK):
        return False
    if k is not None:
        raise ValueError(
            f"{name}: q is an Int8QK (q and k quantized together), so k must be None, got {type(k).__name__}"
        )
    return True


#: ``attention``'s precisions: the input dtype's own (16-bit or fp32 dots),
#: 8-bit q and k (inference; ``fused.attention_int8``), and with P V in FP8
#: too (``fused.attention_int8_fp8``, sm_89 or newer).
PRECISIONS = ("exact", "int8", "int8_fp8")
_EIGHT_BIT_OPS = {"int8": _attention_int8_op, "int8_fp8": _attention_int8_fp8_op}


#: The tag :func:`set_attention_backward` adds to torch.compile's cache keys while dq is summed in atomic
#: order: without it, a compile under one setting can be handed the cached graph of the other.
ATOMIC_DQ_CACHE_TAG = "compile_ops.attention_atomic_dq"


def set_attention_backward(deterministic: bool = True) -> None:
    """Choose how ``fused.attention``'s backward sums dq from now on.

    Args:
        deterministic: ``True`` (the default): three passes (statistics,
            dk/dv, dq; on sm_90 the dk/dv pass of dense calls is the
            five-product kernel without its dQ, ``SM90_DKDV``), the
            gradients bit for bit the same on every run. ``False``: on sm_90
            GPUs, 16-bit calls at D = 64 or 128 (dense or block-sparse,
            causal or not, with key lengths or not) take a five-product
            backward whose dq is added up by TMA reductions in the order the
            GPU's programs run, so dq's last bits vary from run to run (dk
            and dv do not), and the backward runs faster
            (docs/notes/attention.md).

    Other calls (D other than 64 and 128, fp32), and every call while
    ``torch.use_deterministic_algorithms(True)`` is on, keep the
    deterministic passes. Compiled graphs take the setting that held when
    they were traced. ``False`` adds a tag to
    ``torch.compiler.config.cache_key_tag`` (``True`` removes it), so that
    torch.compile's caches (AOTAutograd's and Inductor's, in memory and on
    disk) do not hand a graph traced under one setting to a compile under
    the other: the setting is read inside the backward's trace, which their
    keys do not otherwise see.
    """
    if not isinstance(deterministic, bool):
        raise TypeError(f"set_attention_backward: deterministic must be a bool, got {type(deterministic).__name__}")
    attention_sm90.ATOMIC_DQ = not deterministic
    tags = [tag for tag in torch.compiler.config.cache_key_tag.split(",") if tag and tag != ATOMIC_DQ_CACHE_TAG]
    torch.compiler.config.cache_key_tag = ",".join(tags + [ATOMIC_DQ_CACHE_TAG] * attention_sm90.ATOMIC_DQ)
    clear_launch_plans()  # plans recorded under the other setting launch the other kernels


@checked_arguments
def attention(
    q: Union[Tensor, Int8QK],
    k: Optional[Tensor],
    v: Tensor,
    scale: Optional[float] = None,
    causal: bool = False,
    seq_dim: int = 2,
    kv_lengths: Optional[Tensor] = None,
    return_lse: bool = False,
    precision: str = "exact",
):
    """Flash attention: ``softmax(scale q k^T) v`` without materializing the scores.

    Args:
        q: ``[B, Hq, Lq, D]`` (``seq_dim=2``, SDPA's layout) or ``[B, Lq, Hq, D]``
            (``seq_dim=1``, flash-attn's / diffusers' dispatcher's), any strides;
            fp16/bf16 (fp32 runs with TF32 dots where torch's fp32 matmul
            precision allows TF32, IEEE dots otherwise); D up to 256.
            Or an :class:`Int8QK` (q and k already quantized by
            ``rope_qk``/``qk_norm_rope(..., quantize=True)``) with k None and
            an 8-bit ``precision``: the same computation, minus the
            quantization of q and k.
        k, v: ``[B, Hk, Lk, D]`` / ``[B, Lk, Hk, D]`` in q's layout and dtype;
            ``Hk`` divides ``Hq`` (GQA/MQA); Lk may differ from Lq.
        scale: defaults to ``1 / sqrt(D)``.
        causal: query i sees keys ``j <= i`` (SDPA's ``is_causal``, top-left aligned).
        kv_lengths: ``[B]`` int32/int64 or None: keys at or past
            ``kv_lengths[b]`` are ignored for batch element b (padded text tokens).
        return_lse: also return the log-sum-exp ``[B, Hq, Lq]`` fp32.
        precision: ``"exact"`` (the dots in the inputs' dtype) or ``"int8"``:
            inference on fp16/bf16 inputs with k smoothed (its mean over the
            sequence subtracted, which softmax ignores), q rounded to INT8 per
            token and k per block of 128 keys, an integer QK product and P V
            in the input dtype
            (``fused.attention_int8``; specified in
            ``compile_ops/reference/attention.py``). ``"int8_fp8"``: the
            same, and P V in FP8 too (v in e4m3 per channel, the
            probabilities rounded to e4m3; ``fused.attention_int8_fp8``;
            sm_89 or newer). A gradient through either raises; no lse.

    Returns:
        ``[B, Hq, Lq, D]`` / ``[B, Lq, Hq, D]`` in q's dtype and layout, contiguous
        (and the lse). A query with no visible key gives 0 (lse -inf).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"compile_ops.attention: precision must be one of {PRECISIONS}, got {precision!r}")
    if precision in _EIGHT_BIT_OPS and return_lse:
        raise ValueError(
            f"compile_ops.attention: precision={precision!r} returns no lse (inference only); "
            "call it with return_lse=False"
        )
    if _given_quantized("compile_ops.attention", q, k):
        if precision not in _EIGHT_BIT_OPS:
            raise ValueError(
                f"compile_ops.attention: q is an Int8QK (quantized q and k), which needs an 8-bit "
                f"precision {tuple(_EIGHT_BIT_OPS)}, got precision={precision!r}"
            )
        scale = softmax_scale("compile_ops.attention", q.q, scale)
        return _attention_qk8_op(*q, v, scale, causal, seq_dim, kv_lengths, precision == "int8_fp8", False)[0]
    scale = softmax_scale("compile_ops.attention", q, scale, "a torch.Tensor or an Int8QK")
    if precision in _EIGHT_BIT_OPS:
        op = _EIGHT_BIT_OPS[precision]
        return _dtensor.sequence_parallel(
            lambda q, k, v: op(q, k, v, scale, causal, seq_dim, kv_lengths), q, k, v, seq_dim
        )
    out, lse = _dtensor.sequence_parallel(
        lambda q, k, v: _attention_op(q, k, v, scale, causal, seq_dim, kv_lengths), q, k, v, seq_dim
    )
    return (out, lse) if return_lse else out


@checked_arguments
def attention_fp8_rows(
    q: Union[Tensor, Int8QK],
    k: Optional[Tensor],
    v: Tensor,
    scale: Optional[float] = None,
    causal: bool = False,
    seq_dim: int = 2,
    kv_lengths: Optional[Tensor] = None,
) -> FP8Rows:
    """:func:`attention` with ``precision="int8_fp8"`` whose output comes as the
    FP8 rows an FP8 output projection reads (``FP8Linear``, :func:`fp8_linear`):
    the kernel writes e4m3 values and their scales in its epilogue, so the
    output is never written in 16 bits nor quantized by a pass of its own.
    Inference only (sm_89 or newer on a GPU; the exact specification,
    ``reference.attention.attention_int8_fp8_rows``, elsewhere).

    The rows' scale is a bound, not each row's amax (a row spans every head,
    a program holds one): twice the largest of v's channel scales per batch
    element, which e4m3's exponent makes as precise as a per-row scale for
    all values above 2**-6 of it (the reference's docstring says why).

    Args:
        q, k, v: as :func:`attention` (fp16/bf16, either layout, GQA), or q
            an :class:`Int8QK` and k None.
        scale, causal, kv_lengths: as :func:`attention`.
        seq_dim: q/k/v's layout (2: ``[B, H, L, D]``, 1: ``[B, L, H, D]``).

    Returns:
        ``FP8Rows(q=[B, Lq, Hq * D] float8_e4m3fn, scale=[B, Lq] fp32)``, whatever
        ``seq_dim``: the projection's input rows, heads concatenated per token.
    """
    if _given_quantized("compile_ops.attention_fp8_rows", q, k):
        refuse_gradient("compile_ops.attention_fp8_rows", v)
        scale = softmax_scale("compile_ops.attention_fp8_rows", q.q, scale)
        values, row_scale = _attention_qk8_op(*q, v, scale, causal, seq_dim, kv_lengths, True, True)
        return FP8Rows(values.flatten(2, 3), row_scale)
    refuse_gradient("compile_ops.attention_fp8_rows", q, k, v)
    scale = softmax_scale("compile_ops.attention_fp8_rows", q, scale, "a torch.Tensor or an Int8QK")
    values, row_scale = _attention_int8_fp8_rows_op(q, k, v, scale, causal, seq_dim, kv_lengths)
    return FP8Rows(values.flatten(2, 3), row_scale)


@checked_arguments
def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``'s signature, on :func:`attention`.

    Args:
        query: ``[B, Hq, Lq, D]``; key, value: ``[B, Hk, Lk, D]``.
        attn_mask, dropout_p: not supported (a mask or dropout raises; use
            ``kv_lengths`` of :func:`attention` for key padding).
        is_causal, scale: as SDPA.
        enable_gqa: as SDPA; GQA (Hk dividing Hq) is accepted either way.

    Returns:
        ``[B, Hq, Lq, D]``.
    """
    owner = "compile_ops.scaled_dot_product_attention"
    if attn_mask is not None:
        raise NotImplementedError(
            f"{owner}: attn_mask is not supported; pass key padding as kv_lengths to compile_ops.attention"
        )
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{owner}: dropout_p must be a probability in [0, 1], got {dropout_p}")
    if dropout_p != 0.0:
        raise NotImplementedError(f"{owner}: dropout_p must be 0 (no dropout), got {dropout_p}")
    # SDPA's argument names in its errors, before attention() checks them as q, k, v.
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_floating_input(owner, name, t)
        if t.device != query.device:
            raise ValueError(f"{owner}: {name} is on {t.device} but query is on {query.device}")
    return attention(query, key, value, scale, is_causal, 2)
