"""End-to-end benchmark: diffusers transformers with and without compile_ops.patch.

    PYTHONPATH=. python bench/diffusers_e2e.py [--cases flux_step,wan_step,flux_train] [--out bench/results]

Full-size configs with random weights (nothing is downloaded), bf16, batch 1:

- ``flux_step``: FluxTransformer2DModel (Flux.1-dev: 19 double + 38 single
  blocks, 3072 wide), one denoising forward at 1024x1024 (4096 image + 512
  text tokens).
- ``wan_step``: WanTransformer3DModel (Wan 2.1 1.3B: 30 blocks, 1536 wide),
  one denoising forward at 480p x 81 frames (21 x 30 x 52 = 32760 tokens).
- ``flux_train``: a Flux-size block stack (2 double + 4 single blocks, with
  the embedders and final norm), forward + backward of a mean-square loss at
  4096 + 512 tokens, parameters trainable.

Training runs SDPA without its cuDNN backend: torch 2.11's cuDNN attention
backward fails at this shape (``mha_graph.execute(...).is_good()``), so the
native step uses SDPA's flash backend. Each case runs native eager, native
``torch.compile`` (default mode), patched eager and patched compiled, one
model patched in place between the two halves. Times are medians of ``triton.testing.do_bench``; the peak memory is
the allocator's peak during one call above what was allocated before it.
Writes ``<out>/diffusers-e2e-<gpu>.json`` (rows merge with an existing file
by case and provider).
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.toolkit import environment, results_path, warm_up_gpu, write_results  # noqa: E402

DTYPE = torch.bfloat16


def _flux(num_layers: int, num_single_layers: int):
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=num_layers,
                                   num_single_layers=num_single_layers, attention_head_dim=128,
                                   num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                                   guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    side, text = 64, 512  # 1024 px / 8 (VAE) / 2 (packing) = 64 latent tokens a side
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()
    inputs = dict(hidden_states=torch.randn(1, side * side, 64), encoder_hidden_states=torch.randn(1, text, 4096),
                  pooled_projections=torch.randn(1, 768), timestep=torch.tensor([0.5]),
                  guidance=torch.tensor([3.5]), img_ids=img_ids, txt_ids=torch.zeros(text, 3))
    return model, inputs


def _wan():
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
                                  in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960,
                                  num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
    inputs = dict(hidden_states=torch.randn(1, 16, 21, 60, 104), encoder_hidden_states=torch.randn(1, 512, 4096),
                  timestep=torch.tensor([500]))
    return model, inputs


CASES = {
    "flux_step": (lambda: _flux(19, 38), False),
    "wan_step": (_wan, False),
    "flux_train": (lambda: _flux(2, 4), True),
}


def _measure(fn, timer_ms: float):
    """(median ms, peak MiB above the memory in use before the call)."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
    return do_bench(fn, warmup=timer_ms / 4, rep=timer_ms, return_mode="median"), peak


def run_case(name: str, timer_ms: float) -> list:
    import compile_ops

    build, train = CASES[name]
    torch.manual_seed(0)
    with torch.device("cuda"):
        default = torch.get_default_dtype()
        torch.set_default_dtype(DTYPE)  # initialise in bf16: no fp32 copy of 12B parameters
        try:
            model, inputs = build()
        finally:
            torch.set_default_dtype(default)
    inputs = {k: v.to("cuda", DTYPE if v.is_floating_point() and "ids" not in k else v.dtype)
              for k, v in inputs.items()}
    model.train(train).requires_grad_(train)
    torch.backends.cuda.enable_cudnn_sdp(not train)

    def step(module):
        if not train:
            with torch.no_grad():
                return module(**inputs).sample
        loss = module(**inputs).sample.float().pow(2).mean()
        loss.backward()
        for p in module.parameters():
            p.grad = None
        return loss

    rows, report = [], None
    for provider in ("native_eager", "native_compiled", "patched_eager", "patched_compiled"):
        if provider == "patched_eager":
            torch._dynamo.reset()
            report = compile_ops.patch(model)
            print(report, flush=True)
        module = torch.compile(model) if provider.endswith("compiled") else model
        start = time.perf_counter()
        step(module)  # compiles
        setup_s = time.perf_counter() - start
        ms, peak = _measure(lambda: step(module), timer_ms)
        rows.append({"case": name, "provider": provider, "ms": ms, "peak_MiB": peak, "first_call_s": setup_s,
                     "train": train, "tokens": _tokens(name), "attention_kernel": "auto"})
        print(f"{name:<11} {provider:<17} {ms:9.2f} ms  peak {peak:8.0f} MiB  (first call {setup_s:.0f} s)",
              flush=True)
    by = {r["provider"]: r for r in rows}
    print(f"{name}: patched compiled {by['native_compiled']['ms'] / by['patched_compiled']['ms']:.3f}x native "
          f"compiled; patched eager {by['native_eager']['ms'] / by['patched_eager']['ms']:.3f}x native eager",
          flush=True)
    for r in rows:
        r["patched"] = {"replaced": len(report.replaced), "left": len(report.left)}
    del model
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return rows


def _tokens(name: str) -> int:
    return 21 * 30 * 52 if name == "wan_step" else 4096 + 512


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--rep-ms", type=float, default=3000.0, help="do_bench's time budget per measurement")
    args = p.parse_args(argv)
    warm_up_gpu()
    env = environment()
    import diffusers

    env["diffusers"] = diffusers.__version__
    path = results_path(args.out, "diffusers-e2e", env)
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            rows = json.load(f)["rows"]
    for name in args.cases.split(","):  # written after each case: a later one may run out of time
        rows = [r for r in rows if r["case"] != name] + run_case(name, args.rep_ms)
        write_results(args.out, "diffusers-e2e", env, rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
