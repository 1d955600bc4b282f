"""Peers of the norm family: what a model would call instead of ``torch.ops.fused.*``.

``PEERS[op_name][provider] = callable`` where the callable takes exactly the
op's arguments (as built by ``cases.OpSpec.make_inputs``), so the runner can
time peers and our ops on the same tensors. Liger-Kernel rows appear only where
it is installed (the reference Triton implementation of these norms); its
autograd Functions are called directly because its modules own their
weights, and we need to pass ours.
"""

import torch.nn.functional as F


def _rms_norm(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _layer_norm(x, weight, bias, eps):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _add_rms_norm(x, residual, weight, eps):
    # Eager PyTorch has no fused add+norm: the sum is materialized, then read again.
    h = x + residual
    return F.rms_norm(h, (h.shape[-1],), weight, eps), h


PEERS = {
    "rmsnorm": {"torch_F.rms_norm": _rms_norm},
    "layernorm": {"torch_F.layer_norm": _layer_norm},
    "add_rmsnorm": {"torch_add+F.rms_norm": _add_rms_norm},
}

try:
    # Signature (liger-kernel 0.8): forward(ctx, X, W, eps, offset=0.0,
    # casting_mode="llama", in_place=True, row_mode=None). in_place=False: the
    # in-place backward overwrites dY, which the benchmark reuses across runs.
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    def _liger_rms_norm(x, weight, eps):
        return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False)

    PEERS["rmsnorm"]["liger"] = _liger_rms_norm
except Exception:  # not installed, or built against another torch/triton
    pass

try:
    # Signature: forward(ctx, X, W, B, eps).
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    def _liger_layer_norm(x, weight, bias, eps):
        return LigerLayerNormFunction.apply(x, weight, bias, eps)

    PEERS["layernorm"]["liger"] = _liger_layer_norm
except Exception:  # not installed, or built against another torch/triton
    pass
