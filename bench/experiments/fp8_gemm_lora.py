"""Our own FP8 GEMM with a LoRA adapter's up projection in its epilogue, against cuBLAS
``torch._scaled_mm``, per Flux Linear, on a GPU (Hopper: TMA descriptors).

    PYTHONPATH=. python bench/experiments/fp8_gemm_lora.py OUT.json [--rank 64] [--rounds 3]
    TRITON_INTERPRET=1 PYTHONPATH=. python bench/experiments/fp8_gemm_lora.py --check

:data:`fp8_gemm_kernel` writes ``bf16(sx[m] sw[n] (q @ w.T)[m, n] + bias[n] + (h @ B.T)[m, n])``
from e4m3 rows ``q [M, K]`` and weight ``w [N, K]`` with fp32 row and channel scales, and
the adapter's down projection ``h [M, r]`` (bf16, already scaled) and up weight ``B [N, r]``:
the FP8 dot over K into an fp32 accumulator, the scales and bias, then one bf16 dot of h's
tile with B's over r added in fp32, one store. Tiles walk in grouped order, a program per
tile or (``persistent``) one per SM looping over them; operands load by TMA descriptors.

Per shape of Flux.1-dev's LoRA'd Linears (:data:`bench.experiments.fp8_rows_lora.SHAPES`,
random bf16 activations and weight quantized by ``quantize_fp8_rows``, an adapter of rank
``--rank``), alternated ``--rounds`` times, as CUDA-graph replays:

- ``scaled_mm``: ``torch._scaled_mm`` with rowwise scales and fast accumulation, as
  ``fp8_linear`` calls it;
- ``scaled_mm_op``: it, then ``fused.fp8_rows_lora`` (the current path: both projections);
- ``triton_persistent``: our kernel without the adapter (one program per SM);
- ``triton_persistent_lora``: the down kernel, then our kernel summing its partials in the epilogue;
  ``triton_persistent_lora_gemm`` the kernel alone, ``lora_down`` the down kernel alone;
- ``fp8_linear_lora`` (in ``fp8-gemm-lora-h100.json`` only): the package op built from this
  kernel at one fixed config (128 x 128 tiles, 4 stages, 8 warps), at commit fae65ee, reverted
  (docs/notes/fp8.md, "The adapter in the GEMM's epilogue").

Beside the times: TFLOP/s (``2MNK``, plus ``2MNr`` for the adapter's rows), each output's
relative L2 and largest difference from fp32 (the GEMM alone for rows without the adapter),
the plain kernels' largest difference from ``scaled_mm``, and the autotuner's config.
``--check``: the kernel under triton's interpreter on the CPU (pointer loads and TMA
descriptors, adapter on and off, persistent or not) against fp64, one fixed small config.
"""

import argparse
import itertools
import os
import statistics

import torch
import triton
import triton.language as tl

from bench.experiments.fp8_rows_lora import SHAPES
from bench.toolkit import graph_replay_time, make_timer, relative_l2, warm_up_gpu, write_rows
from compile_ops.kernels.fp8 import lora_down_kernel
from compile_ops.ops import fp8 as fp8_ops

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: The adapter's scale (peft's ``lora_alpha / r``).
SCALING = 0.5
#: FP8 on sm_90: 128 rows and 128 K columns a step, 128 or 256 output columns.
CONFIGS = [
    triton.Config(
        {"BLOCK_M": 128, "BLOCK_N": bn, "BLOCK_K": 128, "GROUP_M": 8, "TMA_STORE": True}, num_stages=s, num_warps=w
    )
    for bn, s, w in ((128, 3, 4), (128, 4, 4), (128, 3, 8), (128, 4, 8), (256, 3, 8), (256, 4, 8))
]
#: With the adapter: the output stored from registers, so that the 128 x 256 tiles' stages,
#: the partial sums and B's tile fit in shared memory without the store's staging tile.
LORA_CONFIGS = [
    triton.Config(
        {"BLOCK_M": 128, "BLOCK_N": bn, "BLOCK_K": 128, "GROUP_M": 8, "TMA_STORE": store}, num_stages=s, num_warps=w
    )
    for bn, s, w, store in (
        (128, 4, 8, True),
        (128, 4, 8, False),
        (128, 3, 4, False),
        (256, 2, 8, False),
        (256, 3, 8, False),
    )  # fmt: skip
]


@triton.jit
def _tile_origin(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(first row, first column)`` of ``tile`` in grouped order: GROUP_M row tiles sweep the
    columns together, so the weight tiles they share come from L2."""
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (tile // per_group) * GROUP_M
    group_m = min(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return (first_m + (tile % per_group) % group_m) * BLOCK_M, (tile % per_group) // group_m * BLOCK_N


@triton.jit
def _source(ptr, rows, cols, BR: tl.constexpr, BC: tl.constexpr, USE_TMA: tl.constexpr):
    """A row-major ``[rows, cols]`` matrix at ``ptr`` as :func:`_load` reads it: a TMA
    descriptor of ``[BR, BC]`` boxes, or the pointer itself."""
    if USE_TMA:
        src = tl.make_tensor_descriptor(ptr, shape=[rows, cols], strides=[cols, 1], block_shape=[BR, BC])
    else:
        src = ptr
    return src


@triton.jit
def _load(src, row, col, rows, cols, BR: tl.constexpr, BC: tl.constexpr, USE_TMA: tl.constexpr):
    """The ``[BR, BC]`` tile at ``(row, col)`` of :func:`_source`'s ``[rows, cols]`` matrix, zeros past its edges."""
    if USE_TMA:
        tile = src.load([row, col])  # TMA fills out-of-bounds boxes with zeros
    else:
        r = row + tl.arange(0, BR)
        c = col + tl.arange(0, BC)
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        tile = tl.load(src + r[:, None].to(tl.int64) * cols + c[None, :], mask=mask, other=0.0)
    return tile


@triton.jit
def _store(dst, value, row, col, rows, cols, BR: tl.constexpr, BC: tl.constexpr, USE_TMA: tl.constexpr):
    """``value [BR, BC]`` into :func:`_source`'s ``[rows, cols]`` matrix at ``(row, col)``, clipped at its edges."""
    if USE_TMA:
        dst.store([row, col], value)  # TMA clips the box at the tensor's bounds
    else:
        r = row + tl.arange(0, BR)
        c = col + tl.arange(0, BC)
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        tl.store(dst + r[:, None].to(tl.int64) * cols + c[None, :], value, mask=mask)


@triton.jit
def _gemm_tile(tile, q, sx_ptr, w, sw_ptr, bias_ptr, partial_ptr, splits, scaling, lora_b, out, M, N, K, R,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
               BLOCK_R: tl.constexpr, HAS_BIAS: tl.constexpr, LORA: tl.constexpr, USE_TMA: tl.constexpr,
               TMA_STORE: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_N]`` output tile: the FP8 K loop, the scales, bias and adapter, one store."""
    off_m, off_n = _tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = _load(q, off_m, k * BLOCK_K, M, K, BLOCK_M, BLOCK_K, USE_TMA)
        b = _load(w, off_n, k * BLOCK_K, N, K, BLOCK_N, BLOCK_K, USE_TMA)
        acc = tl.dot(a, b.T, acc)  # w's tile [BN, BK] transposed: the K-major B operand wgmma wants
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    sx = tl.load(sx_ptr + rows, mask=rows < M, other=0.0)
    sw = tl.load(sw_ptr + cols, mask=cols < N, other=0.0)
    acc = acc * sx[:, None] * sw[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if LORA:
        # h as fused.fp8_rows_lora's up kernel forms it: the down projection's partial sums
        # added in split order, times the row scale and the scaling in fp32, rounded once.
        ranks = tl.arange(0, BLOCK_R)
        down = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for split in range(0, splits):
            part = (split * M + rows).to(tl.int64)
            mask = (rows < M)[:, None] & (ranks < R)[None, :]
            down += tl.load(partial_ptr + part[:, None] * R + ranks[None, :], mask=mask, other=0.0)
        ht = (down * (sx * scaling)[:, None]).to(tl.bfloat16)
        bt = _load(lora_b, off_n, 0, N, R, BLOCK_N, BLOCK_R, USE_TMA)
        if INTERPRET:  # the interpreter multiplies bf16 operands as raw bits: widen them (exactly) first
            ht, bt = ht.to(tl.float32), bt.to(tl.float32)
        # A second fp32 sum added to the scaled one; triton folds the add into the dot's C operand.
        acc += tl.dot(ht, bt.T)
    _store(out, acc.to(tl.bfloat16), off_m, off_n, M, N, BLOCK_M, BLOCK_N, USE_TMA and TMA_STORE)


@triton.jit
def _fp8_gemm_kernel(q_ptr, sx_ptr, w_ptr, sw_ptr, bias_ptr, partial_ptr, splits, scaling, b_ptr, out_ptr, M, N, K,
                     R, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     BLOCK_R: tl.constexpr, HAS_BIAS: tl.constexpr, LORA: tl.constexpr, USE_TMA: tl.constexpr,
                     TMA_STORE: tl.constexpr, PERSISTENT: tl.constexpr, NUM_SMS: tl.constexpr,
                     INTERPRET: tl.constexpr):  # fmt: skip
    """``out [M, N]`` bf16 from ``q [M, K]``, ``w [N, K]`` e4m3, ``sx [M]``, ``sw [N]`` fp32, ``bias [N]``
    bf16 (``HAS_BIAS``); with ``LORA``, ``partial [splits, M, R]`` fp32 (the down projection's sums over
    slices of K, :func:`lora_down`), the adapter's ``scaling`` and ``lora_b [N, R]`` bf16 (R <= BLOCK_R)."""
    q = _source(q_ptr, M, K, BLOCK_M, BLOCK_K, USE_TMA)
    w = _source(w_ptr, N, K, BLOCK_N, BLOCK_K, USE_TMA)
    lora_b = _source(b_ptr, N, R, BLOCK_N, BLOCK_R, USE_TMA and LORA)
    out = _source(out_ptr, M, N, BLOCK_M, BLOCK_N, USE_TMA and TMA_STORE)
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    if PERSISTENT:  # one program per SM: the next tile's loads overlap this one's epilogue
        for tile in tl.range(tl.program_id(0), tiles, NUM_SMS, flatten=True):
            _gemm_tile(tile, q, sx_ptr, w, sw_ptr, bias_ptr, partial_ptr, splits, scaling, lora_b, out, M, N, K, R,
                       BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BLOCK_R, HAS_BIAS, LORA, USE_TMA, TMA_STORE,
                       INTERPRET)  # fmt: skip
    else:
        _gemm_tile(tl.program_id(0), q, sx_ptr, w, sw_ptr, bias_ptr, partial_ptr, splits, scaling, lora_b, out, M,
                   N, K, R, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BLOCK_R, HAS_BIAS, LORA, USE_TMA, TMA_STORE,
                   INTERPRET)  # fmt: skip


#: The kernel, autotuned per shape, adapter and schedule; ``fp8_gemm_kernel.fn`` is the jitted kernel.
fp8_gemm_kernel = triton.autotune(CONFIGS, key=["M", "N", "K", "PERSISTENT"])(_fp8_gemm_kernel)
fp8_gemm_lora_kernel = triton.autotune(LORA_CONFIGS, key=["M", "N", "K", "PERSISTENT"])(_fp8_gemm_kernel)


def _tma_scratch(size: int, alignment: int, stream):
    """Global memory for the descriptors the kernel builds on the device."""
    return torch.empty(size, dtype=torch.uint8, device="cuda")


def _check(name: str, t, dtype, shape) -> None:
    """Raise a ValueError naming ``name`` unless ``t`` is a contiguous tensor of ``dtype`` and ``shape``."""
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != tuple(shape) or not t.is_contiguous():
        got = type(t).__name__
        if isinstance(t, torch.Tensor):
            got = f"{t.dtype} {tuple(t.shape)}" + ("" if t.is_contiguous() else ", not contiguous")
        raise ValueError(f"fp8_gemm: {name} must be a contiguous {dtype} tensor of shape {tuple(shape)}, got {got}")


def _launch_args(q, sx, w, sw, bias, partial, lora_b, scaling: float, persistent: bool, use_tma: bool) -> tuple:
    """``(out [M, N] bf16, the kernel's arguments)`` after checking: ``q [M, K]``, ``w [N, K]``
    e4m3; ``sx [M]``, ``sw [N]`` fp32; ``bias [N]`` bf16 or None; ``partial [splits, M, R]`` fp32
    and ``lora_b [N, R]`` bf16 (both or neither, R a multiple of 16). TMA: K % 16, N % 8."""
    for name, t in (("q", q), ("w", w)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"fp8_gemm: {name} must be a 2-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
    (m, k), n = q.shape, w.shape[0]
    _check("q", q, torch.float8_e4m3fn, (m, k))
    _check("w", w, torch.float8_e4m3fn, (n, k))
    _check("sx", sx, torch.float32, (m,))
    _check("sw", sw, torch.float32, (n,))
    if bias is not None:
        _check("bias", bias, torch.bfloat16, (n,))
    if (partial is None) != (lora_b is None):
        raise ValueError("fp8_gemm: partial and lora_b come together (the adapter's down sums and up weight)")
    splits, r = (partial.shape[0], partial.shape[-1]) if isinstance(partial, torch.Tensor) and partial.dim() else (0, 0)
    if partial is not None:
        _check("partial", partial, torch.float32, (splits, m, r))
        _check("lora_b", lora_b, torch.bfloat16, (n, r))
        if r == 0 or r % 16:
            raise ValueError(f"fp8_gemm: the adapter's rank must be a positive multiple of 16 (tl.dot's K), got {r}")
    tensors = {"q": q, "sx": sx, "w": w, "sw": sw, "bias": bias, "partial": partial, "lora_b": lora_b}
    for name, t in tensors.items():
        if t is not None and t.device != q.device:
            raise ValueError(f"fp8_gemm: {name} is on {t.device}, q on {q.device}")
    if use_tma and (k % 16 or n % 8 or any(t.data_ptr() % 16 for t in (q, w, lora_b) if t is not None)):
        raise ValueError(f"fp8_gemm: TMA needs 16-byte aligned bases and rows (K % 16, N % 8), got K={k}, N={n}")
    out = torch.empty(m, n, dtype=torch.bfloat16, device=q.device)
    args = dict(q_ptr=q, sx_ptr=sx, w_ptr=w, sw_ptr=sw, bias_ptr=out if bias is None else bias)
    args.update(partial_ptr=sx if partial is None else partial, splits=splits, scaling=float(scaling))
    args.update(b_ptr=out if partial is None else lora_b, out_ptr=out, M=m, N=n, K=k, R=r)
    args.update(BLOCK_R=max(16, triton.next_power_of_2(r)), HAS_BIAS=bias is not None, LORA=partial is not None)
    return out, dict(args, USE_TMA=use_tma, PERSISTENT=persistent, INTERPRET=INTERPRET)


def _grid(m: int, n: int, persistent: bool, sms: int):
    """The launch grid of an ``[m, n]`` output under a config: a program per tile, or at most ``sms`` (persistent)."""

    def grid(meta):
        tiles = triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])
        return (min(sms, tiles) if persistent else tiles,)

    return grid


def lora_down(q, lora_a):
    """``partial [splits, M, r]`` fp32: ``fused.fp8_rows_lora``'s down kernel, launched with the
    op's own plan (``q [M, K]`` e4m3, ``lora_a [r, K]`` bf16)."""
    m, k = q.shape
    r = lora_a.shape[0]
    launch = fp8_ops.lora_launch(r, k)
    partial = torch.empty((launch.splits, m, r), dtype=torch.float32, device=q.device)
    lora_down_kernel[(triton.cdiv(m, launch.block_m), launch.splits)](
        q, lora_a, partial, m, k, launch.k_per_split, q.stride(0), q.stride(1), lora_a.stride(0), lora_a.stride(1),
        R=r, BLOCK_M=launch.block_m, BLOCK_K=fp8_ops.LORA_BLOCK_K, BLOCK_R=launch.block_r, IEEE=False, num_warps=4,
    )  # fmt: skip
    return partial


def fp8_gemm(q, sx, w, sw, bias=None, partial=None, lora_b=None, scaling: float = 1.0, persistent: bool = True):
    """``bf16(q @ w.T * sx[:, None] * sw[None, :] + bias + h @ lora_b.T)`` (``[M, N]``) on a GPU by
    TMA, autotuned, with ``h = bf16(sum(partial) * sx * scaling)``; shapes as :func:`_launch_args`."""
    if not isinstance(q, torch.Tensor) or not q.is_cuda:
        raise ValueError("fp8_gemm: q must be a CUDA tensor (--check runs the kernel on the CPU, interpreted)")
    out, args = _launch_args(q, sx, w, sw, bias, partial, lora_b, scaling, persistent, use_tma=q.is_cuda)
    triton.set_allocator(_tma_scratch)  # the descriptors are built on the device, in scratch from it
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    kernel = fp8_gemm_kernel if partial is None else fp8_gemm_lora_kernel
    kernel[_grid(args["M"], args["N"], persistent, sms)](**args, NUM_SMS=sms)
    return out


def _scaled_mm(q, sx, w, sw):
    """cuBLAS's FP8 GEMM as ``fp8_linear`` calls it: ``q [M, K]``, ``w [N, K]``, scales ``[M]``, ``[N]``."""
    return torch._scaled_mm(
        q, w.t(), scale_a=sx[:, None], scale_b=sw[None, :], out_dtype=torch.bfloat16, use_fast_accum=True
    )


def _inputs(m: int, k: int, n: int, rank: int) -> dict:
    """Rows and weight quantized from random bf16 ``x [M, K]``, ``W [N, K]``; adapter
    ``A [r, K]``, ``B [N, r]`` bf16."""
    torch.manual_seed(0)
    x = fp8_ops.quantize_fp8_rows(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    weight = fp8_ops.quantize_fp8_rows((torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16))
    lora_a = (torch.randn(rank, k, device="cuda") / k**0.5).to(torch.bfloat16)
    lora_b = (torch.randn(n, rank, device="cuda") / rank**0.5 * 0.03).to(torch.bfloat16)
    return dict(q=x.q, sx=x.scale, w=weight.q, sw=weight.scale, lora_a=lora_a, lora_b=lora_b)


def measure(rank: int, rounds: int, timer) -> list:
    """A row per shape of :data:`SHAPES`: every provider's times, rate and errors."""
    rows = []
    for name, m, k, n in SHAPES:
        t = _inputs(m, k, n, rank)
        gemm = (t["q"], t["sx"], t["w"], t["sw"])
        partial = lora_down(t["q"], t["lora_a"])
        adapter = dict(lora_b=t["lora_b"], scaling=SCALING)
        providers = {
            "scaled_mm": lambda: _scaled_mm(*gemm),
            "scaled_mm_op": lambda: fp8_ops.fp8_rows_lora(
                _scaled_mm(*gemm), t["q"], t["sx"], t["lora_a"], t["lora_b"], SCALING
            ),
            "triton_persistent": lambda: fp8_gemm(*gemm),
            "lora_down": lambda: lora_down(t["q"], t["lora_a"]),
            "triton_persistent_lora_gemm": lambda: fp8_gemm(*gemm, partial=partial, **adapter),
            "triton_persistent_lora": lambda: fp8_gemm(*gemm, partial=lora_down(t["q"], t["lora_a"]), **adapter),
        }
        x = t["q"].float() * t["sx"][:, None]
        base = (t["q"].float() @ t["w"].float().t()) * t["sx"][:, None] * t["sw"][None, :]
        full = base + ((x @ t["lora_a"].float().t()) * SCALING) @ t["lora_b"].float().t()
        row = {"name": name, "shape": [m, k, n], "rank": rank, "configs": {}}
        outs = {}
        for provider, fn in providers.items():  # compile and autotune outside the timing
            outs[provider] = fn()
            if provider.startswith("triton"):
                kernel = fp8_gemm_lora_kernel if "lora" in provider else fp8_gemm_kernel
                cfg = kernel.best_config
                row["configs"][provider] = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        times = {p: [] for p in providers}
        for _ in range(rounds):
            for provider, fn in providers.items():
                times[provider].append(1e3 * graph_replay_time(fn, timer))
        for provider, got in outs.items():
            us = statistics.median(times[provider])
            row[provider] = {"us": us, "us_min": min(times[provider]), "us_max": max(times[provider])}
            if provider == "lora_down":
                print(f"{name:16s} {provider:27s} {us:8.1f} us", flush=True)
                continue
            lora = provider.endswith(("lora", "lora_gemm", "op"))
            want = full if lora else base
            r = row[provider]
            r.update(
                TFLOPs=2 * m * n * (k + (rank if lora else 0)) / (us * 1e-6) / 1e12,
                reference="gemm+lora" if lora else "gemm",
                rel_l2=relative_l2(got, want),
                max_diff=float((got.float() - want).abs().max()),
            )
            if provider == "triton_persistent":
                r["max_diff_vs_scaled_mm"] = float((got.float() - outs["scaled_mm"].float()).abs().max())
            if provider == "triton_persistent_lora":
                r["max_diff_vs_scaled_mm_op"] = float((got.float() - outs["scaled_mm_op"].float()).abs().max())
            print(
                f"{name:16s} {provider:27s} {us:8.1f} us {r['TFLOPs']:6.0f} TFLOP/s  "
                f"rel_l2 {r['rel_l2']:.2e}  max_diff {r['max_diff']:.3g}",
                flush=True,
            )
        rows.append(row)
        del t, gemm, outs, base, full, partial
    return rows


def check() -> None:
    """The kernel under the interpreter, 32x32x32 tiles, on two shapes (one with M, N, K and r
    off the tiles, and a bias) x adapter x persistence x TMA, within one bf16 rounding of fp64;
    the interpreter casts as the GPU does through the tests' patch (tests/interpreter_casts.py)."""
    if not INTERPRET:
        raise SystemExit("--check runs the kernel under triton's interpreter: set TRITON_INTERPRET=1")
    from tests.interpreter_casts import cast_like_the_gpu

    cast_like_the_gpu()
    block = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)
    for m, k, n, r, with_bias in ((48, 96, 80, 16, False), (70, 112, 72, 48, True)):
        torch.manual_seed(0)
        q = (torch.randn(m, k) * 4).to(torch.float8_e4m3fn)
        w = (torch.randn(n, k) * 4).to(torch.float8_e4m3fn)
        sx, sw = (torch.rand(m) + 0.5) / k**0.5, (torch.rand(n) + 0.5) / 16
        bias = torch.randn(n).to(torch.bfloat16) if with_bias else None
        lora_a = (torch.randn(r, k) / k**0.5).to(torch.bfloat16)
        lora_b = (torch.randn(n, r) / r**0.5).to(torch.bfloat16)
        # The down projection's partial sums over two slices of K, added in the kernel's order.
        partial = torch.stack([q[:, c].float() @ lora_a[:, c].float().t() for c in (slice(0, 64), slice(64, k))])
        h = ((partial[0] + partial[1]) * (sx * SCALING)[:, None]).to(torch.bfloat16)
        base = (q.double() @ w.double().t()) * sx.double()[:, None] * sw.double()[None, :]
        base = base + (0 if bias is None else bias.double()[None, :])
        for lora in (False, True):
            want = base + (h.double() @ lora_b.double().t() if lora else 0)
            # Half a bf16 step of the exact value, and room for fp32's different summation order.
            tol = want.abs() * 2.0**-8 + 1e-5 * want.abs().max()
            for persistent, use_tma in itertools.product((False, True), (False, True)):
                adapter = (partial, lora_b) if lora else (None, None)
                out, args = _launch_args(q, sx, w, sw, bias, *adapter, SCALING, persistent, use_tma)
                fp8_gemm_kernel.fn[_grid(m, n, persistent, 2)](**args, NUM_SMS=2, TMA_STORE=not lora, **block)
                err = (out.double() - want).abs()
                print(
                    f"M={m} K={k} N={n} r={r} bias={with_bias} lora={lora} persistent={persistent} "
                    f"tma={use_tma}: max diff {err.max():.3g}, worst share of tolerance {(err / tol).max():.2f}",
                    flush=True,
                )
                assert bool((err <= tol).all()), "fp8_gemm_kernel differs from fp64 by more than a bf16 rounding"
    print("check passed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="the kernel under TRITON_INTERPRET=1 on the CPU")
    args = parser.parse_args()
    if args.check:
        check()
        return
    if args.out is None:
        parser.error("OUT.json is required (or --check)")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references are full fp32 products
    timer = make_timer(False)
    warm_up_gpu(5)
    with torch.no_grad():
        rows = measure(args.rank, args.rounds, timer)
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
