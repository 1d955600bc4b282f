"""Pure-PyTorch gated activations: the implementation off-GPU and the test oracle.

Computed in fp32 (fp64 for fp64 inputs) and rounded once, as the kernel does;
diffusers computes ``F.gelu(gate)`` at the input dtype and rounds twice.
"""

import math

import torch
import torch.nn.functional as F

from compile_ops.meta import glu as meta
from compile_ops.meta._validate import accumulation_dtype


def halves(x: torch.Tensor, gate_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(value, gate)`` views of ``x [..., 2H]``."""
    first, second = x.chunk(2, dim=-1)
    return (second, first) if gate_first else (first, second)


def apply_activation(gate: torch.Tensor, name: str) -> torch.Tensor:
    """``name`` (``meta.glu.ACTIVATIONS``) of ``gate``, elementwise, at gate's dtype."""
    if name == "silu":
        return F.silu(gate)
    return F.gelu(gate, approximate="none" if name == "gelu" else "tanh")


def _gated(x: torch.Tensor, activation: str, gate_first: bool) -> torch.Tensor:
    value, gate = (t.to(accumulation_dtype(x)) for t in halves(x, gate_first))
    return (value * apply_activation(gate, activation)).to(x.dtype)


def geglu(x: torch.Tensor, approximate: str = "none", gate_first: bool = False) -> torch.Tensor:
    return _gated(x, meta.geglu_activation(approximate), gate_first)


def swiglu(x: torch.Tensor, gate_first: bool = False) -> torch.Tensor:
    return _gated(x, "silu", gate_first)


def activation_derivative(gate: torch.Tensor, activation: str) -> torch.Tensor:
    """``act'(gate)`` in closed form (references run below autograd)."""
    if activation == "silu":
        s = torch.sigmoid(gate)
        return s * (1 + gate * (1 - s))
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(gate / math.sqrt(2)))
        return cdf + gate * torch.exp(-0.5 * gate * gate) / math.sqrt(2 * math.pi)
    k = math.sqrt(2 / math.pi)
    t = torch.tanh(k * (gate + 0.044715 * gate**3))
    return 0.5 * (1 + t) + 0.5 * gate * (1 - t * t) * k * (1 + 3 * 0.044715 * gate * gate)


def glu_backward(grad_out: torch.Tensor, x: torch.Tensor, activation: str, gate_first: bool) -> torch.Tensor:
    acc = accumulation_dtype(x)
    value, gate = (t.to(acc) for t in halves(x, gate_first))
    dy = grad_out.to(acc)
    dvalue = dy * apply_activation(gate, activation)
    dgate = dy * value * activation_derivative(gate, activation)
    parts = (dgate, dvalue) if gate_first else (dvalue, dgate)
    return torch.cat(parts, dim=-1).to(x.dtype)
