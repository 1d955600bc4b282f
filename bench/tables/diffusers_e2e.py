"""The tables of bench/runners/diffusers_e2e.py's JSON: the model step per provider, its 8-bit
attention and FP8 variants."""

from bench.tables import run_line

#: ``diffusers_e2e.py --int8-attention``'s providers, in the table's order: the step with 8-bit
#: attention against bf16 attention and SageAttention, all compiled the same way.
INT8_PROVIDERS = (
    "native_compiled",
    "patched_compiled",
    "int8_attention_compiled",
    "int8_fp8_attention_compiled",
    "int8_fp8_attention_quant_in_attention_compiled",
    "sage_attention_compiled",
)


def is_diffusers_e2e(data: dict) -> bool:
    """bench/runners/diffusers_e2e.py's JSON."""
    return any("case" in r for r in data["rows"])


def is_diffusers_e2e_int8(data: dict) -> bool:
    """diffusers_e2e.py --int8-attention's JSON."""
    return any(r.get("provider") == "int8_attention_compiled" for r in data["rows"])


def diffusers_e2e_int8_table(data: dict) -> str:
    """Markdown: a step with 8-bit attention beside SDPA, our bf16 attention
    and SageAttention, with spreads and each step's distance to the bf16 model."""
    env = data["env"]
    by = {(r["case"], r["provider"]): r for r in data["rows"]}
    cases = list(dict.fromkeys(r["case"] for r in data["rows"]))
    providers = [p for p in INT8_PROVIDERS if any(r["provider"] == p for r in data["rows"])]
    out = [
        run_line(env, f"diffusers {env.get('diffusers', '?')}, sageattention {env.get('sageattention', '?')}")
        + " | bf16, batch 1, random weights, regional compile; ms per step, median of 3 (min-max), and the "
        "step output's relative L2 to the bf16 model in eager mode.",
        "",
        "| case | tokens | " + " | ".join(providers) + " | fastest 8-bit vs native |",
        "|---|---:|" + "---:|" * (len(providers) + 1),
    ]
    for case in cases:
        cells = []
        for p in providers:
            r = by.get((case, p))
            cells.append(
                "-"
                if r is None
                else "err"
                if "error" in r
                else f"{r['ms']:.1f} ({r['ms_min']:.1f}-{r['ms_max']:.1f}), {r['rel_l2_vs_bf16']:.1e}"
            )
        native = by.get((case, "native_compiled"))
        eight_bit = [
            r["ms"]
            for p in ("int8_attention_compiled", "int8_fp8_attention_compiled")
            if "ms" in (r := by.get((case, p), {}))
        ]
        speed = f"{native['ms'] / min(eight_bit):.3f}x" if native and "ms" in native and eight_bit else "-"
        tokens = next((r["tokens"] for (c, _), r in by.items() if c == case and "tokens" in r), "")
        out.append(f"| {case} | {tokens} | " + " | ".join(cells) + f" | {speed} |")
    return "\n".join(out) + "\n"


def is_diffusers_e2e_fp8(data: dict) -> bool:
    """diffusers_e2e.py's JSON of an FP8-only run (``--fp8 --providers native_compiled,...``)."""
    providers = {r.get("provider") for r in data["rows"]}
    return "fp8_compiled" in providers and not providers & {"native_eager", "patched_eager", "patched_compiled"}


def diffusers_e2e_fp8_table(data: dict) -> str:
    """Markdown: the FP8 table alone, under the run's environment line."""
    modes = sorted({r.get("compile", "full") for r in data["rows"]})
    return (
        run_line(
            data["env"], f"diffusers {data['env'].get('diffusers', '?')}, torchao {data['env'].get('torchao', '?')}"
        )
        + f" | bf16, batch 1, random weights, compile: "
        f"{', '.join(modes)}.\n" + _fp8_e2e_table({(r["case"], r["provider"]): r for r in data["rows"]})
    )


def diffusers_e2e_table(data: dict) -> str:
    """Markdown: ms and peak MiB per case for native/patched x eager/compiled,
    and the patched speed-ups."""
    rows, env = data["rows"], data["env"]
    by = {(r["case"], r["provider"]): r for r in rows}
    providers = ("native_eager", "native_compiled", "patched_eager", "patched_compiled")
    out = [
        run_line(env, f"diffusers {env.get('diffusers', '?')}") + " | bf16, batch 1, random weights.",
        "",
        "ms per call (peak MiB above the memory in use before it); compiled = `torch.compile` default mode.",
        "",
        "| case | attention kernel | " + " | ".join(providers) + " | patched vs native, compiled / eager |",
        "|---|---|" + "---:|" * (len(providers) + 1),
    ]
    for case in dict.fromkeys(r["case"] for r in rows):
        cells = [
            f"{by[(case, p)]['ms']:.1f} ({by[(case, p)]['peak_MiB']:.0f})" if (case, p) in by else "-"
            for p in providers
        ]
        speed = "-"
        if all((case, p) in by for p in providers):
            speed = (
                f"{by[(case, 'native_compiled')]['ms'] / by[(case, 'patched_compiled')]['ms']:.2f}x / "
                f"{by[(case, 'native_eager')]['ms'] / by[(case, 'patched_eager')]['ms']:.2f}x"
            )
        kernel = by.get((case, "patched_eager"), {}).get("attention_kernel", "?")
        out.append(f"| {case} | {kernel} | " + " | ".join(cells) + f" | {speed} |")
    return "\n".join(out) + "\n" + _fp8_e2e_table(by)


#: The rows of the FP8 table: bf16 compiled, then the FP8 providers (a row not run is left out).
FP8_TABLE_ROWS = (
    "native_compiled",
    "fp8_compiled",
    "fp8_modulation_compiled",
    "fp8_fp32_accum_compiled",
    "fp8_int8_attention_compiled",
    "fp8_int8_fp8_attention_compiled",
    "torchao_fp8_compiled",
)
#: Rows left out of the FP8 table when they were not run.
OPTIONAL_FP8_ROWS = (
    "fp8_modulation_compiled",
    "fp8_fp32_accum_compiled",
    "fp8_int8_attention_compiled",
    "fp8_int8_fp8_attention_compiled",
)


def _fp8_e2e_table(by: dict) -> str:
    """Markdown: the FP8 providers of ``diffusers_e2e.py --fp8`` beside native
    compiled bf16: median ms (spread over the repeats), speed-ups, the output's
    relative L2 error against bf16, weight memory and the first compiled call."""
    cases = [case for case in dict.fromkeys(c for c, _ in by) if (case, "fp8_compiled") in by]
    if not cases:
        return ""
    out = [
        "",
        "FP8 inference, compiled: median ms (min-max over the repeats); error = the step output's relative "
        "L2 distance to the bf16 model's; per Linear = each block Linear's own error on the bf16 model's "
        "input to it, median (max) over the Linears.",
        "",
        "Graph replay = the same step replayed from one CUDA graph (its GPU time without the host's "
        "launches; `--replay`), vs torchao's replay; host ms = a call's return before the GPU finishes (near "
        "ms: the step waits on launching).",
        "",
        "| case | provider | ms | vs native compiled | vs torchao float8 | graph replay ms | host ms | "
        "rel. L2 vs bf16 | per Linear | weights MiB | peak MiB | first call s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        native, torchao = by.get((case, "native_compiled")), by.get((case, "torchao_fp8_compiled"))
        for provider in FP8_TABLE_ROWS:
            r = by.get((case, provider))
            if r is None and provider in OPTIONAL_FP8_ROWS:
                continue
            if r is None or "error" in r:
                reason = "not run" if r is None else r["error"]
                out.append(f"| {case} | {provider} | {reason} | | | | | | | | | |")
                continue
            spread = f" ({r['ms_min']:.1f}-{r['ms_max']:.1f})" if "ms_min" in r else ""
            vs_native = f"{native['ms'] / r['ms']:.2f}x" if native else "-"
            vs_torchao = f"{torchao['ms'] / r['ms']:.2f}x" if torchao and "error" not in torchao else "-"
            err = f"{r['rel_l2_vs_bf16']:.1e}" if "rel_l2_vs_bf16" in r else "-"
            replay = "-"
            if "replay_ms" in r:
                replay = f"{r['replay_ms']:.1f} ({r['replay_ms_min']:.1f}-{r['replay_ms_max']:.1f})"
                if torchao and "replay_ms" in torchao:
                    replay += f", {torchao['replay_ms'] / r['replay_ms']:.2f}x"
            host = f"{r['host_ms']:.1f}" if "host_ms" in r else "-"
            weights = f"{r['weights_MiB']:.0f}" if "weights_MiB" in r else "not measured"
            per_linear = r.get("per_linear_rel_l2")
            per_linear = f"{per_linear['median']:.1e} ({per_linear['max']:.1e})" if per_linear else "-"
            first = f"{r['first_call_s']:.0f}"
            if "first_call_cold_s" in r:  # the row's own first call found warm caches
                first += f" (cold: {r['first_call_cold_s']:.0f})"
            out.append(
                f"| {case} | {provider} | {r['ms']:.1f}{spread} | {vs_native} | {vs_torchao} | {replay} | "
                f"{host} | {err} | "
                f"{per_linear} | {weights} | {r['peak_MiB']:.0f} | {first} |"
            )
    return "\n".join(out) + "\n"
