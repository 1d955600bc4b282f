"""Attention benchmark: fused.attention against SDPA's backends and FlexAttention.

    PYTHONPATH=. python bench/attention.py [--out bench/results] [--quick] [--causal]

bf16, [B, H, L, D] (SDPA's layout), self-attention at the DiT shapes of
shared/DESIGN.md. Providers: ``fused_eager`` (``compile_ops.attention``),
``fused_compiled`` (it under ``torch.compile(fullgraph=True)``), ``sdpa_flash``,
``sdpa_cudnn``, ``sdpa_efficient`` (``F.scaled_dot_product_attention`` pinned to
one backend) and ``flex_compiled`` (``torch.compile(flex_attention)``, no mask).
TFLOP/s as the anchors count them: forward ``4 B H Lq Lk D`` (halved when
causal), forward+backward 3.5x that. Times are CUDA-graph replays (the kernels'
own time), median of ``triton.testing.do_bench``; peak memory of one
forward+backward step above the inputs. Writes ``<out>/attention-<gpu>.json``.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.toolkit import environment, graph_replay_time, make_timer, warm_up_gpu, write_results  # noqa: E402

#: Flux at 1024x1024 (24 heads), Wan 2.1 480p x 81 frames (12 heads), a
#: HunyuanVideo-sized 40-head sequence, and head dim 64.
SHAPES = ((1, 24, 4608, 128), (1, 12, 32760, 128), (1, 40, 16384, 128), (2, 24, 4096, 64))


def providers(causal: bool) -> dict:
    import compile_ops
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fused(q, k, v):
        return compile_ops.attention(q, k, v, None, causal)

    def sdpa(backend):
        def call(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return call

    out = {"fused_eager": fused, "fused_compiled": torch.compile(fused, fullgraph=True),
           "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION), "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
           "sdpa_efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION)}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention)
        if causal:
            masks = {}

            def flex_call(q, k, v):
                # Built once per shape, as a model builds it once per resolution.
                key = (q.shape[2], k.shape[2])
                if key not in masks:
                    masks[key] = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, *key)
                return flex(q, k, v, block_mask=masks[key])
        else:
            def flex_call(q, k, v):
                return flex(q, k, v)
        out["flex_compiled"] = flex_call
    except ImportError:
        pass
    return out


def measure(fn, q, k, v, timer) -> dict:
    grad = torch.randn_like(q)

    def forward():
        with torch.no_grad():
            fn(q, k, v)

    def step():
        fn(q, k, v).backward(grad)
        q.grad = k.grad = v.grad = None

    forward()
    step()  # compile outside the timing
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {"fwd_ms": graph_replay_time(forward, timer), "fwdbwd_ms": graph_replay_time(step, timer),
            "peak_MiB": peak / 2**20}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--shapes", default="", help="BxHxLxD,... (default: the DiT shapes)")
    args = p.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    timer = make_timer(args.quick)
    env = environment()
    print(f"{env['gpu']} | torch {env['torch']} | triton {env['triton']}", flush=True)
    warm_up_gpu()
    rows, failed = [], False
    for b, h, length, d in shapes:
        torch._dynamo.reset()
        q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        flops = 4 * b * h * length * length * d * (0.5 if args.causal else 1.0)
        for name, fn in providers(args.causal).items():
            row = {"shape": [b, h, length, d], "causal": args.causal, "provider": name}
            try:
                row.update(measure(fn, q, k, v, timer))
                row["fwd_TFLOPs"] = flops / row["fwd_ms"] / 1e9
                row["fwdbwd_TFLOPs"] = 3.5 * flops / row["fwdbwd_ms"] / 1e9
                print(f"{b}x{h}x{length}x{d} {name:<15} fwd {row['fwd_TFLOPs']:6.0f} TFLOP/s "
                      f"fwd+bwd {row['fwdbwd_TFLOPs']:6.0f} TFLOP/s peak {row['peak_MiB']:8.1f} MiB", flush=True)
            except Exception as e:  # noqa: BLE001 (a failing peer is a result; ours is a failure)
                row["error"] = f"{type(e).__name__}: {e}"[:400]
                failed |= name.startswith("fused")
                print(f"{b}x{h}x{length}x{d} {name:<15} FAILED {row['error'][:200]}", flush=True)
            rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    path = write_results(args.out, f"attention{'-causal' if args.causal else ''}", env, rows)
    print(f"wrote {path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
