"""Argument checks and the accumulation-dtype rule shared by every op family.

Each raises before any launch with a message ``fused.<op>: <argument> ...``
that names the argument and what was expected.
"""

import functools
import inspect
import math
import typing
from typing import Callable, Optional, Sequence, Union

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
    return not (
        torch.compiler.is_compiling()
        or type(t) is not torch.Tensor
        or t.device.type == "meta"
        or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
        or (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    )


def check_same_device(op: str, x: torch.Tensor, x_name: str = "x", **others: Optional[torch.Tensor]) -> None:
    for argname, t in others.items():
        if t is not None and t.device != x.device:
            fail(op, f"{argname} is on {t.device} but {x_name} is on {x.device}; all tensors must share a device")


def check_eps(op: str, eps: float) -> None:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        fail(op, f"eps must be a float, got {type(eps).__name__}", TypeError)
    if not eps >= 0.0:  # also rejects NaN
        fail(op, f"eps must be >= 0, got {eps}")


def check_flag(owner: str, name: str, value) -> None:
    """``value`` is a bool (a float or a str is not read as one)."""
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be a bool, got {type(value).__name__}")


def check_floating_input(owner: str, name: str, t) -> None:
    """``t`` is a floating tensor (an input a module or a wrapper hands to torch ops)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{owner}: {name} must have a floating dtype, got {t.dtype}")


def softmax_scale(owner: str, q, scale: Optional[float], q_kinds: str = "a torch.Tensor") -> float:
    """Attention's ``scale``, defaulting to ``1 / sqrt(D)`` of q's last dim;
    q is checked first, so that a q without a head dim gets an error naming it
    (``q_kinds``: what the function takes as q)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{owner}: q must be {q_kinds}, got {type(q).__name__}")
    if q.dim() == 0 or q.shape[-1] == 0:
        raise ValueError(f"{owner}: q must have a non-empty last (head) dim D, got shape {tuple(q.shape)}")
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


# ---------------------------------------------------------------- argument types

#: What an annotation accepts from Python: ``(types, None allowed, what the
#: error says is expected, element types of a sequence or None)``. bool is
#: refused where a number is expected and a number where a bool is (SDPA's
#: rule: ``is_causal=0.5`` is a TypeError, not True); symbolic numbers pass,
#: as torch.compile's tracing hands them on.
_NUMBER = (int, float, torch.SymInt, torch.SymFloat)
_INT = (int, torch.SymInt)
_TYPE_RULES = {
    torch.Tensor: ((torch.Tensor,), False, "a torch.Tensor", None),
    Optional[torch.Tensor]: ((torch.Tensor,), True, "a torch.Tensor or None", None),
    float: (_NUMBER, False, "a float", None),
    Optional[float]: (_NUMBER, True, "a float or None", None),
    int: (_INT, False, "an int", None),
    Optional[int]: (_INT, True, "an int or None", None),
    bool: ((bool, torch.SymBool), False, "a bool", None),
    str: ((str,), False, "a str", None),
    Sequence[int]: ((list, tuple), False, "a sequence of ints", _INT),
    Union[int, Sequence[int]]: ((int, list, tuple), False, "an int or a sequence of ints", _INT),
}


def _resolved_hints(fn: Callable) -> dict:
    """``fn``'s type hints, with any annotation that does not resolve left out."""
    try:
        return typing.get_type_hints(fn)
    except (NameError, AttributeError, TypeError):
        return {name: hint for name, hint in fn.__annotations__.items() if not isinstance(hint, str)}


def _accepts_plainly(rule: tuple, value_type: type) -> bool:
    """Whether every value of exactly ``value_type`` passes ``rule`` (no element or NaN check needed)."""
    _, types, optional, _, elements = rule
    if value_type is type(None):
        return optional
    if elements is not None or value_type is bool and bool not in types:
        return False
    return issubclass(value_type, types)


def type_checker(owner: str, fn: Callable) -> Callable:
    """``check(args, kwargs)``: the Python types of a call of ``fn`` against
    its annotations (those :data:`_TYPE_RULES` knows; others are the
    function's own to check), raising ``TypeError("<owner>: <argument> must
    be ...")``. NaN is refused where a number is expected: no argument of
    this library means anything by it."""
    hints = _resolved_hints(fn)
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    rules = [
        (p.name, *_TYPE_RULES[hints[p.name]]) if _TYPE_RULES.get(hints.get(p.name), None) else None for p in params
    ]
    positional = [rule for rule, p in zip(rules, params) if p.kind != p.KEYWORD_ONLY]
    by_name = {rule[0]: rule for rule in rules if rule is not None}
    # The eager fast path runs this on every op call: values whose exact type is plainly right skip the checks
    # (floats do not, for their NaN check).
    plain = [
        frozenset(
            t for t in (torch.Tensor, torch.nn.Parameter, int, bool, str, type(None)) if _accepts_plainly(rule, t)
        )
        if rule is not None
        else None
        for rule in positional
    ]

    def check_one(rule, value) -> None:
        name, types, optional, expected, elements = rule
        if value is None and optional:
            return
        wrong = not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
        if not wrong and elements is not None and isinstance(value, (list, tuple)):
            wrong = not all(isinstance(v, elements) and not isinstance(v, bool) for v in value)
        if wrong:
            got = repr(value) if isinstance(value, (str, int, float)) else type(value).__name__
            raise TypeError(f"{owner}: {name} must be {expected}, got {got:.60}")
        if isinstance(value, float) and math.isnan(value):
            raise ValueError(f"{owner}: {name} must be a number, got NaN")

    def check(args: tuple, kwargs: dict) -> None:
        for rule, accepted, value in zip(positional, plain, args):
            if rule is not None and type(value) not in accepted:
                check_one(rule, value)
        for name, value in kwargs.items():
            if name in by_name:
                check_one(by_name[name], value)

    return check


def checked_arguments(fn: Callable) -> Callable:
    """Decorate a public function or a module's ``__init__`` so that an
    argument of the wrong Python type raises a TypeError naming it
    (:func:`type_checker`) before the function reads it. Skipped while
    torch.compile traces: the check is for the Python caller. (Module
    forwards check inline: dynamo names a wrapped forward's graph inputs
    after the wrapper's ``*args``.)"""
    owner = "compile_ops." + fn.__qualname__.replace(".__init__", "").replace(".forward", "")
    check = type_checker(owner, fn)

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        if not torch.compiler.is_compiling():
            check(args, kwargs)
        return fn(*args, **kwargs)

    return checked
