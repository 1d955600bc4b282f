"""The 3D RoPE conventions (``grid_rope``: Wan, HunyuanVideo, LTX-Video) against
diffusers' own rotary classes and attention processors (diffusers is a test extra).

Each test builds diffusers' class on a small latent, runs the model's attention
processor with identity projections and norms up to its attention call, and
compares the q and k it rotated with ``reference.rope.rope`` applied to the
fp64-built tables of our spec (the kernel is checked against those tables in
test_rope.py).

Tolerance (per element, derived, not fitted). Let u = 2**-24. Our tables are
fp64 angles with cos/sin rounded to fp32 (error <= u/2).
  * Wan evaluates angles in fp64 and rounds cos/sin to fp32: angle error 0.
  * HunyuanVideo and LTX evaluate frequency, position and product in fp32. The
    frequency is theta ** (an exponent rounded in fp32): relative error
    <= ln(theta) u from the exponent, plus 1-2 ulp for pow and the pi/2 or
    reciprocal step; position and product add ~2 more. So
    |d angle| <= (ln(theta) + 4) u freq_p (|idx scale| + |offset|).
  Rotating a pair of norm r by angles that differ by d moves it by <= r d; fp32
  tables and the fp32 products and sums of both sides add <= 4u (|x1| + |x2|).
"""

import dataclasses
import math

import pytest
import torch
from torch import nn

from compile_ops.meta.rope import GridRope, grid_rope
from compile_ops.reference.rope import grid_tables, rope

hy_mod = pytest.importorskip("diffusers.models.transformers.transformer_hunyuan_video")
ltx_mod = pytest.importorskip("diffusers.models.transformers.transformer_ltx")
wan_mod = pytest.importorskip("diffusers.models.transformers.transformer_wan")
Attention = pytest.importorskip("diffusers.models.attention_processor").Attention
diffusers_apply_rotary_emb = pytest.importorskip("diffusers.models.embeddings").apply_rotary_emb

U = 2.0**-24
GRID = (3, 4, 5)


def grid_rope_tables(spec: GridRope, grid, dtype=torch.float64):
    frames, height, width = grid
    return grid_tables(spec, frames * height * width, height, width, dtype)


def _idx(grid):
    F, H, W = grid
    n = torch.arange(F * H * W)
    return torch.stack((n // (H * W), (n // W) % H, n % W), 1).double()


def angle_tolerance(spec: GridRope, grid, theta, fp32_angles: bool) -> torch.Tensor:
    """[N, P] bound on |diffusers' angle - exact angle|."""
    if not fp32_angles:
        return torch.zeros(math.prod(grid), len(spec.axes), dtype=torch.float64)
    ax = torch.tensor(spec.axes).clamp(min=0)
    mag = (_idx(grid)[:, ax] * torch.tensor(spec.position_scale, dtype=torch.float64)[ax]).abs() + torch.tensor(
        spec.position_offset, dtype=torch.float64
    )[ax].abs()
    mag = torch.where(torch.tensor(spec.axes) >= 0, mag, torch.zeros(()))
    return (math.log(theta) + 4) * U * torch.tensor(spec.frequencies, dtype=torch.float64) * mag


def pair_bound(x, ang_tol, interleaved=True):
    """Elementwise bound for rotated x ([..., L, D] with pairs along D, ang_tol [L, D/2])."""
    x = x.double()
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, -1)
    r = torch.sqrt(x1 * x1 + x2 * x2)
    b = r * ang_tol + 4 * U * (x1.abs() + x2.abs())
    return torch.stack((b, b), -1).flatten(-2) if interleaved else torch.cat((b, b), -1)


def check_close(key, got, want, bound):
    diff = (got.double() - want.double()).abs()
    worst = (diff / bound).max().item()
    assert worst <= 1.0, f"{key}: max diff {diff.max().item():.3e} is {worst:.2f}x the bound"


def check_tables(key, spec, grid, theta, fp32_angles, cos_d, sin_d):
    """diffusers' interleaved full-width tables against ours, one column per pair."""
    P = len(spec.axes)
    assert cos_d.shape[-1] == 2 * P
    cd = cos_d.reshape(-1, 2 * P)
    sd = sin_d.reshape(-1, 2 * P)
    # repeat_interleave: both members of a pair carry the same value
    assert torch.equal(cd[:, 0::2], cd[:, 1::2]) and torch.equal(sd[:, 0::2], sd[:, 1::2])
    c, s = grid_rope_tables(spec, grid)
    tol = angle_tolerance(spec, grid, theta, fp32_angles) + U
    for name, a, b in (("cos", c, cd[:, 0::2]), ("sin", s, sd[:, 0::2])):
        diff = (a - b.double()).abs()
        assert (diff <= tol).all(), f"{key} {name}: {diff.max().item():.3e}"


class _Captured(Exception):
    pass


def capture_qk(monkeypatch, module, call):
    """Run an attention processor up to its attention call; return the query and key it built."""
    box = {}

    def fake_dispatch(query, key, value, *args, **kwargs):
        box["q"], box["k"] = query, key
        raise _Captured

    monkeypatch.setattr(module, "dispatch_attention_fn", fake_dispatch)
    with pytest.raises(_Captured):
        call()
    return box["q"], box["k"]


def identity_projections(attn, names):
    for n in names:
        setattr(attn, n, nn.Identity())


# --------------------------------------------------------------------------- Wan

WAN_CASES = [  # (head_dim, theta, patch_size, extra pixels per axis)
    (128, 10000.0, (1, 2, 2), (0, 0, 0)),
    (64, 10000.0, (1, 2, 2), (0, 1, 1)),
    (96, 500.0, (2, 2, 2), (1, 1, 0)),
    (40, 10000.0, (1, 2, 2), (0, 0, 0)),  # 40 % 6 != 0: frames get 16, h/w 12 each
]


def _wan_inputs(head_dim, theta, patch, extra, grid=GRID):
    emb = wan_mod.WanRotaryPosEmbed(head_dim, patch, max_seq_len=1024, theta=theta)
    shape = [g * p + e for g, p, e in zip(grid, patch, extra)]
    hs = torch.zeros(1, 4, *shape)
    return emb, emb(hs)


@pytest.mark.parametrize("head_dim,theta,patch,extra", WAN_CASES)
def test_wan_tables(head_dim, theta, patch, extra):
    spec = grid_rope("wan", head_dim, theta=theta)
    _, (c, s) = _wan_inputs(head_dim, theta, patch, extra)
    assert c.shape == (1, math.prod(GRID), 1, head_dim) and c.dtype == torch.float32
    check_tables("wan", spec, GRID, theta, False, c, s)


@pytest.mark.parametrize("head_dim,theta,patch,extra", WAN_CASES[:3])
def test_wan_processor(monkeypatch, head_dim, theta, patch, extra):
    heads, B = 3, 2
    spec = grid_rope("wan", head_dim, theta=theta)
    _, rot = _wan_inputs(head_dim, theta, patch, extra)
    attn = wan_mod.WanAttention(
        dim=heads * head_dim, heads=heads, dim_head=head_dim, processor=wan_mod.WanAttnProcessor()
    )
    identity_projections(attn, ["to_q", "to_k", "to_v", "norm_q", "norm_k"])
    attn.fused_projections = False
    L = math.prod(GRID)
    x = torch.randn(B, L, heads * head_dim, generator=torch.Generator().manual_seed(0))
    q, k = capture_qk(monkeypatch, wan_mod, lambda: attn.processor(attn, x, None, None, rot))
    assert q.shape == (B, L, heads, head_dim)  # [B, L, H, D]

    cos, sin = grid_rope_tables(spec, GRID, torch.float32)
    xv = x.view(B, L, heads, head_dim)
    ours = rope(xv, cos, sin, interleaved=True, seq_dim=1)
    bound = pair_bound(xv, torch.zeros(L, len(spec.axes), dtype=torch.float64)[:, None, :])
    check_close("wan processor q/k", q, ours, bound)
    check_close("wan processor q/k", k, ours, bound)


# --------------------------------------------------------------------------- HunyuanVideo

HY_CASES = [  # (axes_dims, theta, patch_size, patch_size_t)
    ((16, 56, 56), 256.0, 2, 1),
    ((8, 28, 28), 10000.0, 2, 1),
    ((16, 24, 24), 256.0, 1, 2),
]


def _hy_inputs(axes_dims, theta, p, pt, grid=GRID):
    emb = hy_mod.HunyuanVideoRotaryPosEmbed(p, pt, list(axes_dims), theta)
    F, H, W = grid
    hs = torch.zeros(1, 4, F * pt, H * p + (p > 1), W * p)
    return emb(hs)


@pytest.mark.parametrize("axes_dims,theta,p,pt", HY_CASES)
def test_hunyuan_tables(axes_dims, theta, p, pt):
    spec = grid_rope("hunyuan", sum(axes_dims), theta=theta, axes_dims=axes_dims)
    c, s = _hy_inputs(axes_dims, theta, p, pt)
    assert c.shape == (math.prod(GRID), sum(axes_dims)) and c.dtype == torch.float32
    check_tables("hunyuan", spec, GRID, theta, True, c, s)


def test_hunyuan_tables_720p():
    """The 720p x 129-frame latent grid: angles up to 79 rad, still inside the fp32 bound."""
    grid = (33, 45, 80)
    spec = grid_rope("hunyuan", 128)
    c, s = _hy_inputs((16, 56, 56), 256.0, 2, 1, grid)
    check_tables("hunyuan 33x45x80", spec, grid, 256.0, True, c, s)
    assert spec.frequencies[36] == 1.0 and grid[2] - 1 == 79  # the largest angle: 79 rad


@pytest.mark.parametrize("axes_dims,theta,p,pt", HY_CASES[:2])
@pytest.mark.parametrize("dual_stream", [False, True])
def test_hunyuan_processor(monkeypatch, axes_dims, theta, p, pt, dual_stream):
    heads, B, n_text = 2, 2, 7
    D = sum(axes_dims)
    spec = grid_rope("hunyuan", D, theta=theta, axes_dims=axes_dims)
    rot = _hy_inputs(axes_dims, theta, p, pt)
    kw = dict(added_kv_proj_dim=heads * D, context_pre_only=False) if dual_stream else dict(pre_only=True)
    attn = Attention(
        query_dim=heads * D,
        cross_attention_dim=None,
        dim_head=D,
        heads=heads,
        out_dim=heads * D,
        bias=True,
        qk_norm="rms_norm",
        eps=1e-6,
        processor=hy_mod.HunyuanVideoAttnProcessor2_0(),
        **kw,
    )
    names = ["to_q", "to_k", "to_v", "norm_q", "norm_k"]
    if dual_stream:
        names += ["add_q_proj", "add_k_proj", "add_v_proj", "norm_added_q", "norm_added_k"]
    identity_projections(attn, names)
    L = math.prod(GRID)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, L, heads * D, generator=g)
    txt = torch.randn(B, n_text, heads * D, generator=g)
    q, k = capture_qk(monkeypatch, hy_mod, lambda: attn.processor(attn, x, txt, None, rot))
    assert q.shape == (B, L + n_text, heads, D)  # [B, L, H, D], video tokens first

    cos, sin = grid_rope_tables(spec, GRID, torch.float32)
    xv = x.view(B, L, heads, D)
    ours = rope(xv, cos, sin, interleaved=True, seq_dim=1)
    bound = pair_bound(xv, angle_tolerance(spec, GRID, theta, True)[:, None, :])
    for t in (q, k):
        check_close("hunyuan processor q/k", t[:, :L], ours, bound)
        # text tokens are appended after the video tokens and are not rotated
        assert torch.equal(t[:, L:], txt.view(B, n_text, heads, D))


# --------------------------------------------------------------------------- LTX-Video

LTX_PIPE = (8 / 25, 32.0, 32.0)
LTX_CASES = [  # (dim, overrides)
    (2048, {}),
    (1920, dict(theta=5000.0, rope_interpolation_scale=(8 / 24, 32.0, 32.0))),
    (1000, dict(base_num_frames=16, base_height=1024, base_width=1536, patch_size=2, patch_size_t=2)),
    (64, dict(rope_interpolation_scale=None)),
    (8, dict(theta=100.0)),  # one frequency per axis (linspace of length 1) and one padding pair
]


def _ltx_rotary(dim, ov, grid=GRID, batch=1):
    cls_kw = {
        k: ov[k]
        for k in ("theta", "base_num_frames", "base_height", "base_width", "patch_size", "patch_size_t")
        if k in ov
    }
    emb = ltx_mod.LTXVideoRotaryPosEmbed(dim, **cls_kw)
    F, H, W = grid
    hs = torch.zeros(batch, F * H * W, dim)
    return emb(hs, F, H, W, ov.get("rope_interpolation_scale", LTX_PIPE))


@pytest.mark.parametrize("dim,ov", LTX_CASES)
def test_ltx_tables(dim, ov):
    spec = grid_rope("ltx", dim, **ov)
    c, s = _ltx_rotary(dim, ov)
    assert c.shape == (1, math.prod(GRID), dim) and c.dtype == torch.float32
    check_tables("ltx", spec, GRID, ov.get("theta", 10000.0), True, c, s)
    # padding channels come first and are untouched (cos 1, sin 0)
    pad = dim % 6
    assert spec.axes[: pad // 2] == (-1,) * (pad // 2)
    assert (c[..., :pad] == 1).all() and (s[..., :pad] == 0).all()


def test_ltx_tables_768x512x121():
    """LTXPipeline at 768x512, 121 frames: latent grid 16 x 16 x 24 (VAE /8 in time, /32 in space)."""
    grid = ((121 - 1) // 8 + 1, 512 // 32, 768 // 32)
    spec = grid_rope("ltx", 2048)
    c, s = _ltx_rotary(2048, {}, grid)
    check_tables("ltx 16x16x24", spec, grid, 10000.0, True, c, s)


@pytest.mark.parametrize("dim,ov", LTX_CASES[:4])
def test_ltx_processor(monkeypatch, dim, ov):
    head_dim = 64 if dim % 64 == 0 else 40 if dim % 40 == 0 else 8
    heads, B = dim // head_dim, 2
    spec = grid_rope("ltx", dim, **ov)
    theta = ov.get("theta", 10000.0)
    rot = _ltx_rotary(dim, ov, batch=B)
    attn = ltx_mod.LTXAttention(
        query_dim=dim, heads=heads, kv_heads=heads, dim_head=head_dim, processor=ltx_mod.LTXVideoAttnProcessor()
    )
    identity_projections(attn, ["to_q", "to_k", "to_v", "norm_q", "norm_k"])
    L = math.prod(GRID)
    x = torch.randn(B, L, dim, generator=torch.Generator().manual_seed(2))
    q, k = capture_qk(monkeypatch, ltx_mod, lambda: attn.processor(attn, x, None, None, rot))
    assert q.shape == (B, L, heads, head_dim)

    # LTX rotates [B, L, heads*head_dim] before splitting heads: one "head" of the inner dim.
    cos, sin = grid_rope_tables(spec, GRID, torch.float32)
    xv = x.view(B, L, 1, dim)
    ours = rope(xv, cos, sin, interleaved=True, seq_dim=1).view(B, L, heads, head_dim)
    bound = pair_bound(xv, angle_tolerance(spec, GRID, theta, True)[:, None, :]).view(B, L, heads, head_dim)
    check_close("ltx processor q/k", q, ours, bound)
    check_close("ltx processor q/k", k, ours, bound)
    # the same thing, per head: head h uses pair columns [h*head_dim/2, (h+1)*head_dim/2)
    hp = head_dim // 2
    for h in range(heads):
        per_head = rope(
            x.view(B, L, heads, head_dim)[:, :, h : h + 1],
            cos[:, h * hp : (h + 1) * hp],
            sin[:, h * hp : (h + 1) * hp],
            interleaved=True,
            seq_dim=1,
        )
        assert torch.equal(per_head[:, :, 0], ours[:, :, h])


def test_ltx_apply_function():
    """transformer_ltx.apply_rotary_emb on [B, L, inner] directly."""
    dim, ov = 2048, {}
    spec = grid_rope("ltx", dim)
    rot = _ltx_rotary(dim, ov)
    x = torch.randn(1, math.prod(GRID), dim, generator=torch.Generator().manual_seed(3))
    theirs = ltx_mod.apply_rotary_emb(x, rot)
    cos, sin = grid_rope_tables(spec, GRID, torch.float32)
    ours = rope(x[:, :, None], cos, sin, interleaved=True, seq_dim=1)[:, :, 0]
    bound = pair_bound(x, angle_tolerance(spec, GRID, 10000.0, True))
    check_close("ltx apply_rotary_emb", theirs, ours, bound)


def test_hunyuan_apply_function_bhld():
    """embeddings.apply_rotary_emb with sequence_dim=2 ([B, H, L, D]) gives the same rotation."""
    spec = grid_rope("hunyuan", 128)
    rot = _hy_inputs((16, 56, 56), 256.0, 2, 1)
    x = torch.randn(2, 3, math.prod(GRID), 128, generator=torch.Generator().manual_seed(4))
    theirs = diffusers_apply_rotary_emb(x, rot, sequence_dim=2)
    cos, sin = grid_rope_tables(spec, GRID, torch.float32)
    ours = rope(x, cos, sin, interleaved=True, seq_dim=2)
    bound = pair_bound(x, angle_tolerance(spec, GRID, 256.0, True))
    check_close("hunyuan apply_rotary_emb [B,H,L,D]", theirs, ours, bound)


def test_ltx_fp64_vs_fp32_gap_is_real():  # why LTX's tolerance is wider
    """At LTX's top frequency (pi/2 * 10^4 rad per unit position) diffusers' fp32 angle is off the
    exact one by ~1e-3..5e-3 rad; the gap is larger than fp32 table rounding by orders of magnitude."""
    spec = grid_rope("ltx", 2048)
    c, _ = _ltx_rotary(2048, {})
    ours, _ = grid_rope_tables(spec, GRID)
    gap = (ours - c.reshape(-1, 2048)[:, 0::2].double()).abs().max().item()
    assert 1e-4 < gap < 1e-2


def test_bound_catches_wrong_specs():
    """The checks are discriminating: plausible wrong specs fail them."""
    x = torch.randn(1, math.prod(GRID), 2, 128, generator=torch.Generator().manual_seed(5))
    rot = _hy_inputs((16, 56, 56), 256.0, 2, 1)
    theirs = diffusers_apply_rotary_emb(x, rot, sequence_dim=1)
    right = grid_rope("hunyuan", 128)
    bound = pair_bound(x, angle_tolerance(right, GRID, 256.0, True)[:, None, :])
    wrong = [
        dataclasses.replace(right, interleaved=False),
        grid_rope("hunyuan", 128, axes_dims=(16, 56, 56), theta=10000.0),
        dataclasses.replace(right, axes=tuple(2 - a for a in right.axes)),  # (w, h, f) order
        dataclasses.replace(right, position_offset=(0.0, 0.0, 0.5)),
    ]
    for spec in wrong:
        cos, sin = grid_rope_tables(spec, GRID, torch.float32)
        ours = rope(x, cos, sin, interleaved=spec.interleaved, seq_dim=1)
        assert ((ours.double() - theirs.double()).abs() > bound).any()


# --------------------------------------------------------------------------- layout / errors


def test_structure():
    w = grid_rope("wan", 128)
    assert w.axes == (0,) * 22 + (1,) * 21 + (2,) * 21 and w.interleaved
    assert w.frequencies[0] == 1.0 and w.frequencies[22] == 1.0 and w.frequencies[43] == 1.0
    assert w.frequencies[21] == pytest.approx(10000.0 ** (-42 / 44), rel=1e-15)
    h = grid_rope("hunyuan", 128)
    assert h.axes == (0,) * 8 + (1,) * 28 + (2,) * 28
    assert h.frequencies[7] == pytest.approx(256.0 ** (-14 / 16), rel=1e-15)
    lt = grid_rope("ltx", 2048)
    assert len(lt.axes) == 1024 and lt.axes[:4] == (-1, 0, 1, 2) and lt.axes[-3:] == (0, 1, 2)
    assert lt.frequencies[1] == pytest.approx(math.pi / 2) and lt.frequencies[-1] == pytest.approx(math.pi / 2 * 1e4)
    assert lt.position_scale == pytest.approx((2 * 0.32 / 20, 2 * 32 / 2048, 2 * 32 / 2048))
    assert lt.position_offset == (-1.0, -1.0, -1.0)
    assert grid_rope("ltx", 2048, rope_interpolation_scale=None).position_scale == (2.0, 2.0, 2.0)


@pytest.mark.parametrize(
    "conv,dim,ov",
    [
        ("wan", 127, {}),
        ("wan", 4, {}),
        ("hunyuan", 120, {}),
        ("hunyuan", 128, dict(axes_dims=(15, 57, 56))),
        ("hunyuan", 64, dict(axes_dims=(32, 32))),
        ("ltx", 2047, {}),
        ("ltx", 4, {}),
        ("ltx", 0, {}),
        ("cogvideo", 64, {}),
    ],
)
def test_bad_dims(conv, dim, ov):
    with pytest.raises(ValueError):
        grid_rope(conv, dim, **ov)


def test_unknown_override():
    with pytest.raises(TypeError):
        grid_rope("wan", 128, axes_dims=(44, 42, 42))
