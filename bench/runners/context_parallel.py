"""Context-parallel steps: compile_ops' attention modes under diffusers' Ulysses and ring, beside one GPU.

    PYTHONPATH=. python bench/runners/context_parallel.py --world 2 [--cases wan_720p,flux] [--repeats 3]

Launches its own ranks (``torch.distributed.run``): first the one-GPU steps
(the case/mode pairs dealt out over the GPUs, each alone on its GPU), then
``--world`` processes, one a GPU, under each parallel layout (Ulysses-W,
ring-W, and ring-2 x Ulysses-W/2 where W is 4 or more). Each process
builds the case's full-size model with random weights (bf16, the same
weights on every rank), patches it in one mode, compiles its blocks in place
(diffusers' ``compile_repeated_blocks``), turns on context parallelism, and
times one denoising step ``--repeats`` times (CUDA events around the step
after a barrier; the median and spread of rank 0's times); with ``--profile``
also rank 0's GPU time by kernel family, the collectives' among them.

Modes: ``native`` (no patch: SDPA, cuDNN), ``patched`` (``compile_ops.patch``,
exact attention), ``int8_fp8`` (``attention_precision="int8_fp8"``) and, on
the video models, ``sliding_tile`` (``attention=SlidingTile(window=(3, 3, 3), tile=(2, 8, 8))``).
Under a ring layout ``native`` runs diffusers' ``_native_cudnn`` backend
(``set_attention_backend``): the ring merge needs the log-sum-exp, which its
default SDPA backend does not return. Modes a layout refuses are recorded as
refused with the error's first line. ``native`` under a parallel layout needs
the context-parallel plan diffusers ships with the model's class (``_cp_plan``):
HunyuanVideo has none (``compile_ops.patch`` installs one on the patched modes),
so its ``native`` rows there are refused before the model is built
(:func:`refusal`).

Every row also gives the step output's relative L2 against the one-GPU
native output (the mode's error) and against the one-GPU output of the same
mode (what splitting across GPUs changed: 0 where the per-head computation is
the same). Writes ``<out>/context-parallel-<cases>-x<world>-<gpu>.json``.

Cases: ``wan_720p`` (Wan 2.1 1.3B, 720p x 81 frames: 21 x 45 x 80 = 75,600
tokens), ``flux`` (Flux.1-dev, 1024 x 1024: 4096 image + 512 text tokens),
``hunyuan_720p`` (HunyuanVideo 13B, 720p x 33 frames: 9 x 45 x 80 = 32,400
video tokens + 256 text tokens, the last quarter of them padding).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import traceback

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.runners.diffusers_models import build  # noqa: E402
from bench.runners.diffusers_timing import compiled, diffusers_environment, profiled  # noqa: E402
from bench.toolkit import log, relative_l2, results_path  # noqa: E402

CASES = {"wan_720p": "wan_step_720p", "flux": "flux_step", "hunyuan_720p": "hunyuan_step_720p"}
MODES = ("native", "patched", "int8_fp8", "sliding_tile")
#: Modes that apply to each case (Flux has no video grid for a sliding tile).
CASE_MODES = {"wan_720p": MODES, "flux": MODES[:3], "hunyuan_720p": MODES}
#: Each case's diffusers model class: whether diffusers ships its context-parallel plan decides,
#: before the model is built, whether ``native`` runs under a parallel layout.
MODEL_CLASSES = {
    "wan_720p": "WanTransformer3DModel",
    "flux": "FluxTransformer2DModel",
    "hunyuan_720p": "HunyuanVideoTransformer3DModel",
}
#: NVLink multicast stays off on shared machines (the device's KINDS.md).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def layouts(world: int) -> list:
    """``(name, ulysses degree, ring degree)`` of the parallel layouts timed on ``world`` GPUs."""
    found = [(f"ulysses{world}", world, 1), (f"ring{world}", 1, world)]
    if world >= 4 and world % 2 == 0:
        found.append((f"ring2_ulysses{world // 2}", world // 2, 2))
    return found


def refusal(case: str, mode: str, layout: str) -> str | None:
    """Why ``mode`` cannot run ``case`` under ``layout``, known before the model is built; None
    where nothing is known against it. ``native`` under a parallel layout runs the plan diffusers
    ships on the model's class (``_cp_plan``): where that is None (HunyuanVideo), diffusers'
    ``enable_parallelism`` has no plan to apply."""
    if mode != "native" or layout == "single":
        return None
    import diffusers

    name = MODEL_CLASSES[case]
    if getattr(diffusers, name)._cp_plan is not None:
        return None
    return (
        f"native {name} under {layout}: diffusers ships no context-parallel plan for it (_cp_plan is None); "
        "compile_ops.patch installs one on the patched modes"
    )


def _patch(model, mode: str) -> None:
    import compile_ops

    if mode == "patched":
        compile_ops.patch(model)
    elif mode == "int8_fp8":
        compile_ops.patch(model, attention_precision="int8_fp8")
    elif mode == "sliding_tile":
        compile_ops.patch(model, attention=compile_ops.SlidingTile(window=(3, 3, 3), tile=(2, 8, 8)))


def _step_times(step, repeats: int, distributed: bool) -> list:
    """``repeats`` wall times (ms) of ``step()``, each after a barrier, on this rank."""
    times = []
    for _ in range(repeats):
        if distributed:
            torch.distributed.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def worker(args) -> None:
    """One rank. Under a parallel layout: every (case, mode) of ``args``, all
    ranks together. ``single``: the (case, mode) pairs dealt out over the
    ranks, each run on its rank's GPU alone. Each rank writes its rows and
    step outputs under ``args.scratch``."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    distributed = args.layout != "single"
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if distributed:
        torch.distributed.init_process_group("nccl")
    if args.pipeline_min_mib is not None:
        from compile_ops.integrations.diffusers import ulysses

        ulysses.PIPELINE_MIN_BYTES = args.pipeline_min_mib * 2**20
    chosen = args.modes.split(",") if args.modes else MODES
    pairs = [(case, mode) for case in args.cases.split(",") for mode in CASE_MODES[case] if mode in chosen]
    rows, outputs = [], {}
    for case, mode in pairs if distributed else pairs[rank::world]:
        row = dict(case=case, mode=mode, layout=args.layout, world=world if distributed else 1)
        try:
            reason = refusal(case, mode, args.layout)
            if reason is not None:  # recorded as a layout's refusal below, without building the model
                raise ValueError(reason)
            model, inputs = build(CASES[case])
            _patch(model, mode)
            if distributed:
                from diffusers import ContextParallelConfig

                ulysses, ring = next((u, r) for name, u, r in layouts(world) if name == args.layout)
                if mode == "native" and ring > 1:
                    model.set_attention_backend("_native_cudnn")
                model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring))
            # As diffusers' compile_repeated_blocks: fullgraph=False, since diffusers'
            # context-parallel hook on the first block (inspect.signature) does not trace.
            compiled(model, "regional", fullgraph=False)

            def step():
                with torch.no_grad():
                    return model(**inputs, return_dict=False)[0]

            out = step()  # compiles
            step()  # and recompiles where the first call's strides differ from the next ones'
            times = _step_times(step, args.repeats, distributed)
            row.update(
                step_ms=statistics.median(times),
                step_ms_min=min(times),
                step_ms_max=max(times),
                times_ms=times,
                attention_paths=sorted({(k, p) for _, k, p in _report(model)}),
            )
            profiled(row, step, args.profile)  # every rank profiles: the step's collectives need them all
            outputs[(case, mode)] = out.cpu()  # bf16: small enough to carry between runs
            del model, inputs, out
        except ValueError as error:  # a mode the layout refuses
            row["refused"] = str(error).splitlines()[0]
        except Exception as error:  # recorded, and the other modes still run
            row["failed"] = f"{type(error).__name__}: {error}".splitlines()[0]
            log(traceback.format_exc())
        torch.cuda.empty_cache()
        rows.append(row)
        log(f"rank {rank} {args.layout} {case} {mode}: {row.get('step_ms', row.get('refused'))}")
    if rank == 0 or not distributed:
        stem = os.path.join(args.scratch, f"{args.layout}-{'+'.join(args.cases.split(','))}-{rank}")
        torch.save(outputs, stem + "-outputs.pt")
        with open(stem + ".json", "w") as f:
            json.dump(rows, f)
    if distributed:
        torch.distributed.destroy_process_group()


def _report(model) -> list:
    """``(path, kernel, parallel path)`` of each patched attention layer (none on a native model)."""
    from compile_ops.integrations.diffusers.context_parallel import parallel_path

    rows = []
    for path, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if hasattr(processor, "describe"):
            rows.append((path, *processor.describe(module)))
        elif processor is not None and hasattr(processor, "_parallel_config"):
            backend = getattr(processor, "_attention_backend", None)
            kernel = f"diffusers {type(processor).__name__}" + (f" ({backend} backend)" if backend else "")
            rows.append((path, kernel, parallel_path(processor._parallel_config)))
    return rows


def _launch(args, layout: str) -> None:
    """Run :func:`worker` on ``args.world`` processes, one a GPU, under ``layout``."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={args.world}",
        f"--master-port={args.port}",
        __file__,
        "--worker",
        "--layout",
        layout,
        "--world",
        str(args.world),
        "--cases",
        args.cases,
        *(["--modes", args.modes] if args.modes else []),
        *(["--profile"] if args.profile else []),
        *(["--pipeline-min-mib", str(args.pipeline_min_mib)] if args.pipeline_min_mib is not None else []),
        "--repeats",
        str(args.repeats),
        "--scratch",
        args.scratch,
    ]
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    subprocess.run(command, check=True, env={**os.environ, **NCCL_ENV, "PYTHONPATH": path})


def _collect(args, env: dict) -> list:
    """Merge every rank file under ``args.scratch`` into rows with their errors
    and speed-ups, and write them to the results JSON."""
    rows, outputs = [], {}
    for name in sorted(os.listdir(args.scratch)):
        if name.endswith(".json"):
            with open(os.path.join(args.scratch, name)) as f:
                rows += json.load(f)
            layout = name.split("-")[0]
            for key, out in torch.load(os.path.join(args.scratch, name[:-5] + "-outputs.pt")).items():
                outputs[(*key, layout)] = out
    for row in rows:
        key = (row["case"], row["mode"], row["layout"])
        if key in outputs:
            for field, mode in (("rel_l2_vs_native_one_gpu", "native"), ("rel_l2_vs_same_mode_one_gpu", row["mode"])):
                reference = outputs.get((row["case"], mode, "single"))
                row[field] = None if reference is None else relative_l2(outputs[key], reference)
    steps = {(r["case"], r["mode"], r["layout"]): r.get("step_ms") for r in rows}
    for row in rows:  # speed-up over the mode's own one-GPU step and over native under the same layout
        if row.get("step_ms"):
            one_gpu, native = (
                steps.get((row["case"], row["mode"], "single")),
                steps.get((row["case"], "native", row["layout"])),
            )
            row["speedup_vs_own_one_gpu"] = one_gpu / row["step_ms"] if one_gpu else None
            row["speedup_vs_native_same_layout"] = native / row["step_ms"] if native else None
    order = {name: i for i, name in enumerate(["single", *(name for name, _, _ in layouts(args.world))])}
    rows.sort(key=lambda r: (r["case"], order[r["layout"]], MODES.index(r["mode"])))
    tag = f"-{args.tag}" if args.tag else ""
    path = results_path(args.out, f"context-parallel-{'+'.join(args.cases.split(','))}-x{args.world}{tag}", env)
    with open(path, "w") as f:
        json.dump(dict(env=env, world=args.world, rows=rows), f, indent=1)
    log(f"wrote {path}")
    return rows


def _print(rows: list) -> None:
    def number(row, field, spec):
        value = row.get(field)
        return "-" if value is None else format(value, spec)

    for row in rows:
        log(
            f"{row['case']:9s} {row['layout']:16s} {row['mode']:13s} "
            + (
                f"{row['step_ms']:9.1f} ms  x{number(row, 'speedup_vs_own_one_gpu', '.2f')} own-1GPU  "
                f"x{number(row, 'speedup_vs_native_same_layout', '.2f')} native  "
                f"relL2 {number(row, 'rel_l2_vs_native_one_gpu', '.2e')} / "
                f"{number(row, 'rel_l2_vs_same_mode_one_gpu', '.2e')}"
                if row.get("step_ms")
                else f"refused: {row.get('refused')}"
                if "refused" in row
                else f"failed: {row.get('failed')}"
            )
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=torch.cuda.device_count())
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--modes", default=None, help=f"comma-separated subset of {', '.join(MODES)} (default: all)")
    p.add_argument(
        "--pipeline-min-mib",
        type=float,
        default=None,
        help="compile_ops' Ulysses exchange pipelines calls whose q shard holds this many MiB "
        "(default: ulysses.PIPELINE_MIN_BYTES; inf: never)",
    )
    p.add_argument("--tag", default=None, help="appended to the results file's name")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--profile",
        action="store_true",
        help="also each step's GPU time by kernel family and its top kernels on rank 0 (torch.profiler), "
        "collectives included: where a split step spends what it does not save",
    )
    p.add_argument(
        "--layouts",
        default=None,
        help="comma-separated subset of single (one GPU) and the parallel layouts (default: all)",
    )
    p.add_argument(
        "--scratch",
        default=None,
        help="a folder that keeps each layout's rows and step outputs "
        "across runs (split a long run: --layouts single,ulysses2, then --layouts ring2)",
    )
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--port", type=int, default=29533, help="the ranks' rendezvous port (runs side by side need two)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="single", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.world < 2:
        raise SystemExit(f"context_parallel: needs 2 or more GPUs, found {args.world}")
    os.environ.update(NCCL_ENV)
    env = diffusers_environment()
    chosen = ["single", *(name for name, _, _ in layouts(args.world))]
    if args.layouts:
        chosen = [name for name in chosen if name in args.layouts.split(",")]
    with tempfile.TemporaryDirectory() as temporary:
        args.scratch = args.scratch or temporary
        os.makedirs(args.scratch, exist_ok=True)
        for layout in chosen:  # the JSON is rewritten after each layout: a cut-off run keeps what it measured
            _launch(args, layout)
            rows = _collect(args, env)
    _print(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
