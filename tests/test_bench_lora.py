"""bench/runners/diffusers_e2e.py end to end on a tiny Flux (on the CPU here:
Dynamo with the eager backend, wall-clock times): the default run's rows, and
``--lora``'s (bench/runners/diffusers_lora.py): the rows it writes, the
hotswap compiling nothing, and the size of its random LoRAs."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

from bench.runners import diffusers_e2e, diffusers_lora, diffusers_models, diffusers_timing  # noqa: E402
from bench.toolkit import relative_l2  # noqa: E402


def _keep_settings(monkeypatch):
    """Restore the settings main() sets from its flags once the test ends."""
    for module, names in ((diffusers_timing, ("BACKEND", "REPLAY")), (diffusers_e2e, ("ATTENTION_KERNEL",))):
        for name in names:
            monkeypatch.setattr(module, name, getattr(module, name))


def test_random_lora_moves_each_linear_by_about_its_delta():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 384)
    lora = diffusers_lora.random_lora({"blocks.0.proj": linear}, seed=1)
    a, b = lora["blocks.0.proj.lora_A.weight"], lora["blocks.0.proj.lora_B.weight"]
    assert a.shape == (diffusers_lora.LORA_RANK, 256) and b.shape == (384, diffusers_lora.LORA_RANK)
    assert a.dtype == b.dtype == diffusers_models.DTYPE and a.device.type == "cpu"
    x = torch.randn(64, 256)
    base = x @ linear.weight.T
    moved = relative_l2(base + x @ a.float().T @ b.float().T, base)
    assert 0.5 * diffusers_lora.LORA_DELTA < moved < 2 * diffusers_lora.LORA_DELTA, moved


def test_default_run_writes_native_and_patched_rows_on_the_cpu(tmp_path, monkeypatch):
    """A CPU smoke run measures no peak memory; the progress line says so instead of failing."""
    _keep_settings(monkeypatch)
    argv = ["--cases", "flux_step_tiny", "--compile", "regional", "--backend", "eager", "--repeats", "2"]
    assert diffusers_e2e.main([*argv, "--rep-ms", "10", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("diffusers-e2e-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [row["provider"] for row in rows] == ["native_eager", "native_compiled", "patched_eager", "patched_compiled"]
    assert all(row["peak_MiB"] is None and row["ms"] > 0 for row in rows)
    # A second run into the same folder merges its rows; each row keeps the command that made it.
    again = [*argv, "--rep-ms", "5", "--providers", "native_eager", "--out", str(tmp_path)]
    assert diffusers_e2e.main(again) == 0
    merged = json.loads(path.read_text())
    commands = {row["provider"]: row["command"] for row in merged["rows"]}
    assert commands["native_eager"].endswith(" ".join(again)) and merged["env"]["command"] == commands["native_eager"]
    assert commands["patched_compiled"].endswith(f"--rep-ms 10 --out {tmp_path}"), commands


def test_lora_case_runs_end_to_end_on_a_tiny_flux_and_hotswaps_without_compiling(tmp_path, monkeypatch):
    _keep_settings(monkeypatch)
    argv = ["--lora", "--cases", "flux_step_tiny", "--compile", "regional", "--backend", "eager"]
    assert diffusers_e2e.main([*argv, "--repeats", "2", "--rep-ms", "10", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("diffusers-e2e-lora-*.json")
    results = json.loads(path.read_text())
    assert "--lora" in results["env"]["command"]
    rows = {row["provider"]: row for row in results["rows"]}
    assert list(rows) == [
        "native_compiled",
        "native_lora_compiled",
        "native_lora_swapped_compiled",
        "native_lora_fused_compiled",
        "native_lora_fused_swapped_compiled",
        "fp8_compiled",
        "fp8_lora_compiled",
        "fp8_lora_swapped_compiled",
        "fp8_lora_fused_compiled",
        "fp8_lora_fused_swapped_compiled",
    ]
    for row in rows.values():
        assert row["case"] == "flux_step_tiny" and row["compile"] == "regional"
        assert len(row["ms_runs"]) == 2 and row["ms_min"] <= row["ms"] <= row["ms_max"]
    for kind in ("native", "fp8"):
        lora, swapped = rows[f"{kind}_lora_compiled"], rows[f"{kind}_lora_swapped_compiled"]
        # Every attention and MLP Linear of the blocks: 12 in the double block, 5 in the single one.
        assert lora["lora_rank"] == 64 and lora["lora_linears"] == 17
        assert lora["lora_moves_output"] > 1e-3 and swapped["swap_moves_output"] > 1e-3
        assert swapped["graphs_compiled_after_swap"] == 0 and 0 < swapped["swap_s"] < 60
        assert "lora_cost" in lora and "lora_cost" in swapped
        # Fused: the merged layers compile once; the fused swap back to the first LoRA compiles nothing.
        fused, fused_swapped = rows[f"{kind}_lora_fused_compiled"], rows[f"{kind}_lora_fused_swapped_compiled"]
        assert fused["graphs_compiled_at_fuse"] > 0 and 0 < fused["fuse_s"] < 60
        assert fused_swapped["graphs_compiled_after_swap"] == 0 and 0 < fused_swapped["swap_s"] < 60
        assert fused_swapped["swap_moves_output"] > 1e-3 and "lora_cost" in fused_swapped
    for state in (
        f"fp8{suffix}_compiled" for suffix in ("", "_lora", "_lora_swapped", "_lora_fused", "_lora_fused_swapped")
    ):
        # FP8 against the native step in the same state: the quantization's error, not a lost adapter's.
        assert 1e-4 < rows[state]["rel_l2_vs_bf16"] < 5e-2, rows[state]
    assert "rel_l2_vs_bf16" not in rows["native_lora_compiled"]
    # The fused FP8 LoRA back on the first adapter: its rows are the first LoRA's, one rounding away.
    assert rows["fp8_lora_fused_swapped_compiled"]["rel_l2_vs_bf16"] < 2 * rows["fp8_lora_compiled"]["rel_l2_vs_bf16"]


def test_lora_case_takes_one_inductor_mode_and_labels_its_rows(tmp_path, monkeypatch):
    """``--lora --inductor-modes reduce-overhead``: every row's ``compile`` names the mode and
    counts the graphs run without CUDA graphs; two modes at once are refused."""
    _keep_settings(monkeypatch)
    argv = ["--lora", "--cases", "flux_step_tiny", "--compile", "regional", "--backend", "eager"]
    with pytest.raises(SystemExit):
        diffusers_e2e.main([*argv, "--inductor-modes", "default,reduce-overhead", "--out", str(tmp_path)])
    argv += ["--inductor-modes", "reduce-overhead", "--providers", "native_compiled", "--repeats", "1"]
    assert diffusers_e2e.main([*argv, "--rep-ms", "10", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("diffusers-e2e-lora-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [row["provider"] for row in rows] == [
        "native_compiled",
        "native_lora_compiled",
        "native_lora_swapped_compiled",
        "native_lora_fused_compiled",
        "native_lora_fused_swapped_compiled",
    ]
    assert all(row["compile"] == "regional+reduce-overhead" and "cudagraph_skips" in row for row in rows)


def test_fp8_providers_compile_in_the_inductor_mode_asked_for(monkeypatch):
    """``--fp8 --inductor-modes reduce-overhead`` (CUDA graphs for the FP8 step): the FP8
    providers compile in that mode, and their rows say so and count the graphs run
    without CUDA graphs, as the bf16 providers' rows do."""
    _keep_settings(monkeypatch)
    diffusers_timing.BACKEND = "eager"
    rows = diffusers_e2e.run_case(
        "flux_step_tiny", 10, 1, True, {"fp8_compiled"}, "regional", False, inductor_mode="reduce-overhead"
    )
    (row,) = [r for r in rows if r["provider"] == "fp8_compiled"]
    assert row["compile"] == "regional+reduce-overhead" and row["cudagraph_skips"] == 0
    assert row["rel_l2_vs_bf16"] < 5e-2


def test_the_fused_qkv_provider_fuses_diffusers_projections_before_patching(monkeypatch):
    """``fp8_fused_qkv_compiled`` calls diffusers' ``fuse_qkv_projections()`` on its
    model (and only it), then patches it in FP8: its step error stays that of
    ``fp8_compiled``, whose Linears it quantizes the same way."""
    _keep_settings(monkeypatch)
    diffusers_timing.BACKEND = "eager"
    fused = []
    real = diffusers.FluxTransformer2DModel.fuse_qkv_projections
    monkeypatch.setattr(
        diffusers.FluxTransformer2DModel, "fuse_qkv_projections", lambda model: fused.append(1) or real(model)
    )
    rows = diffusers_e2e.run_case(
        "flux_step_tiny", 10, 1, True, {"fp8_compiled", "fp8_fused_qkv_compiled"}, "regional", False
    )
    by_provider = {r["provider"]: r for r in rows if "rel_l2_vs_bf16" in r}
    assert fused == [1]
    plain, fused_qkv = (by_provider[p]["rel_l2_vs_bf16"] for p in ("fp8_compiled", "fp8_fused_qkv_compiled"))
    assert fused_qkv < 1.5 * plain, (fused_qkv, plain)
