"""The gated-activation family: geglu, swiglu and their shared backward.

``kernels`` tests run the Triton kernel (CUDA, or CPU under the interpreter)
against an fp64 reference with the two-reference tolerance rule, where "what
PyTorch computes at the input dtype" is each library's own formula: diffusers'
``hidden, gate = x.chunk(2, -1); hidden * act(gate)`` for the default order,
vLLM's ``GeluAndMul`` / ``SiluAndMul`` (``act(x[..., :d]) * x[..., d:]``) for
``gate_first``. The rest check validation, the modules and the reference path.
"""

import pytest
import torch
import torch.nn.functional as F
from bad_input import bad_input_test
from conftest import KERNEL_DEVICE
from hypothesis import given
from hypothesis import strategies as st
from numerics import assert_within_torch_error
from shapes import size

import compile_ops

OPS = {"geglu": "none", "geglu_tanh": "tanh", "swiglu": None}


def _call(op, x, gate_first):
    if op == "swiglu":
        return compile_ops.swiglu(x, gate_first)
    return compile_ops.geglu(x, OPS[op], gate_first)


def _act(op, t):
    return F.silu(t) if op == "swiglu" else F.gelu(t, approximate=OPS[op])


def library_formula(op, x, gate_first):
    """diffusers' activation step (value first), or vLLM's ``forward_native`` (gate first)."""
    if gate_first:
        d = x.shape[-1] // 2
        return _act(op, x[..., :d]) * x[..., d:]
    hidden, gate = x.chunk(2, dim=-1)
    return hidden * _act(op, gate)


# ---------------------------------------------------------------- layer 3/4: kernels vs reference


@st.composite
def glu_cases(draw):
    op = draw(st.sampled_from(sorted(OPS)))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    lead = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    h = draw(size(st.one_of(st.integers(1, 160), st.sampled_from([256, 1000, 1536])), [1, 37, 128, 1536]))
    layout = draw(st.sampled_from(["contiguous", "row_slice", "channel_strided"]))
    gate_first = draw(st.booleans())
    scale = draw(st.sampled_from([1.0, 4.0]))  # 4: gates deep in the activations' tails
    return op, dtype, lead, h, layout, gate_first, scale


def _make_x(dtype, lead, h, layout, scale, device):
    n = 2 * h
    if layout == "row_slice":  # rows spaced wider than 2H: a slice of a bigger activation
        x = torch.randn(lead + (n + 6,), device=device)[..., 5 : 5 + n]
    elif layout == "channel_strided":
        x = torch.randn((n,) + lead, device=device).movedim(0, -1)
    else:
        x = torch.randn(lead + (n,), device=device)
    return (scale * x).to(dtype).requires_grad_(True)


@pytest.mark.kernels
@given(glu_cases())
def test_kernels_match_fp64_reference_forward_and_backward(case):
    op, dtype, lead, h, layout, gate_first, scale = case
    x = _make_x(dtype, lead, h, layout, scale, KERNEL_DEVICE)
    out = _call(op, x, gate_first)
    xd = x.detach().double().requires_grad_(True)
    exact = library_formula(op, xd, gate_first)
    x_plain = x.detach().clone().requires_grad_(True)
    plain = library_formula(op, x_plain, gate_first)

    assert out.dtype == dtype and out.shape == lead + (h,) and out.is_contiguous()
    assert_within_torch_error(out, exact, plain, 2.0, f"{op} output")

    dy = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, dy)
    (dx_exact,) = torch.autograd.grad(exact, xd, dy.double())
    (dx_plain,) = torch.autograd.grad(plain, x_plain, dy)
    assert dx.dtype == dtype and dx.shape == x.shape
    assert_within_torch_error(dx, dx_exact, dx_plain, 3.0, f"{op} dx")


@pytest.mark.kernels
@pytest.mark.parametrize("h", [4096, 5000, 12288])
def test_kernels_wide_rows_span_several_programs(h):
    """H past one column block (4096) and not a multiple of it: every program
    of a row must read its own value and gate columns."""
    x = torch.randn(3, 2 * h, device=KERNEL_DEVICE).requires_grad_(True)
    for op in OPS:
        out = _call(op, x, False)
        xd = x.detach().double().requires_grad_(True)
        exact = library_formula(op, xd, False)
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-6)
        dy = torch.randn_like(out)
        (dx,) = torch.autograd.grad(out, x, dy)
        (dx_exact,) = torch.autograd.grad(exact, xd, dy.double())
        torch.testing.assert_close(dx.double(), dx_exact, rtol=1e-5, atol=1e-6)


@pytest.mark.kernels
@pytest.mark.parametrize("op", sorted(OPS))
def test_kernels_nan_and_inf_stay_where_the_formula_puts_them(op):
    x = torch.randn(4, 2 * 24, device=KERNEL_DEVICE)
    x[0, 3] = float("nan")  # a value: its output element only
    x[1, 24 + 5] = float("nan")  # a gate
    x[2, 24 + 7] = float("inf")  # gelu(inf) = silu(inf) = inf
    x[3, 24 + 9] = -float("inf")  # gelu(-inf) = silu(-inf) = 0 -> value * 0
    out = _call(op, x, False)
    exact = library_formula(op, x.double(), False)
    assert torch.equal(torch.isnan(out), torch.isnan(exact))
    assert torch.equal(torch.isinf(out), torch.isinf(exact))
    finite = torch.isfinite(exact)
    torch.testing.assert_close(out.double()[finite], exact[finite], rtol=1e-5, atol=1e-6)


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_modules_are_diffusers_geglu_and_swiglu(dtype):
    """The modules load diffusers' state dicts and give diffusers' outputs and
    gradients (to the rounding of its two-step formula)."""
    activations = pytest.importorskip("diffusers.models.activations")
    torch.manual_seed(0)
    for theirs, ours in (
        (activations.GEGLU(32, 48), compile_ops.GEGLU(32, 48)),
        (activations.SwiGLU(32, 48, bias=False), compile_ops.SwiGLU(32, 48, bias=False)),
    ):
        theirs = theirs.to(KERNEL_DEVICE, dtype)
        ours.load_state_dict(theirs.state_dict())
        ours = ours.to(KERNEL_DEVICE, dtype)
        x = torch.randn(2, 7, 32, device=KERNEL_DEVICE, dtype=dtype)
        want, got = theirs(x), ours(x)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got, want, **tol)
        dy = torch.randn_like(want)
        for p, q in zip(
            torch.autograd.grad(got, list(ours.parameters()), dy),
            torch.autograd.grad(want, list(theirs.parameters()), dy),
        ):
            torch.testing.assert_close(p, q, **tol)


# ---------------------------------------------------------------- reference path


def test_gate_first_is_the_other_half():
    x = torch.randn(3, 20, dtype=torch.float64)
    swapped = torch.cat(x.chunk(2, -1)[::-1], -1)
    for op in OPS:
        torch.testing.assert_close(_call(op, x, True), _call(op, swapped, False), rtol=0, atol=0)


def test_reference_backward_formulas_match_autograd():
    """The closed-form derivatives the reference (and the kernel) use."""
    from compile_ops.reference.glu import activation_derivative

    g = torch.linspace(-12, 12, 2001, dtype=torch.float64).requires_grad_(True)
    for activation, fn in (
        ("gelu", lambda t: F.gelu(t)),
        ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh")),
        ("silu", F.silu),
    ):
        (want,) = torch.autograd.grad(fn(g).sum(), g)
        torch.testing.assert_close(activation_derivative(g.detach(), activation), want, rtol=1e-12, atol=1e-14)


def test_modules_are_drop_ins_on_the_reference_path():
    activations = pytest.importorskip("diffusers.models.activations")
    theirs = activations.GEGLU(8, 12)
    ours = compile_ops.GEGLU(8, 12)
    assert set(ours.state_dict()) == set(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
    assert ours(x, scale=None).shape == (2, 3, 12)  # diffusers' deprecated argument, ignored


# ---------------------------------------------------------------- bad input


def _bad_input_cases():
    x = torch.randn(2, 8)
    return [
        (lambda: compile_ops.geglu(torch.randn(2, 7)), ValueError, r"x must have an even last dim.*\(2, 7\)"),
        (lambda: compile_ops.swiglu(torch.randn(5)), ValueError, r"x must have an even last dim"),
        (lambda: compile_ops.swiglu(torch.tensor(1.0)), ValueError, r"x must have at least 1 dim"),
        (lambda: compile_ops.geglu(torch.ones(2, 8, dtype=torch.int32)), TypeError, r"x must have a floating dtype"),
        (lambda: compile_ops.swiglu(torch.ones(2, 8, dtype=torch.bool)), TypeError, r"x must have a floating dtype"),
        (lambda: compile_ops.geglu(x, "erf"), ValueError, r"approximate must be one of 'none', 'tanh', got 'erf'"),
        (lambda: compile_ops.geglu(x, None), TypeError, r"approximate must be one of .*, got None"),
        (lambda: compile_ops.swiglu(x, 1), TypeError, r"gate_first must be a bool, got int"),
        (
            lambda: torch.ops.fused.glu_backward(torch.randn(2, 8), x, "gelu", False),
            ValueError,
            r"grad_out must have shape \(2, 4\)",
        ),
        (
            lambda: torch.ops.fused.glu_backward(torch.randn(2, 4), x, "relu", False),
            ValueError,
            r"activation must be one of 'gelu', 'gelu_tanh', 'silu', got 'relu'",
        ),
        (
            lambda: torch.ops.fused.glu_backward(torch.ones(2, 4, dtype=torch.int64), x, "silu", False),
            TypeError,
            r"grad_out must have a floating dtype",
        ),
        (
            lambda: torch.ops.fused.glu_backward(torch.randn(2, 4, device="meta"), x, "silu", False),
            ValueError,
            r"grad_out is on meta but x is on cpu",
        ),
    ]


test_bad_input_raises_a_clear_error = bad_input_test(_bad_input_cases)
