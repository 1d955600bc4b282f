"""The block_sparse family: fused.block_sparse_attention (forward and
backward) and the block-list builders.

``kernels`` tests run the Triton kernels (GPU, or the interpreter with small
shapes and fp16/fp32) by the two-reference rule of test_attention.py, with the
blocks' token mask added to PyTorch's own attention; with every block listed
the results equal fused.attention's bit for bit. The builders are checked
against straightforward loops and traced by torch.compile with fullgraph.
"""

import itertools
import math

import pytest
import torch
from attention_helpers import _SM90, LSE_ROUNDINGS, _qkv, five_product_gradients, torch_at_dtype
from bad_input import bad_input_test
from conftest import INTERPRET, KERNEL_DEVICE, allow_tma_under_interpreter
from hypothesis import given, settings
from hypothesis import strategies as st
from numerics import assert_within_torch_error
from shapes import examples

import compile_ops
from compile_ops._library import clear_launch_plans
from compile_ops.ops import block_sparse as bs
from compile_ops.reference import block_sparse as ref

DTYPES = [torch.float16, torch.float32] + ([] if INTERPRET else [torch.bfloat16])
BLOCK = 128


def _blocks(n):
    return (n + BLOCK - 1) // BLOCK


# ---------------------------------------------------------------- layer 3/4: kernels vs reference


@st.composite
def sparse_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    b = draw(st.integers(1, 2))
    hk = draw(st.integers(1, 2))
    hq = hk * draw(st.sampled_from([1, 2]))
    lq = draw(st.sampled_from([1, 97, 129, 300] if INTERPRET else [1, 97, 129, 300, 1025]))
    lk = draw(st.sampled_from([17, 128, 260] if INTERPRET else [17, 128, 260, 777]))
    d = draw(st.sampled_from([16, 40, 64] if INTERPRET else [16, 40, 64, 128]))
    seq_dim = draw(st.sampled_from([1, 2]))
    causal = draw(st.booleans())
    per_head = draw(st.booleans())
    kv_lengths = [draw(st.integers(1, lk)) for _ in range(b)] if draw(st.booleans()) else None
    density = draw(st.sampled_from([0.25, 0.5, 1.0]))
    seed = draw(st.integers(0, 2**16))
    return dtype, b, hq, hk, lq, lk, d, seq_dim, causal, per_head, kv_lengths, density, seed


def _random_lists(b, h, lq, lk, density, seed, device):
    """Random block lists in shuffled order; key block 0 always listed, so
    that every query (causal or with short key lengths) sees a key and
    PyTorch's masked attention has no empty rows to turn into NaN."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, h, _blocks(lq), _blocks(lk), generator=g) < density
    mask[..., 0] = True
    index, count = ref.block_index_from_mask(mask)
    listed = torch.arange(index.shape[-1]) < count[..., None]
    keys = torch.where(listed, torch.rand(index.shape, generator=g), 2.0)  # shuffle the listed entries only
    index = torch.gather(index, -1, torch.argsort(keys, -1))
    return index.to(device), count.to(device)


@pytest.mark.kernels
@settings(max_examples=examples(cpu=6, gpu=20))
@given(sparse_cases())
def test_kernels_match_fp64_reference_forward_and_backward(case):
    dtype, b, hq, hk, lq, lk, d, seq_dim, causal, per_head, kv_lengths, density, seed = case
    dev = KERNEL_DEVICE
    torch.manual_seed(seed)
    q, k, v = _qkv(b, hq, hk, lq, lk, d, seq_dim, dtype, dev)
    kv = None if kv_lengths is None else torch.tensor(kv_lengths, dtype=torch.int32, device=dev)
    index, count = _random_lists(b if per_head else 1, hq if per_head else 1, lq, lk, density, seed, dev)
    scale = 1 / math.sqrt(d)
    out, lse = compile_ops.block_sparse_attention(q, k, v, index, count, None, causal, seq_dim, kv, return_lse=True)

    allowed = ref.token_mask(index, count, lq, lk)
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    exact, exact_lse = ref.block_sparse_attention(qd, kd, vd, index, count, scale, causal, seq_dim, kv)
    dout = torch.randn_like(out)
    plain, theirs, plain_lse = torch_at_dtype(
        q.detach(), k.detach(), v.detach(), dout, scale, causal, seq_dim, kv, allowed
    )
    # fp32: each output sums its Lk terms p v at fp32, rescaling the running sum once per key tile, in
    # another order than torch's matmul (the GPU found 5.6e-7 against torch's 2.0e-7 at outputs up to 1.2: about
    # 4 ulps against 1.4, fp32 block-sparse, HYPOTHESIS_SEED=90210).
    assert_within_torch_error(out, exact, plain, 2.0, "output", terms=lk if dtype == torch.float32 else 1)
    assert_within_torch_error(lse, exact_lse, plain_lse, 2.0, "lse", fp32_roundings=LSE_ROUNDINGS)

    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(exact, (qd, kd, vd), dout.double())
    for name, g, e, p in zip("qkv", got, want, theirs):
        summed = (lk if name == "q" else lq) if dtype == torch.float32 else 1
        assert_within_torch_error(g, e, p, 3.0, f"d{name}", terms=summed, fp32_roundings=d)


@pytest.mark.skipif(not _SM90, reason="the Gluon backward runs on sm_90 GPUs only")
def test_sm90_five_product_backward_over_block_lists(monkeypatch):
    """``set_attention_backward(deterministic=False)`` on sm_90 with block
    lists: the five-product kernel runs (launched; the deterministic dk/dv
    pass is not) over shuffled lists with every density from near-empty to
    full, per-head and broadcast lists, GQA (the kernel walks each q head's
    lists of its group), ragged Lq and Lk, causal, key lengths, both
    layouts and D = 128 and 64; checked as the dense kernel is (``five_product_gradients``),
    and all three gradients within the two-reference rule of the fp64
    gradients."""
    from compile_ops.ops import attention_launch

    launched, launcher = [], attention_launch.launcher
    monkeypatch.setattr(
        attention_launch, "launcher", lambda kernel: launched.append(kernel.fn.__name__) or launcher(kernel)
    )
    for b, hq, hk, lq, lk, seq_dim, dtype, causal, lengths, per_head, density, d in [
        (1, 4, 4, 1024, 1024, 2, torch.bfloat16, False, None, True, 0.3, 128),
        (2, 6, 2, 700, 1000, 1, torch.float16, False, None, True, 0.5, 128),
        (1, 2, 2, 900, 900, 2, torch.bfloat16, True, None, False, 0.4, 128),
        (2, 4, 1, 640, 500, 1, torch.bfloat16, False, [500, 130], True, 0.05, 128),
        (1, 3, 3, 333, 4000, 2, torch.float16, True, [2900], True, 1.0, 128),
        (2, 6, 2, 700, 1000, 1, torch.float16, False, None, True, 0.5, 64),
        (1, 2, 2, 900, 900, 2, torch.bfloat16, True, [700], False, 0.4, 64),
    ]:
        case = (b, hq, hk, lq, lk, seq_dim, dtype, causal, lengths, per_head, density, d)
        seed = lq + lk
        torch.manual_seed(seed)
        q, k, v = _qkv(b, hq, hk, lq, lk, d, seq_dim, dtype, "cuda")
        kv = None if lengths is None else torch.tensor(lengths, dtype=torch.int32, device="cuda")
        index, count = _random_lists(b if per_head else 1, hq if per_head else 1, lq, lk, density, seed, "cuda")
        out = compile_ops.block_sparse_attention(q, k, v, index, count, None, causal, seq_dim, kv)
        dout = torch.randn_like(out)
        # The deterministic-algorithms leg too: the lists' transposition (a scatter of a scalar) must not
        # raise under use_deterministic_algorithms, and the passes must run then.
        got = five_product_gradients(out, (q, k, v), dout, launched, "attn_bwd_dkdv_kernel", case)
        scale = d**-0.5
        qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
        exact, _ = ref.block_sparse_attention(qd, kd, vd, index, count, scale, causal, seq_dim, kv)
        exact_grads = torch.autograd.grad(exact, (qd, kd, vd), dout.double())
        theirs = torch_at_dtype(
            q.detach(), k.detach(), v.detach(), dout, scale, causal, seq_dim, kv, ref.token_mask(index, count, lq, lk)
        )[1]
        for again in got:
            for name, g, e, p in zip("qkv", again, exact_grads, theirs):
                assert_within_torch_error(g, e, p, 3.0, f"d{name} {case}", fp32_roundings=128)


@pytest.mark.kernels
@pytest.mark.parametrize("causal", [False, True])
def test_kernels_every_block_listed_equals_dense_attention_bit_for_bit(causal):
    dev = KERNEL_DEVICE
    q, k, v = _qkv(2, 4, 2, 300, 260, 32, 1, torch.float16, dev)
    kv = torch.tensor([260, 131], dtype=torch.int32, device=dev)
    index, count = bs.block_index_from_mask(torch.ones(1, 1, _blocks(300), _blocks(260), dtype=torch.bool, device=dev))
    dout = torch.randn(2, 300, 4, 32, device=dev, dtype=torch.float16)
    sparse, sparse_lse = compile_ops.block_sparse_attention(q, k, v, index, count, None, causal, 1, kv, return_lse=True)
    dense, dense_lse = compile_ops.attention(q, k, v, None, causal, 1, kv, return_lse=True)
    pairs = [
        (sparse, dense),
        (sparse_lse, dense_lse),
        *zip(torch.autograd.grad(sparse, (q, k, v), dout), torch.autograd.grad(dense, (q, k, v), dout)),
    ]
    for a, b in pairs:
        assert torch.equal(a, b)


@pytest.mark.kernels
def test_kernels_sparse_dkdv_by_tma_computes_what_pointer_loads_do(monkeypatch):
    """The dk/dv pass's Hopper option on block-sparse lists (dkdv_tiles takes
    TMA for them at D=128 on Hopper): the transposed lists' query tiles by
    whole-tensor descriptors give the gradients of the pointer loads, forced
    on, with GQA, a padded head dim, partial tiles, key lengths, a query
    block with no listed block and both layouts."""
    import dataclasses

    from compile_ops.ops import attention_launch, attention_tiles

    default = attention_tiles.dkdv_tiles
    torch.manual_seed(0)
    for seq_dim in (1, 2):
        q, k, v = _qkv(2, 4, 2, 300, 260, 48, seq_dim, torch.float16, KERNEL_DEVICE)
        kv = torch.tensor([260, 131], dtype=torch.int32, device=KERNEL_DEVICE)
        index, count = _random_lists(2, 4, 300, 260, 0.5, seq_dim, KERNEL_DEVICE)
        count[0, 1, 1] = 0
        grad = torch.randn_like(q)

        def gradients():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            compile_ops.block_sparse_attention(*inputs, index, count, None, False, seq_dim, kv).backward(grad)
            return [t.grad for t in inputs]

        with monkeypatch.context() as m:
            m.setattr(
                attention_launch,
                "dkdv_tiles",
                lambda d, dtype, sparse=False, tma=False: dataclasses.replace(default(d, dtype, sparse), tma=False),
            )
            clear_launch_plans()
            want = gradients()
            m.setattr(
                attention_launch,
                "dkdv_tiles",
                lambda d, dtype, sparse=False, tma=False: dataclasses.replace(default(d, dtype, sparse), tma=True),
            )
            allow_tma_under_interpreter(m)
            clear_launch_plans()
            got = gradients()
        clear_launch_plans()
        for name, g, w in zip("qkv", got, want):
            torch.testing.assert_close(g, w, rtol=2e-3, atol=2e-3, msg=lambda m: f"d{name}: {m}")


@pytest.mark.kernels
def test_kernels_query_blocks_with_no_listed_block_give_zero_not_nan():
    dev = KERNEL_DEVICE
    q, k, v = _qkv(1, 2, 2, 300, 200, 16, 2, torch.float16, dev)
    index = torch.tensor([[1, 0], [0, 0], [0, 1]], dtype=torch.int32, device=dev).expand(1, 2, 3, 2)
    count = torch.tensor([1, 0, 2], dtype=torch.int32, device=dev).expand(1, 2, 3)
    out, lse = compile_ops.block_sparse_attention(q, k, v, index, count, return_lse=True)
    assert torch.equal(out[:, :, 128:256], torch.zeros_like(out[:, :, 128:256]))
    assert torch.isneginf(lse[:, :, 128:256]).all() and torch.isfinite(lse[:, :, :128]).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.equal(dq[:, :, 128:256], torch.zeros_like(dq[:, :, 128:256]))


@pytest.mark.kernels
def test_kernels_backward_is_deterministic():
    dev = KERNEL_DEVICE
    q, k, v = _qkv(1, 4, 2, 260, 390, 32, 2, torch.float16, dev)
    index, count = _random_lists(1, 4, 260, 390, 0.5, 3, dev)
    out = compile_ops.block_sparse_attention(q, k, v, index, count, causal=True)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    again = torch.autograd.grad(out, (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


# ---------------------------------------------------------------- builders


def test_block_index_from_mask_lists_true_blocks_ascending():
    mask = torch.rand(2, 3, 5, 7) < 0.4
    index, count = bs.block_index_from_mask(mask)
    assert index.dtype == count.dtype == torch.int32
    for pos in itertools.product(range(2), range(3), range(5)):
        want = torch.nonzero(mask[pos]).flatten().tolist()
        assert count[pos].item() == len(want) and index[pos][: len(want)].tolist() == want
    assert torch.equal(ref.block_mask_from_lists(index, count, 7), mask)


def test_key_block_lists_transpose_the_lists():
    mask = torch.rand(1, 2, 4, 6) < 0.5
    index, count = bs.block_index_from_mask(mask)
    key_index, key_count = bs.key_block_lists(index, count, 6)
    assert torch.equal(ref.block_mask_from_lists(key_index, key_count, 4), mask.transpose(-1, -2))


def test_tile_permutation_makes_tiles_contiguous():
    frames, height, width, tile = 2, 4, 6, (1, 2, 3)
    perm = bs.tile_permutation(frames, height, width, tile)
    want = []
    for tf, th, tw in itertools.product(range(2), range(2), range(2)):
        for f, h, w in itertools.product(range(1), range(2), range(3)):
            want.append(((tf + f) * height + th * 2 + h) * width + tw * 3 + w)
    assert perm.tolist() == want


def test_ragged_tile_permutation_puts_whole_tiles_first_and_round_trips():
    """A tile that does not divide the grid: whole tiles first (row-major), then
    the cut ones (row-major), tokens row-major inside each; argsort undoes it."""
    frames, height, width, tile = 3, 5, 6, (2, 2, 4)
    perm = bs.tile_permutation(frames, height, width, tile, ragged=True)
    assert torch.equal(perm.sort().values, torch.arange(frames * height * width))
    x = torch.randn(1, frames * height * width, 3)
    assert torch.equal(x[:, perm][:, torch.argsort(perm)], x)
    tiles = {}  # (cut, tile coordinates) -> its tokens in row-major order
    for f, h, w in itertools.product(range(frames), range(height), range(width)):
        coords = (f // 2, h // 2, w // 4)
        cut = f // 2 == frames // 2 or h // 2 == height // 2 or w // 4 == width // 4
        tiles.setdefault((cut, coords), []).append((f * height + h) * width + w)
    want = [token for key in sorted(tiles) for token in tiles[key]]
    assert perm.tolist() == want
    with pytest.raises(ValueError, match="must divide"):
        bs.tile_permutation(frames, height, width, tile)  # ragged is asked for, not assumed


@pytest.mark.parametrize(
    "grid, tile, window",
    [((4, 4, 8), (2, 4, 16), (1, 1, 1)), ((3, 5, 20), (2, 4, 8), (2, 1, 2)), ((5, 7, 9), (2, 2, 4), (3, 3, 3))],
)
def test_sliding_tile_block_mask_is_the_smallest_block_mask_over_the_token_pattern(grid, tile, window):
    """Built from tokens: token a attends to token b when b's tile lies in a's
    tile's window (sliding_tile_mask over the rounded-up tile grid); a block
    pair is kept exactly when some token pair in it is."""
    perm, mask = bs.sliding_tile_block_mask(*grid, tile, window)
    assert torch.equal(perm, bs.tile_permutation(*grid, tile, ragged=True))
    tile_grid = [-(-n // t) for n, t in zip(grid, tile)]
    near = bs.sliding_tile_mask(tile_grid, window)
    coords = torch.stack(torch.meshgrid(*(torch.arange(n) for n in grid), indexing="ij"), -1).reshape(-1, 3)
    tile_ids = ((coords // torch.tensor(tile)) * torch.tensor([tile_grid[1] * tile_grid[2], tile_grid[2], 1])).sum(-1)
    token_mask = near[tile_ids[perm][:, None], tile_ids[perm][None, :]]  # in permuted order
    n = perm.numel()
    blocks = -(-n // 128)
    padded = torch.zeros(blocks * 128, blocks * 128, dtype=torch.bool)
    padded[:n, :n] = token_mask
    want = padded.view(blocks, 128, blocks, 128).any(3).any(1)
    assert torch.equal(mask, want)
    if all(g % t == 0 for g, t in zip(grid, tile)) and math.prod(tile) == 128:
        assert torch.equal(mask, near)  # aligned tiles: exactly the tile pattern


def test_sliding_tile_mask_matches_a_loop():
    grid, window = (3, 4, 5), (3, 2, 3)
    mask = bs.sliding_tile_mask(grid, window)
    tiles = list(itertools.product(*(range(n) for n in grid)))

    def start(c, n, w):
        return min(max(c - w // 2, 0), n - w)

    for i, a in enumerate(tiles):
        for j, b in enumerate(tiles):
            want = all(start(ca, n, w) <= cb < start(ca, n, w) + w for ca, cb, n, w in zip(a, b, grid, window))
            assert mask[i, j].item() == want, (a, b)
    assert (mask.sum(-1) == math.prod(window)).all()  # a constant window size, as STA's


def test_radial_mask_matches_a_loop_and_thins_with_distance():
    frames, per_frame = 21, 1560  # Wan 2.1 480p latents
    mask = bs.radial_mask(frames, per_frame, dense_frames=1)
    n = mask.shape[0]
    assert n == _blocks(frames * per_frame)
    for i, j in itertools.product(range(0, n, 7), range(0, n, 5)):
        ci, cj = min(i * BLOCK + 64, frames * per_frame - 1), min(j * BLOCK + 64, frames * per_frame - 1)
        d = abs(ci // per_frame - cj // per_frame)
        reach = max(per_frame / 2 ** max(math.ceil(math.log2(max(d, 1))), 0), BLOCK)
        want = d <= 1 or abs(ci % per_frame - cj % per_frame) <= reach
        assert mask[i, j].item() == want
    density = mask.float().mean().item()
    assert 0.1 < density < 0.6, density


def test_topk_block_index_matches_a_brute_force_selection():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 300, 16) * 2, torch.randn(1, 1, 390, 16) * 2
    index, count = bs.topk_block_index(q, k, coverage=0.8, sink_blocks=1)
    got = ref.block_mask_from_lists(index, count, 4)
    sizes = torch.tensor([128.0, 128.0, 128.0, 6.0])
    for h, i in itertools.product(range(2), range(3)):
        qm = q[0, h, i * 128 : (i + 1) * 128].mean(0)
        km = torch.stack([k[0, 0, j * 128 : (j + 1) * 128].mean(0) for j in range(4)])
        mass = torch.softmax(km @ qm / 4 + sizes.log(), 0)
        keep, total = {0}, mass[0].item()  # the sink counts toward the coverage
        for j in mass.argsort(descending=True).tolist():
            if total >= 0.8:
                break
            if j in keep:
                continue
            keep.add(j)
            total += mass[j].item()
        assert set(torch.nonzero(got[0, h, i]).flatten().tolist()) == keep


def test_builders_and_attention_trace_with_fullgraph():
    # torch 2.11's AOT autograd hands the ops FunctionalTensors: the eager-only
    # value checks must see through them (they once raised a data-dependent
    # guard error here).
    torch._dynamo.reset()

    def dynamic_sparse(q, k, v):
        index, count = bs.topk_block_index(q, k, coverage=0.9)
        return compile_ops.block_sparse_attention(q, k, v, index, count)

    def static_sparse(q, k, v):
        mask = bs.sliding_tile_mask((1, 1, 3), (1, 1, 2), device=q.device)
        index, count = bs.block_index_from_mask(mask[None, None])  # one list for every batch element and head
        return compile_ops.block_sparse_attention(q, k, v, index, count)

    q, k, v = (torch.randn(1, 2, 384, 16, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 2, 384, 16)
    for fn in (dynamic_sparse, static_sparse):
        out = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
        want = fn(q, k, v)
        torch.testing.assert_close(out, want)
        for got_grad, want_grad in zip(
            torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)
        ):
            torch.testing.assert_close(got_grad, want_grad)


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(1, 1, 3, 5), (2, 3, 7, 40), (1, 2, 4, 1), (1, 1, 2, 300)])
def test_kernels_sort_the_lists_as_the_specification(dtype, shape):
    """``sort_block_lists_kernel`` (ops.block_sparse.ascending) equals
    ``reference.block_sparse.ascending``: each row's listed entries ascending,
    the rest the dtype's largest value; also from broadcast (stride 0) lists."""
    torch.manual_seed(0)
    b, h, nq, w = shape
    index = torch.stack([torch.randperm(w + 3)[:w] for _ in range(b * h * nq)]).view(shape).to(dtype)
    count = torch.randint(0, w + 1, (b, h, nq), dtype=dtype)
    index, count = index.to(KERNEL_DEVICE), count.to(KERNEL_DEVICE)
    assert torch.equal(bs.ascending(index, count), ref.ascending(index, count))
    wide_index, wide_count = index[:, :1].expand(b, 4, nq, w), count[:, :1].expand(b, 4, nq)
    assert torch.equal(bs.ascending(wide_index, wide_count), ref.ascending(wide_index, wide_count))


def test_list_values_are_checked_once_per_unchanged_list_tensors(monkeypatch):
    """The eager value check (a host sync on a GPU) runs once for the same
    list tensors, again after an in-place change or for new tensors, and a
    bad change is still refused: what lets a launch plan replay the op."""
    from compile_ops.meta import block_sparse as meta_bs

    checks = []
    real = meta_bs._check_values
    monkeypatch.setattr(meta_bs, "_check_values", lambda *a: checks.append(1) or real(*a))
    meta_bs._CHECKED_LISTS.clear()
    q, k, v = (torch.randn(1, 2, 300, 16) for _ in range(3))
    index, count = ref.block_index_from_mask(torch.ones(1, 2, 3, 3, dtype=torch.bool))
    for _ in range(3):
        compile_ops.block_sparse_attention(q, k, v, index, count)
    assert len(checks) == 1
    compile_ops.block_sparse_attention(q, k, v, index.clone(), count)  # new tensors
    assert len(checks) == 2
    index[0, 0, 0, 0] = index[0, 0, 0, 1]  # in place: a block listed twice
    with pytest.raises(ValueError, match="block_index lists a block twice"):
        compile_ops.block_sparse_attention(q, k, v, index, count)
    with torch.inference_mode():  # no version counters: checked every call
        index, count = ref.block_index_from_mask(torch.ones(1, 2, 3, 3, dtype=torch.bool))
        before = len(checks)
        for _ in range(2):
            compile_ops.block_sparse_attention(q, k, v, index, count)
        assert len(checks) - before >= 2  # every call (on a GPU, its eager check and its body's fake)


@pytest.mark.gpu
def test_a_replayed_call_still_refuses_bad_lists():
    """Once block-sparse attention's eager calls are replayed (a launch plan),
    new lists of the same shapes and dtypes are still checked: a bad list is
    refused, not handed to the kernel."""
    from compile_ops._library import FUSED_OPS, clear_launch_plans
    from compile_ops._replay import Plan

    clear_launch_plans()
    q, k, v = (torch.randn(1, 2, 300, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    index, count = bs.block_index_from_mask(torch.ones(1, 2, 3, 3, dtype=torch.bool, device="cuda"))
    with torch.no_grad():
        want = compile_ops.block_sparse_attention(q, k, v, index, count)
        got = compile_ops.block_sparse_attention(q, k, v, index, count)
        assert [type(p) for p in FUSED_OPS["block_sparse_attention"].plans.values()] == [Plan]
        assert torch.equal(got, want)
        with pytest.raises(ValueError, match=r"block_index lists key blocks in \[1, 3\]"):
            compile_ops.block_sparse_attention(q, k, v, index.clamp(max=3) + 1, count)
    clear_launch_plans()


# ---------------------------------------------------------------- bad input


def _bad_input_cases():
    q, k, v = (torch.randn(1, 2, 300, 16).half() for _ in range(3))
    index, count = ref.block_index_from_mask(torch.ones(1, 2, 3, 3, dtype=torch.bool))
    att = torch.ops.fused.block_sparse_attention
    return [
        (
            lambda: att(q, k, v, index.clamp(max=3) + 1, count, 0.1, False),
            ValueError,
            r"block_index lists key blocks in \[1, 3\], but there are 3",
        ),
        (
            lambda: att(q, k, v, index, count + 1, 0.1, False),
            ValueError,
            r"block_count must be in \[0, 3\] \(block_index's width\), got values in \[4, 4\]",
        ),
        (
            lambda: att(q, k, v, index[:, :, :2], count[:, :, :2], 0.1, False),
            ValueError,
            r"block_index must have shape \[B or 1, H or 1, ceil\(Lq / 128\), W\] = \[1 or 1, 2 or 1, 3, W\]",
        ),
        (lambda: att(q, k, v, index, count[:, :1], 0.1, False), ValueError, r"block_count must have shape \(1, 2, 3\)"),
        (lambda: att(q, k, v, index.float(), count, 0.1, False), TypeError, r"block_index must be int32 or int64"),
        (
            lambda: att(q, k, v, torch.zeros_like(index), count, 0.1, False),
            ValueError,
            r"block_index lists a block twice",
        ),
        (lambda: att(q, k, v, index.to("meta"), count, 0.1, False), ValueError, r"block_index is on meta but q"),
        (lambda: bs.block_index_from_mask(torch.ones(3, 3)), TypeError, r"mask must be bool"),
        (lambda: bs.sliding_tile_mask((2, 2, 2), (3, 1, 1)), ValueError, r"window \(3, 1, 1\) must fit"),
        (lambda: bs.tile_permutation(2, 4, 6, (1, 3, 3)), ValueError, r"tile \(1, 3, 3\) must divide"),
        (lambda: bs.topk_block_index(q, k, coverage=1.5), ValueError, r"coverage must be a share"),
        (lambda: bs.radial_mask(4, 0), ValueError, r"must be 2 positive ints"),
    ]


test_bad_input_raises_a_clear_error = bad_input_test(_bad_input_cases)
