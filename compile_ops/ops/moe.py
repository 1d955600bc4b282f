"""The MoE routing family as ``torch.ops.fused`` ops: moe_route and moe_route_backward.

``fused.moe_route`` runs the router product, the fp32 softmax and the top-k
in one kernel (a wide router's product in slices of H, in a launch before)
and the per-expert counts and token lists in a second one (``kernels/moe.py``
says why); ``fused.moe_route_backward`` turns the
gradients of the probabilities and routing weights into ``d logits`` in one
kernel and multiplies it with the router weight and x in torch (two GEMMs
that cuBLAS runs at its speed). Layouts: ``compile_ops/meta/moe.py``.
"""

from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from compile_ops import meta, reference
from compile_ops._library import fused_op, launcher, refuse_interpreted_bf16_dots
from compile_ops.kernels.moe import (
    moe_route_backward_kernel,
    moe_route_kernel,
    moe_router_logits_kernel,
    moe_token_lists_kernel,
)
from compile_ops.ops._launch import TRITON_DTYPES, acc_dtype, dot_precision, unit_last_stride

# ---------------------------------------------------------------- launch configs


@dataclass(frozen=True)
class LaunchConfig:
    block_t: int  # tokens per routing (and token-list) program
    block_e: int  # experts held per row (E padded to a power of 2, at least tl.dot's 16)
    block_h: int  # hidden columns per tl.dot step
    num_warps: int
    num_stages: int
    #: 0: the routing kernel computes its logits; else H is cut into this many
    #: slices, whose partial logits a first launch writes (the logits_* fields).
    split: int = 0
    logits_block_t: int = 0
    logits_num_warps: int = 0
    logits_num_stages: int = 0


#: The routing kernel's launch config when it computes its logits (narrow
#: routers: HiDream's E = 4). bench/sweeps/moe.py sweeps these globals. 32
#: tokens per program give 128 programs at T = 4096, about one per SM;
#: ROUTE_BLOCK_H is in 16-bit columns (fp32 takes half as many, fp64 a
#: quarter: the same bytes per pipeline stage). 5 stages are the sweep's best
#: at HiDream's 4096 x 2560 (docs/notes/moe.md, "The routing kernel's pipeline stages").
ROUTE_BLOCK_T = 32
ROUTE_BLOCK_H = 128
ROUTE_NUM_WARPS = 4
ROUTE_NUM_STAGES = 5
#: Wide routers (router weight of at least SPLIT_MIN_WEIGHT_BYTES) cut H into
#: slices of SPLIT_COLUMNS: each of the first launch's programs reads
#: LOGITS_BLOCK_T tokens' slice of x and the weight's slice once (see
#: kernels/moe.py for why); the routing kernel then sums the slices for
#: ROUTE_SPLIT_BLOCK_T tokens a program.
SPLIT_MIN_WEIGHT_BYTES = 128 * 1024
SPLIT_COLUMNS = 1024
LOGITS_BLOCK_T = 128
LOGITS_NUM_WARPS = 8
LOGITS_NUM_STAGES = 3
ROUTE_SPLIT_BLOCK_T = 32
#: Blocks' counts summed at a time by the token-list programs.
COUNT_CHUNK = 64
#: Rows per program of the backward's elementwise kernel.
BACKWARD_BLOCK_T = 32


def launch_config(e: int, h: int, dtype: torch.dtype) -> LaunchConfig:
    """The routing kernels' config for E experts of width H in ``dtype``: past
    64 experts half the H chunk and 2 stages, so that the pipelined stages of
    the router weight tile fit in shared memory."""
    block_e = max(16, triton.next_power_of_2(e))
    block_h = max(16, ROUTE_BLOCK_H * 2 // dtype.itemsize)  # the same bytes per stage in every dtype
    wide = block_e > 64
    if wide:
        # Not below tl.dot's K of 16: a config with a narrow ROUTE_BLOCK_H (the
        # tests' wide-router override, 32 columns) gave fp32 and fp64 chunks of
        # 8, which the interpreter runs and the GPU's compiler rejects.
        block_h = max(16, block_h // 2)
    split = triton.cdiv(h, SPLIT_COLUMNS) if e * h * dtype.itemsize >= SPLIT_MIN_WEIGHT_BYTES else 1
    if split > 1:
        return LaunchConfig(
            ROUTE_SPLIT_BLOCK_T,
            block_e,
            block_h,
            num_warps=4,
            num_stages=1,
            split=split,
            logits_block_t=LOGITS_BLOCK_T if not wide else LOGITS_BLOCK_T // 2,
            logits_num_warps=LOGITS_NUM_WARPS,
            logits_num_stages=2 if wide else LOGITS_NUM_STAGES,
        )
    return LaunchConfig(
        ROUTE_BLOCK_T, block_e, block_h, num_warps=ROUTE_NUM_WARPS, num_stages=2 if wide else ROUTE_NUM_STAGES
    )


def _launch_route(x: Tensor, w: Tensor, top_k: int, renormalize: bool, outs: tuple) -> None:
    refuse_interpreted_bf16_dots("moe_route", x=x, router_weight=w)
    probs, weights, experts, counts, token_index = outs
    n_tokens, h = x.shape
    e = w.shape[0]
    # Dynamic E and H are specialized here: BLOCK_E and the split depend on them.
    cfg = launch_config(int(e), int(h), x.dtype)
    block_k = triton.next_power_of_2(top_k)
    acc = acc_dtype(x)
    partial = None
    if cfg.split:
        h_per_split = triton.cdiv(triton.cdiv(h, cfg.split), cfg.block_h) * cfg.block_h
        split = triton.cdiv(h, h_per_split)
        partial = x.new_empty((split, n_tokens, e), dtype=probs.dtype)
        launcher(moe_router_logits_kernel)[(triton.cdiv(n_tokens, cfg.logits_block_t), split)](
            x,
            w,
            partial,
            n_tokens,
            h,
            e,
            x.stride(0),
            w.stride(0),
            h_per_split,
            DOT_PRECISION=dot_precision(x.dtype),
            ACC_DTYPE=acc,
            BLOCK_T=cfg.logits_block_t,
            BLOCK_E=cfg.block_e,
            BLOCK_H=cfg.block_h,
            num_warps=cfg.logits_num_warps,
            num_stages=cfg.logits_num_stages,
        )
    n_blocks = triton.cdiv(n_tokens, cfg.block_t)
    block_counts = x.new_empty((n_blocks, e), dtype=torch.int32)
    launcher(moe_route_kernel)[(n_blocks,)](
        x,
        w,
        partial,
        probs,
        weights,
        experts,
        block_counts,
        n_tokens,
        h,
        e,
        x.stride(0),
        w.stride(0),
        TOP_K=top_k,
        BLOCK_K=block_k,
        RENORMALIZE=renormalize,
        DOT_PRECISION=dot_precision(x.dtype),
        ACC_DTYPE=acc,
        SPLIT=0 if partial is None else partial.shape[0],
        BLOCK_T=cfg.block_t,
        BLOCK_E=cfg.block_e,
        BLOCK_H=cfg.block_h,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    launcher(moe_token_lists_kernel)[(n_blocks,)](
        experts,
        block_counts,
        counts,
        token_index,
        n_tokens,
        n_blocks,
        e,
        TOP_K=top_k,
        BLOCK_K=block_k,
        BLOCK_T=cfg.block_t,
        BLOCK_E=cfg.block_e,
        COUNT_CHUNK=COUNT_CHUNK,
        num_warps=4,
    )


# ---------------------------------------------------------------- ops


@fused_op("moe_route", fake=meta.moe.moe_route, reference=reference.moe.moe_route)
def _moe_route_op(
    x: Tensor, router_weight: Tensor, top_k: int, renormalize: bool = True
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    outs = meta.moe.moe_route(x, router_weight, top_k, renormalize)
    if x.shape[0] > 0:
        _launch_route(unit_last_stride(x), unit_last_stride(router_weight), top_k, renormalize, outs)
    else:  # no tokens: nothing routed, and no program would write the counts
        outs[3].zero_()
    return outs


@fused_op("moe_route_backward", fake=meta.moe.moe_route_backward, reference=reference.moe.moe_route_backward)
def _moe_route_backward_op(
    grad_probs: Tensor,
    grad_weights: Tensor,
    x: Tensor,
    router_weight: Tensor,
    probs: Tensor,
    experts: Tensor,
    renormalize: bool,
) -> tuple[Tensor, Tensor]:
    meta.moe.moe_route_backward(grad_probs, grad_weights, x, router_weight, probs, experts, renormalize)
    n_tokens, e = probs.shape
    dlogits = probs.new_empty((n_tokens, e))
    if n_tokens > 0:
        launcher(moe_route_backward_kernel)[(triton.cdiv(n_tokens, BACKWARD_BLOCK_T),)](
            grad_probs,
            grad_weights,
            probs,
            experts,
            dlogits,
            n_tokens,
            e,
            grad_probs.stride(0),
            grad_probs.stride(1),
            grad_weights.stride(0),
            grad_weights.stride(1),
            TOP_K=experts.shape[1],
            RENORMALIZE=renormalize,
            ACC_DTYPE=TRITON_DTYPES[probs.dtype],
            BLOCK_T=BACKWARD_BLOCK_T,
            BLOCK_E=max(16, triton.next_power_of_2(int(e))),
            num_warps=4,
        )
    # The two products in the inputs' dtype (cuBLAS, fp32 accumulation), as
    # the gradient of torch's F.linear would be computed.
    dlogits = dlogits.to(x.dtype)
    return dlogits @ router_weight, dlogits.t() @ x


def _setup_moe_route(ctx, inputs, output):
    x, router_weight, top_k, renormalize = inputs
    probs, _, experts, counts, token_index = output
    ctx.mark_non_differentiable(experts, counts, token_index)
    # probs [T, E] and experts [T, k] are all the backward needs besides the
    # inputs of the two products: no logits are kept.
    ctx.save_for_backward(x, router_weight, probs, experts)
    ctx.renormalize = renormalize


def _backward_moe_route(ctx, grad_probs, grad_weights, _grad_experts, _grad_counts, _grad_index):
    x, router_weight, probs, experts = ctx.saved_tensors
    if grad_probs is None:
        grad_probs = torch.zeros_like(probs)
    if grad_weights is None:
        grad_weights = probs.new_zeros(experts.shape)
    dx, dw = _moe_route_backward_op(grad_probs, grad_weights, x, router_weight, probs, experts, ctx.renormalize)
    return dx, dw, None, None


_moe_route_op.register_autograd(_backward_moe_route, setup_context=_setup_moe_route)


# ---------------------------------------------------------------- public function


def moe_route(x: Tensor, router_weight: Tensor, top_k: int, renormalize: bool = True) -> tuple:
    """Mixture-of-experts routing in one op: router logits, fp32 softmax, top-k,
    per-expert counts and token lists.

    Args:
        x: ``[T, H]`` tokens (fp16/bf16/fp32/fp64), any row stride.
        router_weight: ``[E, H]``, x's dtype; ``1 <= E <= meta.moe.MAX_EXPERTS`` (256).
            The logits are ``x @ router_weight.T`` (``nn.Linear(H, E, bias=False)``'s weight).
        top_k: experts per token, ``1 <= top_k <= E``.
        renormalize: divide the k chosen probabilities by their sum, so that
            each token's routing weights sum to 1 (Mixtral, Qwen-MoE's
            ``norm_topk_prob``); False keeps the softmax probabilities as they
            are (HiDream-I1's gate, DeepSeek-V2).

    Returns:
        ``(probs, weights, experts, counts, token_index)``:

        - ``probs [T, E]`` fp32 (fp64 for fp64 inputs): the softmax of the logits;
        - ``weights [T, top_k]``, probs' dtype: the chosen probabilities,
          largest first (renormalized if asked);
        - ``experts [T, top_k]`` int64: the chosen experts in the same order;
          equal probabilities go to the lowest expert index first;
        - ``counts [E]`` int32: tokens per expert (they sum to ``T * top_k``);
        - ``token_index [E, T]`` int32: row e holds the tokens routed to expert
          e in ascending order in its first ``counts[e]`` entries, then ``T``.

        ``probs`` and ``weights`` are differentiable with respect to x and
        router_weight; the three integer outputs are not. Results are the same
        bits on every run (no atomics).

    Non-finite tokens: a NaN or +-inf in a token makes its logits NaN or
    +-inf (one in the router weight, that expert's logit of every token), and
    the softmax gives a token's whole row NaN as soon as one logit is NaN or
    +inf (or all are -inf). Such a token
    chooses the top k of its logits, in ``torch.topk``'s order on them: NaN
    first, then +inf, the numbers in descending order, -inf last; equal
    logits (NaNs among them) go to the lowest expert index first, an order
    torch.topk leaves unspecified. Its ``probs`` and ``weights`` are NaN, so
    that the NaN reaches the MoE output instead of a finite weight made from
    it. A token whose probabilities are finite (a -inf logit gives its
    expert probability 0) routes by them as above; the other tokens are
    unaffected.
    """
    meta.moe.check_options("moe_route", top_k, renormalize)
    return _moe_route_op(x, router_weight, top_k, renormalize)
