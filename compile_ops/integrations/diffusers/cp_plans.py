"""Context-parallel plans for the diffusers transformers that ship none: HunyuanVideo.

diffusers' ``model.enable_parallelism(config=ContextParallelConfig(...))``
reads a model's ``_cp_plan``: which inputs to shard across ranks (and along
which dimension) and which output to gather. ``HunyuanVideoTransformer3DModel``
has none. :func:`patch` installs :func:`hunyuan_video_plan` on such a model
(an instance attribute, removed by ``unpatch``), so that it runs under
Ulysses like Wan and Flux:

- the video tokens are sharded: the first block's ``hidden_states`` and the
  rotary tables (``rope``'s two ``[L, D]`` outputs) along the sequence, and
  ``proj_out``'s output gathered back;
- the text stays whole on every rank (its stream is a few hundred tokens),
  and so does the attention mask, built before the first block over the
  whole video; the patched processor attends every rank's video tokens plus
  the text once (:func:`.ulysses.ulysses_attention`'s replicated tail), so
  the text padding mask is a prefix mask there as on one GPU.

Ring attention would visit the text's keys once a rank: refused
(:func:`.context_parallel.check_parallel_mode`). HunyuanVideo I2V's token
replacement (``image_condition_type="token_replace"``) modulates the first
frame's tokens apart, which only one rank holds: no plan is installed there.
"""

from __future__ import annotations

from torch import nn


def hunyuan_video_plan(model: nn.Module) -> dict:
    """The ``_cp_plan`` of a ``HunyuanVideoTransformer3DModel``: shard the first
    block's video tokens and the rotary tables, gather ``proj_out``'s output."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    first = "transformer_blocks.0" if len(model.transformer_blocks) else "single_transformer_blocks.0"
    rows = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)
    return {
        "rope": {0: rows, 1: rows},
        first: {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def install_plans(model: nn.Module, report, undo: list) -> None:
    """Set :func:`hunyuan_video_plan` as ``_cp_plan`` on every HunyuanVideo
    transformer in ``model`` whose class has none; ``undo`` records each (as
    ``("attribute", module, "_cp_plan", None)``), ``report`` says where none could be."""
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoTransformer3DModel

    for path, module in model.named_modules():
        if not isinstance(module, HunyuanVideoTransformer3DModel) or type(module)._cp_plan is not None:
            continue
        if getattr(module.config, "image_condition_type", None) == "token_replace":
            report.left.append(
                (
                    path or "(model)",
                    "context-parallel plan",
                    "none installed: token replacement modulates the first frame's tokens apart, which "
                    "one rank holds under a sharded sequence",
                )
            )
            continue
        module._cp_plan = hunyuan_video_plan(module)
        undo.append(("attribute", module, "_cp_plan", None))
