"""Block-sparse attention benchmark: fused.block_sparse_attention against
FlexAttention with the same block mask, and against dense attention (ours
and SDPA's cuDNN backend); ``fused_sparse_atomic_dq``: ours after
``compile_ops.set_attention_backward(deterministic=False)``.

    PYTHONPATH=. python bench/runners/block_sparse.py [--out bench/results] [--shape 1x12x75600x128]
    PYTHONPATH=. python bench/runners/block_sparse.py --precision exact,int8,int8_fp8 [--grids wan_480p,wan_720p]

bf16, [1, 24, 32760, 128] by default (Wan-length sequence, Flux's 24 heads), random
block masks at 25% and 50% of the 128 x 128 blocks kept (block 0 and the
diagonal always kept), one mask for every head. Times are CUDA-graph
replays; mask building (the dynamic top-k estimate from q and k, and the
conversion of a static mask) is timed on its own. Writes
``<out>/block-sparse-<gpu>.json``.

``--precision``: instead, our block-sparse forward in each precision
(``block_sparse_attention(..., precision=...)``: 16-bit, 8-bit q k, and FP8
P V too) on the same sliding-tile lists: ``bench/runners/sparse_e2e.py``'s
preset on Wan 2.1's latent grids (``GRIDS``), 12 heads of 128 in the
models' ``[B, L, H, D]`` layout, inference (no gradient). Each provider is
timed ``--repeats`` times, interleaved (median, min, max of the CUDA-graph
replays), with its output's relative L2 distance to the ``exact``
precision's on the same inputs (random normal q, k, v; k with a per-channel
offset, which the 8-bit quantization's smoothing removes); with ``--ordered``
each also as a patched model calls it: q, k, v in token order and the
layout's tile order as ``token_order`` (exact: torch's permutations around
the kernel; 8-bit: the kernels' row gathers). Writes
``<out>/block-sparse-precision-<gpu>.json``; ``--dry`` runs it on the CPU
(the reference path, a tiny grid, the wall clock): a smoke run.
"""

import argparse
import os
import sys
import time

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from bench.toolkit import (  # noqa: E402
    environment,
    graph_replay_time,
    make_timer,
    relative_l2,
    warm_up_gpu,
    write_results,
)

SHAPE = (1, 24, 32760, 128)
DENSITIES = (0.25, 0.5)
#: ``--precision``'s token grids (latent frames, height, width after patching): Wan 2.1 at 81
#: frames, 480p (832 x 480) and 720p (1280 x 720); ``tiny``: the ``--dry`` smoke run's.
GRIDS = {"wan_480p": (21, 30, 52), "wan_720p": (21, 45, 80), "tiny": (6, 24, 32)}
#: Wan 2.1 1.3B's self-attention heads: 12 of 128.
WAN_HEADS, WAN_HEAD_DIM = 12, 128
#: ``--ordered``: the suffix of the providers called with q, k, v in token order and a ``token_order``.
ORDERED = "_ordered"


def random_block_mask(n: int, density: float, generator: torch.Generator) -> torch.Tensor:
    """``[n, n]`` bool on the GPU: each 128 x 128 block kept with probability
    ``density``, plus the diagonal and the first key block (a sink)."""
    mask = torch.rand(n, n, device="cuda", generator=generator) < density
    mask.fill_diagonal_(True)
    mask[:, 0] = True
    return mask


def main(argv=None) -> int:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    import compile_ops

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--shape", default="x".join(map(str, SHAPE)), help="BxHxLxD")
    p.add_argument("--precision", default="", help="comma-separated precisions to compare on sliding-tile lists")
    p.add_argument("--grids", default="wan_480p,wan_720p", help="--precision's grids: " + ",".join(GRIDS))
    p.add_argument("--repeats", type=int, default=3, help="--precision's measurements per provider")
    p.add_argument("--dry", action="store_true", help="--precision on the CPU, the tiny grid (a smoke run)")
    p.add_argument(
        "--ordered",
        action="store_true",
        help="--precision: each precision also as models call it, in token order with token_order= "
        "(the permutations or the kernels' gathers timed with it)",
    )
    args = p.parse_args(argv)
    if args.precision:
        return compare_precisions(args, argv)
    timer = make_timer(args.quick)
    warm_up_gpu()
    shape = tuple(int(x) for x in args.shape.split("x"))
    b, h, length, d = shape
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    n = (length + 127) // 128
    flops_dense = 4 * b * h * length * length * d
    flex = torch.compile(flex_attention)
    rows = []

    def measure(name, density, fn, flops, backward_may_fail=False):
        def forward():
            with torch.no_grad():
                fn()

        def step():
            fn().backward(grad)
            q.grad = k.grad = v.grad = None

        fwd = graph_replay_time(forward, timer)
        row = {
            "provider": name,
            "density": density,
            "shape": list(shape),
            "fwd_ms": fwd,
            "fwd_TFLOPs": flops / fwd / 1e9,
        }
        try:
            step()
            both = graph_replay_time(step, timer)
            row.update(fwdbwd_ms=both, fwdbwd_TFLOPs=3.5 * flops / both / 1e9)
        except Exception as e:  # noqa: BLE001 (cuDNN's backward fails at some shapes: a result; ours must run)
            if not backward_may_fail:
                raise
            q.grad = k.grad = v.grad = None
            row["fwdbwd_error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        print(
            f"{name:<16} density {density:.2f}  fwd {fwd * 1e3:8.1f} us  fwd+bwd "
            f"{row.get('fwdbwd_ms', float('nan')) * 1e3:8.1f} us  (effective {row['fwd_TFLOPs']:.0f} / "
            f"{row.get('fwdbwd_TFLOPs', float('nan')):.0f} TFLOP/s)",
            flush=True,
        )
        return row

    def cudnn_dense():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)

    dense = measure("fused_dense", 1.0, lambda: compile_ops.attention(q, k, v), flops_dense)
    cudnn = measure("sdpa_cudnn_dense", 1.0, cudnn_dense, flops_dense, backward_may_fail=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for density in DENSITIES:
        mask = random_block_mask(n, density, gen)
        kept = mask.float().mean().item()
        index, count = compile_ops.block_index_from_mask(mask[None, None])
        flops = flops_dense * kept
        ours = measure("fused_sparse", kept, lambda: compile_ops.block_sparse_attention(q, k, v, index, count), flops)
        compile_ops.set_attention_backward(deterministic=False)  # the five-product backward over the lists
        try:
            atomic = measure(
                "fused_sparse_atomic_dq", kept, lambda: compile_ops.block_sparse_attention(q, k, v, index, count), flops
            )
        finally:
            compile_ops.set_attention_backward(deterministic=True)
        kv_num = count[0, 0].view(1, 1, n)
        kv_idx = index[0, 0].view(1, 1, n, n)
        block_mask = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=128, seq_lengths=(length, length))
        flex_row = measure("flex_block_mask", kept, lambda: flex(q, k, v, block_mask=block_mask), flops)
        for row in (ours, atomic, flex_row):
            for ref_name, ref in (("fused_dense", dense), ("sdpa_cudnn_dense", cudnn)):
                row[f"speedup_vs_{ref_name}"] = {
                    "fwd": ref["fwd_ms"] / row["fwd_ms"],
                    "fwdbwd": ref["fwdbwd_ms"] / row["fwdbwd_ms"] if "fwdbwd_ms" in ref else None,
                }
        print(
            f"  at {kept:.2f}: ours {ours['speedup_vs_fused_dense']['fwd']:.2f}x / "
            f"{ours['speedup_vs_fused_dense']['fwdbwd']:.2f}x our dense, "
            f"{ours['speedup_vs_sdpa_cudnn_dense']['fwd']:.2f}x / "
            f"{ours['speedup_vs_sdpa_cudnn_dense']['fwdbwd'] or float('nan'):.2f}x cuDNN dense; flex "
            f"{flex_row['fwd_ms'] / ours['fwd_ms']:.2f}x / "
            f"{flex_row['fwdbwd_ms'] / ours['fwdbwd_ms']:.2f}x our time; "
            f"deterministic=False fwd+bwd {atomic['speedup_vs_sdpa_cudnn_dense']['fwdbwd'] or float('nan'):.2f}x "
            f"cuDNN dense",
            flush=True,
        )

    # Mask building: the dynamic top-k estimate (pooled q and k, per head) and
    # a static mask's conversion, compiled as a model would run them.
    topk = torch.compile(lambda q, k: compile_ops.topk_block_index(q, k, coverage=0.9, sink_blocks=1))
    convert = torch.compile(lambda m: compile_ops.block_index_from_mask(m))
    with torch.no_grad():
        topk(q, k)
        static = compile_ops.sliding_tile_mask((3, 5, 18), (3, 3, 5), device="cuda")[None, None]  # 270 tiles
        convert(static)
        t_topk = graph_replay_time(lambda: topk(q, k), timer)
        t_convert = graph_replay_time(lambda: convert(static), timer)
        index, count = topk(q, k)
    topk_kept = count.float().mean().item() / n
    rows.append({"provider": "topk_block_index", "shape": list(shape), "ms": t_topk, "kept": topk_kept})
    rows.append({"provider": "block_index_from_mask", "shape": [1, 1, 270, 270], "ms": t_convert})
    print(
        f"topk_block_index {t_topk * 1e3:.1f} us (keeps {topk_kept:.2f} of the blocks on random data); "
        f"block_index_from_mask {t_convert * 1e3:.1f} us",
        flush=True,
    )

    print(f"wrote {write_results(args.out, 'block-sparse', environment(), rows)}")
    return 0


def sliding_tile_inputs(grid_name: str, heads: int, device: str) -> tuple:
    """``--precision``'s inputs on one grid: ``(layout, (q, k, v), (q, k, v) in token
    order)``, the preset's sliding-tile layout of ``GRIDS[grid_name]`` and bf16 ``[1, L,
    heads, WAN_HEAD_DIM]`` random normal tensors in its tile order, k with a per-channel
    offset (which the 8-bit quantization's smoothing removes); the same tokens in their
    own order are what a model's attention holds before the layout permutes them."""
    import compile_ops
    from bench.runners.sparse_e2e import PRESET

    grid = GRIDS[grid_name]
    layout = compile_ops.SlidingTile(**PRESET).layout(grid, device)
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (1, grid[0] * grid[1] * grid[2], heads, WAN_HEAD_DIM)
    q, k, v = (torch.randn(shape, device=device, generator=generator) for _ in range(3))
    k = k + 2.0 * torch.randn(WAN_HEAD_DIM, device=device, generator=generator)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    tokens = tuple(torch.empty_like(t).index_copy_(1, layout.perm, t) for t in (q, k, v))
    return layout, (q, k, v), tokens


def as_models_call(layout, provider: str):
    """Wan's sparse self-attention as a patched model calls it on ``layout``'s
    lists: a function of q, k, v ``[1, L, H, D]`` in token order (the third item
    of :func:`sliding_tile_inputs`), with the layout's tile order as
    ``token_order``. ``provider``: ``"exact"`` (16-bit, the sm_90 core),
    ``"int8_fp8"`` (8-bit operands, 16-bit output) or ``"int8_fp8 rows"`` (the
    FP8 output rows Wan's self-attention hands an FP8 ``to_out``)."""
    import compile_ops

    lists = (layout.index, layout.count)
    if provider == "int8_fp8 rows":
        rows = torch.ops.fused.block_sparse_attention_int8_fp8_rows
        return lambda q, k, v: rows(q, k, v, *lists, q.shape[-1] ** -0.5, False, 1, None, layout.perm)
    if provider not in ("exact", "int8_fp8"):
        raise ValueError(f"provider: 'exact', 'int8_fp8' or 'int8_fp8 rows', not {provider!r}")
    return lambda q, k, v: compile_ops.block_sparse_attention(
        q, k, v, *lists, seq_dim=1, precision=provider, token_order=layout.perm
    )


def precision_rows(
    grid_name: str, precisions: list, repeats: int, time_ms, device: str, heads: int = WAN_HEADS, ordered=False
) -> list:
    """Rows of ``--precision`` on one grid: per precision, the block-sparse
    forward's times (``time_ms(fn)``, ``repeats`` rounds over the providers in
    turn) and its output's distance to the ``exact`` precision's; ``heads``
    of WAN_HEAD_DIM. ``ordered``: each precision also as a patched model
    calls it, with q, k and v in the token order and the layout's tile order
    as ``token_order`` (the permutations or the kernels' gathers included),
    a provider ``fused_sparse_<precision>_ordered``."""
    import compile_ops
    from bench.runners.sparse_e2e import PRESET

    layout, (q, k, v), (q_tokens, k_tokens, v_tokens) = sliding_tile_inputs(grid_name, heads, device)
    length, shape = q.shape[1], tuple(q.shape)

    def attend(provider):
        precision = provider.removesuffix(ORDERED)
        if provider.endswith(ORDERED):
            return compile_ops.block_sparse_attention(
                q_tokens,
                k_tokens,
                v_tokens,
                layout.index,
                layout.count,
                seq_dim=1,
                precision=precision,
                token_order=layout.perm,
            )
        return compile_ops.block_sparse_attention(q, k, v, layout.index, layout.count, seq_dim=1, precision=precision)

    def in_tile_order(provider, out):
        return out.index_select(1, layout.perm) if provider.endswith(ORDERED) else out

    providers = [*precisions, *(precision + ORDERED for precision in precisions if ordered)]
    with torch.no_grad():
        outputs = {p: in_tile_order(p, attend(p)) for p in dict.fromkeys(("exact", *providers))}
        times = {provider: [] for provider in providers}
        for _ in range(repeats):
            for provider in providers:
                times[provider].append(time_ms(lambda provider=provider: attend(provider)))
    flops = 4 * length * length * heads * WAN_HEAD_DIM * layout.density
    rows = []
    for provider in providers:
        runs = sorted(times[provider])
        ms = runs[len(runs) // 2]
        rows.append(
            {
                "provider": f"fused_sparse_{provider}",
                "precision": provider.removesuffix(ORDERED),
                "token_order": provider.endswith(ORDERED),
                "grid": grid_name,
                "tokens": length,
                "shape": list(shape),
                "preset": f"SlidingTile(window={PRESET['window']}, tile={PRESET['tile']})",
                "density": layout.density,
                "fwd_ms": ms,
                "fwd_ms_min": runs[0],
                "fwd_ms_max": runs[-1],
                "fwd_ms_runs": runs,
                "fwd_TFLOPs": flops / ms / 1e9,
                "rel_l2_vs_exact": relative_l2(outputs[provider], outputs["exact"]),
            }
        )
    for row in rows:  # against the exact precision called the same way
        exact = [r for r in rows if r["precision"] == "exact" and r["token_order"] == row["token_order"]]
        row["speedup_vs_exact"] = exact[0]["fwd_ms"] / row["fwd_ms"] if exact else None
        print(
            f"{grid_name} ({row['density']:.1%} of blocks) {row['provider']:<30} fwd {row['fwd_ms']:8.3f} ms "
            f"({row['fwd_ms_min']:.3f}-{row['fwd_ms_max']:.3f})  {row['speedup_vs_exact'] or float('nan'):.2f}x "
            f"exact  rel L2 to exact {row['rel_l2_vs_exact']:.2e}",
            flush=True,
        )
    return rows


def _wall_clock_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def compare_precisions(args, argv) -> int:
    """``--precision``: :func:`precision_rows` on each grid, one results file
    (``argv``: the command line's arguments, recorded in it)."""
    precisions = args.precision.split(",")
    unknown = set(precisions) - {"exact", "int8", "int8_fp8"}
    if unknown:
        raise SystemExit(
            f"block_sparse.py: unknown precisions {sorted(unknown)}; the precisions are exact,int8,int8_fp8"
        )
    if args.dry:  # two heads: the reference path materializes the scores
        device, grids, heads, time_ms = "cpu", ["tiny"], 2, _wall_clock_ms
        env = {"gpu": "cpu", "torch": torch.__version__}
    else:
        timer = make_timer(args.quick)
        warm_up_gpu()
        device, grids, heads, env = "cuda", args.grids.split(","), WAN_HEADS, environment()

        def time_ms(fn):
            return graph_replay_time(fn, timer)

    env["command"] = "python bench/runners/block_sparse.py " + " ".join(sys.argv[1:] if argv is None else argv)
    rows = []
    for grid_name in grids:
        rows += precision_rows(grid_name, precisions, args.repeats, time_ms, device, heads, args.ordered)
    print(f"wrote {write_results(args.out, 'block-sparse-precision', env, rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
