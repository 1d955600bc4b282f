"""The five-product backward's q/dO ring depth, beside cuDNN and the deterministic passes (issue 28):

    PYTHONPATH=. python bench/experiments/backward_stages.py OUT.json [--shapes BxHxLxD[c],...] [--stages 2,3,4]
        [--rounds 2]

Why: at D = 64 the five-product backward (``set_attention_backward(deterministic=False)``)
holds a q/dO stage in 16 KB of shared memory where D = 128 needs 32, so a
deeper ring fits (``ops.attention.SM90_BACKWARD_STAGES``). Per shape (a
trailing ``c``: causal), ``--rounds`` times alternated: forward+backward
steps of ``compile_ops.attention`` with the five-product backward at each
ring depth, with the deterministic passes, and of SDPA's cuDNN and flash
backends, CUDA-graph replays (``bench.attention.measure``'s step).
"""
import argparse
import json

import torch

import compile_ops
from bench.attention import keep_busy, providers
from bench.toolkit import graph_replay_time, make_timer, warm_up_gpu, write_rows
from compile_ops.ops import attention as attention_ops

SHAPES = "2x24x4096x64,1x24x4429x64,1x24x16384x64,2x24x4096x64c"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--stages", default="2,3,4")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    timer = make_timer(False)
    warm_up_gpu()
    rows = []
    for text in args.shapes.split(","):
        causal = text.endswith("c")
        b, h, length, d = (int(x) for x in text.rstrip("c").split("x"))
        chosen = {name: fn for name, fn in providers(causal).items()
                  if name in ("fused_eager", "sdpa_cudnn", "sdpa_flash")}
        q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn_like(q)
        flops = 3.5 * 4 * b * h * length ** 2 * d * (0.5 if causal else 1.0)
        runs = [("deterministic", chosen["fused_eager"], None), ("sdpa_cudnn", chosen["sdpa_cudnn"], None),
                ("sdpa_flash", chosen["sdpa_flash"], None)]
        runs += [(f"five_product_{s}_stages", chosen["fused_eager"], int(s)) for s in args.stages.split(",")]
        default = attention_ops.SM90_BACKWARD_STAGES
        for rnd in range(args.rounds):
            for name, fn, stages in runs:
                def step(fn=fn):
                    fn(q, k, v).backward(grad)
                    q.grad = k.grad = v.grad = None

                compile_ops.set_attention_backward(deterministic=stages is None)
                attention_ops.SM90_BACKWARD_STAGES = stages or default
                try:
                    keep_busy(step, 1.0)
                    ms = graph_replay_time(step, timer)
                finally:
                    compile_ops.set_attention_backward(deterministic=True)
                    attention_ops.SM90_BACKWARD_STAGES = default
                rows.append(dict(shape=[b, h, length, d], causal=causal, round=rnd, provider=name, fwdbwd_ms=ms,
                                 fwdbwd_TFLOPs=flops / ms / 1e9))
                print(json.dumps(rows[-1]), flush=True)
        del q, k, v, grad
        torch.cuda.empty_cache()
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
