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
import triton
from torch import Tensor

from compile_ops import _dtensor, meta, reference
from compile_ops._library import fused_op, launcher, multiprocessor_count, register_no_gradient
from compile_ops.kernels.rope import rope_kernel
from compile_ops.kernels.rope_backward import qk_norm_rope_bwd_kernel
from compile_ops.meta._validate import accumulation_dtype, checked_arguments
from compile_ops.meta.modulate import static_int
from compile_ops.ops._launch import acc_dtype, column_sum
from compile_ops.ops.attention import Int8QK

#: Channels of one head-row tile per program (positions x head dim).
TILE = 2048
#: Programs per SM the head split aims for: a program loops over its heads, and
#: a few programs per SM keep enough loads in flight.
PROGRAMS_PER_SM = 4
NUM_WARPS = 4


def _positions_and_heads(x: Tensor, seq_dim: int):
    """(batch, position, head, channel) strides of a ``[B, L, H, D]`` or ``[B, H, L, D]`` tensor."""
    h_dim = 3 - seq_dim
    return x.stride(0), x.stride(seq_dim), x.stride(h_dim), x.stride(3)


def _pairs_packable(*tensors: Tensor) -> bool:
    """The kernels may read each interleaved pair as one word: unit channel
    stride, every other stride and the offset even, a 16- or 32-bit dtype.
    Symbolic strides count as not packable."""
    for t in tensors:
        if t.element_size() not in (2, 4) or static_int(t.stride(-1)) != 1:
            return False
        for v in (*t.stride()[:-1], t.storage_offset()):
            v = static_int(v)
            if v is None or v % 2:
                return False
    return True


def _aligned(t: Tensor) -> Tensor:
    """``t`` contiguous and starting on an even element, as the kernels read
    tables and weights by pairs."""
    t = t.contiguous()
    offset = static_int(t.storage_offset())
    return t if offset is not None and offset % 2 == 0 else t.clone()


def _grid(q: Tensor, n_heads: int, seq_dim: int, d: int, block_l: Optional[int] = None, whole_rows: bool = False):
    """``(BLOCK_L, n_pos_blocks, heads_per_program, launch grid)``; ``block_l``
    fixes BLOCK_L (the quantizing mode's scale blocks); ``whole_rows``: every
    program holds all heads (a norm that spans them)."""
    batch, length = q.shape[0], q.shape[seq_dim]
    if block_l is None:
        block_l = max(1, min(64, TILE // triton.next_power_of_2(d)))
    n_pos_blocks = triton.cdiv(length, block_l)
    heads_per_program = n_heads
    n_pos = static_int(batch * n_pos_blocks)
    if n_pos is not None and n_pos > 0 and not whole_rows:
        # Split the heads only as far as needed to fill the GPU: every split
        # re-reads (or recomputes) the angle tile.
        splits = min(n_heads, triton.cdiv(PROGRAMS_PER_SM * multiprocessor_count(q), n_pos))
        heads_per_program = triton.cdiv(n_heads, max(1, splits))
    return block_l, n_pos_blocks, heads_per_program, (batch * n_pos_blocks, triton.cdiv(n_heads, heads_per_program))


def _tables(cos: Tensor, sin: Tensor, per_pair_constants: bool = False):
    """``(cos, sin, batch stride, position stride)`` as the kernels read tables:
    aligned to pairs, batch stride 0 for a table shared by the batch."""
    per_batch = not per_pair_constants and cos.dim() == 3 and cos.shape[0] > 1
    cos, sin = _aligned(cos), _aligned(sin)
    return cos, sin, cos.stride(0) if per_batch else 0, cos.stride(-2)


def _quantize_warps(block_l: int, block_p: int) -> int:
    """Warps of a quantizing program, which holds a whole scale block (128
    positions): more warps, not more registers per thread. With the default
    programs per SM, close to the best of a sweep over programs per SM and
    warps (docs/notes/attention-8bit.md, "q and k quantized by their rotation")."""
    return max(NUM_WARPS, min(16, block_l * block_p // 512))


def _pair_blocks(r: int, d: int) -> dict:
    """The pair and pass-through tile widths of rotary dim ``r`` in head dim ``d``."""
    return dict(BLOCK_P=triton.next_power_of_2(r // 2), BLOCK_T=triton.next_power_of_2(d - r) if d > r else 0)


def _launch_forward(
    q: Tensor,
    k: Optional[Tensor],
    q_out: Tensor,
    k_out: Optional[Tensor],
    seq_dim: int,
    r: int,
    interleaved: bool,
    half_table: bool,
    cos: Tensor,
    sin: Tensor,
    inverse: bool,
    weights=(None, None),
    eps: float = 0.0,
    grid_angles: bool = False,
    frame_size: int = 1,
    width: int = 1,
    quantize: int = 0,
    scales=(None, None),
    k_sum: Optional[Tensor] = None,
):
    """Launch rope_kernel over q (and k); with ``grid_angles``, ``cos`` holds
    the grid constants. ``quantize`` (rope_kernel's QUANTIZE): 1, q_out is
    the ``[blocks, B, H, D]`` fp32 column sums of q (k's, launched alone);
    2, q_out and k_out are INT8 with ``scales`` ``(q_scale [B, Hq, L],
    k_scale [B, Hk, blocks])`` and ``k_sum [B, Hk, D]``."""
    d = q.shape[3]
    r = int(r)  # a constexpr: a head dim made dynamic is specialized here
    hq = q.shape[3 - seq_dim]
    hk = 0 if k is None else k.shape[3 - seq_dim]
    if q.numel() == 0 and (k is None or k.numel() == 0):
        return
    q_w, k_w = (None if w is None else _aligned(w) for w in weights)
    norm = 0 if q_w is None else 2 if meta.rope.norms_span_heads(*weights, q, k) else 1
    block_l, n_pos_blocks, heads_per_program, grid = _grid(
        q, hq + hk, seq_dim, d, reference.attention.INT8_KEY_BLOCK if quantize else None, whole_rows=norm == 2
    )
    k_strides = _positions_and_heads(q if k is None else k, seq_dim)
    if quantize == 1:  # the sums [blocks, B, H, D] are addressed as (batch, block, head) rows
        q_out_strides = (q_out.stride(1), q_out.stride(0), q_out.stride(2))
    else:
        q_out_strides = _positions_and_heads(q_out, seq_dim)[:3]
    k_out_strides = q_out_strides if k is None else _positions_and_heads(k_out, seq_dim)[:3]
    if k is None:
        # No k: HK = 0 and nothing touches K/K_OUT, but K_OUT must not alias
        # Q_OUT: under functionalization each written argument becomes its own
        # clone, and an aliased pair would return the clone nothing wrote to.
        k, k_out = q, q_out.new_empty(0)
    cos, sin, stride_tb, stride_tl = _tables(cos, sin, grid_angles)
    q_scale, k_scale = scales
    scale_strides = [t.stride(i) if t is not None else 0 for t in (q_scale, k_scale, k_sum) for i in (0, 1)]
    pairs = _pair_blocks(r, d)
    launcher(rope_kernel)[grid](
        q,
        k,
        q_out,
        k_out,
        cos,
        sin,
        q if q_w is None else q_w,
        q if k_w is None else k_w,
        q_scale,
        k_scale,
        k_sum,
        q.shape[seq_dim],
        hq,
        hk,
        d,
        n_pos_blocks,
        heads_per_program,
        *_positions_and_heads(q, seq_dim),
        *k_strides,
        *q_out_strides,
        *k_out_strides,
        *scale_strides,
        stride_tb,
        stride_tl,
        frame_size,
        width,
        eps,
        R=r,
        INTERLEAVED=interleaved,
        PACKED=_pairs_packable(q, k),
        HALF_TABLE=half_table,
        GRID_ANGLES=grid_angles,
        NORM=norm,
        INVERSE=inverse,
        BLOCK_L=block_l,
        **pairs,
        ACC=acc_dtype(q),
        QUANTIZE=quantize,
        num_warps=_quantize_warps(block_l, pairs["BLOCK_P"]) if quantize else NUM_WARPS,
    )


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
    _launch_forward(x, None, out, None, seq_dim, r, interleaved, half, cos, sin, inverse)
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
    _launch_forward(q, k, q_out, k_out, seq_dim, r, interleaved, half, cos, sin, inverse)
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
    _launch_forward(
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
    _launch_forward(
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
    dq, dk, dq_weight, dk_weight = meta.rope.qk_norm_rope_backward(
        grad_q, grad_k, q, k, q_weight, k_weight, cos, sin, eps, interleaved, seq_dim, rotary_dim
    )
    r, half = meta.rope.table_layout(q, cos, rotary_dim)
    r = int(r)
    d = q.shape[3]
    hq, hk = q.shape[3 - seq_dim], k.shape[3 - seq_dim]
    spans_heads = meta.rope.norms_span_heads(q_weight, k_weight, q, k)
    block_l, n_pos_blocks, heads_per_program, grid = _grid(q, hq + hk, seq_dim, d, whole_rows=spans_heads)
    n_programs = grid[0] * grid[1]
    acc = accumulation_dtype(q)
    # One partial row of each weight's gradient per program: the weight's width.
    partial_q = torch.empty((n_programs, d * hq if spans_heads else d), dtype=acc, device=q.device)
    partial_k = torch.empty((n_programs, d * hk if spans_heads else d), dtype=acc, device=q.device)
    cos, sin, stride_tb, stride_tl = _tables(cos, sin)
    if n_programs:
        launcher(qk_norm_rope_bwd_kernel)[grid](
            q,
            k,
            grad_q,
            grad_k,
            dq,
            dk,
            partial_q,
            partial_k,
            cos,
            sin,
            _aligned(q_weight),
            _aligned(k_weight),
            q.shape[seq_dim],
            hq,
            hk,
            d,
            n_pos_blocks,
            heads_per_program,
            *_positions_and_heads(q, seq_dim),
            *_positions_and_heads(k, seq_dim),
            *_positions_and_heads(grad_q, seq_dim),
            *_positions_and_heads(grad_k, seq_dim),
            *_positions_and_heads(dq, seq_dim)[:3],
            *_positions_and_heads(dk, seq_dim)[:3],
            stride_tb,
            stride_tl,
            float(eps),
            R=r,
            INTERLEAVED=interleaved,
            PACKED=_pairs_packable(q, k, grad_q, grad_k),
            HALF_TABLE=half,
            BLOCK_L=block_l,
            **_pair_blocks(r, d),
            ACC=acc_dtype(q),
            SPANS_HEADS=spans_heads,
            num_warps=NUM_WARPS,
        )
    column_sum(partial_q, n_programs, dq_weight)
    column_sum(partial_k, n_programs, dk_weight)
    return dq, dk, dq_weight, dk_weight


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
    _launch_forward(
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
    _launch_forward(
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
