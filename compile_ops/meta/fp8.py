"""Shape and dtype rules of the fp8 family, and its validation (the fakes)."""

from typing import Optional

import torch

from compile_ops.meta._validate import check_floating, check_same_device, fail
from compile_ops.meta.glu import ACTIVATIONS

#: ``activation`` of ``fused.quantize_fp8_rows``: none, or what it applies before quantizing.
QUANTIZE_ACTIVATIONS = ("none", *ACTIVATIONS)


def check_rows(op: str, argname: str, x: torch.Tensor) -> None:
    """``x [..., K]``: a floating tensor with a channel (last) dim."""
    check_floating(op, argname, x)
    if x.dim() < 1:
        fail(op, f"{argname} must have at least 1 dim (channels last), got a 0-dim tensor")


def check_activation(activation: str) -> None:
    if not isinstance(activation, str) or activation not in QUANTIZE_ACTIVATIONS:
        fail(
            "quantize_fp8_rows",
            f"activation must be one of {', '.join(map(repr, QUANTIZE_ACTIVATIONS))}, got {activation!r}",
            ValueError if isinstance(activation, str) else TypeError,
        )


def check_head(x: torch.Tensor, head: Optional[torch.Tensor]) -> int:
    """``head [..., K_head]`` (or None): x's leading dims, dtype and device. Returns K_head."""
    if head is None:
        return 0
    op = "quantize_fp8_rows"
    check_floating(op, "head", head)
    if head.dim() != x.dim() or tuple(head.shape[:-1]) != tuple(x.shape[:-1]):
        fail(
            op,
            f"head must be [..., K_head] with x's leading dims {list(x.shape[:-1])} (its rows are "
            f"concatenated before x's), got {list(head.shape)}",
        )
    if head.dtype != x.dtype:
        fail(op, f"head must have x's dtype {x.dtype} (a concatenation of the two), got {head.dtype}", TypeError)
    check_same_device(op, x, head=head)
    return head.shape[-1]


def quantize_fp8_rows(x: torch.Tensor, activation: str = "none", head: Optional[torch.Tensor] = None) -> tuple:
    """``(q [..., K_head + K] float8_e4m3fn, scale [...] float32)``, both contiguous."""
    check_rows("quantize_fp8_rows", "x", x)
    check_activation(activation)
    k_head = check_head(x, head)
    return (
        x.new_empty((*x.shape[:-1], k_head + x.shape[-1]), dtype=torch.float8_e4m3fn),
        x.new_empty(x.shape[:-1], dtype=torch.float32),
    )


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} {list(t.shape)} on {t.device}"


def _linear_fail(msg: str, exc=ValueError):
    # fp8_linear is a function over two ops (quantize, GEMM), not a fused op:
    # its messages name the public function.
    raise exc(f"compile_ops.fp8_linear: {msg}")


def check_fp8_rows(q: torch.Tensor, scale: torch.Tensor, argname: str = "x") -> None:
    """An already-quantized input ``(q [..., K] float8_e4m3fn, scale [...] float32)``."""
    if q.dtype != torch.float8_e4m3fn or q.dim() < 1:
        _linear_fail(f"{argname}.q must be float8_e4m3fn [..., K], got {_describe(q)}", TypeError)
    if scale.dtype != torch.float32 or tuple(scale.shape) != tuple(q.shape[:-1]):
        _linear_fail(
            f"{argname}.scale must be float32 {list(q.shape[:-1])} (one per row of {argname}.q "
            f"{list(q.shape)}), got {_describe(scale)}"
        )
    if scale.device != q.device:
        _linear_fail(f"{argname}.scale is on {scale.device} but {argname}.q is on {q.device}")


def check_linear(
    x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor]
) -> None:
    """``x [..., K]`` (the activation, or its quantized values) against ``weight_q [N, K]``
    float8_e4m3fn, ``weight_scale [N]`` float32 and ``bias [N]`` (floating) or None,
    all on x's device."""
    k = x.shape[-1]
    if weight_q.dtype != torch.float8_e4m3fn or weight_q.dim() != 2 or weight_q.shape[1] != k:
        _linear_fail(
            f"weight_q must be float8_e4m3fn [N, {k}] (K = x's last dim, x is {list(x.shape)}), "
            f"got {_describe(weight_q)}",
            TypeError if weight_q.dtype != torch.float8_e4m3fn else ValueError,
        )
    n = weight_q.shape[0]
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (n,):
        _linear_fail(f"weight_scale must be float32 [{n}] (one per row of weight_q), got {_describe(weight_scale)}")
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.dtype.is_floating_point):
        _linear_fail(f"bias must be a floating [{n}] tensor or None, got {_describe(bias)}")
    for argname, t in (("weight_q", weight_q), ("weight_scale", weight_scale), ("bias", bias)):
        if t is not None and t.device != x.device:
            _linear_fail(f"{argname} is on {t.device} but x is on {x.device}; all tensors must share a device")


#: The adapters' dtypes of ``fused.fp8_rows_lora`` (the kernels' dot operands; fp64 has none).
LORA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fp8_rows_lora(
    result: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float = 1.0,
    scaling_tensor: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``result [..., N]`` (floating), ``q [..., K]`` float8_e4m3fn with result's
    leading dims, ``scale [...]`` float32 (one per row of q), ``lora_a [r, K]``
    and ``lora_b [N, r]`` of one dtype (fp16, bf16 or fp32), ``scaling_tensor``
    a 0-dim floating tensor or None, all on result's device. Returns the
    output, ``[..., N]`` contiguous in result's dtype."""
    op = "fp8_rows_lora"
    check_rows(op, "result", result)
    if not isinstance(q, torch.Tensor):
        fail(op, f"q must be a torch.Tensor, got {type(q).__name__}", TypeError)
    if q.dtype != torch.float8_e4m3fn:
        fail(op, f"q must be float8_e4m3fn (the FP8 rows' codes), got {q.dtype}", TypeError)
    if q.dim() != result.dim() or tuple(q.shape[:-1]) != tuple(result.shape[:-1]):
        fail(op, f"q must be [..., K] with result's leading dims {list(result.shape[:-1])}, got {list(q.shape)}")
    if not isinstance(scale, torch.Tensor):
        fail(op, f"scale must be a torch.Tensor, got {type(scale).__name__}", TypeError)
    if scale.dtype != torch.float32:
        fail(op, f"scale must be float32 (the FP8 rows' scales), got {scale.dtype}", TypeError)
    if tuple(scale.shape) != tuple(q.shape[:-1]):
        fail(op, f"scale must be {list(q.shape[:-1])} (one per row of q {list(q.shape)}), got {list(scale.shape)}")
    for argname, t in (("lora_a", lora_a), ("lora_b", lora_b)):
        check_floating(op, argname, t)
        if t.dtype not in LORA_DTYPES:
            fail(op, f"{argname} must be float16, bfloat16 or float32, got {t.dtype}", TypeError)
        if t.dim() != 2:
            fail(op, f"{argname} must be 2-D, got {list(t.shape)}")
    if lora_b.dtype != lora_a.dtype:
        fail(op, f"lora_b must have lora_a's dtype {lora_a.dtype} (one adapter dtype), got {lora_b.dtype}", TypeError)
    k, n, r = q.shape[-1], result.shape[-1], lora_a.shape[0]
    if lora_a.shape[1] != k:
        fail(op, f"lora_a must be [r, {k}] (K = q's last dim), got {list(lora_a.shape)}")
    if tuple(lora_b.shape) != (n, r):
        fail(
            op,
            f"lora_b must be [{n}, {r}] (N = result's last dim, r = lora_a's rank), got {list(lora_b.shape)}: "
            "the rank of lora_a and lora_b must match",
        )
    if scaling_tensor is not None:
        check_floating(op, "scaling_tensor", scaling_tensor)
        if scaling_tensor.dim() != 0:
            fail(op, f"scaling_tensor must be a 0-dim tensor or None, got shape {list(scaling_tensor.shape)}")
    check_same_device(
        op, result, "result", q=q, scale=scale, lora_a=lora_a, lora_b=lora_b, scaling_tensor=scaling_tensor
    )
    return torch.empty(result.shape, dtype=result.dtype, device=result.device)
