"""The table of bench/runners/host.py's JSON: host time per call."""

from bench.tables import run_line


def is_host(data: dict) -> bool:
    """bench/runners/host.py's JSON: host microseconds per eager call."""
    return any("bare_us" in r for r in data["rows"])


def host_table(data: dict) -> str:
    """Markdown: host microseconds per eager call of each op, against a bare
    Triton launch of its kernels and the PyTorch composite."""
    out = [
        run_line(data["env"]) + " | host µs per call at [1, 64, 3072] bf16 (median of 5 x 1000 calls; the "
        "kernels themselves take the GPU µs column).",
        "",
        "| op | eager | through the dispatcher | bare Triton launch | eager / bare | PyTorch composite "
        "| GPU µs | launch plan |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in data["rows"]:
        if "error" in r:
            out.append(f"| {r['op']} | err | | | | | | |")
            continue
        out.append(
            f"| {r['op']} | {r['eager_us']:.1f} | {r['dispatcher_us']:.1f} | {r['bare_us']:.1f} | "
            f"{r['ratio']:.2f} | {r['reference_us']:.1f} | {r.get('gpu_us', float('nan')):.1f} | "
            f"{'replayed' if r.get('planned') else 'body'} |"
        )
    return "\n".join(out) + "\n"
