"""``FP8Linear``: an ``nn.Linear`` for inference with e4m3 weights and activations."""

from typing import Optional, Union

import torch
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
    """

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


class FP8ProjectionActivation(nn.Module):
    """An MLP's first half for an FP8 second half: ``act(proj(x))`` handed on
    as :class:`~compile_ops.ops.fp8.FP8Rows`, the activation computed and
    quantized per row in one pass (``quantize_fp8_rows(h, activation)``) so
    the hidden activation is never written in 16 bits. Inference only.

    What ``patch(precision="fp8")`` puts in place of diffusers' ``GELU``
    inside a ``FeedForward`` whose next Linear runs in FP8.

    Args:
        proj: the :class:`FP8Linear` ``K -> N``.
        activation: ``"gelu"``, ``"gelu_tanh"`` or ``"silu"``.

    ``forward(x)``: ``x [..., K]`` or FP8Rows of it -> ``FP8Rows`` ``q [..., N]``
    float8_e4m3fn, ``scale [...]`` fp32. A row that ``proj`` makes non-finite
    (NaN), or whose activation is +-inf, is handed on as a row that
    dequantizes to NaN (``quantize_fp8_rows``' rule): the next FP8 Linear's
    output row is NaN, never finite.
    """

    def __init__(self, proj: FP8Linear, activation: str):
        super().__init__()
        if not isinstance(proj, FP8Linear):
            raise TypeError(f"FP8ProjectionActivation: proj must be a compile_ops.FP8Linear, got {type(proj).__name__}")
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"FP8ProjectionActivation: activation must be one of {', '.join(map(repr, ACTIVATIONS))}, "
                f"got {activation!r}"
            )
        self.proj, self.activation = proj, activation

    def forward(self, x: Union[Tensor, FP8Rows]) -> FP8Rows:
        return quantize_fp8_rows(self.proj(x), self.activation)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"
