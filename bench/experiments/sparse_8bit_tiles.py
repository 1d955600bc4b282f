"""The 8-bit block-sparse forward's tiles and its k scale's load, on Wan's sliding-tile lists.

    PYTHONPATH=. python bench/experiments/sparse_8bit_tiles.py OUT.json [--grids wan_480p,wan_720p] [--rounds 3]

``block_sparse_attention(..., precision="int8_fp8")`` on the lists of ``bench/runners/sparse_e2e.py``'s
preset (``bench/runners/block_sparse.py --precision``'s inputs: 12 heads of 128, random normal q, k,
v with a per-channel offset on k), timed under each candidate of :data:`CONFIGS`: the portable
kernel's ``(block_m, warps, stages)`` (``ops.attention_tiles.forward_tiles``, 128-key tiles, which
FP8 P V's specification fixes) and whether each listed tile's k scale is read past Triton's
pipeliner (``ops.attention_launch.K_SCALE_BY_ASM``). Each config is timed on tile-ordered inputs
(the kernel with its quantization passes) and as the models call it (tokens in their own order
with ``token_order=``), beside the 16-bit path on the same lists (the sm_90 core; its
permutations in the ordered call). CUDA-graph replays, ``--rounds`` interleaved rounds over every
provider, median with min and max. Each output's largest difference to the default config's
(the same rounding: expected 0) and its relative L2 to the 16-bit output; the compiled forward
variants' registers and spills. Writes OUT.json.
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

from bench.toolkit import environment, graph_replay_time, make_timer, module_config, relative_l2, warm_up_gpu  # noqa: E402

#: (block_m, warps, stages, k scale past the pipeliner); the first is the shipped default.
CONFIGS = (
    (64, 4, 3, False),
    (64, 4, 3, True),
    (64, 4, 2, True),
    (64, 4, 4, True),
    (128, 8, 2, True),
    (128, 8, 3, True),
)


def _forced_tiles(block_m: int, warps: int, stages: int):
    """A ``forward_tiles`` that gives int8_fp8 calls these tiles and every other call its default."""
    from compile_ops.ops import attention_tiles

    default = attention_tiles.forward_tiles

    def tiles(d, dtype, tma=False, precision="exact", wgmma=False):
        if precision != "int8_fp8":
            return default(d, dtype, tma, precision, wgmma)
        return attention_tiles.Tiles(block_m, 128, warps, stages, tma=tma)

    return tiles


def _label(config) -> str:
    block_m, warps, stages, by_asm = config
    return f"{block_m} queries, {warps} warps, {stages} stages, k scale {'past the pipeliner' if by_asm else 'loaded'}"


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


def grid_rows(grid_name: str, rounds: int, timer) -> list:
    import compile_ops
    from bench.runners.block_sparse import GRIDS, WAN_HEAD_DIM, WAN_HEADS
    from bench.runners.sparse_e2e import PRESET
    from compile_ops.ops import attention_launch

    grid = GRIDS[grid_name]
    layout = compile_ops.SlidingTile(**PRESET).layout(grid, "cuda")
    length = grid[0] * grid[1] * grid[2]
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, length, WAN_HEADS, WAN_HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", generator=generator) for _ in range(3))
    k = k + 2.0 * torch.randn(WAN_HEAD_DIM, device="cuda", generator=generator)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    tokens = tuple(torch.empty_like(t).index_copy_(1, layout.perm, t) for t in (q, k, v))

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

    configure = module_config(attention_launch, "forward_tiles", "K_SCALE_BY_ASM")
    providers = [("exact", None, ordered) for ordered in (False, True)]
    providers += [("int8_fp8", config, ordered) for config in CONFIGS for ordered in (False, True)]
    times = {p: [] for p in providers}
    outputs = {}
    with torch.no_grad():
        for _ in range(rounds):
            for provider in providers:
                precision, config, ordered = provider
                forced = (_forced_tiles(*config[:3]), config[3]) if config else None
                with configure(forced) if forced else contextlib.nullcontext():
                    times[provider].append(graph_replay_time(timed(precision, ordered), timer))
                    if provider not in outputs:
                        outputs[provider] = attend(precision, ordered)
    flops = 4 * length * length * WAN_HEADS * WAN_HEAD_DIM * layout.density
    rows = []
    for provider in providers:
        precision, config, ordered = provider
        runs = sorted(times[provider])
        exact = statistics.median(times[("exact", None, ordered)])
        default = outputs[("int8_fp8", CONFIGS[0], ordered)]
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
        if config:
            row["max_diff_vs_default_config"] = float((outputs[provider].float() - default.float()).abs().max())
        print(
            f"{grid_name} {'ordered' if ordered else 'tiles  '} {row['config']:<62} {row['ms']:.3f} ms "
            f"({row['ms_min']:.3f}-{row['ms_max']:.3f}) x{row['speedup_vs_16_bit']:.3f}",
            flush=True,
        )
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--grids", default="wan_480p,wan_720p")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    warm_up_gpu()
    timer = make_timer(False)
    rows = []
    for grid_name in args.grids.split(","):
        rows += grid_rows(grid_name, args.rounds, timer)
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
