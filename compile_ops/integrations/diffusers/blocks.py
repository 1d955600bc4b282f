"""diffusers blocks whose forward we reproduce with their seams fused.

Blocks have no extension point for their gated residuals, so a block whose
forward we reproduce (Flux's double- and single-stream blocks, Wan's) is
swapped for one that runs its seams as ``fused.gated_residual_norm_modulate``
/ ``fused.gated_residual`` (and ``fused.norm_modulate``). It is swapped only
when its class is exactly diffusers' and its forward's signature and norms
are the ones reproduced; its children are then patched inside the new block.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import nn

from compile_ops.integrations.diffusers.fp8_linears import reads_fp8_rows
from compile_ops.integrations.diffusers.module_rules import diffusers_modules
from compile_ops.integrations.diffusers.processors import FluxAttnProcessor, WanAttnProcessor
from compile_ops.modules.fp8 import takes_fp8_rows
from compile_ops.modules.hooks import must_call
from compile_ops.modules.modulate import AdaLayerNormZero, AdaLayerNormZeroSingle
from compile_ops.modules.norm import LayerNorm
from compile_ops.ops.fp8 import quantize_fp8_rows
from compile_ops.ops.modulate import (
    gated_residual,
    gated_residual_norm_modulate,
    gated_residual_norm_modulate_fp8,
    norm_modulate,
    norm_modulate_fp8,
)


class BlockForward(nn.Module):
    """A diffusers block's forward with its seams fused. It holds the original
    block's children (the same objects; :func:`compile_ops.patch` then patches
    them inside this block, leaving the original's untouched for
    :func:`compile_ops.unpatch`, which hands the original the peft LoRA layers
    put on this block's Linears since)."""

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


def _is_plain_layer_norm(norm: nn.Module) -> bool:
    """A LayerNorm over the last dim that the fused seams compute: torch's, ours,
    or diffusers' FP32LayerNorm (computed in fp32 and cast back, as the kernels do)."""
    layer_norms = (nn.LayerNorm, LayerNorm, diffusers_modules().normalization.FP32LayerNorm)
    return type(norm) in layer_norms and len(norm.normalized_shape) == 1


class FluxTransformerBlock(BlockForward):
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
        seam = gated_residual_norm_modulate_fp8 if reads_fp8_rows(ff) else gated_residual_norm_modulate
        # Under precision="fp8" the seam writes e4m3 rows + scales for the MLP's
        # first FP8Linear, in the same kernel: no bf16 round trip, no quantize pass.
        stream, normed = seam(stream, attn_out, gate_attn, scale, shift, norm.weight, norm.bias, "layernorm", norm.eps)
        return gated_residual(stream, ff(normed), gate_ff)

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, joint_attention_kwargs=None):
        # Under precision="fp8" both AdaLN norms write e4m3 rows for q/k/v directly.
        fp8 = (
            isinstance(self.norm1, AdaLayerNormZero)
            and isinstance(self.norm1_context, AdaLayerNormZero)
            and FluxAttnProcessor.takes_fp8_rows(self.attn, encoder_hidden_states, joint_attention_kwargs)
        )
        normed, *image_mod = self.norm1(hidden_states, emb=temb, **_fp8_rows_kwarg(fp8))
        normed_context, *context_mod = self.norm1_context(encoder_hidden_states, emb=temb, **_fp8_rows_kwarg(fp8))
        outputs = self.attn(
            hidden_states=normed,
            encoder_hidden_states=normed_context,
            image_rotary_emb=image_rotary_emb,
            **(joint_attention_kwargs or {}),
        )
        hidden_states = self._second_half(hidden_states, outputs[0], *image_mod, self.norm2, self.ff)
        if len(outputs) == 3:  # IP-adapter attention, added after the MLP as diffusers does
            hidden_states = hidden_states + outputs[2]
        encoder_hidden_states = self._second_half(
            encoder_hidden_states, outputs[1], *context_mod, self.norm2_context, self.ff_context
        )
        if encoder_hidden_states.dtype == torch.float16:
            encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
        return encoder_hidden_states, hidden_states


def _fp8_rows_kwarg(fp8: bool) -> dict:
    """``{"fp8_rows": True}`` for our AdaLN norms' FP8 output mode, else nothing
    (the plain call, which any norm module takes)."""
    return {"fp8_rows": True} if fp8 else {}


def _fp8_concat_activation(act: nn.Module, proj_out: nn.Module) -> Optional[str]:
    """The ``quantize_fp8_rows`` activation that lets ``proj_out`` (an FP8Linear, or a LoRA layer over one)
    take ``cat([attention, act(mlp)])`` quantized in one pass, or None."""
    if not takes_fp8_rows(proj_out) or type(act) is not nn.GELU:
        return None
    return "gelu" if act.approximate == "none" else "gelu_tanh"


class FluxSingleTransformerBlock(BlockForward):
    """diffusers' ``FluxSingleTransformerBlock`` with the gated residual after
    ``proj_out`` as ``fused.gated_residual``. Under ``precision="fp8"`` the
    MLP's GELU, the concatenation with the attention output and the
    quantization for ``proj_out`` are one pass (``quantize_fp8_rows`` with a
    head): neither the activation nor the concatenation is written."""

    signature = ("hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb", "joint_attention_kwargs")

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, joint_attention_kwargs=None):
        text_tokens = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        # Under precision="fp8" the AdaLN norm writes e4m3 rows for proj_mlp and q/k/v directly.
        fp8 = (
            isinstance(self.norm, AdaLayerNormZeroSingle)
            and takes_fp8_rows(self.proj_mlp)
            and FluxAttnProcessor.takes_fp8_rows(self.attn, None, joint_attention_kwargs)
        )
        normed, gate = self.norm(hidden_states, emb=temb, **_fp8_rows_kwarg(fp8))
        mlp = self.proj_mlp(normed)
        attn_out = self.attn(hidden_states=normed, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
        fp8_activation = _fp8_concat_activation(self.act_mlp, self.proj_out)
        if fp8_activation is not None:
            projected = self.proj_out(quantize_fp8_rows(mlp, fp8_activation, head=attn_out))
        else:
            projected = self.proj_out(torch.cat([attn_out, self.act_mlp(mlp)], dim=2))
        hidden_states = gated_residual(hidden_states, projected, gate)
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return hidden_states[:, :text_tokens], hidden_states[:, text_tokens:]


class WanTransformerBlock(BlockForward):
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
        if not (
            _is_plain_layer_norm(original.norm1)
            and _is_plain_layer_norm(original.norm3)
            and (type(norm2) is nn.Identity or _is_plain_layer_norm(norm2))
        ):
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
            seam = (
                gated_residual_norm_modulate_fp8
                if WanAttnProcessor.takes_fp8_rows(self.attn2, cross=True)
                else gated_residual_norm_modulate
            )
            zero = torch.zeros_like(shift)
            hidden_states, normed = seam(
                hidden_states, attn_out, gate, zero, zero, norm2.weight, norm2.bias, "layernorm", norm2.eps
            )
        attn_out = self.attn2(normed, encoder_hidden_states, None, None)
        # 3. Feed-forward: the (ungated) cross-attention residual and the MLP's modulated norm in one pass.
        seam = gated_residual_norm_modulate_fp8 if reads_fp8_rows(self.ffn) else gated_residual_norm_modulate
        hidden_states, normed = seam(
            hidden_states,
            attn_out,
            torch.ones_like(c_gate),
            c_scale,
            c_shift,
            norm3.weight,
            norm3.bias,
            "layernorm",
            norm3.eps,
        )
        return gated_residual(hidden_states, self.ffn(normed), c_gate)


def block_rules() -> dict:
    """``{exact block class: (what, our block class)}``: blocks whose forward we
    reproduce with fused seams; their children are patched inside."""
    modules = diffusers_modules()
    flux, wan = modules.flux, modules.wan
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
