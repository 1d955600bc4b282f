"""FP8 P V's register cap on block-sparse attention as the patched models call it, on an sm_90 GPU:

    PYTHONPATH=. python bench/experiments/attention_8bit_cap_as_models.py OUT.json [--rounds N]

Why: ``forward_tiles`` gives the ``int8_fp8`` forward 2 stages under
``INT8_FP8_MAXNREG`` on sm_90 (three programs an SM). It was timed on the
plain front end (``attention_8bit_maxnreg.py``); the models call the
variant with a token order and, before an FP8 ``to_out``, FP8 output rows,
which ptxas spills more under the cap (``test_sm90_compile.py``).

On Wan 2.1's sliding-tile lists at 480p and 720p, q, k and v in token order
and the layout's tile order as ``token_order``, in alternated rounds:

- ``exact``: 16-bit block-sparse attention (the sm_90 core and the
  permutations around it), the issue's baseline as the models call it;
- ``int8_fp8`` and ``int8_fp8 rows`` (16-bit output, FP8 output rows), each
  ``capped`` (the shipped launch) and ``uncapped`` (``can_run_gluon`` off for
  the forward: 3 stages, no cap).

Each: the attention kernel's time by the profiler, the whole call's by
CUDA-graph replays; the capped outputs compared bit for bit with the
uncapped ones.
"""

import argparse
import functools
import json

import torch
import triton

from bench.runners.block_sparse import WAN_HEADS, as_models_call, sliding_tile_inputs
from bench.toolkit import kernel_profile
from compile_ops._library import clear_launch_plans
from compile_ops.ops import attention_launch

_CAN_RUN_GLUON = attention_launch.can_run_gluon


def _set_cap(on: bool) -> None:
    attention_launch.can_run_gluon = _CAN_RUN_GLUON if on else (lambda q: False)
    clear_launch_plans()  # a recorded plan would replay the other launch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    results = {"env": dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)}
    rows = results["rows"] = []
    for grid in ("wan_480p", "wan_720p"):
        layout, _, (q, k, v) = sliding_tile_inputs(grid, WAN_HEADS, "cuda")
        exact, eight_bit, eight_bit_rows = (
            functools.partial(as_models_call(layout, provider), q, k, v)
            for provider in ("exact", "int8_fp8", "int8_fp8 rows")
        )

        candidates = [("exact", None, exact)]
        for name, fn in (("int8_fp8", eight_bit), ("int8_fp8 rows", eight_bit_rows)):
            candidates += [(name, True, fn), (name, False, fn)]
        outputs = {}
        with torch.no_grad():
            for rnd in range(args.rounds):
                for name, cap, fn in candidates:
                    _set_cap(cap is not False)
                    got = fn()
                    torch.cuda.synchronize()
                    first = got[0] if isinstance(got, tuple) else got
                    key = (name, cap)
                    outputs.setdefault(key, first.view(torch.uint8).clone())
                    same = None
                    if cap is not None:
                        other = outputs.get((name, not cap))
                        same = None if other is None else bool(torch.equal(outputs[key], other))
                    profile = kernel_profile(fn, calls=5, top=1)
                    row = dict(
                        grid=grid,
                        density=layout.density,
                        provider=name,
                        capped=cap,
                        round=rnd,
                        kernel=profile["top"][0][0],
                        kernel_ms=profile["top"][0][1],
                        gpu_ms=profile["gpu_ms"],
                        graph_ms=triton.testing.do_bench_cudagraph(fn, rep=200),
                        equal_to_other_cap=same,
                    )
                    rows.append(row)
                    print(
                        f"{grid} r{rnd} {name:14s} cap={cap!s:5s} kernel {row['kernel_ms']:.4f} "
                        f"all {row['gpu_ms']:.4f} graph {row['graph_ms']:.4f} same={same}",
                        flush=True,
                    )
                    with open(args.out, "w") as f:
                        json.dump(results, f, indent=1)
        _set_cap(True)
        del q, k, v, outputs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
