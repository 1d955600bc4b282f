"""Triton kernels of the MoE routing family: routing, per-expert token lists, and the routing backward.

``moe_route_kernel``: each program owns ``BLOCK_T`` tokens. It takes
their router logits ``x @ router_weight.T`` ``[BLOCK_T, BLOCK_E]`` (fp32
accumulator, fp64 for fp64 inputs), either computing them with ``tl.dot``
over H in ``BLOCK_H`` chunks or, for a wide router (``SPLIT``), summing the
partial products that ``moe_router_logits_kernel`` wrote for slices of H in
a launch before. Why split: every routing program reads the whole router
weight (512 KB at E = 64, H = 4096 in bf16) from L2; with one program per 16
or 32 tokens those re-reads outweigh the bytes of x itself and stall the
kernel on shared memory (docs/notes/profiles.md, "MoE routing"). Splitting H lets
128 programs cover 128 tokens each, reading a quarter of the weight per
program. The partial sums are added in a fixed order: the logits, hence the
routing, are the same every run. Then the softmax in the accumulator's
precision, the probabilities written, and the top k by k rounds of (row
max, lowest column holding it): the tie break is the lowest expert index,
as a stable descending sort gives (``reference/moe.py``). A token whose
probabilities are NaN (a NaN or +inf logit makes the softmax's whole row
NaN) takes the top k of its logits instead, in torch.topk's order: NaN
above +inf above the numbers above -inf (``reference.moe.routing_key``).
E is held whole in one row of registers: hence
``meta.moe.MAX_EXPERTS``. Each program also writes how many of its tokens
chose each expert (``BLOCK_COUNTS``).

``moe_token_lists_kernel`` (a second launch, one program per routing
block): the per-expert counts and token lists, in ascending token order. A
token's slot in an expert's list is the number of earlier tokens that chose
that expert: the earlier blocks' counts (summed from ``BLOCK_COUNTS``)
plus a prefix sum within the block. Why not in the routing kernel: those
counts depend on every earlier block, which one launch could only wait for
with a grid-wide barrier (not available without a cooperative launch) or
atomic counters, whose order follows the scheduling and would make the
lists differ from run to run. No floating point is involved.

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
def _is_nan(v):
    return v != v  # false for every number and infinity


@triton.jit
def _router_logits(
    X,
    W,
    rows,
    cols,
    row_mask,
    col_mask,
    h_start,
    h_end,
    stride_x,
    stride_w,
    DOT_PRECISION: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``x[rows, h_start:h_end] @ w[cols, h_start:h_end].T`` ``[BLOCK_T, BLOCK_E]`` in ACC_DTYPE."""
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=ACC_DTYPE)
    for h0 in range(h_start, h_end, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_mask = hs < h_end
        x = tl.load(X + rows[:, None] * stride_x + hs[None, :], mask=row_mask[:, None] & h_mask[None, :], other=0.0)
        # W read transposed, [BLOCK_H, BLOCK_E]: the product's right operand.
        w = tl.load(
            W + cols[None, :].to(tl.int64) * stride_w + hs[:, None], mask=col_mask[None, :] & h_mask[:, None], other=0.0
        )
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return acc


@triton.jit
def moe_router_logits_kernel(
    X,
    W,
    PARTIAL,
    n_tokens,
    H,
    E,
    stride_x,
    stride_w,
    h_per_split,
    DOT_PRECISION: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Program (i, s): the logits of tokens ``[i * BLOCK_T, (i + 1) * BLOCK_T)``
    over hidden columns ``[s * h_per_split, (s + 1) * h_per_split)``, to
    ``PARTIAL[s]`` (``[SPLIT, T, E]`` contiguous, ACC_DTYPE). ``h_per_split``
    is a multiple of BLOCK_H."""
    rows = tl.cast(tl.program_id(0), tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < n_tokens
    col_mask = cols < E
    h_start = tl.program_id(1) * h_per_split
    acc = _router_logits(
        X,
        W,
        rows,
        cols,
        row_mask,
        col_mask,
        h_start,
        tl.minimum(h_start + h_per_split, H),
        stride_x,
        stride_w,
        DOT_PRECISION,
        ACC_DTYPE,
        BLOCK_T,
        BLOCK_E,
        BLOCK_H,
    )
    partial = PARTIAL + tl.cast(tl.program_id(1), tl.int64) * n_tokens * E
    tl.store(partial + rows[:, None] * E + cols[None, :], acc, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def moe_route_kernel(
    X,
    W,
    PARTIAL,
    PROBS,
    WEIGHTS,
    EXPERTS,
    BLOCK_COUNTS,
    n_tokens,
    H,
    E,
    stride_x,
    stride_w,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """X ``[T, H]`` and W ``[E, H]`` with unit column stride; PROBS ``[T, E]``,
    WEIGHTS and EXPERTS ``[T, TOP_K]`` contiguous; BLOCK_COUNTS
    ``[cdiv(T, BLOCK_T), E]`` int32: how many of each program's tokens chose
    each expert. SPLIT = 0: the program computes its logits; SPLIT > 0: it
    sums ``PARTIAL [SPLIT, T, E]`` (``moe_router_logits_kernel``'s), in
    order (the same sums every run)."""
    pid = tl.program_id(0)
    rows = tl.cast(pid, tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < n_tokens
    col_mask = cols < E
    out_mask = row_mask[:, None] & col_mask[None, :]

    if SPLIT == 0:
        acc = _router_logits(
            X,
            W,
            rows,
            cols,
            row_mask,
            col_mask,
            0,
            H,
            stride_x,
            stride_w,
            DOT_PRECISION,
            ACC_DTYPE,
            BLOCK_T,
            BLOCK_E,
            BLOCK_H,
        )
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

    # Top-k by k rounds of max over the columns still live (real, not yet
    # picked). The key is the probabilities, or the logits of a token whose
    # probabilities are NaN (the softmax makes the whole row NaN); a NaN key
    # counts as +inf and goes first among the columns holding +inf by its
    # rank (its column, where +inf's is its column + BLOCK_E): torch.topk's
    # order, NaN above +inf.
    nan_row = tl.max(tl.where(col_mask[None, :] & _is_nan(probs), 1, 0), axis=1) > 0
    key = tl.where(nan_row[:, None], logits, probs)
    key_nan = _is_nan(key)
    key = tl.where(key_nan, float("inf"), key)
    rank = cols[None, :] + tl.where(key_nan, 0, BLOCK_E)
    live = (cols[None, :] + tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)) < E
    slots = tl.arange(0, BLOCK_K)
    chosen_p = tl.zeros((BLOCK_T, BLOCK_K), dtype=ACC_DTYPE)
    chosen_e = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
    hits = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.where(live, key, float("-inf")), axis=1)
        # The lowest rank holding the maximum: NaN first, then the lowest
        # column (the deterministic tie-break).
        first = tl.min(tl.where(live & (key == best[:, None]), rank, 2 * BLOCK_E), axis=1)
        index = first % BLOCK_E
        picked = cols[None, :] == index[:, None]
        p = tl.sum(tl.where(picked, probs, 0.0), axis=1)
        chosen_p = tl.where(slots[None, :] == j, p[:, None], chosen_p)
        chosen_e = tl.where(slots[None, :] == j, index[:, None].to(tl.int64), chosen_e)
        hits += picked.to(tl.int32)
        live = live & ~picked
    if RENORMALIZE:
        chosen_p = _divide(chosen_p, tl.sum(chosen_p, axis=1)[:, None])
    k_mask = row_mask[:, None] & (slots < TOP_K)[None, :]
    offsets = rows[:, None] * TOP_K + slots[None, :]
    tl.store(WEIGHTS + offsets, chosen_p.to(WEIGHTS.dtype.element_ty), mask=k_mask)
    tl.store(EXPERTS + offsets, chosen_e, mask=k_mask)
    # This block's tokens per expert (rows past T chose nothing), for the token lists.
    block_counts = tl.sum(tl.where(row_mask[:, None], hits, 0), axis=0)
    tl.store(BLOCK_COUNTS + tl.cast(pid, tl.int64) * E + cols, block_counts, mask=col_mask)


@triton.jit
def moe_token_lists_kernel(
    EXPERTS,
    BLOCK_COUNTS,
    COUNTS,
    TOKEN_INDEX,
    n_tokens,
    n_blocks,
    E,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    COUNT_CHUNK: tl.constexpr,
):
    """Program i: the slots of tokens ``[i * BLOCK_T, (i + 1) * BLOCK_T)`` in
    every expert's row of ``TOKEN_INDEX [E, T]`` (int32, ascending token ids,
    padded with T), from ``EXPERTS [T, TOP_K]`` and ``moe_route_kernel``'s
    ``BLOCK_COUNTS [n_blocks, E]`` (the same BLOCK_T): a token's slot is the
    number of earlier tokens that chose the expert, the earlier blocks'
    counts plus an exclusive prefix sum inside the block. Program i also
    writes the padding at positions ``[i * BLOCK_T, (i + 1) * BLOCK_T)`` past
    each expert's count; program 0 writes ``COUNTS [E]``."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    col_mask = cols < E
    earlier = tl.zeros((BLOCK_E,), dtype=tl.int32)
    total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for b0 in range(0, n_blocks, COUNT_CHUNK):
        blocks = b0 + tl.arange(0, COUNT_CHUNK)
        counts = tl.load(
            BLOCK_COUNTS + blocks[:, None].to(tl.int64) * E + cols[None, :],
            mask=(blocks < n_blocks)[:, None] & col_mask[None, :],
            other=0,
        )
        earlier += tl.sum(tl.where((blocks < pid)[:, None], counts, 0), axis=0)
        total += tl.sum(counts, axis=0)
    if pid == 0:
        tl.store(COUNTS + cols, total, mask=col_mask)

    tokens = tl.cast(pid, tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < n_tokens
    hits = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)
    for j in tl.static_range(TOP_K):  # a token chooses an expert at most once: hits are 0 or 1
        chosen = tl.load(EXPERTS + tokens * TOP_K + j, mask=token_mask, other=-1)
        hits += (chosen[:, None] == cols[None, :]).to(tl.int32)
    slots = earlier[None, :] + tl.cumsum(hits, axis=0) - hits  # exclusive prefix sum down the block
    rows = TOKEN_INDEX + cols[None, :].to(tl.int64) * n_tokens
    tl.store(rows + slots, (tokens[:, None] + 0 * cols[None, :]).to(tl.int32), mask=hits > 0)
    # The padding: this block's range of positions, past each expert's count.
    pad = (tokens[:, None] >= total[None, :]) & token_mask[:, None] & col_mask[None, :]
    tl.store(rows + tokens[:, None], (tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int64) + n_tokens).to(tl.int32), mask=pad)


@triton.jit
def moe_route_backward_kernel(
    GRAD_PROBS,
    GRAD_WEIGHTS,
    PROBS,
    EXPERTS,
    DLOGITS,
    n_tokens,
    E,
    stride_gp_row,
    stride_gp_col,
    stride_gw_row,
    stride_gw_col,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """DLOGITS ``[T, E]`` (contiguous) from GRAD_PROBS ``[T, E]`` and
    GRAD_WEIGHTS ``[T, TOP_K]`` (any strides, 0 included: expanded gradients),
    PROBS ``[T, E]`` and EXPERTS ``[T, TOP_K]`` (contiguous)."""
    pid = tl.program_id(0)
    rows = tl.cast(pid, tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < n_tokens
    mask = row_mask[:, None] & (cols < E)[None, :]
    probs = tl.load(PROBS + rows[:, None] * E + cols[None, :], mask=mask, other=0.0).to(ACC_DTYPE)
    full = tl.load(GRAD_PROBS + rows[:, None] * stride_gp_row + cols[None, :] * stride_gp_col, mask=mask, other=0.0).to(
        ACC_DTYPE
    )

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
