"""bench/ on CPU: the progress accounting, the first run's plan, stages and summary,
run.py's dispatch, and the HunyuanVideo case of the diffusers runners (its builder, and
the context-parallel runner's refusal of native HunyuanVideo under a parallel layout),
without a GPU (tests/test_bench_ab.py: the A/B runner)."""

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import run as bench_run  # noqa: E402
from bench import toolkit  # noqa: E402
from bench.runners import first_run, ops  # noqa: E402
from cases import BY_NAME  # noqa: E402

# ---------------------------------------------------------------- toolkit


def test_progress_shows_tenths_off_a_terminal_and_ends_at_its_total(capsys):
    screen = io.StringIO()
    progress = toolkit.Progress(40, screen)
    for i in range(35):
        progress(f"measurement {i}")
    progress.skip(5, "inputs failed")
    assert progress.done == progress.total == 40
    shown = screen.getvalue().splitlines()
    assert [line.split("]")[0] for line in shown] == [f"[{n:>2}/40" for n in range(4, 33, 4)] + ["[40/40"]
    assert shown[-1] == "[40/40] skipped 5: inputs failed"
    assert len(capsys.readouterr().out.splitlines()) == 36  # the log has every step


def test_progress_shows_every_step_of_a_short_run():
    screen = io.StringIO()
    progress = toolkit.Progress(3, screen)
    for name in "abc":
        progress(name)
    assert screen.getvalue().splitlines() == ["[1/3] a", "[2/3] b", "[3/3] c"]


def test_output_to_sends_prints_and_children_to_the_log_and_keeps_the_screen(tmp_path, capfd):
    log_path = tmp_path / "run.log"
    with toolkit.output_to(str(log_path)) as screen:
        print("a measurement line", flush=True)
        subprocess.run([sys.executable, "-c", "print('from a child')"], check=True)
        screen.write("the progress\n")
    print("after", flush=True)
    out = capfd.readouterr().out
    assert "the progress" in out and "after" in out and "measurement" not in out
    assert log_path.read_text().splitlines() == ["a measurement line", "from a child"]


def test_experiments_parse_their_common_arguments_and_warm_the_gpu_before_timing(monkeypatch):
    """``experiment_parser``: ``out``, the named string options with their
    defaults (underscores as dashes), ``--rounds`` as an int; ``start_experiment``
    parses, then warms the GPU up once, and hands back the timer it made."""
    calls = []
    monkeypatch.setattr(toolkit, "warm_up_gpu", lambda: calls.append("warm"))
    monkeypatch.setattr(toolkit, "make_timer", lambda quick: calls.append(("timer", quick)) or "a timer")
    parser = toolkit.experiment_parser("What it measures.\n\nMore.", shapes="1x2", key_lengths="7")
    assert parser.description == "What it measures."
    args, timer = toolkit.start_experiment(parser, ["rows.json", "--key-lengths", "9", "--rounds", "5"])
    assert (args.out, args.shapes, args.key_lengths, args.rounds) == ("rows.json", "1x2", "9", 5)
    assert timer == "a timer" and calls == [("timer", False), "warm"]
    with pytest.raises(SystemExit):
        toolkit.start_experiment(toolkit.experiment_parser("Doc."), ["--rounds", "2"])  # out is required


def test_gemm_round_rows_give_each_time_its_rate(monkeypatch):
    """``gemm_round_rows``: a row per provider and round, with the fields given,
    the time and ``flops / time`` in TFLOP/s."""
    timed = lambda providers, args, rounds, timer: ((r, n, 2.0 + r) for r in range(rounds) for n in providers)  # noqa: E731
    monkeypatch.setattr(toolkit, "replay_rounds", timed)
    rows = toolkit.gemm_round_rows({"a": None, "b": None}, 6e9, 2, "a timer", case="c", K=3)
    assert [(r["provider"], r["round"]) for r in rows] == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    assert rows[0] == dict(case="c", K=3, provider="a", round=0, ms=2.0, TFLOPs=pytest.approx(3.0))
    assert rows[3]["TFLOPs"] == pytest.approx(2.0)


def test_every_kernel_of_the_package_has_a_profile_family_of_its_own():
    """A step's profile credits each of our kernels to attention or compile_ops,
    never "other" (where a new kernel's time would go unexplained)."""
    import importlib
    import pkgutil

    import triton

    import compile_ops.kernels

    names = set()
    for module in pkgutil.iter_modules(compile_ops.kernels.__path__):
        for value in vars(importlib.import_module(f"compile_ops.kernels.{module.name}")).values():
            if isinstance(value, triton.runtime.JITFunction) and value.fn.__name__.endswith("_kernel"):
                names.add(value.fn.__name__)
    assert {"attn_fwd_kernel", "kv8_stats_kernel", "quantize_fp8_rows_kernel"} <= names
    families = {name: toolkit.kernel_family(name) for name in sorted(names)}
    assert {name for name, family in families.items() if family not in ("attention", "compile_ops")} == set()
    assert families["kv8_quantize_kernel"] == "compile_ops" and families["attn_fwd_sm90_kernel"] == "attention"
    assert toolkit.kernel_family("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_bias_TNT") == "gemm"
    assert toolkit.kernel_family("triton_poi_fused_cat_split_view_1") == "inductor"


def test_timed_call_runs_the_forward_without_grad_and_the_step_without_leftover_grads():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    forward = toolkit.timed_call(torch.mul, (x, w), "fwd")
    assert not forward().requires_grad
    step = toolkit.timed_call(torch.mul, (x, w), "fwdbwd")
    step()
    assert x.grad is None and w.grad is None
    with pytest.raises(ValueError, match="kind must be one of"):
        toolkit.timed_call(torch.mul, (x, w), "backward")


# ---------------------------------------------------------------- the op table's count


def _fake_measure(fails: set):
    def measure(fn, args, timer, graph=False):
        if fn in fails:
            raise RuntimeError("provider failed")
        return 0.01

    return measure


@pytest.mark.parametrize("name", ["rmsnorm", "quantize_fp8_rows"])
def test_the_op_table_makes_as_many_timings_as_its_progress_total(monkeypatch, name):
    """Every provider is timed once per kind (four kinds; two without a
    backward), failed timings included: the count the progress total uses."""

    def failing(*args):
        return None

    monkeypatch.setattr(ops, "_MEASURES", {k: (_fake_measure({failing}), "graph" in k) for k in toolkit.KINDS})
    spec = BY_NAME[name]
    providers = {"fused_eager": len, "fused_compiled": len, "native_eager": len, "native_compiled": failing}
    plan = [(spec, (1, 16, 256)), (spec, (2, 16, 256))]
    total = ops.measurement_count(plan, {name: len(providers)})
    progress = toolkit.Progress(total)
    for s, shape in plan:
        rows = ops.bench_shape(s, shape, providers, None, 1.0, progress, dtype=torch.float32, device="cpu")
    assert progress.done == total == 2 * len(providers) * (4 if spec.differentiable else 2)
    assert "error" in rows[-1] and all("error" not in r for r in rows[:-1])


# ---------------------------------------------------------------- the first run


def _fake_stages(monkeypatch, failing=()):
    """The first run's stages without a GPU: each makes its planned timings (or fails)."""
    counts = {stage: count for stage, _, count in first_run.plan()}

    def stage(kind):
        def run(data, *args):
            progress = args[-1]
            progress(f"{kind} started")
            if kind in failing:
                raise RuntimeError(f"{kind} broke")
            for _ in range(counts[kind] - 1):
                progress(kind)

        return run

    monkeypatch.setattr(first_run, "_setup", stage("setup"))
    monkeypatch.setattr(first_run, "_e2e", stage("e2e"))
    monkeypatch.setattr(first_run, "_attention", stage("attention"))
    monkeypatch.setattr(first_run, "_family", stage("family"))


def test_first_run_plan_counts_every_timing():
    stages = first_run.plan()
    assert [s for s, *_ in stages][:3] == ["setup", "e2e", "attention"]
    assert sum(count for *_, count in stages) == 1 + 2 + 2 + 2 * len(first_run.FAMILY_OPS)
    for family, op in first_run.FAMILY_OPS:  # each family's op is a registry op with a benchmark shape
        spec = BY_NAME[op]
        assert spec.family == family and spec.bench_shapes and spec.make_inputs is not None


@pytest.mark.parametrize("budget_s, failing", [(1e9, ()), (1e9, ("attention",)), (0.0, ())])
def test_first_run_progress_ends_at_its_total_whatever_runs(monkeypatch, budget_s, failing):
    _fake_stages(monkeypatch, failing)
    screen = io.StringIO()
    data = first_run.measure({}, quick=True, start=time.perf_counter(), budget_s=budget_s, screen=screen)
    total = sum(count for *_, count in first_run.plan())
    last = screen.getvalue().splitlines()[-1]
    assert last.startswith(f"[{total}/{total}]")
    assert [e.split(":")[0] for e in data["errors"]] == list(failing)
    if budget_s == 0.0:  # every stage after the warm-up is past the budget
        assert data["skipped"] == [name for _, name, _ in first_run.plan()[1:]]


def test_first_run_writes_its_json_and_log_and_prints_the_summary(monkeypatch, tmp_path, capfd):
    _fake_stages(monkeypatch)
    results = _results()
    monkeypatch.setattr(first_run, "environment", lambda: results["env"])
    monkeypatch.setattr(first_run, "plot", lambda data, png: None)
    assert first_run.run(str(tmp_path), quick=True, budget_s=1e9) == 0
    out = capfd.readouterr().out
    assert out.splitlines()[0].startswith("compile_ops first run on NVIDIA H100 80GB HBM3 (132 SMs)")
    assert "[17/17] family" in out and "Done in" in out and "plot not drawn" in out
    data = json.loads((tmp_path / "first-run-h100.json").read_text())
    assert data["errors"] == [] and data["skipped"] == [] and data["quick"] is True
    assert "[17/17] family" in (tmp_path / "first-run-h100.log").read_text()


def _results() -> dict:
    """A first run's results as the GPU writes them (figures made up)."""

    def row(op, provider, us, pct=None, kind="fwdbwd_graph"):
        return {"op": op, "shape": [2, 4096, 3072], "provider": provider, f"{kind}_us": us, f"{kind}_pct_copy": pct}

    return {
        "env": {"gpu": "NVIDIA H100 80GB HBM3", "sms": 132, "torch": "2.11.0", "triton": "3.6.0", "cuda": "12.8"},
        "copy_TBps": 3.0,
        "matmul_TFLOPs": 700.0,
        "budget_s": 270.0,
        "wall_s": 201.0,
        "families": [
            {"family": "norm", "op": "rmsnorm", "shape": [2, 4096, 3072], "kind": "fwdbwd_graph"},
            {"family": "fp8", "op": "quantize_fp8_rows", "shape": [2, 4096, 3072], "kind": "fwd_graph"},
            {"family": "glu", "op": "geglu_tanh", "shape": [2, 4096, 3072], "kind": "fwdbwd_graph"},
        ],
        "rows": [
            row("rmsnorm", "fused_compiled", 100.0, 85.0),
            row("rmsnorm", "native_compiled", 200.0, 42.5),
            row("quantize_fp8_rows", "fused_compiled", 50.0, 70.0, "fwd_graph"),
            row("quantize_fp8_rows", "native_compiled", 75.0, 46.7, "fwd_graph"),
            dict(row("geglu_tanh", "fused_compiled", None), error="fwd+bwd/graph: RuntimeError: boom"),
            row("geglu_tanh", "native_compiled", 80.0),
        ],
        "attention": {
            "shape": [1, 24, 4608, 128],
            "rows": [
                {"provider": "fused_compiled", "ms": 2.0, "pct_matmul": 61.0},
                {"provider": "sdpa_compiled", "ms": 2.5},
            ],
        },
        "e2e": {
            "config": dict(first_run.E2E),
            "rel_l2": 2e-3,
            "rows": [{"provider": "compile_ops", "ms": 5.0}, {"provider": "torch_compile", "ms": 5.5}],
        },
        "skipped": ["moe_route"],
        "errors": [],
    }


def test_the_summary_reads_at_a_glance():
    files = {"json": "bench/results/first-run-h100.json", "png": None, "log": "bench/results/first-run-h100.log"}
    lines = first_run.summary_lines(_results(), files)
    text = "\n".join(lines)
    assert len(lines) < 30
    assert "NVIDIA H100 80GB HBM3 (132 SMs) | torch 2.11.0 | triton 3.6.0 | CUDA 12.8" in text
    norm = next(line for line in lines if line.startswith("norm "))
    assert "2x4096x3072" in norm and "fwd+bwd" in norm and "2.00x" in norm and "85% of copy" in norm
    fp8 = next(line for line in lines if line.startswith("fp8 "))
    assert " fwd " in fp8 and "1.50x" in fp8
    assert "failed" in next(line for line in lines if line.startswith("glu "))
    attention = next(line for line in lines if line.startswith("attention "))
    assert "1.25x" in attention and "61% of matmul" in attention
    assert "compile_ops 5.00 ms, plain torch.compile 5.50 ms: 1.10x" in text
    assert "Skipped for the 270 s budget: moe_route" in text
    assert "geglu_tanh fused_compiled: fwd+bwd/graph: RuntimeError: boom" in text
    assert "Results bench/results/first-run-h100.json | plot not drawn" in text
    assert "Done in 201 s" in text and "python bench/run.py --full" in text
    assert first_run.failures(_results()) == ["geglu_tanh fused_compiled: fwd+bwd/graph: RuntimeError: boom"]


def test_the_full_runs_summary_finds_each_familys_op_in_the_op_table():
    rows = _results()["rows"] + [
        {"op": "rmsnorm", "shape": [1, 32768, 1536], "provider": "fused_compiled", "fwdbwd_graph_us": 1.0}
    ]
    found = first_run.families_in(rows)
    assert [(f["op"], f["shape"], f["kind"]) for f in found] == [
        ("rmsnorm", [2, 4096, 3072], "fwdbwd_graph"),
        ("geglu_tanh", [2, 4096, 3072], "fwd_graph"),
        ("quantize_fp8_rows", [2, 4096, 3072], "fwd_graph"),
    ]


# ---------------------------------------------------------------- run.py


def test_run_without_a_gpu_is_the_demo(monkeypatch):
    from bench import demo

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(demo, "main", lambda: 7)
    assert bench_run.main([]) == 7


def test_run_stages():
    first = bench_run.parse_args([])
    assert not first.full and not first.ops and first.budget_s == 270.0
    ops_only = bench_run.parse_args(["--ops", "rmsnorm"])
    assert [m for _, m, _ in bench_run.stages(ops_only, True, 8)] == ["ops"]
    full = bench_run.parse_args(["--full", "--quick", "--out", "/tmp/r"])
    planned = bench_run.stages(full, has_diffusers=False, gpus=1)
    assert [m for _, m, _ in planned] == ["ops", "attention", "attention", "block_sparse", "moe"]
    assert planned[2][2] == ["--out", "/tmp/r", "--quick", "--causal", "--shapes", bench_run.CAUSAL_SHAPES]
    assert [m for _, m, _ in bench_run.stages(full, True, 2)][-2:] == ["diffusers_e2e", "distributed_train"]


# ---------------------------------------------------------------- diffusers cases


def test_the_full_hunyuan_video_case_is_diffusers_default_config_at_720p():
    pytest.importorskip("diffusers")
    import inspect

    from diffusers import HunyuanVideoTransformer3DModel

    from bench.runners import diffusers_models

    defaults = inspect.signature(HunyuanVideoTransformer3DModel.__init__).parameters
    full = diffusers_models.HUNYUAN_VIDEO_SIZES["full"]
    assert {name: defaults[name].default for name in full} == full  # diffusers' defaults: the 13B model
    with torch.device("meta"):
        model, inputs = diffusers_models.hunyuan_video(9, 90, 160)
    assert {k: tuple(v.shape) for k, v in inputs.items()} == {
        "hidden_states": (1, 16, 9, 90, 160),
        "timestep": (1,),
        "encoder_hidden_states": (1, 256, 4096),
        "encoder_attention_mask": (1, 256),
        "pooled_projections": (1, 768),
        "guidance": (1,),
    }
    assert len(model.transformer_blocks) == 20 and len(model.single_transformer_blocks) == 40
    assert "hunyuan_step_720p" in diffusers_models.EXTRA_CASES


def test_the_tiny_hunyuan_video_case_builds_and_steps_on_the_cpu():
    pytest.importorskip("diffusers")
    from bench.runners import diffusers_models

    model, inputs = diffusers_models.build("hunyuan_step_tiny")
    assert type(model).__name__ == "HunyuanVideoTransformer3DModel" and not model.training
    video, text = inputs["hidden_states"], inputs["encoder_hidden_states"]
    assert video.shape == (1, 16, 3, 8, 16) and video.dtype == diffusers_models.DTYPE
    assert inputs["encoder_attention_mask"].tolist() == [[1.0] * 6 + [0.0] * 2]  # the last quarter: padding
    with torch.no_grad():
        out = model(**inputs).sample
        padded = text.clone()
        padded[:, 6:] = torch.randn_like(padded[:, 6:])
        unchanged = model(**dict(inputs, encoder_hidden_states=padded)).sample
    assert out.shape == video.shape and out.dtype == video.dtype and torch.isfinite(out).all()
    assert torch.equal(unchanged, out)  # the padding is masked out of every attention


def test_the_context_parallel_runner_refuses_native_hunyuan_video_under_a_parallel_layout():
    pytest.importorskip("diffusers")
    from bench.runners import context_parallel, diffusers_models

    assert set(context_parallel.CASES) == set(context_parallel.CASE_MODES) == set(context_parallel.MODEL_CLASSES)
    built = {**diffusers_models.CASES, **diffusers_models.EXTRA_CASES}
    assert all(name in built for name in context_parallel.CASES.values())
    assert context_parallel.CASE_MODES["hunyuan_720p"] == context_parallel.MODES
    for layout, _, _ in context_parallel.layouts(4):
        reason = context_parallel.refusal("hunyuan_720p", "native", layout)
        assert "HunyuanVideoTransformer3DModel" in reason and "no context-parallel plan" in reason
        assert "\n" not in reason  # a row keeps a refusal's first line
        for mode in ("patched", "int8_fp8", "sliding_tile"):
            assert context_parallel.refusal("hunyuan_720p", mode, layout) is None
        for case in ("wan_720p", "flux"):  # diffusers ships their plans
            assert context_parallel.refusal(case, "native", layout) is None
    assert context_parallel.refusal("hunyuan_720p", "native", "single") is None


def test_block_sparse_precision_rows_time_the_ordered_call_and_compare_it_in_tile_order():
    """``bench/runners/block_sparse.py --precision ... --ordered`` on the CPU's
    tiny grid: a row per precision and per way of calling it; the calls in
    token order give, put in tile order, what the calls on permuted tensors
    give (the same distance to exact), and each is timed against the exact
    precision called the same way."""
    from bench.runners import block_sparse

    def one_ms(fn):  # a stand-in timer: the call runs, every time is 1 ms
        fn()
        return 1.0

    rows = block_sparse.precision_rows("tiny", ["exact", "int8"], 1, one_ms, "cpu", 1, True)
    by = {row["provider"]: row for row in rows}
    assert list(by) == [
        "fused_sparse_exact",
        "fused_sparse_int8",
        "fused_sparse_exact_ordered",
        "fused_sparse_int8_ordered",
    ]
    assert by["fused_sparse_exact_ordered"]["rel_l2_vs_exact"] == 0.0
    assert by["fused_sparse_int8_ordered"]["rel_l2_vs_exact"] == by["fused_sparse_int8"]["rel_l2_vs_exact"] > 1e-3
    assert [row["token_order"] for row in rows] == [False, False, True, True]
    assert all(row["speedup_vs_exact"] == 1.0 for row in rows)
