"""Sweep the MoE routing kernels' launch config on a GPU, to pick the
ROUTE_*, SPLIT_COLUMNS and LOGITS_* globals in compile_ops/ops/moe.py.

    PYTHONPATH=. python bench/sweeps/moe.py [OUT.json] [OPS] [CONFIG,...]

CONFIG: BT/BH/WARPS/STAGES/SPLIT_COLUMNS/LOGITS_BT/LOGITS_WARPS/LOGITS_STAGES/SPLIT_BT

At the registry's shapes of ``moe_route`` (4096 x 4096, E = 64, k = 2) and
``moe_route_hidream`` (4096 x 2560, E = 4), bf16, CUDA-graph replays of the
forward (every kernel: the split logits, routing and the token lists) and of the
forward+backward step (``bench.toolkit.run_sweep``).
"""

import os
import sys

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.toolkit import module_config, run_sweep  # noqa: E402
from compile_ops.ops import moe as moe_ops  # noqa: E402

FIELDS = (
    "route_block_t",
    "route_block_h",
    "route_num_warps",
    "route_num_stages",
    "split_columns",
    "logits_block_t",
    "logits_num_warps",
    "logits_num_stages",
    "route_split_block_t",
)
#: The committed default first; then the narrow routers' kernel (HiDream's E = 4
#: takes it), then the wide routers' split path (E = 64 at H = 4096).
CONFIGS = [
    (32, 128, 4, 5, 1024, 128, 8, 3, 32),
    (32, 128, 4, 3, 1024, 128, 8, 3, 32),
    (16, 128, 4, 5, 1024, 128, 8, 3, 32),
    (32, 256, 4, 4, 1024, 128, 8, 3, 32),
    (64, 128, 4, 5, 1024, 128, 8, 3, 32),
    (32, 128, 4, 5, 512, 128, 8, 3, 32),
    (32, 128, 4, 5, 2048, 128, 8, 3, 32),
    (32, 128, 4, 5, 1024, 64, 4, 3, 32),
    (32, 128, 4, 5, 1024, 64, 4, 4, 32),
    (32, 128, 4, 5, 512, 64, 4, 4, 32),
    (32, 128, 4, 5, 1024, 128, 8, 4, 32),
    (32, 128, 4, 5, 1024, 128, 4, 3, 32),
    (32, 64, 4, 6, 1024, 128, 8, 4, 32),
    (32, 256, 4, 2, 1024, 128, 8, 2, 32),
    (32, 128, 4, 5, 1024, 128, 8, 3, 16),
    (32, 128, 4, 5, 1024, 128, 8, 3, 64),
    (32, 128, 4, 5, 512, 256, 8, 3, 32),
]
OPS = ("moe_route", "moe_route_hidream")


def main(out_path=None, ops=None, configs=None):
    run_sweep(out_path, ops, None, configs, module_config(moe_ops, *(f.upper() for f in FIELDS)), FIELDS, OPS, CONFIGS)


if __name__ == "__main__":
    main(*sys.argv[1:])
