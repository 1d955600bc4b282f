"""Sweep the modulation kernels' launch configs on a GPU, to pick the forward's
``forward_config`` (compile_ops/ops/modulate_launch.py) and the backward's
``backward_config`` (compile_ops/ops/modulate.py).

    PYTHONPATH=. python bench/sweeps/modulate.py [OUT.json] [OPS]

norm_modulate and gated_residual_norm_modulate (LayerNorm without affine,
per-sample [B, C] modulation: the DiT case) at the DiT shapes, bf16, timed as
CUDA-graph replays: the forward alone per forward config, and the whole
forward+backward step per backward config (the backward alone misled the norm
family's sweep, docs/notes/norm.md). Three interleaved rounds, median kept.
OPS (comma-separated) may name the FP8 output modes, norm_modulate_fp8 and
gated_residual_norm_modulate_fp8: forward only (inference), at every shape.
The forward configs include one and two warps a row: at 1536 columns the
4-warp config holds 16 values a thread, and its three row reductions a row
cost more instructions a value than the values themselves (sm_90 SASS,
docs/notes/modulate.md). ``held`` configs hold a row that is not a power of
two wide as ``held_chunks`` blocks instead of one padded block (shapes whose
width does not chunk skip them).

    PYTHONPATH=. python bench/sweeps/modulate.py OUT.json OPS --held

``--held``: the forward only, the shipped config and the padded and held
configs of one to eight warps (the candidates for ``forward_config``'s
held rows, for both output modes).
"""

import functools
import itertools
import os
import statistics
import sys

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import triton  # noqa: E402

from bench.toolkit import bytes_model, graph_replay_time, make_timer, time_forward_backward, warm_up_gpu, write_sweep  # noqa: E402
from cases import BY_NAME, DIT_NORM_SHAPES  # noqa: E402
from compile_ops._library import clear_launch_plans  # noqa: E402
from compile_ops.ops import modulate as modulate_ops  # noqa: E402
from compile_ops.ops import modulate_launch  # noqa: E402
from compile_ops.ops.norm import LaunchConfig  # noqa: E402

# (block_m, warps, piece rows)
FORWARD = [(1, 4, 4), (2, 4, 4), (1, 4, 8), (1, 8, 4), (2, 8, 4), (1, 8, 8), (1, 16, 4), (4, 8, 4)]
FORWARD += [(1, 1, 4), (1, 2, 4), (2, 2, 4)]  # one and two warps a row
#: (block_m, warps, piece rows) of rows held as chunks, and the padded ones ``--held`` keeps.
HELD = [(1, 1, 4), (1, 2, 4), (1, 4, 4), (2, 2, 4), (2, 4, 4), (2, 8, 4)]
HELD_PADDED = [(1, 4, 4), (2, 4, 4), (1, 1, 4), (1, 2, 4), (2, 2, 4)]
OPS = ("norm_modulate", "gated_residual_norm_modulate")
BACKWARD = [(1, 4, 0), (1, 8, 0), (2, 4, 0), (2, 8, 0)]  # (block_m, warps, -)
ROUNDS = 3


def _candidates(spec, width: int, held: bool) -> list:
    """``[(kind, block_m, warps, piece rows, chunks)]`` timed at one shape."""
    chunks = modulate_launch.held_chunks(width)
    if not held:
        fwdbwd = [("fwdbwd", *c, 1) for c in BACKWARD if spec.differentiable]
        return [("fwd", *c, 1) for c in FORWARD] + fwdbwd
    shipped = modulate_launch.forward_config(width, "gated" in spec.name)
    found = [("fwd", shipped.block_m, shipped.num_warps, modulate_launch.FORWARD_PIECE_ROWS, shipped.held_chunks)]
    found += [("fwd", *c, 1) for c in HELD_PADDED] + ([("fwd", *c, chunks) for c in HELD] if chunks > 1 else [])
    return list(dict.fromkeys(found))


def main(out_path=None, ops=None, held=False):
    timer = make_timer(quick=False)
    warm_up_gpu()
    results = []
    for name, shape in itertools.product(ops.split(",") if ops else OPS, DIT_NORM_SHAPES):
        spec = BY_NAME[name]
        args = spec.make_inputs(shape, torch.bfloat16, "cuda", True)
        with torch.no_grad():
            fwd_bytes, fwdbwd_bytes = bytes_model(args, spec.reference(*args))
        block_n = triton.next_power_of_2(shape[-1])
        cands = _candidates(spec, shape[-1], held)
        times = {c: [] for c in cands}
        for _ in range(ROUNDS):
            for kind, m, w, piece, chunks in cands:
                block_width = block_n if chunks == 1 else shape[-1] // chunks
                cfg = LaunchConfig(m, block_width, False, w, held_chunks=chunks)
                saved = modulate_launch.forward_config, modulate_ops.backward_config, modulate_launch.FORWARD_PIECE_ROWS
                clear_launch_plans()  # eager calls replay the config they were recorded with
                try:
                    if kind == "fwd":
                        modulate_launch.forward_config = lambda *key, cfg=cfg: cfg
                        modulate_launch.FORWARD_PIECE_ROWS = piece
                        with torch.no_grad():
                            ms = graph_replay_time(functools.partial(spec.op, *args), timer)
                    else:
                        modulate_ops.backward_config = lambda n, accumulators, single_rows, cfg=cfg: cfg
                        ms = time_forward_backward(spec.op, args, timer, graph=True)
                except Exception as e:  # noqa: BLE001 (a config that fails to compile is a result)
                    print(f"{name} {shape} {kind} {m}x{w}x{chunks}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    ms = float("nan")
                finally:
                    (
                        modulate_launch.forward_config,
                        modulate_ops.backward_config,
                        modulate_launch.FORWARD_PIECE_ROWS,
                    ) = saved
                times[(kind, m, w, piece, chunks)].append(ms)
        for (kind, m, w, piece, chunks), ts in times.items():
            ms = statistics.median(ts)
            gbps = (fwd_bytes if kind == "fwd" else fwdbwd_bytes) / (ms * 1e-3) / 1e9
            results.append(
                {
                    "op": name,
                    "shape": list(shape),
                    "kind": kind,
                    "block_m": m,
                    "num_warps": w,
                    "piece_rows": piece,
                    "held_chunks": chunks,
                    "ms": ms,
                    "GBps": gbps,
                }
            )
            print(
                f"{name:<32} {'x'.join(map(str, shape)):<13} {kind:<6} rows {m} warps {w:>2} piece {piece} "
                f"chunks {chunks}: {ms * 1e3:8.1f} us {gbps:7.0f} GB/s",
                flush=True,
            )
    write_sweep(out_path, results)


if __name__ == "__main__":
    positional = [a for a in sys.argv[1:] if a != "--held"]
    main(*positional[:2], held="--held" in sys.argv[1:])
