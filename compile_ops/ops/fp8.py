"""The fp8 family: ``fused.quantize_fp8_rows``, the FP8 GEMM of rowwise-quantized operands,
and ``fused.fp8_rows_lora``, one LoRA adapter on FP8 rows.

Inference only. An FP8 Linear has no useful gradient (the weight is not a
parameter any more, and e4m3 rounding is flat almost everywhere), so a call
that would need one raises, naming the way out, instead of training a model
through a rounding step.

Where FP8 runs is decided in one place, :func:`uses_scaled_mm`: CUDA GPUs
with FP8 tensor cores (sm_89: Ada, Hopper and newer) run the Triton
quantization and ``torch._scaled_mm``; older GPUs get an error naming their
capability; other devices run the exact reference of
``compile_ops/reference/fp8.py``, which is how CI checks a patched model.

Gradients: every public entry point (:func:`quantize_fp8_rows`,
:func:`fp8_linear`, ``FP8Linear``) refuses at the call when autograd would
record it (grad mode on and an input that requires grad), so the error comes
where the FP8 path is entered, eagerly and under ``torch.compile`` alike.
``torch.ops.fused.quantize_fp8_rows`` called directly has an autograd formula
whose backward raises the same message (without one, torch would warn and
return no gradient).
"""

from typing import NamedTuple, Optional, Union

import torch
import triton
from torch import Tensor

from compile_ops import _library, meta, reference
from compile_ops._library import fused_op, launcher, register_no_gradient
from compile_ops.kernels.fp8 import lora_down_kernel, lora_up_kernel, quantize_fp8_rows_kernel
from compile_ops.kernels.glu import ACTIVATION_CODES
from compile_ops.meta._validate import checked_arguments
from compile_ops.ops._launch import as_rows, dot_precision

#: FP8 tensor cores: sm_89 (Ada) and newer, sm_90 (Hopper) among them.
FP8_CAPABILITY = _library.FP8_MMA

#: Launch configuration, from the sweeps (bench/sweeps/fp8.py,
#: bench/results/sweep-fp8-h100-round1.json and -round2.json; figures in docs/notes/fp8.md). MAX_ROW_VALUES: a
#: program holds up to this many values (its rows padded to whole blocks) in
#: registers and reads them once, which beats the two-pass loop that wider
#: rows take, LOOP_BLOCK_N columns a step with LOOP_WARPS warps. Held rows
#: take their entry of SCHEDULES, else :func:`default_schedule`.
MAX_ROW_VALUES = 16384
CHUNK_N = 4096
TILE = 4096
VALUES_PER_THREAD = 128
ACTIVATION_VALUES_PER_THREAD = 32
MAX_WARPS = 16
LOOP_BLOCK_N = 2048
LOOP_WARPS = 4


class Schedule(NamedTuple):
    """How held rows are launched: one tile of ``block_m`` rows (a power of two)
    a program, cut in blocks of ``block_n`` columns (a power of two; the head
    and x each padded to whole blocks), ``warps`` warps. Blocks narrower than
    a warp group's reach put groups of warps on rows of their own."""

    block_m: int
    block_n: int
    warps: int


#: The held-row launch by ``(activation, head width, width)`` (activation
#: ``"none"`` or its name, head width 0 without a head), from
#: ``bench/sweeps/fp8.py``'s results; an entry holds its rows whatever their
#: width. Other shapes take :func:`default_schedule`, which the sweep found
#: fastest for every other shape it timed.
SCHEDULES: dict = {
    ("gelu_tanh", 0, 8960): Schedule(1, 2048, 8),  # Wan's MLP: narrower blocks, fewer warps
    ("gelu_tanh", 0, 12288): Schedule(1, 4096, 8),  # Flux's MLP: fewer warps
}


def _num_warps(values: int, per_thread: int) -> int:
    """Warps for a program holding ``values`` values, about ``per_thread`` a
    thread: 4 to MAX_WARPS (a power of two)."""
    return max(4, min(MAX_WARPS, triton.next_power_of_2(values) // (32 * per_thread)))


def default_schedule(activation: str, k_head: int, k: int) -> Optional[Schedule]:
    """The rule for rows without a SCHEDULES entry: blocks of CHUNK_N (narrower
    rows one block of their own power of two, several rows a tile up to TILE
    values), warps for about VALUES_PER_THREAD values a thread
    (ACTIVATION_VALUES_PER_THREAD where each costs an activation: more warps
    hide its latency; without one, fewer warps are faster); None for rows past
    MAX_ROW_VALUES (the two-pass loop). ``k_head``, ``k``: the head's and x's
    widths."""
    block_n = min(CHUNK_N, triton.next_power_of_2(max(k, k_head)))
    row_values = block_n * (triton.cdiv(k, block_n) + triton.cdiv(k_head, block_n))
    if row_values > MAX_ROW_VALUES:
        return None
    block_m = 1 << max(0, (TILE // row_values).bit_length() - 1)  # a power of two, as tl.arange needs
    per_thread = VALUES_PER_THREAD if activation == "none" else ACTIVATION_VALUES_PER_THREAD
    return Schedule(block_m, block_n, _num_warps(block_m * row_values, per_thread))


INFERENCE_ONLY = (
    "FP8 paths are inference-only (compile_ops.patch(precision='fp8'), FP8Linear): "
    "nothing can be differentiated through them; run the model under torch.inference_mode() "
    "or torch.no_grad(), or patch it without precision='fp8' to train"
)


class FP8Rows(NamedTuple):
    """Activations quantized per row: ``q [..., K]`` float8_e4m3fn and ``scale [...]``
    fp32, with ``x ~ q * scale[..., None]`` (``compile_ops/reference/fp8.py``).

    What :func:`quantize_fp8_rows` returns, and what a producing kernel's FP8
    output mode hands to :func:`fp8_linear` / ``FP8Linear`` instead of a
    bf16 tensor. A NamedTuple: ``torch.compile`` and ``torch.export`` take it
    as two tensors (pytree), and ``q, scale = rows`` unpacks it."""

    q: Tensor
    scale: Tensor

    def dequantized(self) -> Tensor:
        """``q * scale[..., None]`` in fp32, ``[..., K]``: the rows as the GEMM reads them."""
        return self.q.float() * self.scale[..., None]


def check_fp8_device(device: torch.device) -> None:
    """Raise on a CUDA device without FP8 tensor cores (below sm_89)."""
    uses_scaled_mm(device)


def uses_scaled_mm(device: torch.device) -> bool:
    """The one place that decides where FP8 runs: True on a CUDA GPU with FP8
    tensor cores (Triton quantization, ``torch._scaled_mm``), False on other
    devices (the exact reference); a RuntimeError naming the capability on a
    CUDA GPU below sm_89."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    major, minor, name = _library.cuda_capability(device.index)
    if (major, minor) < FP8_CAPABILITY:
        raise RuntimeError(
            f"compile_ops FP8: {name} is sm_{major}{minor}; "
            f"FP8 GEMMs need FP8 tensor cores (sm_89 or newer: Ada, Hopper, Blackwell). "
            "Patch without precision='fp8' on this GPU"
        )
    return True


def refuse_gradient(fn: str, *tensors: Optional[Tensor]) -> None:
    """The inference-only policy of every FP8 entry point (this family's and the
    producers' FP8 output modes): raise, naming ``fn``, when grad mode is on and
    any of ``tensors`` (None and non-tensors skipped) requires grad."""
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors):
        raise RuntimeError(f"{fn}: an input requires grad. {INFERENCE_ONLY}")


@fused_op("quantize_fp8_rows", fake=meta.fp8.quantize_fp8_rows, reference=reference.fp8.quantize_fp8_rows)
def _quantize_fp8_rows(x: Tensor, activation: str = "none", head: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    q, scale = meta.fp8.quantize_fp8_rows(x, activation, head)
    x2 = as_rows(x)
    n_rows, k = x2.shape
    # Rows by x's count: reshape(-1, 0) of an empty head is ambiguous. Without a
    # head, x again: a pointer the kernel never reads.
    head2 = x2 if head is None else head.reshape(n_rows, head.shape[-1])
    k_head = 0 if head is None else head2.shape[1]
    if n_rows == 0 or k + k_head == 0:  # nothing to launch; the reference gives the (empty or floor) scales
        return tuple(t.contiguous() for t in reference.fp8.quantize_fp8_rows(x, activation, head))
    widths = (int(k_head), int(k))
    schedule = SCHEDULES.get((activation, *widths)) or default_schedule(activation, *widths)
    looped = schedule is None
    if looped:
        schedule = Schedule(1, LOOP_BLOCK_N, LOOP_WARPS)
    block_m, block_n, warps = schedule
    # Both segments in blocks of one width (the kernel keeps one elementwise maximum).
    chunks, head_chunks = (0, 0) if looped else (triton.cdiv(widths[1], block_n), triton.cdiv(widths[0], block_n))
    grid = (triton.cdiv(n_rows, block_m),)  # one tile a program
    launcher(quantize_fp8_rows_kernel)[grid](
        x2,
        q,
        scale,
        n_rows,
        k,
        x2.stride(0),
        x2.stride(1),
        head2,
        k_head,
        head2.stride(0),
        head2.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        LOOPED=looped,
        ACT=-1 if activation == "none" else ACTIVATION_CODES[activation],
        HAS_HEAD=head is not None,
        CHUNKS=chunks,
        HEAD_CHUNKS=head_chunks,
        num_warps=warps,
    )
    return q, scale


register_no_gradient(_quantize_fp8_rows, f"fused.quantize_fp8_rows: {INFERENCE_ONLY}")


@checked_arguments
def quantize_fp8_rows(x: Tensor, activation: str = "none", head: Optional[Tensor] = None) -> FP8Rows:
    """Rowwise e4m3 quantization (``compile_ops/reference/fp8.py`` specifies it).

    Args:
        x: ``[..., K]`` fp32, fp16 or bf16 (fp64 is read as fp32); any strides.
        activation: ``"none"``, or ``"gelu"``, ``"gelu_tanh"``, ``"silu"``:
            quantize ``act(x)`` (rounded to x's dtype, as the activation would
            write it) in the same pass, for the Linear after an MLP's
            activation.
        head: ``[..., K_head]`` in x's dtype with x's leading dims, or None:
            quantize the rows of ``cat([head, act(x)], -1)`` without writing
            the concatenation (Flux's single block: the attention output and
            the MLP activation before ``proj_out``).

    Returns:
        ``FP8Rows(q, scale)``: ``q [..., K_head + K]`` float8_e4m3fn and
        ``scale [...]`` fp32, contiguous, with ``x ~ q * scale[..., None]``.

    Non-finite values (the reference's rule, so that an overflow is never
    hidden): a row holding +inf or -inf (after the activation, in the head
    or in x) gets ``scale = +inf`` and codes NaN at the infinities, +-0
    elsewhere, so ``q * scale`` and every GEMM output of the row are NaN; a
    NaN is left out of its row's scale (the other values quantize as they
    would without it) and its code is NaN. e4m3fn has no infinity, so an
    infinity becomes NaN rather than the row's largest finite value. Other
    rows are unaffected.

    Raises a RuntimeError when x requires grad under grad mode (inference only).
    """
    refuse_gradient("quantize_fp8_rows", x, head)
    meta.fp8.check_activation(activation)
    q, scale = _quantize_fp8_rows(x, activation, head)
    return FP8Rows(q, scale)


@checked_arguments
def fp8_linear(
    x: Union[Tensor, FP8Rows],
    weight_q: Tensor,
    weight_scale: Tensor,
    bias: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    fast_accum: bool = True,
) -> Tensor:
    """``x @ W.T + bias`` with x quantized per row and W per output channel.

    Args:
        x: ``[..., K]`` activations (bf16 in a DiT; fp16, fp32 too), quantized
            here by :func:`quantize_fp8_rows`; or an :class:`FP8Rows`
            ``(q [..., K] float8_e4m3fn, scale [...] fp32)`` already quantized
            (by a producing kernel's FP8 output mode).
        weight_q: ``[N, K]`` float8_e4m3fn, :func:`quantize_fp8_rows` of W.
        weight_scale: ``[N]`` fp32, its scales.
        bias: ``[N]`` or None.
        out_dtype: the output dtype; default x's dtype, bf16 for an FP8Rows x.
        fast_accum: on a GPU, ``torch._scaled_mm``'s fast accumulation (the
            tensor cores' own accumulator for the whole K loop, as torchao's
            float8 inference does by default) instead of promoting partial
            sums to fp32 every few K steps: faster, at the cost of a few low
            bits on long K (docs/notes/fp8.md). The reference (CPU) always
            sums in fp32.

    Returns:
        ``[..., N]`` (x's leading dims). On a CUDA GPU ``torch._scaled_mm``
        with rowwise scales (its rowwise mode writes bf16 and takes a bf16
        bias: an fp32 output is that bf16 result, cast); elsewhere the
        reference, summed in fp32 and cast once.

    Non-finite inputs give non-finite outputs where ``F.linear`` does: a row
    of x holding +-inf or NaN gives an output row of NaN, and a weight row
    quantized from one (an infinite ``weight_scale`` or NaN codes, as
    :func:`quantize_fp8_rows` writes them) an output column of NaN.
    ``F.linear`` gives +-inf or NaN there; FP8 gives NaN (e4m3fn has no
    infinity), never a finite value. Finite rows and columns are unaffected.
    """
    if isinstance(x, FP8Rows):
        meta.fp8.check_fp8_rows(x.q, x.scale)
        refuse_gradient("fp8_linear", x.q, x.scale)
        lead, k = x.q.shape[:-1], x.q.shape[-1]
        q, scale = x.q.reshape(-1, k), x.scale.reshape(-1)
        out_dtype = out_dtype or torch.bfloat16
        meta.fp8.check_linear(x.q, weight_q, weight_scale, bias)
    else:
        if not isinstance(x, Tensor):
            raise TypeError(f"compile_ops.fp8_linear: x must be a torch.Tensor or an FP8Rows, got {type(x).__name__}")
        refuse_gradient("fp8_linear", x)
        meta.fp8.check_linear(x, weight_q, weight_scale, bias)
        lead, k = x.shape[:-1], x.shape[-1]
        q, scale = _quantize_fp8_rows(x.reshape(-1, k))
        out_dtype = out_dtype or x.dtype
    n = weight_q.shape[0]
    if uses_scaled_mm(q.device):
        if k % 16 or n % 16:
            raise ValueError(
                f"compile_ops.fp8_linear: torch._scaled_mm needs K and N to be multiples of 16, got K={k}, N={n}"
            )
        # Row-major x, column-major W (weight_q [N, K] transposed), scales [M, 1]
        # and [1, N]: the layouts of _scaled_mm's rowwise mode. clone and
        # unsqueeze, not .contiguous() and [:, None]: those cannot be fake-traced
        # for CUDA on a CPU-only torch, which the tests do to this branch.
        q = q if q.is_contiguous() else q.clone(memory_format=torch.contiguous_format)
        scale = scale if scale.is_contiguous() else scale.clone(memory_format=torch.contiguous_format)
        out = torch._scaled_mm(
            q,
            weight_q.t(),
            scale_a=scale.unsqueeze(1),
            scale_b=weight_scale.unsqueeze(0),
            bias=None if bias is None else bias.to(torch.bfloat16),
            out_dtype=torch.bfloat16,
            use_fast_accum=fast_accum,
        )
        out = out.to(out_dtype)
    else:
        out = reference.fp8.fp8_linear(q, scale, weight_q, weight_scale, bias, out_dtype)
    return out.reshape(*lead, n)


#: Launch configuration of ``fused.fp8_rows_lora`` (docs/notes/fp8.md, "LoRA on FP8
#: models", has its sweep). The down projection's K is split in slices of about
#: LORA_SPLIT_COLUMNS columns (at most LORA_MAX_SPLITS), one program per slice and
#: tile of rows, so that a few thousand rows still fill the GPU; past LORA_LONG_K
#: columns (an MLP's down projection) in slices of LORA_LONG_SPLIT_COLUMNS, which
#: still fill it, and leave the up kernel fewer partial sums to read. The up
#: projection gives a program LORA_COLUMNS_PER_PROGRAM output columns of a row
#: tile, so that each program sums its rows' partials once for several tiles.
LORA_SPLIT_COLUMNS = 1024
LORA_LONG_K = 4096
LORA_LONG_SPLIT_COLUMNS = 2048
LORA_MAX_SPLITS = 16
LORA_BLOCK_K = 128
LORA_BLOCK_N = 64
LORA_COLUMNS_PER_PROGRAM = 512
#: The down kernel's warps, and its row tiles: LORA_MAX_ROWS rows up to rank 64, fewer for
#: wider ranks (the tile's fp32 sums held to LORA_MAX_ROWS * 64). Every row tile reads the
#: whole of A again, so the tile's height sets A's share of the kernel's traffic
#: (docs/notes/fp8.md, where it stands against its floor).
LORA_DOWN_WARPS = 4
LORA_MAX_ROWS = 64


class LoraLaunch(NamedTuple):
    """``fused.fp8_rows_lora``'s two launches for rank r, K and N: BLOCK_M rows a
    tile (fewer for wide ranks, whose ``[BLOCK_M, BLOCK_R]`` fp32 sums a program
    holds), ``splits`` slices of ``k_per_split`` columns (a multiple of
    LORA_BLOCK_K; none empty)."""

    block_m: int
    block_r: int
    splits: int
    k_per_split: int


def lora_launch(r: int, k: int) -> LoraLaunch:
    """:class:`LoraLaunch` of rank ``r`` and ``k`` input columns (channel dims only:
    no row count, so a traced graph's launch does not depend on the sequence length)."""
    block_r = max(16, triton.next_power_of_2(r))  # tl.dot takes dims of 16 and up
    block_m = max(16, min(LORA_MAX_ROWS, LORA_MAX_ROWS * 64 // block_r))
    columns = LORA_LONG_SPLIT_COLUMNS if k > LORA_LONG_K else LORA_SPLIT_COLUMNS
    splits = max(1, min(LORA_MAX_SPLITS, triton.cdiv(k, columns)))
    k_per_split = triton.cdiv(triton.cdiv(max(k, 1), splits), LORA_BLOCK_K) * LORA_BLOCK_K
    return LoraLaunch(block_m, block_r, triton.cdiv(max(k, 1), k_per_split), k_per_split)


@fused_op("fp8_rows_lora", fake=meta.fp8.fp8_rows_lora, reference=reference.fp8.fp8_rows_lora)
def _fp8_rows_lora(
    result: Tensor,
    q: Tensor,
    scale: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    scaling: float = 1.0,
    scaling_tensor: Optional[Tensor] = None,
) -> Tensor:
    out = meta.fp8.fp8_rows_lora(result, q, scale, lora_a, lora_b, scaling, scaling_tensor)
    _library.refuse_interpreted_bf16_dots("fp8_rows_lora", lora_a=lora_a)
    n, k, r = result.shape[-1], q.shape[-1], lora_a.shape[0]
    # Rows by count: reshape(-1, 0) of an empty row is ambiguous.
    n_rows = scale.numel()
    result2, q2, scale2 = result.reshape(n_rows, n), q.reshape(n_rows, k), scale.reshape(n_rows)
    if n_rows == 0 or n == 0:
        return out
    launch = lora_launch(r, k)
    ieee = lora_a.dtype == torch.float32 and dot_precision(torch.float32) == "ieee"
    partial = torch.empty((launch.splits, n_rows, r), dtype=torch.float32, device=result.device)
    row_tiles = triton.cdiv(n_rows, launch.block_m)
    launcher(lora_down_kernel)[(row_tiles, launch.splits)](
        q2,
        lora_a,
        partial,
        n_rows,
        k,
        launch.k_per_split,
        q2.stride(0),
        q2.stride(1),
        lora_a.stride(0),
        lora_a.stride(1),
        R=r,
        BLOCK_M=launch.block_m,
        BLOCK_K=LORA_BLOCK_K,
        BLOCK_R=launch.block_r,
        IEEE=ieee,
        num_warps=LORA_DOWN_WARPS,
    )
    # An int scaling would reach triton as a specialized constant: a float, always.
    scaling = float(scaling) if isinstance(scaling, int) else scaling
    launcher(lora_up_kernel)[(row_tiles, triton.cdiv(n, LORA_COLUMNS_PER_PROGRAM))](
        result2,
        out,
        partial,
        scale2,
        lora_b,
        result2 if scaling_tensor is None else scaling_tensor,  # not read without one
        scaling,
        n_rows,
        n,
        launch.splits,
        LORA_COLUMNS_PER_PROGRAM,
        result2.stride(0),
        result2.stride(1),
        scale2.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        R=r,
        BLOCK_M=launch.block_m,
        BLOCK_N=LORA_BLOCK_N,
        BLOCK_R=launch.block_r,
        HAS_SCALING_TENSOR=scaling_tensor is not None,
        IEEE=ieee,
        num_warps=4,
    )
    return out


register_no_gradient(_fp8_rows_lora, f"fused.fp8_rows_lora: {INFERENCE_ONLY}")


@checked_arguments
def fp8_rows_lora(
    result: Tensor,
    q: Tensor,
    scale: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    scaling: float = 1.0,
    scaling_tensor: Optional[Tensor] = None,
) -> Tensor:
    """``result + B(round(scaling * A(q * scale)))``: one LoRA adapter added to the
    output of an FP8 GEMM, reading the GEMM's FP8 rows (inference only).

    Args:
        result: ``[..., N]`` (bf16, fp16 or fp32; fp64 read as fp32): the FP8
            GEMM's output for these rows.
        q: ``[..., K]`` float8_e4m3fn with result's leading dims, and
        scale: ``[...]`` fp32: the rows (:class:`FP8Rows`), ``x ~ q * scale[..., None]``.
        lora_a: ``[r, K]``, the down projection's weight (peft's ``lora_A``),
            fp16, bf16 or fp32 (the adapters' dtype).
        lora_b: ``[N, r]`` in lora_a's dtype, the up projection's weight (``lora_B``).
        scaling: the adapter's scale (``lora_alpha / r``, times a weight of ``set_adapters``).
        scaling_tensor: a 0-dim floating tensor multiplying ``scaling``, or
            None: a scale that can change without recompiling a graph
            (peft's scalings of hotswap-ready adapters are such tensors).

    Returns:
        ``[..., N]`` in result's dtype, contiguous. ``A(q * scale)`` is summed in
        fp32 from the codes (the rows are never dequantized in memory), times
        the row's scale and the scaling in fp32, rounded once to the adapters'
        dtype, and ``B``'s product summed in fp32 and added to result in fp32
        before the one rounding to result's dtype:
        ``compile_ops/reference/fp8.py`` (``fp8_rows_lora``) specifies each rounding.

    Non-finite values: a row with a NaN code or a NaN scale gives a NaN output
    row (rows that :func:`quantize_fp8_rows` wrote from +-inf hold NaN codes);
    NaN and +-inf in result stay where they are.

    Raises a RuntimeError when an input requires grad under grad mode (inference only).
    """
    refuse_gradient("fp8_rows_lora", result, q, scale, lora_a, lora_b, scaling_tensor)
    return _fp8_rows_lora(result, q, scale, lora_a, lora_b, scaling, scaling_tensor)
