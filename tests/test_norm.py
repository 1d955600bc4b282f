"""The norm family: rmsnorm, add_rmsnorm, layernorm and their shared backward.

``kernels`` tests run the Triton kernels (CUDA, or CPU under the interpreter)
against an fp64 reference with the two-reference tolerance rule; the rest
check validation, modules and tracing on the reference path.
"""

import expecttest
import pytest
import torch
import torch.nn.functional as F
from bad_input import bad_input_test
from conftest import KERNEL_DEVICE, concurrent_programs_only
from hypothesis import given
from hypothesis import strategies as st
from numerics import assert_within_torch_error
from shapes import size
from torch._subclasses.fake_tensor import FakeTensorMode

import compile_ops
from compile_ops._library import OP_BODIES
from compile_ops.reference import norm as ref

HALF = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------- what plain PyTorch computes


def _torch_at_dtype(op, x, residual, weight, bias, eps):
    """The op as an uncompiled model writes it, in the input dtype (no upcast)."""
    out_dtype = weight.dtype if weight is not None and weight.dtype in HALF else x.dtype
    h = None
    if op == "add_rmsnorm":
        h = (x + residual.to(x.dtype)).to(residual.dtype)
        x = h
    if op == "layernorm":
        xc = x - x.mean(-1, keepdim=True)
        y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    else:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y.to(out_dtype), h


def _call(op, x, residual, weight, bias, eps):
    if op == "rmsnorm":
        return compile_ops.rmsnorm(x, weight, eps, bias), None
    if op == "layernorm":
        return compile_ops.layernorm(x, weight, bias, eps), None
    return compile_ops.add_rmsnorm(x, residual, weight, eps)


def _reference(op, x, residual, weight, bias, eps):
    """fp64 reference from the same (low-precision) inputs."""
    up = [
        None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in (x, residual, weight, bias)
    ]
    xd, rd, wd, bd = up
    if op == "rmsnorm":
        out, h = ref.rmsnorm(xd, wd, eps, bd), None
    elif op == "layernorm":
        out, h = ref.layernorm(xd, wd, bd, eps), None
    else:
        h = xd + rd
        out = ref.rmsnorm(h.to(residual.dtype).double(), wd, eps)  # the op rounds h first
    return (out, h), up


# ---------------------------------------------------------------- layer 3/4: kernels vs reference


@st.composite
def norm_cases(draw):
    op = draw(st.sampled_from(["rmsnorm", "layernorm", "add_rmsnorm"]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    lead = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    n = draw(size(st.one_of(st.integers(1, 200), st.sampled_from([256, 1000, 1536, 3072])), [1, 37, 128, 1000, 3072]))
    weight = draw(st.sampled_from(["none", "same", "fp32"]))
    bias = op != "add_rmsnorm" and draw(st.booleans())
    strided = draw(st.booleans())
    residual_dtype = draw(st.sampled_from([dtype, torch.float32]))
    eps = draw(st.sampled_from([1e-6, 1e-5, 0.1]))
    return op, dtype, lead, n, weight, bias, strided, residual_dtype, eps


def _make_case(op, dtype, lead, n, weight, bias, strided, residual_dtype, device):
    shape = lead + (n,)
    if strided:  # rows spaced wider than n: a slice of a bigger activation
        x = torch.randn(lead + (n + 7,), device=device).to(dtype)[..., 3 : 3 + n]
    else:
        x = torch.randn(shape, device=device).to(dtype)
    x.requires_grad_(True)
    wdtype = {"same": dtype, "fp32": torch.float32}.get(weight)
    w = None if wdtype is None else (1 + 0.2 * torch.randn(n, device=device)).to(wdtype).requires_grad_(True)
    b = (0.2 * torch.randn(n, device=device)).to(wdtype or dtype).requires_grad_(True) if bias else None
    r = torch.randn(shape, device=device).to(residual_dtype).requires_grad_(True) if op == "add_rmsnorm" else None
    return x, r, w, b


@pytest.mark.kernels
@given(norm_cases())
def test_kernels_match_fp64_reference_forward_and_backward(case):
    op, dtype, lead, n, weight, bias, strided, residual_dtype, eps = case
    x, r, w, b = _make_case(op, dtype, lead, n, weight, bias, strided, residual_dtype, KERNEL_DEVICE)
    out, h = _call(op, x, r, w, b, eps)
    (ref_out, ref_h), ref_inputs = _reference(op, x, r, w, b, eps)
    plain_out, plain_h = _torch_at_dtype(op, *[None if t is None else t.detach() for t in (x, r, w, b)], eps)

    assert out.dtype == plain_out.dtype
    assert_within_torch_error(out, ref_out, plain_out, 2.0, f"{op} output")
    if h is not None:
        assert h.dtype == residual_dtype
        assert torch.equal(h, (x.detach().double() + r.detach().double()).to(residual_dtype)), (
            "residual_out is not x + residual rounded once"
        )

    # Backward: the same random upstream gradient through all three computations.
    dy = torch.randn_like(out)
    dh = torch.randn_like(h) if h is not None else None
    inputs = [t for t in (x, r, w, b) if t is not None]
    outs = [out] + ([h] if h is not None else [])
    grads_out = [dy] + ([dh] if dh is not None else [])
    got = torch.autograd.grad(outs, inputs, grads_out)

    ref_in = [t for t in ref_inputs if t is not None]
    ref_outs = [ref_out] + ([ref_h] if ref_h is not None else [])
    exact = torch.autograd.grad(ref_outs, ref_in, [g.double() for g in grads_out])

    plain_in = [t.detach().clone().requires_grad_(True) for t in inputs]
    pi = iter(plain_in)
    px, pr, pw, pb = [None if t is None else next(pi) for t in (x, r, w, b)]
    p_out, p_h = _torch_at_dtype(op, px, pr, pw, pb, eps)
    p_outs = [p_out] + ([p_h] if p_h is not None else [])
    plain = torch.autograd.grad(p_outs, plain_in, grads_out, allow_unused=True)

    for name, g, e, p, t in zip("x residual weight bias".split(), got, exact, plain, inputs):
        assert g.dtype == t.dtype, f"d{name} dtype"
        assert_within_torch_error(g, e, p, 3.0, f"{op} d{name}")


@pytest.mark.kernels
@pytest.mark.parametrize("n", [1, 2, 16385, 65536])
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_kernels_hidden_sizes_from_1_to_65536(op, n):
    """Past MAX_SINGLE_BLOCK the looped kernels take over."""
    x = torch.randn(3, n, device=KERNEL_DEVICE).requires_grad_(True)
    w = (1 + 0.2 * torch.randn(n, device=KERNEL_DEVICE)).requires_grad_(True)
    out, _ = _call(op, x, None, w, None, 1e-5)
    (ref_out, _), (xd, _, wd, _) = _reference(op, x, None, w, None, 1e-5)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, w), dy)
    ex, ew = torch.autograd.grad(ref_out, (xd, wd), dy.double())
    torch.testing.assert_close(gx.double(), ex, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw.double(), ew, rtol=1e-4, atol=1e-4)


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_add_rmsnorm_out_is_rmsnorm_of_residual_out(dtype):
    x = torch.randn(4, 37, 96, device=KERNEL_DEVICE).to(dtype)
    r = torch.randn(4, 37, 96, device=KERNEL_DEVICE).to(dtype)
    w = torch.randn(96, device=KERNEL_DEVICE).to(dtype)
    out, h = compile_ops.add_rmsnorm(x, r, w, 1e-6)
    assert torch.equal(out, compile_ops.rmsnorm(h, w, 1e-6))


@pytest.mark.kernels
@concurrent_programs_only
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm", "add_rmsnorm"])
def test_kernels_backward_is_deterministic(op):
    """Many rows, so many programs' partial sums meet in the weight gradient
    (201 rows in tiles of 16: 13 programs)."""
    x, r, w, b = _make_case(
        op, torch.bfloat16, (3, 67), 160, "fp32", op == "layernorm", False, torch.float32, KERNEL_DEVICE
    )
    out, _ = _call(op, x, r, w, b, 1e-6)
    dy = torch.randn_like(out)
    inputs = [t for t in (x, r, w, b) if t is not None]
    first = torch.autograd.grad(out, inputs, dy, retain_graph=True)
    for _ in range(2):
        again = torch.autograd.grad(out, inputs, dy, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.kernels
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm", "add_rmsnorm"])
def test_kernels_nan_and_inf_stay_in_their_rows(op):
    x = torch.randn(6, 40, device=KERNEL_DEVICE)
    x[1, 3] = float("nan")
    x[4, 0] = float("inf")
    r = torch.randn(6, 40, device=KERNEL_DEVICE) if op == "add_rmsnorm" else None
    w = torch.randn(40, device=KERNEL_DEVICE)
    out, _ = _call(op, x, r, w, None, 1e-6)
    (ref_out, _), _ = _reference(op, x, r, w, None, 1e-6)
    assert torch.equal(torch.isnan(out), torch.isnan(ref_out))
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2, 3, 5]]).all()
    finite = torch.isfinite(ref_out)
    torch.testing.assert_close(out.double()[finite], ref_out[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.kernels
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_kernels_expanded_gradient_from_sum_backward(op):
    """y.sum().backward() hands the backward a stride-0 gradient."""
    x = torch.randn(2, 9, 48, device=KERNEL_DEVICE, requires_grad=True)
    w = torch.randn(48, device=KERNEL_DEVICE, requires_grad=True)
    out, _ = _call(op, x, None, w, None, 1e-6)
    out.sum().backward()
    (ref_out, _), (xd, _, wd, _) = _reference(op, x, None, w, None, 1e-6)
    ref_out.sum().backward()
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), wd.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.kernels
@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16)])
def test_kernels_zero_rows(shape):
    x = torch.randn(shape, device=KERNEL_DEVICE, requires_grad=True)
    w = torch.randn(16, device=KERNEL_DEVICE, requires_grad=True)
    out = compile_ops.rmsnorm(x, w)
    assert out.shape == x.shape
    out.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.gpu
def test_gpu_numel_past_2_31():
    """int64 offsets: the last rows of a 2**31+ element tensor are normalized right."""
    n = 2048
    rows = 2**31 // n + 3
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = compile_ops.rmsnorm(x, w)
    tail = slice(rows - 5, rows)
    torch.testing.assert_close(out[tail], ref.rmsnorm(x[tail], w, 1e-6), rtol=0, atol=0)
    dy = torch.randn_like(x)
    dx, _, _ = torch.ops.fused.norm_backward(dy, None, x, w, None, 1e-6, True)
    want, _, _ = ref.norm_backward(dy[tail], None, x[tail], w, None, 1e-6, True)
    torch.testing.assert_close(dx[tail], want, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- bad input


def _bad_input_cases():
    x = torch.randn(2, 8)
    w = torch.randn(8)
    return [
        (
            lambda: compile_ops.rmsnorm(x, torch.randn(7)),
            ValueError,
            r"rmsnorm: weight must have shape \(8,\).*got \(7,\)",
        ),
        (lambda: compile_ops.rmsnorm(x, torch.randn(2, 8)), ValueError, r"weight must have shape \(8,\)"),
        (lambda: compile_ops.rmsnorm(x.int(), None), TypeError, r"rmsnorm: x must have a floating dtype.*int32"),
        (
            lambda: compile_ops.rmsnorm(x.to(torch.complex64), None),
            TypeError,
            r"x must have a floating dtype.*complex64",
        ),
        (lambda: compile_ops.rmsnorm(x, w.long()), TypeError, r"weight must have a floating dtype.*int64"),
        (lambda: compile_ops.rmsnorm(x, w, -1e-6), ValueError, r"rmsnorm: eps must be >= 0, got -1e-06"),
        (lambda: compile_ops.rmsnorm(x, w, float("nan")), ValueError, r"rmsnorm: eps must be a number, got NaN"),
        (lambda: compile_ops.rmsnorm(x, w.to("meta")), ValueError, r"weight is on meta but x is on cpu"),
        (lambda: compile_ops.rmsnorm(torch.randn(()), None), ValueError, r"x must have at least 1 dim"),
        (lambda: compile_ops.rmsnorm(torch.randn(3, 0), None), ValueError, r"non-empty last \(hidden\) dim"),
        (lambda: compile_ops.layernorm(x, w, torch.randn(9)), ValueError, r"layernorm: bias must have shape \(8,\)"),
        (lambda: compile_ops.layernorm(x, w, None, -1.0), ValueError, r"layernorm: eps must be >= 0"),
        (
            lambda: compile_ops.add_rmsnorm(x, torch.randn(2, 9), w),
            ValueError,
            r"add_rmsnorm: residual must have the shape of x \(2, 8\), got \(2, 9\)",
        ),
        (lambda: compile_ops.add_rmsnorm(x, x.int(), w), TypeError, r"residual must have a floating dtype"),
        (lambda: compile_ops.add_rmsnorm(x, x.to("meta"), w), ValueError, r"residual is on meta"),
        (lambda: compile_ops.RMSNorm((4, 8)), ValueError, r"normalized_shape must name one"),
        # the sum is kept in residual's dtype: one narrower than x's would round it below torch's promotion
        (
            lambda: compile_ops.add_rmsnorm(x, x.half(), w),
            TypeError,
            r"residual must be at least as precise as x .* got residual torch.float16 and x torch.float32",
        ),
        (lambda: compile_ops.add_rmsnorm(x.double(), x, w), TypeError, r"residual must be at least as precise as x"),
        (lambda: compile_ops.add_rmsnorm(x.bfloat16(), x.half(), w), TypeError, r"residual must be at least as"),
        (lambda: compile_ops.rmsnorm(None), TypeError, r"fused.rmsnorm: x must be a torch.Tensor, got NoneType"),
        (lambda: compile_ops.rmsnorm(x, w, "1e-6"), TypeError, r"fused.rmsnorm: eps must be a float, got '1e-6'"),
    ]


test_bad_input_raises_a_clear_error = bad_input_test(_bad_input_cases)


def test_bad_input_raises_before_any_launch_on_cuda():
    """Validation runs in the Triton branch before the launch (fake CUDA tensors)."""
    body = OP_BODIES["fused::rmsnorm"]
    with FakeTensorMode():
        x = torch.empty(4, 64, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"weight must have shape \(64,\)"):
            body(x, torch.empty(32, device="cuda", dtype=torch.bfloat16), 1e-6)


# ---------------------------------------------------------------- modules


@pytest.mark.parametrize("eps", [None, 1e-5])
def test_rmsnorm_module_drops_in_for_torch(eps):
    theirs = torch.nn.RMSNorm(24, eps=eps)
    with torch.no_grad():
        theirs.weight.normal_()
    ours = compile_ops.RMSNorm(24, eps=eps)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 5, 24)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)])
def test_layernorm_module_drops_in_for_torch(affine, bias):
    theirs = torch.nn.LayerNorm(24, eps=1e-6, elementwise_affine=affine, bias=bias)
    if affine:
        with torch.no_grad():
            theirs.weight.normal_()
            if bias:
                theirs.bias.normal_()
    ours = compile_ops.LayerNorm(24, eps=1e-6, elementwise_affine=affine, bias=bias)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 5, 24) * 3 + 1
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "x_dtype,w_dtype,out_dtype",
    [
        (torch.float32, torch.bfloat16, torch.bfloat16),  # half weight: the weight's dtype
        (torch.float32, torch.float16, torch.float16),
        (torch.bfloat16, torch.float32, torch.bfloat16),  # fp32 weight: the input's dtype
        (torch.bfloat16, None, torch.bfloat16),
        (torch.float32, torch.float32, torch.float32),
    ],
)
def test_rmsnorm_module_follows_diffusers_casting_rule(x_dtype, w_dtype, out_dtype):
    m = compile_ops.RMSNorm(16, eps=1e-6, elementwise_affine=w_dtype is not None, dtype=w_dtype)
    x = torch.randn(2, 16).to(x_dtype)
    y = m(x)
    assert y.dtype == out_dtype
    stats = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)  # fp32 statistics
    want = stats * m.weight.float() if m.weight is not None else stats
    torch.testing.assert_close(y.float(), want.to(out_dtype).float(), rtol=1e-2, atol=1e-2)


def test_rmsnorm_module_with_bias_like_diffusers():
    m = compile_ops.RMSNorm(16, eps=1e-6, bias=True)
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    x = torch.randn(4, 16)
    torch.testing.assert_close(m(x), F.rms_norm(x, (16,), m.weight, 1e-6) + m.bias)


# ---------------------------------------------------------------- traced graph snapshot


class TestTracedGraph(expecttest.TestCase):
    def test_dynamo_graph_calls_the_fused_op(self):
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            return gm

        torch._dynamo.reset()
        block = torch.compile(lambda x, w: compile_ops.rmsnorm(x, w, 1e-6) * 2.0, backend=capture, fullgraph=True)
        block(torch.randn(2, 8, 16), torch.randn(16))
        self.assertExpectedInline(
            graphs[0].code.strip(),
            """\
def forward(self, L_x_ : torch.Tensor, L_w_ : torch.Tensor):
    l_x_ = L_x_
    l_w_ = L_w_
    rmsnorm = torch.ops.fused.rmsnorm(l_x_, l_w_, 1e-06, None);  l_x_ = l_w_ = None
    mul = rmsnorm * 2.0;  rmsnorm = None
    return (mul,)""",
        )


@pytest.mark.kernels
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm", "add_rmsnorm"])
def test_kernels_eager_fast_path_equals_the_registered_op(op):
    """The public functions skip the dispatcher in eager mode; the result and the
    gradients must be those of torch.ops.fused.<op> bit for bit."""
    x, r, w, b = _make_case(
        op, torch.bfloat16, (2, 33), 96, "fp32", op == "layernorm", True, torch.float32, KERNEL_DEVICE
    )
    inputs = [t for t in (x, r, w, b) if t is not None]
    fast, _ = _call(op, x, r, w, b, 1e-6)
    op_args = {"rmsnorm": (x, w, 1e-6, b), "layernorm": (x, w, b, 1e-6), "add_rmsnorm": (x, r, w, 1e-6)}[op]
    registered = getattr(torch.ops.fused, op)(*op_args)
    registered = registered[0] if isinstance(registered, tuple) else registered
    assert f"{op}_eager" in type(fast.grad_fn).__name__
    assert f"fused_{op}" in type(registered.grad_fn).__name__
    assert torch.equal(fast, registered)
    dy = torch.randn_like(fast)
    for a, b_ in zip(torch.autograd.grad(fast, inputs, dy), torch.autograd.grad(registered, inputs, dy)):
        assert torch.equal(a, b_)
