"""Sweep the RoPE kernels' launch configs on a GPU, to pick TILE,
PROGRAMS_PER_SM and NUM_WARPS in compile_ops/ops/rope.py.

    PYTHONPATH=. python bench/sweep_rope.py [OUT.json] [OPS] [TILE/PER_SM/WARPS,...]

rope_qk (half-split, [B, L, H, D]), rope (interleaved, [B, H, L, D]),
rope_grid and qk_norm_rope at the registry's RoPE shapes, bf16, timed as CUDA
graph replays of the forward and of the whole forward+backward step. Three
interleaved rounds, median kept.
"""
import functools
import itertools
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.run import (bytes_model, graph_replay_time, make_timer, time_forward_backward,  # noqa: E402
                       warm_up_gpu, write_sweep)
from compile_ops import registry  # noqa: E402
from compile_ops.ops import rope as rope_ops  # noqa: E402

CONFIGS = [(2048, 4, 4), (4096, 4, 4), (4096, 8, 8), (8192, 4, 8)]  # tile, programs per SM, warps
OPS = ("rope_qk", "rope", "rope_grid", "qk_norm_rope")
ROUNDS = 3


def main(out_path=None, ops=None, configs=None):
    ops = ops.split(",") if ops else OPS
    configs = [tuple(int(v) for v in c.split("/")) for c in configs.split(",")] if configs else CONFIGS
    timer = make_timer(quick=False)
    warm_up_gpu()
    results = []
    for name, shape in itertools.product(ops, registry.ROPE_SHAPES):
        spec = registry.BY_NAME[name]
        args = spec.make_inputs(shape, torch.bfloat16, "cuda", True)
        with torch.no_grad():
            fwd_bytes, fwdbwd_bytes = bytes_model(args, spec.reference(*args), spec.backward_reads_inputs)
        times = {(kind, *c): [] for kind in ("fwd", "fwdbwd") for c in configs}
        for _ in range(ROUNDS):
            for kind, tile, per_sm, warps in times:
                saved = rope_ops.TILE, rope_ops.PROGRAMS_PER_SM, rope_ops.NUM_WARPS
                rope_ops.TILE, rope_ops.PROGRAMS_PER_SM, rope_ops.NUM_WARPS = tile, per_sm, warps
                try:
                    if kind == "fwd":
                        with torch.no_grad():
                            ms = graph_replay_time(functools.partial(spec.op, *args), timer)
                    else:
                        ms = time_forward_backward(spec.op, args, timer, graph=True)
                except Exception as e:  # noqa: BLE001 (a config that fails to compile is a result)
                    print(f"{name} {shape} {kind} {tile}/{per_sm}/{warps}: {type(e).__name__}: {str(e)[:200]}",
                          flush=True)
                    ms = float("nan")
                finally:
                    rope_ops.TILE, rope_ops.PROGRAMS_PER_SM, rope_ops.NUM_WARPS = saved
                times[(kind, tile, per_sm, warps)].append(ms)
        for (kind, tile, per_sm, warps), ts in times.items():
            ms = statistics.median(ts)
            gbps = (fwd_bytes if kind == "fwd" else fwdbwd_bytes) / (ms * 1e-3) / 1e9
            results.append({"op": name, "shape": list(shape), "kind": kind, "tile": tile,
                            "programs_per_sm": per_sm, "num_warps": warps, "ms": ms, "GBps": gbps})
            print(f"{name:<13} {'x'.join(map(str, shape)):<13} {kind:<7} tile {tile:>5} per-SM {per_sm:>2} "
                  f"warps {warps}: {ms * 1e3:8.1f} us {gbps:7.0f} GB/s", flush=True)
    write_sweep(out_path, results)


if __name__ == "__main__":
    main(*sys.argv[1:])
