"""End-to-end benchmark: diffusers transformers with and without compile_ops.patch.

    PYTHONPATH=. python bench/runners/diffusers_e2e.py [--cases flux_step,wan_step,flux_train] [--out bench/results]

Full-size configs with random weights (nothing is downloaded), bf16, batch 1
(bench/runners/diffusers_models.py builds them):

- ``flux_step``: FluxTransformer2DModel (Flux.1-dev: 19 double + 38 single
  blocks, 3072 wide), one denoising forward at 1024x1024 (4096 image + 512
  text tokens).
- ``wan_step``: WanTransformer3DModel (Wan 2.1 1.3B: 30 blocks, 1536 wide),
  one denoising forward at 480p x 81 frames (21 x 30 x 52 = 32760 tokens).
- ``flux_train``: a Flux-size block stack (2 double + 4 single blocks, with
  the embedders and final norm), forward + backward of a mean-square loss at
  4096 + 512 tokens, parameters trainable.

FP8 inference (``--fp8``, the step cases): more providers, each on a
freshly built model, since they quantize in place and release the bf16
weights: ``fp8_compiled`` (``compile_ops.patch(model, precision="fp8")`` +
``torch.compile``), ``fp8_fp32_accum_compiled`` (the same with
``fp8_fast_accum=False``), ``fp8_modulation_compiled`` (with
``fp8_modulation=True``: the AdaLN modulation projections in FP8 too),
``fp8_int8_attention_compiled`` (with ``attention_precision="int8"``: 8-bit
attention too, a second approximation whose cost the step error shows),
``fp8_int8_fp8_attention_compiled`` (``attention_precision="int8_fp8"``: P V in
FP8 as well), ``fp8_fused_qkv_compiled`` (diffusers' ``fuse_qkv_projections()``
first, flux-fast's recipe: one FP8 GEMM for each q/k/v triple) and
``torchao_fp8_compiled`` (torchao's
``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` +
``torch.compile``, what users install today). Their rows also give the step
output's relative L2 error against the bf16 model's output on the same
inputs, each block Linear's own error under the provider's recipe (on the
bf16 model's input to it: median, max and the worst Linear), and the bytes
of the model's weights.

``--repeats N`` measures every provider N times (do_bench medians) and
reports the median of those and their spread, and the host time of a call
(near the step's time: the step is bound by launching its kernels).
``--replay`` also times each step as the replay of one CUDA graph holding
it (``replay_ms``): the GPU time alone, whatever a provider's launch cost.
``--providers a,b`` runs only those. ``--inductor-modes default,reduce-overhead``
runs the compiled providers in each of those ``torch.compile`` modes, side by
side (with ``cudagraph_skips``: Inductor's count of graphs it ran without CUDA
graphs); with ``--fp8``, the FP8 providers too (in the FP8 file).
``--compile regional`` compiles each transformer block in place
(``block.compile(fullgraph=True)``; blocks of one class share one compiled
graph, as in diffusers' ``compile_repeated_blocks``) instead of the whole
model: the same kernels in the blocks, minutes less compiling (torchao's
float8 Flux takes 8 minutes whole); every compiled provider of a run uses the
same mode, recorded in its rows.

Training runs SDPA without its cuDNN backend: torch 2.11's cuDNN attention
backward fails at this shape (``mha_graph.execute(...).is_good()``), so the
native step uses SDPA's flash backend. Each case runs native eager, native
``torch.compile`` (default mode), patched eager and patched compiled, one
model patched in place between the two halves. Times are medians of ``triton.testing.do_bench``; the peak memory is
the allocator's peak during one call above what was allocated before it.
Writes ``<out>/diffusers-e2e-<gpu>.json`` (``--fp8``: ``diffusers-e2e-fp8-<gpu>.json``,
with torchao's version; rows merge with an existing file by case, provider and compile mode).

8-bit attention (``--int8-attention``, the step cases): native compiled
(SDPA, cuDNN), patched compiled (our bf16 attention), patched with
``attention_precision="int8"`` and ``"int8_fp8"`` compiled (the latter once more with q and k
quantized by attention at every length, ``int8_fp8_attention_quant_in_attention_compiled``,
where the default quantizes them in their rotation from 8192 tokens up), and SageAttention 1.0.6 in place of
SDPA (its blocks compiled with graph breaks), each on a fresh model, with
the step output's relative L2 to the bf16 model's eager output:
``diffusers-e2e-int8-<gpu>.json``.

LoRA (``--lora``, the step cases): native compiled and ``patch(precision="fp8")``
compiled, plain, with a random LoRA, and after hotswapping a second one
(bench/runners/diffusers_lora.py holds the case): ``diffusers-e2e-lora-<gpu>.json``.
With ``--inductor-modes reduce-overhead`` (one mode) every step runs under CUDA graphs, its
rows' ``compile`` saying so. ``--cases flux_step_tiny --backend eager`` runs it on a tiny Flux, on the CPU
too (timed by the wall clock there): a smoke run.

This module holds the bf16, FP8 and 8-bit attention cases and ``main``;
bench/runners/diffusers_timing.py the compiling and timing it shares with the
other diffusers runners, and the settings ``main`` sets there from
``--backend`` and ``--replay``.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from bench.runners import diffusers_timing as timing  # noqa: E402
from bench.runners.diffusers_lora import run_lora_case  # noqa: E402
from bench.runners.diffusers_models import CASES, EXTRA_CASES, build, tokens  # noqa: E402
from bench.tables.diffusers_e2e import INT8_PROVIDERS  # noqa: E402
from bench.toolkit import relative_l2, results_path, write_results  # noqa: E402

#: ``--attention-kernel``: what the bf16 patched providers pass to ``compile_ops.patch``.
ATTENTION_KERNEL = "auto"


def _mib(peak) -> str:
    """A row's peak memory for the progress line: none is measured on the CPU (smoke runs)."""
    return "       -" if peak is None else f"{peak:8.0f}"


def _quantize(provider: str, model):
    """Quantize ``model`` in place for an FP8 provider; the patch report, if any."""
    if provider != "torchao_fp8_compiled":  # ours: FP8_PROVIDERS' other entries
        import compile_ops

        if provider == "fp8_fused_qkv_compiled":
            model.fuse_qkv_projections()
        return compile_ops.patch(
            model,
            precision="fp8",
            fp8_fast_accum=provider != "fp8_fp32_accum_compiled",
            fp8_modulation=provider == "fp8_modulation_compiled",
            attention_precision=FP8_ATTENTION.get(provider, "exact"),
        )
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return None


def _fp8_recipe(provider: str):
    """``linear -> quantized module`` for an FP8 provider (one Linear at a time)."""
    if provider == "torchao_fp8_compiled":
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

        def torchao(linear):
            # A fresh Linear, not a deepcopy: a copy would keep the measuring hook.
            twin = torch.nn.Linear(
                linear.in_features,
                linear.out_features,
                linear.bias is not None,
                device=linear.weight.device,
                dtype=linear.weight.dtype,
            )
            twin.load_state_dict(linear.state_dict())
            quantize_(twin, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
            return twin

        return torchao
    from compile_ops import FP8Linear

    return lambda linear: FP8Linear.from_linear(linear, fast_accum=provider != "fp8_fp32_accum_compiled")


def _per_linear_errors(model, inputs, providers) -> tuple:
    """The bf16 step output, and per FP8 provider the error of each block
    Linear alone: during one bf16 forward, every Linear in the transformer
    blocks (AdaLN modulation projections aside: one row, not quantized by
    compile_ops) is also run through each provider's recipe on the same
    input, and its relative L2 distance to the bf16 output kept. Errors do
    not compound through depth here, unlike the step output's.

    Returns ``(output, {provider: {"median", "max", "worst", "linears"}})``."""
    from compile_ops.integrations.diffusers import BLOCK_LISTS

    recipes = {}
    for p in providers:
        try:
            recipes[p] = _fp8_recipe(p)
        except ImportError:  # torchao missing: its row says so
            pass
    errors = {p: {} for p in recipes}

    def hook(path):
        def measure(linear, args, output):
            for p, recipe in recipes.items():
                errors[p][path] = relative_l2(recipe(linear)(args[0]), output)

        return measure

    handles = []
    for list_name in BLOCK_LISTS:
        for path, m in getattr(model, list_name, torch.nn.Module()).named_modules(prefix=list_name):
            if type(m) is torch.nn.Linear and ".norm" not in path and m.in_features % 16 == m.out_features % 16 == 0:
                handles.append(m.register_forward_hook(hook(path)))
    try:
        with torch.no_grad():
            out = model(**inputs).sample.detach().clone()
    finally:
        for h in handles:
            h.remove()
    summary = {}
    for p, by_path in errors.items():
        values = sorted(by_path.values())
        summary[p] = {
            "median": values[len(values) // 2],
            "max": values[-1],
            "worst": max(by_path, key=by_path.get),
            "linears": len(values),
        }
    return out, summary


FP8_PROVIDERS = (
    "fp8_compiled",
    "fp8_modulation_compiled",
    "fp8_fp32_accum_compiled",
    "fp8_int8_attention_compiled",
    "fp8_int8_fp8_attention_compiled",
    "fp8_fused_qkv_compiled",
    "torchao_fp8_compiled",
)
#: The FP8 providers that run 8-bit attention too: their attention_precision.
FP8_ATTENTION = {"fp8_int8_attention_compiled": "int8", "fp8_int8_fp8_attention_compiled": "int8_fp8"}
BF16_PROVIDERS = ("native_eager", "native_compiled", "patched_eager", "patched_compiled")


def run_fp8_providers(
    name: str,
    timer_ms: float,
    repeats: int,
    exact,
    providers,
    compile_mode: str,
    per_linear: dict,
    profile: bool = False,
    inductor_mode: str = "default",
) -> list:
    """The FP8 providers in ``providers`` on fresh models, compiled in
    ``inductor_mode``; ``exact`` is the bf16 model's output on the same
    inputs, ``per_linear`` :func:`_per_linear_errors`'."""
    rows = []
    for provider in (p for p in FP8_PROVIDERS if p in providers):
        model, inputs = build(name)
        try:
            report = _quantize(provider, model)
        except ImportError as e:  # torchao not installed: say so in the results
            rows.append({"case": name, "provider": provider, "error": f"{type(e).__name__}: {e}"})
            print(f"{name:<11} {provider:<21} skipped: {e}", flush=True)
            continue
        module = timing.compiled(model, compile_mode, inductor_mode=inductor_mode)
        skips_before = counters["inductor"]["cudagraph_skips"]
        with torch.no_grad():
            start = time.perf_counter()
            out = module(**inputs).sample  # compiles
            setup_s = time.perf_counter() - start
            err = relative_l2(out, exact)
            row = timing.repeated(lambda m=module: m(**inputs).sample, timer_ms, repeats)
            timing.profiled(row, lambda m=module: m(**inputs).sample, profile)
        row.update(
            case=name,
            provider=provider,
            first_call_s=setup_s,
            rel_l2_vs_bf16=err,
            train=False,
            tokens=tokens(name),
            weights_MiB=timing.weight_MiB(model),
            compile=_compile_label(compile_mode, inductor_mode),
        )
        if inductor_mode != "default":
            row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips_before
        if report is not None:
            row["fp8_linears"] = sum("FP8Linear" in detail for _, _, detail in report.replaced)
        if provider in per_linear:
            row["per_linear_rel_l2"] = per_linear[provider]
        rows.append(row)
        print(
            f"{name:<11} {provider:<21} {row['ms']:9.2f} ms ({row['ms_min']:.2f}-{row['ms_max']:.2f}, "
            f"host {row['host_ms']:.1f})  "
            f"rel. L2 vs bf16 {err:.2e}  weights {row['weights_MiB']:.0f} MiB  (first call {setup_s:.0f} s)",
            flush=True,
        )
        if "replay_ms" in row:
            print(
                f"{'':<11} {provider:<21} {row['replay_ms']:9.2f} ms ({row['replay_ms_min']:.2f}-"
                f"{row['replay_ms_max']:.2f}) as a CUDA-graph replay",
                flush=True,
            )
        del model, module
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return rows


def run_case(
    name: str,
    timer_ms: float,
    repeats: int = 1,
    fp8: bool = False,
    providers=None,
    compile_mode: str = "full",
    profile: bool = False,
    inductor_mode: str = "default",
) -> list:
    import compile_ops

    _, train = {**CASES, **EXTRA_CASES}[name]
    model, inputs = build(name)
    torch.backends.cuda.enable_cudnn_sdp(not train)

    def step(module):
        if not train:
            with torch.no_grad():
                return module(**inputs).sample
        loss = module(**inputs).sample.float().pow(2).mean()
        loss.backward()
        for p in module.parameters():
            p.grad = None
        return loss

    providers = set(providers or (*BF16_PROVIDERS, *FP8_PROVIDERS))
    rows, report = [], None
    exact, per_linear = None, {}
    if fp8 and not train:
        exact, per_linear = _per_linear_errors(model, inputs, [p for p in FP8_PROVIDERS if p in providers])
        for p, e in per_linear.items():
            print(
                f"{name:<11} {p:<21} per-Linear rel. L2 vs bf16: median {e['median']:.2e}, max {e['max']:.2e} "
                f"({e['worst']}; {e['linears']} Linears)",
                flush=True,
            )
    for provider in BF16_PROVIDERS:
        if provider.startswith("patched") and report is None:
            torch._dynamo.reset()
            timing.uncompiled(model)
            report = compile_ops.patch(model, attention_kernel=ATTENTION_KERNEL)
            print(report, flush=True)
        if provider not in providers:
            continue
        compiled = provider.endswith("compiled")
        module = timing.compiled(model, compile_mode, inductor_mode=inductor_mode) if compiled else model
        skips_before = counters["inductor"]["cudagraph_skips"]
        start = time.perf_counter()
        step(module)  # compiles
        setup_s = time.perf_counter() - start
        row = timing.repeated(lambda: step(module), timer_ms, repeats)
        timing.profiled(row, lambda: step(module), profile)
        row.update(
            case=name,
            provider=provider,
            first_call_s=setup_s,
            train=train,
            tokens=tokens(name),
            attention_kernel=ATTENTION_KERNEL if provider.startswith("patched") else None,
            weights_MiB=timing.weight_MiB(model),
            compile=_compile_label(compile_mode, inductor_mode),
        )
        if compiled and inductor_mode != "default":
            # Inductor counts each graph it runs without CUDA graphs ("skipping cudagraphs: ...").
            row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips_before
        rows.append(row)
        print(
            f"{name:<11} {provider:<17} {row['ms']:9.2f} ms ({row['ms_min']:.2f}-{row['ms_max']:.2f}, "
            f"host {row['host_ms']:.1f})  "
            f"peak {_mib(row['peak_MiB'])} MiB  (first call {setup_s:.0f} s)",
            flush=True,
        )
    by = {r["provider"]: r for r in rows}
    for kind in ("compiled", "eager"):
        if f"native_{kind}" in by and f"patched_{kind}" in by:
            print(
                f"{name}: patched {kind} {by[f'native_{kind}']['ms'] / by[f'patched_{kind}']['ms']:.3f}x native {kind}",
                flush=True,
            )
    for r in rows:
        r["patched"] = {"replaced": len(report.replaced), "left": len(report.left)}
    del model
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    if exact is not None:
        rows += run_fp8_providers(
            name, timer_ms, repeats, exact, providers, compile_mode, per_linear, profile, inductor_mode
        )
    return rows


def _compile_label(compile_mode: str, inductor_mode: str) -> str:
    """A row's ``compile``: the compile mode, and torch.compile's mode where it is not the default."""
    return compile_mode if inductor_mode == "default" else f"{compile_mode}+{inductor_mode}"


#: The provider whose q and k attention quantizes at every length (the
#: rotation's quantizing mode off), beside int8_fp8_attention_compiled.
QUANT_IN_ATTENTION = "int8_fp8_attention_quant_in_attention_compiled"


def _sage_sdpa():
    """SDPA's signature over SageAttention 1.0.6's ``sageattn`` (8-bit QK per
    block, fp16 PV, Triton), as its README plugs it into models."""
    from sageattention import sageattn

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or dropout_p:
            raise ValueError("sageattn takes no mask and no dropout")
        return sageattn(query, key, value, tensor_layout="HND", is_causal=is_causal, sm_scale=scale)

    return sdpa


def run_int8_attention_case(
    name: str, timer_ms: float, repeats: int, providers, compile_mode: str, profile: bool = False
) -> list:
    """Each of INT8_PROVIDERS (those in ``providers``) on a fresh model; rows
    with the step output's relative L2 to the bf16 model with SDPA (eager)."""
    import compile_ops
    from compile_ops.integrations.diffusers import processors

    model, inputs = build(name)
    with torch.no_grad():
        exact = model(**inputs).sample
    del model
    rows = []
    min_tokens = processors.QUANTIZE_IN_ROTATION_MIN_TOKENS
    for provider in (p for p in INT8_PROVIDERS if p in (providers or INT8_PROVIDERS)):
        model, inputs = build(name)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        try:
            if provider == "patched_compiled":
                compile_ops.patch(model)
            elif provider in ("int8_attention_compiled", "int8_fp8_attention_compiled", QUANT_IN_ATTENTION):
                compile_ops.patch(
                    model, attention_precision="int8" if provider.startswith("int8_attention") else "int8_fp8"
                )
                if provider == QUANT_IN_ATTENTION:
                    processors.QUANTIZE_IN_ROTATION_MIN_TOKENS = 2**62
            elif provider == "sage_attention_compiled":
                torch.nn.functional.scaled_dot_product_attention = _sage_sdpa()
            # SageAttention's launcher is not traceable whole: its blocks compile with graph breaks.
            module = timing.compiled(model, compile_mode, fullgraph=provider != "sage_attention_compiled")
            with torch.no_grad():
                start = time.perf_counter()
                out = module(**inputs).sample  # compiles
                setup_s = time.perf_counter() - start
                row = timing.repeated(lambda m=module: m(**inputs).sample, timer_ms, repeats)
                timing.profiled(row, lambda m=module: m(**inputs).sample, profile)
        except Exception as e:  # noqa: BLE001 (a peer that fails is a result; the others still run)
            rows.append({"case": name, "provider": provider, "error": f"{type(e).__name__}: {e}"[:500]})
            print(f"{name:<11} {provider:<24} error: {rows[-1]['error'][:300]}", flush=True)
            continue
        finally:
            torch.nn.functional.scaled_dot_product_attention = sdpa
            processors.QUANTIZE_IN_ROTATION_MIN_TOKENS = min_tokens
        row.update(
            case=name,
            provider=provider,
            first_call_s=setup_s,
            rel_l2_vs_bf16=relative_l2(out, exact),
            train=False,
            tokens=tokens(name),
            compile=compile_mode,
        )
        rows.append(row)
        print(
            f"{name:<11} {provider:<24} {row['ms']:9.2f} ms ({row['ms_min']:.2f}-{row['ms_max']:.2f}, "
            f"host {row['host_ms']:.1f})  "
            f"rel. L2 vs bf16 SDPA {row['rel_l2_vs_bf16']:.2e}  (first call {setup_s:.0f} s)",
            flush=True,
        )
        del model, module
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return rows


def _version(package: str):
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _row_key(row: dict) -> tuple:
    """A results row's identity: a provider's rows in another compile mode, or patched with another
    attention kernel, are other rows."""
    return row["case"], row["provider"], row.get("compile", "full"), row.get("attention_kernel") or "auto"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--rep-ms", type=float, default=3000.0, help="do_bench's time budget per measurement")
    p.add_argument("--repeats", type=int, default=1, help="measurements per provider (median and spread)")
    p.add_argument(
        "--providers", default=None, help="comma-separated subset of " + ",".join((*BF16_PROVIDERS, *FP8_PROVIDERS))
    )
    p.add_argument(
        "--compile",
        dest="compile_mode",
        choices=("full", "regional"),
        default="full",
        help="compile the whole model, or each transformer block in place",
    )
    p.add_argument(
        "--inductor-modes",
        default="default",
        help="comma-separated torch.compile modes (default,reduce-overhead,max-autotune...) for the "
        "compiled providers, each a row of its own, in diffusers-e2e-modes-<gpu>.json unless default "
        "(with --lora: one mode, in the LoRA file)",
    )
    p.add_argument(
        "--attention-kernel",
        default="auto",
        choices=("auto", "fused", "sdpa"),
        help="compile_ops.patch's attention_kernel for the bf16 patched providers",
    )
    p.add_argument(
        "--replay",
        action="store_true",
        help="also time each step as the replay of one CUDA graph holding it (GPU time, no host cost)",
    )
    p.add_argument(
        "--fp8", action="store_true", help="also compile_ops FP8 and torchao float8 providers on the inference cases"
    )
    p.add_argument(
        "--int8-attention",
        action="store_true",
        help="only the 8-bit attention comparison (INT8_PROVIDERS) on the inference cases",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also each step's GPU time by kernel family and its top kernels (torch.profiler)",
    )
    p.add_argument(
        "--lora",
        action="store_true",
        help="only the LoRA comparison (LORA_PROVIDERS: plain, with a rank-64 LoRA, after a hotswap) "
        "on the inference cases",
    )
    p.add_argument(
        "--backend", default="inductor", help="torch.compile's backend (eager: Dynamo alone, for smoke runs)"
    )
    args = p.parse_args(argv)
    modes = args.inductor_modes.split(",")
    if modes != ["default"] and args.int8_attention:
        p.error("--inductor-modes runs the bf16 and FP8 providers: not with --int8-attention")
    if args.lora and len(modes) > 1:
        p.error("--lora runs in one --inductor-modes mode (its rows say which)")
    if args.lora and (args.fp8 or args.int8_attention):
        p.error("--lora is a comparison of its own: not with --fp8 or --int8-attention")
    global ATTENTION_KERNEL
    ATTENTION_KERNEL = args.attention_kernel
    timing.REPLAY, timing.BACKEND = args.replay, args.backend
    env = timing.diffusers_environment()
    env["command"] = "python bench/runners/diffusers_e2e.py " + " ".join(argv if argv is not None else sys.argv[1:])
    stem = "diffusers-e2e"
    if args.fp8:  # the FP8 comparison has its own file, with the peer's version
        import torchao

        stem, env["torchao"] = "diffusers-e2e-fp8", torchao.__version__
    if args.int8_attention:  # its own file too, with the peer's version
        stem, env["sageattention"] = "diffusers-e2e-int8", _version("sageattention")
    if modes != ["default"] and not (args.lora or args.fp8):  # the compile-mode comparison has its own file
        stem = "diffusers-e2e-modes"
    if args.lora:
        stem = "diffusers-e2e-lora"
    path = results_path(args.out, stem, env)
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            rows = json.load(f)["rows"]
    for name in args.cases.split(","):  # written after each case: a later one may run out of time
        chosen = args.providers.split(",") if args.providers else None
        if args.int8_attention:
            new = run_int8_attention_case(name, args.rep_ms, args.repeats, chosen, args.compile_mode, args.profile)
        elif args.lora:
            new = run_lora_case(
                name, args.rep_ms, args.repeats, chosen, args.compile_mode, args.profile, inductor_mode=modes[0]
            )
        else:
            new = [
                row
                for mode in modes
                for row in run_case(
                    name, args.rep_ms, args.repeats, args.fp8, chosen, args.compile_mode, args.profile, mode
                )
            ]
        # A file may hold rows of several runs (it is read back and merged): each row names its own.
        new = [dict(row, command=env["command"], date=env["date"]) for row in new]
        measured = {_row_key(r) for r in new}
        rows = [r for r in rows if _row_key(r) not in measured] + new
        write_results(args.out, stem, env, rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
