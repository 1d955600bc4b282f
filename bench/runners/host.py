"""Host cost of an eager call: every registry op against a bare Triton launch of its kernels.

    PYTHONPATH=. python bench/runners/host.py [--out bench/results] [--ops rmsnorm,attention]

On a CUDA machine, for each registry op with example inputs, at a shape small
enough that launching, not the kernels, sets the time (``OVERHEAD_SHAPE``,
bf16), the host microseconds per call of:

- ``eager_us``: the op as a model calls it in eager mode (``FusedOp``'s fast
  path: no dispatcher when nothing traces, and the launches replayed from the
  first call's plan where the op has one: ``planned``, ``compile_ops/_replay.py``);
- ``dispatcher_us``: ``torch.ops.fused.<op>`` (torch's dispatcher and
  torch.library's layers in front of the same body);
- ``bare_us``: the Triton launches that one eager call makes, replayed with the
  recorded arguments (``kernel[grid](*args)``): what the kernels cost to launch
  from Python at all, with the outputs allocated beforehand;
- ``reference_us``: the pure-PyTorch composite the op replaces, eager;

and ``gpu_us``, the kernels' own time (CUDA-graph replay), which shows the
calls are host-bound. ``ratio`` is ``eager_us / bare_us`` (the target:
at most 1.5). Writes ``<out>/host-<gpu>.json``; ``bench/runners/ops.py`` runs the
rmsnorm row for its report line.
"""

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.toolkit import as_tuple, environment, graph_replay_time, log, make_timer, write_results  # noqa: E402

#: Small enough that every op's kernels take a few microseconds.
OVERHEAD_SHAPE = (1, 64, 3072)
CALLS = 1000
ROUNDS = 5


def per_call_us(fn, calls: int = CALLS, rounds: int = ROUNDS) -> float:
    """Median over ``rounds`` of the wall time per call of ``calls`` back-to-back calls."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def profile_text(fn, calls: int = 2000, top: int = 14) -> str:
    """cProfile of ``calls`` calls of ``fn``: the functions with the most own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def measure(spec, shape=OVERHEAD_SHAPE, timer=None, profile: bool = False) -> dict:
    """One row of host costs for a registry op (see the module docstring)."""
    from compile_ops._library import FUSED_OPS, clear_launch_plans
    from compile_ops._replay import Plan, recorded_launches

    fused = FUSED_OPS[spec.op_name or spec.name]
    torch.manual_seed(0)
    args = spec.make_inputs(shape, torch.bfloat16, "cuda", False)

    with torch.no_grad():

        def eager():
            return fused(*args)

        def dispatcher():
            return spec.op(*args)

        def reference():
            return spec.reference(*args)

        clear_launch_plans()
        with recorded_launches() as launches:  # the body runs, its launches recorded (no plan yet)
            want = as_tuple(eager())
        torch.cuda.synchronize()

        def bare():
            for kernel, _, grid, a, kw in launches:
                kernel[grid](*a, **kw)

        # bare() writes the first call's outputs again and later calls replay
        # its plan: the same kernels on the same arguments, so all must agree.
        got = as_tuple(eager())
        bare()
        torch.cuda.synchronize()
        same_output = all(torch.equal(g, w) for g, w in zip(got, want) if isinstance(g, torch.Tensor))
        row = {
            "op": spec.name,
            "shape": list(shape),
            "dtype": "bfloat16",
            "kernels": [kernel.fn.__name__ for kernel, *_ in launches],
            "eager_us": per_call_us(eager),
            "dispatcher_us": per_call_us(dispatcher),
            "bare_us": per_call_us(bare),
            "reference_us": per_call_us(reference),
            "same_output": same_output,
            "planned": any(type(p) is Plan for p in fused.plans.values()),
        }
        row["ratio"] = row["eager_us"] / row["bare_us"]
        if timer is not None:
            row["gpu_us"] = graph_replay_time(eager, timer) * 1e3
        if profile:
            row["profile"] = profile_text(eager)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--ops", default="", help="comma-separated op names (default: every op with example inputs)")
    p.add_argument(
        "--profile",
        default="rmsnorm,attention,norm_modulate",
        help="ops whose eager call is also profiled (cProfile, printed and kept in the JSON)",
    )
    args = p.parse_args(argv)
    from cases import OPS

    wanted = {n for n in args.ops.split(",") if n}
    profiled = {n for n in args.profile.split(",") if n}
    specs = [s for s in OPS if s.make_inputs is not None and (not wanted or s.name in wanted)]
    env = environment()
    timer = make_timer(quick=True)
    log(
        f"{env['gpu']} | torch {env['torch']} | triton {env['triton']} | shape {OVERHEAD_SHAPE} bf16, "
        f"host us per call (median of {ROUNDS} x {CALLS} calls)"
    )
    log(f"{'op':34s} {'eager':>7s} {'disp.':>7s} {'bare':>7s} {'ratio':>6s} {'ref.':>7s} {'gpu':>6s}  kernels")
    rows, status = [], 0
    for spec in specs:
        try:
            row = measure(spec, timer=timer, profile=spec.name in profiled)
        except Exception as e:  # noqa: BLE001 (one op's failure is a result; the rest still run)
            rows.append({"op": spec.name, "error": f"{type(e).__name__}: {e}"[:500]})
            log(f"{spec.name:34s} error: {rows[-1]['error'][:200]}")
            status = 1
            continue
        rows.append(row)
        log(
            f"{spec.name:34s} {row['eager_us']:7.1f} {row['dispatcher_us']:7.1f} {row['bare_us']:7.1f} "
            f"{row['ratio']:6.2f} {row['reference_us']:7.1f} {row.get('gpu_us', float('nan')):6.1f}  "
            f"{len(row['kernels'])} {'planned' if row['planned'] else 'body'} "
            f"{'' if row['same_output'] else 'OUTPUT DIFFERS'}"
        )
        if "profile" in row:
            log(row["profile"])
    log(f"wrote {write_results(args.out, 'host', env, rows)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
