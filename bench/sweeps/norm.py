"""Sweep the norm kernels' launch configs on a GPU, to pick the tables in
compile_ops/ops/norm.py (forward_config, backward_config).

    PYTHONPATH=. python bench/sweeps/norm.py [OUT.json]

Times the forward op and the backward op alone (bf16, with weight; RMS, and
LayerNorm with bias) at the DiT shapes, with the bytes model of bench/toolkit.py
(forward: read x + write y; backward: read x, dy + write dx). Each candidate
is timed in three interleaved rounds and the median kept: single do_bench
medians of neighbouring configs are too noisy to rank them.
"""

import itertools
import json
import statistics
import sys

import torch
import triton
from triton.testing import do_bench

import compile_ops
from cases import DIT_NORM_SHAPES
from compile_ops.ops import norm as norm_ops

FORWARD = [(1, 4), (1, 8), (2, 4), (2, 8), (4, 8), (4, 16)]  # (block_m, warps)
BACKWARD = [
    (1, 4, 2),
    (1, 8, 1),
    (1, 8, 2),
    (2, 4, 2),
    (2, 8, 1),
    (2, 8, 2),
    (4, 8, 1),
    (4, 8, 2),
    (1, 8, 4),
    (4, 4, 4),
    (1, 16, 1),
    (2, 16, 1),
]  # (block_m, warps, programs/SM)
STAGES = (1, 3)
ROUNDS = 3


def main(out_path=None, norms=("rms", "ln"), backward_only=False):
    results = []
    for (b, l, c), is_rms in itertools.product(DIT_NORM_SHAPES, (True, False)):
        if ("rms" if is_rms else "ln") not in norms:
            continue
        x = torch.randn(b, l, c, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(c, device="cuda", dtype=torch.bfloat16)
        bias = None if is_rms else torch.randn(c, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        nbytes = x.numel() * x.element_size()
        block_n = triton.next_power_of_2(c)
        name = "rms" if is_rms else "ln"

        def fwd():
            return compile_ops.rmsnorm(x, w, 1e-6) if is_rms else compile_ops.layernorm(x, w, bias, 1e-6)

        def bwd():
            return torch.ops.fused.norm_backward(dy, None, x, w, bias, 1e-6, is_rms)

        cands = [] if backward_only else [("fwd", m, wp, 0, 3) for m, wp in FORWARD]
        cands += [("bwd", m, wp, p, st) for (m, wp, p), st in itertools.product(BACKWARD, STAGES)]
        times = {k: [] for k in cands}
        for _ in range(ROUNDS):
            for kind, m, wp, p, st in cands:
                cfg = norm_ops.LaunchConfig(m, block_n, False, wp, st)
                saved = norm_ops.forward_config, norm_ops.backward_config, norm_ops.BACKWARD_PROGRAMS_PER_SM
                try:
                    if kind == "fwd":
                        norm_ops.forward_config = lambda n, acc=1, cfg=cfg: cfg
                    else:
                        norm_ops.backward_config = lambda n, acc=1, cfg=cfg: cfg
                        norm_ops.BACKWARD_PROGRAMS_PER_SM = p
                    fn = fwd if kind == "fwd" else bwd
                    times[(kind, m, wp, p, st)].append(do_bench(fn, warmup=10, rep=60, return_mode="median"))
                except Exception as e:  # out of registers/shared memory at this size
                    print(f"{kind} {name} {b}x{l}x{c} m={m} w={wp} p={p} s={st}: {type(e).__name__}")
                finally:
                    norm_ops.forward_config, norm_ops.backward_config, norm_ops.BACKWARD_PROGRAMS_PER_SM = saved
        for (kind, m, wp, p, st), ts in times.items():
            if not ts:
                continue
            ms = statistics.median(ts)
            passes = 2 if kind == "fwd" else 3
            results.append(
                dict(
                    kind=kind,
                    norm=name,
                    shape=[b, l, c],
                    block_m=m,
                    warps=wp,
                    programs_per_sm=p,
                    stages=st,
                    us=ms * 1e3,
                    GBps=passes * nbytes / ms / 1e6,
                    spread=(max(ts) - min(ts)) / ms,
                )
            )
        for kind in ("fwd", "bwd"):
            rows = sorted(
                (r for r in results if r["kind"] == kind and r["norm"] == name and r["shape"] == [b, l, c]),
                key=lambda r: r["us"],
            )
            print(
                f"{kind} {name} {b}x{l}x{c}: "
                + " | ".join(
                    f"m{r['block_m']} w{r['warps']}"
                    + (f" p{r['programs_per_sm']} s{r['stages']}" if kind == "bwd" else "")
                    + f" {r['GBps']:.0f} (±{100 * r['spread']:.0f}%)"
                    for r in rows[:4]
                ),
                flush=True,
            )
    if out_path:
        with open(out_path, "w") as f:
            json.dump(
                dict(
                    gpu=torch.cuda.get_device_name(),
                    torch=torch.__version__,
                    triton=triton.__version__,
                    results=results,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    # python bench/sweeps/norm.py [OUT.json] [rms,ln] [bwd]
    main(
        sys.argv[1] if len(sys.argv) > 1 else None,
        tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("rms", "ln"),
        backward_only=len(sys.argv) > 3 and sys.argv[3] == "bwd",
    )
