"""compile_ops.patch with peft LoRA adapters (skipped without peft).

A LoRA loaded before ``patch`` and one added after it must both give the
unpatched model's outputs and adapter gradients with the same LoRA: on the
attention, MLP and AdaLN modulation Linears of small Flux and Wan models,
on diffusers' GEGLU/SwiGLU projections, and on a transformers Llama. The
AdaLN and GLU modules stay fused with a LoRA (or DoRA) on their Linear;
``unpatch`` keeps every adapter added, switched or unloaded since; a tuner
that keeps a module unfused is named in the report. CPU runs the fused ops'
reference paths; on a GPU machine the same tests run the kernels.
"""

import copy

import pytest
import torch
from patch_checks import DEVICE, TOL, assert_gradient_close

import compile_ops

peft = pytest.importorskip("peft")
diffusers = pytest.importorskip("diffusers")

from diffusers_helpers import _flux, _to, _wan  # noqa: E402 (after the skips)

#: Attention, MLP and AdaLN modulation Linears of the small Flux (double- and
#: single-stream blocks, the final norm) and Wan (its modulation is the time
#: projection) models.
TARGETS = {
    "flux": [
        "to_q",
        "to_v",
        "to_out.0",
        "add_k_proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "proj_mlp",
        "proj_out",
        "norm1.linear",
        "norm1_context.linear",
        "norm.linear",
        "norm_out.linear",
    ],
    "wan": ["to_q", "to_k", "to_out.0", "ffn.net.0.proj", "ffn.net.2", "time_proj", "proj_out"],
}
#: The fused AdaLN modules a LoRA must not keep from being replaced.
ADALN = {
    "flux": {
        "transformer_blocks.0.norm1",
        "transformer_blocks.0.norm1_context",
        "single_transformer_blocks.0.norm",
        "norm_out",
    },
    "wan": set(),
}
BUILDERS = {"flux": _flux, "wan": _wan}


def _lora(name, **options):
    """A LoRA on every :data:`TARGETS` Linear of ``name``, with random A and B
    (``init_lora_weights=False``: a zero B would hide a lost adapter)."""
    options = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS[name], **options}
    return peft.LoraConfig(init_lora_weights=False, **options)


def _model(name):
    torch.manual_seed(0)
    model, inputs = BUILDERS[name]()
    return model.to(DEVICE), lambda: _to(inputs(4), DEVICE)


def _add(model, config, adapter="default", seed=7):
    """``config``'s adapter on ``model``, with weights drawn from ``seed``:
    the same on every model it is added to."""
    torch.manual_seed(seed)
    model.add_adapter(copy.deepcopy(config), adapter_name=adapter)


def _assert_same_forward_and_adapter_gradients(model, patched, args):
    """``patched``'s output equals ``model``'s within TOL, and so do the
    gradients of their trainable parameters (the adapters), which must exist
    unless the adapters are disabled."""
    want, got = model(**args).sample, patched(**args).sample
    torch.testing.assert_close(got, want, **TOL)
    assert got.requires_grad == want.requires_grad
    if not want.requires_grad:  # adapters disabled: nothing to train
        return
    weights = torch.randn_like(want)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    grads = {path: p.grad for path, p in model.named_parameters() if p.requires_grad}
    assert grads and all(".lora_" in path for path in grads), sorted(grads)
    trained = {path: p.grad for path, p in patched.named_parameters() if p.requires_grad}
    assert trained.keys() == grads.keys()
    for path, grad in trained.items():
        if grads[path] is None:  # an adapter switched off
            assert grad is None, path
        else:
            assert_gradient_close(grad, grads[path], path)
    for m in (model, patched):
        m.zero_grad(set_to_none=True)


def _lora_layers(model) -> set:
    return {path for path, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}


def _assert_unpatched(model, reference, args):
    """No compile_ops module is left, the LoRA layers are ``reference``'s and
    the output is exactly ``reference``'s (the same diffusers modules run)."""
    assert not any(type(m).__module__.startswith("compile_ops") for m in model.modules())
    assert _lora_layers(model) == _lora_layers(reference)
    with torch.no_grad():
        torch.testing.assert_close(model(**args).sample, reference(**args).sample, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_lora_loaded_before_patch_stays_fused_and_matches_forward_and_backward(name):
    model, inputs = _model(name)
    _add(model, _lora(name))
    patched = copy.deepcopy(model)
    report = compile_ops.patch(patched)
    replaced = {path for path, _, _ in report.replaced}
    assert ADALN[name] <= replaced, str(report)
    assert not any("LoRA" in detail for _, _, detail in report.left), str(report)
    _assert_same_forward_and_adapter_gradients(model, patched, inputs())
    compile_ops.unpatch(patched)
    _assert_unpatched(patched, model, inputs())


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_lora_added_after_patch_matches_and_unpatch_keeps_it(name):
    """The LoRA peft puts on a patched model's AdaLN Linears (held by our
    modules) and the Linears of the fused blocks (Flux's proj_mlp/proj_out)
    goes back with the originals."""
    model, inputs = _model(name)
    patched = copy.deepcopy(model)
    compile_ops.patch(patched)
    for m in (model, patched):
        _add(m, _lora(name))
    _assert_same_forward_and_adapter_gradients(model, patched, inputs())
    compile_ops.unpatch(patched)
    _assert_unpatched(patched, model, inputs())
    if name == "flux":
        assert isinstance(patched.transformer_blocks[0].norm1.linear, peft.tuners.lora.Linear)
        assert isinstance(patched.single_transformer_blocks[0].proj_mlp, peft.tuners.lora.Linear)


def test_set_adapters_disable_and_enable_act_alike_patched_and_after_unpatch():
    """One adapter loaded before patch, one after (on Linears of their own and
    on one they share): weighting, switching and disabling them acts on the
    patched model as on the unpatched one, and unpatch keeps the adapters and
    the state they were left in."""
    model, inputs = _model("flux")
    _add(model, _lora("flux", target_modules=["to_q", "to_v", "ff.net.2", "norm1.linear"]), "before")
    patched = copy.deepcopy(model)
    compile_ops.patch(patched)
    after = _lora("flux", target_modules=["norm1.linear", "norm1_context.linear", "norm.linear", "proj_mlp", "to_k"])
    _add(model, after, "after", seed=8)
    _add(patched, after, "after", seed=8)
    plain = _model("flux")[0]
    steps = [
        (lambda m: m.set_adapters(["before", "after"], weights=[1.0, 0.5]), None),
        (lambda m: m.set_adapters("after"), None),
        (lambda m: m.disable_lora(), plain),
        (lambda m: m.enable_lora(), None),
    ]
    args = inputs()
    for step, same_as in steps:
        for m in (model, patched):
            step(m)
        _assert_same_forward_and_adapter_gradients(model, patched, args)
        if same_as is not None:
            with torch.no_grad():
                torch.testing.assert_close(patched(**args).sample, same_as(**args).sample, **TOL)
    model.set_adapters("before", weights=0.7)
    patched.set_adapters("before", weights=0.7)
    patched.disable_lora()
    compile_ops.unpatch(patched)
    model.disable_lora()
    _assert_unpatched(patched, model, args)
    for m in (model, patched):
        m.enable_lora()
    _assert_unpatched(patched, model, args)


def test_lora_unloaded_after_patch_stays_unloaded_after_unpatch():
    model, inputs = _model("flux")
    _add(model, _lora("flux"))
    plain = copy.deepcopy(model)
    plain.unload_lora()
    compile_ops.patch(model)
    model.unload_lora()
    assert not _lora_layers(model)
    compile_ops.unpatch(model)
    _assert_unpatched(model, plain, inputs())


def test_load_lora_adapter_on_a_patched_flux_matches_the_unpatched_one():
    """A LoRA state dict (diffusers' ``load_lora_adapter``) loaded into a
    patched Flux and into the unpatched one, and kept by ``unpatch``."""
    model, inputs = _model("flux")
    source = copy.deepcopy(model)
    _add(source, _lora("flux", lora_alpha=4))  # a state dict without alphas loads as alpha = rank
    state = {f"transformer.{key}": value for key, value in peft.get_peft_model_state_dict(source).items()}
    patched = copy.deepcopy(model)
    compile_ops.patch(patched)
    for m in (model, patched):
        m.load_lora_adapter(state, prefix="transformer", adapter_name="loaded")
        for path, p in m.named_parameters():  # diffusers loads for inference; train the adapter here
            p.requires_grad_(".lora_" in path)
    args = inputs()
    _assert_same_forward_and_adapter_gradients(model, patched, args)
    with torch.no_grad():
        torch.testing.assert_close(model(**args).sample, source(**args).sample, rtol=0, atol=0)
    compile_ops.unpatch(patched)
    _assert_unpatched(patched, model, args)


def test_dora_on_the_adaln_linears_is_fused_and_exact():
    model, inputs = _model("flux")
    _add(model, _lora("flux", use_dora=True))
    patched = copy.deepcopy(model)
    report = compile_ops.patch(patched)
    assert ADALN["flux"] <= {path for path, _, _ in report.replaced}, str(report)
    _assert_same_forward_and_adapter_gradients(model, patched, inputs())


def test_a_tuner_layer_that_keeps_a_module_unfused_is_named_in_the_report():
    """peft's LN tuning on a norm whose weight the fused module or block reads
    itself (Flux's final AdaLN norm, given an affine; Wan's cross-attention
    norm): those stay unfused, the report names the tuner, and the outputs,
    unpatched and patched, are the same."""
    flux, flux_inputs = _model("flux")
    flux.norm_out.norm = torch.nn.LayerNorm(flux.norm_out.norm.normalized_shape, eps=1e-6, device=DEVICE)
    wan, wan_inputs = _model("wan")
    for model, target, inputs, path, what in (
        (flux, "norm_out.norm", flux_inputs, "norm_out", "diffusers AdaLayerNormContinuous"),
        (wan, "blocks.0.norm2", wan_inputs, "blocks.0", "diffusers WanTransformerBlock"),
    ):
        torch.manual_seed(5)
        peft.inject_adapter_in_model(peft.LNTuningConfig(target_modules=[target]), model)
        patched = copy.deepcopy(model)
        report = compile_ops.patch(patched)
        left = {p: (w, detail) for p, w, detail in report.left}
        assert left[path][0] == what
        assert left[path][1].startswith(f"a peft LNTuningLayer on {target}"), str(report)
        args = inputs()
        torch.testing.assert_close(patched(**args).sample, model(**args).sample, **TOL)
        compile_ops.unpatch(patched)
        _assert_unpatched(patched, model, args)


@pytest.mark.parametrize("activation", ["geglu", "swiglu"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_glu_projection_with_a_lora_is_fused(activation, when):
    """diffusers' GEGLU/SwiGLU (in a FeedForward) with a LoRA on the
    projection our module calls, loaded before or added after patch."""
    torch.manual_seed(0)
    model = diffusers.models.attention.FeedForward(16, dim_out=16, mult=2, activation_fn=activation).to(DEVICE)
    config = peft.LoraConfig(r=4, init_lora_weights=False, target_modules=["net.0.proj", "net.2"])

    def add(m):
        torch.manual_seed(7)
        peft.inject_adapter_in_model(copy.deepcopy(config), m)

    if when == "before":
        add(model)
    patched = copy.deepcopy(model)
    report = compile_ops.patch(patched)
    assert [path for path, _, _ in report.replaced] == ["net.0"], str(report)
    if when == "after":
        add(model)
        add(patched)
    x = torch.randn(2, 5, 16, device=DEVICE)
    want, got = model(x), patched(x)
    torch.testing.assert_close(got, want, **TOL)
    want.square().sum().backward()
    got.square().sum().backward()
    grads = dict(model.named_parameters())
    for path, p in patched.named_parameters():
        if p.requires_grad:
            assert_gradient_close(p.grad, grads[path].grad, path)
    compile_ops.unpatch(patched)
    assert isinstance(patched.net[0].proj, peft.tuners.lora.Linear)
    with torch.no_grad():
        torch.testing.assert_close(patched(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("when", ["before", "after"])
def test_llama_with_a_lora_on_attention_and_mlp_matches_and_unpatch_keeps_it(when):
    """The transformers integration shares adopt and unpatch: a LoRA on the
    attention and SwiGLU MLP Linears, loaded before or added after patch."""
    from test_transformers_patch import _inputs
    from test_transformers_patch import _model as llama

    model = llama("llama")
    config = peft.LoraConfig(
        r=4, init_lora_weights=False, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]
    )

    def add(m):
        torch.manual_seed(7)
        peft.inject_adapter_in_model(copy.deepcopy(config), m)

    if when == "before":
        add(model)
    patched = copy.deepcopy(model)
    report = compile_ops.patch(patched)
    assert {"model.layers.0.mlp", "model.layers.0.self_attn"} <= {path for path, _, _ in report.replaced}, str(report)
    if when == "after":
        add(model)
        add(patched)
    torch.manual_seed(1)
    args = _inputs(9)
    want, got = model(**args).logits, patched(**args).logits
    torch.testing.assert_close(got, want, **TOL)
    weights = torch.randn_like(want)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    grads = {path: p.grad for path, p in model.named_parameters() if p.requires_grad}
    assert grads and all(".lora_" in path for path in grads)
    for path, p in patched.named_parameters():
        if p.requires_grad:
            assert_gradient_close(p.grad, grads[path], path)
    compile_ops.unpatch(patched)
    assert isinstance(patched.model.layers[0].mlp.gate_proj, peft.tuners.lora.Linear)
    assert isinstance(patched.model.layers[0].self_attn.q_proj, peft.tuners.lora.Linear)
    with torch.no_grad():
        torch.testing.assert_close(patched(**args).logits, model(**args).logits, rtol=0, atol=0)
