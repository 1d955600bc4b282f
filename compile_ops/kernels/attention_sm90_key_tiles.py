"""One consumer warp group's pass over a work item's key tiles in the Hopper
(sm_90) forward core (``kernels/attention_sm90.py``, whose docstring gives the
design): each key tile's Q K^T, online-softmax step and P V, the products
issued so that a tile's softmax runs under the previous tile's P V, with the
ring's K and V buffers released as each product is done with them.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from compile_ops.kernels.attention_common import INT8_BIAS, P_FP8_SHIFT, fp8_operand_order
from compile_ops.kernels.attention_sm90_common import WGMMA_ROWS


@gluon.jit
def _softmax(
    s, m, l, row, qk_scale, key_limit, diagonal, MASKED: gl.constexpr, INT8_FP8: gl.constexpr, s_layout: gl.constexpr
):
    """One key tile's online-softmax step in base 2 (``attn_fwd_kernel``'s
    formulas): ``(p, m_new, l_new, alpha)``. ``MASKED`` (the one tile past the
    unmasked ones): its key c is visible to query row r of this consumer
    iff ``c < key_limit`` (the keys up to kv_len) and ``c <= r + diagonal``
    (causal: the query's position less the tile's first key; a tile's width
    where nothing is causal). ``INT8_FP8``: ``s`` holds the biased int32
    scores' bits, ``row`` the tile's factor per row (q's scale times the
    tile's k scale), and p is ``2**8`` times the probability."""
    if INT8_FP8:
        s = s.to(gl.float32, bitcast=True)
    if MASKED:
        cols = gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s_layout))
        rows = gl.arange(0, s.shape[0], layout=gl.SliceLayout(1, s_layout))
        visible = (cols < key_limit)[None, :] & (cols[None, :] <= (rows + diagonal)[:, None])
        s = gl.where(visible, s, float("-inf"))
    if INT8_FP8:  # row > 0: the largest biased score is the largest score
        m_new = gl.maximum(m, (gl.max(s, 1) - INT8_BIAS) * row)
    else:
        m_new = gl.maximum(m, gl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf: shift by 0, so that exp2 gives 0, not NaN.
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    if INT8_FP8:  # exp2((s - BIAS) * row * c - m * c + 8) as one fma per score
        factor = row * qk_scale
        shift = factor * INT8_BIAS + m_shift * qk_scale - P_FP8_SHIFT
        p = gl.exp2(s * factor[:, None] - shift[:, None])
        alpha = gl.exp2((m - m_shift) * qk_scale)
    else:
        m_scaled = m_shift * qk_scale
        p = gl.exp2(s * qk_scale - m_scaled[:, None])
        alpha = gl.exp2(m * qk_scale - m_scaled)
    l = l * alpha + gl.sum(p, 1)
    return p, m_new, l, alpha


@gluon.jit
def _row_factor(row_q, k_scales, blocks, j, SPARSE: gl.constexpr):
    """INT8_FP8: key tile j's factor per row, q's scales times the tile's k
    scale, one per 128-key block (a key tile): the j-th block's, or
    (``SPARSE``) the j-th listed block's (``blocks``, ascending)."""
    if SPARSE:
        return row_q * gl.load(k_scales + gl.load(blocks + j))
    else:
        return row_q * gl.load(k_scales + j)


@gluon.jit
def _scores(c, q_rows, k_smem, k_ready, s_init):
    """Issue Q K^T for the c-th key tile through the ring once its keys have
    arrived (asynchronous)."""
    STAGES: gl.constexpr = k_smem.shape[0]
    stage = c % STAGES
    mbarrier.wait(k_ready.index(stage), (c // STAGES) & 1)
    return warpgroup_mma(
        q_rows, k_smem.index(stage).permute((1, 0)), s_init, use_acc=k_smem.dtype == gl.int8, is_async=True
    )


@gluon.jit
def _next_carry(p, alpha, v_smem, p_smem, p_layout: gl.constexpr):
    """What a key step hands the next one, once its product is done. 16-bit:
    P in registers, the next product's A operand. INT8_FP8: the tile's alpha,
    with ``2**8 p`` rounded to e4m3 stored to this consumer's shared buffer
    in V's key order (the next product's A operand) and ordered before its reads (async
    proxy). In registers, an 8-bit P takes Triton's conversion from the
    scores' layout, byte permutes and warp shuffles, which is slower than
    the round trip through shared memory (docs/notes/attention.md)."""
    if v_smem.dtype == gl.float8e4nv:
        p_smem.store(fp8_operand_order(p.to(gl.float8e4nv)))
        fence_async_shared()
        return alpha
    else:
        return gl.convert_layout(p.to(v_smem.dtype), p_layout)


@gluon.jit
def _pv_issue(carry, o, o_zero, v_smem, p_smem, stage):
    """Issue P V for the tile in ``stage`` (asynchronous): 16-bit, P the
    carry and the rescaled O the accumulator; INT8_FP8, P from ``p_smem``
    into a fresh product (``attn_fwd_kernel``'s two-level accumulation: FP8
    MMAs keep fewer accumulator bits than fp32)."""
    if v_smem.dtype == gl.float8e4nv:
        return warpgroup_mma(p_smem, v_smem.index(stage).permute((1, 0)), o_zero, use_acc=False, is_async=True)
    else:
        return warpgroup_mma(carry, v_smem.index(stage), o, is_async=True)


@gluon.jit
def _pv_fold(token, carry, o, v_smem, o_rows: gl.constexpr):
    """Wait for the product ``_pv_issue`` started and fold it into O: the
    16-bit product is O itself; INT8_FP8's is added to O rescaled by the
    product's tile's alpha (the carry)."""
    if v_smem.dtype == gl.float8e4nv:
        return o * gl.convert_layout(carry, o_rows)[:, None] + warpgroup_mma_wait(0, deps=[token])
    else:
        # P (the carry) is named so that its registers live until the product is done.
        o, carry = warpgroup_mma_wait(0, deps=[token, carry])
        return o


@gluon.jit
def _key_step(
    j,
    c,
    carry,
    o,
    m,
    l,
    q_rows,
    row_q,
    k_scales,
    blocks,
    k_smem,
    v_smem,
    p_smem,
    k_ready,
    k_empty,
    v_ready,
    v_empty,
    s_init,
    o_zero,
    qk_scale,
    key_limit,
    diagonal,
    MASKED: gl.constexpr,
    SPARSE: gl.constexpr,
    s_layout: gl.constexpr,
    p_layout: gl.constexpr,
    o_rows: gl.constexpr,
):
    """Key tile j >= 1 of one consumer's work item, the c-th through the ring:
    S_j and P_j-1 V_j-1 issued back to back, S_j's softmax while the product
    runs, then the product folded in (with 256-key tiles, P_j-1 V_j-1 first
    and folded in, then S_j: ``kernels/attention_sm90.py``'s docstring says
    why). Returns ``(carry, o, m, l)`` for tile j + 1 (:func:`_next_carry`): 16-bit, O
    comes back at S_j's running max; INT8_FP8, at S_j-1's (the next step
    rescales it by alpha_j, the carry, before adding P_j V_j)."""
    STAGES: gl.constexpr = k_smem.shape[0]
    INT8_FP8: gl.constexpr = k_smem.dtype == gl.int8
    stage = c % STAGES
    prev = (c - 1) % STAGES
    # Wide key tiles (BLOCK_N 256): S_j's scores and P_j-1 do not fit in the registers side by side (the
    # accumulator of an issued product and its register operand stay allocated until it is waited for), so
    # P_j-1 V_j-1 is done before S_j is issued; the other consumer's products fill the tensor cores meanwhile.
    SERIAL: gl.constexpr = k_smem.shape[1] > 2 * WGMMA_ROWS
    if SERIAL:
        mbarrier.wait(v_ready.index(prev), ((c - 1) // STAGES) & 1)
        o = _pv_fold(_pv_issue(carry, o, o_zero, v_smem, p_smem, prev), carry, o, v_smem, o_rows)
        mbarrier.arrive(v_empty.index(prev), count=1)
        s = warpgroup_mma_wait(0, deps=[_scores(c, q_rows, k_smem, k_ready, s_init)])
    else:
        s_token = _scores(c, q_rows, k_smem, k_ready, s_init)
        mbarrier.wait(v_ready.index(prev), ((c - 1) // STAGES) & 1)
        o_token = _pv_issue(carry, o, o_zero, v_smem, p_smem, prev)
        s = warpgroup_mma_wait(1, deps=[s_token])  # wgmma groups complete in order: S_j is done
    mbarrier.arrive(k_empty.index(stage), count=1)
    row = row_q
    if INT8_FP8:
        row = _row_factor(row_q, k_scales, blocks, j, SPARSE)
    p, m, l, alpha = _softmax(s, m, l, row, qk_scale, key_limit, diagonal, MASKED, INT8_FP8, s_layout)
    if not SERIAL:
        o = _pv_fold(o_token, carry, o, v_smem, o_rows)
        mbarrier.arrive(v_empty.index(prev), count=1)
    if not INT8_FP8:
        o = o * gl.convert_layout(alpha, o_rows)[:, None]
    return _next_carry(p, alpha, v_smem, p_smem, p_layout), o, m, l


@gluon.jit
def key_tiles(
    it,
    o,
    m,
    l,
    q_rows,
    row_q,
    k_scales,
    blocks,
    k_smem,
    v_smem,
    p_smem,
    q_empty,
    k_ready,
    k_empty,
    v_ready,
    v_empty,
    s_init,
    o_zero,
    qk_scale,
    n_tiles,
    n_full,
    key_limit,
    diagonal,
    SPARSE: gl.constexpr,
    s_layout: gl.constexpr,
    p_layout: gl.constexpr,
    o_rows: gl.constexpr,
):
    """One consumer's pass over its work item's ``n_tiles >= 1`` key tiles,
    the last ``n_tiles - n_full`` (0 or 1) masked, the ring's ``it``-th
    onwards: ``(o, m, l)``. ``SPARSE``: the tiles are the listed blocks at
    ``blocks`` (INT8_FP8 reads their k scales). Once its last Q K^T is done it frees q for the
    loader (``q_empty``), which loads the next item's q under the last P V."""
    STAGES: gl.constexpr = k_smem.shape[0]
    INT8_FP8: gl.constexpr = k_smem.dtype == gl.int8
    # Key tile 0: no product in flight yet to overlap with.
    s = warpgroup_mma_wait(0, deps=[_scores(it, q_rows, k_smem, k_ready, s_init)])
    mbarrier.arrive(k_empty.index(it % STAGES), count=1)
    row = row_q
    if INT8_FP8:
        row = _row_factor(row_q, k_scales, blocks, 0, SPARSE)
    if n_full == 0:  # the only tile is the masked one
        p, m, l, alpha = _softmax(s, m, l, row, qk_scale, key_limit, diagonal, True, INT8_FP8, s_layout)
    else:
        p, m, l, alpha = _softmax(s, m, l, row, qk_scale, key_limit, diagonal, False, INT8_FP8, s_layout)
    carry = _next_carry(p, alpha, v_smem, p_smem, p_layout)
    for j in range(1, n_full):
        carry, o, m, l = _key_step(
            j,
            it + j,
            carry,
            o,
            m,
            l,
            q_rows,
            row_q,
            k_scales,
            blocks,
            k_smem,
            v_smem,
            p_smem,
            k_ready,
            k_empty,
            v_ready,
            v_empty,
            s_init,
            o_zero,
            qk_scale,
            key_limit,
            diagonal,
            False,
            SPARSE,
            s_layout,
            p_layout,
            o_rows,
        )
    if n_tiles > n_full and n_full > 0:  # the masked tile after unmasked ones
        carry, o, m, l = _key_step(
            n_full,
            it + n_full,
            carry,
            o,
            m,
            l,
            q_rows,
            row_q,
            k_scales,
            blocks,
            k_smem,
            v_smem,
            p_smem,
            k_ready,
            k_empty,
            v_ready,
            v_empty,
            s_init,
            o_zero,
            qk_scale,
            key_limit,
            diagonal,
            True,
            SPARSE,
            s_layout,
            p_layout,
            o_rows,
        )
    mbarrier.arrive(q_empty, count=1)  # every Q K^T of this item is done
    last = it + n_tiles - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    o = _pv_fold(_pv_issue(carry, o, o_zero, v_smem, p_smem, last % STAGES), carry, o, v_smem, o_rows)
    mbarrier.arrive(v_empty.index(last % STAGES), count=1)
    return o, m, l
