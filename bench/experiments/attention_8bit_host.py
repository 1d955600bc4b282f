"""Host time of Flux's 8-bit attention call (1x4608x24x128, ``int8_fp8``, q rounded by the kernel):

    PYTHONPATH=. python bench/experiments/attention_8bit_host.py [OUT_DIR]

For both routes of the tree (``gluon``: as ``takes_sm90_8bit`` routes; ``triton``: with it off):

- 16 calls in a row, eager (launch plans) and in a ``torch.compile(fullgraph=True)``
  function (where each call is the opaque op ``fused_gluon.attention_forward_capped_``):
  wall and enqueue time a loop, and a profile's top kernels and host ops; written to
  ``OUT_DIR/probe.json``;
- the opaque op alone, called as a compiled graph calls it, from an idle GPU: host time a
  call, median of 50;
- a cProfile of 200 opaque-op calls on the tree's route: where the host time goes.
"""

import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import compile_ops
from compile_ops._library import clear_launch_plans
from compile_ops.ops import attention_launch
from compile_ops.ops.attention_8bit import quantized_operands

CALLS = 16


def _loop(q, k, v):
    x = q
    for _ in range(CALLS):
        x = compile_ops.attention(x, k, v, seq_dim=1, precision="int8_fp8")
    return x


def _measure(fn, label, q, k, v, iters=30) -> dict:
    with torch.no_grad():
        for _ in range(3):
            fn(q, k, v)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn(q, k, v)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                fn(q, k, v)
            torch.cuda.synchronize()
    wall, enqueue = (t2 - t0) / iters * 1e3, (t1 - t0) / iters * 1e3
    events = prof.key_averages()
    gpu = sorted(
        ((e.key, e.device_time_total / 5 / 1e3, e.count // 5) for e in events if e.device_time_total > 0),
        key=lambda r: -r[1],
    )
    host = sorted(((e.key, e.cpu_time_total / 5 / 1e3, e.count // 5) for e in events), key=lambda r: -r[1])
    print(f"{label:28s} wall {wall:.3f} ms  enqueue {enqueue:.3f} ms  per call wall {wall / CALLS:.4f}", flush=True)
    for row in gpu[:6]:
        print("   gpu", row)
    for row in host[:12]:
        print("   cpu", row)
    return dict(label=label, wall_ms=wall, enqueue_ms=enqueue)


_ROUTED = attention_launch.takes_sm90_8bit


def _use_route(route: str) -> None:
    """``gluon``: the tree's routing; ``triton``: every 8-bit call on ``attn_fwd_kernel``. Launch
    plans are forgotten: a plan recorded on one route would replay its launches on the other."""
    attention_launch.takes_sm90_8bit = _ROUTED if route == "gluon" else (lambda *a: False)
    clear_launch_plans()


def main(out_dir: str) -> None:
    q, k, v = (torch.randn(1, 4608, 24, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    rows = []
    for route in ("gluon", "triton"):
        _use_route(route)
        torch._dynamo.reset()
        rows.append(_measure(_loop, f"eager {route}", q, k, v))
        rows.append(_measure(torch.compile(_loop, fullgraph=True), f"compiled {route}", q, k, v))
    with open(os.path.join(out_dir, "probe.json"), "w") as f:
        json.dump(rows, f, indent=1)

    with torch.no_grad():
        q16, _, k8, k_scale, vt8, v_scale = quantized_operands(q, k, v, 1, pv_fp8=True)
        out = torch.empty_like(q)
        lse = torch.empty(1, 24, 4608, device="cuda", dtype=torch.float32)
        op = torch.ops.fused_gluon.attention_forward_capped_
        args = (q16, k8, vt8, out, lse, 128**-0.5, False, 1, None, None, None, None, k_scale, v_scale, None, None, None)
        for route in ("gluon", "triton", "gluon", "triton"):
            _use_route(route)
            for _ in range(5):
                op(*args)
            times = []
            for _ in range(50):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                op(*args)
                times.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            times.sort()
            print(
                f"opaque op {route:6s} host ms a call: median {times[25]:.4f} min {times[0]:.4f} max {times[-1]:.4f}",
                flush=True,
            )

        _use_route("gluon")
        for _ in range(10):
            op(*args)
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(200):
            op(*args)
        profiler.disable()
        torch.cuda.synchronize()
    for order, lines in (("cumulative", 40), ("tottime", 25)):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(lines)
        print(text.getvalue())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp"))
