"""8-bit attention's FP8 P V accumulated by the MMA itself, on a GPU:

    PYTHONPATH=. python bench/experiments/fp8_pv_accumulator.py OUT.json [--rounds 3]

``int8_fp8`` sums each 128-key tile's P V in a fresh FP8 dot and adds it to
the fp32 accumulator (two-level accumulation, the specification's sum);
``DOT_ACC`` instead hands the rescaled accumulator to the FP8 wgmma as its
C operand: 50 fewer registers on sm_90 (252 -> 203) and no separate add per
accumulator element, at the cost of Hopper's narrower in-MMA accumulation.
Per shape, ``--rounds`` times alternated, CUDA-graph replays of the
attention launch alone (operands quantized outside the timing) and of the
whole op (q rounded in the kernel, k and v by ``quantize_8bit``), beside
SDPA's cuDNN backend; then each variant's relative L2 to the
specification (``reference.attention.attention_int8_fp8``) and to fp64
attention, on one head's first 4096 queries.
"""

import argparse
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.toolkit import environment, graph_replay_time, make_timer, relative_l2, warm_up_gpu
from compile_ops import reference
from compile_ops.ops import attention_8bit, attention_launch, attention_tiles

SHAPES = [(1, 24, 4608, 128), (1, 12, 32760, 128), (1, 40, 16384, 128), (1, 12, 75600, 128), (2, 24, 4096, 64)]
_DEFAULT_TILES = attention_tiles.forward_tiles


def _tiles(dot_acc: bool):
    def tiles(d, dtype, tma=False, precision="exact", wgmma=False, register_cap=False):
        t = _DEFAULT_TILES(d, dtype, tma, precision)
        return attention_tiles.Tiles(t.block_m, t.block_n, t.num_warps, t.num_stages, tma=t.tma, dot_acc=dot_acc)

    return tiles


def _launch(operands, v, out, scale, dot_acc):
    attention_launch.forward_tiles = _tiles(dot_acc)
    try:
        attention_8bit.launch_eight_bit(operands, v, out, scale, False, 2, None)
    finally:
        attention_launch.forward_tiles = _DEFAULT_TILES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    timer = make_timer(False)
    warm_up_gpu(5)
    rows = []
    for b, h, length, d in SHAPES:
        q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        scale = d**-0.5
        flops = 4 * b * h * length * length * d
        out = torch.empty_like(q)
        row = {"shape": [b, h, length, d], "TFLOPs": {}}
        pre = (q, None) + attention_8bit.quantize_8bit(k, v, 2)
        calls = {"sdpa_cudnn": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)}
        for dot_acc in (False, True):
            tag = "dot_acc" if dot_acc else "two_level"
            calls[f"kernel_{tag}"] = lambda dot_acc=dot_acc: _launch(pre, v, out, scale, dot_acc)
            calls[f"op_{tag}"] = lambda dot_acc=dot_acc: _launch(
                attention_8bit.quantized_operands(q, k, v, 2, True), v, out, scale, dot_acc
            )
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for _ in range(args.rounds):
                for name, fn in calls.items():
                    row["TFLOPs"].setdefault(name, []).append(round(flops / graph_replay_time(fn, timer) / 1e9, 1))
        # Errors on one head's first 4096 queries against all its keys (the references hold [Lq, Lk] scores).
        q2, k2, v2 = q[:1, :1, :4096].contiguous(), k[:1, :1].contiguous(), v[:1, :1].contiguous()
        spec = reference.attention.attention_int8_fp8(q2, k2, v2, scale, False, 2).float()
        exact = torch.softmax((q2.double() @ k2.double().transpose(-1, -2)) * scale, -1) @ v2.double()
        for dot_acc in (False, True):
            got = torch.empty_like(q2)
            _launch((q2, None) + attention_8bit.quantize_8bit(k2, v2, 2), v2, got, scale, dot_acc)
            tag = "dot_acc" if dot_acc else "two_level"
            row[f"rel_l2_to_spec_{tag}"] = relative_l2(got.float(), spec)
            row[f"rel_l2_to_fp64_{tag}"] = relative_l2(got.double(), exact)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v, out, pre
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"environment": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
