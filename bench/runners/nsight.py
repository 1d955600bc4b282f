"""Nsight Compute profiles of a fused op's kernels: the profiling step of the kernel workflow.

    python bench/run.py --profile rmsnorm,norm_modulate,attention [--out bench/results]
    PYTHONPATH=. python bench/runners/nsight.py OP [--shape B,L,C] [--passes fwd,fwdbwd] [--out DIR]
                                           [--kernel REGEX] [--sass N]

For each op, at one shape (``--shape``, else the registry's first benchmark
shape; attention: 1 x 4608 x 3072, Flux's 24 heads of 128), bf16, and for
each pass (forward; forward+backward for differentiable ops), this runs the
op in a child process under ``ncu`` (Nsight Compute). The child warms the op
up (Triton compiles, autotunes and loads outside the profile), then runs it
once between ``cudaProfilerStart``/``Stop``; ``ncu --profile-from-start off``
profiles every kernel of that one call, the aten kernels of a backward too.

Per kernel launch it collects (:data:`METRICS`): duration, DRAM bytes and
throughput as % of peak, SM throughput, achieved and theoretical occupancy,
registers per thread, grid and block size, and the warp stall reasons (cycles
per issued instruction that warps spend stalled on each reason), and how busy
the issue slots, the tensor cores and the XU (exp2, conversions), FMA and ALU
pipes were. ``--sass N`` adds a second ncu run with source counters: the N
SASS instructions where warps were sampled waiting most, with their reasons
(best with ``--kernel`` naming one kernel). It writes
``<out>/profile-<op>-<gpu>.json`` (the raw metrics, the GPU, torch, triton and
ncu versions) and ``<out>/profile-<op>-<gpu>.md`` (a short table: each
kernel's time, DRAM % of peak, occupancy and top three stall reasons).

Reading the stalls: ``long_scoreboard`` is waiting for global memory (a
bandwidth-bound kernel shows it on top, with DRAM near peak; with DRAM far from
peak it means too few bytes in flight), ``barrier`` a ``__syncthreads`` (the
cross-warp reductions of a row), ``math_pipe_throttle`` / ``wait`` the
arithmetic, ``mio_throttle`` / ``short_scoreboard`` shared memory.

ncu needs access to the GPU's performance counters (root, or the driver's
``NVreg_RestrictProfilingToAdminUsers=0``); ``$NCU`` names the binary when it
is not on ``PATH`` or in ``/usr/local/cuda/bin``.
"""

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

#: Per kernel launch. The stall reasons come by regular expression (ncu's
#: ``regex:`` prefix): every ``smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio``.
METRICS = (
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "sm__maximum_warps_per_active_cycle_pct",
    "launch__registers_per_thread",
    "launch__grid_size",
    "launch__block_size",
    r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio",
    # Which unit is busy: issue slots, the tensor cores, and the XU (exp2,
    # conversions), FMA and ALU pipes, as % of their peak over active cycles.
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    r"regex:sm__inst_executed_pipe_(xu|fma|alu)\.avg\.pct_of_peak_sustained_active",
)
#: ``--sass``: ncu's instruction-level sampling (where warps wait, per SASS instruction).
SASS_SECTIONS = ("SourceCounters", "WarpStateStats")
PIPES = (
    ("issue", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("tensor", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
    ("XU", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"),
    ("FMA", "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active"),
    ("ALU", "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active"),
)
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"
#: Shapes for ops without registry benchmark shapes ([B, L, C]: C = heads x 128).
DEFAULT_SHAPES = {
    "attention": (1, 4608, 3072),
    "attention_int8": (1, 4608, 3072),
    "attention_int8_fp8": (1, 4608, 3072),
}


def ncu_binary() -> str:
    """The ncu executable: ``$NCU``, ``ncu`` on PATH, or the CUDA toolkit's."""
    for candidate in (os.environ.get("NCU"), shutil.which("ncu"), "/usr/local/cuda/bin/ncu"):
        if candidate and os.path.exists(candidate):
            return candidate
    raise SystemExit("bench/runners/nsight.py: no ncu found (set $NCU, or put Nsight Compute's ncu on PATH)")


def _number(text: str):
    """ncu's value text as a number (thousands separators dropped), else the text."""
    cleaned = text.replace(",", "").strip()
    try:
        return int(cleaned)
    except ValueError:
        try:
            return float(cleaned)
        except ValueError:
            return text


def parse_csv(text: str) -> list:
    """``[{"id", "kernel", "metrics": {name: value}}]`` in launch order from ncu's
    ``--csv --page details`` output (one row per kernel launch and metric).
    Lines before the CSV header (the profiled program's own output, ncu's
    ``==PROF==`` notes) are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    launches = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if not row.get("Metric Name"):
            continue
        launch = launches.setdefault(row["ID"], {"id": int(row["ID"]), "kernel": row["Kernel Name"], "metrics": {}})
        launch["metrics"][row["Metric Name"]] = _number(row["Metric Value"])
    return sorted(launches.values(), key=lambda launch: launch["id"])


def stalls(metrics: dict) -> list:
    """``[(reason, cycles per issued instruction)]``, largest first."""
    found = [
        (name[len(STALL_PREFIX) : -len(STALL_SUFFIX)], value)
        for name, value in metrics.items()
        if name.startswith(STALL_PREFIX)
        and name.endswith(STALL_SUFFIX)
        and isinstance(value, (int, float))
        and not name.endswith("_not_issued" + STALL_SUFFIX)
        and name != STALL_PREFIX + "selected" + STALL_SUFFIX
    ]  # issuing, 1.00 by definition
    return sorted(found, key=lambda item: -item[1])


def _pipe_share(metrics: dict, key: str) -> str:
    """One pipe's share of issue slots for the profile table, or '-' where ncu gave none."""
    value = metrics.get(key)
    return f"{value:.0f}" if isinstance(value, (int, float)) else "-"


def summary_lines(op: str, shape, results: dict) -> list:
    """The Markdown summary: per pass, one row per kernel launch."""
    lines = [f"# ncu profile of `fused.{op}` at {'x'.join(map(str, shape))}, bf16", ""]
    for pass_name, launches in results.items():
        lines += [
            f"## {pass_name}",
            "",
            "| kernel | µs | DRAM GB read+written | DRAM % of peak | SM % of peak "
            "| occupancy achieved / theoretical (%) | regs | busy % (issue, tensor, XU, FMA, ALU) "
            "| top stalls (cycles per issue) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for launch in launches:
            m = launch["metrics"]
            dram = (m.get("dram__bytes_read.sum", 0) + m.get("dram__bytes_write.sum", 0)) / 1e9
            top = ", ".join(f"{reason} {value:.2f}" for reason, value in stalls(m)[:3])
            lines.append(
                f"| `{launch['kernel'][:60]}` | {m.get('gpu__time_duration.sum', 0) / 1e3:.1f} "
                f"| {dram:.3f} | {m.get('dram__throughput.avg.pct_of_peak_sustained_elapsed', 0):.1f} "
                f"| {m.get('sm__throughput.avg.pct_of_peak_sustained_elapsed', 0):.1f} "
                f"| {m.get('sm__warps_active.avg.pct_of_peak_sustained_active', 0):.1f} / "
                f"{m.get('sm__maximum_warps_per_active_cycle_pct', 0):.1f} "
                f"| {m.get('launch__registers_per_thread', '')} "
                f"| {' / '.join(_pipe_share(m, k) for _, k in PIPES)} "
                f"| {top} |"
            )
        lines.append("")
    return lines


def sass_hotspots(text: str, top: int = 15) -> list:
    """From ncu's ``--page source --print-source sass --csv`` output: the ``top``
    SASS instructions by warp-stall samples, as ``{"address", "sass",
    "share", "reasons": [(reason, samples)] (three largest)}``; ``share`` is
    the instruction's fraction of all samples of its kernel. ncu prints one
    block per profiled kernel; this reads the first (``--kernel`` picks it)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        return []
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith('"Kernel Name"')), len(lines))
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:end]))))
    samples = "Warp Stall Sampling (All Samples)"

    def count(row, key):
        value = _number(row.get(key) or "0")
        return value if isinstance(value, (int, float)) else 0

    total = sum(count(row, samples) for row in rows) or 1
    reasons = [k for k in (rows[0] if rows else {}) if k.startswith("stall_") and "Not Issued" not in k]
    ranked = sorted(rows, key=lambda row: -count(row, samples))[:top]
    return [
        {
            "address": row["Address"],
            "sass": row["Source"].strip(),
            "share": count(row, samples) / total,
            "reasons": sorted(((k[len("stall_") :], count(row, k)) for k in reasons), key=lambda x: -x[1])[:3],
        }
        for row in ranked
    ]


def sass_lines(pass_name: str, hotspots: list) -> list:
    """The Markdown table of one pass's :func:`sass_hotspots`."""
    lines = [
        f"### {pass_name}: SASS instructions with the most warp-stall samples",
        "",
        "| share | instruction | top reasons (samples) |",
        "|---|---|---|",
    ]
    for h in hotspots:
        reasons = ", ".join(f"{r} {n}" for r, n in h["reasons"])
        lines.append(f"| {100 * h['share']:.1f}% | `{h['sass'][:70]}` | {reasons} |")
    return lines + [""]


def _shape_of(op: str, shape_arg: str):
    from cases import BY_NAME

    if shape_arg:
        return tuple(int(v) for v in shape_arg.replace("x", ",").split(","))
    spec = BY_NAME[op]
    if spec.bench_shapes:
        return tuple(spec.bench_shapes[0])
    if op in DEFAULT_SHAPES:
        return DEFAULT_SHAPES[op]
    raise SystemExit(f"bench/runners/nsight.py: {op} has no benchmark shape; give one with --shape B,L,C")


# ---------------------------------------------------------------- the profiled child


def run_target(op: str, shape, pass_name: str) -> None:
    """In the child under ncu: warm up, then one call of ``op`` inside the profiler range."""
    import torch

    from bench.toolkit import _training_step
    from cases import BY_NAME

    spec = BY_NAME[op]
    args = spec.make_inputs(shape, torch.bfloat16, "cuda", pass_name == "fwdbwd")
    if pass_name == "fwdbwd":
        call = _training_step(spec.op, args)
    else:

        def call():
            with torch.no_grad():
                spec.op(*args)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


# ---------------------------------------------------------------- the driver


def profile(op: str, out: str, shape_arg: str = "", passes: str = "", sass: int = 0, kernel: str = "") -> int:
    """Profile ``op`` under ncu, write its JSON and Markdown summary; 0 on success.
    ``sass``: also the ``sass`` SASS instructions of each pass where warps stall
    most (a second ncu run with source counters); ``kernel``: only kernels
    whose name matches this regular expression (ncu's ``--kernel-name regex:``)."""
    import torch
    import triton

    from bench.toolkit import environment, gpu_slug, log
    from cases import BY_NAME

    if op not in BY_NAME:
        raise SystemExit(f"bench/runners/nsight.py: unknown op {op!r}; choose from {sorted(BY_NAME)}")
    spec = BY_NAME[op]
    if spec.make_inputs is None:
        raise SystemExit(
            f"nsight.py: {op} has no input maker in the registry (a backward op: profile its "
            "forward's fwdbwd pass instead)"
        )
    shape = _shape_of(op, shape_arg)
    wanted = passes.split(",") if passes else (["fwd", "fwdbwd"] if spec.differentiable else ["fwd"])
    ncu = ncu_binary()
    version = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1:]
    results, failures, hotspots = {}, {}, {}
    for pass_name in wanted:
        target = [
            sys.executable,
            os.path.abspath(__file__),
            op,
            "--target",
            pass_name,
            "--shape",
            ",".join(map(str, shape)),
        ]
        only = ["--kernel-name", f"regex:{kernel}"] if kernel else []
        command = [
            ncu,
            "--profile-from-start",
            "off",
            "--target-processes",
            "all",
            *only,
            "--csv",
            "--page",
            "details",
            "--print-units",
            "base",
            "--metrics",
            ",".join(METRICS),
            *target,
        ]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        if sass:
            sections = [a for name in SASS_SECTIONS for a in ("--section", name)]
            source = subprocess.run(
                [
                    ncu,
                    "--profile-from-start",
                    "off",
                    "--target-processes",
                    "all",
                    *only,
                    *sections,
                    "--import-source",
                    "no",
                    "--csv",
                    "--page",
                    "source",
                    "--print-source",
                    "sass",
                    *target,
                ],
                capture_output=True,
                text=True,
                env=env,
            )
            hotspots[pass_name] = sass_hotspots(source.stdout, sass)
            if not hotspots[pass_name]:
                log(
                    f"nsight: {op} {pass_name}: no SASS source page (exit {source.returncode}):\n"
                    f"{(source.stderr or source.stdout)[-2000:]}"
                )
        log(f"nsight: {op} {'x'.join(map(str, shape))} {pass_name}")
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        launches = parse_csv(done.stdout)
        if done.returncode != 0 or not launches:
            failures[pass_name] = (done.stderr or done.stdout)[-3000:]
            log(f"nsight: {op} {pass_name} failed (exit {done.returncode}):\n{failures[pass_name]}")
            continue
        results[pass_name] = launches
    env_info = environment()
    data = {
        "op": op,
        "shape": list(shape),
        "dtype": "bfloat16",
        "gpu": env_info["gpu"],
        "torch": torch.__version__,
        "triton": triton.__version__,
        "ncu": version[0] if version else None,
        "metrics": list(METRICS),
        "passes": results,
        "failures": failures,
        "sass_hotspots": hotspots,
    }
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"profile-{op}-{gpu_slug(env_info['gpu'])}")
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1)
    lines = summary_lines(op, shape, results)
    for pass_name, found in hotspots.items():
        lines += sass_lines(pass_name, found)
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    log(f"wrote {stem}.json and .md")
    return 1 if failures else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("op")
    p.add_argument("--shape", default="", help="B,L,C (default: the registry's first benchmark shape)")
    p.add_argument("--passes", default="", help="fwd,fwdbwd (default: both for differentiable ops)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument(
        "--sass",
        type=int,
        default=0,
        metavar="N",
        help="also list the N SASS instructions where warps stall most (instruction-level sampling)",
    )
    p.add_argument("--kernel", default="", help="profile only kernels whose name matches this regular expression")
    p.add_argument("--target", default="", help=argparse.SUPPRESS)  # set in the child that ncu runs
    args = p.parse_args(argv)
    if args.target:
        run_target(args.op, _shape_of(args.op, args.shape), args.target)
        return 0
    return profile(args.op, args.out, args.shape, args.passes, args.sass, args.kernel)


if __name__ == "__main__":
    sys.exit(main())
