"""The fp8 family, part two: FP8Linear, FP8ProjectionActivation and the FP8 GEMM (inference only).

Quantization itself is test_fp8.py's. Tests here check the GEMM's reference
against ``torch._scaled_mm`` on the same operands (on a GPU the module against
it, with each accumulation setting, and under CUDA graphs), the module against
the recipe (``_spec_quantize``, tests/fp8_helpers.py) with its distance to the
exact products reported, non-finite activations and weights kept non-finite as
nn.Linear keeps them, FP8Linear under compile and export, dtype casts and state
dicts, and the entry points' refusal of a gradient, of bad input and of a GPU
without FP8 tensor cores (layer 1); trace fp8_linear's CUDA branch on fake CUDA
tensors (layer 2); and repeat the non-finite checks with the kernel quantizing
(layers 3/4).
"""

import pytest
import torch
import torch._dynamo.testing
from bad_input import bad_input_test
from conftest import KERNEL_DEVICE
from fp8_helpers import _fake_cuda_launches, _same_bytes, _spec_quantize

import compile_ops
from compile_ops import FP8Rows, _library
from compile_ops.ops import fp8 as ops
from compile_ops.reference import fp8 as ref

# ---------------------------------------------------------------- layer 1: the modules and the GEMM


def _non_finite_activations(dtype, device="cpu"):
    """``(x [9, 64], bad [9])``: rows with +inf, -inf, NaN, a whole +inf row, a
    whole -inf row, +inf beside -inf, and NaN beside -inf (``bad``), between
    finite rows."""
    inf, nan = float("inf"), float("nan")
    x = torch.randn(9, 64)
    x[1, 3], x[2, 10], x[3, 5], x[4], x[5], x[6, 1], x[6, 2], x[7, 0], x[7, 9] = (
        inf,
        -inf,
        nan,
        inf,
        -inf,
        inf,
        -inf,
        nan,
        -inf,
    )
    bad = torch.tensor([False, True, True, True, True, True, True, True, False])
    return x.to(device, dtype), bad.to(device)


def _check_non_finite_rows_as_nn_linear(fp8, linear, x, bad):
    """FP8Linear ``fp8`` of ``linear`` on ``x`` whose rows ``bad`` are not
    finite: NaN across those rows, where nn.Linear's rows are +-inf or NaN
    (never a finite output from a non-finite input); the finite rows are the
    bytes they have beside finite rows (the bad ones zeroed)."""
    with torch.no_grad():
        got, want = fp8(x), linear(x)
        clean = fp8(torch.where(bad[:, None], 0.0, x).to(x.dtype))
        by_function = compile_ops.fp8_linear(x, fp8.weight_q, fp8.weight_scale, fp8.bias)
    assert (~torch.isfinite(want[bad])).all(), "nn.Linear: every output of a non-finite row is non-finite"
    assert got[bad].isnan().all(), "FP8Linear: NaN across a non-finite row"
    assert torch.isfinite(got[~bad]).all() and torch.equal(got[~bad], clean[~bad])
    assert torch.equal(by_function.isnan(), got.isnan()) and torch.equal(by_function[~bad], got[~bad])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_keeps_non_finite_activation_rows_non_finite_as_nn_linear_does(dtype):
    linear = _linear(dtype=dtype)
    x, bad = _non_finite_activations(dtype)
    _check_non_finite_rows_as_nn_linear(compile_ops.FP8Linear.from_linear(linear), linear, x, bad)


def _non_finite_weight(linear, case):
    """``linear`` with weight row 5 made non-finite by ``case``; returns the row."""
    inf, nan = float("inf"), float("nan")
    with torch.no_grad():
        if case == "whole +inf row":
            linear.weight[5] = inf
        else:
            linear.weight[5, 7] = {"+inf": inf, "-inf": -inf, "nan": nan}[case]
    return 5


def _check_non_finite_weight_columns(fp8, linear, column, x):
    """The output column of a non-finite weight row is NaN for every token, where
    nn.Linear's is +-inf or NaN; the other columns (and weight rows) keep the
    bytes of the same Linear with that row zeroed."""
    zeroed = torch.nn.Linear(linear.in_features, linear.out_features).to(linear.weight.device, linear.weight.dtype)
    with torch.no_grad():
        zeroed.weight.copy_(linear.weight)
        zeroed.weight[column] = 0.0
        zeroed.bias.copy_(linear.bias)
    clean = compile_ops.FP8Linear.from_linear(zeroed)
    others = torch.arange(linear.out_features, device=x.device) != column
    assert torch.isinf(fp8.weight_scale[column]) or fp8.weight_q[column].float().isnan().any()
    assert _same_bytes(fp8.weight_q[others], clean.weight_q[others])
    assert torch.equal(fp8.weight_scale[others], clean.weight_scale[others])
    with torch.no_grad():
        got, want = fp8(x), linear(x)
        clean_out = clean(x)
    assert (~torch.isfinite(want[:, column])).all() and got[:, column].isnan().all()
    assert torch.isfinite(got[:, others]).all() and torch.equal(got[:, others], clean_out[:, others])


@pytest.mark.parametrize("case", ["+inf", "-inf", "nan", "whole +inf row"])
def test_fp8_linear_keeps_a_non_finite_weight_non_finite_as_nn_linear_does(case):
    linear = _linear()
    column = _non_finite_weight(linear, case)
    x = torch.randn(6, 64)
    x[0, 7] = 0.0  # nn.Linear: 0 * inf = NaN in that token's column
    _check_non_finite_weight_columns(compile_ops.FP8Linear.from_linear(linear), linear, column, x)


@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
def test_fp8_projection_activation_keeps_an_overflow_non_finite(activation):
    """FP8ProjectionActivation (an MLP's first half) hands on NaN rows for rows
    the bf16 MLP makes non-finite; its activation mode follows the same rule on
    an activation that is infinite (``act(+inf) = +inf``)."""
    linear, second = _linear(), _linear(48, 64)
    mlp = torch.nn.Sequential(linear, torch.nn.GELU("tanh") if activation == "gelu_tanh" else torch.nn.SiLU(), second)
    fp8 = compile_ops.FP8ProjectionActivation(compile_ops.FP8Linear.from_linear(linear), activation)
    fp8_second = compile_ops.FP8Linear.from_linear(second)
    x, bad = _non_finite_activations(torch.float32)
    with torch.no_grad():
        got, want = fp8_second(fp8(x)), mlp(x)
    assert (~torch.isfinite(want[bad])).all() and got[bad].isnan().all() and torch.isfinite(got[~bad]).all()
    h = torch.randn(3, 48)
    h[0, 4] = float("inf")
    q, scale = compile_ops.quantize_fp8_rows(h, activation)
    assert torch.isinf(scale[0]) and (q[0].float() * scale[0]).isnan().all() and torch.isfinite(scale[1:]).all()


def test_fp8_linear_reference_matches_scaled_mm_on_the_same_operands():
    """Rowwise scales ([M, 1] and [1, N]): cuBLAS's on a GPU (what FP8Linear
    runs there), torch 2.13's CPU _scaled_mm otherwise (older CPU builds take
    per-tensor scales only)."""
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    qx, sx = compile_ops.quantize_fp8_rows(torch.randn(32, 64, device=device))
    qw, sw = compile_ops.quantize_fp8_rows(torch.randn(48, 64, device=device))
    bias = torch.randn(48, device=device).to(torch.bfloat16)
    got = ref.fp8_linear(qx, sx, qw, sw, bias, torch.bfloat16)
    want = torch._scaled_mm(qx, qw.t(), scale_a=sx[:, None], scale_b=sw[None, :], bias=bias, out_dtype=torch.bfloat16)
    # Both sum exact products in fp32 (in other orders) and round once to bf16:
    # at most one bf16 ulp apart (2**-7 relative at the bottom of a binade).
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("fast_accum", [True, False])
def test_fp8_linear_on_the_gpu_is_scaled_mm_with_its_accumulation_flag(fast_accum):
    """FP8Linear on a GPU: the bytes of torch._scaled_mm on its operands with the
    module's accumulation setting; both settings' distance to the fp32 sum of
    the same products printed (fast accumulation: a few more low bits on long K)."""
    torch.manual_seed(0)
    k, n = 4096, 256  # long K: where the accumulator's precision shows
    linear = torch.nn.Linear(k, n).to("cuda", torch.bfloat16)
    fp8 = compile_ops.FP8Linear.from_linear(linear, fast_accum=fast_accum)
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got = fp8(x)
    qx, sx = compile_ops.quantize_fp8_rows(x)
    want = torch._scaled_mm(
        qx,
        fp8.weight_q.t(),
        scale_a=sx[:, None],
        scale_b=fp8.weight_scale[None, :],
        bias=fp8.bias,
        out_dtype=torch.bfloat16,
        use_fast_accum=fast_accum,
    )
    assert torch.equal(got, want)
    fp32_sum = ref.fp8_linear(qx, sx, fp8.weight_q, fp8.weight_scale, fp8.bias, torch.float32)
    err = ((got.float() - fp32_sum).norm() / fp32_sum.norm()).item()
    print(f"fast_accum={fast_accum}: relative L2 to the fp32 sum of the same products {err:.2e}")
    assert err < 1e-2  # bf16 output rounding (~2e-3) plus the accumulator's; a wrong scale is O(1)


@pytest.mark.gpu
def test_fp8_linear_runs_under_cuda_graphs_without_a_skip():
    """``torch.compile(mode="reduce-overhead")``: the quantize kernel and the
    FP8 GEMM are captured in a CUDA graph (no host sync, no CPU tensor, no
    data-dependent allocation), and the replays give the eager bytes."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fp8 = compile_ops.FP8Linear.from_linear(torch.nn.Linear(256, 512).to("cuda", torch.bfloat16))
    graphed = torch.compile(fp8, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for step in range(4):  # warm-up, record, replays
            x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(graphed(x), fp8(x)), f"call {step}"
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def _linear(k=64, n=48, bias=True, dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Linear(k, n, bias=bias).to(dtype)


@pytest.mark.parametrize("bias", [True, False])
def test_fp8_linear_module_matches_the_recipe_and_reports_its_distance_to_exact(bias):
    linear = _linear(bias=bias)
    fp8 = compile_ops.FP8Linear.from_linear(linear)
    assert not list(fp8.parameters()) and fp8.weight_q.dtype == torch.float8_e4m3fn
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        got, exact = fp8(x), linear(x)
    qx, sx = _spec_quantize(x.reshape(-1, 64))
    qw, sw = _spec_quantize(linear.weight)
    want = (qx.float() * sx[:, None]) @ (qw.float() * sw[:, None]).T + (linear.bias if bias else 0)
    torch.testing.assert_close(got, want.reshape(2, 7, 48), rtol=1e-5, atol=1e-5)
    err = ((got - exact).norm() / exact.norm()).item()
    print(f"FP8Linear vs fp32 linear: relative L2 {err:.2e}")
    # It quantized (not 0), and per-row e4m3 keeps each product within ~2^-4 of
    # exact, errors averaging out over K: a few percent at most, where a wrong
    # scale or rounding (or bf16 passed through unquantized) would not land.
    assert 1e-3 < err < 6e-2
    # A producer's already-quantized rows give the same output (in the Linear's dtype).
    with torch.no_grad():
        from_rows = fp8(compile_ops.quantize_fp8_rows(x))
    assert from_rows.dtype == linear.weight.dtype and torch.equal(from_rows, got)


def test_fp8_linear_compiles_fullgraph_without_recompiling_and_exports():
    fp8 = compile_ops.FP8Linear.from_linear(_linear())
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fp8, backend=counter, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for length in (5, 9):
            x = torch.randn(2, length, 64)
            torch.testing.assert_close(compiled(x), fp8(x), rtol=0, atol=0)
            rows = compile_ops.quantize_fp8_rows(x)  # the already-quantized input traces too
            torch.testing.assert_close(compiled(rows), fp8(rows), rtol=0, atol=0)
    assert counter.frame_count == 2, "one graph per input kind, none per sequence length"
    exported = torch.export.export(fp8, (torch.randn(2, 5, 64),))
    assert any("quantize_fp8_rows" in str(n.target) for n in exported.graph.nodes)
    x = torch.randn(2, 5, 64)
    torch.testing.assert_close(exported.module()(x), fp8(x), rtol=0, atol=0)
    rows = compile_ops.quantize_fp8_rows(x)
    exported = torch.export.export(fp8, (rows,))
    torch.testing.assert_close(exported.module()(rows), fp8(rows), rtol=0, atol=0)


def test_module_dtype_casts_keep_the_quantized_weight():
    """``.to(dtype)`` (a diffusers pipeline's) would widen a float8 buffer and round fp32 scales."""
    fp8 = compile_ops.FP8Linear.from_linear(_linear())
    q, scale = fp8.weight_q.clone(), fp8.weight_scale.clone()
    fp8 = fp8.to(torch.bfloat16)
    assert fp8.weight_q.dtype == torch.float8_e4m3fn and _same_bytes(fp8.weight_q, q)
    assert fp8.weight_scale.dtype == torch.float32 and torch.equal(fp8.weight_scale, scale)
    assert fp8.bias.dtype == torch.bfloat16
    assert "fp8 e4m3 rowwise" in repr(fp8) and "in_features=64, out_features=48" in repr(fp8)
    state = fp8.state_dict()
    assert not list(fp8.parameters()) and set(state) == {"weight_q", "weight_scale", "bias"}
    loaded = compile_ops.FP8Linear(64, 48, dtype=torch.bfloat16)
    loaded.load_state_dict(state)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(loaded(x), fp8(x))


def test_fp8_paths_refuse_a_gradient():
    """Public entry points refuse at the call; the raw op's backward refuses too."""
    fp8 = compile_ops.FP8Linear.from_linear(_linear())
    x = torch.randn(3, 64, requires_grad=True)
    for call in (
        lambda: fp8(x),
        lambda: compile_ops.quantize_fp8_rows(x),
        lambda: compile_ops.fp8_linear(x, fp8.weight_q, fp8.weight_scale),
        lambda: torch.compile(fp8, backend="aot_eager", fullgraph=True)(x),
    ):
        with pytest.raises(RuntimeError, match=r"inference-only.*torch.inference_mode\(\)"):
            call()
    q, _ = torch.ops.fused.quantize_fp8_rows(x)
    with pytest.raises(RuntimeError, match="inference-only"):
        q.float().sum().backward()
    with torch.inference_mode():
        assert fp8(x).shape == (3, 48)
    with torch.no_grad():
        assert compile_ops.quantize_fp8_rows(x).q.shape == (3, 64)


def _bad_cases():
    fp8 = compile_ops.FP8Linear.from_linear(_linear())
    qw, sw = compile_ops.quantize_fp8_rows(torch.randn(8, 16))
    x = torch.randn(2, 16)
    rows = compile_ops.quantize_fp8_rows(x)
    quantize, linear = compile_ops.quantize_fp8_rows, compile_ops.fp8_linear
    return [
        (lambda: fp8(torch.randn(3, 32)), ValueError, r"FP8Linear: x must have 64 channels.*\(3, 32\)"),
        (lambda: fp8(FP8Rows(rows.q, rows.scale)), ValueError, r"64 channels.*\(2, 16\)"),
        (lambda: compile_ops.FP8Linear.from_linear(torch.nn.Conv1d(3, 3, 1)), TypeError, "nn.Linear, got Conv1d"),
        (
            lambda: compile_ops.FP8ProjectionActivation(_linear(), "gelu"),
            TypeError,
            "FP8ProjectionActivation: proj must be a compile_ops.FP8Linear, got Linear",
        ),
        (
            lambda: compile_ops.FP8ProjectionActivation(fp8, "relu"),
            ValueError,
            "activation must be one of 'gelu', 'gelu_tanh', 'silu', got 'relu'",
        ),
        (
            lambda: quantize(torch.ones(3, 4, dtype=torch.int32)),
            TypeError,
            "fused.quantize_fp8_rows: x must have a floating dtype.*int32",
        ),
        (lambda: quantize(torch.tensor(1.0)), ValueError, "fused.quantize_fp8_rows: x must have at least 1 dim"),
        (
            lambda: quantize(x, "relu"),
            ValueError,
            "fused.quantize_fp8_rows: activation must be one of 'none', 'gelu', 'gelu_tanh', 'silu', got 'relu'",
        ),
        (lambda: quantize(x, None), TypeError, "activation must be a str, got NoneType"),
        (
            lambda: quantize(x, head=torch.randn(3, 8)),
            ValueError,
            r"head must be \[..., K_head\] with x's leading dims \[2\].*got \[3, 8\]",
        ),
        (
            lambda: quantize(x, head=torch.randn(2, 8, dtype=torch.float64)),
            TypeError,
            "head must have x's dtype torch.float32.*got torch.float64",
        ),
        (lambda: quantize(x, head=torch.randn(2, 8, device="meta")), ValueError, "head is on meta but x is on cpu"),
        # The dispatcher checks the schema first, and names the argument.
        (lambda: quantize([1.0, 2.0]), TypeError, "x must be a torch.Tensor, got list"),
        (
            lambda: linear(torch.randn(2, 32), qw, sw),
            ValueError,
            r"fp8_linear: weight_q must be float8_e4m3fn \[N, 32\].*\[8, 16\]",
        ),
        (lambda: linear(x, qw.float(), sw), TypeError, "weight_q must be float8_e4m3fn.*torch.float32"),
        (lambda: linear(x, qw, sw.double()), ValueError, r"weight_scale must be float32 \[8\].*float64"),
        (lambda: linear(x, qw, sw[:4]), ValueError, r"weight_scale must be float32 \[8\].*\[4\]"),
        (lambda: linear(x, qw, sw, torch.zeros(4)), ValueError, r"bias must be a floating \[8\]"),
        (lambda: linear(x, qw, sw, torch.zeros(8, device="meta")), ValueError, "bias is on meta but x is on cpu"),
        (
            lambda: linear(FP8Rows(rows.q.float(), rows.scale), qw, sw),
            TypeError,
            "x.q must be float8_e4m3fn.*torch.float32",
        ),
        (
            lambda: linear(FP8Rows(rows.q, rows.scale[:1]), qw, sw),
            ValueError,
            r"x.scale must be float32 \[2\] \(one per row",
        ),
    ]


test_bad_input_raises_a_clear_error = bad_input_test(_bad_cases)


def test_a_gpu_without_fp8_tensor_cores_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(RuntimeError, match="NVIDIA A100 is sm_80.*sm_89 or newer"):
        ops.check_fp8_device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert ops.uses_scaled_mm(torch.device("cuda", 0)) and not ops.uses_scaled_mm(torch.device("cpu"))


# ---------------------------------------------------------------- layer 2: fake-CUDA tracing


@pytest.mark.parametrize("bias", [True, False])
def test_fake_cuda_trace_of_fp8_linear_calls_scaled_mm_rowwise(monkeypatch, bias):
    """The CUDA branch of fp8_linear (as on an H100): our quantization, then
    torch._scaled_mm with [M, 1] and [1, N] scales, whose meta function checks them."""
    monkeypatch.setattr(_library, "cuda_capability", lambda index: (9, 0, "NVIDIA H100"))
    fp8 = compile_ops.FP8Linear.from_linear(_linear(bias=bias, dtype=torch.bfloat16))
    x = torch.randn(2, 7, 64, dtype=torch.bfloat16)
    gm, out, _ = _fake_cuda_launches(
        lambda x, *w: compile_ops.fp8_linear(x, *w), x, fp8.weight_q, fp8.weight_scale, fp8.bias
    )
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.fused.quantize_fp8_rows.default in targets and torch.ops.aten._scaled_mm.default in targets
    assert out.shape == (2, 7, 48) and out.dtype == torch.bfloat16
    # Fast accumulation by default (as torchao's float8 inference), else as asked.
    for fast_accum in (True, False):
        kwargs = {} if fast_accum else {"fast_accum": False}
        gm, _, _ = _fake_cuda_launches(
            lambda x, *w: compile_ops.fp8_linear(x, *w, **kwargs), x, fp8.weight_q, fp8.weight_scale
        )
        (mm,) = [n for n in gm.graph.nodes if n.target == torch.ops.aten._scaled_mm.default]
        schema_args = torch.ops.aten._scaled_mm.default._schema.arguments
        use_fast_accum = mm.kwargs.get("use_fast_accum", mm.args[-1] if len(mm.args) == len(schema_args) else False)
        assert use_fast_accum is fast_accum, mm
    rows = compile_ops.quantize_fp8_rows(x)
    gm, out, _ = _fake_cuda_launches(
        lambda q, s, *w: compile_ops.fp8_linear(FP8Rows(q, s), *w, torch.float32),
        rows.q,
        rows.scale,
        fp8.weight_q,
        fp8.weight_scale,
        fp8.bias,
    )
    assert torch.ops.fused.quantize_fp8_rows.default not in [n.target for n in gm.graph.nodes]
    assert out.shape == (2, 7, 48) and out.dtype == torch.float32


# ---------------------------------------------------------------- layer 3/4: the kernel


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_fp8_linear_keeps_non_finite_activations_and_weights_non_finite(dtype):
    """The layer-1 checks of non-finite activation rows and weight rows with
    the kernel quantizing (FP8Linear's activations and from_linear's weight)."""
    linear = _linear(dtype=dtype).to(KERNEL_DEVICE)
    x, bad = _non_finite_activations(dtype, KERNEL_DEVICE)
    _check_non_finite_rows_as_nn_linear(compile_ops.FP8Linear.from_linear(linear), linear, x, bad)
    for case in ("+inf", "-inf", "nan", "whole +inf row"):
        linear = _linear(dtype=dtype).to(KERNEL_DEVICE)
        column = _non_finite_weight(linear, case)
        tokens = torch.randn(6, 64, device=KERNEL_DEVICE).to(dtype)
        tokens[0, 7] = 0.0
        _check_non_finite_weight_columns(compile_ops.FP8Linear.from_linear(linear), linear, column, tokens)
