"""Op benchmark: every registry op at DiT shapes, fused against native PyTorch and peers.

Run by ``python bench/run.py --full`` (every op) or ``--ops rmsnorm,layernorm``
[``--quick``] [``--out bench/results``] [``--merge``] on a CUDA machine
(:func:`run`); writes ``<out>/<gpu>.json`` (e.g. ``bench/results/h100.json``),
logs the table (``bench/report.py``) and writes ``<out>/<gpu>.png``.

Method (docs/design.md, "Benchmarks"):
- bf16 inputs from ``OpSpec.make_inputs`` at ``OpSpec.bench_shapes``, all larger
  than L2; ``triton.testing.do_bench`` median, which also flushes L2 between runs.
- Providers: ``native_eager`` (the pure-PyTorch reference, the composite an
  uncompiled model runs), ``native_compiled`` (it under ``torch.compile``),
  ``fused_eager`` (``torch.ops.fused.<op>``), ``fused_compiled`` (it under
  ``torch.compile(fullgraph=True)``), and the peers in ``bench/peers/<family>.py``.
- Bytes, from the tensors themselves (``bench.toolkit.bytes_model``): forward =
  inputs read once + outputs written once; forward+backward adds the output
  gradients read, the input gradients written and the differentiable inputs
  read again (5 tensor passes for rmsnorm; 4 for a rotation, whose backward
  does not read its inputs). The same count serves every provider of a row, so
  GB/s compare like time does, and is also given as % of the measured device
  copy bandwidth.
"""

import importlib
import json
import os
import traceback

import torch

from bench import report
from bench.toolkit import (
    KIND_LABELS,
    KINDS,
    TIMING,
    Progress,
    as_tuple,
    bytes_model,
    copy_bandwidth_TBps,
    environment,
    error_text,
    gpu_slug,
    log,
    make_timer,
    merge_runs,
    shape_str,
    tensors_of,
    time_forward,
    time_forward_backward,
    warm_up_gpu,
)

#: Providers every op gets, in table order; peers follow.
CORE_PROVIDERS = ("fused_eager", "fused_compiled", "native_eager", "native_compiled")


# ---------------------------------------------------------------- providers


def load_peers(families) -> dict:
    """``{op_name: {provider: fn}}`` merged from ``bench/peers/<family>.py`` (``PEERS``) for each family."""
    peers = {}
    for family in sorted(set(families)):
        module_name = f"bench.peers.{family}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:  # the peer module exists but an import inside it failed
                raise
            continue
        for op_name, providers in getattr(module, "PEERS", {}).items():
            peers.setdefault(op_name, {}).update(providers)
    return peers


def make_providers(spec, peers: dict) -> dict:
    """``{provider: fn(*args)}`` for one op: the four core providers, then its peers.

    Built fresh after ``torch._dynamo.reset()`` for every shape, so each compiled
    provider is specialized to that one shape, as in a model that runs it.
    """
    op = spec.op

    def fused(*args):
        return op(*args)

    providers = {
        "fused_eager": op,
        "fused_compiled": torch.compile(fused, fullgraph=True),
        "native_eager": spec.reference,
        "native_compiled": torch.compile(spec.reference),
    }
    providers.update(peers.get(spec.name, {}))
    return providers


# ---------------------------------------------------------------- measurement

#: How each timing kind is measured: (function, graph replay).
_MEASURES = {
    "fwd": (time_forward, False),
    "fwdbwd": (time_forward_backward, False),
    "fwd_graph": (time_forward, True),
    "fwdbwd_graph": (time_forward_backward, True),
}


def kinds_of(spec, kinds=KINDS) -> list:
    """The timing kinds measured for ``spec``: ``kinds`` less the backward ones
    for an op that is not differentiable (an FP8 output mode)."""
    return [k for k in kinds if spec.differentiable or not k.startswith("fwdbwd")]


def measurement_count(plan, provider_count: dict, kinds=KINDS) -> int:
    """How many timings :func:`bench_shape` makes over ``plan`` (``[(spec, shape)]``)
    with ``provider_count[op name]`` providers per op: the progress total."""
    return sum(provider_count[spec.name] * len(kinds_of(spec, kinds)) for spec, _ in plan)


def bench_shape(
    spec,
    shape,
    providers: dict,
    timer,
    copy_TBps: float,
    progress: Progress,
    dtype=torch.bfloat16,
    device="cuda",
    kinds=KINDS,
) -> list:
    """One row per provider for ``spec`` at ``shape``: for each timing kind of
    ``kinds`` (:func:`kinds_of`), µs, GB/s and % of copy bandwidth (None where
    not measured). A provider that raises gets an ``error`` string and the
    others still run. Each timing is one ``progress`` step, failed or not."""
    args = spec.make_inputs(shape, dtype, device, requires_grad=True)
    with torch.no_grad():
        fwd_bytes, fwdbwd_bytes = bytes_model(args, as_tuple(spec.reference(*args)), spec.backward_reads_inputs)
    copy_GBps = copy_TBps * 1e3
    measured = kinds_of(spec, kinds)
    rows = []
    for name, fn in providers.items():
        row = {
            "op": spec.name,
            "shape": list(shape),
            "dtype": str(dtype).replace("torch.", ""),
            "provider": name,
            "fwd_bytes": fwd_bytes,
            "fwdbwd_bytes": fwdbwd_bytes,
        }
        for key in KINDS:
            row[f"{key}_us"] = row[f"{key}_GBps"] = row[f"{key}_pct_copy"] = None
        errors = []
        for key in measured:
            measure, graph = _MEASURES[key]
            nbytes = fwdbwd_bytes if key.startswith("fwdbwd") else fwd_bytes
            where = f"{spec.name} {shape_str(shape)} {name:<22} {KIND_LABELS[key]:<13}"
            try:
                us = measure(fn, args, timer, graph=graph) * 1e3
            except Exception as e:  # noqa: BLE001 (a failing provider is a result too)
                errors.append(f"{KIND_LABELS[key]}: {error_text(e)}")
                progress(f"{where} FAILED {errors[-1].splitlines()[0][:160]}")
                for a in tensors_of(args):
                    a.grad = None
                continue
            gbps = nbytes / (us * 1e-6) / 1e9
            row[f"{key}_us"], row[f"{key}_GBps"] = us, gbps
            row[f"{key}_pct_copy"] = 100.0 * gbps / copy_GBps
            progress(f"{where} {us:9.1f} us {gbps:7.0f} GB/s {row[f'{key}_pct_copy']:5.1f}% copy")
        if errors:
            row["error"] = " | ".join(errors)
        rows.append(row)
    return rows


# ---------------------------------------------------------------- driver


def select_specs(ops_arg):
    """Registry specs with benchmark shapes, filtered by ``--ops``."""
    from cases import OPS

    specs = [s for s in OPS if s.bench_shapes and s.make_inputs is not None]
    if not ops_arg:
        return specs
    wanted = [n.strip() for n in ops_arg.split(",") if n.strip()]
    known = {s.name for s in specs}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"run.py: unknown or unbenchmarked ops {unknown}; choose from {sorted(known)}")
    return [s for s in specs if s.name in wanted]


def run(ops: str, quick: bool, out: str, merge: bool, screen=None) -> tuple:
    """The op table (``bench/run.py``'s ``--ops``, ``--quick``, ``--out``,
    ``--merge``; ``screen``: where the progress shows, besides the log).
    Returns ``(status, json_path)``: status 1 when a fused provider failed, else 0."""
    specs = select_specs(ops)
    peers = load_peers(s.family for s in specs)
    timer = make_timer(quick)
    env = environment()
    log(
        f"{env['gpu']} ({env['sms']} SMs) | torch {env['torch']} | triton {env['triton']} | "
        f"CUDA {env['cuda']} | liger {env['liger']}" + (" | --quick" if quick else "")
    )
    torch.manual_seed(0)
    warm_up_gpu()
    copy_TBps = copy_bandwidth_TBps(timer)
    log(f"device-to-device copy: {copy_TBps:.3f} TB/s (read+write)")

    plan = [(spec, tuple(shape)) for spec in specs for shape in (spec.bench_shapes[:1] if quick else spec.bench_shapes)]
    provider_count = {spec.name: len(CORE_PROVIDERS) + len(peers.get(spec.name, {})) for spec in specs}
    progress = Progress(measurement_count(plan, provider_count), screen)
    rows = []
    for spec, shape in plan:
        torch._dynamo.reset()  # a fresh, shape-specialized compile per shape
        done = progress.done
        try:
            rows += bench_shape(spec, shape, make_providers(spec, peers), timer, copy_TBps, progress)
        except Exception as e:  # noqa: BLE001 (inputs failed to build: note it, go on)
            traceback.print_exc()
            rows.append({"op": spec.name, "shape": list(shape), "provider": "*", "error": error_text(e)})
            planned = provider_count[spec.name] * len(kinds_of(spec))
            progress.skip(planned - (progress.done - done), f"{spec.name} {shape_str(shape)}: {error_text(e)[:120]}")
        torch.cuda.empty_cache()

    overhead = None
    if any(spec.name == "rmsnorm" for spec in specs):
        try:
            from bench.runners import host

            overhead = host.measure(next(s for s in specs if s.name == "rmsnorm"))
            log(
                f"eager overhead at {shape_str(overhead['shape'])}: fused.rmsnorm {overhead['eager_us']:.1f} us "
                f"per call (through the dispatcher {overhead['dispatcher_us']:.1f}), bare Triton launch "
                f"{overhead['bare_us']:.1f} us (x{overhead['ratio']:.2f}; same output: {overhead['same_output']})"
            )
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            overhead = {"error": error_text(e)}

    for r in rows:
        r["date"] = env["date"]
    data = {
        "env": env,
        "copy_TBps": copy_TBps,
        "quick": bool(quick),
        "timing_ms": dict(zip(("warmup", "rep"), TIMING[bool(quick)])),
        "rows": rows,
        "overhead": overhead,
    }
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, gpu_slug(env["gpu"]))
    if merge and os.path.exists(stem + ".json"):
        data = merge_runs(report.load(stem + ".json"), data)
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1)
    log(f"wrote {stem}.json")
    log(report.format_table(data))
    if report.plot(stem + ".json", stem + ".png"):
        log(f"wrote {stem}.png")

    # Peers may fail (an old Liger, a missing kernel); our own ops may not.
    failed = [r for r in rows if "error" in r and r["provider"] in ("fused_eager", "fused_compiled", "*")]
    for r in rows:
        if "error" in r:
            log(f"error: {r['op']} {shape_str(r['shape'])} {r['provider']}: {r['error'][:300]}")
    return (1 if failed else 0), stem + ".json"
