"""The norm family as ``torch.ops.fused`` ops: rmsnorm, add_rmsnorm, layernorm.

Each forward op returns exactly what the user sees; the shared backward op
``fused.norm_backward`` recomputes the row statistics from x (see
``kernels/norm.py``), so nothing but the inputs is saved for backward.
"""

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
from torch import Tensor

from compile_ops import meta, reference
from compile_ops._library import aten_autocast_policy, fused_op, launcher, multiprocessor_count
from compile_ops.kernels.norm import norm_bwd_kernel, norm_fwd_kernel
from compile_ops.meta._validate import accumulation_dtype
from compile_ops.ops._launch import acc_dtype, as_rows, column_sum, contiguous_param, grad_or_none

# ---------------------------------------------------------------- launch configs

#: Rows up to this many elements stay in registers; longer rows are walked in chunks.
MAX_SINGLE_BLOCK = 16384
#: Chunk width of the looped kernels.
LOOP_BLOCK = 4096


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # rows per program (per loop step in the backward)
    block_n: int  # columns per block: the padded row, or one chunk when looped
    looped: bool
    num_warps: int
    num_stages: int = 3  # triton's default; only the looped/persistent loops use it
    held_chunks: int = 1  # a held row as this many blocks of block_n (the modulation forward)


@functools.lru_cache(maxsize=None)
def forward_config(n: int) -> LaunchConfig:
    """One program per tile of about 8K elements (``bench/sweeps/norm.py``,
    bench/results/sweep-h100.json): enough bytes in flight per program
    without spilling; 16 warps only for the widest single-block rows."""
    block_n = triton.next_power_of_2(n)
    if block_n > MAX_SINGLE_BLOCK:
        return LaunchConfig(1, LOOP_BLOCK, True, 8)
    block_m = max(1, min(16, 8192 // block_n))
    tile = block_m * block_n
    num_warps = 16 if block_n >= 16384 else 8 if tile >= 8192 else 4
    return LaunchConfig(block_m, block_n, False, num_warps)


@functools.lru_cache(maxsize=None)
def backward_config(n: int, accumulators: int = 1) -> LaunchConfig:
    """Persistent programs stepping over tiles of 2 rows up to 4096 wide (1 row
    wider), each thread holding up to 64 fp32 values per tensor. One-row tiles
    with two accumulators (LayerNorm's dweight and dbias) get twice the warps;
    two-row tiles keep theirs, where more warps are slower (docs/notes/norm.md)."""
    block_n = triton.next_power_of_2(n)
    if block_n > MAX_SINGLE_BLOCK:
        return LaunchConfig(1, LOOP_BLOCK, True, 8)
    block_m = max(1, min(16, 8192 // block_n)) if block_n <= 1024 else 2 if block_n <= 4096 else 1
    per_thread = 32 if accumulators >= 2 and block_m == 1 else 64
    num_warps = max(4, min(16, block_m * block_n // (32 * per_thread)))
    return LaunchConfig(block_m, block_n, False, num_warps)


#: Persistent backward programs per multiprocessor.
BACKWARD_PROGRAMS_PER_SM = 2


# ---------------------------------------------------------------- launchers


def _launch_forward(
    x: Tensor,
    residual: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
    is_rms: bool,
    out: Tensor,
    residual_out: Optional[Tensor],
) -> None:
    x2 = as_rows(x)
    res2 = None if residual is None else as_rows(residual)
    n_rows, n = x2.shape
    cfg = forward_config(int(n))  # a hidden dim made dynamic is specialized here: BLOCK_N depends on it
    launcher(norm_fwd_kernel)[(triton.cdiv(n_rows, cfg.block_m),)](
        x2,
        res2,
        contiguous_param(weight),
        contiguous_param(bias),
        out,
        residual_out,
        n_rows,
        n,
        x2.stride(0),
        x2.stride(1),
        0 if res2 is None else res2.stride(0),
        0 if res2 is None else res2.stride(1),
        eps,
        IS_RMS=is_rms,
        HAS_RESIDUAL=residual is not None,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        ACC_DTYPE=acc_dtype(x),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        LOOPED=cfg.looped,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


# ---------------------------------------------------------------- forward ops

#: The RMSNorms follow aten's rms_norm under autocast, which depends on the torch release.
_RMS_NORM_AUTOCAST = aten_autocast_policy("aten::rms_norm", "fp32")


@fused_op("rmsnorm", fake=meta.norm.rmsnorm, reference=reference.norm.rmsnorm, autocast=_RMS_NORM_AUTOCAST)
def _rmsnorm_op(x: Tensor, weight: Optional[Tensor], eps: float, bias: Optional[Tensor] = None) -> Tensor:
    out = meta.norm.rmsnorm(x, weight, eps, bias)
    _launch_forward(x, None, weight, bias, eps, True, out, None)
    return out


@fused_op("layernorm", fake=meta.norm.layernorm, reference=reference.norm.layernorm, autocast="fp32")
def _layernorm_op(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float) -> Tensor:
    out = meta.norm.layernorm(x, weight, bias, eps)
    _launch_forward(x, None, weight, bias, eps, False, out, None)
    return out


@fused_op("add_rmsnorm", fake=meta.norm.add_rmsnorm, reference=reference.norm.add_rmsnorm, autocast=_RMS_NORM_AUTOCAST)
def _add_rmsnorm_op(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    out, residual_out = meta.norm.add_rmsnorm(x, residual, weight, eps)
    _launch_forward(x, residual, weight, None, eps, True, out, residual_out)
    return out, residual_out


# ---------------------------------------------------------------- backward op


@fused_op("norm_backward", fake=meta.norm.norm_backward, reference=reference.norm.norm_backward)
def _norm_backward_op(
    grad_out: Tensor,
    grad_residual: Optional[Tensor],
    x: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
    is_rms: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    dx, dweight, dbias = meta.norm.norm_backward(grad_out, grad_residual, x, weight, bias, eps, is_rms)
    x2, dy2 = as_rows(x), as_rows(grad_out)
    dres2 = None if grad_residual is None else as_rows(grad_residual)
    n_rows, n = x2.shape
    cfg = backward_config(int(n), (weight is not None) + (bias is not None))
    max_programs = multiprocessor_count(x) * BACKWARD_PROGRAMS_PER_SM
    programs = torch.sym_min(max_programs, triton.cdiv(n_rows, cfg.block_m))
    acc = accumulation_dtype(x)
    # The partial-sum buffers have a static first dim: sized by the live program
    # count they would be a dim of size 1 for short inputs, which torch.compile
    # specializes, and every short sequence length would recompile.
    # The looped kernel adds into its partial row chunk by chunk, so it needs zeros.
    alloc = torch.zeros if cfg.looped else torch.empty
    dw_partial = alloc((max_programs, n), dtype=acc, device=x.device) if weight is not None else None
    db_partial = alloc((max_programs, n), dtype=acc, device=x.device) if bias is not None else None
    launcher(norm_bwd_kernel)[(programs,)](
        dy2,
        dres2,
        x2,
        contiguous_param(weight),
        dx,
        dw_partial,
        db_partial,
        n_rows,
        n,
        programs,
        dy2.stride(0),
        dy2.stride(1),
        0 if dres2 is None else dres2.stride(0),
        0 if dres2 is None else dres2.stride(1),
        x2.stride(0),
        x2.stride(1),
        eps,
        IS_RMS=is_rms,
        HAS_DRES=grad_residual is not None,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        ACC_DTYPE=acc_dtype(x),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        LOOPED=cfg.looped,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if weight is not None:
        column_sum(dw_partial, programs, dweight)
    if bias is not None:
        column_sum(db_partial, programs, dbias)
    return dx, dweight, dbias


# ---------------------------------------------------------------- autograd


def _setup_rmsnorm(ctx, inputs, output):
    x, weight, eps, bias = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.eps = eps


def _backward_rmsnorm(ctx, grad_out):
    x, weight, bias = ctx.saved_tensors
    dx, dw, db = _norm_backward_op(grad_out, None, x, weight, bias, ctx.eps, True)
    return dx, grad_or_none(dw, weight), None, grad_or_none(db, bias)


def _setup_layernorm(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.eps = eps


def _backward_layernorm(ctx, grad_out):
    x, weight, bias = ctx.saved_tensors
    dx, dw, db = _norm_backward_op(grad_out, None, x, weight, bias, ctx.eps, False)
    return dx, grad_or_none(dw, weight), grad_or_none(db, bias), None


def _setup_add_rmsnorm(ctx, inputs, output):
    x, residual, weight, eps = inputs
    _, residual_out = output
    # The norm's input is residual_out: saving it avoids recomputing x + residual.
    ctx.save_for_backward(residual_out, weight)
    ctx.eps = eps
    ctx.x_dtype = x.dtype


def _backward_add_rmsnorm(ctx, grad_out, grad_residual_out):
    h, weight = ctx.saved_tensors
    dh, dw, _ = _norm_backward_op(grad_out, grad_residual_out, h, weight, None, ctx.eps, True)
    return dh.to(ctx.x_dtype), dh, grad_or_none(dw, weight), None


_rmsnorm_op.register_autograd(_backward_rmsnorm, setup_context=_setup_rmsnorm)
_layernorm_op.register_autograd(_backward_layernorm, setup_context=_setup_layernorm)
_add_rmsnorm_op.register_autograd(_backward_add_rmsnorm, setup_context=_setup_add_rmsnorm)


# ---------------------------------------------------------------- public functions


def rmsnorm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6, bias: Optional[Tensor] = None) -> Tensor:
    """RMSNorm over the last dim: ``x / sqrt(mean(x**2) + eps) * weight + bias``.

    Args:
        x: ``[..., N]``, fp16/bf16/fp32/fp64, any strides.
        weight: ``[N]`` or None. An fp32 weight with fp16/bf16 x is allowed.
        eps: added to the mean square, ``>= 0``.
        bias: ``[N]`` or None (diffusers' ``RMSNorm(bias=True)``).

    Returns:
        ``[..., N]``, contiguous, in the weight's dtype when the weight is
        fp16/bf16, else in x's dtype (diffusers' rule). Statistics are fp32.
    """
    return _rmsnorm_op(x, weight, eps, bias)


def layernorm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    Args:
        x: ``[..., N]``, fp16/bf16/fp32/fp64, any strides.
        weight: ``[N]`` or None (``elementwise_affine=False``, the DiT case).
        bias: ``[N]`` or None.
        eps: added to the (biased) variance, ``>= 0``.

    Returns:
        ``[..., N]``, contiguous; dtype as :func:`rmsnorm`.
    """
    return _layernorm_op(x, weight, bias, eps)


def add_rmsnorm(
    x: Tensor, residual: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """Residual add fused with RMSNorm: ``h = x + residual; return rmsnorm(h), h``.

    Args:
        x: ``[..., N]``, the branch output.
        residual: ``[..., N]``, the residual stream, in x's dtype or a wider one
            (fp32 while x is bf16): the sum is kept in residual's dtype, so a
            narrower one than x's is refused.
        weight: ``[N]`` or None.
        eps: ``>= 0``.

    Returns:
        ``(out, residual_out)``: ``residual_out = x + residual`` in residual's
        dtype, and ``out = rmsnorm(residual_out, weight, eps)`` in the dtype
        :func:`rmsnorm` gives x (bit-identical to calling :func:`rmsnorm` on
        residual_out when x and residual share a dtype).
    """
    return _add_rmsnorm_op(x, residual, weight, eps)
