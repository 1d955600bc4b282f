"""``patch(precision="fp8")``: the transformer blocks' Linears as :class:`FP8Linear`,
the feed-forward GELUs that feed one as a pass that also quantizes, and diffusers'
``fuse_qkv_projections()`` after the patch."""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType
from typing import Optional

import torch
from torch import nn

from compile_ops.integrations.diffusers.module_rules import FUSED_PROJECTIONS
from compile_ops.integrations.module_swap import PatchReport
from compile_ops.modules.fp8 import FP8Linear, FP8ProjectionActivation, fp8_base, takes_fp8_rows

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


def peft_glue() -> Optional[ModuleType]:
    """:mod:`compile_ops.integrations.peft` with its LoRA dispatcher registered, or
    None without peft (then no model holds a peft adapter layer)."""
    if importlib.util.find_spec("peft") is None:
        return None
    from compile_ops.integrations import peft as glue

    glue.register()
    return glue


def _fp8_detail(fast_accum: bool) -> str:
    return "compile_ops.FP8Linear (e4m3, rowwise scales" + (", fast accumulation)" if fast_accum else ")")


def quantize_linears(model: nn.Module, report: PatchReport, fast_accum: bool, modulation: bool) -> None:
    """Replace the transformer blocks' Linears (with ``modulation``, their
    AdaLN modulation projections too) with :class:`FP8Linear` (weights
    quantized once per output channel; the original weight is not kept),
    and report every Linear of the model, FP8 or not, with the reason.

    A Linear under a peft LoRA layer is quantized by the same rules (its
    parent is the LoRA layer's), and the layer becomes an ``FP8LoraLinear``
    over it; the adapters' own Linears (A, B) stay in their dtype, and a
    layer whose adapters FP8 cannot run (DoRA, ...) keeps its Linear.
    peft's dispatcher is registered here, so adapters added later land on
    the FP8 Linears too."""
    from compile_ops.ops.fp8 import check_fp8_device

    glue = peft_glue()

    def quantize(parent: nn.Module, linear: nn.Linear, path: str, in_blocks: bool) -> Optional[FP8Linear]:
        why = _why_kept(parent, linear, in_blocks, modulation)
        if why is not None:
            report.left.append((path, "nn.Linear", f"kept in {linear.weight.dtype}: {why}"))
            return None
        check_fp8_device(linear.weight.device)
        return FP8Linear.from_linear(linear, fast_accum)

    def adapter_layer(parent: nn.Module, layer: nn.Module, path: str, in_blocks: bool) -> None:
        base = layer.get_base_layer()
        for kind in ("lora_A", "lora_B"):
            for name, adapter in getattr(layer, kind, {}).items():
                dtype = adapter.weight.dtype
                detail = f"a LoRA adapter's own weight: kept in {dtype} (its delta runs beside the base Linear)"
                report.left.append((f"{path}.{kind}.{name}", type(adapter).__name__, detail))
        base_path = f"{path}.base_layer"
        if type(base) is not nn.Linear:
            return
        why = glue.why_layer_not_fp8(layer)
        if why is not None:
            report.left.append(
                (base_path, "nn.Linear", f"kept in {base.weight.dtype}: under a peft adapter layer: {why}")
            )
            return
        fp8 = quantize(parent, base, base_path, in_blocks)
        if fp8 is not None:
            glue.to_fp8(layer, fp8)
            detail = f"{_fp8_detail(fast_accum)} under compile_ops FP8LoraLinear (LoRA beside it in {fp8.out_dtype})"
            report.replaced.append((base_path, "nn.Linear", detail))

    def walk(module: nn.Module, prefix: str, in_blocks: bool) -> None:
        for name, child in list(module.named_children()):
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, FP8Linear):
                continue
            if glue is not None and glue.is_adapter_layer(child):
                if not isinstance(child, glue.FP8LoraLinear):
                    adapter_layer(module, child, path, in_blocks)
                continue  # the adapters' own Linears are not the model's
            if type(child) is nn.Linear:
                fp8 = quantize(module, child, path, in_blocks)
                if fp8 is not None:
                    setattr(module, name, fp8)
                    report.replaced.append((path, "nn.Linear", _fp8_detail(fast_accum)))
                continue
            if isinstance(child, nn.Linear):  # a subclass: its forward may differ
                report.left.append((path, type(child).__name__, "a Linear subclass: its forward is kept"))
            walk(child, path, in_blocks or (isinstance(child, nn.ModuleList) and name in BLOCK_LISTS))

    walk(model, "", False)
    let_fp8_projections_fuse(model)


def is_diffusers_gelu(module: nn.Module) -> bool:
    """diffusers' ``GELU`` (a Linear ``proj`` then the activation), told by its class without importing diffusers."""
    return type(module).__name__ == "GELU" and type(module).__module__.startswith("diffusers.")


def reads_fp8_rows(ff: nn.Module) -> bool:
    """diffusers' ``FeedForward`` whose first module is its ``GELU`` (or our
    :class:`FP8ProjectionActivation` in its place) over a module that takes FP8
    rows (``patch(precision="fp8")``'s FP8Linear, or a LoRA layer over it): it can take the seam's FP8 rows,
    since that module hands its input straight to ``proj``."""
    net = getattr(ff, "net", None)
    return (
        type(ff).__name__ == "FeedForward"
        and isinstance(net, nn.ModuleList)
        and len(net) > 0
        and (is_diffusers_gelu(net[0]) or isinstance(net[0], FP8ProjectionActivation))
        and takes_fp8_rows(getattr(net[0], "proj", None))
    )


def _computes_in_fp8(module: Optional[nn.Module]) -> bool:
    """An FP8Linear, or a LoRA layer over one."""
    return module is not None and fp8_base(module) is not None


def fuse_mlp_activations(model: nn.Module, report: PatchReport) -> None:
    """In every diffusers ``FeedForward`` ``[GELU(proj), Dropout(0), Linear]``
    whose two Linears run in FP8, the GELU's output is quantized in the pass
    that computes it (:class:`FP8ProjectionActivation`) and handed to the
    down projection as FP8 rows; the zero-probability Dropout between them
    (an identity) goes. Others are reported. Either Linear may be under a
    LoRA layer (added before or after patch): its adapters read the rows
    the FP8 GEMM reads, dequantized."""
    for path, ff in list(model.named_modules()):
        net = getattr(ff, "net", None)
        if type(ff).__name__ != "FeedForward" or not isinstance(net, nn.ModuleList) or len(net) < 3:
            continue
        gelu, dropout, down = net[0], net[1], net[2]
        if not (is_diffusers_gelu(gelu) and _computes_in_fp8(gelu.proj) and _computes_in_fp8(down)):
            continue
        if type(dropout) is not nn.Dropout or dropout.p != 0:
            report.left.append(
                (
                    f"{path}.net.0",
                    type(gelu).__name__,
                    f"output stays {fp8_base(down).out_dtype}: {dropout!r} between it and the FP8 down projection",
                )
            )
            continue
        activation = "gelu" if gelu.approximate == "none" else "gelu_tanh"
        net[0], net[1] = FP8ProjectionActivation(gelu.proj, activation, reader=(net, 2)), nn.Identity()
        fused = f"{path}.net.0"
        report.left[:] = [entry for entry in report.left if entry[0] != fused]  # "no fused op": now there is
        report.replaced.append(
            (
                fused,
                "diffusers GELU",
                f"compile_ops FP8ProjectionActivation ({activation} "
                "computed and quantized for the FP8 down projection in one pass; unquantized while a LoRA "
                "layer wraps the down projection)",
            )
        )


#: Every projection some fused Linear of :data:`FUSED_PROJECTIONS` is built from.
_PROJECTIONS = tuple(dict.fromkeys(name for names in FUSED_PROJECTIONS.values() for name in names))


def let_fp8_projections_fuse(model: nn.Module) -> None:
    """Give every attention layer of ``model`` whose projections are FP8 an
    instance ``fuse_projections`` (:func:`fuse_fp8_projections` over its
    class's), so that diffusers' ``fuse_qkv_projections()``, which reads
    weights FP8Linear does not keep, also works after ``patch``."""
    for module in model.modules():
        method = getattr(type(module), "fuse_projections", None)
        if callable(method) and "fuse_projections" not in vars(module) and _fp8_projections(module):
            module.fuse_projections = functools.partial(fuse_fp8_projections, module, method)


def _fp8_projections(attn: nn.Module) -> dict:
    """``{name: FP8Linear}`` of ``attn``'s projections that run in FP8 (under a LoRA layer or not)."""
    bases = {name: fp8_base(getattr(attn, name, None)) for name in _PROJECTIONS}
    return {name: base for name, base in bases.items() if base is not None}


@torch.no_grad()
def fuse_fp8_projections(attn: nn.Module, fuse_projections, *args, **kwargs) -> None:
    """``fuse_projections`` (diffusers' method, unbound) on ``attn``, whose
    projections are FP8Linears. diffusers' method runs on meta stand-ins of
    them (it reads their shapes, dtype and bias, and concatenates weights that
    are not kept); each fused Linear it makes becomes an FP8Linear whose codes,
    scales and bias are the projections' concatenated: the bytes that fusing
    before ``patch`` quantizes to, since the scales are per output row. As in
    diffusers, a LoRA layer's base projection is fused and its adapters stay
    on the separate projection, which the fused path does not call."""
    fp8 = _fp8_projections(attn)
    others = [name for name in _PROJECTIONS if name not in fp8 and getattr(attn, name, None) is not None]
    if not fp8:
        return fuse_projections(attn, *args, **kwargs)
    if others:
        raise ValueError(
            f"compile_ops: fuse_projections on a {type(attn).__name__} whose {', '.join(fp8)} run in FP8 "
            f"and {', '.join(others)} do not: their weights cannot be concatenated; call "
            "fuse_qkv_projections() before compile_ops.patch(precision='fp8')"
        )
    children = dict(attn.named_children())
    try:
        for name, base in fp8.items():
            has_bias = base.bias is not None
            stand_in = nn.Linear(base.in_features, base.out_features, has_bias, device="meta", dtype=base.out_dtype)
            setattr(attn, name, stand_in)
        fuse_projections(attn, *args, **kwargs)
    finally:
        for name in fp8:
            setattr(attn, name, children[name])
    made = {name: fused for name, fused in attn.named_children() if children.get(name) is not fused}
    try:
        fp8_fused = {name: _concatenated(attn, name, fused, fp8) for name, fused in made.items()}
    except ValueError:
        for name in made:  # leave the layer unfused, as it was, rather than holding meta Linears
            delattr(attn, name)
        attn.fused_projections = False
        raise
    for name, fused in fp8_fused.items():
        setattr(attn, name, fused)


def _concatenated(attn: nn.Module, name: str, fused: nn.Module, fp8: dict) -> FP8Linear:
    """The FP8Linear of the projections in ``fp8`` (``{name: FP8Linear}``) that
    :data:`FUSED_PROJECTIONS` names for ``name``, concatenated along their outputs,
    in place of the meta Linear ``fused`` that diffusers' ``fuse_projections`` made."""
    where = f"compile_ops: {type(attn).__name__}.fuse_projections made {name}"
    parts = [fp8.get(projection) for projection in FUSED_PROJECTIONS.get(name, ())]
    if not parts or None in parts or type(fused) is not nn.Linear:
        raise ValueError(
            f"{where} ({type(fused).__name__}), which compile_ops cannot build from FP8 projections "
            f"(it builds {', '.join(FUSED_PROJECTIONS)} from theirs)"
        )
    widths = sum(part.out_features for part in parts)
    has_bias = fused.bias is not None
    if (fused.in_features, fused.out_features) != (parts[0].in_features, widths) or any(
        (part.bias is not None) != has_bias for part in parts
    ):
        raise ValueError(f"{where} [{fused.out_features}, {fused.in_features}], not its projections concatenated")
    new = FP8Linear(fused.in_features, widths, has_bias, "meta", parts[0].out_dtype, parts[0].fast_accum)
    new.weight_q = torch.cat([part.weight_q for part in parts])
    new.weight_scale = torch.cat([part.weight_scale for part in parts])
    new.bias = torch.cat([part.bias for part in parts]) if has_bias else None
    return new
