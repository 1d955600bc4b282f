"""Triton flash attention's forward kernel, and the map of the family's kernels.

Forward (``attn_fwd_kernel``): one program per ``BLOCK_M`` queries of one
(batch, head); it streams ``BLOCK_N``-key tiles of K and V with an online
softmax (exp2 of scores scaled by ``scale * log2(e)``) and writes the output
and the natural-log log-sum-exp. Nothing ``Lq x Lk`` is
stored.

The family's other kernels: ``kernels/attention_backward.py`` (the
deterministic backward passes, and the Triton kernels of the sm_90
backward), ``kernels/attention_8bit.py`` (8-bit attention's k and v
operands), ``kernels/attention_sm90.py`` and
``kernels/attention_sm90_backward.py`` (the Gluon forward core and
backward, sm_90 only), and ``kernels/attention_common.py`` (what they
share).

Key loops are split in two: tiles that need no mask (every key valid and, for
causal, below the diagonal for every query of the tile) run without one; only
the tail and diagonal tiles pay for masking. Causal is SDPA's: query i sees
keys ``j <= i``. Keys past ``kv_len`` (the batch element's valid length, or
Lk) never contribute; a query with no visible key gets 0 and an lse of -inf.

Program order: as launched (query or key tile fastest, then batch x head),
except for causal launches (``HEAVY_FIRST``), where a tile's work grows with
its distance from the diagonal: ``program_rank`` runs the tiles with the
most keys (forward, dq) or queries (dk/dv) first, interleaving a group of
heads sized by the launcher (``ops.attention_tiles.causal_order``).

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
and v as ``kernels/attention_8bit.py`` writes them: k per 128-key block in
INT8 less its mean over the sequence, and v in e4m3 with channel scales,
transposed. q it rounds itself, per token, as each program loads its rows
(``QUANTIZE_Q``). With ``SPARSE`` too (block-sparse attention's 8-bit
precisions) a listed tile reads the k scale of the block its first key lies
in, and FP8 P V's 128-key tiles are the listed blocks themselves.

On Hopper the tiles a loop streams come by TMA (``TMA``): the forward's K
and V through per-head descriptors, the backward's q and dO (dk/dv pass) and
k and v (dq pass) through descriptors over the whole ``[B, H, L, D]``
tensors; the launchers pick it in ``forward_tiles``, ``dkdv_tiles`` and
``dq_tiles``.

Offsets of the (batch, head) bases are int64; q, k, v, dO and O have a unit
stride along D (the launcher guarantees it); D is padded to ``BLOCK_D``.
"""

import triton
import triton.language as tl

from compile_ops.kernels.attention_common import (
    INT8_BIAS,
    INT8_BIAS_BITS,
    INT8_MAX,
    P_FP8_SHIFT,
    aligned_lengths,
    block_list,
    fp8_operand_order,
    fp8_value_positions,
    load_tile,
    quantization_scale,
    query_program,
    query_tile,
    round_to_int8,
    store_tile,
    tile_start,
    tiles_before,
    visible_mask,
)
from compile_ops.kernels.fp8 import to_e4m3


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


@triton.jit
def _fwd_tiles(
    acc,
    m,
    l,
    q,
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
    count,
    kv_len,
    Lk,
    qk_scale,
    q_scale,
    K_SCALE,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FMA_EXPONENT: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
    SPARSE: tl.constexpr,
    TMA: tl.constexpr,
    DOT_ACC: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    INT8: tl.constexpr,
    KEY_BLOCK: tl.constexpr,
    PV_FP8: tl.constexpr,
    LIST_BY_ASM: tl.constexpr = False,
):
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
    is rounded to e4m3 for an FP8 dot at twice the 16-bit rate. V's keys
    come in :func:`fp8_operand_order` within each 16, and so do p's columns:
    in that order p's registers are the dot's operand as they are. The tile's
    products are summed by a fresh dot and added to the fp32 accumulator
    (two-level accumulation: Hopper's FP8 MMA keeps fewer accumulator bits
    than fp32, which over one tile of keys is far below e4m3's rounding).
    With DOT_ACC the accumulator is the FP8 dot's own operand instead: fewer
    registers and a little faster, but further from the specification
    (docs/notes/attention.md), so ``forward_tiles`` leaves it off."""
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
                v = tl.trans(_load_channels(V, start_n, offs_n, fp8_value_positions(Lk), svl, offs_d, D, MASKED))
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
            acc = acc * alpha[:, None] + tl.dot(fp8_operand_order(p.to(tl.float8e4nv)), v)
        elif PV_FP8:
            acc = tl.dot(fp8_operand_order(p.to(tl.float8e4nv)), v, acc * alpha[:, None])
        elif DOT_ACC:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    return acc, m, l


@triton.jit
def attn_fwd_kernel(
    Q,
    K,
    V,
    OUT,
    LSE,
    KV_LEN,
    BLOCKS,
    COUNTS,
    Q_SCALE,
    K_SCALE,
    V_SCALE,
    ROW_SCALE,
    OUT_SCALE,
    TOKENS,
    sqb,
    sqh,
    sql,
    skb,
    skh,
    skl,
    svb,
    svh,
    svl,
    sob,
    soh,
    sol,
    sbb,
    sbh,
    sbr,
    scb,
    sch,
    scr,
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
    DOT_ACC: tl.constexpr = False,
    WARP_SPECIALIZE: tl.constexpr = False,
    INT8: tl.constexpr = False,
    INT8_KEY_BLOCK: tl.constexpr = 128,
    PV_FP8: tl.constexpr = False,
    OUT_FP8: tl.constexpr = False,
    ALIGNED_LENGTHS: tl.constexpr = False,
    LIST_BY_ASM: tl.constexpr = False,
    HEAVY_FIRST: tl.constexpr = False,
    QUANTIZE_Q: tl.constexpr = False,
    SCATTER: tl.constexpr = False,
):
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
    its own. PV_FP8 (with INT8): V is e4m3 ``[B, Hk, D, Lk16]`` (Lk rounded
    up to 16, the keys in ``fp8_operand_order`` within each 16, zero past Lk)
    with a unit key stride (``svl`` is then the stride between channels) and V_SCALE
    its per-channel scales ``[B, Hk, D]`` (fp32 contiguous). OUT_FP8: OUT is
    e4m3, ``out / ROW_SCALE[b]`` rounded to nearest even and clamped to
    +-448 (``ROW_SCALE [B]`` fp32, a bound on |out|: the FP8 rows of
    ``reference.attention.attention_int8_fp8_rows``), and the programs of head
    0 write that scale to their rows of ``OUT_SCALE [B, Lq]``. ALIGNED_LENGTHS
    (the three attention kernels): Lq and Lk are multiples of 16 (``aligned_lengths``).
    LIST_BY_ASM (SPARSE, CUDA, lists at least one entry wide): see
    :func:`tile_start`. HEAVY_FIRST, ``heads_per_group`` (the three
    attention kernels): the program order of causal launches,
    :func:`program_rank`. SCATTER (self-attention, Lq = Lk): the output,
    lse and OUT_SCALE rows of query row r go to token ``TOKENS[r]``'s row
    (``[Lq]`` int32/int64), so that a layout's token order costs no permuted
    copy of the output; Q, K and V come in that order (the 8-bit quantizing
    pass gathers them: q loaded by rows here would be reloaded from shared
    memory, its scales converted between layouts, in every key tile)."""
    Lq, Lk = aligned_lengths(Lq, Lk, ALIGNED_LENGTHS)
    tile, bh = query_tile(heads_per_group, HEAVY_FIRST)
    b, h, q_off, k_off, v_off, q_start, kv_len, unmasked_end, end = query_program(
        tile, bh, KV_LEN, H, GROUP, Lk, sqb, sqh, skb, skh, svb, svh, BLOCK_M, BLOCK_N, CAUSAL, HAS_KV_LEN
    )
    o_off = b * sob + h * soh
    q_rows = q_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    scale = tl.cast(scale, ACC)  # Inductor passes float scalars as fp64
    qk_scale = scale * 1.4426950408889634  # log2(e)

    if TMA:
        q = tl.make_tensor_descriptor(Q + q_off, shape=[Lq, D], strides=[sql, 1], block_shape=[BLOCK_M, BLOCK_D]).load(
            [q_start, 0]
        )
        keys = tl.make_tensor_descriptor(K + k_off, shape=[Lk, D], strides=[skl, 1], block_shape=[BLOCK_N, BLOCK_D])
        if PV_FP8:  # transposed: channels are its rows
            values = tl.make_tensor_descriptor(
                V + v_off, shape=[D, fp8_value_positions(Lk)], strides=[svl, 1], block_shape=[BLOCK_D, BLOCK_N]
            )
        else:
            values = tl.make_tensor_descriptor(
                V + v_off, shape=[Lk, D], strides=[svl, 1], block_shape=[BLOCK_N, BLOCK_D]
            )
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
    in_last_block = not CAUSAL and not HAS_KV_LEN  # both rows below lie in the last key block or past it
    first_masked = tiles_before(unmasked_end, blocks, count, BLOCK_N, SPARSE_BLOCK, SPARSE, in_last_block)
    last = tiles_before(tl.cdiv(end, BLOCK_N) * BLOCK_N, blocks, count, BLOCK_N, SPARSE_BLOCK, SPARSE, in_last_block)
    acc, m, l = _fwd_tiles(
        acc,
        m,
        l,
        q,
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
        count,
        kv_len,
        Lk,
        qk_scale,
        q_scale,
        k_scales,
        D,
        BLOCK_D,
        False,
        CAUSAL,
        DOT_PRECISION,
        FMA_EXPONENT,
        SPARSE_BLOCK,
        SPARSE,
        TMA,
        DOT_ACC,
        WARP_SPECIALIZE,
        INT8,
        INT8_KEY_BLOCK,
        PV_FP8,
        LIST_BY_ASM,
    )
    acc, m, l = _fwd_tiles(
        acc,
        m,
        l,
        q,
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
        count,
        kv_len,
        Lk,
        qk_scale,
        q_scale,
        k_scales,
        D,
        BLOCK_D,
        True,
        CAUSAL,
        DOT_PRECISION,
        FMA_EXPONENT,
        SPARSE_BLOCK,
        SPARSE,
        TMA,
        DOT_ACC,
        False,
        INT8,
        INT8_KEY_BLOCK,
        PV_FP8,
    )

    out_rows = q_rows  # where this program's rows go in OUT, LSE and OUT_SCALE
    if SCATTER:  # loaded after the loop, so that the rows are not kept live through it
        out_rows = tl.load(TOKENS + q_rows, mask=q_rows < Lq, other=0).to(tl.int64)
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
        # Head 0's programs write the rows' scales. A predicate, not a branch: around a branch
        # ptxas spilled inside the key loop under the register cap (docs/notes/attention-8bit.md).
        head0 = (q_rows < Lq) & (h == 0)
        tl.store(OUT_SCALE + b * Lq + out_rows, tl.zeros([BLOCK_M], tl.float32) + row_scale, mask=head0)
    if SCATTER:  # rows past Lq were given token 0: the mask keeps them out
        tl.store(
            OUT + o_off + out_rows[:, None] * sol + offs_d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=(q_rows < Lq)[:, None] & (offs_d < D)[None, :],
        )
    else:
        store_tile(OUT + o_off, q_start, tl.arange(0, BLOCK_M), Lq, sol, offs_d, out, D)
    lse = tl.where(empty, float("-inf"), m * scale + log2_l * 0.6931471805599453)  # ln 2
    tl.store(LSE + tl.cast(bh, tl.int64) * Lq + out_rows, lse, mask=q_rows < Lq)
