"""The fp8 family: rowwise e4m3 quantization and FP8 Linears (inference only).

The specification is compile_ops/reference/fp8.py. Tests here restate it
independently (``_spec_quantize``), check the reference and the op against
it, the GEMM against ``torch._scaled_mm`` on the same operands, FP8Linear
under compile and export, the kernel's bytes against the reference under the
interpreter (or on the GPU), and report the distance to the exact products.
"""
import pytest
import torch
import torch._dynamo.testing
from hypothesis import given
from hypothesis import strategies as st

import compile_ops
from bad_input import bad_input_test
from compile_ops.reference import fp8 as ref
from conftest import KERNEL_DEVICE
from shapes import size


def _spec_quantize(x):
    """The recipe in a few lines, for cross-checking (not the library's code)."""
    xf = x.double().float()
    finite = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros_like(xf))
    amax = finite.amax(-1, keepdim=True).clamp(min=1e-12)
    q = torch.clamp(xf * (torch.tensor(448.0) / amax), -448.0, 448.0).to(torch.float8_e4m3fn)
    return q, (amax / 448.0).squeeze(-1)


def _same_bytes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---------------------------------------------------------------- layer 1: the recipe


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_and_op_follow_the_recipe(dtype):
    x = (torch.randn(6, 40) * torch.logspace(-3, 3, 6)[:, None]).to(dtype)
    q, scale = compile_ops.quantize_fp8_rows(x)
    want_q, want_scale = _spec_quantize(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (6,)
    assert _same_bytes(q, want_q) and torch.equal(scale, want_scale)
    # Dequantized error: e4m3 has 3 mantissa bits, so rounding is off by at most
    # half a unit, 2^-4 relative, for values in the normal range (>= 2^-6 * scale).
    back = q.float() * scale[:, None]
    normal = x.float().abs() >= 2.0 ** -6 * scale[:, None]
    rel = ((back - x.float()).abs() / x.float().abs())[normal]
    assert rel.max() <= 2.0 ** -4 + 1e-6, rel.max()
    # Each row's largest value maps to +-448 exactly.
    assert torch.equal(q.float().abs().amax(-1), torch.full((6,), 448.0))


def test_non_finite_values_keep_the_scale_finite_and_stay_in_their_row():
    x = torch.randn(4, 16)
    x[0, 3], x[1, 5], x[2] = float("inf"), float("nan"), 0.0
    q, scale = compile_ops.quantize_fp8_rows(x)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert q[0, 3].float() == 448.0  # saturated, not NaN
    assert q[1, 5].float().isnan() and not q[1, [0, 1, 2, 3, 4, 6]].float().isnan().any()
    assert (q[2].float() == 0).all()
    clean_q, clean_scale = compile_ops.quantize_fp8_rows(x[3:])
    assert _same_bytes(q[3:], clean_q) and torch.equal(scale[3:], clean_scale)


def test_fp8_linear_reference_matches_scaled_mm_on_the_same_operands():
    torch.manual_seed(0)
    qx, sx = compile_ops.quantize_fp8_rows(torch.randn(32, 64))
    qw, sw = compile_ops.quantize_fp8_rows(torch.randn(48, 64))
    bias = torch.randn(48).to(torch.bfloat16)
    got = ref.fp8_linear(qx, sx, qw, sw, bias, torch.bfloat16)
    want = torch._scaled_mm(qx, qw.t(), scale_a=sx[:, None], scale_b=sw[None, :], bias=bias,
                            out_dtype=torch.bfloat16)
    # Both sum exact products in fp32 (the order may differ) and round once to bf16.
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -8, atol=1e-3)


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
    assert 1e-4 < err < 6e-2  # it quantized, and per-row e4m3 on N(0,1) data is a few percent off


def test_fp8_linear_compiles_fullgraph_without_recompiling_and_exports():
    fp8 = compile_ops.FP8Linear.from_linear(_linear())
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fp8, backend=counter, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for length in (5, 9):
            x = torch.randn(2, length, 64)
            torch.testing.assert_close(compiled(x), fp8(x), rtol=0, atol=0)
    assert counter.frame_count == 1
    exported = torch.export.export(fp8, (torch.randn(2, 5, 64),))
    assert any("quantize_fp8_rows" in str(n.target) for n in exported.graph.nodes)
    x = torch.randn(2, 5, 64)
    torch.testing.assert_close(exported.module()(x), fp8(x), rtol=0, atol=0)


def test_fp8_paths_refuse_a_gradient():
    fp8 = compile_ops.FP8Linear.from_linear(_linear())
    with pytest.raises(RuntimeError, match="inference-only"):
        fp8(torch.randn(3, 64, requires_grad=True))
    q, _ = compile_ops.quantize_fp8_rows(torch.randn(3, 8, requires_grad=True))
    with pytest.raises(RuntimeError, match="inference-only"):
        q.float().sum().backward()


def test_bad_inputs_name_the_argument():
    fp8 = compile_ops.FP8Linear.from_linear(_linear())
    with pytest.raises(ValueError, match="64 channels"):
        fp8(torch.randn(3, 32))
    with pytest.raises(TypeError, match="nn.Linear"):
        compile_ops.FP8Linear.from_linear(torch.nn.Conv1d(3, 3, 1))
    with pytest.raises(TypeError, match="fused.quantize_fp8_rows: x must have a floating dtype"):
        compile_ops.quantize_fp8_rows(torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="fused.quantize_fp8_rows: x must have at least 1 dim"):
        compile_ops.quantize_fp8_rows(torch.tensor(1.0))
    qw, sw = compile_ops.quantize_fp8_rows(torch.randn(8, 16))
    with pytest.raises(ValueError, match="weight_q must be float8_e4m3fn"):
        compile_ops.fp8_linear(torch.randn(2, 32), qw, sw)
    with pytest.raises(ValueError, match="weight_scale must be float32"):
        compile_ops.fp8_linear(torch.randn(2, 16), qw, sw.double())


def test_a_gpu_without_fp8_tensor_cores_is_refused_by_name(monkeypatch):
    from compile_ops.ops import fp8 as ops
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(RuntimeError, match="sm_80.*sm_89 or newer"):
        ops.check_fp8_device("cuda")


# ---------------------------------------------------------------- layer 3/4: the kernel


@pytest.mark.kernels
@given(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       st.integers(0, 5), size(st.one_of(st.integers(1, 300), st.sampled_from([3072, 5000])), [1, 37, 3072, 5000]),
       st.booleans(), st.sampled_from(["none", "inf", "nan", "zero_row"]))
def test_kernel_writes_the_references_bytes(dtype, rows, k, strided, special):
    torch.manual_seed(0)
    base = torch.randn(rows, k + 3 if strided else k) * 4
    x = (base[:, 2:2 + k] if strided else base).to(dtype)
    if rows and special != "none":
        if special == "zero_row":
            x[0] = 0
        else:
            x[0, k // 2] = float(special)
    x = x.to(KERNEL_DEVICE)
    q, scale = compile_ops.quantize_fp8_rows(x)
    want_q, want_scale = ref.quantize_fp8_rows(x.cpu())
    assert _same_bytes(q.cpu(), want_q), "e4m3 bytes differ from the reference"
    assert torch.equal(scale.cpu(), want_scale)
