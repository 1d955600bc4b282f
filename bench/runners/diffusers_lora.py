"""The LoRA case of bench/runners/diffusers_e2e.py (``--lora``, the step cases).

Native compiled and ``patch(precision="fp8")`` compiled (``LORA_PROVIDERS``),
each on a fresh model, three rows apiece: the plain step; the step with a
random rank-``LORA_RANK`` LoRA on every attention and MLP Linear of the blocks
(``enable_lora_hotswap(target_rank=LORA_RANK)`` before loading and compiling;
each delta about ``LORA_DELTA`` of its Linear's output), ``*_lora_compiled``;
and the step after ``load_lora_adapter(..., hotswap=True)`` of a second such
LoRA from host memory, ``*_lora_swapped_compiled``, with the swap's wall
seconds and the graphs Dynamo compiled after it (none: no recompile). Then the
way a server runs a LoRA at the plain step's cost: ``fuse_lora``
(``*_lora_fused_compiled``; FP8 requantizes each merged weight, and the merged
layers' graphs compile once, counted), and a fused swap back to the first LoRA
(``unfuse_lora``, ``load_lora_adapter(..., hotswap=True)``, ``fuse_lora``;
``*_lora_fused_swapped_compiled``, timed and counted as the swap above). FP8
rows give the step error against the native row in the same state.
:func:`run_lora_case` runs it; diffusers_e2e.py's ``main`` writes the rows to
``diffusers-e2e-lora-<gpu>.json``.
"""

import time

import torch
from torch._dynamo.utils import counters

from bench.runners.diffusers_models import DEVICE, DTYPE, build, tokens
from bench.runners.diffusers_timing import compiled, profiled, repeated, synchronize, uncompiled, weight_MiB
from bench.toolkit import relative_l2

#: ``--lora``: the adapters' rank, and the size of each delta ``B A`` against its Linear's weight
#: (Frobenius norms): about the share of the Linear's output the LoRA moves.
LORA_RANK = 64
LORA_DELTA = 0.03
#: ``--lora``: the step's providers; each gives its plain row and one row per LoRA state of ``SUFFIXES``.
LORA_PROVIDERS = ("native_compiled", "fp8_compiled")
#: The LoRA states in the order they run, and their rows' provider suffixes (``{base}_lora{suffix}_compiled``).
SUFFIXES = {"lora": "", "swapped": "_swapped", "fused": "_fused", "fused_swapped": "_fused_swapped"}


def _lora_targets(model) -> dict:
    """``{path: nn.Linear}``: the attention and MLP Linears of the transformer
    blocks (the AdaLN modulation projections, ``*.norm*.linear``, aside)."""
    from compile_ops.integrations.diffusers import BLOCK_LISTS

    return {
        path: m
        for list_name in BLOCK_LISTS
        for path, m in getattr(model, list_name, torch.nn.Module()).named_modules(prefix=list_name)
        if type(m) is torch.nn.Linear and ".norm" not in path
    }


@torch.no_grad()
def random_lora(targets: dict, seed: int) -> dict:
    """A rank-``LORA_RANK`` LoRA on ``targets`` (:func:`_lora_targets`), diffusers'
    layout, bf16, in host memory (where a LoRA file is read into): per Linear
    ``W [N, K]``, ``lora_A [r, K] ~ N(0, 1/K)`` and ``lora_B [N, r] ~ N(0, s^2)``
    with ``s = LORA_DELTA |W| / sqrt(N r)``, so that ``|B A| ~ LORA_DELTA |W|``
    (alpha = rank: scaling 1). Drawn on the model's device from ``seed``."""
    first = next(iter(targets.values())).weight
    generator = torch.Generator(first.device).manual_seed(seed)
    lora = {}
    for path, linear in targets.items():
        n, k = linear.weight.shape
        spread = LORA_DELTA * linear.weight.float().norm().item() / (n * LORA_RANK) ** 0.5
        a = torch.randn(LORA_RANK, k, generator=generator, device=first.device) / k**0.5
        b = torch.randn(n, LORA_RANK, generator=generator, device=first.device) * spread
        lora[f"{path}.lora_A.weight"], lora[f"{path}.lora_B.weight"] = a.to(DTYPE).cpu(), b.to(DTYPE).cpu()
    return lora


def _timed_step(name: str, provider: str, step, timer_ms: float, repeats: int) -> tuple:
    """``(row, output)``: ``step``'s first call (compiling; ``first_call_s``), then :func:`repeated`."""
    with torch.no_grad():
        start = time.perf_counter()
        out = step().clone()  # kept across calls: a CUDA graph's next replay overwrites its output
        synchronize()
        first_call_s = time.perf_counter() - start
        row = repeated(step, timer_ms, repeats)
    row.update(case=name, provider=provider, first_call_s=first_call_s, train=False, tokens=tokens(name))
    return row, out


def run_lora_case(
    name: str,
    timer_ms: float,
    repeats: int,
    providers,
    compile_mode: str,
    profile: bool = False,
    inductor_mode: str = "default",
) -> list:
    """Each of LORA_PROVIDERS (those in ``providers``) on a fresh model: the
    plain step, with a LoRA, and after hotswapping a second LoRA (module
    docstring); the FP8 rows' errors against the native rows of this run.
    ``profile``: the plain and LoRA steps' kernels by family (``--profile``).
    ``inductor_mode``: torch.compile's mode for every step ("reduce-overhead":
    CUDA graphs, which take the host's launch cost out of the step; the
    hotswap then writes into the weights the recorded graphs read)."""
    import compile_ops

    rows, reference, loras = [], {}, None
    for provider in (p for p in LORA_PROVIDERS if p in (providers or LORA_PROVIDERS)):
        model, inputs = build(name)
        if loras is None:  # the same LoRAs for every provider: drawn from the bf16 weights
            targets = _lora_targets(model)
            loras = [random_lora(targets, seed) for seed in (1, 2)]
        if provider == "fp8_compiled":
            compile_ops.patch(model, precision="fp8")
        base = provider.removesuffix("_compiled")
        labels = {"plain": provider, **{state: f"{base}_lora{suffix}_compiled" for state, suffix in SUFFIXES.items()}}
        new, outputs = [], {}

        def measure(state, step):
            skips_before = counters["inductor"]["cudagraph_skips"]  # this state's graphs only
            row, outputs[state] = _timed_step(name, labels[state], step, timer_ms, repeats)
            mode = compile_mode if inductor_mode == "default" else f"{compile_mode}+{inductor_mode}"
            row.update(compile=mode, weights_MiB=weight_MiB(model))
            if inductor_mode != "default":
                # Inductor counts each graph it runs without CUDA graphs ("skipping cudagraphs: ...").
                row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips_before
            with torch.no_grad():
                profiled(row, step, profile and state in ("plain", "lora", "fused"))
            new.append(row)
            return row

        module = compiled(model, compile_mode, inductor_mode=inductor_mode)
        measure("plain", lambda: module(**inputs).sample)
        uncompiled(model)
        torch._dynamo.reset()
        model.enable_lora_hotswap(target_rank=LORA_RANK)
        start = time.perf_counter()
        model.load_lora_adapter(dict(loras[0]), prefix=None, adapter_name="lora")
        synchronize()
        load_s = time.perf_counter() - start
        module = compiled(model, compile_mode, inductor_mode=inductor_mode)
        measure("lora", lambda: module(**inputs).sample).update(load_s=load_s)

        def changed(state, *calls):
            graphs = counters["stats"]["unique_graphs"]
            synchronize()
            start = time.perf_counter()
            for call in calls:
                call()
            synchronize()
            seconds = time.perf_counter() - start
            row = measure(state, lambda: module(**inputs).sample)
            return row, seconds, counters["stats"]["unique_graphs"] - graphs

        def hotswap(lora):
            return lambda: model.load_lora_adapter(dict(lora), prefix=None, adapter_name="lora", hotswap=True)

        swapped, swap_s, compiled_after = changed("swapped", hotswap(loras[1]))
        swapped.update(swap_s=swap_s, graphs_compiled_after_swap=compiled_after)
        fused, fuse_s, compiled_at_fuse = changed("fused", model.fuse_lora)
        fused.update(fuse_s=fuse_s, graphs_compiled_at_fuse=compiled_at_fuse)
        swap_back_fused = (model.unfuse_lora, hotswap(loras[0]), model.fuse_lora)
        fused_swapped, swap_s, compiled_after = changed("fused_swapped", *swap_back_fused)
        fused_swapped.update(swap_s=swap_s, graphs_compiled_after_swap=compiled_after)
        for row in new[1:]:
            row.update(lora_rank=LORA_RANK, lora_linears=len(loras[0]) // 2, lora_delta=LORA_DELTA)
        new[1]["lora_moves_output"] = relative_l2(outputs["lora"], outputs["plain"])
        new[2]["swap_moves_output"] = relative_l2(outputs["swapped"], outputs["lora"])
        fused["fuse_moves_output"] = relative_l2(outputs["fused"], outputs["swapped"])  # the merged weights' rounding
        fused_swapped["swap_moves_output"] = relative_l2(outputs["fused_swapped"], outputs["fused"])
        for row in new[1:]:
            row["lora_cost"] = row["ms"] / new[0]["ms"] - 1  # the step's time the LoRA adds
        if provider == "native_compiled":
            reference = outputs
        elif reference:
            for state, row in zip(("plain", *SUFFIXES), new):
                row.update(rel_l2_vs_bf16=relative_l2(outputs[state], reference[state]), reference="native")
        for row in new:
            error = f"  rel. L2 vs native {row['rel_l2_vs_bf16']:.2e}" if "rel_l2_vs_bf16" in row else ""
            swap = (
                f"  swap {row['swap_s']:.2f} s, {row['graphs_compiled_after_swap']} graphs compiled after it"
                if "swap_s" in row
                else f"  fuse {row['fuse_s']:.2f} s, {row['graphs_compiled_at_fuse']} graphs compiled"
                if "fuse_s" in row
                else ""
            )
            print(
                f"{name:<11} {row['provider']:<28} {row['ms']:9.2f} ms ({row['ms_min']:.2f}-{row['ms_max']:.2f}, "
                f"host {row['host_ms']:.1f}){error}{swap}  (first call {row['first_call_s']:.0f} s)",
                flush=True,
            )
        rows += new
        del model, module
        torch._dynamo.reset()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return rows
