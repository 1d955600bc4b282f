"""Shape, dtype and layout rules of the RoPE family, and its validation (torch only).

x is ``[B, L, H, D]`` (``seq_dim=1``) or ``[B, H, L, D]`` (``seq_dim=2``, SDPA's
and diffusers' ``apply_rotary_emb`` default), any strides. The first
``rotary_dim`` (default D) channels are rotated in pairs, the rest pass through.
cos/sin are ``[L, T]`` or per batch ``[B, L, T]`` with ``T = rotary_dim`` (a
full table, as diffusers builds it: each angle twice) or ``T = rotary_dim / 2``
(one entry per pair). Pairs are ``(i, i + R/2)`` (half-split, diffusers'
``use_real_unbind_dim=-2``) or ``(2i, 2i + 1)`` (``interleaved``, ``-1``: Flux,
CogVideoX, HunyuanVideo).
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch

from compile_ops.meta._validate import check_eps, check_floating, check_same_device, fail
from compile_ops.meta.attention import INT8_DTYPES, int8_qk_shapes


def rotary_dim_of(op: str, x: torch.Tensor, rotary_dim: Optional[int]):
    d = x.shape[-1]
    if rotary_dim is None:
        if d % 2:
            fail(op, f"x's head dim D={d} is odd; pass an even rotary_dim to rotate part of it")
        return d
    if (
        not isinstance(rotary_dim, (int, torch.SymInt))
        or isinstance(rotary_dim, bool)
        or rotary_dim % 2
        or not 0 < rotary_dim <= d
    ):
        fail(op, f"rotary_dim must be an even int in [2, D={d}], got {rotary_dim!r}")
    return rotary_dim


def check_rope(
    op: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_dim: int, rotary_dim: Optional[int]
) -> tuple[int, bool]:
    """Validate; ``(rotary_dim, half_table)``."""
    check_floating(op, "x", x)
    if x.dim() != 4:
        fail(op, f"x must be [B, L, H, D] or [B, H, L, D] (4 dims), got shape {tuple(x.shape)}")
    if seq_dim not in (1, 2) or isinstance(seq_dim, bool):
        fail(op, f"seq_dim must be 1 ([B, L, H, D]) or 2 ([B, H, L, D]), got {seq_dim!r}")
    r = rotary_dim_of(op, x, rotary_dim)
    length = x.shape[seq_dim]
    for argname, t in (("cos", cos), ("sin", sin)):
        check_floating(op, argname, t)
        check_same_device(op, x, **{argname: t})
        if t.dim() not in (2, 3):
            fail(op, f"{argname} must be [L, T] or [B, L, T], got shape {tuple(t.shape)}")
        if t.shape[-2] != length:
            fail(op, f"{argname} has {t.shape[-2]} positions but x has L={length} along seq_dim={seq_dim}")
        if t.dim() == 3 and t.shape[0] not in (1, x.shape[0]):
            fail(op, f"{argname} of shape {tuple(t.shape)} is per batch but x has B={x.shape[0]}")
        if t.shape[-1] not in (r, r // 2):
            fail(
                op,
                f"{argname} must have rotary_dim={r} (a full table) or {r // 2} (one entry "
                f"per pair) columns, got {t.shape[-1]}",
            )
    if cos.shape != sin.shape:
        fail(op, f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    return table_layout(x, cos, rotary_dim)


def table_layout(x: torch.Tensor, cos: torch.Tensor, rotary_dim: Optional[int]) -> tuple[int, bool]:
    """``(rotary_dim, half_table)`` of arguments :func:`check_rope` accepted."""
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    return r, cos.shape[-1] == r // 2


def check_qk(op: str, q: torch.Tensor, k: torch.Tensor, seq_dim: int) -> None:
    """q and k go through one launch: same dtype, device, batch, length and head dim
    (head counts may differ: GQA/MQA)."""
    check_floating(op, "q", q)
    check_floating(op, "k", k)
    if q.dim() != 4 or k.dim() != 4:
        fail(
            op,
            f"q and k must be [B, L, H, D] or [B, H, L, D] (4 dims), got shapes {tuple(q.shape)} and {tuple(k.shape)}",
        )
    if q.dtype != k.dtype:
        fail(op, f"q and k must have the same dtype, got {q.dtype} and {k.dtype}", TypeError)
    if k.device != q.device:
        fail(op, f"k is on {k.device} but q is on {q.device}; all tensors must share a device")
    if seq_dim not in (1, 2) or isinstance(seq_dim, bool):
        fail(op, f"seq_dim must be 1 ([B, L, H, D]) or 2 ([B, H, L, D]), got {seq_dim!r}")
    for what, dim in (("batch size", 0), ("length (seq_dim)", seq_dim), ("head dim", 3)):
        if q.shape[dim] != k.shape[dim]:
            fail(op, f"q and k must have the same {what}, got shapes {tuple(q.shape)} and {tuple(k.shape)}")


def check_norm_weight(op: str, argname: str, w: torch.Tensor, x: torch.Tensor, xname: str, seq_dim: int) -> None:
    """``w`` is ``[D]`` (each head normalized on its own) or ``[H * D]`` (the
    norm spans every head of a position: :func:`norm_spans_heads`)."""
    check_floating(op, argname, w)
    d, heads = x.shape[-1], x.shape[3 - seq_dim]
    if w.shape != (d,) and w.shape != (heads * d,):
        fail(
            op,
            f"{argname} must have shape ({d},), the head dim of {xname}, or ({heads * d},), its heads x head dim, "
            f"got {tuple(w.shape)}",
        )
    check_same_device(op, x, **{argname: w})


def check_norm_weights(op: str, q_weight, k_weight, q: torch.Tensor, k: torch.Tensor, seq_dim: int) -> None:
    """q's and k's norm weights: each ``[D]`` or ``[H * D]`` of its tensor, and
    both norms of one kind (a tensor with one head fits either)."""
    check_norm_weight(op, "q_weight", q_weight, q, "q", seq_dim)
    check_norm_weight(op, "k_weight", k_weight, k, "k", seq_dim)
    q_spans, k_spans = norm_spans_heads(q_weight, q), norm_spans_heads(k_weight, k)
    if (q_spans and not k_spans and k.shape[3 - seq_dim] > 1) or (k_spans and not q_spans and q.shape[3 - seq_dim] > 1):
        fail(
            op,
            "q_weight and k_weight must both be per head ([D]) or both span the heads ([H * D]), got shapes "
            f"{tuple(q_weight.shape)} and {tuple(k_weight.shape)} for q {tuple(q.shape)} and k {tuple(k.shape)}",
        )


def norms_span_heads(q_weight, k_weight, q: torch.Tensor, k) -> bool:
    """Whether q's or k's checked norm weight spans its heads (weights or k may
    be None): :func:`check_norm_weights` made both norms of one kind."""
    return any(w is not None and x is not None and norm_spans_heads(w, x) for w, x in ((q_weight, q), (k_weight, k)))


def norm_spans_heads(w: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether a checked norm weight ``w`` of ``x`` spans its heads (``[H * D]``,
    H > 1: Wan's and LTX's q/k norms) rather than one head (``[D]``: Flux's).
    With one head the two are the same norm."""
    return w.shape[0] != x.shape[-1]


def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    seq_dim: int,
    rotary_dim: Optional[int] = None,
    inverse: bool = False,
) -> torch.Tensor:
    check_rope("rope", x, cos, sin, seq_dim, rotary_dim)
    return x.new_empty(x.shape)


def rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    seq_dim: int,
    rotary_dim: Optional[int] = None,
    inverse: bool = False,
):
    check_qk("rope_qk", q, k, seq_dim)
    check_rope("rope_qk", q, cos, sin, seq_dim, rotary_dim)
    return q.new_empty(q.shape), k.new_empty(k.shape)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    interleaved: bool,
    seq_dim: int,
    rotary_dim: Optional[int] = None,
):
    check_qk("qk_norm_rope", q, k, seq_dim)
    check_rope("qk_norm_rope", q, cos, sin, seq_dim, rotary_dim)
    check_norm_weights("qk_norm_rope", q_weight, k_weight, q, k, seq_dim)
    check_eps("qk_norm_rope", eps)
    return q.new_empty(q.shape), k.new_empty(k.shape)


def qk_rope_int8(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: Optional[torch.Tensor],
    k_weight: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    interleaved: bool,
    seq_dim: int,
    rotary_dim: Optional[int] = None,
) -> tuple:
    """``(q8, q_scale [B, Hq, L], k8, k_scale [B, Hk, ceil(L / 128)])``: the
    int8 tensors in q's and k's shapes, contiguous; the scales fp32."""
    op = "qk_rope_int8"
    check_qk(op, q, k, seq_dim)
    check_rope(op, q, cos, sin, seq_dim, rotary_dim)
    if (q_weight is None) != (k_weight is None):
        fail(
            op,
            "q_weight and k_weight must both be given (RMSNorm of q and k, then RoPE) or both be None "
            f"(RoPE alone), got q_weight={'None' if q_weight is None else 'a tensor'} and "
            f"k_weight={'None' if k_weight is None else 'a tensor'}",
        )
    if q_weight is not None:
        check_norm_weights(op, q_weight, k_weight, q, k, seq_dim)
        check_eps(op, eps)
    if q.dtype not in INT8_DTYPES:
        fail(
            op,
            f"q and k must be float16 or bfloat16 (8-bit attention quantizes 16-bit activations), got {q.dtype}",
            TypeError,
        )
    return int8_qk_shapes(q, k, seq_dim)


def qk_norm_rope_backward(
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    interleaved: bool,
    seq_dim: int,
    rotary_dim: Optional[int] = None,
):
    qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, interleaved, seq_dim, rotary_dim)
    for argname, g, x in (("grad_q", grad_q, q), ("grad_k", grad_k, k)):
        if g.shape != x.shape:
            fail("qk_norm_rope_backward", f"{argname} must have shape {tuple(x.shape)}, got {tuple(g.shape)}")
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        q_weight.new_empty(q_weight.shape),
        k_weight.new_empty(k_weight.shape),
    )


# ------------------------------------------------------------ 3D (video) RoPE

#: Rows of :meth:`GridRope.constants`, the per-pair constants the kernel reads.
GRID_CONSTANT_ROWS = ("slope_1", "slope_2", "slope_3", "intercept_hi", "intercept_lo", "axis")
#: Grid indices stay below this, so that index x (12-bit slope part) is exact in fp32.
GRID_MAX_INDEX = 4096


def _split_12_bits(v: torch.Tensor) -> torch.Tensor:
    """``v`` (fp64) rounded to 12 significant bits."""
    mantissa, exponent = torch.frexp(v)
    return torch.ldexp(torch.round(mantissa * 4096.0) / 4096.0, exponent)


@dataclass(frozen=True)
class GridRope:
    """A RoPE whose angles come from a token's (frame, row, column) position on
    a ``frames x height x width`` grid of patches (row-major token order):
    ``angle(token, p) = (idx[axes[p]] * position_scale[a] + position_offset[a]) * frequencies[p]``
    for pair ``p``, ``a = axes[p]``; ``axes[p] = -1`` leaves the pair unrotated.

    Build one with :func:`grid_rope` for the Wan, HunyuanVideo and LTX-Video
    conventions.
    """

    frequencies: tuple[float, ...]
    axes: tuple[int, ...]
    position_scale: tuple[float, float, float] = (1.0, 1.0, 1.0)
    position_offset: tuple[float, float, float] = (0.0, 0.0, 0.0)
    interleaved: bool = True

    def __post_init__(self):
        if len(self.frequencies) != len(self.axes) or not self.axes:
            raise ValueError(
                f"GridRope: frequencies and axes must be non-empty and of one length (pairs), "
                f"got {len(self.frequencies)} and {len(self.axes)}"
            )
        if any(a not in (-1, 0, 1, 2) for a in self.axes):
            raise ValueError(
                f"GridRope: axes must be 0 (frame), 1 (row), 2 (column) or -1 (unrotated), got {sorted(set(self.axes))}"
            )
        if len(self.position_scale) != 3 or len(self.position_offset) != 3:
            raise ValueError(
                "GridRope: position_scale and position_offset need one entry per axis (frame, row, column)"
            )

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.axes)

    def slopes_and_intercepts(self) -> tuple[list[float], list[float]]:
        """Per pair: ``angle = idx * slope + intercept`` (float64 values)."""
        slopes, intercepts = [], []
        for f, a in zip(self.frequencies, self.axes):
            slopes.append(0.0 if a < 0 else self.position_scale[a] * f)
            intercepts.append(0.0 if a < 0 else self.position_offset[a] * f)
        return slopes, intercepts

    def constants(self, device=None) -> torch.Tensor:
        """``[6, P]`` fp32 (rows :data:`GRID_CONSTANT_ROWS`): the slope in three
        parts (two of 12 significant bits, then the rest), the intercept as a
        head and the rest, and the axis (see ``kernels/rope_common.py``)."""
        slopes, intercepts = (torch.tensor(v, dtype=torch.float64) for v in self.slopes_and_intercepts())
        slope_1 = _split_12_bits(slopes)
        slope_2 = _split_12_bits(slopes - slope_1)
        slope_3 = slopes - slope_1 - slope_2
        icpt_hi = intercepts.to(torch.float32).double()
        rows = [slope_1, slope_2, slope_3, icpt_hi, intercepts - icpt_hi, torch.tensor(self.axes).double()]
        return torch.stack(rows).to(torch.float32).to(device)


#: LTXPipeline's ``rope_interpolation_scale``: (VAE temporal ratio / frame
#: rate, VAE spatial ratio, VAE spatial ratio) with ratios (8, 32) at 25 fps.
LTX_PIPELINE_INTERPOLATION_SCALE = (8.0 / 25.0, 32.0, 32.0)


def _axis_blocks(axes_dims, theta: float):
    """Consecutive blocks of pairs, one per axis: pair i of a block of dim d turns
    at theta ** (-2i / d) (Wan's and HunyuanVideo's per-axis 1D RoPE)."""
    frequencies, axes = [], []
    for axis, d in enumerate(axes_dims):
        frequencies += [float(theta) ** (-2.0 * i / d) for i in range(d // 2)]
        axes += [axis] * (d // 2)
    return tuple(frequencies), tuple(axes)


def _wan(dim: int, theta: float = 10000.0) -> GridRope:
    """Wan 2.x (``WanRotaryPosEmbed``): height and width get 2 * (D // 6)
    channels each, frames the rest; raw patch indices; interleaved."""
    if dim % 2 or dim < 6:
        raise ValueError(
            f"grid_rope('wan'): head dim {dim} cannot be split into three even axis blocks "
            f"(an even dim >= 6: 2 * (dim // 6) for height and width, the rest for frames)"
        )
    hw = 2 * (dim // 6)
    return GridRope(*_axis_blocks((dim - 2 * hw, hw, hw), theta), interleaved=True)


def _hunyuan(dim: int, theta: float = 256.0, axes_dims=(16, 56, 56)) -> GridRope:
    """HunyuanVideo (``HunyuanVideoRotaryPosEmbed``, the config's ``rope_axes_dim``):
    per-axis blocks of ``axes_dims`` channels; raw patch indices; interleaved."""
    axes_dims = tuple(int(d) for d in axes_dims)
    if len(axes_dims) != 3 or any(d <= 0 or d % 2 for d in axes_dims):
        raise ValueError(f"grid_rope('hunyuan'): axes_dims must be three positive even sizes, got {axes_dims}")
    if sum(axes_dims) != dim:
        raise ValueError(f"grid_rope('hunyuan'): axes_dims {axes_dims} sum to {sum(axes_dims)}, not the head dim {dim}")
    return GridRope(*_axis_blocks(axes_dims, theta), interleaved=True)


def _ltx(
    dim: int,
    theta: float = 10000.0,
    base_num_frames: float = 20,
    base_height: float = 2048,
    base_width: float = 2048,
    patch_size: int = 1,
    patch_size_t: int = 1,
    rope_interpolation_scale=LTX_PIPELINE_INTERPOLATION_SCALE,
) -> GridRope:
    """LTX-Video (``LTXVideoRotaryPosEmbed``), over the whole inner dim: K = dim // 6
    frequencies (pi/2) * theta ** (k / (K - 1)), each shared by the three axes
    (pairs ordered (k, axis), axis fastest) after (dim % 6) / 2 unrotated pairs;
    position 2 * idx * scale * patch / base - 1 (raw 2 * idx - 1 when
    ``rope_interpolation_scale`` is None); interleaved."""
    if dim % 2 or dim < 6:
        raise ValueError(
            f"grid_rope('ltx'): dim {dim} cannot be split: an even dim >= 6 "
            f"(dim // 6 frequencies per axis, dim % 6 leading channels unrotated)"
        )
    count = dim // 6
    pads = (dim % 6) // 2
    frequencies, axes = [0.0] * pads, [-1] * pads
    for k in range(count):
        f = (math.pi / 2.0) * float(theta) ** (k / (count - 1) if count > 1 else 0.0)
        frequencies += [f, f, f]
        axes += [0, 1, 2]
    if rope_interpolation_scale is None:
        scale = (2.0, 2.0, 2.0)
    else:
        s = tuple(float(v) for v in rope_interpolation_scale)
        if len(s) != 3:
            raise ValueError("grid_rope('ltx'): rope_interpolation_scale needs 3 entries (frame, row, column)")
        scale = (
            2.0 * s[0] * patch_size_t / base_num_frames,
            2.0 * s[1] * patch_size / base_height,
            2.0 * s[2] * patch_size / base_width,
        )
    return GridRope(tuple(frequencies), tuple(axes), scale, (-1.0, -1.0, -1.0), interleaved=True)


_CONVENTIONS = {"wan": _wan, "hunyuan": _hunyuan, "ltx": _ltx}


def grid_rope(convention: str, dim: int, **overrides) -> GridRope:
    """The :class:`GridRope` of a video transformer's 3D RoPE.

    Args:
        convention: "wan", "hunyuan" or "ltx".
        dim: the head dim for "wan" and "hunyuan"; for "ltx" the dim the model
            gives its rotary class, its whole inner dim (heads * head_dim): LTX
            rotates q and k before splitting heads (view them as ``[B, L, 1, dim]``).
        overrides: the settings a model config can change. wan: ``theta``;
            hunyuan: ``theta``, ``axes_dims`` (``rope_axes_dim``); ltx: ``theta``,
            ``base_num_frames``, ``base_height``, ``base_width``, ``patch_size``,
            ``patch_size_t``, ``rope_interpolation_scale`` (default
            LTXPipeline's (8/25, 32, 32)).
    """
    if convention not in _CONVENTIONS:
        raise ValueError(f"fused.grid_rope: unknown convention {convention!r}; expected one of {sorted(_CONVENTIONS)}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
        raise ValueError(f"fused.grid_rope: dim must be a positive int, got {dim!r}")
    try:
        return _CONVENTIONS[convention](dim, **overrides)
    except TypeError as e:
        raise TypeError(f"fused.grid_rope({convention!r}): {e}") from None


def check_grid(op: str, q: torch.Tensor, constants: torch.Tensor, height: int, width: int, seq_dim: int) -> int:
    """Validate the grid arguments; the rotary dim."""
    if (
        not isinstance(constants, torch.Tensor)
        or constants.dtype != torch.float32
        or constants.dim() != 2
        or constants.shape[0] != len(GRID_CONSTANT_ROWS)
    ):
        fail(
            op,
            f"constants must be a [{len(GRID_CONSTANT_ROWS)}, P] fp32 tensor from GridRope.constants(), got "
            + (
                f"{constants.dtype} of shape {tuple(constants.shape)}"
                if isinstance(constants, torch.Tensor)
                else type(constants).__name__
            ),
        )
    check_same_device(op, q, constants=constants)
    r = 2 * constants.shape[1]
    if r > q.shape[-1]:
        fail(op, f"the grid RoPE rotates {r} channels but q's head dim is D={q.shape[-1]}")
    for argname, v in (("height", height), ("width", width)):
        if not isinstance(v, (int, torch.SymInt)) or isinstance(v, bool) or not 1 <= v <= GRID_MAX_INDEX:
            fail(op, f"{argname} must be an int in [1, {GRID_MAX_INDEX}], got {v!r}")
    length = q.shape[seq_dim]
    if length % (height * width):
        fail(
            op,
            f"q has L={length} tokens along seq_dim={seq_dim}, not a whole number of "
            f"height x width = {height} x {width} frames",
        )
    if length > GRID_MAX_INDEX * height * width:
        fail(op, f"q has {length // (height * width)} frames of {height} x {width}; at most {GRID_MAX_INDEX}")
    return r


def rope_grid(
    q: torch.Tensor,
    k: torch.Tensor,
    constants: torch.Tensor,
    height: int,
    width: int,
    interleaved: bool,
    seq_dim: int,
    inverse: bool = False,
):
    check_qk("rope_grid", q, k, seq_dim)
    check_grid("rope_grid", q, constants, height, width, seq_dim)
    return q.new_empty(q.shape), k.new_empty(k.shape)
