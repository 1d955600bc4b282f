"""What ``attention_kernel="auto"`` gives calls with key lengths (padded
text at the end of the keys): SDPA with a boolean ``[B, 1, 1, Lk]`` mask,
as ``compile_ops.integrations.diffusers`` builds it, against
``fused.attention(..., kv_lengths=...)`` (the sm_90 core on Hopper), with
cuDNN unmasked beside them; forward, bf16, CUDA-graph replays:

    PYTHONPATH=. python bench/experiments/masked_sdpa.py OUT.json
"""

import json
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import compile_ops

R = {"rows": []}
for b, h, video, text, valid in [(1, 24, 4352, 256, 77), (1, 24, 16384, 256, 77), (2, 24, 16384, 256, 77)]:
    L = video + text
    q, k, v = (torch.randn(b, L, h, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    lengths = torch.full((b,), video + valid, device="cuda", dtype=torch.int32)
    mask = (torch.arange(L, device="cuda") < lengths.unsqueeze(1)).unsqueeze(1).unsqueeze(1)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    flops = 4 * b * h * L * (video + valid) * 128
    cands = {
        "sdpa masked (default backend)": lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask),
        "sdpa masked, cuDNN only": ("cudnn", lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)),
        "sdpa unmasked, cuDNN (all L keys)": ("cudnn", lambda: F.scaled_dot_product_attention(qt, kt, vt)),
        "fused kv_lengths": lambda: compile_ops.attention(q, k, v, seq_dim=1, kv_lengths=lengths),
    }
    for name, fn in cands.items():
        backend = None
        if isinstance(fn, tuple):
            backend, fn = fn
        try:
            if backend:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    fn()
                    ms = triton.testing.do_bench_cudagraph(fn, rep=200)
            else:
                fn()
                ms = triton.testing.do_bench_cudagraph(fn, rep=200)
        except Exception as e:  # noqa: BLE001
            print(name, "failed:", type(e).__name__, str(e)[:200], flush=True)
            ms = float("nan")
        R["rows"].append(
            dict(shape=[b, h, L, 128], kv_len=video + valid, provider=name, ms=ms, TFLOPs=flops / ms / 1e9)
        )
        print(f"{b}x{h}x{L} kv {video + valid}: {name:36s} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
    del q, k, v
R["env"] = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
json.dump(R, open(sys.argv[1], "w"), indent=1)
