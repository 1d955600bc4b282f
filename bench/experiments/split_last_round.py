"""The sm_90 core's split last round, on and off in one run (issue 28):

    PYTHONPATH=. python bench/experiments/split_last_round.py OUT.json [--shapes BxHxLxD,...] [--rounds 2]

``ops.attention._split_items`` splits the items of a persistent dense
launch's last, partial round (and one full round before it) along the keys,
so that every SM runs an equal share of their key tiles
(``attn_fwd_sm90_kernel``'s ``SPLIT``). Per shape, alternated ``--rounds``
times: ``compile_ops.attention``'s forward with the split (the package's
rule) and without it (``SPLIT_MIN_IDLE`` above 1), and SDPA's cuDNN backend,
as CUDA-graph replays (where the items fill whole rounds, also the ``SPLIT``
code made to split one whole round, in which every program's range is one
whole item: what the variant's code costs with no piece to merge); the split's output against the unsplit one (max
absolute difference, and the share of elements that differ: the merge of
the pieces rounds differently from one pass) and both against fp32
attention on 512 query rows.
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F

import compile_ops
from bench.toolkit import environment, graph_replay_time, make_timer, relative_l2, warm_up_gpu
from compile_ops._library import clear_launch_plans, multiprocessor_count
from compile_ops.ops import attention as attention_ops

SHAPES = "1x24x4608x128,1x24x4429x128,1x12x32760x128,1x40x16384x128,1x12x75600x128,2x24x4096x64,1x23x4608x128"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--loader-regs", type=int, default=0, help="the core's loader registers (0: the package's)")
    args = p.parse_args(argv)
    if args.loader_regs:  # before the first compile: the kernels read the constant when they are compiled
        from triton.experimental.gluon import language as gl

        from compile_ops.kernels import attention_sm90
        attention_sm90._LOADER_REGS = gl.constexpr(args.loader_regs)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    timer = make_timer(False)
    warm_up_gpu()
    rows = []
    rule, split_rule = attention_ops.SPLIT_MIN_IDLE, attention_ops._split_items
    for shape in (tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")):
        b, h, length, d = shape
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * length ** 2 * d
        items = math.ceil(length / 128) * b * h
        programs = min(items, multiprocessor_count(q))
        tiles = attention_ops.forward_tiles(d, q.dtype, True, "exact", True)
        split = attention_ops._split_items(items, programs, math.ceil(length / tiles.block_n))

        def ours(idle, whole_round=False):
            def call():
                attention_ops.SPLIT_MIN_IDLE = idle
                if whole_round:  # SPLIT's code on one whole round: every program's range is one whole item
                    attention_ops._split_items = lambda items, programs, key_tiles: programs
                clear_launch_plans()  # the rule is not part of a launch plan's signature
                try:
                    with torch.no_grad():
                        return compile_ops.attention(q, k, v)
                finally:
                    attention_ops.SPLIT_MIN_IDLE = rule
                    attention_ops._split_items = split_rule
            return call

        def cudnn():
            with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)

        outs = {"split": ours(rule)(), "unsplit": ours(2.0)()}
        exact = F.scaled_dot_product_attention(*(t[:, :, :512].float() if t is q else t.float() for t in (q, k, v)))
        errors = dict(split_vs_unsplit_max_abs=(outs["split"].float() - outs["unsplit"].float()).abs().max().item(),
                      split_vs_unsplit_differ=(outs["split"] != outs["unsplit"]).float().mean().item(),
                      split_rel_l2_fp32=relative_l2(outs["split"][:, :, :512], exact),
                      unsplit_rel_l2_fp32=relative_l2(outs["unsplit"][:, :, :512], exact))
        print(json.dumps(dict(shape=shape, items=items, programs=programs, split_items=split, **errors)), flush=True)
        for rnd in range(args.rounds):
            providers = [("fused_split", ours(rule)), ("fused_unsplit", ours(2.0)), ("sdpa_cudnn", cudnn)]
            if items % programs == 0:  # SPLIT's code with nothing to split: what the variant itself costs
                providers.append(("fused_split_code_whole_round", ours(rule, whole_round=True)))
            for name, fn in providers:
                ms = graph_replay_time(fn, timer)
                rows.append(dict(shape=list(shape), round=rnd, provider=name, loader_regs=args.loader_regs, items=items, programs=programs,
                                 split_items=split, fwd_ms=ms, fwd_TFLOPs=flops / ms / 1e9, **errors))
                print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(env=environment(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
