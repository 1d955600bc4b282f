"""Poisoned allocations: uninitialized reads made visible on the CPU.

On a GPU, ``torch.empty`` hands out whatever the caching allocator's block
held last (another test's NaN fill, an earlier output), so a kernel or
launcher that reads an element it never wrote gives a result that depends
on what ran before. On the CPU the same memory is usually zeros or stale
finite numbers, and such a read goes unnoticed. Under
``COMPILE_OPS_POISON_EMPTY`` (the interpreter layer only, ``TRITON_INTERPRET=1``:
there the kernels run on these CPU tensors) the allocation functions the
package calls (``torch.empty``, ``torch.empty_like``, ``torch.empty_strided``,
``Tensor.new_empty``) return tensors filled with a poison: NaN in the
16/32/64-bit float dtypes, 0x7F in every byte of the others (NaN in both
float8 formats, 127 / 0x7F7F7F7F / ... in the integer ones: an index far out
of range), True for bool. A kernel that reads an element it never wrote
then puts NaN or garbage into its outputs, which the tests' comparisons
catch.

Scope (the switch's value):

- ``1`` (or ``package``): allocations made by ``compile_ops``' own code (the
  calling frame's module is in the package): the fakes' outputs, launchers'
  buffers and scratch. The tests' own buffers, torch's internals and
  Hypothesis are untouched.
- ``all``: every Python-level call of those functions, the tests' included
  (a test that reads an element it never wrote shows up too).

Allocations made from C++ (aten ops' outputs) are never poisoned: they are
written by the op that makes them.
"""

import functools
import math
import os
import sys

import torch

#: The environment switch: unset/"0" off, "1"/"package" the package's allocations, "all" every caller.
SWITCH = "COMPILE_OPS_POISON_EMPTY"
_SCOPES = {"1": "package", "package": "package", "all": "all"}
_WIDE_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: The byte every non-float element is made of (int8 127, int32 0x7F7F7F7F; e4m3fn and e5m2 NaN).
POISON_BYTE = 0x7F


def scope() -> str | None:
    """The switch's scope ("package" or "all"), or None when it is off."""
    value = os.environ.get(SWITCH, "0").strip().lower()
    if value in ("", "0", "off", "false", "no"):
        return None
    if value not in _SCOPES:
        raise ValueError(f"{SWITCH} must be 0, 1, package or all, got {value!r}")
    return _SCOPES[value]


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` (a fresh, real CPU tensor) with the poison; returns ``t``."""
    if t.numel() == 0 or t.device.type != "cpu" or t.is_complex():
        return t
    # The whole storage, not only the elements: a strided allocation's gaps and a padded
    # buffer's tail (read through a narrower view) are poisoned too.
    storage = t.untyped_storage()
    with torch.no_grad():
        if t.dtype in _WIDE_FLOATS:
            torch.tensor([], dtype=t.dtype).set_(storage).fill_(math.nan)
        elif t.dtype == torch.bool:
            torch.tensor([], dtype=torch.bool).set_(storage).fill_(True)
        else:
            torch.tensor([], dtype=torch.uint8).set_(storage).fill_(POISON_BYTE)
    return t


_ALLOCATORS = (
    (torch, "empty"),
    (torch, "empty_like"),
    (torch, "empty_strided"),
    (torch.Tensor, "new_empty"),
)


def _from_package(depth: int = 2) -> bool:
    frame = sys._getframe(depth)
    name = frame.f_globals.get("__name__", "")
    return name == "compile_ops" or name.startswith("compile_ops.")


def install(which: str) -> list:
    """Replace the allocation functions by poisoning ones (``which``: a scope).
    Returns what :func:`uninstall` puts back."""
    from torch._subclasses.fake_tensor import is_fake

    saved = []
    for owner, name in _ALLOCATORS:
        original = getattr(owner, name)
        saved.append((owner, name, original))

        @functools.wraps(original)
        def poisoned(*args, _original=original, **kwargs):
            t = _original(*args, **kwargs)
            if (
                type(t) is torch.Tensor
                and t.device.type == "cpu"
                and (which == "all" or _from_package())
                and not is_fake(t)
                and not torch.compiler.is_compiling()
            ):
                poison_(t)
            return t

        setattr(owner, name, poisoned)
    return saved


def uninstall(saved: list) -> None:
    for owner, name, original in reversed(saved):
        setattr(owner, name, original)
