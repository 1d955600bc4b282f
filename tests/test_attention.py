"""The attention family's public op: fused.attention and fused.attention_backward.

``kernels`` tests run the Triton kernels (CUDA, or CPU under the interpreter:
fp16/fp32 only there, its bf16 arithmetic is wrong) against an fp64 reference
by the two-reference rule: the kernel's error at most 2x (forward) / 3x
(backward) that of PyTorch's own attention at the input dtype (SDPA for
fp16/bf16; for fp32 the same math, with TF32 matmuls where the session's fp32
matmul precision lets the kernels use TF32 dots on a GPU).

Here: the forward and backward over random shapes against that reference, the
edge rows and lengths, the SDPA drop-in, the reference path, the fp32 dots'
precision setting, and every argument refusal. The family's other files, by
topic: test_attention_backward.py (the backward's kernel choices and
determinism), test_attention_8bit.py (precision="int8" and "int8_fp8"),
test_attention_launch.py (launch options and program order) and
test_attention_sm90.py (the sm_90 forward core); what they share is in
attention_helpers.py.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from attention_helpers import LSE_ROUNDINGS, _qkv, torch_at_dtype
from bad_input import bad_input_test
from conftest import INTERPRET, KERNEL_DEVICE
from hypothesis import given
from hypothesis import strategies as st
from numerics import assert_within_torch_error
from shapes import size

import compile_ops
from compile_ops.reference import attention as ref

DTYPES = [torch.float16, torch.float32] + ([] if INTERPRET else [torch.bfloat16])


# ---------------------------------------------------------------- layer 3/4: kernels vs reference


@st.composite
def attention_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    b = draw(st.integers(1, 2))
    hk = draw(st.integers(1, 2))
    hq = hk * draw(st.sampled_from([1, 2, 3]))
    lengths = size(st.one_of(st.integers(1, 80), st.sampled_from([97, 113, 129])), [1, 17, 64, 129])
    lq, lk = draw(lengths), draw(lengths)
    d = draw(size(st.sampled_from([16, 32, 40, 64, 72, 80, 96, 128]), [40, 64, 128]))
    seq_dim = draw(st.sampled_from([1, 2]))
    causal = draw(st.booleans())
    padded = draw(st.booleans())
    kv_lengths = [draw(st.integers(1, lk)) for _ in range(b)] if padded else None
    scale = draw(st.sampled_from([None, 0.5]))
    return dtype, b, hq, hk, lq, lk, d, seq_dim, causal, kv_lengths, scale


def _cancelled_sums_scale(dout, v, seq_dim, scale):
    """``scale * max_ij sum_d |dO_id| |v_jd|`` (fp64, over every head pair q
    head i / its k head): the magnitude of the two sums the backward's
    ``dS = P (dO.V - rowsum(dO * O))`` cancels, times the softmax scale."""
    do, vv = dout.detach().double().abs(), v.detach().double().abs()
    if seq_dim == 1:
        do, vv = do.transpose(1, 2), vv.transpose(1, 2)
    if do.numel() == 0 or vv.numel() == 0:
        return 0.0
    vv = vv.repeat_interleave(do.shape[1] // vv.shape[1], 1)
    return scale * (do @ vv.transpose(-1, -2)).max().item()


@pytest.mark.kernels
@given(attention_cases())
def test_kernels_match_fp64_reference_forward_and_backward(case):
    dtype, b, hq, hk, lq, lk, d, seq_dim, causal, kv_lengths, scale = case
    dev = KERNEL_DEVICE
    torch.manual_seed(0)  # reruns of a failing example see the same data
    q, k, v = _qkv(b, hq, hk, lq, lk, d, seq_dim, dtype, dev)
    kv = None if kv_lengths is None else torch.tensor(kv_lengths, dtype=torch.int32, device=dev)
    scale_value = 1 / math.sqrt(d) if scale is None else scale
    out, lse = compile_ops.attention(q, k, v, scale, causal, seq_dim, kv, return_lse=True)

    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    exact, exact_lse = ref.attention(qd, kd, vd, scale_value, causal, seq_dim, kv)
    dout = torch.randn_like(out)
    plain, theirs, plain_lse = torch_at_dtype(
        q.detach(), k.detach(), v.detach(), dout, scale_value, causal, seq_dim, kv
    )

    assert out.dtype == dtype and out.shape == q.shape and out.is_contiguous()
    # fp32: each output sums its Lk terms p v at fp32, rescaling the running sum once per key tile, in
    # another order than torch's matmul (the GPU found 5.6e-7 against torch's 2.0e-7 at outputs up to 1.2: about
    # 4 ulps against 1.4, fp32 block-sparse, HYPOTHESIS_SEED=90210).
    assert_within_torch_error(out, exact, plain, 2.0, "output", terms=lk if dtype == torch.float32 else 1)
    # The lse takes fp32 roundings at its own scale that torch's logsumexp can
    # dodge by luck: the running max times scale * log2(e) (one fma per score
    # for 16-bit inputs) and m * scale + ln(l) (Hypothesis, fp16, D=16,
    # Lk=777: 2.2e-6 against torch's 5.7e-7 at lse ~8).
    assert_within_torch_error(lse, exact_lse, plain_lse, 2.0, "lse", fp32_roundings=LSE_ROUNDINGS)

    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(exact, (qd, kd, vd), dout.double())
    cancelled = _cancelled_sums_scale(dout, vd, seq_dim, scale_value)
    for name, g, e, p in zip("qkv", got, want, theirs):
        assert g.dtype == dtype
        # fp32 accumulators everywhere: an fp32 gradient sums its L terms at
        # fp32, a half one rounds once. dS = P (dO.V - rowsum(dO * O)) cancels
        # two D-term fp32 sums taken in different orders (a tensor-core dot and
        # a row sum), which torch's own fp32 run can land on exactly. Their
        # roundings are at the scale of those sums times |k| (dq) or |q| (dk),
        # which can exceed the gradient's own: with one key, dq is exactly 0
        # and the kernel's 2.2e-5 (fp32, D=128, scale 0.5; HYPOTHESIS_SEED
        # 20261125 on an H100) is that cancellation. A tree of D terms
        # rounds about log2(D) times, twice.
        summed = (lk if name == "q" else lq) if dtype == torch.float32 else 1
        roundings = d
        if name != "v":
            other = (kd if name == "q" else qd).detach().abs().max().item() if lq * lk else 0.0
            output_scale = max(e[torch.isfinite(e)].abs().max().item() if e.numel() else 0.0, 1.0)
            roundings = max(d, math.ceil(2 * math.log2(max(d, 2)) * cancelled * other / output_scale))
        assert_within_torch_error(g, e, p, 3.0, f"d{name}", terms=summed, fp32_roundings=roundings)


@pytest.mark.kernels
def test_kernels_rows_with_no_visible_key_give_zero_not_nan():
    dev = KERNEL_DEVICE
    q, k, v = _qkv(2, 2, 1, 5, 6, 16, 2, torch.float16, dev)
    kv = torch.tensor([0, 3], dtype=torch.int32, device=dev)
    out, lse = compile_ops.attention(q, k, v, None, False, 2, kv, return_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.equal(dq[0], torch.zeros_like(dq[0])) and torch.equal(dk[0], torch.zeros_like(dk[0]))
    assert torch.equal(dv[1, :, 3:], torch.zeros_like(dv[1, :, 3:]))  # padded keys get no gradient


@pytest.mark.kernels
@pytest.mark.parametrize("length", [1, 2, 3])
def test_kernels_large_scores_at_tiny_lengths_do_not_overflow(length):
    dev = KERNEL_DEVICE
    q, k, v = _qkv(1, 2, 2, length, length, 16, 2, torch.float32, dev)
    q = (q.detach() * 300).requires_grad_(True)
    out = compile_ops.attention(q, k, v, None, True)
    exact, _ = ref.attention(q.detach().double(), k.detach().double(), v.detach().double(), 0.25, True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), exact, rtol=1e-2, atol=1e-2)  # TF32 on a GPU
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.kernels
def test_kernels_sdpa_drop_in():
    dev = KERNEL_DEVICE
    q, k, v = _qkv(1, 4, 1, 33, 21, 32, 2, torch.float16, dev)
    got = compile_ops.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)


# ---------------------------------------------------------------- reference path


def test_sdpa_signature_rejects_masks_and_dropout():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="attn_mask is not supported"):
        compile_ops.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="dropout_p must be 0"):
        compile_ops.scaled_dot_product_attention(q, q, q, dropout_p=0.1)


def test_reference_matches_sdpa():
    q, k, v = (torch.randn(2, 4, 9, 16, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        out, _ = ref.attention(q, k[:, :2], v[:, :2], 0.3, causal)
        want = F.scaled_dot_product_attention(q, k[:, :2], v[:, :2], is_causal=causal, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out, want)


# ---------------------------------------------------------------- bad input


def _bad_input_cases():
    def qkv(*shapes, dtype=torch.float16):
        return [torch.randn(s).to(dtype) for s in shapes]

    q, k, v = qkv((2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16))
    att = torch.ops.fused.attention
    qk8, qk8_op = _quantized_for_bad_input(q, k), torch.ops.fused.attention_qk8
    return [
        (
            lambda: att(*qkv((2, 4, 8, 16), (2, 2, 8, 32), (2, 2, 8, 32)), 0.1, False),
            ValueError,
            r"head dims differ: q 16, k 32",
        ),
        (
            lambda: att(*qkv((2, 4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)), 0.1, False),
            ValueError,
            r"batch sizes differ: q 2, k 1",
        ),
        (
            lambda: att(*qkv((2, 4, 8, 16), (2, 3, 8, 16), (2, 3, 8, 16)), 0.1, False),
            ValueError,
            r"k/v heads \(3\) must divide q heads \(4\)",
        ),
        (lambda: att(q, k, v[:, :, :5], 0.1, False), ValueError, r"k and v must have the same heads and length"),
        (
            lambda: att(*qkv((2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16), dtype=torch.int32), 0.1, False),
            TypeError,
            r"q must have dtype float16",
        ),
        (lambda: att(q, k.float(), v, 0.1, False), TypeError, r"k has dtype torch.float32 but q has torch.float16"),
        (lambda: att(q[0], k, v, 0.1, False), ValueError, r"q must be 4-D \[B, H, L, D\]"),
        (
            lambda: att(*qkv((1, 1, 4, 300), (1, 1, 4, 300), (1, 1, 4, 300)), 0.1, False),
            ValueError,
            r"head dim D must be in \[1, 256\], got 300",
        ),
        (lambda: att(q, k, v, 0.1, False, 3), ValueError, r"seq_dim must be 2 .* or 1"),
        (lambda: att(q, k.to("meta"), v, 0.1, False), ValueError, r"k is on meta but q is on cpu"),
        (
            lambda: att(q, k, v, 0.1, False, 2, torch.tensor([8, 9])),
            ValueError,
            r"kv_lengths must be in \[0, Lk=8\], got values in \[8, 9\]",
        ),
        (lambda: att(q, k, v, 0.1, False, 2, torch.tensor([8])), ValueError, r"kv_lengths must have shape \(2,\)"),
        (lambda: att(q, k, v, 0.1, False, 2, torch.tensor([8.0, 8.0])), TypeError, r"kv_lengths must be int32"),
        # Python scalars are checked before the dispatcher would turn them into a bool (SDPA's rule)
        *[
            (
                lambda causal=causal: compile_ops.attention(q, k, v, causal=causal),
                TypeError,
                r"causal must be a bool, got (nan|0.5|2)",
            )
            for causal in (float("nan"), 0.5, 2)
        ],
        (
            lambda: compile_ops.attention(*qkv((1, 1, 4, 0), (1, 1, 4, 0), (1, 1, 4, 0))),
            ValueError,
            r"compile_ops.attention: q must have a non-empty last \(head\) dim D, got shape \(1, 1, 4, 0\)",
        ),
        (lambda: compile_ops.attention(q, k, v, scale="x"), TypeError, r"scale must be a float or None, got 'x'"),
        (
            lambda: compile_ops.attention(q.tolist(), k, v),
            TypeError,
            r"q must be a torch.Tensor or an Int8QK, got list",
        ),
        (
            lambda: compile_ops.attention(q, k, v, kv_lengths=[3, 5]),
            TypeError,
            r"kv_lengths must be a torch.Tensor or None, got list",
        ),
        # 8-bit attention on q and k quantized beforehand (Int8QK, fused.attention_qk8)
        (
            lambda: compile_ops.attention(qk8, k, v, precision="int8"),
            ValueError,
            r"compile_ops.attention: q is an Int8QK .* so k must be None, got Tensor",
        ),
        (
            lambda: compile_ops.attention(qk8, None, v),
            ValueError,
            r"q is an Int8QK \(quantized q and k\), which needs an 8-bit precision .* got precision='exact'",
        ),
        (lambda: compile_ops.attention_fp8_rows(qk8, k, v), ValueError, r"attention_fp8_rows: .* k must be None"),
        (
            lambda: qk8_op(q, qk8.q_scale, qk8.k, qk8.k_scale, v, 0.1, False),
            TypeError,
            r"attention_qk8: q must be int8 \(8-bit attention's quantized operand",
        ),
        (
            lambda: qk8_op(qk8.q, qk8.q_scale, qk8.k, qk8.k_scale, v.float(), 0.1, False),
            TypeError,
            r"attention_qk8: v must be float16 or bfloat16",
        ),
        (
            lambda: qk8_op(qk8.q, qk8.q_scale[:, :, :4], qk8.k, qk8.k_scale, v, 0.1, False),
            ValueError,
            r"q_scale must have shape \(2, 4, 8\) \(one scale per query and head\), got \(2, 4, 4\)",
        ),
        (
            lambda: qk8_op(qk8.q, qk8.q_scale, qk8.k, qk8.k_scale.double(), v, 0.1, False),
            TypeError,
            r"k_scale must be float32, got torch.float64",
        ),
        (
            lambda: qk8_op(*qk8, v, 0.1, False, 2, None, False, True),
            ValueError,
            r"fp8_rows=True \(e4m3 output rows\) is a mode of FP8 P V: pass pv_fp8=True too",
        ),
        (
            lambda: qk8_op(*qk8, v, 0.1, False, 2, None, True, True)[0].float().sum().backward(),
            RuntimeError,
            r"element 0 of tensors does not require grad",
        ),
    ]


@pytest.mark.kernels
@pytest.mark.skipif(not INTERPRET, reason="a property of triton's interpreter, which runs bf16 dots on raw bits")
def test_kernels_refuse_bf16_under_the_interpreter():
    """bf16 attention (and its backward) under TRITON_INTERPRET=1 raises where
    it used to return values around 1e8: the interpreter multiplies bf16 dot
    operands as integers."""
    q, k, v = (torch.randn(1, 2, 64, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with pytest.raises(TypeError, match=r"fused.attention: q is bfloat16, whose matrix products triton's interpreter"):
        compile_ops.attention(q, k, v)
    with pytest.raises(TypeError, match=r"fused.attention: q is bfloat16"):
        compile_ops.attention(q, k, v, precision="int8")
    out = compile_ops.attention(q.half(), k.half(), v.half())  # float16 runs
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3)


def _quantized_for_bad_input(q, k):
    return compile_ops.Int8QK(*ref.smooth_quantize_qk(q, k, 2))


test_bad_input_raises_a_clear_error = bad_input_test(_bad_input_cases)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp32_dots_follow_torchs_fp32_matmul_precision():
    """IEEE fp32 dots at torch's default ("highest"), TF32 where "high" allows
    them: the setting torch.matmul and SDPA follow."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda") for _ in range(3))
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        ieee = compile_ops.attention(q, k, v)
        torch.set_float32_matmul_precision("high")
        tf32 = compile_ops.attention(q, k, v)
    finally:
        torch.set_float32_matmul_precision(previous)

    def error(out):
        return ((out.double() - exact).norm() / exact.norm()).item()

    assert error(ieee) < 1e-5 and error(tf32) > 10 * error(ieee), (error(ieee), error(tf32))
