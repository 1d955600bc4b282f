"""The fp8 family: rowwise e4m3 quantization and FP8 Linears (inference only).

The specification is compile_ops/reference/fp8.py. Tests here restate it
independently (``_spec_quantize``), check the reference and the op against
it, the GEMM against ``torch._scaled_mm`` on the same operands, FP8Linear
under compile and export, and report the distance to the exact products
(layer 1); trace the CUDA branches on fake CUDA tensors (layer 2) and read
the sm_90 PTX for the instructions that make the GPU's bytes the
reference's; compare the kernel's bytes with the reference's under the
interpreter or on the GPU (layers 3/4).
"""

import pytest
import torch
import torch._dynamo.testing
import triton
from bad_input import bad_input_test
from conftest import KERNEL_DEVICE
from hypothesis import given
from hypothesis import strategies as st
from shapes import size
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import compile_ops
from compile_ops import FP8Rows, _library
from compile_ops._library import OP_BODIES
from compile_ops.ops import fp8 as ops
from compile_ops.reference import fp8 as ref


def _spec_quantize(x):
    """The recipe in a few lines, for cross-checking (not the library's code)."""
    xf = x.double().float()
    counted = torch.where(torch.isnan(xf), torch.zeros_like(xf), xf.abs())  # NaN left out, +-inf counted
    amax = counted.amax(-1, keepdim=True).clamp(min=1e-12)
    q = torch.clamp(xf * (torch.tensor(448.0) / amax), -448.0, 448.0).to(torch.float8_e4m3fn)
    return q, (amax / 448.0).squeeze(-1)


def _same_bytes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _same_bytes_but_nan_sign(a, b):
    """Equal bytes, NaN where NaN: e4m3fn has two NaNs (0x7f, 0xff). torch keeps
    the input's sign; the GPU's convert may not, and nothing reads a NaN's sign."""
    a, b = a.view(torch.uint8), b.view(torch.uint8)
    a_nan, b_nan = (a & 0x7F) == 0x7F, (b & 0x7F) == 0x7F
    return torch.equal(a_nan, b_nan) and torch.equal(a[~a_nan], b[~b_nan])


# ---------------------------------------------------------------- layer 1: the recipe


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_and_op_follow_the_recipe(dtype):
    x = (torch.randn(6, 40) * torch.logspace(-3, 3, 6)[:, None]).to(dtype)
    q, scale = compile_ops.quantize_fp8_rows(x)
    want_q, want_scale = _spec_quantize(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (6,)
    assert _same_bytes(q, want_q) and torch.equal(scale, want_scale)
    # Dequantized error. x * inverse lands in [-448, 448]; e4m3 keeps 3 mantissa
    # bits, so a value v in [2^e, 2^(e+1)) with e >= -6 (the normal range) is
    # rounded to a multiple of 2^(e-3): off by at most half of that, 2^(e-4) <=
    # 2^-4 |v|. Multiplying back by scale = 1/inverse (each an fp32 rounding,
    # 2^-24 relative) adds ~3 * 2^-24: |x - q * scale| <= (2^-4 + 1e-6) |x|.
    # Below 2^-6 (subnormals, spacing 2^-9) the error is absolute: half a
    # spacing, 2^-10 * scale.
    back = q.float() * scale[:, None]
    err = (back - x.float()).abs()
    normal = x.float().abs() >= 2.0**-6 * scale[:, None]
    rel = (err / x.float().abs())[normal]
    assert rel.max() <= 2.0**-4 + 1e-6, rel.max()
    assert (err <= 2.0**-10 * scale[:, None] * (1 + 1e-6))[~normal].all()
    # Each row's largest value maps to +-448 exactly.
    assert torch.equal(q.float().abs().amax(-1), torch.full((6,), 448.0))


_TORCH_ACTIVATIONS = {
    "gelu": lambda t: torch.nn.functional.gelu(t),
    "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
    "silu": torch.nn.functional.silu,
}


@pytest.mark.parametrize("activation", _TORCH_ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_mode_quantizes_the_activation_rounded_to_the_input_dtype(activation, dtype):
    """quantize_fp8_rows(x, act) is the recipe applied to act(x) computed in
    fp32 and rounded to x's dtype (what the unquantized activation writes)."""
    torch.manual_seed(0)
    x = (torch.randn(6, 40) * 3).to(dtype)
    q, scale = compile_ops.quantize_fp8_rows(x, activation)
    want_q, want_scale = _spec_quantize(_TORCH_ACTIVATIONS[activation](x.float()).to(dtype))
    assert _same_bytes(q, want_q) and torch.equal(scale, want_scale)
    plain_q, _ = compile_ops.quantize_fp8_rows(x)
    assert not _same_bytes(q, plain_q)  # the mode does something
    # With a head: one scale per row of cat([head, act(x)]), the concatenation never written.
    head = (torch.randn(6, 24) * 5).to(dtype)
    q, scale = compile_ops.quantize_fp8_rows(x, activation, head=head)
    want_q, want_scale = _spec_quantize(torch.cat([head, _TORCH_ACTIVATIONS[activation](x.float()).to(dtype)], -1))
    assert q.shape == (6, 64) and _same_bytes(q, want_q) and torch.equal(scale, want_scale)


def test_an_infinity_makes_its_row_nan_and_a_nan_stays_where_it_is():
    """The non-finite rule: amax counts +-inf and leaves NaN out. A row with an
    infinity gets an infinite scale and the codes ``x * (448 / inf)``: NaN at
    the infinities, +-0 elsewhere, so ``q * scale`` is NaN across the row; a
    NaN without an infinity keeps its row's scale and is NaN only where it
    was. Rows are independent: the others keep their bytes."""
    inf, nan = float("inf"), float("nan")
    x = torch.randn(9, 16)
    x[0, 3], x[1, 5], x[2], x[3], x[4], x[5, 0] = inf, nan, 0.0, nan, -inf, 1e-30
    x[6, 2], x[6, 9], x[7, 1], x[7, 4] = -inf, nan, inf, -inf
    q, scale = compile_ops.quantize_fp8_rows(x)
    want_q, want_scale = _spec_quantize(x)
    assert _same_bytes(q, want_q) and torch.equal(scale, want_scale)
    infinite = torch.tensor([True, False, False, False, True, False, True, True, False])
    assert torch.equal(torch.isinf(scale), infinite) and (scale[infinite] > 0).all()
    assert torch.isfinite(scale[~infinite]).all() and (scale[~infinite] > 0).all()
    back = q.float() * scale[:, None]
    assert back[infinite].isnan().all() and not back[~infinite].isinf().any()
    assert torch.equal(q.float().isnan(), ~torch.isfinite(x))  # NaN codes exactly at the non-finite values
    assert (q[0, [0, 1, 2, 4]].float() == 0).all() and (q[4].float().isnan()).all()
    # A NaN without an infinity is left out of the amax: the row's other values
    # get the scale they would get without it.
    _, without_nan = compile_ops.quantize_fp8_rows(torch.cat([x[1, :5], x[1, 6:]]))
    assert torch.equal(scale[1], without_nan)
    assert q[1, 5].float().isnan() and not q[1, [0, 1, 2, 3, 4, 6]].float().isnan().any()
    assert q[3].float().isnan().all()
    # All-zero and all-NaN rows: the floor's scale, 1e-12 / 448.
    floor = torch.tensor(ref.AMAX_FLOOR, dtype=torch.float32) / ref.E4M3_MAX
    assert torch.equal(scale[[2, 3]], floor.expand(2)) and (q[2].float() == 0).all()
    clean_q, clean_scale = compile_ops.quantize_fp8_rows(x[[5, 8]])
    assert _same_bytes(q[[5, 8]], clean_q) and torch.equal(scale[[5, 8]], clean_scale)


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


def _fake_cuda_launches(fn, *args):
    """make_fx of ``fn`` on fake CUDA tensors like ``args``: ``(graph, [(kernel, kwargs, grid)])``."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        cuda_args = tuple(
            torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cuda") if isinstance(a, torch.Tensor) else a
            for a in args
        )
        gm = make_fx(fn)(*cuda_args)
        out = gm(*cuda_args)
    launches = [
        (
            kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__,
            {**n.kwargs["kwargs"], **kernel_side_table.get_constant_args(n.kwargs["constant_args_idx"])},
            n.kwargs["grid"][0],
        )
        for n in gm.graph.nodes
        if n.target is torch.ops.higher_order.triton_kernel_wrapper_mutation
    ]
    return gm, out, launches


@pytest.mark.parametrize(
    "shape, looped, activation, act",
    [
        ((2, 7, 64), False, "none", -1),
        ((3, 3072), False, "none", -1),
        ((5, 4096 + 37), False, "none", -1),
        ((5, 16384 + 37), True, "none", -1),
        ((2, 2**19, 4096), False, "none", -1),
        ((2**20, 8192), False, "none", -1),
        ((2, 4096, 12288), False, "gelu_tanh", 1),
        ((2, 4096, 12288), False, "head", 1),
        ((2, 64, 16384 + 64), True, "head", 1),
    ],
)
def test_fake_cuda_trace_launches_the_quantize_kernel(shape, looped, activation, act):
    """The Triton branch on fake CUDA tensors (meta-sized past 2^31 elements):
    one launch, rows read once up to 16384 columns (an MLP's hidden activation
    and Flux's concatenation with the attention output among them), the
    looped variant past that, the activation's ACT code, a grid that covers
    every row, outputs shaped like the fake's."""
    with torch.device("meta"):
        x = torch.empty(shape, dtype=torch.bfloat16)
        head = torch.empty((*shape[:-1], 3072), dtype=torch.bfloat16) if activation == "head" else None
    body = OP_BODIES["fused::quantize_fp8_rows"]
    if head is None:
        _, (q, scale), launches = _fake_cuda_launches(lambda t: body(t, activation), x)
    else:  # Flux's single block: the attention output, then the MLP's activation
        _, (q, scale), launches = _fake_cuda_launches(lambda t, h: body(t, "gelu_tanh", h), x, head)
        shape = (*shape[:-1], 3072 + shape[-1])
    assert [name for name, _, _ in launches] == ["quantize_fp8_rows_kernel"]
    _, kwargs, grid = launches[0]
    rows = x.numel() // x.shape[-1]
    assert kwargs["LOOPED"] is looped and kwargs["n_rows"] == rows and kwargs["K"] == x.shape[-1]
    assert kwargs["ACT"] == act and kwargs["HAS_HEAD"] is (head is not None)
    assert kwargs["K_HEAD"] == (0 if head is None else 3072)
    if not looped:  # whole rows in registers: whole blocks of 4096 (or of a narrower row's power of two) cover them
        block_n, chunks, head_chunks = kwargs["BLOCK_N"], kwargs["CHUNKS"], kwargs["HEAD_CHUNKS"]
        assert block_n == min(4096, triton.next_power_of_2(max(x.shape[-1], kwargs["K_HEAD"])))
        assert (chunks, head_chunks) == (triton.cdiv(x.shape[-1], block_n), triton.cdiv(kwargs["K_HEAD"], block_n))
        assert block_n * (chunks + head_chunks) <= 16384
    assert grid[0] == triton.cdiv(rows, kwargs["BLOCK_M"]) and 0 < grid[0] < 2**31  # one tile a program
    assert (q.shape, q.dtype, scale.shape, scale.dtype) == (shape, torch.float8_e4m3fn, shape[:-1], torch.float32)


@pytest.mark.parametrize(
    "schedule, shape, k_head",
    [
        (ops.Schedule(1, 4096, 16), (2, 4096, 12288), 3072),  # Flux's single block
        (ops.Schedule(4, 512, 8), (7, 1536), 0),  # rows across warp groups, M not a multiple of 4
        (ops.Schedule(2, 2048, 4), (3, 20000), 0),  # an entry holds rows the default rule would loop
    ],
)
def test_fake_cuda_trace_launches_the_schedule_table_entry(monkeypatch, schedule, shape, k_head):
    """A SCHEDULES entry keyed by (activation, head width, width) sets the held
    launch: its tile rows, block width and warps, each segment in whole
    blocks, a grid of one tile of BLOCK_M rows a program; other widths keep
    the default rule."""
    activation = "gelu_tanh" if k_head else "none"
    monkeypatch.setattr(ops, "SCHEDULES", {(activation, k_head, shape[-1]): schedule})
    with torch.device("meta"):
        x = torch.empty(shape, dtype=torch.bfloat16)
        other = torch.empty((*shape[:-1], shape[-1] + 16), dtype=torch.bfloat16)  # no entry
        heads = (torch.empty((*shape[:-1], k_head), dtype=torch.bfloat16),) if k_head else ()
    body = OP_BODIES["fused::quantize_fp8_rows"]
    _, _, launches = _fake_cuda_launches(
        lambda t, u, *h: (body(t, activation, *h), body(u, activation, *h)), x, other, *heads
    )
    (_, entry, grid), (_, default, default_grid) = launches
    rows = x.numel() // x.shape[-1]
    block_m, block_n, _ = schedule
    assert not entry["LOOPED"] and (entry["BLOCK_M"], entry["BLOCK_N"]) == schedule[:2]
    assert (entry["CHUNKS"], entry["HEAD_CHUNKS"]) == (triton.cdiv(shape[-1], block_n), triton.cdiv(k_head, block_n))
    assert grid[0] == triton.cdiv(rows, block_m)
    assert default_grid[0] == triton.cdiv(rows, default["BLOCK_M"])


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


@pytest.mark.parametrize("variant", ["held", "looped", "two_rows"])
@pytest.mark.parametrize("act", [-1, 1])
def test_sm90_code_rounds_like_the_reference(variant, act):
    """What makes the GPU's bytes the reference's, read from the sm_90 PTX (no GPU
    needed; both variants with a head segment, as Flux's single block runs them): IEEE division for the
    scales (not div.approx/div.full, which plain fp32 ``/`` gives), no
    flush-to-zero, and the round-to-nearest-even saturating convert that
    tests/conftest.py's interpreter patch reproduces. With an activation
    (tanh GELU) the forward sigmoid's one approximate division is the only
    other one (``kernels/glu.py``: its bytes are the GLU kernels', which the
    interpreter layer compares). ``two_rows``: a tile of two rows a program
    (a SCHEDULES entry's shape)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from compile_ops.kernels.fp8 import quantize_fp8_rows_kernel

    signature = {
        "X": "*bf16",
        "Q": "*fp8e4nv",
        "S": "*fp32",
        "n_rows": "i32",
        "K": "i32",
        "stride_row": "i32",
        "stride_col": "i32",
        "HEAD": "*bf16",
        "K_HEAD": "i32",
        "stride_head_row": "i32",
        "stride_head_col": "i32",
        "BLOCK_M": "constexpr",
        "BLOCK_N": "constexpr",
        "LOOPED": "constexpr",
        "ACT": "constexpr",
        "HAS_HEAD": "constexpr",
        "CHUNKS": "constexpr",
        "HEAD_CHUNKS": "constexpr",
    }
    looped, block_m = variant == "looped", 2 if variant == "two_rows" else 1
    # Flux's single block as the launcher runs it: 3 + 1 blocks of 4096 held, or the loop.
    src = ASTSource(
        fn=quantize_fp8_rows_kernel,
        signature=signature,
        constexprs={
            "BLOCK_M": block_m,
            "BLOCK_N": 2048 if looped else 4096,
            "LOOPED": looped,
            "ACT": act,
            "HAS_HEAD": True,
            "CHUNKS": 0 if looped else 3,
            "HEAD_CHUNKS": 0 if looped else 1,
        },
    )
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4 if looped else 8}).asm["ptx"]
    assert set(re.findall(r"cvt\.[\w.]*e4m3[\w.]*", ptx)) == {"cvt.rn.satfinite.e4m3x2.f32"}
    divisions = re.findall(r"div\.[\w.]+", ptx)
    assert set(divisions) == ({"div.rn.f32"} if act < 0 else {"div.rn.f32", "div.full.f32"})
    # The scales' two correctly rounded divisions, in each place a row's scale is taken.
    assert 0 < divisions.count("div.rn.f32") <= 4 * block_m
    assert ".ftz" not in ptx


@pytest.mark.parametrize("variant", ["held", "head", "looped", "two_rows"])
def test_inductor_sees_the_quantize_kernel_write_only_its_outputs(variant, monkeypatch):
    """Inductor's analysis of what a user Triton kernel writes (its TTIR, read
    for an sm_90 target: no GPU needed) finds Q and S only. Were X (or HEAD)
    taken for written, a compiled graph would copy the activation before each
    call and CUDA graphs would skip the FP8 Linears (``mutated inputs``)."""
    from torch._higher_order_ops import triton_kernel_wrap
    from triton.backends.compiler import GPUTarget

    from compile_ops.kernels.fp8 import quantize_fp8_rows_kernel

    class Sm90Target:  # the active driver's target, where this machine may have no GPU
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    monkeypatch.setattr(triton.runtime.driver, "_active", Sm90Target(), raising=False)
    with_head, looped = variant == "head", variant == "looped"
    block_m = 2 if variant == "two_rows" else 1
    x = torch.empty(64, 256, dtype=torch.bfloat16)
    kwargs = dict(
        X=x,
        Q=torch.empty(64, 512 if with_head else 256, dtype=torch.float8_e4m3fn),
        S=torch.empty(64),
        n_rows=64,
        K=256,
        stride_row=256,
        stride_col=1,
        HEAD=torch.empty(64, 256, dtype=torch.bfloat16) if with_head else None,
        K_HEAD=256 if with_head else 0,
        stride_head_row=256,
        stride_head_col=1,
        BLOCK_M=block_m,
        BLOCK_N=256,
        LOOPED=looped,
        ACT=1,
        HAS_HEAD=with_head,
        CHUNKS=0 if looped else 1,
        HEAD_CHUNKS=int(with_head and not looped),
    )
    if hasattr(
        triton_kernel_wrap, "identify_accessed_tensors"
    ):  # newer torch; older ones name it identify_mutated_tensors
        accesses = triton_kernel_wrap.identify_accessed_tensors(quantize_fp8_rows_kernel, kwargs, {})
        written = [dep.name for dep in accesses.read_writes.writes]
    else:
        written = triton_kernel_wrap.identify_mutated_tensors(quantize_fp8_rows_kernel, kwargs, {})
    assert sorted(written) == ["Q", "S"]


# ---------------------------------------------------------------- layer 3/4: the kernel


@pytest.mark.kernels
@given(
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    st.integers(0, 5),
    size(st.one_of(st.integers(1, 300), st.sampled_from([3072, 4096, 5000])), [1, 37, 3072, 5000]),
    st.sampled_from(["contiguous", "row_slice", "column_stride"]),
    st.sampled_from(["none", "inf", "nan", "zero_row", "tiny_row"]),
    st.floats(1e-3, 1e3),
)
def test_kernel_writes_the_references_bytes(dtype, rows, k, layout, special, magnitude):
    torch.manual_seed(k)
    if layout == "column_stride":
        x = (torch.randn(rows, 2 * k) * magnitude)[:, ::2]
    elif layout == "row_slice":
        x = (torch.randn(rows, k + 3) * magnitude)[:, 2 : 2 + k]
    else:
        x = torch.randn(rows, k) * magnitude
    x = x.to(dtype)
    if rows and special != "none":
        if special == "zero_row":
            x[0] = 0
        elif special == "tiny_row":
            x[0] = x[0].float().mul(1e-6).to(dtype)
        else:
            x[0, k // 2] = float(special)
    x = x.to(KERNEL_DEVICE)
    q, scale = compile_ops.quantize_fp8_rows(x)
    want_q, want_scale = ref.quantize_fp8_rows(x.cpu())
    assert _same_bytes_but_nan_sign(q.cpu(), want_q), "e4m3 bytes differ from the reference"
    assert torch.equal(scale.cpu(), want_scale)


def _unquantized_activation(x, activation):
    """act(x) at x's dtype from the GLU kernels (``value * act(gate)`` with a
    value of ones: exact), which share the quantize kernel's activation code."""
    ones_and_x = torch.cat([torch.ones_like(x), x], dim=-1)  # value half, gate half
    if activation == "silu":
        return compile_ops.swiglu(ones_and_x)
    return compile_ops.geglu(ones_and_x, approximate="tanh" if activation == "gelu_tanh" else "none")


def _quantized_in_small_chunks(x, activation, head, chunk_n):
    """``quantize_fp8_rows`` under a launch config scaled down to ``chunk_n``-wide
    chunks (so small rows take the held and the looped paths), and the values
    the reference quantizes: ``act(x)`` as the GLU kernels round it, after the head."""
    from compile_ops._library import clear_launch_plans

    saved = ops.CHUNK_N, ops.MAX_ROW_VALUES, ops.LOOP_BLOCK_N
    ops.CHUNK_N, ops.MAX_ROW_VALUES, ops.LOOP_BLOCK_N = chunk_n, 8 * chunk_n, chunk_n
    clear_launch_plans()
    try:
        q, scale = compile_ops.quantize_fp8_rows(x, activation, head=head)
    finally:
        ops.CHUNK_N, ops.MAX_ROW_VALUES, ops.LOOP_BLOCK_N = saved
        clear_launch_plans()
    values = x if activation == "none" else _unquantized_activation(x, activation)
    if head is not None:
        values = torch.cat([head, values], dim=-1)
    return q, scale, values


@pytest.mark.kernels
@given(
    st.integers(1, 5),
    st.integers(1, 600),
    st.integers(0, 300),
    st.sampled_from([16, 64]),
    st.sampled_from(["none", "gelu_tanh", "silu"]),
    st.sampled_from([torch.float32, torch.float16]),
)
def test_kernel_holds_a_row_in_any_number_of_blocks_or_loops_past_them(rows, k, k_head, chunk_n, activation, dtype):
    """The launch config scaled down (blocks of 16 or 64 columns, rows held up to
    8 blocks, looped past that in blocks of the same width), so that small
    rows take every path Flux's rows take at full size: one or many blocks of
    x, of the head, both, a last block partly masked, and the two-pass loop.
    Bytes and scales equal the reference's of the concatenation, with the
    activation the GLU kernels compute (``_unquantized_activation``)."""

    torch.manual_seed(k * 301 + k_head)
    x = (torch.randn(rows, k) * 3).to(dtype).to(KERNEL_DEVICE)
    head = (torch.randn(rows, k_head) * 2).to(dtype).to(KERNEL_DEVICE) if k_head else None
    q, scale, values = _quantized_in_small_chunks(x, activation, head, chunk_n)
    want_q, want_scale = ref.quantize_fp8_rows(values.cpu())
    assert _same_bytes(q.cpu(), want_q) and torch.equal(scale.cpu(), want_scale)


@pytest.mark.kernels
@pytest.mark.parametrize("k", [40, 200])  # 3 blocks held; the two-pass loop
@pytest.mark.parametrize("activation", ["none", "silu"])
@pytest.mark.parametrize("with_head", [False, True])
def test_kernel_follows_the_non_finite_rule(k, activation, with_head):
    """+inf, -inf, NaN and whole infinite rows, in x and in the head, under the
    scaled-down launch config of the test above: the reference's bytes and
    scales, and the rule itself: a row holding an infinity (after the
    activation) gets an infinite scale and dequantizes to NaN across the row,
    a NaN without one keeps its row's finite scale."""

    inf, nan = float("inf"), float("nan")
    torch.manual_seed(k)
    x = torch.randn(9, k) * 3
    x[1, 3], x[2, k - 1], x[3, 5], x[4], x[5], x[6, 1], x[6, k // 2] = inf, -inf, nan, inf, -inf, inf, -inf
    head = torch.randn(9, 24) * 2
    head[7, 20], head[8, 2] = inf, nan
    x, head = x.to(KERNEL_DEVICE), head.to(KERNEL_DEVICE) if with_head else None
    q, scale, values = _quantized_in_small_chunks(x, activation, head, 16)
    want_q, want_scale = ref.quantize_fp8_rows(values.cpu())
    assert _same_bytes_but_nan_sign(q.cpu(), want_q) and torch.equal(scale.cpu(), want_scale)
    infinite = values.isinf().any(-1)
    assert infinite.sum() >= 3
    assert torch.isinf(scale[infinite]).all() and torch.isfinite(scale[~infinite]).all()
    back = q.float() * scale[:, None]
    assert back[infinite].isnan().all() and torch.equal(back[~infinite].isnan(), values[~infinite].isnan())


def _quantized_under_schedule(x, activation, head, schedule):
    """``quantize_fp8_rows`` with ``schedule`` as the SCHEDULES entry of x's rows,
    and the values the reference quantizes (as :func:`_quantized_in_small_chunks`)."""
    from compile_ops._library import clear_launch_plans

    saved = ops.SCHEDULES
    ops.SCHEDULES = {(activation, 0 if head is None else head.shape[-1], x.shape[-1]): schedule}
    clear_launch_plans()
    try:
        q, scale = compile_ops.quantize_fp8_rows(x, activation, head=head)
    finally:
        ops.SCHEDULES = saved
        clear_launch_plans()
    values = x if activation == "none" else _unquantized_activation(x, activation)
    if head is not None:
        values = torch.cat([head, values], dim=-1)
    return q, scale, values


@pytest.mark.kernels
@given(
    st.integers(1, 13),
    st.one_of(st.just(1), st.integers(2, 120)),
    st.sampled_from([0, 5, 40]),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([16, 32]),
    st.sampled_from(["none", "gelu_tanh", "silu"]),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.sampled_from(["none", "zero_rows", "inf", "nan"]),
)
def test_kernel_schedule_entries_write_the_references_bytes(
    rows, k, k_head, block_m, block_n, activation, dtype, special
):
    """A SCHEDULES entry's launch (tiles of ``block_m`` rows, blocks of 16 or
    32 columns): rows that are not a multiple of a tile's, the last tile
    partly past them, K = 1, K not a multiple of the block, with and without a
    head, all-zero rows (the floor), +-inf and NaN. Bytes and scales equal the reference's of the
    concatenation, with the activation the GLU kernels compute."""
    torch.manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k) * 3
    head = torch.randn(rows, k_head) * 2 if k_head else None
    if special == "zero_rows":
        x[0], x[-1] = 0.0, 0.0
        if head is not None:
            head[0], head[-1] = 0.0, 0.0
    elif special != "none":
        x[-1, k // 2] = float(special)
        x[0, 0] = -float(special)
        if head is not None:
            head[rows // 2, k_head - 1] = float(special)
    x = x.to(dtype).to(KERNEL_DEVICE)
    head = None if head is None else head.to(dtype).to(KERNEL_DEVICE)
    schedule = ops.Schedule(block_m, block_n, 4)
    q, scale, values = _quantized_under_schedule(x, activation, head, schedule)
    want_q, want_scale = ref.quantize_fp8_rows(values.cpu())
    assert _same_bytes_but_nan_sign(q.cpu(), want_q) and torch.equal(scale.cpu(), want_scale)
    if special == "zero_rows":
        assert torch.equal(scale.cpu()[[0, -1]], ref.quantize_fp8_rows(torch.zeros(2, 1))[1])  # the floor


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


@pytest.mark.kernels
@pytest.mark.parametrize("activation", _TORCH_ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shape, layout",
    [
        ((3, 37), "contiguous"),
        ((4, 64), "column_stride"),
        ((2, 4096 + 37), "contiguous"),
        ((2, 16384 + 37), "contiguous"),
    ],
)  # the last: the two-pass loop
def test_kernel_activation_mode_writes_the_bytes_of_quantizing_the_activation(activation, dtype, shape, layout):
    """Bytes and scales equal to quantizing the activation's own kernel output;
    the distance to torch's activation (other tanh/erf/exp) is reported."""
    torch.manual_seed(shape[-1])
    x = torch.randn(shape[0], shape[1] * (2 if layout == "column_stride" else 1)) * 3
    x = (x[:, ::2] if layout == "column_stride" else x).to(dtype).to(KERNEL_DEVICE)
    q, scale = compile_ops.quantize_fp8_rows(x, activation)
    want_q, want_scale = compile_ops.quantize_fp8_rows(_unquantized_activation(x, activation))
    assert _same_bytes(q, want_q) and torch.equal(scale, want_scale)
    # A head segment (strided rows) before the activation: the concatenation's rows.
    head = (torch.randn(shape[0], shape[1] + 8) * 4).to(dtype).to(KERNEL_DEVICE)[:, 3 : 3 + shape[1] // 2]
    q_cat, scale_cat = compile_ops.quantize_fp8_rows(x, activation, head=head)
    want_q, want_scale = compile_ops.quantize_fp8_rows(torch.cat([head, _unquantized_activation(x, activation)], -1))
    assert _same_bytes(q_cat, want_q) and torch.equal(scale_cat, want_scale)
    exact_q, exact_scale = ref.quantize_fp8_rows(x.cpu(), activation)
    deq, exact = q.cpu().float() * scale.cpu()[:, None], exact_q.float() * exact_scale[:, None]
    print(
        f"{activation} {dtype}: relative L2 to quantizing torch's activation "
        f"{((deq - exact).norm() / exact.norm()).item():.1e}"
    )
