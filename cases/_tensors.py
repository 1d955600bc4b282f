"""The random tensors and shape rules that every family's input builders share."""

import torch


def tensor(shape, dtype, device, requires_grad=False, scale=1.0):
    """A ``shape`` tensor of N(0, 1) values times ``scale``, drawn in fp32 and cast to ``dtype``."""
    t = torch.randn(shape, dtype=torch.float32, device=device).mul_(scale).to(dtype)
    return t.requires_grad_(requires_grad)


def param(c, dtype, device, requires_grad):
    """A ``[c]`` weight near 1, like a trained norm's, but not exactly: a kernel
    that ignored it would still be caught."""
    return (1.0 + 0.1 * torch.randn(c, device=device)).to(dtype).requires_grad_(requires_grad)


def split_heads(shape):
    """``[B, L, C]`` -> (B, L, H, D) with D = 128 (16 for small C)."""
    b, length, c = shape
    d = 128 if c % 128 == 0 else 16
    return b, length, c // d, d


def int8_dtype(dtype):
    """8-bit attention takes fp16/bf16: other requested dtypes run as fp16 (the
    interpreter's bf16 dots are wrong in triton 3.6; the GPU runs both)."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16
