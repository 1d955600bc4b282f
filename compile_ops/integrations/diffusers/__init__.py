"""``compile_ops.patch(model)``: the fused ops inside a diffusers transformer.

Modules are swapped by what they compute: a module is replaced only when its
class is exactly one of diffusers' (or torch's) classes whose forward we
reproduce and its configuration is one our module covers; a subclass, which
may override ``forward``, is left alone. Replacements share the original's
parameters and ``nn.Linear`` submodules (weights, LoRA wrappers and optimizer
state stay valid), so :func:`unpatch` only has to put the originals back.

Attention goes through diffusers' own extension point, the attention
processor (``module.set_processor``): our processors run the same
projections, q/k-norm and rotary embeddings as ``fused.qk_norm_rope`` (or
the norms and ``fused.rope_qk``) and attention with ``fused.attention`` or
SDPA (``attention_kernel``), and hand any call they do not cover (an
attention mask, fused projections, image conditioning) to the original
processor.

Blocks have no extension point for their gated residuals, so for the blocks
whose forward we reproduce (Flux's two) the block itself is swapped for one
that runs its seams as ``fused.gated_residual_norm_modulate`` /
``fused.gated_residual``; it is swapped only when its forward's signature is
the one reproduced. Other blocks (SD3, Wan, LTX-Video) keep their forward and
are reported, as is a lone tanh-GELU after a Linear (no fused op here;
``torch.compile`` fuses it).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
from collections import Counter
from typing import Callable, Optional

import torch
from torch import nn

from compile_ops._library import has_wgmma
from compile_ops.modules.fp8 import FP8Linear, FP8ProjectionActivation
from compile_ops.modules.glu import GEGLU, SwiGLU
from compile_ops.modules.hooks import must_call
from compile_ops.modules.modulate import AdaLayerNormContinuous, AdaLayerNormZero, AdaLayerNormZeroSingle
from compile_ops.modules.norm import LayerNorm, RMSNorm
from compile_ops.ops.attention import Int8QK, attention, attention_fp8_rows
from compile_ops.ops.fp8 import FP8Rows, quantize_fp8_rows
from compile_ops.ops.modulate import (gated_residual, gated_residual_norm_modulate,
                                      gated_residual_norm_modulate_fp8, norm_modulate, norm_modulate_fp8)
from compile_ops.ops.rope import qk_norm_rope, rope_qk
from compile_ops.integrations.attention_backend import register_diffusers_backend
from compile_ops.integrations.schedule import DenseFirst
from compile_ops.integrations.sparse_attention import SparseAttention, TopK

_STATE = "_compile_ops_patch"


@dataclasses.dataclass
class PatchReport:
    """What :func:`patch` did: ``replaced`` and ``left`` hold ``(path, what, detail)``
    rows (detail: the replacement, or why the module was left)."""
    replaced: list = dataclasses.field(default_factory=list)
    left: list = dataclasses.field(default_factory=list)
    #: The SparseAttention plan of ``patch(attention=...)``: its ``describe()``
    #: gives the density of each grid the model has run at.
    sparse_attention: Optional[SparseAttention] = None

    def __str__(self) -> str:
        lines = [f"compile_ops.patch: {len(self.replaced)} replaced, {len(self.left)} left as they were"]
        for title, rows in (("replaced", self.replaced), ("left", self.left)):
            groups = Counter((what, detail) for _, what, detail in rows)
            for (what, detail), n in groups.items():
                first = next(path for path, w, d in rows if (w, d) == (what, detail))
                lines.append(f"  {title}: {n} x {what}: {detail} (e.g. {first})")
        if self.sparse_attention is not None:
            lines.append(self.sparse_attention.describe())
        return "\n".join(lines)


def _diffusers():
    try:
        import diffusers  # noqa: F401
        from diffusers.models import activations, normalization
        from diffusers.models.transformers import transformer_flux, transformer_ltx, transformer_wan
    except ImportError as e:  # pragma: no cover (the extra is installed in CI)
        raise ImportError("compile_ops.patch needs diffusers: pip install 'compile_ops[diffusers]'") from e
    return normalization, activations, transformer_flux, transformer_wan, transformer_ltx


def _check_order(model: nn.Module, precision: str) -> None:
    """patch() rewrites modules: after torch.compile the compiled code would
    not see it, and diffusers' hooks (offloading, caching, layerwise casting)
    wrap the modules it replaces. accelerate's hooks (``from_pretrained(
    device_map=...)``, ``cpu_offload``) are carried over to the replacements
    (:func:`_carry_accelerate_hook`), except under ``precision="fp8"`` when
    they offload: FP8 weights are made here, and the offloaded ones are not
    here to quantize."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) or \
            getattr(model, "_compiled_call_impl", None) is not None:
        raise RuntimeError("compile_ops.patch: the model is already compiled; call compile_ops.patch(model) "
                           "first, then torch.compile(model)")
    for name, module in model.named_modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is not None and registry.hooks:
            raise RuntimeError(f"compile_ops.patch: {name or 'the model'} carries diffusers hooks "
                               f"({', '.join(registry.hooks)}); call compile_ops.patch(model) before group "
                               "offloading, layerwise casting or caching")
        if precision == "fp8" and _offloads(getattr(module, "_hf_hook", None)):
            raise RuntimeError(f"compile_ops.patch: precision='fp8' quantizes the weights now, and "
                               f"{name or 'the model'}'s are offloaded by an accelerate hook (device_map / "
                               "cpu_offload); load the model onto the GPU, patch, then offload")
    if hasattr(model, _STATE):
        raise RuntimeError("compile_ops.patch: the model is already patched (compile_ops.unpatch undoes it)")


def _offloads(hook) -> bool:
    """Whether an accelerate hook (or a ``SequentialHook`` of them) keeps weights off the device."""
    if hook is None:
        return False
    return bool(getattr(hook, "offload", False)) or any(_offloads(h) for h in getattr(hook, "hooks", ()))


def _swap_module(parent: nn.Module, name: str, old: nn.Module, new: nn.Module, undo: list) -> None:
    """Put ``new`` in ``old``'s place as ``parent.<name>``, with old's
    accelerate hook, and record the swap for :func:`unpatch`."""
    setattr(parent, name, new)
    _carry_accelerate_hook(old, new)
    undo.append(("module", parent, name, old))


def _carry_accelerate_hook(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` the accelerate hook of the module it replaces. The hook
    moves (or loads from its weights map) the module's tensors by name around
    each call, and our modules keep diffusers' names, so it serves the
    replacement as it served the original; the original keeps its hook for
    :func:`unpatch`."""
    hook = getattr(old, "_hf_hook", None)
    if hook is not None:
        from accelerate.hooks import add_hook_to_module  # present: it made the hook

        add_hook_to_module(new, hook)


def _adopt(new: nn.Module, old: nn.Module) -> Optional[nn.Module]:
    """``new`` (built on the meta device) takes ``old``'s Linear submodules and
    parameters, by name (our modules keep diffusers' names); None when the
    two do not hold the same parameters (a configuration ours does not cover)."""
    if {n for n, _ in new.named_parameters()} != {n for n, _ in old.named_parameters()}:
        return None
    for name, child in list(new.named_children()):
        if isinstance(child, nn.Linear):
            setattr(new, name, old.get_submodule(name))
    for name, _ in list(new.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        setattr(new.get_submodule(owner) if owner else new, leaf, old.get_parameter(name))
    return new


def _on_meta(build: Callable[[], nn.Module], old: nn.Module) -> Optional[nn.Module]:
    with torch.device("meta"):
        new = build()
    return _adopt(new, old)


def _layer_norm(old: nn.LayerNorm) -> Optional[nn.Module]:
    if len(old.normalized_shape) != 1:
        return None
    return _on_meta(lambda: LayerNorm(old.normalized_shape[0], old.eps, old.elementwise_affine,
                                                    old.bias is not None), old)


def _rms_norm(old: nn.Module) -> Optional[nn.Module]:
    # diffusers' RMSNorm keeps dim as a torch.Size, torch's normalized_shape.
    shape = tuple(getattr(old, "normalized_shape", getattr(old, "dim", ())))
    if len(shape) != 1:
        return None
    bias = getattr(old, "bias", None) is not None
    return _on_meta(lambda: RMSNorm(shape[0], old.eps, old.elementwise_affine, bias), old)


def _ada_zero(old: nn.Module, norm_cls) -> Optional[nn.Module]:
    if old.emb is not None:
        return None
    norm_type = "fp32_layer_norm" if type(old.norm) is norm_cls.FP32LayerNorm else "layer_norm"
    return _on_meta(lambda: AdaLayerNormZero(old.linear.in_features, None, norm_type,
                                                           old.linear.bias is not None), old)


def _ada_zero_single(old: nn.Module) -> nn.Module:
    return _on_meta(lambda: AdaLayerNormZeroSingle(old.linear.in_features, "layer_norm",
                                                                 old.linear.bias is not None), old)


def _ada_continuous(old: nn.Module, norm_cls) -> Optional[nn.Module]:
    kinds = {nn.LayerNorm: "layer_norm", norm_cls.RMSNorm: "rms_norm"}
    if type(old.norm) not in kinds:
        return None
    return _on_meta(lambda: AdaLayerNormContinuous(
        old.linear.out_features // 2, old.linear.in_features, old.norm.elementwise_affine, old.norm.eps,
        old.linear.bias is not None, kinds[type(old.norm)]), old)


def _module_rules() -> dict:
    """``{exact class: (what, build(old) -> new or None)}``."""
    norm, act, *_ = _diffusers()
    return {
        nn.LayerNorm: ("torch LayerNorm", _layer_norm),
        norm.FP32LayerNorm: ("diffusers FP32LayerNorm", _layer_norm),
        norm.RMSNorm: ("diffusers RMSNorm", _rms_norm),
        nn.RMSNorm: ("torch RMSNorm", _rms_norm),
        norm.AdaLayerNormZero: ("diffusers AdaLayerNormZero", lambda m: _ada_zero(m, norm)),
        norm.AdaLayerNormZeroSingle: ("diffusers AdaLayerNormZeroSingle", _ada_zero_single),
        norm.AdaLayerNormContinuous: ("diffusers AdaLayerNormContinuous", lambda m: _ada_continuous(m, norm)),
        act.GEGLU: ("diffusers GEGLU", lambda m: _on_meta(
            lambda: GEGLU(m.proj.in_features, m.proj.out_features // 2, m.proj.bias is not None), m)),
        act.SwiGLU: ("diffusers SwiGLU", lambda m: _on_meta(
            lambda: SwiGLU(m.proj.in_features, m.proj.out_features // 2, m.proj.bias is not None),
            m)),
    }


# ---------------------------------------------------------------- blocks


class _BlockForward(nn.Module):
    """A diffusers block's forward with its seams fused. It holds the original
    block's children (the same objects; :func:`patch` then patches them inside
    this block, leaving the original's untouched for :func:`unpatch`)."""

    #: The original forward's parameters, in order: the block is replaced only
    #: when they match, since a diffusers release with another forward would
    #: otherwise be silently reinterpreted.
    signature: tuple = ()
    #: The parameters the original holds itself (not in a child): ours shares
    #: them, by name. A block with others is not replaced.
    own_parameters: tuple = ()

    def __init__(self, original: nn.Module):
        super().__init__()
        for name, child in original.named_children():
            setattr(self, name, child)
        for name in self.own_parameters:
            setattr(self, name, getattr(original, name))
        # For the calls the fused forward does not cover: diffusers' forward,
        # run on this block (same children and parameters, same names).
        self._original_forward = type(original).forward

    @classmethod
    def build(cls, original: nn.Module) -> Optional[nn.Module]:
        params = tuple(inspect.signature(type(original).forward).parameters)[1:]
        own = {name for name, _ in original.named_parameters(recurse=False)}
        if params != cls.signature or own != set(cls.own_parameters):
            return None
        return cls(original)


def _is_diffusers_gelu(module: nn.Module) -> bool:
    return type(module).__name__ == "GELU" and type(module).__module__.startswith("diffusers.")


def _reads_fp8_rows(ff: nn.Module) -> bool:
    """diffusers' ``FeedForward`` whose first module is its ``GELU`` (or our
    :class:`FP8ProjectionActivation` in its place) over an :class:`FP8Linear`
    (after ``patch(precision="fp8")``): it can take the seam's FP8 rows,
    since that module hands its input straight to ``proj``."""
    net = getattr(ff, "net", None)
    return (type(ff).__name__ == "FeedForward" and isinstance(net, nn.ModuleList) and len(net) > 0
            and (_is_diffusers_gelu(net[0]) or isinstance(net[0], FP8ProjectionActivation))
            and isinstance(getattr(net[0], "proj", None), FP8Linear))


def _fuse_mlp_activations(model: nn.Module, report: PatchReport) -> None:
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
        if not (_is_diffusers_gelu(gelu) and isinstance(getattr(gelu, "proj", None), FP8Linear)
                and isinstance(down, FP8Linear)):
            continue
        if type(dropout) is not nn.Dropout or dropout.p != 0:
            report.left.append((f"{path}.net.0", type(gelu).__name__, f"output stays {down.out_dtype}: "
                                f"{dropout!r} between it and the FP8 down projection"))
            continue
        activation = "gelu" if gelu.approximate == "none" else "gelu_tanh"
        net[0], net[1] = FP8ProjectionActivation(gelu.proj, activation), nn.Identity()
        fused = f"{path}.net.0"
        report.left[:] = [entry for entry in report.left if entry[0] != fused]  # "no fused op": now there is
        report.replaced.append((fused, "diffusers GELU", f"compile_ops FP8ProjectionActivation ({activation} "
                                "computed and quantized for the FP8 down projection in one pass)"))


def _is_plain_layer_norm(norm: nn.Module) -> bool:
    """A LayerNorm over the last dim that the fused seams compute: torch's, ours,
    or diffusers' FP32LayerNorm (computed in fp32 and cast back, as the kernels do)."""
    return type(norm) in (nn.LayerNorm, LayerNorm, _diffusers()[0].FP32LayerNorm) and len(norm.normalized_shape) == 1


class FluxTransformerBlock(_BlockForward):
    """diffusers' ``FluxTransformerBlock`` (double-stream) with each stream's
    seam in one ``fused.gated_residual_norm_modulate``: the gated attention
    residual, the second LayerNorm and the MLP modulation read the stream once;
    the gated MLP residual is ``fused.gated_residual``."""

    signature = ("hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb", "joint_attention_kwargs")

    @classmethod
    def build(cls, original):
        if not (_is_plain_layer_norm(original.norm2) and _is_plain_layer_norm(original.norm2_context)):
            return None
        return super().build(original)

    @staticmethod
    def _second_half(stream, attn_out, gate_attn, shift, scale, gate_ff, norm, ff):
        if must_call(norm):  # an offloading/casting hook owns its weight: the unfused seam calls it
            stream = gated_residual(stream, attn_out, gate_attn)
            return gated_residual(stream, ff(norm(stream) * (1 + scale[:, None]) + shift[:, None]), gate_ff)
        seam = gated_residual_norm_modulate_fp8 if _reads_fp8_rows(ff) else gated_residual_norm_modulate
        # Under precision="fp8" the seam writes e4m3 rows + scales for the MLP's
        # first FP8Linear, in the same kernel: no bf16 round trip, no quantize pass.
        stream, normed = seam(stream, attn_out, gate_attn, scale, shift, norm.weight, norm.bias, "layernorm",
                              norm.eps)
        return gated_residual(stream, ff(normed), gate_ff)

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                joint_attention_kwargs=None):
        # Under precision="fp8" both AdaLN norms write e4m3 rows for q/k/v directly.
        fp8 = (isinstance(self.norm1, AdaLayerNormZero) and isinstance(self.norm1_context, AdaLayerNormZero)
               and FluxAttnProcessor.takes_fp8_rows(self.attn, encoder_hidden_states, joint_attention_kwargs))
        normed, *image_mod = self.norm1(hidden_states, emb=temb, **_fp8_rows_kwarg(fp8))
        normed_context, *context_mod = self.norm1_context(encoder_hidden_states, emb=temb, **_fp8_rows_kwarg(fp8))
        outputs = self.attn(hidden_states=normed, encoder_hidden_states=normed_context,
                            image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
        hidden_states = self._second_half(hidden_states, outputs[0], *image_mod, self.norm2, self.ff)
        if len(outputs) == 3:  # IP-adapter attention, added after the MLP as diffusers does
            hidden_states = hidden_states + outputs[2]
        encoder_hidden_states = self._second_half(encoder_hidden_states, outputs[1], *context_mod,
                                                  self.norm2_context, self.ff_context)
        if encoder_hidden_states.dtype == torch.float16:
            encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
        return encoder_hidden_states, hidden_states


def _fp8_rows_kwarg(fp8: bool) -> dict:
    """``{"fp8_rows": True}`` for our AdaLN norms' FP8 output mode, else nothing
    (the plain call, which any norm module takes)."""
    return {"fp8_rows": True} if fp8 else {}


def _fp8_concat_activation(act: nn.Module, proj_out: nn.Module) -> Optional[str]:
    """The ``quantize_fp8_rows`` activation that lets ``proj_out`` (an FP8Linear)
    take ``cat([attention, act(mlp)])`` quantized in one pass, or None."""
    if not isinstance(proj_out, FP8Linear) or type(act) is not nn.GELU:
        return None
    return "gelu" if act.approximate == "none" else "gelu_tanh"


class FluxSingleTransformerBlock(_BlockForward):
    """diffusers' ``FluxSingleTransformerBlock`` with the gated residual after
    ``proj_out`` as ``fused.gated_residual``. Under ``precision="fp8"`` the
    MLP's GELU, the concatenation with the attention output and the
    quantization for ``proj_out`` are one pass (``quantize_fp8_rows`` with a
    head): neither the activation nor the concatenation is written."""

    signature = ("hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb", "joint_attention_kwargs")

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                joint_attention_kwargs=None):
        text_tokens = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        # Under precision="fp8" the AdaLN norm writes e4m3 rows for proj_mlp and q/k/v directly.
        fp8 = (isinstance(self.norm, AdaLayerNormZeroSingle) and isinstance(self.proj_mlp, FP8Linear)
               and FluxAttnProcessor.takes_fp8_rows(self.attn, None, joint_attention_kwargs))
        normed, gate = self.norm(hidden_states, emb=temb, **_fp8_rows_kwarg(fp8))
        mlp = self.proj_mlp(normed)
        attn_out = self.attn(hidden_states=normed, image_rotary_emb=image_rotary_emb,
                             **(joint_attention_kwargs or {}))
        fp8_activation = _fp8_concat_activation(self.act_mlp, self.proj_out)
        if fp8_activation is not None:
            projected = self.proj_out(quantize_fp8_rows(mlp, fp8_activation, head=attn_out))
        else:
            projected = self.proj_out(torch.cat([attn_out, self.act_mlp(mlp)], dim=2))
        hidden_states = gated_residual(hidden_states, projected, gate)
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return hidden_states[:, :text_tokens], hidden_states[:, text_tokens:]


class WanTransformerBlock(_BlockForward):
    """diffusers' ``WanTransformerBlock`` (Wan 2.1 / 2.2 T2V and I2V) with its
    three seams fused: the first norm and its modulation as
    ``fused.norm_modulate``; the gated attention residual with the
    cross-attention norm, and the cross-attention residual with the MLP norm
    and modulation, each as one ``fused.gated_residual_norm_modulate``; the
    gated MLP residual as ``fused.gated_residual``. Under ``precision="fp8"``
    the seams feeding FP8 Linears write e4m3 rows in the same kernel.

    The modulation vectors are cast to the stream's dtype before the kernels
    (diffusers keeps them fp32 and casts the results back): the kernels
    compute in fp32 either way, and fp32-ones would make every output fp32.
    Per-token modulation (Wan 2.2 TI2V's ``[B, L, 6, C]`` temb) and norms whose
    calls are hooked (offloading, casting) run diffusers' forward."""

    signature = ("hidden_states", "encoder_hidden_states", "temb", "rotary_emb")
    own_parameters = ("scale_shift_table",)

    @classmethod
    def build(cls, original):
        norm2 = original.norm2
        if not (_is_plain_layer_norm(original.norm1) and _is_plain_layer_norm(original.norm3)
                and (type(norm2) is nn.Identity or _is_plain_layer_norm(norm2))):
            return None
        return super().build(original)

    def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
        norms = (self.norm1, self.norm2, self.norm3)
        if temb.ndim != 3 or any(must_call(norm) for norm in norms):
            return self._original_forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb)
        norm1, norm2, norm3 = norms
        modulation = (self.scale_shift_table + temb.float()).to(hidden_states.dtype)
        shift, scale, gate, c_shift, c_scale, c_gate = modulation.chunk(6, dim=1)  # [B, 1, C] each
        # 1. Self-attention, its input written as FP8 rows when q/k/v are FP8 Linears.
        modulate = norm_modulate_fp8 if WanAttnProcessor.takes_fp8_rows(self.attn1) else norm_modulate
        normed = modulate(hidden_states, scale, shift, norm1.weight, norm1.bias, "layernorm", norm1.eps)
        attn_out = self.attn1(normed, None, None, rotary_emb)
        # 2. Cross-attention: the gated residual and its (unmodulated) norm in one pass.
        if type(norm2) is nn.Identity:
            hidden_states = gated_residual(hidden_states, attn_out, gate)
            normed = hidden_states
        else:
            seam = (gated_residual_norm_modulate_fp8 if WanAttnProcessor.takes_fp8_rows(self.attn2, cross=True)
                    else gated_residual_norm_modulate)
            zero = torch.zeros_like(shift)
            hidden_states, normed = seam(hidden_states, attn_out, gate, zero, zero, norm2.weight, norm2.bias,
                                         "layernorm", norm2.eps)
        attn_out = self.attn2(normed, encoder_hidden_states, None, None)
        # 3. Feed-forward: the (ungated) cross-attention residual and the MLP's modulated norm in one pass.
        seam = gated_residual_norm_modulate_fp8 if _reads_fp8_rows(self.ffn) else gated_residual_norm_modulate
        hidden_states, normed = seam(hidden_states, attn_out, torch.ones_like(c_gate), c_scale, c_shift,
                                     norm3.weight, norm3.bias, "layernorm", norm3.eps)
        return gated_residual(hidden_states, self.ffn(normed), c_gate)


def _block_rules() -> dict:
    """``{exact block class: (what, our block class)}``: blocks whose forward we
    reproduce with fused seams; their children are patched inside."""
    _, _, flux, wan, _ = _diffusers()
    rules = {
        flux.FluxTransformerBlock: ("diffusers FluxTransformerBlock", FluxTransformerBlock),
        flux.FluxSingleTransformerBlock: ("diffusers FluxSingleTransformerBlock", FluxSingleTransformerBlock),
        wan.WanTransformerBlock: ("diffusers WanTransformerBlock", WanTransformerBlock),
    }
    for theirs, (_, ours) in rules.items():
        _share_block_metadata(ours, theirs)
    return rules


def _share_block_metadata(ours: type, theirs: type) -> None:
    """diffusers' caching hooks (``enable_cache``: first-block cache, FasterCache,
    ...) look a block's outputs up by its class in a registry; give ours the
    original's entry, so that caching enabled after patch() finds our blocks.
    The registry is private: where a diffusers release lacks it, there is
    nothing to share."""
    try:
        from diffusers.hooks._helpers import TransformerBlockRegistry
        TransformerBlockRegistry._register()
        TransformerBlockRegistry.register(model_class=ours, metadata=TransformerBlockRegistry.get(theirs))
    except (ImportError, AttributeError, ValueError):
        pass


_UNFUSED_BLOCKS = ("JointTransformerBlock", "LTXVideoTransformerBlock")


def _left_alone(module: nn.Module, act) -> Optional[str]:
    """Why a module we know of stays (None: not one we report)."""
    if type(module) is act.GELU:
        return f"GELU(approximate={module.approximate!r}) after its Linear: no fused op; torch.compile fuses it"
    if type(module).__name__ in _UNFUSED_BLOCKS and type(module).__module__.startswith("diffusers."):
        return ("its forward keeps the gated residuals and the second norm's modulation (no fused block "
                "forward for it yet); its norms, activations and attention are patched inside")
    return None


# ---------------------------------------------------------------- attention processors


ATTENTION_KERNELS = ("auto", "fused", "sdpa")


#: Self-attention from this many tokens up takes q and k quantized by their
#: rotation's kernel (``fused.qk_rope_int8``); shorter sequences let 8-bit
#: attention quantize them. H100, rotation + quantization of q and k
#: (bench/results/rope-int8-sweep-h100.json, run 2): 4608 tokens (Flux)
#: 0.152 ms fused against 0.129 compiled unfused (its 128-position programs
#: are too few to fill the GPU there); 8192: 0.223 against 0.311; 16384 x 40
#: heads: 0.545 against 0.970; 32760 (Wan 480p): 0.372 against 0.621.
QUANTIZE_IN_ROTATION_MIN_TOKENS = 8192


class _FusedProcessor:
    """Base of our processors: the original processor runs every call that the
    fused path does not cover. ``kernel`` picks the attention kernel (see
    :func:`patch`)."""

    #: Attributes diffusers sets on a model's processors
    #: (``set_attention_backend``, ``enable_parallelism``): they live on the
    #: original, which runs the calls they concern (a parallel config sends
    #: every call there).
    _ORIGINALS = ("_attention_backend", "_parallel_config")

    def __init__(self, original=None, kernel: str = "auto"):
        # No original: diffusers rebuilding the processors it keeps by calling
        # their class with no arguments (loading or unloading an IP-Adapter on
        # Flux and SD3); ours then wraps a fresh diffusers processor of the
        # class it replaces, with the default kernel choice.
        self.original = self._diffusers_processor()() if original is None else original
        self.kernel = kernel
        #: The model's SparseAttention plan for a video self-attention layer
        #: (``patch(attention=...)``), else None.
        self.sparse = None
        # Resolved here, not while Dynamo traces a call.
        self.rms_norm_classes = (RMSNorm, nn.RMSNorm, _diffusers()[0].RMSNorm)

    @classmethod
    def _diffusers_processor(cls) -> type:
        """The diffusers processor class this one replaces."""
        return next(theirs for (_, theirs), (_, ours) in _processor_rules().items() if ours is cls)

    def __getattr__(self, name):  # only for names not set on this object
        original = self.__dict__.get("original")  # absent while copy/pickle rebuild the object
        if original is None:
            raise AttributeError(name)
        return getattr(original, name)

    def __setattr__(self, name, value):
        if name in self._ORIGINALS:
            setattr(self.original, name, value)
        else:
            super().__setattr__(name, value)

    #: ``patch(attention_precision=...)``: "int8" ("int8_fp8") runs dense
    #: attention as ``fused.attention_int8`` (``attention_int8_fp8``) where it
    #: applies (see :meth:`attend`), from the step ``int8_schedule`` (a
    #: :class:`DenseFirst`, or None: every step) says.
    attention_precision = "exact"
    int8_schedule: Optional[DenseFirst] = None

    def attend(self, query, key, value, kv_lengths=None, fp8_rows: bool = False):
        """Attention of ``[B, L, H, D]`` q, k, v; ``kv_lengths [B]``: keys past
        each sample's length are masked (padded text tokens at the end).
        Under ``attention_precision="int8"`` or ``"int8_fp8"``, 16-bit
        inference calls run 8-bit attention; calls that need a gradient
        (training) and fp32 ones keep the exact kernels. ``fp8_rows`` (the
        caller's output projection is an :class:`FP8Linear`): where
        ``"int8_fp8"`` runs, the output comes as :class:`FP8Rows` ``[B, L, H * D]``
        from the kernel's epilogue (:func:`attention_fp8_rows`), else as a tensor."""
        if isinstance(query, Int8QK) or self.eight_bit(query, key, value):
            if fp8_rows and self.attention_precision == "int8_fp8":
                return attention_fp8_rows(query, key, value, seq_dim=1, kv_lengths=kv_lengths)
            return attention(query, key, value, seq_dim=1, kv_lengths=kv_lengths,
                             precision=self.attention_precision)
        if self.kernel == "sdpa" or (self.kernel == "auto" and _sdpa_is_faster(query, key, value, kv_lengths)):
            mask = None
            if kv_lengths is not None:
                keys = torch.arange(key.shape[1], device=key.device)
                mask = (keys < kv_lengths.unsqueeze(1)).unsqueeze(1).unsqueeze(1)  # [B, 1, 1, Lk]
            out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (query, key, value)),
                                                                   attn_mask=mask)
            return out.transpose(1, 2)
        return attention(query, key, value, seq_dim=1, kv_lengths=kv_lengths)

    def eight_bit(self, query, key, value) -> bool:
        """Whether :meth:`attend` runs these 16-bit q, k, v as 8-bit attention:
        an 8-bit ``attention_precision``, a step the schedule says, no gradient."""
        return self.attention_precision != "exact" and (self.int8_schedule is None or self.int8_schedule.active) \
            and query.dtype in (torch.float16, torch.bfloat16) and not _needs_gradient(query, key, value)

    def quantizes_qk(self, query, key, value) -> bool:
        """Whether q and k of a self-attention call come quantized from their
        rotation (``rope_qk``/``qk_norm_rope(..., quantize=True)``): 8-bit
        attention runs (:meth:`eight_bit`), no sparse plan takes the call, and
        the sequence is long enough (:data:`QUANTIZE_IN_ROTATION_MIN_TOKENS`)."""
        return self.eight_bit(query, key, value) and (self.sparse is None or self.sparse.layout is None) \
            and query.shape[1] >= QUANTIZE_IN_ROTATION_MIN_TOKENS

    def attend_self(self, query, key, value, text_tokens: int = 0, kv_lengths=None, fp8_rows: bool = False):
        """Video self-attention of ``[B, L, H, D]`` q, k, v (the last
        ``text_tokens`` of L text, attended densely): the sparse plan's layout
        for this call where one is set, else :meth:`attend` (``fp8_rows`` as there)."""
        layout = None if self.sparse is None else self.sparse.layout
        if layout is None or isinstance(query, Int8QK):
            return self.attend(query, key, value, kv_lengths, fp8_rows)
        if layout.text_tokens != text_tokens:
            raise RuntimeError(f"compile_ops sparse attention: the layout was built for {layout.text_tokens} text "
                               f"tokens, this attention has {text_tokens}; this is a compile_ops bug")
        return layout.attend(query, key, value, kv_lengths)

    def rms_weight(self, norm: nn.Module) -> Optional[tuple]:
        """``(weight, eps)`` of a per-head RMSNorm that ``fused.qk_norm_rope``
        can run (weighted, no bias, a set eps); None for any other norm, and
        for one whose call is hooked (offloading, casting: :func:`must_call`)."""
        if type(norm) not in self.rms_norm_classes or must_call(norm):
            return None
        weight, eps = getattr(norm, "weight", None), getattr(norm, "eps", None)
        if weight is None or getattr(norm, "bias", None) is not None or eps is None:
            return None
        return weight, eps

    def norm_rope(self, query, key, norm_q, norm_k, rope, quantize: bool = False):
        """q/k-norm then rotary embedding of ``[B, L, H, D]`` q and k (``rope``:
        ``(cos, sin)`` tables ``[L, D]`` with pairs interleaved, or None): one
        ``fused.qk_norm_rope`` launch when both norms are weighted RMSNorms with
        one eps, else the norms and ``fused.rope_qk``. ``quantize`` (with
        rope; :meth:`quantizes_qk`): ``(Int8QK, None)`` for 8-bit attention,
        from the same kernel."""
        q_norm, k_norm = self.rms_weight(norm_q), self.rms_weight(norm_k)
        quantize = quantize and rope is not None
        if rope is not None and q_norm is not None and k_norm is not None and q_norm[1] == k_norm[1]:
            out = qk_norm_rope(query, key, q_norm[0], k_norm[0], *rope, eps=q_norm[1], interleaved=True,
                               seq_dim=1, quantize=quantize)
            return (out, None) if quantize else out
        query, key = norm_q(query), norm_k(key)
        if rope is None:
            return query, key
        out = rope_qk(query, key, *rope, interleaved=True, seq_dim=1, quantize=quantize)
        return (out, None) if quantize else out


def _shared_input(x, *linears: nn.Module):
    """``x`` for projections that all read it: quantized once to FP8 rows when
    every one of them is an :class:`FP8Linear` (q, k and v after
    ``patch(precision="fp8")``), instead of once per projection. FP8 rows
    (a norm's FP8 output mode) pass as they are."""
    if isinstance(x, FP8Rows):
        return x
    if all(isinstance(linear, FP8Linear) for linear in linears):
        return quantize_fp8_rows(x)
    return x


def _projection_inputs(attn, hidden_states, encoder_hidden_states=None) -> tuple:
    """``(input of to_q, input of to_k and to_v)`` of a self- or cross-attention
    layer, each quantized once to FP8 rows when all the Linears that read it are
    FP8 (self-attention: one pass for q, k and v, not one for q and one for k/v)."""
    if encoder_hidden_states is None:
        x = _shared_input(hidden_states, attn.to_q, attn.to_k, attn.to_v)
        return x, x
    return hidden_states, _shared_input(encoder_hidden_states, attn.to_k, attn.to_v)


def _heads_joined(out, dtype: torch.dtype):
    """Attention's ``[B, L, H, D]`` output as the ``[B, L, H * D]`` rows of
    the output projection, in ``dtype``; FP8 rows (already joined) as they are."""
    return out if isinstance(out, FP8Rows) else out.flatten(2, 3).to(dtype)


def _tokens(x) -> int:
    """The sequence length of ``[B, L, C]`` hidden states or of their FP8 rows."""
    return (x.q if isinstance(x, FP8Rows) else x).shape[1]


def _needs_gradient(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


#: Keys from which ``fused.attention``'s sm_90 core runs a 16-bit forward
#: faster than SDPA's cuDNN backend on an H100: 1.10-1.11x at 32760 and 75600
#: keys, level at 16384 (1.00x), behind at 4096-4608 (0.95-0.96x, persistent)
#: (bench/results/attention-sm90-core-persistent-h100.json, the README's table).
FUSED_AHEAD_FROM_KEYS = 16385
#: Below that, key counts that are not a multiple of the core's 128-key tiles
#: (``RAGGED_KEY_TILE``), from this many keys on: there cuDNN's forward slows
#: and the core's masked last tile does not. 1x24xLx128, H100, eager / compiled
#: against cuDNN: 1.03x at 3000 keys, 1.04x at 3333, 1.02x at 3952, 1.02-1.03x
#: at 4112 (Flux at 1280x720), 1.03x at 4544, 1.04-1.05x at 4592 (Flux at
#: 1360x768), 1.06x at 4429, 1.07-1.08x at 6989 (a Qwen-Image-sized image plus
#: prompt), 1.03-1.05x at 12345; shorter ragged counts are not ahead (1.00x at
#: 2537, 0.95x at 1537), and over whole tiles cuDNN stays ahead or level: 0.87x
#: at 2048, 0.91x at 2816, 0.94x at 3584, 0.96x at 4608, 1.00-1.03x at 12288
#: (bench/results/attention-ragged-keys-h100.json and ``-short-``).
FUSED_AHEAD_RAGGED_FROM_KEYS = 3000
#: The core's key tile at D = 128 (``ops.attention.forward_tiles``): a key
#: count off its multiples ends in one masked tile.
RAGGED_KEY_TILE = 128
#: The head dim at which that holds. At D = 64 the core (256-key tiles) ran
#: 0.95-0.99x cuDNN over whole tiles, and the portable kernel 1.01-1.03x at
#: SD3's ragged 4429 tokens (bench/results/attention-sm90-core-d64-h100.json,
#: ``-d64-lengths-``): too little to leave SDPA for.
FUSED_AHEAD_HEAD_DIM = 128


def _sdpa_is_faster(query, key, value, kv_lengths=None) -> bool:
    """Inference in fp16/bf16 on a GPU: SDPA's cuDNN backend runs the forward
    faster than fused.attention on an H100 (1.07-1.15x the portable kernel,
    1.02-1.13x causal; README attention tables), except where the sm_90 core
    runs the call at D = 128 (:data:`FUSED_AHEAD_HEAD_DIM`): dense at
    :data:`FUSED_AHEAD_FROM_KEYS` keys or more, or at a ragged key count
    (not a multiple of :data:`RAGGED_KEY_TILE`) from
    :data:`FUSED_AHEAD_RAGGED_FROM_KEYS` keys, and with key lengths at any
    length, since SDPA takes them as a boolean mask, which cuDNN runs at
    0.66-0.67x its unmasked speed while the core's masked tile costs nothing
    (1x24x4608 and 1-2x24x16640 with 4429 / 16461 keys valid: the core
    1.44-1.49x masked SDPA, level with cuDNN unmasked over all the keys; H100,
    bench/results/masked-sdpa-h100.json). Training keeps fused.attention: its
    backward is ahead of SDPA's flash backend, and torch 2.11's cuDNN backward
    fails at Flux's training shape (bench/diffusers_e2e.py). q, k, v
    ``[B, L, H, D]``; ``kv_lengths`` ``[B]`` or None."""
    if not (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)) or _needs_gradient(query, key, value):
        return False
    on_core = has_wgmma(query) and query.shape[-1] == FUSED_AHEAD_HEAD_DIM
    keys = key.shape[1]
    ragged = keys % RAGGED_KEY_TILE != 0 and keys >= FUSED_AHEAD_RAGGED_FROM_KEYS
    return not (on_core and (kv_lengths is not None or keys >= FUSED_AHEAD_FROM_KEYS or ragged))


class FluxAttnProcessor(_FusedProcessor):
    """diffusers' ``FluxAttnProcessor`` (Flux double- and single-stream attention)
    with q/k-norm and rotary embedding in one fused op, and attention as a
    fused op (or SDPA, see :func:`patch`)."""

    def covers(self, attn, encoder_hidden_states, attention_mask) -> bool:
        """Whether the fused path runs this call (else the original processor does)."""
        return not (attention_mask is not None or attn.fused_projections or getattr(self, "_parallel_config", None)
                    or (encoder_hidden_states is not None and attn.added_kv_proj_dim is None))

    @staticmethod
    def takes_fp8_rows(attn, encoder_hidden_states=None, joint_attention_kwargs=None) -> bool:
        """Whether ``attn(hidden_states=FP8Rows, ...)`` is safe for a block to call:
        ``attn``'s processor is ours, covers the call, and every projection that
        reads the hidden states (and the text states, when given) is an
        :class:`FP8Linear`, so the norm before can write FP8 rows directly."""
        processor, kwargs = attn.processor, joint_attention_kwargs or {}
        if not isinstance(processor, FluxAttnProcessor) or set(kwargs) - {"attention_mask"} or \
                not processor.covers(attn, encoder_hidden_states, kwargs.get("attention_mask")):
            return False
        linears = [attn.to_q, attn.to_k, attn.to_v]
        if encoder_hidden_states is not None:
            linears += [attn.add_q_proj, attn.add_k_proj, attn.add_v_proj]
        return all(isinstance(linear, FP8Linear) for linear in linears)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        if not self.covers(attn, encoder_hidden_states, attention_mask):
            if isinstance(hidden_states, FP8Rows) or isinstance(encoder_hidden_states, FP8Rows):
                raise RuntimeError("compile_ops FluxAttnProcessor: FP8 rows reached a call the fused path does "
                                   "not cover (a mask, fused projections or a parallel config since the block "
                                   "checked); this is a compile_ops bug")
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

        def heads(t):
            return t.unflatten(-1, (-1, attn.head_dim))

        def rows(start, end):  # the rotary tables' rows of one stream
            return None if image_rotary_emb is None else tuple(t[start:end] for t in image_rotary_emb)

        image_rope = rows(-_tokens(hidden_states), None)
        x = _shared_input(hidden_states, attn.to_q, attn.to_k, attn.to_v)
        query, key, value = heads(attn.to_q(x)), heads(attn.to_k(x)), heads(attn.to_v(x))
        # A single-stream call's q and k can come quantized from their rotation;
        # a double-stream call's text and image streams are joined after it,
        # and k's smoothing mean spans both, so its attention quantizes them.
        quantize = encoder_hidden_states is None and self.quantizes_qk(query, key, value)
        query, key = self.norm_rope(query, key, attn.norm_q, attn.norm_k, image_rope, quantize)
        if encoder_hidden_states is not None:
            # Text tokens come first in the joint sequence and in the tables;
            # each stream is normed with its own weights and rotated with its rows.
            c = _shared_input(encoder_hidden_states, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            text_query, text_key = self.norm_rope(heads(attn.add_q_proj(c)), heads(attn.add_k_proj(c)),
                                                  attn.norm_added_q, attn.norm_added_k,
                                                  rows(0, _tokens(encoder_hidden_states)))
            query, key = torch.cat([text_query, query], dim=1), torch.cat([text_key, key], dim=1)
            value = torch.cat([heads(attn.add_v_proj(c)), value], dim=1)
        # Double-stream blocks' output projections can read FP8 rows; the
        # single-stream block concatenates the output with its MLP's first.
        fp8_rows = encoder_hidden_states is not None and isinstance(attn.to_out[0], FP8Linear) \
            and isinstance(attn.to_add_out, FP8Linear)
        out = _heads_joined(self.attend(query, key, value, fp8_rows=fp8_rows), value.dtype)
        if encoder_hidden_states is None:
            return out
        sizes = [_tokens(encoder_hidden_states), _tokens(hidden_states)]
        if isinstance(out, FP8Rows):
            text, image = (FP8Rows(*parts) for parts in zip(out.q.split_with_sizes(sizes, dim=1),
                                                             out.scale.split_with_sizes(sizes, dim=1)))
        else:
            text, image = out.split_with_sizes(sizes, dim=1)
        image = attn.to_out[1](attn.to_out[0](image))
        return image, attn.to_add_out(text)


class WanAttnProcessor(_FusedProcessor):
    """diffusers' ``WanAttnProcessor`` (self- and text cross-attention) with
    rotary embedding and attention as fused ops; image-conditioned (I2V)
    attention stays with the original."""

    @staticmethod
    def takes_fp8_rows(attn, cross: bool = False) -> bool:
        """Whether this layer's fused path runs and can take its input (the
        query's, for ``cross``-attention) as FP8 rows: its projections that
        read it are FP8 Linears and the call is one this processor covers."""
        processor = getattr(attn, "processor", None)
        if type(processor) is not WanAttnProcessor or attn.add_k_proj is not None or attn.fused_projections \
                or getattr(processor, "_parallel_config", None):
            return False
        readers = (attn.to_q,) if cross else (attn.to_q, attn.to_k, attn.to_v)
        return all(isinstance(linear, FP8Linear) for linear in readers)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if attention_mask is not None or attn.add_k_proj is not None or attn.fused_projections \
                or getattr(self, "_parallel_config", None):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        hidden_states, context = _projection_inputs(attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(attn.to_k(context)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(context).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            # [1, L, 1, D] tables with each pair's angle repeated: Wan rotates (2i, 2i + 1) pairs.
            cos, sin = (t[0, :, 0] for t in rotary_emb)
            if self.quantizes_qk(query, key, value):  # q and k for 8-bit attention straight from the rotation
                query, key = rope_qk(query, key, cos, sin, interleaved=True, seq_dim=1, quantize=True), None
            else:
                query, key = rope_qk(query, key, cos, sin, interleaved=True, seq_dim=1)
        attend = self.attend if encoder_hidden_states is not None else self.attend_self
        out = _heads_joined(attend(query, key, value, fp8_rows=isinstance(attn.to_out[0], FP8Linear)), value.dtype)
        return attn.to_out[1](attn.to_out[0](out))


class JointAttnProcessor(_FusedProcessor):
    """diffusers' ``JointAttnProcessor2_0`` (SD3 / SD3.5 joint attention) with
    attention as a fused op (SD3 has no rotary embedding)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        if attention_mask is not None or args or kwargs:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)

        def heads(t):
            return t.unflatten(-1, (attn.heads, -1))

        def normed(norm, t):
            return t if norm is None else norm(t)

        x = _shared_input(hidden_states, attn.to_q, attn.to_k, attn.to_v)
        query = normed(attn.norm_q, heads(attn.to_q(x)))
        key = normed(attn.norm_k, heads(attn.to_k(x)))
        value = heads(attn.to_v(x))
        if encoder_hidden_states is not None:
            c = _shared_input(encoder_hidden_states, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            query = torch.cat([query, normed(attn.norm_added_q, heads(attn.add_q_proj(c)))], 1)
            key = torch.cat([key, normed(attn.norm_added_k, heads(attn.add_k_proj(c)))], 1)
            value = torch.cat([value, heads(attn.add_v_proj(c))], 1)
        out = self.attend(query, key, value).flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](out))
        out, context = out[:, :hidden_states.shape[1]], out[:, hidden_states.shape[1]:]
        if not attn.context_pre_only:
            context = attn.to_add_out(context)
        return attn.to_out[1](attn.to_out[0](out)), context


class LTXVideoAttnProcessor(_FusedProcessor):
    """diffusers' ``LTXVideoAttnProcessor`` with rotary embedding and attention
    as fused ops; masked (text cross-) attention stays with the original."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        if attention_mask is not None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        hidden_states, context = _projection_inputs(attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(attn.to_q(hidden_states))
        key = attn.norm_k(attn.to_k(context))
        if image_rotary_emb is not None:
            # LTX's tables span all heads' channels ([B, L, heads * D], pairs
            # (2i, 2i + 1)): rotate the projections as one wide head.
            cos, sin = image_rotary_emb
            query, key = (t.squeeze(2) for t in rope_qk(query.unsqueeze(2), key.unsqueeze(2), cos, sin,
                                                        interleaved=True, seq_dim=1))
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, attn.to_v(context)))
        attend = self.attend if encoder_hidden_states is not None else self.attend_self
        out = attend(query, key, value).flatten(2, 3).to(query.dtype)
        return attn.to_out[1](attn.to_out[0](out))


def _prefix_lengths(mask):
    """``[B]`` int32 key lengths of a ``[B, 1, 1, N]`` (or ``[B, N]``) boolean key
    mask that keeps a prefix of each row (HunyuanVideo builds it so: video
    tokens, then the valid text tokens); checked on the device, without a sync."""
    mask = mask.reshape(mask.shape[0], mask.shape[-1])
    lengths = mask.sum(-1, dtype=torch.int32)
    keys = torch.arange(mask.shape[-1], device=mask.device)
    torch._assert_async((mask == (keys < lengths.unsqueeze(1))).all(),
                        "compile_ops HunyuanVideoAttnProcessor: the attention mask is not a prefix of each row")
    return lengths


class HunyuanVideoAttnProcessor(_FusedProcessor):
    """diffusers' ``HunyuanVideoAttnProcessor2_0`` (double-stream joint attention
    and single-stream attention; video tokens first, text last) with q/k-norm
    and rotary embedding fused, the text padding mask as key lengths, and
    sparse self-attention over the video tokens when ``patch(attention=...)``
    set a plan (the text tokens attend and are attended densely)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        if getattr(self, "_parallel_config", None) or \
                (attention_mask is not None and attention_mask.dtype != torch.bool):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        joint = attn.add_q_proj is not None and encoder_hidden_states is not None
        text_tokens = 0 if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        if not joint and encoder_hidden_states is not None:
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)

        def heads(t):
            return t.unflatten(2, (attn.heads, -1))

        x = _shared_input(hidden_states, attn.to_q, attn.to_k, attn.to_v)
        query, key, value = heads(attn.to_q(x)), heads(attn.to_k(x)), heads(attn.to_v(x))
        if joint or not text_tokens:
            query, key = self.norm_rope(query, key, attn.norm_q, attn.norm_k, image_rotary_emb)
        else:  # single-stream: the rotary embedding on the video tokens only, the q/k norms on all
            video = query.shape[1] - text_tokens
            video_qk = self.norm_rope(query[:, :video], key[:, :video], attn.norm_q, attn.norm_k, image_rotary_emb)
            text_qk = self.norm_rope(query[:, video:], key[:, video:], attn.norm_q, attn.norm_k, None)
            query, key = (torch.cat(pair, dim=1) for pair in zip(video_qk, text_qk))
        if joint:
            c = _shared_input(encoder_hidden_states, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            text_query, text_key = self.norm_rope(heads(attn.add_q_proj(c)), heads(attn.add_k_proj(c)),
                                                  attn.norm_added_q, attn.norm_added_k, None)
            query, key = torch.cat([query, text_query], dim=1), torch.cat([key, text_key], dim=1)
            value = torch.cat([value, heads(attn.add_v_proj(c))], dim=1)
        lengths = None if attention_mask is None else _prefix_lengths(attention_mask)
        out = self.attend_self(query, key, value, text_tokens, lengths).flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out, None
        out, text = out[:, :-text_tokens], out[:, -text_tokens:]
        if getattr(attn, "to_out", None) is not None:
            out = attn.to_out[1](attn.to_out[0](out))
        if getattr(attn, "to_add_out", None) is not None:
            text = attn.to_add_out(text)
        return out, text


def _processor_rules() -> dict:
    """``{(attention class, exact processor class): (what, our processor class)}``."""
    from diffusers.models import attention_processor
    from diffusers.models.transformers import transformer_hunyuan_video as hunyuan

    _, _, flux, wan, ltx = _diffusers()
    return {
        (flux.FluxAttention, flux.FluxAttnProcessor): ("diffusers FluxAttnProcessor", FluxAttnProcessor),
        (wan.WanAttention, wan.WanAttnProcessor): ("diffusers WanAttnProcessor", WanAttnProcessor),
        (attention_processor.Attention, attention_processor.JointAttnProcessor2_0):
            ("diffusers JointAttnProcessor2_0", JointAttnProcessor),
        (ltx.LTXAttention, ltx.LTXVideoAttnProcessor): ("diffusers LTXVideoAttnProcessor", LTXVideoAttnProcessor),
        (attention_processor.Attention, hunyuan.HunyuanVideoAttnProcessor2_0):
            ("diffusers HunyuanVideoAttnProcessor2_0", HunyuanVideoAttnProcessor),
    }


# ---------------------------------------------------------------- FP8 linears

PRECISIONS = ("bf16", "fp8")

#: The ModuleLists of transformer blocks in diffusers' DiTs (Flux, SD3, LTX:
#: ``transformer_blocks``; Flux: ``single_transformer_blocks``; Wan: ``blocks``).
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks")

#: Parents whose Linear projects the timestep embedding into modulation
#: vectors: one row per sample, a GEMV bound by reading its weight (Flux: 3.2B
#: of its 12B parameters). In FP8 only with ``patch(fp8_modulation=True)``:
#: half the bytes, but its rounding reaches every token's shift, scale and gate.
_MODULATION_PARENTS = ("AdaLayerNormZero", "AdaLayerNormZeroSingle", "AdaLayerNormContinuous")


def _fp8_reason(path: str, parent: nn.Module, linear: nn.Linear, in_blocks: bool,
                modulation: bool) -> Optional[str]:
    """Why ``linear`` stays in its dtype under ``precision="fp8"`` (None: it runs
    in FP8); ``modulation``: ``patch(fp8_modulation=...)``."""
    if not in_blocks:
        return "outside the transformer blocks (embedders, final layer: a few rows or once per step)"
    if type(parent).__name__ in _MODULATION_PARENTS and not modulation:
        return "AdaLN modulation projection: one row per sample (fp8_modulation=True quantizes it)"
    if linear.weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"weight dtype {linear.weight.dtype} (expected a floating point weight)"
    if linear.in_features % 16 or linear.out_features % 16:
        return (f"in_features={linear.in_features}, out_features={linear.out_features}: "
                "torch._scaled_mm needs both to be multiples of 16")
    return None


def _quantize_linears(model: nn.Module, report: PatchReport, fast_accum: bool, modulation: bool) -> None:
    """Replace the transformer blocks' Linears (with ``modulation``, their
    AdaLN modulation projections too) with :class:`FP8Linear` (weights
    quantized once per output channel; the original weight is no longer held),
    and report every Linear of the model, FP8 or not, with the reason."""
    from compile_ops.ops.fp8 import check_fp8_device

    def walk(module: nn.Module, prefix: str, in_blocks: bool) -> None:
        for name, child in list(module.named_children()):
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, FP8Linear):
                continue
            if type(child) is nn.Linear:
                why = _fp8_reason(path, module, child, in_blocks, modulation)
                if why is None:
                    check_fp8_device(child.weight.device)
                    setattr(module, name, FP8Linear.from_linear(child, fast_accum))
                    report.replaced.append((path, "nn.Linear", "compile_ops.FP8Linear (e4m3, rowwise scales"
                                            + (", fast accumulation)" if fast_accum else ")")))
                else:
                    report.left.append((path, "nn.Linear", f"kept in {child.weight.dtype}: {why}"))
                continue
            if isinstance(child, nn.Linear):  # a subclass (LoRA layers, ...): its forward may differ
                report.left.append((path, type(child).__name__, "a Linear subclass: its forward is kept"))
            walk(child, path, in_blocks or (isinstance(child, nn.ModuleList) and name in BLOCK_LISTS))

    walk(model, "", False)


# ---------------------------------------------------------------- sparse self-attention


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
    return {WanTransformer3DModel: (_wan_grid, "attn1", None), LTXVideoTransformer3DModel: (_ltx_grid, "attn1", None),
            HunyuanVideoTransformer3DModel: (_hunyuan_grid, "attn", _hunyuan_text)}


def _attach_sparse_attention(model: nn.Module, config, report: PatchReport, undo: list) -> None:
    """Give the model's video self-attention processors one SparseAttention plan
    and the forward pre-hook that picks its layout per call."""
    kind = _sparse_models().get(type(model))
    if kind is None:
        raise TypeError(f"compile_ops.patch: sparse attention covers "
                        f"{', '.join(c.__name__ for c in _sparse_models())}; got {type(model).__name__}")
    grid_of, self_attention, text_of = kind
    layers = [(path, m) for path, m in model.named_modules()
              if path.rpartition(".")[2] == self_attention and isinstance(getattr(m, "processor", None),
                                                                            _FusedProcessor)]
    if not layers:
        raise RuntimeError("compile_ops.patch: sparse attention needs compile_ops' attention processors "
                           "(attention_processors=True), and none was installed on the self-attention layers")
    if text_of is not None and isinstance(config, TopK):
        raise ValueError(f"compile_ops.patch: TopK covers video-only self-attention; {type(model).__name__} attends "
                         "to video and text together: use SlidingTile or Radial")
    plan = SparseAttention(config, grid_of, len(layers), text_of)
    for path, module in layers:
        module.processor.sparse = plan
        report.replaced.append((path, "self-attention", f"compile_ops block-sparse attention ({config})"))
    handle = model.register_forward_pre_hook(plan.pre_forward, with_kwargs=True)
    undo.append(("hook", handle, None, None))
    report.sparse_attention = plan


# ---------------------------------------------------------------- patch / unpatch


ATTENTION_PRECISIONS = ("exact", "int8", "int8_fp8")


def patch(model: nn.Module, attention_processors: bool = True, attention_kernel: str = "auto",
          precision: str = "bf16", fp8_fast_accum: bool = True, attention=None,
          attention_precision: str = "exact", attention_dense_steps: int = 0,
          fp8_modulation: bool = False) -> PatchReport:
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
        attention_processors: also replace the attention processors we cover
            (rotary embeddings fused; calls they do not cover go to diffusers').
        attention_kernel: ``"fused"`` (``fused.attention``), ``"sdpa"``
            (torch's SDPA) or ``"auto"``: SDPA for 16-bit inference on a GPU,
            where its cuDNN backend is faster, except on Hopper (sm_90) at
            D = 128 from :data:`FUSED_AHEAD_FROM_KEYS` keys, at key counts
            off a multiple of 128 from :data:`FUSED_AHEAD_RAGGED_FROM_KEYS`,
            or with key lengths (a text padding mask, which SDPA runs masked
            at 0.67x), where ``fused.attention``'s warp-specialized core is;
            ``fused.attention`` otherwise (training, CPU, fp32).
        precision: ``"bf16"`` keeps the Linears as they are; ``"fp8"``
            replaces the transformer blocks' Linears (attention projections,
            MLPs, the single-stream projections) with :class:`FP8Linear`:
            e4m3 weights with one scale per output channel, quantized here
            once, and activations quantized per row (token) on every call.
            Inference only (a gradient through an FP8 Linear raises), and
            permanent: the original weights are released, so :func:`unpatch`
            refuses the model (reload it instead). Embedders, the final
            layer and (unless ``fp8_modulation``) the AdaLN modulation
            projections stay in their dtype;
            the report lists every Linear and why. On CUDA it needs FP8
            tensor cores (sm_89+); elsewhere the reference path simulates
            the same quantization.
        fp8_fast_accum: under ``precision="fp8"``, the FP8 GEMMs' fast
            accumulation on the GPU (the default, as torchao's float8
            inference); False promotes partial sums to fp32, slower and a
            little more exact (:func:`~compile_ops.ops.fp8.fp8_linear`).
        fp8_modulation: under ``precision="fp8"``, the blocks' AdaLN
            modulation projections (one row per sample: GEMVs that read
            their weight, Flux's 3.2B parameters) in FP8 too, as torchao's
            float8 quantizes them: half their weight bytes and memory, at a
            larger step error (their rounding moves every token's shift,
            scale and gate).
        attention: None (dense attention), or a sparse self-attention
            configuration for a video DiT (Wan, LTX-Video):
            :class:`~compile_ops.SlidingTile`, :class:`~compile_ops.Radial` or
            :class:`~compile_ops.TopK`. Its self-attention layers then run
            ``fused.block_sparse_attention`` on tokens permuted into tiles
            (per grid, built once and cached; text cross-attention stays
            dense); see ``compile_ops/integrations/sparse_attention.py`` for
            the schedule and the compile count. The report's
            ``sparse_attention.describe()`` gives the density per grid.

        attention_precision: ``"exact"``, or ``"int8"``: our processors run
            dense attention as 8-bit attention (``attention(...,
            precision="int8")``: smoothed k, q in INT8 per token, k per block) on
            16-bit inference calls; training calls and fp32 models keep the
            exact kernels, sparse layouts stay 16-bit. ``"int8_fp8"``: the
            same with P V in FP8 too (``precision="int8_fp8"``; sm_89 or newer).
        attention_dense_steps: with an 8-bit ``attention_precision``, the first
            N denoising steps of each generation run exact attention (counted
            from the timestep, as sparse attention's ``dense_steps``; see
            ``compile_ops/integrations/schedule.py``: compile the blocks, not
            the whole model, when N > 0).

    Returns:
        A :class:`PatchReport`; ``print`` it for a summary.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_ops.patch: model must be a torch.nn.Module, got {type(model).__name__}")
    _check_order(model, precision)
    if attention_kernel not in ATTENTION_KERNELS:
        raise ValueError(f"compile_ops.patch: attention_kernel must be one of {ATTENTION_KERNELS}, "
                         f"got {attention_kernel!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"compile_ops.patch: precision must be one of {PRECISIONS}, got {precision!r}")
    if attention_precision not in ATTENTION_PRECISIONS:
        raise ValueError(f"compile_ops.patch: attention_precision must be one of {ATTENTION_PRECISIONS}, "
                         f"got {attention_precision!r}")
    schedule = DenseFirst(attention_dense_steps)  # validates it
    if fp8_modulation and precision != "fp8":
        raise ValueError(f"compile_ops.patch: fp8_modulation applies to precision='fp8', got precision={precision!r}")
    if attention_dense_steps and attention_precision == "exact":
        raise ValueError("compile_ops.patch: attention_dense_steps applies to an 8-bit attention_precision "
                         "('int8' or 'int8_fp8'), got attention_precision='exact'")
    if attention_precision != "exact" and not attention_processors:
        raise ValueError("compile_ops.patch: attention_precision needs attention_processors=True (our "
                         "processors run it)")
    _, act, *_ = _diffusers()
    if importlib.util.find_spec("diffusers.models.attention_dispatch") is not None:  # diffusers 0.35+
        register_diffusers_backend()  # model.set_attention_backend("compile_ops") from here on
    rules, blocks = _module_rules(), _block_rules()
    report, undo = PatchReport(), []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in list(module.named_children()):
            path = f"{prefix}.{name}" if prefix else name
            block = blocks.get(type(child))
            if block is not None:
                new = block[1].build(child)
                if new is None:
                    report.left.append((path, block[0], "a forward or norms the fused block does not reproduce; "
                                                        "its modules are patched inside"))
                else:
                    _swap_module(module, name, child, new, undo)
                    report.replaced.append((path, block[0], f"compile_ops {block[1].__name__} (fused seams)"))
                walk(new or child, path)  # the block's own modules
                continue
            rule = rules.get(type(child))
            new = rule[1](child) if rule else None
            if new is not None:
                _swap_module(module, name, child, new, undo)
                report.replaced.append((path, rule[0], f"compile_ops.{type(new).__name__}"))
                continue  # the replacement owns the subtree
            if rule:
                report.left.append((path, rule[0], "a configuration the fused module does not cover"))
            elif (why := _left_alone(child, act)) is not None:
                report.left.append((path, type(child).__name__, why))
            walk(child, path)

    walk(model, "")
    processors = _processor_rules() if attention_processors else {}
    for path, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if processor is None or not hasattr(module, "set_processor"):
            continue
        match = next((v for (attn_cls, proc_cls), v in processors.items()
                      if isinstance(module, attn_cls) and type(processor) is proc_cls), None)
        if match is None:
            how = ("it calls diffusers' attention dispatcher: model.set_attention_backend('compile_ops') runs "
                   "fused.attention there" if hasattr(processor, "_attention_backend") else "it calls SDPA itself")
            report.left.append((path, type(processor).__name__, f"attention processor not covered; kept ({how})"))
            continue
        ours = match[1](processor, attention_kernel)
        ours.attention_precision = attention_precision
        if attention_dense_steps:
            ours.int8_schedule = schedule
        module.set_processor(ours)
        undo.append(("processor", module, None, processor))
        report.replaced.append((path, match[0], f"compile_ops {match[1].__name__}"))
    if attention_dense_steps:
        undo.append(("hook", model.register_forward_pre_hook(schedule.pre_forward, with_kwargs=True), None, None))
    if attention is not None:
        _attach_sparse_attention(model, attention, report, undo)
    if precision == "fp8":
        _quantize_linears(model, report, fp8_fast_accum, fp8_modulation)
        _fuse_mlp_activations(model, report)
        # The originals in ``undo`` hold the bf16 weights: drop them, or memory would not drop.
        undo = None
    setattr(model, _STATE, undo)
    return report


def unpatch(model: nn.Module) -> None:
    """Put back what :func:`patch` replaced (the same module objects)."""
    if not hasattr(model, _STATE):
        raise RuntimeError("compile_ops.unpatch: the model is not patched")
    undo = getattr(model, _STATE)
    if undo is None:
        raise RuntimeError("compile_ops.unpatch: the model was patched with precision='fp8', which released its "
                           "original weights; load the model again instead")
    for kind, owner, name, original in reversed(undo):
        if kind == "module":
            setattr(owner, name, original)
        elif kind == "hook":
            owner.remove()  # the sparse attention pre-hook's handle
        elif isinstance(owner.processor, _FusedProcessor):
            # Ours gives back the diffusers processor it wraps: the original for
            # the one patch set, a fresh one for one diffusers rebuilt since
            # (by calling our class, as loading an IP-Adapter does).
            owner.set_processor(owner.processor.original)
        # else: diffusers put a processor of its own there since (an IP-Adapter's): it stays.
    delattr(model, _STATE)
