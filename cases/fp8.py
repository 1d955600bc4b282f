"""Inputs of the fp8 family's op, quantize_fp8_rows: plain, with an activation
(``activation``) and with a concatenated head (``head``).

An op's arguments are ``(x [..., N], *activation)`` or ``(x [..., N], activation,
head [..., M])``; ``make_*`` make a row's ``make_inputs`` (no gradient: the op
is inference only), ``*_edges`` its ``edge_inputs``.
"""

from cases._tensors import tensor


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
