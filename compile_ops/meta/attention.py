"""Shape, dtype and layout rules of the attention family, and its validation.

Torch only: the fake implementations of ``fused.attention`` and
``fused.attention_backward``, and the launchers' allocators.

Layouts: q, k, v are ``[B, H, L, D]`` (``seq_dim=2``, SDPA's) or ``[B, L, H, D]``
(``seq_dim=1``, flash-attn's and diffusers' dispatcher's), read through their
strides. k and v share a head count that divides q's (GQA/MQA). The output has
q's shape and layout; the log-sum-exp is ``[B, H, Lq]`` fp32.
"""

from typing import Optional

import torch

from compile_ops.meta._validate import accumulation_dtype, check_same_device, fail, values_readable

#: Activation dtypes; fp32 runs with TF32 dots, fp64 exists for gradcheck.
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: The largest head dim (the tiles pad D to the next power of two).
MAX_HEAD_DIM = 256
#: Block-sparse attention's block edge, in queries and in keys: every kernel
#: tile divides it (FlexAttention's default block size too).
SPARSE_BLOCK = 128


def dims(t: torch.Tensor, seq_dim: int) -> tuple:
    """``(B, H, L, D)`` of a q/k/v tensor in either layout."""
    b, d = t.shape[0], t.shape[3]
    return (b, t.shape[1], t.shape[2], d) if seq_dim == 2 else (b, t.shape[2], t.shape[1], d)


def check_attention(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int,
    kv_lengths: Optional[torch.Tensor],
    quantized_qk: bool = False,
) -> None:
    """Shapes, dtypes, devices and options of an attention call.
    ``quantized_qk``: q and k are 8-bit attention's INT8 operands, v 16-bit."""
    if seq_dim not in (1, 2) or isinstance(seq_dim, bool):
        fail(op, f"seq_dim must be 2 ([B, H, L, D]) or 1 ([B, L, H, D]), got {seq_dim!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
        if t.dim() != 4:
            layout = "[B, H, L, D]" if seq_dim == 2 else "[B, L, H, D]"
            fail(op, f"{name} must be 4-D {layout}, got shape {tuple(t.shape)}")
        if quantized_qk:
            continue
        if t.dtype not in DTYPES:
            names = ", ".join(str(d).replace("torch.", "") for d in DTYPES)
            fail(op, f"{name} must have dtype {names}, got {t.dtype}", TypeError)
    if quantized_qk:
        for name, t in (("q", q), ("k", k)):
            if t.dtype != torch.int8:
                fail(
                    op,
                    f"{name} must be int8 (8-bit attention's quantized operand, from fused.qk_rope_int8), "
                    f"got {t.dtype}",
                    TypeError,
                )
        if v.dtype not in INT8_DTYPES:
            fail(op, f"v must be float16 or bfloat16 (the output's dtype), got {v.dtype}", TypeError)
    else:
        for name, t in (("k", k), ("v", v)):
            if t.dtype != q.dtype:
                fail(op, f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k and v must share a dtype", TypeError)
    check_same_device(op, q, "q", k=k, v=v, kv_lengths=kv_lengths)
    bq, hq, _, dq = dims(q, seq_dim)
    bk, hk, lk, dk = dims(k, seq_dim)
    bv, hv, lv, dv = dims(v, seq_dim)
    if bk != bq or bv != bq:
        fail(op, f"batch sizes differ: q {bq}, k {bk}, v {bv}")
    if dk != dq or dv != dq:
        fail(op, f"head dims differ: q {dq}, k {dk}, v {dv}; q, k and v must share D")
    if not 1 <= dq <= MAX_HEAD_DIM:
        fail(op, f"head dim D must be in [1, {MAX_HEAD_DIM}], got {dq}")
    if hv != hk or lv != lk:
        fail(op, f"k and v must have the same heads and length, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if hk == 0 or hq % hk != 0:
        fail(op, f"k/v heads ({hk}) must divide q heads ({hq}) (GQA/MQA)")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        fail(op, f"scale must be a float, got {type(scale).__name__}", TypeError)
    if not scale > 0:  # the kernels track the running max of the unscaled scores
        fail(op, f"scale must be > 0, got {scale}")
    if not isinstance(causal, bool):
        fail(op, f"causal must be a bool, got {type(causal).__name__}", TypeError)
    if kv_lengths is not None:
        if kv_lengths.dtype not in (torch.int32, torch.int64):
            fail(op, f"kv_lengths must be int32 or int64, got {kv_lengths.dtype}", TypeError)
        if tuple(kv_lengths.shape) != (bq,):
            fail(
                op,
                f"kv_lengths must have shape ({bq},) (one valid key length per batch element), "
                f"got {tuple(kv_lengths.shape)}",
            )


def check_kv_lengths_values(op: str, kv_lengths: Optional[torch.Tensor], lk) -> None:
    """Values of ``kv_lengths`` in ``[0, Lk]``, in eager calls only: reading them
    syncs with the GPU, and under tracing they are data (the kernels clamp to
    Lk and treat a length <= 0 as no keys either way)."""
    if kv_lengths is None or kv_lengths.numel() == 0 or isinstance(lk, torch.SymInt) or not values_readable(kv_lengths):
        return
    lo, hi = int(kv_lengths.min()), int(kv_lengths.max())
    if lo < 0 or hi > lk:
        fail(op, f"kv_lengths must be in [0, Lk={lk}], got values in [{lo}, {hi}]")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: out in q's shape, dtype and layout, contiguous; lse ``[B, H, Lq]`` fp32
    (fp64 for fp64 inputs)."""
    check_attention("attention", q, k, v, scale, causal, seq_dim, kv_lengths)
    check_kv_lengths_values("attention", kv_lengths, dims(k, seq_dim)[2])
    b, h, lq, _ = dims(q, seq_dim)
    return q.new_empty(q.shape), q.new_empty((b, h, lq), dtype=accumulation_dtype(q))


#: 8-bit attention takes 16-bit activations (what a DiT feeds it) and writes them.
INT8_DTYPES = (torch.float16, torch.bfloat16)
#: Keys that share one INT8 scale: one scale per key tile lets the kernel fold
#: it into the per-row factor of its scores (SageAttention quantizes K per
#: block too); the kernel's key tiles divide it.
INT8_KEY_BLOCK = 128


def int8_qk_shapes(q: torch.Tensor, k: torch.Tensor, seq_dim: int) -> tuple:
    """Empty ``(q8, q_scale [B, Hq, Lq], k8, k_scale [B, Hk, ceil(Lk /
    INT8_KEY_BLOCK)])`` of 8-bit attention's quantized q and k: the int8
    tensors in q's and k's shapes (contiguous), the scales fp32."""
    b, h, lq, _ = dims(q, seq_dim)
    hk, lk = dims(k, seq_dim)[1:3]
    return (
        q.new_empty(q.shape, dtype=torch.int8),
        q.new_empty((b, h, lq), dtype=torch.float32),
        k.new_empty(k.shape, dtype=torch.int8),
        k.new_empty((b, hk, -(-lk // INT8_KEY_BLOCK)), dtype=torch.float32),
    )


def _eight_bit(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int,
    kv_lengths: Optional[torch.Tensor],
) -> torch.Tensor:
    check_attention(op, q, k, v, scale, causal, seq_dim, kv_lengths)
    if q.dtype not in INT8_DTYPES:
        fail(
            op,
            f"q, k and v must be float16 or bfloat16 (8-bit attention quantizes 16-bit activations), got {q.dtype}",
            TypeError,
        )
    check_kv_lengths_values(op, kv_lengths, dims(k, seq_dim)[2])
    return q.new_empty(q.shape)


def attention_int8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """out in q's shape, dtype and layout, contiguous (no lse: inference only)."""
    return _eight_bit("attention_int8", q, k, v, scale, causal, seq_dim, kv_lengths)


def attention_int8_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """As :func:`attention_int8` (INT8 q k, and P V in FP8)."""
    return _eight_bit("attention_int8_fp8", q, k, v, scale, causal, seq_dim, kv_lengths)


def attention_int8_fp8_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[torch.Tensor] = None,
) -> tuple:
    """``(values [B, Lq, Hq, D] float8_e4m3fn, row_scale [B, Lq] fp32)``, contiguous,
    whatever q's layout: the rows ``[B, Lq, Hq * D]`` of an FP8 output projection."""
    _eight_bit("attention_int8_fp8_rows", q, k, v, scale, causal, seq_dim, kv_lengths)
    b, h, lq, d = dims(q, seq_dim)
    return (q.new_empty((b, lq, h, d), dtype=torch.float8_e4m3fn), q.new_empty((b, lq), dtype=torch.float32))


def attention_qk8(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[torch.Tensor] = None,
    pv_fp8: bool = False,
    fp8_rows: bool = False,
) -> tuple:
    """``(out, out_scale)`` of 8-bit attention on quantized q and k: out in
    q's shape and layout and v's dtype, out_scale empty; with ``fp8_rows``
    (which needs ``pv_fp8``), :func:`attention_int8_fp8_rows`'s e4m3 values
    ``[B, Lq, Hq, D]`` and scales ``[B, Lq]``."""
    op = "attention_qk8"
    check_attention(op, q, k, v, scale, causal, seq_dim, kv_lengths, quantized_qk=True)
    check_kv_lengths_values(op, kv_lengths, dims(k, seq_dim)[2])
    for name, flag in (("pv_fp8", pv_fp8), ("fp8_rows", fp8_rows)):
        if not isinstance(flag, bool):
            fail(op, f"{name} must be a bool, got {type(flag).__name__}", TypeError)
    if fp8_rows and not pv_fp8:
        fail(op, "fp8_rows=True (e4m3 output rows) is a mode of FP8 P V: pass pv_fp8=True too")
    _, want_q, _, want_k = int8_qk_shapes(q, k, seq_dim)
    for name, t, want in (("q_scale", q_scale, want_q), ("k_scale", k_scale, want_k)):
        if not isinstance(t, torch.Tensor):
            fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
        if tuple(t.shape) != tuple(want.shape):
            fail(
                op,
                f"{name} must have shape {tuple(want.shape)} (one scale per "
                f"{'query' if name == 'q_scale' else f'block of {INT8_KEY_BLOCK} keys'} and head), "
                f"got {tuple(t.shape)}",
            )
        if t.dtype != torch.float32:
            fail(op, f"{name} must be float32, got {t.dtype}", TypeError)
    check_same_device(op, q, "q", q_scale=q_scale, k_scale=k_scale)
    if fp8_rows:
        b, h, lq, d = dims(q, seq_dim)
        return (q.new_empty((b, lq, h, d), dtype=torch.float8_e4m3fn), q.new_empty((b, lq), dtype=torch.float32))
    return q.new_empty(q.shape, dtype=v.dtype), q.new_empty((0,), dtype=torch.float32)


def attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in q's, k's and v's shapes and dtype, contiguous."""
    op = "attention_backward"
    check_attention(op, q, k, v, scale, causal, seq_dim, kv_lengths)
    for name, t in (("grad_out", grad_out), ("out", out)):
        if tuple(t.shape) != tuple(q.shape):
            fail(op, f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
        if t.dtype != q.dtype:
            fail(op, f"{name} must have q's dtype {q.dtype}, got {t.dtype}", TypeError)
    b, h, lq, _ = dims(q, seq_dim)
    if tuple(lse.shape) != (b, h, lq):
        fail(op, f"lse must have shape {(b, h, lq)}, got {tuple(lse.shape)}")
    check_same_device(op, q, "q", grad_out=grad_out, out=out, lse=lse)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
