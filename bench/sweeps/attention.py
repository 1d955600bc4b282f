"""Sweep the attention kernels' tile configs on a GPU, to pick forward_tiles,
dkdv_tiles and dq_tiles in compile_ops/ops/attention_tiles.py.

    PYTHONPATH=. python bench/sweeps/attention.py [OUT.json] [--block-sparse | --tma | --hopper |
                                                             --eight-bit [--modes=M,...] | --backward-tma]

bf16, non-causal, CUDA-graph replays: forward configs timed on the forward,
backward configs (dk/dv pass, then dq pass) on the whole forward+backward step
with the other passes at their defaults. ``--block-sparse`` times
fused.block_sparse_attention at [1, 24, 32760, 128] with a random mask that
keeps a quarter of the 128 x 128 blocks (bench/runners/block_sparse.py's), with the
configs whose tiles fit in a block. ``--eight-bit``: the forward tiles of
8-bit attention (INT8 q k with 16-bit or FP8 P V; q given in INT8 or rounded
by the kernel), kernel only. The forward configs are ``attn_fwd_kernel``'s
(a swept ``Tiles`` never asks for the sm_90 core); the core's own are
swept by bench/experiments/sm90_core_sweep.py.
"""

import functools
import os
import sys

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import compile_ops  # noqa: E402
from bench.runners.block_sparse import random_block_mask  # noqa: E402
from bench.toolkit import graph_replay_time, make_timer, warm_up_gpu, write_sweep  # noqa: E402
from compile_ops._library import clear_launch_plans  # noqa: E402
from compile_ops.ops import attention_8bit, attention_launch, attention_tiles  # noqa: E402
from compile_ops.ops.attention_launch import launch_forward  # noqa: E402

SHAPES = ((1, 24, 4608, 128), (2, 24, 4096, 64))
#: (block_m, block_n, warps, stages) per pass.
#: Their runs: bench/results/sweep-attention-h100-round1.json and -round2.json
#: (the neighbours of the first round's best), sweep-attention-h200-round3.json.
CANDIDATES = {
    "forward_tiles": [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 4), (128, 128, 4, 3), (64, 128, 4, 3)],
    "dkdv_tiles": [
        (32, 64, 4, 3),
        (32, 128, 4, 3),
        (64, 128, 8, 3),
        (32, 64, 4, 4),
        (64, 64, 8, 3),
        (32, 64, 8, 3),
        (16, 64, 4, 3),
    ],
    "dq_tiles": [(128, 64, 8, 3), (128, 32, 4, 3), (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 4, 4), (64, 128, 8, 3)],
}


#: ``--tma``: the backward passes' tiles with TMA loads (D=128 only), the other
#: passes at their defaults.
TMA_TILE_SHAPES = ((1, 24, 4608, 128), (1, 40, 16384, 128))
TMA_TILE_CANDIDATES = {
    "dkdv_tiles": [
        (64, 128, 8, 3),
        (64, 128, 8, 2),
        (64, 128, 8, 4),
        (32, 128, 4, 3),
        (64, 64, 4, 3),
        (128, 128, 8, 2),
    ],
    "dq_tiles": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
}


SPARSE_SHAPE, SPARSE_DENSITY = (1, 24, 32760, 128), 0.25


def _quarter_of_the_blocks(length: int):
    """bench/runners/block_sparse.py's first random mask, as lists."""
    mask = random_block_mask((length + 127) // 128, SPARSE_DENSITY, torch.Generator(device="cuda").manual_seed(0))
    return compile_ops.block_index_from_mask(mask[None, None]), mask.float().mean().item()


#: Block-sparse: program tiles of at most one 128-token block, steps that divide it.
SPARSE_CANDIDATES = {
    "forward_tiles": [(128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 8, 3)],
    "dkdv_tiles": [(64, 128, 8, 3), (64, 128, 8, 2), (64, 128, 8, 4), (32, 128, 4, 3), (128, 128, 8, 2)],
    "dq_tiles": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3)],
}


#: ``--hopper``: the forward's Hopper options against the default
#: tiles, at the shapes of the README's attention tables, with SDPA's cuDNN
#: backend in the same run. Each entry: (block_m, block_n, warps, stages,
#: tma, dot_acc, warp_specialize).
HOPPER_SHAPES = ((1, 24, 4608, 128), (1, 12, 32760, 128), (1, 40, 16384, 128), (1, 12, 75600, 128))
HOPPER_CANDIDATES = [
    (128, 128, 8, 3, False, False, False),  # the default
    (128, 128, 8, 3, False, True, False),
    (128, 128, 8, 3, True, False, False),
    (128, 128, 8, 3, True, True, False),
    (128, 128, 8, 2, True, True, False),
    (128, 128, 8, 4, True, True, False),
    (128, 64, 4, 3, True, True, False),
    (128, 128, 8, 3, True, True, True),
    (128, 64, 8, 3, True, True, True),
    (128, 128, 4, 3, True, True, True),
]


def hopper_sweep(out_path):
    """Forward TFLOP/s of each HOPPER_CANDIDATES entry and of cuDNN; each
    candidate's largest difference from the default's output is printed (the
    options change the schedule, not the arithmetic, beyond the order of adds)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    timer = make_timer(quick=False)
    warm_up_gpu()
    rows = []
    for b, h, length, d in HOPPER_SHAPES:
        q, k, v = (torch.randn(b, length, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * length * length * d
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms = graph_replay_time(
                lambda: torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))), timer
            )
        rows.append({"shape": [b, h, length, d], "provider": "cudnn", "ms": ms, "TFLOPs": flops / ms / 1e9})
        print(f"{b}x{h}x{length}x{d} cudnn: {ms * 1e3:8.1f} us {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
        default = attention_launch.forward_tiles
        reference = None
        for config in HOPPER_CANDIDATES:
            attention_launch.forward_tiles = functools.partial(
                lambda *a, t, **options: t, t=attention_tiles.Tiles(*config)
            )
            clear_launch_plans()  # eager calls replay the tiles they were recorded with
            try:
                with torch.no_grad():
                    out = compile_ops.attention(q, k, v, seq_dim=1)  # [B, L, H, D]: the models' layout
                    reference = out if reference is None else reference
                    diff = (out.float() - reference.float()).abs().max().item()
                    ms = graph_replay_time(lambda: compile_ops.attention(q, k, v, seq_dim=1), timer)
                tflops = flops / ms / 1e9
            except Exception as e:  # noqa: BLE001 (a config that fails to compile is a result)
                print(f"{config}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                ms = tflops = diff = float("nan")
            finally:
                attention_launch.forward_tiles = default
                clear_launch_plans()
            rows.append(
                {
                    "shape": [b, h, length, d],
                    "provider": "fused",
                    "config": list(config),
                    "ms": ms,
                    "TFLOPs": tflops,
                    "max_diff_to_default": diff,
                }
            )
            print(
                f"{b}x{h}x{length}x{d} {config}: {ms * 1e3:8.1f} us {tflops:6.0f} TFLOP/s "
                f"(max |diff| to default {diff:.2e})",
                flush=True,
            )
        del q, k, v
        write_sweep(out_path, rows)  # after each shape: a timed-out sweep keeps what it measured


#: ``--eight-bit``: tiles of the 8-bit forward modes (and the 16-bit one beside
#: them) at HOPPER_SHAPES, TMA on: (block_m, block_n, warps, stages, warp_specialize).
#: ``int8`` / ``int8_fp8``: q given in INT8 with its scales (``attention_qk8``,
#: q and k from ``fused.qk_rope_int8``, as the patched Wan runs it); their
#: ``_round_q`` forms: q given in 16 bits and rounded by the kernel as it
#: loads it (``QUANTIZE_Q``: what ``fused.attention_int8`` / ``_fp8`` launch).
_INT8_CANDIDATES = [
    (128, 128, 8, 3, False),
    (64, 128, 4, 3, False),
    (64, 128, 4, 2, False),
    (64, 64, 4, 3, False),
    (64, 128, 4, 4, False),
]
# FP8 P V's key tiles are the specification's 128 (reference.attention.FP8_PV_TILE).
_INT8_FP8_CANDIDATES = [
    (128, 128, 8, 3, False),
    (64, 128, 4, 3, False),
    (64, 128, 4, 2, False),
    (64, 128, 4, 4, False),
    (128, 128, 4, 3, False),
    (64, 128, 4, 3, True),
]
EIGHT_BIT_CANDIDATES = {
    "exact": [(128, 128, 8, 3, False), (64, 128, 4, 3, False), (64, 128, 4, 2, False), (64, 64, 4, 3, False)],
    "int8": _INT8_CANDIDATES,
    "int8_round_q": _INT8_CANDIDATES,
    "int8_fp8": _INT8_FP8_CANDIDATES,
    "int8_fp8_round_q": _INT8_FP8_CANDIDATES,
}


def eight_bit_sweep(out_path, modes=tuple(EIGHT_BIT_CANDIDATES)):
    """Kernel-only forward TFLOP/s of each EIGHT_BIT_CANDIDATES entry of
    ``modes`` (the quantized operands prepared outside the timed launch, as
    the 8-bit ops prepare them) and of cuDNN, per shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from compile_ops import reference

    timer = make_timer(quick=False)
    warm_up_gpu()
    rows = []
    default = attention_launch.forward_tiles
    for b, h, length, d in HOPPER_SHAPES:
        flops = 4 * b * h * length * length * d
        q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        q8, q_scale, k8, k_scale = reference.attention.smooth_quantize_qk(q, k, 2)
        vt8, v_scale = attention_8bit.fp8_values_transposed(v, 2)
        out, lse = torch.empty_like(q), torch.empty(b, h, length, device="cuda")
        launches = {
            "exact": lambda: launch_forward(q, k, v, out, lse, d**-0.5, False, 2, None),
            "int8": lambda: launch_forward(
                q8, k8, v, out, lse, d**-0.5, False, 2, None, int8_scales=(q_scale, k_scale)
            ),
            "int8_fp8": lambda: launch_forward(
                q8, k8, vt8, out, lse, d**-0.5, False, 2, None, int8_scales=(q_scale, k_scale), v_scale=v_scale
            ),
            "int8_round_q": lambda: launch_forward(
                q, k8, v, out, lse, d**-0.5, False, 2, None, int8_scales=(None, k_scale)
            ),
            "int8_fp8_round_q": lambda: launch_forward(
                q, k8, vt8, out, lse, d**-0.5, False, 2, None, int8_scales=(None, k_scale), v_scale=v_scale
            ),
        }
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms = graph_replay_time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), timer)
        rows.append({"shape": [b, h, length, d], "provider": "cudnn", "ms": ms, "TFLOPs": flops / ms / 1e9})
        print(f"{b}x{h}x{length}x{d} cudnn: {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
        for mode in modes:
            for config in EIGHT_BIT_CANDIDATES[mode]:
                attention_launch.forward_tiles = functools.partial(
                    lambda *a, c: attention_tiles.Tiles(*c[:4], tma=True, warp_specialize=c[4]), c=config
                )
                try:
                    ms = graph_replay_time(launches[mode], timer)
                    tflops = flops / ms / 1e9
                except Exception as e:  # noqa: BLE001 (a config that fails to compile is a result)
                    print(f"{mode} {config}: {type(e).__name__}: {str(e)[-200:]}", flush=True)
                    ms = tflops = float("nan")
                finally:
                    attention_launch.forward_tiles = default
                rows.append(
                    {"shape": [b, h, length, d], "provider": mode, "config": list(config), "ms": ms, "TFLOPs": tflops}
                )
                print(f"{b}x{h}x{length}x{d} {mode} {config}: {tflops:6.0f} TFLOP/s", flush=True)
        del q, k, v, q8, k8, vt8
        torch.cuda.empty_cache()
        write_sweep(out_path, rows)  # after each shape: a timed-out sweep keeps what it measured


#: ``--backward-tma``: the backward passes' TMA loads on and off,
#: (dk/dv pass, dq pass), timed on the forward+backward step at HOPPER_SHAPES
#: and Flux's training shape, twice in alternation.
BACKWARD_TMA_SHAPES = HOPPER_SHAPES + ((2, 24, 4096, 128),)
BACKWARD_TMA_CANDIDATES = [(False, False), (True, False), (False, True), (True, True)] * 2


def backward_tma_sweep(out_path):
    """Forward+backward TFLOP/s (3.5x the forward's FLOPs) with the backward's
    TMA options forced, cuDNN's and FlexAttention's step in the same run, and
    each candidate's largest gradient difference to the pointer loads'."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    timer = make_timer(quick=False)
    warm_up_gpu()
    rows = []
    defaults = attention_launch.dkdv_tiles, attention_launch.dq_tiles
    for b, h, length, d in BACKWARD_TMA_SHAPES:
        q, k, v = (
            torch.randn(b, length, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
        )
        grad = torch.randn_like(q)
        flops = 3.5 * 4 * b * h * length * length * d

        def step(attend):
            attend().backward(grad)
            grads = [t.grad for t in (q, k, v)]
            q.grad = k.grad = v.grad = None
            return grads

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms = graph_replay_time(
                lambda: step(
                    lambda: torch.nn.functional.scaled_dot_product_attention(
                        *(t.transpose(1, 2) for t in (q, k, v))
                    ).transpose(1, 2)
                ),
                timer,
            )
        rows.append({"shape": [b, h, length, d], "provider": "cudnn", "ms": ms, "TFLOPs": flops / ms / 1e9})
        print(f"{b}x{h}x{length}x{d} cudnn: {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
        reference = None
        for dkdv_tma, dq_tma in BACKWARD_TMA_CANDIDATES:
            attention_launch.dkdv_tiles = functools.partial(
                lambda *a, tma, **kw: defaults[0](*a[:3], tma=tma), tma=dkdv_tma
            )
            attention_launch.dq_tiles = functools.partial(
                lambda *a, tma, **kw: defaults[1](*a[:3], tma=tma), tma=dq_tma
            )
            clear_launch_plans()
            try:
                grads = step(lambda: compile_ops.attention(q, k, v, seq_dim=1))
                reference = grads if reference is None else reference
                diff = max((g.float() - r.float()).abs().max().item() for g, r in zip(grads, reference))
                ms = graph_replay_time(lambda: step(lambda: compile_ops.attention(q, k, v, seq_dim=1)), timer)
                tflops = flops / ms / 1e9
            except Exception as e:  # noqa: BLE001 (a config that fails to compile is a result)
                print(f"{(dkdv_tma, dq_tma)}: {type(e).__name__}: {str(e)[-300:]}", flush=True)
                ms = tflops = diff = float("nan")
            finally:
                attention_launch.dkdv_tiles, attention_launch.dq_tiles = defaults
                clear_launch_plans()
            rows.append(
                {
                    "shape": [b, h, length, d],
                    "provider": "fused",
                    "dkdv_tma": dkdv_tma,
                    "dq_tma": dq_tma,
                    "ms": ms,
                    "TFLOPs": tflops,
                    "max_grad_diff_to_pointer_loads": diff,
                }
            )
            print(
                f"{b}x{h}x{length}x{d} dkdv_tma={dkdv_tma} dq_tma={dq_tma}: {tflops:6.0f} TFLOP/s "
                f"(max |grad diff| {diff:.2e})",
                flush=True,
            )
        del q, k, v, grad
        torch.cuda.empty_cache()
        write_sweep(out_path, rows)  # after each shape: a timed-out sweep keeps what it measured


def main(*argv):
    out_path = next((a for a in argv if not a.startswith("--")), None)
    if "--hopper" in argv:
        return hopper_sweep(out_path)
    if "--eight-bit" in argv:
        # --modes int8_fp8,int8_fp8_round_q: those of EIGHT_BIT_CANDIDATES alone
        modes = next((a.split("=", 1)[1].split(",") for a in argv if a.startswith("--modes=")), EIGHT_BIT_CANDIDATES)
        return eight_bit_sweep(out_path, tuple(modes))
    if "--backward-tma" in argv:
        return backward_tma_sweep(out_path)
    sparse = "--block-sparse" in argv
    # --tma: the backward passes' tiles again with their TMA loads, at D=128.
    tma = "--tma" in argv
    timer = make_timer(quick=False)
    warm_up_gpu()
    rows = []
    for b, h, length, d in [SPARSE_SHAPE] if sparse else TMA_TILE_SHAPES if tma else SHAPES:
        q, k, v = (
            torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
        )
        grad = torch.randn_like(q)
        flops = 4 * b * h * length * length * d
        if sparse:
            (index, count), kept = _quarter_of_the_blocks(length)
            flops *= kept

        def attend():
            if sparse:
                return compile_ops.block_sparse_attention(q, k, v, index, count)
            return compile_ops.attention(q, k, v)

        def forward():
            with torch.no_grad():
                attend()

        def step():
            attend().backward(grad)
            q.grad = k.grad = v.grad = None

        for pass_name, configs in (SPARSE_CANDIDATES if sparse else TMA_TILE_CANDIDATES if tma else CANDIDATES).items():
            default = getattr(attention_launch, pass_name)
            for config in configs:
                tiles = attention_tiles.Tiles(*config, tma=tma)
                setattr(attention_launch, pass_name, functools.partial(lambda *a, t, **kw: t, t=tiles))
                clear_launch_plans()
                try:
                    timed, work = (forward, flops) if pass_name == "forward_tiles" else (step, 3.5 * flops)
                    timed()  # compile outside the timing
                    ms = graph_replay_time(timed, timer)
                    tflops = work / ms / 1e9
                except Exception as e:  # noqa: BLE001 (a config that fails to compile is a result)
                    print(f"{pass_name} {config}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    ms = tflops = float("nan")
                finally:
                    setattr(attention_launch, pass_name, default)
                    clear_launch_plans()
                rows.append(
                    {
                        "shape": [b, h, length, d],
                        "block_sparse": sparse,
                        "pass": pass_name,
                        "config": list(config),
                        "tma": tma,
                        "ms": ms,
                        "TFLOPs": tflops,
                    }
                )
                print(
                    f"{b}x{h}x{length}x{d} {pass_name:<14} {config}: {ms * 1e3:8.1f} us {tflops:6.0f} TFLOP/s",
                    flush=True,
                )
        del q, k, v
        write_sweep(out_path, rows)  # after each shape: a timed-out sweep keeps what it measured


if __name__ == "__main__":
    main(*sys.argv[1:])
