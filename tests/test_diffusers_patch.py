"""compile_ops.patch on diffusers transformers built from small random configs.

Patched and unpatched copies of each model must agree (forward and the
parameters' gradients); the patched model must compile with fullgraph and
not recompile when the resolution changes; the report must name what was
replaced; modules we do not recognise must be left working; and patch must
refuse a compiled or hooked model. CPU runs the fused ops' reference paths;
on a GPU machine the same tests run the kernels.
"""

import copy
import os
import shutil
from collections import Counter

import pytest
import tiny_models
import torch
from conftest import HAS_CUDA
from patch_checks import DEVICE, TOL, assert_gradient_close, assert_patched_matches_forward_and_backward

import compile_ops
from compile_ops.integrations import diffusers as integration
from compile_ops.integrations.diffusers import attention_kernel, blocks, processors

diffusers = pytest.importorskip("diffusers")


def _flux():
    model = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    )

    def inputs(side):
        li, lt = side * side, 8
        grid = torch.meshgrid(torch.zeros(1), torch.arange(float(side)), torch.arange(float(side)), indexing="ij")
        ids = torch.stack(grid, -1)
        return dict(
            hidden_states=torch.randn(2, li, 4),
            encoder_hidden_states=torch.randn(2, lt, 32),
            pooled_projections=torch.randn(2, 32),
            timestep=torch.rand(2),
            img_ids=ids.reshape(li, 3),
            txt_ids=torch.zeros(lt, 3),
        )

    return model, inputs


def _wan():
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )

    def inputs(side):
        return dict(
            hidden_states=torch.randn(1, 4, 2, side, side),
            encoder_hidden_states=torch.randn(1, 6, 16),
            timestep=torch.randint(0, 1000, (1,)),
        )

    return model, inputs


def _sd3():
    model = diffusers.SD3Transformer2DModel(
        sample_size=8,
        patch_size=1,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        caption_projection_dim=16,
        joint_attention_dim=16,
        pooled_projection_dim=16,
        out_channels=4,
        qk_norm="rms_norm",
    )

    def inputs(side):
        return dict(
            hidden_states=torch.randn(2, 4, side, side),
            encoder_hidden_states=torch.randn(2, 6, 16),
            pooled_projections=torch.randn(2, 16),
            timestep=torch.rand(2),
        )

    return model, inputs


def _ltx():
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

    def inputs(side):
        return dict(
            hidden_states=torch.randn(1, 2 * side * side, 4),
            encoder_hidden_states=torch.randn(1, 6, 16),
            timestep=torch.randint(0, 1000, (1,)),
            encoder_attention_mask=torch.ones(1, 6),
            num_frames=2,
            height=side,
            width=side,
        )

    return model, inputs


MODELS = {"flux": _flux, "wan": _wan, "sd3": _sd3, "ltx": _ltx}


def _to(inputs, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _pair(name):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model = model.to(DEVICE)
    patched = copy.deepcopy(model)
    report = compile_ops.patch(patched)
    return model, patched, inputs, report


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


def test_attention_kernel_choice_keeps_the_outputs_and_rejects_unknown_names():
    torch.manual_seed(0)
    model, inputs = _flux()
    model = model.to(DEVICE)
    args = _to(inputs(4), DEVICE)
    want = model(**args).sample
    for kernel in ("sdpa", "fused"):
        patched = copy.deepcopy(model)
        compile_ops.patch(patched, attention_kernel=kernel)
        assert patched.transformer_blocks[0].attn.processor.kernel == kernel
        torch.testing.assert_close(patched(**args).sample, want, **TOL)
    with pytest.raises(ValueError, match="attention_kernel must be one of"):
        compile_ops.patch(copy.deepcopy(model), attention_kernel="flash")


def test_auto_attention_kernel_takes_fused_where_the_sm90_core_is_ahead(monkeypatch):
    """``attention_kernel="auto"``'s rule, on fake CUDA tensors ([B, L, H, D]):
    SDPA (cuDNN) for 16-bit inference, except on an sm_90 GPU at D = 128 from
    FUSED_AHEAD_FROM_KEYS keys, at key counts off a multiple of 128 from
    FUSED_AHEAD_RAGGED_FROM_KEYS keys (Flux at 1360x768's 4592), or with key
    lengths at any length (SDPA runs them as a boolean mask), where the Gluon
    core is ahead; fused.attention for fp32 and for calls that need a
    gradient."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compile_ops.ops import attention_tiles

    ahead = attention_kernel.FUSED_AHEAD_FROM_KEYS
    with FakeTensorMode():

        def qkv(lk, d=128, dtype=torch.bfloat16):
            return (
                torch.empty(1, 300, 2, d, dtype=dtype, device="cuda"),
                *(torch.empty(1, lk, 2, d, dtype=dtype, device="cuda") for _ in range(2)),
            )

        lengths = torch.full((1,), 100, device="cuda")
        for wgmma in (True, False):
            monkeypatch.setattr(attention_kernel, "has_wgmma", lambda t, on=wgmma: on)
            assert attention_kernel.sdpa_is_faster(*qkv(ahead)) is not wgmma
            assert attention_kernel.sdpa_is_faster(*qkv(ahead - 1))
            assert attention_kernel.sdpa_is_faster(*qkv(4608))
            ragged = attention_kernel.FUSED_AHEAD_RAGGED_FROM_KEYS
            tiles = attention_tiles.forward_tiles(128, torch.bfloat16, True, "exact", True)
            assert tiles.sm90_core and tiles.block_n == attention_kernel.RAGGED_KEY_TILE  # ragged means a masked tile
            assert attention_kernel.sdpa_is_faster(*qkv(4592)) is not wgmma
            assert attention_kernel.sdpa_is_faster(*qkv(ragged + 1)) is not wgmma
            assert attention_kernel.sdpa_is_faster(*qkv(ragged - 1))  # ragged, shorter than measured
            assert attention_kernel.sdpa_is_faster(*qkv(4592, d=64))
            assert attention_kernel.sdpa_is_faster(*qkv(ahead, d=64))
            assert attention_kernel.sdpa_is_faster(*qkv(ahead), lengths) is not wgmma
            assert attention_kernel.sdpa_is_faster(*qkv(4608), lengths) is not wgmma
            assert attention_kernel.sdpa_is_faster(*qkv(4608, d=64), lengths)
            assert not attention_kernel.sdpa_is_faster(*qkv(ahead, dtype=torch.float32))
            q, k, v = qkv(4608)
            assert not attention_kernel.sdpa_is_faster(q.requires_grad_(), k, v)


@pytest.mark.parametrize("length", [4592, 4608, 2537])
def test_auto_attention_kernel_guards_a_symbolic_key_length(length, monkeypatch):
    """Under dynamic shapes (a model compiled once for many resolutions) the
    rule reads a symbolic key count: the core at Flux 1360x768's ragged 4592
    keys, SDPA at 4608 (whole tiles) and at 2537 (ragged, below
    FUSED_AHEAD_RAGGED_FROM_KEYS), each decision guarded (on the count modulo
    128, and on the bound where it decides), so that a graph traced at one
    kind of length is not reused at the other."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    monkeypatch.setattr(attention_kernel, "has_wgmma", lambda t: True)
    env = ShapeEnv()
    sym = env.create_unspecified_symint_and_symbol(length, ConstantSource("L"), DimDynamic.DYNAMIC)
    with FakeTensorMode(shape_env=env):
        q, k, v = (torch.empty(1, sym, 24, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        sdpa = attention_kernel.sdpa_is_faster(q, k, v)
    assert sdpa == (length != 4592)
    guards = [str(g.expr) for g in env.guards]
    assert f"{'Eq' if length % 128 == 0 else 'Ne'}(Mod({sym}, 128), 0)" in guards, guards
    if length % 128:
        assert any(str(attention_kernel.FUSED_AHEAD_RAGGED_FROM_KEYS) in g for g in guards), guards


# ---------------------------------------------------------------- precision="fp8"


class _SimulatedFP8Linear(torch.nn.Module):
    """The FP8 recipe restated in plain PyTorch, independently of compile_ops:
    per-row (token) activation scales and per-output-channel weight scales,
    ``scale = amax / 448`` over the row's finite values (floored at 1e-12),
    values ``clamp(x * (448 / amax), -448, 448)`` rounded to e4m3, products
    summed in fp32. On a GPU the products are summed by the device's FP8 GEMM
    (``torch._scaled_mm`` rowwise with fast accumulation, as FP8Linear runs
    there by default: tensor-core sums, bf16 bias, output rounded to bf16,
    its only rowwise output type), so the
    comparison isolates the quantization from the GEMM's summation order."""

    def __init__(self, linear):
        super().__init__()
        self.weight_q, self.weight_scale = self.quantize(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    @staticmethod
    def quantize(x):
        x = x.float()
        amax = torch.where(torch.isfinite(x), x.abs(), 0.0).amax(-1, keepdim=True).clamp(min=1e-12)
        q = (x * (448.0 / amax)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return q, (amax / 448.0).squeeze(-1)

    def forward(self, x):
        q, scale = self.quantize(x)
        if q.is_cuda:
            out = torch._scaled_mm(
                q.reshape(-1, q.shape[-1]),
                self.weight_q.t(),
                scale_a=scale.reshape(-1, 1),
                scale_b=self.weight_scale[None, :],
                out_dtype=torch.bfloat16,
                bias=None if self.bias is None else self.bias.to(torch.bfloat16),
                use_fast_accum=True,
            )
            return out.reshape(*q.shape[:-1], -1).to(x.dtype)
        out = (q.float() * scale[..., None]) @ (self.weight_q.float() * self.weight_scale[:, None]).T
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)


def _wan16():
    """Wan with 16-wide heads: every projection a multiple of 16 (torch._scaled_mm's rule)."""
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    return model, _wan()[1]


FP8_MODELS = {"flux": _flux, "wan": _wan16, "sd3": _sd3, "ltx": _ltx}


def _fp8_pair(name, **options):
    torch.manual_seed(0)
    model, inputs = FP8_MODELS[name]()
    model = model.to(DEVICE).eval()
    patched = copy.deepcopy(model)
    report = compile_ops.patch(patched, precision="fp8", **options)
    simulated = copy.deepcopy(model)
    for path, _, detail in report.replaced:
        if "FP8Linear" in detail:
            owner, _, leaf = path.rpartition(".")
            parent = simulated.get_submodule(owner)
            setattr(parent, leaf, _SimulatedFP8Linear(getattr(parent, leaf)))
    return model, patched, simulated, inputs, report


def _relative_l2(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


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


# ---------------------------------------------------------------- the diffusers attention backend


@pytest.mark.parametrize("name", ["wan", "ltx"])
def test_compile_ops_is_a_diffusers_attention_backend(name, monkeypatch):
    """``set_attention_backend("compile_ops")`` on an unpatched model: the
    dispatcher's calls run fused.attention (masked calls, LTX's text
    cross-attention, go to SDPA), outputs equal the native backend's, and a
    fullgraph compile traces it."""
    from compile_ops.integrations import attention_backend

    compile_ops.register_diffusers_backend()
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model = model.to(DEVICE)
    args = _to(inputs(4), DEVICE)
    with torch.no_grad():
        want = model(**args).sample
    calls = Counter()
    fused = attention_backend.attention
    monkeypatch.setattr(attention_backend, "attention", lambda *a, **k: calls.update(["fused"]) or fused(*a, **k))
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    model.set_attention_backend("compile_ops")  # also sets diffusers' process-wide active backend
    try:
        with torch.no_grad():
            got = model(**args).sample
            compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(**args).sample
    finally:
        model.reset_attention_backend()
        _AttentionBackendRegistry.set_active_backend(active)
        torch._dynamo.reset()
    assert calls["fused"] >= 1, calls
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(compiled, want, **TOL)
    with pytest.raises(ValueError, match="must be one of"):
        model.set_attention_backend("compile-ops")


def test_a_block_sparse_mask_through_diffusers_dispatch_runs_block_sparse_attention():
    """``dispatch_attention_fn(..., attn_mask=BlockSparseMask)`` on the
    compile_ops backend: the attention over the listed 128-token blocks,
    equal to dense SDPA under the same blocks as a token mask, eager and under
    a fullgraph compile; a mask of another type or dropout is refused by name."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    compile_ops.register_diffusers_backend()
    torch.manual_seed(0)
    lq, heads, d = 300, 2, 16  # 3 query blocks, the last partial
    q, k, v = (torch.randn(1, lq, heads, d, device=DEVICE) for _ in range(3))
    blocks = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool, device=DEVICE)
    mask = compile_ops.BlockSparseMask.from_block_mask(blocks[None, None].expand(1, heads, 3, 3))
    tokens = blocks.repeat_interleave(128, 0)[:lq].repeat_interleave(128, 1)[:, :lq]
    want = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), attn_mask=tokens
    ).transpose(1, 2)

    def attend(q, k, v, mask):
        return dispatch_attention_fn(q, k, v, attn_mask=mask, backend="compile_ops")

    got = attend(q, k, v, mask)
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")(q, k, v, mask)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(compiled, want, **TOL)
    dense = dispatch_attention_fn(q, k, v, backend="compile_ops")
    assert not torch.allclose(got, dense, **TOL)  # the mask acts
    with pytest.raises(TypeError, match="attn_mask must be a tensor, a compile_ops.BlockSparseMask or None, got"):
        attend(q, k, v, [blocks])
    with pytest.raises(ValueError, match="dropout_p must be 0 with a BlockSparseMask"):
        dispatch_attention_fn(q, k, v, attn_mask=mask, dropout_p=0.1, backend="compile_ops")


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


# ---------------------------------------------------------------- export and AOTInductor (issue 20)


def _flux_block_inputs(model, side):
    """Inputs of the first double block of a patched tiny Flux at ``side x side`` image tokens."""
    args = _to(_flux()[1](side), DEVICE)
    with torch.no_grad():
        hidden = model.x_embedder(args["hidden_states"])
        text = model.context_embedder(args["encoder_hidden_states"])
        temb = model.time_text_embed(args["timestep"] * 1000, args["pooled_projections"])
        rope = model.pos_embed(torch.cat([args["txt_ids"], args["img_ids"]]))
    return dict(hidden_states=hidden, encoder_hidden_states=text, temb=temb, image_rotary_emb=rope)


def _fused_targets(graph_module) -> set:
    return {
        str(n.target)
        for n in graph_module.graph.nodes
        if n.op == "call_function" and str(n.target).startswith("fused.")
    }


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler")
def test_patched_flux_exports_with_a_dynamic_sequence_and_a_block_runs_as_an_aoti_package(tmp_path):
    """torch.export of a whole patched tiny Flux with a dynamic image sequence
    (the fused ops stay ops in the graph) matches eager at two lengths; one
    patched double block goes through AOTInductor (on a GPU: its fused ops as
    Triton kernels in the package), and the package matches eager at lengths
    it was not exported at, run from C++ (``bench/runners/aoti_runner.cpp``, no Python
    in the process) and, on the CPU, loaded in Python. Not in Python on a GPU:
    on the benchmark's machine torch 2.11's loader crashes the process for
    every package (docs/notes/aoti.md)."""
    from bench.runners.aoti import build_runner, flat_inputs, run_package

    torch.manual_seed(0)
    model, inputs = _flux()
    model = model.to(DEVICE).eval()
    compile_ops.patch(model)
    seq = torch.export.Dim("seq", min=4, max=256)
    args = _to(inputs(4), DEVICE)
    dynamic = {name: None for name in args}
    dynamic["hidden_states"], dynamic["img_ids"] = {1: seq}, {0: seq}
    exported = torch.export.export(model, (), args, dynamic_shapes=dynamic)
    assert {"fused.qk_norm_rope.default", "fused.gated_residual_norm_modulate.default"} <= _fused_targets(
        exported.graph_module
    ), _fused_targets(exported.graph_module)
    for side in (4, 6):
        args = _to(inputs(side), DEVICE)
        with torch.no_grad():
            torch.testing.assert_close(exported.module()(**args).sample, model(**args).sample, **TOL)

    block = model.transformer_blocks[0]
    kwargs = _flux_block_inputs(model, 4)
    rope_len = seq + 8  # 8 text tokens, then the image's
    exported = torch.export.export(
        block,
        (),
        kwargs,
        dynamic_shapes=dict(
            hidden_states={1: seq},
            encoder_hidden_states=None,
            temb=None,
            image_rotary_emb=({0: rope_len}, {0: rope_len}),
        ),
    )
    # aoti_compile_and_package writes into inductor's config dict aot_inductor.metadata in place: a dict of
    # its own for this compile keeps the process's config as it was.
    with torch._inductor.config.patch({"aot_inductor.metadata": {}}):
        package = torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "flux_block.pt2"))
    loaded = None if HAS_CUDA else torch._inductor.aoti_load_package(package)
    runner = build_runner(str(tmp_path))
    for side in (5, 7):
        kwargs = _flux_block_inputs(model, side)
        with torch.no_grad():
            want = block(**kwargs)
            from_cpp, _ = run_package(runner, package, flat_inputs(exported, kwargs), DEVICE, repeats=0)
            got = [] if loaded is None else loaded(**kwargs)
        assert len(from_cpp) == len(want)
        for g, w in zip([*from_cpp, *got], [*want, *want]):
            torch.testing.assert_close(g.to(w.device), w, **TOL)


_LOAD_AND_RUN = """
import sys, torch
import compile_ops  # registers the fused ops the saved graph calls
program = torch.export.load(sys.argv[1])
io = torch.load(sys.argv[2])
with torch.no_grad():
    (got,) = program.module()(**io["args"])
    (compiled,) = torch.compile(program.module(), fullgraph=True, backend=sys.argv[4])(**io["args"])
torch.save({"got": got, "compiled": compiled}, sys.argv[3])
"""


def test_patched_flux_ships_as_a_saved_exported_program_that_a_fresh_process_runs(tmp_path):
    """``torch.export.save`` of a whole patched tiny Flux with a dynamic image
    sequence, and ``torch.export.load`` in a fresh process that imports
    compile_ops (the fused ops are ops in the file; their kernels come from the
    installed package): the loaded program, eager and under
    ``torch.compile(fullgraph=True)``, matches the model at a length it was not
    exported at. A shipping path with Python; without it, an AOTInductor
    package run from C++ (the test above, bench/runners/aoti.py)."""
    import subprocess
    import sys

    torch.manual_seed(0)
    model, inputs = _flux()
    model = model.to(DEVICE).eval()
    compile_ops.patch(model)
    seq = torch.export.Dim("seq", min=4, max=256)
    # A tuple out (return_dict=False): a saved program's output structure must
    # be one that pytree can load without diffusers' output class registered.
    args = dict(_to(inputs(4), DEVICE), return_dict=False)
    dynamic = {name: None for name in args}
    dynamic["hidden_states"], dynamic["img_ids"] = {1: seq}, {0: seq}
    torch.export.save(torch.export.export(model, (), args, dynamic_shapes=dynamic), tmp_path / "flux.pt2")
    args = dict(_to(inputs(6), DEVICE), return_dict=False)
    with torch.no_grad():
        (want,) = model(**args)
    torch.save({"args": args}, tmp_path / "io.pt")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            _LOAD_AND_RUN,
            str(tmp_path / "flux.pt2"),
            str(tmp_path / "io.pt"),
            str(tmp_path / "out.pt"),
            "inductor" if HAS_CUDA else "aot_eager",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    out = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(out["got"], want, **TOL)
    torch.testing.assert_close(out["compiled"], want, **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flux", "wan", "sd3", "ltx"])
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"])
def test_patched_model_under_cuda_graphs_has_no_skip_and_matches_the_default_mode(name, mode):
    """``torch.compile(mode=...)`` of a patched model, for each way people
    compile one: captured whole in CUDA graphs where the mode uses them (no
    "skipping cudagraphs" from any op: a host sync, a CPU tensor or a
    data-dependent allocation would cause one), with no graph break
    (fullgraph), and equal to the default mode's output. max-autotune picks
    other kernels for the layers we leave to Inductor (on the H100, Wan's
    output moved by 5e-4 with them), so there the patched model may move by
    at most twice what the unpatched model moves between the same two modes."""
    from torch._dynamo.utils import counters

    def default_and_mode(patch):
        torch.manual_seed(0)
        model, inputs = MODELS[name]()
        model = model.to("cuda").eval()
        if patch:
            compile_ops.patch(model)
        args = _to(inputs(4), "cuda")
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            want = torch.compile(model, fullgraph=True)(**args).sample
            graphed = torch.compile(model, mode=mode, fullgraph=True)
            for _ in range(3):  # warm-up, record, replay
                got = graphed(**args).sample.clone()
        torch._dynamo.reset()
        assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
        return got, want

    got, want = default_and_mode(patch=True)
    tolerance = 1e-5
    if mode != "reduce-overhead":  # same kernels in both for reduce-overhead: no allowance
        native_got, native_want = default_and_mode(patch=False)
        tolerance = max(1e-4, 2 * (native_got - native_want).abs().max().item())
    print(f"{name} {mode}: patched moved {(got - want).abs().max().item():.1e}, allowed {tolerance:.1e}")
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


# ---------------------------------------------------------------- 8-bit attention


def _count_attention_precisions(monkeypatch) -> Counter:
    """Counts, by precision ("exact", "int8", "int8_fp8"), the attention calls our processors make from now on."""
    calls = Counter()
    attend = processors.attention

    def counting(*args, **kwargs):
        calls.update([kwargs.get("precision", "exact")])
        return attend(*args, **kwargs)

    monkeypatch.setattr(processors, "attention", counting)
    return calls


def _bf16(args: dict) -> dict:
    return {
        key: value.to(torch.bfloat16) if torch.is_tensor(value) and value.is_floating_point() else value
        for key, value in args.items()
    }


@pytest.mark.parametrize("precision", ["int8", "int8_fp8"])
@pytest.mark.parametrize("name, layers", [("flux", 2), ("wan", 4)])
def test_int8_attention_precision_runs_8_bit_attention_on_16_bit_inference_only(name, layers, precision, monkeypatch):
    """``patch(attention_precision="int8" / "int8_fp8")``: every attention call
    of a bf16 model's inference goes through 8-bit attention (the
    specification's reference on CPU, the kernel on a GPU), close to the
    exact patched model at 8-bit quantization's distance (printed); a call
    that needs a gradient keeps the exact kernels, and an unknown precision
    is refused."""
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model = model.to(DEVICE, torch.bfloat16).eval()
    exact, int8 = copy.deepcopy(model), copy.deepcopy(model)
    compile_ops.patch(exact)
    compile_ops.patch(int8, attention_precision=precision)
    calls = _count_attention_precisions(monkeypatch)
    args = _bf16(_to(inputs(4), DEVICE))
    with torch.no_grad():
        got = int8(**args).sample
        assert calls[precision] == layers and calls["exact"] == 0, calls
        want = exact(**args).sample
    err = _relative_l2(got, want)
    print(f"{name}: {precision} attention vs exact attention, step output relative L2 {err:.2e}")
    assert 0 < err < 5e-2
    calls.clear()
    int8.train()
    for p in int8.parameters():
        p.requires_grad_(True)
    int8(**args).sample.float().square().mean().backward()  # training: the exact kernels, a gradient
    assert calls[precision] == 0 and calls["exact"] == layers, calls
    with pytest.raises(ValueError, match="attention_precision must be one of"):
        compile_ops.patch(MODELS[name]()[0], attention_precision="fp8")


def _count_query_types(monkeypatch) -> Counter:
    """Counts, by the type of q (``Tensor`` or ``Int8QK``), the attention calls our processors make from now on."""
    seen = Counter()
    attend = processors.attention

    def counting(q, *a, **kw):
        seen.update([type(q).__name__])
        return attend(q, *a, **kw)

    monkeypatch.setattr(processors, "attention", counting)
    return seen


@pytest.mark.parametrize("precision", ["int8", "int8_fp8"])
@pytest.mark.parametrize("name, fused_calls", [("flux", 1), ("wan", 2)])
def test_8bit_attention_takes_q_and_k_quantized_by_their_rotation(name, fused_calls, precision, monkeypatch):
    """Under an 8-bit attention_precision, self-attention whose q and k are
    rotated by our processor (Wan's self-attention, Flux's single-stream
    block) gets them quantized by the rotation's kernel (``Int8QK``,
    ``fused.qk_rope_int8``) from QUANTIZE_IN_ROTATION_MIN_TOKENS tokens up
    (below it, attention quantizes them); Flux's double-stream block joins two streams
    after rotating them, so its attention quantizes them. The model equals
    the same model quantizing inside attention: exactly on CPU (the same
    specification), within an INT8 step's effect on a GPU (k's mean is summed
    in another order there)."""
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model = model.to(DEVICE, torch.bfloat16).eval()
    fused, unfused = copy.deepcopy(model), copy.deepcopy(model)
    for m in (fused, unfused):
        compile_ops.patch(m, attention_precision=precision)
    args = _bf16(_to(inputs(4), DEVICE))
    with torch.no_grad():  # below the length the rotation quantizes from: attention quantizes
        seen = _count_query_types(monkeypatch)
        fused(**args)
        assert seen["Int8QK"] == 0, seen
    monkeypatch.setattr(processors, "QUANTIZE_IN_ROTATION_MIN_TOKENS", 1)  # the tiny models' sequences
    seen = Counter()
    with torch.no_grad():
        seen = _count_query_types(monkeypatch)
        got = fused(**args).sample
        assert seen["Int8QK"] == fused_calls and seen["Tensor"] == (2 if name == "flux" else 4) - fused_calls, seen
        monkeypatch.setattr(processors.FusedProcessor, "quantizes_qk", lambda self, *tensors: False)
        seen.clear()
        want = unfused(**args).sample
        assert seen["Int8QK"] == 0, seen
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    else:
        assert _relative_l2(got, want) < 1e-2


@pytest.mark.parametrize("name, rows_calls", [("flux", 1), ("wan", 4)])
def test_fp8_linears_with_fp8_pv_attention_take_the_attention_output_as_fp8_rows(name, rows_calls, monkeypatch):
    """``patch(precision="fp8", attention_precision="int8_fp8")``: attention
    whose output projection is an FP8Linear hands it FP8 rows from the
    kernel's epilogue (``compile_ops.attention_fp8_rows``: Wan's self- and
    cross-attention, Flux's double-stream blocks; the single-stream block
    concatenates the output with its MLP's, and keeps the 16-bit output).
    Against the same model with that output quantized per row by a pass of
    its own, the step output moves by about e4m3's rounding (printed)."""
    torch.manual_seed(0)
    model, inputs = FP8_MODELS[name]()
    model = model.to(DEVICE, torch.bfloat16).eval()
    rows_model, pass_model = copy.deepcopy(model), copy.deepcopy(model)
    for m in (rows_model, pass_model):
        compile_ops.patch(m, precision="fp8", attention_precision="int8_fp8")
    args = _bf16(_to(inputs(4), DEVICE))
    calls = []
    rows = processors.attention_fp8_rows

    def counted(*a, **kw):
        calls.append(type(a[0]).__name__)
        return rows(*a, **kw)

    def quantized_by_a_pass(q, k, v, seq_dim, kv_lengths):  # what the processors did before the epilogue
        out = compile_ops.attention(q, k, v, seq_dim=seq_dim, kv_lengths=kv_lengths, precision="int8_fp8")
        return compile_ops.quantize_fp8_rows(out.flatten(2, 3))

    with torch.no_grad():
        monkeypatch.setattr(processors, "attention_fp8_rows", counted)
        got = rows_model(**args).sample
        assert len(calls) == rows_calls, calls
        monkeypatch.setattr(processors, "attention_fp8_rows", quantized_by_a_pass)
        want = pass_model(**args).sample
    err = _relative_l2(got, want)
    print(
        f"{name}: attention output as FP8 rows (epilogue's bound scale) vs a per-row quantization pass: "
        f"step output relative L2 {err:.2e}"
    )
    assert 0 < err < 5e-2


def test_int8_attention_dense_steps_keep_the_first_denoising_steps_exact(monkeypatch):
    """``attention_dense_steps=2``: the first two denoising steps of a
    generation (distinct timesteps; a repeated one is classifier-free
    guidance's second call) run exact attention, later ones 8-bit, and a
    timestep above the last starts a new generation."""
    torch.manual_seed(0)
    model, inputs = _wan()
    model = model.to(DEVICE, torch.bfloat16).eval()
    compile_ops.patch(model, attention_precision="int8", attention_dense_steps=2)
    calls = _count_attention_precisions(monkeypatch)
    args = _bf16(_to(inputs(4), DEVICE))
    seen = []
    with torch.no_grad():
        for t in (900, 900, 800, 700, 600, 950):
            calls.clear()
            model(**dict(args, timestep=torch.tensor([t], device=DEVICE)))
            seen.append("int8" if calls["int8"] else "exact")
            assert not (calls["int8"] and calls["exact"]), calls  # one precision per call
    assert seen == ["exact", "exact", "exact", "int8", "int8", "exact"], seen
    compile_ops.unpatch(model)
    assert not model._forward_pre_hooks
    with pytest.raises(ValueError, match="attention_dense_steps applies to an 8-bit attention_precision"):
        compile_ops.patch(_wan()[0], attention_dense_steps=1)
    with pytest.raises(ValueError, match="attention_dense_steps: dense_steps must be an int >= 0"):
        compile_ops.patch(_wan()[0], attention_precision="int8", attention_dense_steps=-1)


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
