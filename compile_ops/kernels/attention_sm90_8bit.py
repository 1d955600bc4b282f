"""8-bit attention's forward on Hopper (sm_90), in Gluon: one warp group a
program, with each key tile's loads issued a tile ahead.

Why beside ``attention.py``'s ``attn_fwd_kernel``, which computes the same
mode (``INT8`` + ``PV_FP8``, dense or over block lists): under the register
cap that fits three of its programs on an SM, it runs two K/V buffers, and
Triton issues tile j + 1's TMA loads at the end of iteration j, after its P V
product, so every tile waits out the trip from L2 to shared memory. Triton
3.6 gives no say over where those loads go. Here they go out right after
tile j's scores' product is issued: tile j - 1's products, the last readers
of that buffer, are done by then, so the load runs under tile j's softmax
and P V.

Why not the sm_90 core's ``INT8_FP8`` mode (``attention_sm90.py``): its two
consumer warp groups share each tile, so an SM runs two warp groups of
softmax, not three, and that mode is not ahead of ``attn_fwd_kernel``
(docs/notes/attention-8bit.md).

A program is 64 queries of one (batch, head) and its key tiles of 128 keys
(one k scale each) in ascending order: all of them, or (``SPARSE``) those of
its listed key blocks. Only the last tile can reach past Lk (the lists are
sorted), so one tile at most is masked. The formulas, the order of the
additions and the roundings are ``attn_fwd_kernel``'s (the core's
``_softmax`` in its ``INT8_FP8`` form, a fresh FP8 product per tile added to
the fp32 accumulator), and so are its output bits. ``QUANTIZE_Q``,
``SCATTER`` and ``OUT_FP8`` are its front ends of the same names: q given in
16 bits and rounded per row as the program loads it, rows written at their
tokens, and the output as e4m3 rows with their scales. Gluon does not run
under the interpreter: tests/test_sm90_compile_gluon.py compiles each
variant for sm_90, and the GPU tests compare it with ``attn_fwd_kernel``.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from compile_ops.kernels.attention_common import (
    INT8_BIAS_BITS,
    INT8_MAX,
    P_FP8_SHIFT,
    block_list,
    fp8_operand_order,
    fp8_value_positions,
    quantization_scale,
    round_to_int8,
    tile_start,
)
from compile_ops.kernels.attention_sm90_common import LOG2E, WGMMA_ROWS, tma_box
from compile_ops.kernels.attention_sm90_key_tiles import _softmax
from compile_ops.kernels.fp8 import to_e4m3

_LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _load_tile(j, blocks, k_desc, v_desc, k_smem, v_smem, ready, b, hk, SPARSE: gl.constexpr):
    """K and V of the j-th key tile (of the j-th listed block: SPARSE) into
    buffer ``j % STAGES``, signalled on its ready barrier."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    STAGES: gl.constexpr = k_smem.shape[0]
    stage = j % STAGES
    start = tile_start(j, blocks, BLOCK_N, BLOCK_N, SPARSE)
    mbarrier.expect(ready.index(stage), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, start, 0], ready.index(stage), tma_box(k_smem.index(stage)))
    tma.async_copy_global_to_shared(v_desc, [b, hk, 0, start], ready.index(stage), tma_box(v_smem.index(stage)))


@gluon.jit
def _key_tile(
    j,
    count,
    acc,
    m,
    l,
    args,
    MASKED: gl.constexpr,
    SPARSE: gl.constexpr,
    s_layout: gl.constexpr,
    p_layout: gl.constexpr,
    o_rows: gl.constexpr,
):
    """Key tile j: its scores' product issued, then tile ``j + STAGES - 1``'s
    loads into the buffer tile j - 1 used, then the softmax step and the FP8
    P V product added to ``acc``; ``(acc, m, l)``."""
    q_smem, k_smem, v_smem, ready, k_desc, v_desc, blocks, row_q, k_scales, s_init, o_zero, qk_scale, b, hk, Lk = args
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    STAGES: gl.constexpr = k_smem.shape[0]
    stage = j % STAGES
    mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
    s_token = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_init, use_acc=True, is_async=True)
    start = tile_start(j, blocks, BLOCK_N, BLOCK_N, SPARSE)
    row = row_q * gl.load(k_scales + start // BLOCK_N)
    if j + STAGES - 1 < count:  # tile j - 1's products were waited for: its buffer is free
        _load_tile(j + STAGES - 1, blocks, k_desc, v_desc, k_smem, v_smem, ready, b, hk, SPARSE)
    s = warpgroup_mma_wait(0, deps=[s_token])
    p, m, l, alpha = _softmax(s, m, l, row, qk_scale, Lk - start, BLOCK_N, MASKED, True, s_layout)
    p8 = gl.convert_layout(fp8_operand_order(p.to(gl.float8e4nv)), p_layout)
    o_token = warpgroup_mma(p8, v_smem.index(stage).permute((1, 0)), o_zero, use_acc=False, is_async=True)
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None] + warpgroup_mma_wait(0, deps=[o_token])
    return acc, m, l


@gluon.jit
def attn8_fwd_sm90_kernel(
    Q,
    K,
    V,
    OUT,
    LSE,
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
    B,
    H,
    GROUP,
    Lq,
    Lk,
    scale,
    D: gl.constexpr,
    STAGES: gl.constexpr,
    SPARSE: gl.constexpr,
    QUANTIZE_Q: gl.constexpr,
    SCATTER: gl.constexpr,
    OUT_FP8: gl.constexpr,
    num_warps: gl.constexpr,
):
    """OUT = softmax(scale Q K^T) V over every key or (SPARSE) the listed key
    blocks, for 64 queries of one (batch, head) a program (grid ``(cdiv(Lq,
    64), B * H)``), and LSE ``[B * H, Lq]`` in natural log. Q int8 (16-bit
    with QUANTIZE_Q, no Q_SCALE) ``[B, H, Lq, D]`` and K int8
    ``[B, Hk, Lk, D]`` (any strides with a unit one along D, Hk = H / GROUP),
    Q_SCALE ``[B, H, Lq]`` and K_SCALE ``[B, Hk, cdiv(Lk, 128)]`` fp32
    contiguous; V e4m3 ``[B, Hk, D, Lk16]`` with a unit key stride (``svl`` the
    stride between channels) and V_SCALE ``[B, Hk, D]``; BLOCKS / COUNTS the
    sorted lists of 128-key blocks per 128-query block (``sb*``, ``sc*`` their
    strides). SCATTER (Lq = Lk): query row r's output and lse rows go to token
    ``TOKENS[r]``. OUT_FP8: OUT is e4m3, ``out / ROW_SCALE[b]`` rounded and
    clamped to +-448, and head 0's programs write that scale to OUT_SCALE
    ``[B, Lq]`` (``attn_fwd_kernel``'s modes of the same names)."""
    BLOCK_M: gl.constexpr = WGMMA_ROWS
    BLOCK_N: gl.constexpr = 128
    K_STEP: gl.constexpr = 32  # a wgmma's K for 8-bit operands
    tile = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    h = bh - b * H
    hk = h // GROUP
    q_start = tile * BLOCK_M
    box: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=4)
    matrix: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    k_desc = tma.make_tensor_descriptor(K, [B, H // GROUP, Lk, D], [skb, skh, skl, 1], [1, 1, BLOCK_N, D], box)
    v_desc = tma.make_tensor_descriptor(
        V, [B, H // GROUP, D, fp8_value_positions(Lk)], [svb, svh, svl, 1], [1, 1, D, BLOCK_N], box
    )
    q_smem = gl.allocate_shared_memory(gl.int8, [BLOCK_M, D], matrix)
    k_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, D], matrix)
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, D, BLOCK_N], matrix)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)

    if SPARSE:
        blocks, count = block_list(BLOCKS, COUNTS, b, h, q_start // BLOCK_N, sbb, sbh, sbr, scb, sch, scr)
        count = count.to(gl.int32)  # int64 lists: the buffers' indices and TMA coordinates are int32
    else:
        blocks, count = BLOCKS, gl.cdiv(Lk, BLOCK_N)
    if not QUANTIZE_Q:
        q_desc = tma.make_tensor_descriptor(Q, [B, H, Lq, D], [sqb, sqh, sql, 1], [1, 1, BLOCK_M, D], box)
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, q_start, 0], q_bar, tma_box(q_smem))
    for i in gl.static_range(STAGES - 1):  # the tiles the loop's first iterations read
        if i < count:
            _load_tile(i, blocks, k_desc, v_desc, k_smem, v_smem, ready, b, hk, SPARSE)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, K_STEP]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, K_STEP]
    )
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    rows = q_start + gl.arange(0, BLOCK_M, layout=s_rows)
    # Rows past Lq get a factor of 1 (never 0: a masked score times 0 would be NaN); they are not stored.
    if QUANTIZE_Q:  # 16-bit q, each row rounded to int8 here, as attn_fwd_kernel's QUANTIZE_Q
        q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        load_rows = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_layout))
        q_cols = gl.arange(0, D, layout=gl.SliceLayout(0, q_layout))
        q_ptrs = Q + b.to(gl.int64) * sqb + h.to(gl.int64) * sqh + load_rows.to(gl.int64)[:, None] * sql
        q = gl.load(q_ptrs + q_cols[None, :], mask=(load_rows < Lq)[:, None], other=0.0).to(gl.float32)
        q_scale, q_inverse = quantization_scale(gl.max(gl.abs(q), 1), INT8_MAX)
        q_smem.store(round_to_int8(q, q_inverse[:, None]))
        fence_async_shared()  # the store, before the wgmma that reads it through the async proxy
        row_q = gl.convert_layout(gl.where(load_rows < Lq, q_scale, 1.0), s_rows)
    else:
        row_q = gl.load(Q_SCALE + bh.to(gl.int64) * Lq + rows, mask=rows < Lq, other=1.0)
    k_scales = K_SCALE + (b * (H // GROUP) + hk) * gl.cdiv(Lk, BLOCK_N)
    o_zero = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    s_init = gl.full([BLOCK_M, BLOCK_N], INT8_BIAS_BITS, gl.int32, s_layout)
    args = (
        q_smem,
        k_smem,
        v_smem,
        ready,
        k_desc,
        v_desc,
        blocks,
        row_q,
        k_scales,
        s_init,
        o_zero,
        scale * LOG2E,
        b,
        hk,
        Lk,
    )
    acc = o_zero
    m = gl.full([BLOCK_M], float("-inf"), gl.float32, s_rows)
    l = gl.zeros([BLOCK_M], gl.float32, s_rows)
    if not QUANTIZE_Q:
        mbarrier.wait(q_bar, 0)
    # Only the last listed block can reach past Lk: the tiles before it need no mask.
    unmasked = count
    if count > 0:
        unmasked -= (tile_start(count - 1, blocks, BLOCK_N, BLOCK_N, SPARSE) + BLOCK_N > Lk).to(gl.int32)
    for j in range(unmasked):
        acc, m, l = _key_tile(j, count, acc, m, l, args, False, SPARSE, s_layout, p_layout, o_rows)
    for j in range(unmasked, count):
        acc, m, l = _key_tile(j, count, acc, m, l, args, True, SPARSE, s_layout, p_layout, o_rows)

    empty = l == 0.0
    l = gl.where(empty, 1.0, l)
    out = acc / gl.convert_layout(l, o_rows)[:, None]
    # Before V's scales are read: with l live past that load, ptxas spilled in the key loops (maxnreg 168).
    log2_l = gl.log2(l) - P_FP8_SHIFT  # l sums 2**8 p
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    out = out * gl.load(V_SCALE + (b * (H // GROUP) + hk) * D + cols)[None, :]  # V's channel scales
    q_rows = q_start + gl.arange(0, BLOCK_M, layout=o_rows)
    if SCATTER:  # rows past Lq are given token 0: the masks keep them out
        out_rows = gl.load(TOKENS + q_rows, mask=q_rows < Lq, other=0).to(gl.int64)
        lse_rows = gl.convert_layout(out_rows, s_rows)
    else:
        out_rows = q_rows.to(gl.int64)
        lse_rows = rows.to(gl.int64)
    if OUT_FP8:
        row_scale = gl.load(ROW_SCALE + b)
        # The reciprocal correctly rounded, as the specification's fp32 division.
        out = to_e4m3(out, gl.div_rn(gl.full([BLOCK_M], 1.0, gl.float32, o_rows), row_scale))
        head0 = (q_rows < Lq) & (h == 0)
        gl.store(OUT_SCALE + b * Lq + out_rows, gl.zeros([BLOCK_M], gl.float32, o_rows) + row_scale, mask=head0)
    gl.store(
        OUT + b.to(gl.int64) * sob + h.to(gl.int64) * soh + out_rows[:, None] * sol + cols[None, :],
        out.to(OUT.dtype.element_ty),
        mask=(q_rows < Lq)[:, None],
    )
    lse = gl.where(empty, float("-inf"), m * scale + log2_l * _LN2)
    gl.store(LSE + bh.to(gl.int64) * Lq + lse_rows, lse, mask=rows < Lq)
