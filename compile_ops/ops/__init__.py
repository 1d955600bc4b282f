"""Op definitions, one module per op family; importing a module registers its torch.ops.fused.* ops."""

from compile_ops.ops import attention, block_sparse, fp8, glu, modulate, moe, norm, rope  # noqa: F401
