"""Triton kernels of the MoE routing family: routing with its per-expert token lists, and the routing backward.

``moe_route_kernel``: each program routes one *token block* of ``BLOCK_T``
tokens and writes the block's entries of the per-expert token lists. Its
router logits ``x @ router_weight.T`` ``[BLOCK_T, BLOCK_E]`` (fp32
accumulator, fp64 for fp64 inputs) it either computes with ``tl.dot`` over
H in ``BLOCK_H`` chunks (narrow routers, HiDream's E = 4; after
``moe_route_prepare_kernel``) or, for a wide router (``SPLIT``), sums from
the partial products that ``moe_router_logits_kernel`` wrote for slices of
H in the launch before. Why split: a program over all of H reads the whole
router weight (512 KB at E = 64, H = 4096 in bf16) from L2; with one program
per 16 or 32 tokens those re-reads were 2-4x the bytes of x itself (ncu:
34% of DRAM bandwidth, stalled on shared memory); slices let 128 programs
cover 128 tokens each, reading a quarter of the weight each. The partial
sums are added in a fixed order: the logits, hence the routing, are the
same every run.

Routing a block: the softmax in the accumulator's precision, the
probabilities written, and the top k by k rounds of (row max, lowest column
holding it): the tie break is the lowest expert index, as a stable
descending sort gives (``reference/moe.py``). NaN is taken as larger than
every probability (as torch's sort does), so a NaN row picks experts
0..k-1. E is held whole in one row of registers: hence
``meta.moe.MAX_EXPERTS``.

Then the block's token lists, in ascending token order: a token's slot in
an expert's row is the number of earlier tokens that chose that expert, the
earlier blocks' counts plus a prefix sum within the block. The block
publishes its own counts (``BLOCK_COUNTS``, then a flag released after
them), waits for the flags of every earlier block (acquired) and sums their
counts: a look-back over published counts, as in single-pass prefix sums.
Programs take their blocks in the order of a ticket counter (an atomic add
at their start), so every earlier block is running or done, whatever order
the hardware starts programs in, and will publish: the wait ends. The last
block writes the totals (``COUNTS``). The atomics only order the programs:
every output is an integer count or an fp sum in a fixed order, the same
bits on every run. The lists' padding (T) and the zeroed counters are
written before, by the launch before (``_prepare``: in the split logits
kernel, or a small kernel of its own). Why not a separate launch for the
lists: on an H100 at 4096 x 4096, E = 64 it took 8.9 us (ncu), a
latency-bound kernel of ~5 dependent round trips to global memory.
And why not the routing in the logits kernel's last tile of each block
(one launch; ``bench/experiments/moe_fusion.py``): measured slower, 38.7
against 33.2 us for three launches, as 32 programs then route 128 tokens
each after the logits, where 128 programs of 32 tokens share the work.

``moe_route_backward_kernel``: ``d loss / d logits [T, E]`` from the
gradients of probs and of the routing weights (``reference.moe.logits_gradient``
gives the formula); the two products with x and router_weight that complete
the backward are torch matmuls in ``ops/moe.py``.
"""
import triton
import triton.language as tl


@triton.jit
def _divide(a, b):
    # triton's fp32 `/` is approximate (2 ulps); div_rn rounds correctly, as torch does.
    if a.dtype == tl.float64:
        return a / b
    else:
        return tl.div_rn(a, b)


@triton.jit
def _router_logits(X, W, rows, cols, row_mask, col_mask, h_start, h_end, stride_x, stride_w,
                   DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    """``x[rows, h_start:h_end] @ w[cols, h_start:h_end].T`` ``[BLOCK_T, BLOCK_E]`` in ACC_DTYPE."""
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=ACC_DTYPE)
    for h0 in range(h_start, h_end, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_mask = hs < h_end
        x = tl.load(X + rows[:, None] * stride_x + hs[None, :], mask=row_mask[:, None] & h_mask[None, :], other=0.0)
        # W read transposed, [BLOCK_H, BLOCK_E]: the product's right operand.
        w = tl.load(W + cols[None, :].to(tl.int64) * stride_w + hs[:, None], mask=col_mask[None, :] & h_mask[:, None],
                    other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return acc


@triton.jit
def _prepare(TOKEN_INDEX, SYNC, n_index, n_sync, fill, program, n_programs, BLOCK: tl.constexpr):
    """``TOKEN_INDEX`` (``n_index`` int32) all ``fill`` (T: the lists' padding,
    which the routing overwrites where tokens go) and ``SYNC`` (``n_sync``
    int32: ``moe_route_kernel``'s counters) all zero, ``program`` of
    ``n_programs`` taking every n_programs-th piece of BLOCK elements."""
    for start in range(program * BLOCK, tl.maximum(n_index, n_sync), n_programs * BLOCK):
        offsets = tl.cast(start, tl.int64) + tl.arange(0, BLOCK)
        tl.store(TOKEN_INDEX + offsets, tl.full((BLOCK,), 0, tl.int32) + fill, mask=offsets < n_index)
        tl.store(SYNC + offsets, tl.zeros((BLOCK,), dtype=tl.int32), mask=offsets < n_sync)


@triton.jit
def moe_route_prepare_kernel(TOKEN_INDEX, SYNC, n_index, n_sync, fill, BLOCK: tl.constexpr):
    """``_prepare`` alone, before a routing kernel that computes its logits."""
    _prepare(TOKEN_INDEX, SYNC, n_index, n_sync, fill, tl.program_id(0), tl.num_programs(0), BLOCK)


@triton.jit
def moe_router_logits_kernel(X, W, PARTIAL, TOKEN_INDEX, SYNC, n_tokens, H, E, stride_x, stride_w, h_per_split,
                             n_index, n_sync, DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr,
                             BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                             PREPARE_BLOCK: tl.constexpr):
    """Program (i, s): the logits of tokens ``[i * BLOCK_T, (i + 1) * BLOCK_T)``
    over hidden columns ``[s * h_per_split, (s + 1) * h_per_split)``, to
    ``PARTIAL[s]`` (``[SPLIT, T, E]`` contiguous, ACC_DTYPE). ``h_per_split``
    is a multiple of BLOCK_H. The programs also do ``_prepare``'s work for
    the routing launch after them (a launch of its own costs more than these
    few stores)."""
    rows = tl.cast(tl.program_id(0), tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < n_tokens
    col_mask = cols < E
    h_start = tl.program_id(1) * h_per_split
    acc = _router_logits(X, W, rows, cols, row_mask, col_mask, h_start, tl.minimum(h_start + h_per_split, H),
                         stride_x, stride_w, DOT_PRECISION, ACC_DTYPE, BLOCK_T, BLOCK_E, BLOCK_H)
    partial = PARTIAL + tl.cast(tl.program_id(1), tl.int64) * n_tokens * E
    tl.store(partial + rows[:, None] * E + cols[None, :], acc, mask=row_mask[:, None] & col_mask[None, :])
    _prepare(TOKEN_INDEX, SYNC, n_index, n_sync, n_tokens, tl.program_id(1) * tl.num_programs(0) + tl.program_id(0),
             tl.num_programs(0) * tl.num_programs(1), PREPARE_BLOCK)


@triton.jit
def _earlier_counts(BLOCK_COUNTS, FLAGS, block, E, cols, col_mask,
                    BLOCK_E: tl.constexpr, COUNT_CHUNK: tl.constexpr):
    """``[BLOCK_E]``: tokens per expert in the blocks before ``block``, once
    each has published them (its flag set after its ``BLOCK_COUNTS`` row)."""
    earlier = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for b0 in range(0, block, COUNT_CHUNK):
        blocks = b0 + tl.arange(0, COUNT_CHUNK)
        waiting_for = blocks < block
        expected = tl.sum(waiting_for.to(tl.int32))
        published = expected - expected - 1
        while published < expected:  # only a count is carried: a tensor of flags crashes triton 3.6's layouts
            # Adding 0 reads the flags with acquire semantics: the counts they guard are visible after it.
            flags = tl.atomic_add(FLAGS + blocks, 0, mask=waiting_for, sem="acquire")
            published = tl.sum(tl.where(waiting_for, flags, 0))
        tl.debug_barrier()  # every thread's acquire before any thread's read below
        # .cg: from L2, where other SMs' stores are; this SM's L1 is not kept coherent with them.
        counts = tl.load(BLOCK_COUNTS + blocks[:, None].to(tl.int64) * E + cols[None, :],
                         mask=waiting_for[:, None] & col_mask[None, :], other=0, cache_modifier=".cg")
        earlier += tl.sum(counts, axis=0)
    return earlier


@triton.jit
def moe_route_kernel(X, W, PARTIAL, PROBS, WEIGHTS, EXPERTS, BLOCK_COUNTS, COUNTS, TOKEN_INDEX, SYNC,
                     n_tokens, H, E, stride_x, stride_w,
                     TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr, SPLIT: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                     COUNT_CHUNK: tl.constexpr):
    """X ``[T, H]`` and W ``[E, H]`` with unit column stride; PROBS ``[T, E]``,
    WEIGHTS and EXPERTS ``[T, TOP_K]`` contiguous; COUNTS ``[E]``,
    TOKEN_INDEX ``[E, T]`` (int32, prefilled with T); scratch: PARTIAL
    ``[SPLIT, T, E]`` (ACC_DTYPE: ``moe_router_logits_kernel``'s, read when
    SPLIT > 0), BLOCK_COUNTS ``[n_blocks, E]`` int32, SYNC ``[1 + n_blocks]``
    int32 zeroed (the ticket, then a published flag per token block). One
    program per token block: SPLIT = 0 computes the block's logits, SPLIT > 0
    sums the partial ones in slice order (the same sums every run)."""
    n_blocks = tl.cdiv(n_tokens, BLOCK_T)
    block = tl.atomic_add(SYNC, 1, sem="relaxed")  # the ticket: blocks in the order programs start
    rows = tl.cast(block, tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < n_tokens
    col_mask = cols < E
    out_mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT == 0:
        acc = _router_logits(X, W, rows, cols, row_mask, col_mask, 0, H, stride_x, stride_w,
                             DOT_PRECISION, ACC_DTYPE, BLOCK_T, BLOCK_E, BLOCK_H)
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=ACC_DTYPE)
        for s in tl.static_range(SPLIT):
            acc += tl.load(PARTIAL + s * n_tokens * E + rows[:, None] * E + cols[None, :], mask=out_mask, other=0.0)
    # Softmax over the E real columns; the padding columns get exp(-inf) = 0.
    logits = tl.where(col_mask[None, :], acc, float("-inf"))
    shifted = logits - tl.max(logits, axis=1)[:, None]
    numerators = tl.exp(shifted)
    probs = _divide(numerators, tl.sum(numerators, axis=1)[:, None])
    tl.store(PROBS + rows[:, None] * E + cols[None, :], probs.to(PROBS.dtype.element_ty), mask=out_mask)

    # Top-k by k rounds of max. The key orders NaN above every probability
    # (2 > 1 >= p) and the padding columns below every one (-1 < 0 <= p).
    key = tl.where(probs != probs, 2.0, probs)
    key = tl.where(col_mask[None, :], key, -1.0)
    slots = tl.arange(0, BLOCK_K)
    chosen_p = tl.zeros((BLOCK_T, BLOCK_K), dtype=ACC_DTYPE)
    chosen_e = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
    hits = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)
        # The lowest column holding the maximum: the deterministic tie-break.
        index = tl.min(tl.where(key == best[:, None], cols[None, :], BLOCK_E), axis=1)
        picked = cols[None, :] == index[:, None]
        p = tl.sum(tl.where(picked, probs, 0.0), axis=1)
        chosen_p = tl.where(slots[None, :] == j, p[:, None], chosen_p)
        chosen_e = tl.where(slots[None, :] == j, index[:, None].to(tl.int64), chosen_e)
        hits += picked.to(tl.int32)
        key = tl.where(picked, -1.0, key)
    if RENORMALIZE:
        chosen_p = _divide(chosen_p, tl.sum(chosen_p, axis=1)[:, None])
    k_mask = row_mask[:, None] & (slots < TOP_K)[None, :]
    offsets = rows[:, None] * TOP_K + slots[None, :]
    tl.store(WEIGHTS + offsets, chosen_p.to(WEIGHTS.dtype.element_ty), mask=k_mask)
    tl.store(EXPERTS + offsets, chosen_e, mask=k_mask)

    # Publish this block's tokens per expert (rows past T chose nothing; a
    # token chooses an expert at most once: hits are 0 or 1), then look back.
    hits = tl.where(row_mask[:, None], hits, 0)
    block_counts = tl.sum(hits, axis=0)
    tl.store(BLOCK_COUNTS + tl.cast(block, tl.int64) * E + cols, block_counts, mask=col_mask)
    tl.debug_barrier()  # every thread's counts stored before the flag releases them
    flags = SYNC + 1
    tl.atomic_xchg(flags + block, 1, sem="release")
    earlier = _earlier_counts(BLOCK_COUNTS, flags, block, E, cols, col_mask, BLOCK_E, COUNT_CHUNK)
    if block == n_blocks - 1:
        tl.store(COUNTS + cols, earlier + block_counts, mask=col_mask)
    token_slots = earlier[None, :] + tl.cumsum(hits, axis=0) - hits  # exclusive prefix sum down the block
    tl.store(TOKEN_INDEX + cols[None, :].to(tl.int64) * n_tokens + token_slots,
             (rows[:, None] + 0 * cols[None, :]).to(tl.int32), mask=hits > 0)


@triton.jit
def moe_route_backward_kernel(GRAD_PROBS, GRAD_WEIGHTS, PROBS, EXPERTS, DLOGITS, n_tokens, E,
                              stride_gp_row, stride_gp_col, stride_gw_row, stride_gw_col,
                              TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, ACC_DTYPE: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """DLOGITS ``[T, E]`` (contiguous) from GRAD_PROBS ``[T, E]`` and
    GRAD_WEIGHTS ``[T, TOP_K]`` (any strides, 0 included: expanded gradients),
    PROBS ``[T, E]`` and EXPERTS ``[T, TOP_K]`` (contiguous)."""
    pid = tl.program_id(0)
    rows = tl.cast(pid, tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < n_tokens
    mask = row_mask[:, None] & (cols < E)[None, :]
    probs = tl.load(PROBS + rows[:, None] * E + cols[None, :], mask=mask, other=0.0).to(ACC_DTYPE)
    full = tl.load(GRAD_PROBS + rows[:, None] * stride_gp_row + cols[None, :] * stride_gp_col, mask=mask,
                   other=0.0).to(ACC_DTYPE)

    # The chosen probabilities, their sum, and sum_j g_j w_j for the renormalization.
    total = tl.zeros((BLOCK_T,), dtype=ACC_DTYPE)
    weighted = tl.zeros((BLOCK_T,), dtype=ACC_DTYPE)
    for j in tl.static_range(TOP_K):
        e = tl.load(EXPERTS + rows * TOP_K + j, mask=row_mask, other=0)
        p = tl.sum(tl.where(cols[None, :] == e[:, None], probs, 0.0), axis=1)
        g = tl.load(GRAD_WEIGHTS + rows * stride_gw_row + j * stride_gw_col, mask=row_mask, other=0.0).to(ACC_DTYPE)
        total += p
        weighted += g * p
    if RENORMALIZE:
        total = tl.where(row_mask, total, 1.0)  # rows past T: no 0 / 0
        weighted = _divide(weighted, total)
    for j in tl.static_range(TOP_K):
        e = tl.load(EXPERTS + rows * TOP_K + j, mask=row_mask, other=0)
        g = tl.load(GRAD_WEIGHTS + rows * stride_gw_row + j * stride_gw_col, mask=row_mask, other=0.0).to(ACC_DTYPE)
        if RENORMALIZE:
            g = _divide(g - weighted, total)
        full += tl.where(cols[None, :] == e[:, None], g[:, None], 0.0)
    dlogits = probs * (full - tl.sum(probs * full, axis=1)[:, None])
    tl.store(DLOGITS + rows[:, None] * E + cols[None, :], dlogits.to(DLOGITS.dtype.element_ty), mask=mask)
