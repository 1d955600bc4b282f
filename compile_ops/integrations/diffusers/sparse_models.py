"""``patch(attention=...)``: the video DiTs whose self-attention can run sparse,
and the attachment of one :class:`SparseAttention` plan to their processors.

Each model's forward pre-hook reads its latent grid (and, where text shares
the attention, its text length) from the call; see
``compile_ops/integrations/sparse_attention.py`` for the plan.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from compile_ops.integrations.diffusers.processors import FusedProcessor
from compile_ops.integrations.module_swap import PatchReport
from compile_ops.integrations.sparse_attention import SparseAttention, TopK


def _wan_grid(model, args, kwargs) -> tuple:
    """Wan's token grid: its ``[B, C, F, H, W]`` latents over the patch size."""
    latents = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    return tuple(n // p for n, p in zip(latents.shape[2:], model.config.patch_size))


def _ltx_grid(model, args, kwargs) -> Optional[tuple]:
    """LTX-Video's token grid, from the ``num_frames/height/width`` it is called
    with (None when they are not given: the call runs dense)."""
    names = ("num_frames", "height", "width")
    dims = [kwargs.get(n, args[4 + i] if len(args) > 4 + i else None) for i, n in enumerate(names)]
    if any(d is None for d in dims):
        return None
    t, p = model.config.patch_size_t, model.config.patch_size
    return (int(dims[0]) // t, int(dims[1]) // p, int(dims[2]) // p)


def _hunyuan_grid(model, args, kwargs) -> tuple:
    """HunyuanVideo's token grid: its ``[B, C, F, H, W]`` latents over the patch size."""
    latents = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    t, p = model.config.patch_size_t, model.config.patch_size
    return (latents.shape[2] // t, latents.shape[3] // p, latents.shape[4] // p)


def _hunyuan_text(model, args, kwargs) -> int:
    """HunyuanVideo's text tokens, which follow the video tokens in every attention."""
    text = kwargs["encoder_hidden_states"] if "encoder_hidden_states" in kwargs else args[2]
    return text.shape[1]


def _sparse_models() -> dict:
    """``{model class: (grid function, self-attention module name, text function)}``:
    the video DiTs whose self-attention can run sparse (text function: the text
    tokens in the same attention, or None where text is cross-attended)."""
    from diffusers import HunyuanVideoTransformer3DModel, LTXVideoTransformer3DModel, WanTransformer3DModel

    return {
        WanTransformer3DModel: (_wan_grid, "attn1", None),
        LTXVideoTransformer3DModel: (_ltx_grid, "attn1", None),
        HunyuanVideoTransformer3DModel: (_hunyuan_grid, "attn", _hunyuan_text),
    }


def attach_sparse_attention(model: nn.Module, config, report: PatchReport, undo: list) -> None:
    """Give the model's video self-attention processors one SparseAttention plan
    and the forward pre-hook that picks its layout per call."""
    kind = _sparse_models().get(type(model))
    if kind is None:
        raise TypeError(
            f"compile_ops.patch: sparse attention covers "
            f"{', '.join(c.__name__ for c in _sparse_models())}; got {type(model).__name__}"
        )
    grid_of, self_attention, text_of = kind
    layers = [
        (path, m)
        for path, m in model.named_modules()
        if path.rpartition(".")[2] == self_attention and isinstance(getattr(m, "processor", None), FusedProcessor)
    ]
    if not layers:
        raise RuntimeError(
            "compile_ops.patch: sparse attention needs compile_ops' attention processors "
            "(attention_processors=True), and none was installed on the self-attention layers"
        )
    if text_of is not None and isinstance(config, TopK):
        raise ValueError(
            f"compile_ops.patch: TopK covers video-only self-attention; {type(model).__name__} attends "
            "to video and text together: use SlidingTile or Radial"
        )
    plan = SparseAttention(config, grid_of, len(layers), text_of)
    for path, module in layers:
        module.processor.sparse = plan
        report.replaced.append((path, "self-attention", f"compile_ops block-sparse attention ({config})"))
    handle = model.register_forward_pre_hook(plan.pre_forward, with_kwargs=True)
    undo.append(("hook", handle, None, None))
    report.sparse_attention = plan
