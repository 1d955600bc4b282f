"""``patch``/``unpatch`` of a diffusers transformer: the walk that applies the
block and module rules, the attention processors, sparse attention and FP8,
and the undo record."""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch
from torch import nn

from compile_ops.integrations.attention_backend import register_diffusers_backend
from compile_ops.integrations.diffusers import ring
from compile_ops.integrations.diffusers.blocks import block_rules
from compile_ops.integrations.diffusers.context_parallel import check_parallel_mode, context_parallel
from compile_ops.integrations.diffusers.cp_plans import install_plans
from compile_ops.integrations.diffusers.fp8_linears import fuse_mlp_activations, quantize_linears
from compile_ops.integrations.diffusers.module_rules import diffusers_modules, module_rules, why_left_alone
from compile_ops.integrations.diffusers.processors import FusedProcessor, processor_rules
from compile_ops.integrations.diffusers.sparse_models import attach_sparse_attention
from compile_ops.integrations.module_swap import (
    PATCH_STATE,
    PatchReport,
    check_patchable,
    restore_module,
    swap_module,
    tuners_in_the_way,
)
from compile_ops.integrations.options import PatchOptions
from compile_ops.integrations.schedule import DenseFirst
from compile_ops.meta.attention import SPARSE_BLOCK


def patch(model: nn.Module, options: Optional[PatchOptions] = None) -> PatchReport:
    """Swap the fused ops into a diffusers transformer, in place.

    Call it before ``torch.compile`` and before diffusers' hooks (group
    offloading, layerwise casting, caching; it raises otherwise). accelerate's
    offloading hooks (``from_pretrained(device_map=...)``, sequential CPU
    offload) may already be there: each replacement takes over its
    original's hook. Works on CPU (the ops' reference paths) and CUDA.

    Args:
        model: a diffusers transformer (``FluxTransformer2DModel``,
            ``SD3Transformer2DModel``, ``WanTransformer3DModel``,
            ``LTXVideoTransformer3DModel``, ...) or any ``nn.Module`` holding
            such modules.
        options: what to patch (:class:`~compile_ops.integrations.options.PatchOptions`);
            None: the defaults.

    Returns:
        A :class:`~compile_ops.integrations.module_swap.PatchReport`; ``print`` it for a summary.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_ops.patch: model must be a torch.nn.Module, got {type(model).__name__}")
    options = PatchOptions() if options is None else options
    check_patchable(model, options.precision)
    schedule = DenseFirst(options.attention_dense_steps)
    activations = diffusers_modules().activations  # first: without diffusers, a clear ImportError
    if importlib.util.find_spec("diffusers.models.attention_dispatch") is not None:  # diffusers 0.35+
        register_diffusers_backend()  # model.set_attention_backend("compile_ops") from here on
    report, undo = PatchReport(), []
    undo.append(("hook", model.register_forward_pre_hook(_check_parallel_config), None, None))
    _replace_modules(model, activations, report, undo)
    _replace_processors(model, options, schedule, report, undo)
    if options.attention_processors:  # the plans rely on our processors' replicated text
        install_plans(model, report, undo)
    if options.attention_dense_steps:
        undo.append(("hook", model.register_forward_pre_hook(schedule.pre_forward, with_kwargs=True), None, None))
    if options.attention is not None:
        attach_sparse_attention(model, options.attention, report, undo)
        # After the sparse plan's hook, which picks each call's layout.
        undo.append(("hook", model.register_forward_pre_hook(prepare_ring_layouts), None, None))
    if options.precision == "fp8":
        quantize_linears(model, report, options.fp8_fast_accum, options.fp8_modulation)
        fuse_mlp_activations(model, report)
        # The originals in ``undo`` hold the bf16 weights: drop them, or memory would not drop.
        undo = None
    setattr(model, PATCH_STATE, undo)
    return report


def _check_parallel_config(model: nn.Module, args) -> None:
    """A patched model's forward pre-hook, run before its (compiled) blocks:
    diffusers' tensor parallelism (``enable_parallelism(config=TensorParallelConfig(...))``,
    set after patch) is refused, and so is an attention mode that the
    context-parallel layout cannot run (``check_parallel_mode``), naming what
    works, not run wrong or raised from inside a compiled block."""
    config = getattr(model, "_parallel_config", None)
    if config is None or torch.compiler.is_compiling():
        return
    if getattr(config, "tensor_parallel_config", None) is not None:
        raise RuntimeError(
            "compile_ops: diffusers' tensor parallelism (TensorParallelConfig) does not run on a "
            "patched model: its sharded projections leave each rank a subset of the heads and "
            "shards of the weights that the fused blocks, processors and FP8 Linears read whole. "
            "Use ContextParallelConfig (Ulysses, ring), or tensor parallelism on an unpatched model"
        )
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if (
            isinstance(processor, FusedProcessor)
            and processor.parallel_config() is not None
            and processor.splits_across_ranks(module)
        ):
            check_parallel_mode(
                processor.parallel_config(),
                processor.attention_precision,
                processor.sparse is not None,
                False,
                f"compile_ops {type(processor).__name__}",
                processor.replicates_text,
            )


def _replace_modules(model: nn.Module, activations, report: PatchReport, undo: list) -> None:
    """Swap the blocks and modules the rules cover, depth first: a replaced
    block's children are patched inside it; a replaced module owns its subtree.
    ``activations``: diffusers' activations module."""
    rules, blocks = module_rules(), block_rules()

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in list(module.named_children()):
            path = f"{prefix}.{name}" if prefix else name
            block = blocks.get(type(child))
            if block is not None:
                what, ours = block
                new = ours.build(child)
                if new is None:
                    why = tuners_in_the_way(child, path, whole_subtree=False)
                    why = why or "a forward or norms the fused block does not reproduce"
                    report.left.append((path, what, f"{why}; its modules are patched inside"))
                else:
                    swap_module(module, name, child, new, undo)
                    report.replaced.append((path, what, f"compile_ops {ours.__name__} (fused seams)"))
                walk(new or child, path)  # the block's own modules
                continue
            rule = rules.get(type(child))
            new = rule[1](child) if rule else None
            if new is not None:
                swap_module(module, name, child, new, undo)
                report.replaced.append((path, rule[0], f"compile_ops.{type(new).__name__}"))
                continue  # the replacement owns the subtree
            if rule:
                why = tuners_in_the_way(child, path, whole_subtree=True)
                report.left.append((path, rule[0], why or "a configuration the fused module does not cover"))
            elif (why := why_left_alone(child, activations)) is not None:
                report.left.append((path, type(child).__name__, why))
            walk(child, path)

    walk(model, "")


def _replace_processors(
    model: nn.Module, options: PatchOptions, schedule: DenseFirst, report: PatchReport, undo: list
) -> None:
    """Set ours on every attention layer whose (attention class, exact processor
    class) a rule covers (none with ``attention_processors=False``); report the others."""
    rules = processor_rules() if options.attention_processors else {}
    for path, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if processor is None or not hasattr(module, "set_processor"):
            continue
        match = next(
            (
                rule
                for (attention_class, processor_class), rule in rules.items()
                if isinstance(module, attention_class) and type(processor) is processor_class
            ),
            None,
        )
        if match is None:
            how = (
                "it calls diffusers' attention dispatcher: model.set_attention_backend('compile_ops') runs "
                "fused.attention there"
                if hasattr(processor, "_attention_backend")
                else "it calls SDPA itself"
            )
            report.left.append((path, type(processor).__name__, f"attention processor not covered; kept ({how})"))
            continue
        what, ours_class = match
        ours = ours_class(processor, options.attention_kernel)
        ours.attention_precision = options.attention_precision
        if options.attention_dense_steps:
            ours.int8_schedule = schedule
        module.set_processor(ours)
        undo.append(("processor", module, None, processor))
        report.replaced.append((path, what, f"compile_ops {ours_class.__name__}"))
        report.attention_layers.append((path, module))


def unpatch(model: nn.Module) -> None:
    """Put back what :func:`patch` replaced (the same module objects), on a
    model patched by either integration, keeping the peft adapters (LoRA)
    added or removed since. ``model``: the patched ``nn.Module``."""
    if not hasattr(model, PATCH_STATE):
        raise RuntimeError("compile_ops.unpatch: the model is not patched")
    undo = getattr(model, PATCH_STATE)
    if undo is None:
        raise RuntimeError(
            "compile_ops.unpatch: the model was patched with precision='fp8', which released its "
            "original weights; load the model again instead"
        )
    for kind, owner, name, original in reversed(undo):
        if kind == "module":
            restore_module(owner, name, original)  # with the LoRA layers put on its Linears since
        elif kind == "hook":
            owner.remove()  # a forward pre-hook's handle (sparse attention, the 8-bit schedule)
        elif kind == "attribute":
            delattr(owner, name)  # an instance attribute patch set (a context-parallel plan)
        elif isinstance(owner.processor, FusedProcessor):
            # Ours gives back the diffusers processor it wraps: the original for
            # the one patch set, a fresh one for one diffusers rebuilt since
            # (by calling our class, as loading an IP-Adapter does).
            owner.set_processor(owner.processor.original)
        # else: diffusers put a processor of its own there since (an IP-Adapter's): it stays.
    delattr(model, PATCH_STATE)


def prepare_ring_layouts(model, args) -> None:
    """A patched model's forward pre-hook, after the sparse plan's (which
    picks the call's layout): builds each ring rank's :class:`RingLayout` of
    the call's layout before the (compiled) blocks run, so that a layout
    ring attention cannot run is refused here, and the blocks find it built
    (reading the permutation's values inside a compiled block would split its graph)."""
    if torch.compiler.is_compiling():
        return
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if not isinstance(processor, FusedProcessor) or processor.sparse is None:
            continue
        cp = context_parallel(processor.parallel_config())
        layout = processor.sparse.layout
        if cp is None or cp.ring_degree <= 1 or layout is None or not processor.splits_across_ranks(module):
            continue
        perm, index = ring.layout_parts(layout)[:2]
        total = perm.numel() if perm is not None else index.shape[-2] * SPARSE_BLOCK
        if total % cp.ring_degree == 0:  # else diffusers' split refuses it first
            owner = f"compile_ops {type(processor).__name__}"
            ring.ring_layout(layout, cp.ring_degree, cp._ring_local_rank, total // cp.ring_degree, owner)
