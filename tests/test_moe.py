"""The MoE routing family: fused.moe_route, its backward, and MoEFeedForward.

``kernels`` tests run the Triton kernels (CUDA, or CPU under the
interpreter: fp16/fp32 there, its bf16 dots are wrong) against:
- an fp64 reference with the two-reference tolerance rule for the
  probabilities, the routing weights and the gradients, where "what PyTorch
  computes at the input dtype" is the composite ``softmax(F.linear(x, w).float())``;
- exactly, the rules the outputs must satisfy among themselves: the experts
  are the stable descending top-k of the kernel's own probabilities (lowest
  index on ties), the weights are those probabilities (renormalized), and the
  counts and token lists are the reference's lists of the kernel's experts;
- the fp64 reference's expert choice, wherever the top-k margins exceed twice
  the kernel's largest probability error (a Hypothesis property).
The rest check the layouts by hand, the validation, and the module against a
plain PyTorch MoE layer, eager and compiled with fullgraph.
"""

import contextlib

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from bad_input import bad_input_test
from conftest import INTERPRET, KERNEL_DEVICE, concurrent_programs_only
from hypothesis import given, settings
from hypothesis import strategies as st
from numerics import assert_within_torch_error
from shapes import examples, size

import compile_ops
from compile_ops.reference.moe import expert_lists, top_k_descending

KERNEL_DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])


def _route_inputs(t, h, e, dtype, device, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(device, dtype).requires_grad_(requires_grad)
    w = (torch.randn(e, h, generator=g) * h**-0.5).to(device, dtype).requires_grad_(requires_grad)
    return x, w


def _composite(x, w, experts, renormalize):
    """The routing as a PyTorch model computes it: logits at x's dtype, softmax
    in fp32 (fp64 for fp64), the weights gathered at the given experts."""
    logits = F.linear(x, w)
    probs = torch.softmax(logits.double() if x.dtype == torch.float64 else logits.float(), dim=-1)
    weights = probs.gather(1, experts)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights


def _margins(probs, top_k):
    """Per row, the smallest gap between consecutive sorted probabilities among
    the first k + 1 (k + 1 only where it exists): how far the row is from a
    different top-k choice or order."""
    top = torch.sort(probs, dim=-1, descending=True).values[:, : top_k + 1]
    if top.shape[1] < 2:
        return torch.full((probs.shape[0],), float("inf"), dtype=probs.dtype)
    return (top[:, :-1] - top[:, 1:]).min(dim=1).values


# ---------------------------------------------------------------- layer 3/4: kernels vs reference


@st.composite
def route_cases(draw):
    e = draw(size(st.one_of(st.integers(1, 40), st.sampled_from([64, 130])), [4, 17, 64, 130]))
    top_k = draw(st.integers(1, min(e, 4)))
    t = draw(size(st.integers(0, 80), [1, 37, 200]))
    h = draw(size(st.integers(1, 96), [16, 72, 256]))
    dtype = draw(st.sampled_from(KERNEL_DTYPES))
    return t, h, e, top_k, dtype, draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 2**16))


def _split_router(split: bool):
    """With ``split``, every router runs the wide routers' path (the logits
    in slices of H, 32 columns wide, summed by the routing kernel), which only
    DiT-sized routers take by default; bench.toolkit's config override drops
    the launch plans recorded under the other config on the way in and out."""
    from bench.toolkit import module_config
    from compile_ops.ops import moe as moe_ops

    if not split:
        return contextlib.nullcontext()
    names = ("SPLIT_MIN_WEIGHT_BYTES", "SPLIT_COLUMNS", "ROUTE_BLOCK_H", "LOGITS_BLOCK_T")
    return module_config(moe_ops, *names)((0, 32, 32, 16))


@pytest.mark.kernels
@settings(max_examples=examples(30, 20))
@given(route_cases())
def test_kernels_match_the_reference_and_choose_its_experts(case):
    t, h, e, top_k, dtype, renormalize, split, seed = case
    x, w = _route_inputs(t, h, e, dtype, KERNEL_DEVICE, requires_grad=True, seed=seed)
    with _split_router(split):
        probs, weights, experts, counts, token_index = compile_ops.moe_route(x, w, top_k, renormalize)
    assert (probs.dtype, weights.dtype, experts.dtype, counts.dtype, token_index.dtype) == (
        torch.float32,
        torch.float32,
        torch.int64,
        torch.int32,
        torch.int32,
    )
    assert probs.shape == (t, e) and weights.shape == experts.shape == (t, top_k)
    assert counts.shape == (e,) and token_index.shape == (e, t)

    # Exact: the kernel's choice, weights and lists follow from its own probabilities.
    own_weights, own_experts = top_k_descending(probs.detach(), top_k)
    assert torch.equal(experts, own_experts)
    if renormalize:
        own_weights = own_weights / own_weights.sum(dim=-1, keepdim=True)
        # 2 ulps: the kernel sums the k values in a tree, torch in its own order.
        torch.testing.assert_close(weights.detach(), own_weights, rtol=4 * 2**-24, atol=0)
    else:
        assert torch.equal(weights.detach(), own_weights)
    want_counts, want_index = expert_lists(experts.cpu(), e)
    assert torch.equal(counts.cpu(), want_counts) and torch.equal(token_index.cpu(), want_index)

    # The two-reference rule, the weights taken at the kernel's experts (so that
    # a near-tie decided the other way does not count as a weight error).
    xd, wd = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    exact_probs, exact_weights = _composite(xd, wd, experts, renormalize)
    x_plain, w_plain = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    plain_probs, plain_weights = _composite(x_plain, w_plain, experts, renormalize)
    # fp32 logits sum H products at fp32 in the kernel's order (Triton's IEEE
    # dot: a running fma chain), each addition a rounding that cuBLAS's order
    # can dodge by luck: H terms of the floor, as the attention tests' fp32
    # gradients (the H100 found 3.8e-7 against torch's 1.1e-7 at H = 256, E = 4:
    # 3 ulps). A 16-bit x rounds torch's logits to its dtype, far coarser.
    summed = h if dtype in (torch.float32, torch.float64) else 1
    assert_within_torch_error(probs, exact_probs, plain_probs, 2.0, "probs", terms=summed)
    assert_within_torch_error(weights, exact_weights, plain_weights, 2.0, "weights", terms=top_k * summed)

    # The expert choice of the fp64 reference, wherever its margins exceed the
    # kernel's rounding error twice (then no error of that size can reorder them).
    if t > 0:
        error = (probs.double() - exact_probs.detach()).abs().max().item()
        clear = (_margins(exact_probs.detach(), top_k) > 2 * error).cpu()
        exact_experts = top_k_descending(exact_probs.detach(), top_k)[1]
        assert torch.equal(experts.cpu()[clear], exact_experts.cpu()[clear])

    # Gradients of both differentiable outputs.
    gp, gw = torch.randn_like(probs), torch.randn_like(weights)
    dx, dw = torch.autograd.grad((probs, weights), (x, w), (gp, gw))
    exact = torch.autograd.grad((exact_probs, exact_weights), (xd, wd), (gp.double(), gw.double()))
    plain = torch.autograd.grad((plain_probs, plain_weights), (x_plain, w_plain), (gp, gw))
    assert dx.dtype == dw.dtype == dtype
    # Each gradient sums e (dx) or t (dw) products of the logits' gradient, which carries
    # the logits' own rounding: fp32, the H terms of the probabilities' floor above (an H200
    # found dw 5.4 ulps off at t = 1, H = 256, E = 4 against torch's 0.9 by luck, seed 312968540).
    assert_within_torch_error(dx, exact[0], plain[0], 3.0, "dx", terms=e * summed)
    assert_within_torch_error(dw, exact[1], plain[1], 3.0, "d router_weight", terms=max(t, 1) * summed)


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernels_ties_go_to_the_lowest_expert_and_nan_rows_to_the_first(dtype):
    """Equal probabilities, exactly: duplicated router rows (1 = 3 the largest,
    0 = 4 next), an all-zero token (every expert equal), and a NaN token."""
    x, w = _route_inputs(4, 32, 6, dtype, KERNEL_DEVICE)
    x = x.abs() + 0.5
    w = torch.zeros_like(w)
    w[1] = w[3] = 0.2
    w[0] = w[4] = 0.1
    x[2] = 0.0
    x[3, 7] = float("nan")
    probs, weights, experts, counts, token_index = compile_ops.moe_route(x, w, 3, False)
    assert experts.tolist()[:2] == [[1, 3, 0]] * 2
    assert experts[2].tolist() == [0, 1, 2] and experts[3].tolist() == [0, 1, 2]
    assert probs[3].isnan().all() and weights[3].isnan().all() and not probs[:3].isnan().any()
    assert counts.tolist() == [4, 4, 2, 2, 0, 0]
    assert token_index.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [2, 3, 4, 4], [0, 1, 4, 4], [4] * 4, [4] * 4]


def _non_finite_route_inputs(dtype, device, infinite_weight):
    """``(x [9, 32], w [6, 32])``: tokens 0-5 not finite (+inf, -inf, NaN, a
    whole +inf row, a whole -inf row, two +inf), 6-8 finite. Router columns 3
    and 5 have chosen signs, so that the logits of tokens 0, 1 and 5 mix NaN,
    +inf and -inf away from experts 0 and 1. ``infinite_weight``: expert 4's
    column 0 is +inf too, which token 6 meets with a positive value (its
    logit +inf beside finite ones), token 7 with a negative one (-inf: finite
    probabilities, 0 for expert 4) and token 8 with 0 (NaN)."""
    inf, nan = float("inf"), float("nan")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 32, generator=g), torch.randn(6, 32, generator=g) * 32**-0.5
    w[:, 3] = torch.tensor([-1.0, -0.5, 0.7, 0.0, 0.2, -0.3])
    w[:, 5] = torch.tensor([0.3, -0.2, 0.1, -0.4, 0.5, -0.6])
    x[0, 3], x[1, 5], x[2, 7], x[3], x[4], x[5, 3], x[5, 5] = inf, -inf, nan, inf, -inf, inf, inf
    if infinite_weight:
        w[4, 0], x[6, 0], x[7, 0], x[8, 0] = inf, 1.0, -1.0, 0.0
    return x.to(device, dtype), w.to(device, dtype)


def _check_non_finite_routing(dtype, device, infinite_weight, renormalize):
    """moe_route against torch.topk on the logits of a PyTorch router
    (``F.linear`` in fp32): a token whose probabilities are NaN takes the
    experts of the largest logits in torch.topk's order (NaN, +inf, the
    numbers, -inf; the lowest expert first among equal logits) and NaN weights;
    the other tokens route by their probabilities as before, and those beside
    finite tokens only route as they do beside the non-finite ones."""
    top_k = 3
    x, w = _non_finite_route_inputs(dtype, device, infinite_weight)
    probs, weights, experts, counts, token_index = compile_ops.moe_route(x, w, top_k, renormalize)
    logits = F.linear(x.float(), w.float()).cpu()
    plain_probs = torch.softmax(logits, dim=-1)
    nan_rows = plain_probs.isnan().any(-1)
    assert torch.equal(probs.isnan().cpu(), nan_rows[:, None].expand(-1, 6))
    assert nan_rows[:6].all() and nan_rows.tolist()[6:] == ([True, False, True] if infinite_weight else [False] * 3)
    experts = experts.cpu()
    key = torch.where(nan_rows[:, None], logits, plain_probs)
    assert torch.equal(experts, torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :top_k])
    # torch.topk's values: the same logits (NaN as NaN) and probabilities, largest first.
    chosen, top = logits[nan_rows].gather(1, experts[nan_rows]), torch.topk(logits[nan_rows], top_k).values
    assert torch.equal(chosen.isnan(), top.isnan()) and torch.equal(chosen.nan_to_num(), top.nan_to_num())
    assert torch.equal(
        probs.cpu()[~nan_rows].gather(1, experts[~nan_rows]), torch.topk(probs.cpu()[~nan_rows], top_k).values
    )
    if not infinite_weight:  # not the old choice, experts 0, 1, 2
        assert experts[[0, 1, 5]].tolist() == [[3, 2, 4], [1, 3, 5], [0, 3, 2]]
    assert weights.cpu()[nan_rows].isnan().all() and torch.isfinite(weights.cpu()[~nan_rows]).all()
    clean = compile_ops.moe_route(torch.where(nan_rows.to(device)[:, None], 0.0, x).to(dtype), w, top_k, renormalize)
    finite = ~nan_rows.to(device)
    for got, want in zip((probs, weights, experts.to(device)), clean[:3]):
        assert torch.equal(got[finite], want[finite])
    want_counts, want_index = expert_lists(experts, 6)
    assert torch.equal(counts.cpu(), want_counts) and torch.equal(token_index.cpu(), want_index)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("infinite_weight", [False, True])
def test_non_finite_tokens_route_as_torch_topk_of_the_logits(infinite_weight, renormalize):
    _check_non_finite_routing(torch.float32, "cpu", infinite_weight, renormalize)


@pytest.mark.kernels
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("infinite_weight", [False, True])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernels_non_finite_tokens_route_as_torch_topk_of_the_logits(dtype, infinite_weight, split):
    """Both routing kernels' paths: logits in one program, or summed from slices of H."""
    with _split_router(split):
        _check_non_finite_routing(dtype, KERNEL_DEVICE, infinite_weight, True)


@pytest.mark.parametrize("route_block_h", [32, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_launch_configs_keep_the_dot_chunk_at_16_or_more(dtype, route_block_h, monkeypatch):
    """Every routing config's H chunk is at least tl.dot's K of 16, also for
    routers past 64 experts (whose chunk is halved) and the tests' narrow
    wide-router override (32 columns): the interpreter runs a chunk of 8, the
    GPU's compiler rejects it (found on an H100: fp32, E = 130)."""
    from compile_ops.ops import moe as moe_ops

    monkeypatch.setattr(moe_ops, "ROUTE_BLOCK_H", route_block_h)
    for e in (4, 64, 65, 130, 256):
        assert moe_ops.launch_config(e, 16, dtype).block_h >= 16, (e, dtype)


@pytest.mark.kernels
@pytest.mark.skipif(not INTERPRET, reason="a property of triton's interpreter, which runs bf16 dots on raw bits")
def test_kernels_refuse_bf16_under_the_interpreter():
    """bf16 routing under TRITON_INTERPRET=1 raises where it used to pick
    experts from garbage logits: the interpreter multiplies bf16 dot operands
    as integers."""
    x, w = _route_inputs(8, 64, 4, torch.bfloat16, KERNEL_DEVICE)
    with pytest.raises(TypeError, match=r"fused.moe_route: x is bfloat16, whose matrix products triton's"):
        compile_ops.moe_route(x, w, 2)


@pytest.mark.kernels
@concurrent_programs_only
def test_kernels_reruns_are_bit_identical():
    x, w = _route_inputs(4096, 512, 64, torch.bfloat16, KERNEL_DEVICE, requires_grad=True)
    runs = []
    for _ in range(3):
        outs = compile_ops.moe_route(x, w, 2)
        grads = torch.autograd.grad(outs[:2], (x, w), (torch.ones_like(outs[0]), torch.ones_like(outs[1])))
        runs.append(outs + grads)
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))


def plain_moe(x, router_weight, w_in, w_out, top_k, renormalize):
    """A plain PyTorch MoE SwiGLU layer (Mixtral/HiDream style) on ``x [T, dim]``
    with MoEFeedForward's weight layout: gate rows, then value rows."""
    probs = torch.softmax(F.linear(x, router_weight).to(torch.promote_types(x.dtype, torch.float32)), dim=-1)
    weights, experts = torch.topk(probs, top_k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros(x.shape, dtype=weights.dtype, device=x.device)
    for e in range(router_weight.shape[0]):
        token, slot = torch.where(experts == e)
        gate, value = F.linear(x[token], w_in[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * value, w_out[e])
        out = out.index_add(0, token, y.to(weights.dtype) * weights[token, slot, None])
    return out.to(x.dtype)


def _check_module_against_plain(module, x, rtol, atol):
    out = module(x)
    want = plain_moe(
        x.reshape(-1, x.shape[-1]), module.router.weight, module.w_in, module.w_out, module.top_k, module.renormalize
    ).reshape(x.shape)
    torch.testing.assert_close(out, want, rtol=rtol, atol=atol)
    params = [x, *module.parameters()]
    dy = torch.randn_like(out)
    for got, ref in zip(torch.autograd.grad(out, params, dy), torch.autograd.grad(want, params, dy)):
        torch.testing.assert_close(got, ref, rtol=rtol, atol=atol)
    return out


@pytest.mark.kernels
def test_kernels_module_is_a_plain_moe_layer():
    torch.manual_seed(0)
    module = compile_ops.MoEFeedForward(32, 48, 6, top_k=2, expert_impl="loop").to(KERNEL_DEVICE)
    x = torch.randn(2, 9, 32, device=KERNEL_DEVICE, requires_grad=True)
    _check_module_against_plain(module, x, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- reference path: layouts, module, compile


def test_layouts_by_hand():
    """counts and token_index of a routing written out by hand (the reference's lists)."""
    experts = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2], [3, 1]])
    counts, token_index = expert_lists(experts, 5)
    assert counts.tolist() == [3, 3, 3, 1, 0]
    assert token_index.tolist() == [[0, 1, 3, 5, 5], [1, 2, 4, 5, 5], [0, 2, 3, 5, 5], [4, 5, 5, 5, 5], [5] * 5]
    values, indices = top_k_descending(torch.tensor([[0.2, 0.3, 0.2, 0.3], [0.25] * 4]), 3)
    assert indices.tolist() == [[1, 3, 0], [0, 1, 2]] and values[0].tolist() == pytest.approx([0.3, 0.3, 0.2])


@pytest.mark.parametrize("impl,dtype", [("loop", torch.float64), ("grouped_mm", torch.float32)])
def test_module_is_a_plain_moe_layer_on_the_reference_path(impl, dtype):
    if impl == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    torch.manual_seed(0)
    module = compile_ops.MoEFeedForward(16, 24, 5, top_k=2, renormalize=impl == "loop", expert_impl=impl).to(dtype)
    x = torch.randn(3, 7, 16, dtype=dtype, requires_grad=True)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    _check_module_against_plain(module, x, **tol)


@pytest.mark.parametrize("impl,dtype", [("loop", torch.float32), ("grouped_mm", torch.bfloat16)])
def test_module_compiles_fullgraph_forward_and_backward(impl, dtype):
    """No graph break (fullgraph) and one compile, forward and backward, with
    the same outputs and gradients as eager. (grouped_mm's fake kernel takes
    bf16 only, as the CUDA kernel does.)"""
    if impl == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    torch.manual_seed(0)
    module = compile_ops.MoEFeedForward(16, 24, 5, top_k=2, expert_impl=impl).to(dtype)
    x = torch.randn(2, 7, 16, dtype=dtype, requires_grad=True)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, backend=counter, fullgraph=True)
    params = [x, *module.parameters()]
    out, want = compiled(x), module(x)
    dy = torch.randn_like(out)
    for got, ref in zip((out, *torch.autograd.grad(out, params, dy)), (want, *torch.autograd.grad(want, params, dy))):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1


# ---------------------------------------------------------------- bad input


def _bad_input_cases():
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    probs, weights, experts, _, _ = compile_ops.moe_route(x, w, 2)
    return [
        (lambda: compile_ops.moe_route(x, w, 4), ValueError, r"moe_route: top_k must be in \[1, E\] = \[1, 3\].*got 4"),
        (lambda: compile_ops.moe_route(x, w, 0), ValueError, r"top_k must be in \[1, E\].*got 0"),
        (lambda: compile_ops.moe_route(x, w, 1.5), TypeError, r"top_k must be an int, got float"),
        (lambda: compile_ops.moe_route(x, w, 2, renormalize=1), TypeError, r"renormalize must be a bool, got int"),
        (
            lambda: compile_ops.moe_route(x, torch.randn(257, 8), 2),
            ValueError,
            r"router_weight must have between 1 and 256 experts \(rows\), got E = 257",
        ),
        (
            lambda: compile_ops.moe_route(x, w.bfloat16(), 2),
            TypeError,
            r"router_weight must have x's dtype torch.float32, got torch.bfloat16",
        ),
        (lambda: compile_ops.moe_route(x.half(), w, 2), TypeError, r"router_weight must have x's dtype torch.float16"),
        (lambda: compile_ops.moe_route(x[None], w, 2), ValueError, r"x must be 2-D \[T, H\].*\(1, 4, 8\)"),
        (lambda: compile_ops.moe_route(x, w[0], 1), ValueError, r"router_weight must be 2-D \[E, H\]"),
        (
            lambda: compile_ops.moe_route(x, torch.randn(3, 9), 2),
            ValueError,
            r"router_weight must have shape \[E, 8\] \(H = x.shape\[1\]\), got \(3, 9\)",
        ),
        (lambda: compile_ops.moe_route(x.long(), w, 2), TypeError, r"x must have a floating dtype"),
        (lambda: compile_ops.moe_route(x, w.to("meta"), 2), ValueError, r"router_weight is on meta but x is on cpu"),
        (
            lambda: torch.ops.fused.moe_route_backward(probs, weights[:, :1], x, w, probs, experts, True),
            ValueError,
            r"grad_weights must have experts' shape \(4, 2\), got \(4, 1\)",
        ),
        (
            lambda: torch.ops.fused.moe_route_backward(probs, weights, x, w, probs, experts.int(), True),
            ValueError,
            r"experts must be int64 \[T=4, k\]",
        ),
        (
            lambda: compile_ops.MoEFeedForward(8, 8, 4, expert_impl="triton"),
            ValueError,
            r"expert_impl must be one of \('auto', 'loop', 'grouped_mm'\)",
        ),
    ]


test_bad_input_raises_a_clear_error = bad_input_test(_bad_input_cases)
