"""The RoPE family as ``torch.ops.fused`` ops: ``fused.rope``.

The backward of a rotation is its transpose, which is the same op with
``inverse`` flipped, so ``fused.rope`` is its own backward op.
"""
from typing import Optional

import triton
from torch import Tensor

from compile_ops import meta, reference
from compile_ops._library import fused_op, launcher
from compile_ops.kernels.rope import rope_kernel

#: Elements of x per program (rows x pairs x 2).
TILE = 4096


@fused_op("rope", fake=meta.rope.rope, reference=reference.rope.rope)
def _rope_op(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, seq_dim: int,
             rotary_dim: Optional[int] = None, inverse: bool = False) -> Tensor:
    out = meta.rope.rope(x, cos, sin, interleaved, seq_dim, rotary_dim, inverse)
    r, half = meta.rope.table_layout(x, cos, rotary_dim)
    r = int(r)  # a constexpr: a head dim made dynamic is specialized here
    B, N1, N2, D = x.shape
    n_rows = B * N1 * N2
    block_p = triton.next_power_of_2(r // 2)
    tail = D - r
    block_m = max(1, min(64, TILE // triton.next_power_of_2(D)))
    per_batch = cos.dim() == 3 and cos.shape[0] > 1
    cos, sin = cos.contiguous(), sin.contiguous()
    launcher(rope_kernel)[(triton.cdiv(n_rows, block_m),)](
        x, cos, sin, out,
        n_rows, N1, N2, D,
        x.stride(0), x.stride(1), x.stride(2), x.stride(3),
        cos.stride(0) if per_batch else 0, cos.stride(-2),
        R=r, SEQ_DIM=seq_dim, INTERLEAVED=interleaved, HALF_TABLE=half, INVERSE=inverse,
        BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_T=triton.next_power_of_2(tail) if tail else 0,
        num_warps=4,
    )
    return out


def _setup_rope(ctx, inputs, output):
    x, cos, sin, interleaved, seq_dim, rotary_dim, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.args = (interleaved, seq_dim, rotary_dim, not inverse)


def _backward_rope(ctx, grad):
    cos, sin = ctx.saved_tensors
    interleaved, seq_dim, rotary_dim, inverse = ctx.args
    return _rope_op(grad, cos, sin, interleaved, seq_dim, rotary_dim, inverse), None, None, None, None, None, None


_rope_op.register_autograd(_backward_rope, setup_context=_setup_rope)


def rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False, seq_dim: int = 2,
         rotary_dim: Optional[int] = None) -> Tensor:
    """Rotary position embedding, as diffusers' ``apply_rotary_emb(x, (cos, sin), use_real=True)``.

    Args:
        x: ``[B, H, L, D]`` (``seq_dim=2``, the default) or ``[B, L, H, D]``
            (``seq_dim=1``), fp16/bf16/fp32/fp64, any strides.
        cos, sin: ``[L, T]`` or ``[B, L, T]``; ``T = rotary_dim`` (diffusers'
            full tables) or ``rotary_dim / 2`` (one angle per pair). Read in fp32.
        interleaved: pairs ``(2i, 2i + 1)`` (``use_real_unbind_dim=-1``: Flux,
            CogVideoX, HunyuanVideo); False: ``(i, i + R/2)`` (``-2``).
        seq_dim: the position dim of x, 1 or 2.
        rotary_dim: channels rotated (even, default D); the rest pass through.

    Returns:
        x's shape and dtype, contiguous; computed in fp32 and rounded once.
    """
    return _rope_op(x, cos, sin, interleaved, seq_dim, rotary_dim, False)
