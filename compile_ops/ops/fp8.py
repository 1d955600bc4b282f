"""The fp8 family: ``fused.quantize_fp8_rows`` and the FP8 GEMM of rowwise-quantized operands.

Inference only. An FP8 Linear has no useful gradient (the weight is not a
parameter any more, and e4m3 rounding is flat almost everywhere), so a call
that would need one raises, naming the way out, instead of training a model
through a rounding step.

Where FP8 runs is decided in one place, :func:`check_fp8_device`: CUDA GPUs
with FP8 tensor cores (sm_89: Ada, Hopper and newer) run the Triton
quantization and ``torch._scaled_mm``; older GPUs get an error naming their
capability; other devices run the exact reference of
``compile_ops/reference/fp8.py``, which is how CI checks a patched model.
"""
from typing import Optional

import torch
import triton
from torch import Tensor

from compile_ops import meta, reference
from compile_ops._library import fused_op, launcher
from compile_ops.kernels.fp8 import quantize_fp8_rows_kernel
from compile_ops.ops._launch import as_rows

#: FP8 tensor cores: sm_89 (Ada) and newer, sm_90 (Hopper) among them.
FP8_CAPABILITY = (8, 9)

#: Elements per program and the widest column block (rows up to this width are
#: held whole in registers; wider rows take the two-pass loop).
TILE = 4096
MAX_BLOCK_N = 4096
NUM_WARPS = 4

INFERENCE_ONLY = ("FP8 paths are inference-only (compile_ops.patch(precision='fp8'), FP8Linear): "
                  "nothing can be differentiated through them; run the model under torch.inference_mode() "
                  "or torch.no_grad(), or patch it without precision='fp8' to train")


def check_fp8_device(device: torch.device) -> None:
    """Raise on a CUDA device without FP8 tensor cores (below sm_89)."""
    device = torch.device(device)
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_CAPABILITY:
            raise RuntimeError(
                f"compile_ops FP8: {torch.cuda.get_device_name(device)} is sm_{capability[0]}{capability[1]}; "
                f"FP8 GEMMs need FP8 tensor cores (sm_89 or newer: Ada, Hopper, Blackwell). "
                "Patch without precision='fp8' on this GPU")


@fused_op("quantize_fp8_rows", fake=meta.fp8.quantize_fp8_rows, reference=reference.fp8.quantize_fp8_rows)
def _quantize_fp8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    q, scale = meta.fp8.quantize_fp8_rows(x)
    x2 = as_rows(x)
    n_rows, k = x2.shape
    if n_rows == 0 or k == 0:  # nothing to launch; the reference gives the (empty or floor) scales
        return tuple(t.contiguous() for t in reference.fp8.quantize_fp8_rows(x))
    block_n = min(triton.next_power_of_2(int(k)), MAX_BLOCK_N)
    block_m = max(1, TILE // block_n)
    grid = (triton.cdiv(n_rows, block_m),)
    launcher(quantize_fp8_rows_kernel)[grid](
        x2, q, scale, n_rows, k, x2.stride(0), x2.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, LOOPED=block_n < k, num_warps=NUM_WARPS)
    return q, scale


def _no_gradient(ctx, grad_q, grad_scale):
    raise RuntimeError(f"fused.quantize_fp8_rows: {INFERENCE_ONLY}")


def _save_nothing(ctx, inputs, output):
    pass


_quantize_fp8_rows.register_autograd(_no_gradient, setup_context=_save_nothing)


def quantize_fp8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Rowwise e4m3 quantization (``compile_ops/reference/fp8.py`` specifies it).

    Args:
        x: ``[..., K]`` fp32, fp16 or bf16; any strides.

    Returns:
        ``(q, scale)``: ``q [..., K]`` float8_e4m3fn and ``scale [...]`` fp32,
        contiguous, with ``x ~ q * scale[..., None]``.
    """
    return _quantize_fp8_rows(x)


def fp8_linear(x: Tensor, weight_q: Tensor, weight_scale: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x @ W.T + bias`` with x quantized per row and W per output channel.

    Args:
        x: ``[..., K]`` activations (bf16 in a DiT; fp16, fp32 too).
        weight_q: ``[N, K]`` float8_e4m3fn, from :func:`quantize_fp8_rows` of W.
        weight_scale: ``[N]`` fp32, its scales.
        bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` in x's dtype. On CUDA ``torch._scaled_mm`` with rowwise
        scales writes bf16 (its rowwise mode's output), cast to x's dtype;
        elsewhere the reference sums in fp32 and casts once.
    """
    if torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError(f"fp8_linear: x requires grad. {INFERENCE_ONLY}")
    k = x.shape[-1]
    if weight_q.dtype != torch.float8_e4m3fn or weight_q.dim() != 2 or weight_q.shape[1] != k:
        raise ValueError(f"fp8_linear: weight_q must be float8_e4m3fn [N, {k}] (x's last dim), "
                         f"got {weight_q.dtype} {tuple(weight_q.shape)}")
    n = weight_q.shape[0]
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (n,):
        raise ValueError(f"fp8_linear: weight_scale must be float32 [{n}], got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"fp8_linear: bias must have shape [{n}], got {tuple(bias.shape)}")
    q, scale = quantize_fp8_rows(x.reshape(-1, k))
    if x.device.type == "cuda":
        check_fp8_device(x.device)
        out = torch._scaled_mm(q, weight_q.t(), scale_a=scale[:, None], scale_b=weight_scale[None, :],
                               bias=None if bias is None else bias.to(torch.bfloat16), out_dtype=torch.bfloat16)
        out = out.to(x.dtype)
    else:
        out = reference.fp8.fp8_linear(q, scale, weight_q, weight_scale, bias, x.dtype)
    return out.reshape(*x.shape[:-1], n)
