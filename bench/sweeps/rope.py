"""Sweep the RoPE kernels' launch configs on a GPU, to pick TILE,
PROGRAMS_PER_SM and NUM_WARPS in compile_ops/ops/rope_launch.py.

    PYTHONPATH=. python bench/sweeps/rope.py [OUT.json] [OPS] [TILE/PER_SM/WARPS,...]

rope_qk (half-split, [B, L, H, D]), rope (interleaved, [B, H, L, D]),
rope_grid and qk_norm_rope at the registry's RoPE shapes, bf16, timed as CUDA
graph replays of the forward and of the whole forward+backward step
(``bench.toolkit.run_sweep``: three interleaved rounds, median kept).
"""

import os
import sys

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.toolkit import module_config, run_sweep  # noqa: E402
from cases import ROPE_SHAPES  # noqa: E402
from compile_ops.ops import rope_launch  # noqa: E402

CONFIGS = [(2048, 4, 4), (4096, 4, 4), (4096, 8, 8), (8192, 4, 8)]  # tile, programs per SM, warps
OPS = ("rope_qk", "rope", "rope_grid", "qk_norm_rope")


def main(out_path=None, ops=None, configs=None):
    run_sweep(
        out_path,
        ops,
        ROPE_SHAPES,
        configs,
        module_config(rope_launch, "TILE", "PROGRAMS_PER_SM", "NUM_WARPS"),
        ("tile", "programs_per_sm", "num_warps"),
        OPS,
        CONFIGS,
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
