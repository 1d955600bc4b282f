"""The RoPE family: fused.rope / rope_qk (both pair conventions, full and half
tables, partial rotary dims, both layouts, per-batch tables, GQA), rope_grid
(3D video RoPE computed in the kernel) and qk_norm_rope, forward and backward.

``kernels`` tests run the Triton kernels (CUDA, or CPU under the interpreter)
against fp64 references with the two-reference rule and against diffusers' own
``apply_rotary_emb`` and rotary classes; the rest check validation and the
reference path.
"""

import pytest
import torch
from bad_input import bad_input_test
from conftest import INTERPRET, KERNEL_DEVICE
from hypothesis import given
from hypothesis import strategies as st
from numerics import assert_within_torch_error
from shapes import size

import compile_ops.ops.rope as rope_ops
from compile_ops.meta.rope import GridRope, grid_rope
from compile_ops.reference import attention as attention_ref
from compile_ops.reference import norm as norm_ref
from compile_ops.reference import rope as ref


def _tables(shape, device):
    angles = torch.rand(shape, device=device) * 6.3
    return angles.cos(), angles.sin()


@st.composite
def rope_cases(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    B, H, L = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 9))
    Hk = draw(st.sampled_from([H, 1]))
    D = 2 * draw(size(st.integers(1, 40), [1, 19, 32, 64]))
    rotary_dim = draw(st.sampled_from([None, 2 * draw(st.integers(1, D // 2))]))
    interleaved, half_table, per_batch = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    seq_dim = draw(st.sampled_from([1, 2]))
    transposed = draw(st.sampled_from([False, True, "odd"]))
    return dtype, B, H, Hk, L, D, rotary_dim, interleaved, half_table, per_batch, seq_dim, transposed


def _heads(dtype, B, H, L, D, seq_dim, transposed, device):
    """``[B, H, L, D]`` (seq_dim 2) or ``[B, L, H, D]``; ``transposed``: a view
    of the other layout (strided rows); "odd": a view at an odd offset with odd
    row strides, which the kernels cannot read pair-wise as words."""
    shape = (B, H, L, D) if seq_dim == 2 else (B, L, H, D)
    if transposed == "odd":
        x = torch.randn(*shape[:3], D + 1, device=device).to(dtype)[..., 1:]
    elif transposed:
        x = torch.randn(shape[0], shape[2], shape[1], D, device=device).to(dtype).transpose(1, 2)
    else:
        x = torch.randn(shape, device=device).to(dtype)
    return x.requires_grad_(True)


def _case(dtype, B, H, Hk, L, D, rotary_dim, interleaved, half_table, per_batch, seq_dim, transposed, device):
    q = _heads(dtype, B, H, L, D, seq_dim, transposed, device)
    k = _heads(dtype, B, Hk, L, D, seq_dim, transposed is False, device)
    r = D if rotary_dim is None else rotary_dim
    t = r // 2 if half_table else r
    cos, sin = _tables(((B,) if per_batch else ()) + (L, t), device)
    return q, k, cos, sin, interleaved, seq_dim, rotary_dim


def _at_dtype(x, cos, sin, interleaved, seq_dim, rotary_dim):
    """diffusers' formula: fp32 arithmetic, rounded to x's dtype (its fp32 math
    is what the reference does too, so this is the reference at x's dtype)."""
    return ref.rope(x, cos, sin, interleaved, seq_dim, rotary_dim)


def _detached(ts, dtype=None):
    return [t.detach().to(dtype or t.dtype).requires_grad_(True) for t in ts]


@pytest.mark.kernels
@given(rope_cases())
def test_kernels_match_fp64_reference_forward_and_backward(case):
    """rope_qk on q and k (GQA head counts, either layout, strided, both
    conventions, full/half/per-batch tables, partial rotary), and rope on q
    alone, which must give rope_qk's q bit for bit (one kernel)."""
    torch.manual_seed(0)
    q, k, cos, sin, interleaved, seq_dim, rotary_dim = _case(*case, KERNEL_DEVICE)
    got = rope_ops.rope_qk(q, k, cos, sin, interleaved, seq_dim, rotary_dim)
    exact_in, plain_in = _detached((q, k), torch.float64), _detached((q, k))
    exact = [ref.rope(x, cos.double(), sin.double(), interleaved, seq_dim, rotary_dim) for x in exact_in]
    plain = [_at_dtype(x, cos, sin, interleaved, seq_dim, rotary_dim) for x in plain_in]
    dys = [torch.randn_like(g) for g in got]
    grads = torch.autograd.grad(got, (q, k), dys)
    exact_grads = torch.autograd.grad(exact, exact_in, [dy.double() for dy in dys])
    plain_grads = torch.autograd.grad(plain, plain_in, dys)
    for name, g, e, p, dg, de, dp in zip("qk", got, exact, plain, grads, exact_grads, plain_grads):
        assert g.dtype == q.dtype and g.is_contiguous()
        assert_within_torch_error(g, e, p, 2.0, f"rope {name}")
        assert_within_torch_error(dg, de, dp, 3.0, f"rope d{name}")
    assert torch.equal(rope_ops.rope(q, cos, sin, interleaved, seq_dim, rotary_dim), got[0])


@pytest.mark.kernels
@pytest.mark.parametrize("interleaved", [True, False])
def test_kernels_match_diffusers_apply_rotary_emb(interleaved):
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    B, H, L, D = 2, 3, 7, 32
    x = torch.randn(B, H, L, D, device=KERNEL_DEVICE)
    cos, sin = embeddings.get_1d_rotary_pos_embed(D, L, use_real=True, repeat_interleave_real=interleaved)
    cos, sin = cos.to(KERNEL_DEVICE), sin.to(KERNEL_DEVICE)
    want = embeddings.apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1 if interleaved else -2)
    torch.testing.assert_close(rope_ops.rope(x, cos, sin, interleaved), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("interleaved", [True, False])
def test_reference_equals_diffusers_apply_rotary_emb_exactly(interleaved):
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    x = torch.randn(2, 3, 7, 32)
    cos, sin = embeddings.get_1d_rotary_pos_embed(32, 7, use_real=True, repeat_interleave_real=interleaved)
    want = embeddings.apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1 if interleaved else -2)
    assert torch.equal(ref.rope(x, cos, sin, interleaved, 2), want)


def _rmsnorm(x, w, eps, seq_dim):
    """The unfused norm: diffusers' RMSNorm over the head dim (``w`` ``[D]``), or
    over all heads of a position (``[H * D]``, Wan's and LTX's ``norm_q``), as
    those models call it: on the ``[B, L, H * D]`` projection before the heads
    are split."""
    if w.shape[0] == x.shape[-1]:
        return norm_ref.rmsnorm(x, w, eps)
    rows = x if seq_dim == 1 else x.transpose(1, 2)
    normed = norm_ref.rmsnorm(rows.flatten(2), w, eps).unflatten(2, rows.shape[2:])
    return normed if seq_dim == 1 else normed.transpose(1, 2)


@pytest.mark.kernels
@given(rope_cases(), st.sampled_from([1e-6, 1e-5]), st.booleans())
def test_kernels_qk_norm_rope_match_fp64_reference_forward_and_backward(case, eps, spans_heads):
    """RMSNorm with weight, per head or (``spans_heads``, ``[H * D]`` weights)
    over all heads of a position, then RoPE: output and dq, dk, dq_weight,
    dk_weight against fp64; PyTorch's error is that of the unfused ops at the
    input dtype (the norm's output rounded, then rotated)."""
    torch.manual_seed(0)
    q, k, cos, sin, interleaved, seq_dim, rotary_dim = _case(*case, KERNEL_DEVICE)
    D = q.shape[-1]
    widths = [D * x.shape[3 - seq_dim] if spans_heads else D for x in (q, k)]
    q_w, k_w = ((1 + 0.1 * torch.randn(n, device=KERNEL_DEVICE)).to(q.dtype).requires_grad_(True) for n in widths)
    args = (cos, sin, eps, interleaved, seq_dim, rotary_dim)
    got = rope_ops.qk_norm_rope(q, k, q_w, k_w, *args)
    exact_in, plain_in = _detached((q, k, q_w, k_w), torch.float64), _detached((q, k, q_w, k_w))
    exact = ref.qk_norm_rope(*exact_in, cos.double(), sin.double(), *args[2:])
    plain = [
        _at_dtype(_rmsnorm(x, w, eps, seq_dim), cos, sin, interleaved, seq_dim, rotary_dim)
        for x, w in ((plain_in[0], plain_in[2]), (plain_in[1], plain_in[3]))
    ]
    dys = [torch.randn_like(g) for g in got]
    grads = torch.autograd.grad(got, (q, k, q_w, k_w), dys)
    exact_grads = torch.autograd.grad(exact, exact_in, [dy.double() for dy in dys])
    plain_grads = torch.autograd.grad(plain, plain_in, dys)
    for name, g, e, p in zip("qk", got, exact, plain):
        assert g.dtype == q.dtype and g.is_contiguous()
        assert_within_torch_error(g, e, p, 2.0, f"qk_norm_rope {name}")
    rows = [x.numel() // w.numel() for x, w in ((q, q_w), (k, k_w))]
    for name, g, e, p, terms in zip(
        ("dq", "dk", "dq_weight", "dk_weight"), grads, exact_grads, plain_grads, [1, 1] + rows
    ):
        # dx = rstd (w dz - xhat c): four fp32 roundings before the terms cancel.
        assert_within_torch_error(
            g, e, p, 3.0, f"qk_norm_rope {name}", terms=terms, fp32_roundings=4 if terms == 1 else 0
        )


@pytest.mark.kernels
@pytest.mark.parametrize("spans_heads", [False, True], ids=["per_head", "spans_heads"])
def test_kernels_qk_norm_rope_weight_grads_are_deterministic(spans_heads):
    torch.manual_seed(0)
    q = torch.randn(2, 40, 6, 32, device=KERNEL_DEVICE, requires_grad=True)
    k = torch.randn(2, 40, 2, 32, device=KERNEL_DEVICE, requires_grad=True)
    widths = (6 * 32, 2 * 32) if spans_heads else (32, 32)
    w = [torch.randn(n, device=KERNEL_DEVICE, requires_grad=True) for n in widths]
    cos, sin = _tables((40, 32), KERNEL_DEVICE)
    dys = [torch.randn_like(q), torch.randn_like(k)]

    def grads():
        out = rope_ops.qk_norm_rope(q, k, *w, cos, sin, 1e-6, True, 1)
        return torch.autograd.grad(out, (q, k, *w), dys)

    first = grads()
    assert all(torch.equal(a, b) for a, b in zip(first, grads()))


# ----------------------------------------------------- gradients of cos and sin

#: (rotary_dim, table columns, table batch) of head dim 8: a full table shared
#: by the batch; a half table per batch element past a partial rotary dim; a
#: full table of batch 1 (broadcast) past another partial rotary dim.
TABLE_GRAD_CASES = [(None, "full", None), (4, "half", 2), (6, "full", 1)]
#: The differentiable inputs of each op, in its argument order.
TABLE_GRAD_INPUTS = {
    "rope": ("q", "cos", "sin"),
    "rope_qk": ("q", "k", "cos", "sin"),
    "qk_norm_rope": ("q", "k", "q_weight", "k_weight", "cos", "sin"),
}


def _table_grad_case(op, rotary_dim, columns, table_batch, seq_dim, dtype, device):
    """The op's differentiable inputs, every one requiring grad: q (3 heads)
    and k (2 heads) ``[2, 5, H, 8]`` in ``seq_dim``'s layout, weights near 1,
    cos/sin of independent angles (the two entries of a full table's pair
    differ, so a gradient summed into the wrong entry shows)."""
    b, length, d = 2, 5, 8
    r = d if rotary_dim is None else rotary_dim
    heads = {"q": 3, "k": 2}
    tensors = {
        name: torch.randn((b, h, length, d) if seq_dim == 2 else (b, length, h, d), device=device)
        for name, h in heads.items()
    }
    tensors.update(q_weight=1 + 0.1 * torch.randn(d, device=device), k_weight=1 + 0.1 * torch.randn(d, device=device))
    tensors["cos"], tensors["sin"] = _tables(
        ((table_batch,) if table_batch else ()) + (length, r // 2 if columns == "half" else r), device
    )
    return [tensors[name].to(dtype).requires_grad_(True) for name in TABLE_GRAD_INPUTS[op]]


def _rotations(impl, op, tensors, interleaved, seq_dim, rotary_dim, inverse=False):
    """The outputs of ``op`` from ``impl``: the public functions (``rope_ops``),
    ``torch.ops.fused`` or the reference (``ref``), which share the argument
    order; ``inverse`` (the op's own argument) is not passed to public functions."""
    extra = (inverse,) if inverse else ()
    if op == "rope":
        x, cos, sin = tensors
        return (impl.rope(x, cos, sin, interleaved, seq_dim, rotary_dim, *extra),)
    if op == "rope_qk":
        return tuple(impl.rope_qk(*tensors, interleaved, seq_dim, rotary_dim, *extra))
    return tuple(impl.qk_norm_rope(*tensors, 1e-6, interleaved, seq_dim, rotary_dim))


@pytest.mark.kernels
@pytest.mark.parametrize("seq_dim", [1, 2])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("op", ["rope", "rope_qk", "qk_norm_rope"])
def test_kernels_cos_sin_grads_match_fp64_reference(op, interleaved, seq_dim):
    """cos and sin that require grad get the reference's gradients (fp32
    inputs against fp64 autograd of the reference), summed over heads, q and
    k, the batch of a shared table and the two entries of a half table's pair;
    every other input's gradient is unchanged by asking for them."""
    for rotary_dim, columns, table_batch in TABLE_GRAD_CASES:
        tensors = _table_grad_case(op, rotary_dim, columns, table_batch, seq_dim, torch.float32, KERNEL_DEVICE)
        outs = _rotations(rope_ops, op, tensors, interleaved, seq_dim, rotary_dim)
        dys = [torch.randn_like(o) for o in outs]
        # The reference's gradients by autograd through its torch ops: x * cos + rotate(x) * sin.
        exact_in = _detached(tensors, torch.float64)
        exact = _rotations(ref, op, exact_in, interleaved, seq_dim, rotary_dim)
        got = torch.autograd.grad(outs, tensors, dys)
        want = torch.autograd.grad(exact, exact_in, [dy.double() for dy in dys])
        for name, t, g, w in zip(TABLE_GRAD_INPUTS[op], tensors, got, want):
            assert g.dtype == t.dtype and g.shape == t.shape, name
            torch.testing.assert_close(
                g.double(), w, rtol=1e-5, atol=1e-5, msg=lambda m, what=f"{op} d{name}": f"{what}: {m}"
            )


@pytest.mark.parametrize("seq_dim", [1, 2])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize(
    "op, inverse", [("rope", False), ("rope", True), ("rope_qk", False), ("rope_qk", True), ("qk_norm_rope", False)]
)
def test_cos_sin_grads_pass_gradcheck_fp64(op, inverse, interleaved, seq_dim):
    """fp64 gradcheck of every input, cos and sin included, through the
    registered autograd on the reference path (the inverse rotation too: the
    backward's own op)."""
    for rotary_dim, columns, table_batch in TABLE_GRAD_CASES:
        tensors = _table_grad_case(op, rotary_dim, columns, table_batch, seq_dim, torch.float64, "cpu")

        def f(*ts, rotary_dim=rotary_dim):
            return _rotations(torch.ops.fused, op, ts, interleaved, seq_dim, rotary_dim, inverse)

        assert torch.autograd.gradcheck(f, tensors, eps=1e-6, atol=1e-8, rtol=1e-7)


def _loss(impl, op, interleaved, seq_dim, rotary_dim, *tensors):
    """A loss of the op's outputs that weights every element differently."""
    outs = _rotations(impl, op, tensors, interleaved, seq_dim, rotary_dim)
    return sum((o * o.detach().sin()).sum() for o in outs)


def test_cos_sin_grads_under_compile_fullgraph():
    """The same gradients from a torch.compile(fullgraph=True) graph (AOT
    autograd's joint graph through the registered backward) as from the
    reference: the three ops, one layout each, fp64 on the reference path."""
    torch._dynamo.reset()
    cases = [
        ("rope", True, 2, 6, "full", 1),
        ("rope_qk", False, 1, 4, "half", 2),
        ("qk_norm_rope", True, 1, None, "full", None),
    ]
    for op, interleaved, seq_dim, rotary_dim, columns, table_batch in cases:
        tensors = _table_grad_case(op, rotary_dim, columns, table_batch, seq_dim, torch.float64, "cpu")
        args = (op, interleaved, seq_dim, rotary_dim)
        compiled = torch.compile(_loss, fullgraph=True, backend="aot_eager")
        got = torch.autograd.grad(compiled(rope_ops, *args, *tensors), tensors)
        exact_in = _detached(tensors)
        want = torch.autograd.grad(_loss(ref, *args, *exact_in), exact_in)
        for name, g, w in zip(TABLE_GRAD_INPUTS[op], got, want):
            torch.testing.assert_close(g, w, msg=lambda m, what=f"{op} d{name}": f"{what}: {m}")


# ------------------------------------------------------------ 3D video RoPE

#: (convention, dim, overrides, (frames, height, width), heads): small grids of
#: each convention; LTX rotates its whole inner dim (heads = 1, D = inner dim).
GRID_CASES = [
    ("wan", 24, {}, (3, 4, 5), 2),
    ("wan", 128, {}, (2, 3, 7), 1),
    ("hunyuan", 32, {"axes_dims": (8, 12, 12)}, (3, 4, 5), 2),
    ("hunyuan", 128, {}, (2, 3, 5), 1),
    ("ltx", 48, {}, (3, 4, 5), 1),
    ("ltx", 50, {"rope_interpolation_scale": (0.32, 32.0, 32.0)}, (2, 3, 4), 1),  # padding pairs
]


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_dim", [1, 2])
@pytest.mark.parametrize("convention,dim,overrides,grid,heads", GRID_CASES)
def test_kernels_rope_grid_match_table_reference(convention, dim, overrides, grid, heads, seq_dim, dtype):
    """Angles computed in the kernel against fp64 tables of the same spec
    (forward and backward), with PyTorch's error being that of diffusers' own
    route: fp32 tables, fp32 arithmetic, rounded."""
    torch.manual_seed(0)
    spec = grid_rope(convention, dim, **overrides)
    frames, height, width = grid
    L = frames * height * width
    q = _heads(dtype, 2, heads, L, dim, seq_dim, False, KERNEL_DEVICE)
    k = _heads(dtype, 2, heads, L, dim, seq_dim, True, KERNEL_DEVICE)
    got = rope_ops.rope_grid(q, k, spec, height, width, seq_dim)
    cos64, sin64 = ref.grid_tables(spec, L, height, width)
    cos, sin = cos64.float().to(KERNEL_DEVICE), sin64.float().to(KERNEL_DEVICE)
    exact_in, plain_in = _detached((q, k), torch.float64), _detached((q, k))
    r = spec.rotary_dim
    exact = [
        ref.rope(x, cos64.to(KERNEL_DEVICE), sin64.to(KERNEL_DEVICE), spec.interleaved, seq_dim, r) for x in exact_in
    ]
    plain = [_at_dtype(x, cos, sin, spec.interleaved, seq_dim, r) for x in plain_in]
    dys = [torch.randn_like(g) for g in got]
    grads = torch.autograd.grad(got, (q, k), dys)
    exact_grads = torch.autograd.grad(exact, exact_in, [dy.double() for dy in dys])
    plain_grads = torch.autograd.grad(plain, plain_in, dys)
    for name, g, e, p, dg, de, dp in zip("qk", got, exact, plain, grads, exact_grads, plain_grads):
        assert_within_torch_error(g, e, p, 2.0, f"rope_grid {name}")
        assert_within_torch_error(dg, de, dp, 3.0, f"rope_grid d{name}")


def test_grid_rope_table_reference_matches_explicit_angles():
    """grid_tables against angles written out per token for a hand-made spec
    (axis -1 pairs stay unrotated)."""
    spec = GridRope(
        frequencies=(1.0, 0.5, 0.25, 2.0),
        axes=(0, 1, 2, -1),
        position_scale=(1.0, 2.0, 0.5),
        position_offset=(0.0, -1.0, 0.25),
    )
    cos, sin = ref.grid_tables(spec, 2 * 3 * 4, 3, 4)
    for token, (f, h, w) in enumerate((f, h, w) for f in range(2) for h in range(3) for w in range(4)):
        angles = torch.tensor([f * 1.0, (2.0 * h - 1.0) * 0.5, (0.5 * w + 0.25) * 0.25, 0.0], dtype=torch.float64)
        assert torch.allclose(cos[token], angles.cos(), atol=1e-15)
        assert torch.allclose(sin[token], angles.sin(), atol=1e-15)


def _bad_input_cases():
    x = torch.randn(2, 3, 5, 16)
    c = torch.randn(5, 16)
    return [
        (
            lambda: rope_ops.rope(torch.randn(2, 5, 16), c, c),
            ValueError,
            r"rope: x must be \[B, L, H, D\] or \[B, H, L, D\]",
        ),
        (
            lambda: rope_ops.rope(torch.randn(2, 3, 5, 15), torch.randn(5, 15), torch.randn(5, 15)),
            ValueError,
            r"head dim D=15 is odd",
        ),
        (
            lambda: rope_ops.rope(x, c, c, rotary_dim=7),
            ValueError,
            r"rotary_dim must be an even int in \[2, D=16\], got 7",
        ),
        (lambda: rope_ops.rope(x, c, c, rotary_dim=18), ValueError, r"rotary_dim must be an even int"),
        (
            lambda: rope_ops.rope(x, torch.randn(6, 16), torch.randn(6, 16)),
            ValueError,
            r"cos has 6 positions but x has L=5 along seq_dim=2",
        ),
        (lambda: rope_ops.rope(x, c, c, seq_dim=3), ValueError, r"seq_dim must be 1 .* or 2"),
        (
            lambda: rope_ops.rope(x, torch.randn(5, 12), torch.randn(5, 12)),
            ValueError,
            r"cos must have rotary_dim=16 \(a full table\) or 8 .* got 12",
        ),
        (lambda: rope_ops.rope(x, c, torch.randn(5, 8)), ValueError, r"cos and sin must have the same shape"),
        (
            lambda: rope_ops.rope(x, torch.randn(3, 5, 16), torch.randn(3, 5, 16)),
            ValueError,
            r"per batch but x has B=2",
        ),
        (lambda: rope_ops.rope(x.int(), c, c), TypeError, r"x must have a floating dtype"),
        (lambda: rope_ops.rope(x, c.to("meta"), c), ValueError, r"cos is on meta but x is on cpu"),
        # q and k together
        (lambda: rope_ops.rope_qk(x, x.half(), c, c), TypeError, r"rope_qk: q and k must have the same dtype"),
        (
            lambda: rope_ops.rope_qk(x, torch.randn(2, 3, 6, 16), c, c),
            ValueError,
            r"rope_qk: q and k must have the same length \(seq_dim\)",
        ),
        (lambda: rope_ops.rope_qk(x, torch.randn(2, 3, 5, 8), c, c), ValueError, r"same head dim"),
        (lambda: rope_ops.rope_qk(x, x.to("meta"), c, c), ValueError, r"k is on meta but q is on cpu"),
        (lambda: rope_ops.rope_qk(x, x[0], c, c), ValueError, r"q and k must be \[B, L, H, D\]"),
        # qk_norm_rope
        (
            lambda: rope_ops.qk_norm_rope(x, x, torch.ones(8), torch.ones(16), c, c),
            ValueError,
            r"qk_norm_rope: q_weight must have shape \(16,\), the head dim of q, or \(48,\), its heads x head dim, "
            r"got \(8,\)",
        ),
        (
            lambda: rope_ops.qk_norm_rope(x, x, torch.ones(48), torch.ones(16), c, c),
            ValueError,
            r"qk_norm_rope: q_weight and k_weight must both be per head \(\[D\]\) or both span the heads "
            r"\(\[H \* D\]\), got shapes \(48,\) and \(16,\)",
        ),
        (
            lambda: rope_ops.qk_norm_rope(x, x, torch.ones(16), torch.ones(16, dtype=torch.int32), c, c),
            TypeError,
            r"k_weight must have a floating dtype",
        ),
        (
            lambda: rope_ops.qk_norm_rope(x, x, torch.ones(16), torch.ones(16), c, c, eps=-1.0),
            ValueError,
            r"eps must be >= 0",
        ),
        (
            lambda: rope_ops.qk_norm_rope(x, x, torch.ones(16), torch.ones(16), torch.randn(5, 6), torch.randn(5, 6)),
            ValueError,
            r"cos must have rotary_dim=16",
        ),
        # the quantizing mode (8-bit attention's q and k)
        (
            lambda: rope_ops.rope_qk(x, x, c, c, quantize=True),
            TypeError,
            r"qk_rope_int8: q and k must be float16 or bfloat16 \(8-bit attention quantizes 16-bit activations\), "
            r"got torch.float32",
        ),
        (
            lambda: torch.ops.fused.qk_rope_int8(x.half(), x.half(), torch.ones(16), None, c, c, 1e-6, True, 2),
            ValueError,
            r"q_weight and k_weight must both be given .* got q_weight=a tensor and k_weight=None",
        ),
        (
            lambda: rope_ops.qk_norm_rope(x.half(), x.half(), torch.ones(8), torch.ones(16), c, c, quantize=True),
            ValueError,
            r"qk_rope_int8: q_weight must have shape \(16,\)",
        ),
        (
            lambda: rope_ops.rope_qk(x.half(), x.half(), c, c, quantize=True)[0].float().sum().backward(),
            RuntimeError,
            r"element 0 of tensors does not require grad",
        ),
        # grid RoPE
        (
            lambda: rope_ops.rope_grid(x, x, grid_rope("wan", 16), 2, 2),
            ValueError,
            r"rope_grid: q has L=5 tokens along seq_dim=2, not a whole number of height x width = 2 x 2 frames",
        ),
        (
            lambda: rope_ops.rope_grid(x, x, grid_rope("wan", 24), 1, 5),
            ValueError,
            r"the grid RoPE rotates 24 channels but q's head dim is D=16",
        ),
        (
            lambda: rope_ops.rope_grid(x, x, grid_rope("wan", 16), 0, 5),
            ValueError,
            r"height must be an int in \[1, 4096\], got 0",
        ),
        (
            lambda: torch.ops.fused.rope_grid(x, x, torch.zeros(6, 8, dtype=torch.float64), 1, 5, True, 2),
            ValueError,
            r"constants must be a \[6, P\] fp32 tensor from GridRope.constants\(\), got torch.float64",
        ),
        (lambda: GridRope(frequencies=(1.0,), axes=(3,)), ValueError, r"GridRope: axes must be 0 \(frame\)"),
        (lambda: grid_rope("sd3", 16), ValueError, r"grid_rope: unknown convention .sd3."),
    ]


test_bad_input_raises_a_clear_error = bad_input_test(_bad_input_cases)


# ------------------------------------------------- the quantizing mode (qk_rope_int8)


def _int8_rope_case(seq_dim, b, hq, hk, length, d, r, dtype, device, key_offset=3.0):
    """q, k (keys offset per channel: what the smoothing removes) and full
    interleaved tables of rotary dim ``r``."""

    def t(h):
        shape = (b, length, h, d) if seq_dim == 1 else (b, h, length, d)
        return torch.randn(shape, device=device)

    offset = torch.linspace(-key_offset, key_offset, d, device=device)
    q, k = (2 * t(hq)).to(dtype), (t(hk) + offset).to(dtype)
    angle = torch.randn(length, r // 2, device=device) * 3
    return q, k, angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1)


@pytest.mark.kernels
@pytest.mark.parametrize("norm", ["head", "heads", None], ids=["qk_norm_rope", "qk_norm_rope_heads", "rope_qk"])
@pytest.mark.parametrize(
    "seq_dim, b, hq, hk, length, d, r, interleaved",
    [
        (1, 2, 4, 2, 300, 64, 64, True),  # GQA, three key blocks (the last partial), packed int8 pairs
        (2, 1, 2, 2, 128, 40, 32, False),  # one whole key block, half-split pairs, a tail past the rotary dim
        (1, 1, 3, 1, 70, 128, 128, True),  # MQA, a single partial block, Flux's and Wan's head dim
    ],
)
def test_kernels_quantizing_rotation_writes_the_specified_operands(norm, seq_dim, b, hq, hk, length, d, r, interleaved):
    """``rope_qk``/``qk_norm_rope(..., quantize=True)`` (``fused.qk_rope_int8``;
    the norm per head or over the heads) against its specification, the 16-bit op then
    ``reference.attention.smooth_quantize_qk``: q's INT8 values and scales
    identical (on a GPU with the norm: see below); k's within 1 (its mean is
    summed in another order) and its block scales within an fp32 rounding.
    Both layouts; both dtypes on a GPU (fp16 under the interpreter). The
    16-bit op is the one on the kernels' device, whose norm differs from the
    reference's by its sum's order."""
    torch.manual_seed(0)
    for dtype in (torch.float16,) + (() if INTERPRET else (torch.bfloat16,)):  # the interpreter's time
        q, k, cos, sin = _int8_rope_case(seq_dim, b, hq, hk, length, d, r, dtype, KERNEL_DEVICE)
        widths = (hq * d, hk * d) if norm == "heads" else (d, d)
        weights = [torch.rand(n, device=KERNEL_DEVICE) + 0.5 for n in widths]
        if norm:
            got = rope_ops.qk_norm_rope(q, k, *weights, cos, sin, 1e-6, interleaved, seq_dim, r, quantize=True)
        else:
            got = rope_ops.rope_qk(q, k, cos, sin, interleaved, seq_dim, r, quantize=True)
        if norm:
            q16, k16 = rope_ops.qk_norm_rope(q, k, *weights, cos, sin, 1e-6, interleaved, seq_dim, r)
        else:
            q16, k16 = rope_ops.rope_qk(q, k, cos, sin, interleaved, seq_dim, r)
        want = attention_ref.smooth_quantize_qk(q16.cpu(), k16.cpu(), seq_dim)
        q8, q_scale, k8, k_scale = (t.cpu() for t in got)
        assert q8.dtype == k8.dtype == torch.int8 and q8.shape == q.shape and k8.shape == k.shape
        assert q_scale.shape == (b, hq, length) and k_scale.shape == (b, hk, -(-length // 128))
        if norm and KERNEL_DEVICE == "cuda":
            # The quantizing kernel's layout (128 positions a program) sums the norm's squares in
            # another order than the 16-bit op's: a rare 16-bit value rounds to its neighbour, which
            # moves its INT8 value by at most 1 and its row's scale by at most one 16-bit step.
            assert (q8.int() - want[0].int()).abs().max() <= 1 and (q8 != want[0]).float().mean() < 1e-3
            torch.testing.assert_close(q_scale, want[1], rtol=2**-7, atol=0)
            assert (q_scale != want[1]).float().mean() < 1e-2
        else:
            assert torch.equal(q8, want[0]) and torch.equal(q_scale, want[1])
        assert (k8.int() - want[2].int()).abs().max() <= 1 and (k8 != want[2]).float().mean() < 1e-3
        torch.testing.assert_close(k_scale, want[3], rtol=1e-6, atol=0)


def test_quantizing_rotation_is_the_16_bit_rotation_then_the_8_bit_quantization():
    """The specification, stated: on the reference path the quantized q and k
    are exactly smooth_quantize_qk of the 16-bit op's output, and 8-bit
    attention given them equals 8-bit attention given the 16-bit q and k."""
    import compile_ops

    torch.manual_seed(0)
    q, k, cos, sin = _int8_rope_case(1, 1, 2, 2, 200, 32, 32, torch.bfloat16, "cpu")
    w = torch.rand(32) + 0.5
    v = torch.randn(1, 200, 2, 32, dtype=torch.bfloat16)
    qk = rope_ops.qk_norm_rope(q, k, w, w, cos, sin, 1e-6, True, 1, quantize=True)
    q16, k16 = rope_ops.qk_norm_rope(q, k, w, w, cos, sin, 1e-6, True, 1)
    for got, want in zip(qk, attention_ref.smooth_quantize_qk(q16, k16, 1)):
        assert torch.equal(got, want)
    for precision in ("int8", "int8_fp8"):
        assert torch.equal(
            compile_ops.attention(qk, None, v, seq_dim=1, precision=precision),
            compile_ops.attention(q16, k16, v, seq_dim=1, precision=precision),
        )
