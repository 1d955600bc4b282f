"""Where the time of a fused norm goes, on a GPU: the kernels of one
forward+backward step (torch.profiler), and the host-side cost of an eager
call (cProfile). A diagnosis tool for bench/notes.md, not part of the benchmark.

    PYTHONPATH=. python bench/profile_norm.py
"""
import cProfile
import pstats

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


def host_cost_of_an_eager_call(shape=(1, 64, 3072), calls=500):
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(shape[-1], device="cuda", dtype=torch.bfloat16)
    for _ in range(50):
        torch.ops.fused.rmsnorm(x, w, 1e-6)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        torch.ops.fused.rmsnorm(x, w, 1e-6)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    kernels_of_a_step()
    host_cost_of_an_eager_call()
