"""Shape and dtype rules of the fp8 family, and its validation (the fakes)."""
import torch

from compile_ops.meta._validate import check_floating, fail


def check_rows(op: str, argname: str, x: torch.Tensor) -> None:
    """``x [..., K]``: a floating tensor with a channel (last) dim."""
    check_floating(op, argname, x)
    if x.dim() < 1:
        fail(op, f"{argname} must have at least 1 dim (channels last), got a 0-dim tensor")


def quantize_fp8_rows(x: torch.Tensor) -> tuple:
    """``(q [..., K] float8_e4m3fn, scale [...] float32)``, both contiguous."""
    check_rows("quantize_fp8_rows", "x", x)
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(x.shape[:-1], dtype=torch.float32)
