"""Launch plans: an eager fused op's second call with the same signature replays its first.

Why: an eager call of a fused op spends several times the host time of the
bare Triton launches it makes before its kernels run (``bench/runners/host.py``;
figures in docs/notes/host-cost.md). The time goes to the fake's validation and
output shapes, the launch configuration, and Triton's own argument binding
and specialization in ``JITFunction.run``. For a given *signature* (every
tensor argument's dtype, device, shape, strides and pointer alignment, every
other argument's value, and torch's fp32 matmul precision, the one global
setting launchers read) all of that comes out the same. So the first call of
a signature runs the op's body and records its launches; later calls
allocate the outputs, point the recorded launches at the new tensors and call
Triton's compiled launcher directly.

A signature gets a plan only when replaying it is certainly the call:

- every tensor a kernel received is an input or an output of the op, or a
  view of one (same storage, fixed offset), or empty (a placeholder), or
  scratch: a buffer of the body's that its kernels write before they read
  it (MoE routing's partial logits and per-block counts), which a replay
  allocates afresh. An intermediate computed by torch ops (a copy, a
  quantization, a zeroed buffer) would be skipped by a replay: the check
  below fills scratch with NaN (all bits set) before verifying, so such a
  plan fails it;
- the inputs are distinct storages, and so are the outputs (empty ones aside);
- kernel arguments are tensors, numbers, strings, triton dtypes or None, and
  grids are tuples of ints;
- the body read no tensor values (it runs under
  ``torch.cuda.set_sync_debug_mode("error")`` while recording; nothing is
  recorded while a CUDA graph is captured or the user's sync debug mode is on,
  since verifying a plan syncs);
- replaying the plan into outputs prefilled with NaN (or -1) reproduces the
  recorded call's outputs exactly (an output written by a torch op, or not
  fully written, fails this).

Otherwise the signature is marked and runs the body every time. Launch
configs that sweeps and tests monkeypatch are not part of the signature:
after changing one, call ``compile_ops._library.clear_launch_plans()``.

Only CUDA tensors get plans (the interpreter runs kernels differently).
This module imports torch and triton only; ``_library`` uses it.
"""

import contextlib
import threading
from typing import Callable, Optional

import torch
from triton import knobs
from triton.experimental.gluon._runtime import GluonJITFunction
from triton.runtime import _allocation
from triton.runtime.jit import JITFunction

#: Kernels whose launches a plan can replay: compiled once, called through
#: their compiled launcher (an autotuner or heuristics wrapper chooses per call).
_PLAIN_KERNELS = (JITFunction, GluonJITFunction)
#: Entries per op before its plans are dropped (a model has a handful of signatures per op).
MAX_PLANS = 256
#: A signature that was recorded and cannot be replayed.
UNPLANNED = object()
_NOT_SEEN = object()
_SCALARS = (bool, int, float, str, type(None))
#: Tensor types that run Triton as they are: a module's weights come as
#: Parameters, a nominal subclass (DTensor, FakeTensor and the like are not plain).
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)

_state = threading.local()


def launch_hooks_set() -> bool:
    """Whether a profiler (proton, ...) hooks Triton's launches: replays pass
    no hooks, so they are off then. (Triton 3.6 keeps the hooks as chains,
    empty when unset; older releases as a function or None.)"""
    return any(
        h is not None and getattr(h, "calls", True)
        for h in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    )


def signature(args, kwargs) -> Optional[tuple]:
    """The key of a call (see the module docstring), or None when an argument
    is of a kind plans do not handle (the call then runs the body)."""
    # Globals that choose kernels: fp32 dots' precision, and (the attention backward's) deterministic algorithms.
    key = [torch.get_float32_matmul_precision(), torch.are_deterministic_algorithms_enabled()]
    for a in (*args, *kwargs.values()):
        if type(a) in PLAIN_TENSORS:
            key.append((a.dtype, a.get_device(), a.shape, a.stride(), a.data_ptr() % 16))
        elif isinstance(a, _SCALARS):
            key.append((type(a), a))
        elif isinstance(a, torch.dtype):
            key.append(a)
        else:
            return None
    if kwargs:
        key.append(tuple(kwargs))
    return tuple(key)


@contextlib.contextmanager
def recorded_launches():
    """Record the launches that fused ops' eager calls make inside the block,
    as ``(kernel, compiled, grid, args, kwargs)`` (``bench/runners/host.py`` replays
    them bare). Calls inside it run their bodies: no plan is used or made."""
    previous = getattr(_state, "launches", None)
    launches = []
    _state.launches = launches
    try:
        yield launches
    finally:
        _state.launches = previous


def recording_kernel(kernel):
    """What ``_library.launcher`` hands a launcher while a call is recorded:
    ``kernel`` itself, or a proxy that also records its launches."""
    launches = getattr(_state, "launches", None)
    return kernel if launches is None else _Recorded(kernel, launches)


class _Recorded:
    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            compiled = self.kernel[grid](*args, **kwargs)
            self.launches.append((self.kernel, compiled, grid, args, kwargs))
            return compiled

        return launch


class _Unplannable(Exception):
    pass


class Plan:
    """The recorded launches of one signature, replayable on new tensors."""

    def __init__(self, inputs: list, outputs, launches: list):
        self.single = isinstance(outputs, torch.Tensor)
        outs = [outputs] if self.single else list(outputs)
        if not outs or any(type(o) is not torch.Tensor for o in outs):
            raise _Unplannable("outputs are not one tensor or a tuple of tensors")
        self.outputs = [(tuple(o.shape), o.stride(), o.dtype) for o in outs]
        self.device = outs[0].device
        self.allocator = None
        storages = {}
        for i, t in enumerate(inputs + outs):
            if t.untyped_storage().nbytes() == 0:
                # Nothing to point at (attention_qk8's out_scale when it writes 16-bit rows): a kernel
                # handed one gets the placeholder below, and a replay allocates it empty again.
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in storages:  # shared storages: a pointer's source is ambiguous
                raise _Unplannable("tensors share a storage")
            storages[ptr] = (i, t.data_ptr())
        #: Scratch storages, ``(bytes, device)`` each: sources numbered after the outputs.
        self.scratch = []
        self.launches = []
        for kernel, compiled, grid, args, kwargs in launches:
            if type(kernel) not in _PLAIN_KERNELS or compiled is None or callable(grid):
                raise _Unplannable("not a plain @triton.jit or @gluon.jit launch with a fixed grid")
            if getattr(compiled.metadata, "global_scratch_size", 0):
                self.allocator = _allocation._allocator.get()  # device-built TMA descriptors need it
            bound = kernel.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in kernel.arg_names})
            bound.apply_defaults()
            values, slots = [], []
            for position, value in enumerate(bound.arguments.values()):
                if isinstance(value, torch.Tensor):
                    source = storages.get(value.untyped_storage().data_ptr())
                    if source is not None:
                        slots.append((position, source[0], value.data_ptr() - source[1]))
                        value = None
                    elif value.numel() == 0:  # a placeholder the kernel never reads (rope without k)
                        value = value.data_ptr()
                    else:  # scratch: allocated again by every replay, NaN-filled by the verification
                        storage = value.untyped_storage()
                        storages[storage.data_ptr()] = (len(inputs) + len(outs) + len(self.scratch), storage.data_ptr())
                        self.scratch.append(storage.nbytes())
                        source = storages[storage.data_ptr()]
                        slots.append((position, source[0], value.data_ptr() - source[1]))
                        value = None
                elif not isinstance(value, _SCALARS) and type(value).__module__.split(".")[0] != "triton":
                    raise _Unplannable(f"a kernel argument of type {type(value).__name__}")
                values.append(value)
            grid = tuple(grid) + (1,) * (3 - len(grid))
            if not all(type(g) is int for g in grid):
                raise _Unplannable("a grid of non-ints")
            self.launches.append((compiled.run, compiled.function, compiled.packed_metadata, grid, values, slots))

    def replay(self, inputs: list):
        """The op's outputs for ``inputs`` (tensors in signature order): new
        outputs, the recorded launches pointed at them."""
        outs = [
            torch.empty_strided(shape, stride, dtype=dtype, device=self.device) for shape, stride, dtype in self.outputs
        ]
        self.launch(inputs, outs)
        return outs[0] if self.single else tuple(outs)

    def launch(self, inputs: list, outs: list, fill_scratch: bool = False) -> None:
        scratch = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in self.scratch]
        if fill_scratch:
            for buffer in scratch:
                buffer.fill_(0xFF)  # NaN in every float dtype, -1 in every int one
        ptrs = [t.data_ptr() for t in inputs] + [o.data_ptr() for o in outs] + [b.data_ptr() for b in scratch]
        if self.allocator is not None and _allocation._allocator.get() is not self.allocator:
            _allocation._allocator.set(self.allocator)  # a new thread: its context has none set
        stream = torch._C._cuda_getCurrentRawStream(self.device.index)
        for run, function, packed, grid, values, slots in self.launches:
            values = values.copy()
            for position, source, offset in slots:
                values[position] = ptrs[source] + offset
            run(*grid, stream, function, packed, None, None, None, *values)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _verified(plan: Plan, inputs: list, outputs) -> bool:
    """Replaying ``plan`` into prefilled outputs gives the recorded ``outputs`` exactly."""
    outs = [
        torch.empty_strided(shape, stride, dtype=dtype, device=plan.device) for shape, stride, dtype in plan.outputs
    ]
    for o in outs:
        o.fill_(float("nan") if o.is_floating_point() else -1)
    plan.launch(inputs, outs, fill_scratch=True)
    want = [outputs] if plan.single else list(outputs)
    return all(_same(o, w) for o, w in zip(outs, want))


def record(plans: dict, key: tuple, body: Callable, args: tuple, kwargs: dict):
    """Run ``body`` once, recording its launches; store a verified :class:`Plan`
    (or UNPLANNED) under ``key``. Returns the body's outputs."""
    if torch.cuda.is_current_stream_capturing() or torch.cuda.get_sync_debug_mode():
        # Recording syncs to verify: not inside a CUDA graph, nor where the user is hunting syncs.
        return body(*args, **kwargs)
    try:
        with recorded_launches() as launches:
            torch.cuda.set_sync_debug_mode("error")
            try:
                outputs = body(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)  # the user's mode: recording starts only when it is off
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise  # the op's own error (bad input): the caller sees it as without plans
        plans[key] = UNPLANNED  # the launch path reads tensor values
        return body(*args, **kwargs)
    if launch_hooks_set():
        return outputs  # a profiler's hooks: record later, without them
    inputs = _tensors(args, kwargs)
    try:
        plan = Plan(inputs, outputs, launches)
        plans[key] = plan if _verified(plan, inputs, outputs) else UNPLANNED
    except _Unplannable:
        plans[key] = UNPLANNED
    if len(plans) > MAX_PLANS:
        plans.clear()
    return outputs


def _tensors(args, kwargs) -> list:
    """A call's tensor arguments in signature order: what plans' slots index
    (one filter for recording and replay, so the indices agree)."""
    return [a for a in (*args, *kwargs.values()) if type(a) in PLAIN_TENSORS]


def run(plans: dict, body: Callable, args: tuple, kwargs: dict):
    """The eager call of an op with ``body`` on CUDA tensors: replayed where
    ``plans`` has a plan for its signature, recorded on its first call, else
    the body. The caller has made the tensors' device current."""
    if getattr(_state, "launches", None) is not None:
        # Called by another op's body that is being recorded: its launches join that recording.
        return body(*args, **kwargs)
    key = signature(args, kwargs)
    plan = _NOT_SEEN if key is None else plans.get(key, _NOT_SEEN)
    if type(plan) is Plan and not launch_hooks_set():
        return plan.replay(_tensors(args, kwargs))
    if plan is _NOT_SEEN and key is not None:
        return record(plans, key, body, args, kwargs)
    return body(*args, **kwargs)
