"""One table of op specs that drives the cross-op tests and the benchmark.

A new op gets opcheck, gradcheck, fake-CUDA tracing, compile coverage and a
benchmark row by adding one ``OpSpec`` here, its input builders in
``cases/<family>.py``. Family-specific behaviour (edge cases, bad input,
modules) lives in ``tests/test_<family>.py``. The package serves the tests and
``bench/`` only: it imports ``compile_ops`` and is not installed with it.
"""

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from cases import attention, block_sparse, fp8, glu, modulate, moe, norm, rope
from compile_ops import reference

# Imported to register the torch.ops.fused ops that OpSpec.op looks up.
from compile_ops.ops import attention as _attention_ops  # noqa: F401
from compile_ops.ops import fp8 as _fp8_ops  # noqa: F401
from compile_ops.ops import glu as _glu_ops  # noqa: F401
from compile_ops.ops import modulate as _modulate_ops  # noqa: F401
from compile_ops.ops import moe as _moe_ops  # noqa: F401
from compile_ops.ops import norm as _norm_ops  # noqa: F401
from compile_ops.ops import rope as _rope_ops  # noqa: F401

Shape = tuple[int, ...]

#: ``torch.library.opcheck``'s tests (its default ``test_utils``).
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
#: ``torch.library.opcheck``'s tests but ``test_schema`` (see ``OpSpec.opcheck_tests``).
OPCHECK_WITHOUT_SCHEMA = OPCHECK_TESTS[1:]


@dataclass(frozen=True)
class OpSpec:
    name: str
    """``torch.ops.fused.<name>``."""
    family: str
    """The stem of the op's modules in kernels/, meta/, reference/, ops/, cases/, tests/, bench/."""
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
    opcheck_tests: Optional[tuple] = None
    """The ``test_utils`` that ``torch.library.opcheck`` runs on the op (None: all
    of them). ``OPCHECK_WITHOUT_SCHEMA`` leaves out ``test_schema``, whose
    check that the op mutates no input compares the inputs with
    ``torch.allclose``, which has no float8 kernel on the CPU: for ops that
    take float8 tensors (``fp8_rows_lora``)."""

    @property
    def op(self) -> torch._ops.OpOverloadPacket:
        return getattr(torch.ops.fused, self.op_name or self.name)

    @property
    def qualname(self) -> str:
        return f"fused::{self.op_name or self.name}"


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
    OpSpec(
        "rmsnorm",
        "norm",
        reference.norm.rmsnorm,
        norm.make_norm(norm.rmsnorm_args),
        norm.norm_edges(norm.rmsnorm_args),
        bench_shapes=DIT_NORM_SHAPES,
    ),
    OpSpec(
        "add_rmsnorm",
        "norm",
        reference.norm.add_rmsnorm,
        norm.make_norm(norm.add_rmsnorm_args),
        norm.norm_edges(norm.add_rmsnorm_args),
        bench_shapes=DIT_NORM_SHAPES,
    ),
    OpSpec(
        "layernorm",
        "norm",
        reference.norm.layernorm,
        norm.make_norm(norm.layernorm_args),
        norm.norm_edges(norm.layernorm_args),
        bench_shapes=DIT_NORM_SHAPES,
    ),
    OpSpec("norm_backward", "norm", reference.norm.norm_backward, None, norm.norm_backward_edges, differentiable=False),
    OpSpec(
        "modulate",
        "modulate",
        reference.modulate.modulate,
        modulate.make_modulation(modulate.modulate_args),
        modulate.modulation_edges(modulate.modulate_args),
        bench_shapes=DIT_NORM_SHAPES[:1],
    ),
    OpSpec(
        "norm_modulate",
        "modulate",
        reference.modulate.norm_modulate,
        modulate.make_modulation(modulate.norm_modulate_args("layernorm")),
        modulate.modulation_edges(modulate.norm_modulate_args("layernorm")),
        bench_shapes=DIT_NORM_SHAPES,
    ),
    OpSpec(
        "gated_residual",
        "modulate",
        reference.modulate.gated_residual,
        modulate.make_modulation(modulate.gated_residual_args),
        modulate.modulation_edges(modulate.gated_residual_args),
        bench_shapes=DIT_NORM_SHAPES[:1],
    ),
    OpSpec(
        "gated_residual_norm_modulate",
        "modulate",
        reference.modulate.gated_residual_norm_modulate,
        modulate.make_modulation(modulate.gated_residual_norm_modulate_args("layernorm")),
        modulate.modulation_edges(modulate.gated_residual_norm_modulate_args("rmsnorm")),
        bench_shapes=DIT_NORM_SHAPES,
    ),
    # The FP8 output modes (inference only): the same arguments, e4m3 rows + scales out.
    OpSpec(
        "norm_modulate_fp8",
        "modulate",
        reference.modulate.norm_modulate_fp8,
        modulate.make_modulation(modulate.norm_modulate_args("layernorm")),
        modulate.modulation_edges(modulate.norm_modulate_args("rmsnorm")),
        differentiable=False,
        bench_shapes=DIT_NORM_SHAPES[:1],
    ),
    OpSpec(
        "gated_residual_norm_modulate_fp8",
        "modulate",
        reference.modulate.gated_residual_norm_modulate_fp8,
        modulate.make_modulation(modulate.gated_residual_norm_modulate_args("layernorm")),
        modulate.modulation_edges(modulate.gated_residual_norm_modulate_args("layernorm")),
        differentiable=False,
        bench_shapes=DIT_NORM_SHAPES[:1],
    ),
    OpSpec(
        "modulate_backward",
        "modulate",
        reference.modulate.modulate_backward,
        None,
        modulate.modulate_backward_edges,
        differentiable=False,
    ),
    OpSpec(
        "rope",
        "rope",
        reference.rope.rope,
        rope.make_rope,
        rope.rope_edges,
        bench_shapes=ROPE_SHAPES,
        backward_reads_inputs=False,
    ),
    OpSpec(
        "rope_qk",
        "rope",
        reference.rope.rope_qk,
        rope.make_rope_qk,
        rope.rope_qk_edges,
        bench_shapes=ROPE_SHAPES,
        backward_reads_inputs=False,
    ),
    OpSpec(
        "rope_grid",
        "rope",
        reference.rope.rope_grid,
        rope.make_rope_grid,
        rope.rope_grid_edges,
        bench_shapes=ROPE_SHAPES,
        backward_reads_inputs=False,
    ),
    OpSpec(
        "qk_norm_rope",
        "rope",
        reference.rope.qk_norm_rope,
        rope.make_qk_norm_rope,
        rope.qk_norm_rope_edges,
        bench_shapes=ROPE_SHAPES,
    ),
    OpSpec(
        "qk_norm_rope_backward",
        "rope",
        reference.rope.qk_norm_rope_backward,
        None,
        rope.qk_norm_rope_backward_edges,
        differentiable=False,
    ),
    # 8-bit attention's q and k from the rotation's kernel (inference only).
    OpSpec(
        "qk_rope_int8",
        "rope",
        reference.rope.qk_rope_int8,
        rope.make_qk_rope_int8,
        rope.qk_rope_int8_edges,
        differentiable=False,
    ),
    OpSpec("geglu", "glu", reference.glu.geglu, glu.make_glu("none"), glu.glu_edges("none"), bench_shapes=GLU_SHAPES),
    OpSpec(
        "geglu_tanh",
        "glu",
        reference.glu.geglu,
        glu.make_glu("tanh"),
        glu.glu_edges("tanh"),
        bench_shapes=GLU_SHAPES,
        op_name="geglu",
    ),
    OpSpec("swiglu", "glu", reference.glu.swiglu, glu.make_glu(), glu.glu_edges(), bench_shapes=GLU_SHAPES),
    OpSpec("glu_backward", "glu", reference.glu.glu_backward, None, glu.glu_backward_edges, differentiable=False),
    OpSpec(
        "moe_route", "moe", reference.moe.moe_route, moe.make_moe(64, 2, True), moe.moe_edges, bench_shapes=MOE_SHAPES
    ),
    # HiDream-I1's gate: 4 experts, 2 per token, not renormalized.
    OpSpec(
        "moe_route_hidream",
        "moe",
        reference.moe.moe_route,
        moe.make_moe(4, 2, False),
        lambda dtype, device, g: moe.moe_edges(dtype, device, g)[1:2],
        bench_shapes=MOE_HIDREAM_SHAPES,
        op_name="moe_route",
    ),
    OpSpec(
        "moe_route_backward",
        "moe",
        reference.moe.moe_route_backward,
        None,
        moe.moe_backward_edges,
        differentiable=False,
    ),
    # Inference only: its autograd formula raises (no gradient to check).
    OpSpec(
        "quantize_fp8_rows",
        "fp8",
        reference.fp8.quantize_fp8_rows,
        fp8.make_quantize(),
        fp8.quantize_edges(),
        differentiable=False,
        bench_shapes=FP8_SHAPES[2:],
    ),
    # The MLP's hidden activation quantized in the same pass (the kernel's ACT).
    OpSpec(
        "quantize_fp8_rows_gelu_tanh",
        "fp8",
        reference.fp8.quantize_fp8_rows,
        fp8.make_quantize("gelu_tanh"),
        fp8.quantize_edges("gelu_tanh"),
        differentiable=False,
        op_name="quantize_fp8_rows",
        bench_shapes=FP8_SHAPES[:1] + FP8_SHAPES[3:],
    ),
    # ... and the row concatenation of a head and the activation (Flux's single block).
    OpSpec(
        "quantize_fp8_rows_concat",
        "fp8",
        reference.fp8.quantize_fp8_rows,
        fp8.make_quantize_concat,
        fp8.quantize_concat_edges,
        differentiable=False,
        op_name="quantize_fp8_rows",
        bench_shapes=FP8_SHAPES[1:2],
    ),
    # One LoRA adapter on FP8 rows (inference only): opcheck's schema test
    # compares float8 inputs with torch.allclose, which has no float8 CPU kernel.
    OpSpec(
        "fp8_rows_lora",
        "fp8",
        reference.fp8.fp8_rows_lora,
        fp8.make_rows_lora,
        fp8.rows_lora_edges,
        differentiable=False,
        bench_shapes=FP8_SHAPES[2:3],
        opcheck_tests=OPCHECK_WITHOUT_SCHEMA,
    ),
    OpSpec(
        "attention",
        "attention",
        reference.attention.attention,
        attention.make_attention,
        attention.attention_edges,
        tf32=True,
    ),
    OpSpec(
        "attention_backward",
        "attention",
        reference.attention.attention_backward,
        None,
        attention.attention_backward_edges,
        differentiable=False,
    ),
    # Inference only: its autograd formula raises.
    OpSpec(
        "attention_int8",
        "attention",
        reference.attention.attention_int8,
        attention.make_attention_int8,
        attention.attention_int8_edges,
        differentiable=False,
    ),
    OpSpec(
        "attention_int8_fp8",
        "attention",
        reference.attention.attention_int8_fp8,
        attention.make_attention_int8,
        attention.attention_int8_edges,
        differentiable=False,
    ),
    # Its output as the FP8 rows the output projection reads (a quantizing epilogue).
    OpSpec(
        "attention_int8_fp8_rows",
        "attention",
        reference.attention.attention_int8_fp8_rows,
        attention.make_attention_int8,
        attention.attention_int8_edges,
        differentiable=False,
    ),
    # ... on q and k quantized by fused.qk_rope_int8.
    OpSpec(
        "attention_qk8",
        "attention",
        reference.attention.attention_qk8,
        attention.make_attention_qk8,
        attention.attention_qk8_edges,
        differentiable=False,
    ),
    OpSpec(
        "block_sparse_attention",
        "block_sparse",
        reference.block_sparse.block_sparse_attention,
        block_sparse.make_block_sparse,
        block_sparse.block_sparse_edges,
        tf32=True,
    ),
    # Its 8-bit precisions (inference only: a gradient raises), against their
    # specification, the same quantization over the listed blocks.
    OpSpec(
        "block_sparse_attention_int8",
        "block_sparse",
        reference.block_sparse.block_sparse_attention,
        block_sparse.make_block_sparse_8bit("int8"),
        block_sparse.block_sparse_8bit_edges("int8"),
        differentiable=False,
        op_name="block_sparse_attention",
    ),
    OpSpec(
        "block_sparse_attention_int8_fp8",
        "block_sparse",
        reference.block_sparse.block_sparse_attention,
        block_sparse.make_block_sparse_8bit("int8_fp8"),
        block_sparse.block_sparse_8bit_edges("int8_fp8"),
        differentiable=False,
        op_name="block_sparse_attention",
    ),
    # ... its output as the FP8 rows the output projection reads (a quantizing epilogue).
    OpSpec(
        "block_sparse_attention_int8_fp8_rows",
        "block_sparse",
        reference.block_sparse.block_sparse_attention_int8_fp8_rows,
        block_sparse.make_block_sparse_fp8_rows,
        block_sparse.block_sparse_fp8_rows_edges,
        differentiable=False,
    ),
    OpSpec(
        "block_sparse_attention_backward",
        "block_sparse",
        reference.block_sparse.block_sparse_attention_backward,
        None,
        block_sparse.block_sparse_backward_edges,
        differentiable=False,
    ),
)

BY_NAME = {spec.name: spec for spec in OPS}
