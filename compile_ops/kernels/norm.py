"""Triton kernels of the norm family: RMSNorm and LayerNorm, forward and backward.

One forward and one backward kernel serve every op of the family; constexpr
flags pick RMS or LayerNorm statistics, the fused residual add, weight and
bias. Each program handles a tile of ``BLOCK_M`` rows:

- ``LOOPED=False``: the whole row fits one ``BLOCK_N`` block and stays in
  registers between the statistics and the output (one read, one write).
- ``LOOPED=True``: hidden sizes past the single-block limit walk the row in
  ``BLOCK_N`` chunks, once per statistic and once for the output; the re-reads
  mostly hit L2.

Statistics are recomputed in the backward from ``x`` (which the backward reads
anyway) instead of being saved by the forward: the forward writes only what
the user sees, and the numbers are bit-identical because the same helper
computes them.

Row offsets are int64, so tensors past 2**31 elements index correctly. Every
stride is passed, stride 0 included (``y.sum().backward()`` hands in an
expanded gradient); triton specializes a stride of 1, so the contiguous case
still gets vector loads. Outputs (and the residual output) are contiguous.
"""

import triton
import triton.language as tl


@triton.jit
def _tile(rows, cols, stride_row, stride_col):
    return rows[:, None] * stride_row + cols[None, :] * stride_col


@triton.jit
def _tile_rows(tile, BLOCK_M: tl.constexpr):
    # tl.cast, not .to(): the interpreter's range() yields Python ints.
    return tl.cast(tile, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)


@triton.jit
def _row_mean(x, N):
    # Correctly rounded division: triton's fp32 `/` is approximate, and with a
    # tiny variance rstd amplifies that error (LayerNorm of width 1 must give dx == 0).
    s = tl.sum(x, axis=1)
    return _div_exact(s, N)


@triton.jit
def _div_exact(s, N):
    if s.dtype == tl.float64:
        return s / N  # fp64 division is IEEE already; div_rn is fp32-only
    else:
        return tl.div_rn(s, tl.full(s.shape, N, s.dtype))


@triton.jit
def _centered_rstd(x, mask, N, eps, IS_RMS: tl.constexpr):
    """``(x - mean, rstd)`` of a ``[BLOCK_M, BLOCK_N]`` tile holding whole rows (zero where masked)."""
    xc, _, rstd = _centered_mean_rstd(x, mask, N, eps, IS_RMS)
    return xc, rstd


@triton.jit
def _centered_mean_rstd(x, mask, N, eps, IS_RMS: tl.constexpr):
    """``(x - mean, mean, rstd)`` of a tile holding whole rows; the mean is 0 for RMS statistics."""
    centered, mean, rstd = _held_centered_mean_rstd((x,), (mask,), N, eps, IS_RMS, 1)
    return centered[0], mean, rstd


@triton.jit
def _held_sum(tiles, CHUNKS: tl.constexpr):
    """Row sums of rows held as CHUNKS tiles: the tiles added elementwise, then
    one reduction (one tile: ``tl.sum`` of it)."""
    total = tiles[0]
    for i in tl.static_range(1, CHUNKS):
        total = total + tiles[i]
    return tl.sum(total, axis=1)


@triton.jit
def _held_centered_mean_rstd(held, masks, N, eps, IS_RMS: tl.constexpr, CHUNKS: tl.constexpr):
    """``(centered tiles, mean, rstd)`` of rows held as CHUNKS tiles (``held``,
    a tuple; ``masks`` their valid elements): the mean is 0 for RMS statistics,
    and the centered tiles are zero where masked."""
    if IS_RMS:
        centered = held
        mean = 0.0
    else:
        mean = _div_exact(_held_sum(held, CHUNKS), N)
        centered = ()
        for i in tl.static_range(CHUNKS):
            centered = centered + (tl.where(masks[i], held[i] - mean[:, None], 0.0),)
    squares = ()
    for i in tl.static_range(CHUNKS):
        squares = squares + (centered[i] * centered[i],)
    return centered, mean, _rsqrt_exact(_div_exact(_held_sum(squares, CHUNKS), N) + eps)


@triton.jit
def _rsqrt_exact(v):
    """1 / sqrt(v) with both steps correctly rounded: triton's fp32 sqrt and
    ``/`` are approximate, and their few ulps of error in rstd reach every
    gradient (docs/notes/modulate.md, "Numerics found on the GPU")."""
    if v.dtype == tl.float64:
        return 1.0 / tl.sqrt(v)  # fp64 sqrt and division are IEEE already
    else:
        return tl.div_rn(tl.full(v.shape, 1.0, v.dtype), tl.sqrt_rn(v))


@triton.jit
def _looped_mean_rstd(
    H,
    rows,
    row_mask,
    cols,
    N,
    stride_row,
    stride_col,
    eps,
    IS_RMS: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``(mean, rstd)`` of rows longer than one block: one pass for the mean
    (LayerNorm only), one for the variance around it."""
    mean = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
    if not IS_RMS:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC_DTYPE)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c < N)[None, :]
            acc += tl.load(H + _tile(rows, c, stride_row, stride_col), mask=mask, other=0.0).to(ACC_DTYPE)
        mean = _row_mean(acc, N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC_DTYPE)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        mask = row_mask[:, None] & (c < N)[None, :]
        h = tl.load(H + _tile(rows, c, stride_row, stride_col), mask=mask, other=0.0).to(ACC_DTYPE)
        hc = tl.where(mask, h - mean[:, None], 0.0)
        acc += hc * hc
    return mean, _rsqrt_exact(_row_mean(acc, N) + eps)


@triton.jit
def _load_input(
    X,
    RES,
    RES_OUT,
    rows,
    cols,
    mask,
    N,
    stride_x_row,
    stride_x_col,
    stride_res_row,
    stride_res_col,
    HAS_RESIDUAL: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
):
    """x, or with a residual ``h = x + residual`` stored to RES_OUT and read back
    rounded to its dtype, so that the output is exactly norm(residual_out)."""
    x = tl.load(X + _tile(rows, cols, stride_x_row, stride_x_col), mask=mask, other=0.0).to(ACC_DTYPE)
    if HAS_RESIDUAL:
        r = tl.load(RES + _tile(rows, cols, stride_res_row, stride_res_col), mask=mask, other=0.0)
        h = (x + r.to(ACC_DTYPE)).to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + _tile(rows, cols, N, 1), h, mask=mask)
        x = h.to(ACC_DTYPE)
    return x


@triton.jit
def _store_output(Y, W, B, xc, rstd, rows, cols, mask, N, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    y = xc * rstd[:, None]
    col_mask = cols < N
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(y.dtype)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(y.dtype)[None, :]
    tl.store(Y + _tile(rows, cols, N, 1), y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def norm_fwd_kernel(
    X,
    RES,
    W,
    B,
    Y,
    RES_OUT,
    n_rows,
    N,
    stride_x_row,
    stride_x_col,
    stride_res_row,
    stride_res_col,
    eps,
    IS_RMS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOOPED: tl.constexpr,
):
    """Y = norm(X [+ RES]) * W + B over rows of length N; RES_OUT = X + RES."""
    eps = tl.cast(eps, ACC_DTYPE)  # Inductor may hand scalars over as fp64
    rows = _tile_rows(tl.program_id(0), BLOCK_M)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_N)
    if not LOOPED:
        mask = row_mask[:, None] & (cols < N)[None, :]
        x = _load_input(
            X,
            RES,
            RES_OUT,
            rows,
            cols,
            mask,
            N,
            stride_x_row,
            stride_x_col,
            stride_res_row,
            stride_res_col,
            HAS_RESIDUAL,
            ACC_DTYPE,
        )
        xc, rstd = _centered_rstd(x, mask, N, eps, IS_RMS)
        _store_output(Y, W, B, xc, rstd, rows, cols, mask, N, HAS_WEIGHT, HAS_BIAS)
    else:
        if HAS_RESIDUAL:
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = row_mask[:, None] & (c < N)[None, :]
                _load_input(
                    X,
                    RES,
                    RES_OUT,
                    rows,
                    c,
                    mask,
                    N,
                    stride_x_row,
                    stride_x_col,
                    stride_res_row,
                    stride_res_col,
                    HAS_RESIDUAL,
                    ACC_DTYPE,
                )
            H, stride_h_row, stride_h_col = RES_OUT, N, 1
        else:
            H, stride_h_row, stride_h_col = X, stride_x_row, stride_x_col
        mean, rstd = _looped_mean_rstd(
            H, rows, row_mask, cols, N, stride_h_row, stride_h_col, eps, IS_RMS, ACC_DTYPE, BLOCK_M, BLOCK_N
        )
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c < N)[None, :]
            h = tl.load(H + _tile(rows, c, stride_h_row, stride_h_col), mask=mask, other=0.0).to(ACC_DTYPE)
            _store_output(Y, W, B, tl.where(mask, h - mean[:, None], 0.0), rstd, rows, c, mask, N, HAS_WEIGHT, HAS_BIAS)


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _grad_input(xhat, wdy, rstd, N, IS_RMS: tl.constexpr):
    """dx of ``xhat * w`` given ``wdy = dy * w``: rstd * (wdy - xhat * mean(xhat * wdy) [- mean(wdy)])."""
    if IS_RMS:
        dx = wdy - xhat * _row_mean(xhat * wdy, N)[:, None]
    else:
        # Both row sums in one multi-operand reduction: one round of shuffles and
        # one barrier instead of two, on the backward's critical path.
        s1, s2 = tl.reduce((xhat * wdy, wdy), 1, _add_pair)
        dx = wdy - xhat * _div_exact(s1, N)[:, None] - _div_exact(s2, N)[:, None]
    return dx * rstd[:, None]


@triton.jit
def norm_bwd_kernel(
    DY,
    DRES,
    X,
    W,
    DX,
    DW_PARTIAL,
    DB_PARTIAL,
    n_rows,
    N,
    n_programs,
    stride_dy_row,
    stride_dy_col,
    stride_dres_row,
    stride_dres_col,
    stride_x_row,
    stride_x_col,
    eps,
    IS_RMS: tl.constexpr,
    HAS_DRES: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOOPED: tl.constexpr,
):
    """DX = d norm(X)*W+B / dX applied to DY (+ DRES); per-program partial sums of
    dW and dB go to row ``program_id`` of DW_PARTIAL / DB_PARTIAL ([programs, N]).

    A persistent grid of ``n_programs`` (passed in: triton's interpreter cannot
    step a range by ``tl.num_programs``): program p takes row tiles p, p + P, ... so the
    partial sums stay in registers and the final reduction (column_sum_kernel)
    is over P rows, not n_rows, in a fixed order: deterministic, no atomics.
    """
    eps = tl.cast(eps, ACC_DTYPE)
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    if not LOOPED:
        col_mask = cols < N
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(ACC_DTYPE)
        dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC_DTYPE)
        db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC_DTYPE)
        for tile in range(pid, n_tiles, n_programs):
            rows = _tile_rows(tile, BLOCK_M)
            mask = (rows < n_rows)[:, None] & col_mask[None, :]
            x = tl.load(X + _tile(rows, cols, stride_x_row, stride_x_col), mask=mask, other=0.0).to(ACC_DTYPE)
            dy = tl.load(DY + _tile(rows, cols, stride_dy_row, stride_dy_col), mask=mask, other=0.0).to(ACC_DTYPE)
            xc, rstd = _centered_rstd(x, mask, N, eps, IS_RMS)
            xhat = xc * rstd[:, None]
            if HAS_WEIGHT:
                wdy = dy * w[None, :]
                dw_acc += dy * xhat
            else:
                wdy = dy
            if HAS_BIAS:
                db_acc += dy
            dx = _grad_input(xhat, wdy, rstd, N, IS_RMS)
            if HAS_DRES:
                dx += tl.load(DRES + _tile(rows, cols, stride_dres_row, stride_dres_col), mask=mask, other=0.0).to(
                    ACC_DTYPE
                )
            tl.store(DX + _tile(rows, cols, N, 1), dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            tl.store(DW_PARTIAL + pid * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
        if HAS_BIAS:
            tl.store(DB_PARTIAL + pid * N + cols, tl.sum(db_acc, axis=0), mask=col_mask)
    else:
        # Rows longer than a block: statistics, then the two row sums of dx, then
        # dx itself, each a walk over the row. The partial-sum rows (zeroed by the
        # launcher) are owned by this program alone, so += on them is race-free.
        for tile in range(pid, n_tiles, n_programs):
            rows = _tile_rows(tile, BLOCK_M)
            row_mask = rows < n_rows
            mean, rstd = _looped_mean_rstd(
                X, rows, row_mask, cols, N, stride_x_row, stride_x_col, eps, IS_RMS, ACC_DTYPE, BLOCK_M, BLOCK_N
            )
            c1_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC_DTYPE)
            c2_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC_DTYPE)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = row_mask[:, None] & (c < N)[None, :]
                x = tl.load(X + _tile(rows, c, stride_x_row, stride_x_col), mask=mask, other=0.0).to(ACC_DTYPE)
                wdy = tl.load(DY + _tile(rows, c, stride_dy_row, stride_dy_col), mask=mask, other=0.0).to(ACC_DTYPE)
                if HAS_WEIGHT:
                    wdy *= tl.load(W + c, mask=c < N, other=0.0).to(ACC_DTYPE)[None, :]
                xhat = tl.where(mask, x - mean[:, None], 0.0) * rstd[:, None]
                c1_acc += xhat * wdy
                c2_acc += wdy
            c1 = _row_mean(c1_acc, N)
            c2 = _row_mean(c2_acc, N)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                col_mask = c < N
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(X + _tile(rows, c, stride_x_row, stride_x_col), mask=mask, other=0.0).to(ACC_DTYPE)
                dy = tl.load(DY + _tile(rows, c, stride_dy_row, stride_dy_col), mask=mask, other=0.0).to(ACC_DTYPE)
                xhat = tl.where(mask, x - mean[:, None], 0.0) * rstd[:, None]
                wdy = dy
                if HAS_WEIGHT:
                    wdy = dy * tl.load(W + c, mask=col_mask, other=0.0).to(ACC_DTYPE)[None, :]
                    p = DW_PARTIAL + pid * N + c
                    tl.store(p, tl.load(p, mask=col_mask) + tl.sum(dy * xhat, axis=0), mask=col_mask)
                if HAS_BIAS:
                    p = DB_PARTIAL + pid * N + c
                    tl.store(p, tl.load(p, mask=col_mask) + tl.sum(dy, axis=0), mask=col_mask)
                dx = wdy - xhat * c1[:, None]
                if not IS_RMS:
                    dx = dx - c2[:, None]
                dx = dx * rstd[:, None]
                if HAS_DRES:
                    dx += tl.load(DRES + _tile(rows, c, stride_dres_row, stride_dres_col), mask=mask, other=0.0).to(
                        ACC_DTYPE
                    )
                tl.store(DX + _tile(rows, c, N, 1), dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def column_sum_kernel(P, OUT, n_rows, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[j] = sum_i P[i, j] for a contiguous [n_rows, N] P, in a fixed order."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=P.dtype.element_ty)
    for start in range(0, n_rows, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        mask = (r < n_rows)[:, None] & col_mask[None, :]
        acc += tl.load(P + r.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_mask)
