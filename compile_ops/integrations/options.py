"""The options of :func:`compile_ops.patch`, defined once for every model library it patches.

:class:`PatchOptions` holds each option's default, meaning and check;
:func:`takes_patch_options` gives ``compile_ops.patch`` its keyword-only
signature from them; the diffusers and transformers integrations take the
checked object.
"""

import dataclasses
import inspect
import typing
from typing import Callable, Optional, Union

from compile_ops.integrations.schedule import check_dense_steps
from compile_ops.integrations.sparse_attention import SPARSE_ATTENTION, Radial, SlidingTile, TopK
from compile_ops.meta._validate import type_checker

#: Who raises: every error names the public function and the option.
OWNER = "compile_ops.patch"

ATTENTION_KERNELS = ("auto", "fused", "sdpa")
PRECISIONS = ("bf16", "fp8")
ATTENTION_PRECISIONS = ("exact", "int8", "int8_fp8")


@dataclasses.dataclass(frozen=True)
class PatchOptions:
    """How :func:`compile_ops.patch` rewrites a model. A diffusers transformer
    takes every option; a transformers model (Llama, Qwen2) takes
    ``attention_processors`` and refuses the others away from their defaults.
    Made with a wrong option, it raises a TypeError or ValueError naming it.

    Attributes:
        attention_processors: also replace the attention processors we cover
            (diffusers; rotary embeddings fused, calls they do not cover go to
            diffusers' own) or attention modules (transformers; the rotary
            embedding as ``fused.rope_qk``). False: norms, MLPs and blocks only.
        attention_kernel: ``"fused"`` (``fused.attention``), ``"sdpa"``
            (torch's SDPA) or ``"auto"``: SDPA for 16-bit inference on a GPU,
            where its cuDNN backend is ahead, except where the sm_90 core of
            ``fused.attention`` is (long or ragged key counts at D = 128, key
            lengths; :func:`compile_ops.integrations.diffusers.attention_kernel.sdpa_is_faster`);
            ``fused.attention`` otherwise (training, CPU, fp32).
        precision: ``"bf16"`` keeps the Linears as they are; ``"fp8"``
            replaces the transformer blocks' Linears (attention projections,
            MLPs, the single-stream projections) with :class:`~compile_ops.FP8Linear`:
            e4m3 weights with one scale per output channel, quantized once at
            patch time, and activations quantized per row (token) on every
            call. Inference only (a gradient through an FP8 Linear raises),
            and permanent: the original weights are released, so
            :func:`compile_ops.unpatch` refuses the model (reload it instead).
            Embedders, the final layer and (unless ``fp8_modulation``) the
            AdaLN modulation projections stay in their dtype; the report lists
            every Linear and why. On CUDA it needs FP8 tensor cores (sm_89+);
            elsewhere the reference path simulates the same quantization.
        fp8_fast_accum: under ``precision="fp8"``, the FP8 GEMMs' fast
            accumulation on the GPU (the default, as torchao's float8
            inference); False promotes partial sums to fp32, slower and a
            little more exact (:func:`~compile_ops.ops.fp8.fp8_linear`).
        attention: None (dense attention), or a sparse self-attention
            configuration for a video DiT (Wan, LTX-Video, HunyuanVideo):
            :class:`~compile_ops.SlidingTile`, :class:`~compile_ops.Radial` or
            :class:`~compile_ops.TopK`. Its self-attention layers then run
            ``fused.block_sparse_attention`` on tokens permuted into tiles
            (per grid, built once and cached; text cross-attention stays
            dense); ``compile_ops/integrations/sparse_attention.py`` gives the
            schedule and the compile count. The report's
            ``sparse_attention.describe()`` gives the density per grid.
        attention_precision: ``"exact"``, or ``"int8"``: our processors run
            dense attention as 8-bit attention (``attention(...,
            precision="int8")``: smoothed k, q in INT8 per token, k per block)
            on 16-bit inference calls, and an ``attention=`` plan's sparse
            steps as 8-bit block-sparse attention (``block_sparse_attention(...,
            precision="int8")``); training calls and fp32 models keep the
            exact kernels. ``"int8_fp8"``: the same with P V in FP8 too (sm_89
            or newer). Needs ``attention_processors``.
        attention_dense_steps: with an 8-bit ``attention_precision``, the
            first N denoising steps of each generation run exact attention
            (counted from the timestep, as sparse attention's ``dense_steps``;
            ``compile_ops/integrations/schedule.py``: compile the blocks, not
            the whole model, when N > 0).
        fp8_modulation: under ``precision="fp8"``, the blocks' AdaLN
            modulation projections (one row per sample: GEMVs bound by reading
            their weight) in FP8 too, as torchao's float8 quantizes them: half
            their weight bytes, at a larger step error (their rounding moves
            every token's shift, scale and gate).
    """

    attention_processors: bool = True
    attention_kernel: str = "auto"
    precision: str = "bf16"
    fp8_fast_accum: bool = True
    attention: Optional[Union[SlidingTile, Radial, TopK]] = None
    attention_precision: str = "exact"
    attention_dense_steps: int = 0
    fp8_modulation: bool = False

    def __post_init__(self):
        _check_types((), {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        for name, allowed in (
            ("attention_kernel", ATTENTION_KERNELS),
            ("precision", PRECISIONS),
            ("attention_precision", ATTENTION_PRECISIONS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{OWNER}: {name} must be one of {allowed}, got {getattr(self, name)!r}")
        check_dense_steps(f"{OWNER}: attention_dense_steps", self.attention_dense_steps)
        if self.fp8_modulation and self.precision != "fp8":
            raise ValueError(f"{OWNER}: fp8_modulation applies to precision='fp8', got precision={self.precision!r}")
        if self.attention_dense_steps and self.attention_precision == "exact":
            raise ValueError(
                f"{OWNER}: attention_dense_steps applies to an 8-bit attention_precision "
                "('int8' or 'int8_fp8'), got attention_precision='exact'"
            )
        if self.attention_precision != "exact" and not self.attention_processors:
            raise ValueError(f"{OWNER}: attention_precision needs attention_processors=True (our processors run it)")
        if self.attention is not None and not isinstance(self.attention, SPARSE_ATTENTION):
            raise TypeError(
                f"{OWNER}: attention must be one of {', '.join(c.__name__ for c in SPARSE_ATTENTION)} "
                f"(or None), got {type(self.attention).__name__}"
            )

    @classmethod
    def from_keywords(cls, options: dict) -> "PatchOptions":
        """The options of a ``compile_ops.patch(model, **options)`` call; an
        unknown name raises a TypeError naming it and the known ones."""
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(
                f"{OWNER}: unknown option {', '.join(map(repr, unknown))}; the options are {', '.join(OPTION_NAMES)}"
            )
        return cls(**options)

    def changed(self) -> list:
        """The names of the options set away from their defaults, in declaration order."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(PatchOptions))
# The Python types of the options, checked as compile_ops' public functions check theirs.
_check_types = type_checker(OWNER, PatchOptions.__init__)


def takes_patch_options(fn: Callable) -> Callable:
    """Give ``fn(model, **options)`` the signature ``fn(model, *, <option>=<default>, ...)``
    with each option's type, from :class:`PatchOptions`: ``help()`` and
    :func:`~compile_ops.meta._validate.checked_arguments` then see every option."""
    hints = typing.get_type_hints(PatchOptions)
    signature = inspect.signature(fn)
    leading = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    options = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
        for f in dataclasses.fields(PatchOptions)
    ]
    fn.__signature__ = signature.replace(parameters=leading + options)
    fn.__annotations__ = {**fn.__annotations__, **{p.name: p.annotation for p in options}}
    return fn
