"""Is a context-parallel step bound by the host? One case, several variants, Ulysses on every rank:

    torchrun --nproc-per-node=2 bench/experiments/context_parallel_host.py OUT_DIR \\
        --case flux_step --variants native,patched,patched_blocks_only [--profile native,patched] [--pin]

Each variant builds the case's full-size model (random weights, bf16), patches
it (or not), turns on Ulysses over every rank, compiles its blocks in place
(``fullgraph=False``, as diffusers' ``compile_repeated_blocks`` under context
parallelism) in the variant's Inductor mode, and times seven steps after
three warm-ups: CUDA events around the step (its GPU time) and the host's
time to return from it (its launches issued). A step whose host time is near
its step time is bound by the host. ``--profile`` variants also write one
step's torch profiler trace and kernel table per rank. ``--pin`` gives each
rank its own share of the cores. Writes ``OUT_DIR/host-<case>-rank<r>.json``.

Variants: ``native``, ``patched`` (``compile_ops.patch``), ``patched_blocks_only``
(``attention_processors=False``), ``patched_fused_attention``
(``attention_kernel="fused"``), ``int8_fp8``, ``sliding_tile``, each
``_eager`` (not compiled) or ``_cg`` (``mode="reduce-overhead"``).

The runs behind docs/notes/context-parallel.md's host-bound Flux figures
(``bench/results/context-parallel-flux-host-h200.json``) ran these variants.
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.runners import diffusers_timing  # noqa: E402
from bench.runners.diffusers_models import build  # noqa: E402

#: A variant's patch options by its base name (None: native).
PATCHES = {
    "native": None,
    "patched": {},
    "patched_blocks_only": dict(attention_processors=False),
    "patched_fused_attention": dict(attention_kernel="fused"),
    "int8_fp8": dict(attention_precision="int8_fp8"),
    "sliding_tile": "sliding_tile",
}


def _variant(name: str) -> tuple:
    """``(patch options, compiled, Inductor mode)`` of a variant name."""
    for suffix, compiled, mode in (("_eager", False, "default"), ("_cg", True, "reduce-overhead")):
        if name.endswith(suffix):
            return PATCHES[name[: -len(suffix)]], compiled, mode
    return PATCHES[name], True, "default"


def _patch(model, options) -> None:
    import compile_ops

    if options == "sliding_tile":
        compile_ops.patch(model, attention=compile_ops.SlidingTile(window=(3, 3, 3), tile=(2, 8, 8)))
    elif options is not None:
        compile_ops.patch(model, **options)


def run(args, rank: int, world: int) -> list:
    from diffusers import ContextParallelConfig

    rows = []
    for name in args.variants.split(","):
        options, compiled, mode = _variant(name)
        row = dict(case=args.case, variant=name, rank=rank, world=world, inductor_mode=mode, compiled=compiled)
        try:
            started = time.time()
            model, inputs = build(args.case)
            _patch(model, options)
            model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
            if compiled:
                diffusers_timing.compiled(model, "regional", fullgraph=False, inductor_mode=mode)

            def step():
                with torch.no_grad():
                    return model(**inputs, return_dict=False)[0].clone()

            for _ in range(3):
                step()
            row["setup_s"] = time.time() - started
            times, host = [], []
            for _ in range(7):
                dist.barrier()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                issued = time.perf_counter()
                start.record()
                step()
                host.append((time.perf_counter() - issued) * 1e3)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            row.update(step_ms=statistics.median(times), times_ms=times, host_ms=statistics.median(host))
            if name in args.profile.split(","):
                from torch.profiler import ProfilerActivity, profile

                dist.barrier()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    step()
                    torch.cuda.synchronize()
                prof.export_chrome_trace(os.path.join(args.out, f"trace-{name}-rank{rank}.json"))
                table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30)
                with open(os.path.join(args.out, f"top-{name}-rank{rank}.txt"), "w") as f:
                    f.write(table)
            del model, inputs
        except Exception:
            row["failed"] = traceback.format_exc()[-3000:]
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        rows.append(row)
        print(f"rank {rank} {name}: step {row.get('step_ms')} ms, host {row.get('host_ms')} ms", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--case", default="flux_step")
    p.add_argument("--variants", default="native,patched")
    p.add_argument("--profile", default="")
    p.add_argument("--pin", action="store_true")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    if args.pin:
        cores = sorted(os.sched_getaffinity(0))
        share = len(cores) // int(os.environ["LOCAL_WORLD_SIZE"])
        os.sched_setaffinity(0, cores[local * share : (local + 1) * share])
    dist.init_process_group("nccl")
    os.makedirs(args.out, exist_ok=True)
    rows = run(args, rank, world)
    with open(os.path.join(args.out, f"host-{args.case}-rank{rank}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
