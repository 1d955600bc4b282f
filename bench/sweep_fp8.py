"""Sweep the rowwise FP8 quantization kernel's launch config on a GPU, to pick
MAX_BLOCK_N (single pass or two-pass loop), the loop's block and warps, and
the single pass's warps in compile_ops/ops/fp8.py.

    PYTHONPATH=. python bench/sweep_fp8.py [OUT.json] [OPS] [MAXN/LOOPN/LOOPM/LOOPWARPS/SINGLEWARPS,...]

At the registry's FP8 shapes (Flux.1-dev's activations), bf16, CUDA-graph
replays of the forward (``bench.toolkit.run_sweep``).
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.toolkit import module_config, run_sweep  # noqa: E402
from compile_ops.ops import fp8 as fp8_ops  # noqa: E402

# max_block_n, loop block_n, loop block_m, loop warps, single-pass max warps.
# The first two: every row of these shapes read once (16 or 32 warps); the
# others loop over 12288-wide rows (8192 < 12288; a 3072-wide row stays single).
CONFIGS = [(16384, 16384, 1, 16, 16), (16384, 16384, 1, 16, 32),
           (8192, 1024, 1, 2, 16), (8192, 1024, 1, 4, 16), (8192, 2048, 1, 4, 16), (8192, 2048, 1, 8, 16),
           (8192, 4096, 1, 4, 16), (8192, 4096, 1, 8, 16), (8192, 4096, 1, 16, 16), (8192, 8192, 1, 8, 16),
           (8192, 8192, 1, 16, 16), (8192, 2048, 2, 4, 16), (8192, 2048, 2, 8, 16), (8192, 1024, 4, 4, 16),
           (8192, 1024, 4, 8, 16)]
OPS = ("quantize_fp8_rows_gelu_tanh", "quantize_fp8_rows_concat", "quantize_fp8_rows")


def main(out_path=None, ops=None, configs=None):
    run_sweep(out_path, ops, None, configs,
              module_config(fp8_ops, "MAX_BLOCK_N", "LOOP_BLOCK_N", "LOOP_BLOCK_M", "LOOP_WARPS", "SINGLE_MAX_WARPS"),
              ("max_block_n", "loop_block_n", "loop_block_m", "loop_warps", "single_max_warps"), OPS, CONFIGS)


if __name__ == "__main__":
    main(*sys.argv[1:])
