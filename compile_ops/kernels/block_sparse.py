"""Triton kernels of the block-sparse attention family. Its attention itself
runs the flash-attention kernels of ``kernels/attention.py`` (``SPARSE``);
here is what prepares their block lists.

``sort_block_lists_kernel``: each row's first ``count`` entries sorted
ascending, the rest set to the dtype's largest value (the order the
attention kernels walk the lists in; ``reference.block_sparse.ascending``
specifies it). A kernel rather than torch ops, so that an eager call's
launches are all the op's own and can be replayed (``compile_ops._replay``).
Rows are sorted whole in registers (``tl.sort``, a bitonic network over
``BLOCK_W``, the lists' width rounded up to a power of two).
"""

import triton
import triton.language as tl


@triton.jit
def sort_block_lists_kernel(
    INDEX,
    COUNT,
    OUT,
    H1,
    NQ,
    W,
    rows,
    sib,
    sih,
    siq,
    siw,
    scb,
    sch,
    scq,
    BLOCK_W: tl.constexpr,
    ROWS: tl.constexpr,
    UNUSED: tl.constexpr,
):
    """``ROWS`` lists of ``INDEX [B1, H1, NQ, W]`` (any strides) with their
    counts ``COUNT [B1, H1, NQ]``, sorted into ``OUT`` (contiguous, INDEX's
    shape and dtype); ``rows`` = B1 * H1 * NQ."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    in_rows = r < rows
    q = r % NQ
    b = r // NQ // H1
    h = r // NQ % H1
    count = tl.load(COUNT + b * scb + h * sch + q * scq, mask=in_rows, other=0)
    cols = tl.arange(0, BLOCK_W)
    listed = in_rows[:, None] & (cols[None, :] < count[:, None])
    entries = tl.load(INDEX + (b * sib + h * sih + q * siq)[:, None] + cols[None, :] * siw, mask=listed, other=UNUSED)
    tl.store(OUT + r[:, None] * W + cols[None, :], tl.sort(entries, dim=1), mask=in_rows[:, None] & (cols[None, :] < W))
