"""Triton kernels of the flash-attention backward.

Deterministic (no atomics): ``attn_bwd_row_stats_kernel`` computes
``delta = rowsum(dO * O)`` and a copy of the lse, both in rows padded to
``STATS_ROW_ALIGN``; ``attn_bwd_dkdv_kernel`` gives each program
``BLOCK_N`` keys of one k/v head and loops over the q heads of its GQA group
and their query tiles, accumulating dk and dv in registers;
``attn_bwd_dq_kernel`` gives each program ``BLOCK_M`` queries and loops over
key tiles. Both recompute the probabilities from the saved lse. Their key
and query loops, program order, block lists and TMA loads are the
forward's (``kernels/attention.py``); on Hopper the q and dO tiles (dk/dv
pass) and the k and v tiles (dq pass) come through descriptors over the
whole ``[B, H, L, D]`` tensors (``_streamed_rows``).

The sm_90 backward (``kernels/attention_sm90_backward.py``) runs the
statistics pass too, which then also zeroes its dq accumulator, and two
kernels of this module after it: ``attn_bwd_dq_from_acc_kernel`` (dq from
the accumulated sums) and ``attn_bwd_parts_kernel`` (dk and dv of the
items it splits).
"""

import triton
import triton.language as tl

from compile_ops.kernels.attention_common import (
    aligned_lengths,
    block_list,
    kv_len_of,
    load_tile,
    program_head,
    program_rank,
    query_program,
    query_tile,
    store_tile,
    tile_start,
    tiles_before,
    visible_mask,
)

#: The backward's per-query statistics (``attn_bwd_row_stats_kernel``) sit in
#: rows of ``_stats_row_length(Lq)``: Lq rounded up to this, a multiple of both
#: passes' query tiles. Why padded: the dk/dv pass loads them once per query
#: tile, and at a length that is not a multiple of 16 (Wan 480p: 32760
#: tokens) a row base of ``head * Lq`` and a mask of ``rows < Lq`` cost those
#: loads their vector width and the kernel spills (docs/notes/attention.md).
#: Padded, the rows start aligned and are read without a mask.
STATS_ROW_ALIGN = tl.constexpr(128)


@triton.jit
def _stats_row_length(Lq):
    return tl.cdiv(Lq, STATS_ROW_ALIGN) * STATS_ROW_ALIGN


@triton.jit
def attn_bwd_row_stats_kernel(
    OUT,
    DO,
    LSE,
    DELTA,
    LSE_ROWS,
    H,
    Lq,
    sob,
    soh,
    sol,
    sdb,
    sdh,
    sdl,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ACC: tl.constexpr,
    DQ_ACC=None,
):
    """The backward's per-query statistics, ``[B * H, _stats_row_length(Lq)]``
    fp32 each (the grid covers the padded rows; BLOCK_M divides
    STATS_ROW_ALIGN): DELTA = rowsum(dO * O), 0 past Lq; LSE_ROWS = the
    forward's LSE ``[B * H, Lq]``, +inf past Lq and for rows with no visible
    key, so that their probabilities are 0. DQ_ACC (the five-product
    backward's dq accumulator, ``[B * H, _stats_row_length(Lq), D]`` fp32):
    its rows zeroed in the same pass, not by a launch of their own."""
    _, _, o_off, do_off = program_head(tl.program_id(1), H, 1, sob, soh, sdb, sdh)  # O and dO share q's heads
    start = tl.program_id(0) * BLOCK_M
    offs = tl.arange(0, BLOCK_M)
    rows = start + offs
    offs_d = tl.arange(0, BLOCK_D)
    head = tl.cast(tl.program_id(1), tl.int64)
    o = load_tile(OUT + o_off, start, offs, Lq, sol, offs_d, D, BLOCK_D, True).to(ACC)
    do = load_tile(DO + do_off, start, offs, Lq, sdl, offs_d, D, BLOCK_D, True).to(ACC)
    lse = tl.load(LSE + head * Lq + rows, mask=rows < Lq, other=float("inf"))
    padded = head * _stats_row_length(Lq) + rows
    tl.store(DELTA + padded, tl.sum(o * do, 1))  # rows past Lq loaded as zeros: 0
    tl.store(LSE_ROWS + padded, tl.where(lse == float("-inf"), float("inf"), lse))
    if DQ_ACC is not None:
        tl.store(
            DQ_ACC + padded[:, None] * D + offs_d[None, :],
            tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
            mask=(offs_d < D)[None, :],
        )


@triton.jit
def attn_bwd_dq_from_acc_kernel(
    DQ_ACC, DQ, H, Lq, sqb, sqh, sql, scale, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr
):
    """dq = scale * DQ_ACC (the five-product backward's fp32 sums of dS K,
    ``[B * H, _stats_row_length(Lq), D]``) in dq's dtype and layout (strides
    ``sq*`` over ``[B, H, Lq, D]``, unit along D)."""
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < Lq)[:, None] & (cols < D)[None, :]
    acc = tl.load(
        DQ_ACC + (head.to(tl.int64) * _stats_row_length(Lq) + rows)[:, None] * D + cols[None, :], mask=mask, other=0.0
    )
    b = head // H
    h = head - b * H
    tl.store(
        DQ + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + rows.to(tl.int64)[:, None] * sql + cols[None, :],
        (acc * scale).to(DQ.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def attn_bwd_parts_kernel(
    PARTIALS,
    DK,
    DV,
    whole,
    parts,
    n_tiles,
    Hk,
    Lk,
    sdkb,
    sdkh,
    sdkl,
    sdvb,
    sdvh,
    sdvl,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """dk and dv of the five-product backward's items done in parts
    (``attn_bwd_sm90_kernel``'s PARTIALS ``[items - whole, parts, 2, 128,
    D]`` fp32, dk already scaled): each item's parts added in part order (so
    reruns give the same bits), cast to DK's / DV's dtype and stored at the
    item's 128 keys (those below Lk) through the strides ``sd*`` over ``[B,
    Hk, Lk, D]``. Program (item - whole, 128 / BLOCK_M rows)."""
    slot = tl.program_id(0)
    item = whole + slot
    tile = item % n_tiles
    bhk = item // n_tiles
    b = bhk // Hk
    hk = bhk - b * Hk
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D)
    at = rows[:, None] * D + cols[None, :]
    dk = tl.zeros([BLOCK_M, D], tl.float32)
    dv = tl.zeros([BLOCK_M, D], tl.float32)
    for k in range(parts):
        own = PARTIALS + (slot.to(tl.int64) * parts + k) * (2 * 128 * D)
        dk += tl.load(own + at)
        dv += tl.load(own + 128 * D + at)
    keys = tile * 128 + rows
    stored = (keys < Lk)[:, None]
    keys = keys.to(tl.int64)[:, None]
    tl.store(
        DK + b.to(tl.int64) * sdkb + hk.to(tl.int64) * sdkh + keys * sdkl + cols[None, :],
        dk.to(DK.dtype.element_ty),
        mask=stored,
    )
    tl.store(
        DV + b.to(tl.int64) * sdvb + hk.to(tl.int64) * sdvh + keys * sdvl + cols[None, :],
        dv.to(DV.dtype.element_ty),
        mask=stored,
    )


@triton.jit
def _streamed_rows(
    src,
    b,
    h,
    start,
    offs,
    n_rows,
    stride_row,
    cols,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROW_MASK: tl.constexpr,
    TMA: tl.constexpr,
):
    """A backward loop step's ``[len(offs), BLOCK_D]`` tile, rows ``start +
    offs`` of head (b, h): TMA (Hopper), through ``src``, a tensor descriptor
    over the whole ``[B, H, L, D]`` tensor with block ``[1, 1, len(offs),
    BLOCK_D]``, whose rows past L and columns past D come back as zeros (TMA
    coordinates are int32); else by pointers from ``src``, the head's base,
    zero past D and (ROW_MASK) past ``n_rows``, as :func:`load_tile`."""
    if TMA:
        tile = src.load([tl.cast(b, tl.int32), tl.cast(h, tl.int32), start, 0])
        return tl.reshape(tile, [tile.shape[2], tile.shape[3]])
    else:
        return load_tile(src, start, offs, n_rows, stride_row, cols, D, BLOCK_D, ROW_MASK)


@triton.jit
def _probabilities(s, scale, lse, FMA_EXPONENT: tl.constexpr):
    """``exp(scale * s - lse)``: the exponent is formed in natural units, with
    torch's two roundings, and only then moved to log2 units for exp2 (scaling
    s by ``scale * log2(e)`` first multiplies the roundings' error by the
    scores' magnitude, past torch's error in fp32 dk).
    16-bit inputs (``FMA_EXPONENT``) take that error for one fma per score:
    p is rounded to 16 bits before its dots anyway."""
    if FMA_EXPONENT:
        return tl.exp2(s * (scale * 1.4426950408889634) - lse * 1.4426950408889634)
    else:
        return tl.exp2((s * scale - lse) * 1.4426950408889634)  # log2(e)


@triton.jit
def _dkdv_tiles(
    dk,
    dv,
    k,
    v,
    Q,
    DO,
    LSE_ROWS,
    DELTA,
    sql,
    sdl,
    k_cols,
    offs_m,
    offs_d,
    first,
    last,
    BLOCKS,
    Lq,
    scale,
    b,
    h,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FMA_EXPONENT: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
    SPARSE: tl.constexpr,
    TMA: tl.constexpr,
):
    """TMA: Q and DO are whole-tensor descriptors, read at head (b, h).
    LSE_ROWS and DELTA: this head's padded statistics rows."""
    for i in range(first, last):  # query tiles
        start_m = tile_start(i, BLOCKS, offs_m.shape[0], SPARSE_BLOCK, SPARSE)
        rows = start_m + offs_m
        q = _streamed_rows(Q, b, h, start_m, offs_m, Lq, sql, offs_d, D, BLOCK_D, True, TMA)
        do = _streamed_rows(DO, b, h, start_m, offs_m, Lq, sdl, offs_d, D, BLOCK_D, True, TMA)
        lse = tl.load(LSE_ROWS + rows)  # padded rows: no mask (attn_bwd_row_stats_kernel)
        delta = tl.load(DELTA + rows)
        # Transposed scores [keys, queries]: dk and dv come out without transposes.
        p_t = _probabilities(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION), scale, lse[None, :], FMA_EXPONENT)
        if MASKED:  # only the causal diagonal tiles (keys past kv_len are zeroed at the store)
            p_t = tl.where(k_cols[:, None] <= rows[None, :], p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE_ROWS,
    DELTA,
    DK,
    DV,
    KV_LEN,
    BLOCKS,
    COUNTS,
    sqb,
    sqh,
    sql,
    skb,
    skh,
    skl,
    svb,
    svh,
    svl,
    sdb,
    sdh,
    sdl,
    sdkb,
    sdkh,
    sdkl,
    sdvb,
    sdvh,
    sdvl,
    sbb,
    sbh,
    sbr,
    scb,
    sch,
    scr,
    B,
    HK,
    GROUP,
    Lq,
    Lk,
    scale,
    heads_per_group,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KV_LEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ACC: tl.constexpr,
    FMA_EXPONENT: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
    SPARSE: tl.constexpr,
    TMA: tl.constexpr = False,
    ALIGNED_LENGTHS: tl.constexpr = False,
    HEAVY_FIRST: tl.constexpr = False,
):
    """dk, dv of BLOCK_N keys of one (batch, k/v head), summed over its GQA group.
    SPARSE: BLOCKS/COUNTS are the transposed lists (per q head and key block,
    the query blocks that list it). TMA (Hopper): the loop's q and dO tiles
    by tensor descriptors over the whole tensors (16-byte aligned bases and
    strides, which the launcher checks). HEAVY_FIRST as the forward: rank 0
    is the first key tile, which the most queries see."""
    Lq, Lk = aligned_lengths(Lq, Lk, ALIGNED_LENGTHS)
    tile, bh = program_rank(heads_per_group, HEAVY_FIRST)
    b, hk, k_off, v_off = program_head(bh, HK, 1, skb, skh, svb, svh)  # a program per (batch, k/v head)
    k_start = tile * BLOCK_N
    k_cols = k_start + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_len = kv_len_of(KV_LEN, b, Lk, HAS_KV_LEN)
    scale = tl.cast(scale, ACC)  # Inductor passes float scalars as fp64
    offs_n = tl.arange(0, BLOCK_N)
    k = load_tile(K + k_off, k_start, offs_n, Lk, skl, offs_d, D, BLOCK_D, True)
    v = load_tile(V + v_off, k_start, offs_n, Lk, svl, offs_d, D, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    # Queries that see some key of this tile: all, or (causal) rows >= k_start.
    # Tiles of rows that all lie at or past the tile's last key need no mask;
    # keys past kv_len are zeroed at the store instead of masked in the loop.
    q_begin = 0
    unmasked_begin = 0
    if CAUSAL:
        q_begin = (k_start // BLOCK_M) * BLOCK_M
        unmasked_begin = tl.minimum(tl.cdiv(k_start + BLOCK_N, BLOCK_M) * BLOCK_M, tl.cdiv(Lq, BLOCK_M) * BLOCK_M)
    if TMA:
        q_rows_src = tl.make_tensor_descriptor(
            Q, shape=[B, HK * GROUP, Lq, D], strides=[sqb, sqh, sql, 1], block_shape=[1, 1, BLOCK_M, BLOCK_D]
        )
        do_rows_src = tl.make_tensor_descriptor(
            DO, shape=[B, HK * GROUP, Lq, D], strides=[sdb, sdh, sdl, 1], block_shape=[1, 1, BLOCK_M, BLOCK_D]
        )
    if k_start < kv_len:
        for g in range(0, GROUP):
            h = hk * GROUP + g
            if TMA:
                q_base, do_base = q_rows_src, do_rows_src
            else:
                q_base, do_base = Q + b * sqb + h * sqh, DO + b * sdb + h * sdh
            row_base = (b * HK * GROUP + h) * _stats_row_length(Lq)
            blocks, count = BLOCKS, 0
            if SPARSE:
                blocks, count = block_list(BLOCKS, COUNTS, b, h, k_start // SPARSE_BLOCK, sbb, sbh, sbr, scb, sch, scr)
            first = tiles_before(q_begin, blocks, count, BLOCK_M, SPARSE_BLOCK, SPARSE)
            first_unmasked = tiles_before(unmasked_begin, blocks, count, BLOCK_M, SPARSE_BLOCK, SPARSE)
            last = tiles_before(tl.cdiv(Lq, BLOCK_M) * BLOCK_M, blocks, count, BLOCK_M, SPARSE_BLOCK, SPARSE)
            dk, dv = _dkdv_tiles(
                dk,
                dv,
                k,
                v,
                q_base,
                do_base,
                LSE_ROWS + row_base,
                DELTA + row_base,
                sql,
                sdl,
                k_cols,
                offs_m,
                offs_d,
                first,
                first_unmasked,
                blocks,
                Lq,
                scale,
                b,
                h,
                D,
                BLOCK_D,
                True,
                DOT_PRECISION,
                FMA_EXPONENT,
                SPARSE_BLOCK,
                SPARSE,
                TMA,
            )
            dk, dv = _dkdv_tiles(
                dk,
                dv,
                k,
                v,
                q_base,
                do_base,
                LSE_ROWS + row_base,
                DELTA + row_base,
                sql,
                sdl,
                k_cols,
                offs_m,
                offs_d,
                first_unmasked,
                last,
                blocks,
                Lq,
                scale,
                b,
                h,
                D,
                BLOCK_D,
                False,
                DOT_PRECISION,
                FMA_EXPONENT,
                SPARSE_BLOCK,
                SPARSE,
                TMA,
            )
    valid = (k_cols < kv_len)[:, None]
    store_tile(DK + b * sdkb + hk * sdkh, k_start, offs_n, Lk, sdkl, offs_d, tl.where(valid, dk * scale, 0.0), D)
    store_tile(DV + b * sdvb + hk * sdvh, k_start, offs_n, Lk, sdvl, offs_d, tl.where(valid, dv, 0.0), D)


@triton.jit
def _dq_tiles(
    dq,
    q,
    do,
    lse,
    delta,
    K,
    V,
    skl,
    svl,
    q_rows,
    offs_n,
    offs_d,
    first,
    last,
    BLOCKS,
    kv_len,
    Lk,
    scale,
    b,
    hk,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FMA_EXPONENT: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
    SPARSE: tl.constexpr,
    TMA: tl.constexpr,
):
    """TMA: K and V are whole-tensor descriptors, read at k/v head (b, hk)."""
    for i in range(first, last):  # key tiles
        start_n = tile_start(i, BLOCKS, offs_n.shape[0], SPARSE_BLOCK, SPARSE)
        cols = start_n + offs_n
        k = _streamed_rows(K, b, hk, start_n, offs_n, Lk, skl, offs_d, D, BLOCK_D, MASKED, TMA)
        v = _streamed_rows(V, b, hk, start_n, offs_n, Lk, svl, offs_d, D, BLOCK_D, MASKED, TMA)
        p = _probabilities(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), scale, lse[:, None], FMA_EXPONENT)
        if MASKED:
            p = tl.where(visible_mask(q_rows, cols, kv_len, CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE_ROWS,
    DELTA,
    DQ,
    KV_LEN,
    BLOCKS,
    COUNTS,
    sqb,
    sqh,
    sql,
    skb,
    skh,
    skl,
    svb,
    svh,
    svl,
    sdb,
    sdh,
    sdl,
    sdqb,
    sdqh,
    sdql,
    sbb,
    sbh,
    sbr,
    scb,
    sch,
    scr,
    B,
    H,
    GROUP,
    Lq,
    Lk,
    scale,
    heads_per_group,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KV_LEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ACC: tl.constexpr,
    FMA_EXPONENT: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
    SPARSE: tl.constexpr,
    TMA: tl.constexpr = False,
    ALIGNED_LENGTHS: tl.constexpr = False,
    HEAVY_FIRST: tl.constexpr = False,
):
    """dq of BLOCK_M queries of one (batch, head); SPARSE, HEAVY_FIRST as the
    forward. TMA (Hopper): the loop's k and v tiles by tensor descriptors over
    the whole tensors, as the dk/dv pass's q and dO."""
    Lq, Lk = aligned_lengths(Lq, Lk, ALIGNED_LENGTHS)
    tile, bh = query_tile(heads_per_group, HEAVY_FIRST)
    b, h, q_off, k_off, v_off, q_start, kv_len, unmasked_end, end = query_program(
        tile, bh, KV_LEN, H, GROUP, Lk, sqb, sqh, skb, skh, svb, svh, BLOCK_M, BLOCK_N, CAUSAL, HAS_KV_LEN
    )
    q_rows = q_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    scale = tl.cast(scale, ACC)  # Inductor passes float scalars as fp64
    row_base = tl.cast(bh, tl.int64) * _stats_row_length(Lq)
    offs_m = tl.arange(0, BLOCK_M)
    q = load_tile(Q + q_off, q_start, offs_m, Lq, sql, offs_d, D, BLOCK_D, True)
    do = load_tile(DO + b * sdb + h * sdh, q_start, offs_m, Lq, sdl, offs_d, D, BLOCK_D, True)
    lse = tl.load(LSE_ROWS + row_base + q_rows)  # padded rows: no mask
    delta = tl.load(DELTA + row_base + q_rows)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    blocks, count = BLOCKS, 0
    if SPARSE:
        blocks, count = block_list(BLOCKS, COUNTS, b, h, q_start // SPARSE_BLOCK, sbb, sbh, sbr, scb, sch, scr)
    in_last_block = not CAUSAL and not HAS_KV_LEN  # both rows below lie in the last key block or past it
    first_masked = tiles_before(unmasked_end, blocks, count, BLOCK_N, SPARSE_BLOCK, SPARSE, in_last_block)
    last = tiles_before(tl.cdiv(end, BLOCK_N) * BLOCK_N, blocks, count, BLOCK_N, SPARSE_BLOCK, SPARSE, in_last_block)
    if TMA:
        Hk = H // GROUP
        keys = tl.make_tensor_descriptor(
            K, shape=[B, Hk, Lk, D], strides=[skb, skh, skl, 1], block_shape=[1, 1, BLOCK_N, BLOCK_D]
        )
        values = tl.make_tensor_descriptor(
            V, shape=[B, Hk, Lk, D], strides=[svb, svh, svl, 1], block_shape=[1, 1, BLOCK_N, BLOCK_D]
        )
    else:
        keys, values = K + k_off, V + v_off
    dq = _dq_tiles(
        dq,
        q,
        do,
        lse,
        delta,
        keys,
        values,
        skl,
        svl,
        q_rows,
        offs_n,
        offs_d,
        0,
        first_masked,
        blocks,
        kv_len,
        Lk,
        scale,
        b,
        h // GROUP,
        D,
        BLOCK_D,
        False,
        CAUSAL,
        DOT_PRECISION,
        FMA_EXPONENT,
        SPARSE_BLOCK,
        SPARSE,
        TMA,
    )
    dq = _dq_tiles(
        dq,
        q,
        do,
        lse,
        delta,
        keys,
        values,
        skl,
        svl,
        q_rows,
        offs_n,
        offs_d,
        first_masked,
        last,
        blocks,
        kv_len,
        Lk,
        scale,
        b,
        h // GROUP,
        D,
        BLOCK_D,
        True,
        CAUSAL,
        DOT_PRECISION,
        FMA_EXPONENT,
        SPARSE_BLOCK,
        SPARSE,
        TMA,
    )
    store_tile(DQ + b * sdqb + h * sdqh, q_start, offs_m, Lq, sdql, offs_d, dq * scale, D)
