"""What the Hopper (sm_90) attention kernels in Gluon share: the forward core
(``kernels/attention_sm90.py``) and the backward (``kernels/attention_sm90_backward.py``)
split their rows between consumer warp groups of one wgmma's M and move tiles by 4-D
TMA descriptors over whole tensors."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

LOG2E = gl.constexpr(1.4426950408889634)
#: Rows per consumer warp group (queries in the forward, keys in the backward): one wgmma's M.
WGMMA_ROWS = gl.constexpr(64)


@gluon.jit
def tma_box(buffer):
    """A ``[rows, cols]`` shared-memory matrix as the ``[1, 1, rows, cols]`` box of a 4-D TMA descriptor."""
    return buffer.reshape([1, 1, buffer.shape[0], buffer.shape[1]])
