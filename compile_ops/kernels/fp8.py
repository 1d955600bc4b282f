"""Triton kernels of the fp8 family: rowwise e4m3 quantization.

The recipe is ``compile_ops/reference/fp8.py``'s, operation for operation, so
that the kernel writes the reference's bytes: the scale and its inverse are
correctly rounded fp32 divisions (triton's plain fp32 ``/`` is approximate on
NVIDIA GPUs), the product one fp32 multiply, the convert round-to-nearest-even.

:func:`quantize_tile` is the piece other kernels call as an epilogue (a
``QUANTIZE`` constexpr): a tile of whole rows in fp32 in, e4m3 values and one
scale per row out. :func:`quantize_fp8_rows_kernel` is the standalone pass for
a tensor that no fused producer quantized.
"""
import triton
import triton.language as tl

from compile_ops.kernels.norm import _tile, _tile_rows

E4M3_MAX: tl.constexpr = tl.constexpr(448.0)
AMAX_FLOOR: tl.constexpr = tl.constexpr(1e-12)
FP32_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _finite_abs(y, mask):
    """|y| where y is finite and inside the mask, else 0 (NaN compares false)."""
    a = tl.abs(y)
    return tl.where(mask & (a <= FP32_MAX), a, 0.0)


@triton.jit
def fp8_scales(amax):
    """``(inverse, scale)`` of row maxima ``amax [BLOCK_M]`` (fp32): ``448 / amax``
    multiplies the values, ``amax / 448`` dequantizes; both correctly rounded."""
    amax = tl.maximum(amax, AMAX_FLOOR)
    inverse = tl.div_rn(tl.full(amax.shape, E4M3_MAX, tl.float32), amax)
    scale = tl.div_rn(amax, tl.full(amax.shape, E4M3_MAX, tl.float32))
    return inverse, scale


@triton.jit
def to_e4m3(y, inverse):
    """``e4m3(clamp(y * inverse[:, None], -448, 448))``: inf saturates, NaN stays NaN."""
    v = tl.clamp(y * inverse[:, None], -E4M3_MAX, E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    return v.to(tl.float8e4nv)


@triton.jit
def quantize_tile(y, mask):
    """``(q, scale)`` of a ``[BLOCK_M, BLOCK_N]`` fp32 tile holding whole rows
    (masked columns ignored): e4m3 values and one fp32 scale per row."""
    inverse, scale = fp8_scales(tl.max(_finite_abs(y, mask), axis=1))
    return to_e4m3(y, inverse), scale


@triton.jit
def quantize_fp8_rows_kernel(X, Q, S, n_rows, K, stride_row, stride_col,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOPED: tl.constexpr):
    """Q[r] = e4m3 of row r of X, S[r] its scale. One program per BLOCK_M rows.
    Rows wider than one block (LOOPED) take two passes over X: the row maxima,
    then the values; Q and S are contiguous."""
    rows = _tile_rows(tl.program_id(0), BLOCK_M)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_N)
    if LOOPED:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_N):
            c = k0 + cols
            mask = row_mask[:, None] & (c < K)[None, :]
            y = tl.load(X + _tile(rows, c, stride_row, stride_col), mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(_finite_abs(y, mask), axis=1))
        inverse, scale = fp8_scales(amax)
        for k1 in range(0, K, BLOCK_N):
            c2 = k1 + cols
            mask2 = row_mask[:, None] & (c2 < K)[None, :]
            y2 = tl.load(X + _tile(rows, c2, stride_row, stride_col), mask=mask2, other=0.0).to(tl.float32)
            tl.store(Q + _tile(rows, c2, K, 1), to_e4m3(y2, inverse), mask=mask2)
    else:
        mask = row_mask[:, None] & (cols < K)[None, :]
        y = tl.load(X + _tile(rows, cols, stride_row, stride_col), mask=mask, other=0.0).to(tl.float32)
        q, scale = quantize_tile(y, mask)
        tl.store(Q + _tile(rows, cols, K, 1), q, mask=mask)
    tl.store(S + rows, scale, mask=row_mask)
