"""Triton kernels of flash attention: forward, and the three backward passes.

Forward (``attn_fwd_kernel``): one program per ``BLOCK_M`` queries of one
(batch, head); it streams ``BLOCK_N``-key tiles of K and V with an online
softmax (exp2 of scores scaled by ``scale * log2(e)``) and writes the output
and the natural-log log-sum-exp. Nothing ``Lq x Lk`` is
stored.

Backward, deterministic (no atomics): ``attn_bwd_row_stats_kernel`` computes
``delta = rowsum(dO * O)`` and a copy of the lse, both in rows padded to
``STATS_ROW_ALIGN``; ``attn_bwd_dkdv_kernel`` gives each program
``BLOCK_N`` keys of one k/v head and loops over the q heads of its GQA group
and their query tiles, accumulating dk and dv in registers;
``attn_bwd_dq_kernel`` gives each program ``BLOCK_M`` queries and loops over
key tiles. Both recompute the probabilities from the saved lse.

Key loops are split in two: tiles that need no mask (every key valid and, for
causal, below the diagonal for every query of the tile) run without one; only
the tail and diagonal tiles pay for masking. Causal is SDPA's: query i sees
keys ``j <= i``. Keys past ``kv_len`` (the batch element's valid length, or
Lk) never contribute; a query with no visible key gets 0 and an lse of -inf.

Program order: as launched (query or key tile fastest, then batch x head),
except for causal launches (``HEAVY_FIRST``), where a tile's work grows with
its distance from the diagonal: ``program_rank`` runs the tiles with the
most keys (forward, dq) or queries (dk/dv) first, interleaving a group of
heads sized by the launcher (``ops.attention.causal_order``).

Block-sparse attention (the ``block_sparse`` family) runs the same kernels
with ``SPARSE``: instead of a range of key tiles, a program walks the
``SPARSE_BLOCK``-sized blocks listed for its query block (forward, dq) or, in
the dk/dv pass, the query blocks that list its key block (the transposed
lists). Loops count tiles, so the dense and sparse paths are one loop:
``tile_start`` maps a tile number to its first row, and ``tiles_before``
a row to the number of tiles that start below it. Lists are ascending (the
ops sort them), so the listed tiles that need a mask are a contiguous run,
the same run as the dense loop's: with every block listed, sparse and dense
attention run the same code on the same tiles in the same order.

8-bit attention (the forward's ``INT8`` and ``PV_FP8`` options) reads k
and v as ``kv8_quantize_kernel`` writes them: k per 128-key block in INT8
less its mean over the sequence, and v in e4m3 with channel scales,
transposed, from the sequence statistics ``kv8_stats_kernel`` writes
before (k's column sums, v's channel amax, per chunk and reduced per head
in a fixed order). q it rounds itself, per token, as each program loads its rows
(``QUANTIZE_Q``).

On Hopper the tiles a loop streams come by TMA (``TMA``): the forward's K
and V through per-head descriptors, the backward's q and dO (dk/dv pass) and
k and v (dq pass) through descriptors over the whole ``[B, H, L, D]``
tensors (``_streamed_rows``); the launchers pick it in ``forward_tiles``,
``dkdv_tiles`` and ``dq_tiles``.

Offsets of the (batch, head) bases are int64; q, k, v, dO and O have a unit
stride along D (the launcher guarantees it); D is padded to ``BLOCK_D``.
"""
import triton
import triton.language as tl

from compile_ops.kernels.attention_common import (INT8_BIAS, INT8_BIAS_BITS, INT8_MAX, P_FP8_SHIFT, aligned_lengths,
                                                  block_list, kv_len_of, load_tile, program_head, program_rank,
                                                  query_program, query_tile, quantization_scale, round_to_int8,
                                                  store_tile, tile_start, tiles_before, visible_mask)
from compile_ops.kernels.fp8 import E4M3_MAX, to_e4m3

#: The 8-bit rounding under the names ``kernels/rope.py`` imports from here.
_INT8_MAX, _int8_of, _scale_of = INT8_MAX, round_to_int8, quantization_scale


@triton.jit
def _load_channels(base, start, offs, n_keys, stride_channel, chans, D: tl.constexpr, KEY_MASK: tl.constexpr):
    """Keys ``start + offs`` of a channel-major tensor (FP8 P V's transposed V,
    ``[D, Lk]`` with unit key stride) as a ``[BLOCK_D, len(offs)]`` tile, zero
    past D and (KEY_MASK) past ``n_keys``. The pointer path of pre-Hopper GPUs
    and the interpreter; Hopper loads the same tile by TMA."""
    ptrs = base + chans[:, None] * stride_channel + (tl.cast(start, tl.int64) + offs)[None, :]
    mask = (chans < D)[:, None]
    if KEY_MASK:
        mask = mask & (start + offs < n_keys)[None, :]
    return tl.load(ptrs, mask=mask, other=0.0)


# ---------------------------------------------------------------- forward


@triton.jit
def _fwd_tiles(acc, m, l, q, K, V, skl, svl, q_rows, offs_n, offs_d, first, last, BLOCKS, count, kv_len, Lk,
               qk_scale, q_scale, K_SCALE,
               D: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               DOT_PRECISION: tl.constexpr, FMA_EXPONENT: tl.constexpr, SPARSE_BLOCK: tl.constexpr,
               SPARSE: tl.constexpr, TMA: tl.constexpr, DOT_ACC: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
               INT8: tl.constexpr, KEY_BLOCK: tl.constexpr, PV_FP8: tl.constexpr,
               LIST_BY_ASM: tl.constexpr = False):
    """Online softmax over key tiles; ``m`` is the running max of the raw
    scores q.k, and exponents are ``(s - m) * scale * log2(e)``: scaled after
    the subtraction, so their rounding error is relative to the (small)
    difference, not to the scores' magnitude. The lse, and so the backward's
    probabilities, keep torch's accuracy (a single visible key gives p == 1
    exactly, and a causal first row a dq of 0). ``FMA_EXPONENT`` (16-bit
    inputs) forms the exponent as one fma, ``s * c - m * c``: one instruction
    less per score, and its extra error (an ulp of ``m * c``) is far below
    the rounding of p to the 16-bit dtype for the second dot.

    Hopper options (``forward_tiles`` picks them): ``TMA``: K and V are tensor
    descriptors, loaded by the TMA unit (rows past Lk and columns past D come
    back as zeros); ``DOT_ACC``: the rescaled accumulator is the second dot's
    accumulator operand (wgmma adds into it) instead of a separate add;
    ``WARP_SPECIALIZE``: Triton's producer/consumer warp groups for the loop;
    ``LIST_BY_ASM`` (SPARSE): the block list read past the pipeliner
    (:func:`tile_start`; ``count`` entries).

    ``INT8`` (8-bit attention): q and k are int8, q with per-token scales
    (``q_scale``, this program's rows), k with one scale per KEY_BLOCK
    keys (``K_SCALE``, this head's blocks), so a tile's scores are its
    integer dot (exact in int32) times one factor per row. Converting int32
    scores to fp32 is a 16-per-clock instruction on Hopper, as slow as the
    exp2 itself; instead each score's bits get 1.5 * 2**23 added, which makes
    them the fp32 number ``1.5 * 2**23 + s`` exactly (``|s| < 2**22``: at most
    127 * 127 * 256), and the offset is folded into the exponent's fma
    (``INT8_BIAS``). Per score that is one integer add where the 16-bit path
    has none.

    ``PV_FP8`` (with INT8): V is e4m3, transposed (``[D, Lk]`` per head, one
    scale per channel applied after the loop), and each tile's ``2**8 * p``
    is rounded to e4m3 for an FP8 dot at twice the 16-bit rate. The tile's
    products are summed by a fresh dot and added to the fp32 accumulator
    (two-level accumulation: Hopper's FP8 MMA keeps fewer accumulator bits
    than fp32, which over one tile of keys is far below e4m3's rounding).
    With DOT_ACC the accumulator is the FP8 dot's own operand instead: 50
    registers fewer and 2-3% faster on an H100, but 1.3-2x the distance to
    the specification (bench/notes.md), so ``forward_tiles`` leaves it off."""
    for i in tl.range(first, last, warp_specialize=WARP_SPECIALIZE):  # key tiles
        start_n = tile_start(i, BLOCKS, offs_n.shape[0], SPARSE_BLOCK, SPARSE, LIST_BY_ASM, count)
        cols = start_n + offs_n
        if TMA:
            k = K.load([start_n, 0])
            if PV_FP8:  # the transposed tile: the FP8 MMA takes its B operand K-major
                v = tl.trans(V.load([0, start_n]))
            else:
                v = V.load([start_n, 0])
        else:
            k = load_tile(K, start_n, offs_n, Lk, skl, offs_d, D, BLOCK_D, MASKED)
            if PV_FP8:
                v = tl.trans(_load_channels(V, start_n, offs_n, Lk, svl, offs_d, D, MASKED))
            else:
                v = load_tile(V, start_n, offs_n, Lk, svl, offs_d, D, BLOCK_D, MASKED)
        if INT8:
            # Biased scores (see above) and the row factor that makes them real: (s - BIAS) * row.
            s = (tl.dot(q, tl.trans(k), out_dtype=tl.int32) + INT8_BIAS_BITS).to(tl.float32, bitcast=True)
            row = q_scale * tl.load(K_SCALE + start_n // KEY_BLOCK)
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            s = tl.where(visible_mask(q_rows, cols, kv_len, CAUSAL), s, float("-inf"))
        if INT8:  # row > 0: the largest biased score is the largest score
            m_new = tl.maximum(m, (tl.max(s, 1) - INT8_BIAS) * row)
        else:
            m_new = tl.maximum(m, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf: shift by 0 so
        # that exp2 gives 0, not exp2(-inf + inf) = NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        if INT8:  # exp2((s - BIAS) * row * c - m * c) as one fma per score
            factor = row * qk_scale
            shift = factor * INT8_BIAS + m_shift * qk_scale  # (constexpr on the right: the interpreter needs it)
            if PV_FP8:
                shift = shift - P_FP8_SHIFT
            p = tl.exp2(s * factor[:, None] - shift[:, None])
            alpha = tl.exp2((m - m_shift) * qk_scale)
        elif FMA_EXPONENT:
            m_scaled = m_shift * qk_scale
            p = tl.exp2(s * qk_scale - m_scaled[:, None])
            alpha = tl.exp2(m * qk_scale - m_scaled)
        else:
            p = tl.exp2((s - m_shift[:, None]) * qk_scale)
            alpha = tl.exp2((m - m_shift) * qk_scale)
        l = l * alpha + tl.sum(p, 1)
        if PV_FP8 and not DOT_ACC:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float8e4nv), v)
        elif PV_FP8:
            acc = tl.dot(p.to(tl.float8e4nv), v, acc * alpha[:, None])
        elif DOT_ACC:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    return acc, m, l


@triton.jit
def attn_fwd_kernel(Q, K, V, OUT, LSE, KV_LEN, BLOCKS, COUNTS, Q_SCALE, K_SCALE, V_SCALE, ROW_SCALE, OUT_SCALE,
                    sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sob, soh, sol, sbb, sbh, sbr, scb, sch, scr,
                    H, GROUP, Lq, Lk, scale, heads_per_group,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, HAS_KV_LEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    ACC: tl.constexpr, FMA_EXPONENT: tl.constexpr, SPARSE_BLOCK: tl.constexpr,
                    SPARSE: tl.constexpr, TMA: tl.constexpr = False, DOT_ACC: tl.constexpr = False,
                    WARP_SPECIALIZE: tl.constexpr = False, INT8: tl.constexpr = False,
                    INT8_KEY_BLOCK: tl.constexpr = 128, PV_FP8: tl.constexpr = False,
                    OUT_FP8: tl.constexpr = False, ALIGNED_LENGTHS: tl.constexpr = False,
                    LIST_BY_ASM: tl.constexpr = False, HEAVY_FIRST: tl.constexpr = False,
                    QUANTIZE_Q: tl.constexpr = False):
    """OUT = softmax(scale Q K^T) V for BLOCK_M queries of one (batch, head); LSE
    ``[B * H, Lq]`` in natural log. ``scale > 0``. SPARSE: only the key blocks
    that BLOCKS/COUNTS list for this query block. TMA, DOT_ACC,
    WARP_SPECIALIZE: see ``_fwd_tiles`` (TMA needs 16-byte aligned bases and
    row strides, which the launcher checks). INT8: Q and K int8, Q_SCALE
    their per-token scales ``[B, H, Lq]``, K_SCALE one per INT8_KEY_BLOCK keys
    ``[B, Hk, ceil(Lk / INT8_KEY_BLOCK)]`` (fp32 contiguous; BLOCK_N divides
    INT8_KEY_BLOCK). QUANTIZE_Q (with INT8): Q is 16-bit and each program
    rounds its own rows to int8 per token (``quantization_scale``, ``round_to_int8``: the
    specification's rounding; Q_SCALE unused), so q is read once, by the
    program that needs it, not read, written and read again by a pass of
    its own. PV_FP8 (with INT8): V is e4m3 ``[B, Hk, D, Lk]`` with a
    unit key stride (``svl`` is then the stride between channels) and V_SCALE
    its per-channel scales ``[B, Hk, D]`` (fp32 contiguous). OUT_FP8: OUT is
    e4m3, ``out / ROW_SCALE[b]`` rounded to nearest even and clamped to
    +-448 (``ROW_SCALE [B]`` fp32, a bound on |out|: the FP8 rows of
    ``reference.attention.attention_int8_fp8_rows``), and the programs of head
    0 write that scale to their rows of ``OUT_SCALE [B, Lq]``. ALIGNED_LENGTHS
    (the three attention kernels): Lq and Lk are multiples of 16 (``aligned_lengths``).
    LIST_BY_ASM (SPARSE, CUDA, lists at least one entry wide): see
    :func:`tile_start`. HEAVY_FIRST, ``heads_per_group`` (the three
    attention kernels): the program order of causal launches,
    :func:`program_rank`."""
    Lq, Lk = aligned_lengths(Lq, Lk, ALIGNED_LENGTHS)
    tile, bh = query_tile(heads_per_group, HEAVY_FIRST)
    b, h, q_off, k_off, v_off, q_start, kv_len, unmasked_end, end = query_program(
        tile, bh, KV_LEN, H, GROUP, Lk, sqb, sqh, skb, skh, svb, svh, BLOCK_M, BLOCK_N, CAUSAL, HAS_KV_LEN)
    o_off = b * sob + h * soh
    q_rows = q_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    scale = tl.cast(scale, ACC)  # Inductor passes float scalars as fp64
    qk_scale = scale * 1.4426950408889634  # log2(e)

    if TMA:
        q = tl.make_tensor_descriptor(Q + q_off, shape=[Lq, D], strides=[sql, 1],
                                      block_shape=[BLOCK_M, BLOCK_D]).load([q_start, 0])
        keys = tl.make_tensor_descriptor(K + k_off, shape=[Lk, D], strides=[skl, 1], block_shape=[BLOCK_N, BLOCK_D])
        if PV_FP8:  # transposed: channels are its rows
            values = tl.make_tensor_descriptor(V + v_off, shape=[D, Lk], strides=[svl, 1],
                                               block_shape=[BLOCK_D, BLOCK_N])
        else:
            values = tl.make_tensor_descriptor(V + v_off, shape=[Lk, D], strides=[svl, 1],
                                               block_shape=[BLOCK_N, BLOCK_D])
    else:
        q = load_tile(Q + q_off, q_start, tl.arange(0, BLOCK_M), Lq, sql, offs_d, D, BLOCK_D, True)
        keys, values = K + k_off, V + v_off
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    m = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
    l = tl.zeros([BLOCK_M], dtype=ACC)
    q_scale, k_scales = 0.0, K_SCALE
    if INT8:
        # Rows past Lq get a factor of 1 (never 0: a masked score times 0 would be NaN); they are not stored.
        if QUANTIZE_Q:
            q_scale, q_inverse = quantization_scale(tl.max(tl.abs(q.to(tl.float32)), 1), INT8_MAX)
            q = round_to_int8(q.to(tl.float32), q_inverse[:, None])
            q_scale = tl.where(q_rows < Lq, q_scale, 1.0)
        else:
            q_scale = tl.load(Q_SCALE + (b * H + h) * Lq + q_rows, mask=q_rows < Lq, other=1.0)
        k_scales = K_SCALE + (b * (H // GROUP) + h // GROUP) * tl.cdiv(Lk, INT8_KEY_BLOCK)
    blocks, count = BLOCKS, 0
    if SPARSE:
        blocks, count = block_list(BLOCKS, COUNTS, b, h, q_start // SPARSE_BLOCK, sbb, sbh, sbr, scb, sch, scr)
    first_masked = tiles_before(unmasked_end, blocks, count, BLOCK_N, SPARSE_BLOCK, SPARSE)
    last = tiles_before(tl.cdiv(end, BLOCK_N) * BLOCK_N, blocks, count, BLOCK_N, SPARSE_BLOCK, SPARSE)
    acc, m, l = _fwd_tiles(acc, m, l, q, keys, values, skl, svl, q_rows, offs_n, offs_d, 0, first_masked,
                           blocks, count, kv_len, Lk, qk_scale, q_scale, k_scales, D, BLOCK_D, False, CAUSAL,
                           DOT_PRECISION, FMA_EXPONENT, SPARSE_BLOCK, SPARSE, TMA, DOT_ACC, WARP_SPECIALIZE, INT8,
                           INT8_KEY_BLOCK, PV_FP8, LIST_BY_ASM)
    acc, m, l = _fwd_tiles(acc, m, l, q, keys, values, skl, svl, q_rows, offs_n, offs_d, first_masked, last,
                           blocks, count, kv_len, Lk, qk_scale, q_scale, k_scales, D, BLOCK_D, True, CAUSAL,
                           DOT_PRECISION, FMA_EXPONENT, SPARSE_BLOCK, SPARSE, TMA, DOT_ACC, False, INT8, INT8_KEY_BLOCK,
                           PV_FP8)

    empty = l == 0.0
    out = acc / tl.where(empty, 1.0, l)[:, None]
    log2_l = tl.log2(tl.where(empty, 1.0, l))
    if PV_FP8:  # V's channel scales; l sums 2**8 p
        v_scales = V_SCALE + (b * (H // GROUP) + h // GROUP) * D
        out = out * tl.load(v_scales + offs_d, mask=offs_d < D, other=0.0)[None, :]
        log2_l = log2_l - P_FP8_SHIFT
    if OUT_FP8:
        row_scale = tl.load(ROW_SCALE + b)
        # The reciprocal correctly rounded, as the specification's fp32 division.
        inverse = tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), row_scale)
        out = to_e4m3(out.to(tl.float32), inverse)
        if h == 0:
            tl.store(OUT_SCALE + b * Lq + q_rows, tl.zeros([BLOCK_M], tl.float32) + row_scale, mask=q_rows < Lq)
    store_tile(OUT + o_off, q_start, tl.arange(0, BLOCK_M), Lq, sol, offs_d, out, D)
    lse = tl.where(empty, float("-inf"), m * scale + log2_l * 0.6931471805599453)  # ln 2
    tl.store(LSE + tl.cast(bh, tl.int64) * Lq + q_rows, lse, mask=q_rows < Lq)


# ---------------------------------------------------------------- 8-bit operands


@triton.jit
def _kv8_head_totals(K_SUM, V_AMAX, head, chunks, cols, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     WITH_K: tl.constexpr, WITH_V: tl.constexpr):
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
            v_total = tl.maximum(v_total, tl.max(tl.load(V_AMAX + at, mask=mask, other=0.0, cache_modifier=".cg"),
                                                 0))
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
def kv8_stats_kernel(K, V, K_SUM, V_AMAX, ARRIVALS, Hk, Lk, skb, skh, skl, svb, svh, svl, rows_per_chunk,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, WITH_V: tl.constexpr,
                     WITH_K: tl.constexpr):
    """Per (batch, k head) ``program_id(1)`` and chunk ``program_id(0)`` of
    ``rows_per_chunk`` keys: WITH_K, k's column sums (K_SUM) and, WITH_V, v's
    column amax (V_AMAX), both fp32 ``[B * Hk, chunks + 1, D]`` with
    ``chunks = cdiv(Lk, rows_per_chunk)``: row ``program_id(0)`` the chunk's,
    and row ``chunks`` the head's, reduced in index order by whichever of its
    programs arrives last (ARRIVALS, ``[B * Hk]`` int32 zeroed by
    ``kv8_counters_clear_kernel``, counts them in): the same bits on every
    run whatever the order the programs ran in, and ``kv8_quantize_kernel``
    reads one row. (The quantizing programs once reduced 16 partials each
    themselves; with the head's total summed once here, the chunk count is
    free to follow the length.) Triton issues the scalar atomic from one
    thread after a CTA barrier, so the release covers every thread's store
    of the chunk's row."""
    bh = tl.program_id(1)
    b = tl.cast(bh, tl.int64) // Hk
    h = bh - b * Hk
    cols = tl.arange(0, BLOCK_D)
    first = tl.program_id(0) * rows_per_chunk
    last = tl.minimum(first + rows_per_chunk, Lk)
    # Elementwise accumulators, reduced over their rows once after the loop,
    # not a row reduction (shared memory and barriers) in every step: the
    # per-step form ran at 1.0-1.3 TB/s on an H100 (bench/notes.md).
    k_sum = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    v_amax = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    for start in range(first, last, BLOCK_L):
        rows = start + tl.arange(0, BLOCK_L)
        mask = (rows < last)[:, None] & (cols < D)[None, :]
        if WITH_K:
            k = tl.load(K + b * skb + h * skh + rows[:, None].to(tl.int64) * skl + cols[None, :], mask=mask,
                        other=0.0)
            k_sum += k.to(tl.float32)
        if WITH_V:
            v = tl.load(V + b * svb + h * svh + rows[:, None].to(tl.int64) * svl + cols[None, :], mask=mask,
                        other=0.0)
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
def fp8_rows_scale_kernel(V_SCALE, ROW_SCALE, per_batch, FLOOR: tl.constexpr, HEADROOM: tl.constexpr,
                          BLOCK: tl.constexpr):
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
def kv8_quantize_kernel(K, K8, K_SCALE, K_SUM, V, VT8, V_AMAX, V_SCALE, H, L, chunks, skb, skh, skl, s8b, s8h, s8l,
                        svb, svh, svl, svtd,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                        WITH_V: tl.constexpr, WITH_K: tl.constexpr):
    """8-bit attention's k and v for the ``BLOCK_L`` (= INT8_KEY_BLOCK)
    positions of block ``program_id(0)`` of one (batch, head), as
    ``reference.attention.smooth_quantize_qk`` and ``quantize_v_fp8``
    specify them, from the head's sequence statistics: row ``chunks`` of
    ``kv8_stats_kernel``'s K_SUM and V_AMAX. WITH_K: K less its mean over the
    sequence in K8, int8 with one scale per block (K_SCALE ``[B * H,
    cdiv(L, BLOCK_L)]``). WITH_V: v's tile in e4m3 with the channel scales
    (V_SCALE ``[B * H, D]``, written by the first block), stored transposed
    into VT8 (channel stride ``svtd``, unit position stride). Without
    WITH_K, v's part alone (k quantized elsewhere: ``fused.qk_rope_int8``)."""
    bh = tl.program_id(1)
    b = tl.cast(bh, tl.int64) // H
    h = bh - b * H
    blk = tl.program_id(0)
    rows = blk * BLOCK_L + tl.arange(0, BLOCK_L)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < L)[:, None] & (cols < D)[None, :]
    totals = (tl.cast(bh, tl.int64) * (chunks + 1) + chunks) * D + cols
    if WITH_K:
        k = tl.load(K + b * skb + h * skh + rows[:, None].to(tl.int64) * skl + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        # (tl.cast, not L.to: Inductor may pass L as a Python int constant)
        mean = tl.div_rn(tl.load(K_SUM + totals, mask=cols < D, other=0.0), tl.cast(L, tl.float32))
        k = tl.where(mask, k - mean[None, :], 0.0)
        scale, inverse = quantization_scale(tl.max(tl.max(tl.abs(k), 1), 0), INT8_MAX)
        tl.store(K_SCALE + tl.cast(bh, tl.int64) * tl.cdiv(L, BLOCK_L) + blk, scale)
        tl.store(K8 + b * s8b + h * s8h + rows[:, None].to(tl.int64) * s8l + cols[None, :], round_to_int8(k, inverse),
                 mask=mask)
    if WITH_V:
        v_scale, v_inverse = quantization_scale(tl.load(V_AMAX + totals, mask=cols < D, other=0.0), E4M3_MAX)
        if blk == 0:
            tl.store(V_SCALE + tl.cast(bh, tl.int64) * D + cols, v_scale, mask=cols < D)
        v = tl.load(V + b * svb + h * svh + rows[:, None].to(tl.int64) * svl + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        v8 = (v * v_inverse[None, :]).to(tl.float8e4nv)
        vt8 = VT8 + tl.cast(bh, tl.int64) * D * svtd + cols[None, :] * svtd + rows[:, None]
        # The transposed store runs along the keys, and a mask at L would split
        # its 16-byte vectors into L's divisibility (single bytes at Wan's 32760
        # keys). VT8's rows are padded to 16 keys, so the store covers the
        # padding, with zeros (v's masked load gives 0 past L).
        padded = (rows < tl.cdiv(L, 16) * 16)[:, None] & (cols < D)[None, :]
        tl.store(vt8, v8, mask=padded)


# ---------------------------------------------------------------- backward


#: The backward's per-query statistics (``attn_bwd_row_stats_kernel``) sit in
#: rows of ``_stats_row_length(Lq)``: Lq rounded up to this, a multiple of both
#: passes' query tiles. Why padded: the dk/dv pass loads them once per query
#: tile, and at a length that is not a multiple of 16 (Wan 480p: 32760
#: tokens) a row base of ``head * Lq`` and a mask of ``rows < Lq`` cost those
#: loads their vector width and the kernel 2.2x its spills (H100,
#: [1,24,4600,128]: the pass 1.35 ms against 1.04 at 4608). Padded, the rows
#: start aligned and are read without a mask.
STATS_ROW_ALIGN = tl.constexpr(128)


@triton.jit
def _stats_row_length(Lq):
    return tl.cdiv(Lq, STATS_ROW_ALIGN) * STATS_ROW_ALIGN


@triton.jit
def attn_bwd_row_stats_kernel(OUT, DO, LSE, DELTA, LSE_ROWS, H, Lq, sob, soh, sol, sdb, sdh, sdl,
                              D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, ACC: tl.constexpr,
                              DQ_ACC=None):
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
        tl.store(DQ_ACC + padded[:, None] * D + offs_d[None, :], tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
                 mask=(offs_d < D)[None, :])


@triton.jit
def attn_bwd_dq_from_acc_kernel(DQ_ACC, DQ, H, Lq, sqb, sqh, sql, scale, D: tl.constexpr, BLOCK_D: tl.constexpr,
                                BLOCK_M: tl.constexpr):
    """dq = scale * DQ_ACC (the five-product backward's fp32 sums of dS K,
    ``[B * H, _stats_row_length(Lq), D]``) in dq's dtype and layout (strides
    ``sq*`` over ``[B, H, Lq, D]``, unit along D)."""
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < Lq)[:, None] & (cols < D)[None, :]
    acc = tl.load(DQ_ACC + (head.to(tl.int64) * _stats_row_length(Lq) + rows)[:, None] * D + cols[None, :],
                  mask=mask, other=0.0)
    b = head // H
    h = head - b * H
    tl.store(DQ + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + rows.to(tl.int64)[:, None] * sql + cols[None, :],
             (acc * scale).to(DQ.dtype.element_ty), mask=mask)


@triton.jit
def attn_bwd_parts_kernel(PARTIALS, DK, DV, whole, parts, n_tiles, Hk, Lk, sdkb, sdkh, sdkl, sdvb, sdvh, sdvl,
                          D: tl.constexpr, BLOCK_M: tl.constexpr):
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
    tl.store(DK + b.to(tl.int64) * sdkb + hk.to(tl.int64) * sdkh + keys * sdkl + cols[None, :],
             dk.to(DK.dtype.element_ty), mask=stored)
    tl.store(DV + b.to(tl.int64) * sdvb + hk.to(tl.int64) * sdvh + keys * sdvl + cols[None, :],
             dv.to(DV.dtype.element_ty), mask=stored)


@triton.jit
def _streamed_rows(src, b, h, start, offs, n_rows, stride_row, cols, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   ROW_MASK: tl.constexpr, TMA: tl.constexpr):
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
    scores' magnitude: 4x torch's error in fp32 dk, found by Hypothesis).
    16-bit inputs (``FMA_EXPONENT``) take that error for one fma per score:
    p is rounded to 16 bits before its dots anyway."""
    if FMA_EXPONENT:
        return tl.exp2(s * (scale * 1.4426950408889634) - lse * 1.4426950408889634)
    else:
        return tl.exp2((s * scale - lse) * 1.4426950408889634)  # log2(e)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, Q, DO, LSE_ROWS, DELTA, sql, sdl, k_cols, offs_m, offs_d, first, last, BLOCKS, Lq,
                scale, b, h, D: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
                DOT_PRECISION: tl.constexpr, FMA_EXPONENT: tl.constexpr, SPARSE_BLOCK: tl.constexpr,
                SPARSE: tl.constexpr, TMA: tl.constexpr):
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
        p_t = _probabilities(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION), scale, lse[None, :],
                             FMA_EXPONENT)
        if MASKED:  # only the causal diagonal tiles (keys past kv_len are zeroed at the store)
            p_t = tl.where(k_cols[:, None] <= rows[None, :], p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(Q, K, V, DO, LSE_ROWS, DELTA, DK, DV, KV_LEN, BLOCKS, COUNTS,
                         sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sdb, sdh, sdl,
                         sdkb, sdkh, sdkl, sdvb, sdvh, sdvl, sbb, sbh, sbr, scb, sch, scr,
                         B, HK, GROUP, Lq, Lk, scale, heads_per_group,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr, HAS_KV_LEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         ACC: tl.constexpr, FMA_EXPONENT: tl.constexpr, SPARSE_BLOCK: tl.constexpr,
                         SPARSE: tl.constexpr, TMA: tl.constexpr = False,
                         ALIGNED_LENGTHS: tl.constexpr = False, HEAVY_FIRST: tl.constexpr = False):
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
        q_rows_src = tl.make_tensor_descriptor(Q, shape=[B, HK * GROUP, Lq, D], strides=[sqb, sqh, sql, 1],
                                               block_shape=[1, 1, BLOCK_M, BLOCK_D])
        do_rows_src = tl.make_tensor_descriptor(DO, shape=[B, HK * GROUP, Lq, D], strides=[sdb, sdh, sdl, 1],
                                                block_shape=[1, 1, BLOCK_M, BLOCK_D])
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
                blocks, count = block_list(BLOCKS, COUNTS, b, h, k_start // SPARSE_BLOCK, sbb, sbh, sbr,
                                           scb, sch, scr)
            first = tiles_before(q_begin, blocks, count, BLOCK_M, SPARSE_BLOCK, SPARSE)
            first_unmasked = tiles_before(unmasked_begin, blocks, count, BLOCK_M, SPARSE_BLOCK, SPARSE)
            last = tiles_before(tl.cdiv(Lq, BLOCK_M) * BLOCK_M, blocks, count, BLOCK_M, SPARSE_BLOCK, SPARSE)
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE_ROWS + row_base, DELTA + row_base, sql, sdl, k_cols,
                                 offs_m, offs_d, first, first_unmasked, blocks, Lq, scale, b, h, D, BLOCK_D, True,
                                 DOT_PRECISION, FMA_EXPONENT, SPARSE_BLOCK, SPARSE, TMA)
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE_ROWS + row_base, DELTA + row_base, sql, sdl, k_cols,
                                 offs_m, offs_d, first_unmasked, last, blocks, Lq, scale, b, h, D, BLOCK_D, False,
                                 DOT_PRECISION, FMA_EXPONENT, SPARSE_BLOCK, SPARSE, TMA)
    valid = (k_cols < kv_len)[:, None]
    store_tile(DK + b * sdkb + hk * sdkh, k_start, offs_n, Lk, sdkl, offs_d,
               tl.where(valid, dk * scale, 0.0), D)
    store_tile(DV + b * sdvb + hk * sdvh, k_start, offs_n, Lk, sdvl, offs_d, tl.where(valid, dv, 0.0), D)


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, K, V, skl, svl, q_rows, offs_n, offs_d, first, last, BLOCKS, kv_len, Lk,
              scale, b, hk, D: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              DOT_PRECISION: tl.constexpr, FMA_EXPONENT: tl.constexpr, SPARSE_BLOCK: tl.constexpr,
              SPARSE: tl.constexpr, TMA: tl.constexpr):
    """TMA: K and V are whole-tensor descriptors, read at k/v head (b, hk)."""
    for i in range(first, last):  # key tiles
        start_n = tile_start(i, BLOCKS, offs_n.shape[0], SPARSE_BLOCK, SPARSE)
        cols = start_n + offs_n
        k = _streamed_rows(K, b, hk, start_n, offs_n, Lk, skl, offs_d, D, BLOCK_D, MASKED, TMA)
        v = _streamed_rows(V, b, hk, start_n, offs_n, Lk, svl, offs_d, D, BLOCK_D, MASKED, TMA)
        p = _probabilities(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), scale, lse[:, None],
                           FMA_EXPONENT)
        if MASKED:
            p = tl.where(visible_mask(q_rows, cols, kv_len, CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def attn_bwd_dq_kernel(Q, K, V, DO, LSE_ROWS, DELTA, DQ, KV_LEN, BLOCKS, COUNTS,
                       sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sdb, sdh, sdl, sdqb, sdqh, sdql,
                       sbb, sbh, sbr, scb, sch, scr,
                       B, H, GROUP, Lq, Lk, scale, heads_per_group,
                       D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       CAUSAL: tl.constexpr, HAS_KV_LEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       ACC: tl.constexpr, FMA_EXPONENT: tl.constexpr, SPARSE_BLOCK: tl.constexpr,
                       SPARSE: tl.constexpr, TMA: tl.constexpr = False,
                       ALIGNED_LENGTHS: tl.constexpr = False, HEAVY_FIRST: tl.constexpr = False):
    """dq of BLOCK_M queries of one (batch, head); SPARSE, HEAVY_FIRST as the
    forward. TMA (Hopper): the loop's k and v tiles by tensor descriptors over
    the whole tensors, as the dk/dv pass's q and dO."""
    Lq, Lk = aligned_lengths(Lq, Lk, ALIGNED_LENGTHS)
    tile, bh = query_tile(heads_per_group, HEAVY_FIRST)
    b, h, q_off, k_off, v_off, q_start, kv_len, unmasked_end, end = query_program(
        tile, bh, KV_LEN, H, GROUP, Lk, sqb, sqh, skb, skh, svb, svh, BLOCK_M, BLOCK_N, CAUSAL, HAS_KV_LEN)
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
    first_masked = tiles_before(unmasked_end, blocks, count, BLOCK_N, SPARSE_BLOCK, SPARSE)
    last = tiles_before(tl.cdiv(end, BLOCK_N) * BLOCK_N, blocks, count, BLOCK_N, SPARSE_BLOCK, SPARSE)
    if TMA:
        Hk = H // GROUP
        keys = tl.make_tensor_descriptor(K, shape=[B, Hk, Lk, D], strides=[skb, skh, skl, 1],
                                         block_shape=[1, 1, BLOCK_N, BLOCK_D])
        values = tl.make_tensor_descriptor(V, shape=[B, Hk, Lk, D], strides=[svb, svh, svl, 1],
                                           block_shape=[1, 1, BLOCK_N, BLOCK_D])
    else:
        keys, values = K + k_off, V + v_off
    dq = _dq_tiles(dq, q, do, lse, delta, keys, values, skl, svl, q_rows, offs_n, offs_d, 0, first_masked,
                   blocks, kv_len, Lk, scale, b, h // GROUP, D, BLOCK_D, False, CAUSAL, DOT_PRECISION, FMA_EXPONENT,
                   SPARSE_BLOCK, SPARSE, TMA)
    dq = _dq_tiles(dq, q, do, lse, delta, keys, values, skl, svl, q_rows, offs_n, offs_d, first_masked, last,
                   blocks, kv_len, Lk, scale, b, h // GROUP, D, BLOCK_D, True, CAUSAL, DOT_PRECISION, FMA_EXPONENT,
                   SPARSE_BLOCK, SPARSE, TMA)
    store_tile(DQ + b * sdqb + h * sdqh, q_start, offs_m, Lq, sdql, offs_d, dq * scale, D)
