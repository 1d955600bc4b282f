"""A patched diffusers model shipped as an AOTInductor package, run from C++.

    PYTHONPATH=. python bench/runners/aoti.py [--layers 19,38] [--repeats 3] [--out bench/results]

The steps a user takes to ship a patched model, timed against the same model
compiled in Python:

1. build Flux.1-dev's transformer (full size by default, random weights, bf16,
   on the GPU) and ``compile_ops.patch`` it;
2. ``torch.export.export`` it with a dynamic image sequence (``Dim``), the
   fused ops staying ops in the graph;
3. ``torch._inductor.aoti_compile_and_package``: one ``.pt2`` holding the
   wrapper, the weights and the fused ops' Triton kernels as cubins;
4. run the package from C++ (``bench/runners/aoti_runner.cpp``, built here with the
   installed torch's headers and libraries) at 1024x1024 (4096 image tokens)
   and at 768x768 (2304, a length it was not exported at), against the eager
   patched model's output, and time it: ``--repeats`` rounds of 10 calls;
5. time the patched model under ``torch.compile`` (block by block, as
   ``bench/runners/diffusers_e2e.py --compile regional``) in the same run.

Why C++: on the benchmark's GPU machine (torch 2.11) the Python loader,
``torch._inductor.aoti_load_package``, crashes or hangs for every package,
plain-PyTorch and CPU packages included, while the same packages load and run
in a C++ process (``docs/notes/aoti.md``). A C++ process is also how a package is
deployed without Python. Writes ``aoti-<gpu>.json``.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
sys.path.insert(0, ROOT)

from bench.toolkit import log, relative_l2, write_results  # noqa: E402

RUNNER_SOURCE = os.path.join(ROOT, "bench", "runners", "aoti_runner.cpp")


def build_runner(dest_dir: str) -> str:
    """Compile ``bench/runners/aoti_runner.cpp`` against the installed torch (``$CXX``
    or g++; CUDA libraries linked when torch has them). Returns its path."""
    torch_dir = os.path.dirname(torch.__file__)
    lib = os.path.join(torch_dir, "lib")
    libs = ["torch", "torch_cpu", "c10"] + [
        name for name in ("torch_cuda", "c10_cuda") if os.path.exists(os.path.join(lib, f"lib{name}.so"))
    ]
    runner = os.path.join(dest_dir, "aoti_runner")
    cmd = [
        os.environ.get("CXX", "g++"),
        "-std=c++20",
        "-O1",
        RUNNER_SOURCE,
        "-I" + os.path.join(torch_dir, "include"),
        "-I" + os.path.join(torch_dir, "include", "torch", "csrc", "api", "include"),
        "-L" + lib,
        "-Wl,--no-as-needed",
        *("-l" + name for name in libs),
        "-Wl,-rpath," + lib,
        "-o",
        runner,
    ]
    subprocess.run(cmd, check=True)
    return runner


def flat_inputs(exported, kwargs: dict) -> list:
    """The package's inputs for a call with ``kwargs``: its tensors in the
    order of the exported program's input spec (what AOTInductor's loaders pass)."""
    from torch.export._tree_utils import reorder_kwargs
    from torch.utils import _pytree as pytree

    flat = pytree.tree_flatten(((), reorder_kwargs(kwargs, exported.call_spec.in_spec)))[0]
    return [x for x in flat if isinstance(x, torch.Tensor)]


def run_package(
    runner: str, package: str, inputs: list, device: str, repeats: int, calls: int = 10, timeout: float = 600
) -> tuple:
    """Run ``package`` in a C++ process on ``inputs``: (its outputs, its JSON
    line: load_s, first_call_ms, ms_runs)."""
    with tempfile.TemporaryDirectory() as tmp:
        inputs_path, outputs_path = os.path.join(tmp, "inputs.pt"), os.path.join(tmp, "outputs.pt")
        torch.save([t.detach().cpu() for t in inputs], inputs_path)
        done = subprocess.run(
            [runner, package, inputs_path, outputs_path, device, str(repeats), str(calls)],
            check=True,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        timing = json.loads(done.stdout.strip().splitlines()[-1])
        return list(torch.load(outputs_path)), timing


def _flux_inputs(side: int, device: str, dtype: torch.dtype) -> dict:
    """One Flux step's inputs at ``side`` x ``side`` latent tokens (1024 px: 64), 512 text tokens."""
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()
    text = 512
    inputs = dict(
        hidden_states=torch.randn(1, side * side, 64),
        encoder_hidden_states=torch.randn(1, text, 4096),
        pooled_projections=torch.randn(1, 768),
        timestep=torch.tensor([0.5]),
        guidance=torch.tensor([3.5]),
        img_ids=img_ids,
        txt_ids=torch.zeros(text, 3),
    )
    return {k: v.to(device, dtype if v.is_floating_point() and "ids" not in k else v.dtype) for k, v in inputs.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--layers", default="19,38", help="double,single blocks (Flux.1-dev: 19,38)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default=None, help="folder for the package and the runner (default: a temp dir)")
    p.add_argument("--skip-compiled", action="store_true", help="time the package alone")
    p.add_argument(
        "--drop-inductor-cache",
        action="store_true",
        help="delete Inductor's cache folder once the package is written (a full-size Flux package "
        "is 24 GB, and the C++ loader extracts another copy: a 64 GB disk holds two)",
    )
    args = p.parse_args(argv)

    import compile_ops
    from bench.runners import diffusers_timing
    from bench.runners.diffusers_models import flux

    on_gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)  # CPU: a check of the steps
    env = diffusers_timing.diffusers_environment() if on_gpu else {"gpu": "cpu", "torch": torch.__version__}
    double, single = (int(n) for n in args.layers.split(","))
    work = args.work or tempfile.mkdtemp(prefix="aoti-")
    os.makedirs(work, exist_ok=True)
    row = {"case": "flux_step", "layers": [double, single], "tokens": {"1024px": 4096 + 512, "768px": 2304 + 512}}

    def save():
        log(json.dumps(row))
        write_results(args.out, "aoti", env, [row])

    started = time.perf_counter()
    runner = build_runner(work)
    torch.manual_seed(0)
    with torch.device(device):
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = flux(double, single)[0].eval().requires_grad_(False)
        finally:
            torch.set_default_dtype(default)
    row["patch"] = str(compile_ops.patch(model)).splitlines()[0]
    sides = {"1024px": 64, "768px": 48}
    inputs = {name: _flux_inputs(side, device, dtype) for name, side in sides.items()}
    with torch.no_grad():
        eager = {name: model(**kw).sample for name, kw in inputs.items()}
    row["build_s"] = time.perf_counter() - started

    start = time.perf_counter()
    seq = torch.export.Dim("seq", min=256, max=16384)
    dynamic = {name: None for name in inputs["1024px"]}
    dynamic["hidden_states"], dynamic["img_ids"] = {1: seq}, {0: seq}
    with torch.no_grad():
        exported = torch.export.export(model, (), inputs["1024px"], dynamic_shapes=dynamic)
    row["fused_ops_in_graph"] = sorted(
        {str(n.target) for n in exported.graph.nodes if str(n.target).startswith("fused.")}
    )
    row["export_s"] = time.perf_counter() - start
    flat = {name: flat_inputs(exported, kw) for name, kw in inputs.items()}
    save()

    start = time.perf_counter()
    package = torch._inductor.aoti_compile_and_package(exported, package_path=os.path.join(work, "flux.pt2"))
    row["package_s"] = time.perf_counter() - start
    row["package_GB"] = os.path.getsize(package) / 1e9
    del exported
    if args.drop_inductor_cache:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        shutil.rmtree(cache_dir(), ignore_errors=True)
    save()

    for name in inputs:
        outs, timing = run_package(runner, package, flat[name], device, args.repeats if name == "1024px" else 0)
        row[f"aoti_{name}"] = dict(timing, rel_l2_vs_eager=relative_l2(outs[0].to(device), eager[name]))
        save()
    runs = sorted(row["aoti_1024px"]["ms_runs"])
    row["aoti_ms"], row["aoti_ms_min"], row["aoti_ms_max"] = runs[len(runs) // 2], runs[0], runs[-1]

    if on_gpu and not args.skip_compiled:
        start = time.perf_counter()
        compiled = diffusers_timing.compiled(model, "regional")
        kw = inputs["1024px"]
        with torch.no_grad():
            got = compiled(**kw).sample
            row["compiled_first_call_s"] = time.perf_counter() - start
            row["compiled_rel_l2_vs_eager"] = relative_l2(got, eager["1024px"])
            row["compiled"] = diffusers_timing.repeated(lambda: compiled(**kw), 2000, args.repeats)
        row["aoti_vs_compiled"] = row["compiled"]["ms"] / row["aoti_ms"]
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
