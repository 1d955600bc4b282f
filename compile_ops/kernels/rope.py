"""Triton kernel of the RoPE family: one kernel for both pair conventions, full
or half tables, partial rotary dims, the forward and its transpose (backward).

Each program takes ``BLOCK_M`` rows (one row = one head's D channels at one
position) of x viewed as ``[B, N1, N2, D]`` with any strides; the position is
index 1 or 2 (``SEQ_DIM``). Pair ``i`` is ``(i, i + R/2)`` or, ``INTERLEAVED``,
``(2i, 2i + 1)``; a full table is read at each member's own column (diffusers'
tables repeat each angle, but nothing here assumes it), a ``HALF_TABLE`` at
column ``i``. Channels past R are copied. Output rows are contiguous.
"""
import triton
import triton.language as tl


@triton.jit
def _members(i, R: tl.constexpr, INTERLEAVED: tl.constexpr):
    if INTERLEAVED:
        return 2 * i, 2 * i + 1
    else:
        return i, i + R // 2


@triton.jit
def rope_kernel(
    X, COS, SIN, OUT,
    n_rows, N1, N2, D,
    stride_b, stride_1, stride_2, stride_d, stride_tb, stride_tl,
    R: tl.constexpr, SEQ_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, HALF_TABLE: tl.constexpr,
    INVERSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """OUT = rotate(X) by the angles in COS/SIN (INVERSE: by their negatives, the
    transpose, which is the backward of the forward rotation)."""
    rows = tl.cast(tl.program_id(0), tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    i2 = rows % N2
    t = rows // N2
    i1 = t % N1
    b = t // N1
    x_row = b * stride_b + i1 * stride_1 + i2 * stride_2
    pos = i1 if SEQ_DIM == 1 else i2
    t_row = b * stride_tb + pos * stride_tl

    pairs = tl.arange(0, BLOCK_P)
    mask = row_mask[:, None] & (pairs < R // 2)[None, :]
    f, g = _members(pairs, R, INTERLEAVED)
    x1 = tl.load(X + x_row[:, None] + (f * stride_d)[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_row[:, None] + (g * stride_d)[None, :], mask=mask, other=0.0).to(tl.float32)
    if HALF_TABLE:
        c1 = tl.load(COS + t_row[:, None] + pairs[None, :], mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + t_row[:, None] + pairs[None, :], mask=mask, other=0.0).to(tl.float32)
        c2, s2 = c1, s1
    else:
        c1 = tl.load(COS + t_row[:, None] + f[None, :], mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + t_row[:, None] + f[None, :], mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(COS + t_row[:, None] + g[None, :], mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + t_row[:, None] + g[None, :], mask=mask, other=0.0).to(tl.float32)
    if INVERSE:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    out_row = rows * D
    tl.store(OUT + out_row[:, None] + f[None, :], y1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + out_row[:, None] + g[None, :], y2.to(OUT.dtype.element_ty), mask=mask)
    if BLOCK_T > 0:  # channels past the rotary dim pass through
        tail = R + tl.arange(0, BLOCK_T)
        tail_mask = row_mask[:, None] & (tail < D)[None, :]
        v = tl.load(X + x_row[:, None] + (tail * stride_d)[None, :], mask=tail_mask, other=0.0)
        tl.store(OUT + out_row[:, None] + tail[None, :], v, mask=tail_mask)
