"""``compile_ops.patch(model)``: the fused ops inside a diffusers transformer.

Modules are swapped by what they compute (:mod:`.module_rules`): a module is
replaced only when its class is exactly one of diffusers' (or torch's)
classes whose forward we reproduce and its configuration is one our module
covers; a subclass, which may override ``forward``, is left alone.
Replacements share the original's parameters and ``nn.Linear`` submodules
(weights, LoRA wrappers and optimizer state stay valid), so :func:`unpatch`
only has to put the originals back.

Attention goes through diffusers' own extension point, the attention
processor (:mod:`.processors`): ours run the same projections, q/k-norm and
rotary embeddings with the fused ops, attention with ``fused.attention`` or
SDPA (:mod:`.attention_kernel`), and hand any call they do not cover to the
original processor.

Blocks have no extension point for their gated residuals, so the blocks
whose forward we reproduce (:mod:`.blocks`: Flux's double- and single-stream
blocks, Wan's block) are swapped for ones that run their seams as fused ops.
SD3's and LTX-Video's blocks keep their forward (their norms, activations and
attention are patched inside) and are reported, as is a lone tanh-GELU after
a Linear (no fused op here; ``torch.compile`` fuses it).

``precision="fp8"`` (:mod:`.fp8_linears`) and sparse video self-attention
(:mod:`.sparse_models`) are applied after the swaps; :mod:`.patching` holds
the walk and the undo record. The options are
:class:`~compile_ops.integrations.options.PatchOptions`.
"""

from compile_ops.integrations.diffusers.attention_kernel import (
    FUSED_AHEAD_FROM_KEYS,
    FUSED_AHEAD_HEAD_DIM,
    FUSED_AHEAD_RAGGED_FROM_KEYS,
    RAGGED_KEY_TILE,
    sdpa_is_faster,
)
from compile_ops.integrations.diffusers.blocks import (
    FluxSingleTransformerBlock,
    FluxTransformerBlock,
    WanTransformerBlock,
)
from compile_ops.integrations.diffusers.fp8_linears import BLOCK_LISTS
from compile_ops.integrations.diffusers.patching import patch, unpatch
from compile_ops.integrations.diffusers.processors import (
    FluxAttnProcessor,
    FusedProcessor,
    HunyuanVideoAttnProcessor,
    JointAttnProcessor,
    LTXVideoAttnProcessor,
    WanAttnProcessor,
)
from compile_ops.integrations.module_swap import PatchReport
from compile_ops.integrations.options import PatchOptions

__all__ = [
    "patch",
    "unpatch",
    "PatchOptions",
    "PatchReport",
    "BLOCK_LISTS",
    "FUSED_AHEAD_FROM_KEYS",
    "FUSED_AHEAD_RAGGED_FROM_KEYS",
    "RAGGED_KEY_TILE",
    "FUSED_AHEAD_HEAD_DIM",
    "sdpa_is_faster",
    "FusedProcessor",
    "FluxAttnProcessor",
    "WanAttnProcessor",
    "JointAttnProcessor",
    "LTXVideoAttnProcessor",
    "HunyuanVideoAttnProcessor",
    "FluxTransformerBlock",
    "FluxSingleTransformerBlock",
    "WanTransformerBlock",
]
