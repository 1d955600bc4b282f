"""A TopK layout's attention with the tile order as ``token_order`` against q, k, v permuted first.

    PYTHONPATH=. python bench/experiments/topk_token_order.py OUT.json [--grids wan_480p,wan_720p] [--rounds 3]

``Layout.attend`` on a ``compile_ops.TopK`` layout, as Wan's processors call it with
``precision="fp8", attention_precision="int8_fp8"`` (the output as FP8 rows) and in 16 bits:
in 8 bits the shipped path hands the op q, k and v in the tokens' own order with the layout's
tile order as ``token_order``, and only the block means read the permuted q and k; the path it
replaced (which 16 bits keep) wrote permuted copies of q, k and v, called the op on them and
permuted the output back. Eager
calls (the lists are chosen per call), ``do_bench`` medians of ``--rounds`` alternated rounds,
each call's kernels by ``torch.profiler``, and the two paths' outputs compared (the same bits, or
their relative L2: the 8-bit quantization smooths k by its mean over the keys, which the two
paths sum in different orders).
Inputs: ``bench/runners/block_sparse.py --precision``'s random q, k, v in token order (12 heads
of 128, k with a channel offset); ``TopK(coverage=0.5)``, whose lists on random inputs keep a
density the results record.
"""

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.toolkit import environment, kernel_profile, make_timer, relative_l2  # noqa: E402


def _permuted_first(layout, query, key, value, precision: str, fp8_rows: bool):
    """The replaced path: q, k, v permuted into the tile order, the op on the copies, the output back."""
    import compile_ops
    from compile_ops.ops.fp8 import FP8Rows

    q, k, v = (t.index_select(1, layout.perm) for t in (query, key, value))
    index, count = compile_ops.topk_block_index(q, k, layout.topk.coverage, layout.topk.sink_blocks, seq_dim=1)
    if fp8_rows:
        out = compile_ops.block_sparse_attention_fp8_rows(q, k, v, index, count, seq_dim=1)
        return FP8Rows(*(t.index_select(1, layout.inverse) for t in out))
    out = compile_ops.block_sparse_attention(q, k, v, index, count, seq_dim=1, precision=precision)
    return out.index_select(1, layout.inverse)


def _compared(a, b) -> tuple:
    """``(same bits, relative L2)`` of two outputs: tensors, or FP8 rows dequantized."""
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b)), relative_l2(a, b)
    return all(torch.equal(x, y) for x, y in zip(a, b)), relative_l2(a.dequantized(), b.dequantized())


def grid_rows(grid_name: str, rounds: int, timer, device: str = "cuda") -> list:
    import compile_ops
    from bench.runners.block_sparse import GRIDS, WAN_HEADS, sliding_tile_inputs

    layout = compile_ops.TopK(coverage=0.5).layout(GRIDS[grid_name], device)
    _, _, (query, key, value) = sliding_tile_inputs(grid_name, WAN_HEADS, device)
    rows = []
    for precision, fp8_rows in (("int8_fp8", True), ("exact", False)):
        calls = {
            "Layout.attend": lambda: layout.attend(query, key, value, precision=precision, fp8_rows=fp8_rows),
            "permuted first": lambda: _permuted_first(layout, query, key, value, precision, fp8_rows),
        }
        times = {name: [] for name in calls}
        with torch.no_grad():
            same, distance = _compared(calls["Layout.attend"](), calls["permuted first"]())
            for _ in range(rounds):
                for name, call in calls.items():
                    times[name].append(timer(call))
            q = query.index_select(1, layout.perm)
            index, count = compile_ops.topk_block_index(q, key.index_select(1, layout.perm), 0.5, 1, seq_dim=1)
            density = count.float().mean().item() / index.shape[-1]
            for name, call in calls.items():
                runs = sorted(times[name])
                row = dict(
                    grid=grid_name,
                    tokens=query.shape[1],
                    precision=precision,
                    fp8_rows=fp8_rows,
                    path=name,
                    density=density,
                    ms=statistics.median(runs),
                    ms_min=runs[0],
                    ms_max=runs[-1],
                    same_bits_as_the_other_path=same,
                    rel_l2_to_the_other_path=distance,
                    kernels=kernel_profile(call, calls=3, top=8),
                )
                print(
                    f"{grid_name} {precision:8s} {name:15s} {row['ms']:.3f} ms ({runs[0]:.3f}-{runs[-1]:.3f}) "
                    f"density {density:.3f} same bits {same} rel. L2 {distance:.2e}",
                    flush=True,
                )
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--grids", default="wan_480p,wan_720p")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    timer = make_timer(False)
    rows = []
    for grid in args.grids.split(","):
        rows += grid_rows(grid, args.rounds, timer)
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"env": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
