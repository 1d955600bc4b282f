"""8-bit attention's k/v quantization passes, launch variants A/B, on a GPU:

    PYTHONPATH=. python bench/experiments/kv8_passes.py OUT.json [--rounds 3] [--baseline | --sweep]

``quantize_8bit`` reads k and v twice: a statistics pass (k's column sums,
v's channel amax, in partials per chunk of keys; the head's totals summed
by the chunk that finishes last) and a quantizing pass (k per 128-key block
in INT8 less its mean, v in e4m3, transposed). The variants move the
statistics pass's chunk length (``STAT_CHUNK_ROWS``).
``--baseline``: the tree has none of these knobs (run it on an older
checkout, ``PYTHONPATH=<that tree>``): its default alone, labelled
"baseline". ``--sweep``: the statistics pass's chunk length, step and warps
forced on more shapes (:func:`sweep`).

Per shape (bf16, keys with a per-channel offset), alternated ``--rounds``
times: CUDA-graph replays of ``quantize_8bit`` in microseconds, and of the
whole ``fused.attention_int8_fp8`` op in TFLOP/s beside SDPA's cuDNN backend
in the same process; every variant's operands against the first variant's
(v bit-identical, k's int8 within 1: its mean is summed in another order).
"""

import argparse
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.toolkit import environment, graph_replay_time, kernel_profile, make_timer, warm_up_gpu
from compile_ops._library import clear_launch_plans

try:
    from compile_ops.ops import attention_8bit
except ImportError:  # --baseline on an older tree: quantize_8bit in ops/attention.py
    from compile_ops.ops import attention as attention_8bit

SHAPES = [(1, 24, 4608, 128), (1, 40, 16384, 128), (1, 12, 32760, 128), (2, 24, 4096, 64)]
#: name -> the module attributes it sets (the others at their defaults)
VARIANTS = {
    "default": {},
    "512-key chunks": dict(STAT_CHUNK_ROWS=512),
    "2048-key chunks": dict(STAT_CHUNK_ROWS=2048),
}
_DEFAULTS = {
    name: getattr(attention_8bit, name)
    for name in ("STAT_CHUNK_ROWS", "STAT_STEP", "MAX_STAT_CHUNKS")
    if hasattr(attention_8bit, name)
}


def _configure(variant):
    if variant != "baseline":
        for name, value in dict(_DEFAULTS, **VARIANTS[variant]).items():
            setattr(attention_8bit, name, value)
    clear_launch_plans()  # an eager op's plan replays the launches it recorded


def sweep(shapes, timer) -> list:
    """``--sweep``: the statistics pass's chunk length, row step and warps,
    each forced on every shape, timed as CUDA-graph replays of the whole
    ``quantize_8bit`` (its quantizing pass is the same in every case) and
    of the statistics kernel alone (a graph of ``quantize_8bit`` less its
    replay of the quantizing pass is not separable, so the kernel's share
    comes from ``kernel_profile``)."""
    rows = []
    default_rows, default_step, default_launch = (
        attention_8bit.stat_rows_per_chunk,
        attention_8bit.STAT_STEP,
        dict(attention_8bit.STATS_LAUNCH),
    )
    for b, h, length, d in shapes:
        torch.manual_seed(0)
        k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        row = {
            "shape": [b, h, length, d],
            "default_rows_per_chunk": default_rows(length),
            "quantize_us": {},
            "stats_us": {},
        }
        for step in (32, 64, 128):
            for warps in (4, 8):
                for chunk in (128, 192, 256, 320, 384, 448, 512, 640, 768, 1024, 1536, 2048):
                    if chunk % step:
                        continue
                    attention_8bit.STAT_STEP = step
                    attention_8bit.STATS_LAUNCH = dict(num_warps=warps)
                    attention_8bit.stat_rows_per_chunk = lambda lk, chunk=chunk: chunk
                    key = f"step {step}, {warps} warps, {chunk} rows"
                    row["quantize_us"][key] = 1e3 * graph_replay_time(
                        lambda: attention_8bit.quantize_8bit(k, v, 2), timer
                    )
                    profile = kernel_profile(lambda: attention_8bit.quantize_8bit(k, v, 2))
                    row["stats_us"][key] = 1e3 * sum(
                        ms for name, ms, _ in profile["top"] if name.startswith("kv8_stats")
                    )
        attention_8bit.stat_rows_per_chunk, attention_8bit.STAT_STEP = default_rows, default_step
        attention_8bit.STATS_LAUNCH = default_launch
        best = min(row["quantize_us"], key=row["quantize_us"].get)
        print(json.dumps({"shape": row["shape"], "best": best, "us": row["quantize_us"][best]}), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    if args.sweep:
        timer = make_timer(False)
        warm_up_gpu(5)
        rows = sweep(SHAPES + [(1, 12, 75600, 128), (1, 24, 4096, 128), (2, 24, 4608, 128)], timer)
        with open(args.out, "w") as f:
            json.dump({"environment": environment(), "rows": rows}, f, indent=1)
        return
    variants = ["baseline"] if args.baseline else list(VARIANTS)
    timer = make_timer(False)
    warm_up_gpu(5)
    rows = []
    for b, h, length, d in SHAPES:
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        k += 3 * torch.randn(1, h, 1, d, device="cuda", dtype=torch.bfloat16)  # keys with a channel offset
        row = {"shape": [b, h, length, d], "quantize_us": {}, "agreement": {}, "op_TFLOPs": {}}
        _configure(variants[0])
        want = [t.clone() for t in attention_8bit.quantize_8bit(k, v, 2)]
        for variant in variants:
            _configure(variant)
            got = attention_8bit.quantize_8bit(k, v, 2)
            k_diff = (got[0].int() - want[0].int()).abs()
            row["agreement"][variant] = {
                "k8 max diff": int(k_diff.max()),
                "k8 differing": float((k_diff > 0).float().mean()),
                "v bit-identical": bool(
                    torch.equal(got[2].view(torch.uint8), want[2].view(torch.uint8)) and torch.equal(got[3], want[3])
                ),
                "k_scale max rel": float(((got[1] - want[1]).abs() / want[1]).max()),
            }
        flops = 4 * b * h * length * length * d
        for _ in range(args.rounds):
            for variant in variants:
                _configure(variant)
                row["quantize_us"].setdefault(variant, []).append(
                    1e3 * graph_replay_time(lambda: attention_8bit.quantize_8bit(k, v, 2), timer)
                )
                row["op_TFLOPs"].setdefault(variant, []).append(
                    flops
                    / 1e9
                    / graph_replay_time(
                        lambda: torch.ops.fused.attention_int8_fp8(q, k, v, d**-0.5, False, 2, None), timer
                    )
                )
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                row["op_TFLOPs"].setdefault("cuDNN bf16", []).append(
                    flops
                    / 1e9
                    / graph_replay_time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), timer)
                )
        _configure(variants[0])
        row["kernels"] = kernel_profile(lambda: attention_8bit.quantize_8bit(k, v, 2))
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump(
            {
                "environment": environment(),
                "variants": {k: repr(v) for k, v in VARIANTS.items()},
                "defaults": repr(_DEFAULTS),
                "rows": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
