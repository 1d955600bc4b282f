"""Peers of the RoPE family.

``PEERS[op_name][provider] = callable`` taking the op's arguments as built by
``cases.OpSpec.make_inputs``.

- ``diffusers_eager`` / ``diffusers_compiled``: the formula of diffusers'
  ``apply_rotary_emb(use_real=True)`` (``x * cos + rotate(x) * sin`` in fp32 on
  full-width tables, rounded to x's dtype), written out here because the GPU
  machine has no diffusers; for ``qk_norm_rope``, ``F.rms_norm`` with the
  weight first (what the models' ``norm_q``/``norm_k`` do), rounded to the
  input dtype, then the formula. For ``rope_grid`` the peers rotate with
  fp32 tables built from the same angles once per shape and cached, as a
  model caches them per resolution; reading them is part of their time but
  not of the byte count.
- ``liger``: Liger-Kernel's ``LigerRopeFunction`` (half-split only: the
  ``rope_qk`` rows, which use it), given q and k as ``[B, H, L, D]`` views of
  the ``[B, L, H, D]`` projections, the layout it reads without a copy.
"""

import torch
import torch.nn.functional as F

from compile_ops.reference.rope import grid_tables


def _full(t, r, interleaved):
    """A half table ``[.., L, R/2]`` widened to diffusers' full ``[.., L, R]``."""
    if t.shape[-1] == r:
        return t
    return t.repeat_interleave(2, -1) if interleaved else torch.cat((t, t), -1)


def _rotated(x, interleaved):
    if interleaved:
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply(x, cos, sin, interleaved, seq_dim, rotary_dim=None):
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    cos, sin = _full(cos, r, interleaved), _full(sin, r, interleaved)
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    shape = (cos.shape[0], cos.shape[1], 1, r) if seq_dim == 1 else (cos.shape[0], 1, cos.shape[1], r)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    xr = x[..., :r]
    out = (xr.float() * cos + _rotated(xr, interleaved).float() * sin).to(x.dtype)
    return torch.cat((out, x[..., r:]), dim=-1) if r < x.shape[-1] else out


def rope(x, cos, sin, interleaved, seq_dim, rotary_dim=None, inverse=False):
    return _apply(x, cos, sin, interleaved, seq_dim, rotary_dim)


def rope_qk(q, k, cos, sin, interleaved, seq_dim, rotary_dim=None, inverse=False):
    return _apply(q, cos, sin, interleaved, seq_dim, rotary_dim), _apply(k, cos, sin, interleaved, seq_dim, rotary_dim)


_TABLES: dict = {}


def _grid_tables(constants, length, height, width):
    key = (constants.data_ptr(), length, height, width)
    if key not in _TABLES:
        cos, sin = grid_tables(constants, length, height, width, dtype=torch.float32)
        _TABLES[key] = (cos.to(constants.device), sin.to(constants.device))
    return _TABLES[key]


def rope_grid(q, k, constants, height, width, interleaved, seq_dim, inverse=False):
    cos, sin = _grid_tables(constants, q.shape[seq_dim], height, width)
    return rope_qk(q, k, cos, sin, interleaved, seq_dim, 2 * constants.shape[1])


def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, interleaved, seq_dim, rotary_dim=None):
    d = q.shape[-1]
    qn = F.rms_norm(q, (d,), q_weight, eps).to(q.dtype)
    kn = F.rms_norm(k, (d,), k_weight, eps).to(k.dtype)
    return rope_qk(qn, kn, cos, sin, interleaved, seq_dim, rotary_dim)


def _liger_rope_qk(q, k, cos, sin, interleaved, seq_dim, rotary_dim=None, inverse=False):
    from liger_kernel.ops.rope import LigerRopeFunction

    if interleaved or seq_dim != 1 or rotary_dim is not None:
        raise NotImplementedError("Liger's rope: half-split, [B, L, H, D] projections, full rotary dim only")
    q_out, k_out = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos[None], sin[None])
    return q_out.transpose(1, 2), k_out.transpose(1, 2)


def _eager_and_compiled(fn):
    return {"diffusers_eager": fn, "diffusers_compiled": torch.compile(fn)}


PEERS = {fn.__name__: _eager_and_compiled(fn) for fn in (rope, rope_qk, rope_grid, qk_norm_rope)}
PEERS["rope_qk"]["liger"] = _liger_rope_qk
