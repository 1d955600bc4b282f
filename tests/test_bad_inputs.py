"""Every public function and module, every argument, every kind of wrong value:
a ``TypeError`` or ``ValueError`` that names the argument, never a crash
elsewhere or a silent result (``tests/bad_input.py`` says what is wrong for
each kind of argument).

Three layers: the reference path (CPU tensors), fake CUDA tensors (the
fakes' validation, what torch.compile traces), and for a representative set
the Triton kernels under the interpreter (``kernels``: the eager fast path).
Hypothesis chooses the argument, the wrong value and the valid shapes around it.
"""

import contextlib

import pytest
import torch
from bad_input import Call, assert_names_the_argument, mutations
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import compile_ops
from compile_ops.ops.fp8 import quantize_fp8_rows


def _t(*shape, device, dtype=torch.float32):
    return torch.randn(*shape, device=device, dtype=dtype)


def _hidden(device, n):
    return _t(2, 3, n, device=device)


def _fn_call(fn, **make):
    """A ``build(device, n)`` that calls ``fn`` with ``make[arg](device, n)`` (a callable) or the value."""

    def build(device, n):
        return fn, {k: (v(device, n) if callable(v) else v) for k, v in make.items()}

    return build


def _module_call(make_module, **make):
    """Call ``make_module(n).to(device)`` on the built arguments (its forward's)."""

    def build(device, n):
        module = make_module(n).to(device)
        return module, {k: (v(device, n) if callable(v) else v) for k, v in make.items()}

    return build


def _x(device, n):
    return _hidden(device, n)


def _vec(device, n):
    return 1 + 0.1 * _t(n, device=device)


def _mod(device, n):
    return _t(2, n, device=device)


def _heads(device, n):  # [B, H, L, D]
    return _t(2, 2, 5, n, device=device)


def _heads16(device, n):  # 8-bit attention's 16-bit inputs
    return _heads(device, n).to(torch.bfloat16)


def _table(device, n):  # [L, D]
    return _t(5, n, device=device)


def _sparse_qkv(device, n):
    return _t(1, 2, 130, n, device=device)


def _sparse_qkv16(device, n):  # 8-bit block-sparse attention's 16-bit inputs
    return _sparse_qkv(device, n).to(torch.bfloat16)


#: The arguments both block-sparse attention functions take, by kind.
_SPARSE_KINDS = dict(q="tensor", k="tensor", v="tensor", block_index="index", block_count="index")
_SPARSE_KINDS.update(scale="float?", causal="bool", seq_dim="int", kv_lengths="index?")


def _block_lists(device):
    return compile_ops.block_index_from_mask(torch.ones(1, 2, 2, 2, dtype=torch.bool, device=device))


def _patched(model):
    compile_ops.patch(model)
    return model


def _fp8_weight(device, n):
    return quantize_fp8_rows(_t(4, n, device=device))


def _fp8_rows(device, n):
    """FP8 rows ``[2, 3, n]`` of the quantize op (the reference path on a CPU, its kernel under the interpreter)."""
    return quantize_fp8_rows(_hidden(device, n))


CALLS = [
    Call(
        "rmsnorm",
        _fn_call(compile_ops.rmsnorm, x=_x, weight=_vec, eps=1e-6, bias=_vec),
        dict(x="tensor", weight="tensor?", eps="float", bias="tensor?"),
    ),
    Call(
        "add_rmsnorm",
        _fn_call(compile_ops.add_rmsnorm, x=_x, residual=_x, weight=_vec, eps=1e-6),
        dict(x="tensor", residual="tensor", weight="tensor?", eps="float"),
    ),
    Call(
        "layernorm",
        _fn_call(compile_ops.layernorm, x=_x, weight=_vec, bias=_vec, eps=1e-5),
        dict(x="tensor", weight="tensor?", bias="tensor?", eps="float"),
    ),
    Call(
        "RMSNorm",
        _fn_call(compile_ops.RMSNorm, dim=lambda d, n: n, eps=1e-6, elementwise_affine=True, bias=False),
        dict(dim="int", eps="float?", elementwise_affine="bool", bias="bool"),
    ),
    Call("RMSNorm.forward", _module_call(compile_ops.RMSNorm, x=_x), dict(x="tensor")),
    Call(
        "LayerNorm",
        _fn_call(compile_ops.LayerNorm, normalized_shape=lambda d, n: n, eps=1e-5, elementwise_affine=True, bias=True),
        dict(normalized_shape="int", eps="float", elementwise_affine="bool", bias="bool"),
    ),
    Call("LayerNorm.forward", _module_call(compile_ops.LayerNorm, x=_x), dict(x="tensor")),
    Call(
        "modulate",
        _fn_call(compile_ops.modulate, x=_x, scale=_mod, shift=_mod),
        dict(x="tensor", scale="tensor", shift="tensor"),
    ),
    Call(
        "norm_modulate",
        _fn_call(
            compile_ops.norm_modulate, x=_x, scale=_mod, shift=_mod, weight=_vec, bias=_vec, norm="layernorm", eps=1e-6
        ),
        dict(x="tensor", scale="tensor", shift="tensor", weight="tensor?", bias="tensor?", norm="str", eps="float"),
    ),
    Call(
        "gated_residual",
        _fn_call(compile_ops.gated_residual, residual=_x, x=_x, gate=_mod),
        dict(residual="tensor", x="tensor", gate="tensor"),
    ),
    Call(
        "gated_residual_norm_modulate",
        _fn_call(
            compile_ops.gated_residual_norm_modulate,
            residual=_x,
            x=_x,
            gate=_mod,
            scale=_mod,
            shift=_mod,
            weight=_vec,
            bias=_vec,
            norm="rmsnorm",
            eps=1e-6,
        ),
        dict(
            residual="tensor",
            x="tensor",
            gate="tensor",
            scale="tensor",
            shift="tensor",
            weight="tensor?",
            bias="tensor?",
            norm="str",
            eps="float",
        ),
    ),
    Call(
        "norm_modulate_fp8",
        _fn_call(compile_ops.norm_modulate_fp8, x=_x, scale=_mod, shift=_mod, norm="layernorm", eps=1e-6),
        dict(x="tensor", scale="tensor", shift="tensor", norm="str", eps="float"),
    ),
    Call(
        "gated_residual_norm_modulate_fp8",
        _fn_call(
            compile_ops.gated_residual_norm_modulate_fp8,
            residual=_x,
            x=_x,
            gate=_mod,
            scale=_mod,
            shift=_mod,
            norm="layernorm",
            eps=1e-6,
        ),
        dict(residual="tensor", x="tensor", gate="tensor", scale="tensor", shift="tensor", norm="str", eps="float"),
    ),
    Call(
        "AdaLayerNormZero",
        _fn_call(compile_ops.AdaLayerNormZero, embedding_dim=lambda d, n: n, norm_type="layer_norm", bias=True),
        dict(embedding_dim="int", norm_type="str", bias="bool"),
    ),
    Call(
        "AdaLayerNormZero.forward",
        _module_call(compile_ops.AdaLayerNormZero, x=_x, emb=_mod, fp8_rows=False),
        dict(x="tensor", emb="tensor", fp8_rows="bool"),
    ),
    Call(
        "AdaLayerNormZeroSingle.forward",
        _module_call(compile_ops.AdaLayerNormZeroSingle, x=_x, emb=_mod),
        dict(x="tensor", emb="tensor"),
    ),
    Call(
        "AdaLayerNormContinuous",
        _fn_call(
            compile_ops.AdaLayerNormContinuous,
            embedding_dim=lambda d, n: n,
            conditioning_embedding_dim=6,
            elementwise_affine=True,
            eps=1e-5,
        ),
        dict(embedding_dim="int", conditioning_embedding_dim="int", elementwise_affine="bool", eps="float"),
    ),
    Call(
        "AdaLayerNormContinuous.forward",
        _module_call(
            lambda n: compile_ops.AdaLayerNormContinuous(n, 6),
            x=_x,
            conditioning_embedding=lambda d, n: _t(2, 6, device=d),
        ),
        dict(x="tensor", conditioning_embedding="tensor"),
    ),
    Call(
        "rope",
        _fn_call(compile_ops.rope, x=_heads, cos=_table, sin=_table, interleaved=False, seq_dim=2, rotary_dim=None),
        dict(x="tensor", cos="tensor", sin="tensor", interleaved="bool", seq_dim="int", rotary_dim="int?"),
    ),
    Call(
        "rope_qk",
        _fn_call(
            compile_ops.rope_qk,
            q=_heads,
            k=_heads,
            cos=_table,
            sin=_table,
            interleaved=True,
            seq_dim=2,
            rotary_dim=None,
            quantize=False,
        ),
        dict(
            q="tensor",
            k="tensor",
            cos="tensor",
            sin="tensor",
            interleaved="bool",
            seq_dim="int",
            rotary_dim="int?",
            quantize="bool",
        ),
    ),
    Call(
        "qk_norm_rope",
        _fn_call(
            compile_ops.qk_norm_rope,
            q=_heads,
            k=_heads,
            q_weight=_vec,
            k_weight=_vec,
            cos=_table,
            sin=_table,
            eps=1e-6,
            interleaved=False,
            seq_dim=2,
            rotary_dim=None,
            quantize=False,
        ),
        dict(
            q="tensor",
            k="tensor",
            q_weight="tensor",
            k_weight="tensor",
            cos="tensor",
            sin="tensor",
            eps="float",
            interleaved="bool",
            seq_dim="int",
            rotary_dim="int?",
            quantize="bool",
        ),
    ),
    Call(
        "rope_grid",
        _fn_call(
            compile_ops.rope_grid,
            q=lambda d, n: _t(1, 2, 6, 16, device=d),
            k=lambda d, n: _t(1, 2, 6, 16, device=d),
            spec=compile_ops.grid_rope("wan", 16),
            height=2,
            width=3,
            seq_dim=2,
        ),
        dict(q="tensor", k="tensor", height="int", width="int", seq_dim="int"),
    ),
    Call("grid_rope", _fn_call(compile_ops.grid_rope, convention="wan", dim=16), dict(convention="str", dim="int")),
    Call(
        "geglu",
        _fn_call(compile_ops.geglu, x=_x, approximate="none", gate_first=False),
        dict(x="tensor", approximate="str", gate_first="bool"),
    ),
    Call("swiglu", _fn_call(compile_ops.swiglu, x=_x, gate_first=False), dict(x="tensor", gate_first="bool")),
    Call(
        "GEGLU",
        _fn_call(compile_ops.GEGLU, dim_in=lambda d, n: n, dim_out=4, bias=True, approximate="tanh"),
        dict(dim_in="int", dim_out="int", bias="bool", approximate="str"),
    ),
    Call(
        "GEGLU.forward", _module_call(lambda n: compile_ops.GEGLU(n, 4), hidden_states=_x), dict(hidden_states="tensor")
    ),
    Call(
        "SwiGLU.forward",
        _module_call(lambda n: compile_ops.SwiGLU(n, 4), hidden_states=_x),
        dict(hidden_states="tensor"),
    ),
    Call(
        "attention",
        _fn_call(
            compile_ops.attention,
            q=_heads,
            k=_heads,
            v=_heads,
            scale=None,
            causal=False,
            seq_dim=2,
            kv_lengths=None,
            return_lse=False,
            precision="exact",
        ),
        dict(
            q="tensor",
            k="tensor",
            v="tensor",
            scale="float?",
            causal="bool",
            seq_dim="int",
            kv_lengths="index?",
            return_lse="bool",
            precision="str",
        ),
    ),
    Call(
        "attention (key lengths)",
        _fn_call(
            compile_ops.attention,
            q=_heads,
            k=_heads,
            v=_heads,
            causal=True,
            kv_lengths=lambda d, n: torch.tensor([5, 3], device=d),
        ),
        dict(kv_lengths="index?", causal="bool"),
    ),
    Call(
        "attention_fp8_rows",
        _fn_call(
            compile_ops.attention_fp8_rows, q=_heads16, k=_heads16, v=_heads16, scale=0.5, causal=False, seq_dim=2
        ),
        dict(q="tensor", k="tensor", v="tensor", scale="float?", causal="bool", seq_dim="int"),
    ),
    Call(
        "scaled_dot_product_attention",
        _fn_call(
            compile_ops.scaled_dot_product_attention,
            query=_heads,
            key=_heads,
            value=_heads,
            dropout_p=0.0,
            is_causal=False,
            scale=None,
            enable_gqa=False,
        ),
        dict(
            query="tensor",
            key="tensor",
            value="tensor",
            dropout_p="float",
            is_causal="bool",
            scale="float?",
            enable_gqa="bool",
        ),
    ),
    Call(
        "set_attention_backward",
        _fn_call(compile_ops.set_attention_backward, deterministic=True),
        dict(deterministic="bool"),
    ),
    Call(
        "moe_route",
        _fn_call(
            compile_ops.moe_route,
            x=lambda d, n: _t(6, n, device=d),
            router_weight=lambda d, n: _t(4, n, device=d),
            top_k=2,
            renormalize=True,
        ),
        dict(x="tensor", router_weight="tensor", top_k="int", renormalize="bool"),
    ),
    Call(
        "MoEFeedForward",
        _fn_call(
            compile_ops.MoEFeedForward,
            dim=lambda d, n: n,
            hidden_dim=8,
            num_experts=4,
            top_k=2,
            renormalize=True,
            expert_impl="auto",
        ),
        dict(dim="int", hidden_dim="int", num_experts="int", top_k="int", renormalize="bool", expert_impl="str"),
    ),
    Call(
        "MoEFeedForward.forward",
        _module_call(lambda n: compile_ops.MoEFeedForward(n, 8, 4), hidden_states=_x),
        dict(hidden_states="tensor"),
    ),
    Call(
        "block_sparse_attention",
        _fn_call(
            compile_ops.block_sparse_attention,
            q=_sparse_qkv,
            k=_sparse_qkv,
            v=_sparse_qkv,
            block_index=lambda d, n: _block_lists(d)[0],
            block_count=lambda d, n: _block_lists(d)[1],
            scale=None,
            causal=False,
            seq_dim=2,
            kv_lengths=None,
            return_lse=False,
            precision="exact",
        ),
        dict(_SPARSE_KINDS, return_lse="bool", precision="str"),
    ),
    Call(
        "block_sparse_attention_fp8_rows",
        _fn_call(
            compile_ops.block_sparse_attention_fp8_rows,
            q=_sparse_qkv16,
            k=_sparse_qkv16,
            v=_sparse_qkv16,
            block_index=lambda d, n: _block_lists(d)[0],
            block_count=lambda d, n: _block_lists(d)[1],
            token_order=lambda d, n: torch.arange(130, device=d).flip(0),
        ),
        dict(_SPARSE_KINDS, token_order="index?"),
    ),
    Call(
        "BlockSparseMask",
        _fn_call(
            compile_ops.BlockSparseMask,
            block_index=lambda d, n: _block_lists(d)[0],
            block_count=lambda d, n: _block_lists(d)[1],
        ),
        dict(block_index="index", block_count="index"),
    ),
    Call(
        "block_index_from_mask",
        _fn_call(
            compile_ops.block_index_from_mask, mask=lambda d, n: torch.ones(1, 2, 2, 2, dtype=torch.bool, device=d)
        ),
        dict(mask="mask"),
    ),
    Call(
        "sliding_tile_mask",
        _fn_call(compile_ops.sliding_tile_mask, tile_grid=(2, 2, 2), window=(1, 1, 1)),
        dict(tile_grid="ints", window="ints"),
    ),
    Call(
        "tile_permutation",
        _fn_call(compile_ops.tile_permutation, frames=2, height=4, width=6, tile=(1, 2, 3), ragged=False),
        dict(frames="int", height="int", width="int", tile="ints", ragged="bool"),
    ),
    Call(
        "radial_mask",
        _fn_call(compile_ops.radial_mask, frames=4, tokens_per_frame=128, dense_frames=1),
        dict(frames="int", tokens_per_frame="int", dense_frames="int"),
    ),
    Call(
        "sliding_tile_block_mask",
        _fn_call(compile_ops.sliding_tile_block_mask, frames=2, height=8, width=8, tile=(1, 8, 8), window=(1, 1, 1)),
        dict(frames="int", height="int", width="int", tile="ints", window="ints"),
    ),
    Call(
        "topk_block_index",
        _fn_call(
            compile_ops.topk_block_index,
            q=_sparse_qkv,
            k=_sparse_qkv,
            coverage=0.9,
            sink_blocks=1,
            scale=None,
            seq_dim=2,
        ),
        dict(q="tensor", k="tensor", coverage="float", sink_blocks="int", scale="float?", seq_dim="int"),
    ),
    Call(
        "quantize_fp8_rows",
        _fn_call(quantize_fp8_rows, x=_x, activation="none", head=None),
        dict(x="tensor", activation="str", head="tensor?"),
    ),
    Call(
        "fp8_linear",
        _fn_call(
            compile_ops.fp8_linear,
            x=_x,
            weight_q=lambda d, n: _fp8_weight(d, n).q,
            weight_scale=lambda d, n: _fp8_weight(d, n).scale,
            bias=lambda d, n: _t(4, device=d),
            fast_accum=True,
        ),
        dict(x="tensor", bias="tensor?", fast_accum="bool", weight_scale="tensor"),
    ),
    Call(
        "fp8_rows_lora",
        _fn_call(
            compile_ops.fp8_rows_lora,
            result=lambda d, n: _t(2, 3, 6, device=d),
            q=lambda d, n: _fp8_rows(d, n).q,
            scale=lambda d, n: _fp8_rows(d, n).scale,
            lora_a=lambda d, n: _t(4, n, device=d),
            lora_b=lambda d, n: _t(6, 4, device=d),
            scaling=0.5,
            scaling_tensor=lambda d, n: torch.full((), 2.0, device=d),
        ),
        dict(
            result="tensor",
            q="tensor",
            scale="tensor",
            lora_a="tensor",
            lora_b="tensor",
            scaling="float",
            scaling_tensor="tensor?",
        ),
    ),
    Call(
        "FP8Linear",
        _fn_call(compile_ops.FP8Linear, in_features=lambda d, n: n, out_features=4, bias=True, fast_accum=True),
        dict(in_features="int", out_features="int", bias="bool", fast_accum="bool"),
    ),
    Call(
        "FP8Linear.forward",
        _module_call(lambda n: compile_ops.FP8Linear.from_linear(nn.Linear(n, 4)), x=_x),
        dict(x="tensor"),
    ),
    Call(
        "FP8ProjectionActivation",
        _fn_call(
            compile_ops.FP8ProjectionActivation, proj=lambda d, n: compile_ops.FP8Linear(n, 4), activation="gelu_tanh"
        ),
        dict(proj="module", activation="str"),
    ),
    Call(
        "SlidingTile",
        _fn_call(compile_ops.SlidingTile, window=(3, 3, 3), tile=(2, 8, 8), dense_steps=0),
        dict(window="ints", tile="ints", dense_steps="int"),
    ),
    Call(
        "Radial",
        _fn_call(compile_ops.Radial, dense_frames=1, dense_steps=0),
        dict(dense_frames="int", dense_steps="int"),
    ),
    Call(
        "TopK",
        _fn_call(compile_ops.TopK, coverage=0.9, sink_blocks=1, tile=(2, 8, 8), dense_steps=0),
        dict(coverage="float", sink_blocks="int", tile="ints", dense_steps="int"),
    ),
    Call(
        "patch",
        _fn_call(
            compile_ops.patch,
            model=lambda d, n: nn.Sequential(nn.Linear(n, n)),
            attention_processors=True,
            attention_kernel="auto",
            precision="bf16",
            fp8_fast_accum=True,
            attention_precision="exact",
            attention_dense_steps=0,
            fp8_modulation=False,
        ),
        dict(
            model="module",
            attention_processors="bool",
            attention_kernel="str",
            precision="str",
            fp8_fast_accum="bool",
            attention_precision="str",
            attention_dense_steps="int",
            fp8_modulation="bool",
        ),
    ),
    Call(
        "unpatch",
        _fn_call(compile_ops.unpatch, model=lambda d, n: _patched(nn.Sequential(nn.Linear(n, n)))),
        dict(model="module"),
    ),
]

#: Functions that take no tensors: their calls are the same on every layer.
_NO_TENSORS = {
    "RMSNorm",
    "LayerNorm",
    "AdaLayerNormZero",
    "AdaLayerNormContinuous",
    "GEGLU",
    "MoEFeedForward",
    "grid_rope",
    "sliding_tile_mask",
    "tile_permutation",
    "radial_mask",
    "sliding_tile_block_mask",
    "FP8Linear",
    "FP8ProjectionActivation",
    "SlidingTile",
    "Radial",
    "TopK",
    "set_attention_backward",
    "patch",
    "unpatch",
}
#: Calls the fake-CUDA layer leaves to the others: modules (Python around the
#: ops the function calls cover; their parameters cannot move to a fake CUDA
#: device on a CPU-only build) and calls that query the GPU itself.
_NOT_FAKE = {call.name for call in CALLS if call.name.endswith(".forward")} | {"topk_block_index", "fp8_linear"}
#: The interpreter layer's representative set: one call per kernel family.
INTERPRETED = [
    "rmsnorm",
    "add_rmsnorm",
    "modulate",
    "gated_residual_norm_modulate",
    "rope_qk",
    "qk_norm_rope",
    "geglu",
    "attention",
    "moe_route",
    "quantize_fp8_rows",
    "fp8_rows_lora",
    "block_sparse_attention",
]
_BY_NAME = {call.name: call for call in CALLS}


#: The (call, hidden size, device, mode) whose valid call ran: once each is
#: enough, and under the interpreter it is most of an example's time.
_VALID_CALLS_RUN: set = set()


def _check(call: Call, data, device: str, mode) -> None:
    """Draw an argument of ``call``, a wrong value for it and the hidden size;
    the call with that value raises an error naming the argument (and the
    valid call, the first time these inputs are built, runs)."""
    argname = data.draw(st.sampled_from(sorted(call.kinds)), label="argument")
    n = data.draw(st.sampled_from([8, 16]), label="hidden size")
    with mode:
        key = (call.name, n, device, type(mode).__name__)
        if key not in _VALID_CALLS_RUN:
            fn, kwargs = call.build(device, n)
            fn(**kwargs)  # the valid call runs
            _VALID_CALLS_RUN.add(key)
        fn, kwargs = call.build(device, n)  # afresh: a call may change its module (patch)
        tensors = [name for name, value in kwargs.items() if isinstance(value, torch.Tensor)]
        alone = tensors == [argname] and not isinstance(fn, nn.Module)
        label, wrong = data.draw(
            st.sampled_from(mutations(call.kinds[argname], kwargs.get(argname), device, alone)), label="wrong value"
        )
        assert_names_the_argument(lambda: fn(**{**kwargs, argname: wrong}), argname)


@pytest.mark.parametrize("name", [call.name for call in CALLS])
@given(data=st.data())
def test_reference_path_names_the_wrong_argument(name, data):
    _check(_BY_NAME[name], data, "cpu", contextlib.nullcontext())


@pytest.mark.parametrize("name", [call.name for call in CALLS if call.name not in _NO_TENSORS | _NOT_FAKE])
@given(data=st.data())
def test_fake_cuda_tensors_name_the_wrong_argument(name, data):
    """What torch.compile traces: fake CUDA tensors, the fakes' validation."""
    _check(_BY_NAME[name], data, "cuda", FakeTensorMode(allow_non_fake_inputs=True))


@pytest.mark.kernels
@pytest.mark.parametrize("name", INTERPRETED)
@given(data=st.data())
def test_kernels_name_the_wrong_argument(name, data):
    """The Triton launch path (the eager fast path, which skips the dispatcher's own argument parsing)."""
    from conftest import KERNEL_DEVICE

    _check(_BY_NAME[name], data, KERNEL_DEVICE, contextlib.nullcontext())


def test_every_public_name_is_covered():
    """A new public function or module joins the suite (data containers and
    registration helpers are checked where they are consumed)."""
    containers = {"FP8Rows", "Int8QK", "GridRope", "register_diffusers_backend"}
    covered = {call.name.split(".")[0].split(" ")[0] for call in CALLS}
    assert set(compile_ops.__all__) - containers - covered == set()
