"""Layer 2b: every kernel variant the launchers emit compiles for an H100 (sm_90), on CPU.

The interpreter runs kernels as Python and accepts code that triton's compiler
rejects (a name reused inside and outside a loop becomes a loop-carried value
of two types, for instance: that reached the GPU once). Here the launch of
every registry op is traced on fake CUDA tensors, as in test_ops_registry.py,
and each distinct (kernel, argument types, constexprs) is compiled ahead of
time through PTX to a cubin with triton's bundled ptxas; no GPU is needed.
Float scalars are compiled as fp32 (triton's launcher) and fp64 (Inductor's).
"""

import pytest
import torch
import triton
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cases import OPS
from compile_ops._library import OP_BODIES

_POINTER = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.float64: "*fp64",
    torch.int8: "*i8",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.float8_e4m3fn: "*fp8e4nv",
}


def _fake_cuda(args):
    return tuple(
        torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cuda") if isinstance(a, torch.Tensor) else a
        for a in args
    )


def _launches(spec, dtype, body=None):
    """``{key: (kernel, signature, constexprs)}`` of every launch of the op's body
    (or of ``body``, called with the op's arguments) over its edge inputs and
    one DiT-sized input."""
    body = body or OP_BODIES[spec.qualname]
    cases = list(spec.edge_inputs(dtype, "cpu", False))
    with FakeTensorMode(allow_non_fake_inputs=True):
        if spec.make_inputs is not None:
            with torch.device("meta"):
                cases.append(spec.make_inputs((2, 64, 3072), dtype, "meta", False))
        launches = {}
        for args in cases:
            gm = make_fx(lambda *a: body(*a))(*_fake_cuda(args))
            for node in gm.graph.nodes:
                if node.target is not torch.ops.higher_order.triton_kernel_wrapper_mutation:
                    continue
                kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
                # torch wraps a plain @triton.jit kernel in a no-config Autotuner.
                kernel = kernel if isinstance(kernel, triton.runtime.JITFunction) else kernel.fn
                constants = dict(kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"]))
                signature = {}
                for name, value in node.kwargs["kwargs"].items():
                    value = value.meta["val"] if hasattr(value, "meta") else value
                    if isinstance(value, torch.Tensor):
                        signature[name] = _POINTER[value.dtype]
                    elif isinstance(value, bool) or isinstance(value, triton.language.dtype):
                        constants[name] = value
                    elif isinstance(value, int):
                        signature[name] = "i64" if abs(value) >= 2**31 else "i32"
                    elif isinstance(value, float):
                        signature[name] = "fp32"
                    else:
                        constants[name] = value
                constexpr_params = {p.name for p in kernel.params if p.is_constexpr}
                for name in list(signature):
                    if name in constexpr_params:  # BLOCK sizes and the like arrive as ints
                        constants[name] = node.kwargs["kwargs"][name]
                        del signature[name]
                for name in constants:
                    signature[name] = "constexpr"
                key = (
                    kernel.fn.__name__,
                    tuple(sorted(signature.items())),
                    tuple(sorted((k, str(v)) for k, v in constants.items())),
                )
                launches[key] = (kernel, signature, constants)
    return launches


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("spec", OPS, ids=[s.name for s in OPS])
def test_every_launched_kernel_variant_compiles_for_sm90(spec, dtype, monkeypatch):
    from compile_ops.ops import attention_launch

    # The variants an H100 launches: the fake CUDA device of a CPU-only build has TMA.
    monkeypatch.setattr(attention_launch, "has_tma", lambda t: t.device.type == "cuda")
    launches = _launches(spec, dtype)
    assert launches, "the op launched no kernel"
    for name, (kernel, signature, constants) in launches.items():
        ordered = {p: signature[p] for p in kernel.arg_names if p in signature}
        # Triton's launcher passes a Python float as fp32, Inductor's as fp64
        # (an fp64 eps once promoted a loop-carried accumulator): compile both.
        float_types = ("fp32", "fp64") if "fp32" in ordered.values() else ("fp32",)
        for float_type in float_types:
            typed = {p: float_type if t == "fp32" else t for p, t in ordered.items()}
            src = ASTSource(fn=kernel, signature=typed, constexprs=constants)
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            assert compiled.asm.get("cubin"), f"{name[0]} ({float_type} scalars): no cubin"


def test_fp8_quantize_schedules_compile_for_sm90(monkeypatch):
    """The quantize kernel's schedules: each candidate of bench/sweeps/fp8.py,
    traced at its shape as that shape's SCHEDULES entry (tiles of several
    rows, blocks narrower than the default's, up to 32 warps),
    compiles for sm_90 with its own warps, specialized as the JIT launches it
    (unit column strides constant, pointers and row sizes divisible by 16)."""
    from types import SimpleNamespace

    from bench.sweeps.fp8 import CASES
    from compile_ops.ops import fp8 as fp8_ops

    divisible = ("X", "Q", "S", "HEAD", "K", "K_HEAD", "stride_row", "stride_head_row")
    for activation, rows, head_width, width, candidates in CASES.values():
        assert width % 16 == head_width % 16 == 0
        with torch.device("meta"):
            args = (torch.empty(rows, width, dtype=torch.bfloat16), activation)
            args += (torch.empty(rows, head_width, dtype=torch.bfloat16),) if head_width else ()
        case = SimpleNamespace(qualname="fused::quantize_fp8_rows", edge_inputs=lambda *_: [args], make_inputs=None)
        for schedule in candidates:
            monkeypatch.setattr(fp8_ops, "SCHEDULES", {(activation, head_width, width): schedule})
            ((kernel, signature, constants),) = _launches(case, torch.bfloat16).values()
            assert (constants["BLOCK_M"], constants["BLOCK_N"]) == schedule[:2]
            constants = {**constants, "stride_col": 1, "stride_head_col": 1}
            ordered = {p: "constexpr" if p in constants else signature[p] for p in kernel.arg_names}
            aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.arg_names) if p in divisible}
            compiled = triton.compile(
                ASTSource(fn=kernel, signature=ordered, constexprs=constants, attrs=aligned),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": schedule.warps},
            )
            assert compiled.asm.get("cubin"), f"{activation} {head_width}+{width} {schedule}: no cubin"


@pytest.mark.parametrize(
    "options",
    [
        dict(tma=True),
        dict(dot_acc=True),
        dict(tma=True, dot_acc=True),
        dict(tma=True, dot_acc=True, warp_specialize=True),
    ],
    ids=["tma", "dot_acc", "tma-dot_acc", "tma-dot_acc-ws"],
)
def test_attention_forward_hopper_options_compile_for_sm90(options, monkeypatch):
    """The forward's Hopper options (issue 28), of which forward_tiles picks
    only TMA (at D=128): traced with the options forced on every launch, the
    variants compile for sm_90 too (and the TMA variant is the one launched)."""
    from compile_ops.ops import attention_launch, attention_tiles

    default = attention_tiles.forward_tiles

    def tiles(d, dtype, tma=False, precision="exact", wgmma=False):  # the portable kernel's variants
        t = default(d, dtype, False, precision)
        return attention_tiles.Tiles(t.block_m, t.block_n, t.num_warps, t.num_stages, **options)

    monkeypatch.setattr(attention_launch, "forward_tiles", tiles)
    spec = next(s for s in OPS if s.name == "attention")
    launches = _launches(spec, torch.bfloat16)
    forward = [
        (kernel, signature, constants)
        for (name, *_), (kernel, signature, constants) in launches.items()
        if name == "attn_fwd_kernel"
    ]
    assert forward and any(c.get("TMA") for _, _, c in forward) == options.get("tma", False)
    for kernel, signature, constants in forward:
        ordered = {p: signature[p] for p in kernel.arg_names if p in signature}
        src = ASTSource(fn=kernel, signature=ordered, constexprs=constants)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        assert compiled.asm.get("cubin")


def test_attention_backward_tma_compiles_for_sm90(monkeypatch):
    """The backward passes' TMA option (dkdv_tiles / dq_tiles take it at
    D=128, dense, on Hopper), forced on every launch of the backward op's
    inputs (whose heads are narrower than 128): the TMA variants of the dk/dv
    and dq kernels compile for sm_90."""
    import dataclasses

    from compile_ops.ops import attention_launch, attention_tiles

    defaults = attention_tiles.dkdv_tiles, attention_tiles.dq_tiles
    monkeypatch.setattr(attention_launch, "has_tma", lambda t: t.device.type == "cuda")
    monkeypatch.setattr(
        attention_launch,
        "dkdv_tiles",
        lambda d, dtype, sparse=False, tma=False: dataclasses.replace(defaults[0](d, dtype, sparse), tma=tma),
    )
    monkeypatch.setattr(
        attention_launch,
        "dq_tiles",
        lambda d, dtype, sparse=False, tma=False: dataclasses.replace(defaults[1](d, dtype, sparse), tma=tma),
    )
    spec = next(s for s in OPS if s.name == "attention_backward")
    # Inputs whose rows are not 16-byte aligned (D = 12 in bf16) keep the pointer loads.
    launches = [
        (kernel, signature, constants)
        for (name, *_), (kernel, signature, constants) in _launches(spec, torch.bfloat16).items()
        if name in ("attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel") and constants["TMA"]
    ]
    assert {kernel.fn.__name__ for kernel, _, _ in launches} == {"attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"}
    for kernel, signature, constants in launches:
        ordered = {p: signature[p] for p in kernel.arg_names if p in signature}
        src = ASTSource(fn=kernel, signature=ordered, constexprs=constants)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        assert compiled.asm.get("cubin")


def test_block_sparse_forward_streams_keys_three_deep_on_sm90(monkeypatch):
    """The block-sparse forward on Hopper reads its block list past Triton's
    pipeliner (``LIST_BY_ASM``, kernels.attention_common.tile_start): its D=128 TMA
    variant compiles for sm_90 with K and V buffered three tiles deep in both
    key loops, as the dense forward's, and no async copy of the list into a
    one-entry buffer (what an ordinary load of the list gets, with K and V two
    deep: the slower sparse forward this option replaced). The portable
    kernel's variant, which TMA GPUs other than sm_90 (and AOTInductor
    packages) run: on an sm_90 GPU the sm_90 core takes these calls, so the
    GPU is taken for one without wgmma."""
    from compile_ops.ops import attention_launch, attention_sm90

    monkeypatch.setattr(attention_launch, "has_tma", lambda t: t.device.type == "cuda")
    monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t: False)
    spec = next(s for s in OPS if s.name == "block_sparse_attention")
    launches = [
        (kernel, signature, constants)
        for (name, *_), (kernel, signature, constants) in _launches(spec, torch.bfloat16).items()
        if name == "attn_fwd_kernel" and constants.get("LIST_BY_ASM") and constants["BLOCK_D"] == 128
    ]
    assert launches, "no D=128 block-sparse forward read its list past the pipeliner"
    for kernel, signature, constants in launches:
        ordered = {p: signature[p] for p in kernel.arg_names if p in signature}
        src = ASTSource(fn=kernel, signature=ordered, constexprs=constants)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
        ttgir = compiled.asm["ttgir"]
        buffers = ttgir.count("ttg.local_alloc : () -> !ttg.memdesc<3x128x128xbf16")
        assert buffers == 4, f"K and V three tiles deep in {buffers} of the 4 buffers of the two key loops"
        assert "1x1xi32" not in ttgir, "the block list went through an async copy again"
        assert "ld.global.b32" in compiled.asm["ptx"]


def test_fp8_pv_accumulated_in_the_mma_compiles_for_sm90(monkeypatch):
    """int8_fp8 with DOT_ACC (the FP8 dot accumulating into the running
    accumulator, measured and left off by ``forward_tiles``): traced with it
    forced, the attention kernel that rounds q itself compiles for sm_90."""
    from compile_ops.ops import attention_launch, attention_tiles

    default = attention_tiles.forward_tiles

    def tiles(d, dtype, tma=False, precision="exact", wgmma=False):  # the portable kernel's variants
        t = default(d, dtype, True, precision)
        return attention_tiles.Tiles(t.block_m, t.block_n, t.num_warps, t.num_stages, tma=t.tma, dot_acc=True)

    monkeypatch.setattr(attention_launch, "forward_tiles", tiles)
    spec = next(s for s in OPS if s.name == "attention_int8_fp8")
    forward = [
        (kernel, signature, constants)
        for (name, *_), (kernel, signature, constants) in _launches(spec, torch.bfloat16).items()
        if name == "attn_fwd_kernel"
    ]
    assert forward and all(c["DOT_ACC"] and c["PV_FP8"] and c["QUANTIZE_Q"] for _, _, c in forward)
    for kernel, signature, constants in forward:
        ordered = {p: signature[p] for p in kernel.arg_names if p in signature}
        src = ASTSource(fn=kernel, signature=ordered, constexprs=constants)
        assert triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm.get("cubin")


@pytest.mark.parametrize("precision", ["int8", "int8_fp8"])
def test_block_sparse_8bit_forward_variants_compile_for_sm90(precision, monkeypatch):
    """``block_sparse_attention(..., precision="int8" / "int8_fp8")``: traced
    over the block-sparse op's inputs (bf16; GQA, per-head lists, key lengths,
    an empty list, no queries, a DiT-sized D = 128 call) on a faked TMA GPU
    without wgmma (the portable kernel's path, which the sm_90 GPU takes too:
    8-bit q is rounded in the kernel, which the core does not do), every
    launch compiles for sm_90: the quantization passes, and the forward with
    SPARSE, INT8 and QUANTIZE_Q (and PV_FP8) together, its D = 128 variant
    with TMA and the block list read past the pipeliner, and the variants
    of a token order (the forward storing its rows at their tokens, the
    quantizing pass gathering q, k and v)."""
    from compile_ops.ops import attention_launch, attention_sm90

    monkeypatch.setattr(attention_launch, "has_tma", lambda t: t.device.type == "cuda")
    monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t: False)
    spec = next(s for s in OPS if s.name == f"block_sparse_attention_{precision}")
    launches = list(_launches(spec, torch.bfloat16).values())
    forward = [c for kernel, _, c in launches if kernel.fn.__name__ == "attn_fwd_kernel"]
    # Every forward rounds q itself but those in a token order, whose q the quantizing pass rounds.
    assert forward and all(
        c["SPARSE"] and c["INT8"] and c["QUANTIZE_Q"] != c["SCATTER"] and c["PV_FP8"] == (precision == "int8_fp8")
        for c in forward
    )
    assert any(c["TMA"] and c["LIST_BY_ASM"] and c["BLOCK_D"] == 128 for c in forward)
    assert any(c["SCATTER"] and c["TMA"] and c["BLOCK_D"] == 128 for c in forward)
    quantize = [c for kernel, _, c in launches if kernel.fn.__name__ == "kv8_quantize_kernel"]
    assert any(c.get("GATHER") and c.get("WITH_Q") for c in quantize)
    assert {kernel.fn.__name__ for kernel, _, _ in launches} >= set(_QUANTIZE_KERNELS)
    for kernel, signature, constants in launches:
        ordered = {p: signature[p] for p in kernel.arg_names if p in signature}
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=ordered, constexprs=constants),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 4},
        )
        assert compiled.asm.get("cubin"), kernel.fn.__name__


def test_a_token_order_keeps_q_in_registers_through_the_key_loop(monkeypatch):
    """The 8-bit forward in a token order (``SCATTER``: q comes rounded, in
    tile order, from the quantizing pass) compiles for sm_90 to the plain
    forward's loop: q stays in registers as the QK MMA's A operand (no int8
    tile loaded back from shared memory in the key loops) and no more layout
    conversions. Fails on a kernel that loads q's rows through the order
    itself: the compiler then keeps q in shared memory and reloads it, and
    converts its row scales between layouts, in every key tile (the first
    form of ``token_order``, whose sparse launches ran about 10% slower)."""
    import re

    from compile_ops.ops import attention_launch, attention_sm90

    monkeypatch.setattr(attention_launch, "has_tma", lambda t: t.device.type == "cuda")
    monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t: False)
    spec = next(s for s in OPS if s.name == "block_sparse_attention_int8_fp8")
    kernel, signature, constants = next(
        launch
        for launch in _launches(spec, torch.bfloat16).values()
        if launch[0].fn.__name__ == "attn_fwd_kernel" and launch[2]["SCATTER"] and launch[2]["BLOCK_D"] == 128
    )
    assert constants["TMA"] and not constants["QUANTIZE_Q"]
    ordered = {p: signature[p] for p in kernel.arg_names if p in signature}

    def loop_ir(scatter: bool) -> str:
        ir = triton.compile(
            ASTSource(fn=kernel, signature=ordered, constexprs=dict(constants, SCATTER=scatter)),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 4},
        ).asm["ttgir"]
        return ir[ir.index("scf.for") :]

    ordered_loops, plain_loops = loop_ir(True), loop_ir(False)
    q_reloads = r"local_load [^\n]*-> tensor<\d+x\d+xi8, #ttg\.dot_op<\{opIdx = 0"
    assert not re.findall(q_reloads, ordered_loops)
    assert ordered_loops.count("convert_layout") == plain_loops.count("convert_layout")


#: quantize_8bit's launches: the statistics pass's arrival counts zeroed,
#: the statistics (each head's totals summed by its last chunk), the values.
_QUANTIZE_KERNELS = ("kv8_counters_clear_kernel", "kv8_stats_kernel", "kv8_quantize_kernel")


@pytest.mark.parametrize(
    "spec", [s for s in OPS if s.name in ("attention_int8", "attention_int8_fp8")], ids=lambda s: s.name
)
def test_8bit_quantization_kernels_compile_for_sm90(spec):
    """The Triton quantization passes of 8-bit attention (the op bodies above
    reach them too; here alone): every variant compiles for sm_90, with its
    int arguments as arguments and as constants (Inductor may pass a static
    int so: ``L.to`` on an int once failed to compile)."""
    from compile_ops.ops import attention_8bit

    def quantize(q, k, v, scale, causal, seq_dim, kv_lengths):
        return attention_8bit.quantize_8bit(k, v if spec.name == "attention_int8_fp8" else None, seq_dim)

    launches = list(_launches(spec, torch.bfloat16, quantize).values())
    assert {kernel.fn.__name__ for kernel, _, _ in launches} == set(_QUANTIZE_KERNELS)
    _compile_with_constant_ints(launches)


def test_fp8_values_alone_kernels_compile_for_sm90():
    """v's quantization alone (WITH_K off: q and k came quantized from
    fused.qk_rope_int8), as attention_qk8 runs it eagerly."""
    from compile_ops.ops import attention_8bit

    spec = next(s for s in OPS if s.name == "attention_qk8")

    def quantize(q, q_scale, k, k_scale, v, scale, causal, seq_dim, *rest):
        return attention_8bit.quantize_8bit(None, v, seq_dim)

    launches = list(_launches(spec, torch.bfloat16, quantize).values())
    assert {kernel.fn.__name__ for kernel, _, _ in launches} == set(_QUANTIZE_KERNELS)
    assert all(constants["WITH_K"] is False for _, _, constants in launches if "WITH_K" in constants)
    _compile_with_constant_ints(launches)


def test_fp8_values_are_stored_in_16_byte_vectors_at_any_length():
    """kv8_quantize_kernel writes v's e4m3 tile transposed, so its store runs
    along the keys; masked at L, its vectors split to L's divisibility, and
    at a length not a multiple of 16 (Wan 480p's 32760 keys) into single
    bytes (2.8x the pass's bytes' time on an H100). In the sm_90 PTX, with
    16-byte-aligned pointers and strides as launches have them and L with no
    divisibility known, every 8-bit store is a 16-byte vector (fails with a
    key mask at L: 128 ``st.global.b8`` per thread)."""
    import re

    from compile_ops.ops import attention_8bit

    spec = next(s for s in OPS if s.name == "attention_int8_fp8")

    def quantize(q, k, v, scale, causal, seq_dim, kv_lengths):
        return attention_8bit.quantize_8bit(k, v, seq_dim)

    launches = [
        (kernel, signature, constants)
        for kernel, signature, constants in _launches(spec, torch.bfloat16, quantize).values()
        if kernel.fn.__name__ == "kv8_quantize_kernel" and constants["BLOCK_D"] == constants["D"] == 128
    ]
    assert launches
    for kernel, signature, constants in launches:
        ordered = {p: signature[p] for p in kernel.arg_names if p in signature}
        aligned = {
            (i,): [["tt.divisibility", 16]]
            for i, p in enumerate(kernel.arg_names)
            if p in signature and p not in ("L", "H", "chunks")
        }
        ptx = triton.compile(
            ASTSource(fn=kernel, signature=ordered, constexprs=constants, attrs=aligned),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 4},
        ).asm["ptx"]
        stores = re.findall(r"st\.global(?:\.v\d)?\.b\d+", ptx)
        assert "st.global.b8" not in stores and stores.count("st.global.v4.b32") == 16, stores


def test_fp8_rows_scale_kernel_compiles_for_sm90():
    """The FP8 output rows' scale bound, computed by a kernel in eager calls
    (traced, the reference's torch ops take its place, so no op body above
    reaches it), at Flux's and Wan's Hk * D."""
    from compile_ops import reference
    from compile_ops.kernels.attention_8bit import fp8_rows_scale_kernel

    signature = {"V_SCALE": "*fp32", "ROW_SCALE": "*fp32", "per_batch": "i32"}
    for per_batch in (24 * 128, 12 * 128, 40):
        constants = dict(
            FLOOR=reference.fp8.AMAX_FLOOR / reference.attention.FP8_MAX,
            HEADROOM=reference.attention.FP8_ROWS_HEADROOM,
            BLOCK=min(4096, triton.next_power_of_2(per_batch)),
        )
        _compile_with_constant_ints([(fp8_rows_scale_kernel, signature, constants)])


def _compile_with_constant_ints(launches):
    for kernel, signature, constants in launches:
        ints = [p for p, t in signature.items() if t in ("i32", "i64")]
        for constant_ints in (False, True):
            consts = dict(constants, **({p: 1000 + i for i, p in enumerate(ints)} if constant_ints else {}))
            typed = {p: ("constexpr" if p in consts else t) for p, t in signature.items()}
            ordered = {p: typed[p] for p in kernel.arg_names if p in typed}
            compiled = triton.compile(
                ASTSource(fn=kernel, signature=ordered, constexprs=consts),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": 4},
            )
            assert compiled.asm.get("cubin")


def test_8bit_rounding_keeps_the_product_out_of_an_fma():
    """``round_to_int8`` rounds ``x * (1 / scale)`` by adding and subtracting
    1.5 * 2**23: if the compiler contracts the product and that add into one
    fma, the product is never rounded to fp32 and a value just below a half
    rounds up, unlike torch (6 GPU test failures, none under the interpreter,
    which cannot contract). In the sm_90 PTX of every quantizing kernel
    (attention's passes and the quantizing rotation) the bias (``0f4B400000``)
    is added by a plain add, never an fma."""

    spec = next(s for s in OPS if s.name == "attention_int8_fp8")
    launches = list(_launches(spec, torch.bfloat16).values())  # its passes, and attention rounding q (QUANTIZE_Q)
    rope = next(s for s in OPS if s.name == "qk_rope_int8")
    launches += list(_launches(rope, torch.bfloat16).values())
    checked = 0
    for kernel, signature, constants in launches:
        ordered = {p: signature[p] for p in kernel.arg_names if p in signature}
        ptx = triton.compile(
            ASTSource(fn=kernel, signature=ordered, constexprs=constants),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 4},
        ).asm["ptx"]
        bias_lines = [line.strip().rstrip(";") for line in ptx.splitlines() if "0f4B400000" in line]
        # The bias as an fma's addend is the contraction; as a factor (the 8-bit forward's
        # exponent, ``factor * _INT8_BIAS + m``) it is the formula.
        assert not [line for line in bias_lines if line.startswith("fma") and line.endswith("0f4B400000")], (
            kernel.fn.__name__,
            bias_lines[:3],
        )
        checked += any(line.startswith("add") for line in bias_lines)
    assert checked >= 2, "no kernel rounded by the bias: the check looked at nothing"


def _sm90_core_variants():
    """``(name, pointer types, constexprs)`` of every variant of the Gluon core:
    the 16-bit ones ``forward_tiles`` gives it (each dtype and head dim),
    dense and block-sparse (int32 and int64 lists), causal or not, with key
    lengths or not (D = 64's 256-key tiles: dense non-causal alone), and INT8_FP8 (measured in
    bench/experiments/sm90_core_sweep.py, not routed yet) at 2 and 3 stages, dense and over
    block lists (int32 and int64; causal with key lengths too)."""
    import itertools

    from compile_ops.ops import attention_sm90, attention_tiles

    regs = attention_sm90.SM90_CORE_CONSUMER_REGS
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        for d in attention_tiles.SM90_CORE_HEAD_DIMS:
            t = attention_tiles.forward_tiles(d, torch_dtype, True, "exact", True)
            assert t.sm90_core
            pointers = dict(Q=f"*{dtype}", K=f"*{dtype}", V=f"*{dtype}", OUT=f"*{dtype}", LSE="*fp32")
            constants = dict(
                D=d,
                BLOCK_N=t.block_n,
                STAGES=t.num_stages,
                CONSUMER_REGS=regs,
                INT8_FP8=False,
                Q_SCALE=None,
                K_SCALE=None,
                V_SCALE=None,
                num_warps=4,
            )
            for lists, causal, kv_len in itertools.product((None, "i32", "i64"), (False, True), (False, True)):
                if dtype == "fp16" and (lists == "i64" or causal != kv_len):
                    continue  # the dtype changes nothing in these: the corners suffice
                if t.block_n != 128 and (lists or causal or kv_len):
                    continue  # wide key tiles (D = 64) take dense non-causal calls alone (takes_sm90_core)
                variant_pointers = dict(pointers)
                flags = dict(SPARSE=bool(lists), CAUSAL=causal, HAS_KV_LEN=kv_len, HEAVY_FIRST=causal and not lists)
                if lists:
                    variant_pointers.update(BLOCKS=f"*{lists}", COUNTS=f"*{lists}")
                else:
                    flags.update(BLOCKS=None, COUNTS=None)
                if kv_len:
                    variant_pointers.update(KV_LEN="*i32")
                else:
                    flags.update(KV_LEN=None)
                name = f"{dtype}-d{d}-{lists or 'dense'}{'-causal' if causal else ''}{'-kv_len' if kv_len else ''}"
                yield name, variant_pointers, dict(constants, **flags)
    eight_bit_pointers = dict(
        Q="*i8", K="*i8", V="*fp8e4nv", OUT="*bf16", LSE="*fp32", Q_SCALE="*fp32", K_SCALE="*fp32", V_SCALE="*fp32"
    )
    eight_bit_constants = dict(D=128, BLOCK_N=128, CONSUMER_REGS=regs, INT8_FP8=True, num_warps=4)
    dense = dict(BLOCKS=None, COUNTS=None, KV_LEN=None, SPARSE=False, CAUSAL=False, HAS_KV_LEN=False, HEAVY_FIRST=False)
    for stages in (2, 3):
        yield f"int8_fp8-{stages}-stages", eight_bit_pointers, dict(eight_bit_constants, STAGES=stages, **dense)
    # Over block lists (block-sparse attention's 8-bit operands): each listed block's tile takes its k scale.
    for lists, causal_kv_len in (("i32", False), ("i64", True)):
        pointers = dict(eight_bit_pointers, BLOCKS=f"*{lists}", COUNTS=f"*{lists}")
        flags = dict(SPARSE=True, CAUSAL=causal_kv_len, HAS_KV_LEN=causal_kv_len, HEAVY_FIRST=False)
        if causal_kv_len:
            pointers["KV_LEN"] = "*i32"
        else:
            flags["KV_LEN"] = None
        name = f"int8_fp8-{lists}{'-causal-kv_len' if causal_kv_len else ''}"
        yield name, pointers, dict(eight_bit_constants, STAGES=attention_tiles.SM90_CORE_STAGES, **flags)


@pytest.mark.parametrize("variant", list(_sm90_core_variants()), ids=lambda v: v[0])
def test_attention_sm90_core_compiles_for_sm90_with_its_register_budgets(variant, tmp_path):
    """The Gluon core (kernels/attention_sm90.py), every variant: it compiles
    for sm_90 with its three partitions' register budgets set
    (``setmaxnreg``: 24 for the loader, SM90_CORE_CONSUMER_REGS for the
    consumers) under the launch's register bound, and nothing spilled inside
    a loop (the key loops): the 16-bit dense variants spill nothing at all;
    with block lists or 8-bit operands the 24-register loader or a consumer
    may keep a few of the item loop's invariants in local memory, reloaded
    outside the loops that hold them (ptxas, the SASS by cuobjdump)."""
    import os
    import re
    import subprocess

    from triton import knobs
    from triton.experimental.gluon._runtime import GluonASTSource

    from compile_ops.kernels.attention_sm90 import attn_fwd_sm90_kernel as kernel
    from compile_ops.ops import attention_sm90

    name, pointers, constants = variant
    signature = {
        p: pointers.get(p, "constexpr" if p in constants else "fp32" if p == "scale" else "i32")
        for p in kernel.arg_names
    }
    launch = attention_sm90.SM90_CORE_LAUNCH
    compiled = triton.compile(
        GluonASTSource(fn=kernel, signature=signature, constexprs=constants),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=launch["num_warps"], maxnreg=launch["maxnreg"]),
    )
    ptx = compiled.asm["ptx"]
    budgets = {int(n) for n in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)}
    assert {24, attention_sm90.SM90_CORE_CONSUMER_REGS} <= budgets, (name, sorted(budgets))
    (tmp_path / "core.ptx").write_text(ptx)
    report = subprocess.run(
        [knobs.nvidia.ptxas.path, "-v", "-arch=sm_90a", str(tmp_path / "core.ptx"), "-o", str(tmp_path / "core.cubin")],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    assert "Used " in report, (name, report)
    if "-dense" in name:  # the 16-bit list-free variants (int8_fp8 ones are named by their stages)
        assert "0 bytes spill stores" in report, (name, report)
    sass = subprocess.run(
        [os.path.join(os.path.dirname(knobs.nvidia.ptxas.path), "cuobjdump"), "-sass", str(tmp_path / "core.cubin")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert not _spills_in_innermost_loops(sass), (name, _spills_in_innermost_loops(sass))
    # The item loops too, which hold the masked tile's step: spills there cost 3-14% an item (a 32-register
    # loader left some in the dense core, 8% slower at 4500 keys; docs/notes/attention-forward.md, "The
    # persistent core's last round"). None in the routed variants; INT8_FP8 (not routed, 0.81-0.94x the
    # portable kernel) has 13, a lead for issue 29, bounded as they are. Over block lists its items also hold
    # their list (22), and causal items with key lengths the masked tile's bounds too, around whose step
    # ptxas saves and restores a few registers (64-72; the dense core's causal INT8_FP8, not built, has 39).
    item_spills = _spills_in_loops_with_mma(sass)
    bound = 0
    if name.startswith("int8_fp8"):  # dense (named by its stages), over lists, over lists causal with key lengths
        bound = 13 if "stages" in name else 72 if "causal" in name else 24
    assert len(item_spills) <= bound, (name, item_spills)


def test_five_product_backward_kernels_compile_for_sm90(monkeypatch, tmp_path):
    """``set_attention_backward(deterministic=False)``'s kernels: traced on a
    faked sm_90 GPU, ``fused.attention_backward`` launches the statistics
    pass with its dq zeroing and dq's cast, which compile for sm_90; the
    Gluon kernel (bf16 and fp16, D = 128 and 64; masked keys, causal, key
    lengths, block lists, a split last round, without dQ, persistent) and the kernel
    adding up a split item's parts
    compile, the Gluon kernel with its partitions' register budgets,
    spilling a few set-up scalars at most, none in a loop when dense at
    D = 128 (ptxas, cuobjdump). D = 64's 128-query steps (dense) keep a
    few more set-up scalars in local memory, reloaded in the step loop: 3
    accesses a step, 11 with masked keys, 19 causal (ptxas at 240
    registers: dK, dV, two 64 x 128 score tiles and their 16-bit
    operands); none without dQ."""
    import os
    import re
    import subprocess

    from triton import knobs
    from triton.experimental.gluon._runtime import GluonASTSource

    from compile_ops.kernels.attention_sm90_backward import attn_bwd_sm90_kernel as kernel
    from compile_ops.ops import attention_launch, attention_sm90

    monkeypatch.setattr(attention_launch, "has_tma", lambda t: t.device.type == "cuda")
    monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t: t.device.type == "cuda")
    monkeypatch.setattr(attention_sm90, "ATOMIC_DQ", True)
    spec = next(s for s in OPS if s.name == "attention_backward")

    def backward(grad, q, k, v, out, lse, scale, causal, seq_dim, kv_lengths):  # D = 128, Lk 256: the kernel's calls
        b, h, lq = grad.shape[:3] if seq_dim == 2 else (grad.shape[0], grad.shape[2], grad.shape[1])
        q, grad, out = (torch.empty(b, h, lq, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        k, v = (torch.empty(b, h, 256, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        return OP_BODIES[spec.qualname](grad, q, k, v, out, lse, scale, False, 2, None)

    launches = _launches(spec, torch.bfloat16, backward)
    names = {kernel.fn.__name__ for kernel, _, _ in launches.values()}
    assert names == {"attn_bwd_row_stats_kernel", "attn_bwd_dq_from_acc_kernel"}, names
    assert all(
        signature.get("DQ_ACC") == "*fp32"  # the statistics pass zeroes the accumulator
        for kernel, signature, _ in launches.values()
        if kernel.fn.__name__ == "attn_bwd_row_stats_kernel"
    )
    # The opaque op's own Triton kernel: the parts of a split last round added up (D = 128 and 64).
    from compile_ops.kernels.attention_backward import attn_bwd_parts_kernel as parts_kernel

    launches = list(launches.values())
    for dtype, d in (("bf16", 128), ("fp16", 64)):
        signature = {p: "i32" for p in parts_kernel.arg_names}
        signature.update(PARTIALS="*fp32", DK=f"*{dtype}", DV=f"*{dtype}", D="constexpr", BLOCK_M="constexpr")
        launches.append((parts_kernel, signature, dict(D=d, BLOCK_M=32)))
    _compile_with_constant_ints(launches)
    launch = attention_sm90.SM90_CORE_LAUNCH
    variants = [
        ("bf16", dict()),
        ("bf16", dict(MASKED_KEYS=True)),
        ("fp16", dict()),
        # the last round split into parts (dense, not causal, no key lengths)
        ("bf16", dict(SPLIT=True)),
        ("fp16", dict(SPLIT=True, MASKED_KEYS=True)),
        ("bf16", dict(CAUSAL=True, HEAVY_FIRST=True, MASKED_KEYS=True)),
        ("fp16", dict(HAS_KV_LEN=True, MASKED_KEYS=True)),
        ("bf16", dict(CAUSAL=True, HAS_KV_LEN=True, HEAVY_FIRST=True, MASKED_KEYS=True)),
        ("bf16", dict(SPARSE=True)),
        ("fp16", dict(SPARSE=True, MASKED_KEYS=True)),
        ("bf16", dict(SPARSE=True, CAUSAL=True, HAS_KV_LEN=True, MASKED_KEYS=True)),
        # D = 64: one dQ piece a consumer
        ("bf16", dict(D=64)),
        ("fp16", dict(D=64, CAUSAL=True, HAS_KV_LEN=True, HEAVY_FIRST=True, MASKED_KEYS=True)),
        ("bf16", dict(D=64, SPLIT=True, MASKED_KEYS=True)),
        ("bf16", dict(D=64, SPARSE=True, MASKED_KEYS=True)),
        # D = 64 with 64-query steps (bench/experiments/five_product_backward.py's step=64)
        ("bf16", dict(D=64, STEP=64)),
        # without dQ: the deterministic backward's dk/dv pass (DQ_ACC unused)
        ("bf16", dict(DQ=False)),
        ("fp16", dict(DQ=False, D=64, MASKED_KEYS=True)),
        ("bf16", dict(DQ=False, CAUSAL=True, HAS_KV_LEN=True, HEAVY_FIRST=True, MASKED_KEYS=True)),
        # ... persistent (dense, not causal: ops.attention_sm90.SM90_DKDV_PERSISTENT)
        ("bf16", dict(DQ=False, PERSISTENT=True)),
        ("fp16", dict(DQ=False, D=64, MASKED_KEYS=True, PERSISTENT=True)),
    ]
    for dtype, flags in variants:
        pointers = dict(
            Q=f"*{dtype}",
            K=f"*{dtype}",
            V=f"*{dtype}",
            DO=f"*{dtype}",
            LSE_ROWS="*fp32",
            DELTA="*fp32",
            DQ_ACC="*fp32",
            DK=f"*{dtype}",
            DV=f"*{dtype}",
            PARTIALS="*fp32",
        )
        if flags.get("HAS_KV_LEN"):
            pointers["KV_LEN"] = "*i32"
        if flags.get("SPARSE"):
            pointers.update(BLOCKS="*i32", COUNTS="*i64")
        d = flags.pop("D", 128)
        constants = dict(
            D=d,
            STEP=attention_sm90.backward_step(d, bool(flags.get("SPARSE"))),
            STAGES=attention_sm90.SM90_BACKWARD_STAGES,
            CONSUMER_REGS=attention_sm90.SM90_CORE_CONSUMER_REGS,
            CAUSAL=False,
            HAS_KV_LEN=False,
            HEAVY_FIRST=False,
            SPARSE=False,
            MASKED_KEYS=False,
            DQ=True,
            SPLIT=False,
            PERSISTENT=False,
            num_warps=4,
        )
        constants.update(flags)
        if not constants["DQ"]:
            del pointers["DQ_ACC"]
        if not constants["SPLIT"]:
            del pointers["PARTIALS"]
        constants.update(
            {name: None for name in ("KV_LEN", "BLOCKS", "COUNTS", "DQ_ACC", "PARTIALS") if name not in pointers}
        )
        signature = {
            p: pointers.get(p, "constexpr" if p in constants else "fp32" if p == "scale" else "i32")
            for p in kernel.arg_names
        }
        aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.arg_names) if p in pointers}
        ptx = triton.compile(
            GluonASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=aligned),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=launch["num_warps"], maxnreg=launch["maxnreg"]),
        ).asm["ptx"]
        budgets = {int(n) for n in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)}
        assert {24, attention_sm90.SM90_CORE_CONSUMER_REGS} <= budgets, (dtype, d, flags, sorted(budgets))
        # dq added by TMA reductions, or (without DQ) not at all
        assert ("cp.reduce.async.bulk.tensor" in ptx) == constants["DQ"], (dtype, d, flags)
        (tmp_path / "bwd.ptx").write_text(ptx)
        report = subprocess.run(
            [
                knobs.nvidia.ptxas.path,
                "-v",
                "-arch=sm_90a",
                str(tmp_path / "bwd.ptx"),
                "-o",
                str(tmp_path / "bwd.cubin"),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
        # Masks, the causal order and block lists add loop-invariant set-up values (batch, head, tile,
        # list pointers) that ptxas keeps in local memory at the consumers' 168 registers: 4-52 bytes,
        # reloaded from L1 at most twice a 64-query step. The dense kernel keeps one (the tile's first key,
        # 4 bytes: stored before the step loop, loaded after it), none in a loop. A spilled tile (dk, dv
        # or a score tile: 256 bytes a thread each) would pass neither bound. 128-query steps: up to 76 and
        # 96 bytes (causal with key lengths).
        stored, loaded = (int(re.search(rf"(\d+) bytes spill {kind}", report).group(1)) for kind in ("stores", "loads"))
        wide = constants["STEP"] > 64
        assert stored <= (80 if wide else 64) and loaded <= (112 if wide else 96), (dtype, d, flags, report)
        if flags in (dict(), dict(DQ=False), dict(SPLIT=True)):  # dense
            sass = subprocess.run(
                [
                    os.path.join(os.path.dirname(knobs.nvidia.ptxas.path), "cuobjdump"),
                    "-sass",
                    str(tmp_path / "bwd.cubin"),
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            # (a spilled tile would be 32-64 accesses a step: these bounds pass only scalars)
            bound = 4 if constants["STEP"] > 64 and constants["DQ"] else 0
            assert len(_spills_in_loops_with_mma(sass)) <= bound, (dtype, d, _spills_in_loops_with_mma(sass))


def _sass_loops(sass: str) -> tuple:
    """A SASS listing's ``(code, loops)``: its instructions as ``(address,
    text)`` and its loops as the ``(start, end)`` spans of backward branches
    that hold no ``EXIT`` and no ``USETMAXREG``: an mbarrier wait's retry
    stub sits past the kernel's exit and branches back to the wait, and a
    warp-specialized partition branches back to where the partitions start
    (and set their register budgets) when it is done; neither is a loop.
    """
    import re

    code = [(int(at, 16), op) for at, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    assert code, "no SASS instructions parsed"
    ends = [at for at, op in code if re.match(r"(@!?U?P\w+\s+)?(EXIT|USETMAXREG)\b", op.strip())]
    loops = [
        (int(m.group(1), 16), at)
        for at, op in code
        for m in [re.search(r"\bBRA\s+0x([0-9a-f]+)", op)]
        if m and int(m.group(1), 16) <= at and not any(int(m.group(1), 16) <= e <= at for e in ends)
    ]
    assert loops, "no loop found: the SASS format changed"
    return code, loops


def _spills_in(code: list, spans: list) -> list:
    """The local-memory loads and stores (spills) of ``code`` inside any of ``spans``."""
    import re

    return [
        (hex(at), op)
        for at, op in code
        if re.search(r"\b(STL|LDL)\b", op) and any(start <= at <= end for start, end in spans)
    ]


def _spills_in_loops_with_mma(sass: str) -> list:
    """The spills of a SASS listing inside any loop that issues a warpgroup
    MMA (``HGMMA``, 8-bit ``IGMMA`` / ``QGMMA``): the consumers' item loops
    and the key loops within them."""
    code, loops = _sass_loops(sass)
    with_mma = [(start, end) for start, end in loops if any("GMMA" in op for at, op in code if start <= at <= end)]
    assert with_mma, "no loop issues a warpgroup MMA: the SASS format changed"
    return _spills_in(code, with_mma)


def _spills_in_innermost_loops(sass: str) -> list:
    """The spills of a SASS listing that sit in an innermost loop: the span
    of a backward branch that holds no other such span (the key loops; an
    mbarrier wait retries from a stub past the exit, so it nests nothing)."""
    code, loops = _sass_loops(sass)
    innermost = [a for a in loops if not any(b != a and a[0] <= b[0] and b[1] <= a[1] for b in loops)]
    return _spills_in(code, innermost)
