"""The table of bench/runners/moe.py's JSON: MoE routing per provider."""

from bench.tables import run_line


def is_moe(data: dict) -> bool:
    """bench/runners/moe.py's JSON: routing times per provider, in microseconds."""
    return any("fwd_graph_us" in r and "experts" in r for r in data["rows"])


def moe_table(data: dict) -> str:
    """Markdown: MoE routing microseconds per case and provider, forward and
    forward+backward, as plain calls and as CUDA-graph replays, with the
    composites' graph-replay forward over ours."""
    rows = data["rows"]
    by = {(r["op"], r["provider"]): r for r in rows}
    out = [
        run_line(data["env"]) + " | bf16, 4096 tokens.",
        "",
        "Microseconds per call (`do_bench` median, L2 flushed): a plain call (host launch cost included) and "
        "a CUDA-graph replay (the GPU's time alone); forward+backward = the backward of the probabilities "
        "and weights into x and the router weight. Last columns: the composite's graph-replay forward "
        "over this provider's.",
        "",
        "| case | provider | fwd | fwd, graph | fwd+bwd | fwd+bwd, graph | composite_eager / this, graph fwd "
        "| composite_compiled / this, graph fwd |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (op, provider), r in by.items():
        t, e, k = r["shape"][-2:], r["experts"], r["top_k"]
        case = f"{op}: {t[0]} x {t[1]}, E = {e}, k = {k}"
        ratios = []
        for peer in ("composite_eager", "composite_compiled"):
            p = by.get((op, peer))
            ratios.append(
                "-"
                if p is None or provider.startswith("composite")
                else f"{p['fwd_graph_us'] / r['fwd_graph_us']:.1f}x"
            )
        out.append(
            f"| {case} | {provider} | {r['fwd_us']:.1f} | {r['fwd_graph_us']:.1f} | {r['fwdbwd_us']:.1f} "
            f"| {r['fwdbwd_graph_us']:.1f} | " + " | ".join(ratios) + " |"
        )
    return "\n".join(out) + "\n"
