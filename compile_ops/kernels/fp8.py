"""Triton kernels of the fp8 family: rowwise e4m3 quantization.

The recipe is ``compile_ops/reference/fp8.py``'s, operation for operation, so
that the kernel writes the reference's bytes: the scale and its inverse are
correctly rounded fp32 divisions (triton's plain fp32 ``/`` is approximate on
NVIDIA GPUs), the product one fp32 multiply, the clamp exact, the convert
round-to-nearest-even (``cvt.rn.satfinite.e4m3x2.f32`` on sm_89+).

:func:`quantize_tile` is the piece other kernels call as an epilogue, behind
a constexpr flag so one kernel serves both output modes::

    y = ...                                   # [BLOCK_M, BLOCK_N] fp32, whole rows
    if QUANTIZE:                              # tl.constexpr
        q, scale = quantize_tile(y, mask)     # mask: [BLOCK_M, BLOCK_N] valid elements
        tl.store(Q + offsets, q, mask=mask)   # Q: *fp8e4nv
        tl.store(S + rows, scale, mask=rows < n_rows)
    else:
        tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)

A producer whose rows span several tiles (a looped kernel) accumulates
:func:`row_amax` over its tiles, takes :func:`fp8_scales` of the result, and
converts each tile with :func:`to_e4m3`, as :func:`quantize_fp8_rows_kernel`
does. :func:`quantize_fp8_rows_kernel` is the standalone pass for a tensor
that no fused producer quantized, and the activation a Linear's output goes
through before the next Linear (``ACT``: GELU, tanh GELU or SiLU of each
element, rounded to the input's dtype as the unquantized activation would
write it, then quantized): an MLP's hidden activation is read once and never
written in 16 bits.
"""
import triton
import triton.language as tl

from compile_ops.kernels.glu import activation
from compile_ops.kernels.norm import _div_exact, _tile, _tile_rows

E4M3_MAX: tl.constexpr = tl.constexpr(448.0)
AMAX_FLOOR: tl.constexpr = tl.constexpr(1e-12)
FP32_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)


@triton.jit
def row_amax(y, mask):
    """``max |y|`` of each row of a ``[BLOCK_M, BLOCK_N]`` fp32 tile over its finite
    elements inside ``mask`` (0 for none): inf and NaN never reach a scale
    (``a <= FP32_MAX`` is false for both)."""
    a = tl.abs(y)
    return tl.max(tl.where(mask & (a <= FP32_MAX), a, 0.0), axis=1)


@triton.jit
def fp8_scales(amax):
    """``(inverse, scale)`` of row maxima ``amax [BLOCK_M]`` (fp32, finite, >= 0):
    ``448 / amax`` multiplies the values, ``amax / 448`` dequantizes; both
    correctly rounded, like the reference's torch divisions (triton's plain
    fp32 ``/`` is approximate on NVIDIA GPUs)."""
    amax = tl.maximum(amax, AMAX_FLOOR)
    # _div_exact divides by a scalar; the inverse has the scalar on top.
    inverse = tl.div_rn(tl.full(amax.shape, E4M3_MAX, tl.float32), amax)
    return inverse, _div_exact(amax, E4M3_MAX)


@triton.jit
def to_e4m3(y, inverse):
    """``e4m3(clamp(y * inverse[:, None], -448, 448))``: inf saturates, NaN stays NaN."""
    v = tl.clamp(y * inverse[:, None], -E4M3_MAX, E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    return v.to(tl.float8e4nv)


@triton.jit
def quantize_tile(y, mask):
    """The FP8 epilogue: ``(q, scale)`` of ``y [BLOCK_M, BLOCK_N]`` fp32 holding
    whole rows, ``mask [BLOCK_M, BLOCK_N]`` its valid elements (the others are
    ignored; store q under the same mask). ``q [BLOCK_M, BLOCK_N]`` float8e4nv,
    ``scale [BLOCK_M]`` fp32: the bytes of ``reference.fp8.quantize_fp8_rows``."""
    inverse, scale = fp8_scales(row_amax(y, mask))
    return to_e4m3(y, inverse), scale


@triton.jit
def _load_values(X, rows, c, stride_row, stride_col, mask, ACT: tl.constexpr, EVICT: tl.constexpr):
    """The fp32 tile of values to quantize: X's elements, or with ``ACT >= 0``
    (``kernels.glu``'s codes) their activation rounded to X's dtype (masked
    elements load 0, whose activation is 0 in every mode). EVICT: the load's
    L2 eviction policy (the two-pass loop keeps its first read for the second)."""
    y = tl.load(X + _tile(rows, c, stride_row, stride_col), mask=mask, other=0.0,
                eviction_policy=EVICT).to(tl.float32)
    if ACT >= 0:
        y = activation(y, ACT, False)[0].to(X.dtype.element_ty).to(tl.float32)
    return y


@triton.jit
def _segment_amax(amax, X, rows, row_mask, cols, K, stride_row, stride_col,
                  ACT: tl.constexpr, BLOCK_N: tl.constexpr):
    """``amax`` raised to the row maxima of a ``K``-column segment of the rows."""
    for k0 in range(0, K, BLOCK_N):
        c = k0 + cols
        mask = row_mask[:, None] & (c < K)[None, :]
        y = _load_values(X, rows, c, stride_row, stride_col, mask, ACT, "evict_last")
        amax = tl.maximum(amax, row_amax(y, mask))
    return amax


@triton.jit
def _segment_store(Q, q_row_stride, q_col0, X, rows, row_mask, cols, K, stride_row, stride_col, inverse,
                   ACT: tl.constexpr, BLOCK_N: tl.constexpr):
    """The e4m3 values of a ``K``-column segment, at Q's columns from ``q_col0``."""
    for k0 in range(0, K, BLOCK_N):
        c = k0 + cols
        mask = row_mask[:, None] & (c < K)[None, :]
        y = _load_values(X, rows, c, stride_row, stride_col, mask, ACT, "evict_first")
        tl.store(Q + _tile(rows, q_col0 + c, q_row_stride, 1), to_e4m3(y, inverse), mask=mask)


@triton.jit
def quantize_fp8_rows_kernel(X, Q, S, n_rows, K, stride_row, stride_col,
                             HEAD, K_HEAD, stride_head_row, stride_head_col,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOPED: tl.constexpr,
                             ACT: tl.constexpr, HAS_HEAD: tl.constexpr, BLOCK_H: tl.constexpr = 1):
    """Q[r] = e4m3 of row r of X (of act(X) with ``ACT >= 0``), S[r] its scale.
    With HAS_HEAD the row is ``HEAD[r]`` (K_HEAD columns, as they are) followed
    by that: the quantization of a concatenation that is never written. One
    program per BLOCK_M rows. A row that fits its blocks (BLOCK_N columns of X,
    BLOCK_H of HEAD) is read once and held in registers; a wider one (LOOPED)
    takes two passes over each segment: the row maxima, then the values (the
    activation computed in each). Q and S are contiguous.

    Why the single pass goes up to 16384 columns (the launcher's choice): an
    MLP's hidden activation (Flux: 12288 wide, 3072 more of attention output
    as the head) in two passes is read twice with its activation computed
    twice, which on an H100 made this kernel 15% of an FP8 Flux step."""
    rows = _tile_rows(tl.program_id(0), BLOCK_M)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_N)
    if LOOPED:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_HEAD:
            amax = _segment_amax(amax, HEAD, rows, row_mask, cols, K_HEAD, stride_head_row, stride_head_col,
                                 -1, BLOCK_N)
        amax = _segment_amax(amax, X, rows, row_mask, cols, K, stride_row, stride_col, ACT, BLOCK_N)
        inverse, scale = fp8_scales(amax)
        if HAS_HEAD:
            _segment_store(Q, K_HEAD + K, 0, HEAD, rows, row_mask, cols, K_HEAD, stride_head_row,
                           stride_head_col, inverse, -1, BLOCK_N)
        _segment_store(Q, K_HEAD + K, K_HEAD, X, rows, row_mask, cols, K, stride_row, stride_col, inverse,
                       ACT, BLOCK_N)
    else:
        mask = row_mask[:, None] & (cols < K)[None, :]
        y = _load_values(X, rows, cols, stride_row, stride_col, mask, ACT, "")
        amax = row_amax(y, mask)
        if HAS_HEAD:
            head_cols = tl.arange(0, BLOCK_H)
            head_mask = row_mask[:, None] & (head_cols < K_HEAD)[None, :]
            h = _load_values(HEAD, rows, head_cols, stride_head_row, stride_head_col, head_mask, -1, "")
            amax = tl.maximum(amax, row_amax(h, head_mask))
        inverse, scale = fp8_scales(amax)
        if HAS_HEAD:
            tl.store(Q + _tile(rows, head_cols, K_HEAD + K, 1), to_e4m3(h, inverse), mask=head_mask)
        tl.store(Q + _tile(rows, K_HEAD + cols, K_HEAD + K, 1), to_e4m3(y, inverse), mask=mask)
    tl.store(S + rows, scale, mask=row_mask)
