"""8-bit attention's operands and forward: :func:`quantize_8bit`'s Triton
passes over k and v, the layouts and scales of FP8 P V, and the body the
8-bit ops share (:func:`launch_eight_bit`)."""

from typing import Optional

import torch
import triton
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from compile_ops import meta, reference
from compile_ops._library import launcher
from compile_ops.kernels.attention_8bit import (
    fp8_rows_scale_kernel,
    kv8_counters_clear_kernel,
    kv8_quantize_kernel,
    kv8_stats_kernel,
)
from compile_ops.ops._launch import unit_last_stride
from compile_ops.ops.attention_args import bhl_strides
from compile_ops.ops.attention_launch import launch_forward
from compile_ops.ops.attention_tiles import block_d

#: The 8-bit quantization's statistics pass: each program reduces a chunk
#: of STAT_CHUNK_ROWS of a head's keys in steps of STAT_STEP rows, and the
#: head's last chunk to finish sums the head's partials; past
#: MAX_STAT_CHUNKS chunks a head the chunks grow instead. The values are a
#: sweep's (chunk and step lengths, warps) best across shapes
#: (docs/notes/attention.md).
STAT_STEP = 128
STAT_CHUNK_ROWS = 1024
MAX_STAT_CHUNKS = 128
#: Launches of the two passes (tests and experiments patch them).
STATS_LAUNCH = dict(num_warps=8)
QUANTIZE_LAUNCH = dict(num_warps=4)  # 8 warps are slower (docs/notes/attention.md)


def stat_rows_per_chunk(lk: int) -> int:
    """Keys per program of the statistics pass over ``lk`` keys: a multiple
    of STAT_STEP, at least STAT_CHUNK_ROWS and enough for at most
    MAX_STAT_CHUNKS programs a head."""
    steps_per_chunk = torch.sym_max(
        triton.cdiv(STAT_CHUNK_ROWS, STAT_STEP), triton.cdiv(triton.cdiv(lk, STAT_STEP), MAX_STAT_CHUNKS)
    )
    return STAT_STEP * steps_per_chunk


def quantize_8bit(
    k: Optional[Tensor],
    v: Optional[Tensor],
    seq_dim: int,
    tokens: Optional[Tensor] = None,
    q: Optional[Tensor] = None,
) -> tuple:
    """8-bit attention's k and v operands by Triton kernels: ``(k8, k_scale)``
    of ``reference.attention.smooth_quantize_qk`` and, with v, ``(vt8,
    v_scale)`` of :func:`fp8_values_transposed`, in three launches: the
    arrival counters zeroed, k's and v's sequence statistics (partials per
    chunk of keys, summed per head by the chunk that finishes last), then
    both quantized; each 16-bit input is read twice. Eager and traced calls
    alike. The same values as the reference up to the order of k's mean's
    sum (an fp32 ulp, which can move a rare k value to the next integer). q
    has no pass: the attention kernel rounds each program's rows per token
    as it loads them (``QUANTIZE_Q``). k None: v's alone (q and k came
    quantized from ``fused.qk_rope_int8``).

    Args:
        k, v: ``[B, Hk, Lk, D]`` (seq_dim 2) or ``[B, Lk, Hk, D]`` (1),
            fp16/bf16, unit-stride D; v None for 16-bit P V.
        tokens: ``[Lk]`` int32/int64 or None: the operands' key r is key
            ``tokens[r]`` of k and v (a permutation; block-sparse attention's
            ``token_order``).
        q: ``[B, Hq, Lq, D]`` / ``[B, Lq, Hq, D]`` with ``tokens`` and k
            (self-attention): also ``(q8, q_scale)`` first, q rounded per
            token in the same order (the attention kernel's own rounding of
            q, ``QUANTIZE_Q``, done here so that the kernel reads q whole).
    """
    with_k, with_v = k is not None, v is not None
    kv = k if with_k else v
    b, hk, lk, d = meta.attention.dims(kv, seq_dim)
    blocks = triton.cdiv(lk, reference.attention.INT8_KEY_BLOCK)
    rows_per_chunk = stat_rows_per_chunk(lk)
    chunks = triton.cdiv(lk, rows_per_chunk)
    # Per (batch, k head): a row per chunk and the head's total; k's column
    # sums and v's column amax, each only when quantized.
    k_sum, v_amax = (
        torch.empty((b * hk, chunks + 1, d), dtype=torch.float32, device=kv.device) if wanted else None
        for wanted in (with_k, with_v)
    )
    arrivals = torch.empty((b * hk,), dtype=torch.int32, device=kv.device)
    with_q = q is not None
    assert not with_q or (with_k and tokens is not None), "q is quantized here in a token order, beside k"
    k8 = k_scale = vt8 = v_scale = q8 = q_scale = None
    if with_q:
        q8 = torch.empty_like(q, dtype=torch.int8)
        q_scale = torch.empty(meta.attention.dims(q, seq_dim)[:3], dtype=torch.float32, device=q.device)
    if with_k:
        k8 = torch.empty_like(k, dtype=torch.int8)
        k_scale = torch.empty((b, hk, blocks), dtype=torch.float32, device=k.device)
    if with_v:
        # Padded to 16 keys: the padding holds keys too, in the operand order (fp8_values_transposed).
        vt8 = torch.empty((b, hk, d, lk + -lk % 16), dtype=torch.float8_e4m3fn, device=v.device)
        v_scale = torch.empty((b, hk, d), dtype=torch.float32, device=v.device)
    k_strides = bhl_strides(k, seq_dim) if with_k else (0, 0, 0)
    v_strides = bhl_strides(v, seq_dim) if with_v else (0, 0, 0)
    if lk > 0 and b * hk > 0:
        consts = dict(D=d, BLOCK_D=block_d(d), WITH_V=with_v, WITH_K=with_k)
        launcher(kv8_counters_clear_kernel)[(triton.cdiv(b * hk, 1024),)](arrivals, b * hk, BLOCK=1024)
        launcher(kv8_stats_kernel)[(chunks, b * hk)](
            k,
            v,
            k_sum,
            v_amax,
            arrivals,
            hk,
            lk,
            *k_strides,
            *v_strides,
            rows_per_chunk,
            BLOCK_L=STAT_STEP,
            **STATS_LAUNCH,
            **consts,
        )
        launcher(kv8_quantize_kernel)[(blocks, b * hk)](
            k,
            k8,
            k_scale,
            k_sum,
            v,
            vt8,
            v_amax,
            v_scale,
            tokens,
            q,
            q8,
            q_scale,
            hk,
            lk,
            chunks,
            q.shape[3 - seq_dim] // hk if with_q else 1,
            *(bhl_strides(q, seq_dim) if with_q else (0, 0, 0)),
            *(bhl_strides(q8, seq_dim) if with_q else (0, 0, 0)),
            *k_strides,
            *(bhl_strides(k8, seq_dim) if with_k else (0, 0, 0)),
            *v_strides,
            vt8.stride(2) if with_v else 0,
            BLOCK_L=reference.attention.INT8_KEY_BLOCK,
            GATHER=tokens is not None,
            WITH_Q=with_q,
            **QUANTIZE_LAUNCH,
            **consts,
        )
    q_operands = (q8, q_scale) if with_q else ()
    return q_operands + ((k8, k_scale) if with_k else ()) + ((vt8, v_scale) if with_v else ())


def fp8_operand_key_order(n: int, device=None) -> Tensor:
    """``[n]`` int64 (n a multiple of 16): the key at each position of FP8 P
    V's transposed V, ``kernels.attention_common.key_at_position``: within
    each 16 keys, position bits 1, 2, 3 are key bits 3, 1, 2. In that order
    the attention kernel's p, in the scores' accumulator layout, is the FP8
    product's register operand as it is (``fp8_operand_order``)."""
    position = torch.arange(n, device=device)
    return (position & ~14) | ((position & 2) << 2) | ((position & 12) >> 1)


def fp8_values_transposed(v: Tensor, seq_dim: int) -> tuple[Tensor, Tensor]:
    """``reference.attention.quantize_v_fp8`` of v (``[B, Hk, Lk, D]`` or
    ``[B, Lk, Hk, D]``) laid out as the FP8 P V kernel reads it: e4m3
    ``[B, Hk, D, Lk16]``, Lk rounded up to 16 (TMA's 16-byte rows) with
    zero keys, the keys in :func:`fp8_operand_key_order`, a unit position
    stride; and the channel scales ``[B, Hk, D]``. In torch ops: the
    layout's specification, which :func:`quantize_8bit`'s kernel writes,
    for the tests and benchmarks."""
    vf = v.float() if seq_dim == 2 else v.float().transpose(1, 2)
    v_scale, v_inverse = reference.attention.fp8_channel_scales(vf)
    lk = vf.shape[2]
    scaled = torch.nn.functional.pad((vf * v_inverse.unsqueeze(2)).transpose(2, 3), (0, -lk % 16))
    ordered = scaled.index_select(3, fp8_operand_key_order(scaled.shape[3], scaled.device))
    return ordered.to(torch.float8_e4m3fn).contiguous(), v_scale


def fp8_rows_scale(v_scale: Tensor) -> Tensor:
    """``reference.attention.fp8_rows_scale`` of v's channel scales ``[B, Hk,
    D]`` (contiguous fp32): ``[B]``. Traced, the reference's torch ops; run
    eagerly, one small kernel, so that the FP8-rows op's launches can be
    replayed (``_replay``: an intermediate from torch ops cannot be)."""
    if is_fake(v_scale):
        return reference.attention.fp8_rows_scale(v_scale)
    b = v_scale.shape[0]
    row_scale = torch.empty((b,), dtype=torch.float32, device=v_scale.device)
    if b > 0:
        per_batch = v_scale[0].numel()
        launcher(fp8_rows_scale_kernel)[(b,)](
            v_scale,
            row_scale,
            per_batch,
            FLOOR=reference.fp8.AMAX_FLOOR / reference.attention.FP8_MAX,
            HEADROOM=reference.attention.FP8_ROWS_HEADROOM,
            BLOCK=min(4096, triton.next_power_of_2(max(per_batch, 1))),
            num_warps=4,
        )
    return row_scale


def launch_eight_bit(
    operands: tuple,
    v: Tensor,
    out: Tensor,
    scale: float,
    causal: bool,
    seq_dim: int,
    kv_lengths: Optional[Tensor],
    out_scale: Optional[Tensor] = None,
    blocks: Optional[tuple] = None,
    lse: Optional[Tensor] = None,
    tokens: Optional[Tensor] = None,
) -> None:
    """The body the 8-bit ops share: fill ``out`` from the forward kernel.
    ``operands``: ``(q8, q_scale, k8, k_scale)`` and, for FP8 P V, ``(vt8,
    v_scale)`` (:func:`quantize_8bit`'s tuple); without the latter P V is
    16-bit, on ``v``. ``out_scale`` ``[B, Lq]`` (FP8 P V only): out is the
    e4m3 rows of ``reference.attention.attention_int8_fp8_rows``, these their
    scales. ``blocks``: block-sparse attention's lists, as ``launch_forward``
    takes them. ``lse`` ``[B, H, Lq]`` fp32: filled with the 8-bit scores'
    log-sum-exp (None: the kernel writes a scratch one). ``tokens``:
    ``launch_forward``'s (the operands made with the same ``tokens``)."""
    q8, q_scale, k8, k_scale, *v_operands = operands
    b, h, lq, _ = meta.attention.dims(q8, seq_dim)
    if lse is None:
        lse = v.new_empty((b, h, lq), dtype=torch.float32)
    if v_operands:  # FP8 P V: v transposed in e4m3, its channel scales, and the FP8 output rows
        v_input, v_scale = v_operands
        fp8_rows = None if out_scale is None else (fp8_rows_scale(v_scale), out_scale)
        pv_fp8 = dict(v_scale=v_scale, fp8_rows=fp8_rows)
    else:  # 16-bit P V reads v itself, so v takes the token order here
        v_input, pv_fp8 = unit_last_stride(v if tokens is None else v.index_select(seq_dim, tokens)), {}
    launch_forward(
        q8,
        k8,
        v_input,
        out,
        lse,
        scale,
        causal,
        seq_dim,
        kv_lengths,
        blocks,
        int8_scales=(q_scale, k_scale),
        tokens=tokens,
        **pv_fp8,
    )


def quantized_operands(
    q: Optional[Tensor], k: Optional[Tensor], v: Tensor, seq_dim: int, pv_fp8: bool, tokens: Optional[Tensor] = None
) -> tuple:
    """The 8-bit kernel's operands: q as given (16-bit, no scale: the kernel
    rounds it, ``QUANTIZE_Q``), :func:`quantize_8bit` of k and, for FP8 P V,
    v, in one pass where they share it (q and k None: they came quantized,
    and only v's operands are made). Traced too (torch.compile,
    torch.export): the Triton passes are faster than Inductor's fusion of the
    specification's torch ops (docs/notes/attention.md), and one path is
    what both modes then run. ``tokens``: :func:`quantize_8bit`'s, q
    rounded there too, in that order."""
    if q is None and not pv_fp8:
        return ()
    q, k, v = (None if t is None else unit_last_stride(t) for t in (q, k, v))
    if tokens is not None:  # q, k and v taken in the token order by one pass
        return quantize_8bit(k, v if pv_fp8 else None, seq_dim, tokens, q)
    operands = quantize_8bit(k, v if pv_fp8 else None, seq_dim)
    # q stays 16-bit, without a scale: the attention kernel rounds each program's rows itself (QUANTIZE_Q).
    return operands if q is None else (q, None) + operands
