"""One table of op specs that drives the cross-op tests and the benchmark.

A new op gets opcheck, gradcheck, fake-CUDA tracing, compile coverage and a
benchmark row by adding one ``OpSpec`` here. Family-specific behaviour (edge
cases, bad input, modules) lives in ``tests/test_<family>.py``.
"""
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from compile_ops import reference
from compile_ops.meta import rope as meta_rope
from compile_ops.ops import attention as _attention_ops  # noqa: F401
from compile_ops.ops import fp8 as _fp8_ops  # noqa: F401
from compile_ops.ops import glu as _glu_ops  # noqa: F401
from compile_ops.ops import modulate as _modulate_ops  # noqa: F401  (registers the ops)
from compile_ops.ops import moe as _moe_ops  # noqa: F401
from compile_ops.ops import norm as _norm_ops  # noqa: F401
from compile_ops.ops import rope as _rope_ops  # noqa: F401

Shape = tuple[int, ...]


@dataclass(frozen=True)
class OpSpec:
    name: str
    """``torch.ops.fused.<name>``."""
    family: str
    """The stem of the op's modules in kernels/, meta/, reference/, ops/, tests/, bench/."""
    reference: Callable
    """Pure-PyTorch implementation with the op's signature."""
    make_inputs: Optional[Callable[[Shape, torch.dtype, str, bool], tuple]]
    """``(shape, dtype, device, requires_grad) -> args``, shape being the activation's
    ``[B, L, C]``. Used by the compile tests (L varies) and the benchmark; None for
    ops that only autograd calls (backward ops)."""
    edge_inputs: Callable[[torch.dtype, str, bool], Sequence[tuple]]
    """Small argument tuples that cover the op's options and edge cases (no
    weight, zero rows, strided rows, mixed dtypes) for opcheck and tracing."""
    differentiable: bool = True
    """Has a gradient to check: False for backward ops (no autograd formula) and
    inference-only ops (``quantize_fp8_rows``: its formula raises), which skip
    opcheck's autograd inputs, gradcheck and the forward+backward compile test."""
    bench_shapes: Sequence[Shape] = ()
    """DiT activation shapes ``[B, L, C]`` benchmarked on the GPU."""
    backward_reads_inputs: bool = True
    """The backward reads the differentiable inputs again (a norm does; a
    rotation, whose backward needs only the angles, does not): the benchmark's
    byte count of a forward+backward step."""
    tf32: bool = False
    """fp32 inputs run with TF32 dots on a GPU where torch's fp32 matmul
    precision allows TF32 (attention): compared with the fp32 reference at
    TF32's tolerance then."""
    op_name: Optional[str] = None
    """The ``torch.ops.fused`` op, when ``name`` labels one variant of it
    (``geglu_tanh`` is ``fused.geglu`` with ``approximate="tanh"``)."""

    @property
    def op(self) -> torch._ops.OpOverloadPacket:
        return getattr(torch.ops.fused, self.op_name or self.name)

    @property
    def qualname(self) -> str:
        return f"fused::{self.op_name or self.name}"


def _tensor(shape, dtype, device, requires_grad=False, scale=1.0):
    t = torch.randn(shape, dtype=torch.float32, device=device).mul_(scale).to(dtype)
    return t.requires_grad_(requires_grad)


def _param(c, dtype, device, requires_grad):
    # Weights near 1 and biases near 0, like trained norms, but not exactly: a
    # kernel that ignored them would still be caught.
    return (1.0 + 0.1 * torch.randn(c, device=device)).to(dtype).requires_grad_(requires_grad)


def _norm_edges(build):
    """Edge-case argument tuples shared by the norm ops; ``build(x, with_affine)``
    turns an activation into the op's arguments."""

    def edges(dtype, device, requires_grad):
        g = requires_grad
        base = _tensor((2, 3, 16), dtype, device, g)
        strided = _tensor((4, 40), dtype, device)[:, 4:20].detach().requires_grad_(g)  # row stride 40
        return [
            build(base, True, dtype, device, g),
            build(base, False, dtype, device, g),
            build(_tensor((0, 16), dtype, device, g), True, dtype, device, g),       # zero rows
            build(_tensor((7,), dtype, device, g), True, dtype, device, g),          # one row, odd width
            build(strided, True, dtype, device, g),
            build(_tensor((3, 5, 33), dtype, device, g), True, dtype, device, g),    # width not a block multiple
        ]

    return edges


def _rmsnorm_args(x, affine, dtype, device, g, eps=1e-6):
    c = x.shape[-1]
    return (x, _param(c, dtype, device, g) if affine else None, eps)


def _layernorm_args(x, affine, dtype, device, g, eps=1e-5):
    c = x.shape[-1]
    if not affine:
        return (x, None, None, eps)
    return (x, _param(c, dtype, device, g), (0.1 * _tensor((c,), dtype, device)).requires_grad_(g), eps)


def _add_rmsnorm_args(x, affine, dtype, device, g, eps=1e-6):
    residual = _tensor(x.shape, dtype, device, g)
    c = x.shape[-1]
    return (x, residual, _param(c, dtype, device, g) if affine else None, eps)


def _norm_backward_edges(dtype, device, requires_grad):
    out = []
    for x, w, b in [(_tensor((2, 3, 16), dtype, device), True, True),
                    (_tensor((5, 24), dtype, device), False, False),
                    (_tensor((0, 16), dtype, device), True, True)]:
        c = x.shape[-1]
        dy = _tensor(x.shape, dtype, device)
        for is_rms in (True, False):
            out.append((dy, None if is_rms else _tensor(x.shape, dtype, device), x,
                        _param(c, dtype, device, False) if w else None,
                        _param(c, dtype, device, False) if b else None, 1e-6, is_rms))
    # An expanded (stride-0) gradient, as y.sum().backward() produces.
    x = _tensor((3, 16), dtype, device)
    out.append((torch.ones((), dtype=dtype, device=device).expand(3, 16), None, x,
                _param(16, dtype, device, False), None, 1e-6, True))
    return out


def _make(build):
    def make_inputs(shape, dtype, device, requires_grad):
        return build(_tensor(shape, dtype, device, requires_grad), True, dtype, device, requires_grad)
    return make_inputs


# ---------------------------------------------------------------- modulate family


def _modulation(shape, dtype, device, g, scale=0.5):
    return (scale * _tensor(shape, dtype, device)).requires_grad_(g)


def _modulate_args(x, mod_shape, affine, dtype, device, g):
    return (x, _modulation(mod_shape, dtype, device, g), _modulation(mod_shape, dtype, device, g, 1.0))


def _affine_params(c, affine, dtype, device, g):
    if not affine:
        return None, None
    return _param(c, dtype, device, g), (0.1 * _tensor((c,), dtype, device)).requires_grad_(g)


def _norm_modulate_args(norm):
    def build(x, mod_shape, affine, dtype, device, g, eps=1e-6):
        return (*_modulate_args(x, mod_shape, affine, dtype, device, g),
                *_affine_params(x.shape[-1], affine, dtype, device, g), norm, eps)
    return build


def _gated_residual_args(x, mod_shape, affine, dtype, device, g):
    return (_tensor(x.shape, dtype, device, g), x, _modulation(mod_shape, dtype, device, g))


def _gated_residual_norm_modulate_args(norm):
    def build(x, mod_shape, affine, dtype, device, g, eps=1e-6):
        return (*_gated_residual_args(x, mod_shape, affine, dtype, device, g),
                *_norm_modulate_args(norm)(x, mod_shape, affine, dtype, device, g, eps)[1:])
    return build


def _modulation_edges(build):
    """Edge cases shared by the modulation ops: every broadcast form of the
    modulation tensors, strided and 2-D x, zero rows, odd widths."""

    def edges(dtype, device, requires_grad):
        g = requires_grad
        strided = _tensor((4, 40), dtype, device)[:, 4:20].detach().requires_grad_(g)  # row stride 40
        cases = [
            ((2, 3, 16), (2, 16), True),          # per sample, diffusers' chunk of the embedding
            ((2, 3, 16), (2, 3, 16), False),      # per token
            ((2, 4, 16), (2, 2, 1, 16), True),    # per frame: x read as [2, 2, 2, 16]
            ((3, 16), (16,), False),              # 2-D x, per channel
            ((2, 5, 33), (1, 1, 33), True),       # width not a block multiple, batch-broadcast
            ((0, 3, 16), (0, 16), True),          # zero rows
        ]
        out = [build(_tensor(x_shape, dtype, device, g), m_shape, affine, dtype, device, g)
               for x_shape, m_shape, affine in cases]
        out.append(build(strided, (), False, dtype, device, g))  # strided rows, 0-dim modulation
        return out

    return edges


def _make_modulation(build):
    """``make_inputs`` of a modulation op: per-sample ``[B, C]`` modulation, as
    diffusers' AdaLayerNormZero chunks it from the timestep embedding."""
    def make_inputs(shape, dtype, device, requires_grad):
        return build(_tensor(shape, dtype, device, requires_grad), (shape[0], shape[-1]), False, dtype,
                     device, requires_grad)
    return make_inputs


def _modulate_backward_edges(dtype, device, requires_grad):
    def t(shape, scale=1.0):
        return _tensor(shape, dtype, device, scale=scale)

    x, per_sample, per_token = t((2, 3, 16)), (2, 16), (2, 3, 16)
    w, b = _param(16, dtype, device, False), _param(16, dtype, device, False)
    # The forward's row statistics of x, as norm_modulate returns them.
    _, mean, rstd = reference.modulate.norm_modulate(x, t(per_sample), t(per_sample), None, None, "layernorm", 1e-6)
    _, no_mean, rms_rstd = reference.modulate.norm_modulate(x, t(per_sample), t(per_sample), None, None,
                                                            "rmsnorm", 1e-6)
    return [
        # modulate; norm_modulate with and without affine, statistics given and recomputed;
        # gated_residual; the seam.
        (t(x.shape), None, x, None, None, None, None, t(per_sample, 0.5), t(per_sample), None, None, "none", 0.0),
        (t(x.shape), None, x, mean, rstd, None, None, t(per_sample, 0.5), t(per_token), w, b, "layernorm", 1e-6),
        (t(x.shape), None, x, None, None, None, None, t((), 0.5), t((16,)), None, None, "rmsnorm", 1e-6),
        (None, t(x.shape), x, None, None, t(x.shape), t(per_token), None, None, None, None, "none", 0.0),
        (t(x.shape), t(x.shape), x, no_mean, rms_rstd, t(x.shape), t(per_sample), t((2, 1, 16), 0.5),
         t(per_sample), w, None, "rmsnorm", 1e-6),
        (t((0, 3, 16)), None, t((0, 3, 16)), None, None, None, None, t((0, 16)), t((0, 16)), None, None,
         "layernorm", 1e-6),
    ]


# ---------------------------------------------------------------- rope family


def _rope_tables(length, t, dtype, device, per_batch=0):
    """Angle tables like diffusers' (fp32 whatever x's dtype, unless fp64)."""
    tdtype = torch.float64 if dtype == torch.float64 else torch.float32
    angles = torch.rand(((per_batch,) if per_batch else ()) + (length, t), device=device, dtype=tdtype) * 6.3
    return angles.cos(), angles.sin()


def _rope_edges(dtype, device, requires_grad):
    g = requires_grad

    def x(shape):
        return _tensor(shape, dtype, device, g)

    bhld = x((2, 3, 5, 16))
    blhd_view = _tensor((2, 5, 3, 16), dtype, device).transpose(1, 2).detach().requires_grad_(g)
    return [
        (bhld, *_rope_tables(5, 16, dtype, device), False, 2, None, False),           # half-split, full table
        (bhld, *_rope_tables(5, 8, dtype, device), True, 2, None, False),             # interleaved, half table
        (x((2, 5, 3, 16)), *_rope_tables(5, 16, dtype, device), True, 1, None, False),  # [B, L, H, D]
        (blhd_view, *_rope_tables(5, 16, dtype, device, 2), False, 2, None, False),   # strided, per batch
        (x((1, 2, 7, 24)), *_rope_tables(7, 16, dtype, device), True, 2, 16, False),  # partial rotary
        (x((0, 2, 7, 16)), *_rope_tables(7, 16, dtype, device), False, 2, None, True),  # zero rows, inverse
    ]


def _heads(shape):
    """``[B, L, C]`` -> (B, L, H, D) with D = 128 (16 for small C)."""
    b, length, c = shape
    d = 128 if c % 128 == 0 else 16
    return b, length, c // d, d


def _make_rope(shape, dtype, device, requires_grad):
    """x ``[B, H, L, D]``, interleaved with a full table (Flux)."""
    b, length, h, d = _heads(shape)
    x = _tensor((b, h, length, d), dtype, device, requires_grad)
    return (x, *_rope_tables(length, d, dtype, device), True, 2, None, False)


def _make_rope_qk(shape, dtype, device, requires_grad):
    """q, k ``[B, L, H, D]`` as a projection makes them (diffusers' attention
    processors rotate them in that layout), half-split with a full table (the
    convention the anchors and Liger's kernel use)."""
    b, length, h, d = _heads(shape)
    q, k = (_tensor((b, length, h, d), dtype, device, requires_grad) for _ in range(2))
    return (q, k, *_rope_tables(length, d, dtype, device), False, 1, None, False)


def _rope_qk_edges(dtype, device, requires_grad):
    g = requires_grad

    def x(shape):
        return _tensor(shape, dtype, device, g)

    blhd_view = _tensor((2, 5, 3, 16), dtype, device).transpose(1, 2).detach().requires_grad_(g)
    return [
        (x((2, 3, 5, 16)), x((2, 1, 5, 16)), *_rope_tables(5, 16, dtype, device), True, 2, None, False),  # GQA
        (x((2, 5, 3, 16)), x((2, 5, 2, 16)), *_rope_tables(5, 8, dtype, device), False, 1, None, False),
        (blhd_view, x((2, 3, 5, 16)), *_rope_tables(5, 16, dtype, device, 2), False, 2, None, True),
        (x((1, 2, 7, 24)), x((1, 2, 7, 24)), *_rope_tables(7, 16, dtype, device), True, 2, 16, False),
        (x((0, 2, 7, 16)), x((0, 2, 7, 16)), *_rope_tables(7, 16, dtype, device), False, 2, None, False),
    ]


def _grid_constants(d, device):
    return meta_rope.grid_rope("wan", d).constants(device)


def _video_grid(length):
    """A (height, width) of a DiT latent that tiles ``length`` tokens: Flux's
    1024x1024 image, Wan's 480p x 81 frames, else one row of gcd(length, 4096)
    tokens per frame (one token for the odd lengths of the compile test, so the
    grid stays the same while the length varies)."""
    return {4608: (64, 72), 32760: (30, 52)}.get(length, (1, math.gcd(length, 4096)))


def _make_rope_grid(shape, dtype, device, requires_grad):
    """q, k ``[B, H, L, D]`` with Wan's 3D RoPE."""
    b, length, h, d = _heads(shape)
    q, k = (_tensor((b, h, length, d), dtype, device, requires_grad) for _ in range(2))
    return (q, k, _grid_constants(d, device), *_video_grid(length), True, 2, False)


def _rope_grid_edges(dtype, device, requires_grad):
    g = requires_grad

    def x(shape):
        return _tensor(shape, dtype, device, g)

    ltx = meta_rope.grid_rope("ltx", 16).constants(device)
    return [
        (x((2, 3, 24, 16)), x((2, 1, 24, 16)), _grid_constants(16, device), 3, 4, True, 2, False),
        (x((1, 24, 2, 16)), x((1, 24, 2, 16)), ltx, 2, 3, True, 1, True),              # padding pairs
        (x((1, 2, 12, 20)), x((1, 2, 12, 20)), _grid_constants(16, device), 2, 2, False, 2, False),  # tail
    ]


def _make_qk_norm_rope(shape, dtype, device, requires_grad):
    """q, k ``[B, L, H, D]`` as Flux norms them, interleaved, full table."""
    b, length, h, d = _heads(shape)
    q, k = (_tensor((b, length, h, d), dtype, device, requires_grad) for _ in range(2))
    q_w, k_w = (_param(d, dtype, device, requires_grad) for _ in range(2))
    return (q, k, q_w, k_w, *_rope_tables(length, d, dtype, device), 1e-6, True, 1, None)


def _qk_norm_rope_edges(dtype, device, requires_grad):
    g = requires_grad

    def x(shape):
        return _tensor(shape, dtype, device, g)

    def w(d):
        return _param(d, dtype, device, g)

    blhd_view = _tensor((2, 5, 3, 16), dtype, device).transpose(1, 2).detach().requires_grad_(g)
    return [
        (x((2, 3, 5, 16)), x((2, 1, 5, 16)), w(16), w(16), *_rope_tables(5, 16, dtype, device), 1e-6, True, 2,
         None),
        (blhd_view, x((2, 3, 5, 16)), w(16), w(16), *_rope_tables(5, 8, dtype, device, 2), 1e-5, False, 2, None),
        (x((1, 7, 2, 24)), x((1, 7, 2, 24)), w(24), w(24), *_rope_tables(7, 16, dtype, device), 1e-6, True, 1, 16),
        (x((0, 2, 7, 16)), x((0, 2, 7, 16)), w(16), w(16), *_rope_tables(7, 16, dtype, device), 1e-6, False, 2,
         None),
    ]


def _make_qk_rope_int8(shape, dtype, device, requires_grad):
    """:func:`_make_qk_norm_rope`'s q, k in 16 bits (8-bit attention's inputs)."""
    return (*_make_qk_norm_rope(shape, _int8_dtype(dtype), device, False)[:-4], 1e-6, True, 1, None)


def _qk_rope_int8_edges(dtype, device, requires_grad):
    """The qk_norm_rope edges in 16 bits with keys offset per channel (what the
    smoothing removes), and each once more as a plain rotation (no weights)."""
    cases = []
    for q, k, q_w, k_w, *rest in _qk_norm_rope_edges(_int8_dtype(dtype), device, False):
        k = (k + torch.linspace(-3, 3, k.shape[-1], device=device).to(k.dtype)).to(k.dtype)
        cases += [(q, k, q_w, k_w, *rest), (q, k, None, None, *rest)]
    return cases


def _qk_norm_rope_backward_edges(dtype, device, requires_grad):
    cases = []
    for args in _qk_norm_rope_edges(dtype, device, False):
        q, k = args[:2]
        grads = (_tensor(q.shape, dtype, device), _tensor(k.shape, dtype, device).transpose(-1, -2)
                 .contiguous().transpose(-1, -2))  # a gradient with a non-unit channel stride
        cases.append((*grads, *args))
    return cases


# ---------------------------------------------------------------- glu family


def _glu_edges(*options):
    """Edge cases of a gated activation; ``options`` follow x in the op's arguments
    (``gate_first`` last, and flipped on some cases)."""

    def edges(dtype, device, requires_grad):
        g = requires_grad

        def x(shape):
            return _tensor(shape, dtype, device, g, scale=2.0)

        row_slice = _tensor((4, 40), dtype, device, scale=2.0)[:, 4:20].detach().requires_grad_(g)  # row stride 40
        channel_strided = _tensor((16, 3), dtype, device, scale=2.0).t().detach().requires_grad_(g)
        return [
            (x((2, 3, 16)), *options, False),
            (x((2, 3, 16)), *options, True),     # vLLM's order
            (x((0, 16)), *options, False),        # zero rows
            (x((10,)), *options, True),           # 1-D, H = 5
            (row_slice, *options, False),
            (channel_strided, *options, True),    # copied to unit column stride
            (x((3, 5, 66)), *options, False),     # H = 33, not a block multiple
        ]

    return edges


def _make_glu(*options):
    def make_inputs(shape, dtype, device, requires_grad):
        return (_tensor(shape, dtype, device, requires_grad, scale=2.0), *options, False)
    return make_inputs


def _glu_backward_edges(dtype, device, requires_grad):
    cases = []
    # Every edge case, spread over the three activations (all of them on all
    # cases would triple opcheck's time for no new path).
    for i, activation in enumerate(("gelu", "gelu_tanh", "silu")):
        for x, gate_first in _glu_edges()(dtype, device, False)[i::2]:
            dy = _tensor((*x.shape[:-1], x.shape[-1] // 2), dtype, device)
            cases.append((dy, x, activation, gate_first))
    # An expanded (stride-0) gradient, as y.sum().backward() produces.
    x = _tensor((3, 16), dtype, device)
    cases.append((torch.ones((), dtype=dtype, device=device).expand(3, 8), x, "gelu", False))
    return cases


# ---------------------------------------------------------------- moe family


def _router(num_experts, h, dtype, device, g):
    """A router weight ``[E, H]`` scaled so that the logits of N(0, 1) tokens are about N(0, 1)."""
    return _tensor((num_experts, h), dtype, device, g, scale=h ** -0.5)


def _make_moe(num_experts, top_k, renormalize):
    """x ``[L, C]``: one sequence's tokens (B is not used, so that the
    sequence dim is the token dim the compile test marks dynamic)."""
    def make_inputs(shape, dtype, device, requires_grad):
        _, length, c = shape
        return (_tensor((length, c), dtype, device, requires_grad), _router(num_experts, c, dtype, device,
                                                                           requires_grad), top_k, renormalize)
    return make_inputs


def _moe_edges(dtype, device, requires_grad):
    """Tokens not a multiple of the routing block (32), E not a power of 2,
    k = 1 and k = E, strided rows, E past 64 (the narrower H chunks), zero tokens."""
    g = requires_grad

    def x(t, h):
        return _tensor((t, h), dtype, device, g)

    row_slice = _tensor((6, 40), dtype, device)[:, 4:20].detach().requires_grad_(g)  # row stride 40
    return [
        (x(37, 8), _router(5, 8, dtype, device, g), 2, True),
        (x(9, 16), _router(17, 16, dtype, device, g), 1, False),
        (row_slice, _router(3, 16, dtype, device, g), 3, True),
        (x(5, 16), _router(130, 16, dtype, device, g), 2, True),
        (x(0, 16), _router(4, 16, dtype, device, g), 2, True),
    ]


def _moe_backward_edges(dtype, device, requires_grad):
    cases = []
    for x, w, top_k, renormalize in _moe_edges(dtype, device, False)[:3]:
        probs, weights, experts, _, _ = reference.moe.moe_route(x, w, top_k, renormalize)
        cases.append((_tensor(probs.shape, probs.dtype, device), _tensor(weights.shape, weights.dtype, device),
                      x, w, probs, experts, renormalize))
    # Expanded (stride-0) gradients, as probs.sum().backward() produces.
    grad_probs, grad_weights, x, w, probs, experts, _ = cases[0]
    cases.append((torch.ones((), dtype=probs.dtype, device=device).expand(probs.shape),
                  torch.ones((), dtype=probs.dtype, device=device).expand(experts.shape), x, w, probs, experts, False))
    return cases


# ---------------------------------------------------------------- fp8 family


def _make_quantize(*activation):
    def make_inputs(shape, dtype, device, requires_grad):
        return (_tensor(shape, dtype, device, False), *activation)
    return make_inputs


def _quantize_edges(*activation):
    def edges(dtype, device, requires_grad):
        return [(*case, *activation) for case in _quantize_edge_tensors(dtype, device)]
    return edges


def _make_quantize_concat(shape, dtype, device, requires_grad):
    x = _tensor(shape, dtype, device, False)
    return (x, "gelu_tanh", _tensor((*shape[:-1], max(1, shape[-1] // 4)), dtype, device, False))


def _quantize_concat_edges(dtype, device, requires_grad):
    """A head and an activation segment: small, the head's row strided, both
    wider than one block (held), wider than a program holds (the loop), an
    empty head, zero rows."""
    wide = _tensor((2, 5000), dtype, device)
    return [
        (_tensor((2, 3, 16), dtype, device), "gelu_tanh", _tensor((2, 3, 8), dtype, device)),
        (_tensor((4, 24), dtype, device), "none", _tensor((4, 40), dtype, device)[:, 4:20]),
        (wide, "gelu_tanh", _tensor((2, 4200), dtype, device)),
        (_tensor((2, 13000), dtype, device), "gelu_tanh", _tensor((2, 4000), dtype, device)),
        (_tensor((3, 16), dtype, device), "silu", _tensor((3, 0), dtype, device)),
        (_tensor((0, 16), dtype, device), "gelu_tanh", _tensor((0, 8), dtype, device)),
    ]


def _quantize_edge_tensors(dtype, device):
    """Rows to quantize: a DiT-like tile, a row with a large outlier and an
    all-zero row, zero rows, a row slice, 1-D, a row held in two blocks
    and one past what a program holds (the two-pass loop). Non-finite values
    are tests/test_fp8.py's: they quantize to NaN codes, and opcheck compares
    outputs without equal_nan."""
    special = _tensor((4, 16), dtype, device)
    special[0, 3], special[2] = 1000.0, 0.0
    return [
        (_tensor((2, 3, 16), dtype, device),),
        (special,),
        (_tensor((0, 16), dtype, device),),
        (_tensor((4, 40), dtype, device)[:, 4:20],),  # row stride 40
        (_tensor((24,), dtype, device),),
        (_tensor((2, 5000), dtype, device),),          # held in two blocks
        (_tensor((2, 16384 + 37), dtype, device),),    # past MAX_ROW_VALUES: the two-pass loop
    ]


# ---------------------------------------------------------------- attention family


def _qkv(b, hq, hk, lq, lk, d, seq_dim, dtype, device, g, scale=1.0):
    def t(h, length):
        shape = (b, h, length, d) if seq_dim == 2 else (b, length, h, d)
        return _tensor(shape, dtype, device, g, scale)
    return t(hq, lq), t(hk, lk), t(hk, lk)


def _attention_edges(dtype, device, requires_grad):
    # Small, because gradcheck and opcheck run every edge on the reference path.
    g = requires_grad
    q_view = _tensor((1, 4, 2, 8), dtype, device).transpose(1, 2).detach().requires_grad_(g)  # strided [B, H, L, D]
    kv_lengths = torch.tensor([5, 2], dtype=torch.int32, device=device)
    return [
        (*_qkv(1, 2, 2, 4, 4, 8, 2, dtype, device, g), 0.35, False, 2, None),
        (*_qkv(1, 2, 1, 3, 5, 12, 1, dtype, device, g), 0.3, True, 1, None),         # GQA, Lq != Lk, D padded
        (*_qkv(2, 1, 1, 3, 5, 8, 2, dtype, device, g), 0.35, False, 2, kv_lengths),   # padded keys
        (q_view, *_qkv(1, 2, 2, 4, 4, 8, 2, dtype, device, g)[1:], 0.35, True, 2, None),
        (*_qkv(1, 2, 2, 0, 4, 8, 2, dtype, device, g), 0.35, False, 2, None),         # no queries
    ]


def _make_attention(shape, dtype, device, requires_grad):
    """q, k, v ``[B, H, L, D]`` (SDPA's layout), non-causal self-attention."""
    b, length, h, d = _heads(shape)
    return (*_qkv(b, h, h, length, length, d, 2, dtype, device, requires_grad), d ** -0.5, False, 2, None)


def _int8_dtype(dtype):
    """8-bit attention takes fp16/bf16: other requested dtypes run as fp16 (the
    interpreter's bf16 dots are wrong in triton 3.6; the GPU runs both)."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16


def _attention_int8_edges(dtype, device, requires_grad):
    """The attention edges in a 16-bit dtype, keys offset by a per-channel
    constant (what the smoothing removes), no gradient (inference only)."""
    dtype = _int8_dtype(dtype)
    cases = []
    for q, k, v, scale, causal, seq_dim, kv_lengths in _attention_edges(dtype, device, False):
        offset = torch.linspace(-3, 3, k.shape[-1], device=device).to(dtype)
        cases.append((q, (k + offset).to(dtype), v, scale, causal, seq_dim, kv_lengths))
    return cases


def _make_attention_int8(shape, dtype, device, requires_grad):
    """q, k, v ``[B, L, H, D]`` (the models' layout), non-causal self-attention, 16-bit."""
    b, length, h, d = _heads(shape)
    return (*_qkv(b, h, h, length, length, d, 1, _int8_dtype(dtype), device, False), d ** -0.5, False, 1, None)


def _quantized_qk_args(q, k, v, scale, causal, seq_dim, kv_lengths, pv_fp8, fp8_rows):
    """fused.attention_qk8's arguments: q and k quantized by the specification."""
    return (*reference.attention.smooth_quantize_qk(q, k, seq_dim), v, scale, causal, seq_dim, kv_lengths,
            pv_fp8, fp8_rows)


def _attention_qk8_edges(dtype, device, requires_grad):
    """The 8-bit edges with q and k quantized, in the three P V / output modes in turn."""
    modes = ((False, False), (True, False), (True, True))
    return [_quantized_qk_args(*case, *modes[i % 3])
            for i, case in enumerate(_attention_int8_edges(dtype, device, False))]


def _make_attention_qk8(shape, dtype, device, requires_grad):
    """:func:`_make_attention_int8`'s inputs with q and k quantized, FP8 P V."""
    return _quantized_qk_args(*_make_attention_int8(shape, dtype, device, False), True, False)


def _attention_backward_edges(dtype, device, requires_grad):
    cases = []
    for q, k, v, scale, causal, seq_dim, kv_lengths in _attention_edges(dtype, device, False):
        out, lse = reference.attention.attention(q, k, v, scale, causal, seq_dim, kv_lengths)
        cases.append((_tensor(q.shape, dtype, device), q, k, v, out, lse, scale, causal, seq_dim, kv_lengths))
    return cases


def _banded_lists(n_q_blocks, n_k_blocks, device, batch=1, heads=1, width=None):
    """Block lists where query block i attends to key blocks 0 (a sink), i - 1
    and i + 1 (clipped), ascending, padded to ``width`` with entries past
    the count set to 0."""
    i = torch.arange(n_q_blocks, device=device)[:, None]
    j = torch.arange(n_k_blocks, device=device)[None, :]
    mask = (j == 0) | ((i - j).abs() == 1)
    index, count = reference.block_sparse.block_index_from_mask(mask.expand(batch, heads, -1, -1))
    width = n_k_blocks if width is None else width
    return index[..., :width].contiguous(), count.clamp(max=width).contiguous()


def _block_sparse_edges(dtype, device, requires_grad):
    g = requires_grad
    kv_lengths = torch.tensor([200, 1], dtype=torch.int32, device=device)
    empty_rows = torch.zeros(1, 1, 2, 2, dtype=torch.int32, device=device), \
        torch.tensor([[[1, 0]]], dtype=torch.int32, device=device)  # the second query block lists nothing
    return [
        (*_qkv(1, 1, 1, 130, 140, 4, 2, dtype, device, g), *_banded_lists(2, 2, device), 0.5, False, 2, None),
        (*_qkv(2, 2, 1, 150, 260, 8, 1, dtype, device, g), *_banded_lists(2, 3, device, 2, 2, width=2), 0.35,
         True, 1, kv_lengths),                                                       # GQA, per-head lists
        (*_qkv(1, 1, 1, 140, 70, 8, 2, dtype, device, g), *empty_rows, 0.35, False, 2, None),
        (*_qkv(1, 2, 2, 0, 4, 8, 2, dtype, device, g), *_banded_lists(0, 1, device), 0.35, False, 2, None),
    ]


def _make_block_sparse(shape, dtype, device, requires_grad):
    """q, k, v ``[B, H, L, D]`` with banded block lists shared by every head."""
    b, length, h, d = _heads(shape)
    n = (length + 127) // 128
    return (*_qkv(b, h, h, length, length, d, 2, dtype, device, requires_grad), *_banded_lists(n, n, device),
            d ** -0.5, False, 2, None)


def _block_sparse_backward_edges(dtype, device, requires_grad):
    cases = []
    for q, k, v, index, count, scale, causal, seq_dim, kv_lengths in _block_sparse_edges(dtype, device, False):
        out, lse = reference.block_sparse.block_sparse_attention(q, k, v, index, count, scale, causal, seq_dim,
                                                                 kv_lengths)
        cases.append((_tensor(q.shape, dtype, device), q, k, v, out, lse, index, count, scale, causal, seq_dim,
                      kv_lengths))
    return cases


#: GEGLU on a DiT feed-forward's hidden: Flux/SD3 (hidden 3072, MLP ratio 4) at
#: 1024x1024 image tokens, the anchors' shapes.
GLU_SHAPES = ((1, 4608, 24576), (2, 4096, 24576))

#: DiT activation shapes from docs/design.md: Flux/SD3 (3072), Wan/LTX-like
#: long sequences (1536), HunyuanVideo-sized hidden (5120).
DIT_NORM_SHAPES = ((2, 4096, 3072), (1, 32768, 1536), (1, 16384, 5120))

#: q/k of Flux at 1024x1024 (24 heads of 128) and Wan 2.1 at 480p x 81 frames
#: (12 heads of 128 at 1536): [1,24,4608,128] and [1,12,32760,128].
ROPE_SHAPES = ((1, 4608, 3072), (1, 32760, 1536))
#: FP8 activations. Flux.1-dev's at 1024x1024: the double block's MLP hidden
#: activation (4096 image tokens, 12288 wide), the single block's (4608 tokens,
#: with the attention output's 3072 columns as the concatenation's head), an
#: attention output (3072 wide, no activation); Wan 2.1 1.3B's MLP hidden
#: activation at 480p (32760 tokens, 8960 wide).
FP8_SHAPES = ((1, 4096, 12288), (1, 4608, 12288), (1, 4096, 3072), (1, 32760, 8960))

#: MoE routing at its target's shapes ``[1, T, H]`` (docs/notes/moe.md): 4096 tokens of width 4096
#: (E = 64, k = 2), and HiDream-I1's width 2560 (E = 4, k = 2).
MOE_SHAPES = ((1, 4096, 4096),)
MOE_HIDREAM_SHAPES = ((1, 4096, 2560),)

OPS: tuple[OpSpec, ...] = (
    OpSpec("rmsnorm", "norm", reference.norm.rmsnorm, _make(_rmsnorm_args),
           _norm_edges(_rmsnorm_args), bench_shapes=DIT_NORM_SHAPES),
    OpSpec("add_rmsnorm", "norm", reference.norm.add_rmsnorm, _make(_add_rmsnorm_args),
           _norm_edges(_add_rmsnorm_args), bench_shapes=DIT_NORM_SHAPES),
    OpSpec("layernorm", "norm", reference.norm.layernorm, _make(_layernorm_args),
           _norm_edges(_layernorm_args), bench_shapes=DIT_NORM_SHAPES),
    OpSpec("norm_backward", "norm", reference.norm.norm_backward, None,
           _norm_backward_edges, differentiable=False),
    OpSpec("modulate", "modulate", reference.modulate.modulate, _make_modulation(_modulate_args),
           _modulation_edges(_modulate_args), bench_shapes=DIT_NORM_SHAPES[:1]),
    OpSpec("norm_modulate", "modulate", reference.modulate.norm_modulate,
           _make_modulation(_norm_modulate_args("layernorm")), _modulation_edges(_norm_modulate_args("layernorm")),
           bench_shapes=DIT_NORM_SHAPES),
    OpSpec("gated_residual", "modulate", reference.modulate.gated_residual,
           _make_modulation(_gated_residual_args), _modulation_edges(_gated_residual_args),
           bench_shapes=DIT_NORM_SHAPES[:1]),
    OpSpec("gated_residual_norm_modulate", "modulate", reference.modulate.gated_residual_norm_modulate,
           _make_modulation(_gated_residual_norm_modulate_args("layernorm")),
           _modulation_edges(_gated_residual_norm_modulate_args("rmsnorm")), bench_shapes=DIT_NORM_SHAPES),
    # The FP8 output modes (inference only): the same arguments, e4m3 rows + scales out.
    OpSpec("norm_modulate_fp8", "modulate", reference.modulate.norm_modulate_fp8,
           _make_modulation(_norm_modulate_args("layernorm")), _modulation_edges(_norm_modulate_args("rmsnorm")),
           differentiable=False, bench_shapes=DIT_NORM_SHAPES[:1]),
    OpSpec("gated_residual_norm_modulate_fp8", "modulate", reference.modulate.gated_residual_norm_modulate_fp8,
           _make_modulation(_gated_residual_norm_modulate_args("layernorm")),
           _modulation_edges(_gated_residual_norm_modulate_args("layernorm")), differentiable=False,
           bench_shapes=DIT_NORM_SHAPES[:1]),
    OpSpec("modulate_backward", "modulate", reference.modulate.modulate_backward, None,
           _modulate_backward_edges, differentiable=False),
    OpSpec("rope", "rope", reference.rope.rope, _make_rope, _rope_edges, bench_shapes=ROPE_SHAPES,
           backward_reads_inputs=False),
    OpSpec("rope_qk", "rope", reference.rope.rope_qk, _make_rope_qk, _rope_qk_edges, bench_shapes=ROPE_SHAPES,
           backward_reads_inputs=False),
    OpSpec("rope_grid", "rope", reference.rope.rope_grid, _make_rope_grid, _rope_grid_edges,
           bench_shapes=ROPE_SHAPES, backward_reads_inputs=False),
    OpSpec("qk_norm_rope", "rope", reference.rope.qk_norm_rope, _make_qk_norm_rope, _qk_norm_rope_edges,
           bench_shapes=ROPE_SHAPES),
    OpSpec("qk_norm_rope_backward", "rope", reference.rope.qk_norm_rope_backward, None,
           _qk_norm_rope_backward_edges, differentiable=False),
    # 8-bit attention's q and k from the rotation's kernel (inference only).
    OpSpec("qk_rope_int8", "rope", reference.rope.qk_rope_int8, _make_qk_rope_int8, _qk_rope_int8_edges,
           differentiable=False),
    OpSpec("geglu", "glu", reference.glu.geglu, _make_glu("none"), _glu_edges("none"), bench_shapes=GLU_SHAPES),
    OpSpec("geglu_tanh", "glu", reference.glu.geglu, _make_glu("tanh"), _glu_edges("tanh"),
           bench_shapes=GLU_SHAPES, op_name="geglu"),
    OpSpec("swiglu", "glu", reference.glu.swiglu, _make_glu(), _glu_edges(), bench_shapes=GLU_SHAPES),
    OpSpec("glu_backward", "glu", reference.glu.glu_backward, None, _glu_backward_edges, differentiable=False),
    OpSpec("moe_route", "moe", reference.moe.moe_route, _make_moe(64, 2, True), _moe_edges,
           bench_shapes=MOE_SHAPES),
    # HiDream-I1's gate: 4 experts, 2 per token, not renormalized.
    OpSpec("moe_route_hidream", "moe", reference.moe.moe_route, _make_moe(4, 2, False),
           lambda dtype, device, g: _moe_edges(dtype, device, g)[1:2], bench_shapes=MOE_HIDREAM_SHAPES,
           op_name="moe_route"),
    OpSpec("moe_route_backward", "moe", reference.moe.moe_route_backward, None, _moe_backward_edges,
           differentiable=False),
    # Inference only: its autograd formula raises (no gradient to check).
    OpSpec("quantize_fp8_rows", "fp8", reference.fp8.quantize_fp8_rows, _make_quantize(), _quantize_edges(),
           differentiable=False, bench_shapes=FP8_SHAPES[2:]),
    # The MLP's hidden activation quantized in the same pass (the kernel's ACT).
    OpSpec("quantize_fp8_rows_gelu_tanh", "fp8", reference.fp8.quantize_fp8_rows, _make_quantize("gelu_tanh"),
           _quantize_edges("gelu_tanh"), differentiable=False, op_name="quantize_fp8_rows",
           bench_shapes=FP8_SHAPES[:1] + FP8_SHAPES[3:]),
    # ... and the row concatenation of a head and the activation (Flux's single block).
    OpSpec("quantize_fp8_rows_concat", "fp8", reference.fp8.quantize_fp8_rows, _make_quantize_concat,
           _quantize_concat_edges, differentiable=False, op_name="quantize_fp8_rows",
           bench_shapes=FP8_SHAPES[1:2]),
    OpSpec("attention", "attention", reference.attention.attention, _make_attention, _attention_edges, tf32=True),
    OpSpec("attention_backward", "attention", reference.attention.attention_backward, None,
           _attention_backward_edges, differentiable=False),
    # Inference only: its autograd formula raises.
    OpSpec("attention_int8", "attention", reference.attention.attention_int8, _make_attention_int8,
           _attention_int8_edges, differentiable=False),
    OpSpec("attention_int8_fp8", "attention", reference.attention.attention_int8_fp8, _make_attention_int8,
           _attention_int8_edges, differentiable=False),
    # Its output as the FP8 rows the output projection reads (a quantizing epilogue).
    OpSpec("attention_int8_fp8_rows", "attention", reference.attention.attention_int8_fp8_rows,
           _make_attention_int8, _attention_int8_edges, differentiable=False),
    # ... on q and k quantized by fused.qk_rope_int8.
    OpSpec("attention_qk8", "attention", reference.attention.attention_qk8, _make_attention_qk8,
           _attention_qk8_edges, differentiable=False),
    OpSpec("block_sparse_attention", "block_sparse", reference.block_sparse.block_sparse_attention,
           _make_block_sparse, _block_sparse_edges, tf32=True),
    OpSpec("block_sparse_attention_backward", "block_sparse", reference.block_sparse.block_sparse_attention_backward,
           None, _block_sparse_backward_edges, differentiable=False),
)

BY_NAME = {spec.name: spec for spec in OPS}
