"""The Hopper (sm_90) attention backward, in Gluon: five products a tile pair, FlashAttention-3's structure.

``attn_bwd_sm90_kernel``: a loader warp and two consumer warp groups of 64
keys sharing steps of 64 queries (128 at D = 64), with dq added by TMA
reductions in the order the programs run: the
``set_attention_backward(deterministic=False)`` option, dense, causal, with
key lengths or over block lists, faster than the deterministic passes
(docs/notes/attention.md). Without dQ it is the deterministic backward's
dk/dv pass (four products), for dense non-causal calls persistent: one
program per SM over the key tiles. It shares the forward core's warp-group
rows and TMA boxes (``kernels/attention_sm90.py``).

Gluon does not run under the interpreter: the CPU tests compile every
variant for sm_90 (tests/test_sm90_compile.py), the GPU tests compare them
with the deterministic passes.
"""
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from compile_ops.kernels.attention_common import dealt_rank, kv_len_of
from compile_ops.kernels.attention_sm90 import LOG2E, WGMMA_ROWS, tma_box

#: dQ's fp32 channels per TMA reduction: 128-byte rows, the reductions' 128-byte swizzle.
_DQ_PIECE = gl.constexpr(32)


@builtin
def _tma_add(tensor_desc, coord, src, _semantic=None):
    """Add the shared-memory tile ``src`` into the global tile of ``tensor_desc``
    at ``coord`` (a TMA bulk reduction, ``cp.reduce.async.bulk.tensor ...
    add``, asynchronous, committed as a bulk group like a TMA store): Gluon
    3.6 builds the operation but exports no function for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _bwd_program(w, KV_LEN, lists, split, Hk, GROUP, heads_per_group, Lq, Lk, CAUSAL: gl.constexpr,
                 HAS_KV_LEN: gl.constexpr, HEAVY_FIRST: gl.constexpr, SPARSE: gl.constexpr, SPLIT: gl.constexpr,
                 STEP: gl.constexpr):
    """Work index w's ``(batch, k head, key tile, kv_len, first query step,
    query steps per q head, query steps, its lists, first step, steps)``,
    the same in every partition. Its item's 128 keys are seen by
    the queries of steps (of STEP rows, 64 or 128) from the first: every one, or
    (causal) those from the tile's first key on; or (SPARSE) the steps
    of each query block whose list holds the tile, for each q head of the
    GQA group (``lists``: the transposed lists, ``(index, count, 3 index
    strides, 3 count strides)``; its lists: the group's first q head's list
    and count, as pointers, with the head strides to the next head's); none
    when the tile starts at or past kv_len (its dk and dv are 0).

    Items are (key tile, batch and k head), key tiles fastest. ``split``:
    ``(key tiles, B)``, or with SPLIT (the launch splits its last items,
    which are of equal work: dense, not causal, no key lengths) ``(key
    tiles, whole, parts, PARTIALS, B)``: work indices from ``whole`` on take
    the items from ``whole`` on in ``parts`` parts each, part k the
    item's steps ``k * steps // parts`` up to the next part's, and write
    their dk and dv to the part slot ``(item - whole) * parts + k`` for
    ``attn_bwd_parts_kernel`` to add up: the launch's
    last round split so that it ends with the others
    (``ops.attention_sm90.backward_tail_split``). HEAVY_FIRST (causal, dense):
    items taken longest first, the first key tiles of a group of heads
    before their second (``kernels.attention_common.dealt_rank``, as the
    deterministic dk/dv pass)."""
    tile, bhk = _bwd_item(w, split, Hk, heads_per_group, HEAVY_FIRST, SPLIT)
    b = bhk // Hk
    hk = bhk % Hk
    kv_len = kv_len_of(KV_LEN, b, Lk, HAS_KV_LEN)
    PER_TILE: gl.constexpr = 2 * WGMMA_ROWS // STEP  # query steps a 128-row block holds
    n_steps = gl.cdiv(Lq, STEP)
    seen = tile * 2 * WGMMA_ROWS < kv_len  # some key of the tile is within kv_len
    first_step = 0
    if CAUSAL and not SPARSE:
        first_step = gl.minimum(tile * PER_TILE, n_steps)  # query i sees keys j <= i: rows from the tile's first key
    first_step = gl.where(seen, first_step, n_steps)
    n_steps -= first_step
    total = GROUP * n_steps
    row_lists = (0, 0, 0, 0)  # dense: none
    if SPARSE:  # (causal: the listed blocks above the diagonal are masked, not skipped)
        # Only the group's first q head's list and count pointers, and the steps to the next head's, stay
        # live through the loop (with all eight list arguments live, ptxas spills set-up values inside it).
        BLOCKS, COUNTS, sbb, sbh, sbr, scb, sch, scr = lists
        first_list = BLOCKS + b * sbb + hk * GROUP * sbh + tile * sbr
        first_count = COUNTS + b * scb + hk * GROUP * sch + tile * scr
        total = 0
        for g in range(GROUP):
            total += PER_TILE * gl.load(first_count + g * sch).to(gl.int32)  # int32 or int64 lists
        total = gl.where(seen, total, 0)
        row_lists = (first_list, sbh, first_count, sch)
    first = 0
    count = total
    if SPLIT:
        _, whole, parts, _, _ = split
        part = (w - whole) % parts
        first = gl.where(w >= whole, part * total // parts, 0)
        count = gl.where(w >= whole, (part + 1) * total // parts, total) - first
    return b, hk, tile, kv_len, first_step, n_steps, total, row_lists, first, count


@gluon.jit
def _bwd_item(w, split, Hk, heads_per_group, HEAVY_FIRST: gl.constexpr, SPLIT: gl.constexpr):
    """Work index w's item as ``(key tile, batch * Hk + k head)``
    (``_bwd_program``)."""
    n_tiles = split[0]
    B = split[-1]
    item = w
    if SPLIT:
        _, whole, parts, _, _ = split
        item = gl.where(item >= whole, whole + (item - whole) // parts, item)
    if HEAVY_FIRST:
        return dealt_rank(item, n_tiles, B * Hk, heads_per_group)
    else:
        return item % n_tiles, item // n_tiles


@gluon.jit
def _bwd_work(args, SPLIT: gl.constexpr):
    """How many work indices a launch has (``args``: the partitions'
    argument tuple, ``attn_bwd_sm90_kernel``'s): its items, or with SPLIT
    the whole ones and the parts of the others (``_bwd_program``). A launch
    of that many programs gives each one; fewer programs (one per SM: the
    persistent dk/dv pass) take them round robin."""
    (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
     delta_smem, dq_args, kv_bars, ready, empty, DK, DV, KV_LEN, lists, split, H, GROUP, Lq,
     Lk, scale, heads_per_group, sdkb, sdkh, sdkl, sdvb, sdvh, sdvl) = args
    items = split[0] * split[-1] * (H // GROUP)
    if SPLIT:
        _, whole, parts, _, _ = split
        items = whole + (items - whole) * parts
    return items


@gluon.jit
def _bwd_step(i, program, GROUP, n_tiles, STAGGER: gl.constexpr, SPARSE: gl.constexpr, STEP: gl.constexpr):
    """The (q head, first query) of a program's i-th step: every q head of
    its GQA group in turn, STEP queries a step from ``first_step`` (SPARSE:
    the steps of each listed query block in turn). STAGGER
    (non-causal): each program starts at its own point of that cycle
    (spread evenly over the programs of a k head), so that they do not add
    into the same dq rows at the same time, which is faster than every
    program starting at 0 (docs/notes/attention.md). Causal programs start
    at their own diagonals, 128 queries apart, so they need no stagger."""
    b, hk, tile, _, first_step, n_steps, total, row_lists, _, _ = program
    j = i
    if STAGGER:
        j = (i + tile * total // n_tiles) % total
    if SPARSE:
        # The q head whose steps hold j: past each head whose PER_TILE * count steps j is at or past
        # (heads with an empty list pass at once; once j falls short it stays short).
        first_list, list_step, first_count, count_step = row_lists
        g = 0
        PER_TILE: gl.constexpr = 2 * WGMMA_ROWS // STEP
        for _ in range(GROUP - 1):
            steps = PER_TILE * gl.load(first_count + g * count_step).to(gl.int32)
            past = j >= steps
            j = gl.where(past, j - steps, j)
            g = gl.where(past, g + 1, g)
        block = gl.load(first_list + g * list_step + j // PER_TILE).to(gl.int32)
        return hk * GROUP + g, block * 2 * WGMMA_ROWS + (j % PER_TILE) * STEP
    else:
        return hk * GROUP + j // n_steps, (first_step + j % n_steps) * STEP


@gluon.jit
def _bwd_load_item(args, w, it, item, CAUSAL: gl.constexpr, HAS_KV_LEN: gl.constexpr, HEAVY_FIRST: gl.constexpr,
                   SPARSE: gl.constexpr, SPLIT: gl.constexpr):
    """The producer warp's part of work index w (its program's ``item``-th,
    whose steps are the ring's from ``it`` on), returning its step count:
    the item's K and V tiles (once both consumers are done with the last
    item's: ``kv_empty``), then each step's q and dO tiles and the step's
    rows of the statistics (lse, delta), every query head of the GQA group
    in turn, into the ring."""
    (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
     delta_smem, dq_args, kv_bars, ready, empty, DK, DV, KV_LEN, lists, split, H, GROUP, Lq,
     Lk, scale, heads_per_group, sdkb, sdkh, sdkl, sdvb, sdvh, sdvl) = args
    STAGES: gl.constexpr = q_smem.shape[0]
    STEP: gl.constexpr = q_smem.shape[1]
    kv_bar, kv_empty = kv_bars
    program = _bwd_program(w, KV_LEN, lists, split, H // GROUP, GROUP, heads_per_group, Lq, Lk, CAUSAL, HAS_KV_LEN,
                           HEAVY_FIRST, SPARSE, SPLIT, STEP)
    b, hk, tile, _, _, _, _, _, from_step, count = program
    mbarrier.wait(kv_empty, (item & 1) ^ 1)
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, tile * 2 * WGMMA_ROWS, 0], kv_bar, tma_box(k_smem))
    tma.async_copy_global_to_shared(v_desc, [b, hk, tile * 2 * WGMMA_ROWS, 0], kv_bar, tma_box(v_smem))
    for i in range(count):  # the item's (from_step + i)-th step, the ring's (it + i)-th
        h, m0 = _bwd_step(from_step + i, program, GROUP, split[0], not CAUSAL, SPARSE, STEP)
        stage = (it + i) % STAGES
        mbarrier.wait(empty.index(stage), (((it + i) // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(stage), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                        + lse_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], ready.index(stage), tma_box(q_smem.index(stage)))
        tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], ready.index(stage), tma_box(do_smem.index(stage)))
        tma.async_copy_global_to_shared(lse_desc, [b * H + h, m0], ready.index(stage), lse_smem.index(stage))
        tma.async_copy_global_to_shared(delta_desc, [b * H + h, m0], ready.index(stage), delta_smem.index(stage))
    return count


@gluon.jit
def _bwd_loader(args, CAUSAL: gl.constexpr, HAS_KV_LEN: gl.constexpr, HEAVY_FIRST: gl.constexpr,
                SPARSE: gl.constexpr, SPLIT: gl.constexpr, PERSISTENT: gl.constexpr):
    """The producer warp of the backward (:func:`_bwd_load_item`): its
    program's work index, or (PERSISTENT) every ``num_programs``-th from
    it, the ring running on across them."""
    if PERSISTENT:
        it = 0
        item = 0
        for w in range(gl.program_id(0), _bwd_work(args, SPLIT), gl.num_programs(0)):
            it += _bwd_load_item(args, w, it, item, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, SPLIT)
            item += 1
    else:
        _bwd_load_item(args, gl.program_id(0), 0, 0, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, SPLIT)


@gluon.jit
def _bwd_dq_step(dq_args, k_smem, dq_zero, head_row, m0, buf, i, W: gl.constexpr):
    """Consumer group W's share of one step's dQ (the five-product kernel's
    DQ): once both groups' halves of dS^T are in ``ds_smem`` (``ds_full``),
    dQ's channels ``D / 2 * W`` on = dS K over the tile's 128 keys, added
    into DQ_ACC's rows ``m0`` on of (batch, q head) row ``head_row`` by TMA
    reductions of STEP x 32 (``_DQ_PIECE`` channels each: two at D = 128, one
    at D = 64; the next step rewrites their buffers once the reductions
    have read them: a second set of buffers is no faster,
    docs/notes/attention.md)."""
    dqa_desc, ds_smem, dq_smem, ds_full = dq_args
    D: gl.constexpr = k_smem.shape[1]
    STEP: gl.constexpr = ds_smem.shape[2]
    HALF: gl.constexpr = D // 2  # this group's dQ channels, from HALF * W
    PIECES: gl.constexpr = HALF // _DQ_PIECE
    mbarrier.wait(ds_full.index(buf), (i // 2) & 1)
    ds_t = ds_smem.index(buf).permute((1, 0))  # dS: [STEP queries, 128 keys]
    first = warpgroup_mma(ds_t, k_smem.slice(HALF * W, _DQ_PIECE, dim=1), dq_zero, use_acc=False, is_async=True)
    if PIECES == 2:
        second = warpgroup_mma(ds_t, k_smem.slice(HALF * W + _DQ_PIECE, _DQ_PIECE, dim=1), dq_zero,
                               use_acc=False, is_async=True)
        first, second = warpgroup_mma_wait(0, deps=[first, second])
    else:
        first = warpgroup_mma_wait(0, deps=[first])
    tma.store_wait(0)  # the step before's reductions have read dq_smem
    gl.thread_barrier()
    dq_smem.index(PIECES * W).store(first)
    if PIECES == 2:
        dq_smem.index(PIECES * W + 1).store(second)
    fence_async_shared()
    gl.thread_barrier()
    _tma_add(dqa_desc, [head_row, m0, HALF * W], dq_smem.index(PIECES * W).reshape([1, STEP, _DQ_PIECE]))
    if PIECES == 2:
        _tma_add(dqa_desc, [head_row, m0, HALF * W + _DQ_PIECE],
                 dq_smem.index(PIECES * W + 1).reshape([1, STEP, _DQ_PIECE]))


@gluon.jit
def _bwd_consume_item(args, w, it, item, W: gl.constexpr, CAUSAL: gl.constexpr, HAS_KV_LEN: gl.constexpr,
                      HEAVY_FIRST: gl.constexpr, SPARSE: gl.constexpr, MASKED_KEYS: gl.constexpr, DQ: gl.constexpr,
                      SPLIT: gl.constexpr):
    """Consumer warp group W's part of work index w (its program's
    ``item``-th, whose steps are the ring's from ``it`` on), returning its
    step count: keys ``64 W`` to ``64 W + 63`` of
    the item's tile, through every step of STEP queries (64; 128 at D = 64, dense). S^T and dP^T (64
    keys x STEP queries) issued together; P^T and dS^T from them, in registers,
    the A operands of dV += P^T dO and dK += dS^T Q; with DQ, dS^T into this
    group's half of a shared [128 keys, STEP queries] tile and its share of
    dQ (``_bwd_dq_step``). Masks: keys past
    kv_len (MASKED_KEYS: the tile may hold some) and, causal, keys past the
    query on the steps that cross the diagonal (two of 64 queries, one of
    128; block lists may add steps above it, masked whole)."""
    (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
     delta_smem, dq_args, kv_bars, ready, empty, DK, DV, KV_LEN, lists, split, H, GROUP, Lq,
     Lk, scale, heads_per_group, sdkb, sdkh, sdkl, sdvb, sdvh, sdvl) = args
    STAGES: gl.constexpr = q_smem.shape[0]
    STEP: gl.constexpr = q_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, STEP, 16])
    d_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
    k_rows = k_smem.slice(WGMMA_ROWS * W, WGMMA_ROWS)
    v_rows = v_smem.slice(WGMMA_ROWS * W, WGMMA_ROWS)
    qk_scale = scale * LOG2E
    s_zero = gl.zeros([WGMMA_ROWS, STEP], gl.float32, s_layout)
    if DQ:  # the dQ products' (unused) accumulator: _bwd_dq_step's products start from zero
        piece_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, _DQ_PIECE, 16])
        dq_zero = gl.zeros([STEP, _DQ_PIECE], gl.float32, piece_layout)
    step_query = gl.arange(0, STEP, layout=gl.SliceLayout(0, s_layout))
    kv_bar, kv_empty = kv_bars
    program = _bwd_program(w, KV_LEN, lists, split, H // GROUP, GROUP, heads_per_group, Lq, Lk, CAUSAL,
                           HAS_KV_LEN, HEAVY_FIRST, SPARSE, SPLIT, STEP)
    b, hk, tile, kv_len, _, _, _, _, from_step, count = program
    dk = gl.zeros([WGMMA_ROWS, D], gl.float32, d_layout)
    dv = gl.zeros([WGMMA_ROWS, D], gl.float32, d_layout)
    first_key = tile * 2 * WGMMA_ROWS + WGMMA_ROWS * W
    key = first_key + gl.arange(0, WGMMA_ROWS, layout=gl.SliceLayout(1, s_layout))
    if MASKED_KEYS and STEP > WGMMA_ROWS:  # (below: masked keys with 128-query steps)
        key_bias = gl.where(key < kv_len, 0.0, float("-inf"))
    mbarrier.wait(kv_bar, item & 1)
    for i in range(count):
        h, m0 = _bwd_step(from_step + i, program, GROUP, split[0], not CAUSAL, SPARSE, STEP)
        c = it + i  # the ring's step
        stage = c % STAGES
        mbarrier.wait(ready.index(stage), (c // STAGES) & 1)
        qs = q_smem.index(stage)
        dos = do_smem.index(stage)
        s_token = warpgroup_mma(k_rows, qs.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_token = warpgroup_mma(v_rows, dos.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=[s_token])
        # The step's statistics as [1, STEP] rows in the scores' layout, read as late as they are needed
        # (registers): lse is +inf past Lq and for rows that saw no key, so that their P is 0.
        lse2 = lse_smem.index(stage).load(s_layout) * LOG2E
        if MASKED_KEYS and STEP > WGMMA_ROWS:
            # Masked keys (past kv_len, where they read as zeros past Lk) give scores, not probabilities
            # of 0: with 128-query steps, a -inf bias of theirs (exp2 gives 0; lse is +inf past Lq:
            # still -inf), since the branch below makes ptxas spill P in the loop.
            p = gl.exp2(st * qk_scale + (key_bias[:, None] - lse2))
        else:
            p = gl.exp2(st * qk_scale - lse2)
        # With 64-query steps, their P rows are set to 0 on the steps and in the groups that hold some.
        if MASKED_KEYS and STEP == WGMMA_ROWS:
            if first_key + WGMMA_ROWS > kv_len:
                p = gl.where(key[:, None] < kv_len, p, 0.0)
        if CAUSAL:  # and keys past the query, on the steps that cross this group's diagonal (or above it)
            if m0 < first_key + WGMMA_ROWS:
                p = gl.where(key[:, None] <= (m0 + step_query)[None, :], p, 0.0)
        if STEP > WGMMA_ROWS:
            # 128-query steps (D = 64): dV += P^T dO waits for dS, so that P's 16-bit operand is not live
            # beside P, dP and dS (64 + 64 + 32 + 32 registers past dK and dV: ptxas would spill in the loop).
            dp = warpgroup_mma_wait(0, deps=[dp_token])
            ds = (p * (dp - delta_smem.index(stage).load(s_layout))).to(q_smem.dtype)
            p_op = gl.convert_layout(p.to(q_smem.dtype), op_layout)
            dv_token = warpgroup_mma(p_op, dos, dv, is_async=True)
        else:
            p_op = gl.convert_layout(p.to(q_smem.dtype), op_layout)
            dv_token = warpgroup_mma(p_op, dos, dv, is_async=True)
            dp = warpgroup_mma_wait(1, deps=[dp_token])
            ds = (p * (dp - delta_smem.index(stage).load(s_layout))).to(q_smem.dtype)
        ds_op = gl.convert_layout(ds, op_layout)
        dk_token = warpgroup_mma(ds_op, qs, dk, is_async=True)
        buf = c % 2  # ds_smem's buffer: the other one may still be read by the other group's dQ product
        if DQ:
            dq_args[1].index(buf).slice(WGMMA_ROWS * W, WGMMA_ROWS).store(ds)  # (dqa_desc, ds_smem, dq_smem, ds_full)
            fence_async_shared()
            mbarrier.arrive(dq_args[3].index(buf), count=1)
        dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=[dv_token, dk_token, p_op, ds_op])
        mbarrier.arrive(empty.index(stage), count=1)  # this step's q, dO and statistics are done with
        if DQ:
            _bwd_dq_step(dq_args, k_smem, dq_zero, b * H + h, m0, buf, c, W)
    mbarrier.arrive(kv_empty, count=1)  # every product that reads this item's K and V is done
    if DQ:
        tma.store_wait(0)  # shared memory must outlive the reductions that read it
    # dK = scale dS^T Q; dV = P^T dO.
    keys = first_key + gl.arange(0, WGMMA_ROWS, layout=gl.SliceLayout(1, d_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, d_layout))
    stored = (keys < Lk)[:, None]
    if SPLIT:  # a part of an item, or a whole one
        _, whole, _, PARTIALS, _ = split
        slot = w - whole
        # A part's fp32 sums go to its slot of PARTIALS, [dk | dv] x [128 keys, D]; a whole item's to DK, DV.
        at = ((WGMMA_ROWS * W + gl.arange(0, WGMMA_ROWS, layout=gl.SliceLayout(1, d_layout)))[:, None] * D
              + cols[None, :])
        own = PARTIALS + gl.maximum(slot, 0).to(gl.int64) * (2 * 2 * WGMMA_ROWS * D) + at
        gl.store(own, dk * scale, mask=slot >= 0)
        gl.store(own + 2 * WGMMA_ROWS * D, dv, mask=slot >= 0)
        stored = stored & (slot < 0)
    keys = keys.to(gl.int64)[:, None]
    gl.store(DK + b.to(gl.int64) * sdkb + hk.to(gl.int64) * sdkh + keys * sdkl + cols[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=stored)
    gl.store(DV + b.to(gl.int64) * sdvb + hk.to(gl.int64) * sdvh + keys * sdvl + cols[None, :],
             dv.to(DV.dtype.element_ty), mask=stored)
    return count


@gluon.jit
def _bwd_consumer(args, W: gl.constexpr, CAUSAL: gl.constexpr, HAS_KV_LEN: gl.constexpr, HEAVY_FIRST: gl.constexpr,
                  SPARSE: gl.constexpr, MASKED_KEYS: gl.constexpr, DQ: gl.constexpr, SPLIT: gl.constexpr,
                  PERSISTENT: gl.constexpr):
    """Consumer warp group W of the backward (:func:`_bwd_consume_item`):
    its program's work index, or (PERSISTENT) every ``num_programs``-th
    from it, with the ring running on across them."""
    if PERSISTENT:
        it = 0
        item = 0
        for w in range(gl.program_id(0), _bwd_work(args, SPLIT), gl.num_programs(0)):
            it += _bwd_consume_item(args, w, it, item, W, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, MASKED_KEYS, DQ,
                                    SPLIT)
            item += 1
    else:
        _bwd_consume_item(args, gl.program_id(0), 0, 0, W, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, MASKED_KEYS, DQ,
                          SPLIT)


@gluon.jit
def _bwd_consumer_low(args, CAUSAL: gl.constexpr, HAS_KV_LEN: gl.constexpr, HEAVY_FIRST: gl.constexpr,
                      SPARSE: gl.constexpr, MASKED_KEYS: gl.constexpr, DQ: gl.constexpr, SPLIT: gl.constexpr,
                      PERSISTENT: gl.constexpr):
    _bwd_consumer(args, 0, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, MASKED_KEYS, DQ, SPLIT, PERSISTENT)


@gluon.jit
def _bwd_consumer_high(args, CAUSAL: gl.constexpr, HAS_KV_LEN: gl.constexpr, HEAVY_FIRST: gl.constexpr,
                       SPARSE: gl.constexpr, MASKED_KEYS: gl.constexpr, DQ: gl.constexpr, SPLIT: gl.constexpr,
                       PERSISTENT: gl.constexpr):
    _bwd_consumer(args, 1, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, MASKED_KEYS, DQ, SPLIT, PERSISTENT)


@gluon.jit
def attn_bwd_sm90_kernel(Q, K, V, DO, LSE_ROWS, DELTA, DQ_ACC, DK, DV, PARTIALS, KV_LEN, BLOCKS, COUNTS, sqb, sqh,
                         sql, skb, skh, skl, svb, svh, svl, sdb, sdh, sdl, sdkb, sdkh, sdkl, sdvb, sdvh, sdvl, sbb, sbh,
                         sbr, scb, sch, scr, stats_row, B, H, GROUP, Lq, Lk, scale, heads_per_group, whole, parts,
                         D: gl.constexpr, STEP: gl.constexpr,
                         STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, CAUSAL: gl.constexpr,
                         HAS_KV_LEN: gl.constexpr, HEAVY_FIRST: gl.constexpr, SPARSE: gl.constexpr,
                         MASKED_KEYS: gl.constexpr, DQ: gl.constexpr, SPLIT: gl.constexpr,
                         PERSISTENT: gl.constexpr, num_warps: gl.constexpr):
    """The attention backward in five products a (key tile, query step): dK
    and dV of 128 keys of one (batch, k head) per program, and (DQ) dQ added
    into DQ_ACC by TMA reductions in whatever order the programs run (not
    bit for bit the same from run to run; ``ops.attention_sm90`` takes it only
    when asked: ``ATOMIC_DQ``). Without DQ, four products: dK and dV alone,
    in the same order on every run (the deterministic backward's dk/dv pass
    on sm_90; DQ_ACC unused). Dense or (SPARSE) block-sparse: BLOCKS ``[B, H,
    cdiv(Lk, 128), W]`` / COUNTS ``[B, H, cdiv(Lk, 128)]`` int32 or int64 are
    the transposed lists (per q head and key block, the ascending query
    blocks that list it; strides ``sbb, sbh, sbr`` / ``scb, sch, scr``);
    causal or not (CAUSAL: query i sees keys j <= i), with key lengths or
    not (HAS_KV_LEN: KV_LEN ``[B]``, keys past ``KV_LEN[b]`` ignored); any
    Lq (LSE_ROWS is +inf past it and for rows that see no key) and Lk.
    MASKED_KEYS: a tile may hold keys past kv_len (Lk is not a multiple of
    128, or key lengths are given), which are masked. HEAVY_FIRST with
    ``heads_per_group``: dense causal programs longest first
    (``ops.attention_tiles.causal_order``).

    Q, DO ``[B, H, Lq, D]`` and K, V, DK, DV ``[B, H / GROUP, Lk, D]`` 16-bit,
    any layout through the (batch, head, position) strides, a unit stride
    along D, TMA-aligned (Q, K, V, DO); LSE_ROWS and DELTA ``[B * H,
    stats_row]`` fp32 (``attn_bwd_row_stats_kernel``'s padded rows); DQ_ACC
    ``[B * H, stats_row, D]`` fp32, zeroed, receives dS K (dq less its
    scale) with DQ. Items are (key tile, batch and k head), ``cdiv(Lk, 128) * B * H /
    GROUP`` of them: the first ``whole`` one program each, the others
    ``parts`` programs each (``_bwd_program``), whose dk and dv go to
    PARTIALS ``[items - whole, parts, 2, 128, D]`` fp32 for
    ``kernels.attention_backward.attn_bwd_parts_kernel`` (SPLIT: dense, not causal,
    no key lengths; else every item is whole, and ``whole``, ``parts`` and
    PARTIALS are unused).
    STEP: the query rows of a step, 64, or 128 at D = 64 without block
    lists (``ops.attention_sm90.backward_step``). PERSISTENT (without DQ, dense,
    not causal): fewer programs than work indices, each taking every
    ``num_programs``-th (one per SM: the descriptors the kernel builds on
    the device take 768 bytes of scratch per program).
    Launch ``whole + (items - whole) * parts`` programs (or fewer, PERSISTENT) with ``num_warps=4``
    and ``maxnreg=168`` (the forward core's budgets: CONSUMER_REGS for both
    consumer groups, 24 for the loader)."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warp group")
    gl.static_assert((D == 64) or (D == 128), "D = 64 or 128 (ops.attention_sm90.takes_sm90_backward)")
    # A consumer's S^T and dP^T are 64 keys x STEP queries: 128-query steps fit its registers beside dK and
    # dV at D = 64 (32 registers each), not at D = 128 (64 each), nor with block lists (ptxas spills in the
    # step loop).
    gl.static_assert((STEP == 64) or ((STEP == 128) and (D == 64) and not SPARSE),
                     "64-query steps, or 128 at D = 64, dense")
    gl.static_assert(not (SPLIT and (CAUSAL or HAS_KV_LEN or SPARSE)), "only items of equal work are split")
    gl.static_assert(not (PERSISTENT and (DQ or CAUSAL or SPARSE)), "the dense, non-causal dk/dv pass persists")
    box: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    matrix: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    stats: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    piece: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    pieces: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=3)
    Hk = H // GROUP
    q_desc = tma.make_tensor_descriptor(Q, [B, H, Lq, D], [sqb, sqh, sql, 1], [1, 1, STEP, D], box)
    do_desc = tma.make_tensor_descriptor(DO, [B, H, Lq, D], [sdb, sdh, sdl, 1], [1, 1, STEP, D], box)
    k_desc = tma.make_tensor_descriptor(K, [B, Hk, Lk, D], [skb, skh, skl, 1], [1, 1, 2 * WGMMA_ROWS, D], box)
    v_desc = tma.make_tensor_descriptor(V, [B, Hk, Lk, D], [svb, svh, svl, 1], [1, 1, 2 * WGMMA_ROWS, D], box)
    lse_desc = tma.make_tensor_descriptor(LSE_ROWS, [B * H, stats_row], [stats_row, 1], [1, STEP], stats)
    delta_desc = tma.make_tensor_descriptor(DELTA, [B * H, stats_row], [stats_row, 1], [1, STEP], stats)
    # Shared memory, 198 KB at D = 128 (2 stages of 64 queries): K and V 64 KB, q and dO 32 KB a stage, dS^T
    # twice 16 KB, dQ 32 KB; at D = 64 with 128-query steps, 194 KB: K and V 32 KB, q and dO 32 KB a stage,
    # dS^T twice 32 KB, dQ 32 KB. Without DQ, no dS^T and dQ buffers: 134 KB at D = 128.
    k_smem = gl.allocate_shared_memory(K.dtype.element_ty, [2 * WGMMA_ROWS, D], matrix)
    v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [2 * WGMMA_ROWS, D], matrix)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, STEP, D], matrix)
    do_smem = gl.allocate_shared_memory(DO.dtype.element_ty, [STAGES, STEP, D], matrix)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, STEP], stats)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, STEP], stats)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(kv_empty, count=2)  # released by both consumers
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # released by both consumers
    # dQ's descriptor and buffers only where the partitions read them (Triton 3.6's lowering fails on a
    # partition argument that no partition reads).
    if DQ:
        dqa_desc = tma.make_tensor_descriptor(DQ_ACC, [B * H, stats_row, D], [stats_row * D, D, 1],
                                              [1, STEP, _DQ_PIECE], pieces)
        ds_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2, 2 * WGMMA_ROWS, STEP], matrix)
        dq_smem = gl.allocate_shared_memory(gl.float32, [D // _DQ_PIECE, STEP, _DQ_PIECE], piece)  # D / 64 a group
        ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2):
            mbarrier.init(ds_full.index(s), count=2)  # both halves of dS^T written
        dq_args = (dqa_desc, ds_smem, dq_smem, ds_full)
    else:
        dq_args = ()
    # (key tiles, [whole, parts, PARTIALS,] B): the split's arguments only where the partitions read them
    # (Triton 3.6's lowering fails on a partition argument that no partition reads).
    if SPLIT:
        split = (gl.cdiv(Lk, 2 * WGMMA_ROWS), whole, parts, PARTIALS, B)
    else:
        split = (gl.cdiv(Lk, 2 * WGMMA_ROWS), B)
    args = (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
            delta_smem, dq_args, (kv_bar, kv_empty), ready, empty, DK, DV, KV_LEN,
            (BLOCKS, COUNTS, sbb, sbh, sbr, scb, sch, scr), split, H, GROUP, Lq, Lk, scale, heads_per_group, sdkb, sdkh,
            sdkl, sdvb, sdvh, sdvl)
    gl.warp_specialize(
        [(_bwd_consumer_low, (args, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, MASKED_KEYS, DQ, SPLIT, PERSISTENT)),
         (_bwd_consumer_high, (args, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, MASKED_KEYS, DQ, SPLIT, PERSISTENT)),
         (_bwd_loader, (args, CAUSAL, HAS_KV_LEN, HEAVY_FIRST, SPARSE, SPLIT, PERSISTENT))], [4, 1],
        [CONSUMER_REGS, 24])
