"""Where each test layer runs (docs/design.md, "the four test layers").

- ``kernels`` tests execute the Triton kernels: on CUDA when there is a GPU,
  else on CPU through triton's interpreter, which needs TRITON_INTERPRET=1
  before triton is imported — so on a CPU-only machine they run in their own
  pytest process (tests/run.sh). Without a GPU or the interpreter they skip.
- Every other test runs the reference path and fake-CUDA tracing, which the
  interpreter breaks, so they skip under TRITON_INTERPRET=1.
"""

import contextlib
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()

#: Where kernel tests put their tensors: the GPU, or the CPU under the interpreter.
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"


def tf32_dots(device) -> bool:
    """Whether fp32 attention's dots run on TF32 tensor cores on ``device``: a GPU
    whose session allows TF32 matmuls (torch's fp32 matmul precision, not
    "highest"). Tests of fp32 attention choose their reference and tolerance by it."""
    return torch.device(device).type == "cuda" and torch.get_float32_matmul_precision() != "highest"


def allow_tma_under_interpreter(patch) -> None:
    """Let a test that forces the attention kernels' TMA option run it under
    the interpreter too (``patch``: a monkeypatch context): there the tensors
    are on the CPU, so the launcher's alignment check and the descriptors'
    scratch allocator are replaced. On a GPU it changes nothing."""
    if INTERPRET:
        from compile_ops.ops import attention_args

        patch.setattr(attention_args, "tma_ready", lambda *tensors: True)
        patch.setattr(
            attention_args, "tma_scratch", lambda size, alignment, stream: torch.empty(size, dtype=torch.int8)
        )


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool = True):
    """``torch.use_deterministic_algorithms(enabled)`` for a block, restored after
    (it chooses the attention backward's kernels)."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


#: For properties of programs running at once (no atomics, a fixed reduction
#: order): the interpreter runs a grid's programs one after another, so there
#: every run agrees by construction and the test would prove nothing.
concurrent_programs_only = pytest.mark.skipif(
    INTERPRET, reason="the interpreter runs programs one at a time: run-to-run determinism is the GPU's property"
)


if INTERPRET:
    import interpreter_casts

    interpreter_casts.cast_like_the_gpu()

#: COMPILE_OPS_POISON_EMPTY (tests/poison.py): the package's torch.empty & co. return NaN / 0x7F-filled
#: tensors, so that a kernel's read of an element nobody wrote shows in its outputs. The interpreter
#: layer only: there the kernels run on these CPU tensors (elsewhere the reference path runs, on aten).
POISON_SCOPE = None
if INTERPRET:
    import poison

    POISON_SCOPE = poison.scope()
    if POISON_SCOPE is not None:
        poison.install(POISON_SCOPE)

_common = dict(
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# One profile per place the suite runs; tests/run.sh picks it (HYPOTHESIS_PROFILE
# overrides). "ci": CPU, the same 50 examples every run. "gpu": 20 random
# examples per property with the seed printed by run.sh, sizes from the few
# choices of tests/shapes.py, so the cold CUDA layer stays under 10 minutes.
# "gpu-long": the same on many more examples, for a run that is not in a hurry.
settings.register_profile("ci", max_examples=50, derandomize=True, **_common)
settings.register_profile("gpu", max_examples=20, **_common)
settings.register_profile("gpu-long", max_examples=200, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gpu" if HAS_CUDA else "ci"))


def pytest_configure(config):
    config.addinivalue_line("markers", "kernels: executes Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")


def pytest_report_header(config):
    if POISON_SCOPE is not None:
        return f"poisoned allocations ({POISON_SCOPE}): torch.empty & co. filled with NaN / 0x7F bytes"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "kernels" in item.keywords:
            if not (HAS_CUDA or INTERPRET):
                item.add_marker(pytest.mark.skip(reason="runs Triton kernels: needs a GPU or TRITON_INTERPRET=1"))
        elif INTERPRET:
            item.add_marker(pytest.mark.skip(reason="the Triton interpreter cannot be fake-traced or compiled"))
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _eight_bit_attention_at_every_length():
    """On a GPU, patched models run an 8-bit ``attention_precision`` from
    ``attention_kernel.EIGHT_BIT_FROM_KEYS`` keys only; the tiny models' sequences
    are far shorter, so their tests would see 16-bit attention where they ask
    for 8-bit. Off a GPU the rule does not apply. The rule's own test
    (test_diffusers_patch_attention.py) sets the bound back. Not through
    ``monkeypatch``: an autouse fixture that takes it sets it up before
    :func:`_no_leaked_global_state`, whose check would then run before a
    test's own monkeypatching is undone."""
    attention_kernel = None
    if HAS_CUDA:
        try:
            from compile_ops.integrations.diffusers import attention_kernel
        except ImportError:  # without diffusers there is no patched model
            pass
    if attention_kernel is None:
        yield
        return
    bound, attention_kernel.EIGHT_BIT_FROM_KEYS = attention_kernel.EIGHT_BIT_FROM_KEYS, 0
    yield
    attention_kernel.EIGHT_BIT_FROM_KEYS = bound


def _global_state() -> dict:
    """What a test may change only for its own duration: torch's config modules
    (changed through their own ``patch()``, never pytest's monkeypatch, which
    deletes an entry it cannot find in the module's ``__dict__``, and torch
    then hides that entry for the rest of the process), torch's global modes,
    and compile_ops' own process-wide settings."""
    import torch._dynamo.config
    import torch._inductor.config
    import torch.compiler.config

    from compile_ops.ops import attention_sm90

    # Read entry by entry: get_config_copy() still lists an entry torch has hidden.
    with warnings.catch_warnings():  # reading a deprecated entry warns
        warnings.simplefilter("ignore", FutureWarning)
        configs = {
            module.__name__: {key: repr(getattr(module, key, "<hidden>")) for key in module.get_config_copy()}
            for module in (torch.compiler.config, torch._dynamo.config, torch._inductor.config)
        }
    return {
        "configs": configs,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
        "attention_atomic_dq": attention_sm90.ATOMIC_DQ,
    }


@pytest.fixture(autouse=True)
def _no_leaked_global_state():
    """Fail the test that leaves global state changed: a later test, in any
    order, must see the process as a fresh one would."""
    before = _global_state()
    yield
    after = _global_state()
    changed = {key for key in before if key != "configs" and before[key] != after[key]}
    for name, config in before["configs"].items():
        now = after["configs"][name]
        changed |= {f"{name}.{key}" for key in config.keys() | now.keys() if config.get(key) != now.get(key)}
    assert not changed, f"the test left global state changed: {sorted(changed)}"
