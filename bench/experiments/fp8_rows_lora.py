"""One LoRA adapter on FP8 rows, per Flux Linear, on a GPU: ``fused.fp8_rows_lora`` against
the path it replaced.

    PYTHONPATH=. python bench/experiments/fp8_rows_lora.py OUT.json [--rank 64] [--rounds 3] [--sweep | --sweep-down]

Per shape of Flux.1-dev's LoRA'd Linears at 1024² (:data:`SHAPES`, bf16 adapters of rank
``--rank``, rows quantized from random activations), alternated ``--rounds`` times, as
CUDA-graph replays (the kernels' own time, no host cost):

- ``dequantized``: what ``FP8LoraLinear`` ran before the op, compiled (``fullgraph``):
  the rows dequantized to bf16, ``lora_A``, the scaling, and B's product added by ``addmm``.
- ``op``: ``fused.fp8_rows_lora`` (its two launches).
- ``floor``: the op's bytes (the codes and scales read, the result read and the output
  written, both adapters read) at the device copy bandwidth measured in the same run.

Beside the times: each provider's largest difference from the specification
(``reference.fp8.fp8_rows_lora``, the same roundings) and the relative L2 of each against
the exact adapter (fp32 from the dequantized rows to the output, rounded once).
``--sweep``: the op's launch knobs (K slice, output columns a program) on every shape;
``--sweep-down``: the down kernel's (K slice, K step, warps, row tile).
"""

import argparse
import itertools
import statistics

import torch

from bench.toolkit import (
    copy_bandwidth_TBps,
    graph_replay_time,
    make_timer,
    module_config,
    relative_l2,
    warm_up_gpu,
    write_rows,
)
from compile_ops import reference
from compile_ops.ops import fp8 as fp8_ops

#: (name, rows M, in_features K, out_features N) of Flux.1-dev's LoRA'd Linears at 1024²
#: (4096 image tokens, 512 text tokens, 4608 in the single blocks).
SHAPES = (
    ("to_q", 4096, 3072, 3072),
    ("add_q_proj", 512, 3072, 3072),
    ("ff.net.0.proj", 4096, 3072, 12288),
    ("ff.net.2", 4096, 12288, 3072),
    ("single to_q", 4608, 3072, 3072),
    ("single proj_out", 4608, 15360, 3072),
)
SCALING = 0.5


def _inputs(m: int, k: int, n: int, rank: int) -> tuple:
    """``(result, q, scale, lora_a, lora_b)`` on the GPU: rows of random bf16
    activations quantized as the producers write them, adapters at peft's scale."""
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    rows = fp8_ops.quantize_fp8_rows(x)
    result = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    lora_a = torch.randn(rank, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    lora_b = torch.randn(n, rank, device="cuda", dtype=torch.bfloat16) / rank**0.5
    return result, rows.q, rows.scale, lora_a, lora_b


@torch.compile(fullgraph=True)
def _dequantized(result, q, scale, lora_a, lora_b, scaling: float):
    """The path before the op: rows dequantized to the adapters' dtype, ``lora_A``, then ``addmm``."""
    x = (q.float() * scale.unsqueeze(-1)).to(lora_a.dtype)
    down = (x @ lora_a.t()) * scaling
    return torch.addmm(result, down, lora_b.t())


def _exact(result, q, scale, lora_a, lora_b, scaling: float) -> torch.Tensor:
    """The adapter in fp32 from the dequantized rows, one rounding at the end."""
    x = q.float() * scale.unsqueeze(-1)
    return (result.float() + (x @ lora_a.float().t()) * scaling @ lora_b.float().t()).to(result.dtype)


def _floor_ms(m: int, k: int, n: int, rank: int, copy_TBps: float) -> float:
    """The op's bytes read and written at the copy bandwidth (which counts both too)."""
    moved = m * k + 4 * m + 2 * 2 * m * n + 2 * rank * (k + n)
    return moved / (copy_TBps * 1e12) * 1e3


def measure(rank: int, rounds: int, timer, copy_TBps: float) -> list:
    rows = []
    for name, m, k, n in SHAPES:
        args = _inputs(m, k, n, rank)
        want = reference.fp8.fp8_rows_lora(*args, SCALING)
        exact = _exact(*args, SCALING)
        providers = {
            "dequantized": lambda: _dequantized(*args, SCALING),
            "op": lambda: fp8_ops.fp8_rows_lora(*args, SCALING),
        }
        times = {p: [] for p in providers}
        for _ in range(rounds):
            for provider, fn in providers.items():
                times[provider].append(1e3 * graph_replay_time(fn, timer))
        row = {"name": name, "shape": [m, k, n], "rank": rank}
        for provider, fn in providers.items():
            got = fn()
            row[provider] = {
                "us": statistics.median(times[provider]),
                "us_min": min(times[provider]),
                "us_max": max(times[provider]),
                "max_diff_vs_specification": float((got.float() - want.float()).abs().max()),
                "rel_l2_vs_exact": relative_l2(got, exact),
            }
        row["floor_us"] = 1e3 * _floor_ms(m, k, n, rank, copy_TBps)
        row["speedup"] = row["dequantized"]["us"] / row["op"]["us"]
        print(
            f"{name:16s} dequantized {row['dequantized']['us']:8.1f} us  op {row['op']['us']:8.1f} us  "
            f"floor {row['floor_us']:7.1f} us  x{row['speedup']:.2f}",
            flush=True,
        )
        rows.append(row)
    return rows


def _sweep(rank: int, timer, knobs: tuple, configs: list, label: str) -> list:
    """The op timed whole (CUDA-graph replays) on every shape at each of ``configs``, tuples of
    the values of ``knobs`` (names of ``compile_ops.ops.fp8``'s launch globals), ``label``
    formatting a config as its row's key."""
    configure = module_config(fp8_ops, *knobs)
    rows = []
    for name, m, k, n in SHAPES:
        args = _inputs(m, k, n, rank)
        row = {"name": name, "shape": [m, k, n], "rank": rank, "us": {}}
        for config in configs:
            with configure(config):
                row["us"][label.format(*config)] = 1e3 * graph_replay_time(
                    lambda: fp8_ops.fp8_rows_lora(*args, SCALING), timer
                )
        best = min(row["us"], key=row["us"].get)
        print(f"{name:16s} best {best}: {row['us'][best]:.1f} us", flush=True)
        rows.append(row)
    return rows


def sweep(rank: int, timer) -> list:
    """The op's K slice and output columns a program, forced on every shape."""
    configs = [(s, s, c) for s, c in itertools.product((256, 512, 1024, 2048, 4096), (128, 256, 512, 1024, 3072))]
    knobs = ("LORA_SPLIT_COLUMNS", "LORA_LONG_SPLIT_COLUMNS", "LORA_COLUMNS_PER_PROGRAM")
    return _sweep(rank, timer, knobs, configs, "{} split columns, {} past LORA_LONG_K, {} columns a program")


def sweep_down(rank: int, timer) -> list:
    """The down kernel's knobs (K slice, K step, warps, rows a tile): the up kernel reads as
    many partial sums as there are slices, and takes the down kernel's row tiles."""
    configs = [(s, s, *rest) for s, *rest in itertools.product((1024, 2048), (128, 256), (4, 8), (64, 128))]
    knobs = ("LORA_SPLIT_COLUMNS", "LORA_LONG_SPLIT_COLUMNS", "LORA_BLOCK_K", "LORA_DOWN_WARPS", "LORA_MAX_ROWS")
    label = "{} split columns, {} past LORA_LONG_K, BLOCK_K {}, {} warps, {} rows"
    return _sweep(rank, timer, knobs, configs, label)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-down", action="store_true", help="the down kernel's knobs")
    args = parser.parse_args()
    timer = make_timer(False)
    warm_up_gpu(5)
    with torch.no_grad():
        if args.sweep_down:
            rows = sweep_down(args.rank, timer)
        elif args.sweep:
            rows = sweep(args.rank, timer)
        else:
            rows = measure(args.rank, args.rounds, timer, copy_bandwidth_TBps(timer))
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
