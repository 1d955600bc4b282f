"""The AdaLN modulation family's forward launcher: how rows split into
segments that share modulation rows, the forward's launch configs (rows
padded to a power of two or held as several blocks, :func:`held_chunks`),
and :func:`launch_forward`, which every forward op of ``ops/modulate.py``
calls with its own flags."""

import functools
from typing import Optional

import torch
import triton
from torch import Tensor

from compile_ops import meta
from compile_ops._library import launcher
from compile_ops.kernels.modulate import modulate_fwd_kernel
from compile_ops.meta.modulate import Broadcast, static_int
from compile_ops.ops._launch import TRITON_DTYPES, acc_dtype, as_rows, contiguous_param
from compile_ops.ops.norm import LaunchConfig

#: The kernels' NORM flag.
NORM_CODES = {"none": 0, "rmsnorm": 1, "layernorm": 2}
#: Rows per forward program: they share the modulation rows, read once per
#: piece (the sweep's best for norm_modulate: docs/notes/modulate.md).
FORWARD_PIECE_ROWS = 4
#: Kernel arguments of an absent modulation tensor.
_NO_BROADCAST = (0, 0, 0, 0, 1)


def broadcast_args(b: Optional[Broadcast]) -> tuple:
    if b is None:
        return _NO_BROADCAST
    return (b.stride_batch, b.stride_group, b.stride_in_group, b.stride_col, b.group)


def broadcasts(op: str, x: Tensor, **tensors: Optional[Tensor]) -> dict:
    return {name: None if m is None else meta.modulate.broadcast_on_x(op, name, m, x) for name, m in tensors.items()}


def segments(h: Tensor, broadcasts: dict):
    """``(tokens, seg_rows, n_segments)``: how the rows of ``h`` split into
    segments that share every modulation row (``kernels/modulate.py``)."""
    tokens = meta.modulate.tokens_of(h)
    seg_rows = meta.modulate.segment_rows(tokens, *[b for b in broadcasts.values() if b is not None])
    return tokens, seg_rows, h.shape[0] * (tokens // seg_rows)


#: A row held as chunks is at most this many blocks (each unrolled in the kernel).
MAX_HELD_CHUNKS = 8
#: Values of a held row a thread holds at most where MEASURED has no entry.
HELD_VALUES_PER_THREAD = 48
#: ``(width, gated): (rows a step, warps)`` of rows held as blocks at the DiT widths:
#: the forward sweeps' best for both output modes together
#: (bench/results/sweep-modulate-held-h100.json, sweep-modulate-held-gated-h100.json;
#: docs/notes/modulate.md).
MEASURED = {
    (1536, False): (1, 2),
    (3072, False): (2, 2),
    (5120, False): (1, 4),
    (1536, True): (1, 2),
    (3072, True): (1, 4),
    (5120, True): (1, 4),
}


def held_chunks(n: int) -> int:
    """How many power-of-two blocks hold a row of ``n`` columns without padding
    it to a power of two: 1 for a power of two or a row under 1024 columns,
    else ``n`` over its largest power-of-two divisor when that gives blocks of
    at least 256 columns, at most MAX_HELD_CHUNKS of them (1536 = 3 x 512,
    3072 = 3 x 1024, 5120 = 5 x 1024). A padded row's masked lanes issue every
    instruction the valid ones do, and the forward is bound by issue, not by
    memory (docs/notes/modulate.md)."""
    if n < 1024 or n & (n - 1) == 0:
        return 1
    block = n & -n
    return n // block if block >= 256 and n // block <= MAX_HELD_CHUNKS else 1


@functools.lru_cache(maxsize=None)
def forward_config(n: int, gated: bool) -> LaunchConfig:
    """From the forward sweeps (bench/results/sweep-modulate-fwd-h100.json,
    then sweep-modulate-held-h100.json): narrow rows take several rows a step
    at 4 warps; from 1024 columns one row a step, two for the gated residual
    (two inputs, two outputs) up to 4096 wide, at 4 warps. A row whose
    width is not a power of two is held as :func:`held_chunks` blocks,
    at MEASURED's config or, at widths not measured, one row a step over the
    warps that give a thread at most HELD_VALUES_PER_THREAD values. Both
    output modes take the same config, so that the FP8 mode quantizes the
    bits the 16-bit mode writes."""
    block_n = triton.next_power_of_2(n)
    if block_n < 1024:
        return LaunchConfig(min(16, 8192 // block_n), block_n, False, 4)
    chunks = held_chunks(n)
    if chunks == 1:
        block_m, warps = MEASURED.get((n, gated), (2 if gated and block_n <= 4096 else 1, 4))
        return LaunchConfig(block_m, block_n, False, warps)
    fallback = (1, min(8, triton.next_power_of_2(triton.cdiv(n, 32 * HELD_VALUES_PER_THREAD))))
    block_m, warps = MEASURED.get((n, gated), fallback)
    return LaunchConfig(block_m, n // chunks, False, warps, held_chunks=chunks)


def launch_forward(
    op: str,
    x: Tensor,
    residual: Optional[Tensor],
    gate: Optional[Tensor],
    scale: Optional[Tensor],
    shift: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    norm: str,
    eps: float,
    out: Optional[Tensor],
    residual_out: Optional[Tensor] = None,
    mean: Optional[Tensor] = None,
    rstd: Optional[Tensor] = None,
    out_scale: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> None:
    """``out_scale`` given: the FP8 output mode, ``out`` e4m3 and ``out_scale`` its
    row scales, of the output rounded to ``out_dtype`` (the unquantized op's)."""
    x2 = as_rows(x)
    res2 = None if residual is None else as_rows(residual)
    n_rows, n = x2.shape
    if static_int(n_rows) == 0:
        return
    b = broadcasts(op, x, gate=gate, scale=scale, shift=shift)
    tokens, seg_rows, n_segments = segments(x, b)
    chunks = triton.cdiv(seg_rows, FORWARD_PIECE_ROWS)
    cfg = forward_config(int(n), gate is not None)
    launcher(modulate_fwd_kernel)[(n_segments * chunks,)](
        x2,
        res2,
        gate,
        scale,
        shift,
        contiguous_param(weight),
        contiguous_param(bias),
        out,
        residual_out,
        mean if norm == "layernorm" else None,
        rstd,
        out_scale,
        n_rows,
        n,
        tokens,
        seg_rows,
        FORWARD_PIECE_ROWS,
        chunks,
        x2.stride(0),
        x2.stride(1),
        0 if res2 is None else res2.stride(0),
        0 if res2 is None else res2.stride(1),
        *broadcast_args(b["gate"]),
        *broadcast_args(b["scale"]),
        *broadcast_args(b["shift"]),
        eps,
        GATED=gate is not None,
        NORM=NORM_CODES[norm],
        MODULATED=scale is not None,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        ACC_DTYPE=acc_dtype(x),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        QUANTIZE=out_scale is not None,
        OUT_DTYPE=TRITON_DTYPES[out_dtype or torch.float32],
        CHUNKS=cfg.held_chunks,
        num_warps=cfg.num_warps,
    )
