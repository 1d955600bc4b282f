"""AdaLN modules that drop in for diffusers' ``AdaLayerNormZero``, ``AdaLayerNormZeroSingle``
and ``AdaLayerNormContinuous``.

Same constructor arguments, parameter names (``linear.*``, ``norm.*``), chunk
order, eps and affine setting as diffusers' own (the versions pyproject.toml
tests), so a diffusers state dict loads unchanged and the outputs are the same
up to rounding; the norm and the modulation run as one ``fused.norm_modulate``
kernel.
"""

from typing import Optional

import torch
from torch import Tensor, nn

from compile_ops.meta._validate import check_flag, checked_arguments
from compile_ops.modules.hooks import check_input, must_call
from compile_ops.modules.norm import LayerNorm, RMSNorm
from compile_ops.ops.modulate import norm_modulate, norm_modulate_fp8

#: diffusers' AdaLayerNormZero norm types -> the eps its LayerNorm uses
#: (``FP32LayerNorm`` keeps torch's default; the kernels compute in fp32 either way).
_ZERO_NORM_EPS = {"layer_norm": 1e-6, "fp32_layer_norm": 1e-5}


class AdaLayerNormZero(nn.Module):
    """diffusers' ``AdaLayerNormZero`` (Flux, SD3, HunyuanVideo double-stream blocks).

    ``forward(x [B, L, C], emb=[B, C])`` returns ``(norm(x) * (1 + scale_msa) + shift_msa,
    gate_msa, shift_mlp, scale_mlp, gate_mlp)``, the last four ``[B, C]``, chunked
    from ``linear(silu(emb))`` in diffusers' order.

    ``num_embeddings`` (the class-label embedding of the original DiT) is not
    supported: compute ``emb`` outside and pass it.

    ``fp8_rows=True`` (inference, for a block whose q/k/v projections are
    FP8 Linears): the first output is ``FP8Rows`` of the modulated norm,
    quantized per row in the norm's kernel (``fused.norm_modulate_fp8``).
    """

    @checked_arguments
    def __init__(
        self, embedding_dim: int, num_embeddings: Optional[int] = None, norm_type: str = "layer_norm", bias: bool = True
    ):
        super().__init__()
        if num_embeddings is not None:
            raise NotImplementedError(
                "AdaLayerNormZero: num_embeddings (class-label embeddings) is not "
                "supported; pass the embedding as `emb`"
            )
        if norm_type not in _ZERO_NORM_EPS:
            raise ValueError(f"AdaLayerNormZero: norm_type must be one of {tuple(_ZERO_NORM_EPS)}, got {norm_type!r}")
        self.emb = None
        self.eps = _ZERO_NORM_EPS[norm_type]
        self.silu = nn.SiLU()
        self.linear = nn.Linear(embedding_dim, 6 * embedding_dim, bias=bias)

    def forward(
        self,
        x: Tensor,
        timestep: Optional[Tensor] = None,
        class_labels: Optional[Tensor] = None,
        hidden_dtype: Optional[torch.dtype] = None,
        emb: Optional[Tensor] = None,
        fp8_rows: bool = False,
    ):
        if emb is None:
            raise ValueError("AdaLayerNormZero: emb ([B, C]) is required")
        check_flag("compile_ops.AdaLayerNormZero", "fp8_rows", fp8_rows)
        check_input("compile_ops.AdaLayerNormZero", "emb", emb, self.linear)
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        x = (norm_modulate_fp8 if fp8_rows else norm_modulate)(
            x, scale_msa, shift_msa, None, None, "layernorm", self.eps
        )
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormZeroSingle(nn.Module):
    """diffusers' ``AdaLayerNormZeroSingle`` (Flux single-stream blocks).

    ``forward(x [B, L, C], emb=[B, C])`` returns ``(norm(x) * (1 + scale) + shift, gate)``;
    ``fp8_rows=True``: the first as ``FP8Rows`` (see :class:`AdaLayerNormZero`).
    """

    @checked_arguments
    def __init__(self, embedding_dim: int, norm_type: str = "layer_norm", bias: bool = True):
        super().__init__()
        if norm_type != "layer_norm":
            raise ValueError(f"AdaLayerNormZeroSingle: norm_type must be 'layer_norm', got {norm_type!r}")
        self.silu = nn.SiLU()
        self.linear = nn.Linear(embedding_dim, 3 * embedding_dim, bias=bias)

    def forward(self, x: Tensor, emb: Optional[Tensor] = None, fp8_rows: bool = False):
        if emb is None:
            raise ValueError("AdaLayerNormZeroSingle: emb ([B, C]) is required")
        check_flag("compile_ops.AdaLayerNormZeroSingle", "fp8_rows", fp8_rows)
        check_input("compile_ops.AdaLayerNormZeroSingle", "emb", emb, self.linear)
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
        modulate = norm_modulate_fp8 if fp8_rows else norm_modulate
        return modulate(x, scale_msa, shift_msa, None, None, "layernorm", 1e-6), gate_msa


class AdaLayerNormContinuous(nn.Module):
    """diffusers' ``AdaLayerNormContinuous`` (the final norm of Flux, SD3, Wan, LTX-Video).

    ``forward(x [B, L, C], conditioning_embedding [B, D])`` returns
    ``norm(x) * (1 + scale) + shift`` with ``scale, shift`` chunked (in that
    order) from ``linear(silu(conditioning_embedding))``; ``norm`` is a
    LayerNorm or RMSNorm with diffusers' affine setting.
    """

    @checked_arguments
    def __init__(
        self,
        embedding_dim: int,
        conditioning_embedding_dim: int,
        elementwise_affine: bool = True,
        eps: float = 1e-5,
        bias: bool = True,
        norm_type: str = "layer_norm",
    ):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(conditioning_embedding_dim, embedding_dim * 2, bias=bias)
        if norm_type == "layer_norm":
            self.norm = LayerNorm(embedding_dim, eps, elementwise_affine, bias)
            self._norm = "layernorm"
        elif norm_type == "rms_norm":
            self.norm = RMSNorm(embedding_dim, eps, elementwise_affine)
            self._norm = "rmsnorm"
        else:
            raise ValueError(f"AdaLayerNormContinuous: norm_type must be 'layer_norm' or 'rms_norm', got {norm_type!r}")

    def forward(self, x: Tensor, conditioning_embedding: Tensor) -> Tensor:
        check_input("compile_ops.AdaLayerNormContinuous", "x", x, self.linear)
        check_input("compile_ops.AdaLayerNormContinuous", "conditioning_embedding", conditioning_embedding, self.linear)
        # Back to x's dtype, as diffusers does (the embedding may be fp32).
        emb = self.linear(self.silu(conditioning_embedding).to(x.dtype))
        scale, shift = torch.chunk(emb, 2, dim=1)
        if must_call(self.norm):  # an offloading/casting hook owns its weight: let it run
            return self.norm(x) * (1 + scale[:, None]) + shift[:, None]
        return norm_modulate(x, scale, shift, self.norm.weight, self.norm.bias, self._norm, self.norm.eps)
