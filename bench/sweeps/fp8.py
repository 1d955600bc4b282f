"""Sweep the held-row schedules of the rowwise FP8 quantization on a GPU, to fill
``SCHEDULES`` in compile_ops/ops/fp8.py.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python bench/sweeps/fp8.py [OUT.json] [CASES]

CASES: comma-separated names of :data:`CASES` (default: all; one run of all
of them takes about two minutes, compiling included). Each case is a shape
of the DiTs' standalone quantizations, bf16, timed under the launcher's
default schedule (no SCHEDULES entry), under the case's SCHEDULES entry if
there is one, and under each candidate ``Schedule(block_m, block_n, warps)``
(one tile a program); beside them a torch copy of the same bytes (read +
written) on the same GPU. CUDA-graph replays, do_bench medians, ROUNDS
interleaved rounds (median kept, spread reported). Each row reports its
time, GB/s and % of that copy, and whether its bytes and scales are the
default schedule's; OUT.json gets the rows with the GPU, torch and triton
versions (``bench.toolkit.write_sweep``). The end of the log gives each
case's fastest schedule as a SCHEDULES line to paste.
"""

import os
import statistics
import sys
import time

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import compile_ops  # noqa: E402
from bench.toolkit import error_text, graph_replay_time, log, warm_up_gpu, write_sweep  # noqa: E402
from compile_ops._library import clear_launch_plans  # noqa: E402
from compile_ops.ops import fp8 as fp8_ops  # noqa: E402
from compile_ops.ops.fp8 import Schedule  # noqa: E402

S = Schedule
#: ``name: (activation, rows, head width, width, candidates)``. Candidates keep
#: at least 4 values a thread in each block (8-byte loads or wider) and, as
#: triton 3.6 compiles them for sm_90, no register spills (``ptxas -v``);
#: tests/test_sm90_compile.py compiles every one.
CASES = {
    # Flux's MLP activation before the down projection.
    "flux_mlp": (
        "gelu_tanh",
        4096,
        0,
        12288,
        [
            S(1, 4096, 8),
            S(2, 2048, 16),
        ],
    ),
    # Flux's single block: the attention output, then the MLP activation, before proj_out.
    "flux_single": (
        "gelu_tanh",
        4608,
        3072,
        12288,
        [
            S(1, 4096, 32),
            S(1, 4096, 8),
            S(2, 2048, 16),
        ],
    ),
    # An attention output that no kernel quantized.
    "flux_attention_out": (
        "none",
        4608,
        0,
        3072,
        [
            S(1, 1024, 4),
            S(4, 1024, 16),
        ],
    ),
    # Wan 2.1 14B's MLP activation (32760 tokens of 480p video).
    "wan_mlp": (
        "gelu_tanh",
        32760,
        0,
        8960,
        [
            S(1, 2048, 16),
            S(1, 2048, 8),
            S(2, 2048, 16),
            S(1, 1024, 4),
            S(2, 1024, 8),
        ],
    ),
    # Wan 2.1 1.3B's residual-stream width, plain.
    "wan_plain": (
        "none",
        32760,
        0,
        1536,
        [
            S(4, 512, 4),
            S(8, 512, 8),
        ],
    ),
}
ROUNDS = 3
#: Where the inputs live (a dry run of the script's logic may set "cpu" under TRITON_INTERPRET=1).
DEVICE = "cuda"
#: do_bench's (warmup, rep) in ms of run time: short, so that one run of every case fits in about three minutes.
WARMUP_MS, REP_MS = 10, 100


def _timer(fn):
    return do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def _inputs(activation, rows, head_width, width):
    """x [rows, width] and head [rows, head_width] (None for 0), bf16 on DEVICE; the bytes read and written."""
    x = torch.randn(rows, width, device=DEVICE, dtype=torch.bfloat16)
    head = torch.randn(rows, head_width, device=DEVICE, dtype=torch.bfloat16) if head_width else None
    moved = x.nbytes + (head.nbytes if head is not None else 0) + rows * (head_width + width) + 4 * rows
    return x, head, moved


def _quantize_under(schedule, key, x, activation, head):
    """A call of the op that launches with ``schedule`` (None: the default schedule)."""
    fp8_ops.SCHEDULES = {} if schedule is None else {key: schedule}
    clear_launch_plans()  # eager calls replay the config they were recorded with

    def call():
        return compile_ops.quantize_fp8_rows(x, activation, head=head)

    return call


def sweep_case(name, activation, rows, head_width, width, candidates) -> list:
    """Rows of one case: the copy, the default schedule, the SCHEDULES entry (if
    there is one) and each candidate, timed in interleaved rounds."""
    x, head, moved = _inputs(activation, rows, head_width, width)
    key = (activation, head_width, width)
    src = torch.empty(moved // 2, device=DEVICE, dtype=torch.uint8)
    dst = torch.empty_like(src)
    saved = fp8_ops.SCHEDULES
    entry = saved.get(key)
    configs = [None, *([entry] if entry and entry not in candidates else []), *candidates]
    labels = {c: "default" if c is None else "table" if c == entry else "candidate" for c in configs}
    times = {c: [] for c in ["copy", *configs]}
    same = {}
    try:
        with torch.no_grad():
            want = _quantize_under(None, key, x, activation, head)()
            for c in configs[1:]:
                try:
                    got = _quantize_under(c, key, x, activation, head)()
                    same[c] = all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want))
                except Exception as e:  # noqa: BLE001 (a schedule that fails to compile is a result)
                    log(f"{name} {c}: {error_text(e)[:200]}")
            for _ in range(ROUNDS):
                times["copy"].append(graph_replay_time(lambda: dst.copy_(src), _timer))
                for c in configs:
                    if c is not None and c not in same:
                        continue
                    times[c].append(graph_replay_time(_quantize_under(c, key, x, activation, head), _timer))
    finally:
        fp8_ops.SCHEDULES = saved
        clear_launch_plans()
    copy_ms = statistics.median(times["copy"])
    default = fp8_ops.default_schedule(activation, head_width, width)
    results = []
    for c in configs:
        ts = times[c]
        ms = statistics.median(ts) if ts else float("nan")
        schedule = c or default
        results.append(
            {
                "case": name,
                "activation": activation,
                "rows": rows,
                "head_width": head_width,
                "width": width,
                "schedule": labels[c],
                **(schedule._asdict() if schedule is not None else {"looped": True}),
                "us": ms * 1e3,
                "GBps": moved / (ms * 1e-3) / 1e9,
                "copy_us": copy_ms * 1e3,
                "pct_of_copy": 100 * copy_ms / ms,
                "spread": (max(ts) - min(ts)) / ms if ts else float("nan"),
                "same_bytes_as_default": True if c is None else same.get(c),
            }
        )
        log(
            f"{name:<19} {labels[c]:<9} {str(tuple(schedule or ())):<20} "
            f"{ms * 1e3:8.1f} us {results[-1]['GBps']:6.0f} GB/s {results[-1]['pct_of_copy']:5.1f}% of copy "
            f"(copy {copy_ms * 1e3:.1f} us, spread {100 * results[-1]['spread']:.0f}%)"
            + ("" if results[-1]["same_bytes_as_default"] else "  BYTES DIFFER")
        )
    return results


def main(out_path=None, cases=None):
    start = time.perf_counter()
    warm_up_gpu(4.0)
    results = []
    for name in cases.split(",") if cases else CASES:
        results += sweep_case(name, *CASES[name])
        log(f"[{time.perf_counter() - start:.0f} s]")
    log("Best schedule of each case (paste into SCHEDULES in compile_ops/ops/fp8.py):")
    for name in dict.fromkeys(r["case"] for r in results):
        rows = [r for r in results if r["case"] == name and r["same_bytes_as_default"] and r["us"] == r["us"]]
        rows = [r for r in rows if "block_m" in r]  # a looped default has no Schedule to paste
        best = min(rows, key=lambda r: r["us"])
        fields = ", ".join(str(best[f]) for f in Schedule._fields)
        log(
            f'    ("{best["activation"]}", {best["head_width"]}, {best["width"]}): Schedule({fields}),'
            f"  # {name}: {best['pct_of_copy']:.0f}% of copy ({best['schedule']})"
        )
    write_sweep(out_path, results)


if __name__ == "__main__":
    main(*sys.argv[1:3])
