"""The RoPE family: fused.rope (both pair conventions, full and half tables,
partial rotary dims, both layouts, per-batch tables) and its backward.

``kernels`` tests run the Triton kernel (CUDA, or CPU under the interpreter)
against an fp64 reference with the two-reference rule and against diffusers'
own ``apply_rotary_emb``; the rest check validation on the reference path.
"""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import compile_ops.ops.rope as rope_ops
from compile_ops.reference import rope as ref
from bad_input import bad_input_test
from conftest import KERNEL_DEVICE
from numerics import assert_within_torch_error


def _tables(shape, device):
    angles = torch.rand(shape, device=device) * 6.3
    return angles.cos(), angles.sin()


@st.composite
def rope_cases(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    B, H, L = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 9))
    D = 2 * draw(st.integers(1, 40))
    rotary_dim = draw(st.sampled_from([None, 2 * draw(st.integers(1, D // 2))]))
    interleaved, half_table, per_batch = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    seq_dim, transposed = draw(st.sampled_from([1, 2])), draw(st.booleans())
    return dtype, B, H, L, D, rotary_dim, interleaved, half_table, per_batch, seq_dim, transposed


def _case(dtype, B, H, L, D, rotary_dim, interleaved, half_table, per_batch, seq_dim, transposed, device):
    other = (B, H, L, D) if seq_dim == 2 else (B, L, H, D)
    if transposed:  # the other layout, viewed: strided rows
        x = torch.randn(other[0], other[2], other[1], D, device=device).to(dtype).transpose(1, 2)
    else:
        x = torch.randn(other, device=device).to(dtype)
    r = D if rotary_dim is None else rotary_dim
    t = r // 2 if half_table else r
    cos, sin = _tables(((B,) if per_batch else ()) + (L, t), device)
    return x.requires_grad_(True), cos, sin, interleaved, seq_dim, rotary_dim


def _at_dtype(x, cos, sin, interleaved, seq_dim, rotary_dim):
    """diffusers' formula: fp32 arithmetic, rounded to x's dtype (its fp32 math
    is what the reference does too, so this is the reference at x's dtype)."""
    return ref.rope(x, cos, sin, interleaved, seq_dim, rotary_dim)


@pytest.mark.kernels
@given(rope_cases())
def test_kernels_match_fp64_reference_forward_and_backward(case):
    torch.manual_seed(0)
    x, cos, sin, interleaved, seq_dim, rotary_dim = _case(*case, KERNEL_DEVICE)
    got = rope_ops.rope(x, cos, sin, interleaved, seq_dim, rotary_dim)
    xd = x.detach().double().requires_grad_(True)
    exact = ref.rope(xd, cos.double(), sin.double(), interleaved, seq_dim, rotary_dim)
    xp = x.detach().clone().requires_grad_(True)
    plain = _at_dtype(xp, cos, sin, interleaved, seq_dim, rotary_dim)
    assert got.dtype == x.dtype and got.is_contiguous()
    assert_within_torch_error(got, exact, plain, 2.0, "rope output")
    dy = torch.randn_like(got)
    (gx,) = torch.autograd.grad(got, x, dy)
    (ex,) = torch.autograd.grad(exact, xd, dy.double())
    (px,) = torch.autograd.grad(plain, xp, dy)
    assert_within_torch_error(gx, ex, px, 3.0, "rope dx")


@pytest.mark.kernels
@pytest.mark.parametrize("interleaved", [True, False])
def test_kernels_match_diffusers_apply_rotary_emb(interleaved):
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    B, H, L, D = 2, 3, 7, 32
    x = torch.randn(B, H, L, D, device=KERNEL_DEVICE)
    cos, sin = embeddings.get_1d_rotary_pos_embed(D, L, use_real=True, repeat_interleave_real=interleaved)
    cos, sin = cos.to(KERNEL_DEVICE), sin.to(KERNEL_DEVICE)
    want = embeddings.apply_rotary_emb(x, (cos, sin), use_real=True,
                                       use_real_unbind_dim=-1 if interleaved else -2)
    torch.testing.assert_close(rope_ops.rope(x, cos, sin, interleaved), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("interleaved", [True, False])
def test_reference_equals_diffusers_apply_rotary_emb_exactly(interleaved):
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    x = torch.randn(2, 3, 7, 32)
    cos, sin = embeddings.get_1d_rotary_pos_embed(32, 7, use_real=True, repeat_interleave_real=interleaved)
    want = embeddings.apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1 if interleaved else -2)
    assert torch.equal(ref.rope(x, cos, sin, interleaved, 2), want)


def _bad_input_cases():
    x = torch.randn(2, 3, 5, 16)
    c = torch.randn(5, 16)
    return [
        (lambda: rope_ops.rope(torch.randn(2, 5, 16), c, c), ValueError, r"rope: x must be \[B, L, H, D\] or \[B, H, L, D\]"),
        (lambda: rope_ops.rope(torch.randn(2, 3, 5, 15), torch.randn(5, 15), torch.randn(5, 15)), ValueError,
         r"head dim D=15 is odd"),
        (lambda: rope_ops.rope(x, c, c, rotary_dim=7), ValueError, r"rotary_dim must be an even int in \[2, D=16\], got 7"),
        (lambda: rope_ops.rope(x, c, c, rotary_dim=18), ValueError, r"rotary_dim must be an even int"),
        (lambda: rope_ops.rope(x, torch.randn(6, 16), torch.randn(6, 16)), ValueError,
         r"cos has 6 positions but x has L=5 along seq_dim=2"),
        (lambda: rope_ops.rope(x, c, c, seq_dim=3), ValueError, r"seq_dim must be 1 .* or 2"),
        (lambda: rope_ops.rope(x, torch.randn(5, 12), torch.randn(5, 12)), ValueError,
         r"cos must have rotary_dim=16 \(a full table\) or 8 .* got 12"),
        (lambda: rope_ops.rope(x, c, torch.randn(5, 8)), ValueError, r"cos and sin must have the same shape"),
        (lambda: rope_ops.rope(x, torch.randn(3, 5, 16), torch.randn(3, 5, 16)), ValueError, r"per batch but x has B=2"),
        (lambda: rope_ops.rope(x.int(), c, c), TypeError, r"x must have a floating dtype"),
        (lambda: rope_ops.rope(x, c.to("meta"), c), ValueError, r"cos is on meta but x is on cpu"),
    ]


test_bad_input_raises_a_clear_error = bad_input_test(_bad_input_cases)
