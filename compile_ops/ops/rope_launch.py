"""The RoPE family's launchers: :func:`launch_forward` fills the outputs of
every rotation op (``rope``, ``rope_qk``, ``rope_grid``, ``qk_norm_rope``,
``qk_rope_int8``) from its fake, :func:`launch_backward` those of
``qk_norm_rope_backward``; the launch shapes (positions and heads a program,
warps) are chosen here."""

from typing import Optional

import torch
import triton
from torch import Tensor

from compile_ops import meta, reference
from compile_ops._library import launcher, multiprocessor_count
from compile_ops.kernels.rope import rope_kernel
from compile_ops.kernels.rope_backward import qk_norm_rope_bwd_kernel
from compile_ops.meta._validate import accumulation_dtype
from compile_ops.meta.modulate import static_int
from compile_ops.ops._launch import acc_dtype, column_sum

#: Channels of one head-row tile per program (positions x head dim).
TILE = 2048
#: Programs per SM the head split aims for: a program loops over its heads, and
#: a few programs per SM keep enough loads in flight.
PROGRAMS_PER_SM = 4
NUM_WARPS = 4
#: The forward's program with a norm over every head (``NORM`` 2): half the
#: channels of a head-row tile and twice the warps, so that each thread holds
#: fewer of the values the second read of the heads finds in cache
#: (docs/notes/rope.md, "Positions a program for the norm over the heads").
WHOLE_ROW_TILE = TILE // 2
WHOLE_ROW_WARPS = 8


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


def launch_forward(
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
    if quantize:
        block_l, warps = reference.attention.INT8_KEY_BLOCK, None
    elif norm == 2:
        block_l, warps = max(1, WHOLE_ROW_TILE // triton.next_power_of_2(d)), WHOLE_ROW_WARPS
    else:
        block_l, warps = None, NUM_WARPS
    block_l, n_pos_blocks, heads_per_program, grid = _grid(q, hq + hk, seq_dim, d, block_l, whole_rows=norm == 2)
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
        num_warps=_quantize_warps(block_l, pairs["BLOCK_P"]) if quantize else warps,
    )


def launch_backward(inputs: tuple, outputs: tuple) -> None:
    """Fill ``qk_norm_rope_backward``'s ``outputs`` (``dq``, ``dk``, ``dq_weight``,
    ``dk_weight``, from its fake) for its ``inputs`` (``grad_q, grad_k, q, k,
    q_weight, k_weight, cos, sin, eps, interleaved, seq_dim, rotary_dim``): the
    kernel's partial rows of the weights' gradients a program, then their
    column sums."""
    grad_q, grad_k, q, k, q_weight, k_weight, cos, sin, eps, interleaved, seq_dim, rotary_dim = inputs
    dq, dk, dq_weight, dk_weight = outputs
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
