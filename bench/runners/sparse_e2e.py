"""Sparse self-attention on a whole video DiT step: Wan 2.1 1.3B (random
full-size weights, bf16, batch 1) at 480p and 720p x 81 frames, native
compiled dense against ``compile_ops.patch(model, attention=PRESET)``
compiled, side by side in one run, with the accuracy cost next to the speed.

Accuracy, on random latents and on a smooth latent video (low-frequency noise
upsampled, unit variance; closer to what a denoiser sees late in sampling):
- each self-attention layer's sparse output against dense attention (SDPA)
  on the same q, k, v (median and max over the layers);
- the step output's relative L2 distance to the dense bf16 model's.
Random weights say nothing about perceived quality: the published
evaluations of sliding-tile attention (VBench, human preference on
HunyuanVideo and Wan) are what the preset's window follows.

    python bench/runners/sparse_e2e.py [--cases wan_step,wan_step_720p] [--repeats 3] [--out DIR]

Results: ``<out>/sparse-e2e-<gpu>.json`` (written after each case).
"""

import argparse
import os
import sys
import time

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.runners.diffusers_e2e import _build, _compiled, _repeated, _uncompiled, diffusers_environment  # noqa: E402
from bench.toolkit import relative_l2, write_results  # noqa: E402

#: The sliding-tile preset measured here (tiles of 2 x 8 x 8 latent tokens, a
#: window of 3 x 3 x 3 tiles); its density per grid is in the results.
PRESET = dict(window=(3, 3, 3), tile=(2, 8, 8))

#: The cases (bench/runners/diffusers_e2e.py builds them): Wan at 480p and 720p x 81 frames.
CASES = ("wan_step", "wan_step_720p")


def _smooth_latents(like: torch.Tensor) -> torch.Tensor:
    """Low-frequency noise (1/4 of the frames, 1/16 of the height and width)
    upsampled trilinearly to ``like``'s shape, at unit variance."""
    b, c, f, h, w = like.shape
    coarse = torch.randn(b, c, max(f // 4, 2), max(h // 16, 2), max(w // 16, 2), device=like.device)
    smooth = torch.nn.functional.interpolate(coarse, size=(f, h, w), mode="trilinear", align_corners=False)
    return (smooth / smooth.std()).to(like.dtype)


def _with_attention_errors(model, inputs) -> tuple:
    """One eager step of the patched model in which every sparse self-attention
    layer also runs dense SDPA on the same q, k, v: ``(output, errors)``."""
    errors = []
    processors = [
        m.processor for m in model.modules() if getattr(getattr(m, "processor", None), "sparse", None) is not None
    ]

    def both(processor):
        def attend(query, key, value, fp8_rows=False):  # attend_self's call (FP8 output rows: not on sparse layouts)
            out = processor.sparse.layout.attend(query, key, value)
            dense = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (query, key, value)))
            errors.append(relative_l2(out, dense.transpose(1, 2)))
            return out

        return attend

    for processor in processors:
        processor.attend_self = both(processor)  # an instance attribute over the method
    try:
        with torch.no_grad():
            out = model(**inputs).sample
    finally:
        for processor in processors:
            del processor.attend_self
    return out, errors


def _summary(errors: list) -> dict:
    values = sorted(errors)
    return {"median": values[len(values) // 2], "max": values[-1], "layers": len(values)}


def run_case(name: str, timer_ms: float, repeats: int) -> list:
    import compile_ops

    model, inputs = _build(name)  # bf16, eval, no gradients
    smooth = dict(inputs, hidden_states=_smooth_latents(inputs["hidden_states"]))
    with torch.no_grad():
        exact, exact_smooth = model(**inputs).sample, model(**smooth).sample
    frames, height, width = inputs["hidden_states"].shape[2:]
    tokens = frames * (height // 2) * (width // 2)  # Wan's 1 x 2 x 2 patches
    rows = []

    def timed(provider, extra):
        module = _compiled(model, "regional")
        with torch.no_grad():
            start = time.perf_counter()
            module(**inputs)
            first = time.perf_counter() - start
            row = _repeated(lambda: module(**inputs).sample, timer_ms, repeats)
        row.update(case=name, provider=provider, first_call_s=first, tokens=tokens, compile="regional", **extra)
        rows.append(row)
        print(
            f"{name:<14} {provider:<16} {row['ms']:9.2f} ms ({row['ms_min']:.2f}-{row['ms_max']:.2f})  "
            f"(first call {first:.0f} s) {extra}",
            flush=True,
        )

    timed("native_compiled", {})
    _uncompiled(model)
    torch._dynamo.reset()
    report = compile_ops.patch(model, attention=compile_ops.SlidingTile(**PRESET))
    out, errors = _with_attention_errors(model, inputs)
    out_smooth, errors_smooth = _with_attention_errors(model, smooth)
    layout = report.sparse_attention.layout
    timed(
        "sparse_compiled",
        {
            "preset": f"SlidingTile(window={PRESET['window']}, tile={PRESET['tile']})",
            "density": layout.density,
            "step_rel_l2": relative_l2(out, exact),
            "step_rel_l2_smooth": relative_l2(out_smooth, exact_smooth),
            "attention_rel_l2": _summary(errors),
            "attention_rel_l2_smooth": _summary(errors_smooth),
        },
    )
    print(report.sparse_attention.describe(), flush=True)
    del model
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--rep-ms", type=float, default=2000.0, help="do_bench's time budget per measurement")
    p.add_argument("--repeats", type=int, default=3, help="measurements per provider (median and spread)")
    args = p.parse_args(argv)
    env = diffusers_environment()
    rows = []
    for name in args.cases.split(","):
        rows += run_case(name, args.rep_ms, args.repeats)
        path = write_results(args.out, "sparse-e2e", env, rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
