"""compile_ops.patch on Hugging Face transformers models (Llama, Qwen2) built from
tiny random configs (transformers is a test extra; the module skips without it).

Patched and unpatched copies must agree (fp32: forward and every parameter's
gradient; bf16: error against an fp64 copy within the tolerance policy's
factors of the unpatched model's own error); the fused ops must be the ones
that ran; the patched model must compile with fullgraph and not recompile
across sequence lengths; state dict keys, ``.to()``, ``isinstance`` and the
KV cache must work as before; the report must name what was replaced and left.
"""

import copy
from collections import Counter

import pytest
import torch
import torch._dynamo.testing  # not imported by "import torch": a test run alone would not find it
from patch_checks import DEVICE, TOL, assert_patched_matches_forward_and_backward

import compile_ops
from compile_ops.integrations import transformers as integration
from compile_ops.modules import norm as norm_modules

transformers = pytest.importorskip("transformers")

LAYERS = 2
VOCAB = 64


def _config(name, **overrides):
    # GQA (4 query heads, 2 key/value heads), head dim 8; Qwen2's q/k/v biases.
    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_cls, model_cls = classes[name]
    return model_cls, config_cls(**{**sizes, **overrides})


def _model(name, **overrides):
    torch.manual_seed(0)
    model_cls, config = _config(name, **overrides)
    model = model_cls(config)
    with torch.no_grad():  # norms initialize to ones, which would hide a weight applied wrongly
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.to(DEVICE)


def _pair(name, **overrides):
    model = _model(name, **overrides)
    patched = copy.deepcopy(model)
    report = compile_ops.patch(patched)
    return model, patched, report


def _inputs(length, batch=2):
    ids = torch.randint(0, VOCAB, (batch, length), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding on one row: the mask path of the attention interface
    return dict(input_ids=ids, attention_mask=mask, use_cache=False)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_patched_model_matches_the_original_forward_and_backward(name):
    model, patched, _ = _pair(name)
    torch.manual_seed(1)
    assert_patched_matches_forward_and_backward(model, patched, _inputs(9), lambda out: out.logits)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_bf16_patched_model_is_within_the_tolerance_policy_of_the_unpatched_one(name):
    """bf16 against an fp64 copy of the same weights: the patched model's error at
    most 2x the unpatched model's own (3x for gradients), as relative L2 norms
    (the fused ops round once where transformers rounds after every step)."""
    model = _model(name)
    exact = copy.deepcopy(model).double()
    model = model.to(torch.bfloat16)
    patched = copy.deepcopy(model)
    compile_ops.patch(patched)
    torch.manual_seed(1)
    args = _inputs(9)

    def run(m):
        """(logits, the embedding's gradient), in fp64."""
        m.zero_grad()
        logits = m(**args).logits
        logits.double().square().mean().backward()
        return logits.double(), m.model.embed_tokens.weight.grad.double()

    exact_results, patched_results, unpatched_results = run(exact), run(patched), run(model)
    for what, want, got, base, factor in zip(
        ("logits", "embedding gradient"), exact_results, patched_results, unpatched_results, (2, 3)
    ):
        err, base_err = ((t - want).norm() / want.norm() for t in (got, base))
        assert err <= factor * base_err + 1e-3, f"{name} {what}: {err:.2e} against the unpatched {base_err:.2e}"


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_norms_mlps_and_rotary_run_the_fused_ops(name, monkeypatch):
    model, patched, _ = _pair(name)
    calls = Counter()

    def counting(module, attr):
        op = getattr(module, attr)
        return lambda *a, **k: calls.update([attr]) or op(*a, **k)

    monkeypatch.setattr(integration, "rope_qk", counting(integration, "rope_qk"))
    monkeypatch.setattr(integration, "swiglu", counting(integration, "swiglu"))
    monkeypatch.setattr(norm_modules, "rmsnorm", counting(norm_modules, "rmsnorm"))
    args = _inputs(5)
    torch.testing.assert_close(patched(**args).logits, model(**args).logits, **TOL)
    # Two norms per layer and the final one; one MLP and one q/k rotation per layer.
    assert calls == Counter(rmsnorm=2 * LAYERS + 1, swiglu=LAYERS, rope_qk=LAYERS), calls


def test_report_names_what_was_replaced_and_what_was_left():
    _, _, report = _pair("llama")
    replaced = {path: (what, detail) for path, what, detail in report.replaced}
    assert replaced["model.layers.0.input_layernorm"] == ("transformers LlamaRMSNorm", "compile_ops RMSNorm")
    assert replaced["model.norm"] == ("transformers LlamaRMSNorm", "compile_ops RMSNorm")
    assert replaced["model.layers.1.mlp"] == ("transformers LlamaMLP", "compile_ops SwiGLUMLP")
    assert replaced["model.layers.1.self_attn"] == ("transformers LlamaAttention", "compile_ops FusedLlamaAttention")
    assert len(report.replaced) == 4 * LAYERS + 1  # two norms, the MLP and attention per layer; the final norm
    left = {path: why for path, _, why in report.left}
    assert set(left) == {"model.rotary_emb"} and "cos/sin tables" in left["model.rotary_emb"]
    assert "compile_ops.patch: 9 replaced, 1 left" in str(report)

    _, patched, report = _pair("qwen2")
    assert {what for _, what, _ in report.replaced} == {
        "transformers Qwen2RMSNorm",
        "transformers Qwen2MLP",
        "transformers Qwen2Attention",
    }

    model = _model("llama")
    report = compile_ops.patch(model, attention_processors=False)
    left = {path: why for path, _, why in report.left}
    assert "attention_processors=False" in left["model.layers.0.self_attn"]
    assert type(model.model.layers[0].self_attn) is transformers.models.llama.modeling_llama.LlamaAttention


def test_other_families_are_left_working_and_reported():
    model = _model("mistral")
    patched = copy.deepcopy(model)
    report = compile_ops.patch(patched)
    assert report.replaced == []
    left = {path: what for path, what, _ in report.left}
    assert left["model.layers.0.self_attn"] == "MistralAttention" and left["model.norm"] == "MistralRMSNorm"
    args = _inputs(5)
    torch.testing.assert_close(patched(**args).logits, model(**args).logits, **TOL)


def test_patched_model_keeps_its_state_dict_classes_and_unpatches():
    model, patched, _ = _pair("llama")
    assert list(patched.state_dict()) == list(model.state_dict())
    patched.load_state_dict(model.state_dict())  # strict: same keys, same shapes
    attn = patched.model.layers[0].self_attn
    # transformers records attentions by class (output_attentions): still an instance of it
    assert isinstance(attn, transformers.models.llama.modeling_llama.LlamaAttention)
    patched.config._attn_implementation = "eager"
    out = patched(**_inputs(5), output_attentions=True)
    assert len(out.attentions) == LAYERS and out.attentions[0].shape == (2, 4, 5, 5)

    doubled = copy.deepcopy(patched).to(torch.float64)
    assert doubled.model.layers[0].mlp.up_proj.weight.dtype == torch.float64
    assert type(doubled.model.layers[0].mlp) is integration.SwiGLUMLP

    with pytest.raises(RuntimeError, match="already patched"):
        compile_ops.patch(patched)
    with pytest.raises(ValueError, match="precision apply to diffusers models"):
        compile_ops.patch(_model("llama"), precision="fp8")
    with pytest.raises(RuntimeError, match="already compiled"):
        compile_ops.patch(torch.compile(_model("llama")))

    before = dict(model.named_modules())
    compile_ops.patch(model)
    assert model.model.layers[0].self_attn.q_proj is before["model.layers.0.self_attn.q_proj"]  # shared Linears
    compile_ops.unpatch(model)
    assert all(module is before[path] for path, module in model.named_modules())


def test_greedy_generation_with_the_kv_cache_matches():
    """Decoding steps of one token at growing positions: the rotary tables of a
    single position, and the cache fed the fused rotation's keys."""
    model, patched, _ = _pair("qwen2")
    prompt = torch.randint(0, VOCAB, (2, 6), device=DEVICE)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = model.generate(prompt, **options)
    assert torch.equal(patched.generate(prompt, **options), want)


# aot_eager (AOT autograd's joint graph through the ops' fakes) for Llama;
# Dynamo alone for Qwen2, whose forward differs in the interface's
# sliding-window argument only (aot_eager of each costs ~15 s on CPU CI).
@pytest.mark.parametrize("name, backend", [("llama", "aot_eager"), ("qwen2", "eager")])
def test_patched_model_compiles_with_fullgraph_and_no_recompile_across_lengths(name, backend):
    torch._dynamo.reset()
    _, patched, _ = _pair(name)
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(patched, fullgraph=True, backend=counter, dynamic=True)
    for i, length in enumerate((7, 12)):
        torch.manual_seed(2)
        args = _inputs(length)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            out = compiled(**args).logits
        if i == 0:
            frames = counter.frame_count  # transformers' model makes one empty frame too, patched or not
            traced = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
            assert {"fused.rmsnorm", "fused.rope_qk", "fused.swiglu"} <= traced
        if backend == "aot_eager":
            out.float().square().mean().backward()
        torch.testing.assert_close(out, patched(**args).logits, **TOL)
    assert counter.frame_count == frames, f"{counter.frame_count - frames} recompiles for a second length"
