"""Inputs of the modulate family's ops: modulate, norm_modulate, the gated residual seams,
their FP8 output modes and modulate_backward.

An ``*_args`` builder ``build(x, mod_shape, affine, dtype, device, g)`` turns an
activation ``x [..., C]`` into an op's arguments, its modulation tensors of
``mod_shape`` (broadcast against x; ``affine``: the norm's weight and bias);
:func:`make_modulation` and :func:`modulation_edges` make the row's
``make_inputs`` and ``edge_inputs`` of one.
"""

from cases._tensors import param, tensor
from compile_ops import reference


def _modulation(shape, dtype, device, g, scale=0.5):
    return (scale * tensor(shape, dtype, device)).requires_grad_(g)


def modulate_args(x, mod_shape, affine, dtype, device, g):
    """``(x, scale, shift)``, both of ``mod_shape``."""
    return (x, _modulation(mod_shape, dtype, device, g), _modulation(mod_shape, dtype, device, g, 1.0))


def _affine_params(c, affine, dtype, device, g):
    if not affine:
        return None, None
    return param(c, dtype, device, g), (0.1 * tensor((c,), dtype, device)).requires_grad_(g)


def norm_modulate_args(norm):
    """The builder of norm_modulate's arguments with ``norm`` (``"layernorm"``,
    ``"rmsnorm"``): :func:`modulate_args`, then ``weight [C], bias [C]`` (None
    without ``affine``), ``norm``, ``eps``."""

    def build(x, mod_shape, affine, dtype, device, g, eps=1e-6):
        return (
            *modulate_args(x, mod_shape, affine, dtype, device, g),
            *_affine_params(x.shape[-1], affine, dtype, device, g),
            norm,
            eps,
        )

    return build


def gated_residual_args(x, mod_shape, affine, dtype, device, g):
    """``(residual like x, x, gate of mod_shape)``."""
    return (tensor(x.shape, dtype, device, g), x, _modulation(mod_shape, dtype, device, g))


def gated_residual_norm_modulate_args(norm):
    """The builder of the seam's arguments: :func:`gated_residual_args`, then
    :func:`norm_modulate_args` ``(norm)``'s past x."""

    def build(x, mod_shape, affine, dtype, device, g, eps=1e-6):
        return (
            *gated_residual_args(x, mod_shape, affine, dtype, device, g),
            *norm_modulate_args(norm)(x, mod_shape, affine, dtype, device, g, eps)[1:],
        )

    return build


def modulation_edges(build):
    """Edge cases shared by the modulation ops: every broadcast form of the
    modulation tensors, strided and 2-D x, zero rows, odd widths."""

    def edges(dtype, device, requires_grad):
        g = requires_grad
        strided = tensor((4, 40), dtype, device)[:, 4:20].detach().requires_grad_(g)  # row stride 40
        cases = [
            ((2, 3, 16), (2, 16), True),  # per sample, diffusers' chunk of the embedding
            ((2, 3, 16), (2, 3, 16), False),  # per token
            ((2, 4, 16), (2, 2, 1, 16), True),  # per frame: x read as [2, 2, 2, 16]
            ((3, 16), (16,), False),  # 2-D x, per channel
            ((2, 5, 33), (1, 1, 33), True),  # width not a block multiple, batch-broadcast
            ((0, 3, 16), (0, 16), True),  # zero rows
        ]
        out = [
            build(tensor(x_shape, dtype, device, g), m_shape, affine, dtype, device, g)
            for x_shape, m_shape, affine in cases
        ]
        out.append(build(strided, (), False, dtype, device, g))  # strided rows, 0-dim modulation
        return out

    return edges


def make_modulation(build):
    """``make_inputs`` of a modulation op: per-sample ``[B, C]`` modulation, as
    diffusers' AdaLayerNormZero chunks it from the timestep embedding."""

    def make_inputs(shape, dtype, device, requires_grad):
        return build(
            tensor(shape, dtype, device, requires_grad), (shape[0], shape[-1]), False, dtype, device, requires_grad
        )

    return make_inputs


def modulate_backward_edges(dtype, device, requires_grad):
    """modulate_backward's cases: the backward of each op of the family, with
    per-sample, per-token and broadcast modulation, and zero rows."""

    def t(shape, scale=1.0):
        return tensor(shape, dtype, device, scale=scale)

    x, per_sample, per_token = t((2, 3, 16)), (2, 16), (2, 3, 16)
    w, b = param(16, dtype, device, False), param(16, dtype, device, False)
    # The forward's row statistics of x, as norm_modulate returns them.
    _, mean, rstd = reference.modulate.norm_modulate(x, t(per_sample), t(per_sample), None, None, "layernorm", 1e-6)
    _, no_mean, rms_rstd = reference.modulate.norm_modulate(
        x, t(per_sample), t(per_sample), None, None, "rmsnorm", 1e-6
    )
    return [
        # modulate; norm_modulate with and without affine, statistics given and recomputed;
        # gated_residual; the seam.
        (t(x.shape), None, x, None, None, None, None, t(per_sample, 0.5), t(per_sample), None, None, "none", 0.0),
        (t(x.shape), None, x, mean, rstd, None, None, t(per_sample, 0.5), t(per_token), w, b, "layernorm", 1e-6),
        (t(x.shape), None, x, None, None, None, None, t((), 0.5), t((16,)), None, None, "rmsnorm", 1e-6),
        (None, t(x.shape), x, None, None, t(x.shape), t(per_token), None, None, None, None, "none", 0.0),
        (
            t(x.shape),
            t(x.shape),
            x,
            no_mean,
            rms_rstd,
            t(x.shape),
            t(per_sample),
            t((2, 1, 16), 0.5),
            t(per_sample),
            w,
            None,
            "rmsnorm",
            1e-6,
        ),
        (
            t((0, 3, 16)),
            None,
            t((0, 3, 16)),
            None,
            None,
            None,
            None,
            t((0, 16)),
            t((0, 16)),
            None,
            None,
            "layernorm",
            1e-6,
        ),
    ]
