"""The compiled Flux FP8 step, step by step, with what could make it host-bound counted between steps:

    PYTHONPATH=. python bench/experiments/flux_host_diag.py ROUTE

``ROUTE``: ``gluon`` (``attention_precision="int8_fp8"`` as the tree routes it), ``triton``
(the same with ``takes_sm90_8bit`` off, so every 8-bit call runs ``attn_fwd_kernel``) or
``fp8`` (``precision="fp8"`` alone: cuDNN's 16-bit attention). Full-size Flux.1-dev
transformer with random weights (``bench/runners/diffusers_models.py``), blocks compiled
regionally as ``diffusers_e2e.py`` does. For 24 steps it prints each sampled step's wall
and host (enqueue) time, the two attention kernels' JIT cache sizes (a per-call cache miss
would grow them), gen-2 garbage collections, the allocator's segments and cudaMalloc
retries, and the GPU's SM clock, temperature, power and throttle reasons; then three
profiled steps: kernel time by name (kernels that add up to the step mean the GPU sets
it) and host time by op.
"""

import gc
import subprocess
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import compile_ops
from bench.runners import diffusers_timing as timing
from bench.runners.diffusers_models import build
from compile_ops.kernels.attention import attn_fwd_kernel
from compile_ops.kernels.attention_sm90_8bit import attn8_fwd_sm90_kernel
from compile_ops.ops import attention_launch

STEPS = 24
_gen2 = {"n": 0, "t": 0.0, "start": 0.0}


def _count_gen2(phase, info):
    if info["generation"] == 2:
        if phase == "start":
            _gen2["start"] = time.perf_counter()
        else:
            _gen2["n"] += 1
            _gen2["t"] += time.perf_counter() - _gen2["start"]


def _gpu_state() -> str:
    query = "clocks.sm,temperature.gpu,power.draw,clocks_throttle_reasons.active"
    return subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.strip()


def _cache_sizes() -> dict:
    kernels = (("gluon", attn8_fwd_sm90_kernel), ("triton", attn_fwd_kernel))
    return {name: sum(len(c[0]) for c in k.device_caches.values()) for name, k in kernels}


def main(route: str) -> None:
    if route == "triton":
        attention_launch.takes_sm90_8bit = lambda *a: False
    gc.callbacks.append(_count_gen2)
    model, inputs = build("flux_step")
    compile_ops.patch(model, precision="fp8", **({} if route == "fp8" else {"attention_precision": "int8_fp8"}))
    module = timing.compiled(model, "regional")
    with torch.no_grad():
        module(**inputs)
        torch.cuda.synchronize()
        for step in range(STEPS):
            before = torch.cuda.memory_stats()
            t0 = time.perf_counter()
            module(**inputs)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            after = torch.cuda.memory_stats()
            if step % 4 == 0 or step >= STEPS - 2:
                retries = after.get("num_alloc_retries", 0) - before.get("num_alloc_retries", 0)
                allocs = after.get("segment.all.allocated", 0) - before.get("segment.all.allocated", 0)
                print(
                    f"{route} step {step:2d} wall {1e3 * (t2 - t0):7.2f} ms host {1e3 * (t1 - t0):7.2f} ms "
                    f"caches {_cache_sizes()} gen2 {_gen2['n']} ({1e3 * _gen2['t']:.1f} ms) "
                    f"segments {after.get('segment.all.current')} cudaMalloc retries +{retries} "
                    f"allocs +{allocs} gpu [{_gpu_state()}]",
                    flush=True,
                )
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                module(**inputs)
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 3 * 1e3
    events = prof.key_averages()
    kernels = [
        (e.key, e.device_time_total / 3 / 1e3, e.count // 3)
        for e in events
        if e.device_time_total > 0 and e.device_type.name == "CUDA"
    ]
    print(f"{route} profiled step wall {wall:.2f} ms, kernels {sum(r[1] for r in kernels):.2f} ms", flush=True)
    for name, ms, calls in sorted(kernels, key=lambda r: -r[1])[:14]:
        print(f"{route}   kernel {ms:8.3f} ms x{calls:4d}  {name[:110]}", flush=True)
    host = [(e.key, e.cpu_time_total / 3 / 1e3, e.count // 3) for e in events if e.device_type.name == "CPU"]
    for name, ms, calls in sorted(host, key=lambda r: -r[1])[:10]:
        print(f"{route}   cpu {ms:8.3f} ms x{calls:4d}  {name[:110]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gluon")
