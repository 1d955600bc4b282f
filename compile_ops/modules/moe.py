"""``MoEFeedForward``: a mixture-of-experts SwiGLU feed-forward routed by ``fused.moe_route``.

The shape of HiDream-I1's MoE FFN (a softmax gate over E experts, top-k,
SwiGLU experts ``w2(silu(w1 x) * w3 x)``), with the expert weights stacked so
that one grouped GEMM can run them all:

- ``router.weight [E, dim]``: ``nn.Linear(dim, E, bias=False)``;
- ``w_in [E, 2 * hidden_dim, dim]``: each expert's gate (``w1``) rows, then
  its value (``w3``) rows, i.e. ``torch.cat([w1, w3])``;
- ``w_out [E, dim, hidden_dim]``: each expert's ``w2``.

Two ways to run the experts, the same result (``expert_impl``):

- ``"grouped_mm"``: the tokens sorted by expert (from ``token_index`` and
  ``counts``: fixed size ``T * k``) through two ``torch._grouped_mm`` calls
  with the experts' offsets; only the chosen (token, expert) pairs are
  computed. Picked by ``"auto"`` on CUDA GPUs of compute capability 9.0 or
  newer with bf16 weights, where torch's grouped GEMM runs.
- ``"loop"``: the portable path, a loop over experts. In eager mode each
  expert gets its ``counts[e]`` tokens (one host read of ``counts`` per
  call). Under ``torch.compile`` a data-dependent batch size would need
  unbacked symbols (``capture_scalar_outputs``) or a graph break, so there
  each expert takes all T slots of its ``token_index`` row, the padding (T)
  reading a zero row whose output lands in a discarded row: fixed shapes, no
  graph break, and ``E / k`` times the expert FLOPs of the grouped path.

Both combine the k expert outputs of a token with its routing weights in
fp32 (fp64 for fp64 weights), in a fixed order: no atomics, the same bits
on every run.
"""

import math

import torch
from torch import Tensor, nn

from compile_ops._library import cuda_capability
from compile_ops.meta._validate import accumulation_dtype, checked_arguments
from compile_ops.modules.hooks import check_input
from compile_ops.ops.glu import swiglu
from compile_ops.ops.moe import moe_route

EXPERT_IMPLS = ("auto", "loop", "grouped_mm")


def grouped_mm_available(t: Tensor) -> bool:
    """Whether ``"auto"`` runs the experts through ``torch._grouped_mm`` for weights like ``t``."""
    return (
        hasattr(torch, "_grouped_mm")
        and t.device.type == "cuda"
        and torch.cuda.is_available()
        and t.dtype == torch.bfloat16
        and cuda_capability(t.device.index)[:2] >= (9, 0)
    )


def _expert_mlp(x: Tensor, w_in: Tensor, w_out: Tensor) -> Tensor:
    """One expert, ``x [n, dim]`` -> ``[n, dim]``: ``w_out (silu(gate) * value)``."""
    return swiglu(x @ w_in.t(), gate_first=True) @ w_out.t()


def experts_loop(
    x: Tensor, weights: Tensor, experts: Tensor, counts: Tensor, token_index: Tensor, w_in: Tensor, w_out: Tensor
) -> Tensor:
    """``[T, dim]`` in the combine dtype: ``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])``,
    one expert at a time (see the module docstring for the two batch sizes)."""
    t, dim = x.shape
    num_experts = w_in.shape[0]
    acc = accumulation_dtype(x, weights)
    # Row T of each padded tensor is what the padding entries (T) of token_index read.
    padded = torch.cat([x, x.new_zeros(1, dim)])
    combine = torch.cat(
        [weights.new_zeros(t, num_experts).scatter(1, experts, weights), weights.new_zeros(1, num_experts)]
    )
    out = torch.zeros(t + 1, dim, dtype=acc, device=x.device)
    sizes = [t] * num_experts if torch.compiler.is_compiling() else counts.tolist()
    for e in range(num_experts):
        rows = token_index[e, : sizes[e]]
        y = _expert_mlp(padded[rows], w_in[e], w_out[e])
        out = out.index_add(0, rows, y.to(acc) * combine[rows, e, None].to(acc))
    return out[:t]


def experts_grouped(
    x: Tensor, weights: Tensor, experts: Tensor, counts: Tensor, token_index: Tensor, w_in: Tensor, w_out: Tensor
) -> Tensor:
    """The same sum through ``torch._grouped_mm``, on the ``T * k`` (token,
    expert) pairs sorted by expert (each expert's tokens ascending)."""
    t, dim = x.shape
    num_experts, k = w_in.shape[0], experts.shape[1]
    acc = accumulation_dtype(x, weights)
    ends = counts.cumsum(0)
    position = torch.arange(t * k, device=x.device)
    expert_of = torch.searchsorted(ends, position, right=True)  # the expert owning each sorted position
    tokens = token_index[expert_of, position - (ends - counts)[expert_of]].long()
    offsets = ends.to(torch.int32)
    h = torch._grouped_mm(x[tokens], w_in.transpose(1, 2), offs=offsets)
    y = torch._grouped_mm(swiglu(h, gate_first=True), w_out.transpose(1, 2), offs=offsets)
    # Back to (token, choice) order by a gather (not an index_add, whose
    # atomics would sum a token's k outputs in a varying order).
    where = torch.zeros(t * num_experts, dtype=torch.long, device=x.device)
    where = where.scatter(0, tokens * num_experts + expert_of, position).view(t, num_experts).gather(1, experts)
    return (y[where].to(acc) * weights[..., None].to(acc)).sum(dim=1)


class MoEFeedForward(nn.Module):
    """Mixture-of-experts SwiGLU feed-forward: input ``[..., dim]``, output ``[..., dim]``.

    Args:
        dim: model width (H).
        hidden_dim: each expert's SwiGLU hidden width.
        num_experts: E, at most ``compile_ops.meta.moe.MAX_EXPERTS`` (256).
        top_k: experts per token.
        renormalize: routing weights divided by their sum (see :func:`compile_ops.ops.moe.moe_route`).
        expert_impl: ``"auto"``, ``"loop"`` or ``"grouped_mm"`` (module docstring).

    ``forward`` returns the output only; the routing of the last call is not
    kept (call :func:`compile_ops.ops.moe.moe_route` for it).
    """

    @checked_arguments
    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int = 2,
        renormalize: bool = True,
        expert_impl: str = "auto",
    ):
        super().__init__()
        if expert_impl not in EXPERT_IMPLS:
            raise ValueError(f"MoEFeedForward: expert_impl must be one of {EXPERT_IMPLS}, got {expert_impl!r}")
        self.top_k, self.renormalize, self.expert_impl = top_k, renormalize, expert_impl
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.w_out = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        # nn.Linear's default initialization, per expert.
        nn.init.uniform_(self.w_in, -1 / math.sqrt(dim), 1 / math.sqrt(dim))
        nn.init.uniform_(self.w_out, -1 / math.sqrt(hidden_dim), 1 / math.sqrt(hidden_dim))

    def forward(self, hidden_states: Tensor) -> Tensor:
        check_input("compile_ops.MoEFeedForward", "hidden_states", hidden_states, self.router)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, experts, counts, token_index = moe_route(x, self.router.weight, self.top_k, self.renormalize)
        grouped = self.expert_impl == "grouped_mm" or (self.expert_impl == "auto" and grouped_mm_available(self.w_in))
        run = experts_grouped if grouped else experts_loop
        out = run(x, weights, experts, counts, token_index, self.w_in, self.w_out)
        return out.to(hidden_states.dtype).reshape(shape)

    def extra_repr(self) -> str:
        e, two_f, dim = self.w_in.shape
        return (
            f"dim={dim}, hidden_dim={two_f // 2}, num_experts={e}, top_k={self.top_k}, "
            f"renormalize={self.renormalize}, expert_impl={self.expert_impl!r}"
        )
