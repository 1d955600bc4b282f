"""The harness of the DTensor test files (test_distributed.py,
test_distributed_attention.py); it holds no tests.

- ``Case``: a public function, its full tensors, the placements they are
  distributed with and the placements expected of its outputs and gradients;
  the tensor builders ``act``, ``param`` and ``table``; the shapes (``B, L, C``;
  ``H, HK, D``), ``WORLD``, and ``R``, ``P``, ``Shard``.
- Builders the cases of both files use: ``_attention`` (causal attention with
  key lengths, lse returned) with ``_attention_inputs``, and ``_as_floats``
  (FP8 outputs as floats).
- ``check``: one case on DTensors against the full tensors, on every rank;
  ``_run_with_wrong_rule``, the harness catching a wrong rule (``WRONG_RULE``);
  ``_record_sharded_ops``, the fused ops DTensor dispatched (``EVERY_OP``:
  every op with a rule ran in some case).
- ``every_verdict``: one spawn of 2 gloo ranks per pytest process runs the
  ``CASES`` of every module of ``CASE_MODULES`` (a process group costs
  seconds to start, and ``EVERY_OP`` needs every case); each test file's
  ``verdicts`` fixture reads it.
"""

import importlib
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_cases, spawn_verdicts

import compile_ops

if dist.is_available():
    from torch.distributed.tensor import Partial, Replicate, Shard

    R, P = Replicate(), Partial()
else:  # the module must import to be skipped
    R = P = Shard = None

WORLD = 2
#: Wall-clock limit of the spawn: two imports of torch + compile_ops on a busy
#: 2-core CI box, then about seventy small cases (about 25 s in all here).
SPAWN_TIMEOUT_S = 240
B, L, C = 2, 4, 8
H, HK, D = 4, 2, 8  # q heads, k/v heads (GQA), head dim


def act(*shape):
    """A differentiable activation."""
    return torch.randn(shape).requires_grad_()


def param(c):
    """A differentiable weight or bias."""
    return (1.0 + 0.1 * torch.randn(c)).requires_grad_()


def table(*shape):
    """A cos or sin table (not differentiable)."""
    return torch.rand(shape) * 2 - 1


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable
    """The public function, options bound: ``fn(*tensors)``."""
    make: Callable[[], tuple]
    """The full tensors; the differentiable ones require grad."""
    shard: tuple
    """The placement each tensor is distributed with."""
    outputs: Optional[tuple]
    """The expected placement of each output; None where the op is not local on ``not_sharded_on``."""
    grads: tuple = ()
    """The expected placement of each input's gradient (None: not differentiable, or not checked)."""
    not_sharded_on: Optional[int] = None
    """A dim that no output may be sharded on."""
    differentiate: Optional[tuple] = None
    """Which outputs to backpropagate from; default: every differentiable one."""
    mesh: tuple = (WORLD,)
    """The mesh shape; on a 2-D mesh each placement above is a tuple, one per mesh dim."""


def _per_mesh_dim(placement) -> tuple:
    return placement if isinstance(placement, tuple) else (placement,)


# ---------------------------------------------------------------- builders the cases of both files use


def _attention(seq_dim, q, k, v, kv_lengths):
    return compile_ops.attention(q, k, v, causal=True, seq_dim=seq_dim, kv_lengths=kv_lengths, return_lse=True)


def _attention_inputs(seq_dim):
    def qkv(heads, length):
        return act(B, heads, length, D) if seq_dim == 2 else act(B, length, heads, D)

    return lambda: (qkv(H, L), qkv(HK, L + 2), qkv(HK, L + 2), torch.tensor([5, 3]))


def _as_floats(out):
    """FP8 outputs as floats: assert_close has no float8 path."""
    return tuple(t.float() if t.dtype == torch.float8_e4m3fn else t for t in _flatten(out))


def _flatten(out):
    for t in out if isinstance(out, tuple) else (out,):
        yield from (_flatten(t) if isinstance(t, tuple) else (t,))


# ---------------------------------------------------------------- the check, run on every rank


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def check(case: Case, mesh) -> None:
    """Raise AssertionError where the DTensor run differs from the full-tensor run."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)  # the same tensors on every rank
    full = case.make()
    sharded = [
        distribute_tensor(t.detach(), mesh, _per_mesh_dim(p)).requires_grad_(t.requires_grad)
        for t, p in zip(full, case.shard)
    ]
    out = _as_tuple(case.fn(*sharded))
    want = _as_tuple(case.fn(*full))
    for i, (o, w) in enumerate(zip(out, want)):
        if case.outputs is not None:
            expected = _per_mesh_dim(case.outputs[i])
            assert o.placements == expected, f"output {i}: placements {o.placements}, expected {expected}"
        if case.not_sharded_on is not None:
            assert Shard(case.not_sharded_on) not in o.placements, f"output {i} is sharded on a dim the op cannot split"
        _close(o.full_tensor(), w, f"output {i}")

    chosen = range(len(out)) if case.differentiate is None else case.differentiate
    chosen = [i for i in chosen if want[i].requires_grad]
    cotangents = [torch.randn(want[i].shape) for i in chosen]
    torch.autograd.backward([want[i] for i in chosen], cotangents)
    torch.autograd.backward(
        [out[i] for i in chosen], [distribute_tensor(g, mesh, out[i].placements) for i, g in zip(chosen, cotangents)]
    )
    for i, (t, s) in enumerate(zip(full, sharded)):
        if not t.requires_grad:
            continue
        if t.grad is None:
            assert s.grad is None, f"gradient {i}: the full run has none"
            continue
        expected = case.grads[i] if i < len(case.grads) else None
        if expected is not None:
            expected = _per_mesh_dim(expected)
            assert s.grad.placements == expected, f"gradient {i}: placements {s.grad.placements}, expected {expected}"
        _close(s.grad.full_tensor(), t.grad, f"gradient {i}")


def _run_with_wrong_rule(mesh) -> Optional[str]:
    """Register a rule that lets rmsnorm run on channel shards (each rank then
    normalizes half a row): :func:`check` must fail. None when it did."""
    from torch.distributed.tensor import DTensor

    from compile_ops import distributed

    def every_dim(shape, call):
        return {d: d for d in range(len(shape))}

    def along_x_channels(shape, call):
        return {len(call.primary.shape) - 1: 0}

    op = torch.ops.fused.rmsnorm.default
    propagator = DTensor._op_dispatcher.sharding_propagator
    good = propagator.op_strategy_funcs[op]
    wrong = distributed.Rule(
        {"x": every_dim, "weight": along_x_channels, "bias": distributed.replicated},
        (distributed.Out("x", every_dim),),
        lambda call: range(len(call.primary.shape)),
    )
    case = Case(
        "rmsnorm/channel_with_wrong_rule",
        lambda x, w: compile_ops.rmsnorm(x, w),
        lambda: (act(B, L + 2, C), param(C)),
        (Shard(2), R),
        None,
    )
    propagator.register_op_strategy(op, partial(distributed.sharding_strategy, wrong))
    propagator.propagate_op_sharding.cache_clear()
    try:
        check(case, mesh)
    except AssertionError:
        return None
    finally:
        propagator.register_op_strategy(op, good)
        propagator.propagate_op_sharding.cache_clear()
    return "a rule that splits rmsnorm's channel dim went undetected"


WRONG_RULE = "harness_detects_a_wrong_rule"
EVERY_OP = "every_fused_op_ran_on_dtensors"


def _record_sharded_ops() -> set:
    """Wrap each fused op's strategy so that the names of the ops DTensor
    propagated (forward and backward) collect in the returned set."""
    from torch.distributed.tensor import DTensor

    from compile_ops.distributed import RULES

    propagator = DTensor._op_dispatcher.sharding_propagator
    seen = set()

    def recording(name, strategy, op_schema):
        seen.add(name)
        return strategy(op_schema)

    for name in RULES:
        op = getattr(torch.ops.fused, name).default
        propagator.op_strategy_funcs[op] = partial(recording, name, propagator.op_strategy_funcs[op])
    return seen


# ---------------------------------------------------------------- one spawn for every case


#: The test modules whose ``CASES`` (``{name: Case}``) the spawn runs, imported by name on each rank.
CASE_MODULES = ("test_distributed", "test_distributed_attention")


def _every_case() -> dict:
    """``{name: Case}`` of every module of ``CASE_MODULES``; a name in two of them raises."""
    cases = {}
    for module in CASE_MODULES:
        for name, case in importlib.import_module(module).CASES.items():
            assert name not in cases, f"the case {name} is in two modules"
            cases[name] = case
    return cases


def _checks(world: int) -> dict:
    """``{name: check}`` for this rank, once its process group is up: every case
    of ``CASE_MODULES`` on its mesh, then ``WRONG_RULE``, then ``EVERY_OP``
    (last: it reads which ops the checks before it dispatched)."""
    from torch.distributed.device_mesh import init_device_mesh

    from compile_ops.distributed import RULES

    cases = _every_case()
    meshes = {shape: init_device_mesh("cpu", shape) for shape in sorted({c.mesh for c in cases.values()})}
    sharded_ops = _record_sharded_ops()
    checks = {name: partial(check, case, meshes[case.mesh]) for name, case in cases.items()}

    def harness_detects_a_wrong_rule():
        failure = _run_with_wrong_rule(meshes[(world,)])
        if failure is not None:
            raise AssertionError(failure)

    def every_op_ran():
        missing = sorted(set(RULES) - sharded_ops)
        if missing:
            raise AssertionError(f"never dispatched with DTensors: {missing}")

    checks[WRONG_RULE] = harness_detects_a_wrong_rule
    checks[EVERY_OP] = every_op_ran
    return checks


def _worker(rank: int, world: int, directory: str) -> None:
    run_cases(rank, world, directory, partial(_checks, world))


_SPAWNED: dict = {}


def every_verdict(tmp_path_factory) -> dict:
    """``{case: None or the failure on some rank}`` for every case of ``CASE_MODULES``,
    ``WRONG_RULE`` and ``EVERY_OP``, from one spawn of 2 ranks: the first test file that
    asks starts it, the others read the same verdicts (or the same failure to finish)."""
    if not _SPAWNED:
        try:
            _SPAWNED["verdicts"] = spawn_verdicts(_worker, WORLD, str(tmp_path_factory.mktemp("gloo")), SPAWN_TIMEOUT_S)
        except pytest.fail.Exception as failure:
            _SPAWNED["failure"] = str(failure)
    if "failure" in _SPAWNED:
        pytest.fail(_SPAWNED["failure"], pytrace=False)
    return _SPAWNED["verdicts"]
