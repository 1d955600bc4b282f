"""Peers of the modulation family: the formulas diffusers' DiT blocks run.

``PEERS[op_name][provider] = callable`` taking the op's arguments (as built by
``cases.OpSpec.make_inputs``: per-sample ``[B, C]`` modulation). The
``native_*`` providers of the runner are our fp32 reference; these are what a
diffusers model computes, at the input dtype (``AdaLayerNormZero``: a
``LayerNorm`` without affine, then ``* (1 + scale[:, None]) + shift[:, None]``;
Flux/SD3 blocks: ``x + gate[:, None] * branch``), eager and under
``torch.compile``.
"""

import torch
import torch.nn.functional as F


def _per_token(m, x):
    return m[:, None] if m.dim() == 2 and x.dim() == 3 else m


def _norm(x, weight, bias, norm, eps):
    if norm == "layernorm":
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    y = F.rms_norm(x, x.shape[-1:], weight, eps)
    return y + bias if bias is not None else y


def modulate(x, scale, shift):
    return x * (1 + _per_token(scale, x)) + _per_token(shift, x)


def norm_modulate(x, scale, shift, weight, bias, norm, eps):
    return modulate(_norm(x, weight, bias, norm, eps), scale, shift)


def gated_residual(residual, x, gate):
    return residual + _per_token(gate, x) * x


def gated_residual_norm_modulate(residual, x, gate, scale, shift, weight, bias, norm, eps):
    h = gated_residual(residual, x, gate)
    return h, norm_modulate(h, scale, shift, weight, bias, norm, eps)


def _eager_and_compiled(fn):
    return {"diffusers_eager": fn, "diffusers_compiled": torch.compile(fn)}


PEERS = {
    fn.__name__: _eager_and_compiled(fn)
    for fn in (modulate, norm_modulate, gated_residual, gated_residual_norm_modulate)
}
