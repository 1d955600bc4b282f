"""The sm_90 Gluon kernels' side of the attention launchers: which calls run
the warp-specialized forward core (:func:`takes_sm90_core`), block-sparse
8-bit attention's forward (:func:`takes_sm90_8bit`) and the five-product
backward (:func:`takes_sm90_backward`, :func:`takes_sm90_dkdv`), how they
are launched, and the opaque ``fused_gluon`` ops traced calls reach them
through."""

import functools
import heapq
import math
from typing import Optional

import torch
import triton
from torch import Tensor

from compile_ops import meta, reference
from compile_ops._library import building_aot_package, has_wgmma, multiprocessor_count, on_eager_fast_path
from compile_ops.kernels.attention_backward import attn_bwd_parts_kernel
from compile_ops.kernels.attention_sm90 import attn_fwd_sm90_kernel
from compile_ops.kernels.attention_sm90_backward import attn_bwd_sm90_kernel
from compile_ops.ops.attention_args import AttentionSizes, bhl_strides, block_list_args, tma_ready, tma_scratch
from compile_ops.ops.attention_tiles import LAUNCH_ORDER, Tiles, causal_order, forward_tiles

#: The sm_90 core's launch: the default partition is one consumer warp group
#: (4 warps; the kernel adds 4 + 1), ``maxnreg`` 168 bounds 3 warp groups at
#: 64K registers, which the partitions split 240 / 240 / 24.
SM90_CORE_LAUNCH = dict(num_warps=4, maxnreg=168)
SM90_CORE_CONSUMER_REGS = 240


def can_run_gluon(q: Tensor) -> bool:
    """Whether a call on ``q`` may run a Gluon kernel (the sm_90 core, the
    five-product backward): an sm_90 GPU, in an eager call or a trace whose
    opaque op Python runs (an AOTInductor package runs from C++ without
    Python, so it gets the Triton kernels, which it compiles in)."""
    return has_wgmma(q) and (on_eager_fast_path() or not building_aot_package())


def takes_sm90_core(
    t: Tiles,
    sizes: AttentionSizes,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_dim: int,
    v_seq_dim: int,
    blocks: Optional[tuple],
    rounds_q: bool,
    fp8_rows: Optional[tuple],
) -> bool:
    """Whether a forward runs on the sm_90 core: its tiles chose it, and the
    call is one the core computes (at least one key, TMA-aligned q, k and
    v; dense or block-sparse, causal or not, with key lengths or not; 8-bit
    with q given in int8, not ``rounds_q``, and a 16-bit output); the rest
    stays on ``attn_fwd_kernel``. Its 256-key tiles
    (D = 64) are not a listed block, and only dense non-causal calls over
    whole tiles without key lengths run ahead of the portable kernel with
    them; ragged, causal and key-length calls run behind it
    (docs/notes/attention.md)."""
    eight_bit_ok = not rounds_q and fp8_rows is None
    wide_ok = t.block_n == meta.attention.SPARSE_BLOCK or (
        blocks is None and not sizes.causal and not sizes.has_kv_len and sizes.lk % t.block_n == 0
    )
    return (
        t.sm90_core
        and eight_bit_ok
        and wide_ok
        and sizes.lk > 0
        and tma_ready(seq_dim, q, k)
        and tma_ready(v_seq_dim, v)
        and not _broadcast(seq_dim, q, k)
        and not _broadcast(v_seq_dim, v)
    )


#: Block-sparse 8-bit attention's forward on sm_90 (kernels/attention_sm90_8bit.py): K/V buffers, and
#: the launch: one warp group a program, ``maxnreg`` 168 for three programs an SM.
SM90_8BIT_STAGES = 2
SM90_8BIT_LAUNCH = dict(num_warps=4, maxnreg=168)


def takes_sm90_8bit(
    sizes: AttentionSizes,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_dim: int,
    blocks: Optional[tuple],
    rounds_q: bool,
    pv_fp8: bool,
) -> bool:
    """Whether an 8-bit forward runs on ``attn8_fwd_sm90_kernel``: a Gluon
    GPU, dense or block lists at least one entry wide, FP8 P V (q given in
    int8, or 16-bit and rounded by the kernel: ``rounds_q``), neither causal
    nor key lengths, at least one key, D = 128, TMA-aligned k and transposed
    v (``[B, Hk, D, Lk16]``) and, given in int8, q; no broadcast strides. The
    rest stays on ``attn_fwd_kernel``."""
    return (
        can_run_gluon(q)
        and (blocks is None or blocks[0].shape[-1] > 0)
        and pv_fp8
        and not sizes.causal
        and not sizes.has_kv_len
        and sizes.lk > 0
        and int(sizes.d) == 128
        and tma_ready(seq_dim, k)
        and (rounds_q or tma_ready(seq_dim, q))
        and tma_ready(2, v)
        and not _broadcast(seq_dim, q, k)
        and not _broadcast(2, v)
    )


def launch_sm90_8bit(
    kernel,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    seq_dim: int,
    blocks: Optional[tuple],
    q_scale: Optional[Tensor],
    k_scale: Tensor,
    v_scale: Tensor,
    fp8_rows: Optional[tuple] = None,
    tokens: Optional[Tensor] = None,
) -> None:
    """Launch ``attn8_fwd_sm90_kernel`` (``kernel``: it, or the launch-plan
    recorder's proxy of it) on ``launch_forward``'s arguments that
    :func:`takes_sm90_8bit` accepted: ``blocks`` the lists or None (dense),
    ``q_scale`` None for a 16-bit q the kernel rounds, ``fp8_rows``
    ``(row_scale [B], out_scale [B, Lq])`` (out e4m3 ``[B, Lq, H, D]``),
    ``tokens`` ``[Lq]`` its token order (``attn_fwd_kernel``'s SPARSE,
    QUANTIZE_Q, OUT_FP8 and SCATTER)."""
    b, h, lq, d = meta.attention.dims(q, seq_dim)
    hk, lk = meta.attention.dims(k, seq_dim)[1:3]
    row_scale, out_scale = fp8_rows if fp8_rows is not None else (None, None)
    triton.set_allocator(tma_scratch)  # the kernel builds its TMA descriptors on the device
    kernel[(triton.cdiv(lq, 64), b * h)](
        q,
        k,
        v,
        out,
        lse,
        *block_list_args(blocks)[:2],
        q_scale,
        k_scale,
        v_scale,
        row_scale,
        out_scale,
        tokens,
        *bhl_strides(q, seq_dim),
        *bhl_strides(k, seq_dim),
        *bhl_strides(v, 2),
        *bhl_strides(out, 1 if fp8_rows is not None else seq_dim),
        *block_list_args(blocks)[2:],
        b,
        h,
        h // hk,
        lq,
        lk,
        float(scale),
        D=d,
        STAGES=SM90_8BIT_STAGES,
        SPARSE=blocks is not None,
        QUANTIZE_Q=q_scale is None,
        SCATTER=tokens is not None,
        OUT_FP8=fp8_rows is not None,
        **SM90_8BIT_LAUNCH,
    )


def _broadcast(seq_dim: int, *tensors: Tensor) -> bool:
    """Whether a batch, head or position of more than one element has stride
    0 (an expanded tensor): the core's TMA descriptors span whole 4-D
    tensors, and a zero stride is not one a descriptor is specified for."""
    for t in tensors:
        sizes = meta.attention.dims(t, seq_dim)[:3]
        if any(stride == 0 and size > 1 for stride, size in zip(bhl_strides(t, seq_dim), sizes)):
            return True
    return False


def _core_programs(q: Tensor, items, causal: bool, sparse: bool):
    """The sm_90 core's grid. Dense (with key lengths or not): one program
    per SM, each looping over its share of the work items with its loader
    running ahead into the next item's q and keys (faster than one program
    per item). Causal and block-sparse items differ in work: one program
    per item, which the GPU deals out as SMs free up (a static round robin
    of them is slower; docs/notes/attention.md)."""
    if causal or sparse:
        return items
    return min(items, multiprocessor_count(q))  # real tensors only: the opaque op or the eager path


def launch_sm90_core(
    kernel,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool,
    seq_dim: int,
    kv_lengths: Optional[Tensor] = None,
    block_index: Optional[Tensor] = None,
    block_count: Optional[Tensor] = None,
    q_scale: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
) -> None:
    """Launch the sm_90 core (``kernel``: it, or the launch-plan recorder's
    proxy of it) on arguments :func:`takes_sm90_core` accepted: its work
    items in ``attn_fwd_kernel``'s program order, on the grid
    :func:`_core_programs` picks; ``block_index`` and
    ``block_count``: block-sparse attention's lists (``launch_forward``'s
    ``blocks``); the scales (all three, or none): its INT8_FP8 mode, on
    ``launch_forward``'s 8-bit operands."""
    b, h, lq, d = meta.attention.dims(q, seq_dim)
    hk, lk = meta.attention.dims(k, seq_dim)[1:3]
    int8_fp8 = v_scale is not None
    t = forward_tiles(d, out.dtype, True, "int8_fp8" if int8_fp8 else "exact", True)
    assert not int8_fp8 or t.block_n == reference.attention.INT8_KEY_BLOCK, t  # one k scale per key tile
    sparse = block_index is not None
    assert not sparse or t.block_n == t.block_m == meta.attention.SPARSE_BLOCK, t  # a tile is a listed block
    items = triton.cdiv(lq, t.block_m) * b * h
    order, group = causal_order(k, lk, b * h) if causal and not sparse else LAUNCH_ORDER
    triton.set_allocator(tma_scratch)  # the core builds its TMA descriptors on the device
    kernel[(_core_programs(q, items, causal, sparse),)](
        q,
        k,
        v,
        out,
        lse,
        kv_lengths,
        block_index,
        block_count,
        q_scale,
        k_scale,
        v_scale,
        *bhl_strides(q, seq_dim),
        *bhl_strides(k, seq_dim),
        *bhl_strides(v, 2 if int8_fp8 else seq_dim),
        *bhl_strides(out, seq_dim),
        *block_list_args((block_index, block_count) if sparse else None)[2:],
        b * h,
        h,
        h // hk,
        lq,
        lk,
        float(scale),
        group,
        D=d,
        BLOCK_N=t.block_n,
        STAGES=t.num_stages,
        CONSUMER_REGS=SM90_CORE_CONSUMER_REGS,
        INT8_FP8=int8_fp8,
        CAUSAL=causal,
        HAS_KV_LEN=kv_lengths is not None,
        SPARSE=sparse,
        **order,
        **SM90_CORE_LAUNCH,
    )


@torch.library.custom_op("fused_gluon::attention_forward_sm90_", mutates_args=("out", "lse"))
def _attention_forward_sm90(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool,
    seq_dim: int,
    kv_lengths: Optional[Tensor] = None,
    block_index: Optional[Tensor] = None,
    block_count: Optional[Tensor] = None,
    q_scale: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
) -> None:
    """The sm_90 core as an op of its own, for traced calls (torch.compile,
    export, the dispatcher's eager path): Inductor cannot trace a Gluon
    kernel the way it inlines ``wrap_triton`` launches, so a compiled graph
    calls this op, which fills ``out`` and ``lse`` in place. In a namespace
    of its own: not a public op (no sharding rule, no registry row); the
    ``fused`` ops that call it have those."""
    launch_sm90_core(
        attn_fwd_sm90_kernel,
        q,
        k,
        v,
        out,
        lse,
        scale,
        causal,
        seq_dim,
        kv_lengths,
        block_index,
        block_count,
        q_scale,
        k_scale,
        v_scale,
    )


@_attention_forward_sm90.register_fake
def _(
    q,
    k,
    v,
    out,
    lse,
    scale,
    causal,
    seq_dim,
    kv_lengths=None,
    block_index=None,
    block_count=None,
    q_scale=None,
    k_scale=None,
    v_scale=None,
):
    return None


#: The backward's dq by atomic-order sums (``compile_ops.set_attention_backward(deterministic=False)``):
#: the five-product sm_90 backward (``attn_bwd_sm90_kernel``) for the calls
#: :func:`takes_sm90_backward` accepts. Off by default: dq then differs from
#: run to run in its last bits (dk and dv do not), and the default backward is
#: bit-identical across runs; the option is faster (docs/notes/attention.md).
#: ``torch.use_deterministic_algorithms(True)`` turns it off again. Read when a
#: call is made, or traced: set it before compiling.
ATOMIC_DQ = False
#: The five-product backward's q/dO ring: 198 KB of shared memory at 2 stages at D = 128, where a third
#: does not fit; at D = 64 more stages are no faster (docs/notes/attention.md).
SM90_BACKWARD_STAGES = 2
#: The head dimensions the five-product backward computes (one or two 32-channel dQ pieces a consumer).
SM90_BACKWARD_HEAD_DIMS = (64, 128)
#: ``attn_bwd_sm90_kernel``'s query rows a step of dense calls, by head dim: at D = 64 a consumer's dK and
#: dV take 32 registers each, which leaves room for 64 x 128 score tiles (FlashAttention-3's hdim-64
#: backward also takes 128-query blocks); at D = 128, 64. Block lists take 64 (:func:`backward_step`).
SM90_BACKWARD_STEPS = {64: 128, 128: 64}


def backward_step(d: int, sparse: bool) -> int:
    """``attn_bwd_sm90_kernel``'s query rows a step at head dim ``d``: :data:`SM90_BACKWARD_STEPS`, or
    64 over block lists (a 128-query step there spills in the step loop)."""
    return 64 if sparse else SM90_BACKWARD_STEPS[d]


def sm90_backward_computes(
    sizes: AttentionSizes, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, seq_dim: int
) -> bool:
    """Whether ``attn_bwd_sm90_kernel`` computes a backward: on an sm_90 GPU
    where a traced call can hold its opaque op (:func:`can_run_gluon`), dense or
    block-sparse, causal or not, key lengths or not, 16-bit (q, k, v and dO
    alike), D = 64 or 128, at least one key, TMA-aligned q, k, v and dO with
    no broadcast strides."""
    tensors = (q, k, v, grad_out)
    return (
        can_run_gluon(q)
        and q.dtype in (torch.float16, torch.bfloat16)
        and all(t.dtype == q.dtype for t in tensors)
        and sizes.d in SM90_BACKWARD_HEAD_DIMS
        and sizes.lk > 0
        and tma_ready(seq_dim, *tensors)
        and not _broadcast(seq_dim, *tensors)
    )


def takes_sm90_backward(sizes: AttentionSizes, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, seq_dim: int) -> bool:
    """Whether a backward runs on the five-product sm_90 kernel: asked for
    (:data:`ATOMIC_DQ`, and torch's deterministic algorithms not asked
    for), on a call it computes (:func:`sm90_backward_computes`)."""
    return (
        ATOMIC_DQ
        and not torch.are_deterministic_algorithms_enabled()
        and sm90_backward_computes(sizes, q, k, v, grad_out, seq_dim)
    )


#: The deterministic backward's dk/dv pass on sm_90: ``attn_bwd_sm90_kernel`` without dQ (four products,
#: warp-specialized; bit for bit the same on every run) for the dense calls it computes, in place of
#: ``attn_bwd_dkdv_kernel``, where it is faster than the ``triton.language`` pass (docs/notes/attention.md).
#: Its last round is never split (its memory, :func:`launch_sm90_backward`). Block-sparse calls keep the
#: ``triton.language`` pass.
SM90_DKDV = True
#: That pass dense and not causal, persistent: one program per SM walks its share of the key tiles, its
#: loader fetching the next tile's K and V once both consumers are done with the last one's and its q/dO
#: ring running on across tiles. Why: the kernel builds its six TMA descriptors on the device, 128 bytes
#: each in scratch memory per program, which one program per key tile would add to the backward's peak
#: memory; one per SM does not, and is faster too (docs/notes/attention.md). Causal items differ in work
#: and keep one program each, as in the forward (:func:`_core_programs`).
SM90_DKDV_PERSISTENT = True


def takes_sm90_dkdv(
    sizes: AttentionSizes, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, seq_dim: int, sparse: bool
) -> bool:
    """Whether the deterministic backward's dk/dv pass runs on
    ``attn_bwd_sm90_kernel`` without dQ: :data:`SM90_DKDV`, a dense call,
    one the kernel computes (:func:`sm90_backward_computes`)."""
    return SM90_DKDV and not sparse and sm90_backward_computes(sizes, q, k, v, grad_out, seq_dim)


#: What a part of an item costs the five-product backward beyond its share of the item's steps, as a
#: fraction of a whole item: its K and V loads, its pipeline's fill and its fp32 dk/dv (the model
#: :func:`backward_tail_split` plans with).
PART_OVERHEAD = 0.03
#: The least modelled gain, as a fraction of the launch's rounds, for which the backward splits its last
#: items: below it the parts cost more than the model says (docs/notes/attention.md).
TAIL_SPLIT_GAIN = 0.04


@functools.lru_cache(maxsize=256)
def backward_tail_split(items: int, sms: int, steps: int) -> tuple[int, int]:
    """``(whole, parts)`` for the five-product backward's ``items`` (key
    tiles of equal work, ``steps`` query steps each) on ``sms`` SMs: the
    first ``whole`` items one program each, the rest ``parts`` programs
    each, so that the launch's last round does not leave SMs idle: 864
    items (1x24x4608 at D = 128) fill 6 rounds of 132 and leave 72 alone in
    a seventh. Programs run in launch order as SMs free up; modelled so (a
    whole item takes 1, a part ``1 / parts +`` :data:`PART_OVERHEAD`), the
    split items are the last leftover (``items % sms``) or the leftover and
    one round more, in 2-8 parts, whichever ends soonest, if that is
    :data:`TAIL_SPLIT_GAIN` sooner than no split; else ``(items, 1)``."""

    def makespan(split: int, parts: int) -> float:
        free = [0.0] * sms
        for duration, count in ((1.0, items - split), (1.0 / parts + PART_OVERHEAD, split * parts)):
            for _ in range(count):
                heapq.heappush(free, heapq.heappop(free) + duration)
        return max(free)

    best, choice = math.ceil(items / sms) * (1 - TAIL_SPLIT_GAIN), (items, 1)
    leftover = items % sms
    for split in sorted({leftover, leftover + sms} - {0}):
        for parts in range(2, min(8, steps) + 1):
            if split <= items and makespan(split, parts) < best:
                best, choice = makespan(split, parts), (items - split, parts)
    return choice


def launch_sm90_backward(
    launch,
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse_rows: Tensor,
    delta: Tensor,
    dq_acc: Optional[Tensor],
    dk: Tensor,
    dv: Tensor,
    scale: float,
    causal: bool,
    seq_dim: int,
    kv_lengths: Optional[Tensor],
    key_index: Optional[Tensor] = None,
    key_count: Optional[Tensor] = None,
) -> None:
    """Launch ``attn_bwd_sm90_kernel`` on arguments
    :func:`sm90_backward_computes` accepted (``launch(kernel)``: the
    kernel, or the launch-plan recorder's proxy of it): dk and dv, and dS K
    added into ``dq_acc`` (zeroed; None: dk and dv alone, the deterministic
    backward's dk/dv pass). Block-sparse: ``key_index`` / ``key_count``,
    ``launch_backward``'s ``key_blocks``. Dense causal programs run longest
    first, in the deterministic dk/dv pass's groups of heads; with dq,
    dense non-causal calls without key lengths (items of equal work) split
    their last items (:func:`backward_tail_split`), whose parts
    ``attn_bwd_parts_kernel`` adds up."""
    b, h, lq, d = meta.attention.dims(q, seq_dim)
    hk, lk = meta.attention.dims(k, seq_dim)[1:3]
    sparse = key_index is not None
    assert not sparse or meta.attention.SPARSE_BLOCK == 128  # a program's key tile is a listed block
    order, group = causal_order(q, lq * (h // hk), b * hk) if causal and not sparse else LAUNCH_ORDER
    n_tiles = triton.cdiv(lk, 128)
    items = n_tiles * b * hk
    step = backward_step(d, sparse)
    whole, parts = items, 1
    # Not for the deterministic dk/dv pass (no dq_acc): its fp32 parts would raise the default backward's peak
    # memory, which the five-product option's dq buffer already does.
    if dq_acc is not None and not (causal or sparse or kv_lengths is not None):
        whole, parts = backward_tail_split(items, multiprocessor_count(q), (h // hk) * triton.cdiv(lq, step))
    partials = q.new_empty((items - whole, parts, 2, 128, d), dtype=torch.float32) if whole < items else None
    work = whole + (items - whole) * parts
    # The deterministic dk/dv pass, dense and not causal (items of equal work): one program per SM.
    persistent = dq_acc is None and SM90_DKDV_PERSISTENT and not (causal or sparse)
    if persistent:
        work = min(work, multiprocessor_count(q))
    triton.set_allocator(tma_scratch)  # the kernel builds its TMA descriptors on the device
    launch(attn_bwd_sm90_kernel)[(work,)](
        q,
        k,
        v,
        grad_out,
        lse_rows,
        delta,
        dq_acc,
        dk,
        dv,
        partials,
        kv_lengths,
        key_index,
        key_count,
        *bhl_strides(q, seq_dim),
        *bhl_strides(k, seq_dim),
        *bhl_strides(v, seq_dim),
        *bhl_strides(grad_out, seq_dim),
        *bhl_strides(dk, seq_dim),
        *bhl_strides(dv, seq_dim),
        *block_list_args((key_index, key_count) if sparse else None)[2:],
        lse_rows.shape[1],
        b,
        h,
        h // hk,
        lq,
        lk,
        float(scale),
        group,
        whole,
        parts,
        D=d,
        STEP=step,
        STAGES=SM90_BACKWARD_STAGES,
        CONSUMER_REGS=SM90_CORE_CONSUMER_REGS,
        CAUSAL=causal,
        HAS_KV_LEN=kv_lengths is not None,
        SPARSE=sparse,
        MASKED_KEYS=lk % 128 != 0 or kv_lengths is not None,
        DQ=dq_acc is not None,
        SPLIT=partials is not None,
        PERSISTENT=persistent,
        **order,
        **SM90_CORE_LAUNCH,
    )
    if partials is not None:
        rows = 32
        launch(attn_bwd_parts_kernel)[(items - whole, 128 // rows)](
            partials,
            dk,
            dv,
            whole,
            parts,
            n_tiles,
            hk,
            lk,
            *bhl_strides(dk, seq_dim),
            *bhl_strides(dv, seq_dim),
            D=d,
            BLOCK_M=rows,
            num_warps=4,
        )


@torch.library.custom_op("fused_gluon::attention_backward_sm90_", mutates_args=("dq_acc", "dk", "dv"))
def _attention_backward_sm90(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse_rows: Tensor,
    delta: Tensor,
    dq_acc: Optional[Tensor],
    dk: Tensor,
    dv: Tensor,
    scale: float,
    causal: bool,
    seq_dim: int,
    kv_lengths: Optional[Tensor] = None,
    key_index: Optional[Tensor] = None,
    key_count: Optional[Tensor] = None,
) -> None:
    """``attn_bwd_sm90_kernel`` (:func:`launch_sm90_backward`) as an op of
    its own, for traced calls (as ``fused_gluon.attention_forward_sm90_``:
    Inductor cannot trace a Gluon kernel); not a public op."""
    launch_sm90_backward(
        lambda kernel: kernel,
        grad_out,
        q,
        k,
        v,
        lse_rows,
        delta,
        dq_acc,
        dk,
        dv,
        scale,
        causal,
        seq_dim,
        kv_lengths,
        key_index,
        key_count,
    )


@_attention_backward_sm90.register_fake
def _(
    grad_out,
    q,
    k,
    v,
    lse_rows,
    delta,
    dq_acc,
    dk,
    dv,
    scale,
    causal,
    seq_dim,
    kv_lengths=None,
    key_index=None,
    key_count=None,
):
    return None
