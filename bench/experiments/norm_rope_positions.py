"""Positions a program and warps for the rotation with a norm over all heads (``NORM`` 2), on a GPU:

    PYTHONPATH=. python bench/experiments/norm_rope_positions.py OUT.json [--lengths 32760,75600] [--rounds 3]

Why: ``qk_norm_rope`` with ``[H * D]`` weights moves its bytes at 1.7-1.8
TB/s against about 2.6 for the plain rotation (docs/notes/rope.md, "Norms
over the heads"). A program holds every head of ``BLOCK_L`` positions (16 at
D = 128 and 4 warps before this sweep, 8 and 8 since) and reads them twice, once for the sums of squares and once to
rotate: fewer positions a program may keep the second read in L1.

Wan 2.1's q/k (``[1, L, 12, 128]`` bf16, norm over 1536 channels), forward,
CUDA-graph replays in alternated rounds over ``BLOCK_L`` x ``num_warps``
(``WHOLE_ROW_TILE`` / ``WHOLE_ROW_WARPS``); the outputs compared bit for bit
with the shipped launch's (another number of warps sums the squares in
another order).
"""

import itertools

import torch

import compile_ops
from bench.experiments.norm_over_heads import EPS, HEAD_DIM, HEADS, wan_inputs
from bench.toolkit import experiment_parser, replay_rounds, start_experiment, write_rows
from compile_ops._library import clear_launch_plans
from compile_ops.ops import rope_launch

SHIPPED = rope_launch.WHOLE_ROW_TILE, rope_launch.WHOLE_ROW_WARPS


def _launch(block_l, warps):
    """Set the whole-row forward's positions a program (at D = 128) and warps (None: shipped)."""
    rope_launch.WHOLE_ROW_TILE, rope_launch.WHOLE_ROW_WARPS = (
        SHIPPED if block_l is None else (block_l * HEAD_DIM, warps)
    )
    clear_launch_plans()


def main(argv=None) -> int:
    args, timer = start_experiment(experiment_parser(__doc__, lengths="32760,75600"), argv)
    configs = [(None, None)] + list(itertools.product((1, 2, 4, 8), (2, 4, 8)))
    rows = []
    for length in map(int, args.lengths.split(",")):
        inputs = wan_inputs(length)
        q = inputs[0]
        shipped = None
        same = {}
        providers = {}
        for block_l, warps in configs:
            name = "shipped" if block_l is None else f"BLOCK_L={block_l} warps={warps}"

            def run(*a, block_l=block_l, warps=warps):
                _launch(block_l, warps)
                return compile_ops.qk_norm_rope(*a, EPS, True, 1)

            with torch.no_grad():
                got = run(*inputs)
            shipped = shipped or got
            same[name] = all(torch.equal(g, s) for g, s in zip(got, shipped))
            providers[name] = run
        moved = 4 * q.numel() * q.element_size()  # q and k read and written once
        for rnd, name, ms in replay_rounds(providers, inputs, args.rounds, timer):
            row = dict(
                shape=[1, length, HEADS, HEAD_DIM],
                config=name,
                round=rnd,
                ms=ms,
                GBps=moved / ms / 1e6,
                bit_equal_to_shipped=same[name],
            )
            rows.append(row)
            print(f"L={length} r{rnd} {name:22s} {ms:.4f} ms {row['GBps']:7.0f} GB/s same={same[name]}", flush=True)
        write_rows(args.out, rows)
        _launch(None, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
