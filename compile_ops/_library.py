"""The one helper that turns a Triton launcher into a ``torch.ops.fused.*`` op.

Why ``triton_op`` with an explicit fake: Inductor inlines the Triton kernel
into its generated code instead of calling an opaque extern (``custom_op``),
and an explicit fake is cheaper per eager call than letting torch derive one by
tracing the body (the three registrations compared: docs/design.md).

Where code runs:
- CUDA tensors run the Triton launcher, under the tensor's device context.
- Other devices run the pure-PyTorch reference (after the same validation),
  which keeps ``opcheck``, ``gradcheck`` and ``torch.compile`` usable on CPU.
- Eager calls from Python skip torch's dispatcher when nothing traces them (see
  ``FusedOp.__call__``): the dispatcher and torch.library's autograd layers
  made an eager forward+backward step host-bound (docs/notes/host-cost.md). On
  CUDA, those calls also replay launch plans (``_replay``): a signature's
  first call records its launches, later ones skip validation, configuration
  and Triton's argument binding.
- With ``TRITON_INTERPRET=1`` in the environment *before* triton is imported,
  CPU tensors run the real Triton kernels through the interpreter instead: that
  is how a CPU-only CI executes every kernel. Triton's interpreter cannot be
  fake-traced, so that mode is for eager calls only (tests run it in a separate
  process; see ``tests/run.sh``).
"""

import contextlib
import functools
import os
import threading
from typing import Callable, Optional

import torch
from torch.library import wrap_triton
from torch.utils._python_dispatch import _get_current_dispatch_mode

from compile_ops import _dtensor, _replay
from compile_ops.meta._validate import type_checker

NAMESPACE = "fused"

#: CPU tensors run the Triton kernels through triton's interpreter.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def runs_triton(t: torch.Tensor) -> bool:
    """True when ops on ``t`` launch Triton kernels (CUDA, or CPU under the interpreter)."""
    return t.device.type == "cuda" or (INTERPRET and t.device.type == "cpu")


def interpreted_bf16_dot(t: Optional[torch.Tensor]) -> bool:
    """True when ``t`` would be a bf16 operand of ``tl.dot`` under triton's
    interpreter: numpy has no bf16, and the interpreter (triton 3.6) multiplies
    such operands as their raw 16-bit patterns, which gives garbage instead of
    an error. Ops refuse them (:func:`refuse_interpreted_bf16_dots`); callers
    that have another path take it."""
    return INTERPRET and t is not None and t.dtype == torch.bfloat16 and t.device.type == "cpu"


def refuse_interpreted_bf16_dots(op: str, **operands: Optional[torch.Tensor]) -> None:
    """Refuse bf16 operands of ``tl.dot`` under triton's interpreter (:func:`interpreted_bf16_dot`)."""
    for name, t in operands.items():
        if interpreted_bf16_dot(t):
            raise TypeError(
                f"fused.{op}: {name} is bfloat16, whose matrix products triton's interpreter "
                "(TRITON_INTERPRET=1) computes on the raw bits; use float16 or float32 there, or a GPU"
            )


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
    if device.type == "cuda" and HAS_CUDA and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return _NO_GUARD


@torch.compiler.assume_constant_result
def cuda_capability(index: Optional[int]) -> tuple:
    """``(major, minor, name)`` of CUDA device ``index`` (None: the current one).
    A constant to torch.compile: looked up once while tracing, not in the graph.

    With :func:`has_tma` the one place that tells GPUs apart: FP8 GEMMs need
    sm_89 (``ops/fp8.py``), the Hopper attention options sm_90."""
    major, minor = torch.cuda.get_device_capability(index)
    return major, minor, torch.cuda.get_device_name(index)


#: The first capability with TMA (tensor descriptors) and warpgroup MMA.
HOPPER = (9, 0)
#: The first capability with FP8 (e4m3) tensor cores: FP8 GEMMs (``ops/fp8.py``)
#: and FP8 P V in attention (``ops/attention.py``).
FP8_MMA = (8, 9)


def require_fp8_mma(t: torch.Tensor, what: str) -> bool:
    """True when ``t`` is on a CUDA GPU with FP8 tensor cores; False off CUDA
    (the caller's reference or interpreter path); a RuntimeError naming the
    GPU's capability and ``what`` needed it on a CUDA GPU below sm_89."""
    if t.device.type != "cuda" or not HAS_CUDA:
        return False
    major, minor, name = cuda_capability(t.device.index)
    if (major, minor) < FP8_MMA:
        raise RuntimeError(
            f"compile_ops: {what} needs FP8 tensor cores (sm_89 or newer: Ada, Hopper, "
            f"Blackwell); {name} is sm_{major}{minor}"
        )
    return True


def has_wgmma(t: torch.Tensor) -> bool:
    """True when ``t`` is on a Hopper GPU (sm_90): the one architecture with
    warpgroup MMA, which the Gluon kernels (``kernels/attention_sm90.py``)
    are written for; False elsewhere (Blackwell has TMA but not wgmma)."""
    if t.device.type != "cuda" or not HAS_CUDA:
        return False
    return cuda_capability(t.device.index)[0] == HOPPER[0]


def has_tma(t: torch.Tensor) -> bool:
    """True when ``t`` is on a GPU with TMA (Hopper, sm_90, or newer): kernels
    take their Hopper path there and the portable one elsewhere (older GPUs,
    the interpreter, fake CUDA tensors on a CPU-only build)."""
    if t.device.type != "cuda" or not HAS_CUDA:
        return False
    return cuda_capability(t.device.index)[:2] >= HOPPER


@functools.lru_cache(maxsize=None)
def _device_properties(index: int):
    return torch.cuda.get_device_properties(index)


def _gpu_property(t: torch.Tensor, name: str, stand_in: int) -> int:
    """``name`` of ``t``'s GPU's properties; ``stand_in`` (the value of the
    reference machine of docs/notes/method.md) when none is present, so that
    fake-CUDA tracing and the interpreter size grids and groups exactly as the
    GPU would."""
    if t.device.type == "cuda" and HAS_CUDA:
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return getattr(_device_properties(index), name)
    return stand_in


def multiprocessor_count(t: torch.Tensor) -> int:
    """Streaming multiprocessors of ``t``'s GPU (132 without one)."""
    return _gpu_property(t, "multi_processor_count", 132)


def l2_cache_bytes(t: torch.Tensor) -> int:
    """L2 cache size in bytes of ``t``'s GPU (``50 * 2**20`` without one)."""
    return _gpu_property(t, "L2_cache_size", 50 * 2**20)


def _first_tensor(args, kwargs) -> torch.Tensor:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    raise TypeError("a fused op needs at least one tensor argument")


#: The Python body of every fused op by qualified name, for tests that
#: fake-trace the Triton branch (the registered kernel is a wrapper around it).
OP_BODIES: dict[str, Callable] = {}
#: Every op's :class:`FusedOp` by name (``"rmsnorm"``), for the host-cost
#: benchmark (``bench/runners/host.py``), which calls each op's eager fast path.
FUSED_OPS: dict[str, "FusedOp"] = {}

_launch_state = threading.local()


def launcher(kernel):
    """How launchers call a ``@triton.jit`` kernel: through ``wrap_triton``, so
    that tracing records it, except on the eager fast path where nothing traces
    and the kernel is launched as is (``wrap_triton`` outside an op would route
    the launch through its tracing machinery: docs/notes/host-cost.md), or
    recorded for a launch plan (``_replay``)."""
    return _replay.recording_kernel(kernel) if getattr(_launch_state, "eager", False) else wrap_triton(kernel)


def on_eager_fast_path() -> bool:
    """True while an op body runs on the eager fast path (real CUDA tensors,
    nothing tracing): a launcher may then launch a kernel that Inductor
    cannot trace (a Gluon kernel) through :func:`launcher`, recorded for
    launch plans; elsewhere it calls the opaque op that launches it."""
    return getattr(_launch_state, "eager", False)


def building_aot_package() -> bool:
    """True while AOTInductor compiles a graph into a package
    (``torch._inductor.aoti_compile_and_package``): a package runs from C++
    with no Python in the process, so a launcher must not put an op defined
    in Python (the Gluon core's opaque op) into its graph."""
    from torch._inductor.virtualized import V  # imported on traced calls only

    return V.aot_compilation


def launch_untraced(body, *args, **kwargs):
    """``body(*args, **kwargs)`` (a launcher) on the eager fast path: the body of
    an opaque op, which runs on real tensors, untraced, so its kernels may
    take launch options that Inductor's launch configs cannot carry."""
    return _launch_eagerly(body, args, kwargs)


def _launch_eagerly(body, args, kwargs, plans: Optional[dict] = None):
    """``body`` on the eager fast path; with ``plans`` (CUDA tensors) through
    launch plans: replayed from an earlier call of the same signature."""
    previous = getattr(_launch_state, "eager", False)
    _launch_state.eager = True
    try:
        if plans is None:
            return body(*args, **kwargs)
        with device_guard(_first_tensor(args, kwargs)):
            return _replay.run(plans, body, args, kwargs)
    finally:
        _launch_state.eager = previous


def clear_launch_plans() -> None:
    """Forget every op's launch plans: after changing a launch config (sweeps,
    tests that monkeypatch one), the next eager call records a new plan."""
    for op in FUSED_OPS.values():
        op.plans.clear()


def _untraced(args, kwargs) -> bool:
    """True when this call is plain eager execution on tensors that run Triton:
    not under torch.compile or export, no dispatch mode (fake tensors, make_fx,
    functionalization), no tensor subclass (DTensor, FakeTensor) but Parameter."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    first = None
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            if type(a) not in _replay.PLAIN_TENSORS:
                return False
            first = first if first is not None else a
    # Under autocast the dispatcher's Autocast kernel (register_autocast_policy) casts first.
    return first is not None and runs_triton(first) and not torch.is_autocast_enabled(first.device.type)


def _on_cuda(args, kwargs) -> bool:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.is_cuda
    return False


def _needs_grad(args, kwargs) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in list(args) + list(kwargs.values())
    )


class FusedOp:
    """A ``torch.ops.fused.<name>`` op and its eager fast path.

    Calling a ``FusedOp`` is calling the op: under ``torch.compile``, export,
    fake tensors or any dispatch mode it *is* the registered op, so graphs show
    ``torch.ops.fused.<name>``. In plain eager execution it runs the same body
    and the same autograd formula without the dispatcher's layers.
    """

    def __init__(
        self,
        name: str,
        custom_op,
        body: Callable,
        eager_check: Optional[Callable] = None,
        check_types: Optional[Callable] = None,
    ):
        self.name = name
        #: The Python types of the arguments (``meta._validate.type_checker``), checked before the
        #: dispatcher, which would turn a float into a bool or take None for a tensor.
        self.check_types = check_types
        self.custom_op = custom_op
        self.body = body
        #: Value checks the fast path runs before every call (see :func:`fused_op`).
        self.eager_check = eager_check
        self.op = getattr(getattr(torch.ops, NAMESPACE), name)
        self._autograd_function = None
        #: Launch plans by call signature (``_replay``): eager CUDA calls only.
        self.plans: dict = {}

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        """Register ``backward``/``setup_context`` on the op, and build the
        ``autograd.Function`` that the fast path uses with the same two functions.

        The registered pair is wrapped for DTensor arguments (see
        :func:`compile_ops._dtensor.gradients_as_dtensors`); the fast path
        never sees DTensors and is left as is."""
        self.custom_op.register_autograd(
            _dtensor.gradients_as_dtensors(backward), setup_context=_dtensor.remember_output_layouts(setup_context)
        )
        body, plans = self.body, self.plans

        def forward(*args):
            return _launch_eagerly(body, args, {}, plans if _on_cuda(args, {}) else None)

        def setup(ctx, inputs, output):
            setup_context(ctx, inputs, output)

        def backward_(ctx, *grads):
            return backward(ctx, *grads)

        # type() rather than a class statement, so that grad_fn names the op.
        EagerFunction = type(
            f"{self.name}_eager",
            (torch.autograd.Function,),
            {
                "forward": staticmethod(forward),
                "setup_context": staticmethod(setup),
                "backward": staticmethod(backward_),
            },
        )
        self._autograd_function = EagerFunction

    def __call__(self, *args, **kwargs):
        if not torch.compiler.is_compiling() and self.check_types is not None:
            self.check_types(args, kwargs)
        if not _untraced(args, kwargs):
            return self.op(*args, **kwargs)
        if self.eager_check is not None:
            self.eager_check(*args, **kwargs)
        if _needs_grad(args, kwargs):
            if self._autograd_function is None:  # inference only: the op's formula raises on backward
                return self.op(*args, **kwargs)
            return self._autograd_function.apply(*args, **kwargs)
        return _launch_eagerly(self.body, args, kwargs, self.plans if _on_cuda(args, kwargs) else None)


#: Autocast policies, mirroring aten's for the ops ours replace: ``"fp32"``
#: (``layer_norm``, ``rms_norm``: floating inputs cast to fp32, on CUDA only:
#: aten has no CPU autocast kernel for them) and ``"lower"``
#: (``scaled_dot_product_attention``: cast to the autocast dtype, on CUDA and CPU).
AUTOCAST_POLICIES = {"fp32": ("cuda",), "lower": ("cuda", "cpu")}
_AUTOCAST_LIB = torch.library.Library(NAMESPACE, "IMPL")


def aten_autocast_policy(aten_op: str, policy: str) -> Optional[str]:
    """``policy`` when this torch gives ``aten_op`` an autocast kernel on each
    device the policy covers, else None: ours then mirrors aten's op on every
    torch release. (aten's ``rms_norm`` is in CUDA autocast's fp32 list in torch
    2.13 and has no autocast kernel in 2.11, where it keeps the input dtype.)"""
    keys = ("Autocast" + torch._C._dispatch_key_for_device(d) for d in AUTOCAST_POLICIES[policy])
    return policy if all(torch._C._dispatch_has_kernel_for_dispatch_key(aten_op, k) for k in keys) else None


def register_autocast_policy(name: str, policy: str) -> None:
    """Give ``torch.ops.fused.<name>`` an Autocast kernel with ``policy`` (see
    :data:`AUTOCAST_POLICIES`): inside ``torch.autocast`` the op's floating
    tensor arguments on that device are cast, then the op runs with autocast
    excluded, as aten's autocast kernels do. (``torch.library.register_autocast``
    takes one fixed dtype; ``"lower"`` follows the autocast dtype in effect.)"""
    op = getattr(getattr(torch.ops, NAMESPACE), name).default
    for device_type in AUTOCAST_POLICIES[policy]:
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def cast_and_run(*args, device_type=device_type, keyset=keyset):
            dtype = torch.float32 if policy == "fp32" else torch.get_autocast_dtype(device_type)
            with torch._C._ExcludeDispatchKeyGuard(keyset):
                return op(*torch.library._cast(args, device_type, dtype))

        # The Python dispatcher (torch.compile, make_fx) reads py_impl; eager reads the library kernel.
        op.py_impl(getattr(torch._C.DispatchKey, key))(cast_and_run)
        _AUTOCAST_LIB.impl(name, lambda _keyset, *args, run=cast_and_run: run(*args), key, with_keyset=True)


def register_no_gradient(op, message: str) -> None:
    """The autograd formula of an inference-only op (FP8 quantization, 8-bit
    attention): outputs track their inputs, and a backward through them
    raises ``message``."""

    def no_gradient(ctx, *grads):
        raise RuntimeError(message)

    op.register_autograd(no_gradient, setup_context=lambda ctx, inputs, output: None)


def fused_op(
    name: str,
    *,
    fake: Callable,
    reference: Callable,
    autocast: Optional[str] = None,
    eager_check: Optional[Callable] = None,
):
    """Define ``torch.ops.fused.<name>`` from the decorated Triton launcher.

    The launcher's type hints give the op schema; it launches kernels through
    :func:`launcher`. ``fake`` (from ``meta/``) validates the arguments and
    allocates the outputs; it is registered as the fake implementation and the
    launcher calls it too, so shapes, dtypes and strides have one source of
    truth. ``reference`` (from ``reference/``) is the implementation on devices
    without Triton; its outputs are made contiguous to match the fake's.
    ``autocast``: the op's policy under ``torch.autocast`` (a key of
    :data:`AUTOCAST_POLICIES`, as the aten op it replaces), or None (none:
    the op sees the dtypes it is given). ``eager_check``: called with the
    op's arguments before each call on the eager fast path, for checks of
    argument *values* that a launch plan's replay (which skips the body and
    so the fake's validation) must not skip. Returns a :class:`FusedOp`.
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
        if autocast is not None:
            register_autocast_policy(name, autocast)
        FUSED_OPS[name] = FusedOp(name, op, body, eager_check, type_checker(f"{NAMESPACE}.{name}", launch))
        return FUSED_OPS[name]

    return decorate
