"""A patched diffusers model under hooks, offloading and adapters, and unpatch after them.

diffusers' layerwise casting with training under autocast; accelerate's
offloading (``cpu_offload``, a disk ``device_map``) before or after patch, and
diffusers hooks that hold a module's weights out between its calls, which the
fused seams must honour; FP8 refusing offloaded weights; IP-Adapters loaded
and unloaded on a patched Flux, and ``unpatch`` keeping the adapter. Each is
compared against the unpatched model under the same hooks or adapter.
"""

import copy

import pytest
import torch
from diffusers_helpers import MODELS, _flux, _pair, _relative_l2, _to
from patch_checks import DEVICE, TOL

import compile_ops
from compile_ops.integrations import diffusers as integration

diffusers = pytest.importorskip("diffusers")


# ---------------------------------------------------------------- layerwise casting


@pytest.mark.parametrize("name", ["wan", "ltx"])
@pytest.mark.parametrize("storage", [torch.float8_e4m3fn, torch.float16], ids=["fp8-storage", "fp16-storage"])
def test_layerwise_casting_training_under_autocast_matches_the_unpatched_model(name, storage):
    """diffusers' layerwise casting (weights stored in 8/16 bits, upcast per
    layer to bf16) with training under autocast, as diffusers' own
    test_layerwise_casting_training does: the patched model trains, and its
    output and gradients stay within bf16 rounding of the unpatched model's
    (a wrong cast or dtype would be O(1) away)."""
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model = model.to(DEVICE)
    args = _to(inputs(4), DEVICE)
    results = []
    for patched in (False, True):
        m = copy.deepcopy(model)
        if patched:
            compile_ops.patch(m)
        m.enable_layerwise_casting(storage_dtype=storage, compute_dtype=torch.bfloat16)
        m.train()
        with torch.amp.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
            out = m(**args).sample
        out.float().square().mean().backward()
        results.append((out.float(), m.proj_out.weight.grad.float()))
    (want, want_grad), (got, got_grad) = results
    assert torch.isfinite(got).all() and torch.isfinite(got_grad).all()
    assert _relative_l2(got, want) < 2e-2, _relative_l2(got, want)
    assert _relative_l2(got_grad, want_grad) < 2e-2, _relative_l2(got_grad, want_grad)


# ---------------------------------------------------------------- offloading hooks
#
# Offloading and casting hooks keep a module's own weights off the device (or
# in a storage dtype) except during its call. A fused seam that reads a
# module's weight instead of calling it must see that and call it. Each test
# checks the patched, hooked model against the plain unpatched one: a seam
# that reads a held-out weight gets NaN, meta tensors or CPU tensors.


class _HeldOutWeights(diffusers.hooks.ModelHook):
    """diffusers' leaf-level group offloading in miniature: a module's own
    parameters are NaN except during its call (the hook puts them back in
    ``pre_forward`` and takes them out in ``post_forward``)."""

    def initialize_hook(self, module):
        self.values = {name: p.detach().clone() for name, p in module.named_parameters(recurse=False)}
        self._hold_out(module)
        return module

    def _hold_out(self, module):
        with torch.no_grad():
            for p in module.parameters(recurse=False):
                p.fill_(float("nan"))

    def pre_forward(self, module, *args, **kwargs):
        with torch.no_grad():
            for name, p in module.named_parameters(recurse=False):
                p.copy_(self.values[name])
        return args, kwargs

    def post_forward(self, module, output):
        self._hold_out(module)
        return output


def _hold_out_every_leaf_weight(model):
    for module in model.modules():
        if next(module.parameters(recurse=False), None) is not None:
            registry = diffusers.hooks.HookRegistry.check_if_exists_or_initialize(module)
            registry.register_hook(_HeldOutWeights(), "held_out_weights")


def _offload(model, how, tmp_path):
    """accelerate's two ways: ``cpu_offload`` (a hook on every module that
    holds tensors, weights on the meta device between calls) and
    ``dispatch_model`` with a device map that puts the blocks and the final
    norm on disk, as ``from_pretrained(device_map=..., max_memory=...)`` does
    for a model too large for the GPU (a hook per block, weights loaded by name
    for the call, executed on the main device)."""
    accelerate = pytest.importorskip("accelerate")
    if how == "cpu_offload":
        return accelerate.cpu_offload(model, execution_device=torch.device(DEVICE))
    device_map = {name: DEVICE for name, _ in model.named_parameters(recurse=False)}  # Wan's scale_shift_table
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList):
            device_map.update({f"{name}.{i}": "disk" for i in range(len(child))})
        else:
            device_map[name] = "disk" if name == "norm_out" else DEVICE
    return accelerate.dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path))


OFFLOAD_MODELS = ["flux", "sd3", "wan"]  # seams that read q/k-norm and LayerNorm weights themselves


@pytest.mark.parametrize("name", OFFLOAD_MODELS)
@pytest.mark.parametrize("order", ["patch-then-offload", "offload-then-patch"])
@pytest.mark.parametrize("how", ["cpu_offload", "device_map"])
def test_accelerate_offloading_before_or_after_patch_matches_the_unpatched_model(name, order, how, tmp_path):
    model, patched, inputs, _ = _pair(name)
    args = _to(inputs(4), DEVICE)
    with torch.no_grad():
        want = model(**args).sample
        if order == "patch-then-offload":
            _offload(patched, how, tmp_path)
        else:  # what patching after from_pretrained(device_map=...) meets
            unpatched = copy.deepcopy(model)
            _offload(unpatched, how, tmp_path)
            compile_ops.patch(unpatched)
            patched = unpatched
        assert any(p.device.type == "meta" for p in patched.parameters())  # the weights really are away
        got = patched(**args).sample
        compile_ops.unpatch(patched)  # the offloaded model without compile_ops: as it was
        assert not any(type(m).__module__.startswith("compile_ops") for m in patched.modules())
        restored = patched(**args).sample
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(restored, want, rtol=0, atol=0)


@pytest.mark.parametrize("name", OFFLOAD_MODELS)
def test_diffusers_leaf_hooks_that_hold_weights_out_between_calls_are_honoured(name):
    model, patched, inputs, _ = _pair(name)
    args = _to(inputs(4), DEVICE)
    _hold_out_every_leaf_weight(patched)
    with torch.no_grad():
        want, got = model(**args).sample, patched(**args).sample
    torch.testing.assert_close(got, want, **TOL)


def test_fp8_refuses_weights_an_accelerate_hook_offloads():
    pytest.importorskip("accelerate")
    model, _ = _flux()
    _offload(model, "cpu_offload", None)
    with pytest.raises(RuntimeError, match="precision='fp8' quantizes the weights now"):
        compile_ops.patch(model, precision="fp8")


def test_ada_layer_norm_continuous_calls_its_affine_norm_when_a_hook_holds_the_weight():
    torch.manual_seed(0)
    norm = compile_ops.modules.modulate.AdaLayerNormContinuous(16, 8, elementwise_affine=True).to(DEVICE)
    with torch.no_grad():
        norm.norm.weight.uniform_(0.5, 1.5)
    x, emb = torch.randn(2, 5, 16, device=DEVICE), torch.randn(2, 8, device=DEVICE)
    with torch.no_grad():
        want = norm(x, emb)
        _hold_out_every_leaf_weight(norm)
        got = norm(x, emb)
    torch.testing.assert_close(got, want, **TOL)


# ---------------------------------------------------------------- IP-Adapters


def _flux_ip_adapter_state_dict(model):
    """A random Flux IP-Adapter in the layout diffusers' loader reads (as diffusers'
    own Flux transformer tests build it): k/v projections per double block and
    the image projection."""
    from diffusers.models.embeddings import ImageProjection
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    torch.manual_seed(3)
    hidden = model.config.num_attention_heads * model.config.attention_head_dim
    cross = model.config.joint_attention_dim
    ip = {}
    names = [n for n in model.attn_processors if not n.startswith("single_transformer_blocks")]
    for key_id, _ in enumerate(names):
        sd = FluxIPAdapterAttnProcessor(hidden_size=hidden, cross_attention_dim=cross, scale=1.0).state_dict()
        for kv in ("k", "v"):
            for p in ("weight", "bias"):
                ip[f"{key_id}.to_{kv}_ip.{p}"] = sd[f"to_{kv}_ip.0.{p}"]
    sd = ImageProjection(
        cross_attention_dim=cross, image_embed_dim=model.config.pooled_projection_dim, num_image_text_embeds=4
    ).state_dict()
    proj = {
        "proj.weight": sd["image_embeds.weight"],
        "proj.bias": sd["image_embeds.bias"],
        "norm.weight": sd["norm.weight"],
        "norm.bias": sd["norm.bias"],
    }
    return {"image_proj": proj, "ip_adapter": ip}


def test_ip_adapter_loads_and_unloads_on_a_patched_flux():
    """diffusers rebuilds the processors it keeps by calling their class with no
    arguments (loading an IP-Adapter; unloading it, as the Flux and SD3
    pipelines do): ours then wrap a fresh diffusers processor. With the adapter
    the patched model equals the unpatched one with the same adapter; unloaded,
    it is the patched model again, still fused."""
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    torch.manual_seed(0)
    model, inputs = _flux()
    model = model.to(DEVICE)
    patched = copy.deepcopy(model)
    compile_ops.patch(patched)
    args = _to(inputs(4), DEVICE)
    args["hidden_states"], args["encoder_hidden_states"] = args["hidden_states"][:1], args["encoder_hidden_states"][:1]
    args["pooled_projections"], args["timestep"] = args["pooled_projections"][:1], args["timestep"][:1]
    with torch.no_grad():
        before = patched(**args).sample
    adapter = _flux_ip_adapter_state_dict(model)
    for m in (model, patched):
        m._load_ip_adapter_weights([adapter])
    processors = patched.attn_processors
    assert any(isinstance(p, FluxIPAdapterAttnProcessor) for p in processors.values())
    kept = [p for p in processors.values() if not isinstance(p, FluxIPAdapterAttnProcessor)]
    assert kept and all(isinstance(p, integration.FluxAttnProcessor) for p in kept), kept
    torch.manual_seed(0)
    image_embeds = torch.randn(1, 1, model.config.joint_attention_dim, device=DEVICE)
    with_adapter = dict(args, joint_attention_kwargs={"ip_adapter_image_embeds": image_embeds})
    with torch.no_grad():
        got, want = patched(**with_adapter).sample, model(**with_adapter).sample
    torch.testing.assert_close(got, want, **TOL)
    assert not torch.allclose(got, before, atol=1e-4, rtol=1e-4)  # the adapter acts
    # Unloading, as FluxIPAdapterMixin.unload_ip_adapter rebuilds the processors.
    patched.set_attn_processor(
        {
            name: integration.FluxAttnProcessor() if isinstance(p, FluxIPAdapterAttnProcessor) else p.__class__()
            for name, p in patched.attn_processors.items()
        }
    )
    assert all(isinstance(p, integration.FluxAttnProcessor) for p in patched.attn_processors.values())
    with torch.no_grad():
        torch.testing.assert_close(patched(**args).sample, before, **TOL)


def test_unpatch_after_an_ip_adapter_keeps_the_adapter():
    """``unpatch`` after diffusers replaced processors (loading an IP-Adapter
    rebuilds them all) gives the unpatched model with the same adapter: the
    adapter's processors stay, ours go back to diffusers' own, and the
    blocks and norms are the originals again."""
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    torch.manual_seed(0)
    model, inputs = _flux()
    model = model.to(DEVICE)
    patched = copy.deepcopy(model)
    compile_ops.patch(patched)
    adapter = _flux_ip_adapter_state_dict(model)
    for m in (model, patched):
        m._load_ip_adapter_weights([adapter])
    compile_ops.unpatch(patched)
    assert not any(type(m).__module__.startswith("compile_ops") for m in patched.modules())
    kinds = {name: type(p) for name, p in patched.attn_processors.items()}
    assert kinds == {name: type(p) for name, p in model.attn_processors.items()}, kinds
    assert any(k is FluxIPAdapterAttnProcessor for k in kinds.values())
    args = _to(inputs(4), DEVICE)
    args["hidden_states"], args["encoder_hidden_states"] = args["hidden_states"][:1], args["encoder_hidden_states"][:1]
    args["pooled_projections"], args["timestep"] = args["pooled_projections"][:1], args["timestep"][:1]
    torch.manual_seed(0)
    image_embeds = torch.randn(1, 1, model.config.joint_attention_dim, device=DEVICE)
    args["joint_attention_kwargs"] = {"ip_adapter_image_embeds": image_embeds}
    with torch.no_grad():
        torch.testing.assert_close(patched(**args).sample, model(**args).sample, rtol=0, atol=0)
