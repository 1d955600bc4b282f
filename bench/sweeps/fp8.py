"""Sweep the rowwise FP8 quantization kernel's launch config on a GPU, to pick
MAX_ROW_VALUES (held rows or the two-pass loop), CHUNK_N (the blocks a held
row is cut in), VALUES_PER_THREAD and ACTIVATION_VALUES_PER_THREAD (warps) and
the loop's block and warps in compile_ops/ops/fp8.py.

    PYTHONPATH=. python bench/sweeps/fp8.py [OUT.json] [OPS]
                                            [ROWVALUES/CHUNK/PERTHREAD/ACTPERTHREAD/LOOPN/LOOPWARPS,...]

At the registry's FP8 shapes (Flux.1-dev's activations), bf16, CUDA-graph
replays of the forward (``bench.toolkit.run_sweep``).
"""

import os
import sys

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.toolkit import module_config, run_sweep  # noqa: E402
from compile_ops.ops import fp8 as fp8_ops  # noqa: E402

FIELDS = (
    "max_row_values",
    "chunk_n",
    "values_per_thread",
    "activation_values_per_thread",
    "loop_block_n",
    "loop_warps",
)
# Held rows in blocks of 4096 or 2048 with several thread loads; then the
# two-pass loop (8192 values: 12288-wide rows loop, narrower ones are held).
CONFIGS = [
    (16384, 4096, 128, 32, 2048, 4),
    (16384, 4096, 64, 64, 2048, 4),
    (16384, 4096, 32, 16, 2048, 4),
    (16384, 2048, 128, 32, 2048, 4),
    (8192, 4096, 128, 32, 2048, 4),
    (8192, 4096, 128, 32, 2048, 8),
]
OPS = ("quantize_fp8_rows_gelu_tanh", "quantize_fp8_rows_concat", "quantize_fp8_rows")


def main(out_path=None, ops=None, configs=None):
    run_sweep(out_path, ops, None, configs, module_config(fp8_ops, *(f.upper() for f in FIELDS)), FIELDS, OPS, CONFIGS)


if __name__ == "__main__":
    main(*sys.argv[1:])
