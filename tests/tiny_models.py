"""Tiny diffusers transformers that several test files build (random weights, CPU-sized).

diffusers is imported when a builder is called: the test files that import
this module skip themselves first where diffusers is not installed."""

#: HunyuanVideo's smallest shape the tests use: one double- and one single-stream block.
HUNYUAN_VIDEO = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=10,
    num_layers=1,
    num_single_layers=1,
    num_refiner_layers=1,
    patch_size=1,
    patch_size_t=1,
    guidance_embeds=True,
    text_embed_dim=16,
    pooled_projection_dim=8,
    rope_axes_dim=(2, 4, 4),
    image_condition_type=None,
)


def hunyuan_video(**overrides):
    """A tiny ``HunyuanVideoTransformer3DModel``: :data:`HUNYUAN_VIDEO` with ``overrides``."""
    import diffusers

    return diffusers.HunyuanVideoTransformer3DModel(**{**HUNYUAN_VIDEO, **overrides})


#: Wan 2.1's smallest shape the tests use: two blocks of two 12-wide heads.
WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=32,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)

#: Flux's smallest shape the tests use: one double- and one single-stream block.
FLUX = dict(
    patch_size=1,
    in_channels=4,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    axes_dims_rope=(4, 6, 6),
)


def wan(**overrides):
    """A tiny ``WanTransformer3DModel``: :data:`WAN` with ``overrides``."""
    import diffusers

    return diffusers.WanTransformer3DModel(**{**WAN, **overrides})


def flux(**overrides):
    """A tiny ``FluxTransformer2DModel``: :data:`FLUX` with ``overrides``."""
    import diffusers

    return diffusers.FluxTransformer2DModel(**{**FLUX, **overrides})
