"""Triton kernels of 8-bit attention's k and v operands.

``kv8_quantize_kernel`` writes k per 128-key block in INT8 less its mean
over the sequence, and v in e4m3 with channel scales, transposed, from the
sequence statistics ``kv8_stats_kernel`` writes before (k's column sums,
v's channel amax, per chunk and reduced per head in a fixed order); the
forward kernel (``kernels/attention.py``, ``INT8`` and ``PV_FP8``) reads
them. ``fp8_rows_scale_kernel``: the scale bound of the FP8 output rows.
"""

import triton
import triton.language as tl

from compile_ops.kernels.attention_common import (
    INT8_MAX,
    fp8_value_positions,
    key_at_position,
    quantization_scale,
    round_to_int8,
)
from compile_ops.kernels.fp8 import E4M3_MAX


@triton.jit
def _kv8_head_totals(
    K_SUM,
    V_AMAX,
    head,
    chunks,
    cols,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WITH_K: tl.constexpr,
    WITH_V: tl.constexpr,
):
    """The ``chunks`` partial rows of one head (from ``head`` on: k's column
    sums, v's column amax) reduced in index order into row ``chunks``.
    ``.cg`` loads (from L2, not this SM's L1): other programs wrote them."""
    k_total = tl.zeros([BLOCK_D], tl.float32)
    v_total = tl.zeros([BLOCK_D], tl.float32)  # an amax of absolute values: 0 is the identity
    for start in range(0, chunks, 16):
        rows = start + tl.arange(0, 16)
        at = head + rows[:, None] * D + cols[None, :]
        mask = (rows < chunks)[:, None] & (cols < D)[None, :]
        if WITH_K:
            k_total += tl.sum(tl.load(K_SUM + at, mask=mask, other=0.0, cache_modifier=".cg"), 0)
        if WITH_V:
            v_total = tl.maximum(v_total, tl.max(tl.load(V_AMAX + at, mask=mask, other=0.0, cache_modifier=".cg"), 0))
    total = head + tl.cast(chunks, tl.int64) * D + cols
    if WITH_K:
        tl.store(K_SUM + total, k_total, mask=cols < D)
    if WITH_V:
        tl.store(V_AMAX + total, v_total, mask=cols < D)


@triton.jit
def kv8_counters_clear_kernel(COUNTS, n, BLOCK: tl.constexpr):
    """Zero ``kv8_stats_kernel``'s ``n`` int32 arrival counts. A kernel, not
    ``torch.zeros``, so that the zeroing is one of the op's own launches,
    which an eager launch plan (``_replay``) replays."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(COUNTS + offs, tl.zeros([BLOCK], tl.int32), mask=offs < n)


@triton.jit
def kv8_stats_kernel(
    K,
    V,
    K_SUM,
    V_AMAX,
    ARRIVALS,
    Hk,
    Lk,
    skb,
    skh,
    skl,
    svb,
    svh,
    svl,
    rows_per_chunk,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
    WITH_V: tl.constexpr,
    WITH_K: tl.constexpr,
):
    """Per (batch, k head) ``program_id(1)`` and chunk ``program_id(0)`` of
    ``rows_per_chunk`` keys: WITH_K, k's column sums (K_SUM) and, WITH_V, v's
    column amax (V_AMAX), both fp32 ``[B * Hk, chunks + 1, D]`` with
    ``chunks = cdiv(Lk, rows_per_chunk)``: row ``program_id(0)`` the chunk's,
    and row ``chunks`` the head's, reduced in index order by whichever of its
    programs arrives last (ARRIVALS, ``[B * Hk]`` int32 zeroed by
    ``kv8_counters_clear_kernel``, counts them in): the same bits on every
    run whatever the order the programs ran in, and ``kv8_quantize_kernel``
    reads one row, so the chunk count is free to follow the length. Triton
    issues the scalar atomic from one
    thread after a CTA barrier, so the release covers every thread's store
    of the chunk's row."""
    bh = tl.program_id(1)
    b = tl.cast(bh, tl.int64) // Hk
    h = bh - b * Hk
    cols = tl.arange(0, BLOCK_D)
    first = tl.program_id(0) * rows_per_chunk
    last = tl.minimum(first + rows_per_chunk, Lk)
    # Elementwise accumulators, reduced over their rows once after the loop,
    # not a row reduction (shared memory and barriers) in every step, which
    # is slower (docs/notes/attention.md).
    k_sum = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    v_amax = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    for start in range(first, last, BLOCK_L):
        rows = start + tl.arange(0, BLOCK_L)
        mask = (rows < last)[:, None] & (cols < D)[None, :]
        if WITH_K:
            k = tl.load(K + b * skb + h * skh + rows[:, None].to(tl.int64) * skl + cols[None, :], mask=mask, other=0.0)
            k_sum += k.to(tl.float32)
        if WITH_V:
            v = tl.load(V + b * svb + h * svh + rows[:, None].to(tl.int64) * svl + cols[None, :], mask=mask, other=0.0)
            v_amax = tl.maximum(v_amax, tl.abs(v.to(tl.float32)))
    chunks = tl.num_programs(0)
    head = tl.cast(bh, tl.int64) * (chunks + 1) * D
    out = head + tl.program_id(0) * D + cols
    if WITH_K:
        tl.store(K_SUM + out, tl.sum(k_sum, 0), mask=cols < D)
    if WITH_V:
        tl.store(V_AMAX + out, tl.max(v_amax, 0), mask=cols < D)
    # acq_rel: publishes this chunk's row (release) and, to the last program
    # to arrive, makes every other chunk's row visible (acquire).
    if tl.atomic_add(ARRIVALS + bh, 1, sem="acq_rel") == chunks - 1:
        _kv8_head_totals(K_SUM, V_AMAX, head, chunks, cols, D, BLOCK_D, WITH_K, WITH_V)


@triton.jit
def fp8_rows_scale_kernel(
    V_SCALE, ROW_SCALE, per_batch, FLOOR: tl.constexpr, HEADROOM: tl.constexpr, BLOCK: tl.constexpr
):
    """``reference.attention.fp8_rows_scale`` for batch element
    ``program_id(0)``: ``HEADROOM * max(FLOOR, max(V_SCALE[b]))`` over its
    ``per_batch`` channel scales (``[B, Hk, D]``, contiguous). The same fp32
    operations as the reference, so the same bits; a kernel rather than torch
    ops so that an eager call's launches are all its own (a launch plan)."""
    base = tl.cast(tl.program_id(0), tl.int64) * per_batch
    amax = tl.zeros([BLOCK], dtype=tl.float32)  # channel scales are positive
    for start in range(0, per_batch, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.load(V_SCALE + base + offs, mask=offs < per_batch, other=0.0))
    tl.store(ROW_SCALE + tl.program_id(0), tl.maximum(tl.max(amax, 0), FLOOR) * HEADROOM)


@triton.jit
def kv8_quantize_kernel(
    K,
    K8,
    K_SCALE,
    K_SUM,
    V,
    VT8,
    V_AMAX,
    V_SCALE,
    TOKENS,
    Q,
    Q8,
    Q_SCALE,
    H,
    L,
    chunks,
    GROUP,
    sqb,
    sqh,
    sql,
    s8qb,
    s8qh,
    s8ql,
    skb,
    skh,
    skl,
    s8b,
    s8h,
    s8l,
    svb,
    svh,
    svl,
    svtd,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
    WITH_V: tl.constexpr,
    WITH_K: tl.constexpr,
    GATHER: tl.constexpr = False,
    WITH_Q: tl.constexpr = False,
):
    """8-bit attention's k and v for the ``BLOCK_L`` (= INT8_KEY_BLOCK)
    positions of block ``program_id(0)`` of one (batch, head), as
    ``reference.attention.smooth_quantize_qk`` and ``quantize_v_fp8``
    specify them, from the head's sequence statistics: row ``chunks`` of
    ``kv8_stats_kernel``'s K_SUM and V_AMAX. WITH_K: K less its mean over the
    sequence in K8, int8 with one scale per block (K_SCALE ``[B * H,
    cdiv(L, BLOCK_L)]``). WITH_V: v's tile in e4m3 with the channel scales
    (V_SCALE ``[B * H, D]``, written by the first block), stored transposed
    into VT8 (channel stride ``svtd``, unit position stride, L rounded up to
    16 positions, zero past L), position r holding key ``key_at_position(r)``
    (the FP8 product's operand order, ``fp8_operand_order``). Without
    WITH_K, v's part alone (k quantized elsewhere: ``fused.qk_rope_int8``).
    GATHER: position r of K8 (VT8: the key at r) is key ``TOKENS[r]`` (``[L]``
    int32/int64) of K and V: the keys quantized in a layout's token order
    (the statistics are sums and maxima over all keys, which no order
    changes). WITH_Q (with GATHER): also the ``GROUP`` q heads that share
    this k head, each token rounded on its own (``quantization_scale``,
    ``round_to_int8``: the attention kernel's QUANTIZE_Q rounding) into Q8
    (q's layout, int8) and Q_SCALE (``[B, H * GROUP, L]`` fp32), in the same
    order."""
    bh = tl.program_id(1)
    b = tl.cast(bh, tl.int64) // H
    h = bh - b * H
    blk = tl.program_id(0)
    rows = blk * BLOCK_L + tl.arange(0, BLOCK_L)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < L)[:, None] & (cols < D)[None, :]
    source_rows = rows.to(tl.int64)  # the rows of K and V read for K8's and VT8's positions
    if GATHER:
        source_rows = tl.load(TOKENS + rows, mask=rows < L, other=0).to(tl.int64)
    totals = (tl.cast(bh, tl.int64) * (chunks + 1) + chunks) * D + cols
    if WITH_K:
        k = tl.load(K + b * skb + h * skh + source_rows[:, None] * skl + cols[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
        # (tl.cast, not L.to: Inductor may pass L as a Python int constant)
        mean = tl.div_rn(tl.load(K_SUM + totals, mask=cols < D, other=0.0), tl.cast(L, tl.float32))
        k = tl.where(mask, k - mean[None, :], 0.0)
        scale, inverse = quantization_scale(tl.max(tl.max(tl.abs(k), 1), 0), INT8_MAX)
        tl.store(K_SCALE + tl.cast(bh, tl.int64) * tl.cdiv(L, BLOCK_L) + blk, scale)
        tl.store(
            K8 + b * s8b + h * s8h + rows[:, None].to(tl.int64) * s8l + cols[None, :],
            round_to_int8(k, inverse),
            mask=mask,
        )
    if WITH_Q:
        for g in range(0, GROUP):
            hq = h * GROUP + g
            x = tl.load(Q + b * sqb + hq * sqh + source_rows[:, None] * sql + cols[None, :], mask=mask, other=0.0).to(
                tl.float32
            )
            q_scale, q_inverse = quantization_scale(tl.max(tl.abs(x), 1), INT8_MAX)
            tl.store(Q_SCALE + (b * H * GROUP + hq) * L + rows, q_scale, mask=rows < L)
            tl.store(
                Q8 + b * s8qb + hq * s8qh + rows[:, None].to(tl.int64) * s8ql + cols[None, :],
                round_to_int8(x, q_inverse[:, None]),
                mask=mask,
            )
    if WITH_V:
        v_scale, v_inverse = quantization_scale(tl.load(V_AMAX + totals, mask=cols < D, other=0.0), E4M3_MAX)
        if blk == 0:
            tl.store(V_SCALE + tl.cast(bh, tl.int64) * D + cols, v_scale, mask=cols < D)
        # Position r holds key key_at_position(r): the FP8 product's operand order (fp8_operand_order).
        v_keys = key_at_position(rows)
        v_rows = v_keys.to(tl.int64)
        if GATHER:
            v_rows = tl.load(TOKENS + v_keys, mask=v_keys < L, other=0).to(tl.int64)
        v_mask = (v_keys < L)[:, None] & (cols < D)[None, :]
        v = tl.load(V + b * svb + h * svh + v_rows[:, None] * svl + cols[None, :], mask=v_mask, other=0.0).to(
            tl.float32
        )
        v8 = (v * v_inverse[None, :]).to(tl.float8e4nv)
        vt8 = VT8 + tl.cast(bh, tl.int64) * D * svtd + cols[None, :] * svtd + rows[:, None]
        # The transposed store runs along the keys, and a mask at L would split
        # its 16-byte vectors into L's divisibility (single bytes at Wan's 32760
        # keys). VT8's rows are padded to 16 keys, so the store covers the
        # padding, with zeros (v's masked load gives 0 past L).
        padded = (rows < fp8_value_positions(L))[:, None] & (cols < D)[None, :]
        tl.store(vt8, v8, mask=padded)
