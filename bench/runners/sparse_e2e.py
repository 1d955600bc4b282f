"""Sparse self-attention on a whole video DiT step: Wan 2.1 1.3B (random
full-size weights, bf16, batch 1) at 480p and 720p x 81 frames, native
compiled dense against ``compile_ops.patch(model, attention=PRESET, **MODES[mode])``
compiled (``--modes``: sparse 16-bit attention alone, and with FP8 Linears
and 8-bit block-sparse attention, ``precision="fp8",
attention_precision="int8_fp8"``), side by side in one run, with the
accuracy cost next to the speed.

Accuracy, on random latents and on a smooth latent video (low-frequency noise
upsampled, unit variance; closer to what a denoiser sees late in sampling):
- each self-attention layer's sparse output against dense attention (SDPA)
  on the same q, k, v (median and max over the layers), and in an 8-bit
  mode against 16-bit block-sparse attention on the same q, k, v and lists;
- the step output's relative L2 distance to the dense bf16 model's, and in
  a mode other than ``sparse`` to the ``sparse`` mode's.
Random weights say nothing about perceived quality: the published
evaluations of sliding-tile attention (VBench, human preference on
HunyuanVideo and Wan) are what the preset's window follows.

    python bench/runners/sparse_e2e.py [--cases wan_step,wan_step_720p] [--modes sparse,sparse_fp8_int8_fp8]
        [--repeats 3] [--out DIR]

Results: ``<out>/sparse-e2e-<gpu>.json`` (written after each case).
``--cases wan_step_tiny --backend eager`` runs a tiny Wan on the CPU too
(the reference paths, timed by the wall clock there): a smoke run.
"""

import argparse
import os
import sys
import time

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.runners import diffusers_models, diffusers_timing  # noqa: E402
from bench.runners.diffusers_models import build  # noqa: E402
from bench.runners.diffusers_timing import compiled, diffusers_environment, profiled, repeated, uncompiled  # noqa: E402
from bench.toolkit import relative_l2, write_results  # noqa: E402

#: The sliding-tile preset measured here (tiles of 2 x 8 x 8 latent tokens, a
#: window of 3 x 3 x 3 tiles); its density per grid is in the results.
PRESET = dict(window=(3, 3, 3), tile=(2, 8, 8))

#: The cases (bench/runners/diffusers_models.py builds them): Wan at 480p and 720p x 81 frames.
CASES = ("wan_step", "wan_step_720p")
#: ``--modes``: each one's ``compile_ops.patch`` options besides ``attention=SlidingTile(**PRESET)``.
MODES = {
    "sparse": {},
    "sparse_fp8_int8_fp8": dict(precision="fp8", attention_precision="int8_fp8"),
}


def _tiny_wan():
    """The smoke case: two Wan layers with two heads of 16 (FP8 takes every
    Linear of them) on 6 x 48 x 64 latents, 6 x 24 x 32 tokens: PRESET's
    window fits its 3 x 3 x 4 tiles, and keeps 75% of the blocks."""
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
    )
    inputs = dict(
        hidden_states=torch.randn(1, 16, 6, 48, 64),
        encoder_hidden_states=torch.randn(1, 16, 32),
        timestep=torch.tensor([500]),
    )
    return model, inputs


#: Cases built here: bench/runners/diffusers_models.py's ``build`` conventions, in its DTYPE on its DEVICE.
SMOKE_CASES = {"wan_step_tiny": _tiny_wan}


def _build_case(name: str) -> tuple:
    if name not in SMOKE_CASES:
        return build(name)
    torch.manual_seed(0)
    model, inputs = SMOKE_CASES[name]()
    model = model.to(diffusers_models.DEVICE, diffusers_models.DTYPE).eval().requires_grad_(False)
    float_dtype = diffusers_models.DTYPE
    return model, {
        k: v.to(diffusers_models.DEVICE, float_dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()
    }


def _smooth_latents(like: torch.Tensor) -> torch.Tensor:
    """Low-frequency noise (1/4 of the frames, 1/16 of the height and width)
    upsampled trilinearly to ``like``'s shape, at unit variance."""
    b, c, f, h, w = like.shape
    coarse = torch.randn(b, c, max(f // 4, 2), max(h // 16, 2), max(w // 16, 2), device=like.device)
    smooth = torch.nn.functional.interpolate(coarse, size=(f, h, w), mode="trilinear", align_corners=False)
    return (smooth / smooth.std()).to(like.dtype)


def _with_attention_errors(model, inputs) -> tuple:
    """One eager step of the patched model in which every sparse self-attention
    layer also runs dense SDPA on the same q, k, v and, where it runs 8-bit,
    16-bit block-sparse attention over the same lists: ``(output, errors
    against dense, errors against 16-bit sparse)``."""
    from compile_ops import FP8Rows

    errors, errors_vs_sparse = [], []
    processors = [
        m.processor for m in model.modules() if getattr(getattr(m, "processor", None), "sparse", None) is not None
    ]

    def both(processor):
        attend_self = type(processor).attend_self

        def attend(query, key, value, text_tokens=0, kv_lengths=None, fp8_rows=False, parallel=None):
            result = attend_self(processor, query, key, value, text_tokens, kv_lengths, fp8_rows, parallel)
            out = result
            if isinstance(result, FP8Rows):  # the kernel's e4m3 rows, dequantized
                out = result.dequantized().unflatten(2, query.shape[2:])
            dense = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (query, key, value)))
            errors.append(relative_l2(out, dense.transpose(1, 2)))
            if processor.attention_precision_of(query, key, value) != "exact":
                errors_vs_sparse.append(relative_l2(out, processor.sparse.layout.attend(query, key, value, kv_lengths)))
            return result

        return attend

    for processor in processors:
        processor.attend_self = both(processor)  # an instance attribute over the method
    try:
        with torch.no_grad():
            out = model(**inputs).sample
    finally:
        for processor in processors:
            del processor.attend_self
    return out, errors, errors_vs_sparse


def _summary(errors: list) -> dict:
    values = sorted(errors)
    return {"median": values[len(values) // 2], "max": values[-1], "layers": len(values)}


def run_case(name: str, timer_ms: float, repeats: int, modes=tuple(MODES), profile: bool = False) -> list:
    """Rows of one case: the native compiled step, then each of ``modes``
    (keys of MODES) on a fresh copy of the model (the same random weights:
    ``precision="fp8"`` releases the 16-bit ones)."""
    import compile_ops

    model, inputs = _build_case(name)  # bf16, eval, no gradients
    smooth = dict(inputs, hidden_states=_smooth_latents(inputs["hidden_states"]))
    with torch.no_grad():
        exact, exact_smooth = model(**inputs).sample, model(**smooth).sample
    frames, height, width = inputs["hidden_states"].shape[2:]
    tokens = frames * (height // 2) * (width // 2)  # Wan's 1 x 2 x 2 patches
    rows, outputs = [], {}

    def timed(model, provider, extra):
        module = compiled(model, "regional")
        with torch.no_grad():
            start = time.perf_counter()
            module(**inputs)
            first = time.perf_counter() - start
            row = repeated(lambda: module(**inputs).sample, timer_ms, repeats)
            profiled(row, lambda: module(**inputs).sample, profile)
        row.update(case=name, provider=provider, first_call_s=first, tokens=tokens, compile="regional", **extra)
        if rows:
            row["speedup_vs_native"] = rows[0]["ms"] / row["ms"]
        rows.append(row)
        print(
            f"{name:<14} {provider:<28} {row['ms']:9.2f} ms ({row['ms_min']:.2f}-{row['ms_max']:.2f})  "
            f"(first call {first:.0f} s) {extra}",
            flush=True,
        )

    timed(model, "native_compiled", {})
    for i, mode in enumerate(modes):
        if i:  # each mode patches a fresh model
            del model
            torch._dynamo.reset()
            torch.cuda.empty_cache()
            model, _ = _build_case(name)
        else:
            uncompiled(model)
            torch._dynamo.reset()
        report = compile_ops.patch(model, attention=compile_ops.SlidingTile(**PRESET), **MODES[mode])
        out, errors, errors_vs_sparse = _with_attention_errors(model, inputs)
        out_smooth, errors_smooth, _ = _with_attention_errors(model, smooth)
        outputs[mode] = out
        extra = {
            "preset": f"SlidingTile(window={PRESET['window']}, tile={PRESET['tile']})",
            "options": {key: str(value) for key, value in MODES[mode].items()},
            "density": report.sparse_attention.layout.density,
            "step_rel_l2": relative_l2(out, exact),
            "step_rel_l2_smooth": relative_l2(out_smooth, exact_smooth),
            "attention_rel_l2": _summary(errors),
            "attention_rel_l2_smooth": _summary(errors_smooth),
        }
        if errors_vs_sparse:
            extra["attention_rel_l2_vs_sparse_16bit"] = _summary(errors_vs_sparse)
        if mode != "sparse" and "sparse" in outputs:
            extra["step_rel_l2_vs_sparse"] = relative_l2(out, outputs["sparse"])
        timed(model, f"{mode}_compiled", extra)
        print(report.sparse_attention.describe(), flush=True)
    del model
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--rep-ms", type=float, default=2000.0, help="do_bench's time budget per measurement")
    p.add_argument("--repeats", type=int, default=3, help="measurements per provider (median and spread)")
    p.add_argument(
        "--backend", default="inductor", help="torch.compile's backend (eager: Dynamo alone, for smoke runs)"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also each step's GPU time by kernel family and its top kernels (torch.profiler)",
    )
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if set(modes) - set(MODES):
        p.error(f"unknown modes {sorted(set(modes) - set(MODES))}; the modes are {','.join(MODES)}")
    diffusers_timing.BACKEND = args.backend
    env = diffusers_environment()
    env["command"] = "python bench/runners/sparse_e2e.py " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = []
    for name in args.cases.split(","):
        rows += run_case(name, args.rep_ms, args.repeats, modes, args.profile)
        path = write_results(args.out, "sparse-e2e", env, rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
