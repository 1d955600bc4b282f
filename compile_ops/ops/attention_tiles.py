"""The attention kernels' launch configurations: tiles by head dim, dtype and
precision (:func:`forward_tiles`, :func:`dkdv_tiles`, :func:`dq_tiles`),
and the order causal launches run their programs in (:func:`causal_order`)."""

from dataclasses import dataclass
from typing import Optional

import torch
import triton
from torch import Tensor

from compile_ops._library import l2_cache_bytes


@dataclass(frozen=True)
class Tiles:
    """A launch's tiles: ``block_m`` queries by ``block_n`` keys (the dk/dv
    pass: ``block_n`` keys per program in ``block_m``-query steps), on
    ``num_warps`` warps with ``num_stages`` pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    #: Forward only, Hopper (kernels/attention.py's ``_fwd_tiles``): K/V by
    #: TMA tensor descriptors (taken only where the tensors are aligned for it),
    #: the accumulator as the second dot's operand, warp-specialized key loop.
    tma: bool = False
    dot_acc: bool = False
    warp_specialize: bool = False
    #: Forward only, sm_90: the call runs on the warp-specialized Gluon core
    #: (kernels/attention_sm90.py) where it allows (:func:`takes_sm90_core`);
    #: block_m, block_n and num_stages are then the core's.
    sm90_core: bool = False
    #: Forward only: a register cap a thread (Triton's ``maxnreg``), or None. Inductor's
    #: launch configs cannot carry it, so traced calls launch such tiles from an opaque op.
    maxnreg: Optional[int] = None


def block_d(d: int) -> int:
    """D padded to a power of two of at least 16 (tl.dot's smallest K)."""
    return max(16, triton.next_power_of_2(d))


#: Head dims the sm_90 core takes (it needs D a power of two for its tiles), and its key tiles at each
#: (:func:`forward_tiles`): 128 keys at D = 128, 256 at D = 64.
SM90_CORE_HEAD_DIMS = (64, 128)
#: The precisions the sm_90 core runs: ``"exact"`` (16-bit). ``"int8_fp8"`` with q given in int8 (its INT8_FP8
#: mode) is built and tested (bit-identical to ``attn_fwd_kernel``) but not ahead of the portable kernel (its P
#: goes through shared memory), so the 8-bit modes stay portable (docs/notes/attention.md).
SM90_CORE_PRECISIONS = ("exact",)
#: The core's K/V ring: more stages are no faster (docs/notes/attention.md).
SM90_CORE_STAGES = 2
#: The portable ``int8_fp8`` forward's register cap on sm_90: at 2 stages three 64 x 128 programs fit an SM's
#: shared memory, and under this cap its registers too (uncapped, two fit); the third program's overlap pays
#: for the spills (docs/notes/attention-8bit.md).
INT8_FP8_MAXNREG = 168


def forward_tiles(
    d: int,
    dtype: torch.dtype,
    tma: bool = False,
    precision: str = "exact",
    wgmma: bool = False,
    register_cap: bool = False,
) -> Tiles:
    """``attn_fwd_kernel``'s tiles by padded head dim ``d``, ``dtype`` and
    ``precision``, chosen by sweeps (``bench/sweeps/attention.py``; the
    figures are in docs/notes/attention.md). ``tma``: the GPU has TMA
    (``_library.has_tma``): D=128 then loads K and V by tensor descriptors
    (warp specialization and the accumulator as a dot operand stay off:
    they did not pay).

    ``precision``: the 8-bit modes (``"int8"``, ``"int8_fp8"``) at D=128 take
    64 queries in one warp group: several small programs per SM overlap
    one's softmax with another's MMAs. FP8 P V's key tiles are the
    specification's 128 (reference.attention.FP8_PV_TILE) at every D.

    ``wgmma`` (the GPU is sm_90, ``_library.has_wgmma``): 16-bit calls at
    the head dims of :data:`SM90_CORE_HEAD_DIMS` take the warp-specialized
    core, 128 queries x 128 keys, 2 K/V stages, ahead of the
    ``triton.language`` kernel. At D = 64 each tile's products halve while
    its softmax stays, so the core takes 256-key tiles (its wide form, P V
    folded in before each softmax for registers); which calls take it is
    :func:`takes_sm90_core`'s rule.

    ``register_cap`` (sm_90, where the call may go through an opaque op:
    ``attention_sm90.can_run_gluon``): ``"int8_fp8"`` at D <= 128 takes 2
    stages under :data:`INT8_FP8_MAXNREG`, three programs an SM."""
    bd = block_d(d)
    if (
        wgmma
        and precision in SM90_CORE_PRECISIONS
        and d in SM90_CORE_HEAD_DIMS
        and dtype in (torch.float16, torch.bfloat16)
    ):
        return Tiles(128, 256 if d == 64 else 128, 4, SM90_CORE_STAGES, tma=True, sm90_core=True)
    if precision == "int8_fp8" and bd <= 128 and register_cap:
        return Tiles(64, 128, 4, 2, tma=tma, maxnreg=INT8_FP8_MAXNREG)
    if precision == "int8_fp8":
        return Tiles(64, 128, 4, 3, tma=tma) if bd <= 128 else Tiles(64, 128, 8, 2, tma=tma)
    if precision == "int8" and 64 < bd <= 128:
        return Tiles(64, 128, 4, 2, tma=tma)
    if dtype in (torch.float32, torch.float64):
        return Tiles(32, 32, 4, 2)  # fp32 operands take twice the shared memory
    if bd <= 64:
        return Tiles(128, 64, 8, 3)
    if bd <= 128:
        return Tiles(128, 128, 8, 3, tma=tma)
    return Tiles(64, 32, 4, 2)


def dkdv_tiles(d: int, dtype: torch.dtype, sparse: bool = False, tma: bool = False) -> Tiles:
    """dk/dv pass: ``block_n`` keys per program, ``block_m``-query steps.
    ``tma`` (the GPU has it): at D=128, 16-bit, the steps' q and dO tiles
    come by TMA, dense and block-sparse (docs/notes/attention.md)."""
    bd = block_d(d)
    if dtype in (torch.float32, torch.float64) or bd > 128:
        return Tiles(16, 32, 4, 2)
    if bd <= 64:
        return Tiles(32, 128, 4, 3)
    # D=128: the sweep's best. Block-sparse loops (an index load feeds each step's addresses) pipeline
    # better at 2 stages, dense ones at 3 (docs/notes/attention.md).
    return Tiles(64, 128, 8, 2 if sparse else 3, tma=tma)


def dq_tiles(d: int, dtype: torch.dtype, sparse: bool = False, tma: bool = False) -> Tiles:
    """dq pass: ``block_m`` queries per program, ``block_n``-key steps; ``tma``
    as :func:`dkdv_tiles` (the steps' k and v tiles), dense only: the
    block-sparse pass is no faster by TMA (docs/notes/attention.md)."""
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
    they run longest first (``kernels.attention_common.program_rank``),
    dealt out across groups of rows whose shared bytes fill about a quarter
    of L2: the rule fits the best groups of a sweep over sequence lengths
    (docs/notes/attention.md, "Causal programs, longest first")."""
    # sym_max/sym_min: under dynamic shapes the group stays symbolic (a kernel argument), not a guard.
    row_bytes = torch.sym_max(2 * length * shared.shape[-1] * shared.element_size(), 1)
    group = torch.sym_max(l2_cache_bytes(shared) // CAUSAL_GROUP_L2_SHARE // row_bytes, 1)
    return dict(HEAVY_FIRST=True), torch.sym_min(group, torch.sym_max(rows, 1))


#: The order of every other launch: as launched (non-causal tiles all do the same work).
LAUNCH_ORDER = (dict(HEAVY_FIRST=False), 1)
