"""Layer 2b: every kernel variant the launchers emit compiles for an H100 (sm_90), on CPU.

The interpreter runs kernels as Python and accepts code that triton's compiler
rejects (a name reused inside and outside a loop becomes a loop-carried value
of two types, for instance: that reached the GPU once). Here the launch of
every registry op is traced on fake CUDA tensors, as in test_ops_registry.py,
and each distinct (kernel, argument types, constexprs) is compiled ahead of
time through PTX to a cubin with triton's bundled ptxas; no GPU is needed.
Float scalars are compiled as fp32 (triton's launcher), and as fp64 (Inductor's)
through the front end, which must compute no fp64 tile.
Beside the registry's launches: the quantize kernel's schedules, the Triton
attention kernels' Hopper options, block-sparse and 8-bit variants and the
8-bit quantization passes, with what their PTX must hold. The Gluon sm_90
attention cores (register budgets, spills read from the SASS) are
test_sm90_compile_gluon.py's; the tracing helpers are tests/sm90_helpers.py.
"""

import re

import pytest
import torch
import triton
from sm90_helpers import (
    _compile_with_constant_ints,
    _launches,
    _product_loop_spills,
    _ptxas_report,
    _sm90_ptx,
    _sm90_ttir,
)
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cases import OPS


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
        src = ASTSource(fn=kernel, signature=ordered, constexprs=constants)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert compiled.asm.get("cubin"), f"{name[0]}: no cubin"
        # Triton's launcher passes a Python float as fp32, Inductor's as fp64: an
        # fp64 eps once promoted a loop-carried accumulator, which the front end
        # rejects, and could promote a tile's arithmetic, which it accepts. So
        # with fp64 scalars the front end must pass and compute no fp64 tensor.
        if "fp32" in signature.values():
            typed = {p: "fp64" if t == "fp32" else t for p, t in signature.items()}
            promoted = [line.strip() for line in _sm90_ttir(kernel, typed, constants).splitlines() if "xf64>" in line]
            assert not promoted, f"{name[0]}: fp64 scalars promote tile arithmetic: {promoted[:3]}"


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

    def tiles(d, dtype, tma=False, precision="exact", wgmma=False, register_cap=False):  # the portable kernel
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

    def tiles(d, dtype, tma=False, precision="exact", wgmma=False, register_cap=False):  # the portable kernel
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


@pytest.mark.parametrize("op", ["attention_int8_fp8", "attention_int8_fp8_rows", "block_sparse_attention_int8_fp8"])
def test_fp8_p_is_the_products_operand_without_shuffles(op):
    """FP8 P V's p goes from the scores' accumulator layout to the FP8
    product's register operand; with V's keys stored in
    ``fp8_operand_order`` and p's columns reordered the same way, the two
    layouts differ only in a thread's own register order. In the sm_90 PTX
    of every FP8 P V forward the ops launch there is no ``shfl.sync.idx``,
    and no ``prmt`` unless the output is FP8 rows (fails without the
    reorder: 32 of each, Triton's conversion)."""

    spec = next(s for s in OPS if s.name == op)
    forward = [
        (kernel, signature, constants)
        for (name, *_), (kernel, signature, constants) in _launches(spec, torch.bfloat16).items()
        if name == "attn_fwd_kernel" and constants["PV_FP8"]
    ]
    assert forward
    for kernel, signature, constants in forward:
        ptx = _sm90_ptx(kernel, signature, constants)
        assert "shfl.sync.idx" not in ptx, constants
        # (FP8 output rows pack their e4m3 bytes by prmt, after the loop.)
        assert constants["OUT_FP8"] or "prmt." not in ptx, constants


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


def test_gated_rows_held_as_blocks_load_every_block_before_the_first_store(monkeypatch):
    """The gated residual writes residual_out inside its row step. Held as
    blocks, a block's store followed by the next block's loads kept those
    loads behind it (the compiler cannot move a load above a store to a
    pointer it may alias), which the padded row never had. In the sm_90 PTX
    of ``gated_residual_norm_modulate_fp8`` held as 3 x 1024, every global
    load comes before the first global store (fails with the loads and
    stores interleaved block by block)."""
    import re
    from types import SimpleNamespace

    from compile_ops.ops import modulate_launch
    from compile_ops.ops.norm import LaunchConfig

    held = LaunchConfig(2, 1024, False, 4, held_chunks=3)
    monkeypatch.setattr(modulate_launch, "forward_config", lambda *key: held)
    with torch.device("meta"):
        x, mod = torch.empty(1, 64, 3072, dtype=torch.bfloat16), torch.empty(1, 1, 3072, dtype=torch.bfloat16)
    args = (x, x, mod, mod, mod, None, None, "layernorm", 1e-6)
    case = SimpleNamespace(
        qualname="fused::gated_residual_norm_modulate_fp8", edge_inputs=lambda *_: [args], make_inputs=None
    )
    ((kernel, signature, constants),) = _launches(case, torch.bfloat16).values()
    assert constants["CHUNKS"] == 3 and constants["GATED"]
    ordered = {p: "constexpr" if p in constants else signature[p] for p in kernel.arg_names}
    ptx = triton.compile(
        ASTSource(fn=kernel, signature=ordered, constexprs=constants),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 4},
    ).asm["ptx"]
    memory = re.findall(r"\b(ld|st)\.global", ptx)
    first_store = memory.index("st")
    assert "ld" not in memory[first_store:], "".join(m[0] for m in memory)


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
        ptx = _sm90_ptx(kernel, signature, constants)
        bias_lines = [line.strip().rstrip(";") for line in ptx.splitlines() if "0f4B400000" in line]
        # The bias as an fma's addend is the contraction; as a factor (the 8-bit forward's
        # exponent, ``factor * _INT8_BIAS + m``) it is the formula.
        assert not [line for line in bias_lines if line.startswith("fma") and line.endswith("0f4B400000")], (
            kernel.fn.__name__,
            bias_lines[:3],
        )
        checked += any(line.startswith("add") for line in bias_lines)
    assert checked >= 2, "no kernel rounded by the bias: the check looked at nothing"


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_fp8_rows_lora_kernels_compile_for_sm90_with_ieee_and_tf32_dots(precision):
    """``fused.fp8_rows_lora``'s two kernels with fp32 adapters at both of torch's
    fp32 matmul settings (IEEE dots at "highest", TF32 dots otherwise; fp16
    adapters take neither), with their int arguments as arguments and as
    constants (Inductor may pass a static K, N or split count)."""
    spec = next(s for s in OPS if s.name == "fp8_rows_lora")
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        launches = _launches(spec, torch.float32)
    finally:
        torch.set_float32_matmul_precision(previous)
    names = {kernel.fn.__name__ for kernel, _, _ in launches.values()}
    assert names == {"lora_down_kernel", "lora_up_kernel"}
    ieee = {constants["IEEE"] for _, _, constants in launches.values()}
    assert ieee == ({True, False} if precision == "highest" else {False})
    _compile_with_constant_ints(launches.values())


def test_fp8_pv_forward_fits_three_programs_an_sm_under_its_register_cap(monkeypatch, tmp_path):
    """FP8 P V's forward on sm_90 takes 2 stages under ``INT8_FP8_MAXNREG``
    registers (``attention_tiles.forward_tiles``) so that three 4-warp
    programs share an SM. Every variant the 8-bit ops launch at D <= 128
    (dense and block-sparse, q rounded by the kernel or given in int8, a
    token order, FP8 output rows), traced on a faked TMA GPU without wgmma
    (the uncapped launch's arguments) and compiled at the capped launch:
    ptxas keeps it within the cap, and its shared memory leaves room for
    three programs in an SM's 228 KB (1 KB of each reserved), and where q
    comes given to a TMA launch nothing spills inside the two key loops. Fails on a variant
    whose shared memory grows past a third (the cap's spills would then buy
    no third program) or that spills inside its key loops."""
    from compile_ops.ops import attention_launch, attention_sm90, attention_tiles

    monkeypatch.setattr(attention_launch, "has_tma", lambda t: t.device.type == "cuda")
    monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t: False)
    capped = attention_tiles.forward_tiles(128, torch.bfloat16, True, "int8_fp8", register_cap=True)
    assert (capped.num_warps, capped.num_stages, capped.maxnreg) == (4, 2, attention_tiles.INT8_FP8_MAXNREG)
    names = ("attention_int8_fp8", "attention_int8_fp8_rows", "attention_qk8", "block_sparse_attention_int8_fp8")
    names += ("block_sparse_attention_int8_fp8_rows",)
    variants = {}
    for spec in (s for s in OPS if s.name in names):
        for kernel, signature, constants in _launches(spec, torch.bfloat16).values():
            if kernel.fn.__name__ == "attn_fwd_kernel" and constants["PV_FP8"] and constants["BLOCK_D"] <= 128:
                flags = ("SPARSE", "QUANTIZE_Q", "SCATTER", "OUT_FP8", "TMA", "BLOCK_D")
                variants[tuple(constants[f] for f in flags)] = (kernel, signature, constants)
    # Every front end the models reach: dense and sparse, q rounded or given, a token order, FP8 rows, TMA.
    for column in range(5):
        assert {key[column] for key in variants} == {False, True}, column
    per_sm, reserved = 228 * 1024, 1024
    for key, (kernel, signature, constants) in variants.items():
        ordered = {p: signature[p] for p in kernel.arg_names if p in signature}
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=ordered, constexprs=constants),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=capped.num_warps, num_stages=capped.num_stages, maxnreg=capped.maxnreg),
        )
        assert 3 * (compiled.metadata.shared + reserved) <= per_sm, (key, compiled.metadata.shared)
        report = _ptxas_report(compiled.asm["ptx"], tmp_path, "fwd")
        registers = int(re.search(r"Used (\d+) registers", report).group(1))
        assert registers <= capped.maxnreg, (key, report)
        spills = re.search(r"\d+ bytes spill stores, \d+ bytes spill loads", report).group(0)
        in_loops = _product_loop_spills(tmp_path / "fwd.cubin")
        print(key, f"{compiled.metadata.shared} B shared, {registers} registers, {spills}, key loops {in_loops}")
        # The models' launches (TMA) with q given, in int8 or in a token order: nothing spills in the
        # two key loops (the FP8 rows' scale store once made ptxas spill there). q rounded by the
        # kernel, or loads without TMA, spill a few values a tile.
        if constants["TMA"] and not constants["QUANTIZE_Q"]:
            assert in_loops == [(0, 0), (0, 0)], (key, in_loops)
