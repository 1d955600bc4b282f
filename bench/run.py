"""Benchmark runner: every registry op at DiT shapes, fused against native PyTorch and peers.

    python bench/run.py [--ops rmsnorm,layernorm] [--quick] [--out bench/results]
    python bench/run.py --profile rmsnorm,attention [--out bench/results]

On a CUDA machine it writes ``<out>/<gpu>.json`` (e.g. ``bench/results/h100.json``),
prints the table (``bench/report.py``) and writes ``<out>/<gpu>.png``. Without
CUDA it runs the CPU demo (``bench/demo.py``) instead and exits with its status.
``--profile OPS`` runs Nsight Compute on each op's kernels instead of timing
(``bench/runners/nsight.py``: DRAM throughput, occupancy, stall reasons per kernel).

This file only parses arguments and dispatches: the op benchmark and its
method are in ``bench/runners/ops.py``; a full run (no ``--ops``) then runs
``bench/runners/attention.py`` (non-causal and causal), ``bench/runners/block_sparse.py``, ``bench/runners/moe.py``,
``bench/runners/diffusers_e2e.py`` (where diffusers is installed) and
``bench/runners/distributed_train.py`` (on 2 or more GPUs). What the runners share
(timing, environment, results files) is in ``bench/toolkit.py``.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.toolkit import log  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="", help="comma-separated op names (default: every op with bench shapes)")
    p.add_argument("--quick", action="store_true", help="one shape per op and short timing runs (smoke test)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"),
                   help="directory for <gpu>.json and <gpu>.png (default: bench/results)")
    p.add_argument("--merge", action="store_true",
                   help="keep the other ops' rows of an existing <gpu>.json (same GPU and versions)")
    p.add_argument("--profile", default="", metavar="OPS",
                   help="comma-separated ops to profile with ncu (bench/runners/nsight.py) instead of the benchmark")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Entry point: the GPU benchmark, or the CPU demo where there is no CUDA device."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        log("run.py: no CUDA device here, so no benchmark; running the CPU demo (bench/demo.py) instead.")
        from bench import demo
        return demo.main()
    if args.profile:
        from bench.runners import nsight

        return max(nsight.profile(op.strip(), args.out) for op in args.profile.split(",") if op.strip())
    from bench.runners import ops

    status = ops.run(args.ops, args.quick, args.out, args.merge)
    if not args.ops:  # a full run: attention too, which bench/runners/attention.py measures in TFLOP/s
        from bench.runners import attention

        quick = ["--quick"] if args.quick else []
        for causal in ([], ["--causal", "--shapes", "1x24x4608x128,1x12x32760x128"]):
            status |= attention.main(["--out", args.out] + quick + causal)
        from bench.runners import block_sparse

        status |= block_sparse.main(["--out", args.out] + quick)
        from bench.runners import moe

        status |= moe.main(["--out", args.out] + quick)
        try:
            import diffusers  # noqa: F401  (the optional extra)
        except ImportError:
            log("run.py: diffusers is not installed (pip install -e '.[diffusers]'): no end-to-end models")
        else:
            from bench.runners import diffusers_e2e

            status |= diffusers_e2e.main(["--out", args.out])
        if torch.cuda.device_count() >= 2:
            from bench.runners import distributed_train

            status |= distributed_train.main(["--out", args.out, "--gpus", "2"])
        else:
            log("run.py: one GPU here: no FSDP2 / heads-sharded run (bench/runners/distributed_train.py needs 2)")
    return status


if __name__ == "__main__":
    sys.exit(main())
