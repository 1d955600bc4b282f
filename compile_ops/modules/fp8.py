"""``FP8Linear``: an ``nn.Linear`` for inference with e4m3 weights and activations."""
from typing import Optional

import torch
from torch import Tensor, nn

from compile_ops.ops.fp8 import check_fp8_device, fp8_linear, quantize_fp8_rows


class FP8Linear(nn.Module):
    """``y = x @ W.T + b`` with W quantized once per output channel and x per
    row on every call (``compile_ops/reference/fp8.py``); inference only.

    Holds ``weight_q [N, K]`` (float8_e4m3fn), ``weight_scale [N]`` (fp32) and
    ``bias [N]`` as buffers, not parameters: nothing here trains, and
    ``model.to(device)`` / ``state_dict`` carry them. The bf16 weight is not
    kept: the Linear's weight memory drops to a half (plus 4 bytes a row).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_q", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn,
                                                     device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype or torch.bfloat16, device=device)
                             if bias else None)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> "FP8Linear":
        """The FP8 twin of ``linear`` (on its device; raises on a GPU without FP8 tensor cores)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"FP8Linear.from_linear: expected an nn.Linear, got {type(linear).__name__}")
        weight = linear.weight
        check_fp8_device(weight.device)
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta")
        new.weight_q, new.weight_scale = quantize_fp8_rows(weight.detach())
        new.bias = None if linear.bias is None else linear.bias.detach().clone()
        return new

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., in_features]`` -> ``[..., out_features]`` in x's dtype."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"FP8Linear: x must have {self.in_features} channels (last dim), "
                             f"got shape {tuple(x.shape)}")
        return fp8_linear(x, self.weight_q, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fp8 e4m3 rowwise")
