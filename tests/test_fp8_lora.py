"""LoRA (peft) on FP8 models: ``patch(precision="fp8")`` and LoRA adapters in
either order, through diffusers' own loading and switching calls.

CPU, the FP8 reference path, fp32 tiny Flux and Wan. Each patched model with
a LoRA is compared against the unpatched model with the same LoRA and
against the same quantization in plain PyTorch (the FP8 GEMMs simulated on
the Linears ``patch`` quantizes without a LoRA, the adapters reading the
GEMM's rows dequantized, their deltas exact).
"""

import copy

import pytest
import torch
from diffusers_helpers import _flux, _relative_l2, _SimulatedFP8Linear, _wan16

import compile_ops
from compile_ops.integrations.diffusers import BLOCK_LISTS

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from peft import LoraConfig, inject_adapter_in_model  # noqa: E402
from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: E402

from compile_ops.integrations.peft import FP8LoraLinear  # noqa: E402
from compile_ops.ops.fp8 import quantize_fp8_rows  # noqa: E402

MODELS = {"flux": _flux, "wan": _wan16}
#: Rank 16: the adapters' own Linears (16 x K, N x 16) have the sizes FP8 takes, and must not be quantized.
RANK = 16


def _lora_state_dict(model, seed, rank=RANK, scale=0.1, bias=False):
    """A random LoRA in diffusers' (peft) layout for every Linear of the
    transformer blocks, the AdaLN modulation projections included (as
    trainers write them for Flux): A ~ N(0, 1/K), so that A x is of the
    order of x, and B ~ N(0, scale^2)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for path, module in model.named_modules():
        if path.split(".")[0] in BLOCK_LISTS and type(module) is torch.nn.Linear and ".lora_" not in path:
            k, n = module.in_features, module.out_features
            state[f"{path}.lora_A.weight"] = torch.randn(rank, k, generator=generator) / k**0.5
            state[f"{path}.lora_B.weight"] = torch.randn(n, rank, generator=generator) * scale
            if bias:
                state[f"{path}.lora_B.bias"] = torch.randn(n, generator=generator) * scale
    return state


def _model(name):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    torch.manual_seed(1)
    return model.eval(), inputs(8)


def _patched(model):
    patched = copy.deepcopy(model)
    report = compile_ops.patch(patched, precision="fp8")
    return patched, report


def _fp8_paths(model):
    """The paths ``patch(precision="fp8")`` quantizes in ``model`` without a LoRA."""
    _, report = _patched(model)
    return [path for path, _, detail in report.replaced if "FP8Linear" in detail]


def _dequantized_rows(layer, args):
    """A LoRA layer's input as its FP8 GEMM reads it: quantized per row, dequantized in fp32."""
    q, scale = _SimulatedFP8Linear.quantize(args[0])
    return ((q.float() * scale.unsqueeze(-1)).to(args[0].dtype), *args[1:])


def _same_quantization(model_with_lora, paths):
    """``model_with_lora`` with the Linears at ``paths`` as the plain-PyTorch FP8
    GEMM; under a LoRA layer, the layer's input is quantized and dequantized
    first, so its adapters read what the GEMM reads (and the GEMM quantizes
    those values to the same codes again)."""
    simulated = copy.deepcopy(model_with_lora)
    for path in paths:
        module = simulated.get_submodule(path)
        if isinstance(module, BaseTunerLayer):
            module.base_layer = _SimulatedFP8Linear(module.base_layer)
            module.register_forward_pre_hook(_dequantized_rows)
        else:
            owner, _, leaf = path.rpartition(".")
            setattr(simulated.get_submodule(owner), leaf, _SimulatedFP8Linear(module))
    return simulated


def _same_bytes(a, b):
    as_bits = (lambda t: t.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (lambda t: t)
    return a.dtype == b.dtype and torch.equal(as_bits(a), as_bits(b))


def _out(model, args):
    with torch.no_grad():
        return model(**args).sample


#: Patched vs the same quantization in plain PyTorch: the fused ops' fp32
#: rounding may flip an e4m3 rounding here and there (seen: 1e-7 to 5e-7);
#: a Linear quantized that should not be (or the reverse) costs 1e-3 or more.
SAME_QUANTIZATION = 1e-4


@pytest.mark.parametrize("name", MODELS)
def test_lora_before_or_after_patch_is_the_same_quantization_with_deltas_of_the_rows(name):
    model, args = _model(name)
    fp8_paths = _fp8_paths(model)
    no_lora_error = _relative_l2(_out(_patched(model)[0], args), _out(model, args))
    lora = _lora_state_dict(model, seed=2)
    after, _ = _patched(model)
    after.load_lora_adapter(lora, prefix=None, adapter_name="style")
    with_lora = copy.deepcopy(model)
    with_lora.load_lora_adapter(lora, prefix=None, adapter_name="style")
    before, report = _patched(with_lora)

    exact, got_after, got_before = (_out(m, args) for m in (with_lora, after, before))
    reference = _out(_same_quantization(with_lora, fp8_paths), args)
    # Either order builds the same modules around the same weights: the same bytes.
    torch.testing.assert_close(got_before, got_after, rtol=0, atol=0)
    lora_effect = _relative_l2(exact, _out(model, args))
    to_exact = _relative_l2(got_after, exact)
    to_reference = _relative_l2(got_after, reference)
    print(
        f"{name}: the LoRA moves the output {lora_effect:.2e}; FP8 + LoRA vs exact {to_exact:.2e} "
        f"(no LoRA {no_lora_error:.2e}); vs same quantization {to_reference:.2e}"
    )
    # The LoRA is seen (a dropped delta would be an error this large), and so is the quantization ...
    assert lora_effect > 0.05
    assert to_exact > 1e-3
    # ... the quantized Linears are the ones patch quantizes without a LoRA (the
    # AdaLN modulation projections, the adapters' own Linears stay unquantized) ...
    assert to_reference < SAME_QUANTIZATION, to_reference
    # ... and a LoRA of this size leaves the FP8 error at its no-LoRA level (seen: x1.2 to x1.35;
    # x1.1 to x1.2 when the adapters read the unquantized activation).
    assert to_exact < 2 * no_lora_error, (to_exact, no_lora_error)

    rows = {path: detail for path, _, detail in report.replaced + report.left}
    some_block = "transformer_blocks.0" if name == "flux" else "blocks.0"
    q = f"{some_block}.attn.to_q" if name == "flux" else f"{some_block}.attn1.to_q"
    assert "FP8Linear" in rows[f"{q}.base_layer"] and "FP8LoraLinear" in rows[f"{q}.base_layer"]
    assert "LoRA adapter's own weight" in rows[f"{q}.lora_A.style"]
    for m in (after, before):
        assert isinstance(m.get_submodule(q), FP8LoraLinear)
        assert type(m.get_submodule(q).lora_A["style"]) is torch.nn.Linear
    if name == "flux":
        assert "modulation" in rows["transformer_blocks.0.norm1.linear.base_layer"]
        assert type(before.transformer_blocks[0].norm1.linear.base_layer) is torch.nn.Linear


def test_set_adapters_disable_enable_and_delete_follow_the_same_quantization():
    """Two adapters with weights, disabled, enabled and one deleted: each state
    of the FP8 model is the same quantization of the unpatched model in that
    state; disabled, it is the FP8 model without a LoRA."""
    model, args = _model("flux")
    plain, _ = _patched(model)
    patched, _ = _patched(model)
    with_lora = copy.deepcopy(model)
    for seed, adapter in enumerate(("sketch", "paint")):
        lora = _lora_state_dict(model, seed=seed + 3)
        for m in (patched, with_lora):
            m.load_lora_adapter(lora, prefix=None, adapter_name=adapter)
    reference = _same_quantization(with_lora, _fp8_paths(model))

    def check(label):
        got, want = _out(patched, args), _out(reference, args)
        assert _relative_l2(got, want) < SAME_QUANTIZATION, label
        return got

    for m in (patched, reference):
        m.set_adapters(["sketch", "paint"], weights=[0.5, 1.5])
    both = check("two adapters with weights")
    for m in (patched, reference):
        m.set_adapters(["paint"], weights=[1.5])
    only_b = check("one adapter")
    assert _relative_l2(both, only_b) > 1e-2
    patched.disable_lora()
    # The FP8 GEMMs on the same inputs; the MLP's GELU is quantized in a pass of its own instead of
    # in the pass computing it (the down projection is under a LoRA layer): the same bytes on the reference.
    torch.testing.assert_close(_out(patched, args), _out(plain, args), rtol=1e-6, atol=1e-6)
    patched.enable_lora()
    torch.testing.assert_close(_out(patched, args), only_b, rtol=0, atol=0)
    for m in (patched, reference):
        m.delete_adapters("sketch")
    assert all("sketch" not in layer.lora_A for layer in patched.modules() if isinstance(layer, FP8LoraLinear))
    check("after deleting the other adapter")


def test_hotswap_under_compile_swaps_without_recompiling():
    """``enable_lora_hotswap(target_rank=...)``, ``torch.compile(fullgraph=True)``
    and ``load_lora_adapter(..., hotswap=True)`` of an adapter of another rank:
    one graph, no recompile, and the output of loading that adapter afresh."""
    import torch._dynamo.utils as dynamo_utils

    model, args = _model("flux")
    first, second = _lora_state_dict(model, seed=5, rank=8), _lora_state_dict(model, seed=6, rank=16)
    patched, _ = _patched(model)
    patched.enable_lora_hotswap(target_rank=16)
    patched.load_lora_adapter(first, prefix=None, adapter_name="style")
    fresh, _ = _patched(model)
    fresh.load_lora_adapter(second, prefix=None, adapter_name="style")
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    compiled = torch.compile(patched, fullgraph=True, backend="eager")
    with torch.no_grad():
        before = compiled(**args).sample
        torch.testing.assert_close(before, _out(patched, args), rtol=0, atol=0)
        patched.load_lora_adapter(second, prefix=None, adapter_name="style", hotswap=True)
        with torch.compiler.set_stance("fail_on_recompile"):
            swapped = compiled(**args).sample
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1, dict(dynamo_utils.counters["stats"])
    assert _relative_l2(swapped, before) > 1e-2  # the swap changed the output ...
    torch.testing.assert_close(swapped, _out(fresh, args), rtol=0, atol=0)  # ... to the second adapter's


def _compiled_blocks_graphs(model, args):
    """Compile ``model``'s blocks one by one with ``fullgraph=True`` (as the Flux LoRA
    benchmark does), call it twice: ``(output, graphs compiled, graph breaks)``."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    for name in BLOCK_LISTS:
        for block in getattr(model, name, ()):
            block.compile(fullgraph=True, backend="eager")
    out = _out(model, args)
    with torch.compiler.set_stance("fail_on_recompile"):
        _out(model, args)
    stats = dynamo_utils.counters["stats"]
    return out, stats["unique_graphs"], sum(dynamo_utils.counters["graph_break"].values())


def test_blocks_compiled_one_by_one_share_their_graphs_with_a_hotswap_ready_lora():
    """Regional compile of an FP8 model with a LoRA loaded after
    ``enable_lora_hotswap``: no graph break, and the blocks of a kind share
    their graphs as without the LoRA (no guard on a block's own objects: the
    scalings are tensors, the FP8Linear buffers graph inputs), so a deeper
    model compiles nothing more per block."""
    model, args = _model("flux")
    for name in ("transformer_blocks", "single_transformer_blocks"):
        blocks = getattr(model, name)
        blocks.extend(copy.deepcopy(blocks[0]) for _ in range(2))
    lora = _lora_state_dict(model, seed=9, rank=8)
    plain, _ = _patched(model)
    patched, _ = _patched(model)
    patched.enable_lora_hotswap(target_rank=16)
    patched.load_lora_adapter(lora, prefix=None, adapter_name="style")
    eager = _out(patched, args)
    _, plain_graphs, plain_breaks = _compiled_blocks_graphs(plain, args)
    out, graphs, breaks = _compiled_blocks_graphs(patched, args)
    assert breaks == plain_breaks == 0
    # One graph per block kind, plus the single block's first call (its input has other strides), as without the LoRA.
    assert graphs == plain_graphs <= 3, (graphs, plain_graphs)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


def test_fuse_requantizes_and_unfuse_gives_back_the_same_bytes():
    """``fuse_lora`` merges the deltas (and ``lora_bias``) into the FP8 weights
    by requantizing; the fused model is as close to the exact one as the
    unfused; ``unfuse_lora`` gives back the codes, scales and biases byte for
    byte; fused then unloaded, the FP8 Linears keep the fused weights."""
    model, args = _model("wan")
    lora = _lora_state_dict(model, seed=7, bias=True)
    exact_model = copy.deepcopy(model)
    exact_model.load_lora_adapter(lora, prefix=None, adapter_name="style")
    exact = _out(exact_model, args)
    patched, _ = _patched(model)
    patched.load_lora_adapter(lora, prefix=None, adapter_name="style")
    layers = [m for m in patched.modules() if isinstance(m, FP8LoraLinear)]
    assert layers and all(layer.lora_bias["style"] for layer in layers)
    buffers = {k: v.clone() for k, v in patched.state_dict().items() if ".lora_" not in k}
    unfused = _out(patched, args)
    patched.fuse_lora()
    assert all(layer.merged for layer in layers)
    fused = _out(patched, args)
    unfused_error, fused_error = _relative_l2(unfused, exact), _relative_l2(fused, exact)
    print(
        f"wan: exact vs FP8 + LoRA {unfused_error:.2e}, fused {fused_error:.2e}; fused vs unfused "
        f"{_relative_l2(fused, unfused):.2e}"
    )
    # W + delta is rounded to e4m3 once more: an error of the size of the weights' own quantization.
    assert fused_error < 2 * unfused_error, (fused_error, unfused_error)
    changed = [k for k, v in patched.state_dict().items() if k in buffers and not torch.equal(v, buffers[k])]
    assert any(k.endswith("weight_q") for k in changed) and any(k.endswith(".bias") for k in changed)
    patched.unfuse_lora()
    assert not any(layer.merged for layer in layers)
    for key, value in patched.state_dict().items():
        assert key not in buffers or _same_bytes(value, buffers[key]), key
    torch.testing.assert_close(_out(patched, args), unfused, rtol=0, atol=0)
    patched.fuse_lora()
    patched.unload_lora()
    assert not any(isinstance(m, BaseTunerLayer) for m in patched.modules())
    torch.testing.assert_close(_out(patched, args), fused, rtol=0, atol=0)


def test_a_fused_lora_swaps_under_compile_without_recompiling():
    """Serving a fused LoRA (the plain FP8 step's kernels): ``fuse_lora`` under
    ``torch.compile(fullgraph=True)`` compiles the merged layers' graph once;
    ``unfuse_lora``, ``load_lora_adapter(..., hotswap=True)`` of a second
    adapter and ``fuse_lora`` again compile nothing, and give the bytes of
    fusing that adapter into a freshly patched model."""
    import torch._dynamo.utils as dynamo_utils

    model, args = _model("flux")
    first, second = _lora_state_dict(model, seed=5), _lora_state_dict(model, seed=6)

    def patched_with(lora):
        patched, _ = _patched(model)
        patched.enable_lora_hotswap(target_rank=RANK)
        patched.load_lora_adapter(lora, prefix=None, adapter_name="style")
        return patched

    served, fresh = patched_with(first), patched_with(second)
    fresh.fuse_lora()
    fresh_codes = {k: v for k, v in fresh.state_dict().items() if k.endswith(("weight_q", "weight_scale"))}
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    compiled = torch.compile(served, fullgraph=True, backend="eager")
    with torch.no_grad():
        compiled(**args)
        served.fuse_lora()
        before = compiled(**args).sample  # the merged layers: one more graph
        graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        served.unfuse_lora()
        served.load_lora_adapter(second, prefix=None, adapter_name="style", hotswap=True)
        served.fuse_lora()
        with torch.compiler.set_stance("fail_on_recompile"):
            swapped = compiled(**args).sample
    stats = dict(dynamo_utils.counters["stats"])
    assert graphs == 2 and stats["unique_graphs"] == graphs, stats
    for key, value in served.state_dict().items():
        assert key not in fresh_codes or _same_bytes(value, fresh_codes[key]), key
    assert _relative_l2(swapped, before) > 1e-2  # the swap changed the output ...
    # ... to the second adapter's, fused. Not bit for bit: the AdaLN modulation projections stay
    # fp32 Linears here, whose unfuse (peft's) subtracts the delta and keeps last-bit changes.
    assert _relative_l2(swapped, _out(fresh, args)) < SAME_QUANTIZATION


def test_safe_fusing_refuses_a_broken_adapter_before_changing_anything():
    model, args = _model("wan")
    lora = _lora_state_dict(model, seed=8)
    lora["blocks.0.attn1.to_q.lora_B.weight"][0, 0] = float("nan")
    patched, _ = _patched(model)
    patched.load_lora_adapter(lora, prefix=None, adapter_name="broken")
    codes = patched.blocks[0].attn1.to_q.base_layer.weight_q.clone()
    with pytest.raises(ValueError, match="adapter broken seems to be broken"):
        patched.fuse_lora(safe_fusing=True)
    assert _same_bytes(patched.blocks[0].attn1.to_q.base_layer.weight_q, codes)
    assert not patched.blocks[0].attn1.to_q.merged


def test_a_lora_layer_takes_fp8_rows_and_reads_them_dequantized():
    """FP8LoraLinear given :class:`FP8Rows` (a fused kernel's output): the GEMM
    reads the rows, the adapters ``q * scale``, and a tensor is those rows'
    output; peft's per-sample adapters, disabling and merging too."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 48)
    net = torch.nn.Sequential(compile_ops.FP8Linear.from_linear(linear), torch.nn.LayerNorm(48))
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["0"], lora_dropout=0.0), net, "a")
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, target_modules=["0"]), net, "b")
    layer = net[0]
    assert isinstance(layer, FP8LoraLinear)
    for p in layer.lora_B.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(3, 5, 32)
    rows = quantize_fp8_rows(x)
    seen = rows.dequantized()
    with torch.no_grad():
        base = layer.base_layer(rows)
        delta = {a: layer.lora_B[a](layer.lora_A[a](seen)) * layer.scaling[a] for a in ("a", "b")}
        layer.set_adapter("a")
        torch.testing.assert_close(layer(rows), base + delta["a"], rtol=1e-6, atol=1e-6)
        # A tensor is quantized once, for the GEMM and the adapters alike.
        torch.testing.assert_close(layer(x), layer(rows), rtol=0, atol=0)
        # A hooked B (offloading moves its weight when called) is called, not read.
        calls = []
        hook = layer.lora_B["a"].register_forward_pre_hook(lambda module, args: calls.append(module))
        torch.testing.assert_close(layer(rows), base + delta["a"], rtol=1e-6, atol=1e-6)
        assert calls == [layer.lora_B["a"]]
        hook.remove()
        mixed = layer(rows, adapter_names=["b", "__base__", "a"])
        want = torch.stack([base[0] + delta["b"][0], base[1], base[2] + delta["a"][2]])
        torch.testing.assert_close(mixed, want, rtol=1e-6, atol=1e-6)
        with pytest.raises(ValueError, match="one adapter per sample"):
            layer(rows, adapter_names=["a"])
        layer.enable_adapters(False)
        torch.testing.assert_close(layer(rows), base, rtol=0, atol=0)
        layer.enable_adapters(True)
        layer.merge(adapter_names=["a"])  # W + delta requantized: within an e4m3 rounding of the unmerged sum
        merged = layer(rows)
        assert 0 < _relative_l2(merged, base + delta["a"]) < 2**-4
        layer.enable_adapters(False)  # disabling a merged layer unmerges it: the FP8 weight from before, exactly
        torch.testing.assert_close(layer(rows), base, rtol=0, atol=0)
        assert not layer.merged


@pytest.mark.parametrize("name", MODELS)
def test_fused_producers_hand_fp8_rows_to_lora_layers(name):
    """With a LoRA on every block Linear, the kernels that produce the LoRA'd
    Linears' inputs (the AdaLN norms' FP8 mode, the GELU, the single block's
    concatenation) still write FP8 rows: no 16-bit copy for the adapters."""
    model, args = _model(name)
    patched, _ = _patched(model)
    patched.load_lora_adapter(_lora_state_dict(model, seed=2), prefix=None, adapter_name="style")
    seen = {}

    def record(path):
        def hook(module, args):
            seen.setdefault(path, type(args[0]).__name__)

        return hook

    for path, module in patched.named_modules():
        if isinstance(module, FP8LoraLinear):
            module.register_forward_pre_hook(record(path))
    _out(patched, args)
    block = "transformer_blocks.0" if name == "flux" else "blocks.0"
    attention = f"{block}.attn" if name == "flux" else f"{block}.attn1"
    ff = f"{block}.ff" if name == "flux" else f"{block}.ffn"
    readers = [f"{attention}.to_{p}" for p in "qkv"] + [f"{ff}.net.0.proj", f"{ff}.net.2"]
    if name == "flux":
        readers += [f"single_transformer_blocks.0.{p}" for p in ("proj_mlp", "proj_out", "attn.to_q")]
    assert {path: seen[path] for path in readers} == dict.fromkeys(readers, "FP8Rows")


@pytest.mark.parametrize(
    "config, argument",
    [
        (dict(use_dora=True), "use_dora"),
        (dict(init_lora_weights="pissa"), "init_lora_weights"),
        (dict(fan_in_fan_out=True), "fan_in_fan_out"),
        (dict(alora_invocation_tokens=[1, 2]), "alora_invocation_tokens"),
    ],
)
def test_lora_options_fp8_cannot_run_are_refused_by_name(config, argument):
    model, _ = _model("flux")
    patched, _ = _patched(model)
    with pytest.raises(ValueError, match=f"FP8Linear: {argument}"):
        patched.add_adapter(LoraConfig(r=4, target_modules=["to_q"], **config), adapter_name="refused")


def test_a_dora_state_dict_is_refused_by_load_lora_adapter():
    model, _ = _model("flux")
    lora = _lora_state_dict(model, seed=9)
    for key in [k for k in lora if k.endswith("lora_B.weight")]:
        lora[key.replace("lora_B.weight", "lora_magnitude_vector")] = torch.ones(lora[key].shape[0])
    patched, _ = _patched(model)
    with pytest.raises(ValueError, match="use_dora"):
        patched.load_lora_adapter(lora, prefix=None, adapter_name="dora")


def test_adapters_fp8_cannot_take_over_keep_their_linear_and_say_why():
    """LoRA then patch: a DoRA adapter, or one fused into its weight, keeps its
    Linear in its dtype (reported, and the model's output is that of the
    unpatched layer there)."""
    model, args = _model("flux")
    dora = copy.deepcopy(model)
    dora.add_adapter(LoraConfig(r=4, target_modules=["to_q"], use_dora=True), adapter_name="dora")
    _, report = _patched(dora)
    rows = {path: detail for path, _, detail in report.replaced + report.left}
    assert "DoRA" in rows["transformer_blocks.0.attn.to_q.base_layer"]
    assert "kept in torch.float32" in rows["transformer_blocks.0.attn.to_q.base_layer"]
    fused = copy.deepcopy(model)
    fused.load_lora_adapter(_lora_state_dict(model, seed=10), prefix=None, adapter_name="style")
    fused.fuse_lora()
    patched, report = _patched(fused)
    rows = {path: detail for path, _, detail in report.replaced + report.left}
    assert "fuse_lora" in rows["transformer_blocks.0.attn.to_k.base_layer"]
    assert type(patched.transformer_blocks[0].attn.to_k.base_layer) is torch.nn.Linear
    assert _out(patched, args).isfinite().all()


def _flux_pipeline(transformer):
    """A FluxPipeline around ``transformer`` alone: enough for its LoRA loading calls."""
    import diffusers

    return diffusers.FluxPipeline(
        transformer=transformer, vae=None, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
    )  # fmt: skip


def _saved(tmp_path, name, lora):
    """``lora`` (diffusers layout, transformer paths) written as a pipeline LoRA file: the folder."""
    import diffusers

    folder = tmp_path / name
    diffusers.FluxPipeline.save_lora_weights(folder, transformer_lora_layers=lora)
    return str(folder)


def test_flux_pipeline_lora_calls_on_an_fp8_transformer_match_the_transformer_calls(tmp_path):
    """``load_lora_weights`` (a file, then a second adapter, then a hotswap),
    ``set_adapters``, ``fuse_lora``/``unfuse_lora`` and ``unload_lora_weights``
    through a FluxPipeline whose transformer was patched to FP8 give the bytes
    of the same calls on the transformer (``load_lora_adapter``, ...)."""
    model, args = _model("flux")
    style, paint, swap = (_lora_state_dict(model, seed=seed) for seed in (11, 12, 13))
    plain, _ = _patched(model)
    pipe = _flux_pipeline(_patched(model)[0])
    by_hand, _ = _patched(model)

    def check(label):
        torch.testing.assert_close(_out(pipe.transformer, args), _out(by_hand, args), rtol=0, atol=0, msg=label)
        return _out(by_hand, args)

    pipe.load_lora_weights(_saved(tmp_path, "style", style), adapter_name="style")
    by_hand.load_lora_adapter(style, prefix=None, adapter_name="style")
    assert isinstance(pipe.transformer.transformer_blocks[0].attn.to_q, FP8LoraLinear)
    assert _relative_l2(check("one adapter"), _out(plain, args)) > 0.05
    pipe.load_lora_weights(_saved(tmp_path, "paint", paint), adapter_name="paint")
    by_hand.load_lora_adapter(paint, prefix=None, adapter_name="paint")
    pipe.set_adapters(["style", "paint"], adapter_weights=[0.5, 1.5])
    by_hand.set_adapters(["style", "paint"], weights=[0.5, 1.5])
    unfused = check("two adapters with weights")
    fp8_before = {n: t.clone() for n, t in by_hand.state_dict().items() if t.dtype == torch.float8_e4m3fn}
    pipe.fuse_lora()
    by_hand.fuse_lora()
    assert _relative_l2(check("fused"), unfused) > 0  # requantized: another rounding
    pipe.unfuse_lora()
    by_hand.unfuse_lora()
    # The FP8 weights come back byte for byte; the unquantized modulation Linears by peft's fp32
    # subtraction, whose last-bit changes can flip an activation's e4m3 rounding downstream.
    fp8_after = {n: t for n, t in by_hand.state_dict().items() if t.dtype == torch.float8_e4m3fn}
    assert fp8_before.keys() == fp8_after.keys() and all(_same_bytes(fp8_before[n], fp8_after[n]) for n in fp8_after)
    assert _relative_l2(check("unfused"), unfused) < SAME_QUANTIZATION
    pipe.load_lora_weights(_saved(tmp_path, "swap", swap), adapter_name="style", hotswap=True)
    by_hand.load_lora_adapter(swap, prefix=None, adapter_name="style", hotswap=True)
    check("hotswapped")
    pipe.unload_lora_weights()
    assert not any(isinstance(m, BaseTunerLayer) for m in pipe.transformer.modules())
    # The modulation Linears keep the fp32 fuse-and-unfuse's last-bit changes.
    torch.testing.assert_close(_out(pipe.transformer, args), _out(plain, args), rtol=1e-5, atol=1e-5)


def _control_lora(model, grown, seed=14, rank=4):
    """A Flux Control LoRA's shape: ``x_embedder`` (a plain Linear: ``patch``
    leaves the embedders) takes twice its input channels, and rank-``rank``
    adapters sit on the double block's q projection, widened to twice its
    input with ``grown``."""
    generator = torch.Generator().manual_seed(seed)
    embed, q = model.x_embedder, model.transformer_blocks[0].attn.to_q
    q_in = 2 * q.in_features if grown else q.in_features
    shapes = {
        "x_embedder": (2 * embed.in_features, embed.out_features),
        "transformer_blocks.0.attn.to_q": (q_in, q.out_features),
    }
    lora = {}
    for path, (k, n) in shapes.items():
        lora[f"{path}.lora_A.weight"] = torch.randn(rank, k, generator=generator) / k**0.5
        lora[f"{path}.lora_B.weight"] = torch.randn(n, rank, generator=generator) * 0.1
    return lora


def test_a_control_lora_loads_on_an_fp8_flux_pipeline_as_before_patch(tmp_path):
    """A Control LoRA grows ``x_embedder`` (left unquantized by ``patch``):
    loaded after ``patch`` it gives the bytes of loading it before, and
    ``unload_lora_weights(reset_to_overwritten_params=True)`` gives back the
    patched model."""
    model, args = _model("flux")
    folder = _saved(tmp_path, "control", _control_lora(model, grown=False))
    plain, _ = _patched(model)
    after = _flux_pipeline(_patched(model)[0])
    after.load_lora_weights(folder, adapter_name="control")
    before = _flux_pipeline(copy.deepcopy(model))
    before.load_lora_weights(folder, adapter_name="control")
    compile_ops.patch(before.transformer, precision="fp8")
    assert after.transformer.x_embedder.in_features == 8 and after.transformer.config.in_channels == 8
    assert isinstance(after.transformer.transformer_blocks[0].attn.to_q, FP8LoraLinear)
    wide = dict(args, hidden_states=torch.cat([args["hidden_states"], torch.randn_like(args["hidden_states"])], -1))
    torch.testing.assert_close(_out(after.transformer, wide), _out(before.transformer, wide), rtol=0, atol=0)
    after.unload_lora_weights(reset_to_overwritten_params=True)
    assert after.transformer.x_embedder.in_features == 4
    torch.testing.assert_close(_out(after.transformer, args), _out(plain, args), rtol=0, atol=0)


def test_a_lora_that_would_grow_an_fp8_linear_is_refused_before_anything_changes(tmp_path):
    model, args = _model("flux")
    pipe = _flux_pipeline(_patched(model)[0])
    want = _out(pipe.transformer, args)
    with pytest.raises(
        ValueError, match=r"grows transformer_blocks\.0\.attn\.to_q .*FP8Linear.* before compile_ops\.patch"
    ):
        pipe.load_lora_weights(_saved(tmp_path, "control", _control_lora(model, grown=True)), adapter_name="control")
    assert pipe.transformer.x_embedder.in_features == 4 and pipe.transformer.config.in_channels == 4
    assert not any(isinstance(m, BaseTunerLayer) for m in pipe.transformer.modules())
    torch.testing.assert_close(_out(pipe.transformer, args), want, rtol=0, atol=0)


def test_inference_runs_each_lora_layer_as_the_rows_op(monkeypatch):
    """Under ``torch.no_grad`` every FP8LoraLinear of a patched model adds its
    adapter with ``fused.fp8_rows_lora`` (tests/test_fp8_rows_lora.py checks
    each condition of the choice, and peft's path where the op cannot serve)."""
    from compile_ops.integrations import peft as fp8_peft

    calls = []
    op = fp8_peft.fp8_rows_lora
    monkeypatch.setattr(fp8_peft, "fp8_rows_lora", lambda *args: calls.append(args) or op(*args))
    model, args = _model("flux")
    patched, _ = _patched(model)
    patched.load_lora_adapter(_lora_state_dict(model, seed=2), prefix=None, adapter_name="style")
    layers = [m for m in patched.modules() if isinstance(m, FP8LoraLinear)]
    _out(patched, args)
    assert len(calls) == len(layers) > 0
