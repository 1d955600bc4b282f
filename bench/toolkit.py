"""What the benchmark runners share: environment, timing, byte counts, results files, sweeps.

Imported by every runner (``bench/runners/``), sweep (``bench/sweeps/``),
experiment and tool; it imports none of them, and ``bench/run.py`` only
parses arguments and dispatches to the runners, so the imports of ``bench/``
run one way.

- Environment: :func:`environment` (GPU, torch, triton, CUDA, Liger versions),
  :func:`gpu_slug` (the file stem of a GPU name).
- Timing: :func:`warm_up_gpu`, :func:`keep_busy`, :func:`make_timer`
  (``triton.testing.do_bench`` median, L2 flushed), :func:`graph_replay_time`
  (CUDA-graph replays), :func:`time_forward`, :func:`time_forward_backward`,
  :func:`timed_call` (one of :data:`KINDS` as a callable), and the roofs: the
  device copy bandwidth (:func:`copy_bandwidth_TBps`) and a large bf16
  matmul's rate (:func:`matmul_TFLOPs`).
- Bytes: :func:`bytes_model`.
- Results: :func:`results_path`, :func:`write_results`, :func:`write_sweep`,
  :func:`merge_runs`.
- Launch-config sweeps: :func:`run_sweep`, :func:`sweep_times`, :func:`module_config`.
- Experiments (``bench/experiments/``): :func:`experiment_parser` (their common
  arguments), :func:`start_experiment` (parsed, timer made, GPU warmed up).
- Output: :class:`Progress` (a counter that ends at its total),
  :func:`output_to` (stdout and stderr into a log file), :func:`machine_line`.
- Small helpers: :func:`log`, :func:`shape_str`, :func:`error_text`,
  :func:`as_tuple`, :func:`tensors_of`.
"""

import argparse
import contextlib
import datetime
import functools
import importlib.metadata
import io
import json
import os
import re
import subprocess
import sys
import time

import torch

#: The device copy that sets the roofline: 2 GiB, far past any L2.
COPY_BYTES = 2 * 1024**3
#: do_bench (warmup, rep) in milliseconds of run time, full and --quick.
TIMING = {False: (25, 200), True: (5, 25)}
#: The ways a runner times a call: the forward alone or the training step (forward+backward),
#: as plain calls (host launch cost included) or as CUDA-graph replays (the kernels' own time).
KINDS = ("fwd", "fwdbwd", "fwd_graph", "fwdbwd_graph")
#: How a kind reads in logs and summaries.
KIND_LABELS = {"fwd": "fwd", "fwdbwd": "fwd+bwd", "fwd_graph": "fwd/graph", "fwdbwd_graph": "fwd+bwd/graph"}


# ---------------------------------------------------------------- small helpers


def log(msg: str) -> None:
    print(msg, flush=True)


def shape_str(shape) -> str:
    return "x".join(str(d) for d in shape)


def as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def tensors_of(values) -> list:
    return [v for v in values if isinstance(v, torch.Tensor)]


def error_text(exc: BaseException) -> str:
    # Compile errors run to pages; their cause is in the first lines.
    return f"{type(exc).__name__}: {exc}".strip()[:500]


# ---------------------------------------------------------------- environment


def relative_l2(got, want) -> float:
    """``|got - want| / |want|`` (L2 over all elements, in fp64): how the
    runners report an approximate result's distance to the exact one."""
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp(min=1e-300)).item()


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


def machine_line(env: dict) -> str:
    """One line naming the GPU and the versions of :func:`environment`'s ``env``."""
    return f"{env['gpu']} ({env['sms']} SMs) | torch {env['torch']} | triton {env['triton']} | CUDA {env.get('cuda')}"


# ---------------------------------------------------------------- progress and output


class Progress:
    """A counter of the measurements of a run: each :meth:`step` logs
    ``[done/total] msg`` (to the log, where :func:`output_to` sends stdout) and,
    given a ``screen``, shows the count there: one line per step for short
    runs or on a terminal, else one line per tenth of the total.

    ``total`` must be counted from the plan that is run, and work that cannot
    run is counted by :meth:`skip`, so that the count ends at its total.
    """

    def __init__(self, total: int, screen=None, every_step: bool = False):
        self.total, self.done, self.screen = total, 0, screen
        self.every_step = every_step or total <= 30
        self._shown_tenths = 0

    def __call__(self, msg: str) -> None:
        self.step(msg)

    def step(self, msg: str, count: int = 1) -> None:
        """``count`` measurements done; ``msg`` says which."""
        self.done += count
        width = len(str(self.total))
        line = f"[{self.done:>{width}}/{self.total}] {msg}"
        log(line)
        if self.screen is None:
            return
        tenths = 10 * self.done // max(self.total, 1)
        if self.every_step or tenths > self._shown_tenths or self.done == self.total:
            self._shown_tenths = tenths
            self.screen.write(line[:160] + "\n")
            self.screen.flush()

    def skip(self, count: int, why: str) -> None:
        """``count`` planned measurements that will not run (a failed input, the time budget)."""
        if count:
            self.step(f"skipped {count}: {why}", count)


@contextlib.contextmanager
def output_to(log_path: str, echo: bool = False):
    """Send stdout and stderr, this process's (``sys.stdout``, ``sys.stderr``
    and file descriptors 1 and 2) and its children's, to ``log_path``
    (appended); with ``echo``, to the screen as well. Yields a text stream
    that still writes to the screen."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    saved_out, saved_err = os.dup(1), os.dup(2)
    screen = os.fdopen(os.dup(1), "w", buffering=1)
    tee = None
    if echo:  # a tee child copies everything to the log and to the screen
        tee = subprocess.Popen(["tee", "-a", log_path], stdin=subprocess.PIPE, stdout=saved_out)
        target = io.TextIOWrapper(tee.stdin, line_buffering=True)
    else:
        target = open(log_path, "a", buffering=1)
    os.dup2(target.fileno(), 1)
    os.dup2(target.fileno(), 2)
    try:
        with contextlib.redirect_stdout(target), contextlib.redirect_stderr(target):
            yield screen
    finally:
        target.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        target.close()
        if tee is not None:
            tee.wait()
        os.close(saved_out)
        os.close(saved_err)
        screen.close()


# ---------------------------------------------------------------- timing


def make_timer(quick: bool):
    """``timer(fn) -> ms``: median of ``triton.testing.do_bench`` (L2 flushed between runs)."""
    from triton.testing import do_bench

    warmup, rep = TIMING[quick]

    def timer(fn):
        return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")

    return timer


def warm_up_gpu(seconds: float = 8.0) -> None:
    """Keep the GPU busy before timing: on a freshly started machine, timings of
    the same kernel in the first minutes spread widely (docs/notes/method.md)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def experiment_parser(doc: str, **options: str) -> argparse.ArgumentParser:
    """The arguments a GPU experiment takes, described by the first line of its
    ``doc``: ``out`` (the JSON file it writes), a string option per item of
    ``options`` (``shapes="4608x24"`` adds ``--shapes`` with that default) and
    ``--rounds`` (its alternated timing rounds, 3). The caller may add more."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("out", help="the JSON file the rows go to")
    for name, default in options.items():
        parser.add_argument(f"--{name.replace('_', '-')}", default=default)
    parser.add_argument("--rounds", type=int, default=3)
    return parser


def start_experiment(parser: argparse.ArgumentParser, argv=None) -> tuple:
    """``(args, timer)``: ``parser``'s arguments from ``argv``, a
    :func:`make_timer` timer, and the GPU kept busy first (:func:`warm_up_gpu`)."""
    args = parser.parse_args(argv)
    timer = make_timer(False)
    warm_up_gpu()
    return args, timer


def keep_busy(fn, seconds: float) -> None:
    """Call ``fn`` for about ``seconds`` (at least twice), then synchronize: a
    call timed right after the GPU sat idle (while the next provider compiled,
    or inputs were made) runs slower at long shapes."""
    start = time.perf_counter()
    calls = 0
    while calls < 2 or time.perf_counter() - start < seconds:
        fn()
        calls += 1
        if calls % 8 == 0:
            torch.cuda.synchronize()  # keep the host from queueing seconds ahead
    torch.cuda.synchronize()


def matmul_TFLOPs(timer, n: int = 8192) -> float:
    """The rate of an ``n x n x n`` bf16 matmul in TFLOP/s: the compute roof
    that attention's share is given against."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    ms = timer(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def copy_bandwidth_TBps(timer) -> float:
    """Device-to-device copy bandwidth in TB/s, counting bytes read and written."""
    src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    moved = src.nbytes + dst.nbytes
    src = dst = None  # give the 4 GiB back before the op benchmarks
    torch.cuda.empty_cache()
    return moved / (ms * 1e-3) / 1e12


def captured_graph(fn, warmups: int = 3):
    """``replay()`` of a CUDA graph holding one call of ``fn`` (warmed up
    ``warmups`` times off the capture stream first, as torch.cuda.graphs
    requires); the bound method keeps the graph alive."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def graph_replay_time(fn, timer) -> float:
    """ms per replay of a CUDA graph holding one call of ``fn``: the GPU time of
    the kernels without the host-side cost of launching them."""
    return timer(captured_graph(fn))


def replay_rounds(providers: dict, args: tuple, rounds: int, timer):
    """``(round, name, ms)`` for every ``{name: fn}`` of ``providers``, ``fn(*args)``
    timed without autograd as a CUDA-graph replay (:func:`graph_replay_time`), in
    ``rounds`` interleaved rounds (clock drift spreads over every provider)."""
    for rnd in range(rounds):
        for name, fn in providers.items():

            def forward(fn=fn):
                with torch.no_grad():
                    fn(*args)

            yield rnd, name, graph_replay_time(forward, timer)


def random_fp8_rows(*shape: int) -> tuple:
    """``(codes [*shape] float8_e4m3fn, scales [*shape[:-1]] fp32)`` on the GPU, drawn
    from the current seed: codes over e4m3's range, scales in [1e-3, 1.1e-2). Rows
    (or weights) to time FP8 GEMMs with, as ``FP8Rows`` or an FP8Linear's buffers."""
    codes = (torch.randn(*shape, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes, torch.rand(*shape[:-1], device="cuda") / 100 + 1e-3


def gemm_round_rows(providers: dict, flops: int, rounds: int, timer, **fields) -> list:
    """:func:`replay_rounds` of ``providers`` (no arguments) as rows: ``fields``, the
    provider, round, ms and TFLOP/s (``flops`` a call), each also printed."""
    rows = []
    for rnd, name, ms in replay_rounds(providers, (), rounds, timer):
        tflops = flops / (ms * 1e-3) / 1e12
        rows.append(dict(fields, provider=name, round=rnd, ms=ms, TFLOPs=tflops))
        print(f"{fields.get('case', '')} r{rnd} {name} {ms:.4f} ms {tflops:7.1f} TFLOP/s", flush=True)
    return rows


#: Kernel families of a model step's profile, by kernel name (first match wins).
KERNEL_FAMILIES = (
    ("gemm", r"gemm|nvjet|xmma|cutlass|cublas|_scaled_mm|sm90_.*_tn|splitK"),
    ("attention", r"flash|fmha|cudnn|attn|sdpa"),
    ("collective", r"nccl|all_?to_?all|all_?gather|all_?reduce|reduce_?scatter"),
    (
        "compile_ops",
        r"^_?(rms|layer|norm|modulate|gated|rope|qk_norm|geglu|swiglu|glu|quantize|fp8|lora|kv8|column_sum|moe_|sort_block)",
    ),
    ("inductor", r"^triton_"),
)


def kernel_family(name: str) -> str:
    """The :data:`KERNEL_FAMILIES` family of a kernel's name, else "other"."""
    import re

    return next((family for family, pattern in KERNEL_FAMILIES if re.search(pattern, name, re.I)), "other")


def kernel_profile(fn, calls: int = 3, top: int = 12) -> dict:
    """Where one call of ``fn`` spends its GPU time: ``torch.profiler`` over
    ``calls`` calls (after one unrecorded), the kernels' device time per call
    by family (:data:`KERNEL_FAMILIES`, else "other") and the ``top`` kernels
    by time, as ``{"gpu_ms", "families": {family: ms}, "top": [[name, ms, launches]]}``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith("Memcpy"):
            ms, launches = kernels.get(event.name, (0.0, 0))
            kernels[event.name] = (ms + event.device_time / 1e3 / calls, launches + 1)
    families = {}
    for name, (ms, _) in kernels.items():
        family = kernel_family(name)
        families[family] = families.get(family, 0.0) + ms
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "gpu_ms": sum(ms for ms, _ in kernels.values()),
        "families": dict(sorted(families.items())),
        "top": [[name[:120], ms, launches // calls] for name, (ms, launches) in ranked],
    }


def _training_step(fn, args):
    """A forward+backward step: backward of every float output with a fixed
    random gradient; input ``.grad`` is set to None so nothing accumulates."""
    leaves = [a for a in tensors_of(args) if a.requires_grad]
    outs = as_tuple(fn(*args))
    # Outputs that carry gradients: not integer ones, nor statistics an op marks
    # non-differentiable (fused.norm_modulate's mean and rstd).
    float_idx = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
    grads = [torch.randn_like(outs[i]) for i in float_idx]
    del outs

    def step():
        outs = as_tuple(fn(*args))
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


# ---------------------------------------------------------------- bytes


def timed_call(fn, args, kind: str):
    """A callable that runs ``fn(*args)`` as timing ``kind`` of :data:`KINDS`
    measures it (compiled and warmed up here, outside any timing): the forward
    under ``torch.no_grad`` or :func:`_training_step`, as plain calls or as the
    replay of a CUDA graph holding one call."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind.startswith("fwdbwd"):
        call = _training_step(fn, args)
    else:

        def call():
            with torch.no_grad():
                return fn(*args)

        call()
    return captured_graph(call) if kind.endswith("_graph") else call


def bytes_model(args, outs, backward_reads_inputs: bool = True) -> tuple:
    """``(forward bytes, forward+backward bytes)`` from the actual tensors.

    Forward = inputs read once + outputs written once; forward+backward adds
    the output gradients read, the input gradients written and the
    differentiable inputs read again (5 tensor passes for rmsnorm; 4 for a
    rotation, whose backward does not read its inputs: ``backward_reads_inputs=False``).
    The same count serves every provider of a row, so GB/s compare like time does.
    """
    inputs = tensors_of(args)
    outputs = tensors_of(outs)
    fwd = sum(t.nbytes for t in inputs) + sum(t.nbytes for t in outputs)
    grad_outputs = sum(t.nbytes for t in outputs if t.is_floating_point())
    differentiable = sum(t.nbytes for t in inputs if t.requires_grad)
    # Input gradients written, and the inputs read again by the backward.
    return fwd, fwd + grad_outputs + (2 if backward_reads_inputs else 1) * differentiable


# ---------------------------------------------------------------- results files


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


def write_rows(out_path: str, rows: list) -> None:
    """An experiment's rows as JSON at ``out_path``, with :func:`environment`
    (GPU, versions, date) beside them, as the runners write theirs."""
    with open(out_path, "w") as f:
        json.dump({"env": environment(), "rows": rows}, f, indent=1)


def write_sweep(out_path, rows: list) -> None:
    """A sweep script's rows as JSON with the GPU and versions (no-op without a path)."""
    if out_path:
        import triton

        with open(out_path, "w") as f:
            json.dump(
                {
                    "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "triton": triton.__version__,
                    "rows": rows,
                },
                f,
                indent=1,
            )


def merge_runs(old: dict, new: dict) -> dict:
    """``old`` with the ops that ``new`` measured replaced by ``new``'s rows (each
    op's providers, peers included, still come from one run). Refused across
    GPUs or versions; the runs' dates and copy bandwidths are kept."""
    keys = ("gpu", "torch", "triton", "cuda", "liger")
    if any(old["env"].get(k) != new["env"].get(k) for k in keys):
        raise SystemExit(
            f"run.py --merge: {[old['env'].get(k) for k in keys]} != "
            f"{[new['env'].get(k) for k in keys]}; run every op instead"
        )
    measured = {r["op"] for r in new["rows"]}
    old_date = old["env"].get("date")
    kept = [dict(r, date=r.get("date", old_date)) for r in old["rows"] if r["op"] not in measured]
    runs = {r["date"]: None for r in kept + new["rows"]}
    copies = dict(old.get("copy_TBps_by_run", {old_date: old["copy_TBps"]}))
    copies[new["env"]["date"]] = new["copy_TBps"]
    return dict(
        new,
        rows=kept + new["rows"],
        overhead=new["overhead"] or old.get("overhead"),
        runs=sorted(runs),
        copy_TBps_by_run={d: copies[d] for d in sorted(runs) if d in copies},
    )


# ---------------------------------------------------------------- launch-config sweeps


def sweep_times(spec, args, configs, configure, timer, rounds: int = 3) -> dict:
    """``{(kind, config): median ms}`` for kind "fwd" and "fwdbwd" ("fwd" only
    for an op that is not differentiable), timed as CUDA
    graph replays of the forward and of the whole training step, in
    ``rounds`` interleaved rounds (so that clock drift spreads over every
    config). ``configure(config)`` is a context manager that makes the op
    launch with ``config``; a config that fails to compile times as NaN."""
    import statistics

    kinds = ("fwd", "fwdbwd") if spec.differentiable else ("fwd",)  # inference-only ops: no backward
    times = {(kind, config): [] for kind in kinds for config in configs}
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
                log(f"{spec.name} {kind} {config}: {error_text(e)[:200]}")
                ms = float("nan")
            times[(kind, config)].append(ms)
    return {key: statistics.median(ts) for key, ts in times.items()}


def module_config(module, *names):
    """A ``configure`` for :func:`run_sweep` that sets the launch-config globals
    ``module.<names>`` to a config's values while it is timed."""
    import contextlib

    from compile_ops._library import clear_launch_plans

    @contextlib.contextmanager
    def configure(config):
        saved = [getattr(module, n) for n in names]
        for n, v in zip(names, config):
            setattr(module, n, v)
        clear_launch_plans()  # eager calls replay the config they were recorded with
        try:
            yield
        finally:
            for n, v in zip(names, saved):
                setattr(module, n, v)
            clear_launch_plans()

    return configure


def run_sweep(out_path, ops, shapes, configs, configure, fields, default_ops, default_configs) -> list:
    """The launch-config sweep of ``bench/sweeps/<family>.py``: every op of
    ``ops`` (comma-separated, else ``default_ops``) at every shape (None: each
    op's registry bench shapes), bf16, timed
    by :func:`sweep_times` under each config (``"a/b/c,..."``, else
    ``default_configs``); ``fields`` names a config's values in the rows.
    Prints one line per measurement and writes the rows with :func:`write_sweep`."""

    from cases import BY_NAME

    ops = ops.split(",") if ops else default_ops
    configs = [tuple(int(v) for v in c.split("/")) for c in configs.split(",")] if configs else default_configs
    timer = make_timer(quick=False)
    warm_up_gpu()
    results = []
    plan = [(BY_NAME[name], shape) for name in ops for shape in (shapes or BY_NAME[name].bench_shapes)]
    for spec, shape in plan:
        name = spec.name
        args = spec.make_inputs(shape, torch.bfloat16, "cuda", True)
        with torch.no_grad():
            fwd_bytes, fwdbwd_bytes = bytes_model(args, spec.reference(*args), spec.backward_reads_inputs)
        for (kind, config), ms in sweep_times(spec, args, configs, configure, timer).items():
            gbps = (fwd_bytes if kind == "fwd" else fwdbwd_bytes) / (ms * 1e-3) / 1e9
            results.append(
                {"op": name, "shape": list(shape), "kind": kind, **dict(zip(fields, config)), "ms": ms, "GBps": gbps}
            )
            described = " ".join(f"{f} {v}" for f, v in zip(fields, config))
            log(f"{name:<13} {shape_str(shape):<14} {kind:<7} {described}: {ms * 1e3:8.1f} us {gbps:7.0f} GB/s")
    write_sweep(out_path, results)
    return results
