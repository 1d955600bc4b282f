"""The sm_90 core (compile_ops/kernels/attention_sm90.py) timed against the
portable kernel and cuDNN in one run, on a Hopper GPU:

    PYTHONPATH=. python bench/experiments/sm90_core_sweep.py OUT.json [PART ...]

Every front end of the core at the README's attention shapes: dense forward at 2
and 3 K/V stages (D = 64 with the package's 256-key tiles), causal, key
lengths, block-sparse at about 26% of the blocks (the lists of
``bench/runners/block_sparse.py``), and the INT8_FP8 mode against
``attn_fwd_kernel``'s INT8 + PV_FP8 on the same operands (q given in int8);
``waves``: the core and cuDNN at 22, 24 and 26 heads (whole and partial last
waves); ``persistent``: the core on one program per work item against one
per SM, in every mode; ``d64``: D = 64 with 256- and 128-key tiles;
``d64-lengths``: D = 64 around SD3's length; ``wan-lists``: the 16-bit core
in both q/k/v layouts and the portable 8-bit kernel on Wan's sliding-tile
lists (``wan-lists-720p``: the 720p grid's alone). Without parts: dense,
sparse and int8. The JSON is written after each part.
The package is kept off the core in this process (``has_wgmma`` False), so
``fused.*`` calls are the portable kernel and the core is launched directly
(``ops.attention_sm90.launch_sm90_core``). Correctness is the GPU tests'
(tests/test_attention_sm90.py: the core equals the portable kernel bit for bit or
within one rounding). Timing: CUDA-graph replays, two alternated rounds."""

import json
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from compile_ops import reference
from compile_ops.kernels.attention_sm90 import attn_fwd_sm90_kernel
from compile_ops.ops import attention_8bit, attention_launch, attention_sm90, attention_tiles
from compile_ops.ops import block_sparse as block_sparse_ops

R = {"timing": []}
SHAPES = [
    (1, 24, 4608, 128),
    (1, 12, 32760, 128),
    (1, 40, 16384, 128),
    (1, 12, 75600, 128),
    (2, 24, 4096, 128),
    (2, 24, 4096, 64),
]


def core(
    q,
    k,
    v,
    out,
    lse,
    stages=2,
    causal=False,
    kv_lengths=None,
    lists=(None, None),
    scales=(None, None, None),
    seq_dim=2,
):
    """The core launched directly, ``stages`` K/V buffers; q ``[B, H, L, D]``
    (``seq_dim=1``: ``[B, L, H, D]``)."""
    attention_tiles.SM90_CORE_STAGES = stages
    attention_sm90.launch_sm90_core(
        attn_fwd_sm90_kernel, q, k, v, out, lse, q.shape[-1] ** -0.5, causal, seq_dim, kv_lengths, *lists, *scales
    )
    attention_tiles.SM90_CORE_STAGES = 2


def forced(fn, per_sm, tiles=None):
    """``fn`` (a direct core launch) on one program per SM or one per work
    item, and with the core's ``tiles`` (``ops.attention_tiles.Tiles``) where given."""

    def call():
        saved = attention_sm90.forward_tiles, attention_sm90._core_programs
        if tiles is not None:
            attention_sm90.forward_tiles = lambda *args, **kwargs: tiles
        attention_sm90._core_programs = lambda q, items, causal, sparse: (
            min(items, attention_sm90.multiprocessor_count(q)) if per_sm else items
        )
        try:
            fn()
        finally:
            attention_sm90.forward_tiles, attention_sm90._core_programs = saved

    return call


def time_rounds(cands, shape, flops, label, rep=200, rounds=2):
    """Time every ``{name: call}`` (CUDA-graph replays; a name starting with
    ``cudnn`` under SDPA's cuDNN backend) in alternated rounds, into R."""
    for rnd in range(rounds):
        for name, fn in cands.items():
            try:
                if name.startswith("cudnn"):
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        fn()
                        ms = triton.testing.do_bench_cudagraph(fn, rep=rep)
                else:
                    fn()
                    ms = triton.testing.do_bench_cudagraph(fn, rep=rep)
                tf = flops / ms / 1e9
            except Exception as e:  # noqa: BLE001
                print(name, "failed", type(e).__name__, str(e)[-300:], flush=True)
                ms = tf = float("nan")
            R["timing"].append(dict(case=label, shape=list(shape), provider=name, round=rnd, ms=ms, TFLOPs=tf))
            print(
                f"{label} {'x'.join(map(str, shape))} round {rnd} {name:28s} {ms:8.3f} ms {tf:6.0f} TFLOP/s", flush=True
            )


def dense_and_causal():
    for b, h, L, d in SHAPES:
        q, k, v = (torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out, lse = torch.empty_like(q), torch.empty(b, h, L, device="cuda")
        flops = 4 * b * h * L * L * d
        time_rounds(
            {
                "cudnn": lambda: F.scaled_dot_product_attention(q, k, v),
                "portable": lambda: torch.ops.fused.attention(q, k, v, d**-0.5, False, 2),
                "core 2 stages": lambda: core(q, k, v, out, lse, 2),
                "core 3 stages": lambda: core(q, k, v, out, lse, 3),
            },
            (b, h, L, d),
            flops,
            "dense",
        )
        if L <= 32760 and d == 128:
            time_rounds(
                {
                    "cudnn causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                    "portable causal": lambda: torch.ops.fused.attention(q, k, v, d**-0.5, True, 2),
                    "core causal": lambda: core(q, k, v, out, lse, causal=True),
                },
                (b, h, L, d),
                flops / 2,
                "causal",
            )
        if L == 4608:  # key lengths: 4096 + 77 of 4608 keys (a padded text + image batch)
            lengths = torch.full((b,), 4096 + 77, device="cuda", dtype=torch.int32)
            flops_kv = 4 * b * h * L * (4096 + 77) * d
            time_rounds(
                {
                    "portable kv_lengths": lambda: torch.ops.fused.attention(q, k, v, d**-0.5, False, 2, lengths),
                    "core kv_lengths": lambda: core(q, k, v, out, lse, kv_lengths=lengths),
                },
                (b, h, L, d),
                flops_kv,
                "kv_lengths",
            )
        del q, k, v, out, lse
        torch.cuda.empty_cache()


def sparse():
    from bench.runners.block_sparse import random_block_mask

    for b, h, L, d in [(1, 12, 32760, 128), (1, 12, 75600, 128)]:
        q, k, v = (torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out, lse = torch.empty_like(q), torch.empty(b, h, L, device="cuda")
        n = triton.cdiv(L, 128)
        mask = random_block_mask(n, 0.25, torch.Generator(device="cuda").manual_seed(0))
        index, count = block_sparse_ops.block_index_from_mask(mask[None, None])
        lists = block_sparse_ops._per_head(block_sparse_ops.ascending(index, count), count, b, h)
        kept = mask.float().mean().item()
        flops = 4 * b * h * L * L * d  # dense-equivalent: the speed-up over cuDNN dense is its ratio
        time_rounds(
            {
                "cudnn dense": lambda: F.scaled_dot_product_attention(q, k, v),
                "portable sparse": lambda: torch.ops.fused.block_sparse_attention(
                    q, k, v, index, count, d**-0.5, False, 2
                ),
                "core sparse": lambda: core(q, k, v, out, lse, lists=lists),
            },
            (b, h, L, d),
            flops,
            f"sparse {kept:.3f}",
        )
        del q, k, v, out, lse
        torch.cuda.empty_cache()


def eight_bit():
    attention_tiles.SM90_CORE_PRECISIONS = ("exact", "int8_fp8")
    for b, h, L in [(1, 24, 4608), (1, 12, 32760), (1, 40, 16384), (1, 12, 75600)]:
        d = 128
        q, k, v = (torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        q8, q_scale, k8, k_scale = reference.attention.smooth_quantize_qk(q, k, 2)
        vt8, v_scale = attention_8bit.fp8_values_transposed(v, 2)
        out, lse = torch.empty_like(q), torch.empty(b, h, L, device="cuda")
        flops = 4 * b * h * L * L * d
        cands = {
            "cudnn bf16": lambda: F.scaled_dot_product_attention(q, k, v),
            "portable int8_fp8": lambda: attention_launch.launch_forward(
                q8, k8, vt8, out, lse, d**-0.5, False, 2, None, int8_scales=(q_scale, k_scale), v_scale=v_scale
            ),
        }
        for stages in (2, 3):
            cands[f"core int8_fp8 {stages} stages"] = lambda st=stages: core(
                q8, k8, vt8, out, lse, st, scales=(q_scale, k_scale, v_scale)
            )
        time_rounds(cands, (b, h, L, d), flops, "int8_fp8")
        del q, k, v, q8, k8, vt8
        torch.cuda.empty_cache()


def waves():
    """Wave quantization: 1xHx4608 with H = 22 is 792 programs, six full waves
    on 132 SMs; H = 24 (Flux) 6.55 waves; 2xHx4096 likewise."""
    for b, h, L in [(1, 22, 4608), (1, 24, 4608), (1, 26, 4608), (2, 22, 4096), (2, 24, 4096)]:
        d = 128
        q, k, v = (torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out, lse = torch.empty_like(q), torch.empty(b, h, L, device="cuda")
        time_rounds(
            {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v), "core": lambda: core(q, k, v, out, lse)},
            (b, h, L, d),
            4 * b * h * L * L * d,
            "waves",
            rounds=3,
        )
        del q, k, v, out, lse


def persistent():
    """The core with one program per work item (the GPU deals them out as SMs
    free up) against one program per SM looping over its items, in every
    mode, cuDNN beside them."""
    from bench.runners.block_sparse import random_block_mask

    for b, h, L in [(1, 24, 4608), (1, 12, 32760), (1, 40, 16384), (1, 12, 75600), (2, 24, 4096)]:
        d = 128
        q, k, v = (torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out, lse = torch.empty_like(q), torch.empty(b, h, L, device="cuda")
        flops = 4 * b * h * L * L * d
        cands = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v)}
        for per_sm in (False, True):
            cands[f"core {'per SM' if per_sm else 'per item'}"] = forced(lambda: core(q, k, v, out, lse), per_sm)
        time_rounds(cands, (b, h, L, d), flops, "dense", rounds=3)
        if L <= 16384:
            cands = {"cudnn causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
            for per_sm in (False, True):
                cands[f"core causal {'per SM' if per_sm else 'per item'}"] = forced(
                    lambda: core(q, k, v, out, lse, causal=True), per_sm
                )
            time_rounds(cands, (b, h, L, d), flops / 2, "causal", rounds=2)
        if L == 4608:
            lengths = torch.full((b,), 4096 + 77, device="cuda", dtype=torch.int32)
            cands = {
                f"core kv_lengths {'per SM' if per_sm else 'per item'}": forced(
                    lambda: core(q, k, v, out, lse, kv_lengths=lengths), per_sm
                )
                for per_sm in (False, True)
            }
            time_rounds(cands, (b, h, L, d), 4 * b * h * L * (4096 + 77) * d, "kv_lengths", rounds=2)
        if L in (32760, 75600):
            n = triton.cdiv(L, 128)
            mask = random_block_mask(n, 0.25, torch.Generator(device="cuda").manual_seed(0))
            index, count = block_sparse_ops.block_index_from_mask(mask[None, None])
            lists = block_sparse_ops._per_head(block_sparse_ops.ascending(index, count), count, b, h)
            cands = {
                f"core sparse {'per SM' if per_sm else 'per item'}": forced(
                    lambda: core(q, k, v, out, lse, lists=lists), per_sm
                )
                for per_sm in (False, True)
            }
            time_rounds(cands, (b, h, L, d), flops, f"sparse {mask.float().mean().item():.3f}", rounds=2)
        del q, k, v, out, lse
        torch.cuda.empty_cache()


def wide(block_n, stages, per_sm, fn):
    """``fn`` (a direct core launch) with the core's key tiles and stages
    forced, on one program per SM or per work item."""
    return forced(fn, per_sm, attention_tiles.Tiles(128, block_n, 4, stages, tma=True, sm90_core=True))


def head_dim_64_lengths():
    """D = 64 dense, the lengths around SD3's 4429 tokens (24 heads): whole
    256-key tiles or not, several partial last waves, the core's wide tiles
    against the portable kernel and cuDNN (which ``takes_sm90_core``'s rule
    for D = 64 is chosen by)."""
    for b, h, L in [(1, 24, 4096), (1, 24, 4352), (1, 24, 4429), (1, 24, 4608), (2, 24, 4429), (1, 38, 4429)]:
        d = 64
        q, k, v = (torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out, lse = torch.empty_like(q), torch.empty(b, h, L, device="cuda")
        time_rounds(
            {
                "cudnn": lambda: F.scaled_dot_product_attention(q, k, v),
                "portable": lambda: torch.ops.fused.attention(q, k, v, d**-0.5, False, 2),
                "core 256 keys per SM": wide(256, 2, True, lambda: core(q, k, v, out, lse)),
            },
            (b, h, L, d),
            4 * b * h * L * L * d,
            "dense",
        )
        del q, k, v, out, lse


def head_dim_64():
    """D = 64: the core with 256-key tiles (its wide-tile form: each consumer
    folds P V in before the softmax) and with 128-key tiles, persistent and
    per item, against the portable kernel and cuDNN; causal and key lengths
    too. Each core output is checked against the portable kernel's first."""
    for b, h, L in [(2, 24, 4096), (1, 24, 4429), (1, 24, 16384)]:
        d = 64
        q, k, v = (torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out, lse = torch.empty_like(q), torch.empty(b, h, L, device="cuda")
        flops = 4 * b * h * L * L * d
        for causal, lengths, label in [
            (False, None, "dense"),
            (True, None, "causal"),
            (False, torch.full((b,), L - 333, device="cuda", dtype=torch.int32), "kv_lengths"),
        ]:
            want = torch.ops.fused.attention(q, k, v, d**-0.5, causal, 2, lengths)[0]
            cands = (
                {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)} if lengths is None else {}
            )
            cands["portable"] = lambda: torch.ops.fused.attention(q, k, v, d**-0.5, causal, 2, lengths)
            for block_n, stages, per_sm in [
                (128, 2, True),
                (128, 2, False),
                (256, 2, True),
                (256, 3, True),
                (256, 2, False),
            ]:
                if causal and per_sm:
                    continue
                name = f"core {block_n} keys {stages} stages {'per SM' if per_sm else 'per item'}"
                cands[name] = wide(
                    block_n, stages, per_sm, lambda: core(q, k, v, out, lse, causal=causal, kv_lengths=lengths)
                )
                out.fill_(float("nan"))
                cands[name]()
                err = (out.float() - want.float()).abs().max().item()
                print(label, b, h, L, name, "max |core - portable|", err, flush=True)
                R.setdefault("checks", []).append(dict(case=label, shape=[b, h, L, d], provider=name, max_abs=err))
            time_rounds(
                cands, (b, h, L, d), flops / 2 if causal else flops * (1 if lengths is None else (L - 333) / L), label
            )
        del q, k, v, out, lse
        torch.cuda.empty_cache()


def wan_lists(grids=("wan_480p", "wan_720p")):
    """Wan's sliding-tile lists (``bench/runners/block_sparse.py --precision``'s
    inputs, tile order): the 16-bit core launched on q, k, v as the models hold
    them (``[B, L, H, D]``) and on ``[B, H, L, D]`` copies, beside the portable
    8-bit kernel on the operands its passes write, each also by
    ``torch.profiler`` (the kernel's own time). Two earlier runs, one per
    layout, timed the same core kernel on these lists further apart than
    their spreads (docs/notes/attention-forward.md, "Ping-pong between the
    consumers")."""
    from bench.runners.block_sparse import WAN_HEADS, sliding_tile_inputs
    from bench.toolkit import kernel_profile

    for grid in grids:
        layout, (q, k, v), _tokens = sliding_tile_inputs(grid, WAN_HEADS, "cuda")  # [B, L, H, D]
        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # [B, H, L, D]
        b, h, L, d = qh.shape
        lists = block_sparse_ops._sorted_lists(qh, 2, layout.index, layout.count)
        q8, q_scale, k8, k_scale = reference.attention.smooth_quantize_qk(qh, kh, 2)
        vt8, v_scale = attention_8bit.fp8_values_transposed(vh, 2)
        out_l, out_h = torch.empty_like(q), torch.empty_like(qh)
        lse = torch.empty(b, h, L, device="cuda")
        cands = {
            "core bf16 [B, L, H, D]": lambda: core(q, k, v, out_l, lse, lists=lists, seq_dim=1),
            "core bf16 [B, H, L, D]": lambda: core(qh, kh, vh, out_h, lse, lists=lists),
            "portable int8_fp8": lambda: attention_launch.launch_forward(
                q8, k8, vt8, out_h, lse, d**-0.5, False, 2, None, lists, int8_scales=(q_scale, k_scale), v_scale=v_scale
            ),
        }
        cands["core bf16 [B, L, H, D]"]()
        cands["core bf16 [B, H, L, D]"]()
        same = bool(torch.equal(out_l.transpose(1, 2), out_h))
        label = f"{grid} sparse {layout.density:.3f}"
        for name, fn in cands.items():
            ms = kernel_profile(fn, calls=5, top=1)["top"][0][1]
            R.setdefault("profiled", []).append(dict(case=label, provider=name, kernel_ms=ms))
            print(label, name, f"kernel by the profiler {ms:.3f} ms", flush=True)
        R.setdefault("checks", []).append(dict(case=label, provider="core, both layouts", bit_equal=same))
        print(label, "core outputs in both layouts equal:", same, flush=True)
        time_rounds(cands, (b, h, L, d), 4 * b * h * L * L * d * layout.density, label, rounds=3)
        del q, k, v, qh, kh, vh, q8, k8, vt8, out_l, out_h, lse
        torch.cuda.empty_cache()


#: The parts a run can name (the module's docstring says what each times).
PARTS = {
    "dense": dense_and_causal,
    "sparse": sparse,
    "int8": eight_bit,
    "waves": waves,
    "persistent": persistent,
    "d64": head_dim_64,
    "d64-lengths": head_dim_64_lengths,
    "wan-lists": wan_lists,
    "wan-lists-720p": lambda: wan_lists(("wan_720p",)),
}


def main():
    attention_sm90.has_wgmma = lambda t: False  # fused.* calls: the portable kernel
    parts = sys.argv[2:] or ["dense", "sparse", "int8"]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"sm90_core_sweep.py: unknown parts {sorted(unknown)}; the parts are {list(PARTS)}")
    R["env"] = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    for part, run in PARTS.items():  # in this order, whatever the command line's
        if part in parts:
            run()
            json.dump(R, open(sys.argv[1], "w"), indent=1)  # after each part: a run cut short keeps what it did


if __name__ == "__main__":
    main()
