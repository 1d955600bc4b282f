"""MoE routing benchmark: fused.moe_route against the PyTorch composite and torch.compile of it.

    PYTHONPATH=. python bench/runners/moe.py [--out bench/results] [--quick]

Side by side in one run, at the registry's shapes (``moe_route``: 4096 tokens
x 4096 wide, E = 64, k = 2; ``moe_route_hidream``: 4096 x 2560, E = 4, k = 2),
bf16, forward and forward+backward (the backward of probs and weights into x
and the router weight), each timed as plain calls and as CUDA-graph replays
(the kernels' time without the host's launch cost):

- ``fused_eager`` / ``fused_compiled``: ``compile_ops.moe_route`` (probs,
  weights, experts, counts and the per-expert token lists ``[E, T]``), and
  it under ``torch.compile(fullgraph=True)``;
- ``composite_eager`` / ``composite_compiled``: what a model writes instead
  (``bench/peers/moe.py``'s :func:`composite`), and it under ``torch.compile``.

The target: fused >= 10x composite_eager and >= 10x composite_compiled at
4096 x 4096, E = 64, k = 2. The summary prints the ratios; the rows go to
``<out>/moe-<gpu>.json`` with the GPU, torch and triton versions. The fused
outputs are checked against the composite's first (probabilities' relative
L2, the share of tokens whose experts agree, the counts where all agree).
Without a GPU, ``main`` runs the providers' CPU-safe check at a small shape
and exits.
"""

import argparse
import functools
import os
import sys

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.peers.moe import SPECS, composite  # noqa: E402
from bench.toolkit import (  # noqa: E402
    environment,
    log,
    make_timer,
    relative_l2,
    shape_str,
    time_forward,
    time_forward_backward,
    warm_up_gpu,
    write_results,
)

#: The fused / composite speed-up the routing kernels are held to.
TARGET = 10.0


def providers() -> dict:
    """Fresh compiled providers (call after ``torch._dynamo.reset()``: one shape each)."""
    import compile_ops

    def fused(*args):
        return compile_ops.moe_route(*args)

    return {
        "fused_eager": compile_ops.moe_route,
        "fused_compiled": torch.compile(fused, fullgraph=True),
        "composite_eager": composite,
        "composite_compiled": torch.compile(composite),
    }


def check(args) -> dict:
    """How the fused outputs compare with the composite's on ``args``."""
    import compile_ops

    with torch.no_grad():
        probs, weights, experts, counts, token_index = compile_ops.moe_route(*args)
        c_probs, c_weights, c_experts, c_counts, c_ids = composite(*args)
    same = (experts == c_experts).all(dim=1)
    result = {"probs_rel_l2": relative_l2(probs, c_probs), "experts_agree": same.float().mean().item()}
    if bool(same.all()):
        result["counts_equal"] = bool(torch.equal(counts.long(), c_counts))
        valid = torch.arange(token_index.shape[1], device=token_index.device)[None, :] < counts[:, None]
        result["token_lists_equal"] = bool(torch.equal(token_index[valid].long(), c_ids))
        result["weights_rel_l2"] = relative_l2(weights, c_weights)
    return result


def bench_case(spec, shape, timer, dtype=torch.bfloat16) -> list:
    args = spec.make_inputs(shape, dtype, "cuda", True)
    log(f"{spec.name} {shape_str(shape)} E={args[1].shape[0]} k={args[2]} renormalize={args[3]}: {check(args)}")
    rows = []
    for name, fn in providers().items():
        row = {
            "op": spec.name,
            "shape": list(shape),
            "experts": args[1].shape[0],
            "top_k": args[2],
            "renormalize": args[3],
            "dtype": str(dtype).replace("torch.", ""),
            "provider": name,
        }
        for key, measure in (
            ("fwd", time_forward),
            ("fwdbwd", time_forward_backward),
            ("fwd_graph", functools.partial(time_forward, graph=True)),
            ("fwdbwd_graph", functools.partial(time_forward_backward, graph=True)),
        ):
            try:
                row[f"{key}_us"] = measure(fn, args, timer) * 1e3
            except Exception as e:  # noqa: BLE001 (a failing provider is a result too)
                row[f"{key}_us"] = None
                row.setdefault("error", []).append(f"{key}: {type(e).__name__}: {str(e)[:300]}")
            for a in args[:2]:
                a.grad = None
            log(f"  {name:<20} {key:<13} " + (f"{row[f'{key}_us']:9.1f} us" if row[f"{key}_us"] else "FAILED"))
        rows.append(row)
    return rows


def summary(rows) -> list:
    """``[(op, kind, vs, ratio)]``: fused time against each composite."""
    out = []
    for op in dict.fromkeys(r["op"] for r in rows):
        by = {r["provider"]: r for r in rows if r["op"] == op}
        for kind in ("fwd", "fwdbwd", "fwd_graph", "fwdbwd_graph"):
            fused = min((by[p].get(f"{kind}_us") or float("inf")) for p in ("fused_eager", "fused_compiled"))
            for vs in ("composite_eager", "composite_compiled"):
                theirs = by[vs].get(f"{kind}_us")
                if theirs and fused < float("inf"):
                    out.append((op, kind, vs, theirs / fused))
    return out


def cpu_check() -> int:
    """Without a GPU: the providers' code on CPU at a small shape (the reference path)."""
    from cases import BY_NAME

    for name in SPECS:
        args = BY_NAME[name].make_inputs((1, 64, 32), torch.float32, "cpu", True)
        result = check(args)
        log(f"{name} (CPU, 64 x 32): {result}")
        if result["experts_agree"] < 1.0 or not result.get("token_lists_equal", False):
            return 1
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        log("bench/runners/moe.py: no CUDA device; checking the providers on CPU instead.")
        return cpu_check()
    from cases import BY_NAME

    env = environment()
    log(f"{env['gpu']} | torch {env['torch']} | triton {env['triton']} | CUDA {env['cuda']}")
    timer = make_timer(args.quick)
    torch.manual_seed(0)
    warm_up_gpu()
    rows = []
    for name in SPECS:
        spec = BY_NAME[name]
        for shape in spec.bench_shapes:
            torch._dynamo.reset()
            rows += bench_case(spec, tuple(shape), timer)
            torch.cuda.empty_cache()
    ratios = summary(rows)
    for op, kind, vs, ratio in ratios:
        log(f"{op:<18} {kind:<13} fused is {ratio:6.1f}x {vs}" + ("" if ratio >= TARGET else f"  (< {TARGET:.0f}x)"))
    path = write_results(args.out, "moe", env, rows)
    log(f"wrote {path}")
    return 1 if any("error" in r and r["provider"].startswith("fused") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
