"""The benchmarks' entry point: a first run on a GPU, the CPU demo without one.

    python bench/run.py                                          # GPU: the first run, a few minutes
    python bench/run.py --full [--quick]                         # GPU: every op, shape, peer and runner
    python bench/run.py --ops rmsnorm,layernorm [--quick] [--merge]  # GPU: those ops' table
    python bench/run.py --profile rmsnorm,attention              # GPU: Nsight Compute per kernel

Without CUDA it runs the CPU demo (``bench/demo.py``) and exits with its status.

On a GPU, the default is the first run (``bench/runners/first_run.py``): one
op per family against ``torch.compile`` of its PyTorch reference, attention,
and one end-to-end step, ending with a short summary; it writes
``<out>/first-run-<gpu>.json``, ``.png`` and ``.log``. ``--full`` runs the op
table (``bench/runners/ops.py``: every registry op at every benchmark shape,
eager and compiled, with its peers; ``<out>/<gpu>.json`` and ``.png``) and then
every runner (:func:`stages`). ``--ops`` runs only the op table, for those ops.
The per-measurement lines go to a log file next to the results (``--verbose``:
to the screen as well); the screen shows the progress and the summary.
``--profile OPS`` runs Nsight Compute on each op's kernels instead of timing
(``bench/runners/nsight.py``). What the runners share (timing, environment,
results files, progress) is in ``bench/toolkit.py``.
"""

import time

START = time.perf_counter()  # the first run's time budget counts from the process start

import argparse  # noqa: E402
import importlib  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.toolkit import log  # noqa: E402

#: ``--full``'s causal attention shapes: Flux's and Wan's lengths.
CAUSAL_SHAPES = "1x24x4608x128,1x12x32760x128"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--full",
        action="store_true",
        help="every op at every shape with its peers, then every runner (attention, block-sparse, MoE, "
        "diffusers end to end, multi-GPU)",
    )
    p.add_argument("--ops", default="", help="only the op table, for these comma-separated ops")
    p.add_argument("--quick", action="store_true", help="short timing runs, one shape per op (smoke test)")
    p.add_argument(
        "--out",
        default=os.path.join(ROOT, "bench", "results"),
        help="directory for the results, plots and logs (default: bench/results)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the other ops' rows of an existing <gpu>.json (same GPU and versions)",
    )
    p.add_argument("--verbose", action="store_true", help="every measurement line on the screen too")
    p.add_argument(
        "--budget-s",
        type=float,
        default=270.0,
        help="the first run skips the stages that would end past this many seconds",
    )
    p.add_argument(
        "--profile",
        default="",
        metavar="OPS",
        help="comma-separated ops to profile with ncu (bench/runners/nsight.py) instead of timing",
    )
    return p.parse_args(argv)


def stages(args, has_diffusers: bool, gpus: int) -> list:
    """What ``--full`` / ``--ops`` run, in order: ``[(label, runner module, argv)]``
    (argv None: the op table, ``bench/runners/ops.py``, called with ``args``)."""
    out, quick = ["--out", args.out], ["--quick"] if args.quick else []
    planned = [("op table" + (f" ({args.ops})" if args.ops else ""), "ops", None)]
    if not args.full:
        return planned
    planned += [
        ("attention, non-causal", "attention", out + quick),
        ("attention, causal", "attention", out + quick + ["--causal", "--shapes", CAUSAL_SHAPES]),
        ("block-sparse attention", "block_sparse", out + quick),
        ("MoE routing", "moe", out + quick),
    ]
    if has_diffusers:
        planned.append(("diffusers end to end", "diffusers_e2e", out))
    if gpus >= 2:
        planned.append(("FSDP2 and sharded attention on 2 GPUs", "distributed_train", out + ["--gpus", "2"]))
    return planned


def table_run(args) -> int:
    """``--full`` or ``--ops``: :func:`stages` with their output in ``<out>/<gpu>.log``."""
    from bench import report
    from bench.runners import first_run
    from bench.toolkit import gpu_slug, output_to

    try:
        import diffusers  # noqa: F401  (the optional extra)

        has_diffusers = True
    except ImportError:
        has_diffusers = False
    planned = stages(args, has_diffusers, torch.cuda.device_count())
    started = time.time()
    log_path = os.path.join(args.out, f"{gpu_slug(torch.cuda.get_device_name())}.log")
    status, table = 0, None
    with output_to(log_path, echo=args.verbose) as screen:
        shown = None if args.verbose else screen
        screen.write(f"bench/run.py: {len(planned)} stage(s); details in {os.path.relpath(log_path)}\n")
        if args.full and not has_diffusers:
            screen.write("diffusers is not installed (pip install -e '.[bench]'): no end-to-end models\n")
        if args.full and torch.cuda.device_count() < 2:
            screen.write("one GPU here: no FSDP2 / sharded run (bench/runners/distributed_train.py needs 2)\n")
        for i, (label, module, argv) in enumerate(planned, 1):
            screen.write(f"[stage {i}/{len(planned)}] {label}\n")
            log(f"==== stage {i}/{len(planned)}: {label}")
            if argv is None:
                from bench.runners import ops

                code, table = ops.run(args.ops, args.quick, args.out, args.merge, shown)
            else:
                code = importlib.import_module(f"bench.runners.{module}").main(argv)
            status |= code
    data = report.load(table)
    if args.full:
        lines = first_run.family_lines(data["rows"], first_run.families_in(data["rows"]))
    else:
        lines = report.format_table(data).splitlines()
    paths = (os.path.join(args.out, name) for name in os.listdir(args.out))
    written = sorted(os.path.relpath(p) for p in paths if os.path.isfile(p) and os.path.getmtime(p) >= started)
    print(
        "\n".join(
            [
                "",
                *lines,
                "",
                "Written: " + ", ".join(written),
                f"Done in {time.perf_counter() - START:.0f} s" + (", with failures (see the log)" if status else ""),
            ]
        ),
        flush=True,
    )
    return status


def main(argv=None) -> int:
    """Entry point: the GPU benchmarks, or the CPU demo where there is no CUDA device."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        log("run.py: no CUDA device here, so no benchmark; running the CPU demo (bench/demo.py) instead.")
        from bench import demo

        return demo.main()
    if args.profile:
        from bench.runners import nsight

        return max(nsight.profile(op.strip(), args.out) for op in args.profile.split(",") if op.strip())
    if args.full or args.ops:
        return table_run(args)
    from bench.runners import first_run

    return first_run.run(args.out, args.quick, args.verbose, args.budget_s, START)


if __name__ == "__main__":
    sys.exit(main())
