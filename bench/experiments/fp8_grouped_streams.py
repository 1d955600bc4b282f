"""Flux's double-block Linears of the image and text streams (the same shapes, their own
weights) as one grouped FP8 GEMM against one GEMM a stream, on a GPU:

    PYTHONPATH=. python bench/experiments/fp8_grouped_streams.py OUT.json [--rounds 3]

The text stream's GEMMs are short (512 tokens) and run far below the image stream's
rate; a grouped GEMM runs both streams' tiles in one launch. Per Flux.1-dev Linear pair
(image 4096 tokens, text 512), providers, CUDA-graph replays in alternated rounds:

- ``per_stream``: ``torch._scaled_mm`` rowwise with fast accumulation, once a stream (what
  ``patch(precision="fp8")`` runs);
- ``grouped``: ``torch._scaled_grouped_mm`` over the streams' rows stacked ``[4608, K]``
  with offsets, each group its own weight ``[2, K, N]``;
- ``one_weight``: one ``torch._scaled_mm`` of all 4608 rows by the image weight: the rate
  a single GEMM of that size reaches, the roof for grouping.

Beside the times: TFLOP/s and the largest difference between the grouped output and the
per-stream outputs (a grouped kernel may sum in another order).
"""

import torch

from bench.toolkit import experiment_parser, gemm_round_rows, random_fp8_rows, start_experiment, write_rows
from compile_ops.ops.fp8 import FP8Rows, fp8_linear

IMAGE, TEXT = 4096, 512
#: ``name: (K, N)`` of Flux.1-dev's double-block Linears, one per stream.
CASES = {
    "qkv_fused": (3072, 9216),
    "q_k_or_v": (3072, 3072),
    "out_proj": (3072, 3072),
    "mlp_up": (3072, 12288),
    "mlp_down": (12288, 3072),
}


def main(argv=None) -> int:
    args, timer = start_experiment(experiment_parser(__doc__), argv)
    rows = []
    for case, (k, n) in CASES.items():
        torch.manual_seed(0)
        rows_q, rows_scale = random_fp8_rows(IMAGE + TEXT, k)
        weights, weight_scales = random_fp8_rows(2, n, k)
        offsets = torch.tensor([IMAGE, IMAGE + TEXT], dtype=torch.int32, device="cuda")
        image, text = rows_q[:IMAGE], rows_q[IMAGE:]
        image_scale, text_scale = rows_scale[:IMAGE], rows_scale[IMAGE:]

        def per_stream():
            return (
                fp8_linear(FP8Rows(image, image_scale), weights[0], weight_scales[0]),
                fp8_linear(FP8Rows(text, text_scale), weights[1], weight_scales[1]),
            )

        def grouped():
            return torch._scaled_grouped_mm(
                rows_q,
                weights.transpose(-2, -1),
                rows_scale,
                weight_scales,
                offs=offsets,
                out_dtype=torch.bfloat16,
                use_fast_accum=True,
            )

        def one_weight():
            return fp8_linear(FP8Rows(rows_q, rows_scale), weights[0], weight_scales[0])

        providers = {"per_stream": per_stream, "grouped": grouped, "one_weight": one_weight}
        with torch.no_grad():
            try:
                got = grouped()
                max_diff = (got.float() - torch.cat(per_stream()).float()).abs().max().item()
            except RuntimeError as e:  # this torch's grouped GEMM refuses the layout: say so, time the rest
                print(f"{case}: grouped refused: {e}", flush=True)
                rows.append(dict(case=case, provider="grouped", error=str(e)))
                del providers["grouped"]
                max_diff = None
        flops = 2 * (IMAGE + TEXT) * n * k
        print(f"{case}: grouped differs from per-stream by {max_diff} at most", flush=True)
        fields = dict(case=case, M=[IMAGE, TEXT], K=k, N=n, grouped_max_diff_from_per_stream=max_diff)
        rows += gemm_round_rows(providers, flops, args.rounds, timer, **fields)
        write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
