"""Inputs of the fp8 family's ops: quantize_fp8_rows plain, with an activation
(``activation``) and with a concatenated head (``head``); fp8_rows_lora.

quantize_fp8_rows's arguments are ``(x [..., N], *activation)`` or ``(x [..., N],
activation, head [..., M])``; fp8_rows_lora's ``(result [..., N], q [..., K],
scale [...], lora_a [r, K], lora_b [N, r], scaling, scaling_tensor)``.
``make_*`` make a row's ``make_inputs`` (no gradient: the ops are inference
only), ``*_edges`` its ``edge_inputs``.
"""

import torch

from cases._tensors import tensor

#: The LoRA rank of fp8_rows_lora's benchmark inputs (the Flux LoRA benchmark's).
LORA_RANK = 64


def make_quantize(*activation):
    """``make_inputs`` of quantize_fp8_rows with ``activation`` (none given: the op's default)."""

    def make_inputs(shape, dtype, device, requires_grad):
        return (tensor(shape, dtype, device, False), *activation)

    return make_inputs


def quantize_edges(*activation):
    """``edge_inputs`` of quantize_fp8_rows with ``activation``: :func:`_quantize_edge_tensors`."""

    def edges(dtype, device, requires_grad):
        return [(*case, *activation) for case in _quantize_edge_tensors(dtype, device)]

    return edges


def make_quantize_concat(shape, dtype, device, requires_grad):
    """x of ``shape`` ``[B, L, C]`` through tanh-GELU, behind a head of ``[B, L, C / 4]``."""
    x = tensor(shape, dtype, device, False)
    return (x, "gelu_tanh", tensor((*shape[:-1], max(1, shape[-1] // 4)), dtype, device, False))


def quantize_concat_edges(dtype, device, requires_grad):
    """A head and an activation segment: small, the head's row strided, both
    wider than one block (held), wider than a program holds (the loop), an
    empty head, zero rows."""
    wide = tensor((2, 5000), dtype, device)
    return [
        (tensor((2, 3, 16), dtype, device), "gelu_tanh", tensor((2, 3, 8), dtype, device)),
        (tensor((4, 24), dtype, device), "none", tensor((4, 40), dtype, device)[:, 4:20]),
        (wide, "gelu_tanh", tensor((2, 4200), dtype, device)),
        (tensor((2, 13000), dtype, device), "gelu_tanh", tensor((2, 4000), dtype, device)),
        (tensor((3, 16), dtype, device), "silu", tensor((3, 0), dtype, device)),
        (tensor((0, 16), dtype, device), "gelu_tanh", tensor((0, 8), dtype, device)),
    ]


def _quantize_edge_tensors(dtype, device):
    """Rows to quantize: a DiT-like tile, a row with a large outlier and an
    all-zero row, zero rows, a row slice, 1-D, a row held in two blocks
    and one past what a program holds (the two-pass loop). Non-finite values
    are tests/test_fp8.py's: they quantize to NaN codes, and opcheck compares
    outputs without equal_nan."""
    special = tensor((4, 16), dtype, device)
    special[0, 3], special[2] = 1000.0, 0.0
    return [
        (tensor((2, 3, 16), dtype, device),),
        (special,),
        (tensor((0, 16), dtype, device),),
        (tensor((4, 40), dtype, device)[:, 4:20],),  # row stride 40
        (tensor((24,), dtype, device),),
        (tensor((2, 5000), dtype, device),),  # held in two blocks
        (tensor((2, 16384 + 37), dtype, device),),  # past MAX_ROW_VALUES: the two-pass loop
    ]


def fp8_codes(shape, device):
    """Random FP8 rows ``(q [*shape] float8_e4m3fn, scale [*shape[:-1]] fp32)``,
    built with torch alone (not by the quantize op, whose reference a cross-op
    test makes raise): codes spread over e4m3's range, scales of a DiT
    activation's rows."""
    q = torch.randn(shape, device=device).mul_(100.0).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    scale = torch.rand(shape[:-1], device=device).add_(0.5).mul_(1 / 448)
    return q, scale


def _lora_dtype(dtype):
    """The adapters' dtype beside a result of ``dtype``: its own, fp32 for fp64 (the kernels' dots take no fp64)."""
    return torch.float32 if dtype == torch.float64 else dtype


def _lora_args(lead, k, n, r, dtype, device, adapter_dtype=None, scaling=0.5, scaling_tensor=None):
    adapter_dtype = adapter_dtype or _lora_dtype(dtype)
    q, scale = fp8_codes((*lead, k), device)
    lora_a = tensor((r, k), adapter_dtype, device, scale=max(k, 1) ** -0.5)
    lora_b = tensor((n, r), adapter_dtype, device, scale=0.1)
    return (tensor((*lead, n), dtype, device), q, scale, lora_a, lora_b, scaling, scaling_tensor)


def make_rows_lora(shape, dtype, device, requires_grad):
    """A rank-LORA_RANK adapter on a square Linear over the rows of ``shape`` ``[B, L, C]``,
    its scaling a 0-dim tensor (a hotswap-ready adapter, what a compiled model passes)."""
    scaling_tensor = torch.full((), 0.5, device=device)
    return _lora_args(shape[:-1], shape[-1], shape[-1], LORA_RANK, dtype, device, None, 1.0, scaling_tensor)


def rows_lora_edges(dtype, device, requires_grad):
    """Small rows, ranks that are not a power of two, K past one split, N past one
    program's columns, a float scaling and a tensor one, adapters of another
    dtype than the result (fp16 under an fp32 result), a strided result,
    zero rows, rank 0, K = 0."""
    cases = [
        _lora_args((2, 3), 16, 24, 4, dtype, device),
        _lora_args((5,), 40, 8, 3, dtype, device, scaling_tensor=torch.full((), -1.5, device=device)),
        _lora_args((1, 7), 2100, 600, 17, dtype, device, scaling=2.0),
        _lora_args((3,), 24, 16, 8, dtype, device, adapter_dtype=torch.float16),
        _lora_args((0,), 16, 8, 4, dtype, device),
        _lora_args((4,), 16, 8, 0, dtype, device),
        _lora_args((4,), 0, 8, 4, dtype, device),
    ]
    strided = list(_lora_args((4,), 16, 8, 4, dtype, device))
    strided[0] = tensor((4, 20), dtype, device)[:, 6:14]  # row stride 20
    return [*cases, tuple(strided)]
