"""The diffusers transformers the end-to-end runners build, and one step's inputs for each.

Full-size configs with random weights (nothing is downloaded), bf16, batch 1;
:func:`build` gives a case's model and inputs on ``DEVICE`` in ``DTYPE``, the
same random weights every call, and :func:`tokens` the attention tokens of its
step. ``CASES``: what bench/runners/diffusers_e2e.py runs by default;
``EXTRA_CASES``: the cases other runners build (bench/runners/sparse_e2e.py,
bench/runners/context_parallel.py) or name in ``--cases``, and the tiny ones of
the smoke runs on the CPU.
"""

import torch

DTYPE = torch.bfloat16
#: Where models are built and run: the GPU; the CPU only for smoke runs of tiny cases.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


#: Flux.1-dev's widths, and a tiny Flux's (two heads of 16: FP8 takes its Linears) for smoke runs.
FLUX_SIZES = {
    "full": dict(
        in_channels=64, attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
        pooled_projection_dim=768, axes_dims_rope=(16, 56, 56), text_tokens=512,
    ),
    "tiny": dict(
        in_channels=16, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=32, axes_dims_rope=(4, 6, 6), text_tokens=8,
    ),
}  # fmt: skip


def flux(num_layers: int, num_single_layers: int, rows: int = 64, cols: int = 64, size: str = "full"):
    """Flux and one step's inputs: ``rows x cols`` latent tokens (1024 px / 8 (VAE) / 2 (packing) = 64 a
    side) after the text tokens (512); ``size``: a key of ``FLUX_SIZES``."""
    from diffusers import FluxTransformer2DModel

    config = dict(FLUX_SIZES[size])
    text = config.pop("text_tokens")
    model = FluxTransformer2DModel(
        patch_size=1, num_layers=num_layers, num_single_layers=num_single_layers, guidance_embeds=True, **config
    )
    channels, joint, pooled = config["in_channels"], config["joint_attention_dim"], config["pooled_projection_dim"]
    row_ids, col_ids = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(row_ids), row_ids, col_ids], -1).reshape(-1, 3).float()
    inputs = dict(
        hidden_states=torch.randn(1, rows * cols, channels),
        encoder_hidden_states=torch.randn(1, text, joint),
        pooled_projections=torch.randn(1, pooled),
        timestep=torch.tensor([0.5]),
        guidance=torch.tensor([3.5]),
        img_ids=img_ids,
        txt_ids=torch.zeros(text, 3),
    )
    return model, inputs


def wan(height: int = 60, width: int = 104):
    """Wan 2.1 1.3B and one step's inputs: 81 frames (21 latent frames) of
    ``height x width`` latents (480p: 60 x 104, 720p: 90 x 160)."""
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=12,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=8960,
        num_layers=30,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
    )
    inputs = dict(
        hidden_states=torch.randn(1, 16, 21, height, width),
        encoder_hidden_states=torch.randn(1, 512, 4096),
        timestep=torch.tensor([500]),
    )
    return model, inputs


#: HunyuanVideo's transformer (13B: 20 double- + 40 single-stream blocks, 3072 wide; diffusers'
#: ``HunyuanVideoTransformer3DModel`` defaults), and a tiny one (two heads of 16) for smoke runs.
HUNYUAN_VIDEO_SIZES = {
    "full": dict(
        in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
        num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
        qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
        rope_theta=256.0, rope_axes_dim=(16, 56, 56),
    ),
    "tiny": dict(
        in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=16, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
        qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=32, pooled_projection_dim=32,
        rope_theta=256.0, rope_axes_dim=(4, 6, 6),
    ),
}  # fmt: skip


def hunyuan_video(frames_latent: int, height: int, width: int, text_tokens: int = 256, size: str = "full"):
    """HunyuanVideo and one step's inputs: ``frames_latent`` latent frames of ``height x width``
    latents (720p x 33 frames: 9 of 90 x 160; patches of 2 x 2 make ``frames_latent x height / 2 x
    width / 2`` video tokens) and ``text_tokens`` text tokens, the last quarter of them padding
    (masked out, as for a prompt shorter than the text encoder's length); ``size``: a key of
    ``HUNYUAN_VIDEO_SIZES``. The timestep and the guidance (the scale times 1000) are floats, as
    the pipeline passes them."""

    from diffusers import HunyuanVideoTransformer3DModel

    config = HUNYUAN_VIDEO_SIZES[size]
    model = HunyuanVideoTransformer3DModel(**config)
    mask = torch.ones(1, text_tokens)
    mask[:, text_tokens - text_tokens // 4 :] = 0
    inputs = dict(
        hidden_states=torch.randn(1, config["in_channels"], frames_latent, height, width),
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=torch.randn(1, text_tokens, config["text_embed_dim"]),
        encoder_attention_mask=mask,
        pooled_projections=torch.randn(1, config["pooled_projection_dim"]),
        guidance=torch.tensor([6000.0]),
    )
    return model, inputs


CASES = {
    "flux_step": (lambda: flux(19, 38), False),
    "wan_step": (wan, False),
    "flux_train": (lambda: flux(2, 4), True),
}
#: Cases other runners build with :func:`build` (bench/runners/sparse_e2e.py, bench/runners/context_parallel.py),
#: not run by diffusers_e2e.py by default. ``flux_blocks_1360x768``: the flux_train block stack (2 double + 4
#: single), one inference forward at 1360x768 (48 x 85 = 4080 image + 512 text = 4592 tokens, not a multiple of
#: 128: ``attention_kernel="auto"`` takes the sm_90 core there; docs/notes/attention-forward.md, ragged key
#: counts). ``hunyuan_step_720p``: HunyuanVideo at 720p x 33 frames, 9 latent frames of 90 x 160 latents
#: (9 x 45 x 80 = 32400 video tokens after patching) and 256 text tokens.
EXTRA_CASES = {
    "wan_step_720p": (lambda: wan(90, 160), False),
    "flux_blocks_1360x768": (lambda: flux(2, 4, 48, 85), False),
    "flux_step_tiny": (lambda: flux(1, 1, 4, 4, size="tiny"), False),
    "hunyuan_step_720p": (lambda: hunyuan_video(9, 90, 160), False),
    "hunyuan_step_tiny": (lambda: hunyuan_video(3, 8, 16, text_tokens=8, size="tiny"), False),
}


def build(name: str):
    """The case's model (bf16, on the GPU, the same random weights every call) and inputs."""
    builder, train = {**CASES, **EXTRA_CASES}[name]
    torch.manual_seed(0)
    with torch.device(DEVICE):
        default = torch.get_default_dtype()
        torch.set_default_dtype(DTYPE)  # initialise in bf16: no fp32 copy of 12B parameters
        try:
            model, inputs = builder()
        finally:
            torch.set_default_dtype(default)
    inputs = {
        k: v.to(DEVICE, DTYPE if v.is_floating_point() and "ids" not in k else v.dtype) for k, v in inputs.items()
    }
    return model.train(train).requires_grad_(train), inputs


def tokens(name: str) -> int:
    """The step's attention tokens: Wan's video tokens (its text in cross-attention), Flux's and
    HunyuanVideo's video and text tokens together (joint attention)."""
    sizes = {
        "wan_step": 21 * 30 * 52,
        "wan_step_720p": 21 * 45 * 80,
        "flux_blocks_1360x768": 48 * 85 + 512,
        "flux_step_tiny": 4 * 4 + 8,
        "hunyuan_step_720p": 9 * 45 * 80 + 256,
        "hunyuan_step_tiny": 3 * 4 * 8 + 8,
    }
    return sizes.get(name, 4096 + 512)
