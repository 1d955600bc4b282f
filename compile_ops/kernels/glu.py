"""Triton kernel of the gated-activation family: GEGLU and SwiGLU, forward and backward.

``x [rows, 2H]`` holds a value half and a gate half; the forward writes
``value * act(gate)`` ``[rows, H]``, the backward reads ``dy [rows, H]`` and x
again and writes ``dx [rows, 2H]``: ``dvalue = dy * act(gate)``,
``dgate = dy * value * act'(gate)``. One kernel serves both directions and all
activations (constexpr ``BACKWARD`` and ``ACT``); which half is the gate is
the constexpr ``GATE_FIRST`` (diffusers: value first; vLLM/sglang: gate first).

Each program owns a ``[BLOCK_M, BLOCK_N]`` tile of the H output columns: one
row block of a wide H (the DiT case, H = 12288), several rows of a narrow one.
Row offsets are int64 (tensors past 2**31 elements); the launcher hands in
rows with a unit column stride, so loads vectorize.

The activations are written with what both the compiler and triton's
interpreter support (``tl.erf``, ``tl.exp``; no libdevice), and inline PTX
where compiled (``PTX``). The backward's derivatives never cancel: the
sigmoid and its complement both come from ``exp(-|z|) <= 1`` and a correctly
rounded reciprocal. The forward needs the sigmoid alone and takes the cheap
form ``1 / (1 + 2^z2)``, compiled to one ``ex2.approx.ftz`` and one
``rcp.approx.ftz`` (a few ulps of fp32): the rowwise FP8 quantization of an
MLP's hidden activation computes it for every element and is bound by its
instruction count, not by memory, where the plain exp and division each
bring a range fix-up (docs/notes/fp8.md).
"""

import os

import triton
import triton.language as tl

#: ``ACT`` values; ``ops/glu.py`` maps the public names onto them. The kernels
#: compare with the literals: Inductor's copy of a user kernel does not carry
#: module globals along.
GELU, GELU_TANH, SILU = 0, 1, 2
#: The ``ACT`` constexpr of each activation name (``meta.glu.ACTIVATIONS``).
ACTIVATION_CODES = {"gelu": GELU, "gelu_tanh": GELU_TANH, "silu": SILU}
#: Kernels compile to PTX (not run by triton's interpreter, which has no inline
#: assembly); read at import, as ``triton.jit`` reads TRITON_INTERPRET.
PTX: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")
#: ``-2 sqrt(2/pi) log2(e)`` and 0.044715 times it: tanh GELU's sigmoid argument
#: in base 2, ``z2 = g (C1 + C3 g^2)``, so that ``sigmoid(2u) = 1 / (1 + 2^z2)``.
_GELU_TANH_C1: tl.constexpr = tl.constexpr(-2.0 * 0.7978845608028654 * 1.4426950408889634)
_GELU_TANH_C3: tl.constexpr = tl.constexpr(-2.0 * 0.7978845608028654 * 1.4426950408889634 * 0.044715)


@triton.jit
def _reciprocal(v):
    # triton's fp32 `/` is approximate (2 ulps); div_rn rounds correctly.
    if v.dtype == tl.float64:
        return 1.0 / v
    else:
        return tl.div_rn(tl.full(v.shape, 1.0, v.dtype), v)


@triton.jit
def _sigmoid_and_complement(z):
    """``(sigmoid(z), 1 - sigmoid(z))`` without cancellation or overflow."""
    t = tl.exp(-tl.abs(z))
    r = _reciprocal(1.0 + t)
    tr = t * r
    positive = z >= 0
    return tl.where(positive, r, tr), tl.where(positive, tr, r)


@triton.jit
def _ptx_unary(instruction: tl.constexpr, x):
    """One fp32 PTX instruction ``instruction`` (``$0``: the result, ``$1``: x) applied to each element of x."""
    return tl.inline_asm_elementwise(instruction, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _sigmoid_base2(z2):
    """``1 / (1 + 2^z2)`` (``z2 = -z log2(e)`` for ``sigmoid(z)``): 0 and 1 exactly
    where the power over- or underflows, NaN for NaN. Under PTX two MUFU
    instructions, flushing denormals (a flushed power adds nothing to 1):
    the plain exp and division take each a range fix-up of several
    instructions, and the activations that feed an FP8 quantization are
    bound by their instruction count (docs/notes/fp8.md)."""
    if PTX:
        power = _ptx_unary("ex2.approx.ftz.f32 $0, $1;", z2)
        return _ptx_unary("rcp.approx.ftz.f32 $0, $1;", 1.0 + power)
    else:
        return 1.0 / (1.0 + tl.math.exp2(z2))


@triton.jit
def activation(g, ACT: tl.constexpr, DERIVATIVE: tl.constexpr):
    """``(act(g), act'(g))``; the derivative is ``g`` (unused) unless DERIVATIVE.

    GELU:      g * Phi(g), Phi(g) = (1 + erf(g / sqrt 2)) / 2;  act' = Phi(g) + g * phi(g)
    GELU_TANH: g * s, s = sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3)
               (that is 0.5 g (1 + tanh u));  act' = s + 2 g s (1 - s) u'
    SILU:      g * s, s = sigmoid(g);  act' = s (1 + g (1 - s))
    """
    if ACT == 0:  # GELU
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))  # 1 / sqrt(2)
        act = g * cdf
        d = g
        if DERIVATIVE:
            d = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327  # 1 / sqrt(2 pi)
    elif ACT == 1:  # GELU_TANH
        g2 = g * g
        d = g
        if DERIVATIVE:
            # 2u; 0.7978845608028654 = sqrt(2 / pi)
            z = 2.0 * 0.7978845608028654 * (g + 0.044715 * g2 * g)
            s, s_c = _sigmoid_and_complement(z)
            du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g2)
            d = s + 2.0 * g * s * s_c * du
        else:
            s = _sigmoid_base2(g * (_GELU_TANH_C1 + _GELU_TANH_C3 * g2))
        act = g * s
    else:
        d = g
        if DERIVATIVE:
            s, s_c = _sigmoid_and_complement(g)
            d = s * (1.0 + g * s_c)
        else:
            s = _sigmoid_base2(g * -1.4426950408889634)  # -log2(e)
        act = g * s
    return act, d


@triton.jit
def glu_kernel(
    X,
    DY,
    OUT,
    n_rows,
    H,
    stride_x_row,
    stride_dy_row,
    ACT: tl.constexpr,
    GATE_FIRST: tl.constexpr,
    BACKWARD: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Forward: ``OUT [rows, H] = value * act(gate)``. Backward: ``OUT [rows, 2H] =
    dx`` from ``DY [rows, H]``. OUT is contiguous; X and DY have unit column stride."""
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(H, BLOCK_N)
    row_block = pid // col_blocks
    rows = tl.cast(row_block, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid - row_block * col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < H)[None, :]
    # Where each half starts within a row.
    value_col = H if GATE_FIRST else 0
    gate_col = 0 if GATE_FIRST else H

    x_tile = X + rows[:, None] * stride_x_row + cols[None, :]
    value = tl.load(x_tile + value_col, mask=mask, other=0.0).to(ACC_DTYPE)
    gate = tl.load(x_tile + gate_col, mask=mask, other=0.0).to(ACC_DTYPE)
    act, dact = activation(gate, ACT, BACKWARD)
    if BACKWARD:
        dy = tl.load(DY + rows[:, None] * stride_dy_row + cols[None, :], mask=mask, other=0.0).to(ACC_DTYPE)
        dx_tile = OUT + rows[:, None] * (2 * H) + cols[None, :]
        tl.store(dx_tile + value_col, (dy * act).to(OUT.dtype.element_ty), mask=mask)
        tl.store(dx_tile + gate_col, (dy * value * dact).to(OUT.dtype.element_ty), mask=mask)
    else:
        tl.store(OUT + rows[:, None] * H + cols[None, :], (value * act).to(OUT.dtype.element_ty), mask=mask)
