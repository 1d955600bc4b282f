"""The fp8 family, part four: ``fused.fp8_linear_lora``, an FP8 Linear with one LoRA
adapter added in its GEMM's epilogue.

The specification is ``compile_ops/reference/fp8.py`` (``fp8_linear_lora``): the
GEMM's fp32 sum scaled per row and channel, plus the bias, plus ``h @ B.T`` with
``h`` formed as ``fp8_rows_lora`` forms it, rounded once. Here: the kernels against
the reference under Hypothesis within a bound derived from the sums' orders and the
one rounding of ``h`` (layers 3/4), refusals, the launches on fake CUDA tensors,
and which path ``FP8LoraLinear`` takes (this op, ``fp8_rows_lora`` after cuBLAS, or
peft's Linears).
"""

import pytest
import torch
from bad_input import bad_input_test
from conftest import HAS_CUDA, INTERPRET, KERNEL_DEVICE
from fp8_helpers import _fake_cuda_launches
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fp8_rows_lora import _one_rounding_bound, _ulp

import compile_ops
from cases.fp8 import fp8_codes
from compile_ops._library import OP_BODIES
from compile_ops.reference import fp8 as ref

pytest.importorskip("peft")

from peft import LoraConfig, inject_adapter_in_model  # noqa: E402

from compile_ops.integrations import peft as fp8_peft  # noqa: E402

#: The relative error of one addition in the GEMM's FP8 sum: fp32 (2**-24) under the
#: interpreter; on Hopper the tensor cores' FP8 accumulation keeps fewer bits between
#: the K steps, as cuBLAS's fast mode does (about 14, DeepSeek-V3's measurement): 2**-13.
GEMM_UNIT = 2.0**-13 if HAS_CUDA and not INTERPRET else 2.0**-24

#: The adapters' (and output's) dtypes: bf16 on a GPU only, the interpreter's dots take none.
DTYPES = [torch.float16] + ([torch.bfloat16] if HAS_CUDA and not INTERPRET else [])


def _inputs(lead, k, n, r, dtype, device="cpu", bias=True):
    q, scale = fp8_codes((*lead, k), device)
    weight_q, weight_scale = fp8_codes((n, k), device)
    weight_scale = weight_scale / max(k, 1) ** 0.5
    lora_a = (torch.randn(r, k, device=device) / max(k, 1) ** 0.5).to(dtype)
    lora_b = (torch.randn(n, r, device=device) * 0.1).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    return q, scale, weight_q, weight_scale, b, lora_a, lora_b


def _bound(q, scale, weight_q, weight_scale, bias, lora_a, lora_b, scaling, scaling_tensor):
    """``(want, bound)``: the reference and how far from it another summation order
    may land: the GEMM's K-term sum (``2 (K + 1) GEMM_UNIT`` of ``|q| @ |w|.T`` scaled),
    the adapter's part as ``test_fp8_rows_lora._one_rounding_bound`` bounds it (h's
    one rounding may tip), and one unit of the output's dtype."""
    k, n = q.shape[-1], weight_q.shape[0]
    m = scale.numel()
    want = ref.fp8_linear_lora(q, scale, weight_q, weight_scale, bias, lora_a, lora_b, scaling, scaling_tensor)
    want = want.reshape(m, n).double()
    q2 = q.reshape(m, k).double()
    gemm = (q2.abs() @ weight_q.double().abs().T) * scale.reshape(m, 1).double() * weight_scale.double()
    zeros = torch.zeros(*q.shape[:-1], n)
    _, adapter = _one_rounding_bound(zeros, q, scale, lora_a, lora_b, scaling, scaling_tensor)
    slack = 2 * (k + 1) * GEMM_UNIT * gemm + adapter.reshape(m, n).double()
    return want, slack + 2 * _ulp(want.abs() + slack, lora_b.dtype)


@pytest.mark.kernels
@settings(max_examples=30)
@given(
    rows=st.sampled_from([(1,), (2, 3), (130,), (3, 70)]),
    k=st.sampled_from([16, 48, 160, 1040]),
    n=st.sampled_from([8, 24, 136]),
    r=st.sampled_from([0, 3, 16, 17, 64]),
    dtype=st.sampled_from(DTYPES),
    bias=st.booleans(),
    scaling=st.sampled_from([0.5, -2.0]),
    tensor_scaling=st.booleans(),
)
def test_kernels_match_the_reference_within_the_sums_orders(rows, k, n, r, dtype, bias, scaling, tensor_scaling):
    torch.manual_seed(sum(rows) * k + n + r)
    args = _inputs(rows, k, n, r, dtype, KERNEL_DEVICE, bias)
    scaling_tensor = torch.tensor(0.75, device=KERNEL_DEVICE) if tensor_scaling else None
    got = compile_ops.fp8_linear_lora(compile_ops.FP8Rows(*args[:2]), *args[2:], scaling, scaling_tensor)
    assert got.dtype == dtype and got.shape == (*rows, n)
    cpu = [None if t is None else t.cpu() for t in args]
    want, bound = _bound(*cpu, scaling, None if scaling_tensor is None else scaling_tensor.cpu())
    err = (got.cpu().reshape(want.shape).double() - want).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item():.3g}"


@pytest.mark.kernels
def test_a_row_of_nan_codes_gives_a_nan_output_row():
    q, scale, *rest = _inputs((4,), 32, 24, 8, torch.float16, KERNEL_DEVICE)
    q[1, 5] = float("nan")
    got = compile_ops.fp8_linear_lora(compile_ops.FP8Rows(q, scale), *rest, 0.5)
    assert got[1].isnan().all() and not got[[0, 2, 3]].isnan().any()


def test_two_launches_whose_constants_do_not_depend_on_the_row_count():
    """Fake CUDA: the down kernel and the GEMM, whose tiles and K slices are chosen by
    channel dims only (the grid is at most one program per SM), so a new sequence
    length compiles nothing."""
    seen = []
    for rows in (5, 4096):
        args = _inputs((1, rows), 3072, 3072, 64, torch.bfloat16)
        _, out, launches = _fake_cuda_launches(lambda *a: OP_BODIES["fused::fp8_linear_lora"](*a, 1.0, None), *args)
        assert out.shape == (1, rows, 3072) and out.dtype == torch.bfloat16
        assert [name for name, _, _ in launches] == ["lora_down_kernel", "fp8_linear_lora_kernel"]
        seen.append(
            [
                {k: v for k, v in kw.items() if k.isupper() and k != "M" and isinstance(v, (int, bool))}
                for _, kw, _ in launches
            ]
        )
        (_, down, down_grid), (_, gemm, _) = launches
        assert gemm["splits"] == down_grid[1] > 1 and gemm["HAS_BIAS"] and not gemm["HAS_SCALING_TENSOR"]
    assert seen[0] == seen[1]


def _refusals():
    q, scale, w, ws, bias, a, b = _inputs((2, 3), 16, 8, 4, torch.float16)
    rows = compile_ops.FP8Rows(q, scale)
    op = compile_ops.fp8_linear_lora
    return [
        (lambda: op(q, w, ws, bias, a, b), TypeError, r"x must be an FP8Rows"),
        (lambda: op(rows, w.float(), ws, bias, a, b), TypeError, r"weight_q must be torch.float8_e4m3fn"),
        (lambda: op(rows, w[:, :8], ws, bias, a, b), ValueError, r"weight_q must be \[N, 16\]"),
        (lambda: op(rows, w, ws[:4], bias, a, b), ValueError, r"weight_scale must be \[8\]"),
        (lambda: op(rows, w, ws, bias[:4], a, b), ValueError, r"bias must be \[8\]"),
        (lambda: op(rows, w, ws, bias, a[:, :8], b), ValueError, r"lora_a must be \[r, 16\]"),
        (lambda: op(rows, w, ws, bias, a, b[:, :3]), ValueError, r"lora_b must be \[8, 4\]"),
        (lambda: op(rows, w, ws, bias, a.float(), b.float()), TypeError, r"must be float16 or bfloat16"),
        (lambda: op(compile_ops.FP8Rows(q, scale[:, :1]), w, ws, bias, a, b), ValueError, r"scale must be \[2, 3\]"),
        (lambda: op(rows, w, ws, bias, a.to("meta"), b), ValueError, r"lora_a is on meta but q"),
        (lambda: op(rows, w, ws, bias, a.requires_grad_(), b), RuntimeError, r"inference-only"),
    ]


test_bad_input_raises_a_clear_error = bad_input_test(_refusals)


# ---------------------------------------------------------------- FP8LoraLinear: which path


def _layer(adapters=("a",), dtype=torch.float16):
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 48).to(dtype)
    net = torch.nn.Sequential(compile_ops.FP8Linear.from_linear(linear), torch.nn.LayerNorm(48))
    for name in adapters:
        inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["0"]), net, name)
    layer = net[0]
    for p in layer.lora_B.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layer.set_adapter(list(adapters))
    return layer


@pytest.fixture
def fused_calls(monkeypatch):
    """Every ``fp8_linear_lora`` call FP8LoraLinear makes, and the fused path allowed
    where the layer would take it on a Hopper GPU (the interpreter on the CPU)."""
    calls = []

    def spy(rows, *args):
        calls.append(args[-2:])
        return compile_ops.fp8_linear_lora(rows, *args)

    monkeypatch.setattr(fp8_peft, "fp8_linear_lora", spy)
    monkeypatch.setattr(fp8_peft._library, "has_tma", lambda t: True)
    return calls


@pytest.mark.parametrize("adapters", [("a",), ("a", "b")], ids=["one", "two"])
def test_the_first_adapter_runs_in_the_gemm_s_epilogue(adapters, fused_calls):
    """The first active adapter goes into the GEMM; any other follows as
    ``fp8_rows_lora`` on its output, which is what the layer computes."""
    layer = _layer(adapters)
    rows = compile_ops.quantize_fp8_rows(torch.randn(3, 5, 32).half())
    base = layer.get_base_layer()
    with torch.no_grad():
        got = layer(rows)
    assert fused_calls == [(layer.scaling["a"], None)]
    a, b = layer.lora_A["a"].weight, layer.lora_B["a"].weight
    want = ref.fp8_linear_lora(rows.q, rows.scale, base.weight_q, base.weight_scale, base.bias, a, b, 2.0)
    if "b" in adapters:
        second = layer.lora_A["b"].weight, layer.lora_B["b"].weight
        want = ref.fp8_rows_lora(want, rows.q, rows.scale, *second, layer.scaling["b"])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["grad", "hooked_base", "slow_accum", "disabled"])
def test_the_gemm_keeps_cublas_where_the_epilogue_cannot_serve(case, fused_calls):
    layer = _layer()
    base = layer.get_base_layer()
    if case == "hooked_base":
        base.register_forward_pre_hook(lambda module, args: None)
    if case == "slow_accum":
        base.fast_accum = False
    if case == "disabled":
        layer.enable_adapters(False)
    rows = compile_ops.quantize_fp8_rows(torch.randn(2, 32).half())
    with torch.set_grad_enabled(case == "grad"):
        if case == "grad":
            layer.lora_A["a"].weight.requires_grad_()
        layer(rows)
    assert fused_calls == []


def test_off_hopper_the_layer_keeps_cublas_and_fp8_rows_lora(monkeypatch):
    calls = []
    monkeypatch.setattr(fp8_peft, "fp8_linear_lora", lambda *a: calls.append(a))
    monkeypatch.setattr(fp8_peft._library, "has_tma", lambda t: False)
    monkeypatch.setattr(fp8_peft._library, "INTERPRET", False)
    layer = _layer()
    with torch.no_grad():
        layer(compile_ops.quantize_fp8_rows(torch.randn(2, 32).half()))
    assert calls == []
