"""Forward speed at key lengths that are not a multiple of 128, against cuDNN (``attention_kernel="auto"``):

    PYTHONPATH=. python bench/experiments/ragged_keys.py OUT.json [--shapes BxHxLxD,...] [--rounds 3]

Why: ``integrations.diffusers.attention_kernel.sdpa_is_faster`` sent 16-bit inference below
16385 keys to SDPA's cuDNN backend, from measurements at whole multiples of
128 keys (4096, 4608). At 4429 and 4500 keys (D = 128) the sm_90 core ran
1.05-1.06x cuDNN in the split-last-round runs (docs/notes/attention-forward.md): cuDNN's
time grows at a ragged key length and the core's masked last tile costs
nothing. Which lengths does that hold at? Flux at non-square resolutions
(1360x768: 4592 tokens; 1280x720: 4112) and Qwen-Image (an image's tokens
plus a prompt's) have such lengths. Per shape, ``--rounds`` times
alternated: ``compile_ops.attention`` eager and compiled
(``bench.runners.attention.providers``) and SDPA's cuDNN backend, forward, CUDA-graph
replays.
"""

import json

import torch

from bench.runners.attention import providers
from bench.toolkit import experiment_parser, replay_rounds, start_experiment, write_rows

SHAPES = (
    "1x24x4608x128,1x24x4544x128,1x24x4592x128,1x24x4429x128,1x24x4112x128,1x24x2816x128,1x24x6989x128,"
    "1x24x12288x128,1x24x12345x128"
)


def main(argv=None) -> int:
    args, timer = start_experiment(experiment_parser(__doc__, shapes=SHAPES), argv)
    chosen = {
        name: fn for name, fn in providers(False).items() if name in ("fused_eager", "fused_compiled", "sdpa_cudnn")
    }
    rows = []
    for shape in (tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")):
        b, h, length, d = shape
        q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * length**2 * d
        for rnd, name, ms in replay_rounds(chosen, (q, k, v), args.rounds, timer):
            rows.append(
                dict(
                    shape=list(shape),
                    round=rnd,
                    provider=name,
                    keys_mod_128=length % 128,
                    fwd_ms=ms,
                    fwd_TFLOPs=flops / ms / 1e9,
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
