"""Pure-PyTorch implementations, one module per op family: the CPU path and the test oracle."""

from compile_ops.reference import attention, block_sparse, fp8, glu, modulate, moe, norm, rope  # noqa: F401
