"""The sm_90 core's configurations (compile_ops/kernels/attention_sm90.py),
checked and timed against the portable kernel and cuDNN, on an H100:

    PYTHONPATH=. python bench/experiments/sm90_core_sweep.py OUT.json

Checks: outputs and log-sum-exp of each configuration (key tile, stages,
consumer registers) against the portable kernel (``fused.attention`` with
the core kept off) and fp32 SDPA, over ragged, GQA and short shapes; every
configuration run five times into NaN-filled outputs (a race shows as rows
off the portable kernel or left non-finite in some runs). Timing: CUDA-graph
replays, two alternated rounds, cuDNN in the same run, bf16 at D = 128 and
64 (the core's D = 64 is measured here before the package routes it).

``--int8-fp8``: the core's INT8_FP8 mode (q given in int8, k and v
quantized beforehand, as the portable kernel's timing in
``sweep_attention.py --eight-bit`` has them) against ``attn_fwd_kernel``'s
INT8 + PV_FP8 launch on the same operands, checked against it and timed at
2-4 stages, cuDNN bf16 in the same run."""
import json
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from compile_ops import reference
from compile_ops.kernels.attention_sm90 import attn_fwd_sm90_kernel
from compile_ops.ops import attention as attention_ops

R = {"checks": [], "timing": []}
CONFIGS = [(128, 2, 240), (128, 3, 240), (128, 4, 240)]  # (key tile, stages, consumer registers)


def ws_fwd(q, k, v, block_n=128, stages=2, regs=240, fill=None):
    """q ``[B, H, Lq, D]``, k, v ``[B, Hk, Lk, D]`` 16-bit: ``(out, lse)``."""
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    out = torch.empty_like(q) if fill is None else torch.full_like(q, fill)
    lse = torch.empty(b, h, lq, device="cuda")
    # The kernel builds its TMA descriptors on the device, in memory from this allocator.
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    attn_fwd_sm90_kernel[(triton.cdiv(lq, 128), b * h)](
        q, k, v, out, lse, None, None, None, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2), h, h // hk, lq, lk,
        float(d ** -0.5), D=d, BLOCK_N=block_n, STAGES=stages, CONSUMER_REGS=regs, INT8_FP8=False, num_warps=4,
        maxnreg=168)
    return out, lse


def eight_bit_operands(q, k, v):
    """``(q8, q_scale, k8, k_scale, vt8, v_scale)``: the specification's quantization."""
    return (*reference.attention.smooth_quantize_qk(q, k, 2), *attention_ops.fp8_values_transposed(v, 2))


def core_int8_fp8(ops, out, lse, stages=2, fill=None):
    """The core's INT8_FP8 mode on ``eight_bit_operands``; out ``[B, H, Lq, D]`` bf16."""
    q8, q_scale, k8, k_scale, vt8, v_scale = ops
    b, h, lq, d = q8.shape
    if fill is not None:
        out.fill_(fill)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    attn_fwd_sm90_kernel[(triton.cdiv(lq, 128), b * h)](
        q8, k8, vt8, out, lse, q_scale, k_scale, v_scale, q8.stride(0), q8.stride(1), q8.stride(2),
        k8.stride(0), k8.stride(1), k8.stride(2), vt8.stride(0), vt8.stride(1), vt8.stride(2),
        out.stride(0), out.stride(1), out.stride(2), h, h // k8.shape[1], lq, k8.shape[2], float(d ** -0.5),
        D=d, BLOCK_N=128, STAGES=stages, CONSUMER_REGS=240, INT8_FP8=True, num_warps=4, maxnreg=168)
    return out


def portable_int8_fp8(ops, out, lse):
    q8, q_scale, k8, k_scale, vt8, v_scale = ops
    attention_ops.launch_forward(q8, k8, vt8, out, lse, q8.shape[-1] ** -0.5, False, 2, None,
                                 int8_scales=(q_scale, k_scale), v_scale=v_scale)
    return out


def time_rounds(cands, shape, rep, rounds=2):
    """Time every ``{name: call}`` (CUDA-graph replays, ``cudnn`` under SDPA's
    cuDNN backend) in alternated rounds at ``shape`` [B, H, L, D], into R."""
    b, h, L, d = shape
    flops = 4 * b * h * L * L * d
    for rnd in range(rounds):
        for name, fn in cands.items():
            try:
                if name == "cudnn":
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        fn(); ms = triton.testing.do_bench_cudagraph(fn, rep=rep)
                else:
                    fn(); ms = triton.testing.do_bench_cudagraph(fn, rep=rep)
                tf = flops / ms / 1e9
            except Exception as e:  # noqa: BLE001
                print(name, "failed", type(e).__name__, str(e)[-300:], flush=True)
                ms = tf = float("nan")
            R["timing"].append(dict(shape=list(shape), provider=name, round=rnd, ms=ms, TFLOPs=tf))
            print(f"{b}x{h}x{L}x{d} round {rnd} {name:24s} {tf:6.0f} TFLOP/s", flush=True)


def eight_bit():
    """Checks and timing of the INT8_FP8 mode (``--int8-fp8``)."""
    for b, h, hk, lq, lk in [(1, 4, 4, 1000, 1000), (2, 8, 2, 333, 4096), (1, 2, 2, 64, 77), (1, 3, 3, 130, 1),
                             (1, 12, 12, 4680, 4680), (1, 2, 1, 513, 129)]:
        torch.manual_seed(lq + lk)
        q = torch.randn(b, h, lq, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, hk, lk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k = k + 4 * torch.randn(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16)  # offset keys
        ops = eight_bit_operands(q, k, v)
        want = portable_int8_fp8(ops, torch.empty_like(q), torch.empty(b, h, lq, device="cuda"))
        exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=h != hk)
        for stages in (2, 3):
            row = dict(mode="int8_fp8", shape=[b, h, hk, lq, lk], stages=stages)
            try:
                worst, bad = 0.0, 0
                for _ in range(5):
                    out = core_int8_fp8(ops, torch.empty_like(q), torch.empty(b, h, lq, device="cuda"), stages,
                                        fill=float("nan"))
                    diff = (out.float() - want.float()).abs().nan_to_num(1e9)
                    worst, bad = max(worst, diff.max().item()), max(bad, int((diff.amax(-1) > 0.05).sum()))
                row.update(max_diff_vs_portable=worst, rows_off=bad, rel_vs_exact=rel(out, exact),
                           portable_rel_vs_exact=rel(want, exact))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[-400:]}"
            R["checks"].append(row)
            print(row, flush=True)

    for b, h, L in [(1, 24, 4608), (1, 12, 32760), (1, 40, 16384), (1, 12, 75600)]:
        d = 128
        q, k, v = (torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ops = eight_bit_operands(q, k, v)
        out, lse = torch.empty_like(q), torch.empty(b, h, L, device="cuda")
        cands = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v),
                 "portable int8_fp8": lambda: portable_int8_fp8(ops, out, lse)}
        for stages in (2, 3, 4):
            cands[f"core int8_fp8 {stages} stages"] = (lambda st=stages: core_int8_fp8(ops, out, lse, st))
        time_rounds(cands, [b, h, L, d], rep=200)
        del q, k, v, ops
        torch.cuda.empty_cache()


def portable(q, k, v):
    """``attn_fwd_kernel`` (main() keeps the package off the core in this process)."""
    return torch.ops.fused.attention(q, k, v, q.shape[-1] ** -0.5, False, 2)


def fits(cfg, d):
    """Whether q's 128 rows and the K/V ring fit the 227 KB of shared memory
    (a launch that does not breaks the CUDA-graph captures after it)."""
    block_n, stages, _ = cfg
    return (128 * d + 2 * stages * block_n * d) * 2 <= 227 * 1024


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(b, h, hk, lq, lk, cfg, d=128, dtype=torch.bfloat16):
    torch.manual_seed(lq + lk + h)
    q = torch.randn(b, h, lq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, hk, lk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, hk, lk, d, device="cuda", dtype=dtype)
    row = dict(shape=[b, h, hk, lq, lk, d], dtype=str(dtype), config=cfg)
    try:
        ref_out, ref_lse = portable(q, k, v)
        exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=h != hk)
        worst_out = worst_lse = 0.0
        bad_rows = 0
        for _ in range(5):
            out, lse = ws_fwd(q, k, v, *cfg, fill=float("nan"))
            torch.cuda.synchronize()
            worst_out = max(worst_out, (out.float() - ref_out.float()).abs().nan_to_num(1e9).max().item())
            worst_lse = max(worst_lse, (lse - ref_lse.view_as(lse)).abs().nan_to_num(1e9).max().item())
            bad_rows = max(bad_rows, int(((out.float() - ref_out.float()).abs().nan_to_num(1e9).amax(-1) > 0.05)
                                         .sum()))
        row.update(max_diff_vs_portable=worst_out, lse_max_diff=worst_lse, rows_off=bad_rows,
                   rel_vs_exact=rel(out, exact), portable_rel_vs_exact=rel(ref_out, exact))
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e)[-400:]}"
    R["checks"].append(row)
    print(row, flush=True)


def main():
    attention_ops.has_wgmma = lambda t: False
    if "--int8-fp8" in sys.argv:
        eight_bit()
        R["env"] = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
        json.dump(R, open(sys.argv[1], "w"), indent=1)
        return
    for cfg in CONFIGS:
        for shape in [(1, 4, 4, 1000, 1000), (2, 8, 2, 333, 4096), (1, 2, 2, 64, 77), (1, 2, 2, 130, 1),
                      (1, 3, 3, 200, 256), (1, 12, 12, 4680, 4680), (1, 2, 1, 513, 129), (1, 12, 12, 4096, 32760)]:
            for d in (128, 64):
                if fits(cfg, d):
                    check(*shape, cfg, d=d)
        if fits(cfg, 128):
            check(2, 8, 2, 333, 4096, cfg, dtype=torch.float16)

    for b, h, L, d in [(1, 24, 4608, 128), (1, 12, 32760, 128), (1, 40, 16384, 128), (1, 12, 75600, 128),
                       (2, 24, 4096, 128), (2, 24, 4096, 64), (1, 24, 4608, 64)]:
        q, k, v = (torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cands = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v), "portable bf16": lambda: portable(q, k, v)}
        for cfg in CONFIGS:
            if fits(cfg, d):
                cands["core %dx%d r%d" % cfg] = (lambda cfg=cfg: ws_fwd(q, k, v, *cfg))
        time_rounds(cands, [b, h, L, d], rep=300)
        del q, k, v
        torch.cuda.empty_cache()
    R["env"] = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    json.dump(R, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
