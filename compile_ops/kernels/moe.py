"""Triton kernels of the MoE routing family: routing, per-expert token lists, and the routing backward.

``moe_route_kernel``: each program owns ``BLOCK_T`` tokens. It accumulates
their router logits ``x @ router_weight.T`` ``[BLOCK_T, BLOCK_E]`` with
``tl.dot`` over H in ``BLOCK_H`` chunks (fp32 accumulator, fp64 for fp64
inputs), takes the softmax in that precision, writes the probabilities and
picks the top k by k rounds of (row max, lowest column holding it): the tie
break is the lowest expert index, as a stable descending sort gives
(``reference/moe.py``). NaN is taken as larger than every probability (as
torch's sort does), so a NaN row picks experts 0..k-1. E is held whole in one
row of registers: hence ``meta.moe.MAX_EXPERTS``.

``moe_token_lists_kernel`` (a second, small launch): one program per expert
scans the chosen experts of every token in ascending token order, compacting
the tokens that chose it with a prefix sum per block and a running offset,
and writes its count and its row of ``token_index`` (padded with T). Why not
in the routing kernel: a token's slot in an expert's list is the number of
earlier tokens that chose that expert, which depends on every earlier token
block; inside one launch that needs either a grid-wide barrier (not
available without a cooperative launch) or atomic counters, whose order
follows the scheduling and would make the lists differ from run to run. The
scan reads ``experts`` (``T * k`` indices, L2-resident at DiT sizes) once per
expert and involves no floating point at all.

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
def moe_route_kernel(X, W, PROBS, WEIGHTS, EXPERTS, n_tokens, H, E, stride_x, stride_w,
                     TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    """X ``[T, H]`` and W ``[E, H]`` with unit column stride; PROBS ``[T, E]``,
    WEIGHTS and EXPERTS ``[T, TOP_K]`` contiguous."""
    pid = tl.program_id(0)
    rows = tl.cast(pid, tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < n_tokens
    col_mask = cols < E

    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=ACC_DTYPE)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_mask = hs < H
        x = tl.load(X + rows[:, None] * stride_x + hs[None, :], mask=row_mask[:, None] & h_mask[None, :], other=0.0)
        # W read transposed, [BLOCK_H, BLOCK_E]: the product's right operand.
        w = tl.load(W + cols[None, :].to(tl.int64) * stride_w + hs[:, None], mask=col_mask[None, :] & h_mask[:, None],
                    other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)

    # Softmax over the E real columns; the padding columns get exp(-inf) = 0.
    logits = tl.where(col_mask[None, :], acc, float("-inf"))
    shifted = logits - tl.max(logits, axis=1)[:, None]
    numerators = tl.exp(shifted)
    probs = _divide(numerators, tl.sum(numerators, axis=1)[:, None])
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(PROBS + rows[:, None] * E + cols[None, :], probs.to(PROBS.dtype.element_ty), mask=out_mask)

    # Top-k by k rounds of max. The key orders NaN above every probability
    # (2 > 1 >= p) and the padding columns below every one (-1 < 0 <= p).
    key = tl.where(probs != probs, 2.0, probs)
    key = tl.where(col_mask[None, :], key, -1.0)
    slots = tl.arange(0, BLOCK_K)
    chosen_p = tl.zeros((BLOCK_T, BLOCK_K), dtype=ACC_DTYPE)
    chosen_e = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)
        # The lowest column holding the maximum: the deterministic tie-break.
        index = tl.min(tl.where(key == best[:, None], cols[None, :], BLOCK_E), axis=1)
        picked = cols[None, :] == index[:, None]
        p = tl.sum(tl.where(picked, probs, 0.0), axis=1)
        chosen_p = tl.where(slots[None, :] == j, p[:, None], chosen_p)
        chosen_e = tl.where(slots[None, :] == j, index[:, None].to(tl.int64), chosen_e)
        key = tl.where(picked, -1.0, key)
    if RENORMALIZE:
        chosen_p = _divide(chosen_p, tl.sum(chosen_p, axis=1)[:, None])
    k_mask = row_mask[:, None] & (slots < TOP_K)[None, :]
    offsets = rows[:, None] * TOP_K + slots[None, :]
    tl.store(WEIGHTS + offsets, chosen_p.to(WEIGHTS.dtype.element_ty), mask=k_mask)
    tl.store(EXPERTS + offsets, chosen_e, mask=k_mask)


@triton.jit
def moe_token_lists_kernel(EXPERTS, COUNTS, TOKEN_INDEX, n_tokens,
                           TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    """Program e: ``COUNTS[e]`` and row e of ``TOKEN_INDEX [E, T]`` from
    ``EXPERTS [T, TOP_K]`` (contiguous), in ascending token order."""
    expert = tl.program_id(0)
    row = TOKEN_INDEX + tl.cast(expert, tl.int64) * n_tokens
    slots = tl.arange(0, BLOCK_K)
    count = tl.zeros((), dtype=tl.int64)
    for t0 in range(0, n_tokens, BLOCK_T):
        tokens = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        token_mask = tokens < n_tokens
        chosen = tl.load(EXPERTS + tokens[:, None] * TOP_K + slots[None, :],
                         mask=token_mask[:, None] & (slots < TOP_K)[None, :], other=-1)
        # A token chooses an expert at most once, so this is 0 or 1.
        hit = tl.sum((chosen == expert).to(tl.int32), axis=1)
        position = count + tl.cumsum(hit, axis=0) - hit  # exclusive prefix sum: the token's slot
        tl.store(row + position, tokens.to(tl.int32), mask=hit > 0)
        count += tl.sum(hit, axis=0)
    tl.store(COUNTS + expert, count.to(tl.int32))
    # The padding past the list: T, from the block holding the first free slot on.
    for t0 in range((count // BLOCK_T) * BLOCK_T, n_tokens, BLOCK_T):
        position = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        tl.store(row + position, (tl.zeros((BLOCK_T,), dtype=tl.int64) + n_tokens).to(tl.int32),
                 mask=(position >= count) & (position < n_tokens))


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
