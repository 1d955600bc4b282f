"""``patch(precision="fp8")``: the transformer blocks' Linears as :class:`FP8Linear`,
and the feed-forward GELUs that feed one as a pass that also quantizes."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from compile_ops.integrations.module_swap import PatchReport
from compile_ops.modules.fp8 import FP8Linear, FP8ProjectionActivation

#: The ModuleLists of transformer blocks in diffusers' DiTs (Flux, SD3, LTX:
#: ``transformer_blocks``; Flux: ``single_transformer_blocks``; Wan: ``blocks``).
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks")

#: Parents whose Linear projects the timestep embedding into modulation
#: vectors: one row per sample, a GEMV bound by reading its weight. In FP8
#: only with ``patch(fp8_modulation=True)``: its rounding reaches every
#: token's shift, scale and gate.
MODULATION_PARENTS = ("AdaLayerNormZero", "AdaLayerNormZeroSingle", "AdaLayerNormContinuous")


def _why_kept(parent: nn.Module, linear: nn.Linear, in_blocks: bool, modulation: bool) -> Optional[str]:
    """Why ``linear`` stays in its dtype under ``precision="fp8"`` (None: it runs
    in FP8); ``modulation``: ``patch(fp8_modulation=...)``."""
    if not in_blocks:
        return "outside the transformer blocks (embedders, final layer: a few rows or once per step)"
    if type(parent).__name__ in MODULATION_PARENTS and not modulation:
        return "AdaLN modulation projection: one row per sample (fp8_modulation=True quantizes it)"
    if linear.weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"weight dtype {linear.weight.dtype} (expected a floating point weight)"
    if linear.in_features % 16 or linear.out_features % 16:
        return (
            f"in_features={linear.in_features}, out_features={linear.out_features}: "
            "torch._scaled_mm needs both to be multiples of 16"
        )
    return None


def quantize_linears(model: nn.Module, report: PatchReport, fast_accum: bool, modulation: bool) -> None:
    """Replace the transformer blocks' Linears (with ``modulation``, their
    AdaLN modulation projections too) with :class:`FP8Linear` (weights
    quantized once per output channel; the original weight is not kept),
    and report every Linear of the model, FP8 or not, with the reason."""
    from compile_ops.ops.fp8 import check_fp8_device

    def walk(module: nn.Module, prefix: str, in_blocks: bool) -> None:
        for name, child in list(module.named_children()):
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, FP8Linear):
                continue
            if type(child) is nn.Linear:
                why = _why_kept(module, child, in_blocks, modulation)
                if why is None:
                    check_fp8_device(child.weight.device)
                    setattr(module, name, FP8Linear.from_linear(child, fast_accum))
                    report.replaced.append(
                        (
                            path,
                            "nn.Linear",
                            "compile_ops.FP8Linear (e4m3, rowwise scales"
                            + (", fast accumulation)" if fast_accum else ")"),
                        )
                    )
                else:
                    report.left.append((path, "nn.Linear", f"kept in {child.weight.dtype}: {why}"))
                continue
            if isinstance(child, nn.Linear):  # a subclass (LoRA layers, ...): its forward may differ
                report.left.append((path, type(child).__name__, "a Linear subclass: its forward is kept"))
            walk(child, path, in_blocks or (isinstance(child, nn.ModuleList) and name in BLOCK_LISTS))

    walk(model, "", False)


def is_diffusers_gelu(module: nn.Module) -> bool:
    """diffusers' ``GELU`` (a Linear ``proj`` then the activation), told by its class without importing diffusers."""
    return type(module).__name__ == "GELU" and type(module).__module__.startswith("diffusers.")


def reads_fp8_rows(ff: nn.Module) -> bool:
    """diffusers' ``FeedForward`` whose first module is its ``GELU`` (or our
    :class:`FP8ProjectionActivation` in its place) over an :class:`FP8Linear`
    (after ``patch(precision="fp8")``): it can take the seam's FP8 rows,
    since that module hands its input straight to ``proj``."""
    net = getattr(ff, "net", None)
    return (
        type(ff).__name__ == "FeedForward"
        and isinstance(net, nn.ModuleList)
        and len(net) > 0
        and (is_diffusers_gelu(net[0]) or isinstance(net[0], FP8ProjectionActivation))
        and isinstance(getattr(net[0], "proj", None), FP8Linear)
    )


def fuse_mlp_activations(model: nn.Module, report: PatchReport) -> None:
    """In every diffusers ``FeedForward`` ``[GELU(proj), Dropout(0), Linear]``
    whose two Linears run in FP8, the GELU's output is quantized in the pass
    that computes it (:class:`FP8ProjectionActivation`) and handed to the
    down projection as FP8 rows; the zero-probability Dropout between them
    (an identity) goes. Others are reported."""
    for path, ff in list(model.named_modules()):
        net = getattr(ff, "net", None)
        if type(ff).__name__ != "FeedForward" or not isinstance(net, nn.ModuleList) or len(net) < 3:
            continue
        gelu, dropout, down = net[0], net[1], net[2]
        if not (
            is_diffusers_gelu(gelu)
            and isinstance(getattr(gelu, "proj", None), FP8Linear)
            and isinstance(down, FP8Linear)
        ):
            continue
        if type(dropout) is not nn.Dropout or dropout.p != 0:
            report.left.append(
                (
                    f"{path}.net.0",
                    type(gelu).__name__,
                    f"output stays {down.out_dtype}: {dropout!r} between it and the FP8 down projection",
                )
            )
            continue
        activation = "gelu" if gelu.approximate == "none" else "gelu_tanh"
        net[0], net[1] = FP8ProjectionActivation(gelu.proj, activation), nn.Identity()
        fused = f"{path}.net.0"
        report.left[:] = [entry for entry in report.left if entry[0] != fused]  # "no fused op": now there is
        report.replaced.append(
            (
                fused,
                "diffusers GELU",
                f"compile_ops FP8ProjectionActivation ({activation} "
                "computed and quantized for the FP8 down projection in one pass)",
            )
        )
