"""CPU demo: a small DiT block built on the fused ops, compiled whole by Inductor.

    PYTHONPATH=. python bench/demo.py

What it shows without a GPU: a Flux/SD3-style block whose norms are
``torch.ops.fused.*`` compiles with ``fullgraph=True`` (zero graph breaks, the
fused ops visible as single nodes in Dynamo's graph), and the compiled block
gives the same output and the same gradients, for every parameter and input,
as the same block written with ``torch.nn.functional`` and run eagerly. On CPU
the fused ops run their pure-PyTorch reference, so this checks the op
plumbing (schemas, fake implementations, autograd registration, tracing), not
the Triton kernels; ``bench/run.py`` measures those on a GPU.
"""

import collections
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import compile_ops  # noqa: E402  (registers torch.ops.fused.*)

EPS = 1e-6
#: fp32 on both sides; the two paths differ only in summation order.
RTOL, ATOL = 1e-4, 1e-5


class DiTBlock(nn.Module):
    """A diffusion-transformer block in the Flux/SD3 style.

    AdaLN conditioning (shift/scale/gate from a timestep embedding) around a
    LayerNorm without affine parameters, attention with per-head RMSNorm on q
    and k (qk-norm), a GELU-tanh MLP, and gated residuals. Flux's block size
    is ``DiTBlock(3072, 24)``.

    Args:
        dim: hidden size C.
        heads: attention heads; ``dim`` must be a multiple.
        mlp_ratio: MLP hidden size as a multiple of ``dim``.
        fused: True routes the norms, modulations, gated residuals and
            attention through ``compile_ops`` (``torch.ops.fused.*``);
            False through ``torch.nn.functional``. Parameter names are the same
            either way, so one block's ``state_dict`` loads into the other.

    ``forward(x, temb)``: ``x`` ``[B, L, dim]`` tokens, ``temb`` ``[B, dim]``
    timestep embedding; returns ``[B, L, dim]``.
    """

    def __init__(self, dim: int = 64, heads: int = 4, mlp_ratio: int = 4, fused: bool = True):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.fused = fused
        # Real DiTs zero-init the modulation (AdaLN-Zero), which zeroes the gates
        # and with them most gradients; the default init keeps every path live.
        self.ada = nn.Linear(dim, 6 * dim)
        # Separate projections, as in diffusers: tensor parallelism shards each
        # by heads (bench/runners/distributed_train.py); a packed qkv would shard across q/k/v.
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        # Near 1 but not 1, so that a norm that dropped its weight would show.
        self.q_norm_weight = nn.Parameter(1.0 + 0.1 * torch.randn(self.head_dim))
        self.k_norm_weight = nn.Parameter(1.0 + 0.1 * torch.randn(self.head_dim))
        self.proj = nn.Linear(dim, dim)
        self.mlp_in = nn.Linear(dim, mlp_ratio * dim)
        self.mlp_out = nn.Linear(mlp_ratio * dim, dim)

    def _rmsnorm(self, x, weight):
        if self.fused:
            return compile_ops.rmsnorm(x, weight, EPS)
        return F.rms_norm(x, (self.head_dim,), weight, EPS)

    def _attention(self, h):
        def heads(t):  # [B, L, H, D]
            return t.unflatten(-1, (self.heads, self.head_dim))

        q = self._rmsnorm(heads(self.to_q(h)), self.q_norm_weight)
        k = self._rmsnorm(heads(self.to_k(h)), self.k_norm_weight)
        v = heads(self.to_v(h))
        if self.fused:
            out = compile_ops.attention(q, k, v, seq_dim=1)
        else:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            out = out.transpose(1, 2)
        return self.proj(out.flatten(2))

    def _mlp(self, h):
        return self.mlp_out(F.gelu(self.mlp_in(h), approximate="tanh"))

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(F.silu(temb)).chunk(6, dim=-1)
        if self.fused:
            # Three kernels carry the residual stream: norm+modulate, then the
            # seam (gated residual + norm + modulate), then the last gated residual.
            h = compile_ops.norm_modulate(x, scale1, shift1, None, None, "layernorm", EPS)
            x, h = compile_ops.gated_residual_norm_modulate(
                x, self._attention(h), gate1, scale2, shift2, None, None, "layernorm", EPS
            )
            return compile_ops.gated_residual(x, self._mlp(h), gate2)
        h = F.layer_norm(x, (self.dim,), eps=EPS) * (1 + scale1[:, None]) + shift1[:, None]
        x = x + gate1[:, None] * self._attention(h)
        h = F.layer_norm(x, (self.dim,), eps=EPS) * (1 + scale2[:, None]) + shift2[:, None]
        return x + gate2[:, None] * self._mlp(h)


class _GraphRecorder:
    """A ``torch.compile`` backend that keeps each Dynamo graph, then hands it to Inductor.

    One call per graph Dynamo produces, so the count is the graph-break check,
    and the kept graphs show which ops reached the compiler.
    """

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs.append(gm)
        return compile_fx(gm, example_inputs)


def fused_calls(gm: torch.fx.GraphModule) -> collections.Counter:
    """``{"fused.rmsnorm": n, ...}``: the ``torch.ops.fused`` calls in an FX graph."""
    calls = collections.Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)  # "fused.rmsnorm" (packet) or "fused.rmsnorm.default"
        if name.startswith("fused."):
            calls[".".join(name.split(".")[:2])] += 1
    return calls


def _forward_backward(fn, module, x, temb, grad_out):
    """Output and gradients (``x``, ``temb`` and every parameter) of one step."""
    x = x.detach().clone().requires_grad_(True)
    temb = temb.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out = fn(x, temb)
    out.backward(grad_out)
    grads = {"x": x.grad, "temb": temb.grad}
    grads.update({name: p.grad for name, p in module.named_parameters()})
    return out.detach(), grads


def _compare(label, got, want):
    """assert_close on the output and every gradient; prints the largest differences."""
    out_g, grads_g = got
    out_w, grads_w = want
    torch.testing.assert_close(out_g, out_w, rtol=RTOL, atol=ATOL, msg=lambda m: f"{label}, output: {m}")
    diffs = {}
    for name, g in grads_w.items():
        assert g is not None, f"{label}: eager PyTorch gave no gradient for {name}"
        assert grads_g[name] is not None, f"{label}: no gradient for {name}"
        torch.testing.assert_close(
            grads_g[name], g, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{label}, grad of {name}: {m}"
        )
        diffs[name] = (grads_g[name] - g).abs().max().item()
    worst = max(diffs, key=diffs.get)
    print(
        f"  {label}: max |diff| output {(out_g - out_w).abs().max().item():.2e}, "
        f"gradients {diffs[worst]:.2e} (worst: {worst}; {len(diffs)} gradients compared)"
    )


def main() -> int:
    """Run the demo; returns 0 when everything matched (a mismatch raises)."""
    t0 = time.perf_counter()
    torch._dynamo.reset()  # hermetic when a test calls main() after other compiles
    torch.manual_seed(0)
    B, L, C, H = 2, 24, 64, 4
    fused = DiTBlock(C, H, fused=True)
    plain = DiTBlock(C, H, fused=False)
    plain.load_state_dict(fused.state_dict())
    x, temb, grad_out = torch.randn(B, L, C), torch.randn(B, C), torch.randn(B, L, C)
    print(
        f"DiT block B={B} L={L} C={C} heads={H}, fp32 on {x.device.type}: "
        f"fused ops compiled by Inductor vs torch.nn.functional eager"
    )

    recorder = _GraphRecorder()
    compiled = torch.compile(fused, fullgraph=True, backend=recorder)
    got_compiled = _forward_backward(compiled, fused, x, temb, grad_out)
    got_eager = _forward_backward(fused, fused, x, temb, grad_out)
    want = _forward_backward(plain, plain, x, temb, grad_out)

    # fullgraph=True already raises on a graph break; one graph confirms it.
    assert len(recorder.graphs) == 1, f"expected 1 Dynamo graph, got {len(recorder.graphs)}"
    calls = fused_calls(recorder.graphs[0])
    expected = {
        "fused.norm_modulate": 1,
        "fused.gated_residual_norm_modulate": 1,
        "fused.gated_residual": 1,
        "fused.rmsnorm": 2,
        "fused.attention": 1,
    }
    assert dict(calls) == expected, f"fused ops in the graph: {dict(calls)}, expected {expected}"
    print(
        f"  Dynamo: {len(recorder.graphs)} graph, 0 graph breaks; fused ops in the graph: "
        + ", ".join(f"{name} x{n}" for name, n in sorted(calls.items()))
    )

    _compare("compiled fused vs eager PyTorch", got_compiled, want)
    _compare("eager fused vs eager PyTorch", got_eager, want)
    print(f"OK ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
