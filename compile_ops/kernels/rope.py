"""Triton forward kernel of the RoPE family.

One forward kernel serves ``fused.rope``, ``fused.rope_qk``, ``fused.rope_grid``,
the forward of ``fused.qk_norm_rope`` and the INT8 quantizing rotation
``fused.qk_rope_int8``; plain rotations are their own backward (the same kernel
with ``INVERSE``, the transpose), and ``qk_norm_rope``'s backward kernel is in
kernels/rope_backward.py. Pairs, angles and the helpers both share are in
kernels/rope_common.py.

Work split: a program owns ``BLOCK_L`` positions of one batch element and a
range of heads (q's heads first, then k's). It gets the angles of its positions
once, into registers, and loops over its heads: the angle tile (1 KB per
position for diffusers' full fp32 tables, more than a bf16 head row) is read or
computed once per program instead of once per head, and q and k share it.

No module-level constexprs: Inductor copies a user kernel's source into its
generated code, and globals of the kernel's module do not come along.
Channels past R pass through (``NORM``: normalized and weighted like the rest).
"""

import triton
import triton.language as tl

from compile_ops.kernels.attention_common import INT8_MAX, quantization_scale, round_to_int8
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
def _normed_rotated(
    x_row,
    stride_xd,
    p,
    mask,
    tail,
    tail_mask,
    w1,
    w2,
    w_tail,
    c1,
    s1,
    c2,
    s2,
    rstd,
    D,
    eps,
    R: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PACKED: tl.constexpr,
    NORM: tl.constexpr,
    INVERSE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ACC: tl.constexpr,
):
    """One head's rows at pointers ``x_row`` [BLOCK_L]: (RMS-normalized with
    weight, then) rotated, in ACC: pair tiles ``(y1, y2)`` and the tail (y1
    itself when there is no tail). NORM 1: the head's own rstd; 2: ``rstd``
    [BLOCK_L], the row's over all heads."""
    x1, x2 = load_pairs(x_row, stride_xd, p, mask, R, INTERLEAVED, PACKED, ACC)
    if BLOCK_T > 0:
        t = load_tail(x_row, stride_xd, tail, tail_mask).to(ACC)
    else:
        t = x1  # no tail: a placeholder row_rstd ignores
    if NORM == 1:
        rstd = row_rstd(x1, x2, t, D, eps, BLOCK_T)
    if NORM > 0:
        rstd = rstd[:, None]
        x1 = x1 * rstd * w1
        x2 = x2 * rstd * w2
        if BLOCK_T > 0:
            t = t * rstd * w_tail
    y1, y2 = rotate_pairs(x1, x2, c1, s1, c2, s2, INVERSE)
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
def _rotate_heads(
    X,
    OUT,
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
    stride_ob,
    stride_ol,
    stride_oh,
    D,
    eps,
    SCALE,
    stride_sb,
    stride_sh,
    K_SUM,
    stride_mb,
    stride_mh,
    block,
    L,
    R: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PACKED: tl.constexpr,
    NORM: tl.constexpr,
    INVERSE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ACC: tl.constexpr,
    MODE: tl.constexpr,
):
    """Heads [h_start, h_end) of X at positions ``pos`` (position block
    ``block``): (RMS-normalize with weight W, then) rotate, and by ``MODE``.
    NORM 1: each head on its own (W ``[D]``); 2: over the heads, which are
    then all of X's (W ``[H * D]``; a first loop sums the squares).

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
    if NORM > 0:  # NORM 2: the first head's, then each head's in the loop
        w1, w2, w_tail = norm_weights(W, p, tail, D, R, INTERLEAVED, BLOCK_T, ACC)
    else:
        w1, w2, w_tail = c1, c2, c1  # unused
    rstd = tl.zeros(x_rows.shape, ACC)  # NORM 2: the row's, over every head
    if NORM == 2:
        rstd, _ = heads_rstd_and_dot(
            x_rows,
            x_rows,
            stride_xh,
            stride_xh,
            stride_xd,
            stride_xd,
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
            False,
        )
    for h in range(h_start, h_end):
        head = tl.cast(h, tl.int64)
        if NORM == 2:
            w1, w2, w_tail = norm_weights(W + head * D, p, tail, D, R, INTERLEAVED, BLOCK_T, ACC)
        y1, y2, t = _normed_rotated(
            x_rows + head * stride_xh,
            stride_xd,
            p,
            mask,
            tail,
            tail_mask,
            w1,
            w2,
            w_tail,
            c1,
            s1,
            c2,
            s2,
            rstd,
            D,
            eps,
            R,
            INTERLEAVED,
            PACKED,
            NORM,
            INVERSE,
            BLOCK_T,
            ACC,
        )
        rows = out_rows + head * stride_oh  # MODE 0, 2, 3: this head's output rows
        if MODE != 0:
            # What the 16-bit op would have stored: the quantization's input.
            x_dtype = X.dtype.element_ty
            y1 = tl.where(mask, y1.to(x_dtype).to(ACC), 0.0)
            y2 = tl.where(mask, y2.to(x_dtype).to(ACC), 0.0)
            t = tl.where(tail_mask, t.to(x_dtype).to(ACC), 0.0)
        if MODE == 1:
            sums = OUT + b * stride_ob + block * stride_ol + head * stride_oh + tl.zeros([1], tl.int64)
            store_pairs(sums, p, (p < R // 2)[None, :], tl.sum(y1, 0)[None, :], tl.sum(y2, 0)[None, :], R, INTERLEAVED)
            if BLOCK_T > 0:
                tl.store(sums + tail, tl.sum(t, 0), mask=tail < D)
        if MODE == 2:
            scale, inverse = quantization_scale(_abs_max(y1, y2, t, BLOCK_T), INT8_MAX)
            tl.store(SCALE + b * stride_sb + head * stride_sh + pos, scale, mask=pos_mask)
            inverse = inverse[:, None]
        if MODE == 3:
            mean_row = K_SUM + b * stride_mb + head * stride_mh + tl.zeros([1], tl.int64)
            length = tl.cast(L, ACC)  # (tl.cast: Inductor may pass L as a Python int constant)
            m1, m2 = load_pairs(mean_row, 1, p, (p < R // 2)[None, :], R, INTERLEAVED, True, ACC)
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
            store_pairs(rows, p, mask, y1, y2, R, INTERLEAVED)
            if BLOCK_T > 0:
                tl.store(rows[:, None] + tail[None, :], t.to(OUT.dtype.element_ty), mask=tail_mask)


@triton.jit
def rope_kernel(
    Q,
    K,
    Q_OUT,
    K_OUT,
    COS,
    SIN,
    Q_W,
    K_W,
    Q_SCALE,
    K_SCALE,
    K_SUM,
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
    stride_oqb,
    stride_oql,
    stride_oqh,
    stride_okb,
    stride_okl,
    stride_okh,
    stride_qsb,
    stride_qsh,
    stride_ksb,
    stride_ksh,
    stride_mb,
    stride_mh,
    stride_tb,
    stride_tl,
    frame_size,
    width,
    eps,
    R: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PACKED: tl.constexpr,
    HALF_TABLE: tl.constexpr,
    GRID_ANGLES: tl.constexpr,
    NORM: tl.constexpr,
    INVERSE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ACC: tl.constexpr,
    QUANTIZE: tl.constexpr,
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
    b, pos, pos_mask, first_head = program_block(L, n_pos_blocks, heads_per_program, BLOCK_L)
    block = tl.program_id(0) % n_pos_blocks
    p = tl.arange(0, BLOCK_P)
    c1, s1, c2, s2 = angle_cos_sin(
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
        R,
        INTERLEAVED,
        HALF_TABLE,
        GRID_ANGLES,
        ACC,
    )
    start, end = head_range(first_head, 0, HQ, heads_per_program)
    _rotate_heads(
        Q,
        Q_OUT,
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
        stride_oqb,
        stride_oql,
        stride_oqh,
        D,
        eps,
        Q_SCALE,
        stride_qsb,
        stride_qsh,
        K_SUM,
        0,
        0,
        block,
        L,
        R,
        INTERLEAVED,
        PACKED,
        NORM,
        INVERSE,
        BLOCK_T,
        ACC,
        QUANTIZE,
    )
    start, end = head_range(first_head, HQ, HK, heads_per_program)
    _rotate_heads(
        K,
        K_OUT,
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
        stride_okb,
        stride_okl,
        stride_okh,
        D,
        eps,
        K_SCALE,
        stride_ksb,
        stride_ksh,
        K_SUM,
        stride_mb,
        stride_mh,
        block,
        L,
        R,
        INTERLEAVED,
        PACKED,
        NORM,
        INVERSE,
        BLOCK_T,
        ACC,
        3 if QUANTIZE == 2 else 0,
    )
