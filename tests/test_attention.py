"""The attention family: fused.attention and fused.attention_backward.

``kernels`` tests run the Triton kernels (CUDA, or CPU under the interpreter:
fp16/fp32 only there, its bf16 arithmetic is wrong) against an fp64 reference
by the two-reference rule: the kernel's error at most 2x (forward) / 3x
(backward) that of PyTorch's own attention at the input dtype (SDPA for
fp16/bf16; for fp32 the same math, with TF32 matmuls where the session's fp32
matmul precision lets the kernels use TF32 dots on a GPU).
"""

import dataclasses
import math
import types

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from bad_input import bad_input_test
from conftest import INTERPRET, KERNEL_DEVICE, allow_tma_under_interpreter, deterministic_algorithms, tf32_dots
from hypothesis import given
from hypothesis import strategies as st
from numerics import assert_within_torch_error
from shapes import size

import compile_ops
from compile_ops._library import clear_launch_plans, multiprocessor_count
from compile_ops.kernels.attention_common import program_rank
from compile_ops.reference import attention as ref

LSE_ROUNDINGS = 2
DTYPES = [torch.float16, torch.float32] + ([] if INTERPRET else [torch.bfloat16])


def _bhld(t, seq_dim):
    return t if seq_dim == 2 else t.transpose(1, 2)


def _tf32(t):
    """fp32 values cut to TF32's 10 mantissa bits as the tensor cores read fp32
    operands that triton hands them: the low 13 bits dropped (truncation)."""
    i = t.float().contiguous().view(torch.int32)
    return (i & ~0x1FFF).view(torch.float32)


def _fp32_flash(q, k, v, dout, scale, causal, kv_lengths, operand, allowed=None):
    """The flash formulas at fp32 on ``[B, H, L, D]`` tensors, every dot
    operand passed through ``operand``: ``(out, (dq, dk, dv), lse)``."""
    hq, hk = q.shape[1], k.shape[1]
    k, v = (t.repeat_interleave(hq // hk, 1) for t in (k, v))
    s = operand(q) @ operand(k).transpose(-1, -2) * scale
    s = s.masked_fill(~_mask(q.shape[2], k.shape[2], causal, kv_lengths, q.shape[0], q.device, allowed), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0)[..., None])
    out = operand(p) @ operand(v)
    ds = p * (operand(dout) @ operand(v).transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    dq = operand(ds) @ operand(k) * scale
    dk = (operand(ds).transpose(-1, -2) @ operand(q) * scale).unflatten(1, (hk, -1)).sum(2)
    dv = (operand(p).transpose(-1, -2) @ operand(dout)).unflatten(1, (hk, -1)).sum(2)
    return out, (dq, dk, dv), lse


def _mask(lq, lk, causal, kv_lengths, batch, device, allowed):
    mask = ref.visible(lq, lk, causal, kv_lengths, batch, device)
    return mask if allowed is None else mask & allowed


def torch_at_dtype(q, k, v, dout, scale, causal, seq_dim, kv_lengths, allowed=None):
    """What PyTorch computes at the input dtype: ``(out, (dq, dk, dv), lse)``;
    ``allowed``: an extra ``[B, H, Lq, Lk]`` token mask (block-sparse tests).

    fp16/bf16: SDPA and its backward (on a GPU its flash backend). fp32: the
    flash formulas that SDPA's fp32 backends use (their backward forms
    ``rowsum(dO * O)`` and cancels against it), with every dot operand rounded
    to TF32 on a GPU when torch's fp32 matmul precision allows TF32, as the
    kernels then use TF32 dots (IEEE dots otherwise; the interpreter's dots
    are exact fp32).
    """
    q, k, v, dout = (_bhld(t.detach(), seq_dim) for t in (q, k, v, dout))
    if q.dtype == torch.float32:
        operand = _tf32 if tf32_dots(q.device) else (lambda t: t)
        out, grads, lse = _fp32_flash(q, k, v, dout, scale, causal, kv_lengths, operand, allowed)
    else:
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        mask = _mask(q.shape[2], k.shape[2], causal, kv_lengths, q.shape[0], q.device, allowed)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        grads = torch.autograd.grad(out, (q, k, v), dout)
        # SDPA does not return its lse: the fp32 logsumexp of the scores of the
        # half-precision inputs, which tensor cores accumulate in fp32 too.
        lse = ref.attention(*(t.detach().float() for t in (q, k, v)), scale, causal, 2, kv_lengths, allowed)[1]
    return _bhld(out, seq_dim).detach(), tuple(_bhld(g, seq_dim) for g in grads), lse


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


def _qkv(b, hq, hk, lq, lk, d, seq_dim, dtype, device):
    def t(h, length):
        shape = (b, h, length, d) if seq_dim == 2 else (b, length, h, d)
        return torch.randn(shape, device=device).to(dtype).requires_grad_(True)

    return t(hq, lq), t(hk, lk), t(hk, lk)


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
def test_kernels_backward_is_deterministic_with_a_non_contiguous_grad():
    dev = KERNEL_DEVICE
    q, k, v = _qkv(1, 4, 2, 70, 90, 64, 1, torch.float16, dev)
    out = compile_ops.attention(q, k, v, None, True, 1)
    dout = torch.randn(out.shape[::-1], device=dev, dtype=out.dtype).permute(3, 2, 1, 0)  # no unit stride
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for _ in range(2):
        again = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    # The same gradient, contiguous: the layout of dO must not change a bit.
    contiguous = torch.autograd.grad(out, (q, k, v), dout.contiguous())
    assert all(torch.equal(a, b) for a, b in zip(first, contiguous))


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


@pytest.mark.kernels
@pytest.mark.parametrize(
    "seq_dim, hq, hk, lq, lk, d",
    [
        (1, 4, 2, 50, 300, 64),  # GQA, a partial last key block
        (2, 2, 2, 130, 256, 128),  # whole key blocks: v needs no row padding
    ],
)
def test_kernels_attention_on_quantized_qk_is_the_8bit_ops(seq_dim, hq, hk, lq, lk, d):
    """``attention(Int8QK, None, v, precision=...)`` (``fused.attention_qk8``)
    given k quantized by the 8-bit ops' own Triton pass and q by the
    specification is bit for bit those ops, whose kernel rounds q itself
    (the same products on the same operands, v quantized alone), in all
    three output forms."""
    from compile_ops.ops import attention_8bit

    torch.manual_seed(0)
    q, k, v = _int8_case(seq_dim, 2, hq, hk, lq, lk, d, torch.float16, KERNEL_DEVICE)
    # q as the kernel rounds it (the specification's, exactly); k from the ops' own Triton pass.
    qk = compile_ops.Int8QK(*ref.smooth_quantize_qk(q, k, seq_dim)[:2], *attention_8bit.quantize_8bit(k, None, seq_dim))
    with torch.no_grad():
        for precision in EIGHT_BIT:
            got = compile_ops.attention(qk, None, v, seq_dim=seq_dim, precision=precision)
            want = compile_ops.attention(q, k, v, seq_dim=seq_dim, precision=precision)
            assert got.dtype == v.dtype and torch.equal(got, want), precision
        got, want = (compile_ops.attention_fp8_rows(a, b, v, seq_dim=seq_dim) for a, b in ((qk, None), (q, k)))
        assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8)) and torch.equal(got.scale, want.scale)


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


# ---------------------------------------------------------------- 8-bit attention (precision="int8")


def _relative_l2(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _int8_case(seq_dim, b, hq, hk, lq, lk, d, dtype, device, key_offset=2.0):
    """q, k, v with keys carrying a per-channel offset (what the smoothing removes)."""

    def t(h, length):
        shape = (b, h, length, d) if seq_dim == 2 else (b, length, h, d)
        return torch.randn(shape, device=device)

    offset = key_offset * torch.randn(d, device=device)
    return t(hq, lq).to(dtype), (t(hk, lk) + offset).to(dtype), t(hk, lk).to(dtype)


def test_int8_specification_quantizes_per_token_and_smoothing_leaves_attention_exact():
    """The specification in reference.attention: INT8 values in [-127, 127]
    with scales ``amax / 127`` per query token and per block of 128 keys
    (each row's or block's largest value maps to +-127), k's mean removed
    first, which changes no exact attention output; the approximation's
    distance to exact attention is printed."""
    torch.manual_seed(0)
    q, k, v = _int8_case(1, 2, 4, 2, 37, 300, 24, torch.bfloat16, "cpu", key_offset=4.0)
    q8, q_scale, k8, k_scale = ref.smooth_quantize_qk(q, k, seq_dim=1)
    assert q8.dtype == k8.dtype == torch.int8 and q8.shape == q.shape and k8.shape == k.shape
    assert q_scale.shape == (2, 4, 37) and k_scale.shape == (2, 2, 3) and q_scale.is_contiguous()
    assert k_scale.is_contiguous()
    assert int(q8.abs().max()) == 127 and (q8.abs().amax(-1) == 127).all()  # every token uses the full range
    torch.testing.assert_close(q_scale, q.float().abs().amax(-1).transpose(1, 2) / 127)
    smoothed = k.float() - k.float().mean(dim=1, keepdim=True)
    blocks = [smoothed[:, i : i + 128].abs().amax(dim=(1, 3)) for i in (0, 128, 256)]  # [B, Hk] each
    torch.testing.assert_close(k_scale, torch.stack(blocks, dim=-1) / 127)
    for i, start in enumerate((0, 128, 256)):  # every block uses the full range, the last (44 keys) too
        assert (k8[:, start : start + 128].abs().amax(dim=(1, 3)) == 127).all(), i
    torch.testing.assert_close(
        ref.dequantize_int8(k8.transpose(1, 2), k_scale, 128),
        smoothed.transpose(1, 2),
        rtol=0,
        atol=float(k_scale.max()) / 2 * 1.001,
    )
    # Softmax ignores the shift: exact attention with and without the smoothing agree (fp64).
    exact, _ = ref.attention(q.double(), k.double(), v.double(), 0.2, False, 1)
    shifted, _ = ref.attention(q.double(), k.double() - k.double().mean(dim=1, keepdim=True), v.double(), 0.2, False, 1)
    torch.testing.assert_close(shifted, exact, rtol=1e-10, atol=1e-10)
    approx = ref.attention_int8(q, k, v, 0.2, False, 1)
    err = _relative_l2(approx, exact)
    print(f"int8 specification vs exact attention: relative L2 {err:.2e}")
    assert err < 5e-2  # 8-bit q.k: ~1e-2 here; a wrong scale or a missing smoothing is O(1)


@given(
    st.integers(1, 300),
    st.sampled_from([1, 16, 128]),
    st.integers(1, 40),
    st.sampled_from(["normal", "outlier", "zero_block"]),
    st.integers(0, 2**16),
)
def test_int8_block_quantization_properties(length, block, d, kind, seed):
    """quantize_int8 for any length and block: scales ``[B, H, ceil(L / block)]``
    equal to each block's amax / 127 (the floor for an all-zero block, whose
    values stay 0), every value in [-127, 127], the block's largest value at
    +-127, and each dequantized value within half a step of the input (and
    fp32's rounding of the reciprocal scale and of the two products)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, length, d, generator=g)
    if kind == "outlier":
        x[..., length // 2, d // 2] = 1e4
    elif kind == "zero_block":
        x[..., : min(block, length), :] = 0
    q, scale = ref.quantize_int8(x, block)
    blocks = -(-length // block)
    assert q.dtype == torch.int8 and scale.shape == (2, 3, blocks) and scale.dtype == torch.float32
    assert int(q.abs().max()) <= 127
    padded = torch.cat([x.abs().amax(-1), x.new_zeros(2, 3, blocks * block - length)], -1)
    amax = padded.view(2, 3, blocks, block).amax(-1)
    torch.testing.assert_close(scale, (amax / 127).clamp(min=torch.finfo(torch.float32).tiny), rtol=0, atol=0)
    q_amax = torch.cat([q.abs().amax(-1).float(), q.new_zeros(2, 3, blocks * block - length).float()], -1)
    q_amax = q_amax.view(2, 3, blocks, block).amax(-1)
    assert torch.equal(q_amax == 127, amax > 0)  # full range used, zero blocks stay zero
    step = ref.dequantize_int8(q, scale, block) - x
    per_row = scale.repeat_interleave(block, -1)[..., :length, None]
    # Half a step, plus the fp32 rounding of 1 / scale, x * (1 / scale) and q * scale (each at most
    # 127 * 2**-24 steps for |q| <= 127): 1.7e-6 steps over the half were found with a division
    # (length 209, seed 740); a wrong rounding mode errs by up to a whole step.
    assert (step.abs() <= per_row * (0.5 + 3 * 127 * 2.0**-24)).all()


#: The 8-bit precisions: their op and specification, and how far the kernel
#: may be from the specification in relative L2 (fp16, bf16 outputs). INT8 q k:
#: the 16-bit rounding of P and the output (~2e-4 fp16, ~2e-3 bf16). FP8 P V:
#: the kernel's exponents differ from the specification's in the last fp32
#: bits (an fma against a subtraction), which moves a rare p across an e4m3
#: rounding boundary, a step of 6-12% of that p: 2e-4 to 1.5e-3 measured under
#: the interpreter, against 3-4e-2 for the quantization itself (a kernel that
#: rounds p without the 2**8 shift, skips V's scales or P's rounding, or
#: rescales the running max wrongly lands at 1e-2 or beyond).
EIGHT_BIT = {
    "int8": (ref.attention_int8, {torch.float16: 1e-3, torch.bfloat16: 6e-3}),
    "int8_fp8": (ref.attention_int8_fp8, {torch.float16: 4e-3, torch.bfloat16: 8e-3}),
}


def _exact_of(q, k, v, *args):
    return ref.attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), *args)[0]


def test_fp8_pv_specification_rounds_v_per_channel_and_p_against_the_running_max():
    """quantize_v_fp8: scales ``amax / 448`` per (batch, head, channel) over the
    sequence, each channel's largest value at +-448, values within half an
    e4m3 step. attention_int8_fp8 with one key tile is the direct formula
    (p against the row's max, shifted by 2**8 and rounded, over the sum of
    the unrounded p); with several tiles it stays within e4m3's rounding of
    that formula. Distances to exact attention are printed."""
    torch.manual_seed(0)
    v = torch.randn(2, 3, 200, 24)
    v[0, 1, 5, 7] = 300.0  # an outlier only moves its own channel's scale
    v8, scale = ref.quantize_v_fp8(v)
    assert v8.dtype == torch.float8_e4m3fn and scale.shape == (2, 3, 24)
    torch.testing.assert_close(scale, v.abs().amax(2) / 448, rtol=0, atol=0)
    assert (v8.float().abs().amax(2) == 448).all()
    step = (v8.float() * scale.unsqueeze(2) - v).abs()
    assert (step <= v.abs() / 16 * (1 + 1e-6) + scale.unsqueeze(2) * 2**-10).all()  # 3 mantissa bits, subnormals

    q, k, vv = _int8_case(2, 1, 2, 2, 20, 100, 32, torch.float16, "cpu")
    scale = 32**-0.5
    q8, q_scale, k8, k_scale = ref.smooth_quantize_qk(q, k, 2)
    s = ref.dequantize_int8(q8, q_scale) @ ref.dequantize_int8(k8, k_scale, ref.INT8_KEY_BLOCK).transpose(-1, -2)
    p = torch.exp2((s - s.amax(-1, keepdim=True)) * scale * math.log2(math.e) + ref.P_FP8_SHIFT)
    v8, v_scale = ref.quantize_v_fp8(vv.float())
    direct = (p.to(torch.float8_e4m3fn).float() @ v8.float()) * v_scale.unsqueeze(2) / p.sum(-1, keepdim=True)
    got = ref.attention_int8_fp8(q, k, vv, scale, False, 2)
    torch.testing.assert_close(got, direct.half(), rtol=2e-3, atol=1e-3)  # one tile: the same p up to fp32 ulps

    q, k, vv = _int8_case(1, 2, 4, 2, 37, 300, 24, torch.bfloat16, "cpu", key_offset=4.0)
    tiled = ref.attention_int8_fp8(q, k, vv, 0.2, False, 1)
    int8 = ref.attention_int8(q, k, vv, 0.2, False, 1)
    exact = _exact_of(q, k, vv, 0.2, False, 1)
    err, err_int8 = _relative_l2(tiled, exact), _relative_l2(int8, exact)
    print(f"int8_fp8 specification vs exact attention: relative L2 {err:.2e} (int8 q k alone: {err_int8:.2e})")
    assert err < 6e-2 and _relative_l2(tiled, int8) < 6e-2  # e4m3's 3 mantissa bits: ~3.5e-2; a wrong scale is O(1)


@given(
    st.integers(1, 300),
    st.integers(1, 40),
    st.sampled_from(["normal", "outlier", "zero_channel", "tiny"]),
    st.integers(0, 2**16),
)
def test_fp8_v_quantization_properties(length, d, kind, seed):
    """quantize_v_fp8 for any length and width: scales ``[B, H, D]`` equal to
    each channel's amax / 448 (the floor for an all-zero channel, whose values
    stay 0), each channel's largest value at +-448, and every dequantized value
    within half an e4m3 step of the input: 2**-4 of it in e4m3's normal range,
    2**-10 of the scale below (subnormals), plus fp32's rounding of v * (1 / scale)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(2, 3, length, d, generator=g)
    if kind == "outlier":
        v[..., length // 2, d // 2] = 1e4
    elif kind == "zero_channel":
        v[..., d // 2] = 0
    elif kind == "tiny":
        v = v * 1e-30
    v8, scale = ref.quantize_v_fp8(v)
    assert v8.dtype == torch.float8_e4m3fn and scale.shape == (2, 3, d) and scale.dtype == torch.float32
    amax = v.abs().amax(2)
    torch.testing.assert_close(scale, (amax / 448).clamp(min=torch.finfo(torch.float32).tiny), rtol=0, atol=0)
    values = v8.float()
    assert torch.equal(values.abs().amax(2) == 448, amax > 0)  # full range used, zero channels stay zero
    step = (values * scale.unsqueeze(2) - v).abs()
    bound = torch.maximum(v.abs() * 2.0**-4, scale.unsqueeze(2) * 2.0**-10) * (1 + 2.0**-20)
    assert (step <= bound).all()


@pytest.mark.kernels
@pytest.mark.parametrize("precision", list(EIGHT_BIT))
@pytest.mark.parametrize(
    "seq_dim, causal, lengths, hq, hk, lq, lk, d",
    [
        (2, False, None, 2, 2, 130, 300, 64),  # two query tiles, three key tiles (the last partial)
        (1, True, None, 4, 2, 50, 166, 40),  # [B, L, H, D], GQA, Lq != Lk, D padded
        (2, False, (30, 266), 2, 1, 33, 266, 128),  # padded keys, MQA
        (1, False, None, 2, 2, 40, 256, 32),  # Lk a multiple of 16: FP8 P V's transposed v needs no row padding
    ],
)
def test_kernels_int8_match_the_same_quantization(precision, seq_dim, causal, lengths, hq, hk, lq, lk, d):
    """The kernel against its specification (``EIGHT_BIT``: same quantized
    operands, the same steps); the distance of both to exact attention is
    printed."""
    spec, bounds = EIGHT_BIT[precision]
    torch.manual_seed(0)
    dtypes = [torch.float16] + ([] if INTERPRET else [torch.bfloat16])
    for dtype in dtypes:
        q, k, v = _int8_case(seq_dim, 2, hq, hk, lq, lk, d, dtype, KERNEL_DEVICE)
        kv_lengths = None if lengths is None else torch.tensor(lengths, device=KERNEL_DEVICE)
        with torch.no_grad():
            got = compile_ops.attention(
                q, k, v, causal=causal, seq_dim=seq_dim, kv_lengths=kv_lengths, precision=precision
            )
        assert got.dtype == dtype and got.shape == q.shape
        lengths_cpu = None if kv_lengths is None else kv_lengths.cpu()
        want = spec(q.cpu(), k.cpu(), v.cpu(), d**-0.5, causal, seq_dim, lengths_cpu)
        exact = _exact_of(q, k, v, d**-0.5, causal, seq_dim, lengths_cpu)
        to_spec, to_exact = _relative_l2(got.cpu(), want), _relative_l2(got.cpu(), exact)
        print(f"{dtype} {precision} kernel: to the specification {to_spec:.2e}, to exact attention {to_exact:.2e}")
        assert to_spec < bounds[dtype], to_spec


def _e4m3_index(x: torch.Tensor) -> torch.Tensor:
    """Each e4m3 value's signed position on e4m3's number line (+-0 at 0):
    adjacent representable values differ by 1."""
    bits = x.view(torch.uint8).int()
    magnitude = bits & 0x7F
    return torch.where(bits & 0x80 > 0, -magnitude, magnitude)


@pytest.mark.kernels
@pytest.mark.parametrize("b, hk, d", [(3, 2, 16), (2, 40, 128), (1, 1, 5)])
def test_kernels_fp8_rows_scale_bound_is_the_reference_bit_for_bit(b, hk, d):
    """The FP8 rows' scale bound that eager calls compute by a kernel
    (``fp8_rows_scale_kernel``) equals ``reference.attention.fp8_rows_scale``
    exactly: the largest channel scale of each batch element (placed last,
    past the kernel loop's first block at Hk * D = 5120), the floor for an
    all-zero v (batch element 0), and the headroom factor."""
    from compile_ops.ops.attention_8bit import fp8_rows_scale

    torch.manual_seed(0)
    v_scale = torch.rand(b, hk, d) * torch.logspace(-6, 2, b)[:, None, None]
    v_scale[1:, -1, -1] *= 4.0  # each largest in the last channel: past the loop's first block at 5120
    v_scale[0] = 0.0
    v_scale = v_scale.to(KERNEL_DEVICE)
    got = fp8_rows_scale(v_scale)
    assert got.shape == (b,) and got.dtype == torch.float32
    assert torch.equal(got, ref.fp8_rows_scale(v_scale))


def test_fp8_rows_specification_bounds_the_output_by_v_and_rounds_it_once():
    """attention_int8_fp8_rows: one scale per batch element, twice the largest
    of v's channel scales (the floor for an all-zero v), on every row; no
    value saturates (|out| <= 448 * v_scale of its channel, p's rounding
    adds at most 2**-4); every value is out's fp32 result rounded once to
    e4m3 (within half a step of attention_int8_fp8's, which rounds out to
    16 bits first). The cost of the bound against a per-row amax scale is
    printed: e4m3's exponent keeps it small."""
    from compile_ops.reference import fp8 as ref_fp8

    torch.manual_seed(0)
    q, k, v = _int8_case(1, 2, 4, 2, 70, 300, 32, torch.bfloat16, "cpu")
    v[1, :, 1, 5] *= 40.0  # an outlier channel in one batch element: only its scale moves
    values, row_scale = ref.attention_int8_fp8_rows(q, k, v, 0.2, False, 1)
    assert values.shape == (2, 70, 4, 32) and values.dtype == torch.float8_e4m3fn
    assert row_scale.shape == (2, 70) and row_scale.dtype == torch.float32
    _, v_scale = ref.quantize_v_fp8(v.float().transpose(1, 2))
    want_scale = 2 * v_scale.flatten(1).amax(1)
    assert torch.equal(row_scale, want_scale[:, None].expand(2, 70))
    assert want_scale[1] > 10 * want_scale[0]
    assert values.float().abs().max() < 448 * 17 / 32  # |out| / scale <= 224 (1 + 2**-4): nothing clamps
    out16 = ref.attention_int8_fp8(q, k, v, 0.2, False, 1).float()
    dequantized = values.float() * row_scale[:, :, None, None]
    step = torch.maximum(out16.abs() * 2.0**-4, row_scale[:, :, None, None] * 2.0**-9)
    assert ((dequantized - out16).abs() <= step).all()  # half a step from fp32, plus bf16's rounding of out16
    per_row = ref_fp8.quantize_fp8_rows(out16.flatten(2, 3))
    per_row = (per_row[0].float() * per_row[1][..., None]).unflatten(2, (4, 32))
    for b in range(2):  # batch 1's rows are dominated by the outlier channel, which a per-row scale hits exactly
        err, per_row_err = _relative_l2(dequantized[b], out16[b]), _relative_l2(per_row[b], out16[b])
        print(
            f"FP8 rows against the 16-bit output, batch {b}: bound scale {err:.2e}, per-row amax scale "
            f"{per_row_err:.2e}"
        )
        assert err < 4e-2

    zeros, zero_scale = ref.attention_int8_fp8_rows(q, k, torch.zeros_like(v), 0.2, False, 1)
    assert (zeros.float() == 0).all() and torch.isfinite(zero_scale).all() and (zero_scale > 0).all()


@pytest.mark.kernels
@pytest.mark.parametrize(
    "seq_dim, causal, lengths, hq, hk, lq, lk, d",
    [
        (1, False, None, 2, 2, 130, 300, 64),  # two query tiles, a partial last key tile
        (2, True, (30, 266), 4, 2, 50, 266, 40),  # SDPA's layout in, [B, L, H, D] rows out; GQA, padded keys, D padded
    ],
)
def test_kernels_fp8_rows_match_the_specification(seq_dim, causal, lengths, hq, hk, lq, lk, d):
    """The FP8 output epilogue. Exactly: its scales equal the specification's,
    and its values are the same kernel's 16-bit output (``precision="int8_fp8"``)
    times the scale's reciprocal rounded to e4m3, within one step (the 16-bit
    output was rounded once more) and rarely off at all. Against the
    specification (attention_int8_fp8_rows) as a whole, dequantized: the
    16-bit kernel's distance to its specification plus e4m3's rounding of
    that difference. Distances are printed, with the rows' to exact attention."""
    torch.manual_seed(0)
    q, k, v = _int8_case(seq_dim, 2, hq, hk, lq, lk, d, torch.float16, KERNEL_DEVICE)
    kv_lengths = None if lengths is None else torch.tensor(lengths, device=KERNEL_DEVICE)
    with torch.no_grad():
        rows = compile_ops.attention_fp8_rows(q, k, v, causal=causal, seq_dim=seq_dim, kv_lengths=kv_lengths)
        out16 = compile_ops.attention(
            q, k, v, causal=causal, seq_dim=seq_dim, kv_lengths=kv_lengths, precision="int8_fp8"
        )
    assert rows.q.shape == (2, lq, hq * d) and rows.q.dtype == torch.float8_e4m3fn and rows.scale.shape == (2, lq)
    lengths_cpu = None if kv_lengths is None else kv_lengths.cpu()
    want, want_scale = ref.attention_int8_fp8_rows(q.cpu(), k.cpu(), v.cpu(), d**-0.5, causal, seq_dim, lengths_cpu)
    assert torch.equal(rows.scale.cpu(), want_scale)
    out16 = (out16 if seq_dim == 1 else out16.transpose(1, 2)).flatten(2, 3).cpu().float()
    inverse = torch.ones_like(want_scale) / want_scale
    rounded = (out16 * inverse[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    steps = (_e4m3_index(rows.q.cpu()) - _e4m3_index(rounded)).abs()
    assert steps.max() <= 1 and steps.float().mean() < 0.01, (steps.max(), steps.float().mean())
    dequantized = rows.q.cpu().double() * want_scale[..., None].double()
    to_spec = _relative_l2(dequantized, want.flatten(2, 3).double() * want_scale[..., None].double())
    exact = _exact_of(q, k, v, d**-0.5, causal, seq_dim, lengths_cpu)
    to_exact = _relative_l2(dequantized, (exact if seq_dim == 1 else exact.transpose(1, 2)).flatten(2, 3))
    print(
        f"FP8 rows kernel: {steps.float().mean():.2%} of values a step from its 16-bit output's; to the "
        f"specification {to_spec:.2e}, to exact attention {to_exact:.2e}"
    )
    assert to_spec < 3e-2, to_spec  # a wrong scale or layout is O(1)


def test_fp8_rows_compile_with_fullgraph_and_refuse_a_gradient():
    torch.manual_seed(0)
    q, k, v = _int8_case(1, 1, 2, 2, 9, 9, 16, torch.float16, "cpu")
    attend = lambda q, k, v: compile_ops.attention_fp8_rows(q, k, v, seq_dim=1)  # noqa: E731
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, v), attend(q, k, v)
    assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8)) and torch.equal(got.scale, want.scale)
    torch._dynamo.reset()
    q.requires_grad_()
    with pytest.raises(RuntimeError, match="compile_ops.attention_fp8_rows: an input requires grad"):
        compile_ops.attention_fp8_rows(q, k, v, seq_dim=1)
    with pytest.raises(TypeError, match="fused.attention_int8_fp8_rows: q, k and v must be float16 or bfloat16"):
        with torch.no_grad():
            compile_ops.attention_fp8_rows(q.float(), k.float(), v.float(), seq_dim=1)


@pytest.mark.kernels
@pytest.mark.parametrize("stat_step, stat_chunk_rows", [(128, 1024), (64, 64), (16, 16)])
@pytest.mark.parametrize(
    "seq_dim, b, hq, hk, lq, lk, d",
    [
        (1, 2, 4, 2, 50, 300, 40),  # GQA, D padded, a partial last key block, v's rows padded to 16
        (2, 1, 2, 2, 130, 256, 64),  # two q tiles, whole key blocks, no row padding
        (2, 2, 2, 1, 20, 100, 64),  # one key block
    ],
)
def test_kernels_8bit_quantization_writes_the_specified_operands(
    seq_dim, b, hq, hk, lq, lk, d, stat_step, stat_chunk_rows, monkeypatch
):
    """quantize_8bit (the Triton passes the 8-bit ops run) against the torch
    specification: v's channel scales and e4m3 bytes identical; k's int8
    values within 1 of it (its mean is summed in another order) and its
    block scales within an fp32 rounding. (q is rounded by the attention
    kernel: ``test_kernels_attention_on_quantized_qk_is_the_8bit_ops``.)
    The statistics pass as launched (one chunk a head at these lengths),
    in 64-key chunks (2 to 5 a head) and in 16-key ones: up to 19 chunks a
    head, so that the last chunk's sum of the head's partials takes two of
    its 16-row steps (a wrong step, or a total summed before every chunk
    arrived, shows). v's row padding (4 and 12 keys in the first and third
    cases) holds zeros."""
    from compile_ops.ops import attention_8bit

    monkeypatch.setattr(attention_8bit, "STAT_STEP", stat_step)
    monkeypatch.setattr(attention_8bit, "STAT_CHUNK_ROWS", stat_chunk_rows)
    launched, launcher = [], attention_8bit.launcher
    monkeypatch.setattr(
        attention_8bit, "launcher", lambda kernel: launched.append(kernel.fn.__name__) or launcher(kernel)
    )
    torch.manual_seed(0)
    q, k, v = _int8_case(seq_dim, b, hq, hk, lq, lk, d, torch.float16, KERNEL_DEVICE, key_offset=3.0)
    operands = attention_8bit.quantize_8bit(k, v, seq_dim)
    assert launched == ["kv8_counters_clear_kernel", "kv8_stats_kernel", "kv8_quantize_kernel"], launched
    # v's rows are padded to 16 keys, and the transposed store covers the padding with zeros.
    padding = operands[2]._base[..., lk:]
    assert padding.shape[-1] == -lk % 16 and not padding.view(torch.uint8).any()
    k8, k_scale, vt8, v_scale = (t.cpu() for t in operands)
    want_k8, want_k_scale = ref.smooth_quantize_qk(q.cpu(), k.cpu(), seq_dim)[2:]
    want_vt8, want_v_scale = attention_8bit.fp8_values_transposed(v.cpu(), seq_dim)
    assert torch.equal(v_scale, want_v_scale)
    assert vt8.stride(3) == 1 and torch.equal(vt8.view(torch.uint8), want_vt8.view(torch.uint8))
    assert (k8.int() - want_k8.int()).abs().max() <= 1 and (k8 != want_k8).float().mean() < 1e-3
    torch.testing.assert_close(k_scale, want_k_scale, rtol=1e-6, atol=0)


@pytest.mark.parametrize("lk", [1, 127, 1024, 1025, 4608, 32760, 131072, 131073, 10**6])
def test_8bit_statistics_chunks_cover_the_keys_within_their_bounds(lk):
    """The statistics pass's chunks (``stat_rows_per_chunk``): whole steps
    of STAT_STEP keys that cover the keys with no chunk empty, STAT_CHUNK_ROWS
    keys each up to MAX_STAT_CHUNKS a head, longer past it (where no fewer
    steps a chunk keep within MAX_STAT_CHUNKS)."""
    from compile_ops.ops import attention_8bit

    step, most = attention_8bit.STAT_STEP, attention_8bit.MAX_STAT_CHUNKS
    rows = attention_8bit.stat_rows_per_chunk(lk)
    chunks = -(-lk // rows)
    assert rows % step == 0 and (chunks - 1) * rows < lk <= chunks * rows
    assert 1 <= chunks <= most
    if lk <= most * attention_8bit.STAT_CHUNK_ROWS:
        assert rows == attention_8bit.STAT_CHUNK_ROWS
    else:
        assert -(-lk // (rows - step)) > most, (rows, chunks)


@pytest.mark.parametrize("precision", list(EIGHT_BIT))
def test_8bit_ops_quantize_by_the_triton_passes_when_traced_too(precision):
    """Traced on fake tensors (what torch.compile lowers, torch.export), the
    op body is ``quantize_8bit``'s Triton passes and the attention kernel: k's
    (and for FP8 P V v's) sequence statistics, k's (and v's) quantization,
    then attention, which rounds q itself (``QUANTIZE_Q``); not the
    specification's torch ops, which Inductor fused into slower code
    (docs/notes/attention-8bit.md, "The 8-bit quantization passes")."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from compile_ops._library import OP_BODIES

    op = {"int8": "fused::attention_int8", "int8_fp8": "fused::attention_int8_fp8"}[precision]
    with FakeTensorMode():
        q, k, v = (torch.empty(1, 200, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        gm = make_fx(lambda *a: OP_BODIES[op](*a))(q, k, v, 0.125, False, 1, None)
    launched = [
        kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__
        for n in gm.graph.nodes
        if n.target is torch.ops.higher_order.triton_kernel_wrapper_mutation
    ]
    assert launched == ["kv8_counters_clear_kernel", "kv8_stats_kernel", "kv8_quantize_kernel", "attn_fwd_kernel"], (
        launched
    )
    attention = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.triton_kernel_wrapper_mutation][-1]
    arguments = dict(
        attention.kwargs["kwargs"], **kernel_side_table.get_constant_args(attention.kwargs["constant_args_idx"])
    )
    assert arguments["QUANTIZE_Q"] is True and arguments["INT8"] is True and arguments["Q_SCALE"] is None
    assert arguments["Q"].meta["val"].dtype == torch.bfloat16
    torch_ops = {n.target for n in gm.graph.nodes if n.op == "call_function"} - {
        torch.ops.higher_order.triton_kernel_wrapper_mutation
    }
    assert not any("div" in str(t) or "round" in str(t) or "amax" in str(t) for t in torch_ops), torch_ops


@pytest.mark.parametrize("precision", list(EIGHT_BIT))
def test_int8_compiles_with_fullgraph_and_equals_eager(precision):
    torch.manual_seed(0)
    q, k, v = _int8_case(1, 1, 2, 2, 9, 9, 16, torch.float16, "cpu")
    attend = lambda q, k, v: compile_ops.attention(q, k, v, seq_dim=1, precision=precision)  # noqa: E731
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), attend(q, k, v), rtol=0, atol=0)
    torch._dynamo.reset()


@pytest.mark.parametrize("precision", list(EIGHT_BIT))
def test_int8_refuses_other_dtypes_a_gradient_and_an_lse(precision):
    op = EIGHT_BIT[precision][0].__name__
    q, k, v = _int8_case(2, 1, 2, 2, 8, 8, 16, torch.float16, "cpu")
    with pytest.raises(TypeError, match=f"fused.{op}: q, k and v must be float16 or bfloat16"):
        compile_ops.attention(q.float(), k.float(), v.float(), precision=precision)
    with pytest.raises(ValueError, match=f"precision='{precision}' returns no lse"):
        compile_ops.attention(q, k, v, precision=precision, return_lse=True)
    with pytest.raises(ValueError, match="precision must be one of"):
        compile_ops.attention(q, k, v, precision="fp4")
    q.requires_grad_()
    out = compile_ops.attention(q, k, v, precision=precision)
    with pytest.raises(RuntimeError, match=f"fused.{op} is inference only"):
        out.float().sum().backward()


def test_fp8_pv_refuses_a_gpu_without_fp8_tensor_cores(monkeypatch):
    """On a CUDA GPU below sm_89 the op names the capability it needs (checked
    with the capability lookup faked: no such GPU here)."""
    from compile_ops import _library

    monkeypatch.setattr(_library, "HAS_CUDA", True)
    monkeypatch.setattr(_library, "cuda_capability", lambda index: (8, 0, "NVIDIA A100"))
    on_cuda = types.SimpleNamespace(device=torch.device("cuda", 0))  # all the check reads
    with pytest.raises(RuntimeError, match=r"P V in FP8\) needs FP8 tensor cores \(sm_89 or newer.*A100 is sm_80"):
        _library.require_fp8_mma(on_cuda, "precision='int8_fp8' attention (P V in FP8)")
    monkeypatch.setattr(_library, "cuda_capability", lambda index: (9, 0, "NVIDIA H100"))
    assert _library.require_fp8_mma(on_cuda, "FP8 P V")


@pytest.mark.kernels
@pytest.mark.parametrize(
    "precision, options",
    [
        ("exact", dict(tma=True)),
        ("exact", dict(dot_acc=True)),
        ("exact", dict(tma=True, dot_acc=True, warp_specialize=True)),
        ("int8", dict(tma=True)),
        ("int8_fp8", dict(tma=True)),  # int8 q k by TMA; FP8 P V's transposed V too
    ],
    ids=["tma", "dot_acc", "tma-dot_acc-ws", "int8-tma", "int8_fp8-tma"],
)
def test_kernels_hopper_options_compute_what_the_default_forward_does(precision, options, monkeypatch):
    """The forward's Hopper options (forward_tiles picks TMA at D=128 on
    Hopper, the others are off) change how tiles are loaded and accumulated,
    not the result: forced on,
    with a padded head dim, a partial key tile, key lengths and both layouts,
    the output equals the default's up to the order of additions."""
    from compile_ops.ops import attention_launch, attention_tiles

    default = attention_tiles.forward_tiles
    torch.manual_seed(0)
    for seq_dim in (1, 2):
        # D = 48: padded to 64, and (TMA's condition, which the interpreter run forces) every head's
        # base 16-byte aligned in int8 too
        shape = (2, 70, 2, 48) if seq_dim == 1 else (2, 2, 70, 48)
        q, k, v = (torch.randn(shape, device=KERNEL_DEVICE).to(torch.float16) for _ in range(3))
        kv_lengths = torch.tensor([50, 70], device=KERNEL_DEVICE)
        with torch.no_grad():
            want = compile_ops.attention(q, k, v, seq_dim=seq_dim, kv_lengths=kv_lengths, precision=precision)
        with monkeypatch.context() as m:
            m.setattr(
                attention_launch,
                "forward_tiles",
                lambda d, dtype, tma=False, precision="exact", wgmma=False: attention_tiles.Tiles(
                    *dataclasses.astuple(default(d, dtype, False, precision))[:4], **options
                ),
            )
            allow_tma_under_interpreter(m)
            clear_launch_plans()  # the eager call above left a plan for the default tiles
            with torch.no_grad():
                got = compile_ops.attention(q, k, v, seq_dim=seq_dim, kv_lengths=kv_lengths, precision=precision)
        clear_launch_plans()
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.kernels
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernels_backward_tma_computes_what_pointer_loads_do(causal, monkeypatch):
    """The backward passes' Hopper option (dkdv_tiles / dq_tiles take TMA at
    D=128 on Hopper): the dk/dv pass's q and dO tiles and the dq pass's k and
    v tiles through whole-tensor descriptors give the gradients of the
    pointer loads: forced on, with GQA, a padded head dim, partial query and
    key tiles, key lengths and both layouts."""
    from compile_ops.ops import attention_launch, attention_tiles

    defaults = attention_tiles.dkdv_tiles, attention_tiles.dq_tiles
    torch.manual_seed(0)
    for seq_dim in (1, 2):
        q_shape = (2, 70, 4, 48) if seq_dim == 1 else (2, 4, 70, 48)
        k_shape = (2, 150, 2, 48) if seq_dim == 1 else (2, 2, 150, 48)
        q = torch.randn(q_shape, device=KERNEL_DEVICE).to(torch.float16)
        k, v = (torch.randn(k_shape, device=KERNEL_DEVICE).to(torch.float16) for _ in range(2))
        grad = torch.randn_like(q)
        kv_lengths = torch.tensor([150, 101], device=KERNEL_DEVICE)

        def gradients():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            compile_ops.attention(*inputs, causal=causal, seq_dim=seq_dim, kv_lengths=kv_lengths).backward(grad)
            return [t.grad for t in inputs]

        want = gradients()
        with monkeypatch.context() as m:
            m.setattr(
                attention_launch,
                "dkdv_tiles",
                lambda d, dtype, sparse=False, tma=False: dataclasses.replace(defaults[0](d, dtype, sparse), tma=True),
            )
            m.setattr(
                attention_launch,
                "dq_tiles",
                lambda d, dtype, sparse=False, tma=False: dataclasses.replace(defaults[1](d, dtype, sparse), tma=True),
            )
            allow_tma_under_interpreter(m)
            clear_launch_plans()
            got = gradients()
        clear_launch_plans()
        for name, g, w in zip("qkv", got, want):
            torch.testing.assert_close(g, w, rtol=2e-3, atol=2e-3, msg=lambda m: f"d{name}: {m}")


@pytest.mark.kernels
@pytest.mark.parametrize("group", [1, 3, 8], ids=["one-row", "uneven-groups", "all-rows"])
def test_kernels_causal_program_order_computes_what_launch_order_does(group, monkeypatch):
    """Causal launches deal their tiles out longest first over groups of
    (batch, head) rows (``ops.attention_tiles.causal_order``,
    ``kernels.attention_common.program_rank``): every group size gives the bits of
    the launch order, forward and both backward passes, over 8 query-head rows
    (B=2, 4 q heads, 2 k heads: the dk/dv pass has 4 rows), so groups of 3
    leave a short last group, and partial query and key tiles (Lq != Lk).
    A program given another's tile, or none, leaves rows unwritten."""
    from compile_ops.ops import attention_launch, attention_tiles

    torch.manual_seed(0)
    q = torch.randn(2, 4, 150, 32, device=KERNEL_DEVICE).to(torch.float16)
    k, v = (torch.randn(2, 2, 200, 32, device=KERNEL_DEVICE).to(torch.float16) for _ in range(2))
    grad = torch.randn_like(q)

    def run():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = compile_ops.attention(*inputs, causal=True, return_lse=True)
        out.backward(grad)
        return [out.detach(), lse] + [t.grad for t in inputs]

    groups = []
    with monkeypatch.context() as m:
        m.setattr(attention_launch, "causal_order", lambda shared, length, rows: attention_tiles.LAUNCH_ORDER)
        clear_launch_plans()
        want = run()

        def order(shared, length, rows):
            groups.append((rows, min(group, rows)))
            return dict(HEAVY_FIRST=True), min(group, rows)

        m.setattr(attention_launch, "causal_order", order)
        clear_launch_plans()
        got = run()
    clear_launch_plans()
    assert groups == [(8, min(group, 8)), (4, min(group, 4)), (8, min(group, 8))], groups
    for name, g, w in zip(["out", "lse", "dq", "dk", "dv"], got, want):
        assert torch.equal(g, w), name


@triton.jit
def _ranks_kernel(OUT, heads_per_group):
    """Each program's ``program_rank`` (rank, row) at its launch-order index of ``OUT [tiles * rows, 2]``."""
    rank, bh = program_rank(heads_per_group, True)
    linear = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    tl.store(OUT + 2 * linear, rank)
    tl.store(OUT + 2 * linear + 1, bh)


@pytest.mark.kernels
@pytest.mark.parametrize(
    "tiles, rows, group", [(5, 7, 3), (4, 6, 6), (3, 4, 1)], ids=["uneven-groups", "one-group", "one-row-groups"]
)
def test_kernels_program_rank_deals_the_heaviest_tiles_first(tiles, rows, group):
    """``program_rank`` itself, on a ``(tiles, rows)`` grid: in launch order
    (x fastest) the programs take each (rank, row) once, groups of ``group``
    consecutive rows one after another, and within a group every row's rank r
    before any row's rank r + 1. The launch order itself (identity) fails the
    second and third properties whenever rows > 1."""
    out = torch.full((tiles * rows, 2), -1, dtype=torch.int32, device=KERNEL_DEVICE)
    _ranks_kernel[(tiles, rows)](out, group)
    taken = [tuple(p) for p in out.cpu().tolist()]  # (rank, row) of each program, in launch order
    assert sorted(taken) == [(r, b) for r in range(tiles) for b in range(rows)], taken
    for start in range(0, rows, group):
        size = min(group, rows - start)
        span = taken[start * tiles : (start + size) * tiles]
        assert sorted({b for _, b in span}) == list(range(start, start + size)), (start, span)
        assert [r for r, _ in span] == sorted(r for r, _ in span), (start, span)


def test_causal_launches_carry_the_program_order(monkeypatch):
    """The launchers pass the order to all three kernels of a causal call (the
    group of ``causal_order``) and the launch order to a non-causal one, traced
    on fake CUDA tensors: a launcher that dropped it would fail here, where
    the kernels' bit-identity tests cannot see it. (On an sm_90 GPU the
    non-causal forward would take the Gluon core, which has no such order:
    kept off here.)"""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from compile_ops._library import OP_BODIES
    from compile_ops.ops import attention_sm90, attention_tiles

    monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t: False)
    # The groups below are an H100's (50 MiB of L2); an H200's 60 MiB would make them 6 heads.
    monkeypatch.setattr(attention_tiles, "l2_cache_bytes", lambda t: 50 * 2**20)

    def launches(causal):
        with FakeTensorMode():
            q = torch.empty(1, 24, 4608, 128, dtype=torch.bfloat16, device="cuda")
            k, v, grad = (torch.empty_like(q) for _ in range(3))
            lse = torch.empty(1, 24, 4608, dtype=torch.float32, device="cuda")

            def both(q, k, v, grad, lse):
                OP_BODIES["fused::attention"](q, k, v, 0.125, causal, 2, None)
                return OP_BODIES["fused::attention_backward"](grad, q, k, v, grad, lse, 0.125, causal, 2, None)

            gm = make_fx(both)(q, k, v, grad, lse)
        return {
            kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__: (
                n.kwargs["kwargs"]["HEAVY_FIRST"],
                n.kwargs["kwargs"]["heads_per_group"],
            )
            for n in gm.graph.nodes
            if n.target is torch.ops.higher_order.triton_kernel_wrapper_mutation and "HEAVY_FIRST" in n.kwargs["kwargs"]
        }

    names = ["attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"]
    assert launches(True) == dict.fromkeys(names, (True, 5))  # 2.4 MB of bf16 k and v per head: 5 heads
    assert launches(False) == dict.fromkeys(names, (False, 1))


def test_causal_order_groups_the_rows_whose_keys_fill_a_quarter_of_l2():
    """The group rule against the sweep it was fitted to (docs/notes/attention-forward.md,
    "Causal programs, longest first"):
    bf16 k and v of 2.4 MB per row (4608 x 128) give 5 rows, 1 MB (4096 x 64)
    12, 8.4 and 16.8 MB one row; never more rows than launched, never none."""
    from compile_ops.ops.attention_tiles import causal_order

    def group(length, d, rows, dtype=torch.bfloat16):
        constexprs, g = causal_order(torch.empty(1, 1, length, d, dtype=dtype, device="meta"), length, rows)
        assert constexprs == dict(HEAVY_FIRST=True)
        return g

    assert [group(4608, 128, 24), group(4096, 64, 48), group(16384, 128, 40), group(32760, 128, 12)] == [5, 12, 1, 1]
    assert group(4096, 64, 4) == 4 and group(0, 64, 0) == 1
    assert group(4608, 128, 24, torch.int8) == 11  # 8-bit keys and values: half the bytes

    # A symbolic length (a compiled model's second resolution): the group stays an expression, no guard.
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    length = env.create_unspecified_symint_and_symbol(4608, ConstantSource("L"), DimDynamic.DYNAMIC)
    _, g = causal_order(torch.empty(1, 1, 8, 128, dtype=torch.bfloat16, device="meta"), length, 24)
    assert isinstance(g, torch.SymInt) and g.node.hint == 5 and not env.guards


@pytest.mark.parametrize("length", [4608, 4600])
def test_symbolic_lengths_keep_their_divisibility_hint_and_guard_it(length, monkeypatch):
    """Under dynamic shapes (a compiled model's second resolution) Inductor
    cannot tell the kernels that a symbolic Lq/Lk is a multiple of 16, as
    Triton's JIT does from the value (H100: the dk/dv pass 25% slower, bench
    notes). The launchers pass it as ``ALIGNED_LENGTHS`` to all three kernels,
    and computing it guards on the divisibility, so a graph traced at an
    aligned length is not reused at an unaligned one. (The portable kernels
    are the subject: on an sm_90 GPU the D = 64 forward at 4608 keys would
    take the Gluon core, which has no such hint, so the GPU is taken for one
    without wgmma.)"""
    from torch._dynamo.source import ConstantSource
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from compile_ops._library import OP_BODIES
    from compile_ops.ops import attention_sm90

    monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t: False)

    env = ShapeEnv()
    sym = env.create_unspecified_symint_and_symbol(length, ConstantSource("L"), DimDynamic.DYNAMIC)
    with FakeTensorMode(shape_env=env):
        q, k, v, grad = (torch.empty(1, 2, sym, 64, dtype=torch.bfloat16, device="cuda") for _ in range(4))
        lse = torch.empty(1, 2, sym, dtype=torch.float32, device="cuda")

        def both(q, k, v, grad, lse):
            OP_BODIES["fused::attention"](q, k, v, 0.125, False, 2, None)
            return OP_BODIES["fused::attention_backward"](grad, q, k, v, grad, lse, 0.125, False, 2, None)

        gm = make_fx(both)(q, k, v, grad, lse)
    aligned = {
        kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__: n.kwargs["kwargs"]["ALIGNED_LENGTHS"]
        for n in gm.graph.nodes
        if n.target is torch.ops.higher_order.triton_kernel_wrapper_mutation and "ALIGNED_LENGTHS" in n.kwargs["kwargs"]
    }
    assert aligned == dict.fromkeys(["attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"], length % 16 == 0)
    guard = f"{'Eq' if length % 16 == 0 else 'Ne'}(Mod({sym}, 16), 0)"
    assert guard in [str(g.expr) for g in env.guards]


def _traced_forward(q, k, v, causal=False, kv_lengths=None, seq_dim=2):
    """The launches of ``fused.attention``'s body traced on fake CUDA tensors:
    the Triton kernels' names and the opaque ops it calls."""
    return _traced_launches("fused::attention", q, k, v, 0.125, causal, seq_dim, kv_lengths)


def _traced_launches(op, *args):
    """The launches of ``op``'s body traced on fake CUDA tensors: the Triton
    kernels' names and the opaque ops it calls."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from compile_ops._library import OP_BODIES

    gm = make_fx(lambda *a: OP_BODIES[op](*a))(*args)
    return [
        kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__
        if n.target is torch.ops.higher_order.triton_kernel_wrapper_mutation
        else str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function"
        and (n.target is torch.ops.higher_order.triton_kernel_wrapper_mutation or "fused_gluon" in str(n.target))
    ]


def _traced_tiles(q, k, v, wgmma=None):
    """``attn_fwd_kernel``'s (BLOCK_M, BLOCK_N, TMA, num_warps, num_stages) in
    ``fused.attention``'s body traced on fake CUDA tensors; ``wgmma`` False:
    with the GPU taken for one without wgmma."""
    import contextlib

    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from compile_ops._library import OP_BODIES
    from compile_ops.ops import attention_sm90

    with pytest.MonkeyPatch.context() if wgmma is False else contextlib.nullcontext() as m:
        if m is not None:
            m.setattr(attention_sm90, "has_wgmma", lambda t: False)
        gm = make_fx(lambda *a: OP_BODIES["fused::attention"](*a))(q, k, v, 0.125, False, 2, None)
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.higher_order.triton_kernel_wrapper_mutation)
    config = kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).configs[0]  # torch's one-config wrapper
    args = node.kwargs["kwargs"]
    return args["BLOCK_M"], args["BLOCK_N"], args["TMA"], config.num_warps, config.num_stages


def test_forward_takes_the_sm90_core_exactly_where_it_computes_the_call(monkeypatch):
    """On an sm_90 GPU (``has_wgmma`` faked for fake CUDA tensors) a 16-bit
    forward at D = 128 with TMA-aligned tensors is the Gluon core's opaque
    op (what a compiled graph calls: Inductor cannot inline a Gluon kernel),
    in both layouts, dense or block-sparse, causal or not, with key lengths
    or not; every call the core does not compute stays on
    ``attn_fwd_kernel``, as does every call while AOTInductor builds a
    package, and no GPU without wgmma takes the core."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compile_ops.ops import attention_sm90

    core, portable = ["fused_gluon.attention_forward_sm90_.default"], ["attn_fwd_kernel"]
    with FakeTensorMode():

        def qkv(b=1, h=2, lq=300, lk=300, d=128, dtype=torch.bfloat16, seq_dim=2):
            shape = (lambda l: (b, h, l, d)) if seq_dim == 2 else (lambda l: (b, l, h, d))
            return tuple(torch.empty(shape(l), dtype=dtype, device="cuda") for l in (lq, lk, lk))

        def sparse(q, k, v, causal=False, kv_lengths=None):
            index = torch.zeros(1, 1, 3, 3, dtype=torch.int32, device="cuda")
            count = torch.ones(1, 1, 3, dtype=torch.int32, device="cuda")
            launches = _traced_launches(
                "fused::block_sparse_attention", q, k, v, index, count, 0.125, causal, 2, kv_lengths
            )
            return [name for name in launches if name in portable + core]

        for wgmma in (False, True):
            monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t, on=wgmma: on and t.device.type == "cuda")
            takes = core if wgmma else portable
            assert _traced_forward(*qkv()) == takes
            assert _traced_forward(*qkv(seq_dim=1), seq_dim=1) == takes
            assert _traced_forward(*qkv(dtype=torch.float16)) == takes
            assert _traced_forward(*qkv(lq=5, lk=1)) == takes
            q, k, v = qkv()
            lengths = torch.full((1,), 200, device="cuda")
            assert _traced_forward(q, k, v, causal=True) == takes
            assert _traced_forward(q, k, v, kv_lengths=lengths) == takes
            assert _traced_forward(q, k, v, causal=True, kv_lengths=lengths) == takes
            assert sparse(q, k, v) == takes
            assert sparse(q, k, v, causal=True, kv_lengths=lengths) == takes
            # D = 64: the core's 256-key tiles take dense non-causal calls over whole tiles without key lengths.
            assert _traced_forward(*qkv(d=64, lq=300, lk=512)) == takes
            assert _traced_forward(*qkv(d=64, lq=300, lk=512, seq_dim=1), seq_dim=1) == takes
            assert _traced_forward(*qkv(d=64)) == portable  # 300 keys: a ragged wide tile
            q64, k64, v64 = qkv(d=64, lq=512, lk=512)
            assert _traced_forward(q64, k64, v64, causal=True) == portable
            assert _traced_forward(q64, k64, v64, kv_lengths=lengths) == portable
            assert sparse(*qkv(d=64)) == portable
            assert _traced_forward(*qkv(d=32, lq=512, lk=512)) == portable
            assert _traced_forward(*qkv(dtype=torch.float32)) == portable
            assert _traced_forward(*qkv(lk=0)) == portable
            # A call the core declines keeps attn_fwd_kernel's own tiles, not the core's.
            assert _traced_tiles(*qkv(lk=0)) == _traced_tiles(*qkv(lk=0), wgmma=False)
            # While AOTInductor builds a package (run from C++, no Python): the Triton kernel, not the opaque op.
            from torch._inductor.virtualized import V

            with V.set_aot_compilation(True):
                assert _traced_forward(*qkv()) == portable
            # Rows 514 bytes apart: off TMA's 16-byte alignment.
            padded = torch.empty_strided(
                (1, 2, 300, 128), (2 * 300 * 257, 300 * 257, 257, 1), dtype=torch.bfloat16, device="cuda"
            )
            assert _traced_forward(padded, k, v) == portable
            # Keys and values shared by a batch of 2 (expanded, stride 0): the core's 4-D descriptors decline.
            q2 = torch.empty(2, 2, 300, 128, dtype=torch.bfloat16, device="cuda")
            assert _traced_forward(q2, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1)) == portable
            assert _traced_forward(q2, *qkv(b=2)[1:]) == takes


@pytest.mark.parametrize("length", [4096, 4429])
def test_head_dim_64_core_rule_guards_a_symbolic_key_length(length, monkeypatch):
    """Under dynamic shapes the D = 64 rule (the core's 256-key tiles for whole
    tiles only) reads a symbolic key length: the traced graph takes the core
    at 4096 keys and the portable kernel at 4429, and guards on Lk % 256 so
    that neither graph is reused at the other kind of length."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from compile_ops.ops import attention_sm90

    monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t: t.device.type == "cuda")
    env = ShapeEnv()
    sym = env.create_unspecified_symint_and_symbol(length, ConstantSource("L"), DimDynamic.DYNAMIC)
    with FakeTensorMode(shape_env=env):
        q, k, v = (torch.empty(1, 2, sym, 64, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        launches = _traced_forward(q, k, v)
    assert launches == (["fused_gluon.attention_forward_sm90_.default"] if length % 256 == 0 else ["attn_fwd_kernel"])
    guard = f"{'Eq' if length % 256 == 0 else 'Ne'}(Mod({sym}, 256), 0)"
    assert guard in [str(g.expr) for g in env.guards]


def test_backward_tail_split_at_known_shapes():
    """The five-product backward's split of its last round, at the shapes
    its numbers were measured at (132 SMs): Flux's 864 items leave 72 alone
    in a seventh round and are split (their 72 items in 5 parts); whole
    rounds, and leftovers whose split gains less than 4% by the model, are
    not; one query step cannot be parted."""
    from compile_ops.ops.attention_sm90 import backward_tail_split

    assert backward_tail_split(864, 132, 72) == (792, 5)  # 1x24x4608, D = 128
    assert backward_tail_split(840, 132, 35) == (792, 5)  # 1x24x4429 (SD3), D = 64: 128-query steps
    assert backward_tail_split(1728, 132, 72) == (1716, 8)  # 2x24x4608: 12 items alone in a 14th round
    assert backward_tail_split(1536, 132, 32) == (1536, 1)  # 2x24x4096 (D = 64): 2.3% modelled, 0.98x measured
    assert backward_tail_split(3072, 132, 512) == (3072, 1)  # 1x12x32760: 2.7% modelled, 0.98x measured
    assert backward_tail_split(264, 132, 72) == (264, 1)  # whole rounds
    assert backward_tail_split(100, 132, 1) == (100, 1)


@given(st.integers(1, 3000), st.sampled_from([78, 114, 132]), st.integers(1, 80))
def test_backward_tail_split_ends_sooner_by_its_model(items, sms, steps):
    """For any launch, ``backward_tail_split`` gives ``(whole, parts)`` with
    the parted items the last leftover of a round (or it and one round
    more), 2-8 parts of at most ``steps`` query steps each, and a makespan,
    as its docstring models it (programs in launch order on the SMs as they
    free up, a part costing its share plus ``PART_OVERHEAD``), at least
    ``TAIL_SPLIT_GAIN`` shorter than without the split; or no split."""
    import heapq

    from compile_ops.ops import attention_sm90

    whole, parts = attention_sm90.backward_tail_split(items, sms, steps)
    if parts == 1:
        assert whole == items
        return
    assert 2 <= parts <= min(8, steps) and items - whole in (items % sms, items % sms + sms)
    free = [0.0] * sms
    for duration in [1.0] * whole + [1 / parts + attention_sm90.PART_OVERHEAD] * ((items - whole) * parts):
        heapq.heappush(free, heapq.heappop(free) + duration)
    assert max(free) < -(-items // sms) * (1 - attention_sm90.TAIL_SPLIT_GAIN)


def test_backward_steps_are_128_queries_only_at_head_dim_64_without_block_lists():
    """``attn_bwd_sm90_kernel``'s step rule (``ops.attention_sm90.backward_step``):
    128 queries for dense calls at D = 64 (1.06-1.14x on an H100), 64 at
    D = 128 (dK and dV fill the registers) and over block lists (a 128-query
    step spilled in the step loop); the kernel's static assert refuses the rest."""
    from compile_ops.ops.attention_sm90 import backward_step

    assert [backward_step(64, False), backward_step(64, True), backward_step(128, False), backward_step(128, True)] == [
        128,
        64,
        64,
        64,
    ]


def test_set_attention_backward_keys_compile_caches_by_its_setting():
    """``set_attention_backward(deterministic=False)`` adds its tag to
    torch.compile's cache keys (``torch.compiler.config.cache_key_tag``),
    keeping a tag of the user's; ``True`` takes it off again, once however
    often it was set; a non-bool is refused."""
    from compile_ops.ops import attention as attention_ops

    before = torch.compiler.config.cache_key_tag
    # torch's config modules are changed through their own patch(): pytest's monkeypatch
    # (9.x) deletes an entry it did not find in the module's __dict__ when it undoes.
    with torch.compiler.config.patch(cache_key_tag="users-own"):
        try:
            compile_ops.set_attention_backward(deterministic=False)
            compile_ops.set_attention_backward(deterministic=False)
            assert torch.compiler.config.cache_key_tag == "users-own," + attention_ops.ATOMIC_DQ_CACHE_TAG
            compile_ops.set_attention_backward(deterministic=True)
            assert torch.compiler.config.cache_key_tag == "users-own"
        finally:
            compile_ops.set_attention_backward(deterministic=True)
    assert torch.compiler.config.cache_key_tag == before
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        compile_ops.set_attention_backward(deterministic=1)


def test_backward_takes_the_five_product_kernel_only_when_asked_and_able(monkeypatch):
    """Traced on fake CUDA tensors of a faked sm_90 GPU: ``fused.attention_backward``
    runs the three deterministic passes by default, the dk/dv pass as the
    sm_90 kernel without dQ for dense calls it computes (``SM90_DKDV``); with
    ``set_attention_backward(deterministic=False)`` a 16-bit call at
    D = 128 or 64 (Lk a multiple of 128 or not, causal or not, with key
    lengths or not, dense or ``fused.block_sparse_attention_backward``'s)
    runs the five-product kernel's opaque op and dq's cast, and every other
    call (D = 32, 96 or 256, fp32, or torch's deterministic algorithms on)
    keeps the three passes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compile_ops.ops import attention_sm90

    five = ["attn_bwd_row_stats_kernel", "fused_gluon.attention_backward_sm90_.default", "attn_bwd_dq_from_acc_kernel"]
    three = ["attn_bwd_row_stats_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"]
    # the deterministic backward of a dense call the sm_90 kernel computes: its dk/dv pass is that kernel
    three_sm90 = ["attn_bwd_row_stats_kernel", "fused_gluon.attention_backward_sm90_.default", "attn_bwd_dq_kernel"]
    monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t: t.device.type == "cuda")

    def launches(lk=256, d=128, dtype=torch.bfloat16, causal=False, with_lengths=False, sparse=False):
        with FakeTensorMode():
            q, grad, out = (torch.empty(2, 3, 200, d, dtype=dtype, device="cuda") for _ in range(3))
            k, v = (torch.empty(2, 3, lk, d, dtype=dtype, device="cuda") for _ in range(2))
            lse = torch.empty(2, 3, 200, device="cuda")
            lengths = torch.empty(2, dtype=torch.int32, device="cuda") if with_lengths else None
            if not sparse:
                return _traced_launches("fused::attention_backward", grad, q, k, v, out, lse, 0.125, causal, 2, lengths)
            index = torch.zeros(1, 1, 2, 2, dtype=torch.int32, device="cuda")
            count = torch.ones(1, 1, 2, dtype=torch.int32, device="cuda")
            every = _traced_launches(
                "fused::block_sparse_attention_backward",
                grad,
                q,
                k,
                v,
                out,
                lse,
                index,
                count,
                0.125,
                causal,
                2,
                lengths,
            )
            return [name for name in every if name in five + three]  # less the lists' sorting

    assert launches() == three_sm90 and launches(sparse=True) == three
    assert launches(d=64, causal=True, with_lengths=True, lk=300) == three_sm90
    monkeypatch.setattr(attention_sm90, "SM90_DKDV", False)
    assert launches() == three
    monkeypatch.setattr(attention_sm90, "SM90_DKDV", True)
    compile_ops.set_attention_backward(deterministic=False)
    try:
        for taken in (
            dict(),
            dict(lk=300),
            dict(causal=True),
            dict(with_lengths=True),
            dict(causal=True, with_lengths=True, lk=300),
            dict(sparse=True),
            dict(sparse=True, causal=True, lk=300),
            dict(d=64),
            dict(d=64, causal=True, lk=300),
            dict(d=64, sparse=True),
        ):
            assert launches(**taken) == five, taken
        for other in (
            dict(d=256),
            dict(d=32),
            dict(dtype=torch.float32),
            dict(d=96, causal=True),
            dict(d=256, sparse=True),
        ):
            assert launches(**other) == three, other
        with deterministic_algorithms():
            assert launches() == three_sm90 and launches(sparse=True) == three
    finally:
        compile_ops.set_attention_backward(deterministic=True)
    assert launches() == three_sm90


@pytest.mark.kernels
def test_kernels_five_product_backward_statistics_zero_and_cast_dq():
    """The Triton halves of the five-product backward (its Gluon kernel runs
    on sm_90 GPUs only): the statistics pass zeroes every padded row of the
    dq accumulator it is given (NaN-filled before), and the cast writes
    ``scale * accumulator`` into dq's strided rows, the padded rows left
    out, in dq's dtype."""
    from compile_ops.kernels.attention_backward import attn_bwd_dq_from_acc_kernel, attn_bwd_row_stats_kernel
    from compile_ops.ops import attention_launch

    dev = KERNEL_DEVICE
    b, h, lq, d = 2, 3, 100, 32
    out, grad = (torch.randn(b, lq, h, d, device=dev, dtype=torch.float16) for _ in range(2))
    lse = torch.randn(b, h, lq, device=dev)
    rows = 128  # _stats_row_length(100)
    delta, lse_rows = (torch.empty(b * h, rows, device=dev) for _ in range(2))
    acc = torch.full((b * h, rows, d), float("nan"), device=dev)
    attention_launch.launcher(attn_bwd_row_stats_kernel)[(rows // 64, b * h)](
        out,
        grad,
        lse,
        delta,
        lse_rows,
        h,
        lq,
        *out.stride()[:1],
        out.stride(2),
        out.stride(1),
        *grad.stride()[:1],
        grad.stride(2),
        grad.stride(1),
        D=d,
        BLOCK_D=d,
        BLOCK_M=64,
        ACC=tl.float32,
        DQ_ACC=acc,
        num_warps=4,
    )
    assert torch.equal(acc, torch.zeros_like(acc))
    torch.testing.assert_close(delta[:, :lq], (out.float() * grad.float()).sum(-1).transpose(1, 2).reshape(b * h, lq))
    acc = torch.randn(b * h, rows, d, device=dev)
    dq = torch.full((b, lq, h, d), float("nan"), device=dev, dtype=torch.bfloat16)
    attention_launch.launcher(attn_bwd_dq_from_acc_kernel)[(triton.cdiv(lq, 64), b * h)](
        acc, dq, h, lq, dq.stride(0), dq.stride(2), dq.stride(1), 0.125, D=d, BLOCK_D=d, BLOCK_M=64, num_warps=4
    )
    want = (acc.view(b, h, rows, d)[:, :, :lq] * 0.125).to(torch.bfloat16).transpose(1, 2)
    assert torch.equal(dq, want)


@pytest.mark.kernels
def test_kernels_five_product_backward_parts_add_up_in_order():
    """``attn_bwd_parts_kernel``: each parted item's fp32 dk and dv parts
    (``[items - whole, parts, 2, 128, D]``) summed in part order, cast to
    dk's / dv's dtype and written at the item's key tile of the item's
    (batch, k head) through strides (here ``[B, Lk, Hk, D]``), keys past Lk
    left alone; whole items' rows are not touched. fp32 outputs and parts of
    mixed magnitudes, so that another order of the sums gives other bits
    (checked on the data), and bf16 outputs for the cast."""
    from compile_ops.kernels.attention_backward import attn_bwd_parts_kernel
    from compile_ops.ops import attention_launch

    dev = KERNEL_DEVICE
    b, hk, lk, d, parts, whole = 2, 3, 300, 32, 3, 2  # 3 key tiles x 6 (batch, head) rows: items 2..17 parted
    n_tiles = triton.cdiv(lk, 128)
    items = n_tiles * b * hk
    gen = torch.Generator().manual_seed(0)
    partials = (
        torch.randn(items - whole, parts, 2, 128, d, generator=gen)
        * 2.0 ** torch.randint(-12, 12, (items - whole, parts, 2, 128, d), generator=gen)
    ).to(dev)
    summed = partials[:, 0] + partials[:, 1] + partials[:, 2]  # in part order, as fp32
    assert not torch.equal(summed, partials[:, 2] + partials[:, 1] + partials[:, 0])  # the order shows
    for dtype in (torch.float32, torch.bfloat16):
        dk, dv = (torch.full((b, lk, hk, d), float("nan"), device=dev, dtype=dtype) for _ in range(2))
        attention_launch.launcher(attn_bwd_parts_kernel)[(items - whole, 128 // 32)](
            partials,
            dk,
            dv,
            whole,
            parts,
            n_tiles,
            hk,
            lk,
            dk.stride(0),
            dk.stride(2),
            dk.stride(1),
            dv.stride(0),
            dv.stride(2),
            dv.stride(1),
            D=d,
            BLOCK_M=32,
            num_warps=4,
        )
        for grad, which in ((dk, 0), (dv, 1)):
            want = torch.full((b, hk, n_tiles * 128, d), float("nan"), device=dev)
            want.view(b * hk * n_tiles, 128, d)[whole:] = summed[:, which]
            want = want[:, :, :lk].to(dtype).transpose(1, 2)
            assert torch.equal(grad.isnan(), want.isnan()), dtype
            assert torch.equal(grad.nan_to_num(), want.nan_to_num()), dtype


def test_8bit_forward_takes_the_sm90_core_only_with_q_given_in_int8(monkeypatch):
    """With ``"int8_fp8"`` among the core's precisions (it is built and tested,
    and joins by default once measured ahead), traced on fake CUDA tensors
    on a faked sm_90 GPU: 8-bit attention on q and k given in int8 with a
    16-bit output is the core's op; q rounded by the kernel, FP8 output rows
    and 16-bit P V stay on ``attn_fwd_kernel``; with the default precisions
    it all stays there."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compile_ops.ops import attention_sm90, attention_tiles

    core = ["fused_gluon.attention_forward_sm90_.default"]
    monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t: t.device.type == "cuda")
    with FakeTensorMode():
        q, k, v = (torch.empty(1, 300, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        q8, k8 = (torch.empty(1, 300, 2, 128, dtype=torch.int8, device="cuda") for _ in range(2))
        q_scale, k_scale = torch.empty(1, 2, 300, device="cuda"), torch.empty(1, 2, 3, device="cuda")

        def qk8(pv_fp8, fp8_rows):
            return [
                name
                for name in _traced_launches(
                    "fused::attention_qk8", q8, q_scale, k8, k_scale, v, 0.125, False, 1, None, pv_fp8, fp8_rows
                )
                if name in ("attn_fwd_kernel", core[0])
            ]

        for with_int8 in (False, True):
            precisions = ("exact", "int8_fp8") if with_int8 else ("exact",)
            monkeypatch.setattr(attention_tiles, "SM90_CORE_PRECISIONS", precisions)
            assert qk8(True, False) == (core if with_int8 else ["attn_fwd_kernel"])
            assert qk8(True, True) == ["attn_fwd_kernel"]
            assert qk8(False, False) == ["attn_fwd_kernel"]
            rounded = _traced_launches("fused::attention_int8_fp8", q, k, v, 0.125, False, 1, None)
            assert rounded[-1] == "attn_fwd_kernel" and core[0] not in rounded


_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _sorted_block_lists(b, h, lq, lk, seed):
    """Random ascending block lists ``(index [b, h, nq, nk], count [b, h, nq])``
    int32 on the GPU: each key block kept with probability 1/2, one query
    block of each head with an empty list, and the last (ragged) key block
    always kept by query block 0."""
    nq, nk = triton.cdiv(lq, 128), triton.cdiv(lk, 128)
    g = torch.Generator(device="cuda").manual_seed(seed)
    keep = torch.rand(b, h, nq, nk, device="cuda", generator=g) < 0.5
    keep[:, :, 0, -1] = True
    keep[:, :, -1] = nq == 1  # empty, unless it is the only query block
    count = keep.sum(-1).to(torch.int32)
    # Kept blocks first, ascending: sort by (not kept, index).
    order = torch.arange(nk, device="cuda") + nk * (~keep).to(torch.int64)
    index = order.sort(-1).values.remainder(nk).to(torch.int32)
    return index.contiguous(), count.contiguous()


_SM90_CORE_MODES = ("dense", "causal", "kv_lengths", "sparse", "sparse_causal_kv_lengths")


@pytest.mark.skipif(not _SM90, reason="the Gluon core runs on sm_90 GPUs only")
@pytest.mark.parametrize("mode", _SM90_CORE_MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sm90_core_computes_what_the_portable_forward_does(dtype, mode, monkeypatch):
    """On an H100/H200 the core's output and lse are ``attn_fwd_kernel``'s
    (same 128 x 128 tiles, products and formulas: equal up to one rounding of
    the output) over ragged lengths, GQA, fewer keys than a tile, Lq != Lk
    and both layouts; dense or block-sparse (lists with empty rows and the
    ragged last block), causal, key lengths (0 among them: rows with no key
    give 0 and lse -inf). Five launches into NaN-filled outputs each write
    every row (a race between its partitions would leave some unwritten or
    wrong), on grids of 1, 3 and 7 programs too, each going through many
    work items (the ring and q buffer carried across items, in every mode,
    persistent or not in the package), and the eager fast path's replayed
    second call and a compiled call (through the opaque op) give the first
    call's result."""
    from compile_ops.kernels.attention_sm90 import attn_fwd_sm90_kernel
    from compile_ops.ops import attention_sm90

    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    causal = "causal" in mode
    for b, h, hk, lq, lk, seq_dim in [
        (1, 4, 4, 1000, 1000, 2),
        (2, 8, 2, 333, 4096, 1),
        (1, 2, 2, 64, 77, 2),
        (2, 2, 1, 513, 129, 1),
        (1, 3, 3, 130, 1, 2),
        (1, 12, 12, 4680, 4680, 2),
    ]:
        torch.manual_seed(lq + lk)
        shape = (lambda hh, l: (b, hh, l, 128)) if seq_dim == 2 else (lambda hh, l: (b, l, hh, 128))
        q = torch.randn(shape(h, lq), device="cuda", dtype=dtype)
        k, v = (torch.randn(shape(hk, lk), device="cuda", dtype=dtype) for _ in range(2))
        lengths = None
        if "kv_lengths" in mode:  # a ragged length, and 0 for a second batch element
            lengths = torch.tensor([max(lk - 37, 1), 0][:b], device="cuda", dtype=torch.int32)
        lists = _sorted_block_lists(b, h, lq, lk, lq + lk) if "sparse" in mode else (None, None)

        def attend(q, k, v):
            if lists[0] is None:
                return compile_ops.attention(
                    q, k, v, causal=causal, seq_dim=seq_dim, kv_lengths=lengths, return_lse=True
                )
            return compile_ops.block_sparse_attention(
                q, k, v, *lists, causal=causal, seq_dim=seq_dim, kv_lengths=lengths, return_lse=True
            )

        with torch.no_grad():
            clear_launch_plans()
            got = [attend(q, k, v) for _ in range(2)]
            torch._dynamo.reset()  # a fresh graph for each case: not a recompilation, which fullgraph bounds
            compiled = torch.compile(attend, fullgraph=True)(q, k, v)
            with monkeypatch.context() as m:
                m.setattr(attention_sm90, "has_wgmma", lambda t: False)
                clear_launch_plans()
                want = attend(q, k, v)
        case = (mode, b, h, hk, lq, lk, seq_dim)
        torch.testing.assert_close(got[0][0], want[0], rtol=ulp, atol=1e-5, msg=lambda m: f"{case}: {m}")
        torch.testing.assert_close(got[0][1], want[1], rtol=1e-6, atol=1e-5, msg=lambda m: f"{case}: {m}")
        for again in (got[1], compiled):
            assert torch.equal(again[0], got[0][0]) and torch.equal(again[1], got[0][1]), case
        for programs in (None, None, 1, 3, 7):
            out, lse = torch.full_like(q, float("nan")), torch.full((b, h, lq), float("nan"), device="cuda")
            with monkeypatch.context() as m:
                if programs:
                    m.setattr(attention_sm90, "_core_programs", lambda q, items, causal, sparse, n=programs: n)
                attention_sm90.launch_sm90_core(
                    attn_fwd_sm90_kernel, q, k, v, out, lse, 128**-0.5, causal, seq_dim, lengths, *lists
                )
            assert torch.equal(out, got[0][0]) and torch.equal(lse, got[0][1]), (case, programs)
    clear_launch_plans()


@pytest.mark.skipif(not _SM90, reason="the Gluon core runs on sm_90 GPUs only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sm90_core_wide_tiles_at_head_dim_64_match_the_reference(dtype, monkeypatch):
    """D = 64 dense calls over whole 256-key tiles take the core's wide form
    (256-key tiles, each P V folded in before the next Q K^T): not the
    portable kernel's tiles, so not its bits, but within the two-reference
    rule (twice PyTorch's own error at the dtype) of the fp64 attention, out
    and lse, over GQA, Lq != Lk, both layouts and a single tile. Launches
    into NaN-filled outputs on grids of 1, 3 and 7 programs (each walking
    many items through the ring) and a compiled call give the first call's
    bits, and the portable kernel's output stays within a few roundings."""
    from compile_ops.kernels.attention_sm90 import attn_fwd_sm90_kernel
    from compile_ops.ops import attention_args, attention_sm90, attention_tiles

    for b, h, hk, lq, lk, seq_dim in [
        (1, 4, 4, 1000, 1024, 2),
        (2, 8, 2, 333, 4096, 1),
        (1, 2, 2, 64, 256, 2),
        (2, 3, 3, 513, 512, 1),
    ]:
        torch.manual_seed(lq + lk)
        q, k, v = _qkv(b, h, hk, lq, lk, 64, seq_dim, dtype, "cuda")
        case = (b, h, hk, lq, lk, seq_dim)
        tiles = attention_tiles.forward_tiles(64, dtype, True, "exact", True)
        sizes = attention_args.attention_sizes(q, k, False, seq_dim, None)
        assert attention_sm90.takes_sm90_core(tiles, sizes, q, k, v, seq_dim, seq_dim, None, False, None), case
        with torch.no_grad():
            clear_launch_plans()
            out, lse = compile_ops.attention(q, k, v, seq_dim=seq_dim, return_lse=True)
            torch._dynamo.reset()
            compiled = torch.compile(
                lambda q, k, v: compile_ops.attention(q, k, v, seq_dim=seq_dim, return_lse=True), fullgraph=True
            )(q, k, v)
            with monkeypatch.context() as m:
                m.setattr(attention_sm90, "has_wgmma", lambda t: False)
                clear_launch_plans()
                portable = compile_ops.attention(q, k, v, seq_dim=seq_dim)
        exact, exact_lse = ref.attention(*(t.detach().double() for t in (q, k, v)), 64**-0.5, False, seq_dim, None)
        plain, _, plain_lse = torch_at_dtype(q, k, v, torch.zeros_like(q), 64**-0.5, False, seq_dim, None)
        assert_within_torch_error(out, exact, plain, 2.0, f"output {case}")
        assert_within_torch_error(lse, exact_lse, plain_lse, 2.0, f"lse {case}", fp32_roundings=LSE_ROUNDINGS)
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
        torch.testing.assert_close(
            out, portable, rtol=2 * ulp, atol=4 * ulp * out.abs().max().item(), msg=lambda msg: f"{case}: {msg}"
        )
        assert torch.equal(compiled[0], out) and torch.equal(compiled[1], lse), case
        for programs in (None, 1, 3, 7):
            again, again_lse = torch.full_like(q, float("nan")), torch.full((b, h, lq), float("nan"), device="cuda")
            with monkeypatch.context() as m:
                if programs:
                    m.setattr(attention_sm90, "_core_programs", lambda q, items, causal, sparse, n=programs: n)
                attention_sm90.launch_sm90_core(
                    attn_fwd_sm90_kernel, q, k, v, again, again_lse, 64**-0.5, False, seq_dim
                )
            assert torch.equal(again, out) and torch.equal(again_lse, lse), (case, programs)
    clear_launch_plans()


def five_product_gradients(out, inputs, dout, launched, passes_kernel, case, parts=False):
    """The gradients of ``out`` three times by the five-product backward
    (``set_attention_backward(deterministic=False)``), checked against the
    deterministic passes': the Gluon kernel and dq's cast from its sums are
    launched and ``passes_kernel`` (one of the deterministic passes' kernels)
    is not, as ``launched`` (kernel names the caller's patched launcher
    appends) shows; under ``use_deterministic_algorithms``
    the passes run, bit-equal to the default; dk and dv are equal across
    reruns (each program sums its steps in a fixed order); and all three
    gradients are within 1e-3 (relative L2) of the passes', from which they
    differ only in the order of fp32 sums. ``parts``: whether the launch
    splits its last items (``attn_bwd_parts_kernel`` launched or not).
    Returns the three runs' (dq, dk, dv)."""
    clear_launch_plans()
    want = torch.autograd.grad(out, inputs, dout, retain_graph=True)
    compile_ops.set_attention_backward(deterministic=False)
    try:
        launched.clear()
        got = [torch.autograd.grad(out, inputs, dout, retain_graph=True) for _ in range(3)]
        five = "attn_bwd_dq_from_acc_kernel"  # dq's cast from the five-product kernel's sums
        assert "attn_bwd_sm90_kernel" in launched and five in launched and passes_kernel not in launched, (
            case,
            launched,
        )
        assert ("attn_bwd_parts_kernel" in launched) == parts, (case, launched)
        with deterministic_algorithms():
            launched.clear()
            pinned = torch.autograd.grad(out, inputs, dout, retain_graph=True)
            assert five not in launched and passes_kernel in launched, (case, launched)
    finally:
        compile_ops.set_attention_backward(deterministic=True)
        clear_launch_plans()
    assert all(torch.equal(p, w) for p, w in zip(pinned, want)), case
    assert all(torch.equal(again[1], got[0][1]) and torch.equal(again[2], got[0][2]) for again in got[1:]), case
    for g, w in zip(got[0], want):
        assert ((g.float() - w.float()).norm() / w.float().norm()).item() < 1e-3, case
    return got


@pytest.mark.skipif(not _SM90, reason="the Gluon core runs on sm_90 GPUs only")
def test_sm90_five_product_backward_matches_the_deterministic_one(monkeypatch):
    """``compile_ops.set_attention_backward(deterministic=False)`` on sm_90,
    dense: the five-product Gluon backward at D = 128 and 64 over ragged Lq
    and Lk (key tiles masked past Lk), GQA, both layouts, fp16 and bf16, causal with Lq
    above, equal to and below Lk, and key lengths (one batch row with
    none), checked against the deterministic passes
    (:func:`five_product_gradients`), and dq, dk and dv within the
    two-reference rule of the fp64 gradients."""
    from compile_ops.ops import attention_launch, attention_sm90

    launched, launcher = [], attention_launch.launcher
    monkeypatch.setattr(
        attention_launch, "launcher", lambda kernel: launched.append(kernel.fn.__name__) or launcher(kernel)
    )
    for b, h, hk, lq, lk, seq_dim, dtype, causal, lengths, d in [
        (1, 4, 4, 1000, 1024, 2, torch.bfloat16, False, None, 128),
        (2, 8, 2, 333, 300, 1, torch.float16, False, None, 128),
        (1, 2, 2, 64, 77, 2, torch.bfloat16, False, None, 128),
        (1, 3, 3, 4680, 4680, 1, torch.bfloat16, False, None, 128),
        (1, 4, 2, 1000, 1000, 2, torch.bfloat16, True, None, 128),
        (2, 3, 3, 300, 700, 1, torch.float16, True, None, 128),
        (1, 2, 2, 700, 300, 2, torch.bfloat16, True, None, 128),
        (3, 4, 2, 500, 640, 2, torch.bfloat16, False, [640, 77, 0], 128),
        (2, 2, 2, 600, 600, 1, torch.float16, True, [600, 250], 128),
        (1, 4, 4, 1000, 1024, 2, torch.bfloat16, False, None, 64),
        (2, 8, 2, 333, 300, 1, torch.float16, False, None, 64),
        (1, 3, 3, 4429, 4429, 1, torch.bfloat16, False, None, 64),
        (2, 3, 3, 300, 700, 1, torch.float16, True, None, 64),
        (2, 2, 2, 600, 600, 1, torch.float16, True, [600, 250], 64),
        # more items than an H100's 132 SMs, and a leftover: whole items and parts in one launch
        (1, 5, 5, 700, 4096, 2, torch.bfloat16, False, None, 128),
        (2, 4, 2, 500, 4300, 1, torch.float16, False, None, 64),
    ]:
        torch.manual_seed(lq + lk)
        q, k, v = _qkv(b, h, hk, lq, lk, d, seq_dim, dtype, "cuda")
        kv_lengths = None if lengths is None else torch.tensor(lengths, device="cuda", dtype=torch.int32)
        out = compile_ops.attention(q, k, v, None, causal, seq_dim, kv_lengths)
        dout = torch.randn_like(out)
        case = (b, h, hk, lq, lk, seq_dim, dtype, causal, lengths, d)
        items = triton.cdiv(lk, 128) * b * hk
        steps = h // hk * triton.cdiv(lq, attention_sm90.SM90_BACKWARD_STEPS[d])
        whole, _ = attention_sm90.backward_tail_split(items, multiprocessor_count(q), steps)
        parts = not causal and lengths is None and whole < items
        got = five_product_gradients(out, (q, k, v), dout, launched, "attn_bwd_dq_kernel", case, parts)
        qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
        exact, _ = ref.attention(qd, kd, vd, d**-0.5, causal, seq_dim, kv_lengths)
        exact_grads = torch.autograd.grad(exact, (qd, kd, vd), dout.double())
        theirs = torch_at_dtype(q, k, v, dout, d**-0.5, causal, seq_dim, kv_lengths)[1]
        for again in got:
            for name, g, e, p in zip("qkv", again, exact_grads, theirs):
                assert_within_torch_error(g, e, p, 3.0, f"d{name} {case}", fp32_roundings=128)


@pytest.mark.skipif(not _SM90, reason="the Gluon core runs on sm_90 GPUs only")
def test_sm90_deterministic_backward_by_the_kernel_without_dq(monkeypatch):
    """The default (deterministic) backward on sm_90, whose dk/dv pass is
    ``attn_bwd_sm90_kernel`` without dQ (``SM90_DKDV``): launched for dense
    calls, its last round never split (no fp32 parts: the default backward's
    peak memory); bit-identical across reruns; dq
    bit-equal to the ``triton.language`` passes' (the same dq pass) and dk,
    dv within 1e-3 of theirs; all three within the two-reference rule of
    the fp64 gradients; D = 128 and 64, GQA, both layouts, causal, key
    lengths, ragged Lq and Lk. The dense non-causal cases run the pass
    persistent (``SM90_DKDV_PERSISTENT``), two of them with more key tiles
    than an H100's 132 SMs (160 and 136), so that some programs take two
    and a dropped or doubled second item fails the fp64 rule."""
    from compile_ops.ops import attention_launch, attention_sm90

    launched, launcher = [], attention_launch.launcher
    monkeypatch.setattr(
        attention_launch, "launcher", lambda kernel: launched.append(kernel.fn.__name__) or launcher(kernel)
    )
    for b, h, hk, lq, lk, seq_dim, dtype, causal, lengths, d in [
        (1, 5, 5, 700, 4096, 2, torch.bfloat16, False, None, 128),  # split, with dq by reductions
        (2, 8, 2, 333, 300, 1, torch.float16, False, None, 128),
        (1, 4, 2, 1000, 1000, 2, torch.bfloat16, True, None, 128),
        (3, 4, 2, 500, 640, 2, torch.bfloat16, False, [640, 77, 0], 128),
        (2, 4, 2, 500, 4300, 1, torch.float16, False, None, 64),  # split, with dq by reductions
        (2, 3, 3, 300, 700, 1, torch.float16, True, [700, 250], 64),
    ]:
        case = (b, h, hk, lq, lk, seq_dim, dtype, causal, lengths, d)
        torch.manual_seed(lq + lk)
        q, k, v = _qkv(b, h, hk, lq, lk, d, seq_dim, dtype, "cuda")
        kv_lengths = None if lengths is None else torch.tensor(lengths, device="cuda", dtype=torch.int32)
        out = compile_ops.attention(q, k, v, None, causal, seq_dim, kv_lengths)
        dout = torch.randn_like(out)
        clear_launch_plans()
        launched.clear()
        got = [torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) for _ in range(3)]
        assert "attn_bwd_sm90_kernel" in launched and "attn_bwd_dkdv_kernel" not in launched, (case, launched)
        assert "attn_bwd_parts_kernel" not in launched, (case, launched)
        assert all(torch.equal(a, g) for again in got[1:] for a, g in zip(again, got[0])), case
        monkeypatch.setattr(attention_sm90, "SM90_DKDV", False)
        clear_launch_plans()
        passes = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        monkeypatch.setattr(attention_sm90, "SM90_DKDV", True)
        clear_launch_plans()
        assert torch.equal(got[0][0], passes[0]), case
        for g, w in zip(got[0][1:], passes[1:]):
            assert ((g.float() - w.float()).norm() / w.float().norm()).item() < 1e-3, case
        qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
        exact, _ = ref.attention(qd, kd, vd, d**-0.5, causal, seq_dim, kv_lengths)
        exact_grads = torch.autograd.grad(exact, (qd, kd, vd), dout.double())
        theirs = torch_at_dtype(q, k, v, dout, d**-0.5, causal, seq_dim, kv_lengths)[1]
        for name, g, e, p in zip("qkv", got[0], exact_grads, theirs):
            assert_within_torch_error(g, e, p, 3.0, f"d{name} {case}", fp32_roundings=128)


@pytest.mark.skipif(not _SM90, reason="the Gluon core runs on sm_90 GPUs only")
def test_sm90_backward_compiled_equals_eager(monkeypatch):
    """Under ``torch.compile`` (Inductor, fullgraph) the sm_90 backward runs
    as the opaque ``fused_gluon.attention_backward_sm90_``: the five-product
    option with a dQ accumulator (and, where the launch splits its last
    round, the parts' sum inside the op), the deterministic default without
    one (``dq_acc=None``: its dq comes from the ``triton.language`` pass).
    dk and dv equal the eager backward's bit for bit; dq too in the
    deterministic mode, within 1e-3 with five products (its sums' order
    varies from run to run: 1.6e-4 seen on an H100, where the bound was
    1e-4); D = 128 and 64, with and without a split. The five-product
    option first, then the default compiling the same function again: its
    graph must not come from the compile caches' entry of the other
    setting (``set_attention_backward``'s cache tag)."""
    from compile_ops.ops import attention_launch, attention_sm90

    # Traced calls launch the Gluon kernel inside the opaque op, not through ``launcher``.
    launched, launcher, launch_sm90 = [], attention_launch.launcher, attention_sm90.launch_sm90_backward
    monkeypatch.setattr(
        attention_launch, "launcher", lambda kernel: launched.append(kernel.fn.__name__) or launcher(kernel)
    )

    def recorded(launch, *args):
        return launch_sm90(lambda kernel: launched.append(kernel.fn.__name__) or launch(kernel), *args)

    for module in (attention_launch, attention_sm90):  # the eager path's launch and the opaque op's
        monkeypatch.setattr(module, "launch_sm90_backward", recorded)

    def attend(q, k, v):
        return compile_ops.attention(q, k, v, None, False, 2)

    try:
        for deterministic in (False, True):
            compile_ops.set_attention_backward(deterministic=deterministic)
            splits, sms = set(), multiprocessor_count(torch.empty(0, device="cuda"))
            for b, h, lq, lk, d in [(1, 5, 700, 4096, 128), (2, 4, 500, 4300, 64), (1, 4, 300, 4224, 128)]:
                items = triton.cdiv(lk, 128) * b * h
                steps = triton.cdiv(lq, attention_sm90.SM90_BACKWARD_STEPS[d])
                split = attention_sm90.backward_tail_split(items, sms, steps)[0] < items
                splits.add(split)
                torch.manual_seed(lk)
                q, k, v = _qkv(b, h, h, lq, lk, d, 2, torch.bfloat16, "cuda")
                dout = torch.randn(b, h, lq, d, device="cuda", dtype=torch.bfloat16)
                eager = torch.autograd.grad(attend(q, k, v), (q, k, v), dout)
                torch._dynamo.reset()
                clear_launch_plans()
                launched.clear()
                compiled = torch.autograd.grad(torch.compile(attend, fullgraph=True)(q, k, v), (q, k, v), dout)
                case = (b, h, lq, lk, d, split)
                assert "attn_bwd_sm90_kernel" in launched, (case, launched)
                assert ("attn_bwd_parts_kernel" in launched) == (split and not deterministic), (case, launched)
                assert torch.equal(compiled[1], eager[1]) and torch.equal(compiled[2], eager[2]), case
                if deterministic:
                    assert "attn_bwd_dq_kernel" in launched, (case, launched)
                    assert torch.equal(compiled[0], eager[0]), case
                else:
                    error = (compiled[0].float() - eager[0].float()).norm() / eager[0].float().norm()
                    assert error.item() < 1e-3, case
            assert splits == {True, False}, splits  # (on a 132-SM GPU: an H100 or H200)
    finally:
        compile_ops.set_attention_backward(deterministic=True)


@pytest.mark.skipif(not _SM90, reason="the Gluon core runs on sm_90 GPUs only")
def test_sm90_core_int8_fp8_computes_what_the_portable_kernel_does(monkeypatch):
    """The core's INT8_FP8 mode, forced on (``"int8_fp8"`` among its
    precisions): ``attention_qk8`` with FP8 P V on q and k given in int8 is
    ``attn_fwd_kernel``'s result (the same formulas: equal up to one rounding
    of the output) over ragged, GQA, short and Lq != Lk shapes, with offset
    keys, in both layouts; five launches into NaN-filled outputs (three on
    grids of 1, 3 and 7 programs, each through many work items) each write
    every row, and the replayed second call and a compiled call give the
    first call's result."""
    from compile_ops.kernels.attention_sm90 import attn_fwd_sm90_kernel
    from compile_ops.ops import attention_8bit, attention_sm90, attention_tiles

    for b, h, hk, lq, lk, seq_dim in [
        (1, 4, 4, 1000, 1000, 2),
        (2, 8, 2, 333, 4096, 1),
        (1, 2, 2, 64, 77, 2),
        (1, 2, 1, 513, 129, 1),
        (1, 3, 3, 130, 1, 2),
        (1, 12, 12, 4680, 4680, 2),
    ]:
        torch.manual_seed(lq + lk)
        shape = (lambda hh, l: (b, hh, l, 128)) if seq_dim == 2 else (lambda hh, l: (b, l, hh, 128))
        q = torch.randn(shape(h, lq), device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(shape(hk, lk), device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k = k + 4 * torch.randn(128, device="cuda", dtype=torch.bfloat16)  # a per-channel offset
        q8, q_scale, k8, k_scale = ref.smooth_quantize_qk(q, k, seq_dim)
        args = (q8, q_scale, k8, k_scale, v, 128**-0.5, False, seq_dim, None, True, False)
        case = (b, h, hk, lq, lk, seq_dim)
        with torch.no_grad():
            with monkeypatch.context() as m:
                m.setattr(attention_tiles, "SM90_CORE_PRECISIONS", ("exact", "int8_fp8"))
                clear_launch_plans()
                got = [torch.ops.fused.attention_qk8(*args)[0] for _ in range(2)]
                compiled = torch.compile(lambda *a: torch.ops.fused.attention_qk8(*a)[0], fullgraph=True)(*args)
                vt8, v_scale = attention_8bit.quantized_operands(None, None, v, seq_dim, True)
                for programs in (None, None, 1, 3, 7):
                    out = torch.full_like(q, float("nan"))
                    lse = torch.empty(b, h, lq, device="cuda")
                    if programs:
                        m.setattr(attention_sm90, "_core_programs", lambda q, items, causal, sparse, n=programs: n)
                    attention_sm90.launch_sm90_core(
                        attn_fwd_sm90_kernel,
                        q8,
                        k8,
                        vt8,
                        out,
                        lse,
                        128**-0.5,
                        False,
                        seq_dim,
                        None,
                        None,
                        None,
                        q_scale,
                        k_scale,
                        v_scale,
                    )
                    assert torch.equal(out, got[0]), (case, programs)
            clear_launch_plans()
            want = torch.ops.fused.attention_qk8(*args)[0]
        torch.testing.assert_close(got[0], want, rtol=2.0**-7, atol=1e-5, msg=lambda m: f"{case}: {m}")
        for again in (got[1], compiled):
            assert torch.equal(again, got[0]), case
    clear_launch_plans()
