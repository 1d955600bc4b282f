"""The forward's time against its number of work items, on a GPU:

    PYTHONPATH=. python bench/experiments/forward_waves.py OUT.json [--length 4608] [--heads 20,21,...]

Why: the dense sm_90 core is persistent, one program per SM dealt 128-query
work items round robin, so a launch whose items are not a multiple of the
SM count ends in a partial wave. At Flux's 1x24x4608x128 that is 864 items
on 132 SMs: six full rounds and one of 72. If the tail costs what the wave
count says, the time steps with ``ceil(items / SMs)`` rather than growing
with the items. This script times ``compile_ops.attention``'s forward
(CUDA-graph replays) and SDPA's cuDNN backend at one length over a range of
head counts, with the item and round counts beside each time.
"""

import argparse
import json
import math

import torch
import torch.nn.functional as F

import compile_ops
from bench.toolkit import graph_replay_time, make_timer, warm_up_gpu, write_rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--length", type=int, default=4608)
    p.add_argument("--heads", default="20,21,22,23,24,25,26")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    timer = make_timer(False)
    warm_up_gpu()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for rnd in range(args.rounds):
        for h in (int(x) for x in args.heads.split(",")):
            q, k, v = (torch.randn(1, h, args.length, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            items = math.ceil(args.length / 128) * h
            flops = 4 * h * args.length**2 * 128

            def ours():
                with torch.no_grad():
                    compile_ops.attention(q, k, v)

            def cudnn():
                with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    F.scaled_dot_product_attention(q, k, v)

            for name, fn in (("fused_eager", ours), ("sdpa_cudnn", cudnn)):
                ms = graph_replay_time(fn, timer)
                rows.append(
                    dict(
                        round=rnd,
                        heads=h,
                        length=args.length,
                        items=items,
                        waves=items / sms,
                        provider=name,
                        fwd_ms=ms,
                        fwd_TFLOPs=flops / ms / 1e9,
                        ms_per_full_wave=ms / math.ceil(items / sms),
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
