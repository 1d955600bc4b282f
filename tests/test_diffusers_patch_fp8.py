"""compile_ops.patch(precision="fp8") on diffusers transformers.

Each FP8-patched model must equal the same quantization restated in plain
PyTorch (diffusers_helpers._SimulatedFP8Linear) to well within what FP8 moves
the output; the report lists every Linear and why it was or was not quantized;
``fp8_modulation`` quantizes the AdaLN projections too; the model refuses a
gradient and compiles with fullgraph without recompiling across resolutions;
and the fused seams hand FP8 rows to the Linears after them (each activation
quantized once, in the pass that computes it). CPU runs the FP8 reference
path; on a GPU machine the same tests run the kernels and FP8 GEMMs.
"""

import copy
from collections import Counter

import pytest
import torch
from diffusers_helpers import FP8_MODELS, _relative_l2, _SimulatedFP8Linear, _to, _wan
from patch_checks import DEVICE, TOL

import compile_ops
from compile_ops.integrations.diffusers import blocks

pytest.importorskip("diffusers")


def _fp8_pair(name, fuse_projections=False, **options):
    torch.manual_seed(0)
    model, inputs = FP8_MODELS[name]()
    model = model.to(DEVICE).eval()
    if fuse_projections:
        model.fuse_qkv_projections()  # diffusers' own, before patch (flux-fast's order)
    patched = copy.deepcopy(model)
    report = compile_ops.patch(patched, precision="fp8", **options)
    simulated = copy.deepcopy(model)
    for path, _, detail in report.replaced:
        if "FP8Linear" in detail:
            owner, _, leaf = path.rpartition(".")
            parent = simulated.get_submodule(owner)
            setattr(parent, leaf, _SimulatedFP8Linear(getattr(parent, leaf)))
    return model, patched, simulated, inputs, report


@pytest.mark.parametrize("name", FP8_MODELS)
def test_fp8_patched_model_matches_the_same_quantization_in_plain_pytorch(name):
    model, patched, simulated, inputs, report = _fp8_pair(name)
    fp8 = [path for path, _, detail in report.replaced if "FP8Linear" in detail]
    assert len(fp8) >= 6, report  # the blocks' projections and MLPs were quantized
    torch.manual_seed(1)
    args = _to(inputs(8), DEVICE)
    with torch.no_grad():
        exact, want, got = (m(**args).sample for m in (model, simulated, patched))
    to_exact, to_simulation = _relative_l2(want, exact), _relative_l2(got, want)
    print(
        f"{name}: FP8 vs the unquantized model {to_exact:.2e}; patched vs same-quantization reference "
        f"{to_simulation:.2e}"
    )
    # The quantization moved the output (the test sees FP8 at all) ...
    assert to_exact > 1e-3
    # ... and the patched model applies the same quantization: what is left is
    # the fused ops' fp32 rounding, flipping an e4m3 rounding here and there.
    assert to_simulation < to_exact / 20, (to_simulation, to_exact)


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_fp8_projections_fused_by_diffusers_take_the_norms_fp8_rows(name, monkeypatch):
    """``fuse_qkv_projections()`` then ``patch(precision="fp8")``: ``to_qkv``
    (and Flux's ``to_added_qkv``, Wan's cross-attention ``to_kv``) are FP8
    Linears that read the rows the unfused model's projections read (the
    same quantize passes, by shape: the AdaLN norms' FP8 rows where those
    feed q/k/v), and the model equals the same quantization in plain PyTorch."""
    from compile_ops.ops import fp8 as fp8_ops

    passes = Counter()
    real = fp8_ops._quantize_fp8_rows
    monkeypatch.setattr(
        fp8_ops, "_quantize_fp8_rows", lambda x, *a, **k: passes.update([tuple(x.shape)]) or real(x, *a, **k)
    )
    counts = {}
    for fuse in (False, True):
        model, patched, simulated, inputs, report = _fp8_pair(name, fuse_projections=fuse)
        torch.manual_seed(1)
        args = _to(inputs(8), DEVICE)
        with torch.no_grad():
            exact, want = (m(**args).sample for m in (model, simulated))
            passes.clear()
            got = patched(**args).sample
        counts[fuse] = dict(passes)
        to_exact, to_simulation = _relative_l2(want, exact), _relative_l2(got, want)
        assert to_exact > 1e-3
        assert to_simulation < to_exact / 20, (fuse, to_simulation, to_exact)
    fused = {path for path, _, detail in report.replaced if "FP8Linear" in detail and path.endswith(("qkv", "to_kv"))}
    want_fused = (
        {"blocks.0.attn1.to_qkv", "blocks.0.attn2.to_kv"}
        if name == "wan"
        else {
            "transformer_blocks.0.attn.to_qkv",
            "transformer_blocks.0.attn.to_added_qkv",
            "single_transformer_blocks.0.attn.to_qkv",
        }
    )
    assert want_fused <= fused, fused
    assert counts[True] == counts[False], counts


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_fuse_qkv_projections_after_fp8_patch_equals_fusing_before(name):
    """``patch(precision="fp8")`` then ``fuse_qkv_projections()``: the fused
    Linears are FP8Linears holding the bytes that fusing first and then
    patching quantizes to, the model gives the same output without calling a
    separate projection, and ``unfuse_qkv_projections()`` gives back the
    unfused FP8 model's output. A layer whose projections are FP8 only in part
    refuses to fuse, naming them."""
    model, fused_first, _, inputs, _ = _fp8_pair(name, fuse_projections=True)
    _, patched_first, _, _, _ = _fp8_pair(name)
    fused_after = copy.deepcopy(patched_first)
    fused_after.fuse_qkv_projections()
    made = 0
    for path, module in fused_first.named_modules():
        if not path.endswith(("to_qkv", "to_kv", "to_added_qkv")):
            continue
        ours = fused_after.get_submodule(path)
        assert type(ours) is compile_ops.FP8Linear, (path, type(ours))
        assert torch.equal(ours.weight_q.view(torch.uint8), module.weight_q.view(torch.uint8)), path
        assert torch.equal(ours.weight_scale, module.weight_scale) and torch.equal(ours.bias, module.bias), path
        owner = fused_after.get_submodule(path.rpartition(".")[0])
        unused = ("to_q", "to_k", "to_v") if path.endswith("to_qkv") else ("to_k", "to_v")
        unused = ("add_q_proj", "add_k_proj", "add_v_proj") if path.endswith("to_added_qkv") else unused
        for separate in unused:
            getattr(owner, separate).register_forward_pre_hook(lambda *a: pytest.fail("a separate projection ran"))
        made += 1
    assert made >= (3 if name == "flux" else 2), made  # each block kind fused something
    torch.manual_seed(1)
    args = _to(inputs(8), DEVICE)
    with torch.no_grad():
        want, got = fused_first(**args).sample, fused_after(**args).sample
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        unfused = copy.deepcopy(fused_after)
        for module in unfused.modules():
            module._forward_pre_hooks.clear()
        unfused.unfuse_qkv_projections()
        torch.testing.assert_close(unfused(**args).sample, patched_first(**args).sample, rtol=0, atol=0)
    layer = "blocks.0.attn1" if name == "wan" else "transformer_blocks.0.attn"
    attn = copy.deepcopy(patched_first).get_submodule(layer)
    attn.to_k = torch.nn.Linear(attn.to_k.in_features, attn.to_k.out_features, device=DEVICE)
    with pytest.raises(ValueError, match=r"to_q, to_v.* run in FP8 and to_k do not"):
        attn.fuse_projections()
    assert not hasattr(attn, "to_qkv") and not getattr(attn, "fused_projections", False)


def test_fp8_fusion_takes_the_base_projection_under_a_lora_as_diffusers_does():
    """A LoRA on ``to_q`` added after the FP8 patch: fusing concatenates the
    base FP8Linear's codes (diffusers reads a LoRA layer's base weight too) and
    the adapter stays on the separate ``to_q``."""
    peft = pytest.importorskip("peft")
    from compile_ops.integrations.peft import FP8LoraLinear
    from compile_ops.modules.fp8 import fp8_base

    _, patched, _, _, _ = _fp8_pair("flux")
    patched.add_adapter(peft.LoraConfig(r=4, target_modules=["to_q"]), adapter_name="a")
    attn = patched.transformer_blocks[0].attn
    assert isinstance(attn.to_q, FP8LoraLinear)
    base = fp8_base(attn.to_q)
    attn.fuse_projections()
    rows = base.out_features
    assert torch.equal(attn.to_qkv.weight_q[:rows].view(torch.uint8), base.weight_q.view(torch.uint8))
    assert torch.equal(attn.to_qkv.weight_scale[:rows], base.weight_scale)
    assert isinstance(attn.to_q, FP8LoraLinear) and fp8_base(attn.to_q) is base


def test_fp8_fusion_refuses_a_fused_linear_it_cannot_build_and_leaves_the_layer_unfused():
    """A ``fuse_projections`` that makes a Linear compile_ops does not know how
    to build from FP8 projections (a later diffusers', here a stand-in) is
    refused, naming it, and the layer is left unfused, without meta Linears."""
    from compile_ops.integrations.diffusers.fp8_linears import fuse_fp8_projections

    _, patched, _, _, _ = _fp8_pair("flux")
    attn = patched.transformer_blocks[0].attn

    def fuses_something_else(layer):
        with torch.device("meta"):
            layer.to_qk = torch.nn.Linear(layer.to_q.in_features, 2 * layer.to_q.out_features)
        layer.fused_projections = True

    with pytest.raises(ValueError, match=r"made to_qk \(Linear\), which compile_ops cannot build"):
        fuse_fp8_projections(attn, fuses_something_else)
    assert not hasattr(attn, "to_qk") and not attn.fused_projections
    assert type(attn.to_q) is compile_ops.FP8Linear and attn.to_q.weight_q.device.type != "meta"


def test_fp8_modulation_quantizes_the_adaln_projections_too():
    """patch(fp8_modulation=True): the blocks' AdaLN modulation projections
    (one row per sample) are FP8 Linears as well, the model still equals the
    same quantization in plain PyTorch, and its weights shrink further;
    without precision='fp8' the option is refused."""
    model, patched, simulated, inputs, report = _fp8_pair("flux", fp8_modulation=True)
    rows = {path: detail for path, _, detail in report.replaced + report.left}
    for path in (
        "transformer_blocks.0.norm1.linear",
        "transformer_blocks.0.norm1_context.linear",
        "single_transformer_blocks.0.norm.linear",
    ):
        assert "FP8Linear" in rows[path], (path, rows[path])
    assert "outside the transformer blocks" in rows["norm_out.linear"]  # the final layer stays
    torch.manual_seed(1)
    args = _to(inputs(8), DEVICE)
    with torch.no_grad():
        exact, want, got = (m(**args).sample for m in (model, simulated, patched))
    assert _relative_l2(got, want) < _relative_l2(want, exact) / 20
    _, default, *_ = _fp8_pair("flux")
    assert sum(b.numel() * b.element_size() for b in patched.buffers()) + sum(
        p.numel() * p.element_size() for p in patched.parameters()
    ) < sum(t.numel() * t.element_size() for t in (*default.buffers(), *default.parameters()))
    with pytest.raises(ValueError, match="fp8_modulation applies to precision='fp8'"):
        compile_ops.patch(copy.deepcopy(model), fp8_modulation=True)


def test_fp8_report_lists_every_linear_and_why():
    model, patched, _, _, report = _fp8_pair("flux")
    rows = {path: detail for path, _, detail in report.replaced + report.left}
    linears = [path for path, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert set(linears) <= set(rows), set(linears) - set(rows)
    assert "FP8Linear" in rows["transformer_blocks.0.attn.to_q"]
    assert "FP8Linear" in rows["transformer_blocks.0.ff.net.2"]
    assert "FP8Linear" in rows["single_transformer_blocks.0.proj_out"]
    assert "outside the transformer blocks" in rows["x_embedder"]
    assert "modulation" in rows["transformer_blocks.0.norm1.linear"]
    weights = [n for n, _ in patched.named_parameters() if n.startswith("transformer_blocks.0.attn.to_q")]
    assert weights == [], weights  # the bf16 weight is gone, not kept beside the FP8 one
    with pytest.raises(RuntimeError, match="precision='fp8'"):
        compile_ops.unpatch(patched)
    with pytest.raises(ValueError, match="precision must be one of"):
        compile_ops.patch(copy.deepcopy(model), precision="int4")
    fp8 = [m for m in patched.modules() if isinstance(m, compile_ops.FP8Linear)]
    assert fp8 and all(m.fast_accum for m in fp8)  # the default, as torchao's float8 inference
    exact_sums = copy.deepcopy(model)
    compile_ops.patch(exact_sums, precision="fp8", fp8_fast_accum=False)
    assert not any(m.fast_accum for m in exact_sums.modules() if isinstance(m, compile_ops.FP8Linear))


def test_fp8_on_a_model_with_nothing_to_quantize_reports_instead_of_raising():
    model, _ = _wan()  # 24-wide projections: not multiples of 16
    report = compile_ops.patch(model.to(DEVICE), precision="fp8")
    assert not [p for p, _, d in report.replaced if "FP8Linear" in d]
    reasons = [d for p, w, d in report.left if w == "nn.Linear" and p.startswith("blocks.")]
    assert reasons and all("multiples of 16" in d for d in reasons), reasons


def test_fp8_patched_model_refuses_a_gradient():
    _, patched, _, inputs, _ = _fp8_pair("flux")
    args = _to(inputs(4), DEVICE)
    args["hidden_states"].requires_grad_(True)
    with pytest.raises(RuntimeError, match="inference"):
        patched(**args).sample.sum().backward()


def test_fp8_patched_model_compiles_with_fullgraph_and_no_recompile_across_resolutions():
    # Dynamo alone: graph breaks and recompiles are its; FP8Linear's AOT graph
    # and export are test_fp8's (aot_eager here cost 57 s of CPU CI).
    torch._dynamo.reset()
    _, patched, _, inputs, _ = _fp8_pair("flux")
    compiled = torch.compile(patched, fullgraph=True, backend="eager", dynamic=True)
    with torch.no_grad():
        for i, side in enumerate((4, 6)):
            torch.manual_seed(2)
            args = _to(inputs(side), DEVICE)
            with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
                out = compiled(**args).sample
            torch.testing.assert_close(out, patched(**args).sample, **TOL)


def test_fp8_flux_seams_hand_fp8_rows_to_the_mlp(monkeypatch):
    """Under precision="fp8" each double-block stream's seam writes the MLP's
    FP8 input itself (gated_residual_norm_modulate_fp8), the MLP's first
    FP8Linear takes those rows without quantizing again, the MLP's GELU output
    is quantized in the pass that computes it (in the single block, with the
    attention output concatenated before it), and the AdaLN norms before
    q/k/v (and the single block's proj_mlp) write their FP8 rows themselves
    (norm_modulate_fp8): only the attention outputs are quantized apart."""
    _, patched, simulated, inputs, _ = _fp8_pair("flux")
    calls = Counter()

    def counting(module, name):
        op = getattr(module, name)

        def call(*a, **k):
            label = name
            if "quantize" in name:  # what the pass quantizes: "/<activation>", "+head" for a concatenation
                activation = a[1] if len(a) > 1 else k.get("activation", "none")
                head = (a[2] if len(a) > 2 else k.get("head")) is not None
                label += ("" if activation == "none" else f"/{activation}") + ("+head" if head else "")
            calls.update([label])
            return op(*a, **k)

        return call

    from compile_ops.modules import modulate as modulate_modules
    from compile_ops.ops import fp8 as fp8_ops

    for name in ("gated_residual_norm_modulate", "gated_residual_norm_modulate_fp8"):
        monkeypatch.setattr(blocks, name, counting(blocks, name))
    for name in ("norm_modulate", "norm_modulate_fp8"):
        monkeypatch.setattr(modulate_modules, name, counting(modulate_modules, name))
    monkeypatch.setattr(fp8_ops, "_quantize_fp8_rows", counting(fp8_ops, "_quantize_fp8_rows"))
    args = _to(inputs(4), DEVICE)
    with torch.no_grad():
        got, want = patched(**args).sample, simulated(**args).sample
    assert calls["gated_residual_norm_modulate_fp8"] == 2 and calls["gated_residual_norm_modulate"] == 0
    # The three AdaLN norms (image and text streams of the double block, the
    # single block) write FP8 rows for q/k/v and proj_mlp; the final norm
    # (before the bf16 proj_out) stays bf16.
    assert calls["norm_modulate_fp8"] == 3 and calls["norm_modulate"] == 1, calls
    # 17 FP8 Linears, 5 quantize passes: the MLPs' down projections take their
    # rows from the pass that computes the GELU (two), the single block's
    # proj_out from the pass that computes its GELU and concatenates the
    # attention output (one); only the double block's two attention outputs
    # (to_out, to_add_out) are quantized on their own.
    fp8_linears = sum(isinstance(m, compile_ops.FP8Linear) for m in patched.modules())
    assert fp8_linears == 17 and sum(calls[k] for k in calls if k.startswith("_quantize")) == 5, calls
    assert calls["_quantize_fp8_rows"] == 2, calls
    assert calls["_quantize_fp8_rows/gelu_tanh"] == 2 and calls["_quantize_fp8_rows/gelu_tanh+head"] == 1, calls
    assert sum(isinstance(m, compile_ops.FP8ProjectionActivation) for m in patched.modules()) == 2
    assert _relative_l2(got, want) < 1e-4


def test_fp8_self_attention_quantizes_its_input_once_for_q_k_and_v(monkeypatch):
    """Wan's self-attention: to_q, to_k and to_v read one tensor, quantized
    in one pass (a second pass for q re-reads 32760 x 1536 activations per
    block at 480p); cross-attention quantizes its query and the text once each.
    (LTX-Video's masked cross-attention runs diffusers' processor, whose
    to_k and to_v each quantize the text: 128 tokens, left as it is.)"""
    _, patched, simulated, inputs, _ = _fp8_pair("wan")
    from compile_ops.ops import fp8 as fp8_ops

    inputs_quantized = []
    quantize = fp8_ops._quantize_fp8_rows

    def recording(x, *args, **kwargs):
        inputs_quantized.append(x)
        return quantize(x, *args, **kwargs)

    monkeypatch.setattr(fp8_ops, "_quantize_fp8_rows", recording)
    args = _to(inputs(4), DEVICE)
    with torch.no_grad():
        got, want = patched(**args).sample, simulated(**args).sample
    # (The text is quantized once per block: each block's cross-attention reads it.)
    # (Views of one tensor, e.g. flattened to rows: same storage, same first element, same size.)
    same = [(x.data_ptr(), x.numel()) for x in inputs_quantized]  # all held alive: no address reuse
    twice = [i for i in range(1, len(same)) if same[i] == same[i - 1]]
    assert inputs_quantized and not twice, f"calls {twice} quantize the tensor the call before them did"
    assert _relative_l2(got, want) < 1e-4


def test_fp8_mlp_activation_is_fused_only_where_nothing_sits_between():
    """A FeedForward's GELU hands FP8 rows to the down projection when the
    Dropout between them is the identity (p=0); with p>0 it stays as it was
    and the report says why. Both give the same-quantization result."""
    from diffusers.models.attention import FeedForward

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.transformer_blocks = torch.nn.ModuleList(
        [FeedForward(32, dropout=p, activation_fn="gelu-approximate") for p in (0.0, 0.1)]
    ).eval()
    reference = copy.deepcopy(model)
    report = compile_ops.patch(model, precision="fp8")
    fused, kept = model.transformer_blocks
    assert isinstance(fused.net[0], compile_ops.FP8ProjectionActivation) and fused.net[0].activation == "gelu_tanh"
    assert type(kept.net[0]).__name__ == "GELU"
    assert any(path == "transformer_blocks.1.net.0" and "Dropout(p=0.1" in why for path, _, why in report.left)
    for path, _, _ in report.replaced:
        if path.endswith(("net.0.proj", "net.2")):
            owner, _, leaf = path.rpartition(".")
            parent = reference.get_submodule(owner)
            setattr(parent, leaf, _SimulatedFP8Linear(getattr(parent, leaf)))
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        for ours, theirs in zip(model.transformer_blocks, reference.transformer_blocks):
            torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
