"""8-bit attention against 16-bit on short key sequences (text cross-attention), as FP8 rows:

    PYTHONPATH=. python bench/experiments/short_keys.py OUT.json [--shapes BxHxLqxLkxD,...] [--rounds 3]

Why: in the profile of Wan 2.1's 720p step with ``precision="fp8",
attention=SlidingTile(...), attention_precision="int8_fp8"`` the 8-bit kernel's
60 launches a step took 106 ms, where the 16-bit sparse step's self-attention
took 98 ms and cuDNN's cross-attention (75600 queries, 512 text keys) 14.7 ms.
With four key tiles a program, the 8-bit kernel's per-program work (q rounded
to int8, the output rounded to e4m3) is not amortized over a key loop. Does
8-bit cross-attention pay at all, and from how many keys?

Per shape (``[B, Lq, H, D]`` q, ``[B, Lk, H, D]`` k and v, bf16, the models'
layout), ``--rounds`` times alternated, each as CUDA-graph replays, what an FP8
output projection then reads (FP8 rows): SDPA's cuDNN backend + the
``quantize_fp8_rows`` pass; ``compile_ops.attention`` (exact) + that pass;
``compile_ops.attention_fp8_rows`` (8-bit, the rows from its epilogue).
Each provider's rows are dequantized and compared with fp32 attention once.
"""

import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import compile_ops
from bench.toolkit import experiment_parser, relative_l2, replay_rounds, start_experiment, write_rows

#: Wan 2.1's text cross-attention at 720p and 480p (512 text tokens), and key lengths up to self-attention's.
SHAPES = (
    "1x12x75600x512x128,1x12x32760x512x128,1x12x32760x1024x128,1x12x32760x2048x128,"
    "1x12x32760x4096x128,1x12x32760x8192x128"
)


def _providers() -> dict:
    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
        return compile_ops.quantize_fp8_rows(out.transpose(1, 2).flatten(2, 3))

    def fused(q, k, v):
        return compile_ops.quantize_fp8_rows(compile_ops.attention(q, k, v, seq_dim=1).flatten(2, 3))

    def eight_bit(q, k, v):
        return compile_ops.attention_fp8_rows(q, k, v, seq_dim=1)

    return {"cudnn_bf16_then_quantize": cudnn, "fused_exact_then_quantize": fused, "int8_fp8_rows": eight_bit}


def main(argv=None) -> int:
    args, timer = start_experiment(experiment_parser(__doc__, shapes=SHAPES), argv)
    providers = _providers()
    rows = []
    for shape in (tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")):
        b, h, lq, lk, d = shape
        torch.manual_seed(0)
        q = torch.randn(b, lq, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, lk, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        with torch.no_grad():
            exact = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)))
            exact = exact.transpose(1, 2).flatten(2, 3)
            errors = {}
            for name, fn in providers.items():
                rows_out = fn(q, k, v)
                errors[name] = relative_l2(rows_out.dequantized(), exact)
        del exact
        flops = 4 * b * h * lq * lk * d
        for rnd, name, ms in replay_rounds(providers, (q, k, v), args.rounds, timer):
            rows.append(
                dict(
                    shape=list(shape),
                    round=rnd,
                    provider=name,
                    ms=ms,
                    TFLOPs=flops / ms / 1e9,
                    rel_l2_to_fp32=errors[name],
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
