"""What the attention test files share (test_attention*.py, test_block_sparse*.py,
test_sparse_attention.py); it holds no tests.

- ``torch_at_dtype``: PyTorch's own attention and gradients at the input dtype,
  the second reference of the two-reference rule (test_attention.py), with the
  fp32 flash formulas it runs for fp32; ``LSE_ROUNDINGS``: the fp32 roundings
  the rule allows the lse.
- Case builders: ``_qkv`` (random q, k, v in either layout, requiring grad),
  ``_int8_case`` (keys with a per-channel offset, which 8-bit attention's
  smoothing removes) and ``_relative_l2``.
- ``EIGHT_BIT``: the 8-bit precisions' specifications and the kernels' bounds
  to them.
- sm_90: ``_SM90`` (an sm_90 GPU is present), ``_traced_launches`` (the kernels
  and opaque ops an op's body launches, traced on fake CUDA tensors) and
  ``five_product_gradients`` (the five-product backward checked against the
  deterministic passes).
"""

import torch
import torch.nn.functional as F
from conftest import deterministic_algorithms, tf32_dots

import compile_ops
from compile_ops._library import clear_launch_plans
from compile_ops.reference import attention as ref

LSE_ROUNDINGS = 2


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


def _qkv(b, hq, hk, lq, lk, d, seq_dim, dtype, device):
    def t(h, length):
        shape = (b, h, length, d) if seq_dim == 2 else (b, length, h, d)
        return torch.randn(shape, device=device).to(dtype).requires_grad_(True)

    return t(hq, lq), t(hk, lk), t(hk, lk)


def _relative_l2(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _int8_case(seq_dim, b, hq, hk, lq, lk, d, dtype, device, key_offset=2.0):
    """q, k, v with keys carrying a per-channel offset (what the smoothing removes)."""

    def t(h, length):
        shape = (b, h, length, d) if seq_dim == 2 else (b, length, h, d)
        return torch.randn(shape, device=device)

    offset = key_offset * torch.randn(d, device=device)
    return t(hq, lq).to(dtype), (t(hk, lk) + offset).to(dtype), t(hk, lk).to(dtype)


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


_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


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
