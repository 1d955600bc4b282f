"""The sm_90 Gluon forward core (``fused_gluon.attention_forward_sm90_``).

Where it is taken, traced on fake CUDA tensors of a faked sm_90 GPU: exactly
the calls it computes (16-bit at D = 128, and D = 64 over whole 256-key
tiles, with the guard that rule needs under dynamic shapes; 8-bit only on q
and k given in int8). What it computes, on an H100/H200 only: the portable
``attn_fwd_kernel``'s output and lse (dense, causal, key lengths,
block-sparse, and the INT8_FP8 mode), the D = 64 wide tiles within the
two-reference rule, on any grid and compiled. Block-sparse 8-bit
attention's Gluon forward (``attn8_fwd_sm90_kernel``): where it is taken,
and that it gives the portable kernel's bytes. The sm_90 backward is in
test_attention_backward.py.
"""

import pytest
import torch
import triton
from attention_helpers import _SM90, LSE_ROUNDINGS, _qkv, _traced_launches, torch_at_dtype
from numerics import assert_within_torch_error

import compile_ops
from compile_ops._library import clear_launch_plans
from compile_ops.reference import attention as ref


def _traced_forward(q, k, v, causal=False, kv_lengths=None, seq_dim=2):
    """The launches of ``fused.attention``'s body traced on fake CUDA tensors:
    the Triton kernels' names and the opaque ops it calls."""
    return _traced_launches("fused::attention", q, k, v, 0.125, causal, seq_dim, kv_lengths)


def _traced_tiles(q, k, v, wgmma=None, op="fused::attention", seq_dim=2):
    """``attn_fwd_kernel``'s (BLOCK_M, BLOCK_N, TMA, num_warps, num_stages) in
    ``op``'s body (an attention op of q, k, v, scale, causal, seq_dim,
    kv_lengths) traced on fake CUDA tensors; ``wgmma`` False: with the GPU
    taken for one without wgmma."""
    import contextlib

    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from compile_ops._library import OP_BODIES
    from compile_ops.ops import attention_sm90

    with pytest.MonkeyPatch.context() if wgmma is False else contextlib.nullcontext() as m:
        if m is not None:
            m.setattr(attention_sm90, "has_wgmma", lambda t: False)
        gm = make_fx(lambda *a: OP_BODIES[op](*a))(q, k, v, 0.125, False, seq_dim, None)
    for node in gm.graph.nodes:
        if node.target is torch.ops.higher_order.triton_kernel_wrapper_mutation:
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])  # torch's one-config wrapper
            if kernel.fn.__name__ == "attn_fwd_kernel":
                config, args = kernel.configs[0], node.kwargs["kwargs"]
                return args["BLOCK_M"], args["BLOCK_N"], args["TMA"], config.num_warps, config.num_stages
    raise AssertionError(f"{op} launched no attn_fwd_kernel")


def test_forward_takes_the_sm90_core_exactly_where_it_computes_the_call(monkeypatch):
    """On an sm_90 GPU (``has_wgmma`` faked for fake CUDA tensors) a 16-bit
    forward at D = 128 with TMA-aligned tensors is the Gluon core's opaque
    op (what a compiled graph calls: Inductor cannot inline a Gluon kernel),
    in both layouts, dense or block-sparse, causal or not, with key lengths
    or not; every call the core does not compute stays on
    ``attn_fwd_kernel``, as does every call while AOTInductor builds a
    package, and no GPU without wgmma takes the core."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compile_ops.ops import attention_sm90

    core, portable = ["fused_gluon.attention_forward_sm90_.default"], ["attn_fwd_kernel"]
    with FakeTensorMode():

        def qkv(b=1, h=2, lq=300, lk=300, d=128, dtype=torch.bfloat16, seq_dim=2):
            shape = (lambda l: (b, h, l, d)) if seq_dim == 2 else (lambda l: (b, l, h, d))
            return tuple(torch.empty(shape(l), dtype=dtype, device="cuda") for l in (lq, lk, lk))

        def sparse(q, k, v, causal=False, kv_lengths=None):
            index = torch.zeros(1, 1, 3, 3, dtype=torch.int32, device="cuda")
            count = torch.ones(1, 1, 3, dtype=torch.int32, device="cuda")
            launches = _traced_launches(
                "fused::block_sparse_attention", q, k, v, index, count, 0.125, causal, 2, kv_lengths
            )
            return [name for name in launches if name in portable + core]

        for wgmma in (False, True):
            monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t, on=wgmma: on and t.device.type == "cuda")
            takes = core if wgmma else portable
            assert _traced_forward(*qkv()) == takes
            assert _traced_forward(*qkv(seq_dim=1), seq_dim=1) == takes
            assert _traced_forward(*qkv(dtype=torch.float16)) == takes
            assert _traced_forward(*qkv(lq=5, lk=1)) == takes
            q, k, v = qkv()
            lengths = torch.full((1,), 200, device="cuda")
            assert _traced_forward(q, k, v, causal=True) == takes
            assert _traced_forward(q, k, v, kv_lengths=lengths) == takes
            assert _traced_forward(q, k, v, causal=True, kv_lengths=lengths) == takes
            assert sparse(q, k, v) == takes
            assert sparse(q, k, v, causal=True, kv_lengths=lengths) == takes
            # D = 64: the core's 256-key tiles take dense non-causal calls over whole tiles without key lengths.
            assert _traced_forward(*qkv(d=64, lq=300, lk=512)) == takes
            assert _traced_forward(*qkv(d=64, lq=300, lk=512, seq_dim=1), seq_dim=1) == takes
            assert _traced_forward(*qkv(d=64)) == portable  # 300 keys: a ragged wide tile
            q64, k64, v64 = qkv(d=64, lq=512, lk=512)
            assert _traced_forward(q64, k64, v64, causal=True) == portable
            assert _traced_forward(q64, k64, v64, kv_lengths=lengths) == portable
            assert sparse(*qkv(d=64)) == portable
            assert _traced_forward(*qkv(d=32, lq=512, lk=512)) == portable
            assert _traced_forward(*qkv(dtype=torch.float32)) == portable
            assert _traced_forward(*qkv(lk=0)) == portable
            # A call the core declines keeps attn_fwd_kernel's own tiles, not the core's.
            assert _traced_tiles(*qkv(lk=0)) == _traced_tiles(*qkv(lk=0), wgmma=False)
            # While AOTInductor builds a package (run from C++, no Python): the Triton kernel, not the opaque op.
            from torch._inductor.virtualized import V

            with V.set_aot_compilation(True):
                assert _traced_forward(*qkv()) == portable
            # Rows 514 bytes apart: off TMA's 16-byte alignment.
            padded = torch.empty_strided(
                (1, 2, 300, 128), (2 * 300 * 257, 300 * 257, 257, 1), dtype=torch.bfloat16, device="cuda"
            )
            assert _traced_forward(padded, k, v) == portable
            # Keys and values shared by a batch of 2 (expanded, stride 0): the core's 4-D descriptors decline.
            q2 = torch.empty(2, 2, 300, 128, dtype=torch.bfloat16, device="cuda")
            assert _traced_forward(q2, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1)) == portable
            assert _traced_forward(q2, *qkv(b=2)[1:]) == takes


@pytest.mark.parametrize("length", [4096, 4429])
def test_head_dim_64_core_rule_guards_a_symbolic_key_length(length, monkeypatch):
    """Under dynamic shapes the D = 64 rule (the core's 256-key tiles for whole
    tiles only) reads a symbolic key length: the traced graph takes the core
    at 4096 keys and the portable kernel at 4429, and guards on Lk % 256 so
    that neither graph is reused at the other kind of length."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from compile_ops.ops import attention_sm90

    monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t: t.device.type == "cuda")
    env = ShapeEnv()
    sym = env.create_unspecified_symint_and_symbol(length, ConstantSource("L"), DimDynamic.DYNAMIC)
    with FakeTensorMode(shape_env=env):
        q, k, v = (torch.empty(1, 2, sym, 64, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        launches = _traced_forward(q, k, v)
    assert launches == (["fused_gluon.attention_forward_sm90_.default"] if length % 256 == 0 else ["attn_fwd_kernel"])
    guard = f"{'Eq' if length % 256 == 0 else 'Ne'}(Mod({sym}, 256), 0)"
    assert guard in [str(g.expr) for g in env.guards]


def test_8bit_forward_takes_the_sm90_core_only_with_q_given_in_int8(monkeypatch):
    """With ``"int8_fp8"`` among the core's precisions (it is built and tested,
    and joins by default once measured ahead), traced on fake CUDA tensors
    on a faked sm_90 GPU: 8-bit attention on q and k given in int8 with a
    16-bit output is the core's op; q rounded by the kernel, FP8 output rows
    and 16-bit P V stay on ``attn_fwd_kernel`` (FP8 P V under its register
    cap, from the capped op); with the default precisions it all stays there."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compile_ops.ops import attention_sm90, attention_tiles

    core = ["fused_gluon.attention_forward_sm90_.default"]
    capped = ["fused_gluon.attention_forward_capped_.default"]
    monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t: t.device.type == "cuda")
    with FakeTensorMode():
        q, k, v = (torch.empty(1, 300, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        q8, k8 = (torch.empty(1, 300, 2, 128, dtype=torch.int8, device="cuda") for _ in range(2))
        q_scale, k_scale = torch.empty(1, 2, 300, device="cuda"), torch.empty(1, 2, 3, device="cuda")

        def qk8(pv_fp8, fp8_rows):
            return [
                name
                for name in _traced_launches(
                    "fused::attention_qk8", q8, q_scale, k8, k_scale, v, 0.125, False, 1, None, pv_fp8, fp8_rows
                )
                if name in ("attn_fwd_kernel", core[0], capped[0])
            ]

        for with_int8 in (False, True):
            precisions = ("exact", "int8_fp8") if with_int8 else ("exact",)
            monkeypatch.setattr(attention_tiles, "SM90_CORE_PRECISIONS", precisions)
            assert qk8(True, False) == (core if with_int8 else capped)
            assert qk8(True, True) == capped
            assert qk8(False, False) == ["attn_fwd_kernel"]
            rounded = _traced_launches("fused::attention_int8_fp8", q, k, v, 0.125, False, 1, None)
            assert rounded[-1] == capped[0] and core[0] not in rounded


def test_fp8_pv_forward_runs_capped_from_its_op_on_sm90_alone(monkeypatch):
    """FP8 P V's forward under its register cap (``attention_tiles.INT8_FP8_MAXNREG``)
    cannot be inlined (Inductor's launch configs drop ``maxnreg``): traced on
    fake CUDA tensors on a faked sm_90 GPU, dense and block-sparse
    ``int8_fp8`` calls are ``fused_gluon.attention_forward_capped_``; 16-bit
    P V (``int8``) stays on ``attn_fwd_kernel``, as does every call on a GPU
    without wgmma and while AOTInductor builds a package (no Python to run
    the op), at the uncapped 3 stages."""
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compile_ops.ops import attention_sm90

    capped = ["fused_gluon.attention_forward_capped_.default"]
    with FakeTensorMode():
        q, k, v = (torch.empty(1, 300, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        index = torch.zeros(1, 1, 3, 3, dtype=torch.int32, device="cuda")
        count = torch.ones(1, 1, 3, dtype=torch.int32, device="cuda")

        def forwards(precision, sparse=False):
            if sparse:
                args = ("fused::block_sparse_attention", q, k, v, index, count, 0.125, False, 1, None, precision)
            else:
                args = ("fused::attention_" + precision, q, k, v, 0.125, False, 1, None)
            return [n for n in _traced_launches(*args) if n in ("attn_fwd_kernel", capped[0])]

        for wgmma in (False, True):
            monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t, on=wgmma: on and t.device.type == "cuda")
            assert forwards("int8_fp8") == (capped if wgmma else ["attn_fwd_kernel"])
            assert forwards("int8_fp8", sparse=True) == (capped if wgmma else ["attn_fwd_kernel"])
            assert forwards("int8") == ["attn_fwd_kernel"]
            assert forwards("int8", sparse=True) == ["attn_fwd_kernel"]
            with V.set_aot_compilation(True):
                assert forwards("int8_fp8") == ["attn_fwd_kernel"]
                assert _traced_tiles(q, k, v, op="fused::attention_int8_fp8", seq_dim=1)[4] == 3
            if not wgmma:
                assert _traced_tiles(q, k, v, op="fused::attention_int8_fp8", seq_dim=1)[4] == 3


def _sorted_block_lists(b, h, lq, lk, seed):
    """Random ascending block lists ``(index [b, h, nq, nk], count [b, h, nq])``
    int32 on the GPU: each key block kept with probability 1/2, one query
    block of each head with an empty list, and the last (ragged) key block
    always kept by query block 0."""
    nq, nk = triton.cdiv(lq, 128), triton.cdiv(lk, 128)
    g = torch.Generator(device="cuda").manual_seed(seed)
    keep = torch.rand(b, h, nq, nk, device="cuda", generator=g) < 0.5
    keep[:, :, 0, -1] = True
    keep[:, :, -1] = nq == 1  # empty, unless it is the only query block
    count = keep.sum(-1).to(torch.int32)
    # Kept blocks first, ascending: sort by (not kept, index).
    order = torch.arange(nk, device="cuda") + nk * (~keep).to(torch.int64)
    index = order.sort(-1).values.remainder(nk).to(torch.int32)
    return index.contiguous(), count.contiguous()


_SM90_CORE_MODES = ("dense", "causal", "kv_lengths", "sparse", "sparse_causal_kv_lengths")


@pytest.mark.skipif(not _SM90, reason="the Gluon core runs on sm_90 GPUs only")
@pytest.mark.parametrize("mode", _SM90_CORE_MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sm90_core_computes_what_the_portable_forward_does(dtype, mode, monkeypatch):
    """On an H100/H200 the core's output and lse are ``attn_fwd_kernel``'s
    (same 128 x 128 tiles, products and formulas: equal up to one rounding of
    the output) over ragged lengths, GQA, fewer keys than a tile, Lq != Lk
    and both layouts; dense or block-sparse (lists with empty rows and the
    ragged last block), causal, key lengths (0 among them: rows with no key
    give 0 and lse -inf). Five launches into NaN-filled outputs each write
    every row (a race between its partitions would leave some unwritten or
    wrong), on grids of 1, 3 and 7 programs too, each going through many
    work items (the ring and q buffer carried across items, in every mode,
    persistent or not in the package), and the eager fast path's replayed
    second call and a compiled call (through the opaque op) give the first
    call's result."""
    from compile_ops.kernels.attention_sm90 import attn_fwd_sm90_kernel
    from compile_ops.ops import attention_sm90

    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    causal = "causal" in mode
    for b, h, hk, lq, lk, seq_dim in [
        (1, 4, 4, 1000, 1000, 2),
        (2, 8, 2, 333, 4096, 1),
        (1, 2, 2, 64, 77, 2),
        (2, 2, 1, 513, 129, 1),
        (1, 3, 3, 130, 1, 2),
        (1, 12, 12, 4680, 4680, 2),
    ]:
        torch.manual_seed(lq + lk)
        shape = (lambda hh, l: (b, hh, l, 128)) if seq_dim == 2 else (lambda hh, l: (b, l, hh, 128))
        q = torch.randn(shape(h, lq), device="cuda", dtype=dtype)
        k, v = (torch.randn(shape(hk, lk), device="cuda", dtype=dtype) for _ in range(2))
        lengths = None
        if "kv_lengths" in mode:  # a ragged length, and 0 for a second batch element
            lengths = torch.tensor([max(lk - 37, 1), 0][:b], device="cuda", dtype=torch.int32)
        lists = _sorted_block_lists(b, h, lq, lk, lq + lk) if "sparse" in mode else (None, None)

        def attend(q, k, v):
            if lists[0] is None:
                return compile_ops.attention(
                    q, k, v, causal=causal, seq_dim=seq_dim, kv_lengths=lengths, return_lse=True
                )
            return compile_ops.block_sparse_attention(
                q, k, v, *lists, causal=causal, seq_dim=seq_dim, kv_lengths=lengths, return_lse=True
            )

        with torch.no_grad():
            clear_launch_plans()
            got = [attend(q, k, v) for _ in range(2)]
            torch._dynamo.reset()  # a fresh graph for each case: not a recompilation, which fullgraph bounds
            compiled = torch.compile(attend, fullgraph=True)(q, k, v)
            with monkeypatch.context() as m:
                m.setattr(attention_sm90, "has_wgmma", lambda t: False)
                clear_launch_plans()
                want = attend(q, k, v)
        case = (mode, b, h, hk, lq, lk, seq_dim)
        torch.testing.assert_close(got[0][0], want[0], rtol=ulp, atol=1e-5, msg=lambda m: f"{case}: {m}")
        torch.testing.assert_close(got[0][1], want[1], rtol=1e-6, atol=1e-5, msg=lambda m: f"{case}: {m}")
        for again in (got[1], compiled):
            assert torch.equal(again[0], got[0][0]) and torch.equal(again[1], got[0][1]), case
        for programs in (None, None, 1, 3, 7):
            out, lse = torch.full_like(q, float("nan")), torch.full((b, h, lq), float("nan"), device="cuda")
            with monkeypatch.context() as m:
                if programs:
                    m.setattr(attention_sm90, "_core_programs", lambda q, items, causal, sparse, n=programs: n)
                attention_sm90.launch_sm90_core(
                    attn_fwd_sm90_kernel, q, k, v, out, lse, 128**-0.5, causal, seq_dim, lengths, *lists
                )
            assert torch.equal(out, got[0][0]) and torch.equal(lse, got[0][1]), (case, programs)
    clear_launch_plans()


@pytest.mark.skipif(not _SM90, reason="the Gluon core runs on sm_90 GPUs only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sm90_core_wide_tiles_at_head_dim_64_match_the_reference(dtype, monkeypatch):
    """D = 64 dense calls over whole 256-key tiles take the core's wide form
    (256-key tiles, each P V folded in before the next Q K^T): not the
    portable kernel's tiles, so not its bits, but within the two-reference
    rule (twice PyTorch's own error at the dtype) of the fp64 attention, out
    and lse, over GQA, Lq != Lk, both layouts and a single tile. Launches
    into NaN-filled outputs on grids of 1, 3 and 7 programs (each walking
    many items through the ring) and a compiled call give the first call's
    bits, and the portable kernel's output stays within a few roundings."""
    from compile_ops.kernels.attention_sm90 import attn_fwd_sm90_kernel
    from compile_ops.ops import attention_args, attention_sm90, attention_tiles

    for b, h, hk, lq, lk, seq_dim in [
        (1, 4, 4, 1000, 1024, 2),
        (2, 8, 2, 333, 4096, 1),
        (1, 2, 2, 64, 256, 2),
        (2, 3, 3, 513, 512, 1),
    ]:
        torch.manual_seed(lq + lk)
        q, k, v = _qkv(b, h, hk, lq, lk, 64, seq_dim, dtype, "cuda")
        case = (b, h, hk, lq, lk, seq_dim)
        tiles = attention_tiles.forward_tiles(64, dtype, True, "exact", True)
        sizes = attention_args.attention_sizes(q, k, False, seq_dim, None)
        assert attention_sm90.takes_sm90_core(tiles, sizes, q, k, v, seq_dim, seq_dim, None, False, None), case
        with torch.no_grad():
            clear_launch_plans()
            out, lse = compile_ops.attention(q, k, v, seq_dim=seq_dim, return_lse=True)
            torch._dynamo.reset()
            compiled = torch.compile(
                lambda q, k, v: compile_ops.attention(q, k, v, seq_dim=seq_dim, return_lse=True), fullgraph=True
            )(q, k, v)
            with monkeypatch.context() as m:
                m.setattr(attention_sm90, "has_wgmma", lambda t: False)
                clear_launch_plans()
                portable = compile_ops.attention(q, k, v, seq_dim=seq_dim)
        exact, exact_lse = ref.attention(*(t.detach().double() for t in (q, k, v)), 64**-0.5, False, seq_dim, None)
        plain, _, plain_lse = torch_at_dtype(q, k, v, torch.zeros_like(q), 64**-0.5, False, seq_dim, None)
        assert_within_torch_error(out, exact, plain, 2.0, f"output {case}")
        assert_within_torch_error(lse, exact_lse, plain_lse, 2.0, f"lse {case}", fp32_roundings=LSE_ROUNDINGS)
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
        torch.testing.assert_close(
            out, portable, rtol=2 * ulp, atol=4 * ulp * out.abs().max().item(), msg=lambda msg: f"{case}: {msg}"
        )
        assert torch.equal(compiled[0], out) and torch.equal(compiled[1], lse), case
        for programs in (None, 1, 3, 7):
            again, again_lse = torch.full_like(q, float("nan")), torch.full((b, h, lq), float("nan"), device="cuda")
            with monkeypatch.context() as m:
                if programs:
                    m.setattr(attention_sm90, "_core_programs", lambda q, items, causal, sparse, n=programs: n)
                attention_sm90.launch_sm90_core(
                    attn_fwd_sm90_kernel, q, k, v, again, again_lse, 64**-0.5, False, seq_dim
                )
            assert torch.equal(again, out) and torch.equal(again_lse, lse), (case, programs)
    clear_launch_plans()


@pytest.mark.skipif(not _SM90, reason="the Gluon core runs on sm_90 GPUs only")
def test_sm90_core_int8_fp8_computes_what_the_portable_kernel_does(monkeypatch):
    """The core's INT8_FP8 mode, forced on (``"int8_fp8"`` among its
    precisions): ``attention_qk8`` with FP8 P V on q and k given in int8 is
    ``attn_fwd_kernel``'s result (the same formulas: equal up to one rounding
    of the output) over ragged, GQA, short and Lq != Lk shapes, with offset
    keys, in both layouts; five launches into NaN-filled outputs (three on
    grids of 1, 3 and 7 programs, each through many work items) each write
    every row, and the replayed second call and a compiled call give the
    first call's result."""
    from compile_ops.kernels.attention_sm90 import attn_fwd_sm90_kernel
    from compile_ops.ops import attention_8bit, attention_sm90, attention_tiles

    for b, h, hk, lq, lk, seq_dim in [
        (1, 4, 4, 1000, 1000, 2),
        (2, 8, 2, 333, 4096, 1),
        (1, 2, 2, 64, 77, 2),
        (1, 2, 1, 513, 129, 1),
        (1, 3, 3, 130, 1, 2),
        (1, 12, 12, 4680, 4680, 2),
    ]:
        torch.manual_seed(lq + lk)
        shape = (lambda hh, l: (b, hh, l, 128)) if seq_dim == 2 else (lambda hh, l: (b, l, hh, 128))
        q = torch.randn(shape(h, lq), device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(shape(hk, lk), device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k = k + 4 * torch.randn(128, device="cuda", dtype=torch.bfloat16)  # a per-channel offset
        q8, q_scale, k8, k_scale = ref.smooth_quantize_qk(q, k, seq_dim)
        args = (q8, q_scale, k8, k_scale, v, 128**-0.5, False, seq_dim, None, True, False)
        case = (b, h, hk, lq, lk, seq_dim)
        with torch.no_grad():
            with monkeypatch.context() as m:
                m.setattr(attention_tiles, "SM90_CORE_PRECISIONS", ("exact", "int8_fp8"))
                clear_launch_plans()
                got = [torch.ops.fused.attention_qk8(*args)[0] for _ in range(2)]
                compiled = torch.compile(lambda *a: torch.ops.fused.attention_qk8(*a)[0], fullgraph=True)(*args)
                vt8, v_scale = attention_8bit.quantized_operands(None, None, v, seq_dim, True)
                for programs in (None, None, 1, 3, 7):
                    out = torch.full_like(q, float("nan"))
                    lse = torch.empty(b, h, lq, device="cuda")
                    if programs:
                        m.setattr(attention_sm90, "_core_programs", lambda q, items, causal, sparse, n=programs: n)
                    attention_sm90.launch_sm90_core(
                        attn_fwd_sm90_kernel,
                        q8,
                        k8,
                        vt8,
                        out,
                        lse,
                        128**-0.5,
                        False,
                        seq_dim,
                        None,
                        None,
                        None,
                        q_scale,
                        k_scale,
                        v_scale,
                    )
                    assert torch.equal(out, got[0]), (case, programs)
            clear_launch_plans()
            want = torch.ops.fused.attention_qk8(*args)[0]
        torch.testing.assert_close(got[0], want, rtol=2.0**-7, atol=1e-5, msg=lambda m: f"{case}: {m}")
        for again in (got[1], compiled):
            assert torch.equal(again, got[0]), case
    clear_launch_plans()


def test_8bit_forward_takes_its_gluon_kernel_exactly_where_it_computes_the_call(monkeypatch):
    """``takes_sm90_8bit`` on fake CUDA tensors of a faked sm_90 GPU: dense
    or over block lists, FP8 P V, q given in int8 or rounded by the kernel,
    D = 128, TMA-aligned operands take ``attn8_fwd_sm90_kernel``; a causal
    mask, key lengths, zero-width lists, 16-bit P V, D = 64, int8 q or k
    rows not 16 bytes apart, a GPU without wgmma and an AOTInductor build
    stay on ``attn_fwd_kernel``."""
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compile_ops.ops import attention_sm90
    from compile_ops.ops.attention_args import attention_sizes

    monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t: t.device.type == "cuda")
    with FakeTensorMode():
        q8, k8 = (torch.empty(1, 300, 2, 128, dtype=torch.int8, device="cuda") for _ in range(2))
        vt8 = torch.empty(1, 2, 128, 304, dtype=torch.float8_e4m3fn, device="cuda")
        lists = (torch.zeros(1, 2, 3, 3, dtype=torch.int32, device="cuda"), torch.ones(1, 2, 3, dtype=torch.int32))
        kv_lengths = torch.full((1,), 300, dtype=torch.int32, device="cuda")

        def takes(q=q8, k=k8, causal=False, kv=None, blocks=lists, rounds_q=False, pv_fp8=True):
            sizes = attention_sizes(q, k, causal, 1, kv)
            return attention_sm90.takes_sm90_8bit(sizes, q, k, vt8, 1, blocks, rounds_q, pv_fp8)

        assert takes()
        assert takes(blocks=None)
        assert takes(rounds_q=True)
        assert not takes(causal=True)
        assert not takes(blocks=None, causal=True)
        assert not takes(kv=kv_lengths)
        assert not takes(blocks=(torch.empty(1, 2, 3, 0, dtype=torch.int32, device="cuda"), lists[1]))
        assert not takes(pv_fp8=False)
        q64, k64 = (torch.empty(1, 300, 2, 64, dtype=torch.int8, device="cuda") for _ in range(2))
        assert not takes(q=q64, k=k64)
        # Rows 136 bytes apart: not the 16-byte multiple a TMA descriptor takes.
        unaligned = torch.empty_strided(
            (1, 300, 2, 128), (300 * 2 * 136, 2 * 136, 136, 1), dtype=torch.int8, device="cuda"
        )
        assert not takes(q=unaligned)
        assert not takes(k=unaligned)
        # A q the kernel rounds is loaded row by row, not by TMA: its alignment does not matter.
        unaligned_16bit = torch.empty_strided(
            (1, 300, 2, 128), (300 * 2 * 132, 2 * 132, 132, 1), dtype=torch.bfloat16, device="cuda"
        )
        assert takes(q=unaligned_16bit, rounds_q=True)
        with V.set_aot_compilation(True):
            assert not takes()
        monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t: False)
        assert not takes()


@pytest.mark.skipif(not _SM90, reason="the Gluon kernels run on sm_90 GPUs only")
def test_8bit_gluon_forward_computes_what_the_portable_kernel_does(monkeypatch):
    """``attn8_fwd_sm90_kernel`` against ``attn_fwd_kernel`` (taken by
    turning ``takes_sm90_8bit`` off) on the same calls: dense ``int8_fp8``
    with q rounded by the kernel or given in int8, self and cross attention,
    block-sparse in tile order and in a token order, and the FP8 rows of
    both, over random sorted lists with an empty query block a head and the
    ragged last key block listed, GQA, lengths that are and are not
    multiples of 64 and 128, both layouts: the same output bytes and lse
    (and rows' scales), eagerly, replayed and compiled; the Gluon kernel is
    launched, and a causal call is not."""
    from compile_ops.ops import attention_launch

    launched = []
    real_launch = attention_launch.launch_sm90_8bit
    monkeypatch.setattr(attention_launch, "launch_sm90_8bit", lambda *a: launched.append(1) or real_launch(*a))
    ops = torch.ops.fused
    for b, h, hk, length, seq_dim in [(1, 4, 4, 1000, 2), (2, 8, 2, 333, 1), (1, 2, 1, 77, 2), (1, 6, 6, 4608, 1)]:
        torch.manual_seed(length)
        shape = (lambda hh, n=length: (b, hh, n, 128)) if seq_dim == 2 else (lambda hh, n=length: (b, n, hh, 128))
        q = torch.randn(shape(h), device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(shape(hk), device="cuda", dtype=torch.bfloat16) + 0.5 for _ in range(2))
        # Cross attention: a third of the keys, Lk != Lq.
        k_short, v_short = (t.narrow(seq_dim, 0, length // 3).contiguous() for t in (k, v))
        q8, q_scale, k8, k_scale = ref.smooth_quantize_qk(q, k, seq_dim)
        index, count = _sorted_block_lists(b, h, length, length, seed=length)
        tokens = torch.randperm(length, device="cuda")
        scale = 128**-0.5
        calls = {
            "dense": lambda: ops.attention_int8_fp8(q, k, v, scale, False, seq_dim, None),
            "dense-cross": lambda: ops.attention_int8_fp8(q, k_short, v_short, scale, False, seq_dim, None),
            "dense-rows": lambda: ops.attention_int8_fp8_rows(q, k, v, scale, False, seq_dim, None),
            "dense-q8": lambda: ops.attention_qk8(q8, q_scale, k8, k_scale, v, scale, False, seq_dim, None, True),
            "dense-causal": lambda: ops.attention_int8_fp8(q, k, v, scale, True, seq_dim, None),
            "tile": lambda: ops.block_sparse_attention(q, k, v, index, count, scale, False, seq_dim, None, "int8_fp8"),
            "tokens": lambda: ops.block_sparse_attention(
                q, k, v, index, count, scale, False, seq_dim, None, "int8_fp8", tokens
            ),
            "rows": lambda: ops.block_sparse_attention_int8_fp8_rows(
                q, k, v, index, count, scale, False, seq_dim, None, tokens
            ),
        }
        for name, call in calls.items():
            case = (b, h, hk, length, seq_dim, name)
            with torch.no_grad():
                clear_launch_plans()
                launched.clear()
                got = [call() for _ in range(2)]  # the second replays the first's launch plan
                assert bool(launched) == (name != "dense-causal"), case
                compiled = torch.compile(call, fullgraph=True)()
                with monkeypatch.context() as m:
                    m.setattr(attention_launch, "takes_sm90_8bit", lambda *a: False)
                    clear_launch_plans()
                    launched.clear()
                    want = call()
                    assert not launched, case
            for result in (*got, compiled):
                for have, expected in zip(_outputs(result), _outputs(want), strict=True):
                    assert torch.equal(have.view(torch.uint8), expected.view(torch.uint8)), case
    clear_launch_plans()


def _outputs(result) -> tuple:
    """An op's outputs as a tuple, whether it returns one tensor or several."""
    return result if isinstance(result, tuple) else (result,)
