"""Bad-input testing: every public function and module answers a wrong argument
with an error that names the argument, the way PyTorch does.

Two tools:
- :func:`bad_input_test`: the family files' hand-written cases (a call, its
  exception type and a regex the message must match).
- :class:`Call` and :func:`mutations`: the cross-family property suite
  (``tests/test_bad_inputs.py``). A ``Call`` holds a valid call of a public
  function and the kind of each argument; a mutation replaces one argument by
  a value of the wrong type, dtype, device or value set for that kind, and the
  call must then raise ``TypeError`` or ``ValueError`` naming that argument.
"""

import math
import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch


def bad_input_test(cases):
    """A test parametrized over ``cases() -> [(call, exception type, pattern)]``;
    assign it to ``test_bad_input_raises_a_clear_error`` in the family's file."""

    @pytest.mark.parametrize("case", range(len(cases())))
    def test(case):
        fn, exc, pattern = cases()[case]
        with pytest.raises(exc, match=pattern):
            fn()

    return test


#: Argument kinds (:func:`mutations` says what a wrong value of each is).
#: ``tensor``: a floating tensor; ``index``: an integer tensor; ``mask``: a
#: bool tensor; ``ints``: a sequence of ints. A trailing ``?`` allows None.
KINDS = ("tensor", "index", "mask", "float", "bool", "int", "str", "ints", "module")


@dataclass(frozen=True)
class Call:
    """A valid call of a public function: ``build(device, hidden_size) -> (fn,
    kwargs)``, and the kind (:data:`KINDS`) of each argument the suite mutates."""

    name: str
    build: Callable
    kinds: dict

    def __post_init__(self):
        assert set(self.kinds.values()) <= set(KINDS) | {k + "?" for k in KINDS}, self.kinds


def _other_device(device: str) -> str:
    return "cpu" if torch.device(device).type != "cpu" else "meta"


def mutations(kind: str, value, device: str, alone: bool = False) -> list:
    """``(label, wrong value)`` pairs for an argument of ``kind`` whose valid
    value is ``value``; ``alone``: the call's only tensor, which any device may hold."""
    optional = kind.endswith("?")
    base = kind.rstrip("?")
    wrong = [] if optional else [("None", None)]
    if base in ("tensor", "index", "mask"):
        t = value
        wrong.append(("a list", [[1.0, 2.0]]))
        wrong_dtypes = {
            "tensor": (torch.int64, torch.complex64),
            "index": (torch.float32, torch.bool),
            "mask": (torch.float32, torch.int64),
        }[base]
        if t is not None:
            wrong += [(f"dtype {dtype}", torch.ones(t.shape, dtype=dtype, device=t.device)) for dtype in wrong_dtypes]
            if not alone:
                wrong.append(("another device", torch.ones(t.shape, dtype=t.dtype, device=_other_device(device))))
    elif base == "float":
        wrong += [("a str", "x"), ("NaN", math.nan), ("a list", [1.0])]
    elif base == "bool":
        wrong += [("0.5", 0.5), ("NaN", math.nan), ("2", 2), ("a str", "yes")]
    elif base == "int":
        wrong += [("1.5", 1.5), ("a str", "x"), ("NaN", math.nan)]
    elif base == "str":
        wrong += [("an int", 3), ("an unknown name", "no-such-option")]
    elif base == "ints":
        wrong += [("a str", "x"), ("floats", tuple(1.5 for _ in value))]
    elif base == "module":
        wrong += [("an int", 3)]
    return wrong


def assert_names_the_argument(call: Callable, argname: str) -> None:
    """``call()`` raises TypeError or ValueError whose message names ``argname``
    as a word (``fused.rmsnorm: eps must be ...``)."""
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    message = str(info.value)
    assert re.search(rf"(?<![\w]){re.escape(argname)}(?![\w])", message), (
        f"the error does not name {argname!r}: {type(info.value).__name__}: {message}"
    )
