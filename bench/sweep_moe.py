"""Sweep the MoE routing kernels' launch config on a GPU, to pick the
ROUTE_* and SCAN_* globals in compile_ops/ops/moe.py.

    PYTHONPATH=. python bench/sweep_moe.py [OUT.json] [OPS] [BT/BH/WARPS/STAGES/SCAN_BT/SCAN_WARPS,...]

At the registry's shapes of ``moe_route`` (4096 x 4096, E = 64, k = 2) and
``moe_route_hidream`` (4096 x 2560, E = 4), bf16, CUDA-graph replays of the
forward (both kernels: routing and the per-expert scan) and of the
forward+backward step (``bench.toolkit.run_sweep``).
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.toolkit import module_config, run_sweep  # noqa: E402
from compile_ops.ops import moe as moe_ops  # noqa: E402

FIELDS = ("route_block_t", "route_block_h", "route_num_warps", "route_num_stages", "scan_block_t", "scan_num_warps")
CONFIGS = [(32, 128, 4, 3, 1024, 4),  # the committed default
           (16, 128, 4, 3, 1024, 4), (16, 256, 4, 3, 1024, 4), (16, 128, 4, 5, 1024, 4),
           (32, 128, 4, 4, 1024, 4), (32, 128, 4, 5, 1024, 4), (32, 256, 4, 3, 1024, 4), (32, 64, 4, 6, 1024, 4),
           (32, 128, 8, 3, 1024, 4),
           (64, 128, 4, 3, 1024, 4), (64, 128, 4, 4, 1024, 4), (64, 128, 8, 4, 1024, 4), (64, 64, 4, 5, 1024, 4),
           (128, 64, 8, 3, 1024, 4), (128, 128, 8, 3, 1024, 4),
           (32, 128, 4, 3, 256, 4), (32, 128, 4, 3, 512, 4), (32, 128, 4, 3, 2048, 8), (32, 128, 4, 3, 4096, 8)]
OPS = ("moe_route", "moe_route_hidream")


def main(out_path=None, ops=None, configs=None):
    run_sweep(out_path, ops, None, configs, module_config(moe_ops, *(f.upper() for f in FIELDS)), FIELDS,
              OPS, CONFIGS)


if __name__ == "__main__":
    main(*sys.argv[1:])
