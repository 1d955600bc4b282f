"""Which work the programs of the Hopper (sm_90) attention backward
(``kernels/attention_sm90_backward.py``) do, the same in every partition: a
work index's item (key tile, batch and k head), its query steps (every q head
of the GQA group in turn, from the causal diagonal or the transposed block
lists), and with a split last round the part of the item's steps it takes.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from compile_ops.kernels.attention_common import dealt_rank, kv_len_of
from compile_ops.kernels.attention_sm90_common import WGMMA_ROWS


@gluon.jit
def bwd_program(
    w,
    KV_LEN,
    lists,
    split,
    Hk,
    GROUP,
    heads_per_group,
    Lq,
    Lk,
    CAUSAL: gl.constexpr,
    HAS_KV_LEN: gl.constexpr,
    HEAVY_FIRST: gl.constexpr,
    SPARSE: gl.constexpr,
    SPLIT: gl.constexpr,
    STEP: gl.constexpr,
):
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
    (``bwd_program``)."""
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
def bwd_work(args, SPLIT: gl.constexpr):
    """How many work indices a launch has (``args``: the partitions'
    argument tuple, ``attn_bwd_sm90_kernel``'s): its items, or with SPLIT
    the whole ones and the parts of the others (``bwd_program``). A launch
    of that many programs gives each one; fewer programs (one per SM: the
    persistent dk/dv pass) take them round robin."""
    (
        q_desc,
        k_desc,
        v_desc,
        do_desc,
        lse_desc,
        delta_desc,
        k_smem,
        v_smem,
        q_smem,
        do_smem,
        lse_smem,
        delta_smem,
        dq_args,
        kv_bars,
        ready,
        empty,
        DK,
        DV,
        KV_LEN,
        lists,
        split,
        H,
        GROUP,
        Lq,
        Lk,
        scale,
        heads_per_group,
        sdkb,
        sdkh,
        sdkl,
        sdvb,
        sdvh,
        sdvl,
    ) = args
    items = split[0] * split[-1] * (H // GROUP)
    if SPLIT:
        _, whole, parts, _, _ = split
        items = whole + (items - whole) * parts
    return items


@gluon.jit
def bwd_step(i, program, GROUP, n_tiles, STAGGER: gl.constexpr, SPARSE: gl.constexpr, STEP: gl.constexpr):
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
