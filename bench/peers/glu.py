"""Peers of the gated-activation family.

``PEERS[op_name][provider] = callable`` taking the op's arguments as built by
``cases.OpSpec.make_inputs`` (``x [..., 2H]``, then the op's options).

- ``diffusers_eager`` / ``diffusers_compiled``: the activation step of
  diffusers' ``GEGLU`` / ``SwiGLU`` (``hidden, gate = x.chunk(2, -1);
  hidden * act(gate)`` at the input dtype), written out here because the GPU
  machine has no diffusers. Compiled, it is the torch.compile row.
- ``liger``: Liger-Kernel's ``LigerGELUMulFunction`` (tanh GELU only: the
  ``geglu_tanh`` rows) and ``LigerSiLUMulFunction``, given ``(gate, value)``
  from ``x.chunk(2, -1)`` (it makes the chunks contiguous, as a
  diffusers-order caller must).
- ``liger_gate_first``: Liger's ``LigerFusedGateUpSiLUMulFunction``, which reads
  the unchunked ``[gate, value]`` tensor (vLLM's order): the same bytes and
  work as ``swiglu(x, gate_first=True)``, timed on the same x.
"""

import torch
import torch.nn.functional as F


def _diffusers(activation):
    def step(x, *options):
        hidden, gate = x.chunk(2, dim=-1)
        return hidden * activation(gate)

    return step


_GELU = _diffusers(F.gelu)
_GELU_TANH = _diffusers(lambda g: F.gelu(g, approximate="tanh"))
_SILU = _diffusers(F.silu)

PEERS = {
    "geglu": {"diffusers_eager": _GELU, "diffusers_compiled": torch.compile(_GELU)},
    "geglu_tanh": {"diffusers_eager": _GELU_TANH, "diffusers_compiled": torch.compile(_GELU_TANH)},
    "swiglu": {"diffusers_eager": _SILU, "diffusers_compiled": torch.compile(_SILU)},
}

try:
    # Signatures (liger-kernel 0.8.5): LigerGELUMulFunction.forward(ctx, a, b) = gelu_tanh(a) * b;
    # LigerSiLUMulFunction.forward(ctx, a, b, ...) = silu(a) * b;
    # LigerFusedGateUpSiLUMulFunction.forward(ctx, y, in_place=False) = silu(y[:H]) * y[H:].
    from liger_kernel.ops.geglu import LigerGELUMulFunction
    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction, LigerSiLUMulFunction

    def _liger_geglu(x, *options):
        hidden, gate = x.chunk(2, dim=-1)
        return LigerGELUMulFunction.apply(gate, hidden)

    def _liger_swiglu(x, *options):
        hidden, gate = x.chunk(2, dim=-1)
        return LigerSiLUMulFunction.apply(gate, hidden)

    def _liger_swiglu_gate_first(x, *options):
        # 2-D in and out: its backward returns the gradient flattened to rows
        # (liger-kernel 0.8.5), which autograd rejects for a 3-D input.
        rows = x.reshape(-1, x.shape[-1])
        return LigerFusedGateUpSiLUMulFunction.apply(rows, False).view(*x.shape[:-1], -1)

    PEERS["geglu_tanh"]["liger"] = _liger_geglu
    PEERS["swiglu"]["liger"] = _liger_swiglu
    PEERS["swiglu"]["liger_gate_first"] = _liger_swiglu_gate_first
except Exception:  # not installed, or built against another torch/triton
    pass
