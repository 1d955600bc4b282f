"""``compile_ops.patch(model)`` on a Hugging Face transformers model (Llama, Qwen2).

What runs fused, per decoder layer:

- the RMSNorms (``LlamaRMSNorm``, ``Qwen2RMSNorm``, the final norm too):
  :class:`compile_ops.RMSNorm` (``fused.rmsnorm``);
- the MLP ``down_proj(silu(gate_proj(x)) * up_proj(x))``: :class:`SwiGLUMLP`,
  whose activation step is one ``fused.swiglu`` with the gate first;
- the rotary embedding of q and k: one ``fused.rope_qk`` (half-split pairs
  ``(i, i + D/2)``, the ``rotate_half`` convention) in the attention module.

Where the rotary hook is, and why. transformers 5 applies the rotation in the
attention module's ``forward`` (``apply_rotary_pos_emb(q, k, cos, sin)``, a
module-level function of each ``modeling_<model>.py``) *before* it calls the
attention interface (``ALL_ATTENTION_FUNCTIONS``), which therefore receives q
and k already rotated: registering an attention function cannot reach the
rotation. Rebinding ``apply_rotary_pos_emb`` in transformers' modules would
change every model of that class in the process, patched or not, and
``unpatch`` could not scope it. So the attention module itself is replaced,
as diffusers' Flux blocks are (integrations/diffusers/blocks.py): by an
instance of a subclass of the original class (``isinstance`` holds, so
transformers' output recording, ``output_attentions``, still finds it) whose
``forward`` is transformers' with the rotation as ``fused.rope_qk``; it holds
the original's Linears and attributes, and the attention itself still goes through
``ALL_ATTENTION_FUNCTIONS`` (``config._attn_implementation``: sdpa, eager,
flash, ``compile_ops`` if registered) and the KV cache as before. It is
replaced only when the class is exactly one listed in :data:`FAMILIES` and its
forward has the signature reproduced (another transformers release with
another forward is left and reported).

Replacements keep transformers' submodule and parameter names and share the
original tensors, so ``state_dict()`` keys, loading, ``model.to(...)`` and
optimizer state are unchanged, and :func:`compile_ops.unpatch` puts the
originals back (the diffusers integration's unpatch: the same undo record,
integrations/module_swap.py).

Numerics: the fused ops compute in fp32 and round once, where transformers
rounds after each step in the model's dtype (RMSNorm rounds the normalized x
before the weight, rotary rounds each product); in fp32 the two agree to
rounding. One dtype rule differs: with a 16-bit input and an fp32 norm weight,
transformers' RMSNorm returns fp32 (the product's promotion) and
``fused.rmsnorm`` the input's dtype.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Optional

import torch
from torch import Tensor, nn

from compile_ops.integrations.module_swap import PATCH_STATE, PatchReport, build_on_meta, check_patchable, swap_module
from compile_ops.integrations.options import PatchOptions
from compile_ops.modules.norm import RMSNorm
from compile_ops.ops.glu import swiglu
from compile_ops.ops.rope import rope_qk

#: ``{transformers.models.<name>: (class prefix, attention attributes passed to
#: the attention interface)}``: the families whose RMSNorm, MLP and attention
#: forwards are reproduced (transformers 5.17-5.24). Qwen2 hands its sliding window
#: to the interface; Llama has none.
FAMILIES = {
    "llama": ("Llama", ()),
    "qwen2": ("Qwen2", ("sliding_window",)),
}


def is_transformers_model(model) -> bool:
    """Whether ``model`` is a transformers module (a ``PreTrainedModel`` or one
    of its layers), told by its class's module so that transformers is not
    imported to ask."""
    return any(cls.__module__.split(".")[0] == "transformers" for cls in type(model).__mro__)


class SwiGLUMLP(nn.Module):
    """transformers' Llama-style MLP, ``down_proj(silu(gate_proj(x)) * up_proj(x))``,
    with the activation step as one ``fused.swiglu``.

    Input ``[..., hidden_size]``, output ``[..., hidden_size]``. The Linears keep
    transformers' names (``gate_proj``, ``up_proj``, ``down_proj``), so state
    dicts load unchanged. The two projections are concatenated gate first
    (``[..., 2 * intermediate_size]``, the op's ``gate_first=True`` layout):
    under ``torch.compile`` Inductor writes both GEMMs straight into the halves
    of one buffer (checked on its CPU output code), so the concatenation costs
    nothing there; in eager it is one extra copy of the two projections.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)
        return self.down_proj(swiglu(gate_up, gate_first=True))


class RotaryAttention(nn.Module):
    """The forward of transformers' Llama-style attention with the rotary
    embedding of q and k as one ``fused.rope_qk``. Mixed in before the
    original class (``type(...)`` in :func:`_attention_class`), so instances
    are still instances of it; built from an original instance, whose Linears
    (the same objects) and plain attributes (config, layer_idx, head_dim,
    scaling, ...) it takes."""

    #: The original forward's parameters, in order, as transformers releases
    #: have them: 5.17-5.23 pass the KV cache as ``past_key_values``; 5.24
    #: renamed it ``cache`` and hands the call's kwargs to its ``update``.
    signatures = (
        ("hidden_states", "position_embeddings", "attention_mask", "past_key_values", "kwargs"),
        ("hidden_states", "position_embeddings", "attention_mask", "cache", "kwargs"),
    )
    #: Set per family: module attributes passed to the attention interface, and
    #: the family's ``eager_attention_forward`` (the interface's default).
    interface_attributes: tuple = ()
    eager_attention_forward = None

    def __init__(self, original: nn.Module):
        # nn.Module's __init__, not the transformers class's: that one would
        # build new Linears from the config.
        nn.Module.__init__(self)
        for name, value in vars(original).items():
            if not name.startswith("_"):  # nn.Module's own state, hooks included, stays the original's
                setattr(self, name, value)
        for name, child in original.named_children():
            setattr(self, name, child)

    def forward(
        self,
        hidden_states: Tensor,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        attention_mask: Optional[Tensor] = None,
        past_key_values=None,
        cache=None,
        **kwargs,
    ):
        """hidden_states ``[B, L, hidden]``; position_embeddings ``(cos, sin)``, each
        ``[B or 1, L, head_dim]`` (transformers' full tables, in the model's dtype);
        the KV cache as ``cache`` (transformers 5.24) or ``past_key_values`` (earlier).
        Returns ``(output [B, L, hidden], attention weights or None)``, as transformers'."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        cos, sin = position_embeddings
        # The projections' [B, L, H, D] views go to the op as they are (seq_dim=1):
        # it reads any strides and writes contiguous outputs, so transformers'
        # transpose before the rotation is only a view after it.
        query, key = rope_qk(
            self.q_proj(hidden_states).view(hidden_shape),
            self.k_proj(hidden_states).view(hidden_shape),
            cos,
            sin,
            interleaved=False,
            seq_dim=1,
        )
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        elif past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, type(self).eager_attention_forward
        )
        extra = {name: getattr(self, name) for name in self.interface_attributes}
        attn_output, attn_weights = interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **extra,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    @classmethod
    def build(cls, original: nn.Module) -> Optional[nn.Module]:
        """The replacement of ``original``, or None when its forward or parameters
        are not the ones reproduced."""
        params = tuple(inspect.signature(type(original).forward).parameters)[1:]
        children = {name for name, _ in original.named_children()}
        if (
            params not in cls.signatures
            or children != {"q_proj", "k_proj", "v_proj", "o_proj"}
            or next(original.parameters(recurse=False), None) is not None
        ):
            return None
        return cls(original)


_ATTENTION_CLASSES: dict = {}


def _attention_class(original_cls: type, interface_attributes: tuple) -> type:
    """``Fused<Name>(RotaryAttention, <Name>)``, made once per transformers class
    (one class per original: torch.compile guards on the module's type)."""
    if original_cls not in _ATTENTION_CLASSES:
        module = sys.modules[original_cls.__module__]
        _ATTENTION_CLASSES[original_cls] = type(
            f"Fused{original_cls.__name__}",
            (RotaryAttention, original_cls),
            {
                "__module__": __name__,
                "interface_attributes": interface_attributes,
                "eager_attention_forward": staticmethod(module.eager_attention_forward),
            },
        )
    return _ATTENTION_CLASSES[original_cls]


def _rms_norm(old: nn.Module) -> Optional[nn.Module]:
    return build_on_meta(lambda: RMSNorm(old.weight.shape[0], old.variance_epsilon), old)


def _mlp(old: nn.Module) -> Optional[nn.Module]:
    from transformers.activations import SiLUActivation

    if type(old.act_fn) not in (SiLUActivation, nn.SiLU):
        return None
    return build_on_meta(
        lambda: SwiGLUMLP(old.gate_proj.in_features, old.gate_proj.out_features, old.gate_proj.bias is not None), old
    )


_NOT_REPRODUCED = "a configuration or forward the fused module does not reproduce"


def _rules(attention: bool) -> tuple[dict, dict]:
    """``({exact class: (what, build(old) -> new or None, why it is left when None)},
    {rotary embedding class: family prefix})`` for the :data:`FAMILIES`."""
    rules, rotary = {}, {}
    for family, (prefix, attributes) in FAMILIES.items():
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        rules[getattr(module, f"{prefix}RMSNorm")] = (f"transformers {prefix}RMSNorm", _rms_norm, _NOT_REPRODUCED)
        rules[getattr(module, f"{prefix}MLP")] = (
            f"transformers {prefix}MLP",
            _mlp,
            "not a SiLU MLP (fused.swiglu computes value * silu(gate))",
        )
        cls = getattr(module, f"{prefix}Attention")
        rules[cls] = (
            (f"transformers {prefix}Attention", _attention_class(cls, attributes).build, _NOT_REPRODUCED)
            if attention
            else (
                f"transformers {prefix}Attention",
                lambda old: None,
                "attention_processors=False: transformers' rotary embedding kept",
            )
        )
        rotary[getattr(module, f"{prefix}RotaryEmbedding")] = prefix
    return rules, rotary


def _reject_diffusers_options(options: PatchOptions) -> None:
    """The options that apply to diffusers models only must be at their defaults."""
    changed = [name for name in options.changed() if name != "attention_processors"]
    if changed:
        raise ValueError(
            f"compile_ops.patch: {', '.join(changed)} apply to diffusers models; a transformers "
            "model takes attention_processors only"
        )


def patch(model: nn.Module, options: Optional[PatchOptions] = None) -> PatchReport:
    """Swap the fused ops into a Hugging Face transformers model (Llama, Qwen2), in place.

    Call it before ``torch.compile`` (it raises on a compiled model). Works on
    CPU (the ops' reference paths) and CUDA; training and inference.

    Args:
        model: a transformers ``LlamaForCausalLM`` / ``LlamaModel`` /
            ``Qwen2ForCausalLM`` / ``Qwen2Model`` (or one of their layers);
            other families' modules are left and reported.
        options: :class:`~compile_ops.integrations.options.PatchOptions`
            (None: the defaults). ``attention_processors``: also replace the
            attention modules, whose rotary embedding then runs as
            ``fused.rope_qk`` (the attention itself stays transformers'
            ``config._attn_implementation``); False: norms and MLPs only. The
            other options apply to diffusers models; here they must be left
            at their defaults.

    Returns:
        A :class:`~compile_ops.integrations.module_swap.PatchReport`: replaced
        modules, and those left (other families' norms, MLPs and attention,
        non-SiLU MLPs, the rotary embedding modules that build the tables).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_ops.patch: model must be a torch.nn.Module, got {type(model).__name__}")
    options = PatchOptions() if options is None else options
    _reject_diffusers_options(options)
    check_patchable(model, "bf16")
    rules, rotary = _rules(options.attention_processors)
    report, undo = PatchReport(), []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in list(module.named_children()):
            path = f"{prefix}.{name}" if prefix else name
            rule = rules.get(type(child))
            new = rule[1](child) if rule else None
            if new is not None:
                swap_module(module, name, child, new, undo)
                report.replaced.append((path, rule[0], f"compile_ops {type(new).__name__}"))
                continue  # the replacement holds the original's children, which need nothing
            if rule:
                report.left.append((path, rule[0], rule[2]))
            elif type(child) in rotary:
                report.left.append(
                    (
                        path,
                        type(child).__name__,
                        "transformers' cos/sin tables, kept (the attention modules rotate q and k with them)",
                    )
                )
            elif type(child).__name__.endswith(("RMSNorm", "MLP", "Attention")):
                report.left.append(
                    (
                        path,
                        type(child).__name__,
                        "a class whose forward compile_ops does not "
                        f"reproduce (covered: {', '.join(p for p, _ in FAMILIES.values())})",
                    )
                )
            walk(child, path)

    walk(model, "")
    setattr(model, PATCH_STATE, undo)
    return report
