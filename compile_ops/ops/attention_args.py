"""What every attention launch derives from its tensors: the call's sizes and
shared constexprs, (batch, head, position) strides, block-list arguments,
and whether TMA descriptors may cover the tensors."""

from dataclasses import dataclass
from typing import Optional

import torch
import triton
from torch import Tensor

from compile_ops import meta
from compile_ops.ops._launch import acc_dtype, dot_precision
from compile_ops.ops.attention_tiles import block_d


def bhl_strides(t: Tensor, seq_dim: int) -> tuple:
    """(batch, head, position) strides of a q/k/v-shaped tensor in either layout."""
    if seq_dim == 2:
        return t.stride(0), t.stride(1), t.stride(2)
    return t.stride(0), t.stride(2), t.stride(1)


@dataclass(frozen=True)
class AttentionSizes:
    """A call's sizes and the constexprs every attention kernel takes (:func:`attention_sizes`)."""

    b: int
    h: int
    hk: int
    lq: int
    lk: int
    d: int
    causal: bool
    has_kv_len: bool
    #: ``D``, ``BLOCK_D``, ``CAUSAL``, ``HAS_KV_LEN``, ``DOT_PRECISION``, ``ACC``, ``FMA_EXPONENT``,
    #: ``SPARSE_BLOCK`` and ``ALIGNED_LENGTHS``, passed to the kernels as ``**consts``.
    consts: dict


def attention_sizes(q: Tensor, k: Tensor, causal: bool, seq_dim: int, kv_lengths: Optional[Tensor]) -> AttentionSizes:
    """Sizes (b, h, hk, lq, lk, d) and the constexprs every attention kernel takes.
    ``DOT_PRECISION`` matters for fp32 (TF32 or IEEE, ``dot_precision``); half
    operands ignore it. ``FMA_EXPONENT``: 16-bit inputs form exponents with
    one fma (their p is rounded to 16 bits anyway); fp32/fp64 keep torch's
    accuracy. ``ALIGNED_LENGTHS``: Lq and Lk are multiples of 16, the hint
    Triton's JIT takes from the values itself and Inductor loses when the
    lengths are symbolic (``kernels.attention_common.aligned_lengths``);
    traced with dynamic shapes, computing it guards on the lengths'
    divisibility, so a compiled graph serves either aligned or unaligned
    lengths, each at full speed."""
    b, h, lq, d = meta.attention.dims(q, seq_dim)
    hk, lk = meta.attention.dims(k, seq_dim)[1:3]
    consts = dict(
        D=d,
        BLOCK_D=block_d(d),
        CAUSAL=causal,
        HAS_KV_LEN=kv_lengths is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        ACC=acc_dtype(q),
        FMA_EXPONENT=q.dtype in (torch.float16, torch.bfloat16),
        SPARSE_BLOCK=meta.attention.SPARSE_BLOCK,
        ALIGNED_LENGTHS=bool(lq % 16 == 0 and lk % 16 == 0),
    )
    return AttentionSizes(b, h, hk, lq, lk, d, causal, kv_lengths is not None, consts)


def block_list_args(blocks: Optional[tuple]) -> tuple:
    """The kernels' block-list arguments: ``(index, count, 3 index strides, 3
    count strides)`` of ``[B, H, rows, width]`` / ``[B, H, rows]`` lists, or
    placeholders for dense attention."""
    if blocks is None:
        return (None, None) + (0,) * 6
    index, count = blocks
    return (index, count, *index.stride()[:3], *count.stride())


def tma_ready(seq_dim: int, *tensors: Tensor) -> bool:
    """TMA descriptors over each (batch, head)'s ``[L, D]`` rows need 16-byte
    aligned bases and row strides: the storage offset and the batch, head and
    position strides (in bytes) must be multiples of 16 (storages themselves
    are aligned by the CUDA allocator; the offset, unlike ``data_ptr``, is
    there on the fake tensors torch.compile traces with)."""
    for t in tensors:
        if not t.is_cuda or t.storage_offset() * t.element_size() % 16:
            return False
        if any(stride * t.element_size() % 16 for stride in bhl_strides(t, seq_dim)):
            return False
    return True


def tma_scratch(size: int, alignment: int, stream) -> Tensor:
    """Global memory for the descriptors a kernel builds on the device (TMA)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def take_tma(wanted: bool, *layouts: tuple) -> bool:
    """Whether a launch loads by TMA: its tiles want it and every ``(seq_dim,
    *tensors)`` of ``layouts`` is aligned for descriptors (:func:`tma_ready`).
    If so, triton's allocator is set for the descriptors the kernel makes on
    the device: Inductor sets its own before its launches, eager launches
    need it set too."""
    tma = wanted and all(tma_ready(seq_dim, *tensors) for seq_dim, *tensors in layouts)
    if tma:
        triton.set_allocator(tma_scratch)
    return tma
