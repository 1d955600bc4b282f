"""Model builders and checks shared by the diffusers test files (not a test file).

Small diffusers transformers from random configs, each with a function giving
its inputs at a resolution: ``_flux``, ``_wan``, ``_sd3``, ``_ltx`` (``MODELS``)
and ``_wan16``, Wan with 16-wide heads for FP8 (``FP8_MODELS``); ``_pair``, an
unpatched model and a patched copy with patch's report; ``_to``, inputs moved to
a device; ``_relative_l2``; and ``_SimulatedFP8Linear``, the FP8 recipe restated
in plain PyTorch. Used by the ``test_diffusers_patch*.py`` files,
``test_fp8_lora.py`` and ``test_lora_patch.py``.

Importing this module never fails without diffusers (``diffusers`` is None
then): each test file skips itself with ``pytest.importorskip("diffusers")``
before it calls a builder.
"""

import copy

import tiny_models
import torch
from patch_checks import DEVICE

import compile_ops

try:
    import diffusers
except ImportError:  # each importing test file skips itself: pytest.importorskip("diffusers")
    diffusers = None


def _flux():
    model = tiny_models.flux()

    def inputs(side):
        li, lt = side * side, 8
        grid = torch.meshgrid(torch.zeros(1), torch.arange(float(side)), torch.arange(float(side)), indexing="ij")
        ids = torch.stack(grid, -1)
        return dict(
            hidden_states=torch.randn(2, li, 4),
            encoder_hidden_states=torch.randn(2, lt, 32),
            pooled_projections=torch.randn(2, 32),
            timestep=torch.rand(2),
            img_ids=ids.reshape(li, 3),
            txt_ids=torch.zeros(lt, 3),
        )

    return model, inputs


def _wan():
    model = tiny_models.wan()

    def inputs(side):
        return dict(
            hidden_states=torch.randn(1, 4, 2, side, side),
            encoder_hidden_states=torch.randn(1, 6, 16),
            timestep=torch.randint(0, 1000, (1,)),
        )

    return model, inputs


def _sd3():
    model = diffusers.SD3Transformer2DModel(
        sample_size=8,
        patch_size=1,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        caption_projection_dim=16,
        joint_attention_dim=16,
        pooled_projection_dim=16,
        out_channels=4,
        qk_norm="rms_norm",
    )

    def inputs(side):
        return dict(
            hidden_states=torch.randn(2, 4, side, side),
            encoder_hidden_states=torch.randn(2, 6, 16),
            pooled_projections=torch.randn(2, 16),
            timestep=torch.rand(2),
        )

    return model, inputs


def _ltx():
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        num_layers=1,
        caption_channels=16,
    )

    def inputs(side):
        return dict(
            hidden_states=torch.randn(1, 2 * side * side, 4),
            encoder_hidden_states=torch.randn(1, 6, 16),
            timestep=torch.randint(0, 1000, (1,)),
            encoder_attention_mask=torch.ones(1, 6),
            num_frames=2,
            height=side,
            width=side,
        )

    return model, inputs


MODELS = {"flux": _flux, "wan": _wan, "sd3": _sd3, "ltx": _ltx}


def _to(inputs, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _pair(name):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model = model.to(DEVICE)
    patched = copy.deepcopy(model)
    report = compile_ops.patch(patched)
    return model, patched, inputs, report


def _relative_l2(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


class _SimulatedFP8Linear(torch.nn.Module):
    """The FP8 recipe restated in plain PyTorch, independently of compile_ops:
    per-row (token) activation scales and per-output-channel weight scales,
    ``scale = amax / 448`` over the row's finite values (floored at 1e-12),
    values ``clamp(x * (448 / amax), -448, 448)`` rounded to e4m3, products
    summed in fp32. On a GPU the products are summed by the device's FP8 GEMM
    (``torch._scaled_mm`` rowwise with fast accumulation, as FP8Linear runs
    there by default: tensor-core sums, bf16 bias, output rounded to bf16,
    its only rowwise output type), so the
    comparison isolates the quantization from the GEMM's summation order."""

    def __init__(self, linear):
        super().__init__()
        self.weight_q, self.weight_scale = self.quantize(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    @staticmethod
    def quantize(x):
        x = x.float()
        amax = torch.where(torch.isfinite(x), x.abs(), 0.0).amax(-1, keepdim=True).clamp(min=1e-12)
        q = (x * (448.0 / amax)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return q, (amax / 448.0).squeeze(-1)

    def forward(self, x):
        q, scale = self.quantize(x)
        if q.is_cuda:
            out = torch._scaled_mm(
                q.reshape(-1, q.shape[-1]),
                self.weight_q.t(),
                scale_a=scale.reshape(-1, 1),
                scale_b=self.weight_scale[None, :],
                out_dtype=torch.bfloat16,
                bias=None if self.bias is None else self.bias.to(torch.bfloat16),
                use_fast_accum=True,
            )
            return out.reshape(*q.shape[:-1], -1).to(x.dtype)
        out = (q.float() * scale[..., None]) @ (self.weight_q.float() * self.weight_scale[:, None]).T
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)


def _wan16():
    """Wan with 16-wide heads: every projection a multiple of 16 (torch._scaled_mm's rule)."""
    model = tiny_models.wan(attention_head_dim=16, ffn_dim=64)
    return model, _wan()[1]


FP8_MODELS = {"flux": _flux, "wan": _wan16, "sd3": _sd3, "ltx": _ltx}
