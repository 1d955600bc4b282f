"""Benchmark runner: every registry op at DiT shapes, fused against native PyTorch and peers.

    python bench/run.py [--ops rmsnorm,layernorm] [--quick] [--out bench/results]

On a CUDA machine it writes ``<out>/<gpu>.json`` (e.g. ``bench/results/h100.json``),
prints the table (``bench/report.py``) and writes ``<out>/<gpu>.png``. Without
CUDA it runs the CPU demo (``bench/demo.py``) instead and exits with its status.

Method (shared/DESIGN.md, "Benchmarks"):
- bf16 inputs from ``OpSpec.make_inputs`` at ``OpSpec.bench_shapes``, all larger
  than L2; ``triton.testing.do_bench`` median, which also flushes L2 between runs.
- Providers: ``native_eager`` (the pure-PyTorch reference, the composite an
  uncompiled model runs), ``native_compiled`` (it under ``torch.compile``),
  ``fused_eager`` (``torch.ops.fused.<op>``), ``fused_compiled`` (it under
  ``torch.compile(fullgraph=True)``), and the peers in ``bench/<family>.py``.
- Bytes, from the tensors themselves: forward = inputs read once + outputs
  written once; forward+backward adds the output gradients read, the input
  gradients written and the differentiable inputs read again (5 tensor passes
  for rmsnorm; 4 for a rotation, whose backward does not read its inputs).
  The same count serves every provider of a row, so GB/s compare like time
  does, and is also given as % of the measured device copy bandwidth.
"""
import argparse
import datetime
import functools
import importlib
import importlib.metadata
import json
import os
import re
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

#: The device copy that sets the roofline: 2 GiB, far past any L2.
COPY_BYTES = 2 * 1024**3
#: do_bench (warmup, rep) in milliseconds of run time, full and --quick.
TIMING = {False: (25, 200), True: (5, 25)}
#: Shape and call count of the eager-overhead probe: small enough that the
#: kernel takes a few microseconds and the host-side cost of a call shows.
OVERHEAD_SHAPE = (1, 64, 3072)
OVERHEAD_CALLS = 2000
#: Providers every op gets, in table order; peers follow.
CORE_PROVIDERS = ("fused_eager", "fused_compiled", "native_eager", "native_compiled")


# ---------------------------------------------------------------- helpers

def _log(msg: str) -> None:
    print(msg, flush=True)


def gpu_slug(name: str) -> str:
    """A file stem for a GPU name: "NVIDIA H100 80GB HBM3" -> "h100",
    "NVIDIA A100-SXM4-80GB" -> "a100", "NVIDIA GeForce RTX 4090" -> "rtx4090"."""
    vendor = {"nvidia", "geforce", "tesla", "quadro", "amd", "radeon", "instinct"}
    words = [w for w in re.split(r"[\s_]+", name.lower()) if w and w not in vendor]
    if not words:
        return "gpu"
    stem = words[0].split("-")[0]
    if stem.isalpha() and len(words) > 1:  # a product line before the model: "rtx 4090"
        stem += words[1].split("-")[0]
    return re.sub(r"[^a-z0-9]+", "", stem) or "gpu"


def shape_str(shape) -> str:
    return "x".join(str(d) for d in shape)


def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _tensors(values) -> list:
    return [v for v in values if isinstance(v, torch.Tensor)]


def _error(exc: BaseException) -> str:
    # Compile errors run to pages; their cause is in the first lines.
    return f"{type(exc).__name__}: {exc}".strip()[:500]


def make_timer(quick: bool):
    """``timer(fn) -> ms``: median of ``triton.testing.do_bench`` (L2 flushed between runs)."""
    from triton.testing import do_bench

    warmup, rep = TIMING[quick]

    def timer(fn):
        return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")

    return timer


def warm_up_gpu(seconds: float = 8.0) -> None:
    """Keep the GPU busy before timing: on a freshly started machine, timings of
    the same kernel in the first minutes spread by up to 2x (bench/notes.md)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def copy_bandwidth_TBps(timer) -> float:
    """Device-to-device copy bandwidth in TB/s, counting bytes read and written."""
    src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    moved = src.nbytes + dst.nbytes
    src = dst = None  # give the 4 GiB back before the op benchmarks
    torch.cuda.empty_cache()
    return moved / (ms * 1e-3) / 1e12


def environment() -> dict:
    """GPU and software versions recorded with the results."""
    import triton

    try:
        liger = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        liger = None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "liger": liger,
    }


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

def bytes_model(args, outs, backward_reads_inputs: bool = True) -> tuple:
    """``(forward bytes, forward+backward bytes)`` from the actual tensors (see
    module docstring); a rotation's backward does not read its inputs again."""
    inputs = _tensors(args)
    outputs = _tensors(outs)
    fwd = sum(t.nbytes for t in inputs) + sum(t.nbytes for t in outputs)
    grad_outputs = sum(t.nbytes for t in outputs if t.is_floating_point())
    differentiable = sum(t.nbytes for t in inputs if t.requires_grad)
    # Input gradients written, and the inputs read again by the backward.
    return fwd, fwd + grad_outputs + (2 if backward_reads_inputs else 1) * differentiable


def graph_replay_time(fn, timer) -> float:
    """ms per replay of a CUDA graph holding one call of ``fn``: the GPU time of
    the kernels without the host-side cost of launching them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture stream, as torch.cuda.graphs requires
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timer(graph.replay)


def _training_step(fn, args):
    """A forward+backward step: backward of every float output with a fixed
    random gradient; input ``.grad`` is set to None so nothing accumulates."""
    leaves = [a for a in _tensors(args) if a.requires_grad]
    outs = _as_tuple(fn(*args))
    # Outputs that carry gradients: not integer ones, nor statistics an op marks
    # non-differentiable (fused.norm_modulate's mean and rstd).
    float_idx = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
    grads = [torch.randn_like(outs[i]) for i in float_idx]
    del outs

    def step():
        outs = _as_tuple(fn(*args))
        torch.autograd.backward([outs[i] for i in float_idx], grads)
        for a in leaves:
            a.grad = None

    step()  # compile the backward outside the timing
    return step


def time_forward(fn, args, timer, graph: bool = False) -> float:
    """Forward time in ms, under ``torch.no_grad`` (no autograd graph is recorded);
    with ``graph``, of CUDA-graph replays of the call."""
    with torch.no_grad():
        fn(*args)  # compile and autotune outside the timing
        call = lambda: fn(*args)  # noqa: E731
        return graph_replay_time(call, timer) if graph else timer(call)


def time_forward_backward(fn, args, timer, graph: bool = False) -> float:
    """Forward+backward time in ms of :func:`_training_step`; with ``graph``, of
    CUDA-graph replays of it."""
    step = _training_step(fn, args)
    return graph_replay_time(step, timer) if graph else timer(step)


class Progress:
    """``[i/total]`` prefixed lines, flushed as each measurement ends."""

    def __init__(self, total: int):
        self.total, self.done = total, 0

    def __call__(self, msg: str) -> None:
        self.done += 1
        width = len(str(self.total))
        _log(f"[{self.done:>{width}}/{self.total}] {msg}")


def bench_shape(spec, shape, providers: dict, timer, copy_TBps: float, progress: Progress,
                dtype=torch.bfloat16, device="cuda") -> list:
    """One row per provider for ``spec`` at ``shape``: forward and forward+backward
    µs, GB/s and % of copy bandwidth. A provider that raises gets an ``error``
    string and the others still run."""
    args = spec.make_inputs(shape, dtype, device, requires_grad=True)
    with torch.no_grad():
        fwd_bytes, fwdbwd_bytes = bytes_model(args, _as_tuple(spec.reference(*args)), spec.backward_reads_inputs)
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
                errors.append(f"{label}: {_error(e)}")
                progress(f"{where} FAILED {errors[-1].splitlines()[0][:160]}")
                for a in _tensors(args):
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


def run_cuda(args) -> int:
    """The GPU benchmark; returns 1 when a fused provider failed, else 0."""
    from bench import report

    specs = select_specs(args.ops)
    peers = load_peers(s.family for s in specs)
    timer = make_timer(args.quick)
    env = environment()
    _log(f"{env['gpu']} ({env['sms']} SMs) | torch {env['torch']} | triton {env['triton']} | "
         f"CUDA {env['cuda']} | liger {env['liger']}" + (" | --quick" if args.quick else ""))
    torch.manual_seed(0)
    warm_up_gpu()
    copy_TBps = copy_bandwidth_TBps(timer)
    _log(f"device-to-device copy: {copy_TBps:.3f} TB/s (read+write)")

    plan = [(spec, tuple(shape)) for spec in specs
            for shape in (spec.bench_shapes[:1] if args.quick else spec.bench_shapes)]
    progress = Progress(sum(2 * (len(CORE_PROVIDERS) + len(peers.get(spec.name, {}))) for spec, _ in plan))
    rows = []
    for spec, shape in plan:
        torch._dynamo.reset()  # a fresh, shape-specialized compile per shape
        try:
            rows += bench_shape(spec, shape, make_providers(spec, peers), timer, copy_TBps, progress)
        except Exception as e:  # noqa: BLE001 (inputs failed to build: note it, go on)
            traceback.print_exc()
            rows.append({"op": spec.name, "shape": list(shape), "provider": "*", "error": _error(e)})
        torch.cuda.empty_cache()

    overhead = None
    if any(spec.name == "rmsnorm" for spec in specs):
        try:
            overhead = eager_overhead()
            _log(f"eager overhead at {shape_str(OVERHEAD_SHAPE)}: fused.rmsnorm {overhead['fused_op_us']:.1f} us "
                 f"per call, bare Triton launch {overhead['bare_triton_us']:.1f} us "
                 f"(x{overhead['ratio']:.2f}; same output: {overhead['same_output']})")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            overhead = {"error": _error(e)}

    for r in rows:
        r["date"] = env["date"]
    data = {"env": env, "copy_TBps": copy_TBps, "quick": bool(args.quick),
            "timing_ms": dict(zip(("warmup", "rep"), TIMING[bool(args.quick)])),
            "rows": rows, "overhead": overhead}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, gpu_slug(env["gpu"]))
    if args.merge and os.path.exists(stem + ".json"):
        data = merge_runs(report.load(stem + ".json"), data)
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1)
    _log(f"wrote {stem}.json")
    print(report.format_table(data), flush=True)
    if report.plot(stem + ".json", stem + ".png"):
        _log(f"wrote {stem}.png")

    # Peers may fail (an old Liger, a missing kernel); our own ops may not.
    failed = [r for r in rows if "error" in r and r["provider"] in ("fused_eager", "fused_compiled", "*")]
    for r in rows:
        if "error" in r:
            _log(f"error: {r['op']} {shape_str(r['shape'])} {r['provider']}: {r['error'][:300]}")
    return 1 if failed else 0


def sweep_times(spec, args, configs, configure, timer, rounds: int = 3) -> dict:
    """``{(kind, config): median ms}`` for kind "fwd" and "fwdbwd", timed as CUDA
    graph replays of the forward and of the whole training step, in
    ``rounds`` interleaved rounds (so that clock drift spreads over every
    config). ``configure(config)`` is a context manager that makes the op
    launch with ``config``; a config that fails to compile times as NaN."""
    import statistics

    times = {(kind, config): [] for kind in ("fwd", "fwdbwd") for config in configs}
    for _ in range(rounds):
        for kind, config in times:
            try:
                with configure(config):
                    if kind == "fwd":
                        with torch.no_grad():
                            ms = graph_replay_time(functools.partial(spec.op, *args), timer)
                    else:
                        ms = time_forward_backward(spec.op, args, timer, graph=True)
            except Exception as e:  # noqa: BLE001 (a config that fails is a result)
                _log(f"{spec.name} {kind} {config}: {_error(e)[:200]}")
                ms = float("nan")
            times[(kind, config)].append(ms)
    return {key: statistics.median(ts) for key, ts in times.items()}


def module_config(module, *names):
    """A ``configure`` for :func:`run_sweep` that sets the launch-config globals
    ``module.<names>`` to a config's values while it is timed."""
    import contextlib

    @contextlib.contextmanager
    def configure(config):
        saved = [getattr(module, n) for n in names]
        for n, v in zip(names, config):
            setattr(module, n, v)
        try:
            yield
        finally:
            for n, v in zip(names, saved):
                setattr(module, n, v)

    return configure


def run_sweep(out_path, ops, shapes, configs, configure, fields, default_ops, default_configs) -> list:
    """The launch-config sweep of ``bench/sweep_<family>.py``: every op of
    ``ops`` (comma-separated, else ``default_ops``) at every shape, bf16, timed
    by :func:`sweep_times` under each config (``"a/b/c,..."``, else
    ``default_configs``); ``fields`` names a config's values in the rows.
    Prints one line per measurement and writes the rows with :func:`write_sweep`."""
    import itertools

    from compile_ops import registry

    ops = ops.split(",") if ops else default_ops
    configs = [tuple(int(v) for v in c.split("/")) for c in configs.split(",")] if configs else default_configs
    timer = make_timer(quick=False)
    warm_up_gpu()
    results = []
    for name, shape in itertools.product(ops, shapes):
        spec = registry.BY_NAME[name]
        args = spec.make_inputs(shape, torch.bfloat16, "cuda", True)
        with torch.no_grad():
            fwd_bytes, fwdbwd_bytes = bytes_model(args, spec.reference(*args), spec.backward_reads_inputs)
        for (kind, config), ms in sweep_times(spec, args, configs, configure, timer).items():
            gbps = (fwd_bytes if kind == "fwd" else fwdbwd_bytes) / (ms * 1e-3) / 1e9
            results.append({"op": name, "shape": list(shape), "kind": kind, **dict(zip(fields, config)),
                            "ms": ms, "GBps": gbps})
            described = " ".join(f"{f} {v}" for f, v in zip(fields, config))
            _log(f"{name:<13} {shape_str(shape):<14} {kind:<7} {described}: {ms * 1e3:8.1f} us {gbps:7.0f} GB/s")
    write_sweep(out_path, results)
    return results


def results_path(out_dir: str, stem: str, env: dict) -> str:
    """``<out_dir>/<stem>-<gpu>.json``: where a runner's results go."""
    return os.path.join(out_dir, f"{stem}-{gpu_slug(env['gpu'])}.json")


def write_results(out_dir: str, stem: str, env: dict, rows: list) -> str:
    """A runner's rows with the GPU and versions, at :func:`results_path`; returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = results_path(out_dir, stem, env)
    with open(path, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    return path


def write_sweep(out_path, rows: list) -> None:
    """A sweep script's rows as JSON with the GPU and versions (no-op without a path)."""
    if out_path:
        import triton

        with open(out_path, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)


def merge_runs(old: dict, new: dict) -> dict:
    """``old`` with the ops that ``new`` measured replaced by ``new``'s rows (each
    op's providers, peers included, still come from one run). Refused across
    GPUs or versions; the runs' dates and copy bandwidths are kept."""
    keys = ("gpu", "torch", "triton", "cuda", "liger")
    if any(old["env"].get(k) != new["env"].get(k) for k in keys):
        raise SystemExit(f"run.py --merge: {[old['env'].get(k) for k in keys]} != "
                         f"{[new['env'].get(k) for k in keys]}; run every op instead")
    measured = {r["op"] for r in new["rows"]}
    old_date = old["env"].get("date")
    kept = [dict(r, date=r.get("date", old_date)) for r in old["rows"] if r["op"] not in measured]
    runs = {r["date"]: None for r in kept + new["rows"]}
    copies = dict(old.get("copy_TBps_by_run", {old_date: old["copy_TBps"]}))
    copies[new["env"]["date"]] = new["copy_TBps"]
    return dict(new, rows=kept + new["rows"], overhead=new["overhead"] or old.get("overhead"),
                runs=sorted(runs), copy_TBps_by_run={d: copies[d] for d in sorted(runs) if d in copies})


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="", help="comma-separated op names (default: every op with bench shapes)")
    p.add_argument("--quick", action="store_true", help="one shape per op and short timing runs (smoke test)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"),
                   help="directory for <gpu>.json and <gpu>.png (default: bench/results)")
    p.add_argument("--merge", action="store_true",
                   help="keep the other ops' rows of an existing <gpu>.json (same GPU and versions)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Entry point: the GPU benchmark, or the CPU demo where there is no CUDA device."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        _log("run.py: no CUDA device here, so no benchmark; running the CPU demo (bench/demo.py) instead.")
        from bench import demo
        return demo.main()
    status = run_cuda(args)
    if not args.ops:  # a full run: attention too, which bench/attention.py measures in TFLOP/s
        from bench import attention

        quick = ["--quick"] if args.quick else []
        for causal in ([], ["--causal", "--shapes", "1x24x4608x128,1x12x32760x128"]):
            status |= attention.main(["--out", args.out] + quick + causal)
        from bench import block_sparse

        status |= block_sparse.main(["--out", args.out] + quick)
        try:
            import diffusers  # noqa: F401  (the optional extra)
        except ImportError:
            _log("run.py: diffusers is not installed (pip install -e '.[diffusers]'): no end-to-end models")
        else:
            from bench import diffusers_e2e

            status |= diffusers_e2e.main(["--out", args.out])
        if torch.cuda.device_count() >= 2:
            from bench import distributed_train

            status |= distributed_train.main(["--out", args.out, "--gpus", "2"])
        else:
            _log("run.py: one GPU here: no FSDP2 / heads-sharded run (bench/distributed_train.py needs 2)")
    return status


if __name__ == "__main__":
    sys.exit(main())
