"""Sweep the gated-activation kernel's launch config on a GPU, to pick TILE,
MAX_BLOCK_N and NUM_WARPS in compile_ops/ops/glu.py.

    PYTHONPATH=. python bench/sweeps/glu.py [OUT.json] [OPS] [TILE/BLOCK_N/WARPS,...]

At the registry's GLU shapes, bf16, CUDA-graph replays of the forward and of
the forward+backward step (``bench.toolkit.run_sweep``).
"""

import os
import sys

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.toolkit import module_config, run_sweep  # noqa: E402
from cases import GLU_SHAPES  # noqa: E402
from compile_ops.ops import glu as glu_ops  # noqa: E402

CONFIGS = [
    (4096, 4096, 8),
    (4096, 4096, 4),
    (4096, 2048, 8),
    (2048, 2048, 4),
    (2048, 1024, 4),
    (8192, 4096, 8),
    (8192, 8192, 16),
    (1024, 1024, 4),
]  # tile, max block_n, warps
OPS = ("geglu", "geglu_tanh", "swiglu")


def main(out_path=None, ops=None, configs=None):
    run_sweep(
        out_path,
        ops,
        GLU_SHAPES,
        configs,
        module_config(glu_ops, "TILE", "MAX_BLOCK_N", "NUM_WARPS"),
        ("tile", "max_block_n", "num_warps"),
        OPS,
        CONFIGS,
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
