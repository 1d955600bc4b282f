"""Argument checks and the accumulation-dtype rule shared by every op family.

Each raises before any launch with a message ``fused.<op>: <argument> ...``
that names the argument and what was expected.
"""
from typing import Optional

import torch

#: dtypes the kernels read and write; fp64 exists for gradcheck.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def accumulation_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """What the kernels and references compute in: fp32, or fp64 when any input
    is fp64 (gradcheck)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def fail(op: str, msg: str, exc=ValueError):
    raise exc(f"fused.{op}: {msg}")


def check_floating(op: str, argname: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        fail(op, f"{argname} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if t.dtype not in FLOAT_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in FLOAT_DTYPES)
        fail(op, f"{argname} must have a floating dtype ({names}), got {t.dtype}", TypeError)


def values_readable(t: torch.Tensor) -> bool:
    """Whether checks may read ``t``'s values: eager calls only. Under tracing
    they are data, and reading a CUDA tensor's values syncs with the GPU
    (which a CUDA-graph capture forbids)."""
    # Tracing hands ops FakeTensors, or (AOT autograd) FunctionalTensors that
    # wrap them under an active fake mode: only a plain tensor has values.
    return not (torch.compiler.is_compiling() or type(t) is not torch.Tensor or t.device.type == "meta"
                or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
                or (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()))


def check_same_device(op: str, x: torch.Tensor, x_name: str = "x", **others: Optional[torch.Tensor]) -> None:
    for argname, t in others.items():
        if t is not None and t.device != x.device:
            fail(op, f"{argname} is on {t.device} but {x_name} is on {x.device}; all tensors must share a device")


def check_eps(op: str, eps: float) -> None:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        fail(op, f"eps must be a float, got {type(eps).__name__}", TypeError)
    if not eps >= 0.0:  # also rejects NaN
        fail(op, f"eps must be >= 0, got {eps}")
