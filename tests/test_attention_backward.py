"""fused.attention_backward's kernel choices and its determinism.

The deterministic default (three passes; on sm_90 its dk/dv pass is the Gluon
kernel without dQ) and the five-product backward that
``set_attention_backward(deterministic=False)`` selects: which kernels a call
launches (traced on fake CUDA tensors of a faked sm_90 GPU), the split of the
last round (``backward_tail_split``) by its model, the step rule, the compile
caches' key, the five-product backward's Triton halves (``kernels``), and on an
sm_90 GPU the Gluon backward against the deterministic passes and the fp64
reference, eager and compiled. The backward's values over random shapes are
checked with the forward's in test_attention.py.
"""

import pytest
import torch
import triton
import triton.language as tl
from attention_helpers import _SM90, _qkv, _traced_launches, five_product_gradients, torch_at_dtype
from conftest import KERNEL_DEVICE, deterministic_algorithms
from hypothesis import given
from hypothesis import strategies as st
from numerics import assert_within_torch_error

import compile_ops
from compile_ops._library import clear_launch_plans, multiprocessor_count
from compile_ops.reference import attention as ref


@pytest.mark.kernels
def test_kernels_backward_is_deterministic_with_a_non_contiguous_grad():
    dev = KERNEL_DEVICE
    q, k, v = _qkv(1, 4, 2, 70, 90, 64, 1, torch.float16, dev)
    out = compile_ops.attention(q, k, v, None, True, 1)
    dout = torch.randn(out.shape[::-1], device=dev, dtype=out.dtype).permute(3, 2, 1, 0)  # no unit stride
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for _ in range(2):
        again = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    # The same gradient, contiguous: the layout of dO must not change a bit.
    contiguous = torch.autograd.grad(out, (q, k, v), dout.contiguous())
    assert all(torch.equal(a, b) for a, b in zip(first, contiguous))


def test_backward_tail_split_at_known_shapes():
    """The five-product backward's split of its last round, at the shapes
    its numbers were measured at (132 SMs): Flux's 864 items leave 72 alone
    in a seventh round and are split (their 72 items in 5 parts); whole
    rounds, and leftovers whose split gains less than 4% by the model, are
    not; one query step cannot be parted."""
    from compile_ops.ops.attention_sm90 import backward_tail_split

    assert backward_tail_split(864, 132, 72) == (792, 5)  # 1x24x4608, D = 128
    assert backward_tail_split(840, 132, 35) == (792, 5)  # 1x24x4429 (SD3), D = 64: 128-query steps
    assert backward_tail_split(1728, 132, 72) == (1716, 8)  # 2x24x4608: 12 items alone in a 14th round
    assert backward_tail_split(1536, 132, 32) == (1536, 1)  # 2x24x4096 (D = 64): 2.3% modelled, 0.98x measured
    assert backward_tail_split(3072, 132, 512) == (3072, 1)  # 1x12x32760: 2.7% modelled, 0.98x measured
    assert backward_tail_split(264, 132, 72) == (264, 1)  # whole rounds
    assert backward_tail_split(100, 132, 1) == (100, 1)


@given(st.integers(1, 3000), st.sampled_from([78, 114, 132]), st.integers(1, 80))
def test_backward_tail_split_ends_sooner_by_its_model(items, sms, steps):
    """For any launch, ``backward_tail_split`` gives ``(whole, parts)`` with
    the parted items the last leftover of a round (or it and one round
    more), 2-8 parts of at most ``steps`` query steps each, and a makespan,
    as its docstring models it (programs in launch order on the SMs as they
    free up, a part costing its share plus ``PART_OVERHEAD``), at least
    ``TAIL_SPLIT_GAIN`` shorter than without the split; or no split."""
    import heapq

    from compile_ops.ops import attention_sm90

    whole, parts = attention_sm90.backward_tail_split(items, sms, steps)
    if parts == 1:
        assert whole == items
        return
    assert 2 <= parts <= min(8, steps) and items - whole in (items % sms, items % sms + sms)
    free = [0.0] * sms
    for duration in [1.0] * whole + [1 / parts + attention_sm90.PART_OVERHEAD] * ((items - whole) * parts):
        heapq.heappush(free, heapq.heappop(free) + duration)
    assert max(free) < -(-items // sms) * (1 - attention_sm90.TAIL_SPLIT_GAIN)


def test_backward_steps_are_128_queries_only_at_head_dim_64_without_block_lists():
    """``attn_bwd_sm90_kernel``'s step rule (``ops.attention_sm90.backward_step``):
    128 queries for dense calls at D = 64 (1.06-1.14x on an H100), 64 at
    D = 128 (dK and dV fill the registers) and over block lists (a 128-query
    step spilled in the step loop); the kernel's static assert refuses the rest."""
    from compile_ops.ops.attention_sm90 import backward_step

    assert [backward_step(64, False), backward_step(64, True), backward_step(128, False), backward_step(128, True)] == [
        128,
        64,
        64,
        64,
    ]


def test_set_attention_backward_keys_compile_caches_by_its_setting():
    """``set_attention_backward(deterministic=False)`` adds its tag to
    torch.compile's cache keys (``torch.compiler.config.cache_key_tag``),
    keeping a tag of the user's; ``True`` takes it off again, once however
    often it was set; a non-bool is refused."""
    from compile_ops.ops import attention as attention_ops

    before = torch.compiler.config.cache_key_tag
    # torch's config modules are changed through their own patch(): pytest's monkeypatch
    # (9.x) deletes an entry it did not find in the module's __dict__ when it undoes.
    with torch.compiler.config.patch(cache_key_tag="users-own"):
        try:
            compile_ops.set_attention_backward(deterministic=False)
            compile_ops.set_attention_backward(deterministic=False)
            assert torch.compiler.config.cache_key_tag == "users-own," + attention_ops.ATOMIC_DQ_CACHE_TAG
            compile_ops.set_attention_backward(deterministic=True)
            assert torch.compiler.config.cache_key_tag == "users-own"
        finally:
            compile_ops.set_attention_backward(deterministic=True)
    assert torch.compiler.config.cache_key_tag == before
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        compile_ops.set_attention_backward(deterministic=1)


def test_backward_takes_the_five_product_kernel_only_when_asked_and_able(monkeypatch):
    """Traced on fake CUDA tensors of a faked sm_90 GPU: ``fused.attention_backward``
    runs the three deterministic passes by default, the dk/dv pass as the
    sm_90 kernel without dQ for dense calls it computes (``SM90_DKDV``); with
    ``set_attention_backward(deterministic=False)`` a 16-bit call at
    D = 128 or 64 (Lk a multiple of 128 or not, causal or not, with key
    lengths or not, dense or ``fused.block_sparse_attention_backward``'s)
    runs the five-product kernel's opaque op and dq's cast, and every other
    call (D = 32, 96 or 256, fp32, or torch's deterministic algorithms on)
    keeps the three passes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compile_ops.ops import attention_sm90

    five = ["attn_bwd_row_stats_kernel", "fused_gluon.attention_backward_sm90_.default", "attn_bwd_dq_from_acc_kernel"]
    three = ["attn_bwd_row_stats_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"]
    # the deterministic backward of a dense call the sm_90 kernel computes: its dk/dv pass is that kernel
    three_sm90 = ["attn_bwd_row_stats_kernel", "fused_gluon.attention_backward_sm90_.default", "attn_bwd_dq_kernel"]
    monkeypatch.setattr(attention_sm90, "has_wgmma", lambda t: t.device.type == "cuda")

    def launches(lk=256, d=128, dtype=torch.bfloat16, causal=False, with_lengths=False, sparse=False):
        with FakeTensorMode():
            q, grad, out = (torch.empty(2, 3, 200, d, dtype=dtype, device="cuda") for _ in range(3))
            k, v = (torch.empty(2, 3, lk, d, dtype=dtype, device="cuda") for _ in range(2))
            lse = torch.empty(2, 3, 200, device="cuda")
            lengths = torch.empty(2, dtype=torch.int32, device="cuda") if with_lengths else None
            if not sparse:
                return _traced_launches("fused::attention_backward", grad, q, k, v, out, lse, 0.125, causal, 2, lengths)
            index = torch.zeros(1, 1, 2, 2, dtype=torch.int32, device="cuda")
            count = torch.ones(1, 1, 2, dtype=torch.int32, device="cuda")
            every = _traced_launches(
                "fused::block_sparse_attention_backward",
                grad,
                q,
                k,
                v,
                out,
                lse,
                index,
                count,
                0.125,
                causal,
                2,
                lengths,
            )
            return [name for name in every if name in five + three]  # less the lists' sorting

    assert launches() == three_sm90 and launches(sparse=True) == three
    assert launches(d=64, causal=True, with_lengths=True, lk=300) == three_sm90
    monkeypatch.setattr(attention_sm90, "SM90_DKDV", False)
    assert launches() == three
    monkeypatch.setattr(attention_sm90, "SM90_DKDV", True)
    compile_ops.set_attention_backward(deterministic=False)
    try:
        for taken in (
            dict(),
            dict(lk=300),
            dict(causal=True),
            dict(with_lengths=True),
            dict(causal=True, with_lengths=True, lk=300),
            dict(sparse=True),
            dict(sparse=True, causal=True, lk=300),
            dict(d=64),
            dict(d=64, causal=True, lk=300),
            dict(d=64, sparse=True),
        ):
            assert launches(**taken) == five, taken
        for other in (
            dict(d=256),
            dict(d=32),
            dict(dtype=torch.float32),
            dict(d=96, causal=True),
            dict(d=256, sparse=True),
        ):
            assert launches(**other) == three, other
        with deterministic_algorithms():
            assert launches() == three_sm90 and launches(sparse=True) == three
    finally:
        compile_ops.set_attention_backward(deterministic=True)
    assert launches() == three_sm90


@pytest.mark.kernels
def test_kernels_five_product_backward_statistics_zero_and_cast_dq():
    """The Triton halves of the five-product backward (its Gluon kernel runs
    on sm_90 GPUs only): the statistics pass zeroes every padded row of the
    dq accumulator it is given (NaN-filled before), and the cast writes
    ``scale * accumulator`` into dq's strided rows, the padded rows left
    out, in dq's dtype."""
    from compile_ops.kernels.attention_backward import attn_bwd_dq_from_acc_kernel, attn_bwd_row_stats_kernel
    from compile_ops.ops import attention_launch

    dev = KERNEL_DEVICE
    b, h, lq, d = 2, 3, 100, 32
    out, grad = (torch.randn(b, lq, h, d, device=dev, dtype=torch.float16) for _ in range(2))
    lse = torch.randn(b, h, lq, device=dev)
    rows = 128  # _stats_row_length(100)
    delta, lse_rows = (torch.empty(b * h, rows, device=dev) for _ in range(2))
    acc = torch.full((b * h, rows, d), float("nan"), device=dev)
    attention_launch.launcher(attn_bwd_row_stats_kernel)[(rows // 64, b * h)](
        out,
        grad,
        lse,
        delta,
        lse_rows,
        h,
        lq,
        *out.stride()[:1],
        out.stride(2),
        out.stride(1),
        *grad.stride()[:1],
        grad.stride(2),
        grad.stride(1),
        D=d,
        BLOCK_D=d,
        BLOCK_M=64,
        ACC=tl.float32,
        DQ_ACC=acc,
        num_warps=4,
    )
    assert torch.equal(acc, torch.zeros_like(acc))
    torch.testing.assert_close(delta[:, :lq], (out.float() * grad.float()).sum(-1).transpose(1, 2).reshape(b * h, lq))
    acc = torch.randn(b * h, rows, d, device=dev)
    dq = torch.full((b, lq, h, d), float("nan"), device=dev, dtype=torch.bfloat16)
    attention_launch.launcher(attn_bwd_dq_from_acc_kernel)[(triton.cdiv(lq, 64), b * h)](
        acc, dq, h, lq, dq.stride(0), dq.stride(2), dq.stride(1), 0.125, D=d, BLOCK_D=d, BLOCK_M=64, num_warps=4
    )
    want = (acc.view(b, h, rows, d)[:, :, :lq] * 0.125).to(torch.bfloat16).transpose(1, 2)
    assert torch.equal(dq, want)


@pytest.mark.kernels
def test_kernels_five_product_backward_parts_add_up_in_order():
    """``attn_bwd_parts_kernel``: each parted item's fp32 dk and dv parts
    (``[items - whole, parts, 2, 128, D]``) summed in part order, cast to
    dk's / dv's dtype and written at the item's key tile of the item's
    (batch, k head) through strides (here ``[B, Lk, Hk, D]``), keys past Lk
    left alone; whole items' rows are not touched. fp32 outputs and parts of
    mixed magnitudes, so that another order of the sums gives other bits
    (checked on the data), and bf16 outputs for the cast."""
    from compile_ops.kernels.attention_backward import attn_bwd_parts_kernel
    from compile_ops.ops import attention_launch

    dev = KERNEL_DEVICE
    b, hk, lk, d, parts, whole = 2, 3, 300, 32, 3, 2  # 3 key tiles x 6 (batch, head) rows: items 2..17 parted
    n_tiles = triton.cdiv(lk, 128)
    items = n_tiles * b * hk
    gen = torch.Generator().manual_seed(0)
    partials = (
        torch.randn(items - whole, parts, 2, 128, d, generator=gen)
        * 2.0 ** torch.randint(-12, 12, (items - whole, parts, 2, 128, d), generator=gen)
    ).to(dev)
    summed = partials[:, 0] + partials[:, 1] + partials[:, 2]  # in part order, as fp32
    assert not torch.equal(summed, partials[:, 2] + partials[:, 1] + partials[:, 0])  # the order shows
    for dtype in (torch.float32, torch.bfloat16):
        dk, dv = (torch.full((b, lk, hk, d), float("nan"), device=dev, dtype=dtype) for _ in range(2))
        attention_launch.launcher(attn_bwd_parts_kernel)[(items - whole, 128 // 32)](
            partials,
            dk,
            dv,
            whole,
            parts,
            n_tiles,
            hk,
            lk,
            dk.stride(0),
            dk.stride(2),
            dk.stride(1),
            dv.stride(0),
            dv.stride(2),
            dv.stride(1),
            D=d,
            BLOCK_M=32,
            num_warps=4,
        )
        for grad, which in ((dk, 0), (dv, 1)):
            want = torch.full((b, hk, n_tiles * 128, d), float("nan"), device=dev)
            want.view(b * hk * n_tiles, 128, d)[whole:] = summed[:, which]
            want = want[:, :, :lk].to(dtype).transpose(1, 2)
            assert torch.equal(grad.isnan(), want.isnan()), dtype
            assert torch.equal(grad.nan_to_num(), want.nan_to_num()), dtype


@pytest.mark.skipif(not _SM90, reason="the Gluon core runs on sm_90 GPUs only")
def test_sm90_five_product_backward_matches_the_deterministic_one(monkeypatch):
    """``compile_ops.set_attention_backward(deterministic=False)`` on sm_90,
    dense: the five-product Gluon backward at D = 128 and 64 over ragged Lq
    and Lk (key tiles masked past Lk), GQA, both layouts, fp16 and bf16, causal with Lq
    above, equal to and below Lk, and key lengths (one batch row with
    none), checked against the deterministic passes
    (:func:`five_product_gradients`), and dq, dk and dv within the
    two-reference rule of the fp64 gradients."""
    from compile_ops.ops import attention_launch, attention_sm90

    launched, launcher = [], attention_launch.launcher
    monkeypatch.setattr(
        attention_launch, "launcher", lambda kernel: launched.append(kernel.fn.__name__) or launcher(kernel)
    )
    for b, h, hk, lq, lk, seq_dim, dtype, causal, lengths, d in [
        (1, 4, 4, 1000, 1024, 2, torch.bfloat16, False, None, 128),
        (2, 8, 2, 333, 300, 1, torch.float16, False, None, 128),
        (1, 2, 2, 64, 77, 2, torch.bfloat16, False, None, 128),
        (1, 3, 3, 4680, 4680, 1, torch.bfloat16, False, None, 128),
        (1, 4, 2, 1000, 1000, 2, torch.bfloat16, True, None, 128),
        (2, 3, 3, 300, 700, 1, torch.float16, True, None, 128),
        (1, 2, 2, 700, 300, 2, torch.bfloat16, True, None, 128),
        (3, 4, 2, 500, 640, 2, torch.bfloat16, False, [640, 77, 0], 128),
        (2, 2, 2, 600, 600, 1, torch.float16, True, [600, 250], 128),
        (1, 4, 4, 1000, 1024, 2, torch.bfloat16, False, None, 64),
        (2, 8, 2, 333, 300, 1, torch.float16, False, None, 64),
        (1, 3, 3, 4429, 4429, 1, torch.bfloat16, False, None, 64),
        (2, 3, 3, 300, 700, 1, torch.float16, True, None, 64),
        (2, 2, 2, 600, 600, 1, torch.float16, True, [600, 250], 64),
        # more items than an H100's 132 SMs, and a leftover: whole items and parts in one launch
        (1, 5, 5, 700, 4096, 2, torch.bfloat16, False, None, 128),
        (2, 4, 2, 500, 4300, 1, torch.float16, False, None, 64),
    ]:
        torch.manual_seed(lq + lk)
        q, k, v = _qkv(b, h, hk, lq, lk, d, seq_dim, dtype, "cuda")
        kv_lengths = None if lengths is None else torch.tensor(lengths, device="cuda", dtype=torch.int32)
        out = compile_ops.attention(q, k, v, None, causal, seq_dim, kv_lengths)
        dout = torch.randn_like(out)
        case = (b, h, hk, lq, lk, seq_dim, dtype, causal, lengths, d)
        items = triton.cdiv(lk, 128) * b * hk
        steps = h // hk * triton.cdiv(lq, attention_sm90.SM90_BACKWARD_STEPS[d])
        whole, _ = attention_sm90.backward_tail_split(items, multiprocessor_count(q), steps)
        parts = not causal and lengths is None and whole < items
        got = five_product_gradients(out, (q, k, v), dout, launched, "attn_bwd_dq_kernel", case, parts)
        qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
        exact, _ = ref.attention(qd, kd, vd, d**-0.5, causal, seq_dim, kv_lengths)
        exact_grads = torch.autograd.grad(exact, (qd, kd, vd), dout.double())
        theirs = torch_at_dtype(q, k, v, dout, d**-0.5, causal, seq_dim, kv_lengths)[1]
        for again in got:
            for name, g, e, p in zip("qkv", again, exact_grads, theirs):
                assert_within_torch_error(g, e, p, 3.0, f"d{name} {case}", fp32_roundings=128)


@pytest.mark.skipif(not _SM90, reason="the Gluon core runs on sm_90 GPUs only")
def test_sm90_deterministic_backward_by_the_kernel_without_dq(monkeypatch):
    """The default (deterministic) backward on sm_90, whose dk/dv pass is
    ``attn_bwd_sm90_kernel`` without dQ (``SM90_DKDV``): launched for dense
    calls, its last round never split (no fp32 parts: the default backward's
    peak memory); bit-identical across reruns; dq
    bit-equal to the ``triton.language`` passes' (the same dq pass) and dk,
    dv within 1e-3 of theirs; all three within the two-reference rule of
    the fp64 gradients; D = 128 and 64, GQA, both layouts, causal, key
    lengths, ragged Lq and Lk. The dense non-causal cases run the pass
    persistent (``SM90_DKDV_PERSISTENT``), two of them with more key tiles
    than an H100's 132 SMs (160 and 136), so that some programs take two
    and a dropped or doubled second item fails the fp64 rule."""
    from compile_ops.ops import attention_launch, attention_sm90

    launched, launcher = [], attention_launch.launcher
    monkeypatch.setattr(
        attention_launch, "launcher", lambda kernel: launched.append(kernel.fn.__name__) or launcher(kernel)
    )
    for b, h, hk, lq, lk, seq_dim, dtype, causal, lengths, d in [
        (1, 5, 5, 700, 4096, 2, torch.bfloat16, False, None, 128),  # split, with dq by reductions
        (2, 8, 2, 333, 300, 1, torch.float16, False, None, 128),
        (1, 4, 2, 1000, 1000, 2, torch.bfloat16, True, None, 128),
        (3, 4, 2, 500, 640, 2, torch.bfloat16, False, [640, 77, 0], 128),
        (2, 4, 2, 500, 4300, 1, torch.float16, False, None, 64),  # split, with dq by reductions
        (2, 3, 3, 300, 700, 1, torch.float16, True, [700, 250], 64),
    ]:
        case = (b, h, hk, lq, lk, seq_dim, dtype, causal, lengths, d)
        torch.manual_seed(lq + lk)
        q, k, v = _qkv(b, h, hk, lq, lk, d, seq_dim, dtype, "cuda")
        kv_lengths = None if lengths is None else torch.tensor(lengths, device="cuda", dtype=torch.int32)
        out = compile_ops.attention(q, k, v, None, causal, seq_dim, kv_lengths)
        dout = torch.randn_like(out)
        clear_launch_plans()
        launched.clear()
        got = [torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) for _ in range(3)]
        assert "attn_bwd_sm90_kernel" in launched and "attn_bwd_dkdv_kernel" not in launched, (case, launched)
        assert "attn_bwd_parts_kernel" not in launched, (case, launched)
        assert all(torch.equal(a, g) for again in got[1:] for a, g in zip(again, got[0])), case
        monkeypatch.setattr(attention_sm90, "SM90_DKDV", False)
        clear_launch_plans()
        passes = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        monkeypatch.setattr(attention_sm90, "SM90_DKDV", True)
        clear_launch_plans()
        assert torch.equal(got[0][0], passes[0]), case
        for g, w in zip(got[0][1:], passes[1:]):
            assert ((g.float() - w.float()).norm() / w.float().norm()).item() < 1e-3, case
        qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
        exact, _ = ref.attention(qd, kd, vd, d**-0.5, causal, seq_dim, kv_lengths)
        exact_grads = torch.autograd.grad(exact, (qd, kd, vd), dout.double())
        theirs = torch_at_dtype(q, k, v, dout, d**-0.5, causal, seq_dim, kv_lengths)[1]
        for name, g, e, p in zip("qkv", got[0], exact_grads, theirs):
            assert_within_torch_error(g, e, p, 3.0, f"d{name} {case}", fp32_roundings=128)


@pytest.mark.skipif(not _SM90, reason="the Gluon core runs on sm_90 GPUs only")
def test_sm90_backward_compiled_equals_eager(monkeypatch):
    """Under ``torch.compile`` (Inductor, fullgraph) the sm_90 backward runs
    as the opaque ``fused_gluon.attention_backward_sm90_``: the five-product
    option with a dQ accumulator (and, where the launch splits its last
    round, the parts' sum inside the op), the deterministic default without
    one (``dq_acc=None``: its dq comes from the ``triton.language`` pass).
    dk and dv equal the eager backward's bit for bit; dq too in the
    deterministic mode, within 1e-3 with five products (its sums' order
    varies from run to run: 1.6e-4 seen on an H100, where the bound was
    1e-4); D = 128 and 64, with and without a split. The five-product
    option first, then the default compiling the same function again: its
    graph must not come from the compile caches' entry of the other
    setting (``set_attention_backward``'s cache tag)."""
    from compile_ops.ops import attention_launch, attention_sm90

    # Traced calls launch the Gluon kernel inside the opaque op, not through ``launcher``.
    launched, launcher, launch_sm90 = [], attention_launch.launcher, attention_sm90.launch_sm90_backward
    monkeypatch.setattr(
        attention_launch, "launcher", lambda kernel: launched.append(kernel.fn.__name__) or launcher(kernel)
    )

    def recorded(launch, *args):
        return launch_sm90(lambda kernel: launched.append(kernel.fn.__name__) or launch(kernel), *args)

    for module in (attention_launch, attention_sm90):  # the eager path's launch and the opaque op's
        monkeypatch.setattr(module, "launch_sm90_backward", recorded)

    def attend(q, k, v):
        return compile_ops.attention(q, k, v, None, False, 2)

    try:
        for deterministic in (False, True):
            compile_ops.set_attention_backward(deterministic=deterministic)
            splits, sms = set(), multiprocessor_count(torch.empty(0, device="cuda"))
            for b, h, lq, lk, d in [(1, 5, 700, 4096, 128), (2, 4, 500, 4300, 64), (1, 4, 300, 4224, 128)]:
                items = triton.cdiv(lk, 128) * b * h
                steps = triton.cdiv(lq, attention_sm90.SM90_BACKWARD_STEPS[d])
                split = attention_sm90.backward_tail_split(items, sms, steps)[0] < items
                splits.add(split)
                torch.manual_seed(lk)
                q, k, v = _qkv(b, h, h, lq, lk, d, 2, torch.bfloat16, "cuda")
                dout = torch.randn(b, h, lq, d, device="cuda", dtype=torch.bfloat16)
                eager = torch.autograd.grad(attend(q, k, v), (q, k, v), dout)
                torch._dynamo.reset()
                clear_launch_plans()
                launched.clear()
                compiled = torch.autograd.grad(torch.compile(attend, fullgraph=True)(q, k, v), (q, k, v), dout)
                case = (b, h, lq, lk, d, split)
                assert "attn_bwd_sm90_kernel" in launched, (case, launched)
                assert ("attn_bwd_parts_kernel" in launched) == (split and not deterministic), (case, launched)
                assert torch.equal(compiled[1], eager[1]) and torch.equal(compiled[2], eager[2]), case
                if deterministic:
                    assert "attn_bwd_dq_kernel" in launched, (case, launched)
                    assert torch.equal(compiled[0], eager[0]), case
                else:
                    error = (compiled[0].float() - eager[0].float()).norm() / eager[0].float().norm()
                    assert error.item() < 1e-3, case
            assert splits == {True, False}, splits  # (on a 132-SM GPU: an H100 or H200)
    finally:
        compile_ops.set_attention_backward(deterministic=True)
