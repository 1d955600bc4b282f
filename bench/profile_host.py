"""Host-side cost of the fused norm ops in eager mode (cProfile, cumulative),
for a forward call and for a forward+backward step on a small input.

    PYTHONPATH=. python bench/profile_host.py
"""
import cProfile
import pstats
import time

import torch

import compile_ops


def per_call_us(fn, calls=300):
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def profile(fn, title, calls=300):
    print(f"==== {title}: {per_call_us(fn):.1f} us/call without profiler", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(22)


x = torch.randn(1, 64, 3072, device="cuda", dtype=torch.bfloat16)
w = torch.randn(3072, device="cuda", dtype=torch.bfloat16)
dy = torch.randn_like(x)
xg = x.clone().requires_grad_(True)
wg = w.clone().requires_grad_(True)


def step():
    compile_ops.rmsnorm(xg, wg, 1e-6).backward(dy)
    xg.grad = wg.grad = None


profile(lambda: torch.ops.fused.rmsnorm(x, w, 1e-6), "fused.rmsnorm forward, no grad")
profile(lambda: torch.ops.fused.norm_backward(dy, None, x, w, None, 1e-6, True), "fused.norm_backward direct")
profile(step, "autograd step rmsnorm fwd+bwd")
