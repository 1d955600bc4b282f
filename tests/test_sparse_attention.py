"""Sparse self-attention through compile_ops.patch(model, attention=...): Wan and
LTX-Video, against the dense patched model (a window covering the grid) and
against dense attention under the same explicit token mask (smaller windows)."""

import copy
import dataclasses
import functools
import itertools

import pytest
import tiny_models
import torch
import torch._dynamo.testing
from conftest import HAS_CUDA, KERNEL_DEVICE

import compile_ops
from compile_ops.integrations import sparse_attention as sparse
from compile_ops.ops import block_sparse as bs

diffusers = pytest.importorskip("diffusers")
DEVICE = "cuda" if HAS_CUDA else "cpu"
TOL = dict(rtol=2e-3, atol=2e-3) if HAS_CUDA else dict(rtol=1e-4, atol=1e-5)


def _wan():
    torch.manual_seed(0)
    model = tiny_models.wan(attention_head_dim=8, rope_max_seq_len=64)

    def inputs(frames, side, timestep=500):
        # frames x side/2 x side/2 tokens
        return dict(
            hidden_states=torch.randn(1, 4, frames, side, side),
            encoder_hidden_states=torch.randn(1, 6, 16),
            timestep=torch.tensor([timestep]),
        )

    return model, inputs, lambda frames, side: (frames, side // 2, side // 2)


def _ltx():
    torch.manual_seed(0)
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

    def inputs(frames, side, timestep=500):
        return dict(
            hidden_states=torch.randn(1, frames * side * side, 4),
            encoder_hidden_states=torch.randn(1, 6, 16),
            timestep=torch.tensor([timestep]),
            encoder_attention_mask=torch.ones(1, 6),
            num_frames=frames,
            height=side,
            width=side,
        )

    return model, inputs, lambda frames, side: (frames, side, side)


def _hunyuan():
    """HunyuanVideo: text tokens follow the video tokens in every attention;
    the last two of its 12 text tokens are padding (a key-length mask)."""
    torch.manual_seed(0)
    model = tiny_models.hunyuan_video()

    def inputs(frames, side, timestep=500):
        return dict(
            hidden_states=torch.randn(1, 4, frames, side, side),
            timestep=torch.tensor([float(timestep)]),
            encoder_hidden_states=torch.randn(1, 12, 16),
            pooled_projections=torch.randn(1, 8),
            encoder_attention_mask=torch.tensor([[1.0] * 10 + [0.0] * 2]),
            guidance=torch.tensor([300.0]),
        )

    return model, inputs, lambda frames, side: (frames, side, side)


# 4 x 16 x 16 video tokens: 8 blocks of 128
MODELS = {"wan": (_wan, (4, 32)), "ltx": (_ltx, (4, 16)), "hunyuan": (_hunyuan, (4, 16))}


def _pair(name, config):
    build, _ = MODELS[name]
    model, inputs, grid = build()
    model = model.to(DEVICE).float()
    dense = copy.deepcopy(model)
    compile_ops.patch(dense)
    sparse_model = copy.deepcopy(model)
    report = compile_ops.patch(sparse_model, attention=config)
    return dense, sparse_model, report, inputs, grid


def _forward_backward(model, args):
    args = {
        k: v.clone().requires_grad_(k == "hidden_states")
        if isinstance(v, torch.Tensor) and v.is_floating_point()
        else v
        for k, v in args.items()
    }
    out = model(**args).sample
    out.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, args["hidden_states"].grad, grads


@pytest.mark.parametrize("name", MODELS)
def test_a_window_covering_the_grid_is_the_dense_patched_model(name):
    dense, sparse_model, report, inputs, _ = _pair(name, compile_ops.SlidingTile(window=(2, 2, 2), tile=(2, 8, 8)))
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs(*MODELS[name][1]).items()}
    want, want_dx, want_grads = _forward_backward(dense, args)
    got, got_dx, got_grads = _forward_backward(sparse_model, args)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_dx, want_dx, **TOL)
    assert want_grads.keys() == got_grads.keys()
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], **TOL, msg=lambda m: f"{n}: {m}")
    assert "100.0% of blocks" in str(report), str(report)  # ran sparse, with every block listed


def _dense_under_lists(index, count, perm, query, key, value, kv_lengths=None):
    """Dense SDPA of [B, L, H, D] q, k, v in the natural token order under the
    explicit token mask of block lists ``index``/``count`` (made over the
    sequence permuted by ``perm``; None: natural), and the key lengths: no
    permuted attention, no block-sparse kernel."""
    length = query.shape[1]
    position = torch.argsort(perm) if perm is not None else torch.arange(length, device=query.device)
    block = position // 128  # each token's block in the permuted sequence
    listed = torch.zeros(*index.shape[:3], index.shape[2], dtype=torch.bool, device=query.device)
    for b, h, i in itertools.product(*(range(n) for n in index.shape[:3])):  # each list's first `count` blocks
        listed[b, h, i, index[b, h, i, : count[b, h, i]].long()] = True
    mask = listed[:, :, block[:, None], block[None, :]]  # [B or 1, H or 1, L, L]
    if kv_lengths is not None:
        mask = mask & (torch.arange(length, device=query.device) < kv_lengths[:, None, None, None])
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (query, key, value)), attn_mask=mask
    )
    return out.transpose(1, 2)


def _masked_reference(layout, query, key, value, kv_lengths=None):
    """Dense attention under a static layout's explicit token mask."""
    return _dense_under_lists(layout.index, layout.count, layout.perm, query, key, value, kv_lengths)


#: Radial attention needs frames of more than two blocks to drop any (1024 tokens a frame here).
RADIAL_SIZES = {"wan": (4, 64), "ltx": (4, 32), "hunyuan": (4, 32)}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(
    "config",
    [
        compile_ops.SlidingTile(window=(1, 2, 1), tile=(2, 8, 8)),
        compile_ops.SlidingTile(window=(1, 1, 1), tile=(1, 4, 8)),
        compile_ops.Radial(dense_frames=1),
    ],
    ids=["sta-2x", "sta-ragged", "radial"],
)
def test_a_smaller_window_is_dense_attention_under_the_same_explicit_mask(name, config):
    _, sparse_model, report, inputs, grid = _pair(name, config)
    reference = copy.deepcopy(sparse_model)
    layouts = []
    for module in reference.modules():
        processor = getattr(module, "processor", None)
        if getattr(processor, "sparse", None) is not None:
            plan = processor.sparse

            def masked(query, key, value, text_tokens=0, kv_lengths=None, plan=plan, **rest):
                # bf16, one rank: no FP8 rows, no parallel config or replicated text.
                assert text_tokens == plan.layout.text_tokens and not any(rest.values()), rest
                layouts.append(plan.layout)
                return _masked_reference(plan.layout, query, key, value, kv_lengths)

            processor.attend_self = masked
    size = RADIAL_SIZES[name] if isinstance(config, compile_ops.Radial) else MODELS[name][1]
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs(*size).items()}
    got, got_dx, _ = _forward_backward(sparse_model, args)
    want, want_dx, _ = _forward_backward(reference, args)
    assert layouts and all(layout is not None for layout in layouts)  # the reference ran masked, every layer
    density = layouts[0].density
    assert 0 < density < 1, density  # sparse for real
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_dx, want_dx, **TOL)
    print(f"{name} {config}: {density:.1%} of blocks; {report.sparse_attention.describe()}")


@pytest.mark.parametrize("video_grid, text", [((4, 16, 16), 12), ((3, 6, 20), 140)])
def test_text_after_the_video_is_attended_by_all_and_attends_to_all(video_grid, text):
    """A joint video + text layout (HunyuanVideo): the video blocks keep the
    sliding-tile pattern; every block holding text (the one shared with the
    last video tokens included) is in every list, and lists everything."""
    config = compile_ops.SlidingTile(window=(1, 1, 1), tile=(2, 4, 8))
    layout = config.layout(video_grid, "cpu", text_tokens=text)
    video = video_grid[0] * video_grid[1] * video_grid[2]
    n = -(-(video + text) // 128)
    listed = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        listed[i, layout.index[0, 0, i, : layout.count[0, 0, i]].long()] = True
    perm, video_mask = bs.sliding_tile_block_mask(*video_grid, config.tile, config.window)
    first_text = video // 128
    assert torch.equal(layout.perm, torch.cat([perm, torch.arange(video, video + text)]))
    assert torch.equal(listed[:first_text, :first_text], video_mask[:first_text, :first_text])
    assert listed[:, first_text:].all() and listed[first_text:, :].all()
    assert 0 < layout.density < 1


def test_layout_lists_are_as_wide_as_the_longest_and_list_the_mask():
    """A layout's static lists are cut to their longest list (the op sorts them
    on every call, at a cost that follows the width) and still list exactly
    the sliding-tile block mask."""
    config = compile_ops.SlidingTile(window=(1, 1, 1), tile=(2, 4, 8))
    grid = (6, 16, 32)
    layout = config.layout(grid, "cpu")
    _, mask = bs.sliding_tile_block_mask(*grid, config.tile, config.window)
    n = mask.shape[0]
    assert layout.index.shape == (1, 1, n, int(layout.count.max())) and layout.index.shape[-1] < n
    listed = compile_ops.reference.block_sparse.block_mask_from_lists(layout.index, layout.count, n)[0, 0]
    assert torch.equal(listed, mask)


def test_dense_steps_keep_the_first_steps_dense_and_a_new_generation_restarts():
    _, sparse_model, report, inputs, _ = _pair("wan", compile_ops.SlidingTile(window=(1, 1, 1), dense_steps=2))
    plan, seen = report.sparse_attention, []
    with torch.no_grad():
        for t in (900, 900, 800, 700, 600, 950, 900):  # CFG repeats a timestep; 950 starts a new generation
            sparse_model(
                **{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs(4, 32, timestep=t).items()}
            )
            seen.append(plan.layout is not None)
    assert seen == [False, False, False, True, True, False, False], seen


def test_the_report_names_the_layers_and_the_density_per_grid():
    dense, sparse_model, report, inputs, grid = _pair("wan", compile_ops.SlidingTile(window=(1, 1, 1)))
    rows = [path for path, what, _ in report.replaced if what == "self-attention"]
    assert rows == ["blocks.0.attn1", "blocks.1.attn1"], rows
    with torch.no_grad():
        sparse_model(**{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs(4, 32).items()})
    text = str(report)
    assert "sparse self-attention in 2 layers" in text and "grid (4, 16, 16) (8 blocks): 12.5% of blocks" in text
    compile_ops.unpatch(sparse_model)  # the hook goes with the processors
    assert not sparse_model._forward_pre_hooks


def test_the_permutation_and_layouts_are_built_once_per_grid(monkeypatch):
    _, sparse_model, report, inputs, _ = _pair("wan", compile_ops.SlidingTile(window=(1, 1, 1)))
    builds = []
    original = bs.sliding_tile_block_mask
    monkeypatch.setattr(sparse, "sliding_tile_block_mask", lambda *a, **k: builds.append(a) or original(*a, **k))
    with torch.no_grad():
        for frames, side in ((4, 32), (4, 32), (2, 32), (4, 32)):
            sparse_model(
                **{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs(frames, side).items()}
            )
    assert [a[:3] for a in builds] == [(4, 16, 16), (2, 16, 16)], builds


def test_configurations_that_do_not_fit_raise_by_name():
    _, sparse_model, _, inputs, _ = _pair("wan", compile_ops.SlidingTile(window=(3, 1, 1), tile=(2, 8, 8)))
    with pytest.raises(ValueError, match=r"window \(3, 1, 1\) must fit in the tile grid \(2, 2, 2\)"):
        sparse_model(**{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs(4, 32).items()})
    with pytest.raises(ValueError, match="window must be three positive ints"):
        compile_ops.SlidingTile(window=(0, 1, 1))
    with pytest.raises(ValueError, match="dense_steps must be an int >= 0"):
        compile_ops.Radial(dense_steps=-1)
    with pytest.raises(ValueError, match=r"coverage must be in \(0, 1\]"):
        compile_ops.TopK(coverage=1.5)
    flux = tiny_models.flux(
        attention_head_dim=8, joint_attention_dim=16, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4)
    )
    with pytest.raises(TypeError, match="sparse attention covers WanTransformer3DModel"):
        compile_ops.patch(flux, attention=compile_ops.SlidingTile())
    with pytest.raises(TypeError, match="attention must be one of SlidingTile, Radial, TopK"):
        compile_ops.patch(_wan()[0], attention="sta")
    with pytest.raises(RuntimeError, match="attention_processors=True"):
        compile_ops.patch(_wan()[0], attention_processors=False, attention=compile_ops.SlidingTile())


def _topk_reference(layout, query, key, value):
    """TopK restated without the block-sparse kernels: the lists that
    topk_block_index picks on the tile-permuted q/k, as an explicit per-head
    token mask for dense SDPA."""
    q, k = (t.index_select(1, layout.perm) for t in (query, key))
    index, count = bs.topk_block_index(q, k, layout.topk.coverage, layout.topk.sink_blocks, seq_dim=1)
    return _dense_under_lists(index, count, layout.perm, query, key, value)


def test_topk_is_dense_attention_under_the_lists_it_chose():
    """TopK against the same approximation spelled out (its lists as a token
    mask for dense SDPA), and its distance to the dense model reported."""
    _, sparse_model, report, inputs, _ = _pair("wan", compile_ops.TopK(coverage=0.5, tile=(2, 8, 8)))
    reference, dense = copy.deepcopy(sparse_model), copy.deepcopy(sparse_model)
    for model, replace in ((reference, "reference"), (dense, "dense")):
        for module in model.modules():
            processor = getattr(module, "processor", None)
            if getattr(processor, "sparse", None) is None:
                continue
            if replace == "dense":
                processor.sparse = None
            else:

                def masked(query, key, value, text_tokens=0, kv_lengths=None, plan=processor.sparse, **rest):
                    assert not any(rest.values()), rest  # a bf16 model, one rank
                    return _topk_reference(plan.layout, query, key, value)

                processor.attend_self = masked
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs(4, 32).items()}
    with torch.no_grad():
        got, want, exact = sparse_model(**args).sample, reference(**args).sample, dense(**args).sample
    assert report.sparse_attention.layout.topk is not None and "chosen per call" in str(report)
    torch.testing.assert_close(got, want, **TOL)
    err = ((got - exact).norm() / exact.norm()).item()
    print(f"TopK(coverage=0.5): relative L2 to the dense model {err:.2e}")
    assert err > 1e-4  # it dropped blocks: the comparison above is not dense against dense


def test_a_topk_layout_hands_fp8_rows_at_their_tokens():
    """``Layout.attend(..., fp8_rows=True)`` on a TopK layout (lists chosen per
    call on the tile-permuted q and k, the rows put back at their tokens):
    each row is the same call's 16-bit ``int8_fp8`` output rounded to e4m3 by
    the rows' scale, within one step (the 16-bit output was rounded once
    more); a row at another token's place is many steps off."""
    from test_attention_8bit import _e4m3_index

    layout = compile_ops.TopK(coverage=0.5, tile=(2, 8, 8)).layout((4, 16, 16), "cpu")
    # fp16, whose finer rounding of the 16-bit output rarely moves an e4m3 step.
    q, k, v = (torch.randn(1, 1024, 2, 16, dtype=torch.float16) for _ in range(3))
    with torch.no_grad():
        rows = layout.attend(q, k, v, precision="int8_fp8", fp8_rows=True)
        out16 = layout.attend(q, k, v, precision="int8_fp8").flatten(2, 3).float()
    assert rows.q.shape == (1, 1024, 32) and layout.inverse is not None
    inverse = torch.ones_like(rows.scale) / rows.scale
    for shift, steps_at_most in ((0, 1), (1, None)):
        rounded = (out16.roll(shift, 1) * inverse[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        steps = (_e4m3_index(rows.q) - _e4m3_index(rounded)).abs()
        if steps_at_most is not None:
            assert steps.max() <= steps_at_most and steps.float().mean() < 0.01, (steps.max(), steps.float().mean())
        else:
            assert steps.float().mean() > 4, steps.float().mean()


def test_a_topk_layout_reads_8bit_operands_through_the_tile_order(monkeypatch):
    """8-bit calls on a TopK layout hand the op q, k and v in their own order
    with the tile order as ``token_order`` (the kernels gather and scatter, no
    permuted copies); 16-bit calls hand it the permuted copies, which the op
    would otherwise make itself, and no order. Both give the result of the
    permuted call put back (docs/notes/block-sparse.md, "TopK through the
    tile order")."""
    layout = compile_ops.TopK(coverage=0.5, tile=(2, 8, 8)).layout((4, 16, 16), "cpu")
    q, k, v = (torch.randn(1, 1024, 2, 16, dtype=torch.bfloat16) for _ in range(3))
    calls = []

    def spy(name, op):
        def call(q_, k_, v_, index, count, **options):
            calls.append((name, q_ is q, options["token_order"] is layout.perm))
            return op(q_, k_, v_, index, count, **options)

        return call

    monkeypatch.setattr(sparse, "block_sparse_attention", spy("tensor", sparse.block_sparse_attention))
    monkeypatch.setattr(sparse, "block_sparse_attention_fp8_rows", spy("rows", sparse.block_sparse_attention_fp8_rows))
    with torch.no_grad():
        for precision, fp8_rows in (("int8_fp8", True), ("int8", False), ("exact", False)):
            got = layout.attend(q, k, v, precision=precision, fp8_rows=fp8_rows)
            got = got.dequantized() if fp8_rows else got
            permuted = (t.index_select(1, layout.perm) for t in (q, k, v))
            lists = bs.topk_block_index(*(t.index_select(1, layout.perm) for t in (q, k)), 0.5, 1, seq_dim=1)
            if fp8_rows:
                want = compile_ops.block_sparse_attention_fp8_rows(*permuted, *lists, seq_dim=1)
                want = want.dequantized()
            else:
                want = compile_ops.block_sparse_attention(*permuted, *lists, seq_dim=1, precision=precision)
            torch.testing.assert_close(got, want.index_select(1, layout.inverse), rtol=0, atol=0)
    assert calls == [("rows", True, True), ("tensor", True, True), ("tensor", False, False)], calls


@pytest.mark.parametrize("name", MODELS)
def test_regional_compile_fullgraph_compiles_once_per_mode_across_resolutions(name):
    """The blocks compiled in place (diffusers' compile_repeated_blocks) with
    dynamic shapes, as the schedule needs: one graph per mode, shared by the
    blocks, for every resolution; switching modes back is no recompile."""
    torch._dynamo.reset()
    _, sparse_model, report, inputs, _ = _pair(name, compile_ops.SlidingTile(window=(1, 1, 1), dense_steps=1))
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    blocks = sparse_model.blocks if name == "wan" else sparse_model.transformer_blocks
    for block in blocks:
        block.compile(backend=counter, fullgraph=True, dynamic=True)
    eager = copy.deepcopy(sparse_model)
    for block in eager.blocks if name == "wan" else eager.transformer_blocks:
        block._compiled_call_impl = None
    frames, side = MODELS[name][1]
    with torch.no_grad():
        for size in ((frames, side), (frames // 2, side * 3 // 2)):  # two grids
            for t in (900, 800):  # dense (first step), sparse
                args = {
                    k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs(*size, timestep=t).items()
                }
                torch.testing.assert_close(sparse_model(**args).sample, eager(**args).sample, **TOL)
    assert len(report.sparse_attention.layouts) == 2  # both grids ran sparse
    assert counter.frame_count == 2, counter.frame_count  # one per mode


@pytest.mark.kernels
def test_kernels_run_a_permuted_toy_sequence_like_the_masked_reference():
    """The block-sparse kernels (GPU, or the interpreter) on a ragged-tile permuted sequence."""
    torch.manual_seed(0)
    grid = (3, 6, 20)  # 360 tokens, 3 blocks; tile (2, 4, 8) is ragged on every axis
    layout = compile_ops.SlidingTile(window=(1, 1, 1), tile=(2, 4, 8)).layout(grid, KERNEL_DEVICE)
    q, k, v = (torch.randn(1, 360, 2, 16, device=KERNEL_DEVICE) for _ in range(3))
    got = layout.attend(q, k, v)
    want = _masked_reference(layout, q.double(), k.double(), v.double())
    assert 0 < layout.density < 1
    torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=2e-3)


# ---------------------------------------------------------------- 8-bit block-sparse attention with FP8 Linears


def _masked_8bit_reference(layout, precision, query, key, value, kv_lengths=None, fp8_rows=False):
    """8-bit attention's specification over a static layout without the
    block-sparse op: q, k, v permuted into the layout's order (where the
    8-bit operands are quantized: k's blocks of 128 are the permuted ones),
    ``reference.attention.attention_8bit`` under the lists' token mask built
    here by a loop, and un-permuted; with ``fp8_rows`` (``"int8_fp8"``), the
    FP8 rows of ``reference.attention.attention_int8_fp8_rows`` instead."""
    from compile_ops.reference import attention as dense_reference

    if layout.perm is not None:
        query, key, value = (t.index_select(1, layout.perm) for t in (query, key, value))
    index, count = layout.index, layout.count
    listed = torch.zeros(*index.shape[:3], index.shape[2], dtype=torch.bool, device=query.device)
    for b, h, i in itertools.product(*(range(n) for n in index.shape[:3])):
        listed[b, h, i, index[b, h, i, : count[b, h, i]].long()] = True
    block = torch.arange(query.shape[1], device=query.device) // 128
    allowed = listed[:, :, block[:, None], block[None, :]]
    if fp8_rows:
        assert precision == "int8_fp8"
        rows = dense_reference.attention_int8_fp8_rows(
            query, key, value, query.shape[-1] ** -0.5, False, 1, kv_lengths, allowed
        )
        values, scale = (t if layout.inverse is None else t.index_select(1, layout.inverse) for t in rows)
        return compile_ops.FP8Rows(values.flatten(2, 3), scale)
    out, _ = dense_reference.attention_8bit(
        query, key, value, query.shape[-1] ** -0.5, False, 1, kv_lengths, precision == "int8_fp8", allowed
    )
    return out if layout.inverse is None else out.index_select(1, layout.inverse)


def _sparse_calls(monkeypatch) -> list:
    """The precision of every block-sparse call the patched models make from now
    on (``"int8_fp8 rows"``: the call whose output is FP8 rows)."""
    calls = []

    def counting(name, label):
        original = getattr(sparse, name)

        def call(*args, **kwargs):
            calls.append(label or kwargs.get("precision", "exact"))
            return original(*args, **kwargs)

        monkeypatch.setattr(sparse, name, call)

    counting("block_sparse_attention", None)
    counting("block_sparse_attention_fp8_rows", "int8_fp8 rows")
    return calls


def _relative_l2(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("precision", ["int8", "int8_fp8"])
@pytest.mark.parametrize("name", MODELS)
def test_sparse_8bit_attention_with_fp8_linears_is_the_same_approximation_spelled_out(name, precision, monkeypatch):
    """``patch(precision="fp8", attention=SlidingTile(...), attention_precision=...)``
    on a bf16 model: every sparse self-attention layer runs block-sparse
    attention in that precision (the report says so per layer), and the model
    equals the same model whose sparse layers compute the specification
    spelled out (permuted operands, 8-bit quantization, the lists as an
    explicit token mask): the same bits off the GPU, within the kernels'
    distance to their specification on it (under 1e-2 and under the 8-bit
    approximation's own effect, printed with the distances to the exact
    sparse model and to the unpatched model)."""
    build, size = MODELS[name]
    model, inputs, _ = build()
    model = model.to(DEVICE, torch.bfloat16).eval()
    config = compile_ops.SlidingTile(window=(1, 2, 1), tile=(2, 8, 8))
    options = dict(precision="fp8", attention=config)
    patched, exact_sparse = copy.deepcopy(model), copy.deepcopy(model)
    report = compile_ops.patch(patched, attention_precision=precision, **options)
    compile_ops.patch(exact_sparse, **options)
    reference = copy.deepcopy(patched)
    for module in reference.modules():
        processor = getattr(module, "processor", None)
        if getattr(processor, "sparse", None) is not None:

            def masked(query, key, value, text_tokens=0, kv_lengths=None, plan=None, fp8_rows=False, **rest):
                assert text_tokens == plan.layout.text_tokens and not any(rest.values()), rest  # one rank
                fp8_rows = fp8_rows and precision == "int8_fp8"
                return _masked_8bit_reference(plan.layout, precision, query, key, value, kv_lengths, fp8_rows)

            processor.attend_self = functools.partial(masked, plan=processor.sparse)
    args = {
        k: v.to(DEVICE, torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
        for k, v in inputs(*size).items()
    }
    args = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in args.items()}
    calls = _sparse_calls(monkeypatch)
    with torch.no_grad():
        got = patched(**args).sample
        layers = report.sparse_attention.layers
        # int8_fp8's output reaches the FP8 output projections as the kernel's FP8 rows, except
        # HunyuanVideo's, whose joint output is split into video and text before its projections.
        rows = precision == "int8_fp8" and name != "hunyuan"
        assert calls == ["int8_fp8 rows" if rows else precision] * layers, calls
        want, approximated, unpatched = (m(**args).sample for m in (reference, exact_sparse, model))
    density = report.sparse_attention.layout.density
    assert 0 < density < 1, density
    to_reference, to_exact_sparse = _relative_l2(got, want), _relative_l2(got, approximated)
    to_unpatched = _relative_l2(got, unpatched)
    print(
        f"{name} {precision} + fp8 Linears, {density:.1%} of blocks: to the same approximation {to_reference:.2e}, "
        f"to the exact sparse FP8 model {to_exact_sparse:.2e}, to the unpatched model {to_unpatched:.2e}"
    )
    assert to_exact_sparse > 1e-3  # the 8-bit attention changed the output: the comparison sees it
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    else:
        # bf16 on a GPU: the kernel's exp2 and fp32 sums flip some of p's 8-bit roundings against the
        # PyTorch specification; through the model that is under 1e-2 (as the dense 8-bit model test
        # allows) and under the 8-bit approximation's own effect (about half of it, measured).
        assert to_reference < min(1e-2, to_exact_sparse), (to_reference, to_exact_sparse)
    kernels = {path: kernel for path, kernel, _ in report.attention_paths()}
    for path, _, detail in report.replaced:
        if "block-sparse" in detail:
            assert kernels[path].startswith(f"fused.block_sparse_attention ({config}) in precision={precision!r}")
    assert any(f"fused.block_sparse_attention ({config}) in precision" in line for line in str(report).splitlines())


def test_sparse_and_8bit_schedules_each_keep_their_own_steps(monkeypatch):
    """``SlidingTile(dense_steps=1)`` with ``attention_precision="int8",
    attention_dense_steps=2``: step 1 runs dense exact attention (both
    schedules), step 2 sparse attention in the exact precision (the 8-bit
    schedule's second dense step), step 3 on sparse 8-bit; a new generation
    starts over."""
    from compile_ops.integrations.diffusers import processors

    model, inputs, _ = _wan()
    model = model.to(DEVICE, torch.bfloat16).eval()
    compile_ops.patch(
        model,
        attention=compile_ops.SlidingTile(window=(1, 1, 1), dense_steps=1),
        attention_precision="int8",
        attention_dense_steps=2,
    )
    sparse_calls, dense_calls = _sparse_calls(monkeypatch), []
    dense = processors.attention
    monkeypatch.setattr(
        processors, "attention", lambda *a, **kw: dense_calls.append(kw.get("precision", "exact")) or dense(*a, **kw)
    )
    seen = []
    with torch.no_grad():
        for t in (900, 800, 700, 950):
            sparse_calls.clear(), dense_calls.clear()
            args = inputs(4, 32, timestep=t)
            model(
                **{k: v.to(DEVICE, torch.bfloat16) if v.is_floating_point() else v.to(DEVICE) for k, v in args.items()}
            )
            # (a GPU may run exact dense calls on SDPA: they count as not 8-bit)
            seen.append((sorted(set(sparse_calls)), "int8" if "int8" in dense_calls else "exact"))
    # Self-attention sparse from step 2; cross-attention (dense) 8-bit from step 3, as the sparse steps.
    assert seen == [([], "exact"), (["exact"], "exact"), (["int8"], "int8"), ([], "exact")], seen


@pytest.mark.kernels
@pytest.mark.parametrize("precision", ["int8", "int8_fp8"])
def test_kernels_run_a_permuted_toy_sequence_in_8_bits_like_the_specification(precision):
    """The 8-bit block-sparse kernel (GPU, or the interpreter) through a
    ragged-tile layout with key lengths: the specification spelled out
    (:func:`_masked_8bit_reference`) within the dense 8-bit kernel's bound."""
    from attention_helpers import EIGHT_BIT

    torch.manual_seed(0)
    layout = compile_ops.SlidingTile(window=(1, 1, 1), tile=(2, 4, 8)).layout((3, 6, 20), KERNEL_DEVICE)
    q, k, v = (torch.randn(2, 360, 2, 32, device=KERNEL_DEVICE).half() for _ in range(3))
    kv_lengths = torch.tensor([360, 200], dtype=torch.int32, device=KERNEL_DEVICE)
    with torch.no_grad():
        got = layout.attend(q, k, v, kv_lengths, precision=precision)
    cpu = dataclasses.replace(layout, **{f: getattr(layout, f).cpu() for f in ("perm", "inverse", "index", "count")})
    want = _masked_8bit_reference(cpu, precision, q.cpu(), k.cpu(), v.cpu(), kv_lengths.cpu())
    assert 0 < layout.density < 1
    assert _relative_l2(got.cpu(), want) < EIGHT_BIT[precision][1][torch.float16]
