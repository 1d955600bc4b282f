"""The fp8 family, part three: ``fused.fp8_rows_lora``, one LoRA adapter on FP8 rows.

The specification is ``compile_ops/reference/fp8.py`` (``fp8_rows_lora``):
the down projection summed in fp32 from the codes, times the row's scale and
the scaling in fp32, rounded once to the adapters' dtype, the up projection
summed in fp32 and added to result before the one rounding to result's dtype.
Here: refusals, the launches on fake CUDA tensors (two, none depending on the
row count), one compile across sequence lengths and scaling values (layers
1-2); the kernels against the reference under Hypothesis, within the bound of
the one adapter-dtype rounding their fp32 sums may tip, non-finite rows, and
the same bits on every run (layers 3/4). Which path ``FP8LoraLinear`` takes
(this op or peft's Linears) is checked here too; its models are
test_fp8_lora.py's.
"""

import math

import pytest
import torch
from bad_input import bad_input_test
from conftest import HAS_CUDA, INTERPRET, KERNEL_DEVICE, concurrent_programs_only
from fp8_helpers import _fake_cuda_launches
from hypothesis import given, settings
from hypothesis import strategies as st
from numerics import assert_same_nonfinite
from shapes import size

import compile_ops
from cases.fp8 import fp8_codes
from compile_ops._library import OP_BODIES
from compile_ops.reference import fp8 as ref

pytest.importorskip("peft")

from peft import LoraConfig, inject_adapter_in_model  # noqa: E402

from compile_ops.integrations import peft as fp8_peft  # noqa: E402


def _inputs(lead, k, n, r, result_dtype, adapter_dtype, device="cpu", result_scale=1.0):
    q, scale = fp8_codes((*lead, k), device)
    result = (torch.randn(*lead, n, device=device) * result_scale).to(result_dtype)
    lora_a = (torch.randn(r, k, device=device) / max(k, 1) ** 0.5).to(adapter_dtype)
    lora_b = torch.randn(n, r, device=device).to(adapter_dtype)
    return result, q, scale, lora_a, lora_b


# ---------------------------------------------------------------- the bound of one rounding


def _ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at ``|t|`` (fp64), subnormals included."""
    info = torch.finfo(dtype)
    exponent = torch.floor(torch.log2(t.abs().clamp(min=info.smallest_normal)))
    return torch.exp2(exponent) * info.eps


def _one_rounding_bound(result, q, scale, lora_a, lora_b, scaling, scaling_tensor):
    """``(want, bound)``: the reference's output and how far from it, element by
    element, another fp32 summation order may land. The down projection's sum
    (K products, rounded in fp32 in any order) may differ by ``2 (K + 1) u``
    of ``|q| @ |A|.T`` (u = 2**-24); the row factor is the same fp32 product in
    both; so the rounding of ``h`` to the adapters' dtype may tip only where a
    rounding boundary lies that close, and there by one unit of the adapters'
    dtype (fp32 adapters: by that margin, many units). The up projection's
    sum and result's add: ``2 (r + 2) u`` of their magnitudes. Then one unit
    of result's dtype for its final rounding."""
    u = 2.0**-24
    k, n, r = q.shape[-1], result.shape[-1], lora_a.shape[0]
    m = scale.numel()
    q2, adapter = q.reshape(m, k).double(), lora_a.dtype
    s = torch.tensor(float(scaling), dtype=torch.float32)
    if scaling_tensor is not None:
        s = s * scaling_tensor.float()
    factor = (scale.reshape(m, 1).float() * s).double()
    # The reference's h, restated (the reference returns only the output).
    h = ((q2.float() @ lora_a.float().T) * factor.float()).to(adapter)
    pre = (q2.float() @ lora_a.float().T).double() * factor
    margin = 2 * (k + 1) * u * (q2.abs() @ lora_a.double().abs().T) * factor.abs() + 4 * u * pre.abs()
    # Widened twice over: the fp64 -> adapter dtype conversion may round through fp32 first.
    tips = (pre - 2 * margin).to(adapter) != (pre + 2 * margin).to(adapter)
    # Where the rounding may tip, h moves by up to the margin and a unit of its dtype (two at a binade's
    # edge): one unit for 16-bit adapters, whose margins are far below their unit; many fp32 units for fp32.
    h_slack = torch.where(tips, 2 * margin + 2 * _ulp(h.double(), adapter), 0.0)
    b = lora_b.double()
    up = h.double().abs() @ b.abs().T
    res = result.reshape(m, n).double()
    delta = h_slack @ b.abs().T + 2 * (r + 2) * u * (up + res.abs())
    want = ref.fp8_rows_lora(result, q, scale, lora_a, lora_b, scaling, scaling_tensor).reshape(m, n)
    bound = delta + _ulp(want.double().abs() + delta, result.dtype)
    return want.reshape(result.shape), bound.reshape(result.shape)


#: (result dtype, adapters' dtype). bf16 adapters on a GPU only: the interpreter
#: multiplies bf16 dot operands as raw bits (the op refuses them there).
DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float16),
    (torch.float32, torch.float16),
] + ([(torch.bfloat16, torch.bfloat16)] if HAS_CUDA and not INTERPRET else [])


@pytest.mark.kernels
@settings(max_examples=30)
@given(
    dtypes=st.sampled_from(DTYPE_PAIRS),
    m=size(st.integers(1, 70), [1, 37, 128]),
    k=size(st.integers(1, 2200), [16, 200, 3072]),
    n=size(st.integers(1, 700), [8, 72, 3072]),
    r=size(st.integers(1, 20), [1, 16, 64]),
    scaling=st.sampled_from([1.0, 0.5, -2.0, 0.0625]),
    tensor_scaling=st.booleans(),
    result_scale=st.sampled_from([1.0, 0.01]),
    seed=st.integers(0, 2**16),
)
def test_kernels_match_the_reference_within_one_rounding_of_the_adapters_dtype(
    dtypes, m, k, n, r, scaling, tensor_scaling, result_scale, seed
):
    """The kernels' output against the reference's, element by element, within
    :func:`_one_rounding_bound` (a 1% error in the row factor fails it: the
    adapters' h would be off by many units of its dtype)."""
    result_dtype, adapter_dtype = dtypes
    torch.manual_seed(seed)
    lead = (2, m) if m % 2 == 0 else (m,)
    args = _inputs(lead, k, n, r, result_dtype, adapter_dtype, KERNEL_DEVICE, result_scale)
    scaling_tensor = torch.tensor(1.25, device=KERNEL_DEVICE) if tensor_scaling else None
    got = compile_ops.fp8_rows_lora(*args, scaling, scaling_tensor)
    cpu = [t.cpu() for t in args] + [scaling, None if scaling_tensor is None else scaling_tensor.cpu()]
    want, bound = _one_rounding_bound(*cpu)
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    err = (got.cpu().double() - want.double()).abs()
    assert (err <= bound).all(), f"error {err.max():.3g} past the bound by {(err - bound).max():.3g}"


@pytest.mark.kernels
def test_a_long_k_in_its_own_slices_matches_the_reference():
    """K past ``LORA_LONG_K`` (an MLP's down projection) is cut in the longer
    slices, a count the hypothesis sizes above do not reach: the partial sums
    of every slice, the last one short, still add up to the reference's."""
    from compile_ops.ops import fp8 as fp8_ops

    k = fp8_ops.LORA_LONG_K + 257
    launch = fp8_ops.lora_launch(8, k)
    assert launch.splits == math.ceil(k / fp8_ops.LORA_LONG_SPLIT_COLUMNS) < math.ceil(k / fp8_ops.LORA_SPLIT_COLUMNS)
    assert launch.splits * launch.k_per_split - k >= 1  # the last slice short
    torch.manual_seed(0)
    args = _inputs((5,), k, 24, 8, torch.float32, torch.float32, KERNEL_DEVICE)
    got = compile_ops.fp8_rows_lora(*args, 0.5)
    want, bound = _one_rounding_bound(*[t.cpu() for t in args], 0.5, None)
    err = (got.cpu().double() - want.double()).abs()
    assert (err <= bound).all(), f"error {err.max():.3g} past the bound by {(err - bound).max():.3g}"


@pytest.mark.kernels
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS[:2], ids=["fp32", "fp16"])
def test_non_finite_rows_propagate_as_the_dequantized_rows_would(dtypes):
    """A row of x holding +-inf or NaN (quantized: infinite scale and NaN codes,
    or a NaN code), a NaN scale: that output row is NaN, as the dequantized
    rows through torch's Linears make it; +-inf and NaN in result stay where
    they are; every other element is finite."""
    result_dtype, adapter_dtype = dtypes
    x = torch.randn(6, 40, device=KERNEL_DEVICE)
    x[1, 3], x[2, 5], x[3, 0] = float("inf"), float("-inf"), float("nan")
    q, scale = compile_ops.quantize_fp8_rows(x)
    scale[4] = float("nan")
    result, _, _, lora_a, lora_b = _inputs((6,), 40, 24, 4, result_dtype, adapter_dtype, KERNEL_DEVICE)
    result[0, 7], result[5, 2], result[5, 9] = float("inf"), float("-inf"), float("nan")
    got = compile_ops.fp8_rows_lora(result, q, scale, lora_a, lora_b, 0.5).cpu()
    cpu = (result.cpu(), q.cpu(), scale.cpu(), lora_a.cpu(), lora_b.cpu())
    assert_same_nonfinite(got, ref.fp8_rows_lora(*cpu, 0.5))
    dequantized = cpu[1].float() * cpu[2][:, None]
    torch_path = (cpu[0].float() + (dequantized @ cpu[3].float().T * 0.5) @ cpu[4].float().T).to(result_dtype)
    assert_same_nonfinite(got, torch_path)
    assert got[1:5].isnan().all() and got[[0, 5]].isfinite().sum() == 2 * 24 - 3


@pytest.mark.kernels
@concurrent_programs_only
def test_the_same_bits_on_every_run():
    """Partial sums per K slice, added in a fixed order: no atomics, so reruns agree bit for bit."""
    args = _inputs((2, 300), 3072, 640, 64, torch.float16, torch.float16, KERNEL_DEVICE)
    first = compile_ops.fp8_rows_lora(*args, 0.5)
    assert all(torch.equal(first, compile_ops.fp8_rows_lora(*args, 0.5)) for _ in range(3))


# ---------------------------------------------------------------- layers 1-2: launches, compile, refusals


def test_two_launches_whose_constants_do_not_depend_on_the_row_count():
    """Fake CUDA: the down and the up kernel, with the K slices and the tiles
    chosen by channel dims only, so a new sequence length compiles nothing."""
    seen = []
    for rows in (5, 4096):
        args = _inputs((1, rows), 3072, 3072, 64, torch.bfloat16, torch.bfloat16)
        _, out, launches = _fake_cuda_launches(lambda *a: OP_BODIES["fused::fp8_rows_lora"](*a, 1.0, None), *args)
        assert out.shape == (1, rows, 3072) and out.dtype == torch.bfloat16
        assert [name for name, _, _ in launches] == ["lora_down_kernel", "lora_up_kernel"]
        constants = [
            {k: v for k, v in kw.items() if k.isupper() and isinstance(v, (int, bool))} for _, kw, _ in launches
        ]
        seen.append(constants)
        (_, down, down_grid), (_, up, _) = launches
        partial = down["PARTIAL"].meta["val"]
        assert partial.shape == (down_grid[1], rows, 64) and partial.dtype == torch.float32
        assert down_grid[1] > 1 and down["k_per_split"] * down_grid[1] >= 3072  # K split across programs
        assert up["splits"] == down_grid[1] and not up["HAS_SCALING_TENSOR"]
    assert seen[0] == seen[1]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_one_compile_across_lengths_and_scaling_values(backend):
    """torch.compile(fullgraph=True): the op traces without a break, one graph
    serves three sequence lengths and a new value of the scaling tensor
    (a hotswap) recompiles nothing."""
    import torch._dynamo.testing

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    f = torch.compile(compile_ops.fp8_rows_lora, backend=counter, fullgraph=True)
    scaling_tensor = torch.tensor(0.5)
    for length, value in ((5, 0.5), (9, 2.0), (17, -1.0)):
        args = _inputs((2, length), 32, 24, 4, torch.float32, torch.float32)
        for t in args[:3]:
            torch._dynamo.mark_dynamic(t, 1)
        scaling_tensor.fill_(value)
        got = f(*args, 0.25, scaling_tensor)
        torch.testing.assert_close(got, ref.fp8_rows_lora(*args, 0.25, scaling_tensor), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def _refusals():
    result, q, scale, lora_a, lora_b = _inputs((2, 3), 16, 8, 4, torch.float32, torch.float32)
    op = compile_ops.fp8_rows_lora
    return [
        (lambda: op(result, q.float(), scale, lora_a, lora_b), TypeError, r"q must be float8_e4m3fn"),
        (lambda: op(result, q[:, :2], scale, lora_a, lora_b), ValueError, r"q must be \[\.\.\., K\] with result's"),
        (lambda: op(result, q, scale.double(), lora_a, lora_b), TypeError, r"scale must be float32"),
        (lambda: op(result, q, scale[:, :1], lora_a, lora_b), ValueError, r"scale must be \[2, 3\]"),
        (lambda: op(result, q, scale, lora_a[:, :8], lora_b), ValueError, r"lora_a must be \[r, 16\]"),
        (lambda: op(result, q, scale, lora_a, lora_b[:, :3]), ValueError, r"lora_b must be \[8, 4\].*rank"),
        (lambda: op(result, q, scale, lora_a, lora_b.half()), TypeError, r"lora_b must have lora_a's dtype"),
        (lambda: op(result, q, scale, lora_a.double(), lora_b.double()), TypeError, r"lora_a must be float16"),
        (lambda: op(result, q, scale, lora_a[0], lora_b), ValueError, r"lora_a must be 2-D"),
        (
            lambda: op(result, q, scale, lora_a, lora_b, 1.0, torch.ones(1)),
            ValueError,
            r"scaling_tensor must be a 0-dim",
        ),
        (lambda: op(result, q, scale, lora_a, lora_b, float("nan")), ValueError, r"scaling must be a number"),
        (lambda: op(result, q, scale, lora_a.to("meta"), lora_b), ValueError, r"lora_a is on meta but result"),
        (lambda: op(result, q, scale, lora_a.requires_grad_(), lora_b), RuntimeError, r"inference-only"),
    ]


test_bad_input_raises_a_clear_error = bad_input_test(_refusals)


def test_the_op_has_no_gradient():
    result, q, scale, lora_a, lora_b = _inputs((3,), 16, 8, 4, torch.float32, torch.float32)
    out = torch.ops.fused.fp8_rows_lora(result.requires_grad_(), q, scale, lora_a, lora_b, 1.0, None)
    with pytest.raises(RuntimeError, match="fused.fp8_rows_lora: FP8 paths are inference-only"):
        out.sum().backward()


# ---------------------------------------------------------------- FP8LoraLinear: which path


def _layer(dtype=torch.float32, **config):
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 48).to(dtype)
    # The LayerNorm gives peft a parameter to read the model's device from.
    net = torch.nn.Sequential(compile_ops.FP8Linear.from_linear(linear), torch.nn.LayerNorm(48))
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["0"], **config), net, "a")
    layer = net[0]
    for p in layer.lora_B.parameters():
        torch.nn.init.normal_(p)
    return layer


@pytest.fixture
def op_calls(monkeypatch):
    """The scalings of every ``fp8_rows_lora`` call FP8LoraLinear makes."""
    calls = []

    def spy(result, q, scale, lora_a, lora_b, scaling, scaling_tensor):
        calls.append((scaling, scaling_tensor))
        return compile_ops.fp8_rows_lora(result, q, scale, lora_a, lora_b, scaling, scaling_tensor)

    monkeypatch.setattr(fp8_peft, "fp8_rows_lora", spy)
    return calls


def _peft_path(layer, rows):
    """The layer's output through peft's Linears on the dequantized rows."""
    seen = rows.dequantized()
    delta = layer.lora_B["a"](layer.lora_A["a"](seen.to(layer.lora_A["a"].weight.dtype))) * layer.scaling["a"]
    return (layer.base_layer(rows).float() + delta.float()).to(layer.base_layer.out_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_inference_call_runs_the_op_and_matches_peft_s_path(dtype, op_calls):
    layer = _layer(dtype)
    rows = compile_ops.quantize_fp8_rows(torch.randn(3, 5, 32).to(dtype))
    with torch.no_grad():
        got = layer(rows)
        want = _peft_path(layer, rows)
    assert op_calls == [(layer.scaling["a"], None)]
    # peft's path rounds the dequantized rows to the adapters' dtype before lora_A; the op does not.
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.kernels
@pytest.mark.skipif(not INTERPRET, reason="a property of triton's interpreter, which runs bf16 dots on raw bits")
def test_bf16_adapters_take_peft_s_path_under_the_interpreter(op_calls):
    layer = _layer(torch.bfloat16)
    rows = compile_ops.quantize_fp8_rows(torch.randn(2, 5, 32).bfloat16())
    with torch.no_grad():
        got, want = layer(rows), _peft_path(layer, rows)
    assert op_calls == []
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_a_hotswap_ready_adapter_passes_its_scaling_tensor(op_calls):
    from peft.utils.hotswap import prepare_model_for_compiled_hotswap

    layer = _layer()
    prepare_model_for_compiled_hotswap(torch.nn.Sequential(layer, torch.nn.LayerNorm(48)), target_rank=8)
    assert isinstance(layer.scaling["a"], torch.Tensor)
    rows = compile_ops.quantize_fp8_rows(torch.randn(4, 32))
    with torch.no_grad():
        got = layer(rows)
        want = _peft_path(layer, rows)
    ((scaling, scaling_tensor),) = op_calls
    assert scaling == 1.0 and scaling_tensor is layer.scaling["a"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _hooked(layer):
    layer.lora_A["a"].register_forward_pre_hook(lambda module, args: None)


@pytest.mark.parametrize(
    "case",
    ["grad", "dropout", "lora_bias", "adapter_names", "hooked", "b_dtype"],
)
def test_peft_s_path_where_the_op_cannot_serve(case, op_calls):
    """Training (gradients), active dropout, ``lora_bias``, per-sample adapters,
    a hooked adapter Linear, B in another dtype than the output: peft's path,
    with its output."""
    config = {"lora_dropout": 0.5} if case == "dropout" else {"lora_bias": True} if case == "lora_bias" else {}
    layer = _layer(**config)
    if case == "hooked":
        _hooked(layer)
    if case == "b_dtype":
        layer.lora_A["a"].half()
        layer.lora_B["a"].half()
    rows = compile_ops.quantize_fp8_rows(torch.randn(2, 5, 32))
    kwargs = {"adapter_names": ["a", "a"]} if case == "adapter_names" else {}
    with torch.set_grad_enabled(case == "grad"):
        got = layer(rows, **kwargs)
        if case == "dropout":  # dropout draws its mask: the same path in eval mode has none
            assert op_calls == []
            layer.eval()
            got, want = layer(rows), _peft_path(layer, rows)
            assert op_calls == [(layer.scaling["a"], None)]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            return
        want = _peft_path(layer, rows)  # lora_B's bias included
    assert op_calls == []
    torch.testing.assert_close(got, want, rtol=1e-3 if case == "b_dtype" else 1e-5, atol=1e-3)
    if case == "grad":
        got.sum().backward()
        assert layer.lora_A["a"].weight.grad is not None
