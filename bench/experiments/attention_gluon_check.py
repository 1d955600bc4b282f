"""GPU check and timing of the Gluon forward experiment (attention_gluon.py) against the
portable kernel and cuDNN, on an H100:

    python bench/experiments/attention_gluon_check.py OUT.json   # checks and timing
    python bench/experiments/attention_gluon_check.py --races    # the race probe

The race probe runs bf16 forwards into NaN-filled outputs and counts, per
configuration, rows left non-finite and rows off the portable kernel by more
than 0.05 (bench/results/attention-gluon-experiment-races-h100.txt)."""
import json
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.experiments.attention_gluon import attn_fwd_hopper_kernel
from compile_ops import reference
from compile_ops.ops import attention as A

R = {"checks": [], "timing": []}


def gluon_fwd(q, k, v, seq_dim, mode, block_n=None, stages=2, q8=None, v8=None, fill=None):
    """q, k, v as given to the ops ([B,H,L,D] seq_dim 2 / [B,L,H,D] seq_dim 1), bf16.
    ``q8`` (smooth_quantize_qk's four tensors) and ``v8`` (fp8_values_transposed's
    two): operands quantized beforehand, as the portable kernel's timing has them.
    ``fill``: the output's value before the launch (default: uninitialized)."""
    b, h, lq, d = (q.shape if seq_dim == 2 else (q.shape[0], q.shape[2], q.shape[1], q.shape[3]))
    hk, lk = (k.shape[1], k.shape[2]) if seq_dim == 2 else (k.shape[2], k.shape[1])
    out = torch.empty_like(q) if fill is None else torch.full_like(q, fill)
    lse = torch.empty(b, h, lq, device="cuda")
    qs = ks = vs = None
    if mode == "bf16":
        qq, kk, vv, vsd = q, k, v, seq_dim
        block_n = block_n or 64
    else:
        qq, qs, kk, ks = q8 if q8 is not None else reference.attention.smooth_quantize_qk(q, k, seq_dim)
        if mode == "int8_fp8":
            vv, vs = v8 if v8 is not None else A.fp8_values_transposed(v, seq_dim)
            vsd = 2
            block_n = 128
        else:
            vv, vsd = v, seq_dim
            block_n = block_n or 64
    # The kernel builds its TMA descriptors on the device, in memory from this allocator.
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    grid = (triton.cdiv(lq, 64), b * h)
    strides = (*A._bhl_strides(qq, seq_dim), *A._bhl_strides(kk, seq_dim), *A._bhl_strides(vv, vsd),
               *A._bhl_strides(out, seq_dim))
    attn_fwd_hopper_kernel[grid](qq, kk, vv, out, lse, qs, ks, vs, *strides, h, h // hk, lq, lk, float(d ** -0.5),
                                 D=d, BLOCK_M=64, BLOCK_N=block_n, STAGES=stages, INT8=mode != "bf16",
                                 KEY_BLOCK=reference.attention.INT8_KEY_BLOCK, PV_FP8=mode == "int8_fp8",
                                 num_warps=4)
    return out, lse


def portable(q, k, v, seq_dim, mode):
    if mode == "bf16":
        return torch.ops.fused.attention(q, k, v, q.shape[-1] ** -0.5, False, seq_dim)
    op = torch.ops.fused.attention_int8 if mode == "int8" else torch.ops.fused.attention_int8_fp8
    return op(q, k, v, q.shape[-1] ** -0.5, False, seq_dim, None), None  # the 8-bit ops return no lse


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(b, h, hk, lq, lk, seq_dim, mode):
    shape = lambda hh, l: (b, hh, l, 128) if seq_dim == 2 else (b, l, hh, 128)
    torch.manual_seed(lq + lk + h)
    q = torch.randn(shape(h, lq), device="cuda", dtype=torch.bfloat16)
    k = torch.randn(shape(hk, lk), device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape(hk, lk), device="cuda", dtype=torch.bfloat16)
    try:
        out, lse = gluon_fwd(q, k, v, seq_dim, mode)
        torch.cuda.synchronize()
        ref_out, ref_lse = portable(q, k, v, seq_dim, mode)
        qf, kf, vf = (t.float() if seq_dim == 2 else t.float().transpose(1, 2) for t in (q, k, v))
        exact = F.scaled_dot_product_attention(qf, kf, vf, enable_gqa=h != hk)
        exact = exact if seq_dim == 2 else exact.transpose(1, 2)
        row = dict(shape=[b, h, hk, lq, lk], seq_dim=seq_dim, mode=mode, vs_portable=rel(out, ref_out),
                   lse_vs_portable=None if ref_lse is None else (lse - ref_lse).abs().max().item(),
                   vs_exact=rel(out, exact),
                   portable_vs_exact=rel(ref_out, exact), finite=bool(out.isfinite().all()))
    except Exception as e:  # noqa: BLE001
        row = dict(shape=[b, h, hk, lq, lk], seq_dim=seq_dim, mode=mode, error=f"{type(e).__name__}: {str(e)[-400:]}")
    R["checks"].append(row)
    print(row, flush=True)


def main():
    for mode in ("int8_fp8", "bf16", "int8"):
        for args in [(1, 4, 4, 1000, 1000, 2), (2, 8, 2, 333, 4096, 1), (1, 2, 2, 64, 77, 2), (1, 2, 2, 130, 1, 1),
                     (1, 3, 3, 200, 256, 2), (1, 12, 12, 4680, 4680, 1), (1, 2, 1, 513, 129, 2)]:
            check(*args[:5], args[5], mode)

    timer = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=200)
    for b, h, L, d in [(1, 24, 4608, 128), (1, 12, 32760, 128), (1, 40, 16384, 128), (1, 12, 75600, 128)]:
        flops = 4 * b * h * L * L * d
        q, k, v = (torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        q8 = reference.attention.smooth_quantize_qk(q, k, 2)
        vt8, v_scale = A.fp8_values_transposed(v, 2)
        out, lse = torch.empty_like(q), torch.empty(b, h, L, device="cuda")
        cands = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v)}
        cands["portable bf16"] = lambda: A.launch_forward(q, k, v, out, lse, d ** -0.5, False, 2, None)
        cands["portable int8_fp8"] = lambda: A.launch_forward(q8[0], q8[2], vt8, out, lse, d ** -0.5, False, 2, None,
                                                              int8_scales=(q8[1], q8[3]), v_scale=v_scale)
        for bn, st in [(64, 2), (64, 3), (128, 2)]:
            cands[f"gluon bf16 {bn}x{st}"] = (lambda bn=bn, st=st: gluon_fwd(q, k, v, 2, "bf16", bn, st))
        for st in (2, 3):
            cands[f"gluon int8_fp8 128x{st}"] = (lambda st=st: gluon_fwd(q, k, v, 2, "int8_fp8", 128, st, q8=q8,
                                                                                      v8=(vt8, v_scale)))
        cands["gluon int8 64x2"] = lambda: gluon_fwd(q, k, v, 2, "int8", 64, 2, q8=q8)
        for name, fn in cands.items():
            try:
                if name == "cudnn":
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        fn(); ms = timer(fn)
                else:
                    fn(); ms = timer(fn)
                tf = flops / ms / 1e9
            except Exception as e:  # noqa: BLE001
                print(name, "failed", type(e).__name__, str(e)[-300:], flush=True)
                ms = tf = float("nan")
            R["timing"].append(dict(shape=[b, h, L, d], provider=name, ms=ms, TFLOPs=tf))
            print(f"{b}x{h}x{L}x{d} {name:24s} {tf:6.0f} TFLOP/s", flush=True)
        del q, k, v, q8, vt8
        torch.cuda.empty_cache()
    R["env"] = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    json.dump(R, open(sys.argv[1], "w"), indent=1)


def race_probe():
    for seq_dim in (1, 2):
        for lk in (4680, 4672, 4096, 1000):
            for block_n, stages in ((64, 2), (64, 3), (128, 2)):
                shape = (1, 12, lk, 128) if seq_dim == 2 else (1, lk, 12, 128)
                torch.manual_seed(0)
                q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                out, lse = gluon_fwd(q, k, v, seq_dim, "bf16", block_n, stages, fill=float("nan"))
                ref = torch.ops.fused.attention(q, k, v, 128 ** -0.5, False, seq_dim)[0]
                o, r = ((t if seq_dim == 2 else t.transpose(1, 2)) for t in (out, ref))
                bad = (~o.isfinite()).any(-1)  # [B, H, L]
                wrong = (o.float() - r.float()).abs().amax(-1).nan_to_num(1e9) > 0.05
                print(f"seq_dim {seq_dim} L {lk} bn {block_n} st {stages}: unwritten/NaN rows {int(bad.sum())} "
                      f"first {bad.nonzero()[:4].tolist()} wrong rows {int(wrong.sum())} "
                      f"first {wrong.nonzero()[:4].tolist()} lse nan {int(lse.isnan().sum())}", flush=True)


if __name__ == "__main__":
    race_probe() if "--races" in sys.argv else main()
