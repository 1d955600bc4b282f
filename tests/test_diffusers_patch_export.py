"""Shipping a patched diffusers model: torch.export, AOTInductor, CUDA graphs.

A patched tiny Flux exported with a dynamic image sequence (the fused ops stay
ops in the graph), a block as an AOTInductor package run from C++, a saved
ExportedProgram loaded and run in a fresh process; and, on a GPU, each model
under the ``torch.compile`` modes that capture CUDA graphs, with no skipped
capture and the default mode's outputs.
"""

import os
import shutil

import pytest
import torch
from conftest import HAS_CUDA
from diffusers_helpers import MODELS, _flux, _to
from patch_checks import DEVICE, TOL

import compile_ops

pytest.importorskip("diffusers")


# ---------------------------------------------------------------- export and AOTInductor (issue 20)


def _flux_block_inputs(model, side):
    """Inputs of the first double block of a patched tiny Flux at ``side x side`` image tokens."""
    args = _to(_flux()[1](side), DEVICE)
    with torch.no_grad():
        hidden = model.x_embedder(args["hidden_states"])
        text = model.context_embedder(args["encoder_hidden_states"])
        temb = model.time_text_embed(args["timestep"] * 1000, args["pooled_projections"])
        rope = model.pos_embed(torch.cat([args["txt_ids"], args["img_ids"]]))
    return dict(hidden_states=hidden, encoder_hidden_states=text, temb=temb, image_rotary_emb=rope)


def _fused_targets(graph_module) -> set:
    return {
        str(n.target)
        for n in graph_module.graph.nodes
        if n.op == "call_function" and str(n.target).startswith("fused.")
    }


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler")
def test_patched_flux_exports_with_a_dynamic_sequence_and_a_block_runs_as_an_aoti_package(tmp_path):
    """torch.export of a whole patched tiny Flux with a dynamic image sequence
    (the fused ops stay ops in the graph) matches eager at two lengths; one
    patched double block goes through AOTInductor (on a GPU: its fused ops as
    Triton kernels in the package), and the package matches eager at lengths
    it was not exported at, run from C++ (``bench/runners/aoti_runner.cpp``, no Python
    in the process) and, on the CPU, loaded in Python. Not in Python on a GPU:
    on the benchmark's machine torch 2.11's loader crashes the process for
    every package (docs/notes/aoti.md)."""
    from bench.runners.aoti import build_runner, flat_inputs, run_package

    torch.manual_seed(0)
    model, inputs = _flux()
    model = model.to(DEVICE).eval()
    compile_ops.patch(model)
    seq = torch.export.Dim("seq", min=4, max=256)
    args = _to(inputs(4), DEVICE)
    dynamic = {name: None for name in args}
    dynamic["hidden_states"], dynamic["img_ids"] = {1: seq}, {0: seq}
    exported = torch.export.export(model, (), args, dynamic_shapes=dynamic)
    assert {"fused.qk_norm_rope.default", "fused.gated_residual_norm_modulate.default"} <= _fused_targets(
        exported.graph_module
    ), _fused_targets(exported.graph_module)
    for side in (4, 6):
        args = _to(inputs(side), DEVICE)
        with torch.no_grad():
            torch.testing.assert_close(exported.module()(**args).sample, model(**args).sample, **TOL)

    block = model.transformer_blocks[0]
    kwargs = _flux_block_inputs(model, 4)
    rope_len = seq + 8  # 8 text tokens, then the image's
    exported = torch.export.export(
        block,
        (),
        kwargs,
        dynamic_shapes=dict(
            hidden_states={1: seq},
            encoder_hidden_states=None,
            temb=None,
            image_rotary_emb=({0: rope_len}, {0: rope_len}),
        ),
    )
    # aoti_compile_and_package writes into inductor's config dict aot_inductor.metadata in place: a dict of
    # its own for this compile keeps the process's config as it was.
    with torch._inductor.config.patch({"aot_inductor.metadata": {}}):
        package = torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "flux_block.pt2"))
    loaded = None if HAS_CUDA else torch._inductor.aoti_load_package(package)
    runner = build_runner(str(tmp_path))
    for side in (5, 7):
        kwargs = _flux_block_inputs(model, side)
        with torch.no_grad():
            want = block(**kwargs)
            from_cpp, _ = run_package(runner, package, flat_inputs(exported, kwargs), DEVICE, repeats=0)
            got = [] if loaded is None else loaded(**kwargs)
        assert len(from_cpp) == len(want)
        for g, w in zip([*from_cpp, *got], [*want, *want]):
            torch.testing.assert_close(g.to(w.device), w, **TOL)


_LOAD_AND_RUN = """
import sys, torch
import compile_ops  # registers the fused ops the saved graph calls
program = torch.export.load(sys.argv[1])
io = torch.load(sys.argv[2])
with torch.no_grad():
    (got,) = program.module()(**io["args"])
    (compiled,) = torch.compile(program.module(), fullgraph=True, backend=sys.argv[4])(**io["args"])
torch.save({"got": got, "compiled": compiled}, sys.argv[3])
"""


def test_patched_flux_ships_as_a_saved_exported_program_that_a_fresh_process_runs(tmp_path):
    """``torch.export.save`` of a whole patched tiny Flux with a dynamic image
    sequence, and ``torch.export.load`` in a fresh process that imports
    compile_ops (the fused ops are ops in the file; their kernels come from the
    installed package): the loaded program, eager and under
    ``torch.compile(fullgraph=True)``, matches the model at a length it was not
    exported at. A shipping path with Python; without it, an AOTInductor
    package run from C++ (the test above, bench/runners/aoti.py)."""
    import subprocess
    import sys

    torch.manual_seed(0)
    model, inputs = _flux()
    model = model.to(DEVICE).eval()
    compile_ops.patch(model)
    seq = torch.export.Dim("seq", min=4, max=256)
    # A tuple out (return_dict=False): a saved program's output structure must
    # be one that pytree can load without diffusers' output class registered.
    args = dict(_to(inputs(4), DEVICE), return_dict=False)
    dynamic = {name: None for name in args}
    dynamic["hidden_states"], dynamic["img_ids"] = {1: seq}, {0: seq}
    torch.export.save(torch.export.export(model, (), args, dynamic_shapes=dynamic), tmp_path / "flux.pt2")
    args = dict(_to(inputs(6), DEVICE), return_dict=False)
    with torch.no_grad():
        (want,) = model(**args)
    torch.save({"args": args}, tmp_path / "io.pt")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            _LOAD_AND_RUN,
            str(tmp_path / "flux.pt2"),
            str(tmp_path / "io.pt"),
            str(tmp_path / "out.pt"),
            "inductor" if HAS_CUDA else "aot_eager",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    out = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(out["got"], want, **TOL)
    torch.testing.assert_close(out["compiled"], want, **TOL)


# ---------------------------------------------------------------- CUDA graphs (torch.compile modes)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flux", "wan", "sd3", "ltx"])
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"])
def test_patched_model_under_cuda_graphs_has_no_skip_and_matches_the_default_mode(name, mode):
    """``torch.compile(mode=...)`` of a patched model, for each way people
    compile one: captured whole in CUDA graphs where the mode uses them (no
    "skipping cudagraphs" from any op: a host sync, a CPU tensor or a
    data-dependent allocation would cause one), with no graph break
    (fullgraph), and equal to the default mode's output. max-autotune picks
    other kernels for the layers we leave to Inductor (on the H100, Wan's
    output moved by 5e-4 with them), so there the patched model may move by
    at most twice what the unpatched model moves between the same two modes."""
    from torch._dynamo.utils import counters

    def default_and_mode(patch):
        torch.manual_seed(0)
        model, inputs = MODELS[name]()
        model = model.to("cuda").eval()
        if patch:
            compile_ops.patch(model)
        args = _to(inputs(4), "cuda")
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            want = torch.compile(model, fullgraph=True)(**args).sample
            graphed = torch.compile(model, mode=mode, fullgraph=True)
            for _ in range(3):  # warm-up, record, replay
                got = graphed(**args).sample.clone()
        torch._dynamo.reset()
        assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
        return got, want

    got, want = default_and_mode(patch=True)
    tolerance = 1e-5
    if mode != "reduce-overhead":  # same kernels in both for reduce-overhead: no allowance
        native_got, native_want = default_and_mode(patch=False)
        tolerance = max(1e-4, 2 * (native_got - native_want).abs().max().item())
    print(f"{name} {mode}: patched moved {(got - want).abs().max().item():.1e}, allowed {tolerance:.1e}")
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
