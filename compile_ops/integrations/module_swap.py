"""What the diffusers and transformers integrations' ``patch`` share: the
report, the record of what to undo, and the swap of one module for its
replacement.

A replacement is built on the meta device and takes the original's
parameters and ``nn.Linear`` submodules by name (our modules keep the model
library's names), so weights, LoRA wrappers and optimizer state stay valid
and ``unpatch`` only has to put the originals back. A peft tuner layer
(LoRA, ...) wrapping one of those Linears is taken as the Linear it wraps,
and one that peft puts on a replacement's Linear after ``patch`` goes back
with the original (:func:`restore_module`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from typing import Callable, Optional

import torch
from torch import nn

from compile_ops.integrations.sparse_attention import SparseAttention

#: The model attribute holding the undo list of a patched model (None: a
#: patch that cannot be undone, ``precision="fp8"``).
PATCH_STATE = "_compile_ops_patch"


@dataclasses.dataclass
class PatchReport:
    """What :func:`compile_ops.patch` did: ``replaced`` and ``left`` hold
    ``(path, what, detail)`` rows (detail: the replacement, or why the module
    was left)."""

    replaced: list = dataclasses.field(default_factory=list)
    left: list = dataclasses.field(default_factory=list)
    #: The SparseAttention plan of ``patch(attention=...)``: its ``describe()``
    #: gives the density of each grid the model has run at.
    sparse_attention: Optional[SparseAttention] = None
    #: ``(path, attention module)`` of each layer with a compile_ops processor:
    #: :meth:`attention_paths` describes them as they run now.
    attention_layers: list = dataclasses.field(default_factory=list)

    def attention_paths(self) -> list:
        """``(path, kernel, parallel path)`` of each patched attention layer, read
        now: after ``model.enable_parallelism(...)`` it names the Ulysses/ring path."""
        return [
            (path, *module.processor.describe(module))
            for path, module in self.attention_layers
            if hasattr(module.processor, "describe")
        ]

    def __str__(self) -> str:
        lines = [f"compile_ops.patch: {len(self.replaced)} replaced, {len(self.left)} left as they were"]
        for title, rows in (("replaced", self.replaced), ("left", self.left)):
            groups = Counter((what, detail) for _, what, detail in rows)
            for (what, detail), n in groups.items():
                first = next(path for path, w, d in rows if (w, d) == (what, detail))
                lines.append(f"  {title}: {n} x {what}: {detail} (e.g. {first})")
        paths = self.attention_paths()
        for (kernel, parallel), n in Counter((kernel, parallel) for _, kernel, parallel in paths).items():
            first = next(path for path, k, p in paths if (k, p) == (kernel, parallel))
            lines.append(f"  attention: {n} x {kernel}; across ranks: {parallel} (e.g. {first})")
        if self.sparse_attention is not None:
            lines.append(self.sparse_attention.describe())
        return "\n".join(lines)


def check_patchable(model: nn.Module, precision: str) -> None:
    """Raise unless ``model`` can be patched now. patch() rewrites modules:
    after torch.compile the compiled code would not see it, and diffusers'
    hooks (offloading, caching, layerwise casting) wrap the modules it
    replaces. accelerate's hooks (``from_pretrained(device_map=...)``,
    ``cpu_offload``) are carried over to the replacements
    (:func:`carry_accelerate_hook`), except under ``precision="fp8"`` when
    they offload: FP8 weights are made at patch time, from weights that
    must be on the device."""
    if (
        isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
        or getattr(model, "_compiled_call_impl", None) is not None
    ):
        raise RuntimeError(
            "compile_ops.patch: the model is already compiled; call compile_ops.patch(model) "
            "first, then torch.compile(model)"
        )
    if getattr(model, "_parallel_config", None) is not None:
        raise RuntimeError(
            "compile_ops.patch: the model already has a parallel config (model.enable_parallelism "
            "or from_pretrained(parallel_config=...)), whose hooks and processors patch would "
            "replace; call compile_ops.patch(model) first, then model.enable_parallelism(...)"
        )
    for name, module in model.named_modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is not None and registry.hooks:
            raise RuntimeError(
                f"compile_ops.patch: {name or 'the model'} carries diffusers hooks "
                f"({', '.join(registry.hooks)}); call compile_ops.patch(model) before group "
                "offloading, layerwise casting or caching"
            )
        if precision == "fp8" and _offloads(getattr(module, "_hf_hook", None)):
            raise RuntimeError(
                f"compile_ops.patch: precision='fp8' quantizes the weights now, and "
                f"{name or 'the model'}'s are offloaded by an accelerate hook (device_map / "
                "cpu_offload); load the model onto the GPU, patch, then offload"
            )
    if hasattr(model, PATCH_STATE):
        raise RuntimeError("compile_ops.patch: the model is already patched (compile_ops.unpatch undoes it)")


def _offloads(hook) -> bool:
    """Whether an accelerate hook (or a ``SequentialHook`` of them) keeps weights off the device."""
    if hook is None:
        return False
    return bool(getattr(hook, "offload", False)) or any(_offloads(h) for h in getattr(hook, "hooks", ()))


def swap_module(parent: nn.Module, name: str, old: nn.Module, new: nn.Module, undo: list) -> None:
    """Put ``new`` in ``old``'s place as ``parent.<name>``, with old's
    accelerate hook, and record the swap for ``unpatch``."""
    setattr(parent, name, new)
    carry_accelerate_hook(old, new)
    undo.append(("module", parent, name, old))


def carry_accelerate_hook(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` the accelerate hook of the module it replaces. The hook
    moves (or loads from its weights map) the module's tensors by name around
    each call, and our modules keep the original names, so it serves the
    replacement as it served the original; the original keeps its hook for
    ``unpatch``."""
    hook = getattr(old, "_hf_hook", None)
    if hook is not None:
        from accelerate.hooks import add_hook_to_module  # present: it made the hook

        add_hook_to_module(new, hook)


def tuner_base(module: Optional[nn.Module]) -> Optional[nn.Module]:
    """The layer that ``module``, a peft tuner layer (``BaseTunerLayer``: LoRA,
    DoRA, ...), wraps, through nested ones; ``module`` itself when it is not one."""
    utils = sys.modules.get("peft.tuners.tuners_utils")  # not imported: no module is a tuner layer
    tuner_class = getattr(utils, "BaseTunerLayer", None)
    if tuner_class is not None and isinstance(module, tuner_class):
        return module.get_base_layer()
    return module


def base_linear(module: Optional[nn.Module]) -> Optional[nn.Linear]:
    """``module``'s ``nn.Linear``: itself, or the one a peft tuner layer wraps; None for anything else."""
    base = tuner_base(module)
    return base if isinstance(base, nn.Linear) else None


def adopt(new: nn.Module, old: nn.Module) -> Optional[nn.Module]:
    """``new`` (built on the meta device) takes ``old``'s Linear submodules and
    parameters, by name; None when the two do not hold the same parameters (a
    configuration ours does not cover). ``new`` calls each Linear it takes, so
    a peft tuner layer wrapping one (a LoRA) is taken in its place, adapters included."""
    linears = [name for name, child in new.named_children() if isinstance(child, nn.Linear)]
    for name in linears:
        theirs = base_linear(old._modules.get(name))
        if theirs is None or _parameter_names(theirs) != _parameter_names(new.get_submodule(name)):
            return None

    def outside_linears(module: nn.Module) -> set:
        return {n for n in _parameter_names(module) if n.split(".", 1)[0] not in linears}

    if outside_linears(new) != outside_linears(old):
        return None
    for name in linears:
        setattr(new, name, old.get_submodule(name))
    for name in outside_linears(new):
        owner, _, leaf = name.rpartition(".")
        setattr(new.get_submodule(owner) if owner else new, leaf, old.get_parameter(name))
    return new


def _parameter_names(module: nn.Module) -> set:
    return {name for name, _ in module.named_parameters()}


def restore_module(owner: nn.Module, name: str, original: nn.Module) -> None:
    """Put ``original`` back as ``owner.<name>`` (undoing :func:`swap_module`).
    Where the replacement there now holds, under a name they share, another
    module over the same layer, the original takes it: a peft tuner layer put
    on a shared Linear after ``patch`` (or the bare Linear left by unloading
    one), so adapters, their weights and their active or disabled state stay."""
    replacement = owner._modules.get(name)
    if replacement is not None and replacement is not original:
        for child_name, child in replacement.named_children():
            theirs = original._modules.get(child_name)
            if theirs is not None and child is not theirs and tuner_base(child) is tuner_base(theirs):
                setattr(original, child_name, child)
    setattr(owner, name, original)


def tuners_in_the_way(module: nn.Module, path: str, whole_subtree: bool) -> Optional[str]:
    """The peft tuner layers (LoRA, ...) in ``module`` (at ``path``) that keep
    it from being replaced, named with their paths, or None: those that do not
    wrap an ``nn.Linear`` child of ``module`` and, with ``whole_subtree``
    (a module whose replacement takes its Linears only), those deeper in it too."""
    blocking = []
    for where, layer in _tuner_layers(module):
        deep = "." in where
        if (whole_subtree and deep) or (not deep and base_linear(layer) is None):
            blocking.append(f"{_describe_tuner(layer)} on {path}.{where}")
    return ", ".join(blocking) or None


def _tuner_layers(module: nn.Module, prefix: str = ""):
    """``(path, layer)`` of the outermost peft tuner layers under ``module``."""
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if tuner_base(child) is not child:
            yield path, child
        else:
            yield from _tuner_layers(child, path)


def _describe_tuner(layer: nn.Module) -> str:
    """How a report names a tuner layer: a LoRA (with DoRA), else by its peft class."""
    if not hasattr(layer, "lora_A"):
        return f"a peft {type(layer).__name__}"
    return "a LoRA with DoRA" if any(getattr(layer, "use_dora", {}).values()) else "a LoRA"


def build_on_meta(build: Callable[[], nn.Module], old: nn.Module) -> Optional[nn.Module]:
    """``build()`` on the meta device (no memory, no initialization), holding ``old``'s tensors (:func:`adopt`)."""
    with torch.device("meta"):
        new = build()
    return adopt(new, old)
