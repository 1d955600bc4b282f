"""The tables of bench/runners/aoti.py's JSON: AOTInductor packages, and the compile modes."""

from bench.tables import run_line


def is_aoti(data: dict) -> bool:
    """bench/runners/aoti.py's JSON: a patched model as an AOTInductor package run from C++."""
    return any("aoti_ms" in r for r in data["rows"])


def aoti_table(data: dict) -> str:
    """Markdown: the package's step from C++ against the compiled patched model, and its sizes and times."""
    env = data["env"]
    out = [
        run_line(env, f"diffusers {env.get('diffusers')}") + " | bf16, batch 1, random weights; ms: median "
        "(min-max) of 3 rounds of 10 calls (C++) or 3 do_bench medians (compiled).",
        "",
        "| case | blocks | package GB | compile + package s | C++ load s | AOTI package from C++ ms "
        "| compiled (regional) ms | package vs compiled | rel. L2 vs eager (package; 768 px) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        compiled = r.get("compiled", {})
        out.append(
            f"| {r['case']} | {r['layers'][0]} + {r['layers'][1]} | {r['package_GB']:.1f} | {r['package_s']:.0f} "
            f"| {r['aoti_1024px']['load_s']:.1f} | {r['aoti_ms']:.1f} ({r['aoti_ms_min']:.1f}-{r['aoti_ms_max']:.1f}) "
            f"| {compiled.get('ms', float('nan')):.1f} ({compiled.get('ms_min', float('nan')):.1f}-"
            f"{compiled.get('ms_max', float('nan')):.1f}) | {r.get('aoti_vs_compiled', float('nan')):.2f}x "
            f"| {r['aoti_1024px']['rel_l2_vs_eager']:.1e}; {r['aoti_768px']['rel_l2_vs_eager']:.1e} |"
        )
    return "\n".join(out) + "\n"


def is_compile_modes(data: dict) -> bool:
    """bench/runners/diffusers_e2e.py's JSON from ``--inductor-modes``: a provider in several torch.compile modes."""
    return any("+" in r.get("compile", "") for r in data["rows"])


def compile_modes_table(data: dict) -> str:
    """Markdown: each case's compiled step in every torch.compile mode of the run, against the default mode."""
    env = data["env"]
    out = [
        run_line(env, f"diffusers {env.get('diffusers')}") + " | bf16, batch 1, random weights, inference; "
        "ms: median (min-max) of 3 do_bench medians.",
        "",
        "| case | provider | torch.compile mode | ms | vs default mode | host ms | cudagraph skips | first call s |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    default = {(r["case"], r["provider"]): r["ms"] for r in data["rows"] if "+" not in r.get("compile", "")}
    for r in data["rows"]:
        mode = r["compile"].split("+")[1] if "+" in r["compile"] else "default"
        base = default.get((r["case"], r["provider"]), float("nan"))
        out.append(
            f"| {r['case']} | {r['provider']} | {mode} ({r['compile'].split('+')[0]}) | {r['ms']:.1f} "
            f"({r['ms_min']:.1f}-{r['ms_max']:.1f}) | {base / r['ms']:.3f}x | {r['host_ms']:.1f} "
            f"| {r.get('cudagraph_skips', '-')} | {r['first_call_s']:.0f} |"
        )
    return "\n".join(out) + "\n"
