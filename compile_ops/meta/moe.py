"""Shape, dtype and argument rules of the MoE routing family, and its validation.

Torch only: these are the fake implementations of ``fused.moe_route`` and
``fused.moe_route_backward`` and allocate the launchers' outputs.

Output layout of ``fused.moe_route(x [T, H], router_weight [E, H], top_k, renormalize)``:

- ``probs [T, E]``: softmax of the router logits ``x @ router_weight.T``,
  computed and stored in fp32 (fp64 for fp64 inputs, for gradcheck);
- ``weights [T, k]``: the top-k probabilities in descending order (same
  dtype as probs), divided by their sum when ``renormalize``;
- ``experts [T, k]`` int64 (``torch.topk``'s index dtype, so that it feeds
  ``gather``/``scatter`` as is): the chosen experts, most probable first;
  equal probabilities go to the LOWEST expert index first. A token whose
  probabilities are NaN (the softmax gives a whole row NaN once a logit is
  NaN or +inf, or all are -inf: a NaN or inf in x or the router weight)
  chooses by its logits instead, in torch.topk's order on them: NaN first,
  then +inf, the numbers in descending order, -inf last, equal logits
  (NaNs among them) to the lowest expert index first. Its weights are NaN;
- ``counts [E]`` int32: tokens routed to each expert (``sum(counts) == T * k``);
- ``token_index [E, T]`` int32: row e lists the ids of the tokens routed to
  expert e in ascending order in its first ``counts[e]`` entries; the rest of
  the row holds ``T`` (one past the last token), so that a gather from x
  padded with one zero row reads zeros there and an ``index_add`` into a
  ``[T + 1, ...]`` buffer drops them in the pad row. int32 (and for counts):
  half the bytes of int64, and what ``torch._grouped_mm``'s offsets take;
  ``index_select``/``index_add``/indexing accept it as an index.
"""

import torch

from compile_ops.meta._validate import accumulation_dtype, check_floating, check_same_device, fail

#: The most experts the routing kernel holds in one program's registers (one
#: row of logits per token); more would spill. DiT MoEs use 4 (HiDream-I1) to 64.
MAX_EXPERTS = 256
#: Integer dtypes of the index outputs (see the module docstring).
EXPERTS_DTYPE = torch.int64
INDEX_DTYPE = torch.int32


def check_top_k(op: str, top_k, num_experts: int) -> None:
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        fail(op, f"top_k must be an int, got {type(top_k).__name__}", TypeError)
    if not 1 <= top_k <= num_experts:
        fail(op, f"top_k must be in [1, E] = [1, {num_experts}] (E: router_weight.shape[0]), got {top_k}")


def check_renormalize(op: str, renormalize) -> None:
    if not isinstance(renormalize, bool):
        fail(op, f"renormalize must be a bool, got {type(renormalize).__name__}", TypeError)


def check_options(op: str, top_k, renormalize) -> None:
    """The non-tensor arguments' types. The public function checks them before
    the dispatcher would, so that a wrong type gets this message on every path
    (the dispatcher reads ``renormalize=1`` as True and rejects a float
    ``top_k`` in its own words)."""
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        fail(op, f"top_k must be an int, got {type(top_k).__name__}", TypeError)
    check_renormalize(op, renormalize)


def check_router_inputs(op: str, x: torch.Tensor, router_weight: torch.Tensor) -> tuple:
    """Validate ``x [T, H]`` and ``router_weight [E, H]``; returns ``(T, H, E)``."""
    check_floating(op, "x", x)
    check_floating(op, "router_weight", router_weight)
    if x.dim() != 2:
        fail(op, f"x must be 2-D [T, H] (tokens, hidden), got shape {tuple(x.shape)}")
    if router_weight.dim() != 2:
        fail(op, f"router_weight must be 2-D [E, H] (experts, hidden), got shape {tuple(router_weight.shape)}")
    if router_weight.dtype != x.dtype:
        fail(op, f"router_weight must have x's dtype {x.dtype}, got {router_weight.dtype}", TypeError)
    t, h = x.shape
    e = router_weight.shape[0]
    if router_weight.shape[1] != h:
        fail(op, f"router_weight must have shape [E, {h}] (H = x.shape[1]), got {tuple(router_weight.shape)}")
    if not 1 <= e <= MAX_EXPERTS:
        fail(op, f"router_weight must have between 1 and {MAX_EXPERTS} experts (rows), got E = {e}")
    check_same_device(op, x, router_weight=router_weight)
    return t, h, e


def moe_route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple:
    """``(probs [T, E], weights [T, k], experts [T, k], counts [E], token_index [E, T])``."""
    op = "moe_route"
    t, h, e = check_router_inputs(op, x, router_weight)
    check_top_k(op, top_k, e)
    check_renormalize(op, renormalize)
    acc = accumulation_dtype(x)
    return (
        x.new_empty((t, e), dtype=acc),
        x.new_empty((t, top_k), dtype=acc),
        x.new_empty((t, top_k), dtype=EXPERTS_DTYPE),
        x.new_empty((e,), dtype=INDEX_DTYPE),
        x.new_empty((e, t), dtype=INDEX_DTYPE),
    )


def moe_route_backward(
    grad_probs: torch.Tensor,
    grad_weights: torch.Tensor,
    x: torch.Tensor,
    router_weight: torch.Tensor,
    probs: torch.Tensor,
    experts: torch.Tensor,
    renormalize: bool,
) -> tuple:
    """``(dx [T, H], d_router_weight [E, H])`` in the inputs' dtype."""
    op = "moe_route_backward"
    t, h, e = check_router_inputs(op, x, router_weight)
    check_renormalize(op, renormalize)
    for name, g in (("grad_probs", grad_probs), ("probs", probs), ("grad_weights", grad_weights)):
        check_floating(op, name, g)
    if tuple(probs.shape) != (t, e) or tuple(grad_probs.shape) != (t, e):
        fail(
            op,
            f"probs and grad_probs must have shape {(t, e)} ([T, E]), got {tuple(probs.shape)} and "
            f"{tuple(grad_probs.shape)}",
        )
    if experts.dim() != 2 or experts.shape[0] != t or experts.dtype != EXPERTS_DTYPE:
        fail(op, f"experts must be int64 [T={t}, k], got {experts.dtype} {tuple(experts.shape)}")
    if not 1 <= experts.shape[1] <= e:
        fail(op, f"experts must have between 1 and E = {e} columns (top_k), got {experts.shape[1]}")
    if tuple(grad_weights.shape) != tuple(experts.shape):
        fail(op, f"grad_weights must have experts' shape {tuple(experts.shape)}, got {tuple(grad_weights.shape)}")
    check_same_device(
        op,
        x,
        router_weight=router_weight,
        grad_probs=grad_probs,
        grad_weights=grad_weights,
        probs=probs,
        experts=experts,
    )
    return x.new_empty(x.shape), router_weight.new_empty(router_weight.shape)
