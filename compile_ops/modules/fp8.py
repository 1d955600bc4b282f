"""``FP8Linear``: an ``nn.Linear`` for inference with e4m3 weights and activations."""

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compile_ops.meta._validate import checked_arguments
from compile_ops.meta.glu import ACTIVATIONS
from compile_ops.ops.fp8 import FP8Rows, check_fp8_device, fp8_linear, quantize_fp8_rows


class FP8Linear(nn.Module):
    """``y = x @ W.T + b`` with W quantized once per output channel and x per
    row on every call (``compile_ops/reference/fp8.py``); inference only.

    Holds ``weight_q [N, K]`` (float8_e4m3fn), ``weight_scale [N]`` (fp32) and
    ``bias [N]`` as buffers, not parameters: nothing here trains, and
    ``model.to(device)`` / ``state_dict`` carry them. The bf16 weight is not
    kept: the Linear's weight memory drops to a half (plus 4 bytes a row).

    ``forward`` takes ``x [..., in_features]`` (quantized per row on each
    call) or an :class:`~compile_ops.ops.fp8.FP8Rows` ``(q, scale)`` that a
    producing kernel already quantized; the output has x's dtype, or
    ``out_dtype`` (the original Linear's weight dtype) for an FP8Rows input.

    Non-finite values are not hidden (``quantize_fp8_rows``' rule): a token
    holding +-inf or NaN gives an output row of NaN, and a weight row holding
    one an output column of NaN for every token, where ``nn.Linear`` gives
    +-inf or NaN; never a finite value, and the other rows and columns are
    what they would be without it.

    ``module.to(dtype)`` / ``.half()`` (a diffusers pipeline's ``.to``) moves
    the quantized weight and its scales but keeps their dtypes: a float8
    tensor counts as floating point to ``nn.Module.to``, which would otherwise
    widen the weight and round the fp32 scales to the new dtype.

    LoRA: peft wraps it in ``compile_ops.integrations.peft.FP8LoraLinear``
    (the adapters run beside the FP8 GEMM in the activation dtype, on the
    rows the GEMM reads: ``fused.fp8_rows_lora`` in inference), which
    :meth:`dequantized_weight` and :meth:`requantize_` serve for merging.
    """

    #: Fused producers may hand it FP8 rows (:func:`takes_fp8_rows`).
    TAKES_FP8_ROWS = True

    @checked_arguments
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype: Optional[torch.dtype] = None,
        fast_accum: bool = True,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        #: torch._scaled_mm's fast accumulation on a GPU (:func:`~compile_ops.ops.fp8.fp8_linear`).
        self.fast_accum = fast_accum
        #: The output dtype of an already-quantized (FP8Rows) input, which has no dtype of its own.
        self.out_dtype = dtype or torch.bfloat16
        self.register_buffer(
            "weight_q", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
        )
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer(
            "bias", torch.zeros(out_features, dtype=dtype or torch.bfloat16, device=device) if bias else None
        )

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, fast_accum: bool = True) -> "FP8Linear":
        """The FP8 twin of ``linear`` (on its device; raises on a GPU without FP8
        tensor cores). ``fast_accum``: see :func:`~compile_ops.ops.fp8.fp8_linear`.
        The weight is quantized per output channel by ``quantize_fp8_rows``: a
        row holding +-inf gets an infinite scale and NaN codes, one holding
        NaN keeps NaN codes, so its output channel is NaN."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"FP8Linear.from_linear: expected an nn.Linear, got {type(linear).__name__}")
        weight = linear.weight
        check_fp8_device(weight.device)
        new = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            device="meta",
            dtype=weight.dtype,
            fast_accum=fast_accum,
        )
        new.weight_q, new.weight_scale = quantize_fp8_rows(weight.detach())
        new.bias = None if linear.bias is None else linear.bias.detach().clone()
        return new

    @property
    def qweight(self) -> Tensor:
        """``weight_q`` under the name that peft (and quantized-Linear libraries
        such as GPTQ's) read to find a quantized layer's device: there is no
        ``weight`` to read, on purpose."""
        return self.weight_q

    @torch.no_grad()
    def dequantized_weight(self) -> Tensor:
        """The weight the FP8 GEMM multiplies by, ``weight_q * weight_scale[:, None]``:
        ``[out_features, in_features]`` fp32 (NaN in a row quantized from a
        non-finite one)."""
        return self.weight_q.float() * self.weight_scale.float()[:, None]

    @torch.no_grad()
    def requantize_(self, weight: Tensor) -> None:
        """Quantize ``weight [out_features, in_features]`` (any floating dtype, on
        this module's device) per output channel, as :meth:`from_linear` does,
        into ``weight_q`` and ``weight_scale`` in place: the buffers stay the
        same tensors, so a compiled graph reading them reads the new values."""
        if tuple(weight.shape) != tuple(self.weight_q.shape):
            raise ValueError(
                f"FP8Linear.requantize_: weight must have shape {tuple(self.weight_q.shape)} "
                f"[out_features, in_features], got {tuple(weight.shape)}"
            )
        weight_q, weight_scale = quantize_fp8_rows(weight.detach())
        self.weight_q.copy_(weight_q)
        self.weight_scale.copy_(weight_scale)

    def _apply(self, fn, recurse=True):
        quantized = {"weight_q": self.weight_q, "weight_scale": self.weight_scale}
        super()._apply(fn, recurse)
        for name, original in quantized.items():
            if getattr(self, name).dtype != original.dtype:  # a dtype cast: redo it as a move only
                setattr(self, name, original.to(getattr(self, name).device))
        return self

    def forward(self, x: Union[Tensor, FP8Rows]) -> Tensor:
        """``x [..., in_features]`` or ``FP8Rows(q [..., in_features], scale [...])``
        -> ``[..., out_features]``."""
        if not isinstance(x, (Tensor, FP8Rows)):
            raise TypeError(f"compile_ops.FP8Linear: x must be a torch.Tensor or an FP8Rows, got {type(x).__name__}")
        k = x.q.shape[-1] if isinstance(x, FP8Rows) else x.shape[-1]
        if k != self.in_features:
            shape = x.q.shape if isinstance(x, FP8Rows) else x.shape
            raise ValueError(f"FP8Linear: x must have {self.in_features} channels (last dim), got shape {tuple(shape)}")
        out_dtype = self.out_dtype if isinstance(x, FP8Rows) else x.dtype
        return fp8_linear(x, self.weight_q, self.weight_scale, self.bias, out_dtype, self.fast_accum)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, fp8 e4m3 rowwise, fast_accum={self.fast_accum}"
        )


#: ``F.gelu``'s ``approximate`` for each GELU name of ``meta.glu.ACTIVATIONS``.
GELU_APPROXIMATE = {"gelu": "none", "gelu_tanh": "tanh"}


class FP8ProjectionActivation(nn.Module):
    """An MLP's first half for an FP8 second half: ``act(proj(x))`` handed on
    as :class:`~compile_ops.ops.fp8.FP8Rows`, the activation computed and
    quantized per row in one pass (``quantize_fp8_rows(h, activation)``) so
    the hidden activation is never written in 16 bits. Inference only.

    What ``patch(precision="fp8")`` puts in place of diffusers' ``GELU``
    inside a ``FeedForward`` whose next Linear runs in FP8.

    Args:
        proj: the :class:`FP8Linear` ``K -> N``, or an adapter layer over one
            (``compile_ops.integrations.peft.FP8LoraLinear``).
        activation: ``"gelu"``, ``"gelu_tanh"`` or ``"silu"``.
        reader: ``(modules, index)``, where the module that reads the output
            sits (the ``FeedForward``'s ``net`` and the down projection's
            index), held outside the module tree; None: the output is always
            FP8Rows.

    ``forward(x)``: ``x [..., K]`` or FP8Rows of it -> ``FP8Rows`` ``q [..., N]``
    float8_e4m3fn, ``scale [...]`` fp32 while the reader takes them
    (:func:`takes_fp8_rows`: an FP8Linear, or a LoRA layer over one); while
    it is anything else the activation ``[..., N]`` in proj's output dtype,
    as diffusers' ``GELU`` computes it. A row that ``proj`` makes non-finite (NaN), or whose
    activation is +-inf, is handed on as a row that dequantizes to NaN
    (``quantize_fp8_rows``' rule): the next FP8 Linear's output row is NaN,
    never finite.
    """

    def __init__(self, proj: nn.Module, activation: str, reader: Optional[tuple] = None):
        super().__init__()
        if fp8_base(proj) is None:
            raise TypeError(
                f"FP8ProjectionActivation: proj must be a compile_ops.FP8Linear, got {type(proj).__name__} "
                "(an adapter layer such as LoRA over an FP8Linear also does)"
            )
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"FP8ProjectionActivation: activation must be one of {', '.join(map(repr, ACTIVATIONS))}, "
                f"got {activation!r}"
            )
        self.proj, self.activation = proj, activation
        self.reader = reader  # a tuple: not registered, so the reader stays its own parent's child

    def hands_rows(self) -> bool:
        """Whether the output goes on as FP8Rows: its reader takes them (or there is no reader)."""
        if self.reader is None:
            return True
        modules, index = self.reader
        return takes_fp8_rows(modules[index])

    def forward(self, x: Union[Tensor, FP8Rows]) -> Union[FP8Rows, Tensor]:
        h = self.proj(x)
        if self.hands_rows():
            return quantize_fp8_rows(h, self.activation)
        # What diffusers' GELU (and the SiLU) computes, in h's dtype.
        return F.silu(h) if self.activation == "silu" else F.gelu(h, approximate=GELU_APPROXIMATE[self.activation])

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


def takes_fp8_rows(module: nn.Module) -> bool:
    """Whether ``module`` takes :class:`~compile_ops.ops.fp8.FP8Rows` as its input,
    so that the kernel producing it may write them: its class says so
    (``TAKES_FP8_ROWS``): :class:`FP8Linear`, and the LoRA layer over one,
    ``compile_ops.integrations.peft.FP8LoraLinear``, whose adapters read the
    same rows."""
    return getattr(type(module), "TAKES_FP8_ROWS", False) is True


def fp8_base(module: nn.Module) -> Optional[FP8Linear]:
    """The :class:`FP8Linear` that computes ``module``: itself, or the base layer of
    an adapter wrapped around one (peft's ``get_base_layer()``); None otherwise."""
    base = module.get_base_layer() if callable(getattr(module, "get_base_layer", None)) else module
    return base if isinstance(base, FP8Linear) else None
