"""Pure-PyTorch MoE routing: the implementation off-GPU and the test oracle.

Computed in fp32 (fp64 for fp64 inputs) like the kernel; the layouts, the
tie-break (lowest expert index first) and the choice for a token whose
probabilities are NaN (:func:`routing_key`) are those of
``compile_ops/meta/moe.py``.
Every step has a fixed output shape (no ``nonzero``, no ``.item()``), so the
reference traces under ``torch.compile(fullgraph=True)`` too.
"""

import torch

from compile_ops.meta import moe as meta
from compile_ops.meta._validate import accumulation_dtype


def top_k_descending(key: torch.Tensor, top_k: int) -> tuple:
    """``(values, indices)`` of the ``top_k`` largest entries of each row, largest
    first, equal values in ascending index order: a stable descending sort,
    torch.topk's order (NaN above +inf above every number above -inf) with
    the ties that torch.topk leaves unspecified going to the lowest index."""
    values, indices = torch.sort(key, dim=-1, descending=True, stable=True)
    return values[:, :top_k], indices[:, :top_k]


def routing_key(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """What each token's experts are the top k of: its probabilities, or its
    logits where its probabilities are NaN. The softmax makes a whole row NaN
    as soon as one logit is NaN or +inf (or all are -inf), which would leave
    nothing to choose by; the logits still order the experts as torch.topk on
    them does, NaN and +inf first."""
    return torch.where(probs.isnan().any(dim=-1, keepdim=True), logits, probs)


def expert_lists(experts: torch.Tensor, num_experts: int) -> tuple:
    """``(counts [E] int32, token_index [E, T] int32)`` from ``experts [T, k]``:
    each expert's tokens in ascending order, padded with T."""
    t = experts.shape[0]
    hit = torch.zeros((num_experts, t), dtype=torch.bool, device=experts.device)
    hit.scatter_(0, experts.t(), True)  # hit[e, t]: token t chose expert e
    counts = hit.sum(dim=1)
    # A stable sort of "not chosen" puts each expert's tokens first, in ascending order.
    order = torch.sort((~hit).to(torch.uint8), dim=1, stable=True).indices
    slots = torch.arange(t, device=experts.device)
    token_index = torch.where(slots[None, :] < counts[:, None], order, t)
    return counts.to(meta.INDEX_DTYPE), token_index.to(meta.INDEX_DTYPE)


def moe_route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple:
    acc = accumulation_dtype(x)
    logits = x.to(acc) @ router_weight.to(acc).t()
    probs = torch.softmax(logits, dim=-1)
    experts = top_k_descending(routing_key(logits, probs), top_k)[1]
    weights = probs.gather(1, experts)  # NaN where the probabilities are
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    counts, token_index = expert_lists(experts, router_weight.shape[0])
    return probs, weights, experts.to(meta.EXPERTS_DTYPE), counts, token_index


def logits_gradient(
    grad_probs: torch.Tensor, grad_weights: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor, renormalize: bool
) -> torch.Tensor:
    """``d loss / d logits [T, E]`` in probs' dtype.

    With ``w_j = p[e_j] / S`` and ``S = sum_j p[e_j]`` (renormalize), the
    weights send ``(g_j - sum_i g_i w_i) / S`` to ``p[e_j]``; without, ``g_j``.
    The softmax then gives ``p * (G - sum(p * G))``.
    """
    acc = probs.dtype
    g = grad_weights.to(acc)
    selected = probs.gather(1, experts)
    if renormalize:
        total = selected.sum(dim=1, keepdim=True)
        g = (g - (g * selected / total).sum(dim=1, keepdim=True)) / total
    full = grad_probs.to(acc).scatter_add(1, experts, g)
    return probs * (full - (probs * full).sum(dim=1, keepdim=True))


def moe_route_backward(
    grad_probs: torch.Tensor,
    grad_weights: torch.Tensor,
    x: torch.Tensor,
    router_weight: torch.Tensor,
    probs: torch.Tensor,
    experts: torch.Tensor,
    renormalize: bool,
) -> tuple:
    dlogits = logits_gradient(grad_probs, grad_weights, probs, experts, renormalize).to(x.dtype)
    return dlogits @ router_weight, dlogits.t() @ x
