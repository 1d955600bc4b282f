"""Triton kernels of the AdaLN modulation family, forward and backward.

One forward and one backward kernel serve every op of the family; constexpr
flags switch the parts of ``h = residual + gate * x`` (GATED), ``norm(h) * w + b``
(NORM: 0 none, 1 RMS, 2 LayerNorm; affine optional) and ``* (1 + scale) + shift``
(MODULATED) on and off. Rows are whole hidden vectors (up to 16384 wide) held in
registers, and the row helpers are the norm family's, so normalized values are
bit-identical to ``fused.rmsnorm`` / ``fused.layernorm`` where the forward holds
a row as one block (a row held as several adds them first: another order).

Rows are cut into segments of ``seg_rows`` consecutive rows that share one row
of every modulation tensor (scale, shift, gate), and segments into pieces of
``chunk_rows`` rows. Row ``r = b * tokens + t`` reads modulation row
``b * SB + (t // GROUP) * SG + (t % GROUP) * SS`` (stride 0 wherever the tensor
broadcasts, ``meta/modulate.py``); a piece reads it once for all its rows.

Forward: one program per piece. Backward: persistent programs take pieces
p, p + P, ... and write one partial row per piece for the gradients of the
modulation tensors, which the launcher sums in a fixed order: broadcast
gradients are reduced without atomics, deterministically.
"""

import triton
import triton.language as tl

from compile_ops.kernels.fp8 import _columns, counted_abs, fp8_scales, to_e4m3
from compile_ops.kernels.norm import _centered_mean_rstd, _grad_input, _held_centered_mean_rstd, _tile


@triton.jit
def _modulation_row(M, row, cols, col_mask, tokens, sb, sg, ss, sc, group):
    """``[BLOCK_N]``, in M's dtype: the modulation row that row ``row`` of x reads."""
    b = row // tokens
    t = row - b * tokens
    g = t // group
    off = b * sb + g * sg + (t - g * group) * ss
    return tl.load(M + off + cols * sc, mask=col_mask, other=0.0)


@triton.jit
def _piece_rows(piece, chunks, seg_rows, chunk_rows):
    """``(segment, its first row, the piece's first row, the piece's end row)``."""
    # tl.cast: the interpreter's range() yields Python ints.
    segment = tl.cast(piece, tl.int64) // chunks
    seg_start = segment * seg_rows
    start = seg_start + (piece - segment * chunks) * chunk_rows
    return segment, seg_start, start, tl.minimum(start + chunk_rows, seg_start + seg_rows)


@triton.jit
def _normalized(
    h,
    mask,
    rows,
    row_mask,
    cols,
    N,
    W,
    B,
    MEAN,
    RSTD,
    eps,
    NORM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    LOAD_STATS: tl.constexpr,
):
    """``(norm(h) * w + b, xhat, mean, rstd)`` of a tile of whole rows; ``h`` for
    every tensor when NORM == 0. With LOAD_STATS the row statistics come from
    MEAN (LayerNorm) and RSTD, as the forward stored them, instead of two
    dependent row reductions."""
    if NORM == 0:
        y, xhat, mean, rstd = h, h, h, h
    else:
        if LOAD_STATS:
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            if NORM == 2:
                mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
                xc = tl.where(mask, h - mean[:, None], 0.0)
            else:
                mean = 0.0
                xc = h
        else:
            xc, mean, rstd = _centered_mean_rstd(h, mask, N, eps, NORM == 1)
        xhat = xc * rstd[:, None]
        y = _affine(xhat, cols, N, W, B, HAS_WEIGHT, HAS_BIAS)
    return y, xhat, mean, rstd


@triton.jit
def _affine(xhat, cols, N, W, B, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``xhat * w + b`` of normalized columns ``cols``, the affine terms each optional."""
    y = xhat
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=cols < N, other=0.0).to(xhat.dtype)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=cols < N, other=0.0).to(xhat.dtype)[None, :]
    return y


@triton.jit
def _modulation_rows(M, row, N, tokens, sb, sg, ss, sc, group, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr):
    """The modulation row that row ``row`` of x reads, as a tuple of CHUNKS ``[BLOCK_N]`` chunks."""
    chunks = ()
    for i in tl.static_range(CHUNKS):
        cols = i * BLOCK_N + tl.arange(0, BLOCK_N)
        chunks = chunks + (_modulation_row(M, row, cols, cols < N, tokens, sb, sg, ss, sc, group),)
    return chunks


@triton.jit
def modulate_fwd_kernel(
    X,
    RES,
    GATE,
    SCALE,
    SHIFT,
    W,
    B,
    OUT,
    RES_OUT,
    MEAN,
    RSTD,
    OUT_SCALE,
    n_rows,
    N,
    tokens,
    seg_rows,
    chunk_rows,
    chunks,
    stride_x_row,
    stride_x_col,
    stride_res_row,
    stride_res_col,
    g_sb,
    g_sg,
    g_ss,
    g_sc,
    g_group,
    sc_sb,
    sc_sg,
    sc_ss,
    sc_sc,
    sc_group,
    sh_sb,
    sh_sg,
    sh_ss,
    sh_sc,
    sh_group,
    eps,
    GATED: tl.constexpr,
    NORM: tl.constexpr,
    MODULATED: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUANTIZE: tl.constexpr = False,
    OUT_DTYPE: tl.constexpr = None,
    CHUNKS: tl.constexpr = 1,
):
    """RES_OUT = RES + GATE * X (GATED); OUT = modulate(norm(h) * W + B) with h
    RES_OUT read back at its dtype (GATED) or X. OUT is written when NORM or
    MODULATED; with NORM, the row statistics go to MEAN (LayerNorm) and RSTD
    (not under QUANTIZE).

    QUANTIZE (the FP8 output mode, inference): OUT is e4m3 and OUT_SCALE gets
    one fp32 scale per row (``kernels/fp8.py``), of the output rounded to
    OUT_DTYPE first, so the bytes are those of ``quantize_fp8_rows`` of the
    unquantized op's output (an output that overflows OUT_DTYPE is +-inf
    there, and its row's scale infinite: ``kernels/fp8.py``'s rule); rows are
    whole in a tile, so the row maximum is one reduction of registers already
    held.

    A row is held as CHUNKS blocks of BLOCK_N columns (a tuple, unrolled):
    one block padded to a power of two, or several that cover a width such as
    1536 = 3 x 512 without padding (``ops/modulate_launch.py``,
    ``held_chunks``). The statistics and the FP8 maximum add the blocks
    elementwise and reduce once.

    Program p takes piece p: ``chunk_rows`` rows of one segment, which share
    their modulation rows, so those are read once per piece as 1-D rows rather
    than gathered per row (the piece sizes tried: docs/notes/modulate.md).
    """
    eps = tl.cast(eps, ACC_DTYPE)  # Inductor may hand scalars over as fp64
    # (Names must not repeat in and outside the loop below: triton would carry them.)
    segment, seg_start, start, end = _piece_rows(tl.program_id(0), chunks, seg_rows, chunk_rows)
    # The modulation rows stay in registers in the input dtype: half the
    # registers of fp32 for bf16, at the same speed (docs/notes/modulate.md).
    if MODULATED:
        scale = _modulation_rows(SCALE, seg_start, N, tokens, sc_sb, sc_sg, sc_ss, sc_sc, sc_group, BLOCK_N, CHUNKS)
        shift = _modulation_rows(SHIFT, seg_start, N, tokens, sh_sb, sh_sg, sh_ss, sh_sc, sh_group, BLOCK_N, CHUNKS)
    if GATED:
        gate = _modulation_rows(GATE, seg_start, N, tokens, g_sb, g_sg, g_ss, g_sc, g_group, BLOCK_N, CHUNKS)
    for row0 in range(start, end, BLOCK_M):
        rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        # Every block is loaded before the first store: the compiler cannot
        # move a load above a store to a pointer it may alias (RES_OUT).
        loaded, residuals, columns, masks = (), (), (), ()
        for i in tl.static_range(CHUNKS):
            cols, mask = _columns(i * BLOCK_N, N, rows, row_mask, BLOCK_N)
            columns, masks = columns + (cols,), masks + (mask,)
            loaded = loaded + (tl.load(X + _tile(rows, cols, stride_x_row, stride_x_col), mask=mask, other=0.0),)
            if GATED:
                r = tl.load(RES + _tile(rows, cols, stride_res_row, stride_res_col), mask=mask, other=0.0)
                residuals = residuals + (r,)
        held = ()  # h of each block, in ACC_DTYPE
        for i in tl.static_range(CHUNKS):
            h = loaded[i].to(ACC_DTYPE)
            if GATED:
                # Rounded to residual_out's dtype before the norm: out == norm_modulate(residual_out).
                h_out = (residuals[i].to(ACC_DTYPE) + gate[i].to(ACC_DTYPE)[None, :] * h).to(RES_OUT.dtype.element_ty)
                tl.store(RES_OUT + _tile(rows, columns[i], N, 1), h_out, mask=masks[i])
                h = h_out.to(ACC_DTYPE)
            held = held + (h,)
        if NORM != 0 or MODULATED:
            if NORM != 0:
                held, mean, rstd = _held_centered_mean_rstd(held, masks, N, eps, NORM == 1, CHUNKS)
                if not QUANTIZE:  # the statistics are for a backward, which FP8 outputs have not
                    if NORM == 2:
                        tl.store(MEAN + rows, mean, mask=row_mask)
                    tl.store(RSTD + rows, rstd, mask=row_mask)
            outs = ()
            peak = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for i in tl.static_range(CHUNKS):
                y = held[i]
                if NORM != 0:
                    y = _affine(y * rstd[:, None], columns[i], N, W, B, HAS_WEIGHT, HAS_BIAS)
                if MODULATED:
                    y = y * (1.0 + scale[i].to(ACC_DTYPE))[None, :] + shift[i].to(ACC_DTYPE)[None, :]
                if QUANTIZE:
                    # The row's scale is of the output rounded to OUT_DTYPE, over every chunk.
                    y = y.to(OUT_DTYPE).to(tl.float32)
                    peak = tl.maximum(peak, counted_abs(y, masks[i]))
                    outs = outs + (y,)
                else:
                    tl.store(OUT + _tile(rows, columns[i], N, 1), y.to(OUT.dtype.element_ty), mask=masks[i])
            if QUANTIZE:
                inverse, q_scale = fp8_scales(tl.max(peak, axis=1))
                for i in tl.static_range(CHUNKS):
                    tl.store(OUT + _tile(rows, columns[i], N, 1), to_e4m3(outs[i], inverse), mask=masks[i])
                tl.store(OUT_SCALE + rows, q_scale, mask=row_mask)


@triton.jit
def _store_partial(P, row_offset, cols, col_mask, acc):
    """Row ``row_offset / N`` of P = the column sums of ``acc``."""
    tl.store(P + row_offset + cols, tl.sum(acc, axis=0).to(P.dtype.element_ty), mask=col_mask)


@triton.jit
def modulate_bwd_kernel(
    DY,
    DH,
    H,
    MEAN,
    RSTD,
    XB,
    GATE,
    SCALE,
    W,
    B,
    DIN,
    DXB,
    DGATE_P,
    DSCALE_P,
    DSHIFT_P,
    DW_P,
    DB_P,
    n_rows,
    N,
    tokens,
    seg_rows,
    chunk_rows,
    chunks,
    n_segments,
    n_programs,
    stride_dy_row,
    stride_dy_col,
    stride_dh_row,
    stride_dh_col,
    stride_h_row,
    stride_h_col,
    stride_xb_row,
    stride_xb_col,
    g_sb,
    g_sg,
    g_ss,
    g_sc,
    g_group,
    sc_sb,
    sc_sg,
    sc_ss,
    sc_sc,
    sc_group,
    eps,
    HAS_DY: tl.constexpr,
    HAS_DH: tl.constexpr,
    GATED: tl.constexpr,
    NORM: tl.constexpr,
    MODULATED: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_STATS: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Gradients of the forward kernel's outputs (see ``modulate_fwd_kernel``).

    In: DY = d out (HAS_DY), DH = d residual_out (HAS_DH), H = the norm's input
    (x, or residual_out when GATED), MEAN/RSTD = its row statistics from the
    forward (HAS_STATS; else recomputed), XB = the gated branch x. Out: DIN = dH (d x,
    or d residual when GATED; written when HAS_DY), DXB = dH * gate; partial
    rows ``[chunks, n_segments, N]`` of dgate, dscale, dshift (the final
    gradients themselves when ``chunks == 1`` and nothing broadcasts further),
    and ``[programs, N]`` of dweight, dbias.
    """
    eps = tl.cast(eps, ACC_DTYPE)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(ACC_DTYPE)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC_DTYPE)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC_DTYPE)
    for piece in range(pid, n_segments * chunks, n_programs):
        segment, seg_start, start, end = _piece_rows(piece, chunks, seg_rows, chunk_rows)
        # Every row of a segment shares its modulation rows: load them once.
        if GATED:
            gate = _modulation_row(GATE, seg_start, cols, col_mask, tokens, g_sb, g_sg, g_ss, g_sc, g_group).to(
                ACC_DTYPE
            )
        if MODULATED:
            scale1 = 1.0 + _modulation_row(
                SCALE, seg_start, cols, col_mask, tokens, sc_sb, sc_sg, sc_ss, sc_sc, sc_group
            ).to(ACC_DTYPE)
        dgate_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC_DTYPE)
        dscale_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC_DTYPE)
        dshift_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC_DTYPE)
        for row0 in range(start, end, BLOCK_M):
            rows = row0 + tl.arange(0, BLOCK_M)
            row_mask = rows < end
            mask = row_mask[:, None] & col_mask[None, :]
            if HAS_DY:
                dy = tl.load(DY + _tile(rows, cols, stride_dy_row, stride_dy_col), mask=mask, other=0.0).to(ACC_DTYPE)
                h = tl.load(H + _tile(rows, cols, stride_h_row, stride_h_col), mask=mask, other=0.0).to(ACC_DTYPE)
                y, xhat, mean, rstd = _normalized(
                    h, mask, rows, row_mask, cols, N, W, B, MEAN, RSTD, eps, NORM, HAS_WEIGHT, HAS_BIAS, HAS_STATS
                )
                if MODULATED:
                    dscale_acc += dy * y
                    dshift_acc += dy
                    dn = dy * scale1[None, :]
                else:
                    dn = dy
                if NORM != 0:
                    if HAS_WEIGHT:
                        dw_acc += dn * xhat
                        dn_w = dn * w[None, :]
                    else:
                        dn_w = dn
                    if HAS_BIAS:
                        db_acc += dn
                    dh = _grad_input(xhat, dn_w, rstd, N, NORM == 1)
                else:
                    dh = dn
                if HAS_DH:
                    dh += tl.load(DH + _tile(rows, cols, stride_dh_row, stride_dh_col), mask=mask, other=0.0).to(
                        ACC_DTYPE
                    )
                tl.store(DIN + _tile(rows, cols, N, 1), dh.to(DIN.dtype.element_ty), mask=mask)
            else:
                dh = tl.load(DH + _tile(rows, cols, stride_dh_row, stride_dh_col), mask=mask, other=0.0).to(ACC_DTYPE)
            if GATED:
                xb = tl.load(XB + _tile(rows, cols, stride_xb_row, stride_xb_col), mask=mask, other=0.0).to(ACC_DTYPE)
                dgate_acc += dh * xb
                tl.store(DXB + _tile(rows, cols, N, 1), (dh * gate[None, :]).to(DXB.dtype.element_ty), mask=mask)
        partial_row = (piece - segment * chunks) * n_segments * N + segment * N
        if GATED:
            _store_partial(DGATE_P, partial_row, cols, col_mask, dgate_acc)
        if MODULATED:
            _store_partial(DSCALE_P, partial_row, cols, col_mask, dscale_acc)
            _store_partial(DSHIFT_P, partial_row, cols, col_mask, dshift_acc)
    if HAS_WEIGHT:
        tl.store(DW_P + pid * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_P + pid * N + cols, tl.sum(db_acc, axis=0), mask=col_mask)
