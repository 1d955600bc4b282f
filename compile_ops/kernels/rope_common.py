"""Triton helpers the RoPE kernels share (kernels/rope.py, kernels/rope_backward.py).

Pairs: pair ``p`` is channels ``(2p, 2p + 1)`` (``INTERLEAVED``) or ``(p, p + R/2)``.
Angles: a full table ``[.., L, R]`` read at each member's own column
(diffusers' tables repeat each angle, but nothing here assumes it), a
``HALF_TABLE`` ``[.., L, R/2]`` read at column ``p``, or ``GRID_ANGLES``:
computed from the token's (frame, row, column) position and per-pair
constants, with no table.

No module-level constexprs: Inductor copies a user kernel's source into its
generated code, and globals of the kernel's module do not come along.
"""

import triton
import triton.language as tl

from compile_ops.kernels.norm import _div_exact, _rsqrt_exact


@triton.jit
def _two_sum(a, b):
    """``a + b`` rounded, and its exact rounding error (Knuth; no branch)."""
    s = a + b
    b_part = s - a
    return s, (a - (s - b_part)) + (b - b_part)


@triton.jit
def load_pairs(
    rows, stride_c, p, mask, R: tl.constexpr, INTERLEAVED: tl.constexpr, PACKED: tl.constexpr, ACC: tl.constexpr
):
    """Both members of pairs ``p`` [BLOCK_P] of the rows at pointers ``rows``
    [BLOCK_L]: two [BLOCK_L, BLOCK_P] tiles in ACC.

    ``PACKED`` (interleaved, unit channel stride, rows aligned to two
    elements): each pair is read as one integer word and split with shifts.
    Deinterleaving in registers instead (``tl.split`` of the row, or of a
    [.., 2] load) is well short of the half-split layout's two plain loads
    (docs/notes/rope.md)."""
    if INTERLEAVED and PACKED and rows.dtype.element_ty.primitive_bitwidth < 64:
        words = tl.load(_word_pointers(rows)[:, None] + p[None, :], mask=mask, other=0)
        first, second = _unpack(words, rows.dtype.element_ty)
        first = first.to(ACC)
        second = second.to(ACC)
    elif INTERLEAVED:
        first = tl.load(rows[:, None] + (2 * p * stride_c)[None, :], mask=mask, other=0.0).to(ACC)
        second = tl.load(rows[:, None] + ((2 * p + 1) * stride_c)[None, :], mask=mask, other=0.0).to(ACC)
    else:
        first = tl.load(rows[:, None] + (p * stride_c)[None, :], mask=mask, other=0.0).to(ACC)
        second = tl.load(rows[:, None] + ((p + R // 2) * stride_c)[None, :], mask=mask, other=0.0).to(ACC)
    return first, second


@triton.jit
def _word_pointers(rows):
    """Pointers to the pair words of 8-, 16- or 32-bit rows."""
    if rows.dtype.element_ty.primitive_bitwidth == 8:
        return rows.to(tl.pointer_type(tl.uint16))
    elif rows.dtype.element_ty.primitive_bitwidth == 16:
        return rows.to(tl.pointer_type(tl.uint32))
    else:
        return rows.to(tl.pointer_type(tl.uint64))


@triton.jit
def _unpack(words, dtype: tl.constexpr):
    """The two floats of ``dtype`` in each pair word, low half first."""
    if dtype.primitive_bitwidth == 16:
        first = words.to(tl.uint16).to(dtype, bitcast=True)
        second = (words >> 16).to(tl.uint16).to(dtype, bitcast=True)
    else:
        first = words.to(tl.uint32).to(dtype, bitcast=True)
        second = (words >> 32).to(tl.uint32).to(dtype, bitcast=True)
    return first, second


@triton.jit
def _pack(first, second, dtype: tl.constexpr):
    if dtype.primitive_bitwidth == 8:  # int8 pairs of the quantizing mode
        words = first.to(dtype).to(tl.uint8, bitcast=True).to(tl.uint16) | (
            second.to(dtype).to(tl.uint8, bitcast=True).to(tl.uint16) << 8
        )
    elif dtype.primitive_bitwidth == 16:
        words = first.to(dtype).to(tl.uint16, bitcast=True).to(tl.uint32) | (
            second.to(dtype).to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        )
    else:
        words = first.to(dtype).to(tl.uint32, bitcast=True).to(tl.uint64) | (
            second.to(dtype).to(tl.uint32, bitcast=True).to(tl.uint64) << 32
        )
    return words


@triton.jit
def store_pairs(rows, p, mask, first, second, R: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Store both members of pairs ``p`` to rows with unit channel stride,
    aligned to two elements (fresh outputs and buffers)."""
    dtype = rows.dtype.element_ty
    if INTERLEAVED and dtype.primitive_bitwidth < 64:
        tl.store(_word_pointers(rows)[:, None] + p[None, :], _pack(first, second, dtype), mask=mask)
    elif INTERLEAVED:
        tl.store(rows[:, None] + (2 * p)[None, :], first.to(dtype), mask=mask)
        tl.store(rows[:, None] + (2 * p + 1)[None, :], second.to(dtype), mask=mask)
    else:
        tl.store(rows[:, None] + p[None, :], first.to(dtype), mask=mask)
        tl.store(rows[:, None] + (p + R // 2)[None, :], second.to(dtype), mask=mask)


@triton.jit
def _grid_angle_cos_sin(CONSTS, pos, p, frame_size, width, R: tl.constexpr, ACC: tl.constexpr):
    """cos and sin of ``idx[axis[p]] * slope[p] + intercept[p]`` for token
    positions ``pos`` of a (frames, rows of ``width``) grid with ``frame_size``
    tokens per frame.

    The angle is carried as an fp32 head plus an error term: a video's angles
    reach hundreds of radians (LTX: 15708), where one fp32 rounding is ~1e-5
    (~1e-3) of error, far above a table built in fp64. The slope comes in three
    parts, the first two of 12 significant bits, so that ``idx * part`` is exact
    for an index below 4096 (the launcher checks); the sums are error-free
    transformations; the error term is folded in to first order,
    cos(a + e) = cos(a) - e sin(a). No fma: the interpreter rounds one.
    """
    n_pairs: tl.constexpr = R // 2
    pm = p < n_pairs
    # Rows of the constants: meta.rope.GRID_CONSTANT_ROWS.
    slope_1 = tl.load(CONSTS + 0 * n_pairs + p, mask=pm, other=0.0).to(ACC)[None, :]
    slope_2 = tl.load(CONSTS + 1 * n_pairs + p, mask=pm, other=0.0).to(ACC)[None, :]
    slope_3 = tl.load(CONSTS + 2 * n_pairs + p, mask=pm, other=0.0).to(ACC)[None, :]
    icpt_hi = tl.load(CONSTS + 3 * n_pairs + p, mask=pm, other=0.0).to(ACC)[None, :]
    icpt_lo = tl.load(CONSTS + 4 * n_pairs + p, mask=pm, other=0.0).to(ACC)[None, :]
    axis = tl.load(CONSTS + 5 * n_pairs + p, mask=pm, other=0.0)[None, :]
    frame = pos // frame_size
    row = (pos - frame * frame_size) // width
    col = pos - frame * frame_size - row * width
    idx = tl.where(axis == 0, frame[:, None], tl.where(axis == 1, row[:, None], col[:, None])).to(ACC)
    angle, err_1 = _two_sum(idx * slope_1, icpt_hi)
    angle, err_2 = _two_sum(angle, idx * slope_2)
    err = err_1 + err_2 + idx * slope_3 + icpt_lo
    c = tl.cos(angle)
    s = tl.sin(angle)
    return c - err * s, s + err * c


@triton.jit
def angle_cos_sin(
    COS,
    SIN,
    b,
    pos,
    pos_mask,
    p,
    stride_tb,
    stride_tl,
    frame_size,
    width,
    R: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HALF_TABLE: tl.constexpr,
    GRID_ANGLES: tl.constexpr,
    ACC: tl.constexpr,
):
    """cos and sin of both members' angles at positions ``pos``: four
    [BLOCK_L, BLOCK_P] tiles ``(cos_1, sin_1, cos_2, sin_2)``. For GRID_ANGLES,
    COS holds the per-pair constants."""
    mask = pos_mask[:, None] & (p < R // 2)[None, :]
    if GRID_ANGLES:
        c, s = _grid_angle_cos_sin(COS, pos, p, frame_size, width, R, ACC)
        c1, s1, c2, s2 = c, s, c, s
    else:
        offset = b * stride_tb + pos * stride_tl
        if HALF_TABLE:
            c1 = tl.load(COS + offset[:, None] + p[None, :], mask=mask, other=0.0).to(ACC)
            s1 = tl.load(SIN + offset[:, None] + p[None, :], mask=mask, other=0.0).to(ACC)
            c2, s2 = c1, s1
        else:
            c1, c2 = load_pairs(COS + offset, 1, p, mask, R, INTERLEAVED, True, ACC)
            s1, s2 = load_pairs(SIN + offset, 1, p, mask, R, INTERLEAVED, True, ACC)
    return c1, s1, c2, s2


@triton.jit
def rotate_pairs(x1, x2, c1, s1, c2, s2, INVERSE: tl.constexpr):
    """The rotation of pairs (x1, x2), or its transpose (the backward)."""
    if INVERSE:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    return y1, y2


@triton.jit
def program_block(L, n_pos_blocks, heads_per_program, BLOCK_L: tl.constexpr):
    """This program's batch element, positions [BLOCK_L] and their mask, and
    first head (in q's heads, then k's): the grid both kernels share."""
    pid = tl.program_id(0)
    b = tl.cast(pid // n_pos_blocks, tl.int64)
    pos = tl.cast(pid % n_pos_blocks, tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)
    return b, pos, pos < L, tl.program_id(1) * heads_per_program


@triton.jit
def load_tail(rows, stride_c, tail, tail_mask):
    """Channels past the rotary dim of the rows at pointers ``rows``."""
    return tl.load(rows[:, None] + (tail * stride_c)[None, :], mask=tail_mask, other=0.0)


@triton.jit
def head_range(first_head, n_heads_before, n_heads, heads_per_program):
    """This program's heads of one tensor whose heads come after
    ``n_heads_before`` heads of the other in the combined head order."""
    start = tl.maximum(first_head - n_heads_before, 0)
    end = tl.minimum(first_head + heads_per_program - n_heads_before, n_heads)
    return start, end


@triton.jit
def row_rstd(x1, x2, t, D, eps, BLOCK_T: tl.constexpr):
    squares = tl.sum(x1 * x1 + x2 * x2, axis=1)
    if BLOCK_T > 0:
        squares += tl.sum(t * t, axis=1)
    # eps arrives as fp64 from Inductor's launch (fp32 from triton's): cast, or
    # the whole row's arithmetic is promoted to fp64.
    return _rsqrt_exact(_div_exact(squares, D) + tl.cast(eps, squares.dtype))


@triton.jit
def heads_rstd_and_dot(
    x_rows,
    g_rows,
    stride_h,
    stride_gh,
    stride_c,
    stride_gc,
    p,
    mask,
    tail,
    tail_mask,
    W,
    c1,
    s1,
    c2,
    s2,
    h_start,
    h_end,
    D,
    eps,
    R: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ACC: tl.constexpr,
    WITH_DOT: tl.constexpr,
):
    """``(rstd, dot)`` of each position's row over heads [h_start, h_end), all
    of the tensor's: an RMSNorm that spans the heads (``[H * D]`` weights W).
    WITH_DOT (the backward, G its output gradient): ``dot`` sums ``w dz x``
    over the row, ``dz`` the rotation's transpose of G, so that the row's
    ``mean(w dz xhat)`` is ``rstd * dot / (H * D)``; else it is 0."""
    squares = tl.zeros(x_rows.shape, ACC)
    dot = tl.zeros(x_rows.shape, ACC)
    for h in range(h_start, h_end):
        head = tl.cast(h, tl.int64)
        x1, x2 = load_pairs(x_rows + head * stride_h, stride_c, p, mask, R, INTERLEAVED, PACKED, ACC)
        squares += tl.sum(x1 * x1 + x2 * x2, axis=1)
        if BLOCK_T > 0:
            t = load_tail(x_rows + head * stride_h, stride_c, tail, tail_mask).to(ACC)
            squares += tl.sum(t * t, axis=1)
        if WITH_DOT:
            w1, w2, w_tail = norm_weights(W + head * D, p, tail, D, R, INTERLEAVED, BLOCK_T, ACC)
            g1, g2 = load_pairs(g_rows + head * stride_gh, stride_gc, p, mask, R, INTERLEAVED, PACKED, ACC)
            dz1, dz2 = rotate_pairs(g1, g2, c1, s1, c2, s2, True)
            dot += tl.sum(w1 * dz1 * x1 + w2 * dz2 * x2, axis=1)
            if BLOCK_T > 0:
                dz_tail = load_tail(g_rows + head * stride_gh, stride_gc, tail, tail_mask).to(ACC)
                dot += tl.sum(w_tail * dz_tail * t, axis=1)
    # eps as in row_rstd: cast, or Inductor's fp64 scalar promotes the row. A
    # program with none of this tensor's heads divides by 1, not 0 (unused).
    rstd = _rsqrt_exact(_div_exact(squares, D * tl.maximum(h_end - h_start, 1)) + tl.cast(eps, squares.dtype))
    return rstd, dot


@triton.jit
def norm_weights(W, p, tail, D, R: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_T: tl.constexpr, ACC: tl.constexpr):
    """The norm weight as [1, BLOCK_P] pair tiles and a [1, BLOCK_T] tail tile."""
    w1, w2 = load_pairs(W + tl.zeros([1], tl.int64), 1, p, (p < R // 2)[None, :], R, INTERLEAVED, True, ACC)
    w_tail = tl.load(W + tail, mask=tail < D, other=0.0).to(ACC)[None, :]
    return w1, w2, w_tail
