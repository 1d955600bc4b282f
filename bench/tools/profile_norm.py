"""Where the time of a fused norm goes, on a GPU: the kernels of one
forward+backward step (torch.profiler), and the host-side cost of eager calls
(cProfile, cumulative) for a forward, a direct backward op and an autograd
step on a small input. A diagnosis tool behind docs/notes/norm.md, not part of the benchmark.

    PYTHONPATH=. python bench/tools/profile_norm.py
"""

import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

import compile_ops


def kernels_of_a_step(shape=(1, 16384, 5120)):
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(shape[-1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def step():
        compile_ops.rmsnorm(x, w, 1e-6).backward(g)
        x.grad = w.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


def per_call_us(fn, calls=300):
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def profile_host(fn, title, calls=300):
    print(f"==== {title}: {per_call_us(fn):.1f} us/call without profiler", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(22)


def host_costs(shape=(1, 64, 3072)):
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(shape[-1], device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

    def step():
        compile_ops.rmsnorm(xg, wg, 1e-6).backward(dy)
        xg.grad = wg.grad = None

    profile_host(lambda: torch.ops.fused.rmsnorm(x, w, 1e-6), "fused.rmsnorm forward, no grad")
    profile_host(lambda: torch.ops.fused.norm_backward(dy, None, x, w, None, 1e-6, True), "fused.norm_backward direct")
    profile_host(step, "autograd step rmsnorm fwd+bwd")


if __name__ == "__main__":
    kernels_of_a_step()
    host_costs()
