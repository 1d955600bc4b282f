"""Attention in patched diffusers models, and compile_ops as diffusers' attention backend.

The fused processors' choice of attention kernel (``attention_kernel``, and the
"auto" rule between SDPA and the fused kernel, eager and on a symbolic key
length); ``set_attention_backend("compile_ops")`` on unpatched models and a
``BlockSparseMask`` through diffusers' dispatcher; 8-bit attention
(``attention_precision="int8"`` / ``"int8_fp8"``): where it applies, q and k
quantized by their rotation, FP8 rows from the attention epilogue to FP8
Linears, and the dense first denoising steps. CPU runs the reference paths; on
a GPU machine the same tests run the kernels.
"""

import copy
from collections import Counter

import pytest
import torch
from diffusers_helpers import FP8_MODELS, MODELS, _flux, _relative_l2, _to, _wan
from patch_checks import DEVICE, TOL

import compile_ops
from compile_ops.integrations.diffusers import attention_kernel, processors

pytest.importorskip("diffusers")

#: The bound of the 8-bit rule as measured (conftest lifts it for the tiny models on a GPU).
EIGHT_BIT_FROM_KEYS = attention_kernel.EIGHT_BIT_FROM_KEYS


# ---------------------------------------------------------------- the fused processors' attention kernel


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


def test_8bit_attention_runs_on_a_gpu_from_the_keys_where_it_pays(monkeypatch):
    """Under an 8-bit attention_precision a processor runs a 16-bit inference
    call (fake CUDA tensors, [B, L, H, D]) in 8 bits from EIGHT_BIT_FROM_KEYS
    keys on a GPU: Wan's text cross-attention (512 keys) keeps 16-bit
    attention, faster and more accurate there; off a GPU, at any length (the
    precision the caller set). The report names the bound."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(attention_kernel, "EIGHT_BIT_FROM_KEYS", EIGHT_BIT_FROM_KEYS)
    model, _ = _wan()
    report = compile_ops.patch(model.to(torch.bfloat16).eval(), attention_precision="int8_fp8")
    ours = (getattr(m, "processor", None) for m in model.modules())
    processor = next(p for p in ours if isinstance(p, processors.FusedProcessor))
    with FakeTensorMode():

        def qkv(keys, device="cuda"):
            q = torch.empty(1, 4096, 2, 64, dtype=torch.bfloat16, device=device)
            return (q, *(torch.empty(1, keys, 2, 64, dtype=torch.bfloat16, device=device) for _ in range(2)))

        assert not processor.eight_bit(*qkv(512)) and not processor.eight_bit(*qkv(EIGHT_BIT_FROM_KEYS - 1))
        assert processor.eight_bit(*qkv(EIGHT_BIT_FROM_KEYS)) and processor.eight_bit(*qkv(512, "cpu"))
    kernels = [kernel for _, kernel, _ in report.attention_paths()]
    bound = f"(inference) from {EIGHT_BIT_FROM_KEYS} keys on a GPU"
    assert kernels and all(bound in kernel for kernel in kernels), kernels


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
