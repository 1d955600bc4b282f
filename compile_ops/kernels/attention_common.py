"""What the attention kernels share (``kernels/attention.py``'s Triton kernels and
``kernels/attention_sm90.py``'s Gluon core): tile loads and stores, the
programs' order and set-up, block-list walks, and 8-bit attention's
constants and rounding."""

import triton
import triton.language as tl


@triton.jit
def _tile_ptrs(base, start, offs, stride_row, cols):
    # The tile's first row as an int64 scalar, the in-tile offsets in int32:
    # rows of one head may lie more than 2**31 elements apart ([B, L, H, D]).
    return base + tl.cast(start, tl.int64) * stride_row + offs[:, None] * stride_row + cols[None, :]


@triton.jit
def load_tile(
    base, start, offs, n_rows, stride_row, cols, D: tl.constexpr, BLOCK_D: tl.constexpr, ROW_MASK: tl.constexpr
):
    """Rows ``start + offs`` as a ``[len(offs), BLOCK_D]`` tile, zero past D and
    (ROW_MASK) past ``n_rows``."""
    ptrs = _tile_ptrs(base, start, offs, stride_row, cols)
    if ROW_MASK:
        if D == BLOCK_D:
            return tl.load(ptrs, mask=(start + offs < n_rows)[:, None], other=0.0)
        else:
            return tl.load(ptrs, mask=(start + offs < n_rows)[:, None] & (cols < D)[None, :], other=0.0)
    else:
        if D == BLOCK_D:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=(cols < D)[None, :], other=0.0)


@triton.jit
def store_tile(base, start, offs, n_rows, stride_row, cols, value, D: tl.constexpr):
    tl.store(
        _tile_ptrs(base, start, offs, stride_row, cols),
        value.to(base.dtype.element_ty),
        mask=(start + offs < n_rows)[:, None] & (cols < D)[None, :],
    )


@triton.jit
def visible_mask(q_rows, k_cols, kv_len, CAUSAL: tl.constexpr):
    """``[M, N]`` bool: key column j is visible to query row i."""
    ok = (k_cols < kv_len)[None, :]
    if CAUSAL:
        ok = ok & (k_cols[None, :] <= q_rows[:, None])
    return ok


@triton.jit
def aligned_lengths(Lq, Lk, ALIGNED_LENGTHS: tl.constexpr):
    """``(Lq, Lk)``, known to the compiler as multiples of 16 when
    ALIGNED_LENGTHS. Why: Triton's JIT specializes integer arguments divisible
    by 16 on its own, but Inductor, launching a kernel under dynamic shapes
    (the second resolution a compiled model sees), cannot prove it for a
    symbolic length and drops the hint; the lse/delta and mask arithmetic then
    loses its vector width (docs/notes/attention.md). ``n // 16 * 16`` is n
    itself here, and a form
    the compiler's divisibility analysis reads (``tl.multiple_of`` is ignored
    on a scalar argument)."""
    if ALIGNED_LENGTHS:
        return Lq // 16 * 16, Lk // 16 * 16
    else:
        return Lq, Lk


@triton.jit
def program_rank(heads_per_group, HEAVY_FIRST: tl.constexpr):
    """``(rank, batch * heads + head)`` of this program in a ``(tiles, B * H)`` grid.

    Without HEAVY_FIRST: ``(program_id(0), program_id(1))``. With it, the
    programs are taken in launch order (x fastest) and dealt out to groups of
    ``heads_per_group`` (batch, head) rows (:func:`dealt_rank`)."""
    if HEAVY_FIRST:
        n_tiles = tl.num_programs(0)
        linear = tl.program_id(0) + tl.program_id(1) * n_tiles
        return dealt_rank(linear, n_tiles, tl.num_programs(1), heads_per_group)
    else:
        return tl.program_id(0), tl.program_id(1)


@triton.jit
def dealt_rank(linear, n_tiles, n_rows, heads_per_group):
    """``(rank, row)`` of the ``linear``-th of ``n_tiles * n_rows`` programs
    dealt out to groups of ``heads_per_group`` (batch, head) rows: a group's
    rank-0 tiles first, one per row, then its rank-1 tiles, and so on, then
    the next group. The caller maps rank to the tile that has the most work
    (causal attention: the last query tile, the first key tile), so programs
    run roughly longest first, which keeps the last wave short; the group
    bounds how many heads' keys and values are read at once (L2 reuse)."""
    group_programs = heads_per_group * n_tiles
    first = (linear // group_programs) * heads_per_group
    within = linear % group_programs
    rows = tl.minimum(heads_per_group, n_rows - first)
    return within // rows, first + within % rows


@triton.jit
def query_tile(heads_per_group, HEAVY_FIRST: tl.constexpr):
    """``(query tile, batch * heads + head)`` of a forward or dq program; with
    HEAVY_FIRST (causal) rank 0 is the last query tile, which sees the most keys."""
    rank, bh = program_rank(heads_per_group, HEAVY_FIRST)
    if HEAVY_FIRST:
        return tl.num_programs(0) - 1 - rank, bh
    else:
        return rank, bh


@triton.jit
def program_head(bh, H, GROUP, sqb, sqh, skb, skh):
    """``(batch, head, q offset, k/v offset)`` of (batch, q head) ``bh``,
    all int64: one batch element may hold more than 2**31 elements."""
    b = tl.cast(bh, tl.int64) // H
    h = bh - b * H
    return b, h, b * sqb + h * sqh, b * skb + (h // GROUP) * skh


@triton.jit
def query_program(
    tile,
    bh,
    KV_LEN,
    H,
    GROUP,
    Lk,
    sqb,
    sqh,
    skb,
    skh,
    svb,
    svh,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KV_LEN: tl.constexpr,
):
    """The setup of a program that owns ``BLOCK_M`` queries (forward, dq pass):
    ``(batch, head, q/k/v offsets, first query, kv_len, end of the unmasked
    key tiles, end of all key tiles)``."""
    b, h, q_off, k_off = program_head(bh, H, GROUP, sqb, sqh, skb, skh)
    v_off = b * svb + (h // GROUP) * svh
    q_start = tile * BLOCK_M
    kv_len = kv_len_of(KV_LEN, b, Lk, HAS_KV_LEN)
    end = kv_len
    if CAUSAL:
        end = tl.minimum(end, q_start + BLOCK_M)
    unmasked_end = tl.minimum(_unmasked_key_end(kv_len, q_start, BLOCK_N, CAUSAL), end)
    return b, h, q_off, k_off, v_off, q_start, kv_len, unmasked_end, end


@triton.jit
def kv_len_of(KV_LEN, b, Lk, HAS_KV_LEN: tl.constexpr):
    if HAS_KV_LEN:
        return tl.minimum(tl.load(KV_LEN + b).to(tl.int32), Lk)
    else:
        return Lk


@triton.jit
def _unmasked_key_end(kv_len, q_start, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys below this need no mask for any query row ``>= q_start``."""
    end = (kv_len // BLOCK_N) * BLOCK_N
    if CAUSAL:
        end = tl.minimum(end, (q_start // BLOCK_N) * BLOCK_N)
    return end


@triton.jit
def block_list(BLOCKS, COUNTS, b, h, row, sbb, sbh, sbr, scb, sch, scr):
    """The listed blocks of (batch b, head h, block ``row``): a pointer to
    their indices and their count (broadcast lists have stride 0)."""
    return BLOCKS + b * sbb + h * sbh + row * sbr, tl.load(COUNTS + b * scb + h * sch + row * scr)


LIST_CHUNK = tl.constexpr(64)  # listed blocks compared at once by tiles_before
#: 1.5 * 2**23 and its fp32 bits: int32 scores plus these bits, read as fp32,
#: are exactly INT8_BIAS + score (the INT8 path of _fwd_tiles).
INT8_BIAS = tl.constexpr(12582912.0)
INT8_BIAS_BITS = tl.constexpr(0x4B400000)
#: FP8 P V rounds ``2**8 * p`` to e4m3, not p (reference.attention.P_FP8_SHIFT):
#: probabilities down to 2**-14 stay normal numbers. A per-row term of the exponent.
P_FP8_SHIFT = tl.constexpr(8.0)


@triton.jit
def tiles_before(
    row,
    BLOCKS,
    count,
    TILE: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
    SPARSE: tl.constexpr,
    ROW_IN_LAST_BLOCK: tl.constexpr = False,
):
    """How many of the loop's tiles start below ``row`` (a multiple of TILE):
    ``row // TILE``, or (SPARSE) the tiles of the listed blocks (ascending,
    ``count`` of them at ``BLOCKS``) that start below it.

    ROW_IN_LAST_BLOCK: ``row`` lies in the last block a list can hold, or past
    it (the key tiles' ends of a call without a causal mask or key lengths),
    so every listed block but the last starts below it: one read of the last
    entry instead of a scan of the list, which in a short key loop is a
    share of the program's time."""
    if SPARSE:
        block = row // SPARSE_BLOCK
        # `straddles`: the block that holds `row` is listed; its first tiles lie below `row`.
        if ROW_IN_LAST_BLOCK:
            straddles = tl.load(BLOCKS + count - 1, mask=count > 0, other=-1) == block
            below = count - straddles.to(tl.int32)
        else:
            below = tl.zeros([], dtype=tl.int32)
            for j in range(0, tl.cdiv(count, LIST_CHUNK)):
                offs = tl.cast(j, tl.int32) * LIST_CHUNK + tl.arange(0, LIST_CHUNK)
                listed = tl.load(BLOCKS + offs, mask=offs < count, other=block)
                below += tl.sum((listed < block).to(tl.int32))
            straddles = tl.load(BLOCKS + below, mask=below < count, other=-1) == block
        return below * (SPARSE_BLOCK // TILE) + tl.where(straddles, (row % SPARSE_BLOCK) // TILE, 0)
    else:
        return row // TILE


@triton.jit
def tile_start(
    i,
    BLOCKS,
    TILE: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
    SPARSE: tl.constexpr,
    LIST_BY_ASM: tl.constexpr = False,
    count=0,
):
    """First row of the loop's i-th tile: ``i * TILE``, or (SPARSE) a tile of
    the ``i // (SPARSE_BLOCK // TILE)``-th listed block.

    LIST_BY_ASM (the forward on Hopper, CUDA only): the listed block is read by
    a plain ``ld.global`` that Triton's software pipeliner does not claim.
    Given an ordinary load there, Triton 3.6 pipelines it as an async copy
    into a one-entry buffer and spends one of the loop's stages on it, so K
    and V stream two tiles deep instead of the dense loop's three (TTGIR of
    the TMA forward), which slows the sparse forward (docs/notes/attention.md).
    Declared pure because the pipeliner refuses an impure
    asm op in a loop it pipelines ("doesn't know how to predicate"); the
    lists are read-only here, but pure also lets it hoist the read into its
    prologue, unpredicated, for iterations past the list, so the entry is
    clamped to ``[0, count)`` (entry 0 when empty: the launcher takes this
    path only for lists at least one entry wide)."""
    if SPARSE:
        i = tl.cast(i, tl.int32)  # the interpreter's range yields Python ints
        per_block: tl.constexpr = SPARSE_BLOCK // TILE
        if LIST_BY_ASM:
            entry = tl.maximum(tl.minimum(i // per_block, count - 1), 0)
            block = tl.inline_asm_elementwise(
                "ld.global.b32 $0, [$1];", "=r,l", [BLOCKS + entry], dtype=tl.int32, is_pure=True, pack=1
            )
        else:
            block = tl.load(BLOCKS + i // per_block).to(tl.int32)
        return block * SPARSE_BLOCK + (i % per_block) * TILE
    else:
        return i * TILE


# ---------------------------------------------------------------- 8-bit rounding (forward and quantizing passes)

INT8_MAX = tl.constexpr(127.0)
_FP32_TINY = tl.constexpr(1.1754943508222875e-38)


@triton.jit
def quantization_scale(amax, TOP: tl.constexpr):
    """A quantization scale and its reciprocal: ``max(amax / TOP, tiny)``
    (fp32's smallest normal: an all-zero block or channel stays 0 and the
    reciprocal stays finite) and ``1 / scale``, both correctly rounded, as
    ``reference.attention.quantization_scale``. The values are then
    multiplied by the reciprocal: one FMUL each, where a correctly rounded
    division per value (``div.rn.f32``, a dozen instructions and a slow-path
    branch) makes the quantizing passes arithmetic-bound."""
    # Scalars broadcast, not tl.full: Gluon kernels call this too, and their full tensors need a layout.
    scale = tl.maximum(tl.div_rn(amax, TOP), _FP32_TINY)
    return scale, tl.div_rn(1.0, scale)


@triton.jit
def round_to_int8(x, inverse):
    """``round_half_even(x * inverse)`` clamped to [-127, 127], as int8 (the
    product rounded to fp32, as torch's). Adding and subtracting
    ``INT8_BIAS`` (1.5 * 2**23) rounds an fp32 |x| < 2**22 to an integer, half
    to even, as fp32 addition rounds: torch.round's rounding. The clamp comes
    first (the same result: its bounds are integers) so that the compiler
    cannot contract the product and the bias into one fma, which would round
    once where torch rounds twice (a product just below a half would round
    up)."""
    clamped = tl.minimum(tl.maximum(x * inverse, -INT8_MAX), INT8_MAX)
    return ((clamped + INT8_BIAS) - INT8_BIAS).to(tl.int8)


@triton.jit
def fp8_operand_order(p):
    """``p`` ``[M, N]`` (N a multiple of 16) with its columns reordered within
    each 16: column ``k`` of the result is column :func:`key_at_position`
    ``(k)`` of ``p``. FP8 P V's V stores its keys in this order (the
    quantizing pass), so the product sums the same pairs; in this order the
    scores' accumulator layout (a thread's columns 2t, 2t + 1 of each 8) is
    already the FP8 product's register operand layout (4 consecutive bytes
    a thread), which otherwise costs shuffles and byte permutes a tile.
    Column bits (3, 2, 1) of the result are bits (2, 1, 3) of the source."""
    M: tl.constexpr = p.shape[0]
    N: tl.constexpr = p.shape[1]
    return p.reshape([M, N // 16, 2, 2, 2, 2]).permute((0, 1, 3, 4, 2, 5)).reshape([M, N])


@triton.jit
def fp8_value_positions(Lk):
    """The positions of FP8 P V's transposed V for ``Lk`` keys: Lk rounded up
    to 16. The padding holds keys in :func:`fp8_operand_order` too, so the
    kernels read V up to here, not up to Lk (zero keys past Lk)."""
    return tl.cdiv(Lk, 16) * 16


@triton.jit
def key_at_position(position):
    """The key (within its 16) stored at ``position`` of FP8 P V's transposed
    V: bits 1, 2, 3 of the position are bits 3, 1, 2 of the key; bit 0 and
    the bits from 4 up stay (:func:`fp8_operand_order`)."""
    return (position & ~14) | ((position & 2) << 2) | ((position & 12) >> 1)
