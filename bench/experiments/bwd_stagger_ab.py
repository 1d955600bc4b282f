"""A/B of the five-product backward's step order (STAGGER) on an sm_90 GPU:
forward+backward CUDA-graph replays, alternated rounds; dk/dv/dq against
the deterministic backward. PYTHONPATH=. python bench/experiments/bwd_stagger_ab.py OUT.json"""
import json
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import compile_ops
from bench.attention import measure
from bench.toolkit import make_timer
from compile_ops._library import clear_launch_plans
from compile_ops.ops import attention as attention_ops

R = {"rows": [], "checks": []}
timer = make_timer(False)
for b, h, L in [(1, 24, 4608), (1, 40, 16384), (1, 12, 32760)]:
    d = 128
    q, k, v = (torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    flops = 3.5 * 4 * b * h * L * L * d

    def fused(q, k, v):
        return compile_ops.attention(q, k, v)

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)

    out = compile_ops.attention(q, k, v)
    want = torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    for stagger in (False, True):
        attention_ops.SM90_BACKWARD_STAGGER = stagger
        compile_ops.set_attention_backward(deterministic=False)
        got = torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
        compile_ops.set_attention_backward(deterministic=True)
        R["checks"].append(dict(shape=[b, h, L, d], stagger=stagger, **{
            f"d{n}_rel_l2": ((g.float() - w.float()).norm() / w.float().norm()).item()
            for n, g, w in zip("qkv", got, want)}))
        print(R["checks"][-1], flush=True)
    del out, want, got
    for rnd in range(2):
        for name in ("cudnn", "deterministic", "five, in order", "five, staggered"):
            attention_ops.SM90_BACKWARD_STAGGER = name == "five, staggered"
            compile_ops.set_attention_backward(deterministic=not name.startswith("five"))
            try:
                row = measure(cudnn if name == "cudnn" else fused, q, k, v, timer)
            finally:
                compile_ops.set_attention_backward(deterministic=True)
            R["rows"].append(dict(shape=[b, h, L, d], provider=name, round=rnd, **row,
                                  fwdbwd_TFLOPs=flops / row["fwdbwd_ms"] / 1e9))
            print(f"{b}x{h}x{L}x{d} round {rnd} {name:18s} {row['fwdbwd_ms']:8.3f} ms "
                  f"{flops / row['fwdbwd_ms'] / 1e9:6.0f} TFLOP/s", flush=True)
    del q, k, v, grad
    torch.cuda.empty_cache()
R["env"] = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
json.dump(R, open(sys.argv[1], "w"), indent=1)
