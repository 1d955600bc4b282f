"""The portable int8_fp8 forward under a register cap (three programs an SM) against its shipped launch, on a GPU:

    PYTHONPATH=. python bench/experiments/attention_8bit_maxnreg.py OUT.json [--core]

Why: the kernel holds 254 registers a thread at its 64 x 128 tiles, so an SM
runs two 4-warp programs, and its issue slots were half busy: latency, not
issue, may bound it (docs/notes/attention-8bit.md, "Three programs an SM").
At 2 stages a program takes 74 KB of shared memory, so three fit if the
registers do: ``maxnreg=168``.

``attn_fwd_kernel`` is launched by ``ops.attention_launch.launch_forward``
(q given in int8, k and v quantized beforehand) with the shipped tiles, at 2
stages, and at 2 stages with ``maxnreg=168``, on Wan 2.1's sliding-tile lists
at 480p and 720p and on dense 1x24x4608x128. ``--core``: also the 16-bit sm_90
core on the same lists (``sm90_core_sweep.core``), the issue's baseline.
Alternated rounds; each the profiler's kernel time and CUDA-graph replays;
every output compared bit for bit with the shipped launch's.
"""

import argparse
import dataclasses
import json

import torch
import triton

from bench.experiments import sm90_core_sweep
from bench.toolkit import kernel_profile
from compile_ops import reference
from compile_ops.ops import attention_8bit, attention_launch, attention_sm90
from compile_ops.ops import block_sparse as block_sparse_ops

#: ``(name, stages, maxnreg)``: None keeps the shipped value.
CONFIGS = (("shipped", None, None), ("2 stages", 2, None), ("2 stages, maxnreg 168", 2, 168))
CORE = "16-bit sm_90 core"
_LAUNCH = {"stages": None, "maxnreg": None}


class _CappedLaunch:
    """``launcher(kernel)[grid](...)`` with ``_LAUNCH``'s maxnreg added."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def call(*args, **kwargs):
            if _LAUNCH["maxnreg"]:
                kwargs["maxnreg"] = _LAUNCH["maxnreg"]
            return launch(*args, **kwargs)

        return call


def _tiles(shipped):
    def tiles(*args, **kwargs):
        t = shipped(*args, **kwargs)
        return dataclasses.replace(t, num_stages=_LAUNCH["stages"]) if _LAUNCH["stages"] else t

    return tiles


def _cases(with_dense: bool):
    """``(label, [B, L, H, D] q/k/v or None, [B, H, L, D] q/k/v, lists)``."""
    from bench.runners.block_sparse import WAN_HEADS, sliding_tile_inputs

    for grid in ("wan_480p", "wan_720p"):
        layout, blhd, _ = sliding_tile_inputs(grid, WAN_HEADS, "cuda")
        bhld = tuple(t.transpose(1, 2).contiguous() for t in blhd)
        yield (
            f"{grid} {layout.density:.3f}",
            blhd,
            bhld,
            block_sparse_ops._sorted_lists(bhld[0], 2, layout.index, layout.count),
        )
    if with_dense:
        g = torch.Generator(device="cuda").manual_seed(0)
        bhld = tuple(torch.randn(1, 24, 4608, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        yield "dense 1x24x4608x128", None, bhld, None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--core", action="store_true")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    attention_sm90.has_wgmma = lambda t: False  # the portable kernel, launched as is
    attention_launch.launcher = _CappedLaunch
    attention_launch.forward_tiles = _tiles(attention_launch.forward_tiles)
    results = {"env": dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)}
    rows = results["rows"] = []
    for label, blhd, (q, k, v), lists in _cases(with_dense=not args.core):
        b, h, length, d = q.shape
        q8, q_scale, k8, k_scale = reference.attention.smooth_quantize_qk(q, k, 2)
        vt8, v_scale = attention_8bit.fp8_values_transposed(v, 2)
        out, lse = torch.empty_like(q), torch.empty(b, h, length, device="cuda")
        core_out = None if blhd is None else torch.empty_like(blhd[0])

        def eight_bit():
            attention_launch.launch_forward(
                q8, k8, vt8, out, lse, d**-0.5, False, 2, None, lists, int8_scales=(q_scale, k_scale), v_scale=v_scale
            )

        def core():
            sm90_core_sweep.core(*blhd, core_out, lse, lists=lists, seq_dim=1)

        candidates = [(name, stages, cap, eight_bit) for name, stages, cap in CONFIGS]
        if args.core and blhd is not None:
            candidates.append((CORE, None, None, core))
        shipped = None
        for rnd in range(args.rounds):
            for name, stages, cap, fn in candidates:
                _LAUNCH.update(stages=stages, maxnreg=cap)
                fn()
                torch.cuda.synchronize()
                same = None
                if fn is eight_bit:
                    shipped = out.clone() if shipped is None else shipped
                    same = bool(torch.equal(out, shipped))
                row = dict(
                    case=label,
                    config=name,
                    stages=stages,
                    maxnreg=cap,
                    round=rnd,
                    profiler_ms=kernel_profile(fn, calls=5, top=1)["top"][0][1],
                    graph_ms=triton.testing.do_bench_cudagraph(fn, rep=200),
                    bit_equal_to_shipped=same,
                )
                rows.append(row)
                print(
                    f"{label:22s} r{rnd} {name:24s} {row['profiler_ms']:.4f} {row['graph_ms']:.4f} {same}", flush=True
                )
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
        _LAUNCH.update(stages=None, maxnreg=None)
        del q8, k8, vt8, out, q, k, v
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
