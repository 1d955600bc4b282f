"""Triton backward kernel of ``fused.qk_norm_rope``.

The grid and addressing are kernels/rope.py's forward kernel's (a program owns
``BLOCK_L`` positions of one batch element and a range of q's then k's heads,
sharing one angle tile); pairs, angles and the helpers are kernels/rope_common.py's.
Besides dq and dk, each program writes its partial sums of the norm weights'
gradients as one row, reduced over programs in a fixed order by the launcher.
"""

import triton
import triton.language as tl

from compile_ops.kernels.norm import _div_exact
from compile_ops.kernels.rope_common import (
    angle_cos_sin,
    head_range,
    heads_rstd_and_dot,
    load_pairs,
    load_tail,
    norm_weights,
    program_block,
    rotate_pairs,
    row_rstd,
    store_pairs,
)


@triton.jit
def _norm_rope_grad_heads(
    X,
    G,
    DX,
    DW_PART,
    W,
    h_start,
    h_end,
    b,
    pos,
    pos_mask,
    p,
    c1,
    s1,
    c2,
    s2,
    stride_xb,
    stride_xl,
    stride_xh,
    stride_xd,
    stride_gb,
    stride_gl,
    stride_gh,
    stride_gd,
    stride_ob,
    stride_ol,
    stride_oh,
    D,
    eps,
    R: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ACC: tl.constexpr,
    SPANS_HEADS: tl.constexpr,
):
    """dx of heads [h_start, h_end) of ``rotate(rmsnorm(x) * w)`` given its
    gradient G, and this program's partial sum of dw, one row of DW_PART.
    SPANS_HEADS: the norm spans the heads, which are then all of X's (W and
    DW_PART's row ``[H * D]``); a first loop sums each row's squares and
    ``w dz x`` over them."""
    mask = pos_mask[:, None] & (p < R // 2)[None, :]
    tail = R + tl.arange(0, BLOCK_T if BLOCK_T > 0 else 1)
    tail_mask = pos_mask[:, None] & (tail < D)[None, :]
    x_rows = X + b * stride_xb + pos * stride_xl
    g_rows = G + b * stride_gb + pos * stride_gl
    out_rows = DX + b * stride_ob + pos * stride_ol
    w1, w2, w_tail = norm_weights(W, p, tail, D, R, INTERLEAVED, BLOCK_T, ACC)
    dw1 = tl.zeros(mask.shape, ACC)
    dw2 = tl.zeros(mask.shape, ACC)
    dw_tail = tl.zeros(tail_mask.shape, ACC)
    row_rstd_all = tl.zeros(x_rows.shape, ACC)
    row_c = tl.zeros(x_rows.shape, ACC)
    if SPANS_HEADS:
        row_rstd_all, dot = heads_rstd_and_dot(
            x_rows,
            g_rows,
            stride_xh,
            stride_gh,
            stride_xd,
            stride_gd,
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
            R,
            INTERLEAVED,
            PACKED,
            BLOCK_T,
            ACC,
            True,
        )
        # mean(w dz xhat) over the row, xhat = x * rstd
        row_c = _div_exact(row_rstd_all * dot, D * tl.maximum(h_end - h_start, 1))
    for h in range(h_start, h_end):
        head = tl.cast(h, tl.int64)
        if SPANS_HEADS:
            w1, w2, w_tail = norm_weights(W + head * D, p, tail, D, R, INTERLEAVED, BLOCK_T, ACC)
        x1, x2 = load_pairs(x_rows + head * stride_xh, stride_xd, p, mask, R, INTERLEAVED, PACKED, ACC)
        g1, g2 = load_pairs(g_rows + head * stride_gh, stride_gd, p, mask, R, INTERLEAVED, PACKED, ACC)
        dz1, dz2 = rotate_pairs(g1, g2, c1, s1, c2, s2, True)  # the rotation's transpose
        if BLOCK_T > 0:
            t = load_tail(x_rows + head * stride_xh, stride_xd, tail, tail_mask).to(ACC)
            dz_tail = load_tail(g_rows + head * stride_gh, stride_gd, tail, tail_mask).to(ACC)
        else:
            t = x1
        if SPANS_HEADS:
            rstd = row_rstd_all[:, None]
        else:
            rstd = row_rstd(x1, x2, t, D, eps, BLOCK_T)[:, None]
        xhat1 = x1 * rstd
        xhat2 = x2 * rstd
        if SPANS_HEADS:  # this head's own dw columns: a fresh sum
            dw1 = dz1 * xhat1
            dw2 = dz2 * xhat2
        else:
            dw1 += dz1 * xhat1
            dw2 += dz2 * xhat2
        wdz1 = dz1 * w1
        wdz2 = dz2 * w2
        if BLOCK_T > 0:
            xhat_tail = t * rstd
            if SPANS_HEADS:
                dw_tail = dz_tail * xhat_tail
            else:
                dw_tail += dz_tail * xhat_tail
            wdz_tail = dz_tail * w_tail
        if SPANS_HEADS:
            c = row_c[:, None]
        else:
            dot = tl.sum(wdz1 * xhat1 + wdz2 * xhat2, axis=1)
            if BLOCK_T > 0:
                dot += tl.sum(wdz_tail * xhat_tail, axis=1)
            c = _div_exact(dot, D)[:, None]  # triton's fp32 "/" is ~2 ulps off: seen in dk on the GPU
        rows = out_rows + head * stride_oh
        store_pairs(rows, p, mask, rstd * (wdz1 - xhat1 * c), rstd * (wdz2 - xhat2 * c), R, INTERLEAVED)
        if BLOCK_T > 0:
            tl.store(
                rows[:, None] + tail[None, :],
                (rstd * (wdz_tail - xhat_tail * c)).to(DX.dtype.element_ty),
                mask=tail_mask,
            )
        if SPANS_HEADS:
            _store_weight_grad_row(DW_PART + head * D, p, tail, dw1, dw2, dw_tail, D, R, INTERLEAVED, BLOCK_T)
    if not SPANS_HEADS:
        _store_weight_grad_row(DW_PART, p, tail, dw1, dw2, dw_tail, D, R, INTERLEAVED, BLOCK_T)


@triton.jit
def _store_weight_grad_row(
    ROW, p, tail, dw1, dw2, dw_tail, D, R: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_T: tl.constexpr
):
    """A program's partial sums of dw over its positions, one row of D at ROW:
    reduced over programs in a fixed order later."""
    store_pairs(
        ROW + tl.zeros([1], tl.int64),
        p,
        (p < R // 2)[None, :],
        tl.sum(dw1, axis=0)[None, :],
        tl.sum(dw2, axis=0)[None, :],
        R,
        INTERLEAVED,
    )
    if BLOCK_T > 0:
        tl.store(ROW + tail, tl.sum(dw_tail, axis=0), mask=tail < D)


@triton.jit
def qk_norm_rope_bwd_kernel(
    Q,
    K,
    GQ,
    GK,
    DQ,
    DK,
    DQW_PART,
    DKW_PART,
    COS,
    SIN,
    Q_W,
    K_W,
    L,
    HQ,
    HK,
    D,
    n_pos_blocks,
    heads_per_program,
    stride_qb,
    stride_ql,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kl,
    stride_kh,
    stride_kd,
    stride_gqb,
    stride_gql,
    stride_gqh,
    stride_gqd,
    stride_gkb,
    stride_gkl,
    stride_gkh,
    stride_gkd,
    stride_oqb,
    stride_oql,
    stride_oqh,
    stride_okb,
    stride_okl,
    stride_okh,
    stride_tb,
    stride_tl,
    eps,
    R: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PACKED: tl.constexpr,
    HALF_TABLE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ACC: tl.constexpr,
    SPANS_HEADS: tl.constexpr = False,
):
    """dq, dk and per-program partial rows of dq_weight, dk_weight of
    ``rotate(rmsnorm(q) * q_weight), rotate(rmsnorm(k) * k_weight)``; the grid
    and addressing are rope_kernel's, rstd is recomputed from the row in registers.
    SPANS_HEADS: both norms span their tensor's heads (weights ``[H * D]``),
    and every program holds all of q's and k's heads."""
    b, pos, pos_mask, first_head = program_block(L, n_pos_blocks, heads_per_program, BLOCK_L)
    program = tl.cast(tl.program_id(0), tl.int64) * tl.num_programs(1) + tl.program_id(1)
    # A partial row of dw per program: D wide, or the tensor's H * D when the norm spans the heads.
    q_row, k_row = program * D, program * D
    if SPANS_HEADS:
        q_row, k_row = q_row * HQ, k_row * HK
    p = tl.arange(0, BLOCK_P)
    c1, s1, c2, s2 = angle_cos_sin(
        COS, SIN, b, pos, pos_mask, p, stride_tb, stride_tl, 1, 1, R, INTERLEAVED, HALF_TABLE, False, ACC
    )
    start, end = head_range(first_head, 0, HQ, heads_per_program)
    _norm_rope_grad_heads(
        Q,
        GQ,
        DQ,
        DQW_PART + q_row,
        Q_W,
        start,
        end,
        b,
        pos,
        pos_mask,
        p,
        c1,
        s1,
        c2,
        s2,
        stride_qb,
        stride_ql,
        stride_qh,
        stride_qd,
        stride_gqb,
        stride_gql,
        stride_gqh,
        stride_gqd,
        stride_oqb,
        stride_oql,
        stride_oqh,
        D,
        eps,
        R,
        INTERLEAVED,
        PACKED,
        BLOCK_T,
        ACC,
        SPANS_HEADS,
    )
    start, end = head_range(first_head, HQ, HK, heads_per_program)
    _norm_rope_grad_heads(
        K,
        GK,
        DK,
        DKW_PART + k_row,
        K_W,
        start,
        end,
        b,
        pos,
        pos_mask,
        p,
        c1,
        s1,
        c2,
        s2,
        stride_kb,
        stride_kl,
        stride_kh,
        stride_kd,
        stride_gkb,
        stride_gkl,
        stride_gkh,
        stride_gkd,
        stride_okb,
        stride_okl,
        stride_okh,
        D,
        eps,
        R,
        INTERLEAVED,
        PACKED,
        BLOCK_T,
        ACC,
        SPANS_HEADS,
    )
