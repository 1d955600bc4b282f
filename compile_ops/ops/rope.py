"""The RoPE family as ``torch.ops.fused`` ops.

- ``fused.rope``: one tensor, cos/sin tables.
- ``fused.rope_qk``: q and k in one launch, sharing the table reads.
- ``fused.rope_grid``: q and k, angles computed in the kernel from 3D
  (frame, row, column) positions: video RoPE with no table in memory.
- ``fused.qk_norm_rope``: per-head RMSNorm with weight, then RoPE, q and k in
  one launch; ``fused.qk_norm_rope_backward`` is its backward.

The backward of a rotation is its transpose, the same op with ``inverse``
flipped, so the first three ops are their own backward ops. Tables that
require grad get theirs from plain torch ops in the backward (the rotated
input times the output's gradient, summed to the table's shape).
"""

from typing import Optional

import torch
from torch import Tensor

from compile_ops import _dtensor, meta, reference
from compile_ops._library import fused_op, register_no_gradient
from compile_ops.meta._validate import accumulation_dtype, checked_arguments
from compile_ops.ops._launch import column_sum
from compile_ops.ops.attention import Int8QK
from compile_ops.ops.rope_launch import launch_backward, launch_forward

# ---------------------------------------------------------------- fused.rope


@fused_op("rope", fake=meta.rope.rope, reference=reference.rope.rope)
def _rope_op(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
    seq_dim: int,
    rotary_dim: Optional[int] = None,
    inverse: bool = False,
) -> Tensor:
    out = meta.rope.rope(x, cos, sin, interleaved, seq_dim, rotary_dim, inverse)
    r, half = meta.rope.table_layout(x, cos, rotary_dim)
    launch_forward(x, None, out, None, seq_dim, r, interleaved, half, cos, sin, inverse)
    return out


def _table_grads(needs: tuple[bool, bool], cos: Tensor, sin: Tensor, rotated, args: tuple):
    """``(dcos, dsin)``, each None unless ``needs`` says its table requires
    grad, summed over ``rotated``: ``(rotation input in the accumulation
    dtype, its output's gradient)`` pairs. ``args``: ``(interleaved,
    seq_dim, rotary_dim, transposed)`` as the backward's rotation takes them.

    Plain torch ops rather than a kernel: a table's gradient is a reduction
    over heads and batch that the kernels' transposed rotation does not do,
    and it runs only for tables that require grad."""
    if not any(needs):
        return None, None
    interleaved, seq_dim, rotary_dim, transposed = args
    r, half = meta.rope.table_layout(rotated[0][0], cos, rotary_dim)
    sums = None
    for xf, grad in rotated:
        grads = reference.rope.table_grads(grad, xf, cos, r, half, interleaved, seq_dim, not transposed)
        sums = grads if sums is None else tuple(a + b for a, b in zip(sums, grads))
    return tuple(g.to(t.dtype) if need else None for g, t, need in zip(sums, (cos, sin), needs))


def _setup_rope(ctx, inputs, output):
    x, cos, sin, interleaved, seq_dim, rotary_dim, inverse = inputs
    # x only for the tables' gradients: the rotation's transpose does not read it.
    ctx.save_for_backward(cos, sin, x if any(ctx.needs_input_grad[1:3]) else None)
    ctx.args = (interleaved, seq_dim, rotary_dim, not inverse)


def _backward_rope(ctx, grad):
    cos, sin, x = ctx.saved_tensors
    needs = ctx.needs_input_grad[1:3]
    rotated = [(x.to(accumulation_dtype(x)), grad)] if any(needs) else None
    dcos, dsin = _table_grads(needs, cos, sin, rotated, ctx.args)
    return _rope_op(grad, cos, sin, *ctx.args), dcos, dsin, None, None, None, None


_rope_op.register_autograd(_backward_rope, setup_context=_setup_rope)


# ------------------------------------------------------------- fused.rope_qk


@fused_op("rope_qk", fake=meta.rope.rope_qk, reference=reference.rope.rope_qk)
def _rope_qk_op(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
    seq_dim: int,
    rotary_dim: Optional[int] = None,
    inverse: bool = False,
) -> tuple[Tensor, Tensor]:
    q_out, k_out = meta.rope.rope_qk(q, k, cos, sin, interleaved, seq_dim, rotary_dim, inverse)
    r, half = meta.rope.table_layout(q, cos, rotary_dim)
    launch_forward(q, k, q_out, k_out, seq_dim, r, interleaved, half, cos, sin, inverse)
    return q_out, k_out


def _save_pair_shapes(ctx, q: Tensor, k: Tensor) -> None:
    ctx.pair_shapes = ((q.shape, q.dtype, q.device), (k.shape, k.dtype, k.device))


def _grads_of_pair(ctx, grad_q: Optional[Tensor], grad_k: Optional[Tensor]):
    """Autograd passes None for an output that got no gradient: zeros then."""
    return tuple(
        torch.zeros(shape, dtype=dtype, device=device) if g is None else g
        for g, (shape, dtype, device) in zip((grad_q, grad_k), ctx.pair_shapes)
    )


def _setup_rope_qk(ctx, inputs, output):
    q, k, cos, sin, interleaved, seq_dim, rotary_dim, inverse = inputs
    tables_need_grad = any(ctx.needs_input_grad[2:4])
    ctx.save_for_backward(cos, sin, *((q, k) if tables_need_grad else (None, None)))
    _save_pair_shapes(ctx, q, k)
    ctx.args = (interleaved, seq_dim, rotary_dim, not inverse)


def _backward_rope_qk(ctx, grad_q, grad_k):
    cos, sin, q, k = ctx.saved_tensors
    grad_q, grad_k = _grads_of_pair(ctx, grad_q, grad_k)
    needs = ctx.needs_input_grad[2:4]
    rotated = [(x.to(accumulation_dtype(x)), g) for x, g in ((q, grad_q), (k, grad_k))] if any(needs) else None
    dcos, dsin = _table_grads(needs, cos, sin, rotated, ctx.args)
    return (*_rope_qk_op(grad_q, grad_k, cos, sin, *ctx.args), dcos, dsin, None, None, None, None)


_rope_qk_op.register_autograd(_backward_rope_qk, setup_context=_setup_rope_qk)


# ----------------------------------------------------------- fused.rope_grid


@fused_op("rope_grid", fake=meta.rope.rope_grid, reference=reference.rope.rope_grid)
def _rope_grid_op(
    q: Tensor,
    k: Tensor,
    constants: Tensor,
    height: int,
    width: int,
    interleaved: bool,
    seq_dim: int,
    inverse: bool = False,
) -> tuple[Tensor, Tensor]:
    q_out, k_out = meta.rope.rope_grid(q, k, constants, height, width, interleaved, seq_dim, inverse)
    r = 2 * constants.shape[1]
    launch_forward(
        q,
        k,
        q_out,
        k_out,
        seq_dim,
        r,
        interleaved,
        False,
        constants,
        constants,
        inverse,
        grid_angles=True,
        frame_size=height * width,
        width=width,
    )
    return q_out, k_out


def _setup_rope_grid(ctx, inputs, output):
    q, k, constants, height, width, interleaved, seq_dim, inverse = inputs
    ctx.save_for_backward(constants)
    _save_pair_shapes(ctx, q, k)
    ctx.args = (height, width, interleaved, seq_dim, not inverse)


def _backward_rope_grid(ctx, grad_q, grad_k):
    (constants,) = ctx.saved_tensors
    grad_q, grad_k = _grads_of_pair(ctx, grad_q, grad_k)
    return (*_rope_grid_op(grad_q, grad_k, constants, *ctx.args), None, None, None, None, None, None)


_rope_grid_op.register_autograd(_backward_rope_grid, setup_context=_setup_rope_grid)


# -------------------------------------------------------- fused.qk_norm_rope


@fused_op("qk_norm_rope", fake=meta.rope.qk_norm_rope, reference=reference.rope.qk_norm_rope)
def _qk_norm_rope_op(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    cos: Tensor,
    sin: Tensor,
    eps: float,
    interleaved: bool,
    seq_dim: int,
    rotary_dim: Optional[int] = None,
) -> tuple[Tensor, Tensor]:
    q_out, k_out = meta.rope.qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, interleaved, seq_dim, rotary_dim)
    r, half = meta.rope.table_layout(q, cos, rotary_dim)
    launch_forward(
        q, k, q_out, k_out, seq_dim, r, interleaved, half, cos, sin, False, weights=(q_weight, k_weight), eps=float(eps)
    )
    return q_out, k_out


@fused_op("qk_norm_rope_backward", fake=meta.rope.qk_norm_rope_backward, reference=reference.rope.qk_norm_rope_backward)
def _qk_norm_rope_backward_op(
    grad_q: Tensor,
    grad_k: Tensor,
    q: Tensor,
    k: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    cos: Tensor,
    sin: Tensor,
    eps: float,
    interleaved: bool,
    seq_dim: int,
    rotary_dim: Optional[int] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    inputs = (grad_q, grad_k, q, k, q_weight, k_weight, cos, sin, eps, interleaved, seq_dim, rotary_dim)
    outputs = meta.rope.qk_norm_rope_backward(*inputs)
    launch_backward(inputs, outputs)
    return outputs


def _setup_qk_norm_rope(ctx, inputs, output):
    q, k, q_weight, k_weight, cos, sin, eps, interleaved, seq_dim, rotary_dim = inputs
    ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
    _save_pair_shapes(ctx, q, k)
    ctx.args = (eps, interleaved, seq_dim, rotary_dim)


def _backward_qk_norm_rope(ctx, grad_q, grad_k):
    q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
    grad_q, grad_k = _grads_of_pair(ctx, grad_q, grad_k)
    grads = _qk_norm_rope_backward_op(grad_q, grad_k, q, k, q_weight, k_weight, cos, sin, *ctx.args)
    eps, interleaved, seq_dim, rotary_dim = ctx.args
    needs = ctx.needs_input_grad[4:6]
    # The tables rotate the normalized q and k: recomputed, not saved by the forward.
    rotated = (
        [
            (reference.rope.normalized(x, w, eps, seq_dim), g)
            for x, w, g in ((q, q_weight, grad_q), (k, k_weight, grad_k))
        ]
        if any(needs)
        else None
    )
    dcos, dsin = _table_grads(needs, cos, sin, rotated, (interleaved, seq_dim, rotary_dim, True))
    return (*grads, dcos, dsin, None, None, None, None)


_qk_norm_rope_op.register_autograd(_backward_qk_norm_rope, setup_context=_setup_qk_norm_rope)


# -------------------------------------------------------- fused.qk_rope_int8


@fused_op("qk_rope_int8", fake=meta.rope.qk_rope_int8, reference=reference.rope.qk_rope_int8)
def _qk_rope_int8_op(
    q: Tensor,
    k: Tensor,
    q_weight: Optional[Tensor],
    k_weight: Optional[Tensor],
    cos: Tensor,
    sin: Tensor,
    eps: float,
    interleaved: bool,
    seq_dim: int,
    rotary_dim: Optional[int] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    q8, q_scale, k8, k_scale = meta.rope.qk_rope_int8(
        q, k, q_weight, k_weight, cos, sin, eps, interleaved, seq_dim, rotary_dim
    )
    r, half = meta.rope.table_layout(q, cos, rotary_dim)
    b, hk, d, blocks = k.shape[0], k.shape[3 - seq_dim], k.shape[3], k_scale.shape[2]
    # Two passes over k's projection, none over a 16-bit k: its column sums per
    # block of 128 keys, reduced in a fixed order to the mean's numerator;
    # then q and k rotated again and quantized (the rotation is recomputed
    # rather than stored and read back).
    sums = torch.empty((blocks, b, hk, d), dtype=torch.float32, device=k.device)
    k_sum = torch.empty((b, hk, d), dtype=torch.float32, device=k.device)
    launch_forward(
        k,
        None,
        sums,
        None,
        seq_dim,
        r,
        interleaved,
        half,
        cos,
        sin,
        False,
        weights=(k_weight, None),
        eps=float(eps),
        quantize=1,
    )
    if sums.numel():
        column_sum(sums.view(blocks, -1), blocks, k_sum)
    launch_forward(
        q,
        k,
        q8,
        k8,
        seq_dim,
        r,
        interleaved,
        half,
        cos,
        sin,
        False,
        weights=(q_weight, k_weight),
        eps=float(eps),
        quantize=2,
        scales=(q_scale, k_scale),
        k_sum=k_sum,
    )
    return q8, q_scale, k8, k_scale


register_no_gradient(
    _qk_rope_int8_op,
    "fused.qk_rope_int8 is inference only (it rounds q and k to 8 bits "
    "for 8-bit attention): train with the 16-bit rope_qk / qk_norm_rope, or run under "
    "torch.no_grad()",
)


# ---------------------------------------------------------- public functions


@checked_arguments
def rope(
    x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False, seq_dim: int = 2, rotary_dim: Optional[int] = None
) -> Tensor:
    """Rotary position embedding, as diffusers' ``apply_rotary_emb(x, (cos, sin), use_real=True)``.

    Args:
        x: ``[B, H, L, D]`` (``seq_dim=2``, the default) or ``[B, L, H, D]``
            (``seq_dim=1``), fp16/bf16/fp32/fp64, any strides.
        cos, sin: ``[L, T]`` or ``[B, L, T]``; ``T = rotary_dim`` (diffusers'
            full tables) or ``rotary_dim / 2`` (one angle per pair). Read in fp32.
            Differentiable: tables that require grad (learned or computed
            from learned frequencies) get their gradients, summed over the
            heads and the batch they are shared by; tables that don't cost
            the backward nothing.
        interleaved: pairs ``(2i, 2i + 1)`` (``use_real_unbind_dim=-1``: Flux,
            CogVideoX, HunyuanVideo); False: ``(i, i + R/2)`` (``-2``).
        seq_dim: the position dim of x, 1 or 2.
        rotary_dim: channels rotated (even, default D); the rest pass through.

    Returns:
        x's shape and dtype, contiguous; computed in fp32 and rounded once.
    """
    return _rope_op(x, cos, sin, interleaved, seq_dim, rotary_dim, False)


@checked_arguments
def rope_qk(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool = False,
    seq_dim: int = 2,
    rotary_dim: Optional[int] = None,
    quantize: bool = False,
):
    """:func:`rope` of q and k in one launch (each table row is read once for both).

    Args:
        q: ``[B, Hq, L, D]`` (``seq_dim=2``) or ``[B, L, Hq, D]`` (``seq_dim=1``), any strides.
        k: the same layout, dtype, B, L and D as q; ``Hk`` heads (GQA: any Hk).
        cos, sin, interleaved, seq_dim, rotary_dim: as for :func:`rope`; the
            tables' gradients sum q's and k's.
        quantize: inference with 8-bit attention (fp16/bf16 q, k): return
            the rotated q and k quantized for ``attention(..., precision=
            "int8" | "int8_fp8")`` (:class:`~compile_ops.Int8QK`), written
            by the rotation's own kernel (``fused.qk_rope_int8``), never in
            16 bits. The same values as this function's output passed to
            8-bit attention, up to the summation order of k's mean.

    Returns:
        ``(q_rotated, k_rotated)``, each contiguous in its input's shape and dtype;
        with ``quantize``, an :class:`~compile_ops.Int8QK`.
    """
    if quantize:
        return Int8QK(*_qk_rope_int8_op(q, k, None, None, cos, sin, 0.0, interleaved, seq_dim, rotary_dim))
    return _rope_qk_op(q, k, cos, sin, interleaved, seq_dim, rotary_dim, False)


@checked_arguments
def rope_grid(
    q: Tensor, k: Tensor, spec: "meta.rope.GridRope", height: int, width: int, seq_dim: int = 2
) -> tuple[Tensor, Tensor]:
    """3D (video) RoPE of q and k with the angles computed in the kernel from each
    token's (frame, row, column) position: no cos/sin table is built or read.

    Args:
        q: ``[B, Hq, L, D]`` (``seq_dim=2``) or ``[B, L, Hq, D]`` (``seq_dim=1``),
            any strides; ``L = frames * height * width`` tokens in row-major
            (frame, row, column) order. A slice of a longer sequence (the image
            tokens of a joint text+video sequence) is a strided view: pass it as is.
        k: as q, with any head count.
        spec: a :class:`~compile_ops.meta.rope.GridRope`, e.g. from
            :func:`compile_ops.grid_rope` ``("wan" | "hunyuan" | "ltx", ...)``; its
            ``rotary_dim`` channels are rotated, the rest of D passes through.
        height, width: the patch grid of one frame.

    Returns:
        ``(q_rotated, k_rotated)``, contiguous, in the inputs' shapes and dtype.
    """
    constants = _dtensor.replicated_like(_grid_constants(spec, q.device), q)
    return _rope_grid_op(q, k, constants, height, width, spec.interleaved, seq_dim, False)


_GRID_CONSTANTS: dict = {}


def _grid_constants(spec: "meta.rope.GridRope", device) -> Tensor:
    """``spec.constants()`` on ``device``, built once per (spec, device)."""
    key = (spec, str(device))
    if key not in _GRID_CONSTANTS:
        _GRID_CONSTANTS[key] = spec.constants(device)
    return _GRID_CONSTANTS[key]


@checked_arguments
def qk_norm_rope(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    cos: Tensor,
    sin: Tensor,
    eps: float = 1e-6,
    interleaved: bool = False,
    seq_dim: int = 2,
    rotary_dim: Optional[int] = None,
    quantize: bool = False,
):
    """RMSNorm with weight, then RoPE, of q and k in one kernel (the ``norm_q``
    / ``norm_k`` + ``apply_rotary_emb`` of Flux, SD3 and HunyuanVideo, whose
    norms take each head on its own, and of Wan and LTX-Video, whose norms
    span all heads of a position).

    Args:
        q: ``[B, Hq, L, D]`` (``seq_dim=2``) or ``[B, L, Hq, D]`` (``seq_dim=1``), any strides.
        k: the same layout, dtype, B, L and D as q; any head count.
        q_weight, k_weight: the RMSNorms' weights (any float dtype): ``[D]``
            normalizes each head on its own; ``[Hq * D]`` and ``[Hk * D]``
            normalize each position's channels of all heads together (heads
            in order, as ``x.flatten`` of ``[B, L, H, D]`` lays them out).
            Both of one kind (a tensor with one head fits either).
        cos, sin: as for :func:`rope`; their gradients are those of the
            rotation of the normalized q and k (the values the tables rotate).
        eps: the RMSNorm epsilon.
        interleaved, seq_dim, rotary_dim: as for :func:`rope` (channels past
            ``rotary_dim`` are normalized, not rotated).
        quantize: as for :func:`rope_qk`: q and k for 8-bit attention, as an
            :class:`~compile_ops.Int8QK`, from the same kernel.

    Returns:
        ``(q_out, k_out)`` in q's and k's shapes and dtype, contiguous: the norm
        and the rotation in fp32, rounded once (diffusers rounds the norm's
        output to the weight's dtype before rotating). With ``quantize``, an
        :class:`~compile_ops.Int8QK`.
    """
    if quantize:
        return Int8QK(*_qk_rope_int8_op(q, k, q_weight, k_weight, cos, sin, eps, interleaved, seq_dim, rotary_dim))
    return _qk_norm_rope_op(q, k, q_weight, k_weight, cos, sin, eps, interleaved, seq_dim, rotary_dim)
