"""The table of bench/runners/context_parallel.py's JSON: each attention mode's step per parallel layout."""

from bench.tables import run_line

LAYOUT_NAMES = {"single": "one GPU"}
MODE_NAMES = {
    "native": "native (SDPA)",
    "patched": "patch(model)",
    "int8_fp8": "attention_precision='int8_fp8'",
    "sliding_tile": "attention=SlidingTile((3,3,3), (2,8,8))",
}


def is_context_parallel(data: dict) -> bool:
    return any("layout" in r and "mode" in r for r in data["rows"])


def marker(rows: list) -> str:
    """The docs block of a case's table on W GPUs: ``context-parallel-<case>-x<W>-table``."""
    world = max(r.get("world", 1) for r in rows)
    return f"context-parallel-{rows[0]['case']}-x{world}-table"


def _layout(name: str) -> str:
    if name in LAYOUT_NAMES:
        return LAYOUT_NAMES[name]
    return " x ".join(part.replace("ulysses", "Ulysses-").replace("ring", "ring-") for part in name.split("_"))


def _number(value, spec: str, unit: str = "") -> str:
    return "-" if value is None else format(value, spec) + unit


def context_parallel_table(data: dict) -> str:
    """Markdown: median step (min-max over the repeats), the speed-up over the
    mode's own one-GPU step and over native under the same layout, and the
    output's relative L2 to the one-GPU native and same-mode outputs; refused
    modes with the refusal."""
    env, rows = data["env"], data["rows"]
    out = [
        run_line(env, f"diffusers {env.get('diffusers', '?')}", gpus=data.get("world", 1))
        + f" | {rows[0]['case']}, bf16, batch 1, random weights, blocks compiled in place.",
        "",
        "| layout | mode | step ms | vs own one-GPU | vs native, same layout | rel. L2 to native one-GPU "
        "| rel. L2 to same mode one-GPU |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mode = MODE_NAMES.get(r["mode"], r["mode"])
        if r.get("step_ms") is None:
            why = r.get("refused") or r.get("failed") or "?"
            out.append(
                f"| {_layout(r['layout'])} | {mode} | refused: {why.split(':', 1)[-1].split('(')[0].strip()} | | | | |"
            )
            continue
        out.append(
            f"| {_layout(r['layout'])} | {mode} | {r['step_ms']:.1f} ({r['step_ms_min']:.1f}-"
            f"{r['step_ms_max']:.1f}) | {_number(r.get('speedup_vs_own_one_gpu'), '.2f', 'x')} "
            f"| {_number(r.get('speedup_vs_native_same_layout'), '.2f', 'x')} "
            f"| {_number(r.get('rel_l2_vs_native_one_gpu'), '.2e')} "
            f"| {_number(r.get('rel_l2_vs_same_mode_one_gpu'), '.2e')} |"
        )
    return "\n".join(out) + "\n"
