"""Flux's projections that read one input, as one FP8 GEMM over their concatenated
weights against one GEMM each, on a GPU:

    PYTHONPATH=. python bench/experiments/fp8_fused_projections.py OUT.json [--rounds 3]

Each case is a group of Flux.1-dev Linears that read the same e4m3 rows (``M`` tokens,
``K`` = 3072): the double block's image q/k/v (4096 tokens), its text q/k/v (512), and
the single block's q/k/v with and without its MLP up projection (4608). Providers,
``torch._scaled_mm`` with rowwise scales and fast accumulation as ``fp8_linear`` calls
it, CUDA-graph replays in alternated rounds:

- ``separate``: one GEMM per Linear (what ``patch(precision="fp8")`` runs);
- ``fused``: one GEMM over the weights concatenated along N, whose output columns are
  the Linears' outputs side by side (rowwise weight scales concatenate with them).

Beside the times: TFLOP/s (``2MNK`` summed over the group) and the largest difference
between the fused output's column blocks and the separate outputs (0 when cuBLAS sums
each column the same way in both).
"""

import torch

from bench.toolkit import experiment_parser, gemm_round_rows, random_fp8_rows, start_experiment, write_rows
from compile_ops.ops.fp8 import FP8Rows, fp8_linear

K = 3072
#: ``name: (tokens, [output widths])``: Flux.1-dev's groups of Linears over one input.
CASES = {
    "double_image_qkv": (4096, [3072, 3072, 3072]),
    "double_text_qkv": (512, [3072, 3072, 3072]),
    "single_qkv": (4608, [3072, 3072, 3072]),
    "single_qkv_mlp": (4608, [3072, 3072, 3072, 12288]),
}


def _operands(tokens: int, widths: list) -> tuple:
    """``(q [M, K] e4m3, q_scale [M], [(w [N, K] e4m3, w_scale [N])] per Linear)``, seeded."""
    torch.manual_seed(0)
    q, q_scale = random_fp8_rows(tokens, K)
    return q, q_scale, [random_fp8_rows(n, K) for n in widths]


def main(argv=None) -> int:
    args, timer = start_experiment(experiment_parser(__doc__), argv)
    rows = []
    for case, (tokens, widths) in CASES.items():
        q, q_scale, weights = _operands(tokens, widths)
        fused_weight = torch.cat([w for w, _ in weights])
        fused_scale = torch.cat([s for _, s in weights])
        with torch.no_grad():
            separate = [fp8_linear(FP8Rows(q, q_scale), w, s) for w, s in weights]
            fused = fp8_linear(FP8Rows(q, q_scale), fused_weight, fused_scale)
        max_diff = (fused.float() - torch.cat(separate, dim=1).float()).abs().max().item()
        providers = {
            "separate": lambda: [fp8_linear(FP8Rows(q, q_scale), w, s) for w, s in weights],
            "fused": lambda: fp8_linear(FP8Rows(q, q_scale), fused_weight, fused_scale),
        }
        flops = 2 * tokens * sum(widths) * K
        print(f"{case}: fused differs from separate by {max_diff:.3g} at most", flush=True)
        fields = dict(case=case, M=tokens, K=K, N=widths, fused_max_diff_from_separate=max_diff)
        rows += gemm_round_rows(providers, flops, args.rounds, timer, **fields)
        write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
