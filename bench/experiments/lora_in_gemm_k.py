"""A LoRA adapter as r more columns of the FP8 GEMM's K, against ``fused.fp8_rows_lora``
beside the GEMM, per Flux Linear, on a GPU (docs/notes/fp8.md, "Next: the adapters in the
GEMM's K").

    PYTHONPATH=. python bench/experiments/lora_in_gemm_k.py OUT.json [--rank 64] [--rounds 3]

The GEMM of FP8 rows ``x = q sx`` and weight ``W = w sw`` computes
``sx[m] sw[n] (q @ w.T)[m, n]``; over K + r columns it adds ``sx[m] sw[n] (u @ v.T)``,
which is the adapter's ``s (x A.T) B.T`` when ``u = (q A.T) / c`` and
``v = s c B / sw`` (``c [r]``, a split of the magnitude between the two factors). Both
are e4m3: ``c = ||A_j||_1`` bounds ``|u|`` by 448 for any row, but ``v`` may then pass 448;
this script takes ``c_j = min(||A_j||_1, 448 / max_n |s B[n, j] / sw[n]|)`` (``v`` always
fits) and clamps ``u`` to +-448, and reports how many entries the clamp touched.

Per shape (:data:`bench.experiments.fp8_rows_lora.SHAPES`, bf16 activations and weights,
adapters with ``||delta|| / ||x W.T||`` set to ``--delta-share``), alternated ``--rounds``
times, as CUDA-graph replays:

- ``plain``: the FP8 GEMM without the adapter;
- ``op``: the GEMM, then ``fused.fp8_rows_lora``;
- ``folded``: the down projection written as e4m3 into the r tail columns of a
  ``[M, K + r]`` row buffer (compiled torch ops; a producer would write the head), then
  the GEMM over K + r.

Beside the times: each output's relative L2 against the exact layer (fp32 from the bf16
activations, weight and adapter), the clamped share of ``u``, and ``c``'s reduction.
``--cpu``: those numerics alone on the CPU (the reference path), at several delta shares.
"""

import argparse
import json
import statistics

import torch

from bench.experiments.fp8_rows_lora import SHAPES
from bench.toolkit import graph_replay_time, make_timer, relative_l2, warm_up_gpu, write_rows
from compile_ops.ops import fp8 as fp8_ops
from compile_ops.ops.fp8 import FP8Rows

E4M3_MAX = 448.0
SCALING = 1.0


def fold_weight(weight_q, weight_scale, lora_a, lora_b, scaling: float) -> tuple:
    """``(w' [N, K + r] e4m3, c [r] fp32, the share of the r columns whose c was cut to fit v)``."""
    norms = lora_a.float().abs().sum(1)
    b_over_sw = (scaling * lora_b.float()) / weight_scale.float()[:, None]
    fits = E4M3_MAX / b_over_sw.abs().amax(0).clamp(min=1e-30)
    c = torch.minimum(norms, fits)
    v = (b_over_sw * c[None, :]).to(torch.float8_e4m3fn)
    return torch.cat([weight_q, v], 1), c, float((fits < norms).float().mean())


def down_projection(q, lora_a, c):
    """``u = (q A.T) / c`` [M, r] fp32, before its e4m3 rounding."""
    return (q.to(lora_a.dtype) @ lora_a.t()).float() / c


def down_into_tail(buffer, q, lora_a, c) -> None:
    """``buffer[:, K:] = clamp(u, +-448)`` as e4m3 (:func:`down_projection`); ``buffer[:, :K]`` holds q."""
    buffer[:, q.shape[-1] :] = down_projection(q, lora_a, c).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _inputs(m: int, k: int, n: int, rank: int, delta_share: float, device) -> dict:
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    weight = (torch.randn(n, k, device=device) / k**0.5).to(torch.bfloat16)
    lora_a = (torch.randn(rank, k, device=device) / k**0.5).to(torch.bfloat16)
    lora_b = torch.randn(n, rank, device=device)
    base = x.float() @ weight.float().t()
    delta = SCALING * (x.float() @ lora_a.float().t()) @ lora_b.t()
    lora_b = (lora_b * (delta_share * base.norm() / delta.norm())).to(torch.bfloat16)
    exact = base + SCALING * (x.float() @ lora_a.float().t()) @ lora_b.float().t()
    w = fp8_ops.quantize_fp8_rows(weight)
    return dict(x=x, weight_q=w.q, weight_scale=w.scale, lora_a=lora_a, lora_b=lora_b, exact=exact, base=base)


def providers(t: dict) -> tuple:
    """``({name: fn}, facts)``: the three ways to the layer's output, on the same rows."""
    rows = fp8_ops.quantize_fp8_rows(t["x"])
    m, k = rows.q.shape
    folded_w, c, cut = fold_weight(t["weight_q"], t["weight_scale"], t["lora_a"], t["lora_b"], SCALING)
    rank = t["lora_a"].shape[0]
    buffer = torch.empty(m, k + rank, dtype=torch.float8_e4m3fn, device=rows.q.device)
    buffer[:, :k] = rows.q
    down = torch.compile(down_into_tail, fullgraph=True) if rows.q.is_cuda else down_into_tail

    def plain():
        return fp8_ops.fp8_linear(rows, t["weight_q"], t["weight_scale"])

    def op():
        return fp8_ops.fp8_rows_lora(plain(), rows.q, rows.scale, t["lora_a"], t["lora_b"], SCALING)

    def folded():
        down(buffer, rows.q, t["lora_a"], c)
        return fp8_ops.fp8_linear(FP8Rows(buffer, rows.scale), folded_w, t["weight_scale"])

    u = down_projection(rows.q, t["lora_a"], c)
    facts = {
        "c_cut_share": cut,
        "u_clamped_share": float((u.abs() > E4M3_MAX).float().mean()),
        "u_max": float(u.abs().max()),
    }
    return {"plain": plain, "op": op, "folded": folded}, facts


def measure(rank: int, rounds: int, delta_share: float, timer) -> list:
    rows = []
    for name, m, k, n in SHAPES:
        t = _inputs(m, k, n, rank, delta_share, "cuda")
        fns, facts = providers(t)
        times = {p: [] for p in fns}
        for _ in range(rounds):
            for provider, fn in fns.items():
                times[provider].append(1e3 * graph_replay_time(fn, timer))
        row = {"name": name, "shape": [m, k, n], "rank": rank, "delta_share": delta_share, **facts}
        for provider, fn in fns.items():
            want = t["base"] if provider == "plain" else t["exact"]
            row[provider] = {
                "us": statistics.median(times[provider]),
                "us_min": min(times[provider]),
                "us_max": max(times[provider]),
                "rel_l2_vs_exact": relative_l2(fn(), want),
            }
        print(
            f"{name:16s} plain {row['plain']['us']:7.1f} us  op {row['op']['us']:7.1f}  "
            f"folded {row['folded']['us']:7.1f}  error op {row['op']['rel_l2_vs_exact']:.2e} "
            f"folded {row['folded']['rel_l2_vs_exact']:.2e}  u clamped {facts['u_clamped_share']:.1e}",
            flush=True,
        )
        rows.append(row)
    return rows


def numerics(rank: int, delta_shares, rows_m: int = 256) -> list:
    """``--cpu``: the errors and the clamp of :func:`providers` on the CPU's
    reference path (no timing), ``rows_m`` rows of each shape, per delta share."""
    rows = []
    for share in delta_shares:
        for name, _, k, n in SHAPES:
            t = _inputs(rows_m, k, n, rank, share, "cpu")
            fns, facts = providers(t)
            errors = {p: relative_l2(fn(), t["base"] if p == "plain" else t["exact"]) for p, fn in fns.items()}
            rows.append({"name": name, "shape": [rows_m, k, n], "delta_share": share, **facts, **errors})
            print(
                f"share {share:4.2f} {name:16s} c cut {facts['c_cut_share']:4.2f}  u clamped "
                f"{facts['u_clamped_share']:.2e}  error plain {errors['plain']:.2e} op {errors['op']:.2e} "
                f"folded {errors['folded']:.2e}",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--delta-share", type=float, default=0.1, help="||adapter's delta|| / ||x W.T||")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="the numerics only, on the CPU's reference path, at delta shares 0.03, 0.1, 0.3 and 1 (no timing)",
    )
    args = parser.parse_args()
    if args.cpu:
        with torch.no_grad():
            rows = numerics(args.rank, (0.03, 0.1, 0.3, 1.0))
        with open(args.out, "w") as f:
            json.dump({"env": {"device": "cpu", "torch": torch.__version__}, "rows": rows}, f, indent=1)
        return
    timer = make_timer(False)
    warm_up_gpu(5)
    with torch.no_grad():
        rows = measure(args.rank, args.rounds, args.delta_share, timer)
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
