"""Shape/dtype/stride rules and input validation, one module per op family (torch only)."""

from compile_ops.meta import attention, block_sparse, fp8, glu, modulate, moe, norm, rope  # noqa: F401
