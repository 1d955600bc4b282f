"""Shape, dtype and argument rules of the gated-activation family, and its validation.

Torch only: these are the fake implementations of ``fused.geglu``,
``fused.swiglu`` and ``fused.glu_backward`` and allocate the launchers' outputs.
"""

import torch

from compile_ops.meta._validate import check_floating, check_same_device, fail

#: ``approximate`` of ``fused.geglu``, as ``torch.nn.functional.gelu`` names them.
GELU_APPROXIMATIONS = ("none", "tanh")
#: The ``activation`` of ``fused.glu_backward``: what each forward op gates with.
ACTIVATIONS = ("gelu", "gelu_tanh", "silu")


def geglu_activation(approximate: str) -> str:
    """The backward's activation name for ``fused.geglu(approximate=...)``."""
    return "gelu" if approximate == "none" else "gelu_tanh"


def check_options(op: str, gate_first: bool, approximate: str = "none") -> None:
    """The non-tensor arguments. The public functions check them before the
    dispatcher would, so that a wrong type gets this message on every path
    (the dispatcher reads ``gate_first=1`` as True and rejects a None
    ``approximate`` in its own words)."""
    if not isinstance(gate_first, bool):
        fail(op, f"gate_first must be a bool, got {type(gate_first).__name__}", TypeError)
    _check_choice(op, "approximate", approximate, GELU_APPROXIMATIONS)


def check_gated_input(op: str, x: torch.Tensor, gate_first: bool) -> int:
    """Validate ``x [..., 2H]`` and ``gate_first``; returns H."""
    check_floating(op, "x", x)
    if x.dim() < 1:
        fail(op, "x must have at least 1 dim (value and gate halves last), got a 0-dim tensor")
    if x.shape[-1] % 2 != 0:
        fail(op, f"x must have an even last dim (a value half and a gate half), got shape {tuple(x.shape)}")
    check_options(op, gate_first)
    return x.shape[-1] // 2


def _check_choice(op: str, argname: str, value: str, choices: tuple) -> None:
    if not isinstance(value, str) or value not in choices:
        fail(
            op,
            f"{argname} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}",
            ValueError if isinstance(value, str) else TypeError,
        )


def geglu(x: torch.Tensor, approximate: str = "none", gate_first: bool = False) -> torch.Tensor:
    h = check_gated_input("geglu", x, gate_first)
    check_options("geglu", gate_first, approximate)
    return x.new_empty((*x.shape[:-1], h))


def swiglu(x: torch.Tensor, gate_first: bool = False) -> torch.Tensor:
    h = check_gated_input("swiglu", x, gate_first)
    return x.new_empty((*x.shape[:-1], h))


def glu_backward(grad_out: torch.Tensor, x: torch.Tensor, activation: str, gate_first: bool) -> torch.Tensor:
    """``dx``: x's shape and dtype."""
    op = "glu_backward"
    h = check_gated_input(op, x, gate_first)
    _check_choice(op, "activation", activation, ACTIVATIONS)
    check_floating(op, "grad_out", grad_out)
    expected = (*x.shape[:-1], h)
    if tuple(grad_out.shape) != expected:
        fail(op, f"grad_out must have shape {expected} (x's with the last dim halved), got {tuple(grad_out.shape)}")
    check_same_device(op, x, grad_out=grad_out)
    return x.new_empty(x.shape)
