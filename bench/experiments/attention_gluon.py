"""Experiment (issue 28/29, not part of the package): the attention forward in
Gluon with asynchronous wgmma and explicit waits. It lost; kept so the
result can be reproduced and the next attempt starts from it.

Why it was tried: ``compile_ops/kernels/attention.py``'s forward is written in
``triton.language``, whose compiler waits for every wgmma right after issuing
it (a dot whose result feeds anything but its own accumulator is never left
in flight; a QK product issued one tile ahead was still waited for at once,
and spilled). ncu's instruction-level sampling on an H100 put 22% (int8_fp8)
and 37% (bf16) of the warps' time on those waits and the CTA barrier
(bench/notes.md, "A Hopper core in Gluon"). Gluon exposes the asynchronous
wgmma and its wait, so this kernel schedules each key tile as
FlashAttention-3 does within a warp group: at the top of step j, S_j (issued
at the end of step j-1, before P_j-1 V_j-1) is waited for with P_j-1 V_j-1
left in flight; S_j's softmax runs under that product; then the product is
folded in, S_j+1 and P_j V_j are issued. Two 64-query programs share an SM.
K and V come by TMA into a ring of STAGES buffers with one mbarrier each,
refilled once the wgmma that read a buffer has completed.

What it measured (``attention_gluon_check.py``, H100, torch 2.11, triton
3.6, bench/results/attention-gluon-experiment-h100.json, kernel only with
the operands quantized beforehand, TFLOP/s at 1x24x4608 / 1x12x32760 /
1x40x16384 / 1x12x75600, D=128, same run): int8_fp8 703 / 787 / 786 / 785
against the triton.language kernel's 699 / 793 / 770 / 761; bf16 (64-key
tiles, 3 stages) 480 / 536 / 533 / 526 against 508 / 526 / 558 / 567 (cuDNN
584 / 562 / 617 / 569). Known defect: a race. With 64-key tiles whole
64-query programs come out wrong or NaN at random on longer sequences, and
int8_fp8 did once at 1x12x4680 (results/attention-gluon-experiment-races-h100.txt);
the suspect is the in-flight P operand's registers, which nothing names as a
dependency of the wait (Gluon's lowering rejects 8-bit dependencies).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

# The portable kernel's constants (gl.constexpr is tl.constexpr): the INT8
# bias trick and FP8 P V's shift mean the same here.
from compile_ops.kernels.attention import _INT8_BIAS, _INT8_BIAS_BITS, _P_FP8_SHIFT  # noqa: E402

_LOG2E = gl.constexpr(1.4426950408889634)
_LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _load_tile(desc, smem, bars, tile, n_tiles, TRANSPOSED: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr):
    """Start the TMA copy of key tile ``tile`` (when it exists) into its ring buffer."""
    stage = tile % STAGES
    exists = tile < n_tiles
    bar = bars.index(stage)
    mbarrier.expect(bar, desc.block_type.nbytes, pred=exists)
    if TRANSPOSED:  # FP8 P V's V: [D, Lk], keys along the rows' contiguous axis
        tma.async_copy_global_to_shared(desc, [0, tile * BLOCK_N], bar, smem.index(stage), pred=exists)
    else:
        tma.async_copy_global_to_shared(desc, [tile * BLOCK_N, 0], bar, smem.index(stage), pred=exists)


@gluon.jit
def _values(v_smem, stage, TRANSPOSED: gl.constexpr):
    """The P V product's B operand ``[BLOCK_N, D]`` from the ring buffer."""
    if TRANSPOSED:
        return v_smem.index(stage).permute((1, 0))
    else:
        return v_smem.index(stage)


@gluon.jit
def _softmax(s, m, l, row, qk_scale, key_limit, INT8: gl.constexpr, PV_FP8: gl.constexpr,
             MASKED: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr, o_rows: gl.constexpr):
    """One tile's online-softmax step (``attn_fwd_kernel._fwd_update``'s formulas):
    ``(p, m_new, l_new, alpha)``, alpha in the accumulator's row layout
    ``o_rows``; scores of keys ``>= key_limit`` are masked."""
    if INT8:
        s = s.to(gl.float32, bitcast=True)
    if MASKED:
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where((cols < key_limit)[None, :], s, float("-inf"))
    if INT8:  # row > 0: the largest biased score is the largest score
        m_new = gl.maximum(m, (gl.max(s, 1) - _INT8_BIAS) * row)
    else:
        m_new = gl.maximum(m, gl.max(s, 1))
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    if INT8:
        factor = row * qk_scale
        shift = factor * _INT8_BIAS + m_shift * qk_scale
        if PV_FP8:
            shift = shift - _P_FP8_SHIFT
        p = gl.exp2(s * factor[:, None] - shift[:, None])
        alpha = gl.exp2((m - m_shift) * qk_scale)
    else:
        m_scaled = m_shift * qk_scale
        p = gl.exp2(s * qk_scale - m_scaled[:, None])
        alpha = gl.exp2(m * qk_scale - m_scaled)
    l = l * alpha + gl.sum(p, 1)
    return p, m_new, l, gl.convert_layout(alpha, o_rows)


@gluon.jit
def _scores(q_smem, k_smem, k_bars, tile, s_init, INT8: gl.constexpr, STAGES: gl.constexpr):
    """Issue tile ``tile``'s Q K^T once its keys have arrived (asynchronous)."""
    stage = tile % STAGES
    mbarrier.wait(k_bars.index(stage), (tile // STAGES) & 1)
    return warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_init, use_acc=INT8, is_async=True)


@gluon.jit
def _products(p, o, alpha, v_smem, v_bars, tile, PV_FP8: gl.constexpr, STAGES: gl.constexpr):
    """Issue tile ``tile``'s P V once its values have arrived (asynchronous): a
    fresh product (FP8, added to the fp32 accumulator after the wait), or the
    rescaled accumulator itself as the wgmma's accumulator (16-bit)."""
    stage = tile % STAGES
    mbarrier.wait(v_bars.index(stage), (tile // STAGES) & 1)
    if PV_FP8:
        return warpgroup_mma(p, _values(v_smem, stage, PV_FP8), gl.zeros_like(o), use_acc=False, is_async=True)
    else:
        return warpgroup_mma(p, _values(v_smem, stage, PV_FP8), o * alpha[:, None], is_async=True)


@gluon.jit
def _key_tile(j, n_tiles, s_token, o_token, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, s_init, o, m,
              l, alpha_prev, row_q, K_SCALE, qk_scale, key_limit, INT8: gl.constexpr, KEY_BLOCK: gl.constexpr,
              PV_FP8: gl.constexpr, MASKED: gl.constexpr, HAS_NEXT: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr, o_rows: gl.constexpr):
    """Key tile ``j``, whose Q K^T (``s_token``) was issued behind tile j-1's
    P V (``o_token``, none for j = 0): its softmax runs while the tensor
    cores finish P_j-1 V_j-1; then tile j+1's Q K^T (``HAS_NEXT``) and tile
    j's P V are issued, and the loop's next step finds them in flight.
    Returns ``(s_token, o_token, o, m, l, alpha)``."""
    if o_token is None:
        s = warpgroup_mma_wait(0, deps=[s_token])
    else:
        s = warpgroup_mma_wait(1, deps=[s_token])  # S_j is ready; P_j-1 V_j-1 may still run
    _load_tile(k_desc, k_smem, k_bars, j + STAGES, n_tiles, False, BLOCK_N, STAGES)  # K_j's buffer is free
    row = row_q
    if INT8:
        row = row_q * gl.load(K_SCALE + (j * BLOCK_N) // KEY_BLOCK)
    p, m, l, alpha = _softmax(s, m, l, row, qk_scale, key_limit, INT8, PV_FP8, MASKED, BLOCK_N, s_layout, o_rows)
    if PV_FP8:
        p = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
    else:
        p = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    if o_token is not None:
        part = warpgroup_mma_wait(0, deps=[o_token])
        if PV_FP8:
            o = o * alpha_prev[:, None] + part
        else:
            o = part
        _load_tile(v_desc, v_smem, v_bars, j - 1 + STAGES, n_tiles, PV_FP8, BLOCK_N, STAGES)  # V_j-1's too
    if HAS_NEXT:
        s_token = _scores(q_smem, k_smem, k_bars, j + 1, s_init, INT8, STAGES)
    o_token = _products(p, o, alpha, v_smem, v_bars, j, PV_FP8, STAGES)
    return s_token, o_token, o, m, l, alpha


@gluon.jit
def attn_fwd_hopper_kernel(Q, K, V, OUT, LSE, Q_SCALE, K_SCALE, V_SCALE,
                           sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sob, soh, sol,
                           H, GROUP, Lq, Lk, scale,
                           D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                           INT8: gl.constexpr, KEY_BLOCK: gl.constexpr, PV_FP8: gl.constexpr,
                           num_warps: gl.constexpr):
    """OUT = softmax(scale Q K^T) V for BLOCK_M queries of one (batch, head),
    LSE ``[B * H, Lq]`` (natural log); the arguments are ``attn_fwd_kernel``'s
    (dense, non-causal; KEY_BLOCK is ``INT8_KEY_BLOCK``, a multiple of BLOCK_N). ``Lk >= 1``; q, k, v (and OUT) have a unit stride
    along D and 16-byte aligned bases and row strides (TMA)."""
    gl.static_assert(num_warps == 4, "one warp group per program")
    gl.static_assert(BLOCK_M == 64, "a warp group's wgmma covers 64 rows")
    QK_K: gl.constexpr = 32 if INT8 else 16
    PV_K: gl.constexpr = 32 if PV_FP8 else 16
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, QK_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, PV_K])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if PV_FP8 else 2)
    qk_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                        element_bitwidth=8 if INT8 else 16, rank=2)
    v_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                       element_bitwidth=8 if PV_FP8 else 16, rank=2)

    bh = gl.program_id(1)
    b = bh.to(gl.int64) // H
    h = bh - b * H
    kv_h = h // GROUP
    q_start = gl.program_id(0) * BLOCK_M
    qk_scale = scale.to(gl.float32) * _LOG2E

    q_desc = tma.make_tensor_descriptor(Q + b * sqb + h * sqh, [Lq, D], [sql, 1], [BLOCK_M, D], qk_smem_layout)
    k_desc = tma.make_tensor_descriptor(K + b * skb + kv_h * skh, [Lk, D], [skl, 1], [BLOCK_N, D], qk_smem_layout)
    if PV_FP8:
        v_desc = tma.make_tensor_descriptor(V + b * svb + kv_h * svh, [D, Lk], [svl, 1], [D, BLOCK_N], v_smem_layout)
        v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [STAGES, D, BLOCK_N], v_smem_layout)
    else:
        v_desc = tma.make_tensor_descriptor(V + b * svb + kv_h * svh, [Lk, D], [svl, 1], [BLOCK_N, D], v_smem_layout)
        v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [STAGES, BLOCK_N, D], v_smem_layout)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [BLOCK_M, D], qk_smem_layout)
    k_smem = gl.allocate_shared_memory(K.dtype.element_ty, [STAGES, BLOCK_N, D], qk_smem_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)

    n_tiles = gl.cdiv(Lk, BLOCK_N)
    n_full = Lk // BLOCK_N  # tiles with every key valid
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_start, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        _load_tile(k_desc, k_smem, k_bars, i, n_tiles, False, BLOCK_N, STAGES)
        _load_tile(v_desc, v_smem, v_bars, i, n_tiles, PV_FP8, BLOCK_N, STAGES)

    rows_s = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    row_q = gl.full([BLOCK_M], 1.0, gl.float32, gl.SliceLayout(1, s_layout))
    k_scales = K_SCALE
    if INT8:
        # Rows past Lq get a factor of 1 (never 0: a masked score times 0 would be NaN); they are not stored.
        row_q = gl.load(Q_SCALE + bh.to(gl.int64) * Lq + rows_s, mask=rows_s < Lq, other=1.0)
        k_scales = K_SCALE + (b * (H // GROUP) + kv_h) * gl.cdiv(Lk, KEY_BLOCK)
    if INT8:
        s_init = gl.full([BLOCK_M, BLOCK_N], _INT8_BIAS_BITS, gl.int32, s_layout)
    else:
        s_init = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    m = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    o = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    mbarrier.wait(q_bar, 0)

    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    s_token = _scores(q_smem, k_smem, k_bars, 0, s_init, INT8, STAGES)
    if n_tiles == 1:  # one (possibly ragged) tile: nothing to overlap
        s_token, o_token, o, m, l, alpha = _key_tile(
            0, n_tiles, s_token, None, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, s_init, o, m, l, l,
            row_q, k_scales, qk_scale, Lk, INT8, KEY_BLOCK, PV_FP8, True, False, BLOCK_N, STAGES, s_layout,
            p_layout, o_rows)
    else:
        s_token, o_token, o, m, l, alpha = _key_tile(
            0, n_tiles, s_token, None, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, s_init, o, m, l, l,
            row_q, k_scales, qk_scale, Lk, INT8, KEY_BLOCK, PV_FP8, False, True, BLOCK_N, STAGES, s_layout,
            p_layout, o_rows)
        for j in range(1, n_tiles - 1):
            s_token, o_token, o, m, l, alpha = _key_tile(
                j, n_tiles, s_token, o_token, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, s_init, o, m,
                l, alpha, row_q, k_scales, qk_scale, Lk, INT8, KEY_BLOCK, PV_FP8, False, True, BLOCK_N, STAGES,
                s_layout, p_layout, o_rows)
        last = n_tiles - 1
        if n_full == n_tiles:
            s_token, o_token, o, m, l, alpha = _key_tile(
                last, n_tiles, s_token, o_token, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, s_init, o,
                m, l, alpha, row_q, k_scales, qk_scale, Lk, INT8, KEY_BLOCK, PV_FP8, False, False, BLOCK_N, STAGES,
                s_layout, p_layout, o_rows)
        else:  # the ragged last tile
            s_token, o_token, o, m, l, alpha = _key_tile(
                last, n_tiles, s_token, o_token, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, s_init, o,
                m, l, alpha, row_q, k_scales, qk_scale, Lk - last * BLOCK_N, INT8, KEY_BLOCK, PV_FP8, True, False,
                BLOCK_N, STAGES, s_layout, p_layout, o_rows)
    # The last tile's P V.
    part = warpgroup_mma_wait(0, deps=[o_token])
    if PV_FP8:
        o = o * alpha[:, None] + part
    else:
        o = part
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))

    empty = l == 0.0
    log2_l = gl.log2(gl.where(empty, 1.0, l))
    out = o / gl.convert_layout(gl.where(empty, 1.0, l), gl.SliceLayout(1, o_layout))[:, None]
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    if PV_FP8:  # V's channel scales; l sums 2**8 p
        out = out * gl.load(V_SCALE + (b * (H // GROUP) + kv_h) * D + cols)[None, :]
        log2_l = log2_l - _P_FP8_SHIFT
    rows_o = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    ptrs = OUT + b * sob + h * soh + rows_o.to(gl.int64)[:, None] * sol + cols[None, :]
    gl.store(ptrs, out.to(OUT.dtype.element_ty), mask=(rows_o < Lq)[:, None])
    lse = gl.where(empty, float("-inf"), m * scale + log2_l * _LN2)
    gl.store(LSE + bh.to(gl.int64) * Lq + rows_s, lse, mask=rows_s < Lq)
