"""How the portable attention kernels are launched: choices that change no result.

The Hopper options (TMA loads, dot accumulation, warp specialization), forced
on, against the default forward and backward; the causal programs' order
(the longest tiles first, over groups of rows sized to the L2 cache:
``causal_order``, ``program_rank``) bit for bit against the launch order, and
the group rule; and what the launchers pass the kernels when traced (the
order, ``ALIGNED_LENGTHS`` and its guard under dynamic shapes).
"""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from conftest import KERNEL_DEVICE, allow_tma_under_interpreter

import compile_ops
from compile_ops._library import clear_launch_plans
from compile_ops.kernels.attention_common import program_rank


@pytest.mark.kernels
@pytest.mark.parametrize(
    "precision, options",
    [
        ("exact", dict(tma=True)),
        ("exact", dict(dot_acc=True)),
        ("exact", dict(tma=True, dot_acc=True, warp_specialize=True)),
        ("int8", dict(tma=True)),
        ("int8_fp8", dict(tma=True)),  # int8 q k by TMA; FP8 P V's transposed V too
    ],
    ids=["tma", "dot_acc", "tma-dot_acc-ws", "int8-tma", "int8_fp8-tma"],
)
def test_kernels_hopper_options_compute_what_the_default_forward_does(precision, options, monkeypatch):
    """The forward's Hopper options (forward_tiles picks TMA at D=128 on
    Hopper, the others are off) change how tiles are loaded and accumulated,
    not the result: forced on,
    with a padded head dim, a partial key tile, key lengths and both layouts,
    the output equals the default's up to the order of additions."""
    from compile_ops.ops import attention_launch, attention_tiles

    default = attention_tiles.forward_tiles
    torch.manual_seed(0)
    for seq_dim in (1, 2):
        # D = 48: padded to 64, and (TMA's condition, which the interpreter run forces) every head's
        # base 16-byte aligned in int8 too
        shape = (2, 70, 2, 48) if seq_dim == 1 else (2, 2, 70, 48)
        q, k, v = (torch.randn(shape, device=KERNEL_DEVICE).to(torch.float16) for _ in range(3))
        kv_lengths = torch.tensor([50, 70], device=KERNEL_DEVICE)
        with torch.no_grad():
            want = compile_ops.attention(q, k, v, seq_dim=seq_dim, kv_lengths=kv_lengths, precision=precision)
        with monkeypatch.context() as m:
            m.setattr(
                attention_launch,
                "forward_tiles",
                lambda d, dtype, tma=False, precision="exact", wgmma=False, register_cap=False: attention_tiles.Tiles(
                    *dataclasses.astuple(default(d, dtype, False, precision))[:4], **options
                ),
            )
            allow_tma_under_interpreter(m)
            clear_launch_plans()  # the eager call above left a plan for the default tiles
            with torch.no_grad():
                got = compile_ops.attention(q, k, v, seq_dim=seq_dim, kv_lengths=kv_lengths, precision=precision)
        clear_launch_plans()
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.kernels
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernels_backward_tma_computes_what_pointer_loads_do(causal, monkeypatch):
    """The backward passes' Hopper option (dkdv_tiles / dq_tiles take TMA at
    D=128 on Hopper): the dk/dv pass's q and dO tiles and the dq pass's k and
    v tiles through whole-tensor descriptors give the gradients of the
    pointer loads: forced on, with GQA, a padded head dim, partial query and
    key tiles, key lengths and both layouts."""
    from compile_ops.ops import attention_launch, attention_tiles

    defaults = attention_tiles.dkdv_tiles, attention_tiles.dq_tiles
    torch.manual_seed(0)
    for seq_dim in (1, 2):
        q_shape = (2, 70, 4, 48) if seq_dim == 1 else (2, 4, 70, 48)
        k_shape = (2, 150, 2, 48) if seq_dim == 1 else (2, 2, 150, 48)
        q = torch.randn(q_shape, device=KERNEL_DEVICE).to(torch.float16)
        k, v = (torch.randn(k_shape, device=KERNEL_DEVICE).to(torch.float16) for _ in range(2))
        grad = torch.randn_like(q)
        kv_lengths = torch.tensor([150, 101], device=KERNEL_DEVICE)

        def gradients():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            compile_ops.attention(*inputs, causal=causal, seq_dim=seq_dim, kv_lengths=kv_lengths).backward(grad)
            return [t.grad for t in inputs]

        want = gradients()
        with monkeypatch.context() as m:
            m.setattr(
                attention_launch,
                "dkdv_tiles",
                lambda d, dtype, sparse=False, tma=False: dataclasses.replace(defaults[0](d, dtype, sparse), tma=True),
            )
            m.setattr(
                attention_launch,
                "dq_tiles",
                lambda d, dtype, sparse=False, tma=False: dataclasses.replace(defaults[1](d, dtype, sparse), tma=True),
            )
            allow_tma_under_interpreter(m)
            clear_launch_plans()
            got = gradients()
        clear_launch_plans()
        for name, g, w in zip("qkv", got, want):
            torch.testing.assert_close(g, w, rtol=2e-3, atol=2e-3, msg=lambda m: f"d{name}: {m}")


@pytest.mark.kernels
@pytest.mark.parametrize("group", [1, 3, 8], ids=["one-row", "uneven-groups", "all-rows"])
def test_kernels_causal_program_order_computes_what_launch_order_does(group, monkeypatch):
    """Causal launches deal their tiles out longest first over groups of
    (batch, head) rows (``ops.attention_tiles.causal_order``,
    ``kernels.attention_common.program_rank``): every group size gives the bits of
    the launch order, forward and both backward passes, over 8 query-head rows
    (B=2, 4 q heads, 2 k heads: the dk/dv pass has 4 rows), so groups of 3
    leave a short last group, and partial query and key tiles (Lq != Lk).
    A program given another's tile, or none, leaves rows unwritten."""
    from compile_ops.ops import attention_launch, attention_tiles

    torch.manual_seed(0)
    q = torch.randn(2, 4, 150, 32, device=KERNEL_DEVICE).to(torch.float16)
    k, v = (torch.randn(2, 2, 200, 32, device=KERNEL_DEVICE).to(torch.float16) for _ in range(2))
    grad = torch.randn_like(q)

    def run():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = compile_ops.attention(*inputs, causal=True, return_lse=True)
        out.backward(grad)
        return [out.detach(), lse] + [t.grad for t in inputs]

    groups = []
    with monkeypatch.context() as m:
        m.setattr(attention_launch, "causal_order", lambda shared, length, rows: attention_tiles.LAUNCH_ORDER)
        clear_launch_plans()
        want = run()

        def order(shared, length, rows):
            groups.append((rows, min(group, rows)))
            return dict(HEAVY_FIRST=True), min(group, rows)

        m.setattr(attention_launch, "causal_order", order)
        clear_launch_plans()
        got = run()
    clear_launch_plans()
    assert groups == [(8, min(group, 8)), (4, min(group, 4)), (8, min(group, 8))], groups
    for name, g, w in zip(["out", "lse", "dq", "dk", "dv"], got, want):
        assert torch.equal(g, w), name


@triton.jit
def _ranks_kernel(OUT, heads_per_group):
    """Each program's ``program_rank`` (rank, row) at its launch-order index of ``OUT [tiles * rows, 2]``."""
    rank, bh = program_rank(heads_per_group, True)
    linear = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    tl.store(OUT + 2 * linear, rank)
    tl.store(OUT + 2 * linear + 1, bh)


@pytest.mark.kernels
@pytest.mark.parametrize(
    "tiles, rows, group", [(5, 7, 3), (4, 6, 6), (3, 4, 1)], ids=["uneven-groups", "one-group", "one-row-groups"]
)
def test_kernels_program_rank_deals_the_heaviest_tiles_first(tiles, rows, group):
    """``program_rank`` itself, on a ``(tiles, rows)`` grid: in launch order
    (x fastest) the programs take each (rank, row) once, groups of ``group``
    consecutive rows one after another, and within a group every row's rank r
    before any row's rank r + 1. The launch order itself (identity) fails the
    second and third properties whenever rows > 1."""
    out = torch.full((tiles * rows, 2), -1, dtype=torch.int32, device=KERNEL_DEVICE)
    _ranks_kernel[(tiles, rows)](out, group)
    taken = [tuple(p) for p in out.cpu().tolist()]  # (rank, row) of each program, in launch order
    assert sorted(taken) == [(r, b) for r in range(tiles) for b in range(rows)], taken
    for start in range(0, rows, group):
        size = min(group, rows - start)
        span = taken[start * tiles : (start + size) * tiles]
        assert sorted({b for _, b in span}) == list(range(start, start + size)), (start, span)
        assert [r for r, _ in span] == sorted(r for r, _ in span), (start, span)


def test_causal_launches_carry_the_program_order(monkeypatch):
    """The launchers pass the order to all three kernels of a causal call (the
    group of ``causal_order``) and the launch order to a non-causal one, traced
    on fake CUDA tensors: a launcher that dropped it would fail here, where
    the kernels' bit-identity tests cannot see it. (On an sm_90 GPU the
    non-causal forward would take the Gluon core, which has no such order:
    kept off here.)"""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from compile_ops._library import OP_BODIES
    from compile_ops.ops import attention_sm90, attention_tiles

    monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t: False)
    # The groups below are an H100's (50 MiB of L2); an H200's 60 MiB would make them 6 heads.
    monkeypatch.setattr(attention_tiles, "l2_cache_bytes", lambda t: 50 * 2**20)

    def launches(causal):
        with FakeTensorMode():
            q = torch.empty(1, 24, 4608, 128, dtype=torch.bfloat16, device="cuda")
            k, v, grad = (torch.empty_like(q) for _ in range(3))
            lse = torch.empty(1, 24, 4608, dtype=torch.float32, device="cuda")

            def both(q, k, v, grad, lse):
                OP_BODIES["fused::attention"](q, k, v, 0.125, causal, 2, None)
                return OP_BODIES["fused::attention_backward"](grad, q, k, v, grad, lse, 0.125, causal, 2, None)

            gm = make_fx(both)(q, k, v, grad, lse)
        return {
            kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__: (
                n.kwargs["kwargs"]["HEAVY_FIRST"],
                n.kwargs["kwargs"]["heads_per_group"],
            )
            for n in gm.graph.nodes
            if n.target is torch.ops.higher_order.triton_kernel_wrapper_mutation and "HEAVY_FIRST" in n.kwargs["kwargs"]
        }

    names = ["attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"]
    assert launches(True) == dict.fromkeys(names, (True, 5))  # 2.4 MB of bf16 k and v per head: 5 heads
    assert launches(False) == dict.fromkeys(names, (False, 1))


def test_causal_order_groups_the_rows_whose_keys_fill_a_quarter_of_l2():
    """The group rule against the sweep it was fitted to (docs/notes/attention-forward.md,
    "Causal programs, longest first"):
    bf16 k and v of 2.4 MB per row (4608 x 128) give 5 rows, 1 MB (4096 x 64)
    12, 8.4 and 16.8 MB one row; never more rows than launched, never none."""
    from compile_ops.ops.attention_tiles import causal_order

    def group(length, d, rows, dtype=torch.bfloat16):
        constexprs, g = causal_order(torch.empty(1, 1, length, d, dtype=dtype, device="meta"), length, rows)
        assert constexprs == dict(HEAVY_FIRST=True)
        return g

    assert [group(4608, 128, 24), group(4096, 64, 48), group(16384, 128, 40), group(32760, 128, 12)] == [5, 12, 1, 1]
    assert group(4096, 64, 4) == 4 and group(0, 64, 0) == 1
    assert group(4608, 128, 24, torch.int8) == 11  # 8-bit keys and values: half the bytes

    # A symbolic length (a compiled model's second resolution): the group stays an expression, no guard.
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    length = env.create_unspecified_symint_and_symbol(4608, ConstantSource("L"), DimDynamic.DYNAMIC)
    _, g = causal_order(torch.empty(1, 1, 8, 128, dtype=torch.bfloat16, device="meta"), length, 24)
    assert isinstance(g, torch.SymInt) and g.node.hint == 5 and not env.guards


@pytest.mark.parametrize("length", [4608, 4600])
def test_symbolic_lengths_keep_their_divisibility_hint_and_guard_it(length, monkeypatch):
    """Under dynamic shapes (a compiled model's second resolution) Inductor
    cannot tell the kernels that a symbolic Lq/Lk is a multiple of 16, as
    Triton's JIT does from the value (H100: the dk/dv pass 25% slower, bench
    notes). The launchers pass it as ``ALIGNED_LENGTHS`` to all three kernels,
    and computing it guards on the divisibility, so a graph traced at an
    aligned length is not reused at an unaligned one. (The portable kernels
    are the subject: on an sm_90 GPU the D = 64 forward at 4608 keys would
    take the Gluon core, which has no such hint, so the GPU is taken for one
    without wgmma.)"""
    from torch._dynamo.source import ConstantSource
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from compile_ops._library import OP_BODIES
    from compile_ops.ops import attention_sm90

    monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t: False)

    env = ShapeEnv()
    sym = env.create_unspecified_symint_and_symbol(length, ConstantSource("L"), DimDynamic.DYNAMIC)
    with FakeTensorMode(shape_env=env):
        q, k, v, grad = (torch.empty(1, 2, sym, 64, dtype=torch.bfloat16, device="cuda") for _ in range(4))
        lse = torch.empty(1, 2, sym, dtype=torch.float32, device="cuda")

        def both(q, k, v, grad, lse):
            OP_BODIES["fused::attention"](q, k, v, 0.125, False, 2, None)
            return OP_BODIES["fused::attention_backward"](grad, q, k, v, grad, lse, 0.125, False, 2, None)

        gm = make_fx(both)(q, k, v, grad, lse)
    aligned = {
        kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__: n.kwargs["kwargs"]["ALIGNED_LENGTHS"]
        for n in gm.graph.nodes
        if n.target is torch.ops.higher_order.triton_kernel_wrapper_mutation and "ALIGNED_LENGTHS" in n.kwargs["kwargs"]
    }
    assert aligned == dict.fromkeys(["attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"], length % 16 == 0)
    guard = f"{'Eq' if length % 16 == 0 else 'Ne'}(Mod({sym}, 16), 0)"
    assert guard in [str(g.expr) for g in env.guards]
