"""Op benchmark: every registry op at DiT shapes, fused against native PyTorch and peers.

Run by ``python bench/run.py [--ops rmsnorm,layernorm] [--quick] [--out bench/results] [--merge]``
on a CUDA machine (:func:`run`); writes ``<out>/<gpu>.json`` (e.g.
``bench/results/h100.json``), prints the table (``bench/report.py``) and writes
``<out>/<gpu>.png``.

Method (shared/DESIGN.md, "Benchmarks"):
- bf16 inputs from ``OpSpec.make_inputs`` at ``OpSpec.bench_shapes``, all larger
  than L2; ``triton.testing.do_bench`` median, which also flushes L2 between runs.
- Providers: ``native_eager`` (the pure-PyTorch reference, the composite an
  uncompiled model runs), ``native_compiled`` (it under ``torch.compile``),
  ``fused_eager`` (``torch.ops.fused.<op>``), ``fused_compiled`` (it under
  ``torch.compile(fullgraph=True)``), and the peers in ``bench/<family>.py``.
- Bytes, from the tensors themselves (``bench.toolkit.bytes_model``): forward =
  inputs read once + outputs written once; forward+backward adds the output
  gradients read, the input gradients written and the differentiable inputs
  read again (5 tensor passes for rmsnorm; 4 for a rotation, whose backward
  does not read its inputs). The same count serves every provider of a row, so
  GB/s compare like time does, and is also given as % of the measured device
  copy bandwidth.
"""
import functools
import importlib
import json
import os
import time
import traceback

import torch

from bench import report
from bench.toolkit import (TIMING, as_tuple, bytes_model, copy_bandwidth_TBps, environment, error_text, gpu_slug,
                           log, make_timer, merge_runs, shape_str, tensors_of, time_forward, time_forward_backward,
                           warm_up_gpu)

#: Shape and call count of the eager-overhead probe: small enough that the
#: kernel takes a few microseconds and the host-side cost of a call shows.
OVERHEAD_SHAPE = (1, 64, 3072)
OVERHEAD_CALLS = 2000
#: Providers every op gets, in table order; peers follow.
CORE_PROVIDERS = ("fused_eager", "fused_compiled", "native_eager", "native_compiled")


# ---------------------------------------------------------------- providers

def load_peers(families) -> dict:
    """``{op_name: {provider: fn}}`` merged from ``bench/<family>.py`` (``PEERS``) for each family."""
    peers = {}
    for family in sorted(set(families)):
        module_name = f"bench.{family}"
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

class Progress:
    """``[i/total]`` prefixed lines, flushed as each measurement ends."""

    def __init__(self, total: int):
        self.total, self.done = total, 0

    def __call__(self, msg: str) -> None:
        self.done += 1
        width = len(str(self.total))
        log(f"[{self.done:>{width}}/{self.total}] {msg}")


def bench_shape(spec, shape, providers: dict, timer, copy_TBps: float, progress: Progress,
                dtype=torch.bfloat16, device="cuda") -> list:
    """One row per provider for ``spec`` at ``shape``: forward and forward+backward
    µs, GB/s and % of copy bandwidth. A provider that raises gets an ``error``
    string and the others still run."""
    args = spec.make_inputs(shape, dtype, device, requires_grad=True)
    with torch.no_grad():
        fwd_bytes, fwdbwd_bytes = bytes_model(args, as_tuple(spec.reference(*args)), spec.backward_reads_inputs)
    copy_GBps = copy_TBps * 1e3
    rows = []
    for name, fn in providers.items():
        row = {"op": spec.name, "shape": list(shape), "dtype": str(dtype).replace("torch.", ""),
               "provider": name, "fwd_bytes": fwd_bytes, "fwdbwd_bytes": fwdbwd_bytes}
        errors = []
        for key, measure, nbytes, label in (
                ("fwd", time_forward, fwd_bytes, "fwd"),
                ("fwdbwd", time_forward_backward, fwdbwd_bytes, "fwd+bwd"),
                ("fwd_graph", functools.partial(time_forward, graph=True), fwd_bytes, "fwd/graph"),
                ("fwdbwd_graph", functools.partial(time_forward_backward, graph=True), fwdbwd_bytes,
                 "fwd+bwd/graph")):
            row[f"{key}_us"] = row[f"{key}_GBps"] = row[f"{key}_pct_copy"] = None
            where = f"{spec.name} {shape_str(shape)} {name:<22} {label:<13}"
            try:
                us = measure(fn, args, timer) * 1e3
            except Exception as e:  # noqa: BLE001 (a failing provider is a result too)
                errors.append(f"{label}: {error_text(e)}")
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


def eager_overhead(device="cuda", calls: int = OVERHEAD_CALLS, warmup: int = 200) -> dict:
    """Host time per call of ``torch.ops.fused.rmsnorm`` against a bare Triton
    launch of the same kernel with the same arguments, on an input small
    enough that the launch path, not the kernel, sets the time."""
    import triton
    import triton.language as tl

    from compile_ops.kernels.norm import norm_fwd_kernel
    from compile_ops.ops.norm import forward_config

    eps = 1e-6
    x = torch.randn(OVERHEAD_SHAPE, dtype=torch.bfloat16, device=device)
    weight = (1.0 + 0.1 * torch.randn(OVERHEAD_SHAPE[-1], device=device)).to(torch.bfloat16)
    # What ops/norm.py::_launch_forward passes for rmsnorm without residual or
    # bias: rows as a view, the output allocated up front, fp32 statistics.
    x2 = x.reshape(-1, x.shape[-1])
    n_rows, n = x2.shape
    cfg = forward_config(n)
    out = torch.empty_like(x)
    grid = (triton.cdiv(n_rows, cfg.block_m),)

    def bare():
        norm_fwd_kernel[grid](
            x2, None, weight, None, out, None,
            n_rows, n,
            x2.stride(0), x2.stride(1), 0, 0,
            eps,
            IS_RMS=True, HAS_RESIDUAL=False, HAS_WEIGHT=True, HAS_BIAS=False, ACC_DTYPE=tl.float32,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, LOOPED=cfg.looped, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )

    def fused():
        return torch.ops.fused.rmsnorm(x, weight, eps)

    def sync():
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()

    def per_call_us(fn):
        for _ in range(warmup):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        return (time.perf_counter() - t0) / calls * 1e6

    bare()
    # Same kernel, same configuration: the outputs must agree bit for bit, or
    # the probe is not timing what the op launches.
    same_output = torch.equal(fused(), out)
    from compile_ops._library import OP_BODIES

    from torch._library.triton import set_wrap_triton_enabled

    body = OP_BODIES["fused::rmsnorm"]
    fused_us, bare_us = per_call_us(fused), per_call_us(bare)

    # Our Python alone (validation, configs, launch) without torch's dispatcher
    # and autograd layers: splits the overhead between this project and
    # torch.library. Wrapping is off as inside the op's own backend (with it on,
    # a direct call would go through the tracing HOP instead).
    def body_call():
        with set_wrap_triton_enabled(False):
            return body(x, weight, eps)

    body_us = per_call_us(body_call)
    return {"shape": list(OVERHEAD_SHAPE), "calls": calls, "fused_op_us": fused_us,
            "bare_triton_us": bare_us, "op_body_us": body_us, "ratio": fused_us / bare_us,
            "same_output": same_output}


# ---------------------------------------------------------------- driver

def select_specs(ops_arg):
    """Registry specs with benchmark shapes, filtered by ``--ops``."""
    from compile_ops import registry

    specs = [s for s in registry.OPS if s.bench_shapes and s.make_inputs is not None]
    if not ops_arg:
        return specs
    wanted = [n.strip() for n in ops_arg.split(",") if n.strip()]
    known = {s.name for s in specs}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"run.py: unknown or unbenchmarked ops {unknown}; choose from {sorted(known)}")
    return [s for s in specs if s.name in wanted]


def run(ops: str, quick: bool, out: str, merge: bool) -> int:
    """The GPU benchmark (``bench/run.py``'s ``--ops``, ``--quick``, ``--out``,
    ``--merge``); returns 1 when a fused provider failed, else 0."""
    specs = select_specs(ops)
    peers = load_peers(s.family for s in specs)
    timer = make_timer(quick)
    env = environment()
    log(f"{env['gpu']} ({env['sms']} SMs) | torch {env['torch']} | triton {env['triton']} | "
        f"CUDA {env['cuda']} | liger {env['liger']}" + (" | --quick" if quick else ""))
    torch.manual_seed(0)
    warm_up_gpu()
    copy_TBps = copy_bandwidth_TBps(timer)
    log(f"device-to-device copy: {copy_TBps:.3f} TB/s (read+write)")

    plan = [(spec, tuple(shape)) for spec in specs
            for shape in (spec.bench_shapes[:1] if quick else spec.bench_shapes)]
    progress = Progress(sum(2 * (len(CORE_PROVIDERS) + len(peers.get(spec.name, {}))) for spec, _ in plan))
    rows = []
    for spec, shape in plan:
        torch._dynamo.reset()  # a fresh, shape-specialized compile per shape
        try:
            rows += bench_shape(spec, shape, make_providers(spec, peers), timer, copy_TBps, progress)
        except Exception as e:  # noqa: BLE001 (inputs failed to build: note it, go on)
            traceback.print_exc()
            rows.append({"op": spec.name, "shape": list(shape), "provider": "*", "error": error_text(e)})
        torch.cuda.empty_cache()

    overhead = None
    if any(spec.name == "rmsnorm" for spec in specs):
        try:
            overhead = eager_overhead()
            log(f"eager overhead at {shape_str(OVERHEAD_SHAPE)}: fused.rmsnorm {overhead['fused_op_us']:.1f} us "
                f"per call, bare Triton launch {overhead['bare_triton_us']:.1f} us "
                f"(x{overhead['ratio']:.2f}; same output: {overhead['same_output']})")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            overhead = {"error": error_text(e)}

    for r in rows:
        r["date"] = env["date"]
    data = {"env": env, "copy_TBps": copy_TBps, "quick": bool(quick),
            "timing_ms": dict(zip(("warmup", "rep"), TIMING[bool(quick)])),
            "rows": rows, "overhead": overhead}
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, gpu_slug(env["gpu"]))
    if merge and os.path.exists(stem + ".json"):
        data = merge_runs(report.load(stem + ".json"), data)
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1)
    log(f"wrote {stem}.json")
    print(report.format_table(data), flush=True)
    if report.plot(stem + ".json", stem + ".png"):
        log(f"wrote {stem}.png")

    # Peers may fail (an old Liger, a missing kernel); our own ops may not.
    failed = [r for r in rows if "error" in r and r["provider"] in ("fused_eager", "fused_compiled", "*")]
    for r in rows:
        if "error" in r:
            log(f"error: {r['op']} {shape_str(r['shape'])} {r['provider']}: {r['error'][:300]}")
    return 1 if failed else 0
