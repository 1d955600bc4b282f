"""Whether a fused seam may read a module's tensors without calling it.

A fused kernel that stands in for ``norm(x)`` reads ``norm.weight`` itself.
That is only right while calling the module would do nothing beyond its
``forward``. Offloading and casting hooks move or cast the module's own
tensors around its call: diffusers' group offloading (leaf level) and
layerwise casting, accelerate's ``cpu_offload`` and ``device_map`` dispatch
(``AlignDevicesHook``). Between calls such a module's weight sits on the CPU,
on the meta device or in a storage dtype. So a seam that meets a hooked module
holding tensors of its own calls the module instead (the unfused path for that
one step), and the hook does its work.
"""

import itertools
from typing import Optional

from torch import nn

from compile_ops.meta._validate import check_floating_input


def has_call_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs hooks around its ``forward``: torch's
    forward (pre-)hooks, a diffusers ``HookRegistry`` holding hooks, or an
    accelerate hook. Registries are looked up rather than an instance-level
    ``forward``, which stays behind after hooks are removed."""
    if module._forward_pre_hooks or module._forward_hooks:
        return True
    registry = getattr(module, "_diffusers_hook", None)
    if registry is not None and registry.hooks:
        return True
    return getattr(module, "_hf_hook", None) is not None


def must_call(module: Optional[nn.Module]) -> bool:
    """True when a fused seam has to call ``module`` rather than read its
    tensors: it holds parameters or buffers of its own and its call is hooked
    (:func:`has_call_hooks`). A hooked module without tensors of its own (a
    LayerNorm without affine) is safe to fuse past."""
    if module is None or not has_call_hooks(module):
        return False
    return (
        next(module.parameters(recurse=False), None) is not None
        or next(module.buffers(recurse=False), None) is not None
    )


def check_input(owner: str, name: str, t, module: nn.Module) -> None:
    """A module's input ``t`` for its submodule ``module``: a floating tensor on
    ``module``'s device, unless ``module`` runs hooks (offloading moves its
    weights to the input when it is called)."""
    check_floating_input(owner, name, t)
    if must_call(module):
        return
    like = next(itertools.chain(module.parameters(), module.buffers()), None)
    if like is not None and like.device.type != "meta" and t.device != like.device:
        raise ValueError(
            f"{owner}: {name} is on {t.device} but the weights of its {type(module).__name__} are on {like.device}"
        )
