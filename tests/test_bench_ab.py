"""bench/tools/ab.py on CPU: its arguments, cases, interleaving and results JSON,
and its refusal without a GPU (the timing itself needs one)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.tools import ab  # noqa: E402
from cases import BY_NAME  # noqa: E402


def test_ab_refuses_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device here"):
        ab.main(["--ref", "main", "--ops", "rmsnorm"])


def test_ab_arguments_and_cases():
    args = ab.parse_args(["--ops", "rmsnorm,attention,quantize_fp8_rows", "--rounds", "3"])
    assert args.ref == "main" and args.kinds == ["fwd_graph", "fwdbwd_graph"] and args.shapes == []
    cases = ab.plan_cases(BY_NAME, args.ops, args.shapes, args.kinds)
    first = tuple(BY_NAME["rmsnorm"].bench_shapes[0])
    assert cases == [
        ("rmsnorm", first, "fwd_graph"),
        ("rmsnorm", first, "fwdbwd_graph"),
        ("attention", ab.DEFAULT_SHAPE, "fwd_graph"),
        ("attention", ab.DEFAULT_SHAPE, "fwdbwd_graph"),
        ("quantize_fp8_rows", tuple(BY_NAME["quantize_fp8_rows"].bench_shapes[0]), "fwd_graph"),
    ]
    shaped = ab.parse_args(["--ops", "rmsnorm", "--shapes", "1x64x128,2x8x256", "--kinds", "fwd"])
    assert ab.plan_cases(BY_NAME, shaped.ops, shaped.shapes, shaped.kinds) == [
        ("rmsnorm", (1, 64, 128), "fwd"),
        ("rmsnorm", (2, 8, 256), "fwd"),
    ]
    with pytest.raises(SystemExit, match="not a registry op"):
        ab.plan_cases(BY_NAME, ["norm_backward"], [], ["fwd"])
    with pytest.raises(SystemExit):
        ab.parse_args(["--ops", "rmsnorm", "--kinds", "bwd"])
    assert {ab.round_order(0, 0), ab.round_order(1, 0)} == {("ref", "tree"), ("tree", "ref")}
    assert ab.round_order(0, 1) == ab.round_order(1, 0)


def test_ab_workers_read_each_sides_op_table(tmp_path):
    """A side with ``cases/`` reads its table there; a ref without it, from ``compile_ops/registry.py``."""
    (tmp_path / "tree" / "cases").mkdir(parents=True)
    (tmp_path / "tree" / "cases" / "__init__.py").write_text("")
    (tmp_path / "ref" / "compile_ops").mkdir(parents=True)
    (tmp_path / "ref" / "compile_ops" / "registry.py").write_text("")
    assert ab.op_table_module(str(tmp_path / "tree")) == "cases"
    assert ab.op_table_module(str(tmp_path / "ref")) == "compile_ops.registry"
    assert ab.op_table_module(ab.ROOT) == "cases"


def test_ab_results_hold_both_sides_the_ratio_and_the_spread():
    cases = [("rmsnorm", (2, 4096, 3072), "fwd_graph"), ("attention", (1, 4608, 3072), "fwd_graph")]
    times = {"ref": {0: [0.10, 0.12, 0.11], 1: [2.0, 2.0, 2.0]}, "tree": {0: [0.05, 0.06, 0.055]}}
    errors = {"ref": {}, "tree": {1: "RuntimeError: boom"}}
    env = {"gpu": "NVIDIA H100 80GB HBM3", "sms": 132, "torch": "2.11.0", "triton": "3.6.0", "cuda": "12.8"}
    commits = {"ref": {"name": "main", "commit": "a" * 40}, "tree": {"commit": "b" * 40, "dirty": True}}
    data = ab.assemble(cases, times, errors, env, commits, {"rounds": 3})
    assert data["machine"] == "NVIDIA H100 80GB HBM3 (132 SMs) | torch 2.11.0 | triton 3.6.0 | CUDA 12.8"
    first, second = data["rows"]
    assert first["ref_ms"] == 0.11 and first["tree_ms"] == 0.055 and first["speedup"] == pytest.approx(2.0)
    assert first["ref_spread"] == pytest.approx(0.02 / 0.11) and first["tree_runs"] == [0.05, 0.06, 0.055]
    assert second["tree_error"] == "RuntimeError: boom" and "speedup" not in second
    table = "\n".join(ab.format_rows(data))
    assert "2.000x" in table and "failed" in table and "with changes" in table
    assert ab.default_out("origin/main", "NVIDIA H100 80GB HBM3").endswith("bench/results/ab-origin-main-h100.json")
