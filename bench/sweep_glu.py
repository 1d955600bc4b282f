"""Sweep the gated-activation kernel's launch config on a GPU, to pick TILE,
MAX_BLOCK_N and NUM_WARPS in compile_ops/ops/glu.py.

    PYTHONPATH=. python bench/sweep_glu.py [OUT.json] [OPS] [TILE/BLOCK_N/WARPS,...]

At the registry's GLU shapes, bf16, CUDA-graph replays of the forward and of
the forward+backward step (``bench.run.sweep_times``).
"""
import contextlib
import itertools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.run import bytes_model, make_timer, sweep_times, warm_up_gpu, write_sweep  # noqa: E402
from compile_ops import registry  # noqa: E402
from compile_ops.ops import glu as glu_ops  # noqa: E402

CONFIGS = [(4096, 4096, 8), (4096, 4096, 4), (4096, 2048, 8), (2048, 2048, 4), (2048, 1024, 4),
           (8192, 4096, 8), (8192, 8192, 16), (1024, 1024, 4)]  # tile, max block_n, warps
OPS = ("geglu", "geglu_tanh", "swiglu")


@contextlib.contextmanager
def _configured(config):
    saved = glu_ops.TILE, glu_ops.MAX_BLOCK_N, glu_ops.NUM_WARPS
    glu_ops.TILE, glu_ops.MAX_BLOCK_N, glu_ops.NUM_WARPS = config
    try:
        yield
    finally:
        glu_ops.TILE, glu_ops.MAX_BLOCK_N, glu_ops.NUM_WARPS = saved


def main(out_path=None, ops=None, configs=None):
    ops = ops.split(",") if ops else OPS
    configs = [tuple(int(v) for v in c.split("/")) for c in configs.split(",")] if configs else CONFIGS
    timer = make_timer(quick=False)
    warm_up_gpu()
    results = []
    for name, shape in itertools.product(ops, registry.GLU_SHAPES):
        spec = registry.BY_NAME[name]
        args = spec.make_inputs(shape, torch.bfloat16, "cuda", True)
        with torch.no_grad():
            fwd_bytes, fwdbwd_bytes = bytes_model(args, spec.reference(*args), spec.backward_reads_inputs)
        for (kind, (tile, block_n, warps)), ms in sweep_times(spec, args, configs, _configured, timer).items():
            gbps = (fwd_bytes if kind == "fwd" else fwdbwd_bytes) / (ms * 1e-3) / 1e9
            results.append({"op": name, "shape": list(shape), "kind": kind, "tile": tile,
                            "max_block_n": block_n, "num_warps": warps, "ms": ms, "GBps": gbps})
            print(f"{name:<11} {'x'.join(map(str, shape)):<14} {kind:<7} tile {tile:>5} block_n {block_n:>5} "
                  f"warps {warps:>2}: {ms * 1e3:8.1f} us {gbps:7.0f} GB/s", flush=True)
    write_sweep(out_path, results)


if __name__ == "__main__":
    main(*sys.argv[1:])
