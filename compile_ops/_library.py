"""The one helper that turns a Triton launcher into a ``torch.ops.fused.*`` op.

Why ``triton_op`` with an explicit fake (measured on an H100, torch 2.11,
``shared/anchors/h100-baseline.json``): Inductor inlines the Triton kernel into
its generated code instead of calling an opaque extern (``custom_op`` costs
325 us per eager call against 25 us), and an explicit fake is 2.7x cheaper per
eager call than letting torch derive one by tracing the body.

Where code runs:
- CUDA tensors run the Triton launcher, under the tensor's device context.
- Other devices run the pure-PyTorch reference (after the same validation),
  which keeps ``opcheck``, ``gradcheck`` and ``torch.compile`` usable on CPU.
- With ``TRITON_INTERPRET=1`` in the environment *before* triton is imported,
  CPU tensors run the real Triton kernels through the interpreter instead: that
  is how a CPU-only CI executes every kernel. Triton's interpreter cannot be
  fake-traced, so that mode is for eager calls only (tests run it in a separate
  process; see ``tests/run.sh``).
"""
import contextlib
import functools
import os
from typing import Callable

import torch

NAMESPACE = "fused"

#: CPU tensors run the Triton kernels through triton's interpreter.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def runs_triton(t: torch.Tensor) -> bool:
    """True when ops on ``t`` launch Triton kernels (CUDA, or CPU under the interpreter)."""
    return t.device.type == "cuda" or (INTERPRET and t.device.type == "cpu")


#: Looked up once: ``torch.cuda.is_available()`` costs microseconds per call,
#: and the launch path is host-bound for small inputs.
HAS_CUDA = torch.cuda.is_available()
_NO_GUARD = contextlib.nullcontext()


def device_guard(t: torch.Tensor):
    """The launch context for ``t``'s device: switch only when ``t`` is not on
    the current device (entering ``torch.cuda.device`` costs two driver calls).

    A CPU-only torch build cannot enter ``torch.cuda.device`` even while it
    fake-traces a CUDA op body, and there is no device to select then anyway.
    """
    device = t.device
    if device.type == "cuda" and HAS_CUDA and device.index is not None \
            and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return _NO_GUARD


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(t: torch.Tensor) -> int:
    """Streaming multiprocessors of ``t``'s GPU; a fixed stand-in when none is present.

    The stand-in (an H100's 132) lets fake-CUDA tracing and the interpreter size
    persistent grids exactly as the GPU would.
    """
    if t.device.type == "cuda" and HAS_CUDA:
        return _sm_count(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return 132


def _first_tensor(args, kwargs) -> torch.Tensor:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    raise TypeError("a fused op needs at least one tensor argument")


#: The Python body of every fused op by qualified name, for tests that
#: fake-trace the Triton branch (the registered kernel is a wrapper around it).
OP_BODIES: dict[str, Callable] = {}


def fused_op(name: str, *, fake: Callable, reference: Callable):
    """Define ``torch.ops.fused.<name>`` from the decorated Triton launcher.

    The launcher's type hints give the op schema. ``fake`` (from ``meta/``)
    validates the arguments and allocates the outputs; it is registered as the
    fake implementation and the launcher calls it too, so shapes, dtypes and
    strides have one source of truth. ``reference`` (from ``reference/``) is
    the implementation on devices without Triton; its outputs are made
    contiguous to match the fake's.
    """

    def decorate(launch: Callable):
        @functools.wraps(launch)
        def body(*args, **kwargs):
            t = _first_tensor(args, kwargs)
            if runs_triton(t):
                with device_guard(t):
                    return launch(*args, **kwargs)
            fake(*args, **kwargs)  # the same validation as the Triton path
            out = reference(*args, **kwargs)
            if isinstance(out, tuple):
                return tuple(o.contiguous() for o in out)
            return out.contiguous()

        qualname = f"{NAMESPACE}::{name}"
        OP_BODIES[qualname] = body
        op = torch.library.triton_op(qualname, body, mutates_args=())
        op.register_fake(fake)
        return op

    return decorate
