"""Triton kernels of the RoPE family.

One forward kernel serves ``fused.rope``, ``fused.rope_qk``, ``fused.rope_grid``
and the forward of ``fused.qk_norm_rope``; one backward kernel serves
``qk_norm_rope`` (plain rotations are their own backward: the same forward
kernel with ``INVERSE``, the transpose).

Work split: a program owns ``BLOCK_L`` positions of one batch element and a
range of heads (q's heads first, then k's). It gets the angles of its positions
once, into registers, and loops over its heads: the angle tile (1 KB per
position for diffusers' full fp32 tables, more than a bf16 head row) is read or
computed once per program instead of once per head, and q and k share it.

Pairs: pair ``p`` is channels ``(2p, 2p + 1)`` (``INTERLEAVED``) or ``(p, p + R/2)``.
Angles: a full table ``[.., L, R]`` read at each member's own column
(diffusers' tables repeat each angle, but nothing here assumes it), a
``HALF_TABLE`` ``[.., L, R/2]`` read at column ``p``, or ``GRID_ANGLES``:
computed from the token's (frame, row, column) position and per-pair
constants, with no table.

No module-level constexprs: Inductor copies a user kernel's source into its
generated code, and globals of the kernel's module do not come along.
Channels past R pass through (``NORM``: normalized and weighted like the rest).
"""
import triton
import triton.language as tl

from compile_ops.kernels.attention_common import INT8_MAX, quantization_scale, round_to_int8
from compile_ops.kernels.norm import _div_exact, _rsqrt_exact


@triton.jit
def _two_sum(a, b):
    """``a + b`` rounded, and its exact rounding error (Knuth; no branch)."""
    s = a + b
    b_part = s - a
    return s, (a - (s - b_part)) + (b - b_part)


@triton.jit
def _load_pairs(rows, stride_c, p, mask, R: tl.constexpr, INTERLEAVED: tl.constexpr, PACKED: tl.constexpr,
                ACC: tl.constexpr):
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
        words = first.to(dtype).to(tl.uint8, bitcast=True).to(tl.uint16) \
            | (second.to(dtype).to(tl.uint8, bitcast=True).to(tl.uint16) << 8)
    elif dtype.primitive_bitwidth == 16:
        words = first.to(dtype).to(tl.uint16, bitcast=True).to(tl.uint32) \
            | (second.to(dtype).to(tl.uint16, bitcast=True).to(tl.uint32) << 16)
    else:
        words = first.to(dtype).to(tl.uint32, bitcast=True).to(tl.uint64) \
            | (second.to(dtype).to(tl.uint32, bitcast=True).to(tl.uint64) << 32)
    return words


@triton.jit
def _store_pairs(rows, p, mask, first, second, R: tl.constexpr, INTERLEAVED: tl.constexpr):
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
def _angles(COS, SIN, b, pos, pos_mask, p, stride_tb, stride_tl, frame_size, width,
            R: tl.constexpr, INTERLEAVED: tl.constexpr, HALF_TABLE: tl.constexpr, GRID_ANGLES: tl.constexpr,
            ACC: tl.constexpr):
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
            c1, c2 = _load_pairs(COS + offset, 1, p, mask, R, INTERLEAVED, True, ACC)
            s1, s2 = _load_pairs(SIN + offset, 1, p, mask, R, INTERLEAVED, True, ACC)
    return c1, s1, c2, s2


@triton.jit
def _rotate(x1, x2, c1, s1, c2, s2, INVERSE: tl.constexpr):
    """The rotation of pairs (x1, x2), or its transpose (the backward)."""
    if INVERSE:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    return y1, y2


@triton.jit
def _program_block(L, n_pos_blocks, heads_per_program, BLOCK_L: tl.constexpr):
    """This program's batch element, positions [BLOCK_L] and their mask, and
    first head (in q's heads, then k's): the grid both kernels share."""
    pid = tl.program_id(0)
    b = tl.cast(pid // n_pos_blocks, tl.int64)
    pos = tl.cast(pid % n_pos_blocks, tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)
    return b, pos, pos < L, tl.program_id(1) * heads_per_program


@triton.jit
def _load_tail(rows, stride_c, tail, tail_mask):
    """Channels past the rotary dim of the rows at pointers ``rows``."""
    return tl.load(rows[:, None] + (tail * stride_c)[None, :], mask=tail_mask, other=0.0)


@triton.jit
def _head_range(first_head, n_heads_before, n_heads, heads_per_program):
    """This program's heads of one tensor whose heads come after
    ``n_heads_before`` heads of the other in the combined head order."""
    start = tl.maximum(first_head - n_heads_before, 0)
    end = tl.minimum(first_head + heads_per_program - n_heads_before, n_heads)
    return start, end


@triton.jit
def _rstd(x1, x2, t, D, eps, BLOCK_T: tl.constexpr):
    squares = tl.sum(x1 * x1 + x2 * x2, axis=1)
    if BLOCK_T > 0:
        squares += tl.sum(t * t, axis=1)
    # eps arrives as fp64 from Inductor's launch (fp32 from triton's): cast, or
    # the whole row's arithmetic is promoted to fp64.
    return _rsqrt_exact(_div_exact(squares, D) + tl.cast(eps, squares.dtype))


@triton.jit
def _weights(W, p, tail, D, R: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_T: tl.constexpr,
             ACC: tl.constexpr):
    """The norm weight as [1, BLOCK_P] pair tiles and a [1, BLOCK_T] tail tile."""
    w1, w2 = _load_pairs(W + tl.zeros([1], tl.int64), 1, p, (p < R // 2)[None, :], R, INTERLEAVED, True, ACC)
    w_tail = tl.load(W + tail, mask=tail < D, other=0.0).to(ACC)[None, :]
    return w1, w2, w_tail


@triton.jit
def _normed_rotated(x_row, stride_xd, p, mask, tail, tail_mask, w1, w2, w_tail, c1, s1, c2, s2, D, eps,
                    R: tl.constexpr, INTERLEAVED: tl.constexpr, PACKED: tl.constexpr, NORM: tl.constexpr,
                    INVERSE: tl.constexpr, BLOCK_T: tl.constexpr, ACC: tl.constexpr):
    """One head's rows at pointers ``x_row`` [BLOCK_L]: (RMS-normalized with
    weight, then) rotated, in ACC: pair tiles ``(y1, y2)`` and the tail (y1
    itself when there is no tail)."""
    x1, x2 = _load_pairs(x_row, stride_xd, p, mask, R, INTERLEAVED, PACKED, ACC)
    if BLOCK_T > 0:
        t = _load_tail(x_row, stride_xd, tail, tail_mask).to(ACC)
    else:
        t = x1  # no tail: a placeholder _rstd ignores
    if NORM:
        rstd = _rstd(x1, x2, t, D, eps, BLOCK_T)[:, None]
        x1 = x1 * rstd * w1
        x2 = x2 * rstd * w2
        if BLOCK_T > 0:
            t = t * rstd * w_tail
    y1, y2 = _rotate(x1, x2, c1, s1, c2, s2, INVERSE)
    if BLOCK_T == 0:
        t = y1
    return y1, y2, t


@triton.jit
def _abs_max(y1, y2, t, BLOCK_T: tl.constexpr):
    """The largest magnitude of each row of the pair tiles and the tail."""
    amax = tl.maximum(tl.max(tl.abs(y1), 1), tl.max(tl.abs(y2), 1))
    if BLOCK_T > 0:
        amax = tl.maximum(amax, tl.max(tl.abs(t), 1))
    return amax


@triton.jit
def _rotate_heads(X, OUT, W, h_start, h_end, b, pos, pos_mask, p, c1, s1, c2, s2,
                  stride_xb, stride_xl, stride_xh, stride_xd, stride_ob, stride_ol, stride_oh, D, eps,
                  SCALE, stride_sb, stride_sh, K_SUM, stride_mb, stride_mh, block, L,
                  R: tl.constexpr, INTERLEAVED: tl.constexpr, PACKED: tl.constexpr, NORM: tl.constexpr,
                  INVERSE: tl.constexpr, BLOCK_T: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr):
    """Heads [h_start, h_end) of X at positions ``pos`` (position block
    ``block``): (RMS-normalize with weight W, then) rotate, and by ``MODE``:

    - 0: store into OUT (unit channel stride), in OUT's dtype.
    - 1: the column sums of the result rounded to X's dtype, one fp32 row
      per (batch, head, block) of OUT (``stride_ol`` its block stride): the
      partials of k's mean for 8-bit attention's smoothing.
    - 2: q of 8-bit attention: the result rounded to X's dtype, in INT8 with
      one scale per row into SCALE (``[B, H, L]`` by strides, unit position
      stride), as ``reference.attention.quantize_int8``.
    - 3: k of 8-bit attention: the same less its mean (K_SUM's column sums
      / L, ``[B, H, D]`` by strides), in INT8 with one scale for the block
      (``BLOCK_L = INT8_KEY_BLOCK`` positions; SCALE ``[B, H, blocks]``)."""
    mask = pos_mask[:, None] & (p < R // 2)[None, :]
    tail = R + tl.arange(0, BLOCK_T if BLOCK_T > 0 else 1)
    tail_mask = pos_mask[:, None] & (tail < D)[None, :]
    x_rows = X + b * stride_xb + pos * stride_xl
    out_rows = OUT + b * stride_ob + pos * stride_ol
    if NORM:
        w1, w2, w_tail = _weights(W, p, tail, D, R, INTERLEAVED, BLOCK_T, ACC)
    else:
        w1, w2, w_tail = c1, c2, c1  # unused
    for h in range(h_start, h_end):
        head = tl.cast(h, tl.int64)
        y1, y2, t = _normed_rotated(x_rows + head * stride_xh, stride_xd, p, mask, tail, tail_mask,
                                    w1, w2, w_tail, c1, s1, c2, s2, D, eps,
                                    R, INTERLEAVED, PACKED, NORM, INVERSE, BLOCK_T, ACC)
        rows = out_rows + head * stride_oh  # MODE 0, 2, 3: this head's output rows
        if MODE != 0:
            # What the 16-bit op would have stored: the quantization's input.
            x_dtype = X.dtype.element_ty
            y1 = tl.where(mask, y1.to(x_dtype).to(ACC), 0.0)
            y2 = tl.where(mask, y2.to(x_dtype).to(ACC), 0.0)
            t = tl.where(tail_mask, t.to(x_dtype).to(ACC), 0.0)
        if MODE == 1:
            sums = OUT + b * stride_ob + block * stride_ol + head * stride_oh + tl.zeros([1], tl.int64)
            _store_pairs(sums, p, (p < R // 2)[None, :], tl.sum(y1, 0)[None, :], tl.sum(y2, 0)[None, :],
                         R, INTERLEAVED)
            if BLOCK_T > 0:
                tl.store(sums + tail, tl.sum(t, 0), mask=tail < D)
        if MODE == 2:
            scale, inverse = quantization_scale(_abs_max(y1, y2, t, BLOCK_T), INT8_MAX)
            tl.store(SCALE + b * stride_sb + head * stride_sh + pos, scale, mask=pos_mask)
            inverse = inverse[:, None]
        if MODE == 3:
            mean_row = K_SUM + b * stride_mb + head * stride_mh + tl.zeros([1], tl.int64)
            length = tl.cast(L, ACC)  # (tl.cast: Inductor may pass L as a Python int constant)
            m1, m2 = _load_pairs(mean_row, 1, p, (p < R // 2)[None, :], R, INTERLEAVED, True, ACC)
            y1 = tl.where(mask, y1 - tl.div_rn(m1, length), 0.0)
            y2 = tl.where(mask, y2 - tl.div_rn(m2, length), 0.0)
            if BLOCK_T > 0:
                m_tail = tl.load(mean_row + tail, mask=tail < D, other=0.0)[None, :]
                t = tl.where(tail_mask, t - tl.div_rn(m_tail, length), 0.0)
            scale, inverse = quantization_scale(tl.max(_abs_max(y1, y2, t, BLOCK_T), 0), INT8_MAX)
            tl.store(SCALE + b * stride_sb + head * stride_sh + block, scale)
        if MODE >= 2:
            y1 = round_to_int8(y1, inverse)
            y2 = round_to_int8(y2, inverse)
            if BLOCK_T > 0:
                t = round_to_int8(t, inverse)
        if MODE != 1:
            _store_pairs(rows, p, mask, y1, y2, R, INTERLEAVED)
            if BLOCK_T > 0:
                tl.store(rows[:, None] + tail[None, :], t.to(OUT.dtype.element_ty), mask=tail_mask)


@triton.jit
def rope_kernel(
    Q, K, Q_OUT, K_OUT, COS, SIN, Q_W, K_W, Q_SCALE, K_SCALE, K_SUM,
    L, HQ, HK, D, n_pos_blocks, heads_per_program,
    stride_qb, stride_ql, stride_qh, stride_qd, stride_kb, stride_kl, stride_kh, stride_kd,
    stride_oqb, stride_oql, stride_oqh, stride_okb, stride_okl, stride_okh,
    stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_mb, stride_mh,
    stride_tb, stride_tl, frame_size, width, eps,
    R: tl.constexpr, INTERLEAVED: tl.constexpr, PACKED: tl.constexpr, HALF_TABLE: tl.constexpr,
    GRID_ANGLES: tl.constexpr, NORM: tl.constexpr, INVERSE: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, ACC: tl.constexpr, QUANTIZE: tl.constexpr,
):
    """Q_OUT, K_OUT = rotate([rmsnorm]Q), rotate([rmsnorm]K) (``INVERSE``: by the
    negated angles). Tensors are addressed by (batch, position, head, channel)
    strides, so either layout and any strides work; HK = 0 rotates Q alone.

    ``QUANTIZE`` (8-bit attention's operands, ``BLOCK_L = INT8_KEY_BLOCK``;
    ``_rotate_heads`` has the details): 1, Q's column sums per position block
    into Q_OUT (fp32 rows addressed as (batch, block, head) by strides; the
    launcher's buffer is ``[blocks, B, H, D]``; run on k alone, HK = 0); 2, Q_OUT
    and K_OUT are INT8, q with a scale per row (Q_SCALE), k smoothed by the
    mean of K_SUM's sums with one scale per block (K_SCALE)."""
    b, pos, pos_mask, first_head = _program_block(L, n_pos_blocks, heads_per_program, BLOCK_L)
    block = tl.program_id(0) % n_pos_blocks
    p = tl.arange(0, BLOCK_P)
    c1, s1, c2, s2 = _angles(COS, SIN, b, pos, pos_mask, p, stride_tb, stride_tl, frame_size, width,
                             R, INTERLEAVED, HALF_TABLE, GRID_ANGLES, ACC)
    start, end = _head_range(first_head, 0, HQ, heads_per_program)
    _rotate_heads(Q, Q_OUT, Q_W, start, end, b, pos, pos_mask, p, c1, s1, c2, s2,
                  stride_qb, stride_ql, stride_qh, stride_qd, stride_oqb, stride_oql, stride_oqh, D, eps,
                  Q_SCALE, stride_qsb, stride_qsh, K_SUM, 0, 0, block, L,
                  R, INTERLEAVED, PACKED, NORM, INVERSE, BLOCK_T, ACC, QUANTIZE)
    start, end = _head_range(first_head, HQ, HK, heads_per_program)
    _rotate_heads(K, K_OUT, K_W, start, end, b, pos, pos_mask, p, c1, s1, c2, s2,
                  stride_kb, stride_kl, stride_kh, stride_kd, stride_okb, stride_okl, stride_okh, D, eps,
                  K_SCALE, stride_ksb, stride_ksh, K_SUM, stride_mb, stride_mh, block, L,
                  R, INTERLEAVED, PACKED, NORM, INVERSE, BLOCK_T, ACC, 3 if QUANTIZE == 2 else 0)


@triton.jit
def _norm_rope_grad_heads(X, G, DX, DW_PART, W, h_start, h_end, b, pos, pos_mask, p, c1, s1, c2, s2,
                          stride_xb, stride_xl, stride_xh, stride_xd, stride_gb, stride_gl, stride_gh,
                          stride_gd, stride_ob, stride_ol, stride_oh, D, eps,
                          R: tl.constexpr, INTERLEAVED: tl.constexpr, PACKED: tl.constexpr,
                          BLOCK_T: tl.constexpr, ACC: tl.constexpr):
    """dx of heads [h_start, h_end) of ``rotate(rmsnorm(x) * w)`` given its
    gradient G, and this program's partial sum of dw, one row of DW_PART."""
    mask = pos_mask[:, None] & (p < R // 2)[None, :]
    tail = R + tl.arange(0, BLOCK_T if BLOCK_T > 0 else 1)
    tail_mask = pos_mask[:, None] & (tail < D)[None, :]
    x_rows = X + b * stride_xb + pos * stride_xl
    g_rows = G + b * stride_gb + pos * stride_gl
    out_rows = DX + b * stride_ob + pos * stride_ol
    w1, w2, w_tail = _weights(W, p, tail, D, R, INTERLEAVED, BLOCK_T, ACC)
    dw1 = tl.zeros(mask.shape, ACC)
    dw2 = tl.zeros(mask.shape, ACC)
    dw_tail = tl.zeros(tail_mask.shape, ACC)
    for h in range(h_start, h_end):
        head = tl.cast(h, tl.int64)
        x1, x2 = _load_pairs(x_rows + head * stride_xh, stride_xd, p, mask, R, INTERLEAVED, PACKED, ACC)
        g1, g2 = _load_pairs(g_rows + head * stride_gh, stride_gd, p, mask, R, INTERLEAVED, PACKED, ACC)
        dz1, dz2 = _rotate(g1, g2, c1, s1, c2, s2, True)  # the rotation's transpose
        if BLOCK_T > 0:
            t = _load_tail(x_rows + head * stride_xh, stride_xd, tail, tail_mask).to(ACC)
            dz_tail = _load_tail(g_rows + head * stride_gh, stride_gd, tail, tail_mask).to(ACC)
        else:
            t = x1
        rstd = _rstd(x1, x2, t, D, eps, BLOCK_T)[:, None]
        xhat1 = x1 * rstd
        xhat2 = x2 * rstd
        dw1 += dz1 * xhat1
        dw2 += dz2 * xhat2
        wdz1 = dz1 * w1
        wdz2 = dz2 * w2
        dot = tl.sum(wdz1 * xhat1 + wdz2 * xhat2, axis=1)
        if BLOCK_T > 0:
            xhat_tail = t * rstd
            dw_tail += dz_tail * xhat_tail
            wdz_tail = dz_tail * w_tail
            dot += tl.sum(wdz_tail * xhat_tail, axis=1)
        c = _div_exact(dot, D)[:, None]  # triton's fp32 "/" is ~2 ulps off: seen in dk on the GPU
        rows = out_rows + head * stride_oh
        _store_pairs(rows, p, mask, rstd * (wdz1 - xhat1 * c), rstd * (wdz2 - xhat2 * c), R, INTERLEAVED)
        if BLOCK_T > 0:
            tl.store(rows[:, None] + tail[None, :], (rstd * (wdz_tail - xhat_tail * c)).to(DX.dtype.element_ty),
                     mask=tail_mask)
    # One partial row per program: reduced over programs in a fixed order later.
    p_mask = p < R // 2
    _store_pairs(DW_PART + tl.zeros([1], tl.int64), p, p_mask[None, :], tl.sum(dw1, axis=0)[None, :],
                 tl.sum(dw2, axis=0)[None, :], R, INTERLEAVED)
    if BLOCK_T > 0:
        tl.store(DW_PART + tail, tl.sum(dw_tail, axis=0), mask=tail < D)


@triton.jit
def qk_norm_rope_bwd_kernel(
    Q, K, GQ, GK, DQ, DK, DQW_PART, DKW_PART, COS, SIN, Q_W, K_W,
    L, HQ, HK, D, n_pos_blocks, heads_per_program,
    stride_qb, stride_ql, stride_qh, stride_qd, stride_kb, stride_kl, stride_kh, stride_kd,
    stride_gqb, stride_gql, stride_gqh, stride_gqd, stride_gkb, stride_gkl, stride_gkh, stride_gkd,
    stride_oqb, stride_oql, stride_oqh, stride_okb, stride_okl, stride_okh,
    stride_tb, stride_tl, eps,
    R: tl.constexpr, INTERLEAVED: tl.constexpr, PACKED: tl.constexpr, HALF_TABLE: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, ACC: tl.constexpr,
):
    """dq, dk and per-program partial rows of dq_weight, dk_weight of
    ``rotate(rmsnorm(q) * q_weight), rotate(rmsnorm(k) * k_weight)``; the grid
    and addressing are rope_kernel's, rstd is recomputed from the row in registers."""
    b, pos, pos_mask, first_head = _program_block(L, n_pos_blocks, heads_per_program, BLOCK_L)
    part_row = (tl.cast(tl.program_id(0), tl.int64) * tl.num_programs(1) + tl.program_id(1)) * D
    p = tl.arange(0, BLOCK_P)
    c1, s1, c2, s2 = _angles(COS, SIN, b, pos, pos_mask, p, stride_tb, stride_tl, 1, 1,
                             R, INTERLEAVED, HALF_TABLE, False, ACC)
    start, end = _head_range(first_head, 0, HQ, heads_per_program)
    _norm_rope_grad_heads(Q, GQ, DQ, DQW_PART + part_row, Q_W, start, end, b, pos, pos_mask, p,
                          c1, s1, c2, s2, stride_qb, stride_ql, stride_qh, stride_qd,
                          stride_gqb, stride_gql, stride_gqh, stride_gqd, stride_oqb, stride_oql, stride_oqh,
                          D, eps, R, INTERLEAVED, PACKED, BLOCK_T, ACC)
    start, end = _head_range(first_head, HQ, HK, heads_per_program)
    _norm_rope_grad_heads(K, GK, DK, DKW_PART + part_row, K_W, start, end, b, pos, pos_mask, p,
                          c1, s1, c2, s2, stride_kb, stride_kl, stride_kh, stride_kd,
                          stride_gkb, stride_gkl, stride_gkh, stride_gkd, stride_okb, stride_okl, stride_okh,
                          D, eps, R, INTERLEAVED, PACKED, BLOCK_T, ACC)
