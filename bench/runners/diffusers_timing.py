"""How the diffusers runners compile a model and time its step.

What bench/runners/diffusers_e2e.py, its cases (bench/runners/diffusers_lora.py)
and the other diffusers runners (bench/runners/sparse_e2e.py,
bench/runners/context_parallel.py, bench/runners/aoti.py) share:
:func:`compiled` and :func:`uncompiled` (the whole model or its blocks in
place), :func:`repeated` (do_bench medians, their spread, the peak memory and
:func:`host_ms`; the wall clock on the CPU, for smoke runs), :func:`profiled`
(GPU time by kernel family), :func:`weight_MiB`, :func:`diffusers_environment`,
and the settings a runner's ``main`` sets from its flags: ``BACKEND`` and
``REPLAY``, read here.
"""

import time

import torch

from bench.runners.diffusers_models import DEVICE
from bench.toolkit import captured_graph, environment, kernel_profile, warm_up_gpu

#: ``--backend``: torch.compile's backend ("eager" runs Dynamo alone: smoke runs).
BACKEND = "inductor"
#: ``--replay``: steps are also timed as replays of one CUDA graph holding the
#: step (``toolkit.captured_graph``): the GPU time without the host's launches,
#: which regional compile and eager steps pay per kernel.
REPLAY = False


#: torch.compile modes that run the compiled graphs under CUDA graphs.
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compiled(model, mode: str, fullgraph: bool = True, inductor_mode: str = "default"):
    """``model`` compiled whole (``mode="full"``) or block by block in place (``"regional"``:
    the repeated blocks in the ModuleLists that ``compile_ops.patch`` knows), in
    ``torch.compile``'s ``inductor_mode`` ("default", "reduce-overhead", ...)."""
    from compile_ops.integrations.diffusers import BLOCK_LISTS

    options = dict(mode=inductor_mode) if BACKEND == "inductor" else dict(backend=BACKEND)
    if mode == "full":
        return torch.compile(model, **options)
    for name in BLOCK_LISTS:
        for block in getattr(model, name, ()):
            block.compile(fullgraph=fullgraph, **options)
    if BACKEND == "inductor" and inductor_mode in CUDA_GRAPH_MODES and not hasattr(model, "_step_begins"):
        # Each compiled block's call would otherwise start a new generation of the CUDA-graph
        # trees, which frees the outputs of the block before it: one generation per step.
        hook = model.register_forward_pre_hook(lambda *_: torch.compiler.cudagraph_mark_step_begin())
        model._step_begins = hook
    return model


def uncompiled(model) -> None:
    """Undo ``compiled(model, "regional")``: patch() swaps blocks, and a compiled
    block would keep running its old graph."""
    from compile_ops.integrations.diffusers import BLOCK_LISTS

    for name in BLOCK_LISTS:
        for block in getattr(model, name, ()):
            block._compiled_call_impl = None
    if hasattr(model, "_step_begins"):
        model._step_begins.remove()
        del model._step_begins


def measure(fn, timer_ms: float):
    """(median ms, peak MiB above the memory in use before the call); on the CPU
    (smoke runs) :func:`host_ms` and no peak."""
    if DEVICE == "cpu":
        return host_ms(fn), None
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    return do_bench(fn, warmup=timer_ms / 4, rep=timer_ms, return_mode="median"), peak


def _tensor_bytes(t) -> int:
    """The bytes ``t`` holds: a wrapper subclass (torchao's Float8Tensor) counts its
    inner tensors, not ``numel`` times the size of the dtype it presents."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        return sum(_tensor_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


def weight_MiB(model) -> float:
    """The MiB that ``model``'s parameters and buffers hold (quantized ones at their stored size)."""
    return sum(_tensor_bytes(t) for t in (*model.parameters(), *model.buffers())) / 2**20


def host_ms(fn, calls: int = 5) -> float:
    """Median ms for ``fn`` to return (its launches queued, the GPU not waited
    for), from an idle GPU: near the step's time, the step is bound by the
    host (or by the launch queue filling); well below it, by the GPU."""
    times = []
    for _ in range(calls):
        synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    synchronize()
    return sorted(times)[calls // 2]


def synchronize() -> None:
    """Wait for the GPU (nothing to wait for on the CPU)."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def repeated(fn, timer_ms: float, repeats: int) -> dict:
    """Median, min and max of ``repeats`` do_bench medians, the peak memory,
    :func:`host_ms`, and under ``--replay`` the same medians of the step's
    CUDA-graph replay (``replay_ms``...)."""
    runs = [measure(fn, timer_ms) for _ in range(repeats)]
    times = sorted(ms for ms, _ in runs)
    row = {
        "ms": times[len(times) // 2],
        "ms_min": times[0],
        "ms_max": times[-1],
        "ms_runs": times,
        "peak_MiB": None if DEVICE == "cpu" else max(peak for _, peak in runs),
        "host_ms": host_ms(fn),
    }
    if REPLAY:
        replay = captured_graph(fn, warmups=2)
        times = sorted(measure(replay, timer_ms)[0] for _ in range(repeats))
        row.update(replay_ms=times[len(times) // 2], replay_ms_min=times[0], replay_ms_max=times[-1])
    return row


def profiled(row: dict, fn, profile: bool) -> None:
    """With ``--profile``: the step's GPU time by kernel family into ``row``, and printed."""
    if not profile:
        return
    row["kernels"] = kernel_profile(fn, top=20)
    families = "  ".join(f"{f} {ms:.1f}" for f, ms in row["kernels"]["families"].items())
    print(f"    GPU {row['kernels']['gpu_ms']:.1f} ms: {families}", flush=True)
    for name, ms, launches in row["kernels"]["top"]:
        print(f"      {ms:7.2f} ms {launches:4d}x {name}", flush=True)


def diffusers_environment() -> dict:
    """Warm the GPU up and return the run's environment with diffusers' version
    (what every diffusers runner records)."""
    import diffusers

    if DEVICE == "cpu":  # a smoke run
        env = {"gpu": "cpu", "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    else:
        warm_up_gpu()
        env = environment()
    env["diffusers"] = diffusers.__version__
    return env
