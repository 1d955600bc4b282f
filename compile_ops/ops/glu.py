"""The gated-activation family as ``torch.ops.fused`` ops: geglu, swiglu, glu_backward.

``x [..., 2H]`` is a projection's output holding a value half and a gate half;
the ops return ``value * act(gate)`` ``[..., H]``. The backward op reads x
again (the only tensor saved) and writes ``dx [..., 2H]`` in one pass, so
neither direction materializes the halves or the activation.
"""

from dataclasses import dataclass

import triton
from torch import Tensor

from compile_ops import meta, reference
from compile_ops._library import fused_op, launcher
from compile_ops.kernels.glu import ACTIVATION_CODES, glu_kernel
from compile_ops.ops._launch import acc_dtype, as_rows, unit_last_stride

# ---------------------------------------------------------------- launch configs


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # rows per program
    block_n: int  # output columns per program
    num_warps: int


#: Output elements per program, the widest column block, and warps per program.
#: ``bench/sweeps/glu.py`` (bench/results/sweep-glu-h100.json, docs/notes/glu.md):
#: tiles from 1024 to 4096 elements with 4 or 8 warps are level at the DiT
#: shapes, 1024 with 4 warps first in every row; 8192-element tiles lose.
TILE = 1024
MAX_BLOCK_N = 1024
NUM_WARPS = 4


def launch_config(h: int) -> LaunchConfig:
    """Tiles of ``TILE`` output elements: a column block of a wide H, or
    several rows of a narrow one."""
    block_n = min(triton.next_power_of_2(max(h, 1)), MAX_BLOCK_N)
    block_m = max(1, TILE // block_n)
    return LaunchConfig(block_m, block_n, NUM_WARPS)


def _launch(x: Tensor, grad_out, out: Tensor, activation: str, gate_first: bool) -> None:
    """Forward (``grad_out`` None) into ``out [..., H]``, or backward into ``out [..., 2H]``."""
    # Rows in place for contiguous inputs and row slices (a projection's output,
    # a chunk of one); the rare channel-strided input is copied, so loads vectorize.
    x2 = unit_last_stride(as_rows(x))
    dy2 = None if grad_out is None else unit_last_stride(as_rows(grad_out))
    n_rows, two_h = x2.shape
    h = two_h // 2
    cfg = launch_config(int(h))  # a dynamic H is specialized here: BLOCK_N depends on it
    grid = (triton.cdiv(n_rows, cfg.block_m) * triton.cdiv(h, cfg.block_n),)
    launcher(glu_kernel)[grid](
        x2,
        dy2,
        out,
        n_rows,
        h,
        x2.stride(0),
        0 if dy2 is None else dy2.stride(0),
        ACT=ACTIVATION_CODES[activation],
        GATE_FIRST=gate_first,
        BACKWARD=grad_out is not None,
        ACC_DTYPE=acc_dtype(x),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
    )


# ---------------------------------------------------------------- ops


@fused_op("geglu", fake=meta.glu.geglu, reference=reference.glu.geglu)
def _geglu_op(x: Tensor, approximate: str = "none", gate_first: bool = False) -> Tensor:
    out = meta.glu.geglu(x, approximate, gate_first)
    _launch(x, None, out, meta.glu.geglu_activation(approximate), gate_first)
    return out


@fused_op("swiglu", fake=meta.glu.swiglu, reference=reference.glu.swiglu)
def _swiglu_op(x: Tensor, gate_first: bool = False) -> Tensor:
    out = meta.glu.swiglu(x, gate_first)
    _launch(x, None, out, "silu", gate_first)
    return out


@fused_op("glu_backward", fake=meta.glu.glu_backward, reference=reference.glu.glu_backward)
def _glu_backward_op(grad_out: Tensor, x: Tensor, activation: str, gate_first: bool) -> Tensor:
    dx = meta.glu.glu_backward(grad_out, x, activation, gate_first)
    _launch(x, grad_out, dx, activation, gate_first)
    return dx


def _setup_geglu(ctx, inputs, output):
    x, approximate, gate_first = inputs
    ctx.save_for_backward(x)
    ctx.args = (meta.glu.geglu_activation(approximate), gate_first)


def _setup_swiglu(ctx, inputs, output):
    x, gate_first = inputs
    ctx.save_for_backward(x)
    ctx.args = ("silu", gate_first)


def _backward_glu(ctx, grad_out):
    (x,) = ctx.saved_tensors
    dx = _glu_backward_op(grad_out, x, *ctx.args)
    return (dx,) + (None,) * (len(ctx.needs_input_grad) - 1)


_geglu_op.register_autograd(_backward_glu, setup_context=_setup_geglu)
_swiglu_op.register_autograd(_backward_glu, setup_context=_setup_swiglu)


# ---------------------------------------------------------------- public functions


def geglu(x: Tensor, approximate: str = "none", gate_first: bool = False) -> Tensor:
    """GEGLU: ``value * gelu(gate)`` of the two halves of ``x``'s last dim.

    The activation step of diffusers' ``GEGLU`` (``hidden, gate = x.chunk(2, -1);
    hidden * F.gelu(gate)``) after its projection.

    Args:
        x: ``[..., 2H]``, fp16/bf16/fp32/fp64; any leading dims and row
            strides (a channel-strided x is copied first).
        approximate: ``"none"`` (exact erf GELU, diffusers' default) or
            ``"tanh"``, as ``F.gelu`` names them.
        gate_first: False: ``[value, gate]`` (diffusers); True: ``[gate, value]``
            (vLLM's / sglang's ``GeluAndMul``).

    Returns:
        ``[..., H]`` in x's dtype, contiguous; computed in fp32 and rounded once.
    """
    meta.glu.check_options("geglu", gate_first, approximate)
    return _geglu_op(x, approximate, gate_first)


def swiglu(x: Tensor, gate_first: bool = False) -> Tensor:
    """SwiGLU: ``value * silu(gate)`` of the two halves of ``x``'s last dim.

    The activation step of diffusers' ``SwiGLU`` (HunyuanVideo's token refiner).

    Args:
        x: ``[..., 2H]``, as for :func:`geglu`.
        gate_first: False: ``[value, gate]`` (diffusers); True: ``[gate, value]``
            (vLLM's / sglang's ``SiluAndMul``, Liger's fused gate-up layout).

    Returns:
        ``[..., H]`` in x's dtype, contiguous; computed in fp32 and rounded once.
    """
    meta.glu.check_options("swiglu", gate_first)
    return _swiglu_op(x, gate_first)
