"""compile_ops: fused Triton kernels for diffusion transformers, as ``torch.ops.fused.*`` ops.

Importing the package registers the ops; the public functions and modules are
re-exported here.
"""

import torch

from compile_ops import (
    _cache_key,
    ops,  # noqa: F401  (registers torch.ops.fused.*)
)
from compile_ops import distributed as _distributed
from compile_ops.integrations.attention_backend import register_diffusers_backend
from compile_ops.integrations.options import PatchOptions, takes_patch_options
from compile_ops.integrations.sparse_attention import Radial, SlidingTile, TopK
from compile_ops.meta._validate import checked_arguments
from compile_ops.meta.rope import GridRope, grid_rope
from compile_ops.modules.fp8 import FP8Linear, FP8ProjectionActivation
from compile_ops.modules.glu import GEGLU, SwiGLU
from compile_ops.modules.modulate import AdaLayerNormContinuous, AdaLayerNormZero, AdaLayerNormZeroSingle
from compile_ops.modules.moe import MoEFeedForward
from compile_ops.modules.norm import LayerNorm, RMSNorm
from compile_ops.ops.attention import (
    Int8QK,
    attention,
    attention_fp8_rows,
    scaled_dot_product_attention,
    set_attention_backward,
)
from compile_ops.ops.block_sparse import (
    BlockSparseMask,
    block_index_from_mask,
    block_sparse_attention,
    block_sparse_attention_fp8_rows,
    radial_mask,
    sliding_tile_block_mask,
    sliding_tile_mask,
    tile_permutation,
    topk_block_index,
)
from compile_ops.ops.fp8 import FP8Rows, fp8_linear, fp8_rows_lora, quantize_fp8_rows
from compile_ops.ops.glu import geglu, swiglu
from compile_ops.ops.modulate import (
    gated_residual,
    gated_residual_norm_modulate,
    gated_residual_norm_modulate_fp8,
    modulate,
    norm_modulate,
    norm_modulate_fp8,
)
from compile_ops.ops.moe import moe_route
from compile_ops.ops.norm import add_rmsnorm, layernorm, rmsnorm
from compile_ops.ops.rope import qk_norm_rope, rope, rope_grid, rope_qk

# DTensor sharding rules for every op (a no-op without torch.distributed); see
# compile_ops/distributed.py for why this happens at import.
_distributed.register()
# torch.compile's caches key graphs by op names, not op bodies: our sources go in their keys.
_cache_key.register()


def _check_model(owner: str, model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{owner}: model must be a torch.nn.Module, got {type(model).__name__}")


@checked_arguments
@takes_patch_options
def patch(model, **options):
    """Swap the fused ops into a model, in place, and return a report of what
    was replaced and what was left (``print`` it).

    ``model``: a diffusers transformer (Flux, SD3, Wan, LTX-Video,
    HunyuanVideo, ... or any ``nn.Module`` holding their modules; see
    :func:`compile_ops.integrations.diffusers.patch`) or a Hugging Face
    transformers Llama / Qwen2 model (:func:`compile_ops.integrations.transformers.patch`).
    The options, keyword-only, are
    :class:`~compile_ops.integrations.options.PatchOptions`' fields: among
    them ``precision="fp8"`` (FP8 Linears in the blocks),
    ``attention=SlidingTile(...)`` / ``Radial(...)`` / ``TopK(...)`` (sparse
    video self-attention) and ``attention_precision="int8"`` (8-bit dense
    attention for inference). A wrong option raises an error naming it."""
    _check_model("compile_ops.patch", model)
    options = PatchOptions.from_keywords(options)
    from compile_ops.integrations import transformers as _transformers

    if _transformers.is_transformers_model(model):
        return _transformers.patch(model, options)
    from compile_ops.integrations.diffusers import patch as _patch

    return _patch(model, options)


def unpatch(model) -> None:
    """Undo :func:`patch` on ``model`` (the patched ``nn.Module``): the original
    modules and attention processors go back; see
    :func:`compile_ops.integrations.diffusers.unpatch`."""
    _check_model("compile_ops.unpatch", model)
    from compile_ops.integrations.diffusers import unpatch as _unpatch

    _unpatch(model)


__version__ = "0.1.0"

__all__ = [
    "rmsnorm",
    "add_rmsnorm",
    "layernorm",
    "RMSNorm",
    "LayerNorm",
    "modulate",
    "norm_modulate",
    "gated_residual",
    "gated_residual_norm_modulate",
    "norm_modulate_fp8",
    "gated_residual_norm_modulate_fp8",
    "AdaLayerNormZero",
    "AdaLayerNormZeroSingle",
    "AdaLayerNormContinuous",
    "rope",
    "rope_qk",
    "rope_grid",
    "qk_norm_rope",
    "grid_rope",
    "GridRope",
    "geglu",
    "swiglu",
    "GEGLU",
    "SwiGLU",
    "attention",
    "attention_fp8_rows",
    "Int8QK",
    "scaled_dot_product_attention",
    "set_attention_backward",
    "moe_route",
    "MoEFeedForward",
    "block_sparse_attention",
    "block_sparse_attention_fp8_rows",
    "BlockSparseMask",
    "block_index_from_mask",
    "sliding_tile_mask",
    "tile_permutation",
    "radial_mask",
    "topk_block_index",
    "sliding_tile_block_mask",
    "FP8Linear",
    "FP8ProjectionActivation",
    "FP8Rows",
    "fp8_linear",
    "quantize_fp8_rows",
    "fp8_rows_lora",
    "SlidingTile",
    "Radial",
    "TopK",
    "register_diffusers_backend",
    "patch",
    "unpatch",
]
