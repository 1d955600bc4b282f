"""Sweep the norm kernels' launch configs on a GPU, to pick the heuristics in
compile_ops/ops/norm.py (forward_config, backward_config, BACKWARD_PROGRAMS_PER_SM).

    PYTHONPATH=. python bench/sweep_norm.py [OUT.json]

Times the forward op and the backward op alone (bf16, weight, RMS and LayerNorm)
at the DiT shapes for each candidate, with the same bytes model as bench/run.py
(forward: read x + write y; backward: read x, dy + write dx).
"""
import itertools
import json
import sys

import torch
import triton
from triton.testing import do_bench

import compile_ops
from compile_ops.ops import norm as norm_ops
from compile_ops.registry import DIT_NORM_SHAPES


def _time(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def main(out_path=None):
    results = []
    default_fwd, default_bwd = norm_ops.forward_config, norm_ops.backward_config
    default_programs = norm_ops.BACKWARD_PROGRAMS_PER_SM
    for (b, l, c), is_rms in itertools.product(DIT_NORM_SHAPES, (True, False)):
        x = torch.randn(b, l, c, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(c, device="cuda", dtype=torch.bfloat16)
        bias = None if is_rms else torch.randn(c, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        nbytes = x.numel() * x.element_size()
        block_n = triton.next_power_of_2(c)
        name = "rms" if is_rms else "ln"
        fwd = (lambda: compile_ops.rmsnorm(x, w, 1e-6)) if is_rms else (lambda: compile_ops.layernorm(x, w, bias, 1e-6))
        bwd = lambda: torch.ops.fused.norm_backward(dy, None, x, w, bias, 1e-6, is_rms)  # noqa: E731
        for block_m, warps in itertools.product((1, 2, 4), (4, 8, 16)):
            if block_m * block_n > 32768 or block_m * block_n < 32 * warps:
                continue
            cfg = norm_ops.LaunchConfig(block_m, block_n, False, warps)
            norm_ops.forward_config = lambda n, cfg=cfg: cfg
            ms = _time(fwd)
            results.append(dict(kind="fwd", norm=name, shape=[b, l, c], block_m=block_m, warps=warps,
                                us=ms * 1e3, GBps=2 * nbytes / ms / 1e6))
            norm_ops.forward_config = default_fwd
            for programs in (1, 2, 4):
                norm_ops.backward_config = lambda n, cfg=cfg: cfg
                norm_ops.BACKWARD_PROGRAMS_PER_SM = programs
                try:
                    ms = _time(bwd)
                except Exception as e:  # register or shared-memory overflow at this size
                    print(f"bwd {name} {b}x{l}x{c} m={block_m} w={warps} p={programs}: {type(e).__name__}")
                    continue
                finally:
                    norm_ops.backward_config = default_bwd
                    norm_ops.BACKWARD_PROGRAMS_PER_SM = default_programs
                results.append(dict(kind="bwd", norm=name, shape=[b, l, c], block_m=block_m, warps=warps,
                                    programs_per_sm=programs, us=ms * 1e3, GBps=3 * nbytes / ms / 1e6))
        for kind in ("fwd", "bwd"):
            rows = [r for r in results if r["kind"] == kind and r["norm"] == name and r["shape"] == [b, l, c]]
            rows.sort(key=lambda r: r["us"])
            print(f"{kind} {name} {b}x{l}x{c}: best " + " | ".join(
                f"m={r['block_m']} w={r['warps']}" + (f" p={r['programs_per_sm']}" if kind == "bwd" else "")
                + f" {r['GBps']:.0f} GB/s" for r in rows[:4]), flush=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
