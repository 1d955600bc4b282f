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

from bench.toolkit import experiment_parser, gemm_round_rows, start_experiment, write_rows

IMAGE, TEXT = 4096, 512
#: ``name: (K, N)`` of Flux.1-dev's double-block Linears, one per stream.
CASES = {
    "qkv_fused": (3072, 9216),
    "q_k_or_v": (3072, 3072),
    "out_proj": (3072, 3072),
    "mlp_up": (3072, 12288),
    "mlp_down": (12288, 3072),
}


def _e4m3(*shape):
    return (torch.randn(*shape, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)


def _scales(*shape):
    return torch.rand(*shape, device="cuda") / 100 + 1e-3


def _gemm(q, q_scale, weight, weight_scale):
    return torch._scaled_mm(
        q,
        weight.t(),
        scale_a=q_scale[:, None],
        scale_b=weight_scale[None],
        out_dtype=torch.bfloat16,
        use_fast_accum=True,
    )


def main(argv=None) -> int:
    args, timer = start_experiment(experiment_parser(__doc__), argv)
    rows = []
    for case, (k, n) in CASES.items():
        torch.manual_seed(0)
        rows_q, rows_scale = _e4m3(IMAGE + TEXT, k), _scales(IMAGE + TEXT)
        weights, weight_scales = _e4m3(2, n, k), _scales(2, n)
        offsets = torch.tensor([IMAGE, IMAGE + TEXT], dtype=torch.int32, device="cuda")
        image, text = rows_q[:IMAGE], rows_q[IMAGE:]
        image_scale, text_scale = rows_scale[:IMAGE], rows_scale[IMAGE:]

        def per_stream():
            return (
                _gemm(image, image_scale, weights[0], weight_scales[0]),
                _gemm(text, text_scale, weights[1], weight_scales[1]),
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
            return _gemm(rows_q, rows_scale, weights[0], weight_scales[0])

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
