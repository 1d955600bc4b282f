"""LoRA (peft) on :class:`~compile_ops.FP8Linear`: the adapters run in the
activation dtype beside the FP8 GEMM, on the rows it reads:
``y = fp8_linear(rows) + scaling * B(A(rows.q * rows.scale))``, ``rows`` x
quantized per row once (or handed on by the kernel that produced x); in
inference each adapter is one ``fused.fp8_rows_lora`` call on the codes.

How peft finds it: peft builds a LoRA layer for a target module through
``LoraModel._create_new_module``, the one call that every way of adding an
adapter goes through (peft's ``get_peft_model`` / ``inject_adapter_in_model``,
diffusers' ``add_adapter`` and ``load_lora_adapter``, hotswapping). diffusers
builds the ``LoraConfig`` itself, so peft's per-config custom-module mapping
cannot reach it, and an FP8Linear posing as an ``nn.Linear`` would be merged by
peft's default layer into a ``weight`` it does not have. :func:`register`
(run when this module is imported, which ``patch(precision="fp8")`` does)
puts a dispatcher in front of peft's:
an FP8Linear target gets an :class:`FP8LoraLinear`, anything else what peft
gives it.

What runs: plain LoRA with any rank, alpha, rsLoRA, dropout, rank and alpha
patterns, ``lora_bias``, several adapters with weights (``set_adapters``),
disabling, deleting and hotswapping. What does not, refused by name
(:func:`why_not_fp8`): LoRA variants (DoRA, ...), initializations that read
the base weight (PiSSA, OLoRA, ...), ``fan_in_fan_out``.

Merging (``fuse_lora``, peft's ``merge``) requantizes: the FP8 weight is
dequantized, the deltas added in fp32 and the sum quantized per output
channel again, so the merged layer rounds ``W + scaling * B @ A`` to e4m3
once more. Unmerging puts back the codes and scales kept at the first merge,
byte for byte, instead of subtracting and rounding again (which would leave
the weight a rounding away from where it was after every fuse and unfuse);
the copy (the FP8 weight's size) goes when the layer unmerges or the LoRA is
unloaded.

diffusers' Flux pipelines (``FluxLoraLoaderMixin.load_lora_weights``) check,
before loading, whether the LoRA grows a Linear (Control LoRAs widen
``x_embedder``) by reading each target's ``weight`` from the transformer's
state dict, which an FP8Linear does not have. :func:`register` wraps those
two class methods of diffusers' mixin (there is no per-model hook: the
check reads ``transformer.state_dict()``, and giving FP8Linear a ``weight``
entry would change what the model saves): a LoRA's FP8Linear targets skip
diffusers' shape expansion, and one that would grow an FP8Linear is refused
by name. A LoRA with no FP8Linear target goes through diffusers' code untouched.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Any, Optional

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.model import LoraModel
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge
from torch import Tensor, nn

from compile_ops._library import interpreted_bf16_dot
from compile_ops.meta.fp8 import LORA_DTYPES
from compile_ops.modules.fp8 import FP8Linear
from compile_ops.modules.hooks import must_call
from compile_ops.ops.fp8 import FP8Rows, fp8_rows_lora, quantize_fp8_rows

#: ``init_lora_weights`` values that do not read the base layer's weight.
PLAIN_INITS = (True, False, "gaussian")

#: Where the codes and scales from before the first merge are kept (peft's per-layer cache, not in the state_dict).
BEFORE_MERGE = "compile_ops_fp8_before_merge"


def why_not_fp8(config: Any) -> Optional[str]:
    """Why a LoRA of ``config`` (a peft ``LoraConfig``) cannot run on an FP8Linear,
    naming the argument, or None when it can."""
    if getattr(config, "use_dora", False):
        return (
            "use_dora=True: DoRA rescales every output channel by the norm of W + scaling * B @ A, "
            "which needs the full-precision weight that FP8Linear does not keep"
        )
    variants = [
        field.name
        for field in dataclasses.fields(config)
        if field.metadata.get("is_lora_variant") and getattr(config, field.name)
    ]
    if variants:
        return (
            f"{', '.join(variants)}: a LoRA variant whose forward or merge FP8Linear does not implement "
            "(plain LoRA only)"
        )
    init = config.init_lora_weights
    if not any(init is plain or (isinstance(plain, str) and init == plain) for plain in PLAIN_INITS):
        return (
            f"init_lora_weights={init!r}: this initialization reads the base layer's weight, and FP8Linear "
            "keeps only its e4m3 codes (use True, False or 'gaussian', or load the adapter's weights)"
        )
    if config.fan_in_fan_out:
        return "fan_in_fan_out=True: FP8Linear's weight is [out_features, in_features], as nn.Linear's"
    return None


def why_layer_not_fp8(layer: nn.Module) -> Optional[str]:
    """Why the adapters already in ``layer`` (a peft ``lora.Linear`` over an
    ``nn.Linear``) cannot move onto an FP8Linear (None: they can)."""
    if type(layer) is not LoraLinear:
        return f"a peft {type(layer).__name__}, whose forward and merge are its own"
    if any(layer.use_dora.values()) or layer.lora_variant:
        names = sorted(set(layer.lora_variant) | {name for name, on in layer.use_dora.items() if on})
        return f"adapter(s) {', '.join(names)} are a LoRA variant (DoRA, ...), which needs the full-precision weight"
    if layer.fan_in_fan_out:
        return "its adapters were made with fan_in_fan_out=True"
    if layer.merged:
        return (
            "its adapters are merged into the weight (fuse_lora): unfuse_lora before patch, or unload the "
            "LoRA after fusing (unload_lora_weights) to quantize the fused weight"
        )
    return None


class FP8LoraLinear(LoraLinear):
    """peft's LoRA ``Linear`` over a :class:`~compile_ops.FP8Linear`: ``forward(x)``
    is ``base_layer(x) + sum over active adapters of scaling * B(A(dropout(x)))``,
    the adapters in the activation dtype (the dtype they were loaded in; a new
    adapter takes the FP8Linear's ``out_dtype``, the original weight's).

    ``x [..., in_features]``, or :class:`~compile_ops.FP8Rows` ``(q, scale)``
    that a fused kernel quantized for the FP8 GEMM (a patched model's
    producers hand them to these layers as to bare FP8Linears,
    ``TAKES_FP8_ROWS``): the GEMM reads the rows, and the adapters read the
    same rows dequantized (``q * scale``). A tensor x is quantized once for
    both, so the output does not depend on whether a producer fused the
    quantization (except for an x whose dtype is not the FP8Linear's
    ``out_dtype``: its adapters read x as it is). Output:
    ``[..., out_features]``, x's dtype (the FP8Linear's ``out_dtype`` for
    rows).

    How an adapter runs: in inference (nothing to differentiate, dropout
    inactive, no ``lora_bias``, no per-sample adapters, unhooked Linears, B in
    the output's dtype) as one :func:`~compile_ops.fp8_rows_lora` op, which
    reads the FP8 codes and never writes the dequantized rows; otherwise as
    peft's Linears on ``q * scale`` (:meth:`_rows_op_scalings` decides).

    Why the adapters read the quantized rows: the producers' FP8 epilogues
    (the AdaLN norms, the GELU, attention) then write one output for the
    whole layer, where unquantized adapters need a 16-bit copy written and
    every LoRA'd Linear quantizing its own input again
    (docs/notes/fp8.md, "LoRA on FP8 models").

    ``merge`` / ``unmerge``: see the module docstring. Everything else
    (``set_adapter``, ``set_scale``, ``delete_adapter``, hotswapping) is
    peft's own.
    """

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config: Any, **kwargs) -> None:
        """peft's, after refusing what FP8Linear cannot run (:func:`why_not_fp8`)."""
        why = why_not_fp8(config)
        if why is not None:
            raise ValueError(f"LoRA adapter {adapter_name!r} on a compile_ops FP8Linear: {why}")
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    @property
    def lora_variants(self) -> dict:
        """Plain LoRA only (peft's variant table); :meth:`update_layer` names what it refuses."""
        return {(): None}

    def _get_in_out_features(self, module: nn.Module) -> tuple:
        base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
        return base.in_features, base.out_features

    def _get_base_layer_device_and_dtype(self, base_layer: nn.Module) -> tuple:
        # The adapters take the activation dtype, not float8 (what peft would read from the weight).
        base = base_layer.get_base_layer() if isinstance(base_layer, BaseTunerLayer) else base_layer
        return base.weight_q.device, base.out_dtype

    #: Fused producers may hand it FP8 rows (``compile_ops.modules.fp8.takes_fp8_rows``).
    TAKES_FP8_ROWS = True

    def forward(self, x, *args: Any, **kwargs: Any) -> Tensor:
        """``x [..., in_features]`` or ``FP8Rows(q [..., in_features], scale [...])``
        -> ``[..., out_features]``; ``adapter_names`` (a keyword, one name per
        sample of x's first dim): peft's per-sample adapters."""
        if isinstance(x, FP8Rows):
            return self._forward_rows(x, *args, **kwargs)
        base = self.get_base_layer()
        if self.disable_adapters or self.merged or not isinstance(x, Tensor) or x.dtype != base.out_dtype:
            return super().forward(x, *args, **kwargs)
        return self._forward_rows(quantize_fp8_rows(x), *args, **kwargs)

    def _forward_rows(self, rows: FP8Rows, *args: Any, adapter_names: Optional[list] = None, **kwargs: Any) -> Tensor:
        """``forward`` of already-quantized rows ``q [B, ..., K]``: the adapters
        read ``q * scale``, through ``fused.fp8_rows_lora`` where
        :meth:`_rows_op_scalings` allows it; ``adapter_names`` (one per sample,
        peft's mixed batches) picks each sample's adapter."""
        if self.disable_adapters and self.merged:
            self.unmerge()
        result = self.base_layer(rows, *args, **kwargs)
        if self.disable_adapters or self.merged:
            return result
        x = None  # the rows dequantized, for the adapters that take peft's path
        if adapter_names is None:
            groups = [(adapter, None) for adapter in self.active_adapters]
        else:
            if len(adapter_names) != rows.q.shape[0]:
                raise ValueError(
                    f"adapter_names must name one adapter per sample: got {len(adapter_names)} for {rows.q.shape[0]}"
                )
            groups = [
                (adapter, [i for i, name in enumerate(adapter_names) if name == adapter])
                for adapter in dict.fromkeys(adapter_names)
                if adapter != "__base__"
            ]
        out_dtype = result.dtype
        for adapter, samples in groups:
            if adapter not in self.lora_A:
                continue
            lora_a, lora_b = self.lora_A[adapter], self.lora_B[adapter]
            scalings = None if samples is not None else self._rows_op_scalings(adapter, rows, result)
            if scalings is not None:
                result = fp8_rows_lora(result, rows.q, rows.scale, lora_a.weight, lora_b.weight, *scalings)
                continue
            if x is None:
                x = rows.dequantized()
            inputs = self.lora_dropout[adapter]((x if samples is None else x[samples]).to(lora_a.weight.dtype))
            if (
                samples is None
                and lora_b.bias is None
                and lora_b.weight.dtype == result.dtype
                and not must_call(lora_b)  # an offloading hook moves its weight when it is called
            ):
                # B's product added in its GEMM's epilogue (beta = 1): the delta is never written
                # on its own, and no elementwise kernel reads the output again to add it.
                down = lora_a(inputs) * self.scaling[adapter]
                rows_2d = result.reshape(-1, result.shape[-1])
                result = torch.addmm(rows_2d, down.reshape(-1, down.shape[-1]), lora_b.weight.t()).view(result.shape)
                continue
            delta = lora_b(lora_a(inputs)) * self.scaling[adapter]
            if samples is None:
                result = result + delta
            else:
                result[samples] += delta.to(out_dtype)
        return result.to(out_dtype)

    def _rows_op_scalings(self, adapter: str, rows: FP8Rows, result: Tensor) -> Optional[tuple]:
        """``(scaling, scaling_tensor)`` for :func:`~compile_ops.fp8_rows_lora` when
        ``adapter`` can run as that op on ``rows`` (added to ``result``), else
        None (peft's path: dequantized rows, ``lora_A`` and B's ``addmm``).

        The op needs: no gradient to record (inference), no active dropout, no
        ``lora_bias``, plain Linears whose calls are not hooked (an offloading
        hook moves a weight when its module is called, so a hooked module is
        called), B in result's dtype, on result's device (not bf16 under triton's
        interpreter on the CPU, whose dots take none). A hotswap-ready
        adapter's scaling (a 0-dim tensor, peft's ``enable_lora_hotswap``) is
        passed as the tensor, so a swap changes no constant of a compiled graph.
        Per-sample adapters (``adapter_names``) never come here."""
        lora_a, lora_b, dropout = self.lora_A[adapter], self.lora_B[adapter], self.lora_dropout[adapter]
        if not (isinstance(lora_a, nn.Linear) and isinstance(lora_b, nn.Linear)):
            return None
        if lora_a.bias is not None or lora_b.bias is not None or must_call(lora_a) or must_call(lora_b):
            return None
        if not (isinstance(dropout, nn.Identity) or isinstance(dropout, nn.Dropout) and not dropout.training):
            return None
        a, b = lora_a.weight, lora_b.weight
        if b.dtype != result.dtype or a.dtype != b.dtype or a.dtype not in LORA_DTYPES:
            return None
        if a.device != result.device or b.device != result.device:
            return None
        if interpreted_bf16_dot(a):
            return None  # the op refuses them there
        scaling = self.scaling[adapter]
        if isinstance(scaling, Tensor):
            if scaling.dim() != 0 or not scaling.is_floating_point() or scaling.device != result.device:
                return None
            scalings = (1.0, scaling)
        elif isinstance(scaling, (int, float)) and not isinstance(scaling, bool):
            scalings = (float(scaling), None)
        else:
            return None
        tensors = (a, b, result, rows.q, rows.scale, scalings[1])
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
            return None
        return scalings

    def _delta_fp32(self, adapter: str) -> Tensor:
        """``scaling * B @ A`` of ``adapter``, ``[out_features, in_features]`` fp32."""
        lora_a, lora_b = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        return (lora_b.float() @ lora_a.float()) * self.scaling[adapter]

    @torch.no_grad()
    def merge(self, safe_merge: bool = False, adapter_names: Optional[list] = None) -> None:
        """Merge ``adapter_names`` (None: the active adapters) into the FP8 weight:
        dequantize, add their deltas (and ``lora_bias`` biases) in fp32,
        quantize per output channel again. ``safe_merge``: raise, naming the
        adapter, before anything changes if the sum is not finite."""
        adapter_names = check_adapters_to_merge(self, adapter_names)
        adapter_names = [name for name in adapter_names if name in self.lora_A]
        if not adapter_names:
            return
        base = self.get_base_layer()
        weight = base.dequantized_weight()
        bias = None if base.bias is None else base.bias.float()
        for adapter in adapter_names:
            weight = weight + self._delta_fp32(adapter)
            if self.lora_bias[adapter]:
                if bias is None:
                    raise RuntimeError(
                        "Impossible to merge LoRA with `lora_bias=True` because the base layer has no bias."
                    )
                bias = bias + self.lora_B[adapter].bias.float() * self.scaling[adapter]
            if safe_merge and not (weight.isfinite().all() and (bias is None or bias.isfinite().all())):
                raise ValueError(f"NaNs detected in the merged weights. The adapter {adapter} seems to be broken")
        if not self.merged:
            kept = (base.weight_q.clone(), base.weight_scale.clone(), None if base.bias is None else base.bias.clone())
            self._cache_store(BEFORE_MERGE, kept)
        base.requantize_(weight)
        if bias is not None:
            base.bias.copy_(bias)
        self.merged_adapters.extend(adapter_names)

    @torch.no_grad()
    def unmerge(self) -> None:
        """Unmerge every merged adapter: the FP8 weight (and bias) from before the
        first merge, byte for byte."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
            return
        base = self.get_base_layer()
        weight_q, weight_scale, bias = self._cache_pop(BEFORE_MERGE)
        base.weight_q.copy_(weight_q)
        base.weight_scale.copy_(weight_scale)
        if bias is not None:
            base.bias.copy_(bias)
        self.merged_adapters.clear()


def to_fp8(layer: LoraLinear, fp8: FP8Linear) -> FP8LoraLinear:
    """``layer`` (a peft ``lora.Linear`` that :func:`why_layer_not_fp8` accepts)
    over ``fp8``, its base Linear quantized: the same object, adapters and
    state, now an :class:`FP8LoraLinear` (its class changes in place, so
    references to it and its hooks stay valid)."""
    layer.base_layer = fp8
    layer.__class__ = FP8LoraLinear
    return layer


def is_adapter_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a peft adapter layer (LoRA or another tuner's) around a base layer."""
    return isinstance(module, BaseTunerLayer)


def fp8_targets(model: nn.Module) -> dict:
    """``{path: FP8Linear}``: where a LoRA state dict names each FP8Linear of
    ``model``: its own path, or that of the peft layer wrapping it."""
    wrapped = {}
    for path, module in model.named_modules():
        if isinstance(module, BaseTunerLayer) and isinstance(module.get_base_layer(), FP8Linear):
            wrapped[path] = module.get_base_layer()
    bases = {id(base) for base in wrapped.values()}
    bare = {path: m for path, m in model.named_modules() if isinstance(m, FP8Linear) and id(m) not in bases}
    return {**bare, **wrapped}


def _lora_shapes(lora_state_dict: dict, prefix: str) -> dict:
    """``{module path: (in_features of lora_A, out_features of lora_B)}`` of a
    diffusers-layout LoRA state dict (``{prefix}{path}.lora_A.weight [r, K]``,
    ``...lora_B.weight [N, r]``); ``prefix`` is stripped where keys carry it."""
    shapes = {}
    for key, lora_a in lora_state_dict.items():
        if key.endswith(".lora_A.weight"):
            path = key[: -len(".lora_A.weight")]
            lora_b = lora_state_dict.get(f"{path}.lora_B.weight")
            shapes[path.removeprefix(prefix)] = (lora_a.shape[1], None if lora_b is None else lora_b.shape[0])
    return shapes


def check_lora_fits_fp8(transformer: nn.Module, lora_state_dict: dict, prefix: str) -> None:
    """Raise, naming the module, when the LoRA ``lora_state_dict`` (diffusers
    layout, keys under ``prefix``) would grow one of ``transformer``'s
    FP8Linears (a Flux Control LoRA widening its input): the full-precision
    weight that growing would pad is gone."""
    targets = fp8_targets(transformer)
    for path, (in_features, out_features) in _lora_shapes(lora_state_dict, prefix).items():
        fp8 = targets.get(path)
        if fp8 is None:
            continue
        if in_features > fp8.in_features or (out_features or 0) > fp8.out_features:
            raise ValueError(
                f"compile_ops: this LoRA grows {path} (a compile_ops FP8Linear, in_features={fp8.in_features}, "
                f"out_features={fp8.out_features}) to in_features={in_features}, out_features={out_features}, as "
                "Flux Control LoRAs do; an FP8Linear cannot grow (patch(precision='fp8') released its "
                "full-precision weight): load this LoRA before compile_ops.patch"
            )


def _wrap_flux_lora_checks(mixin: type) -> None:
    """Wrap ``mixin``'s (diffusers' ``FluxLoraLoaderMixin``) two shape checks
    so that they leave FP8Linear targets out (see the module docstring)."""
    expand_model = mixin.__dict__["_maybe_expand_transformer_param_shape_or_error_"].__func__
    expand_lora = mixin.__dict__["_maybe_expand_lora_state_dict"].__func__

    def expand_model_or_refuse(cls, transformer, lora_state_dict=None, norm_state_dict=None, prefix=None):
        if lora_state_dict:
            check_lora_fits_fp8(transformer, lora_state_dict, f"{prefix or cls.transformer_name}.")
        return expand_model(cls, transformer, lora_state_dict, norm_state_dict, prefix)

    def expand_lora_but_fp8(cls, transformer, lora_state_dict):
        prefix = f"{cls.transformer_name}."
        targets = fp8_targets(transformer)
        named = [path for path in _lora_shapes(lora_state_dict, prefix) if path in targets]
        if not named:
            return expand_lora(cls, transformer, lora_state_dict)
        starts = tuple(f"{prefix}{path}.lora_" for path in named)
        rest = expand_lora(cls, transformer, {k: v for k, v in lora_state_dict.items() if not k.startswith(starts)})
        return {k: lora_state_dict[k] if k.startswith(starts) else rest[k] for k in lora_state_dict}

    for wrapper in (expand_model_or_refuse, expand_lora_but_fp8):
        wrapper.skips_fp8 = True
    mixin._maybe_expand_transformer_param_shape_or_error_ = classmethod(expand_model_or_refuse)
    mixin._maybe_expand_lora_state_dict = classmethod(expand_lora_but_fp8)


def register_flux_lora_loader() -> bool:
    """Let diffusers' Flux pipelines' ``load_lora_weights`` load onto FP8Linears
    (:func:`_wrap_flux_lora_checks`), once; only where diffusers is already
    imported (a diffusers model is). Returns whether the wrappers are in place."""
    if "diffusers" not in sys.modules:
        return False
    try:
        from diffusers.loaders.lora_pipeline import FluxLoraLoaderMixin
    except ImportError:
        return False
    names = ("_maybe_expand_transformer_param_shape_or_error_", "_maybe_expand_lora_state_dict")
    methods = [FluxLoraLoaderMixin.__dict__.get(name) for name in names]
    if not all(isinstance(method, classmethod) for method in methods):
        warnings.warn(
            "compile_ops: this diffusers' FluxLoraLoaderMixin has no "
            f"{' / '.join(names)} (diffusers 0.42 is tested); Flux pipelines' load_lora_weights may fail "
            "on FP8 models: load with pipe.transformer.load_lora_adapter instead",
            stacklevel=2,
        )
        return False
    if not all(getattr(method.__func__, "skips_fp8", False) for method in methods):
        _wrap_flux_lora_checks(FluxLoraLoaderMixin)
    return True


def register() -> bool:
    """Put the FP8Linear dispatcher in front of peft's LoRA dispatch, and (where
    diffusers is imported) the FP8 shape checks into diffusers' Flux LoRA
    loader, once (calling it again does nothing). Returns whether the
    dispatcher is in place: False, with a warning, on a peft without
    ``LoraModel._create_new_module``."""
    register_flux_lora_loader()
    create = getattr(LoraModel, "_create_new_module", None)
    if create is None:
        warnings.warn(
            "compile_ops: this peft has no LoraModel._create_new_module (peft 0.21 is tested); "
            "LoRA adapters cannot be added to FP8Linear layers",
            stacklevel=2,
        )
        return False
    if getattr(create, "dispatches_fp8", False):
        return True

    def create_new_module(lora_config, adapter_name, target, **kwargs):
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if isinstance(base, FP8Linear) and kwargs.get("parameter_name") is None:
            kwargs.pop("parameter_name", None)
            return FP8LoraLinear(target, adapter_name, config=lora_config, **kwargs)
        return create(lora_config, adapter_name, target, **kwargs)

    create_new_module.dispatches_fp8 = True
    LoraModel._create_new_module = staticmethod(create_new_module)
    return True


register()
