"""Triton kernels of the fp8 family: rowwise e4m3 quantization.

The recipe is ``compile_ops/reference/fp8.py``'s, operation for operation, so
that the kernel writes the reference's bytes: the scale and its inverse are
correctly rounded fp32 divisions (triton's plain fp32 ``/`` is approximate on
NVIDIA GPUs), the product one fp32 multiply, the clamp exact, the convert
round-to-nearest-even (``cvt.rn.satfinite.e4m3x2.f32`` on sm_89+, which
saturates to +-448 itself: compiled, the clamp is the convert's).

Non-finite values follow the reference's rule through the one row scale of
:func:`fp8_scales`, which every producer calls: NaN is left out of a row's
maximum and stays NaN; +-inf counts, so its row's scale is +inf, its inverse
0, and the row's codes are NaN at the infinities and +-0 elsewhere (``q *
scale`` is NaN across the row: no overflow reaches the GEMM as a finite
value).

A producer quantizes its output in its epilogue, behind a constexpr flag so
one kernel serves both output modes: it keeps the elementwise maximum of
:func:`counted_abs` over the tiles that hold a row (one tile or several),
reduces it once per row, takes :func:`fp8_scales` of the result, and
converts each tile with :func:`to_e4m3`::

    y = ...                                   # [BLOCK_M, BLOCK_N] fp32, whole rows
    if QUANTIZE:                              # tl.constexpr
        inverse, scale = fp8_scales(tl.max(counted_abs(y, mask), axis=1))
        tl.store(Q + offsets, to_e4m3(y, inverse), mask=mask)   # Q: *fp8e4nv
        tl.store(S + rows, scale, mask=rows < n_rows)
    else:
        tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)

:func:`quantize_fp8_rows_kernel` is the standalone pass for a tensor that
no fused producer quantized, and the activation a Linear's output goes
through before the next Linear (``ACT``: GELU, tanh GELU or SiLU of each
element, rounded to the input's dtype as the unquantized activation would
write it, then quantized): an MLP's hidden activation is read once and never
written in 16 bits.

One LoRA adapter on FP8 rows (``fused.fp8_rows_lora``, specified by
``reference.fp8.fp8_rows_lora``) is two launches: :func:`lora_down_kernel`
sums ``q @ A.T`` over a slice of K per program (the codes converted to the
adapters' dtype in registers, exactly: the dequantized rows are never
written) into fp32 partial sums, and :func:`lora_up_kernel` adds the slices
in a fixed order, applies the row's scale and the scaling, rounds to the
adapters' dtype once, and adds ``h @ B.T`` to the result tile. No atomics:
the same bits every run.
"""

import triton
import triton.language as tl

from compile_ops.kernels.glu import PTX, activation
from compile_ops.kernels.norm import _div_exact, _tile, _tile_rows

E4M3_MAX: tl.constexpr = tl.constexpr(448.0)
AMAX_FLOOR: tl.constexpr = tl.constexpr(1e-12)


@triton.jit
def counted_abs(y, mask):
    """``|y|`` where ``mask`` holds and y is not NaN, else 0: the elements a row's
    scale counts (``a <= inf`` is false for NaN only; +-inf counts and makes the
    scale infinite). A producer that holds a row in several tiles keeps the
    elementwise maximum of these and reduces once, rather than once per tile."""
    if PTX:
        # max.f32 returns the number of a number and a NaN: one instruction, |y| its operand's modifier.
        return tl.where(mask, tl.maximum(tl.abs(y), 0.0), 0.0)
    else:
        a = tl.abs(y)
        return tl.where(mask & (a <= float("inf")), a, 0.0)


@triton.jit
def fp8_scales(amax):
    """``(inverse, scale)`` of row maxima ``amax [BLOCK_M]`` (fp32, >= 0, +inf
    allowed): ``448 / amax`` multiplies the values, ``amax / 448`` dequantizes;
    both correctly rounded, like the reference's torch divisions (triton's
    plain fp32 ``/`` is approximate on NVIDIA GPUs). The one place a row's
    scale is taken, by every producer of FP8 rows: an infinite amax gives
    ``(0, +inf)``, which :func:`to_e4m3` turns into NaN codes at the
    infinities and +-0 elsewhere."""
    amax = tl.maximum(amax, AMAX_FLOOR)
    # _div_exact divides by a scalar; the inverse has the scalar on top.
    inverse = tl.div_rn(tl.full(amax.shape, E4M3_MAX, tl.float32), amax)
    return inverse, _div_exact(amax, E4M3_MAX)


@triton.jit
def to_e4m3(y, inverse):
    """``e4m3(clamp(y * inverse[:, None], -448, 448))``: inf times a finite nonzero
    inverse saturates, NaN stays NaN, and so does inf times the 0 inverse of a
    row whose amax is infinite."""
    v = y * inverse[:, None]
    if not PTX:  # PTX's conversion saturates finite values to +-448 and keeps NaN: the clamp is its own
        v = tl.clamp(v, -E4M3_MAX, E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    return v.to(tl.float8e4nv)


@triton.jit
def _load_raw(X, rows, c, stride_row, stride_col, mask, EVICT: tl.constexpr):
    """X's elements at ``rows x c`` in X's dtype (masked elements 0). EVICT: the
    load's L2 eviction policy (the two-pass loop keeps its first read for the second)."""
    return tl.load(X + _tile(rows, c, stride_row, stride_col), mask=mask, other=0.0, eviction_policy=EVICT)


@triton.jit
def _values(raw, ACT: tl.constexpr):
    """The fp32 tile to quantize from a raw tile: its elements, or with ``ACT >= 0``
    (``kernels.glu``'s codes) their activation rounded to the raw dtype (the
    activation of a masked 0 is 0 in every mode)."""
    y = raw.to(tl.float32)
    if ACT >= 0:
        y = activation(y, ACT, False)[0].to(raw.dtype).to(tl.float32)
    return y


@triton.jit
def _load_values(X, rows, c, stride_row, stride_col, mask, ACT: tl.constexpr, EVICT: tl.constexpr):
    """:func:`_values` of X's tile at ``rows x c``."""
    return _values(_load_raw(X, rows, c, stride_row, stride_col, mask, EVICT), ACT)


@triton.jit
def _columns(c0, K, rows, row_mask, BLOCK_N: tl.constexpr):
    """Columns ``c0 .. c0 + BLOCK_N`` of a ``K``-column segment, and their mask for ``rows``."""
    c = c0 + tl.arange(0, BLOCK_N)
    return c, row_mask[:, None] & (c < K)[None, :]


@triton.jit
def _segment_peak(peak, X, rows, row_mask, K, stride_row, stride_col, ACT: tl.constexpr, BLOCK_N: tl.constexpr):
    """``peak [BLOCK_M, BLOCK_N]`` raised to :func:`counted_abs` of a ``K``-column segment's blocks."""
    for k0 in range(0, K, BLOCK_N):
        c, mask = _columns(k0, K, rows, row_mask, BLOCK_N)
        y = _load_values(X, rows, c, stride_row, stride_col, mask, ACT, "evict_last")
        peak = tl.maximum(peak, counted_abs(y, mask))
    return peak


@triton.jit
def _segment_store(
    Q,
    q_row_stride,
    q_col0,
    X,
    rows,
    row_mask,
    K,
    stride_row,
    stride_col,
    inverse,
    ACT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The e4m3 values of a ``K``-column segment, at Q's columns from ``q_col0``."""
    for k0 in range(0, K, BLOCK_N):
        c, mask = _columns(k0, K, rows, row_mask, BLOCK_N)
        y = _load_values(X, rows, c, stride_row, stride_col, mask, ACT, "evict_first")
        tl.store(Q + _tile(rows, q_col0 + c, q_row_stride, 1), to_e4m3(y, inverse), mask=mask)


@triton.jit
def _held_block(i: tl.constexpr, rows, row_mask, K, K_HEAD, BLOCK_N: tl.constexpr, HEAD_CHUNKS: tl.constexpr):
    """Block ``i`` of a held row (HEAD_CHUNKS blocks of the head, then x's): its
    columns in its segment, their mask, and its first column in Q's row."""
    if i < HEAD_CHUNKS:
        c, mask = _columns(i * BLOCK_N, K_HEAD, rows, row_mask, BLOCK_N)
        q_col0 = 0
    else:
        c, mask = _columns((i - HEAD_CHUNKS) * BLOCK_N, K, rows, row_mask, BLOCK_N)
        q_col0 = K_HEAD
    return c, mask, q_col0


@triton.jit
def _load_held_rows(
    rows,
    row_mask,
    segments,
    BLOCK_N: tl.constexpr,
    CHUNKS: tl.constexpr,
    HEAD_CHUNKS: tl.constexpr,
):
    """The raw blocks (X's dtype, a tuple) of the tile of ``rows``: HEAD_CHUNKS
    of HEAD then CHUNKS of X, from ``segments = (X, HEAD, K, K_HEAD,
    stride_row, stride_col, stride_head_row, stride_head_col)``. The loads are
    issued here; nothing waits on them until a block is used. The rows come
    from the caller, not from here: Inductor's analysis of what a user kernel
    writes follows a store's address back through a call to every argument of
    the call, so rows returned by a call that reads X would mark X written."""
    X, HEAD, K, K_HEAD, stride_row, stride_col, stride_head_row, stride_head_col = segments
    blocks = ()
    for i in tl.static_range(HEAD_CHUNKS + CHUNKS):
        c, mask, _ = _held_block(i, rows, row_mask, K, K_HEAD, BLOCK_N, HEAD_CHUNKS)
        if i < HEAD_CHUNKS:
            raw = _load_raw(HEAD, rows, c, stride_head_row, stride_head_col, mask, "")
        else:
            raw = _load_raw(X, rows, c, stride_row, stride_col, mask, "")
        blocks = blocks + (raw,)
    return blocks


@triton.jit
def _quantize_held_rows(
    Q,
    S,
    rows,
    row_mask,
    blocks,
    K,
    K_HEAD,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNKS: tl.constexpr,
    HEAD_CHUNKS: tl.constexpr,
):
    """Q's rows and S's scales of the tile of ``rows`` (``row_mask``: those below
    n_rows), ``blocks`` of :func:`_load_held_rows`: the activation of x's
    blocks (the head's go as they are), one elementwise maximum over the
    blocks reduced once, each block converted with its row's inverse scale."""
    peak = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    values = ()
    for i in tl.static_range(HEAD_CHUNKS + CHUNKS):
        _, mask, _ = _held_block(i, rows, row_mask, K, K_HEAD, BLOCK_N, HEAD_CHUNKS)
        y = _values(blocks[i], -1 if i < HEAD_CHUNKS else ACT)
        peak = tl.maximum(peak, counted_abs(y, mask))
        values = values + (y,)
    inverse, scale = fp8_scales(tl.max(peak, axis=1))
    for i in tl.static_range(HEAD_CHUNKS + CHUNKS):
        c, mask, q_col0 = _held_block(i, rows, row_mask, K, K_HEAD, BLOCK_N, HEAD_CHUNKS)
        tl.store(Q + _tile(rows, q_col0 + c, K_HEAD + K, 1), to_e4m3(values[i], inverse), mask=mask)
    tl.store(S + rows, scale, mask=row_mask)


@triton.jit
def quantize_fp8_rows_kernel(
    X,
    Q,
    S,
    n_rows,
    K,
    stride_row,
    stride_col,
    HEAD,
    K_HEAD,
    stride_head_row,
    stride_head_col,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOOPED: tl.constexpr,
    ACT: tl.constexpr,
    HAS_HEAD: tl.constexpr,
    CHUNKS: tl.constexpr = 1,
    HEAD_CHUNKS: tl.constexpr = 0,
):
    """Q[r] = e4m3 of row r of X (of act(X) with ``ACT >= 0``), S[r] its scale.
    With HAS_HEAD the row is ``HEAD[r]`` (K_HEAD columns, as they are) followed
    by that: the quantization of a concatenation that is never written. One
    program per tile of BLOCK_M rows; Q and S are contiguous.

    Single pass (not LOOPED): a tile's rows are read once and held in registers
    as HEAD_CHUNKS blocks of HEAD then CHUNKS blocks of X, each BLOCK_N wide
    (a tuple of tiles, unrolled), so that a row is padded to whole blocks,
    not to a power of two (Flux's 3072 + 12288 columns: 4 blocks of 4096,
    where one block per segment would be 4096 + 16384); the row maximum is the
    elementwise maximum over the blocks, reduced once (a tile of one row
    spreads a row across the warps; BLOCK_M rows over narrower blocks give
    groups of warps rows of their own). One tile a program: prefetching a
    second tile doubles the registers a thread holds and halves the programs
    an SM runs (docs/notes/fp8.md). LOOPED (rows too wide to hold): two
    passes over each segment in BLOCK_N blocks, the row maxima and then the
    values (the activation computed in each; the first pass asks L2 to keep
    what the second reads again).

    Why hold rows up to 16384 columns: an MLP's hidden activation (Flux:
    12288 wide, 3072 more of attention output as the head) in two passes is
    read twice with its activation computed twice, which made this kernel a
    large part of an FP8 Flux step (docs/notes/fp8.md)."""
    if LOOPED:
        rows = _tile_rows(tl.program_id(0), BLOCK_M)
        row_mask = rows < n_rows
        peak = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if HAS_HEAD:
            peak = _segment_peak(peak, HEAD, rows, row_mask, K_HEAD, stride_head_row, stride_head_col, -1, BLOCK_N)
        peak = _segment_peak(peak, X, rows, row_mask, K, stride_row, stride_col, ACT, BLOCK_N)
        inverse, scale = fp8_scales(tl.max(peak, axis=1))
        if HAS_HEAD:
            _segment_store(
                Q, K_HEAD + K, 0, HEAD, rows, row_mask, K_HEAD, stride_head_row, stride_head_col, inverse, -1, BLOCK_N
            )
        _segment_store(Q, K_HEAD + K, K_HEAD, X, rows, row_mask, K, stride_row, stride_col, inverse, ACT, BLOCK_N)
        tl.store(S + rows, scale, mask=row_mask)
    else:
        segments = (X, HEAD, K, K_HEAD, stride_row, stride_col, stride_head_row, stride_head_col)
        rows = _tile_rows(tl.program_id(0), BLOCK_M)
        row_mask = rows < n_rows
        blocks = _load_held_rows(rows, row_mask, segments, BLOCK_N, CHUNKS, HEAD_CHUNKS)
        _quantize_held_rows(Q, S, rows, row_mask, blocks, K, K_HEAD, ACT, BLOCK_M, BLOCK_N, CHUNKS, HEAD_CHUNKS)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b`` in fp32; IEEE: fp32 operands multiplied as fp32 ("ieee"),
    not on TF32 tensor cores (torch's fp32 matmul precision says which)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def lora_down_kernel(
    Q,
    A,
    PARTIAL,
    n_rows,
    K,
    k_per_split,
    stride_q_row,
    stride_q_col,
    stride_a_rank,
    stride_a_col,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr,
):
    """``PARTIAL[split, rows, :R] = Q[rows, cols] @ A[:, cols].T`` in fp32 over the
    split's ``k_per_split`` columns (a multiple of BLOCK_K): one program per
    (tile of BLOCK_M rows, split). The e4m3 codes become A's dtype in
    registers (exact: every e4m3 value is a bf16, fp16 and fp32 value); the
    row scales are applied after the sum, by :func:`lora_up_kernel`.
    PARTIAL is ``[splits, n_rows, R]`` fp32, contiguous."""
    rows = _tile_rows(tl.program_id(0), BLOCK_M)
    row_mask = rows < n_rows
    split = tl.cast(tl.program_id(1), tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < k_end
        codes = tl.load(
            Q + _tile(rows, cols, stride_q_row, stride_q_col), mask=row_mask[:, None] & col_mask[None, :], other=0.0
        )
        a_t = tl.load(  # [BLOCK_K, BLOCK_R]: A's tile transposed
            A + _tile(cols, ranks, stride_a_col, stride_a_rank),
            mask=col_mask[:, None] & rank_mask[None, :],
            other=0.0,
        )
        acc = _dot(codes.to(A.dtype.element_ty), a_t, acc, IEEE)
    out_rows = split * n_rows + rows
    tl.store(PARTIAL + _tile(out_rows, ranks, R, 1), acc, mask=row_mask[:, None] & rank_mask[None, :])


@triton.jit
def lora_up_kernel(
    RESULT,
    OUT,
    PARTIAL,
    S,
    B,
    SCALING,
    scaling,
    n_rows,
    N,
    splits,
    cols_per_program,
    stride_result_row,
    stride_result_col,
    stride_s,
    stride_b_col,
    stride_b_rank,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_SCALING_TENSOR: tl.constexpr,
    IEEE: tl.constexpr,
):
    """``OUT[rows, cols] = RESULT[rows, cols] + h @ B[cols].T`` with ``h = (sum over
    splits of PARTIAL[:, rows]) * (S[rows] * s)`` rounded to B's dtype, ``s =
    fp32(scaling) * SCALING[()]`` (HAS_SCALING_TENSOR) or ``fp32(scaling)``:
    one program per (tile of BLOCK_M rows, ``cols_per_program`` columns, a
    multiple of BLOCK_N), which sums its rows' partials in split order once
    and loops over its column tiles. OUT is contiguous ``[n_rows, N]``."""
    rows = _tile_rows(tl.program_id(0), BLOCK_M)
    row_mask = rows < n_rows
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    down = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for split in range(0, splits):
        part_rows = tl.cast(split, tl.int64) * n_rows + rows  # int64: splits * n_rows may pass 2**31
        down += tl.load(PARTIAL + _tile(part_rows, ranks, R, 1), mask=row_mask[:, None] & rank_mask[None, :], other=0.0)
    # Inductor may pass the Python float as fp64: the factor is fp32, as the reference's.
    s = tl.cast(scaling, tl.float32)
    if HAS_SCALING_TENSOR:
        s = s * tl.load(SCALING).to(tl.float32)
    row_factor = tl.load(S + rows * stride_s, mask=row_mask, other=0.0) * s
    h = (down * row_factor[:, None]).to(B.dtype.element_ty)
    col_start = tl.cast(tl.program_id(1), tl.int64) * cols_per_program
    col_end = tl.minimum(col_start + cols_per_program, N)
    for n0 in range(col_start, col_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_mask = cols < col_end
        b_t = tl.load(  # [BLOCK_R, BLOCK_N]: B's tile transposed
            B + _tile(ranks, cols, stride_b_rank, stride_b_col),
            mask=rank_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        delta = _dot(h, b_t, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE)
        mask = row_mask[:, None] & col_mask[None, :]
        res = tl.load(RESULT + _tile(rows, cols, stride_result_row, stride_result_col), mask=mask, other=0.0)
        out = res.to(tl.float32) + delta
        tl.store(OUT + _tile(rows, cols, N, 1), out.to(OUT.dtype.element_ty), mask=mask)
