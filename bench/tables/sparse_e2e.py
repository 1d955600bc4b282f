"""The table of bench/runners/sparse_e2e.py's JSON: the video step with sparse attention layouts."""

from bench.tables import run_line


def is_sparse_e2e(data: dict) -> bool:
    """bench/runners/sparse_e2e.py's JSON."""
    return any(r.get("provider") == "sparse_compiled" for r in data["rows"])


def sparse_e2e_table(data: dict) -> str:
    """Markdown: sparse self-attention against native compiled dense per case,
    with the density and the accuracy cost (random and smooth latents)."""
    env = data["env"]
    by = {(r["case"], r["provider"]): r for r in data["rows"]}
    out = [
        run_line(env, f"diffusers {env.get('diffusers', '?')}") + " | bf16, batch 1, random weights, "
        "blocks compiled in place.",
        "",
        "Median ms (min-max over the repeats). Errors: relative L2 to dense; attention = each layer's sparse "
        "output against dense SDPA on the same q/k/v, median (max) over the layers; random / smooth latents.",
        "",
        "| case | tokens | provider | ms | vs native compiled | density | step error | attention error |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for case in dict.fromkeys(r["case"] for r in data["rows"]):
        native = by.get((case, "native_compiled"))
        sparse = [p for c, p in by if c == case and p.startswith("sparse")]
        for provider in ("native_compiled", *sparse):
            r = by.get((case, provider))
            if r is None:
                continue
            speed = f"{native['ms'] / r['ms']:.2f}x" if native else "-"
            if provider != "native_compiled":
                att, att_s = r["attention_rel_l2"], r["attention_rel_l2_smooth"]
                extra = (
                    f"{r['density']:.1%} | {r['step_rel_l2']:.2e} / {r['step_rel_l2_smooth']:.2e} | "
                    f"{att['median']:.2e} ({att['max']:.2e}) / {att_s['median']:.2e} ({att_s['max']:.2e})"
                )
                options = "".join(f", {k}={v!r}" for k, v in r.get("options", {}).items())
                provider = f"{provider}, {r['preset']}{options}"
            else:
                extra = "100% | - | -"
            out.append(
                f"| {case} | {r['tokens']} | {provider} | {r['ms']:.1f} ({r['ms_min']:.1f}-{r['ms_max']:.1f}) "
                f"| {speed} | {extra} |"
            )
    return "\n".join(out) + "\n"
