"""The tables of bench/runners/attention.py's JSON: dense attention per provider, and its 8-bit modes."""

from bench.tables import run_line, shape_name


def is_attention(data: dict) -> bool:
    """bench/runners/attention.py's JSON (TFLOP/s rows) rather than bench/run.py's."""
    return any("fwd_TFLOPs" in r or r.get("provider") == "sdpa_flash" for r in data["rows"])


def attention_table(data: dict) -> str:
    """Markdown: TFLOP/s forward / forward+backward per provider and shape, and
    the peak memory of a forward+backward step, ours against SDPA's flash."""
    rows = data["rows"]
    env = data["env"]
    causal = any(r.get("causal") for r in rows)
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in rows))
    by = {(tuple(r["shape"]), r["provider"]): r for r in rows}
    out = [
        run_line(env) + f" | bf16, [B, H, L, D], {'causal' if causal else 'non-causal'} self-attention.",
        "",
        "TFLOP/s forward / forward+backward (CUDA-graph replay; 4·B·H·L²·D per forward"
        f"{', halved for causal' if causal else ''}, 3.5x for forward+backward), and the peak memory "
        "of one forward+backward step above its inputs.",
        "",
        "| shape | " + " | ".join(providers) + " | peak MiB fused / sdpa_flash |",
        "|---|" + "---:|" * (len(providers) + 1),
    ]
    for shape in shapes:
        cells = []
        for prov in providers:
            r = by.get((shape, prov), {})
            cells.append("err" if "error" in r or not r else f"{r['fwd_TFLOPs']:.0f} / {r['fwdbwd_TFLOPs']:.0f}")
        mem = [by.get((shape, p), {}).get("peak_MiB") for p in ("fused_eager", "sdpa_flash")]
        mem_cell = " / ".join("-" if m is None else f"{m:.0f}" for m in mem)
        out.append(f"| {shape_name(shape)} | " + " | ".join(cells) + f" | {mem_cell} |")
    return "\n".join(out) + "\n"


def is_attention_int8(data: dict) -> bool:
    """bench/runners/attention.py --int8's JSON: rows per input kind, with their error."""
    return any("inputs" in r and "rel_l2_vs_fp64" in r for r in data["rows"])


def attention_int8_table(data: dict) -> str:
    """Markdown: forward TFLOP/s of 8-bit attention beside cuDNN, our exact
    kernel and SageAttention, each with its relative L2 to fp64 attention,
    per shape and input kind."""
    rows = data["rows"]
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    keys = list(dict.fromkeys((tuple(r["shape"]), r["inputs"]) for r in rows))
    by = {(tuple(r["shape"]), r["inputs"], r["provider"]): r for r in rows}
    out = [
        run_line(data["env"]) + " | [B, H, L, D], non-causal, forward; bf16 inputs, 8-bit providers "
        "quantize inside the timed call.",
        "",
        "TFLOP/s (4·B·H·L²·D per forward, `do_bench` median) and, in brackets, the relative L2 distance "
        "to fp64 attention (and its cosine similarity, where the run recorded it). Inputs: `normal` N(0, 1); "
        "`offset_keys` keys with a per-channel offset of "
        "N(0, 4²) and doubled queries.",
        "",
        "| shape | inputs | " + " | ".join(providers) + " |",
        "|---|---|" + "---:|" * len(providers),
    ]
    for shape, kind in keys:
        cells = []
        for prov in providers:
            r = by.get((shape, kind, prov))
            cosine = f", cos {r['cosine_vs_fp64']:.5f}" if r and "cosine_vs_fp64" in r else ""
            cells.append(
                "err" if not r or "error" in r else f"{r['fwd_TFLOPs']:.0f} ({r['rel_l2_vs_fp64']:.1e}{cosine})"
            )
        out.append(f"| {shape_name(shape)} | {kind} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"
