"""compile_ops.patch on diffusers transformers built from small random configs.

Patched and unpatched copies of each model (Flux, Wan, SD3, LTX-Video, and
HunyuanVideo, CogVideoX, Qwen-Image) must agree (forward and the parameters'
gradients); the patched model must compile with fullgraph and not recompile
when the resolution changes; the report must name what was replaced; modules
we do not recognise must be left working; and patch must refuse a compiled or
hooked model. CPU runs the fused ops' reference paths; on a GPU machine the
same tests run the kernels.

The other topics have files of their own: test_diffusers_patch_attention.py
(attention kernels, the diffusers attention backend, 8-bit attention),
test_diffusers_patch_fp8.py (precision="fp8"), test_diffusers_patch_hooks.py
(layerwise casting, offloading hooks, IP-Adapters) and
test_diffusers_patch_export.py (torch.export, AOTInductor, CUDA graphs). The
model builders they share are in diffusers_helpers.py.
"""

import copy
from collections import Counter

import pytest
import tiny_models
import torch
from diffusers_helpers import MODELS, _flux, _pair, _to
from patch_checks import DEVICE, TOL, assert_gradient_close, assert_patched_matches_forward_and_backward

import compile_ops
from compile_ops.integrations import diffusers as integration
from compile_ops.integrations.diffusers import blocks, processors

diffusers = pytest.importorskip("diffusers")


@pytest.mark.parametrize("name", MODELS)
def test_patched_model_matches_the_original_forward_and_backward(name):
    model, patched, inputs, _ = _pair(name)
    torch.manual_seed(1)
    assert_patched_matches_forward_and_backward(model, patched, _to(inputs(8), DEVICE), lambda out: out.sample)


def test_report_names_what_was_replaced_and_what_was_left():
    _, _, _, report = _pair("flux")
    replaced = {(what, detail) for _, what, detail in report.replaced}
    assert ("diffusers AdaLayerNormZero", "compile_ops.AdaLayerNormZero") in replaced
    assert ("diffusers AdaLayerNormContinuous", "compile_ops.AdaLayerNormContinuous") in replaced
    assert ("diffusers FluxAttnProcessor", "compile_ops FluxAttnProcessor") in replaced
    paths = {path for path, _, _ in report.replaced}
    assert {"transformer_blocks.0.attn.norm_q", "single_transformer_blocks.0.norm", "norm_out"} <= paths
    left = {path: why for path, _, why in report.left}
    assert "GELU" in left["transformer_blocks.0.ff.net.0"]
    assert "compile_ops.patch: " in str(report) and "AdaLayerNormZeroSingle" in str(report)


def test_flux_blocks_run_their_seams_and_qk_norms_through_the_fused_ops(monkeypatch):
    model, patched, inputs, report = _pair("flux")
    replaced = {path: detail for path, _, detail in report.replaced}
    assert replaced["transformer_blocks.0"] == "compile_ops FluxTransformerBlock (fused seams)"
    assert replaced["single_transformer_blocks.0"] == "compile_ops FluxSingleTransformerBlock (fused seams)"
    calls = Counter()

    def counting(module, name):
        op = getattr(module, name)
        return lambda *a, **k: calls.update([name]) or op(*a, **k)

    for module, name in (
        (blocks, "gated_residual_norm_modulate"),
        (blocks, "gated_residual"),
        (processors, "qk_norm_rope"),
        (processors, "rope_qk"),
    ):
        monkeypatch.setattr(module, name, counting(module, name))
    args = _to(inputs(4), DEVICE)
    torch.testing.assert_close(patched(**args).sample, model(**args).sample, **TOL)
    # Double block: one seam per stream, a gated MLP residual per stream, one
    # qk_norm_rope per stream; single block: its gated residual and one
    # qk_norm_rope. No separate rope pass.
    assert calls == Counter(gated_residual_norm_modulate=2, gated_residual=3, qk_norm_rope=3)


@pytest.mark.parametrize("name, layers", [("wan", 2), ("ltx", 1)])
def test_norms_over_the_heads_run_with_their_rotation_in_one_op(name, layers, monkeypatch):
    """Wan's and LTX-Video's q/k norms span the heads: with a rotation
    (self-attention) they run inside one ``qk_norm_rope`` per layer; Wan's
    text cross-attention (no rotation) runs its norms as they are."""
    model, patched, inputs, _ = _pair(name)
    calls = Counter()

    def counting(name):
        op = getattr(processors, name)
        return lambda *a, **k: calls.update([name]) or op(*a, **k)

    for op in ("qk_norm_rope", "rope_qk"):
        monkeypatch.setattr(processors, op, counting(op))
    args = _to(inputs(4), DEVICE)
    torch.testing.assert_close(patched(**args).sample, model(**args).sample, **TOL)
    assert calls == Counter(qk_norm_rope=layers)


def test_diffusers_caching_enabled_after_patch_finds_the_fused_blocks():
    hooks = pytest.importorskip("diffusers.hooks")
    model, patched, inputs, _ = _pair("flux")
    for m in (model, patched):  # first-block cache: looks each block's outputs up by its class
        m.enable_cache(hooks.FirstBlockCacheConfig(threshold=0.2))
    torch.manual_seed(3)
    args = _to(inputs(4), DEVICE)
    for _ in range(3):  # the first call fills the cache, the later ones may reuse it
        args["timestep"] = args["timestep"] * 0.99
        with model.cache_context("cond"), patched.cache_context("cond"):
            torch.testing.assert_close(patched(**args).sample, model(**args).sample, **TOL)


def test_a_flux_block_whose_norms_the_fused_forward_does_not_reproduce_keeps_its_forward():
    torch.manual_seed(0)
    model, inputs = _flux()
    model.transformer_blocks[0].norm2 = torch.nn.RMSNorm(32, eps=1e-6)
    reference = copy.deepcopy(model)
    report = compile_ops.patch(model)
    left = {path: why for path, _, why in report.left}
    assert "fused block does not reproduce" in left["transformer_blocks.0"]
    assert type(model.transformer_blocks[0]).__module__.startswith("diffusers")
    assert type(model.transformer_blocks[0].norm1) is compile_ops.AdaLayerNormZero  # still patched inside
    args = inputs(4)
    torch.testing.assert_close(model(**args).sample, reference(**args).sample, **TOL)


def test_an_unknown_module_is_left_working_and_unpatch_restores_the_originals():
    class ScaledRMSNorm(torch.nn.RMSNorm):  # a subclass may compute something else: not ours to replace
        def forward(self, x):
            return 2 * super().forward(x)

    torch.manual_seed(0)
    model, inputs = _flux()
    block = model.transformer_blocks[0]
    block.attn.norm_q = ScaledRMSNorm(16, eps=1e-6)
    originals = dict(model.named_modules())
    reference = copy.deepcopy(model)
    report = compile_ops.patch(model)
    assert "transformer_blocks.0.attn.norm_q" not in {path for path, _, _ in report.replaced}
    assert type(model.transformer_blocks[0].attn.norm_q) is ScaledRMSNorm
    args = inputs(4)
    torch.testing.assert_close(model(**args).sample, reference(**args).sample, **TOL)
    compile_ops.unpatch(model)
    assert all(module is originals[path] for path, module in model.named_modules())
    assert type(block.attn.processor).__module__.startswith("diffusers")


def test_patch_refuses_a_compiled_hooked_or_already_patched_model():
    model, _ = _flux()
    with pytest.raises(RuntimeError, match="already compiled; call compile_ops.patch"):
        compile_ops.patch(torch.compile(model))
    hooked, _ = _flux()
    hooked.enable_cache(diffusers.FirstBlockCacheConfig(threshold=0.1))  # a diffusers hook on the blocks
    with pytest.raises(RuntimeError, match="carries diffusers hooks .*before group offloading"):
        compile_ops.patch(hooked)
    compile_ops.patch(model)
    with pytest.raises(RuntimeError, match="already patched"):
        compile_ops.patch(model)
    with pytest.raises(RuntimeError, match="not patched"):
        compile_ops.unpatch(_flux()[0])
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict"):
        compile_ops.patch({})


def test_patch_takes_its_options_keyword_only_and_names_a_wrong_one():
    """compile_ops.patch's options are PatchOptions' fields, keyword-only and
    with the same defaults; a positional option, an unknown name or a wrong
    value raises before the model changes, naming what is wrong."""
    import dataclasses
    import inspect

    from compile_ops.integrations.options import PatchOptions

    params = inspect.signature(compile_ops.patch).parameters
    fields = dataclasses.fields(PatchOptions)
    assert list(params) == ["model", *(f.name for f in fields)]
    assert all(
        params[f.name].kind is inspect.Parameter.KEYWORD_ONLY and params[f.name].default == f.default for f in fields
    )
    model, _ = _flux()
    before = dict(model.named_modules())
    with pytest.raises(TypeError, match="positional argument"):
        compile_ops.patch(model, True)
    with pytest.raises(TypeError, match="unknown option 'precison'"):
        compile_ops.patch(model, precison="fp8")
    with pytest.raises(ValueError, match="precision must be one of"):
        compile_ops.patch(model, precision="int4")
    with pytest.raises(TypeError, match="attention_processors must be a bool"):
        compile_ops.patch(model, attention_processors=1)
    with pytest.raises(TypeError, match="attention must be one of SlidingTile, Radial, TopK"):
        compile_ops.patch(model, attention="sta")
    assert dict(model.named_modules()) == before and not hasattr(model, "_compile_ops_patch")


# aot_eager (AOT autograd's joint graph through the ops' fakes) for Flux, whose
# processor and fused blocks call the most ops; Dynamo alone (graph breaks,
# guards, the fakes under symbolic shapes) for the others: the joint graph of
# each op (Wan's rope_qk and attention among them) is test_ops_registry's
# compile test already, and Wan's aot_eager run cost 45 s of CPU CI.
@pytest.mark.parametrize(
    "name, sides, backend",
    [("flux", (4, 6), "aot_eager"), ("wan", (8, 12), "eager"), ("sd3", (8, 12), "eager"), ("ltx", (4, 6), "eager")],
)
def test_patched_model_compiles_with_fullgraph_and_no_recompile_across_resolutions(name, sides, backend):
    torch._dynamo.reset()
    _, patched, inputs, _ = _pair(name)
    compiled = torch.compile(patched, fullgraph=True, backend=backend, dynamic=True)
    for i, side in enumerate(sides):
        torch.manual_seed(2)
        args = _to(inputs(side), DEVICE)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            out = compiled(**args).sample
        torch.testing.assert_close(out, patched(**args).sample, **TOL)


def test_processors_hand_uncovered_calls_to_the_original():
    model, patched, inputs, _ = _pair("flux")
    attn = patched.transformer_blocks[0].attn
    assert isinstance(attn.processor, integration.FluxAttnProcessor)
    calls = []
    original = attn.processor.original
    attn.processor.original = lambda *a, **k: calls.append(a) or original(*a, **k)
    x = torch.randn(2, 5, 32, device=DEVICE)
    context = torch.randn(2, 3, 32, device=DEVICE)
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool, device=DEVICE)
    attn(x, context, attention_mask=mask)  # masks are not the fused kernel's: the original runs
    assert len(calls) == 1
    attn(x, context)
    assert len(calls) == 1


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_projections_fused_by_diffusers_run_on_the_fused_path(name):
    """After diffusers' ``fuse_qkv_projections()`` (flux-fast's recipe) the
    processors read ``to_qkv`` / ``to_added_qkv`` / ``to_kv`` as diffusers'
    do: the patched model matches the fused original forward and backward,
    no call goes to the original processor, and the separate Linears, which
    diffusers keeps, are never called."""
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model = model.to(DEVICE)
    model.fuse_qkv_projections()
    patched = copy.deepcopy(model)
    compile_ops.patch(patched)
    for module in patched.modules():
        processor = getattr(module, "processor", None)
        if isinstance(processor, processors.FusedProcessor):
            processor.original = lambda *a, **k: pytest.fail("a call went to the original processor")
            # Cross-attention (Wan's attn2) fuses k and v only: its to_q stays in use.
            unused = ("to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
            unused += () if getattr(module, "is_cross_attention", False) else ("to_q",)
            for linear in (getattr(module, n, None) for n in unused):
                if linear is not None:
                    linear.register_forward_pre_hook(lambda *a: pytest.fail("a separate projection was called"))
    assert any(hasattr(m, "to_qkv") for m in patched.modules())
    torch.manual_seed(1)
    assert_patched_matches_forward_and_backward(model, patched, _to(inputs(8), DEVICE), lambda out: out.sample)


def test_processors_share_diffusers_settings_with_the_original():
    _, patched, _, _ = _pair("flux")
    processor = patched.transformer_blocks[0].attn.processor
    original = processor.original
    assert processor._parallel_config is None
    processor._parallel_config = "a parallel config"  # what enable_parallelism writes
    assert original._parallel_config == "a parallel config"  # the original, which then runs the calls
    assert processor._parallel_config == "a parallel config"
    assert "_parallel_config" not in vars(processor)
    copied = copy.deepcopy(processor)  # __getattr__ must not recurse while copy rebuilds the object
    assert copied.kernel == processor.kernel and copied.original is not original


# ---------------------------------------------------------------- HunyuanVideo, CogVideoX, Qwen-Image


def _hunyuan_video():
    model = tiny_models.hunyuan_video()
    return model, lambda: dict(
        hidden_states=torch.randn(1, 4, 1, 16, 16),
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=torch.randn(1, 12, 16),
        pooled_projections=torch.randn(1, 8),
        encoder_attention_mask=torch.ones(1, 12),
        guidance=torch.tensor([300.0]),
    )


def _cogvideox():
    model = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        time_embed_dim=2,
        text_embed_dim=8,
        num_layers=2,
        sample_width=8,
        sample_height=8,
        sample_frames=8,
        patch_size=2,
        patch_size_t=None,
        temporal_compression_ratio=4,
        max_text_seq_length=8,
    )
    return model, lambda: dict(
        hidden_states=torch.randn(2, 1, 4, 8, 8),
        encoder_hidden_states=torch.randn(2, 8, 8),
        timestep=torch.tensor([100, 700]),
    )


def _qwen_image():
    model = diffusers.QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=16,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )
    return model, lambda: dict(
        hidden_states=torch.randn(1, 16, 16),
        encoder_hidden_states=torch.randn(1, 8, 16),
        encoder_hidden_states_mask=torch.ones(1, 8, dtype=torch.long),
        timestep=torch.tensor([1.0]),
        img_shapes=[(1, 4, 4)],
    )


# name: (build, a kept processor calls diffusers' dispatcher). HunyuanVideo's
# attention runs compile_ops' processor; its token refiner's calls SDPA.
MORE_MODELS = {
    "hunyuan_video": (_hunyuan_video, False),
    "cogvideox": (_cogvideox, False),
    "qwen_image": (_qwen_image, True),
}


@pytest.mark.parametrize("name", MORE_MODELS)
def test_more_dits_patch_to_the_same_forward_and_backward_and_run_the_backend(name):
    """HunyuanVideo, CogVideoX and Qwen-Image (diffusers' own tiny test configs):
    norms and AdaLN modules patched (HunyuanVideo's attention processors too),
    outputs and gradients unchanged; kept processors that call the dispatcher
    run the compile_ops backend there with the same outputs."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    build, dispatches = MORE_MODELS[name]
    torch.manual_seed(0)
    model, inputs = build()
    model = model.to(DEVICE)
    patched = copy.deepcopy(model)
    report = compile_ops.patch(patched)
    assert any("compile_ops.LayerNorm" in d or "compile_ops.RMSNorm" in d for _, _, d in report.replaced), report
    left = [d for _, w, d in report.left if "Processor" in w]
    assert left and any("dispatcher" in d for d in left) == dispatches, left  # the report says which is which
    if name == "hunyuan_video":
        assert sum("HunyuanVideoAttnProcessor" in d for _, _, d in report.replaced) == 2, report
    torch.manual_seed(1)
    args = _to(inputs(), DEVICE)
    want, got = model(**args).sample, patched(**args).sample
    torch.testing.assert_close(got, want, **TOL)
    want.square().mean().backward()
    got.square().mean().backward()
    for (path, p), (_, q) in zip(model.named_parameters(), patched.named_parameters()):
        if p.grad is not None:
            assert_gradient_close(q.grad, p.grad, path)
    if dispatches:
        active = _AttentionBackendRegistry._active_backend
        patched.set_attention_backend("compile_ops")
        try:
            with torch.no_grad():
                torch.testing.assert_close(patched(**args).sample, want.detach(), **TOL)
        finally:
            patched.reset_attention_backend()
            _AttentionBackendRegistry.set_active_backend(active)
