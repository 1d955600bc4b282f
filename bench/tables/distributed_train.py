"""The table of bench/runners/distributed_train.py's JSON: FSDP2 training on 1 and N GPUs."""

from bench.tables import run_line


def is_distributed_train(data: dict) -> bool:
    """bench/runners/distributed_train.py's JSON."""
    return any("multi" in r for r in data["rows"])


def compiled_summary(result: dict) -> str:
    """bench/runners/distributed_train.py's compiled timings of a sharded run, in words."""
    if "compile_error" in result:
        return f"compiled: failed, {result['compile_error']}"
    if "compiled_sharded_ms" not in result:
        return "not compiled"
    return f"compiled: {result['compiled_sharded_ms']:.2f} against {result['compiled_unsharded_ms']:.2f}"


def distributed_train_table(data: dict) -> str:
    """Markdown: FSDP2 training throughput on 1 and N GPUs, the loss
    agreement, and the heads-sharded block's check."""
    row, env = data["rows"][0], data["env"]
    config, gpus = row["config"], row["gpus"]
    batch = config["global_batch"]
    runs = (
        ("1 GPU, whole batch", row["single"], 1, batch),
        ("1 GPU", row["baseline"], 1, batch // gpus),
        (f"{gpus} GPUs", row["multi"], gpus, batch // gpus),
    )
    base = row["baseline"]["training"]["samples_per_s"]
    out = [
        run_line(env, gpus=gpus) + f" | {config['depth']} blocks of {config['dim']} wide, "
        f"{config['heads']} heads, {config['tokens']} tokens a sample, {config['dtype']} compute, fp32 parameters "
        f"and gradient reduction, AdamW (fused), {config['steps']} steps ({config['warmup']} untimed).",
        "",
        "| run | samples per GPU | ms per step | samples/s | samples/s per GPU | vs 1 GPU | peak MiB per GPU |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, run, ranks, per_rank in runs:
        t = run["training"]
        out.append(
            f"| {name} | {per_rank} | {t['step_ms']:.1f} | {t['samples_per_s']:.2f} | "
            f"{t['samples_per_s'] / ranks:.2f} | {t['samples_per_s'] / base:.2f}x | {t['peak_MiB']:.0f} |"
        )
    single, multi = row["single"]["training"]["losses"], row["multi"]["training"]["losses"]
    worst = max(abs(a - b) / abs(a) for a, b in zip(single, multi))
    heads = row["multi"]["heads_sharded"]
    collectives = ", ".join(f"{n} x {k.split('.')[-1]}" for k, n in heads["forward_collectives"].items())
    out += [
        "",
        f"Per-step losses, {gpus} GPUs against 1 GPU on the same global batch of {config['global_batch']}: "
        f"largest relative difference {worst:.1e} over {len(single)} steps.",
        f"Heads-sharded block (tensor parallel): forward collectives {collectives}; worst relative "
        f"error against the unsharded block (output and every gradient) "
        f"{max(heads['relative_errors'].values()):.1e}"
        f"; {heads['sharded_ms']:.2f} ms forward+backward against {heads['unsharded_ms']:.2f} unsharded, eager "
        f"({compiled_summary(heads)}).",
    ]
    sequence = row["multi"].get("sequence_sharded")
    if sequence:
        collectives = ", ".join(f"{n} x {k.split('.')[-1]}" for k, n in sequence["forward_collectives"].items())
        out.append(
            f"Sequence-sharded attention ([1, {config['tokens']}, {config['heads']}, "
            f"{config['dim'] // config['heads']}]): output {sequence['output_placements']}, forward "
            f"collectives {collectives}; worst relative error {max(sequence['relative_errors'].values()):.1e}; "
            f"{sequence['sharded_ms']:.2f} ms forward+backward against {sequence['unsharded_ms']:.2f} on one "
            f"GPU, eager ({compiled_summary(sequence)})."
        )
    if row["failures"]:
        out += ["", "Failed: " + "; ".join(row["failures"])]
    return "\n".join(out) + "\n"
