"""Which diffusers (and torch) modules are swapped for ours, and how each is built.

A module is replaced only when its class is exactly one whose forward ours
reproduces and its configuration is one ours covers; a subclass, which may
override ``forward``, is left alone. The sizes are read from the Linear
itself where a peft tuner layer (LoRA) wraps it.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple, Optional

from torch import nn

from compile_ops.integrations.module_swap import base_linear, build_on_meta
from compile_ops.modules.glu import GEGLU, SwiGLU
from compile_ops.modules.modulate import AdaLayerNormContinuous, AdaLayerNormZero, AdaLayerNormZeroSingle
from compile_ops.modules.norm import LayerNorm, RMSNorm

#: diffusers' fused projection Linears (``fuse_qkv_projections()``, each attention
#: class's ``fuse_projections``): the projections whose output rows each one's rows
#: are, in order. The processors read them; the FP8 patch builds them.
FUSED_PROJECTIONS = {
    "to_qkv": ("to_q", "to_k", "to_v"),
    "to_kv": ("to_k", "to_v"),
    "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj"),
    "to_added_kv": ("add_k_proj", "add_v_proj"),
}


class DiffusersModules(NamedTuple):
    """The diffusers modules whose classes the rules name."""

    normalization: ModuleType
    activations: ModuleType
    flux: ModuleType
    wan: ModuleType
    ltx: ModuleType


def diffusers_modules() -> DiffusersModules:
    """diffusers' modules, imported on first use: ``import compile_ops`` does not need diffusers."""
    try:
        import diffusers  # noqa: F401
        from diffusers.models import activations, normalization
        from diffusers.models.transformers import transformer_flux, transformer_ltx, transformer_wan
    except ImportError as e:  # pragma: no cover (the extra is installed in CI)
        raise ImportError("compile_ops.patch needs diffusers: pip install 'compile_ops[diffusers]'") from e
    return DiffusersModules(normalization, activations, transformer_flux, transformer_wan, transformer_ltx)


def _layer_norm(old: nn.LayerNorm) -> Optional[nn.Module]:
    if len(old.normalized_shape) != 1:
        return None
    return build_on_meta(
        lambda: LayerNorm(old.normalized_shape[0], old.eps, old.elementwise_affine, old.bias is not None), old
    )


def _rms_norm(old: nn.Module) -> Optional[nn.Module]:
    # diffusers' RMSNorm keeps dim as a torch.Size, torch's normalized_shape.
    shape = tuple(getattr(old, "normalized_shape", getattr(old, "dim", ())))
    if len(shape) != 1:
        return None
    bias = getattr(old, "bias", None) is not None
    return build_on_meta(lambda: RMSNorm(shape[0], old.eps, old.elementwise_affine, bias), old)


def _ada_zero(old: nn.Module, norm_module: ModuleType) -> Optional[nn.Module]:
    linear = base_linear(old.linear)
    if old.emb is not None or linear is None:
        return None
    norm_type = "fp32_layer_norm" if type(old.norm) is norm_module.FP32LayerNorm else "layer_norm"
    return build_on_meta(lambda: AdaLayerNormZero(linear.in_features, None, norm_type, linear.bias is not None), old)


def _ada_zero_single(old: nn.Module) -> Optional[nn.Module]:
    linear = base_linear(old.linear)
    if linear is None:
        return None
    return build_on_meta(lambda: AdaLayerNormZeroSingle(linear.in_features, "layer_norm", linear.bias is not None), old)


def _ada_continuous(old: nn.Module, norm_module: ModuleType) -> Optional[nn.Module]:
    kinds = {nn.LayerNorm: "layer_norm", norm_module.RMSNorm: "rms_norm"}
    linear = base_linear(old.linear)
    if type(old.norm) not in kinds or linear is None:
        return None
    return build_on_meta(
        lambda: AdaLayerNormContinuous(
            linear.out_features // 2,
            linear.in_features,
            old.norm.elementwise_affine,
            old.norm.eps,
            linear.bias is not None,
            kinds[type(old.norm)],
        ),
        old,
    )


def _glu(glu_class: type):
    """The builder of our ``glu_class`` (GEGLU, SwiGLU) from diffusers' module of the same name."""

    def build(old: nn.Module) -> Optional[nn.Module]:
        proj = base_linear(old.proj)
        if proj is None:
            return None
        return build_on_meta(lambda: glu_class(proj.in_features, proj.out_features // 2, proj.bias is not None), old)

    return build


def module_rules() -> dict:
    """``{exact class: (what, build(old) -> new or None)}``."""
    norm, act = diffusers_modules()[:2]
    return {
        nn.LayerNorm: ("torch LayerNorm", _layer_norm),
        norm.FP32LayerNorm: ("diffusers FP32LayerNorm", _layer_norm),
        norm.RMSNorm: ("diffusers RMSNorm", _rms_norm),
        nn.RMSNorm: ("torch RMSNorm", _rms_norm),
        norm.AdaLayerNormZero: ("diffusers AdaLayerNormZero", lambda m: _ada_zero(m, norm)),
        norm.AdaLayerNormZeroSingle: ("diffusers AdaLayerNormZeroSingle", _ada_zero_single),
        norm.AdaLayerNormContinuous: ("diffusers AdaLayerNormContinuous", lambda m: _ada_continuous(m, norm)),
        act.GEGLU: ("diffusers GEGLU", _glu(GEGLU)),
        act.SwiGLU: ("diffusers SwiGLU", _glu(SwiGLU)),
    }


#: diffusers blocks whose forward no fused block reproduces: reported, their modules patched inside.
UNFUSED_BLOCKS = ("JointTransformerBlock", "LTXVideoTransformerBlock")


def why_left_alone(module: nn.Module, activations: ModuleType) -> Optional[str]:
    """Why a module we know of stays (None: not one we report)."""
    if type(module) is activations.GELU:
        return f"GELU(approximate={module.approximate!r}) after its Linear: no fused op; torch.compile fuses it"
    if type(module).__name__ in UNFUSED_BLOCKS and type(module).__module__.startswith("diffusers."):
        return (
            "its forward keeps the gated residuals and the second norm's modulation (no fused block "
            "forward reproduces it); its norms, activations and attention are patched inside"
        )
    return None
