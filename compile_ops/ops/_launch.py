"""Launcher helpers shared by every op family in ``ops/``."""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from compile_ops._library import launcher
from compile_ops.kernels.norm import column_sum_kernel
from compile_ops.meta._validate import accumulation_dtype


def acc_dtype(x: Tensor):
    """The kernels' accumulation dtype as a triton dtype (``meta._validate.accumulation_dtype``)."""
    return tl.float64 if accumulation_dtype(x) == torch.float64 else tl.float32


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for operands of ``dtype``, as torch's fp32 matmul setting says.

    fp32 dots use TF32 tensor cores only where the user allowed TF32 for
    matmuls (``torch.set_float32_matmul_precision("high")`` or ``"medium"``,
    ``torch.backends.cuda.matmul.allow_tf32 = True``); at torch's default
    ("highest") they are IEEE fp32, so an fp32 model's attention is as exact
    as the SDPA it replaces. Read when the op runs, or once when a compiled
    graph is traced. fp16/bf16 operands ignore it; fp64 is always IEEE.
    """
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


#: torch dtypes as the kernels' ``tl.constexpr`` dtype arguments.
TRITON_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float64: tl.float64,
}


def as_rows(t: Tensor) -> Tensor:
    """``t`` as ``[rows, N]``: a view whenever the leading dims collapse to one
    row stride (contiguous, row slices, expanded gradients); a copy otherwise."""
    return t.reshape(-1, t.shape[-1])


def unit_last_stride(t: Tensor) -> Tensor:
    """``t`` itself when its last dim has unit stride (what kernels that vector-load
    along it need), else a contiguous copy. A clone, not ``.contiguous()``: the
    latter cannot be fake-traced for CUDA on a CPU-only torch build, which
    tests/test_ops_registry.py does to every launcher."""
    return t if t.stride(-1) == 1 else t.clone(memory_format=torch.contiguous_format)


def contiguous_param(p: Optional[Tensor]) -> Optional[Tensor]:
    return None if p is None else p.contiguous()


def grad_or_none(g: Tensor, p: Optional[Tensor]) -> Optional[Tensor]:
    """An op's gradient output for an optional input: None where the input was None."""
    return None if p is None else g


def column_sum(partial: Tensor, n_rows, out: Tensor) -> None:
    """``out = partial[:n_rows].sum(0)`` for a contiguous 2-D ``partial``, in a fixed order.

    ``out`` may be any contiguous tensor of ``partial.shape[1]`` elements, of
    any float dtype (the kernel casts once, at the store).
    """
    n = partial.shape[1]
    # Narrow column strips (one 128-byte line of fp32 per row) so that enough
    # programs share the few MB of partial sums: with 256-wide strips a 3072
    # hidden size ran on 12 of 132 SMs.
    block_n = min(triton.next_power_of_2(n), 32)
    launcher(column_sum_kernel)[(triton.cdiv(n, block_n),)](
        partial, out, n_rows, n, BLOCK_R=64, BLOCK_N=block_n, num_warps=4
    )
