"""The AdaLN modulation family: modulate, norm_modulate, gated_residual,
gated_residual_norm_modulate and their shared backward.

``kernels`` tests run the Triton kernels (CUDA, or CPU under the interpreter)
against an fp64 reference with the two-reference tolerance rule, over every
broadcast form of scale/shift/gate; the rest check validation, the diffusers
modules, compilation and the traced graph on the reference path.
"""

import expecttest
import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from bad_input import bad_input_test
from conftest import HAS_CUDA, KERNEL_DEVICE, concurrent_programs_only
from hypothesis import given
from hypothesis import strategies as st
from numerics import assert_within_torch_error
from shapes import size
from torch._subclasses.fake_tensor import FakeTensorMode

import compile_ops
from compile_ops._library import OP_BODIES, clear_launch_plans
from compile_ops.ops import modulate_launch
from compile_ops.ops.norm import LaunchConfig
from compile_ops.reference import modulate as ref

OPS = ("modulate", "norm_modulate", "gated_residual", "gated_residual_norm_modulate")

#: Broadcast forms of a modulation tensor for x [B, L, C]: name -> shape.
FORMS = {
    "per-sample [B, C]": lambda B, L, C: (B, C),
    "per-sample [B, 1, C]": lambda B, L, C: (B, 1, C),
    "per-token [B, L, C]": lambda B, L, C: (B, L, C),
    "per-frame [B, F, 1, C]": lambda B, L, C: (B, 2 if L % 2 == 0 else 1, 1, C),
    "per-channel [C]": lambda B, L, C: (C,),
    "one value (0-dim)": lambda B, L, C: (),
    "batch-broadcast per-token [1, L, C]": lambda B, L, C: (1, L, C),
}


# ---------------------------------------------------------------- what plain PyTorch computes


def _normalized_at_dtype(h, weight, bias, norm, eps):
    """The norm as diffusers runs it, at the input dtype. With a weight of another
    dtype (which torch's LayerNorm rejects) the family's rule: fp32, then the
    weight's dtype when it is fp16/bf16, else h's."""
    c = h.shape[-1]
    same = all(t is None or t.dtype == h.dtype for t in (weight, bias))
    if norm == "layernorm" and same:
        return F.layer_norm(h, (c,), weight, bias, eps)
    out_dtype = weight.dtype if weight is not None and weight.dtype in (torch.float16, torch.bfloat16) else h.dtype
    if norm == "layernorm":
        up = [None if t is None else t.float() for t in (weight, bias)]
        return F.layer_norm(h.float(), (c,), *up, eps).to(out_dtype)
    y = F.rms_norm(h.float(), (c,), None, eps).to(out_dtype)  # fp32 statistics
    y = y * weight if weight is not None else y
    y = y + bias if bias is not None else y
    # (diffusers' RMSNorm would return fp32 for an fp32 weight and a half input;
    # the family keeps the input's dtype there.)
    return y.to(out_dtype)


def _plain(op, args):
    """The op as an uncompiled diffusers model writes it, in the inputs' dtypes."""

    def x_shaped(m, x):
        # A 0-dim tensor broadcasts as is (expanded, it would promote like a dimensioned one).
        return m if m.dim() == 0 else ref.expand_to_x(m, x)

    if op == "modulate":
        x, scale, shift = args
        return (x * (1 + x_shaped(scale, x)) + x_shaped(shift, x),)
    if op == "norm_modulate":
        x, scale, shift, w, b, norm, eps = args
        return (_normalized_at_dtype(x, w, b, norm, eps) * (1 + x_shaped(scale, x)) + x_shaped(shift, x),)
    residual, x, gate = args[:3]
    h = residual + x_shaped(gate, x) * x
    if op == "gated_residual":
        return (h,)
    scale, shift, w, b, norm, eps = args[3:]
    return h, _normalized_at_dtype(h, w, b, norm, eps) * (1 + x_shaped(scale, h)) + x_shaped(shift, h)


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


@st.composite
def modulation_cases(draw):
    op = draw(st.sampled_from(OPS))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    B, L = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    C = draw(size(st.one_of(st.integers(1, 80), st.sampled_from([128, 333, 1024])), [1, 37, 128, 1024, 1536]))
    forms = [draw(st.sampled_from(sorted(FORMS))) for _ in range(3)]
    mod_dtype = draw(st.sampled_from([dtype, dtype, torch.float32]))
    chunked = draw(st.booleans())  # modulation as a strided chunk of a [B, 6C] embedding
    strided_x = draw(st.booleans())
    norm = draw(st.sampled_from(["layernorm", "rmsnorm"]))
    affine = draw(st.sampled_from(["none", "weight", "weight+bias", "fp32 weight"]))
    residual_fp32 = draw(st.booleans())
    return op, dtype, B, L, C, forms, mod_dtype, chunked, strided_x, norm, affine, residual_fp32


def _case_args(op, dtype, B, L, C, forms, mod_dtype, chunked, strided_x, norm, affine, residual_fp32, device):
    def act(dt):
        if strided_x:
            return torch.randn(B, L, C + 5, device=device).to(dt)[..., 2 : 2 + C].requires_grad_(True)
        return torch.randn(B, L, C, device=device).to(dt).requires_grad_(True)

    def modulation(form, scale):
        shape = FORMS[form](B, L, C)
        if chunked and len(shape) == 2 and shape[0] == B:
            emb = (scale * torch.randn(B, 6 * C, device=device)).to(mod_dtype)
            return emb[:, 2 * C : 3 * C].detach().requires_grad_(True)  # stride (6C, 1), as emb.chunk(6)
        return (scale * torch.randn(shape, device=device)).to(mod_dtype).requires_grad_(True)

    x = act(dtype)
    wdtype = torch.float32 if affine == "fp32 weight" else dtype
    w = (1 + 0.2 * torch.randn(C, device=device)).to(wdtype).requires_grad_(True) if affine != "none" else None
    b = (0.2 * torch.randn(C, device=device)).to(wdtype).requires_grad_(True) if affine == "weight+bias" else None
    scale, shift, gate = modulation(forms[0], 0.5), modulation(forms[1], 1.0), modulation(forms[2], 1.0)
    if op == "modulate":
        return (x, scale, shift)
    if op == "norm_modulate":
        return (x, scale, shift, w, b, norm, 1e-6)
    residual = act(torch.float32 if residual_fp32 else dtype)
    if op == "gated_residual":
        return (residual, x, gate)
    return (residual, x, gate, scale, shift, w, b, norm, 1e-6)


def _fp64(args):
    return tuple(a.detach().double().requires_grad_(True) if isinstance(a, torch.Tensor) else a for a in args)


def _grads(outs, args, grads_out):
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return torch.autograd.grad(outs, tensors, grads_out, allow_unused=True)


# ---------------------------------------------------------------- layer 3/4: kernels vs reference


@pytest.mark.kernels
@given(modulation_cases())
def test_kernels_match_fp64_reference_forward_and_backward(case):
    torch.manual_seed(0)  # each example's tensors from its own case only: reproducible failures
    op = case[0]
    args = _case_args(*case, KERNEL_DEVICE)
    got = _outputs(getattr(compile_ops, op)(*args))
    exact_args = _fp64(args)
    exact = _outputs(getattr(ref, op)(*exact_args))[: len(got)]  # without the statistics outputs
    plain_args = tuple(a.detach().clone().requires_grad_(True) if isinstance(a, torch.Tensor) else a for a in args)
    plain = _plain(op, plain_args)
    for g, e, p in zip(got, exact, plain):
        assert g.dtype == p.dtype, f"{op}: output dtype {g.dtype}, plain PyTorch gives {p.dtype}"
        assert_within_torch_error(g, e, p, 2.0, f"{op} output")

    grads_out = [torch.randn_like(o) for o in got]
    names = [n for n, a in zip("abcdefghi", args) if isinstance(a, torch.Tensor)]
    for name, g, e, p, a in zip(
        names,
        _grads(got, args, grads_out),
        _grads(exact, exact_args, [g.double() for g in grads_out]),
        _grads(plain, plain_args, grads_out),
        [a for a in args if isinstance(a, torch.Tensor)],
    ):
        assert g.shape == a.shape and g.dtype == a.dtype, f"{op}: gradient of input {name}"
        terms = max(1, got[0].numel() // max(1, a.numel()))  # > 1: summed over broadcast dims
        assert_within_torch_error(g, e, p, 3.0, f"{op} gradient of input {name} {tuple(a.shape)}", terms)


@pytest.mark.kernels
@pytest.mark.parametrize("width", [1280, 1536])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("op", ["norm_modulate", "gated_residual_norm_modulate"])
def test_kernels_rows_held_as_chunks_match_fp64_and_quantize_their_own_output(op, norm, width, monkeypatch):
    """Widths past 1024 that are not powers of two are held as several blocks
    (``held_chunks``: 5 x 256, 3 x 512), with the row's statistics and FP8
    maximum over all of them; both output modes, under the shipped config
    (``forward_config``) and two rows a step over 10 rows."""
    chunks = modulate_launch.held_chunks(width)
    gated = op.startswith("gated")
    assert chunks > 1
    shipped = modulate_launch.forward_config(width, gated)
    assert shipped.held_chunks == chunks
    for held in (shipped, LaunchConfig(2, width // chunks, False, 2, held_chunks=chunks)):
        launched = []  # the configs the launcher asked for: the kernel ran held, not some other path
        monkeypatch.setattr(modulate_launch, "forward_config", lambda *key: launched.append(key) or held)
        clear_launch_plans()  # an eager call replays the config it was recorded with
        try:
            torch.manual_seed(0)
            forms = ["per-sample [B, C]", "per-token [B, L, C]", "per-sample [B, C]"]
            case = (op, torch.bfloat16, 2, 5, width, forms, torch.bfloat16, True, False, norm, "weight+bias", False)
            args = _case_args(*case, KERNEL_DEVICE)
            with torch.no_grad():
                got = _outputs(getattr(compile_ops, op)(*args))
                exact = _outputs(getattr(ref, op)(*_fp64(args)))[: len(got)]
                plain = _plain(op, args)
            for g, e, p in zip(got, exact, plain):
                assert_within_torch_error(g, e, p, 2.0, f"{op} output at {width} columns, {held}")
            _check_fp8_mode(op, _detached(args))
            assert (width, gated) in launched
        finally:
            clear_launch_plans()  # no plan recorded under the held config outlives the test


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_kernels_seam_out_is_norm_modulate_of_residual_out(dtype, norm):
    """gated_residual_norm_modulate rounds residual_out first: out is exactly
    norm_modulate(residual_out), and residual_out exactly gated_residual."""
    d = KERNEL_DEVICE
    residual, x = torch.randn(2, 37, 96, device=d).to(dtype), torch.randn(2, 37, 96, device=d).to(dtype)
    gate, scale, shift = (torch.randn(2, 96, device=d).to(dtype) for _ in range(3))
    h, out = compile_ops.gated_residual_norm_modulate(residual, x, gate, scale, shift, None, None, norm, 1e-6)
    assert torch.equal(h, compile_ops.gated_residual(residual, x, gate))
    assert torch.equal(out, compile_ops.norm_modulate(h, scale, shift, None, None, norm, 1e-6))


@pytest.mark.kernels
def test_kernels_norm_modulate_equals_the_norm_family_when_unmodulated():
    """The family reuses the norm family's row statistics: with scale = shift = 0
    the output is fused.layernorm's, bit for bit."""
    x = torch.randn(5, 21, 160, device=KERNEL_DEVICE).to(torch.bfloat16)
    zero = torch.zeros(5, 160, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    w = torch.randn(160, device=KERNEL_DEVICE).to(torch.bfloat16)
    got = compile_ops.norm_modulate(x, zero, zero, w, None, "layernorm", 1e-6)
    assert torch.equal(got, compile_ops.layernorm(x, w, None, 1e-6))


@pytest.mark.kernels
@concurrent_programs_only
@pytest.mark.parametrize("form", ["per-sample [B, C]", "per-frame [B, F, 1, C]", "per-channel [C]"])
def test_kernels_backward_is_deterministic(form):
    """Many rows, so many programs' partial sums meet in every reduced gradient."""
    case = (
        "gated_residual_norm_modulate",
        torch.bfloat16,
        2,
        96,
        160,
        [form] * 3,
        torch.bfloat16,
        False,
        False,
        "layernorm",
        "weight+bias",
        True,
    )
    args = _case_args(*case, KERNEL_DEVICE)
    outs = compile_ops.gated_residual_norm_modulate(*args)
    grads_out = [torch.randn_like(o) for o in outs]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    first = torch.autograd.grad(outs, tensors, grads_out, retain_graph=True)
    again = torch.autograd.grad(outs, tensors, grads_out, retain_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.kernels
def test_kernels_modulation_tensors_with_different_frame_counts():
    """Per-frame tensors with 4 and 6 frames over 12 tokens: no two of their runs
    line up (3 and 2 rows), so the backward reduces per row (the runs' gcd)."""
    d = KERNEL_DEVICE
    args = [
        torch.randn(2, 12, 24, device=d),
        torch.randn(2, 12, 24, device=d),
        torch.randn(2, 4, 1, 24, device=d),
        torch.randn(2, 6, 1, 24, device=d),
        torch.randn((), device=d),
    ]
    args = [a.requires_grad_(True) for a in args]
    outs = compile_ops.gated_residual_norm_modulate(*args, None, None, "layernorm", 1e-6)
    exact_args = [a.detach().double().requires_grad_(True) for a in args]
    exact = ref.gated_residual_norm_modulate(*exact_args, None, None, "layernorm", 1e-6)[:2]
    grads_out = [torch.randn_like(o) for o in outs]
    for g, e in zip(outs, exact):
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-5)
    for g, e in zip(
        torch.autograd.grad(outs, args, grads_out),
        torch.autograd.grad(exact, exact_args, [g.double() for g in grads_out]),
    ):
        torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-4)


@pytest.mark.kernels
def test_kernels_adaln_zero_block_matches_plain_pytorch():
    """A diffusers-style AdaLN-Zero DiT block (bench/demo.py) on the fused ops,
    Triton kernels included, against the same block in torch.nn.functional:
    output and the gradients of every parameter and input."""
    from bench.demo import DiTBlock

    torch.manual_seed(0)
    fused = DiTBlock(48, 4, fused=True).to(KERNEL_DEVICE)
    plain = DiTBlock(48, 4, fused=False).to(KERNEL_DEVICE)
    plain.load_state_dict(fused.state_dict())
    x, temb = torch.randn(2, 10, 48, device=KERNEL_DEVICE), torch.randn(2, 48, device=KERNEL_DEVICE)
    dy = torch.randn(2, 10, 48, device=KERNEL_DEVICE)
    results = []
    for block in (fused, plain):
        xi, ti = x.clone().requires_grad_(True), temb.clone().requires_grad_(True)
        out = block(xi, ti)
        out.backward(dy)
        results.append((out, {"x": xi.grad, "temb": ti.grad, **{n: p.grad for n, p in block.named_parameters()}}))
    (out_f, grads_f), (out_p, grads_p) = results
    torch.testing.assert_close(out_f, out_p, rtol=1e-4, atol=1e-5)
    for name, g in grads_p.items():
        torch.testing.assert_close(grads_f[name], g, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.gpu
def test_gpu_per_token_and_2d_rows_past_2_31_elements():
    """int64 offsets in the forward and the backward, per-token modulation (the
    largest modulation tensors) at more than 2**31 elements."""
    C = 2048
    rows = 2**31 // C + 3
    x = torch.randn(1, rows, C, device="cuda", dtype=torch.bfloat16)
    scale = torch.randn(1, rows, C, device="cuda", dtype=torch.bfloat16)
    out = compile_ops.modulate(x, scale, scale)
    tail = slice(rows - 4, rows)
    want = ref.modulate(x[:, tail], scale[:, tail], scale[:, tail])
    torch.testing.assert_close(out[:, tail], want, rtol=0, atol=0)
    del out
    dx, _, _, dscale, _, _, _ = torch.ops.fused.modulate_backward(
        x, None, x, None, None, None, None, scale, scale, None, None, "none", 0.0
    )
    torch.testing.assert_close(dx[:, tail], (x[:, tail].float() * (1 + scale[:, tail].float())).bfloat16())
    torch.testing.assert_close(dscale[:, tail], (x[:, tail].float() ** 2).bfloat16())


# ---------------------------------------------------------------- bad input


def _bad_input_cases():
    x = torch.randn(2, 6, 8)
    s = torch.randn(2, 8)
    nm = compile_ops.norm_modulate
    return [
        (
            lambda: compile_ops.modulate(x, torch.randn(3, 8), s),
            ValueError,
            r"modulate: scale of shape \(3, 8\) does not broadcast to x of shape \(2, 6, 8\).*dim 0.*size 3",
        ),
        (lambda: compile_ops.modulate(x, s, torch.randn(2, 7)), ValueError, r"shift of shape \(2, 7\) does not"),
        (
            lambda: compile_ops.modulate(x, torch.randn(2, 6, 8, 1, 1), s),
            ValueError,
            r"scale of shape \(2, 6, 8, 1, 1\) does not broadcast.*expected 0-dim, \[C\], \[B, C\]",
        ),
        (
            lambda: compile_ops.modulate(x, torch.randn(2, 4, 1, 8), s),
            ValueError,
            r"per frame \(\[B, F, 1, C\]\) but x's 6 tokens do not split into F=4 frames",
        ),
        (lambda: compile_ops.modulate(x, s.int(), s), TypeError, r"modulate: scale must have a floating dtype.*int32"),
        (lambda: compile_ops.modulate(x, s, s.to("meta")), ValueError, r"shift is on meta but x is on cpu"),
        (lambda: compile_ops.modulate(torch.randn(8), s, s), ValueError, r"x must be \[B, \.\.\., C\]"),
        (lambda: compile_ops.modulate(torch.randn(1, 2, 16385), s, s), ValueError, r"hidden size 16385.*up to 16384"),
        (
            lambda: compile_ops.modulate(torch.randn(2, 3, 4, 5, 8), torch.randn(2, 3, 1, 5, 8), torch.randn(())),
            ValueError,
            r"pattern of 3 levels",
        ),
        (
            lambda: nm(x, s, s, None, None, "groupnorm", 1e-6),
            ValueError,
            r"norm_modulate: norm must be one of \('layernorm', 'rmsnorm'\), got 'groupnorm'",
        ),
        (lambda: nm(x, s, s, torch.randn(7), None, "layernorm", 1e-6), ValueError, r"weight must have shape \(8,\)"),
        (lambda: nm(x, s, s, None, None, "rmsnorm", -1.0), ValueError, r"eps must be >= 0"),
        (
            lambda: compile_ops.gated_residual(torch.randn(2, 6, 9), x, s),
            ValueError,
            r"gated_residual: residual must have the shape of x \(2, 6, 8\), got \(2, 6, 9\)",
        ),
        (lambda: compile_ops.gated_residual(x, x, torch.randn(2, 6)), ValueError, r"gate of shape \(2, 6\) does not"),
        (
            lambda: compile_ops.gated_residual_norm_modulate(x, x, s, s, s, None, None, "layer_norm", 1e-6),
            ValueError,
            r"norm must be one of",
        ),
        (
            lambda: compile_ops.AdaLayerNormContinuous(8, 8, norm_type="group_norm"),
            ValueError,
            r"norm_type must be 'layer_norm' or 'rms_norm'",
        ),
    ]


test_bad_input_raises_a_clear_error = bad_input_test(_bad_input_cases)


def test_bad_input_raises_before_any_launch_on_cuda():
    """Validation runs in the Triton branch before the launch (fake CUDA tensors)."""
    body = OP_BODIES["fused::norm_modulate"]
    with FakeTensorMode():
        x = torch.empty(2, 64, 32, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"scale of shape \(3, 32\) does not broadcast"):
            body(
                x,
                torch.empty(3, 32, device="cuda", dtype=torch.bfloat16),
                torch.empty(2, 32, device="cuda", dtype=torch.bfloat16),
                None,
                None,
                "layernorm",
                1e-6,
            )


# ---------------------------------------------------------------- broadcast forms, dtypes, compile


@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_broadcast_form_matches_torch_broadcasting_with_gradients(form):
    """Reference path: the op's outputs and its gradients (the reductions over
    the broadcast dims) equal autograd through plain PyTorch broadcasting."""
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    scale = torch.randn(FORMS[form](2, 6, 8), dtype=torch.float64, requires_grad=True)
    shift = torch.randn(FORMS[form](2, 6, 8), dtype=torch.float64, requires_grad=True)
    got = compile_ops.norm_modulate(x, scale, shift, None, None, "layernorm", 1e-6)
    gx, gs, gsh = torch.autograd.grad(got.sum(), (x, scale, shift))
    if scale.dim() == 4:  # per frame: torch broadcasts it against x viewed as [B, F, L/F, C]
        xv = x.view(2, scale.shape[1], -1, 8)
    elif scale.dim() == 2:
        xv = x
        scale, shift = scale.detach()[:, None].requires_grad_(True), shift.detach()[:, None].requires_grad_(True)
    else:
        xv = x
    want = F.layer_norm(xv, (8,), eps=1e-6) * (1 + scale) + shift
    torch.testing.assert_close(got, want.reshape(x.shape))
    wx, ws, wsh = torch.autograd.grad(want.sum(), (x, scale, shift))
    torch.testing.assert_close(gx, wx)
    torch.testing.assert_close(gs, ws.reshape(gs.shape))
    torch.testing.assert_close(gsh, wsh.reshape(gsh.shape))


@pytest.mark.parametrize("form", ["per-token [B, L, C]", "per-frame [B, F, 1, C]", "per-sample [B, 1, C]"])
def test_compile_one_graph_across_sequence_lengths(form):
    """fullgraph=True, and one compile for three sequence lengths with the
    sequence dim dynamic, whatever the modulation's form."""
    device = "cuda" if HAS_CUDA else "cpu"
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=True)
    def seam(residual, x, gate, scale, shift):
        h, out = compile_ops.gated_residual_norm_modulate(
            residual, x, gate, scale, shift, None, None, "layernorm", 1e-6
        )
        return h.float().square().sum() + out.float().square().sum()

    for L in (6, 10, 18):
        residual, x = (torch.randn(2, L, 32, device=device, requires_grad=True) for _ in range(2))
        mods = [torch.randn(FORMS[form](2, L, 32), device=device, requires_grad=True) for _ in range(3)]
        for t in (residual, x):
            torch._dynamo.mark_dynamic(t, 1)
        if form.startswith("per-token"):
            for m in mods:
                torch._dynamo.mark_dynamic(m, 1)
        seam(residual, x, *mods).backward()
        assert all(t.grad is not None for t in (residual, x, *mods))
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 3 sequence lengths"


# ---------------------------------------------------------------- diffusers' modules


def _diffusers_normalization():
    return pytest.importorskip("diffusers.models.normalization")


@pytest.mark.parametrize("norm_type", ["layer_norm", "fp32_layer_norm"])
def test_ada_layer_norm_zero_matches_diffusers(norm_type):
    theirs = _diffusers_normalization().AdaLayerNormZero(32, norm_type=norm_type)
    ours = compile_ops.AdaLayerNormZero(32, norm_type=norm_type)
    ours.load_state_dict(theirs.state_dict())
    x, emb = torch.randn(2, 7, 32), torch.randn(2, 32)
    for got, want in zip(ours(x, emb=emb), theirs(x, emb=emb)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_ada_layer_norm_zero_single_matches_diffusers():
    theirs = _diffusers_normalization().AdaLayerNormZeroSingle(32)
    ours = compile_ops.AdaLayerNormZeroSingle(32)
    ours.load_state_dict(theirs.state_dict())
    x, emb = torch.randn(2, 7, 32), torch.randn(2, 32)
    for got, want in zip(ours(x, emb=emb), theirs(x, emb=emb)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "norm_type,affine,bias",
    [("layer_norm", True, True), ("layer_norm", False, False), ("rms_norm", True, False), ("rms_norm", False, False)],
)
def test_ada_layer_norm_continuous_matches_diffusers(norm_type, affine, bias):
    theirs = _diffusers_normalization().AdaLayerNormContinuous(32, 24, affine, 1e-6, bias, norm_type)
    with torch.no_grad():
        for p in theirs.norm.parameters():
            p.normal_()  # not the 1/0 init, so that a dropped weight or bias shows
    ours = compile_ops.AdaLayerNormContinuous(32, 24, affine, 1e-6, bias, norm_type)
    ours.load_state_dict(theirs.state_dict())
    x, cond = torch.randn(2, 7, 32, requires_grad=True), torch.randn(2, 24)
    got, want = ours(x, cond), theirs(x, cond)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(got)
    for g, w in zip(
        torch.autograd.grad(got, [x, *ours.parameters()], dy), torch.autograd.grad(want, [x, *theirs.parameters()], dy)
    ):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- traced graph snapshot


class TestTracedGraph(expecttest.TestCase):
    def test_adaln_zero_single_compiles_to_one_fused_call(self):
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            return gm

        torch._dynamo.reset()
        block = compile_ops.AdaLayerNormZeroSingle(16)
        torch.compile(block, backend=capture, fullgraph=True)(torch.randn(2, 8, 16), emb=torch.randn(2, 16))
        self.assertExpectedInline(
            graphs[0].code.strip(),
            """\
def forward(self, L_emb_ : torch.Tensor, L_self_modules_linear_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_linear_parameters_bias_ : torch.nn.parameter.Parameter, L_x_ : torch.Tensor):
    l_emb_ = L_emb_
    l_self_modules_linear_parameters_weight_ = L_self_modules_linear_parameters_weight_
    l_self_modules_linear_parameters_bias_ = L_self_modules_linear_parameters_bias_
    l_x_ = L_x_
    silu = torch.nn.functional.silu(l_emb_, inplace = False);  l_emb_ = None
    emb = torch._C._nn.linear(silu, l_self_modules_linear_parameters_weight_, l_self_modules_linear_parameters_bias_);  silu = l_self_modules_linear_parameters_weight_ = l_self_modules_linear_parameters_bias_ = None
    chunk = emb.chunk(3, dim = 1);  emb = None
    shift_msa = chunk[0]
    scale_msa = chunk[1]
    gate_msa = chunk[2];  chunk = None
    norm_modulate = torch.ops.fused.norm_modulate(l_x_, scale_msa, shift_msa, None, None, 'layernorm', 1e-06);  l_x_ = scale_msa = shift_msa = None
    getitem_3 = norm_modulate[0];  norm_modulate = None
    return (getitem_3, gate_msa)""",
        )


# ---------------------------------------------------------------- FP8 output modes (inference)


def _detached(args):
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)


def _same_fp8(rows, want, fp32_output=False):
    """Equal e4m3 bytes and scales. ``fp32_output``: the stated bound where the
    quantized output is fp32 (no 16-bit rounding in between): the fused and
    the unfused kernel compute the fp32 output in separately compiled code,
    whose last bit may differ (seen on an H100, triton 3.6: one row scale
    apart in a Hypothesis case); a row's amax then differs by 1 fp32 ulp,
    which ``amax / 448`` (rounded again) turns into at most 2 ulps of the
    scale (seen: 2 ulps at 0.0154), and the values of a row whose scale
    moved stay within one e4m3 step."""
    q, scale = rows
    want_q, want_scale = want
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    if not fp32_output:
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), "e4m3 bytes differ"
        assert torch.equal(scale, want_scale), "row scales differ"
        return
    torch.testing.assert_close(scale, want_scale, rtol=2**-22, atol=0)
    same = scale == want_scale
    assert torch.equal(q[same].view(torch.uint8), want_q[same].view(torch.uint8)), "e4m3 bytes differ"
    # One e4m3 step: 2**-3 relative for normals, 2**-9 absolute among subnormals.
    torch.testing.assert_close(q[~same].float(), want_q[~same].float(), rtol=2**-3, atol=2**-9)


def _check_fp8_mode(op, args):
    """``<op>_fp8(*args)`` is ``quantize_fp8_rows`` of ``<op>(*args)``'s normed output, bytes and scales."""
    fused = getattr(compile_ops, f"{op}_fp8")(*args)
    plain = getattr(compile_ops, op)(*args)
    if op == "gated_residual_norm_modulate":
        torch.testing.assert_close(fused[0], plain[0], rtol=0, atol=0, equal_nan=True)
        fused, plain = fused[1], plain[1]
    _same_fp8(fused, compile_ops.quantize_fp8_rows(plain), fp32_output=plain.dtype == torch.float32)


@pytest.mark.parametrize("op", ["norm_modulate", "gated_residual_norm_modulate"])
def test_fp8_modes_are_quantize_of_the_unquantized_output_and_refuse_gradients(op):
    forms = ["per-sample [B, C]", "per-token [B, L, C]", "per-sample [B, C]"]
    case = (op, torch.bfloat16, 2, 5, 48, forms, torch.bfloat16, True, False, "layernorm", "weight+bias", False)
    _check_fp8_mode(op, _detached(_case_args(*case, "cpu")))
    with pytest.raises(RuntimeError, match="inference-only"):
        getattr(compile_ops, f"{op}_fp8")(*_case_args(*case, "cpu"))  # inputs that require grad


@pytest.mark.kernels
@given(modulation_cases())
def test_kernels_fp8_modes_write_the_bytes_of_quantizing_their_own_output(case):
    """The epilogue quantizes the output the unquantized kernel would store: the
    bytes equal ``quantize_fp8_rows`` of that output, bit for bit (both kernels)."""
    op = "gated_residual_norm_modulate" if case[0].startswith("gated") else "norm_modulate"
    torch.manual_seed(0)
    _check_fp8_mode(op, _detached(_case_args(op, *case[1:], KERNEL_DEVICE)))


def _overflow_args(op, device):
    """fp16 inputs whose unquantized output is not finite in rows 0-3 of 6: an
    output past fp16's range from finite inputs (row 0, one channel), a -inf
    shift (row 1; with the residual, an infinity in it too), a NaN in x (row
    2), a whole row of +inf shift (row 3); rows 4 and 5 finite."""
    torch.manual_seed(0)
    inf = float("inf")
    x, scale, shift = torch.randn(1, 6, 48), 0.5 * torch.randn(1, 6, 48), torch.randn(1, 6, 48)
    x[0, 0, 3], scale[0, 0, 3] = 5.0, 3e4  # about 4.5 * 3e4 > 65504
    shift[0, 1, 5], x[0, 2, 7], shift[0, 3] = -inf, float("nan"), inf
    x, scale, shift = (t.to(device, torch.float16) for t in (x, scale, shift))
    if op == "norm_modulate":
        return (x, scale, shift, None, None, "layernorm", 1e-6)
    residual, gate = torch.randn(1, 6, 48), torch.randn(1, 6, 48)
    residual[0, 0, 3], gate[0, 0, 3], residual[0, 1, 0] = 5.0, 1.0, -inf  # h[0, 0, 3] = 10: row 0 overflows
    residual, gate = residual.to(device, torch.float16), gate.to(device, torch.float16)
    return (residual, x, gate, scale, shift, None, None, "layernorm", 1e-6)


def _check_fp8_mode_keeps_an_overflow(op, device):
    """The FP8 mode's rows of a non-finite output row dequantize to NaN across
    the row (``reference/fp8.py``'s rule: an infinity makes the scale infinite),
    so the FP8 Linear after it is NaN where nn.Linear on the unquantized
    output is +-inf or NaN; the bytes stay those of quantize_fp8_rows of the
    unquantized output, and the finite rows stay finite."""
    args = _overflow_args(op, device)
    plain, rows = getattr(compile_ops, op)(*args), getattr(compile_ops, f"{op}_fp8")(*args)
    if op == "gated_residual_norm_modulate":
        plain, rows = plain[1], rows[1]
    assert plain[0, 0, 3].isinf()  # the overflow itself
    bad = ~torch.isfinite(plain).all(-1)
    assert bad.tolist() == [[True] * 4 + [False] * 2]
    back = rows.dequantized()
    assert back[bad].isnan().all() and torch.isfinite(back[~bad]).all()
    torch.manual_seed(1)
    linear = torch.nn.Linear(48, 32).to(device, torch.float16)
    with torch.no_grad():
        got, want = compile_ops.FP8Linear.from_linear(linear)(rows), linear(plain)
    assert (~torch.isfinite(want[bad])).all() and got[bad].isnan().all() and torch.isfinite(got[~bad]).all()
    _check_fp8_mode(op, args)


@pytest.mark.parametrize("op", ["norm_modulate", "gated_residual_norm_modulate"])
def test_fp8_modes_keep_an_overflow_non_finite(op):
    _check_fp8_mode_keeps_an_overflow(op, "cpu")


@pytest.mark.kernels
@pytest.mark.parametrize("op", ["norm_modulate", "gated_residual_norm_modulate"])
def test_kernels_fp8_modes_keep_an_overflow_non_finite(op):
    """The fused epilogue (``kernels/fp8.py``'s shared row scale) on the same rows."""
    _check_fp8_mode_keeps_an_overflow(op, KERNEL_DEVICE)
