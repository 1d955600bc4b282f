"""Flash attention as ``torch.ops.fused`` ops: attention and attention_backward.

``fused.attention`` returns the output and the log-sum-exp; autograd saves
q, k, v, the output and the lse (O(L) extra memory) and calls
``fused.attention_backward``, which runs the three Triton passes of
``kernels/attention.py``: deterministic, bit-identical across runs. With
:data:`ATOMIC_DQ` set (``compile_ops.set_attention_backward``), the calls
:func:`_takes_sm90_backward` accepts run the five-product Gluon backward of
``kernels/attention_sm90.py`` instead, whose dq is summed by TMA reductions
in the order the GPU runs its programs.

The forward runs ``kernels/attention.py``'s ``attn_fwd_kernel`` everywhere,
except on Hopper (sm_90, the one place that tells: ``forward_tiles`` with
``_library.has_wgmma``) for the calls ``_takes_sm90_core`` accepts, which run
the warp-specialized Gluon core of ``kernels/attention_sm90.py`` (same
results, bit for bit); traced calls reach it through the opaque op
``fused_gluon.attention_forward_sm90_``.
"""
import functools
import heapq
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch
import triton
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from compile_ops import _dtensor, meta, reference
from compile_ops._library import (building_aot_package, clear_launch_plans, fused_op, has_tma, has_wgmma,
                                  l2_cache_bytes, launcher, multiprocessor_count, on_eager_fast_path,
                                  refuse_interpreted_bf16_dots, register_no_gradient, require_fp8_mma)
from compile_ops.kernels.attention import attn_fwd_kernel
from compile_ops.kernels.attention_8bit import (fp8_rows_scale_kernel, kv8_counters_clear_kernel, kv8_quantize_kernel,
                                                kv8_stats_kernel)
from compile_ops.kernels.attention_backward import (STATS_ROW_ALIGN, attn_bwd_dkdv_kernel,
                                                    attn_bwd_dq_from_acc_kernel, attn_bwd_dq_kernel,
                                                    attn_bwd_parts_kernel, attn_bwd_row_stats_kernel)
from compile_ops.kernels.attention_sm90 import attn_fwd_sm90_kernel
from compile_ops.kernels.attention_sm90_backward import attn_bwd_sm90_kernel
from compile_ops.meta._validate import check_module_input, checked_arguments, softmax_scale
from compile_ops.ops._launch import acc_dtype, dot_precision, unit_last_stride
from compile_ops.ops.fp8 import FP8Rows, refuse_gradient

# ---------------------------------------------------------------- launch configs


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    #: Forward only, Hopper (see kernels/attention.py ``_fwd_tiles``): K/V by
    #: TMA tensor descriptors (taken only where the tensors are aligned for it),
    #: the accumulator as the second dot's operand, warp-specialized key loop.
    tma: bool = False
    dot_acc: bool = False
    warp_specialize: bool = False
    #: Forward only, sm_90: the call runs on the warp-specialized Gluon core
    #: (kernels/attention_sm90.py) where it allows (:func:`_takes_sm90_core`);
    #: block_m, block_n and num_stages are then the core's.
    sm90_core: bool = False


def block_d(d: int) -> int:
    """D padded to a power of two of at least 16 (tl.dot's smallest K)."""
    return max(16, triton.next_power_of_2(d))


#: Head dims the sm_90 core takes (it needs D a power of two for its tiles), and its key tiles at each
#: (:func:`forward_tiles`): 128 keys at D = 128, 256 at D = 64.
SM90_CORE_HEAD_DIMS = (64, 128)
#: The precisions the sm_90 core runs: ``"exact"`` (16-bit). ``"int8_fp8"`` with q given in int8 (its INT8_FP8
#: mode) is built and tested (bit-identical to ``attn_fwd_kernel``) but not
#: ahead of it: 0.93x at 4608 keys, 0.98-1.00x from 16384 (H200,
#: bench/results/attention-sm90-core-int8-fp8-smem-h200.json; its P goes
#: through shared memory, bench/notes.md), so the 8-bit modes stay portable.
SM90_CORE_PRECISIONS = ("exact",)
#: The core's K/V ring: 3 and 4 stages measured within 1% (16-bit; 8-bit: 4 stages +5% at 32760 keys only).
SM90_CORE_STAGES = 2
#: The sm_90 core's launch: the default partition is one consumer warp group
#: (4 warps; the kernel adds 4 + 1), ``maxnreg`` 168 bounds 3 warp groups at
#: 64K registers, which the partitions split 240 / 240 / 24.
SM90_CORE_LAUNCH = dict(num_warps=4, maxnreg=168)
SM90_CORE_CONSUMER_REGS = 240


def forward_tiles(d: int, dtype: torch.dtype, tma: bool = False, precision: str = "exact",
                  wgmma: bool = False) -> Tiles:
    """Forward tiles by padded head dim: ``bench/sweep_attention.py`` on an H100,
    bf16 (bench/results/sweep-attention-h100-*.json). ``tma``: the GPU has TMA
    (``_library.has_tma``): D=128 then loads K and V by tensor descriptors,
    524-578 TFLOP/s against 463-515 with pointer loads at the four shapes of
    ``sweep_attention.py --hopper`` (bench/results/sweep-attention-hopper-h100.json;
    a 4th stage ran out of shared memory, warp specialization and the
    accumulator as a dot operand moved it by -3% to +2%).

    ``precision``: the 8-bit modes (``"int8"``, ``"int8_fp8"``) at D=128 take
    64 queries in one warp group (bench/notes.md, 8-bit attention: several
    small programs per SM overlap one's softmax with another's MMAs):
    ``"int8_fp8"`` 682-805 TFLOP/s at the four shapes against 583-663 with
    128 queries in two groups, ``"int8"`` 580-635 at 2 stages against
    542-611. FP8 P V's key tiles are the specification's 128
    (reference.attention.FP8_PV_TILE) at every D.

    ``wgmma`` (the GPU is sm_90, ``_library.has_wgmma``): 16-bit calls at
    the head dims of :data:`SM90_CORE_HEAD_DIMS` take the warp-specialized
    core, 128 queries x 128 keys, 2 K/V stages: 0.93-1.10x cuDNN at the
    five shapes of issue 28, where the ``triton.language`` kernel was
    0.88-1.01x (bench/results/attention-sm90-core-sweep-h100.json; 3 stages
    within 1%, 64-key tiles 9-10% slower in ``-first-h100.json``). At D = 64
    each tile's products halve while its softmax stays: 256-key tiles (the
    core's wide form, P V folded in before each softmax for registers),
    persistent, ran 0.96-0.99x cuDNN at 2x24x4096 and 1x24x16384, where the
    portable kernel ran 0.89-0.91x and the core's 128-key tiles the portable
    kernel's speed (H100, ``attention-sm90-core-d64-h100.json``); which calls
    take it is :func:`_takes_sm90_core`'s rule."""
    bd = block_d(d)
    if wgmma and precision in SM90_CORE_PRECISIONS and d in SM90_CORE_HEAD_DIMS \
            and dtype in (torch.float16, torch.bfloat16):
        return Tiles(128, 256 if d == 64 else 128, 4, SM90_CORE_STAGES, tma=True, sm90_core=True)
    if precision == "int8_fp8":
        return Tiles(64, 128, 4, 3, tma=tma) if bd <= 128 else Tiles(64, 128, 8, 2, tma=tma)
    if precision == "int8" and 64 < bd <= 128:
        return Tiles(64, 128, 4, 2, tma=tma)
    if dtype in (torch.float32, torch.float64):
        return Tiles(32, 32, 4, 2)  # fp32 operands take twice the shared memory
    if bd <= 64:
        return Tiles(128, 64, 8, 3)   # 390 TFLOP/s at D=64 against 326 for 4 warps
    if bd <= 128:
        return Tiles(128, 128, 8, 3, tma=tma)  # 419 against 369 for 64-key tiles
    return Tiles(64, 32, 4, 2)


def dkdv_tiles(d: int, dtype: torch.dtype, sparse: bool = False, tma: bool = False) -> Tiles:
    """dk/dv pass: ``block_n`` keys per program, ``block_m``-query steps.
    ``tma`` (the GPU has it): at D=128, 16-bit, the steps' q and dO tiles
    come by TMA (dense: ``bench/results/sweep-attention-backward-tma-h100.json``;
    block-sparse at its 2 stages: the pass 6.20 ms against 6.82 with pointer
    loads at 1x12x32760x128 and 35.2 against 38.0 at 1x12x75600x128, 26%
    kept, ``bench/results/block-sparse-backward-tma-h100.json``)."""
    bd = block_d(d)
    if dtype in (torch.float32, torch.float64) or bd > 128:
        return Tiles(16, 32, 4, 2)
    if bd <= 64:
        return Tiles(32, 128, 4, 3)
    # D=128: 370 TFLOP/s (fwd+bwd step) against 355 for (32, 64, 4, 3) once
    # exponents became one fma (sweep round 3, H200); 128 keys with 32-query
    # steps and 4 warps took 1.75x as long. Block-sparse loops (an index load
    # feeds each step's addresses) pipeline better at 2 stages, where dense
    # ones lose 15% (bench/results/sweep-block-sparse-h100.json, bench/notes.md).
    return Tiles(64, 128, 8, 2 if sparse else 3, tma=tma)


def dq_tiles(d: int, dtype: torch.dtype, sparse: bool = False, tma: bool = False) -> Tiles:
    """dq pass: ``block_m`` queries per program, ``block_n``-key steps; ``tma``
    as :func:`dkdv_tiles` (the steps' k and v tiles), dense only: the
    block-sparse pass measured no faster by TMA (4.44 ms against 4.24 at
    1x12x32760x128, 24.9 against 25.1 at 1x12x75600x128, same JSON)."""
    if dtype in (torch.float32, torch.float64) or block_d(d) > 128:
        return Tiles(32, 16, 4, 2)
    if block_d(d) <= 64:
        return Tiles(128, 64, 8, 3)
    return Tiles(128, 64, 8, 2 if sparse else 3, tma=tma and not sparse)


# ---------------------------------------------------------------- launch helpers


def _bhl_strides(t: Tensor, seq_dim: int) -> tuple:
    """(batch, head, position) strides of a q/k/v-shaped tensor in either layout."""
    if seq_dim == 2:
        return t.stride(0), t.stride(1), t.stride(2)
    return t.stride(0), t.stride(2), t.stride(1)


def _common(q: Tensor, k: Tensor, causal: bool, seq_dim: int, kv_lengths: Optional[Tensor]) -> dict:
    """Sizes (b, h, hk, lq, lk, d) and the constexprs every attention kernel takes.
    ``DOT_PRECISION`` matters for fp32 (TF32 or IEEE, ``dot_precision``); half
    operands ignore it. ``FMA_EXPONENT``: 16-bit inputs form exponents with
    one fma (their p is rounded to 16 bits anyway); fp32/fp64 keep torch's
    accuracy. ``ALIGNED_LENGTHS``: Lq and Lk are multiples of 16, the hint
    Triton's JIT takes from the values itself and Inductor loses when the
    lengths are symbolic (``kernels.attention._lengths``); traced with dynamic
    shapes, computing it guards on the lengths' divisibility, so a compiled
    graph serves either aligned or unaligned lengths, each at full speed."""
    b, h, lq, d = meta.attention.dims(q, seq_dim)
    hk, lk = meta.attention.dims(k, seq_dim)[1:3]
    return dict(b=b, h=h, hk=hk, lq=lq, lk=lk, d=d,
                consts=dict(D=d, BLOCK_D=block_d(d), CAUSAL=causal, HAS_KV_LEN=kv_lengths is not None,
                            DOT_PRECISION=dot_precision(q.dtype), ACC=acc_dtype(q),
                            FMA_EXPONENT=q.dtype in (torch.float16, torch.bfloat16),
                            SPARSE_BLOCK=meta.attention.SPARSE_BLOCK,
                            ALIGNED_LENGTHS=bool(lq % 16 == 0 and lk % 16 == 0)))


# ---------------------------------------------------------------- launchers


def _lists(blocks: Optional[tuple]) -> tuple:
    """The kernels' block-list arguments: ``(index, count, 3 index strides, 3
    count strides)`` of ``[B, H, rows, width]`` / ``[B, H, rows]`` lists, or
    placeholders for dense attention."""
    if blocks is None:
        return (None, None) + (0,) * 6
    index, count = blocks
    return (index, count, *index.stride()[:3], *count.stride())


def _tma_ready(seq_dim: int, *tensors: Tensor) -> bool:
    """TMA descriptors over each (batch, head)'s ``[L, D]`` rows need 16-byte
    aligned bases and row strides: the storage offset and the batch, head and
    position strides (in bytes) must be multiples of 16 (storages themselves
    are aligned by the CUDA allocator; the offset, unlike ``data_ptr``, is
    there on the fake tensors torch.compile traces with)."""
    for t in tensors:
        if not t.is_cuda or t.storage_offset() * t.element_size() % 16:
            return False
        if any(stride * t.element_size() % 16 for stride in _bhl_strides(t, seq_dim)):
            return False
    return True


def _scratch(size: int, alignment: int, stream) -> Tensor:
    """Global memory for the descriptors a kernel builds on the device (TMA)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _take_tma(wanted: bool, *layouts: tuple) -> bool:
    """Whether a launch loads by TMA: its tiles want it and every ``(seq_dim,
    *tensors)`` of ``layouts`` is aligned for descriptors (:func:`_tma_ready`).
    If so, triton's allocator is set for the descriptors the kernel makes on
    the device: Inductor sets its own before its launches, eager launches
    need it set too."""
    tma = wanted and all(_tma_ready(seq_dim, *tensors) for seq_dim, *tensors in layouts)
    if tma:
        triton.set_allocator(_scratch)
    return tma


#: The share of L2 that the (batch, head) rows run at once by a causal launch
#: may fill with the tensors they all read (k and v; q and dO for dk/dv).
CAUSAL_GROUP_L2_SHARE = 4


def causal_order(shared: Tensor, length: int, rows: int) -> tuple[dict, int]:
    """``(constexprs, heads_per_group)`` of a causal launch over ``rows``
    (batch, head) rows of which each reads ``length`` positions of two
    ``shared``-like tensors (``[..., D]``: k and v, or q and dO for dk/dv).

    Causal programs differ in work by up to the sequence's tile count, so
    they run longest first (``kernels.attention._program_rank``), dealt out
    across groups of rows whose shared bytes fill about a quarter of L2.
    The rule fits the measured best groups of the sweep in bench/notes.md
    ("Causal programs, longest first"): one row at 16384 and 32760 tokens
    (8.4 and 16.8 MB of k and v per row), 3-6 at 4608 (2.4 MB), 12-48 at
    4096 tokens with D = 64 (1 MB)."""
    # sym_max/sym_min: under dynamic shapes the group stays symbolic (a kernel argument), not a guard.
    row_bytes = torch.sym_max(2 * length * shared.shape[-1] * shared.element_size(), 1)
    group = torch.sym_max(l2_cache_bytes(shared) // CAUSAL_GROUP_L2_SHARE // row_bytes, 1)
    return dict(HEAVY_FIRST=True), torch.sym_min(group, torch.sym_max(rows, 1))


#: The order of every other launch: as launched (non-causal tiles all do the same work).
_LAUNCH_ORDER = (dict(HEAVY_FIRST=False), 1)


def _takes_sm90_core(t: Tiles, c: dict, q: Tensor, k: Tensor, v: Tensor, seq_dim: int, v_seq_dim: int,
                     blocks: Optional[tuple], rounds_q: bool, fp8_rows: Optional[tuple]) -> bool:
    """Whether a forward runs on the sm_90 core: its tiles chose it, and the
    call is one the core computes (at least one key, TMA-aligned q, k and
    v; dense or block-sparse, causal or not, with key lengths or not; 8-bit
    only dense, with q given in int8, not ``rounds_q``, and a 16-bit
    output); the rest stays on ``attn_fwd_kernel``. Its 256-key tiles
    (D = 64) are not a listed block, and only dense non-causal calls over
    whole tiles without key lengths measured ahead with them: 427 against
    the portable kernel's 396 TFLOP/s at 2x24x4096x64, 448 against 412 at
    1x24x16384x64, but 360 against 377 at SD3's ragged 4429 tokens, 391
    against 410 with key lengths and 281 against 373 causal at 2x24x4096
    (H100, ``bench/results/attention-sm90-core-d64-h100.json``)."""
    eight_bit_ok = not rounds_q and fp8_rows is None and (blocks is None or q.dtype != torch.int8)
    wide_ok = t.block_n == meta.attention.SPARSE_BLOCK or (
        blocks is None and not c["consts"]["CAUSAL"] and not c["consts"]["HAS_KV_LEN"] and c["lk"] % t.block_n == 0)
    return (t.sm90_core and eight_bit_ok and wide_ok and c["lk"] > 0 and _tma_ready(seq_dim, q, k)
            and _tma_ready(v_seq_dim, v) and not _broadcast(seq_dim, q, k) and not _broadcast(v_seq_dim, v))


def _broadcast(seq_dim: int, *tensors: Tensor) -> bool:
    """Whether a batch, head or position of more than one element has stride
    0 (an expanded tensor): the core's TMA descriptors span whole 4-D
    tensors, and a zero stride is not one a descriptor is specified for."""
    for t in tensors:
        sizes = meta.attention.dims(t, seq_dim)[:3]
        if any(stride == 0 and size > 1 for stride, size in zip(_bhl_strides(t, seq_dim), sizes)):
            return True
    return False


def _core_programs(q: Tensor, items, causal: bool, sparse: bool):
    """The sm_90 core's grid. Dense (with key lengths or not): one program
    per SM, each looping over its share of the work items with its loader
    running ahead into the next item's q and keys, 1.01-1.06x one program per
    item (0.96x cuDNN at 1x24x4608 where one per item was 0.91x, 0.96x at
    2x24x4096; H100, ``bench/results/attention-sm90-core-persistent-h100.json``).
    Causal and block-sparse items differ in work: one program per item,
    which the GPU deals out as SMs free up (a static round robin of causal
    items ran 0.84x at 1x40x16384, of block-sparse ones 0.98-1.01x)."""
    if causal or sparse:
        return items
    return min(items, multiprocessor_count(q))  # real tensors only: the opaque op or the eager path


def _launch_sm90_core(kernel, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                      causal: bool, seq_dim: int, kv_lengths: Optional[Tensor] = None,
                      block_index: Optional[Tensor] = None, block_count: Optional[Tensor] = None,
                      q_scale: Optional[Tensor] = None, k_scale: Optional[Tensor] = None,
                      v_scale: Optional[Tensor] = None) -> None:
    """Launch the sm_90 core (``kernel``: it, or the launch-plan recorder's
    proxy of it) on arguments :func:`_takes_sm90_core` accepted: its work
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
    order, group = causal_order(k, lk, b * h) if causal and not sparse else _LAUNCH_ORDER
    triton.set_allocator(_scratch)  # the core builds its TMA descriptors on the device
    kernel[(_core_programs(q, items, causal, sparse), )](
        q, k, v, out, lse, kv_lengths, block_index, block_count, q_scale, k_scale, v_scale,
        *_bhl_strides(q, seq_dim), *_bhl_strides(k, seq_dim), *_bhl_strides(v, 2 if int8_fp8 else seq_dim),
        *_bhl_strides(out, seq_dim), *_lists((block_index, block_count) if sparse else None)[2:],
        b * h, h, h // hk, lq, lk, float(scale), group, D=d, BLOCK_N=t.block_n, STAGES=t.num_stages,
        CONSUMER_REGS=SM90_CORE_CONSUMER_REGS, INT8_FP8=int8_fp8, CAUSAL=causal, HAS_KV_LEN=kv_lengths is not None,
        SPARSE=sparse, **order, **SM90_CORE_LAUNCH)


@torch.library.custom_op("fused_gluon::attention_forward_sm90_", mutates_args=("out", "lse"))
def _attention_forward_sm90(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, causal: bool,
                            seq_dim: int, kv_lengths: Optional[Tensor] = None, block_index: Optional[Tensor] = None,
                            block_count: Optional[Tensor] = None, q_scale: Optional[Tensor] = None,
                            k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None) -> None:
    """The sm_90 core as an op of its own, for traced calls (torch.compile,
    export, the dispatcher's eager path): Inductor cannot trace a Gluon
    kernel the way it inlines ``wrap_triton`` launches, so a compiled graph
    calls this op, which fills ``out`` and ``lse`` in place. In a namespace
    of its own: not a public op (no sharding rule, no registry row); the
    ``fused`` ops that call it have those."""
    _launch_sm90_core(attn_fwd_sm90_kernel, q, k, v, out, lse, scale, causal, seq_dim, kv_lengths, block_index,
                      block_count, q_scale, k_scale, v_scale)


@_attention_forward_sm90.register_fake
def _(q, k, v, out, lse, scale, causal, seq_dim, kv_lengths=None, block_index=None, block_count=None, q_scale=None,
      k_scale=None, v_scale=None):
    return None


def _core_gpu(q: Tensor) -> bool:
    """Whether a call on ``q`` may run a Gluon kernel (the sm_90 core, the
    five-product backward): an sm_90 GPU, in an eager call or a trace whose
    opaque op Python runs (an AOTInductor package runs from C++ without
    Python, so it gets the Triton kernels, which it compiles in)."""
    return has_wgmma(q) and (on_eager_fast_path() or not building_aot_package())


def launch_forward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, causal: bool,
                   seq_dim: int, kv_lengths: Optional[Tensor], blocks: Optional[tuple] = None,
                   int8_scales: Optional[tuple] = None, v_scale: Optional[Tensor] = None,
                   fp8_rows: Optional[tuple] = None) -> None:
    """Fill ``out`` and ``lse`` (from the fake). ``blocks``: block-sparse
    attention's ``(index [B, H, Lq blocks, width], count [B, H, Lq blocks])``.
    ``int8_scales``: 8-bit attention's ``(q_scale [B, H, Lq], k_scale [B, Hk,
    ceil(Lk / INT8_KEY_BLOCK)])``, q and k being int8 (the rest follows v's
    dtype unless ``v_scale``); q_scale None: q is 16-bit, and the kernel
    rounds it per token as it loads it (``QUANTIZE_Q``). ``v_scale`` (with ``int8_scales``): FP8 P V,
    v being e4m3 ``[B, Hk, D, Lk]`` with a unit key stride
    (:func:`fp8_values_transposed`) and ``v_scale [B, Hk, D]`` its channel
    scales; out's dtype is then q's original one (``out``'s). ``fp8_rows``
    (with ``v_scale``): ``(row_scale [B], out_scale [B, Lq])`` fp32, out being
    e4m3 ``[B, Lq, Hq, D]`` whatever seq_dim: the output written as the FP8
    rows of ``reference.attention.attention_int8_fp8_rows``."""
    refuse_interpreted_bf16_dots("attention", q=q, k=k, v=v)
    c = _common(q, k, causal, seq_dim, kv_lengths)
    if out.numel() == 0:
        return
    pv_fp8 = v_scale is not None
    q, k = (unit_last_stride(t) for t in (q, k))  # D is unit-stride in every layout models use
    if not pv_fp8:
        v = unit_last_stride(v)
    int8 = int8_scales is not None
    assert int8 or not pv_fp8, "FP8 P V is a mode of 8-bit attention"
    assert pv_fp8 or fp8_rows is None, "FP8 output rows are a mode of FP8 P V"
    consts = c["consts"]
    if int8:  # the accumulators and a 16-bit PV dot follow out (fp32 for e4m3 rows); an int8 dot needs K (= D) >= 32
        consts = dict(consts, ACC=acc_dtype(out), DOT_PRECISION=dot_precision(out.dtype), FMA_EXPONENT=True,
                      BLOCK_D=max(32, consts["BLOCK_D"]))
    q_scale, k_scale = int8_scales if int8 else (None, None)
    precision = "int8_fp8" if pv_fp8 else "int8" if int8 else "exact"
    v_seq_dim = 2 if pv_fp8 else seq_dim  # the transposed v: its channels take the position stride
    if pv_fp8 and v.stride(3) != 1:
        raise ValueError(f"launch_forward: FP8 P V takes v as [B, Hk, D, Lk] with unit key stride, got strides "
                         f"{tuple(v.stride())}")
    core = forward_tiles(int(c["d"]), out.dtype, True, precision, _core_gpu(q))
    if _takes_sm90_core(core, c, q, k, v, seq_dim, v_seq_dim, blocks, int8 and q_scale is None, fp8_rows):
        lists = blocks if blocks is not None else (None, None)
        scales = (q_scale, k_scale, v_scale) if pv_fp8 else (None, None, None)
        if on_eager_fast_path():  # launched as is, recorded for launch plans
            _launch_sm90_core(launcher(attn_fwd_sm90_kernel), q, k, v, out, lse, scale, causal, seq_dim, kv_lengths,
                              *lists, *scales)
        else:
            torch.ops.fused_gluon.attention_forward_sm90_(q, k, v, out, lse, float(scale), causal, seq_dim,
                                                          kv_lengths, *lists, *scales)
        return
    t = forward_tiles(int(c["d"]), out.dtype, has_tma(q), precision)  # attn_fwd_kernel's own tiles
    # One k scale per tile: its key tiles divide the scale blocks (all tiles are powers of two up to 128).
    assert not int8 or reference.attention.INT8_KEY_BLOCK % t.block_n == 0, t
    # The rounded probabilities are relative to the running max of the specification's tiles.
    assert not pv_fp8 or t.block_n == reference.attention.FP8_PV_TILE, t
    tma = _take_tma(t.tma, (seq_dim, q, k), (v_seq_dim, v))
    index, count, *list_strides = _lists(blocks)
    # The block list past Triton's pipeliner (kernels.attention._tile_start):
    # with the Hopper loop's TMA, by inline PTX (so not under the interpreter),
    # and only for lists with an entry that clamped reads may land on.
    list_by_asm = blocks is not None and tma and q.is_cuda and index.shape[-1] > 0
    row_scale, out_scale = fp8_rows if fp8_rows is not None else (None, None)
    grid = (triton.cdiv(c["lq"], t.block_m), c["b"] * c["h"])
    order, group = causal_order(k, c["lk"], grid[1]) if causal and blocks is None else _LAUNCH_ORDER
    launcher(attn_fwd_kernel)[grid](
        q, k, v, out, lse, kv_lengths, index, count, q_scale, k_scale, v_scale, row_scale, out_scale,
        *_bhl_strides(q, seq_dim), *_bhl_strides(k, seq_dim), *_bhl_strides(v, v_seq_dim),
        *_bhl_strides(out, 1 if fp8_rows is not None else seq_dim), *list_strides,
        c["h"], c["h"] // c["hk"], c["lq"], c["lk"], float(scale), group,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.num_warps, num_stages=t.num_stages,
        SPARSE=blocks is not None, TMA=tma, DOT_ACC=t.dot_acc, WARP_SPECIALIZE=t.warp_specialize, INT8=int8,
        INT8_KEY_BLOCK=reference.attention.INT8_KEY_BLOCK, PV_FP8=pv_fp8, OUT_FP8=fp8_rows is not None,
        LIST_BY_ASM=list_by_asm, QUANTIZE_Q=int8 and q_scale is None, **order, **consts,
    )


#: The backward's dq by atomic-order sums (``compile_ops.set_attention_backward(deterministic=False)``):
#: the five-product sm_90 backward (``attn_bwd_sm90_kernel``) for the calls
#: :func:`_takes_sm90_backward` accepts. Off by default: dq then differs from
#: run to run in its last bits (dk and dv do not), and the default backward is
#: bit-identical across runs. Forward+backward 1.03-1.12x the deterministic
#: backward and 0.87-1.00x cuDNN at issue 28's D = 128 shapes (four runs), 0.95-0.98x at
#: 2x24x4096x64 (128-query steps, :data:`SM90_BACKWARD_STEPS`), causal 1.05-1.19x and 0.92-1.00x,
#: block-sparse 1.11-1.26x (H100,
#: ``bench/results/attention-h100.json``, ``attention-causal-h100.json`` and
#: ``block-sparse-h100.json``'s ``*_atomic_dq``; bench/notes.md, "A
#: five-product backward in Gluon" and after);
#: ``torch.use_deterministic_algorithms(True)`` turns it off again. Read when a
#: call is made, or traced: set it before compiling.
ATOMIC_DQ = False
#: The five-product backward's q/dO ring: 198 KB of shared memory at 2 stages at D = 128, where a third
#: does not fit; at D = 64 (16 KB a stage) 4 and 6 stages ran no faster than 2, within 1% or slower at
#: four shapes (H100, ``bench/results/attention-backward-stages-d64-h100.json``).
SM90_BACKWARD_STAGES = 2
#: The head dimensions the five-product backward computes (one or two 32-channel dQ pieces a consumer).
SM90_BACKWARD_HEAD_DIMS = (64, 128)
#: ``attn_bwd_sm90_kernel``'s query rows a step of dense calls, by head dim: at D = 64 a consumer's dK and
#: dV take 32 registers each, which leaves room for 64 x 128 score tiles (FlashAttention-3's hdim-64
#: backward also takes 128-query blocks); at D = 128, 64. Block lists take 64 (:func:`backward_step`).
SM90_BACKWARD_STEPS = {64: 128, 128: 64}


def backward_step(d: int, sparse: bool) -> int:
    """``attn_bwd_sm90_kernel``'s query rows a step at head dim ``d``: :data:`SM90_BACKWARD_STEPS`, or
    64 over block lists (a 128-query step there made ptxas spill in the step loop)."""
    return 64 if sparse else SM90_BACKWARD_STEPS[d]


def _sm90_backward_computes(c: dict, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, seq_dim: int) -> bool:
    """Whether ``attn_bwd_sm90_kernel`` computes a backward: on an sm_90 GPU
    where a traced call can hold its opaque op (:func:`_core_gpu`), dense or
    block-sparse, causal or not, key lengths or not, 16-bit (q, k, v and dO
    alike), D = 64 or 128, at least one key, TMA-aligned q, k, v and dO with
    no broadcast strides."""
    tensors = (q, k, v, grad_out)
    return (_core_gpu(q) and q.dtype in (torch.float16, torch.bfloat16)
            and all(t.dtype == q.dtype for t in tensors) and c["d"] in SM90_BACKWARD_HEAD_DIMS and c["lk"] > 0
            and _tma_ready(seq_dim, *tensors) and not _broadcast(seq_dim, *tensors))


def _takes_sm90_backward(c: dict, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, seq_dim: int) -> bool:
    """Whether a backward runs on the five-product sm_90 kernel: asked for
    (:data:`ATOMIC_DQ`, and torch's deterministic algorithms not asked
    for), on a call it computes (:func:`_sm90_backward_computes`)."""
    return (ATOMIC_DQ and not torch.are_deterministic_algorithms_enabled()
            and _sm90_backward_computes(c, q, k, v, grad_out, seq_dim))


#: The deterministic backward's dk/dv pass on sm_90: ``attn_bwd_sm90_kernel`` without dQ (four products,
#: warp-specialized; bit for bit the same on every run) for the dense calls it computes, in place of
#: ``attn_bwd_dkdv_kernel``. Forward+backward against the ``triton.language`` pass, H100, alternated rounds:
#: as it runs (no split), 1.02-1.03x at 1x24x4608x128, 1.03-1.05x at 1x40x16384x128, 0.99-1.02x at
#: 2x24x4096x64 and 1.05-1.07x causal at 1x24x4608x128 (2 rounds,
#: ``bench/results/attention-deterministic-dq-sm90-h100.json``: its ``triton_dq`` runs are this default, its
#: ``triton_passes`` runs the old one); in 3 rounds before
#: (``attention-deterministic-dkdv-sm90-h100.json``), 1.00-1.01x at 2x24x4096x64, 1.03-1.07x causal, and
#: with a last round split, which the pass no longer does (its memory, :func:`_launch_sm90_backward`),
#: 1.02-1.03x at 4608 and 1.09-1.16x at 1x24x4429x64. Block-sparse calls keep the ``triton.language`` pass
#: (not measured on this kernel without dQ).
SM90_DKDV = True
#: That pass dense and not causal, persistent: one program per SM walks its share of the key tiles, its
#: loader fetching the next tile's K and V once both consumers are done with the last one's and its q/dO
#: ring running on across tiles. Why: the kernel builds its six TMA descriptors on the device, 128 bytes
#: each in scratch memory per program, which one program per key tile made 0.4-2.5 MiB (one fp32 per key
#: row) above the ``triton.language`` pass's peak (bench/notes.md, the README tables rerun whole); one
#: per SM brings 1x40x16384x128 back to 651 MiB. And it is faster: forward+backward 1.00-1.02x at
#: 1x24x4608x128, 1.02-1.04x at 1x40x16384x128, 1.04-1.06x at 2x24x4096x64 against one program per tile
#: (H100, 2 rounds alternated, ``bench/results/attention-dkdv-persistent-h100.json``). Causal items differ
#: in work and keep one program each, as in the forward (:func:`_core_programs`).
SM90_DKDV_PERSISTENT = True


#: What a part of an item costs the five-product backward beyond its share of the item's steps, as a
#: fraction of a whole item: its K and V loads, its pipeline's fill and its fp32 dk/dv (the model
#: :func:`backward_tail_split` plans with).
PART_OVERHEAD = 0.03
#: The least modelled gain, as a fraction of the launch's rounds, for which the backward splits its last
#: items. Measured on an H100 (forward+backward, split against not, 3 rounds alternated,
#: ``bench/results/attention-five-product-split-h100.json``): modelled 4.4% -> 1.04x at 1x24x4608x128 but
#: 1.00x at 1x24x4592x128; 7.7% -> 1.04x at 1x24x4429x64; 2.3% -> 0.98x at 2x24x4096x64 and 2.7% -> 0.98x
#: at 1x12x32760x128, where the model's parts cost more than it says.
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


def _launch_sm90_backward(launch, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, lse_rows: Tensor,
                          delta: Tensor, dq_acc: Optional[Tensor], dk: Tensor, dv: Tensor, scale: float, causal: bool,
                          seq_dim: int, kv_lengths: Optional[Tensor], key_index: Optional[Tensor] = None,
                          key_count: Optional[Tensor] = None) -> None:
    """Launch ``attn_bwd_sm90_kernel`` on arguments
    :func:`_sm90_backward_computes` accepted (``launch(kernel)``: the
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
    order, group = causal_order(q, lq * (h // hk), b * hk) if causal and not sparse else _LAUNCH_ORDER
    n_tiles = triton.cdiv(lk, 128)
    items = n_tiles * b * hk
    step = backward_step(d, sparse)
    whole, parts = items, 1
    # Not for the deterministic dk/dv pass (no dq_acc): its fp32 parts (47 MB at 1x24x4608x128) would raise the
    # default backward's peak memory, which the five-product option's dq buffer already does.
    if dq_acc is not None and not (causal or sparse or kv_lengths is not None):
        whole, parts = backward_tail_split(items, multiprocessor_count(q), (h // hk) * triton.cdiv(lq, step))
    partials = q.new_empty((items - whole, parts, 2, 128, d), dtype=torch.float32) if whole < items else None
    work = whole + (items - whole) * parts
    # The deterministic dk/dv pass, dense and not causal (items of equal work): one program per SM.
    persistent = dq_acc is None and SM90_DKDV_PERSISTENT and not (causal or sparse)
    if persistent:
        work = min(work, multiprocessor_count(q))
    triton.set_allocator(_scratch)  # the kernel builds its TMA descriptors on the device
    launch(attn_bwd_sm90_kernel)[(work, )](
        q, k, v, grad_out, lse_rows, delta, dq_acc, dk, dv, partials, kv_lengths, key_index, key_count,
        *_bhl_strides(q, seq_dim), *_bhl_strides(k, seq_dim), *_bhl_strides(v, seq_dim),
        *_bhl_strides(grad_out, seq_dim), *_bhl_strides(dk, seq_dim), *_bhl_strides(dv, seq_dim),
        *_lists((key_index, key_count) if sparse else None)[2:], lse_rows.shape[1], b, h, h // hk, lq, lk,
        float(scale), group, whole, parts, D=d, STEP=step, STAGES=SM90_BACKWARD_STAGES,
        CONSUMER_REGS=SM90_CORE_CONSUMER_REGS,
        CAUSAL=causal, HAS_KV_LEN=kv_lengths is not None, SPARSE=sparse,
        MASKED_KEYS=lk % 128 != 0 or kv_lengths is not None, DQ=dq_acc is not None, SPLIT=partials is not None,
        PERSISTENT=persistent, **order, **SM90_CORE_LAUNCH)
    if partials is not None:
        rows = 32
        launch(attn_bwd_parts_kernel)[(items - whole, 128 // rows)](
            partials, dk, dv, whole, parts, n_tiles, hk, lk, *_bhl_strides(dk, seq_dim), *_bhl_strides(dv, seq_dim),
            D=d, BLOCK_M=rows, num_warps=4)


@torch.library.custom_op("fused_gluon::attention_backward_sm90_", mutates_args=("dq_acc", "dk", "dv"))
def _attention_backward_sm90(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, lse_rows: Tensor, delta: Tensor,
                             dq_acc: Optional[Tensor], dk: Tensor, dv: Tensor, scale: float, causal: bool, seq_dim: int,
                             kv_lengths: Optional[Tensor] = None, key_index: Optional[Tensor] = None,
                             key_count: Optional[Tensor] = None) -> None:
    """``attn_bwd_sm90_kernel`` (:func:`_launch_sm90_backward`) as an op of
    its own, for traced calls (as ``fused_gluon.attention_forward_sm90_``:
    Inductor cannot trace a Gluon kernel); not a public op."""
    _launch_sm90_backward(lambda kernel: kernel, grad_out, q, k, v, lse_rows, delta, dq_acc, dk, dv, scale,
                          causal, seq_dim, kv_lengths, key_index, key_count)


@_attention_backward_sm90.register_fake
def _(grad_out, q, k, v, lse_rows, delta, dq_acc, dk, dv, scale, causal, seq_dim, kv_lengths=None, key_index=None,
      key_count=None):
    return None


def launch_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dq: Tensor,
                    dk: Tensor, dv: Tensor, scale: float, causal: bool, seq_dim: int, kv_lengths: Optional[Tensor],
                    blocks: Optional[tuple] = None, key_blocks: Optional[tuple] = None) -> None:
    """Fill dq, dk, dv (from the fake). Block-sparse: ``blocks`` as the forward,
    ``key_blocks`` the transposed lists (per key block, the query blocks that
    list it: ``[B, H, Lk blocks, width]`` / ``[B, H, Lk blocks]``)."""
    refuse_interpreted_bf16_dots("attention_backward", q=q, k=k, v=v, grad_out=grad_out)
    c = _common(q, k, causal, seq_dim, kv_lengths)
    if dq.numel() == 0 or dk.numel() == 0:  # no queries or no keys: all gradients are 0
        dq.zero_(), dk.zero_(), dv.zero_()
        return
    q, k, v, out, grad_out = (unit_last_stride(x) for x in (q, k, v, out, grad_out))
    lse = lse.contiguous()
    d, consts = int(c["d"]), c["consts"]
    sparse = blocks is not None
    # Per-query statistics in padded rows (kernels.attention.STATS_ROW_ALIGN): delta and the lse.
    stats_row = triton.cdiv(c["lq"], STATS_ROW_ALIGN.value) * STATS_ROW_ALIGN.value
    delta, lse_rows = (lse.new_empty((c["b"] * c["h"], stats_row)) for _ in range(2))
    five_products = _takes_sm90_backward(c, q, k, v, grad_out, seq_dim)
    # The deterministic backward's dk/dv by the same kernel without dQ (dense calls).
    sm90_dkdv = (SM90_DKDV and not five_products and not sparse
                 and _sm90_backward_computes(c, q, k, v, grad_out, seq_dim))
    # The five-product backward's dq sums, zeroed by the statistics pass.
    dq_acc = lse.new_empty((c["b"] * c["h"], stats_row, d)) if five_products else None
    rows = 64
    launcher(attn_bwd_row_stats_kernel)[(stats_row // rows, c["b"] * c["h"])](
        out, grad_out, lse, delta, lse_rows, c["h"], c["lq"], *_bhl_strides(out, seq_dim),
        *_bhl_strides(grad_out, seq_dim), D=d, BLOCK_D=consts["BLOCK_D"], BLOCK_M=rows, ACC=consts["ACC"],
        DQ_ACC=dq_acc, num_warps=4)
    if five_products or sm90_dkdv:
        if on_eager_fast_path():  # launched as is, recorded for launch plans
            _launch_sm90_backward(launcher, grad_out, q, k, v, lse_rows, delta, dq_acc, dk, dv, scale, causal,
                                  seq_dim, kv_lengths, *(key_blocks or (None, None)))
        else:
            torch.ops.fused_gluon.attention_backward_sm90_(grad_out, q, k, v, lse_rows, delta, dq_acc, dk, dv,
                                                           float(scale), causal, seq_dim, kv_lengths,
                                                           *(key_blocks or (None, None)))
    if five_products:
        launcher(attn_bwd_dq_from_acc_kernel)[(triton.cdiv(c["lq"], rows), c["b"] * c["h"])](
            dq_acc, dq, c["h"], c["lq"], *_bhl_strides(dq, seq_dim), float(scale), D=d, BLOCK_D=consts["BLOCK_D"],
            BLOCK_M=rows, num_warps=4)
        return
    strides = (*_bhl_strides(q, seq_dim), *_bhl_strides(k, seq_dim), *_bhl_strides(v, seq_dim),
               *_bhl_strides(grad_out, seq_dim))
    if not sm90_dkdv:
        t = dkdv_tiles(d, q.dtype, sparse, has_tma(q))
        assert STATS_ROW_ALIGN.value % t.block_m == 0, t  # the statistics rows hold whole query tiles
        tma = _take_tma(t.tma, (seq_dim, q, grad_out))
        index, count, *list_strides = _lists(key_blocks)
        # A dk/dv row reads q and dO of its whole GQA group of heads.
        order, group = (causal_order(q, c["lq"] * (c["h"] // c["hk"]), c["b"] * c["hk"]) if causal and not sparse
                        else _LAUNCH_ORDER)
        launcher(attn_bwd_dkdv_kernel)[(triton.cdiv(c["lk"], t.block_n), c["b"] * c["hk"])](
            q, k, v, grad_out, lse_rows, delta, dk, dv, kv_lengths, index, count, *strides,
            *_bhl_strides(dk, seq_dim), *_bhl_strides(dv, seq_dim), *list_strides,
            c["b"], c["hk"], c["h"] // c["hk"], c["lq"], c["lk"], float(scale), group,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.num_warps, num_stages=t.num_stages, SPARSE=sparse,
            TMA=tma, **order, **consts,
        )
    t = dq_tiles(d, q.dtype, sparse, has_tma(q))
    assert STATS_ROW_ALIGN.value % t.block_m == 0, t
    tma = _take_tma(t.tma, (seq_dim, k, v))
    index, count, *list_strides = _lists(blocks)
    order, group = causal_order(k, c["lk"], c["b"] * c["h"]) if causal and not sparse else _LAUNCH_ORDER
    launcher(attn_bwd_dq_kernel)[(triton.cdiv(c["lq"], t.block_m), c["b"] * c["h"])](
        q, k, v, grad_out, lse_rows, delta, dq, kv_lengths, index, count, *strides, *_bhl_strides(dq, seq_dim),
        *list_strides, c["b"], c["h"], c["h"] // c["hk"], c["lq"], c["lk"], float(scale), group,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.num_warps, num_stages=t.num_stages, SPARSE=sparse,
        TMA=tma, **order, **consts,
    )


# ---------------------------------------------------------------- ops


@fused_op("attention", fake=meta.attention.attention, reference=reference.attention.attention,
          autocast="lower")
def _attention_op(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, seq_dim: int = 2,
                  kv_lengths: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    out, lse = meta.attention.attention(q, k, v, scale, causal, seq_dim, kv_lengths)
    launch_forward(q, k, v, out, lse, scale, causal, seq_dim, kv_lengths)
    return out, lse


@fused_op("attention_backward", fake=meta.attention.attention_backward,
          reference=reference.attention.attention_backward)
def _attention_backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                           scale: float, causal: bool, seq_dim: int = 2,
                           kv_lengths: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = meta.attention.attention_backward(grad_out, q, k, v, out, lse, scale, causal, seq_dim,
                                                   kv_lengths)
    launch_backward(grad_out, q, k, v, out, lse, dq, dk, dv, scale, causal, seq_dim, kv_lengths)
    return dq, dk, dv


def _setup_attention(ctx, inputs, output):
    q, k, v, scale, causal, seq_dim, kv_lengths = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, kv_lengths)
    ctx.args = (scale, causal, seq_dim)


def _backward_attention(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, kv_lengths = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(grad_out, q, k, v, out, lse, *ctx.args, kv_lengths)
    return dq, dk, dv, None, None, None, None


_attention_op.register_autograd(_backward_attention, setup_context=_setup_attention)


@fused_op("attention_int8", fake=meta.attention.attention_int8, reference=reference.attention.attention_int8,
          autocast="lower")
def _attention_int8_op(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, seq_dim: int = 2,
                       kv_lengths: Optional[Tensor] = None) -> Tensor:
    out = meta.attention.attention_int8(q, k, v, scale, causal, seq_dim, kv_lengths)
    _launch_eight_bit(_quantized(q, k, v, seq_dim, pv_fp8=False), v, out, scale, causal, seq_dim, kv_lengths)
    return out


register_no_gradient(_attention_int8_op, "fused.attention_int8 is inference only (its q and k are rounded to 8 "
                     "bits, which has no useful gradient): train with precision='exact', or run the call under "
                     "torch.no_grad()")


#: The 8-bit quantization's statistics pass: each program reduces a chunk
#: of STAT_CHUNK_ROWS of a head's keys in steps of STAT_STEP rows, and the
#: head's last chunk to finish sums the head's partials; past
#: MAX_STAT_CHUNKS chunks a head the chunks grow instead. Swept on an H100
#: (bench/results/quantize-8bit-stats-sweep-h100.json: chunks of 128 to 2048
#: keys, steps of 32 to 128, 4 or 8 warps, seven shapes): 1024-key chunks
#: in 128-key steps at 8 warps are within 3.5% of each shape's best. With
#: kv8_quantize_kernel's padded store, both passes are 19-20% faster than 16
#: chunks a head in 64-key steps at 4 warps (the configuration before) at
#: aligned lengths and 55% at 32760 (bench/notes.md).
STAT_STEP = 128
STAT_CHUNK_ROWS = 1024
MAX_STAT_CHUNKS = 128
#: Launches of the two passes (tests and experiments patch them).
STATS_LAUNCH = dict(num_warps=8)
QUANTIZE_LAUNCH = dict(num_warps=4)  # 8 warps: 1.2x the time (H200, bench/notes.md)


def stat_rows_per_chunk(lk: int) -> int:
    """Keys per program of the statistics pass over ``lk`` keys: a multiple
    of STAT_STEP, at least STAT_CHUNK_ROWS and enough for at most
    MAX_STAT_CHUNKS programs a head."""
    steps_per_chunk = torch.sym_max(triton.cdiv(STAT_CHUNK_ROWS, STAT_STEP),
                                    triton.cdiv(triton.cdiv(lk, STAT_STEP), MAX_STAT_CHUNKS))
    return STAT_STEP * steps_per_chunk


def quantize_8bit(k: Optional[Tensor], v: Optional[Tensor], seq_dim: int) -> tuple:
    """8-bit attention's k and v operands by Triton kernels: ``(k8, k_scale)``
    of ``reference.attention.smooth_quantize_qk`` and, with v, ``(vt8,
    v_scale)`` of :func:`fp8_values_transposed`, in three launches: the
    arrival counters zeroed, k's and v's sequence statistics (partials per
    chunk of keys, summed per head by the chunk that finishes last), then
    both quantized; each 16-bit input is read twice. Eager and traced calls
    alike. The same values as the reference up to the order of k's mean's
    sum (an fp32 ulp, which can move a rare k value to the next integer). q
    has no pass: the attention kernel rounds each program's rows per token
    as it loads them (``QUANTIZE_Q``). k None: v's alone (q and k came
    quantized from ``fused.qk_rope_int8``).

    Args:
        k, v: ``[B, Hk, Lk, D]`` (seq_dim 2) or ``[B, Lk, Hk, D]`` (1),
            fp16/bf16, unit-stride D; v None for 16-bit P V.
    """
    with_k, with_v = k is not None, v is not None
    kv = k if with_k else v
    b, hk, lk, d = meta.attention.dims(kv, seq_dim)
    blocks = triton.cdiv(lk, reference.attention.INT8_KEY_BLOCK)
    rows_per_chunk = stat_rows_per_chunk(lk)
    chunks = triton.cdiv(lk, rows_per_chunk)
    # Per (batch, k head): a row per chunk and the head's total; k's column
    # sums and v's column amax, each only when quantized.
    k_sum, v_amax = (torch.empty((b * hk, chunks + 1, d), dtype=torch.float32, device=kv.device) if wanted
                     else None for wanted in (with_k, with_v))
    arrivals = torch.empty((b * hk,), dtype=torch.int32, device=kv.device)
    k8 = k_scale = vt8 = v_scale = None
    if with_k:
        k8 = torch.empty_like(k, dtype=torch.int8)
        k_scale = torch.empty((b, hk, blocks), dtype=torch.float32, device=k.device)
    if with_v:
        # The kernel is handed the whole padded buffer, not the narrowed view the attention kernel
        # reads: a traced kernel mutating a view made Inductor emit an e4m3 slice copy that failed
        # to compile (tl.full of fp8) at 32760 tokens.
        vt8 = torch.empty((b, hk, d, lk + -lk % 16), dtype=torch.float8_e4m3fn, device=v.device)
        v_scale = torch.empty((b, hk, d), dtype=torch.float32, device=v.device)
    k_strides = _bhl_strides(k, seq_dim) if with_k else (0, 0, 0)
    v_strides = _bhl_strides(v, seq_dim) if with_v else (0, 0, 0)
    if lk > 0 and b * hk > 0:
        consts = dict(D=d, BLOCK_D=block_d(d), WITH_V=with_v, WITH_K=with_k)
        launcher(kv8_counters_clear_kernel)[(triton.cdiv(b * hk, 1024),)](arrivals, b * hk, BLOCK=1024)
        launcher(kv8_stats_kernel)[(chunks, b * hk)](
            k, v, k_sum, v_amax, arrivals, hk, lk, *k_strides, *v_strides, rows_per_chunk, BLOCK_L=STAT_STEP,
            **STATS_LAUNCH, **consts)
        launcher(kv8_quantize_kernel)[(blocks, b * hk)](
            k, k8, k_scale, k_sum, v, vt8, v_amax, v_scale, hk, lk, chunks, *k_strides,
            *(_bhl_strides(k8, seq_dim) if with_k else (0, 0, 0)), *v_strides, vt8.stride(2) if with_v else 0,
            BLOCK_L=reference.attention.INT8_KEY_BLOCK, **QUANTIZE_LAUNCH, **consts)
    return ((k8, k_scale) if with_k else ()) + ((vt8.narrow(3, 0, lk), v_scale) if with_v else ())


def fp8_values_transposed(v: Tensor, seq_dim: int) -> tuple[Tensor, Tensor]:
    """``reference.attention.quantize_v_fp8`` of v (``[B, Hk, Lk, D]`` or
    ``[B, Lk, Hk, D]``) laid out as the FP8 P V kernel reads it: e4m3
    ``[B, Hk, D, Lk]`` with a unit key stride and rows padded to 16 bytes
    (TMA's row alignment), and the channel scales ``[B, Hk, D]``. In torch
    ops: the layout's specification, which :func:`quantize_8bit`'s kernel
    writes (padding columns excepted), for the tests and benchmarks."""
    vf = v.float() if seq_dim == 2 else v.float().transpose(1, 2)
    v_scale, v_inverse = reference.attention.fp8_channel_scales(vf)
    lk = vf.shape[2]
    scaled = (vf * v_inverse.unsqueeze(2)).transpose(2, 3)
    # Contiguous whatever the padding: with none, pad returns the transposed view, and a cast
    # that preserved its strides would leave the keys D apart (the kernel reads them as adjacent).
    vt = torch.nn.functional.pad(scaled, (0, -lk % 16)).to(torch.float8_e4m3fn,
                                                            memory_format=torch.contiguous_format)
    return vt.narrow(3, 0, lk), v_scale


def fp8_rows_scale(v_scale: Tensor) -> Tensor:
    """``reference.attention.fp8_rows_scale`` of v's channel scales ``[B, Hk,
    D]`` (contiguous fp32): ``[B]``. Traced, the reference's torch ops; run
    eagerly, one small kernel, so that the FP8-rows op's launches can be
    replayed (``_replay``: an intermediate from torch ops cannot be)."""
    if is_fake(v_scale):
        return reference.attention.fp8_rows_scale(v_scale)
    b = v_scale.shape[0]
    row_scale = torch.empty((b,), dtype=torch.float32, device=v_scale.device)
    if b > 0:
        per_batch = v_scale[0].numel()
        launcher(fp8_rows_scale_kernel)[(b,)](
            v_scale, row_scale, per_batch, FLOOR=reference.fp8.AMAX_FLOOR / reference.attention.FP8_MAX,
            HEADROOM=reference.attention.FP8_ROWS_HEADROOM,
            BLOCK=min(4096, triton.next_power_of_2(max(per_batch, 1))), num_warps=4)
    return row_scale


def _launch_eight_bit(operands: tuple, v: Tensor, out: Tensor, scale: float, causal: bool, seq_dim: int,
                      kv_lengths: Optional[Tensor], out_scale: Optional[Tensor] = None) -> None:
    """The body the 8-bit ops share: fill ``out`` from the forward kernel.
    ``operands``: ``(q8, q_scale, k8, k_scale)`` and, for FP8 P V, ``(vt8,
    v_scale)`` (:func:`quantize_8bit`'s tuple); without the latter P V is
    16-bit, on ``v``. ``out_scale`` ``[B, Lq]`` (FP8 P V only): out is the
    e4m3 rows of ``reference.attention.attention_int8_fp8_rows``, these their
    scales."""
    q8, q_scale, k8, k_scale, *v_operands = operands
    b, h, lq, _ = meta.attention.dims(q8, seq_dim)
    lse = v.new_empty((b, h, lq), dtype=torch.float32)  # written by the kernel, not returned
    if not v_operands:
        launch_forward(q8, k8, unit_last_stride(v), out, lse, scale, causal, seq_dim, kv_lengths,
                       int8_scales=(q_scale, k_scale))
        return
    vt8, v_scale = v_operands
    fp8_rows = None if out_scale is None else (fp8_rows_scale(v_scale), out_scale)
    launch_forward(q8, k8, vt8, out, lse, scale, causal, seq_dim, kv_lengths, int8_scales=(q_scale, k_scale),
                   v_scale=v_scale, fp8_rows=fp8_rows)


def _quantized(q: Optional[Tensor], k: Optional[Tensor], v: Tensor, seq_dim: int, pv_fp8: bool) -> tuple:
    """The 8-bit kernel's operands: q as given (16-bit, no scale: the kernel
    rounds it, ``QUANTIZE_Q``), :func:`quantize_8bit` of k and, for FP8 P V,
    v, in one pass where they share it (q and k None: they came quantized,
    and only v's operands are made). Traced too (torch.compile,
    torch.export): the Triton passes beat Inductor's fusion of the
    specification's torch ops at every measured shape for ``int8_fp8`` (H100,
    1x24x4608x128: 568 TFLOP/s eager against 541 compiled with the torch
    ops; bench/notes.md), and one path is what both modes then run."""
    if q is None and not pv_fp8:
        return ()
    q, k, v = (None if t is None else unit_last_stride(t) for t in (q, k, v))
    operands = quantize_8bit(k, v if pv_fp8 else None, seq_dim)
    # q stays 16-bit, without a scale: the attention kernel rounds each program's rows itself (QUANTIZE_Q).
    return operands if q is None else (q, None) + operands


@fused_op("attention_int8_fp8", fake=meta.attention.attention_int8_fp8,
          reference=reference.attention.attention_int8_fp8, autocast="lower")
def _attention_int8_fp8_op(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, seq_dim: int = 2,
                           kv_lengths: Optional[Tensor] = None) -> Tensor:
    out = meta.attention.attention_int8_fp8(q, k, v, scale, causal, seq_dim, kv_lengths)
    require_fp8_mma(q, "precision='int8_fp8' attention (P V in FP8)")
    _launch_eight_bit(_quantized(q, k, v, seq_dim, pv_fp8=True), v, out, scale, causal, seq_dim, kv_lengths)
    return out


register_no_gradient(_attention_int8_fp8_op, "fused.attention_int8_fp8 is inference only (q, k, v and the "
                     "probabilities are rounded to 8 bits): train with precision='exact', or run the call under "
                     "torch.no_grad()")


@fused_op("attention_int8_fp8_rows", fake=meta.attention.attention_int8_fp8_rows,
          reference=reference.attention.attention_int8_fp8_rows, autocast="lower")
def _attention_int8_fp8_rows_op(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, seq_dim: int = 2,
                                kv_lengths: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    values, out_scale = meta.attention.attention_int8_fp8_rows(q, k, v, scale, causal, seq_dim, kv_lengths)
    require_fp8_mma(q, "FP8 output rows of 8-bit attention")
    _launch_eight_bit(_quantized(q, k, v, seq_dim, pv_fp8=True), v, values, scale, causal, seq_dim, kv_lengths,
                      out_scale=out_scale)
    return values, out_scale


register_no_gradient(_attention_int8_fp8_rows_op, "fused.attention_int8_fp8_rows is inference only (its output "
                     "is e4m3): train with precision='exact', or run the call under torch.no_grad()")


@fused_op("attention_qk8", fake=meta.attention.attention_qk8, reference=reference.attention.attention_qk8)
def _attention_qk8_op(q: Tensor, q_scale: Tensor, k: Tensor, k_scale: Tensor, v: Tensor, scale: float,
                      causal: bool, seq_dim: int = 2, kv_lengths: Optional[Tensor] = None, pv_fp8: bool = False,
                      fp8_rows: bool = False) -> tuple[Tensor, Tensor]:
    out, out_scale = meta.attention.attention_qk8(q, q_scale, k, k_scale, v, scale, causal, seq_dim, kv_lengths,
                                                  pv_fp8, fp8_rows)
    if pv_fp8:
        require_fp8_mma(q, "8-bit attention with P V in FP8")
    operands = (q, q_scale, k, k_scale) + _quantized(None, None, v, seq_dim, pv_fp8)
    _launch_eight_bit(operands, v, out, scale, causal, seq_dim, kv_lengths, out_scale if fp8_rows else None)
    return out, out_scale


register_no_gradient(_attention_qk8_op, "fused.attention_qk8 is inference only (its q and k are INT8): train "
                     "with precision='exact', or run the call under torch.no_grad()")


# ---------------------------------------------------------------- public functions


class Int8QK(NamedTuple):
    """q and k of 8-bit attention, already quantized as
    ``reference.attention.smooth_quantize_qk`` specifies: what
    ``rope_qk(..., quantize=True)`` and ``qk_norm_rope(..., quantize=True)``
    write straight from the projections (no 16-bit q or k in memory), and
    what :func:`attention` and :func:`attention_fp8_rows` take as ``q`` (with
    ``k=None``) in place of 16-bit q and k."""
    q: Tensor
    """int8, q's shape and layout."""
    q_scale: Tensor
    """``[B, Hq, Lq]`` fp32: one scale per query."""
    k: Tensor
    """int8, k's shape and layout: k less its mean over the sequence."""
    k_scale: Tensor
    """``[B, Hk, ceil(Lk / 128)]`` fp32: one scale per block of 128 keys."""


def _given_quantized(name: str, q, k) -> bool:
    """Whether a call passes :class:`Int8QK` as q (and then k must be None)."""
    if not isinstance(q, Int8QK):
        return False
    if k is not None:
        raise ValueError(f"{name}: q is an Int8QK (q and k quantized together), so k must be None, got "
                         f"{type(k).__name__}")
    return True


#: ``attention``'s precisions: the input dtype's own (16-bit or fp32 dots),
#: 8-bit q and k (inference; ``fused.attention_int8``), and with P V in FP8
#: too (``fused.attention_int8_fp8``, sm_89 or newer).
PRECISIONS = ("exact", "int8", "int8_fp8")
_EIGHT_BIT_OPS = {"int8": _attention_int8_op, "int8_fp8": _attention_int8_fp8_op}


#: The tag :func:`set_attention_backward` adds to torch.compile's cache keys while dq is summed in atomic
#: order. (Without it, a compile under one setting found the AOTAutograd cache's graph of the other: the
#: deterministic backward ran the five-product kernel, H100, ``test_sm90_backward_compiled_equals_eager``.)
ATOMIC_DQ_CACHE_TAG = "compile_ops.attention_atomic_dq"


def set_attention_backward(deterministic: bool = True) -> None:
    """Choose how ``fused.attention``'s backward sums dq from now on.

    ``deterministic=True`` (the default): three passes (statistics, dk/dv,
    dq; on sm_90 the dk/dv pass of dense calls is the five-product kernel
    without its dQ, ``SM90_DKDV``), the gradients bit for bit the same on
    every run. ``False``: on sm_90 GPUs, 16-bit calls at
    D = 64 or 128 (dense or block-sparse, causal or not, with key lengths or not)
    take a five-product backward whose dq is added up by TMA reductions in
    the order the GPU's programs run, so dq's last bits vary from run to run
    (dk and dv do not); forward+backward on an H100 1.05-1.17x the
    ``triton.language`` passes, causal 1.10-1.19x, block-sparse 1.11-1.26x,
    and 1.02-1.09x the default with its sm_90 dk/dv pass (README). Other calls (D
    other than 64 and 128, fp32), and
    every call while ``torch.use_deterministic_algorithms(True)`` is on,
    keep the deterministic passes. Compiled graphs take the setting that
    held when they were traced. ``False`` adds a tag to
    ``torch.compiler.config.cache_key_tag`` (``True`` removes it), so that
    torch.compile's caches (AOTAutograd's and Inductor's, in memory and on
    disk) do not hand a graph traced under one setting to a compile under
    the other: the setting is read inside the backward's trace, which their
    keys do not otherwise see.
    """
    if not isinstance(deterministic, bool):
        raise TypeError(f"set_attention_backward: deterministic must be a bool, got {type(deterministic).__name__}")
    global ATOMIC_DQ
    ATOMIC_DQ = not deterministic
    tags = [tag for tag in torch.compiler.config.cache_key_tag.split(",") if tag and tag != ATOMIC_DQ_CACHE_TAG]
    torch.compiler.config.cache_key_tag = ",".join(tags + [ATOMIC_DQ_CACHE_TAG] * ATOMIC_DQ)
    clear_launch_plans()  # plans recorded under the other setting launch the other kernels


@checked_arguments
def attention(q: Union[Tensor, Int8QK], k: Optional[Tensor], v: Tensor, scale: Optional[float] = None, causal: bool = False,
              seq_dim: int = 2, kv_lengths: Optional[Tensor] = None, return_lse: bool = False,
              precision: str = "exact"):
    """Flash attention: ``softmax(scale q k^T) v`` without materializing the scores.

    Args:
        q: ``[B, Hq, Lq, D]`` (``seq_dim=2``, SDPA's layout) or ``[B, Lq, Hq, D]``
            (``seq_dim=1``, flash-attn's / diffusers' dispatcher's), any strides;
            fp16/bf16 (fp32 runs with TF32 dots where torch's fp32 matmul
            precision allows TF32, IEEE dots otherwise); D up to 256.
            Or an :class:`Int8QK` (q and k already quantized by
            ``rope_qk``/``qk_norm_rope(..., quantize=True)``) with k None and
            an 8-bit ``precision``: the same computation, minus the
            quantization of q and k.
        k, v: ``[B, Hk, Lk, D]`` / ``[B, Lk, Hk, D]`` in q's layout and dtype;
            ``Hk`` divides ``Hq`` (GQA/MQA); Lk may differ from Lq.
        scale: defaults to ``1 / sqrt(D)``.
        causal: query i sees keys ``j <= i`` (SDPA's ``is_causal``, top-left aligned).
        kv_lengths: ``[B]`` int32/int64 or None: keys at or past
            ``kv_lengths[b]`` are ignored for batch element b (padded text tokens).
        return_lse: also return the log-sum-exp ``[B, Hq, Lq]`` fp32.
        precision: ``"exact"`` (the dots in the inputs' dtype) or ``"int8"``:
            inference on fp16/bf16 inputs with k smoothed (its mean over the
            sequence subtracted, which softmax ignores), q rounded to INT8 per
            token and k per block of 128 keys, an integer QK product and P V
            in the input dtype
            (``fused.attention_int8``; specified in
            ``compile_ops/reference/attention.py``). ``"int8_fp8"``: the
            same, and P V in FP8 too (v in e4m3 per channel, the
            probabilities rounded to e4m3; ``fused.attention_int8_fp8``;
            sm_89 or newer). A gradient through either raises; no lse.

    Returns:
        ``[B, Hq, Lq, D]`` / ``[B, Lq, Hq, D]`` in q's dtype and layout, contiguous
        (and the lse). A query with no visible key gives 0 (lse -inf).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"compile_ops.attention: precision must be one of {PRECISIONS}, got {precision!r}")
    if precision in _EIGHT_BIT_OPS and return_lse:
        raise ValueError(f"compile_ops.attention: precision={precision!r} returns no lse (inference only); "
                         "call it with return_lse=False")
    if _given_quantized("compile_ops.attention", q, k):
        if precision not in _EIGHT_BIT_OPS:
            raise ValueError(f"compile_ops.attention: q is an Int8QK (quantized q and k), which needs an 8-bit "
                             f"precision {tuple(_EIGHT_BIT_OPS)}, got precision={precision!r}")
        scale = softmax_scale("compile_ops.attention", q.q, scale)
        return _attention_qk8_op(*q, v, scale, causal, seq_dim, kv_lengths, precision == "int8_fp8", False)[0]
    scale = softmax_scale("compile_ops.attention", q, scale, "a torch.Tensor or an Int8QK")
    if precision in _EIGHT_BIT_OPS:
        op = _EIGHT_BIT_OPS[precision]
        return _dtensor.sequence_parallel(
            lambda q, k, v: op(q, k, v, scale, causal, seq_dim, kv_lengths), q, k, v, seq_dim)
    out, lse = _dtensor.sequence_parallel(
        lambda q, k, v: _attention_op(q, k, v, scale, causal, seq_dim, kv_lengths), q, k, v, seq_dim)
    return (out, lse) if return_lse else out


@checked_arguments
def attention_fp8_rows(q: Union[Tensor, Int8QK], k: Optional[Tensor], v: Tensor, scale: Optional[float] = None, causal: bool = False,
                       seq_dim: int = 2, kv_lengths: Optional[Tensor] = None) -> FP8Rows:
    """:func:`attention` with ``precision="int8_fp8"`` whose output comes as the
    FP8 rows an FP8 output projection reads (``FP8Linear``, :func:`fp8_linear`):
    the kernel writes e4m3 values and their scales in its epilogue, so the
    output is never written in 16 bits nor quantized by a pass of its own.
    Inference only (sm_89 or newer on a GPU; the exact specification,
    ``reference.attention.attention_int8_fp8_rows``, elsewhere).

    The rows' scale is a bound, not each row's amax (a row spans every head,
    a program holds one): twice the largest of v's channel scales per batch
    element, which e4m3's exponent makes as precise as a per-row scale for
    all values above 2**-6 of it (the reference's docstring says why).

    Args:
        q, k, v: as :func:`attention` (fp16/bf16, either layout, GQA), or q
            an :class:`Int8QK` and k None.
        scale, causal, kv_lengths: as :func:`attention`.
        seq_dim: q/k/v's layout (2: ``[B, H, L, D]``, 1: ``[B, L, H, D]``).

    Returns:
        ``FP8Rows(q=[B, Lq, Hq * D] float8_e4m3fn, scale=[B, Lq] fp32)``, whatever
        ``seq_dim``: the projection's input rows, heads concatenated per token.
    """
    if _given_quantized("compile_ops.attention_fp8_rows", q, k):
        refuse_gradient("compile_ops.attention_fp8_rows", v)
        scale = softmax_scale("compile_ops.attention_fp8_rows", q.q, scale)
        values, row_scale = _attention_qk8_op(*q, v, scale, causal, seq_dim, kv_lengths, True, True)
        return FP8Rows(values.flatten(2, 3), row_scale)
    refuse_gradient("compile_ops.attention_fp8_rows", q, k, v)
    scale = softmax_scale("compile_ops.attention_fp8_rows", q, scale, "a torch.Tensor or an Int8QK")
    values, row_scale = _attention_int8_fp8_rows_op(q, k, v, scale, causal, seq_dim, kv_lengths)
    return FP8Rows(values.flatten(2, 3), row_scale)


@checked_arguments
def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``'s signature, on :func:`attention`.

    Args:
        query: ``[B, Hq, Lq, D]``; key, value: ``[B, Hk, Lk, D]``.
        attn_mask, dropout_p: not supported (a mask or dropout raises; use
            ``kv_lengths`` of :func:`attention` for key padding).
        is_causal, scale: as SDPA.
        enable_gqa: as SDPA; GQA (Hk dividing Hq) is accepted either way.

    Returns:
        ``[B, Hq, Lq, D]``.
    """
    owner = "compile_ops.scaled_dot_product_attention"
    if attn_mask is not None:
        raise NotImplementedError(f"{owner}: attn_mask is not supported; pass key padding as kv_lengths to "
                                  "compile_ops.attention")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{owner}: dropout_p must be a probability in [0, 1], got {dropout_p}")
    if dropout_p != 0.0:
        raise NotImplementedError(f"{owner}: dropout_p must be 0 (no dropout), got {dropout_p}")
    # SDPA's argument names in its errors, before attention() checks them as q, k, v.
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_module_input(owner, name, t, None)
        if t.device != query.device:
            raise ValueError(f"{owner}: {name} is on {t.device} but query is on {query.device}")
    return attention(query, key, value, scale, is_causal, 2)
