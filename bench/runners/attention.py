"""Attention benchmark: fused.attention against SDPA's backends and FlexAttention.

    PYTHONPATH=. python bench/runners/attention.py [--out bench/results] [--quick] [--causal | --int8]

bf16, [B, H, L, D] (SDPA's layout), self-attention at the DiT shapes
(:data:`SHAPES`). Providers: ``fused_eager`` (``compile_ops.attention``),
``fused_compiled`` (it under ``torch.compile(fullgraph=True)``), ``fused_atomic_dq``
(``fused_eager`` with ``compile_ops.set_attention_backward(deterministic=False)``:
the five-product sm_90 backward where it applies), ``sdpa_flash``,
``sdpa_cudnn``, ``sdpa_efficient`` (``F.scaled_dot_product_attention`` pinned to
one backend) and ``flex_compiled`` (``torch.compile(flex_attention)``, no mask).
TFLOP/s as FlashAttention's benchmarks count them: forward ``4 B H Lq Lk D`` (halved when
causal), forward+backward 3.5x that. Times are CUDA-graph replays (the kernels'
own time), median of ``triton.testing.do_bench``, each after the call has
kept the GPU busy for ``BUSY_SECONDS``; peak memory of one forward+backward
step above the inputs. Writes ``<out>/attention-<gpu>.json``.

``--int8``: 8-bit attention (``precision="int8"`` and ``"int8_fp8"``, eager and compiled) beside
cuDNN bf16, our exact kernel and SageAttention where installed, forward only,
on N(0, 1) inputs and on keys with a per-channel offset; every row carries its
relative L2 distance to fp64 attention (``attention-int8-<gpu>.json``). ``--int8 --rope``:
q/k-norm + rotation + 8-bit attention, q and k quantized by the rotation's kernel against
by attention, beside rotation + cuDNN (``attention-int8-rope-<gpu>.json``).
"""

import argparse
import os
import sys

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.toolkit import environment, graph_replay_time, keep_busy, make_timer, warm_up_gpu, write_results  # noqa: E402

#: Flux at 1024x1024 (24 heads), Wan 2.1 480p x 81 frames (12 heads), a
#: HunyuanVideo-sized 40-head sequence, and head dim 64.
SHAPES = ((1, 24, 4608, 128), (1, 12, 32760, 128), (1, 40, 16384, 128), (2, 24, 4096, 64))


def providers(causal: bool) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import compile_ops

    def fused(q, k, v):
        return compile_ops.attention(q, k, v, None, causal)

    def sdpa(backend):
        def call(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return call

    out = {
        "fused_eager": fused,
        "fused_compiled": torch.compile(fused, fullgraph=True),
        "fused_atomic_dq": fused,
        "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa_efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
    }
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


#: Seconds each provider runs untimed, at the shape, right before its timings
#: (``toolkit.keep_busy``): do_bench's own warm-up is shorter than one step at
#: the long shapes (bench/results/attention-alternated-order-h100.json).
BUSY_SECONDS = 2.0


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
    keep_busy(forward, BUSY_SECONDS)
    fwd_ms = graph_replay_time(forward, timer)
    keep_busy(step, BUSY_SECONDS)
    return {"fwd_ms": fwd_ms, "fwdbwd_ms": graph_replay_time(step, timer), "peak_MiB": peak / 2**20}


#: ``--int8``: the input kinds the 8-bit comparison measures errors on: N(0, 1)
#: q, k, v, and keys with a per-channel offset N(0, 4^2) and doubled queries
#: (where unsmoothed 8-bit keys lose the most).
INT8_INPUTS = ("normal", "offset_keys")
#: Queries of each shape whose outputs are compared with fp64 attention (all keys).
ERROR_QUERIES = 1024


def int8_providers() -> dict:
    """Forward-only providers of the 8-bit comparison: ours exact and 8-bit,
    cuDNN bf16, and SageAttention (INT8 QK) where it is installed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import compile_ops

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)

    def int8(q, k, v):
        return compile_ops.attention(q, k, v, precision="int8")

    def int8_fp8(q, k, v):
        return compile_ops.attention(q, k, v, precision="int8_fp8")

    out = {
        "sdpa_cudnn": cudnn,
        "fused_eager": lambda q, k, v: compile_ops.attention(q, k, v),
        "fused_int8_eager": int8,
        "fused_int8_compiled": torch.compile(int8, fullgraph=True),
        "fused_int8_fp8_eager": int8_fp8,
        "fused_int8_fp8_compiled": torch.compile(int8_fp8, fullgraph=True),
    }
    try:
        from sageattention import sageattn

        out["sageattention"] = lambda q, k, v: sageattn(q, k, v, tensor_layout="HND", is_causal=False)
    except ImportError:
        pass
    return out


def int8_inputs(kind: str, b: int, h: int, length: int, d: int) -> tuple:
    q, k, v = (torch.randn(b, h, length, d, device="cuda") for _ in range(3))
    if kind == "offset_keys":
        q, k = 2 * q, k + 4 * torch.randn(d, device="cuda")
    return tuple(t.to(torch.bfloat16) for t in (q, k, v))


def int8_comparison(shapes, timer) -> list:
    """Forward TFLOP/s of each provider (CUDA-graph replays where the provider
    can be captured, else plain calls), and each one's relative L2 distance to
    fp64 attention over the first ERROR_QUERIES queries of every head."""
    from compile_ops.reference.attention import attention as exact_attention

    rows = []
    for b, h, length, d in shapes:
        torch._dynamo.reset()
        flops = 4 * b * h * length * length * d
        for kind in INT8_INPUTS:
            q, k, v = int8_inputs(kind, b, h, length, d)
            n = min(ERROR_QUERIES, length)
            exact, _ = exact_attention(q[:, :, :n].double(), k.double(), v.double(), d**-0.5, False)
            for name, fn in int8_providers().items():
                row = {"shape": [b, h, length, d], "inputs": kind, "provider": name}
                try:
                    with torch.no_grad():
                        out = fn(q, k, v)
                        got = out[:, :, :n].double()
                        row["rel_l2_vs_fp64"] = ((got - exact).norm() / exact.norm()).item()
                        row["cosine_vs_fp64"] = F.cosine_similarity(got.flatten(), exact.flatten(), dim=0).item()
                        try:
                            row["fwd_ms"] = graph_replay_time(lambda: fn(q, k, v), timer)
                        except Exception:  # noqa: BLE001 (not capturable: time plain calls)
                            torch.cuda.synchronize()
                            row["fwd_ms"], row["timing"] = timer(lambda: fn(q, k, v)), "eager calls"
                    row["fwd_TFLOPs"] = flops / row["fwd_ms"] / 1e9
                    print(
                        f"{b}x{h}x{length}x{d} {kind:<11} {name:<20} fwd {row['fwd_TFLOPs']:6.0f} TFLOP/s "
                        f"rel. L2 vs fp64 {row['rel_l2_vs_fp64']:.2e} cosine {row['cosine_vs_fp64']:.6f}",
                        flush=True,
                    )
                except Exception as e:  # noqa: BLE001 (a failing provider is a result)
                    row["error"] = f"{type(e).__name__}: {e}"[:400]
                    print(f"{b}x{h}x{length}x{d} {kind:<11} {name:<20} FAILED {row['error'][:200]}", flush=True)
                rows.append(row)
            q = k = v = exact = None  # free this input kind's tensors before the next
            torch.cuda.empty_cache()
    return rows


def rope_int8_providers() -> dict:
    """``--rope``: q/k-norm + rotation + attention of ``[B, L, H, D]``
    projections (what a patched Flux block runs; Wan's self-attention is the
    same without the norm), each provider the pair as a model calls it: our
    ``qk_norm_rope`` then cuDNN bf16 (SDPA on the transposed views), then
    8-bit attention quantizing its 16-bit q and k, and ``qk_norm_rope(...,
    quantize=True)`` handing them over quantized (``Int8QK``: no 16-bit q or
    k written). Eager and compiled."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import compile_ops

    def cudnn(q, k, v, w, cos, sin):
        q, k = compile_ops.qk_norm_rope(q, k, w, w, cos, sin, 1e-6, True, 1)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)

    def quantized_in_attention(q, k, v, w, cos, sin):
        q, k = compile_ops.qk_norm_rope(q, k, w, w, cos, sin, 1e-6, True, 1)
        return compile_ops.attention(q, k, v, seq_dim=1, precision="int8_fp8")

    def quantized_by_rotation(q, k, v, w, cos, sin):
        qk = compile_ops.qk_norm_rope(q, k, w, w, cos, sin, 1e-6, True, 1, quantize=True)
        return compile_ops.attention(qk, None, v, seq_dim=1, precision="int8_fp8")

    out = {}
    for name, fn in (
        ("rope_sdpa_cudnn", cudnn),
        ("rope_int8_fp8", quantized_in_attention),
        ("rope_int8_fp8_fused_quant", quantized_by_rotation),
    ):
        out[f"{name}_eager"] = fn
        out[f"{name}_compiled"] = torch.compile(fn, fullgraph=True)
    return out


def rope_int8_comparison(shapes, timer) -> list:
    """``--rope``: TFLOP/s (attention's FLOPs; the time includes the norm and
    rotation) of :func:`rope_int8_providers` as CUDA-graph replays, and each
    one's relative L2 distance to fp64 attention of the bf16-rotated q and k
    over the first ERROR_QUERIES queries."""
    import compile_ops
    from compile_ops.reference.attention import attention as exact_attention

    rows = []
    for b, h, length, d in shapes:
        torch._dynamo.reset()
        flops = 4 * b * h * length * length * d
        for kind in INT8_INPUTS:
            q, k, v = (t.transpose(1, 2).contiguous() for t in int8_inputs(kind, b, h, length, d))  # [B, L, H, D]
            w = (torch.rand(d, device="cuda") + 0.5).to(torch.bfloat16)
            angle = torch.randn(length, d // 2, device="cuda") * 10
            cos, sin = angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1)
            n = min(ERROR_QUERIES, length)
            q16, k16 = compile_ops.qk_norm_rope(q, k, w, w, cos, sin, 1e-6, True, 1)
            exact, _ = exact_attention(q16[:, :n].double(), k16.double(), v.double(), d**-0.5, False, 1)
            q16 = k16 = None
            args = (q, k, v, w, cos, sin)
            for name, fn in rope_int8_providers().items():
                row = {"shape": [b, h, length, d], "inputs": kind, "provider": name}
                try:
                    with torch.no_grad():
                        got = fn(*args)[:, :n].double()
                        row["rel_l2_vs_fp64"] = ((got - exact).norm() / exact.norm()).item()
                        row["cosine_vs_fp64"] = F.cosine_similarity(got.flatten(), exact.flatten(), dim=0).item()
                        got = None
                        row["fwd_ms"] = graph_replay_time(lambda: fn(*args), timer)
                    row["fwd_TFLOPs"] = flops / row["fwd_ms"] / 1e9
                    print(
                        f"{b}x{h}x{length}x{d} {kind:<11} {name:<34} {row['fwd_ms']:8.3f} ms "
                        f"{row['fwd_TFLOPs']:6.0f} TFLOP/s rel. L2 vs fp64 {row['rel_l2_vs_fp64']:.2e}",
                        flush=True,
                    )
                except Exception as e:  # noqa: BLE001 (a failing provider is a result)
                    row["error"] = f"{type(e).__name__}: {e}"[:400]
                    print(f"{b}x{h}x{length}x{d} {kind:<11} {name:<34} FAILED {row['error'][:200]}", flush=True)
                rows.append(row)
            args = q = k = v = exact = None
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--shapes", default="", help="BxHxLxD,... (default: the DiT shapes)")
    p.add_argument(
        "--int8", action="store_true", help="the 8-bit comparison instead: forward only, errors against fp64 attention"
    )
    p.add_argument(
        "--rope",
        action="store_true",
        help="with --int8: q/k-norm + rotation + attention pairs, the quantization in the rotation "
        "against in attention, beside the rotation + cuDNN bf16",
    )
    args = p.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    timer = make_timer(args.quick)
    env = environment()
    print(f"{env['gpu']} | torch {env['torch']} | triton {env['triton']}", flush=True)
    warm_up_gpu()
    if args.int8 and args.rope:
        rows = rope_int8_comparison(shapes, timer)
        print(f"wrote {write_results(args.out, 'attention-int8-rope', env, rows)}", flush=True)
        return 1 if any("error" in r for r in rows) else 0
    if args.int8:
        rows = int8_comparison(shapes, timer)
        print(f"wrote {write_results(args.out, 'attention-int8', env, rows)}", flush=True)
        return 1 if any("error" in r and r["provider"].startswith("fused") for r in rows) else 0
    import compile_ops

    rows, failed = [], False
    for b, h, length, d in shapes:
        torch._dynamo.reset()
        q, k, v = (
            torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
        )
        flops = 4 * b * h * length * length * d * (0.5 if args.causal else 1.0)
        for name, fn in providers(args.causal).items():
            row = {"shape": [b, h, length, d], "causal": args.causal, "provider": name}
            try:
                compile_ops.set_attention_backward(deterministic=name != "fused_atomic_dq")
                row.update(measure(fn, q, k, v, timer))
                row["fwd_TFLOPs"] = flops / row["fwd_ms"] / 1e9
                row["fwdbwd_TFLOPs"] = 3.5 * flops / row["fwdbwd_ms"] / 1e9
                print(
                    f"{b}x{h}x{length}x{d} {name:<15} fwd {row['fwd_TFLOPs']:6.0f} TFLOP/s "
                    f"fwd+bwd {row['fwdbwd_TFLOPs']:6.0f} TFLOP/s peak {row['peak_MiB']:8.1f} MiB",
                    flush=True,
                )
            except Exception as e:  # noqa: BLE001 (a failing peer is a result; ours is a failure)
                row["error"] = f"{type(e).__name__}: {e}"[:400]
                failed |= name.startswith("fused")
                print(f"{b}x{h}x{length}x{d} {name:<15} FAILED {row['error'][:200]}", flush=True)
            finally:
                compile_ops.set_attention_backward(deterministic=True)
            rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    path = write_results(args.out, f"attention{'-causal' if args.causal else ''}", env, rows)
    print(f"wrote {path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
