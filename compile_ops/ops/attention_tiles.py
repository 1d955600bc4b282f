"""The attention kernels' launch configurations: tiles by head dim, dtype and
precision (:func:`forward_tiles`, :func:`dkdv_tiles`, :func:`dq_tiles`),
and the order causal launches run their programs in (:func:`causal_order`)."""
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from compile_ops._library import l2_cache_bytes


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
    #: (kernels/attention_sm90.py) where it allows (:func:`takes_sm90_core`);
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
    take it is :func:`takes_sm90_core`'s rule."""
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


#: The share of L2 that the (batch, head) rows run at once by a causal launch
#: may fill with the tensors they all read (k and v; q and dO for dk/dv).
CAUSAL_GROUP_L2_SHARE = 4


def causal_order(shared: Tensor, length: int, rows: int) -> tuple[dict, int]:
    """``(constexprs, heads_per_group)`` of a causal launch over ``rows``
    (batch, head) rows of which each reads ``length`` positions of two
    ``shared``-like tensors (``[..., D]``: k and v, or q and dO for dk/dv).

    Causal programs differ in work by up to the sequence's tile count, so
    they run longest first (``kernels.attention_common.program_rank``), dealt out
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
LAUNCH_ORDER = (dict(HEAVY_FIRST=False), 1)
