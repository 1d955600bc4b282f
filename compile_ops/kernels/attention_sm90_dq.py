"""dQ in the Hopper (sm_90) attention backward (``kernels/attention_sm90_backward.py``
with ``DQ``): a consumer group's channels of each step's dS K, added into the
fp32 accumulator by TMA bulk reductions in the order the programs run.
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

#: dQ's fp32 channels per TMA reduction: 128-byte rows, the reductions' 128-byte swizzle.
DQ_PIECE = gl.constexpr(32)


@builtin
def _tma_add(tensor_desc, coord, src, _semantic=None):
    """Add the shared-memory tile ``src`` into the global tile of ``tensor_desc``
    at ``coord`` (a TMA bulk reduction, ``cp.reduce.async.bulk.tensor ...
    add``, asynchronous, committed as a bulk group like a TMA store): Gluon
    3.6 builds the operation but exports no function for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def bwd_dq_step(dq_args, k_smem, dq_zero, head_row, m0, buf, i, W: gl.constexpr):
    """Consumer group W's share of one step's dQ (the five-product kernel's
    DQ): once both groups' halves of dS^T are in ``ds_smem`` (``ds_full``),
    dQ's channels ``D / 2 * W`` on = dS K over the tile's 128 keys, added
    into DQ_ACC's rows ``m0`` on of (batch, q head) row ``head_row`` by TMA
    reductions of STEP x 32 (``DQ_PIECE`` channels each: two at D = 128, one
    at D = 64; the next step rewrites their buffers once the reductions
    have read them: a second set of buffers is no faster,
    docs/notes/attention.md)."""
    dqa_desc, ds_smem, dq_smem, ds_full = dq_args
    D: gl.constexpr = k_smem.shape[1]
    STEP: gl.constexpr = ds_smem.shape[2]
    HALF: gl.constexpr = D // 2  # this group's dQ channels, from HALF * W
    PIECES: gl.constexpr = HALF // DQ_PIECE
    mbarrier.wait(ds_full.index(buf), (i // 2) & 1)
    ds_t = ds_smem.index(buf).permute((1, 0))  # dS: [STEP queries, 128 keys]
    first = warpgroup_mma(ds_t, k_smem.slice(HALF * W, DQ_PIECE, dim=1), dq_zero, use_acc=False, is_async=True)
    if PIECES == 2:
        second = warpgroup_mma(
            ds_t, k_smem.slice(HALF * W + DQ_PIECE, DQ_PIECE, dim=1), dq_zero, use_acc=False, is_async=True
        )
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
    _tma_add(dqa_desc, [head_row, m0, HALF * W], dq_smem.index(PIECES * W).reshape([1, STEP, DQ_PIECE]))
    if PIECES == 2:
        _tma_add(
            dqa_desc, [head_row, m0, HALF * W + DQ_PIECE], dq_smem.index(PIECES * W + 1).reshape([1, STEP, DQ_PIECE])
        )
