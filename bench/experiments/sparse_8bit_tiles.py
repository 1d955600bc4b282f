"""The 8-bit block-sparse forward's tiles, and what its short key loops cost, on Wan's lists.

    PYTHONPATH=. python bench/experiments/sparse_8bit_tiles.py OUT.json [--grids wan_480p,wan_720p] [--rounds 3]
        [--configs 64/4/3,...]
    PYTHONPATH=. python bench/experiments/sparse_8bit_tiles.py OUT.json --loops [--rounds 3]

``block_sparse_attention(..., precision="int8_fp8")`` on the lists of ``bench/runners/sparse_e2e.py``'s
preset (``bench/runners/block_sparse.py --precision``'s inputs: 12 heads of 128, random normal q, k,
v with a per-channel offset on k), timed under each candidate of :data:`CONFIGS`, the portable
kernel's ``(block_m, warps, stages)`` (``ops.attention_tiles.forward_tiles``; 128-key tiles, which
FP8 P V's specification fixes). Each config is timed on tile-ordered inputs (the kernel with its
quantization passes) and as the models call it (tokens in their own order with ``token_order=``),
beside the 16-bit path on the same lists (the sm_90 core; its permutations in the ordered call).
CUDA-graph replays, ``--rounds`` interleaved rounds over every provider, median with min and max.
Each output's largest difference to the default config's (the same rounding: expected 0) and its
relative L2 to the 16-bit output; each default call's kernels by ``torch.profiler``; the compiled
forward variants' registers and spills. The first run (``sparse-8bit-tiles-h100.json``) also read
each listed tile's k scale by inline PTX, a knob removed after it.

``--loops``: what the length of a program's key loop costs each kernel. 32760 queries of 12 heads,
each query block attending to n key blocks, n in :data:`LOOP_BLOCKS`: dense attention over 128 n
keys, and block-sparse attention listing the first n blocks of 32760 keys, in both precisions,
each call's attention kernel alone by ``torch.profiler``, as TFLOP/s.
"""

import argparse
import contextlib
import json
import os
import statistics
import sys

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.toolkit import (  # noqa: E402
    environment,
    graph_replay_time,
    kernel_profile,
    make_timer,
    module_config,
    relative_l2,
    warm_up_gpu,
)

#: (block_m, warps, stages); the first is the shipped default.
CONFIGS = ((64, 4, 3), (64, 4, 2), (64, 4, 4), (128, 8, 2), (128, 8, 3))
#: ``--loops``: key blocks a query block attends to (Wan's sliding tiles list about 28-30).
LOOP_BLOCKS = (8, 16, 30, 64, 256)


def _forced_tiles(block_m: int, warps: int, stages: int):
    """A ``forward_tiles`` that gives int8_fp8 calls these tiles and every other call its default."""
    from compile_ops.ops import attention_tiles

    default = attention_tiles.forward_tiles

    def tiles(d, dtype, tma=False, precision="exact", wgmma=False, register_cap=False):
        if precision != "int8_fp8":
            return default(d, dtype, tma, precision, wgmma)
        return attention_tiles.Tiles(block_m, 128, warps, stages, tma=tma)

    return tiles


def _label(config) -> str:
    return "{} queries, {} warps, {} stages".format(*config)


def _attention_kernel_ms(fn) -> float:
    """The device time of ``fn``'s largest kernel per call (its attention kernel, in the
    calls timed here), by ``torch.profiler``."""
    return kernel_profile(fn, calls=5, top=1)["top"][0][1]


def _compiled_forwards() -> list:
    """Registers and spills of every ``attn_fwd_kernel`` variant compiled in this process."""
    from compile_ops.kernels.attention import attn_fwd_kernel

    rows = []
    for kernel_cache, *_ in attn_fwd_kernel.device_caches.values():
        for kernel in kernel_cache.values():
            kernel._init_handles()
            constants = getattr(getattr(kernel, "src", None), "constants", {}) or {}
            rows.append(
                {
                    "constants": {str(k): v for k, v in constants.items() if isinstance(v, (bool, int))},
                    "num_warps": kernel.metadata.num_warps,
                    "num_stages": kernel.metadata.num_stages,
                    "shared": kernel.metadata.shared,
                    "registers": kernel.n_regs,
                    "spills": kernel.n_spills,
                }
            )
    return rows


def grid_rows(grid_name: str, rounds: int, timer, configs=CONFIGS) -> list:
    """The rows of one grid: the 16-bit core and each of ``configs``, in tile and in token
    order, timed in ``rounds`` interleaved rounds."""
    import compile_ops
    from bench.runners.block_sparse import WAN_HEAD_DIM, WAN_HEADS, sliding_tile_inputs
    from compile_ops.ops import attention_launch

    layout, (q, k, v), tokens = sliding_tile_inputs(grid_name, WAN_HEADS, "cuda")
    length = q.shape[1]

    def attend(precision: str, ordered: bool):
        if ordered:
            return compile_ops.block_sparse_attention(
                *tokens, layout.index, layout.count, seq_dim=1, precision=precision, token_order=layout.perm
            ).index_select(1, layout.perm)
        return compile_ops.block_sparse_attention(q, k, v, layout.index, layout.count, seq_dim=1, precision=precision)

    def timed(precision: str, ordered: bool):
        if ordered:  # the model's call alone, without the comparison's permutation back
            return lambda: compile_ops.block_sparse_attention(
                *tokens, layout.index, layout.count, seq_dim=1, precision=precision, token_order=layout.perm
            )
        return lambda: attend(precision, False)

    configure = module_config(attention_launch, "forward_tiles")
    providers = [("exact", None, ordered) for ordered in (False, True)]
    providers += [("int8_fp8", config, ordered) for config in configs for ordered in (False, True)]
    times = {p: [] for p in providers}
    outputs = {}
    with torch.no_grad():
        for _ in range(rounds):
            for provider in providers:
                precision, config, ordered = provider
                with configure((_forced_tiles(*config),)) if config else contextlib.nullcontext():
                    times[provider].append(graph_replay_time(timed(precision, ordered), timer))
                    if provider not in outputs:
                        outputs[provider] = attend(precision, ordered)
    flops = 4 * length * length * WAN_HEADS * WAN_HEAD_DIM * layout.density
    rows = []
    for provider in providers:
        precision, config, ordered = provider
        runs = sorted(times[provider])
        exact = statistics.median(times[("exact", None, ordered)])
        default = outputs.get(("int8_fp8", CONFIGS[0], ordered))
        row = {
            "grid": grid_name,
            "tokens": length,
            "density": layout.density,
            "precision": precision,
            "config": _label(config) if config else "sm_90 core (16-bit)",
            "token_order": ordered,
            "ms": statistics.median(runs),
            "ms_min": runs[0],
            "ms_max": runs[-1],
            "TFLOPs": flops / statistics.median(runs) / 1e9,
            "speedup_vs_16_bit": exact / statistics.median(runs),
            "rel_l2_vs_16_bit": relative_l2(outputs[provider], outputs[("exact", None, ordered)]),
        }
        if config and default is not None:
            row["max_diff_vs_default_config"] = float((outputs[provider].float() - default.float()).abs().max())
        if config in (None, CONFIGS[0]):
            row["kernels"] = kernel_profile(timed(precision, ordered), calls=5, top=6)
        print(
            f"{grid_name} {'ordered' if ordered else 'tiles  '} {row['config']:<62} {row['ms']:.3f} ms "
            f"({row['ms_min']:.3f}-{row['ms_max']:.3f}) x{row['speedup_vs_16_bit']:.3f}",
            flush=True,
        )
        rows.append(row)
    return rows


def loop_rows(rounds: int) -> list:
    """``--loops``: per n of :data:`LOOP_BLOCKS` and precision, dense attention over 128 n keys
    and block-sparse attention over the first n blocks of 32760 keys (the same work per query
    block), the attention kernel's time alone."""
    import compile_ops
    from bench.runners.block_sparse import WAN_HEAD_DIM, WAN_HEADS

    length = 32760
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, length, WAN_HEADS, WAN_HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", generator=generator, dtype=torch.bfloat16) for _ in range(3))
    query_blocks = -(-length // 128)
    rows = []
    with torch.no_grad():
        for n in LOOP_BLOCKS:
            index = torch.arange(n, device="cuda", dtype=torch.int32).expand(1, 1, query_blocks, n).contiguous()
            count = torch.full((1, 1, query_blocks), n, device="cuda", dtype=torch.int32)
            keys = slice(0, 128 * n)
            calls = {}
            for precision in ("exact", "int8_fp8"):
                calls[("dense", precision)] = lambda p=precision: compile_ops.attention(
                    q, k[:, keys], v[:, keys], seq_dim=1, precision=p
                )
                calls[("sparse", precision)] = lambda p=precision: compile_ops.block_sparse_attention(
                    q, k, v, index, count, seq_dim=1, precision=p
                )
            times = {key: [] for key in calls}
            for _ in range(rounds):
                for key, fn in calls.items():
                    times[key].append(_attention_kernel_ms(fn))
            flops = 4 * length * 128 * n * WAN_HEADS * WAN_HEAD_DIM
            for (kind, precision), runs in times.items():
                runs = sorted(runs)
                ms = statistics.median(runs)
                rows.append(
                    {
                        "key_blocks": n,
                        "kind": kind,
                        "precision": precision,
                        "kernel_ms": ms,
                        "kernel_ms_min": runs[0],
                        "kernel_ms_max": runs[-1],
                        "TFLOPs": flops / ms / 1e9,
                    }
                )
                print(f"{n:4d} blocks {kind:6s} {precision:8s} {ms:.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--grids", default="wan_480p,wan_720p")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", default="", help="block_m/warps/stages,... (default: CONFIGS)")
    parser.add_argument("--loops", action="store_true", help="the cost of a program's key loop length instead")
    args = parser.parse_args()
    warm_up_gpu()
    timer = make_timer(False)
    rows = []
    if args.loops:
        rows = loop_rows(args.rounds)
    for grid_name in [] if args.loops else args.grids.split(","):
        configs = [tuple(int(x) for x in c.split("/")) for c in args.configs.split(",")] if args.configs else CONFIGS
        rows += grid_rows(grid_name, args.rounds, timer, configs)
    env = dict(environment(), command="python bench/experiments/sparse_8bit_tiles.py " + " ".join(sys.argv[1:]))
    results = {"environment": env, "rows": rows}
    for with_kernels in (False, True):  # the timings first, whatever the kernels' query does
        if with_kernels:
            results["compiled_forwards"] = _compiled_forwards()
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
