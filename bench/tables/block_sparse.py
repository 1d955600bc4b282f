"""The table of bench/runners/block_sparse.py's JSON: block-sparse attention against dense, per density."""

from bench.tables import run_line, shape_name


def is_block_sparse(data: dict) -> bool:
    """bench/runners/block_sparse.py's JSON."""
    return any(r.get("provider") == "fused_sparse" for r in data["rows"])


def block_sparse_table(data: dict) -> str:
    """Markdown: ms forward / forward+backward per share of blocks kept, ours
    against FlexAttention with the same BlockMask and our dense attention, and
    the mask builders' times."""
    rows, env = data["rows"], data["env"]
    dense = next(r for r in rows if r["provider"] == "fused_dense")
    cudnn = next((r for r in rows if r["provider"] == "sdpa_cudnn_dense"), None)
    by = {(r["provider"], r["density"]): r for r in rows if "density" in r}
    shape = shape_name(dense["shape"])

    def ratio(a, b):
        both = f"{a['fwdbwd_ms'] / b['fwdbwd_ms']:.2f}x" if "fwdbwd_ms" in a and "fwdbwd_ms" in b else "-"
        return f"{a['fwd_ms'] / b['fwd_ms']:.2f}x / {both}"

    def times(r):
        return f"{r['fwd_ms']:.2f} / " + (f"{r['fwdbwd_ms']:.1f}" if "fwdbwd_ms" in r else "-")

    cudnn_text = ""
    if cudnn:
        failed = f"; its backward: {cudnn['fwdbwd_error'][:80]}" if "fwdbwd_error" in cudnn else ""
        cudnn_text = f", SDPA's cuDNN dense attention's ({times(cudnn)} ms{failed})"
    atomic = any(p == "fused_sparse_atomic_dq" for p, _ in by)
    out = [
        run_line(env) + f" | bf16, {shape}, random 128x128 block masks (diagonal and block 0 kept), one for "
        "every head.",
        "",
        "ms forward / forward+backward (CUDA-graph replay); the speed-ups divide our dense attention's time "
        f"({times(dense)} ms){cudnn_text} and FlexAttention's (compiled, same `BlockMask`) by ours"
        + (
            "; `fused_sparse_atomic_dq`: ours after `set_attention_backward(deterministic=False)`, its speed-ups "
            "in the last two columns"
            if atomic
            else ""
        )
        + ".",
        "",
        "| blocks kept | fused_sparse | flex_block_mask | vs fused dense | "
        + ("vs cuDNN dense | " if cudnn else "")
        + "vs flex |"
        + (" fused_sparse_atomic_dq | its vs cuDNN dense | its vs flex |" if atomic else ""),
        "|---:|---:|---:|---:|" + ("---:|" if cudnn else "") + "---:|" + ("---:|---:|---:|" if atomic else ""),
    ]
    for density in sorted({d for p, d in by if p == "fused_sparse"}):
        ours, flex = by[("fused_sparse", density)], by.get(("flex_block_mask", density), {})
        line = (
            f"| {density:.0%} | {times(ours)} | "
            + (f"{times(flex)} | " if flex else "- | ")
            + f"{ratio(dense, ours)} | "
            + (f"{ratio(cudnn, ours)} | " if cudnn else "")
            + (f"{ratio(flex, ours)} |" if flex else "- |")
        )
        if atomic:
            fast = by.get(("fused_sparse_atomic_dq", density))
            line += (
                (
                    f" {times(fast)} | "
                    + (f"{ratio(cudnn, fast)} | " if cudnn else "- | ")
                    + (f"{ratio(flex, fast)} |" if flex else "- |")
                )
                if fast
                else " - | - | - |"
            )
        out.append(line)
    builders = [r for r in rows if "ms" in r]
    if builders:
        out += [
            "",
            "Mask building, compiled: "
            + "; ".join(f"`{r['provider']}` {shape_name(r['shape'])} {r['ms'] * 1e3:.0f} us" for r in builders)
            + ".",
        ]
    return "\n".join(out) + "\n"
