"""compile_ops' sparse layouts, 8-bit precisions and key lengths under diffusers' ring attention.

In one process: the ring steps of ``compile_ops/integrations/diffusers/ring.py``
run shard by shard in diffusers' rotation order and are merged as diffusers'
ring template merges them (by log-sum-exp), against the whole-sequence call:
sparse layouts (SlidingTile, Radial, TopK, a BlockSparseMask), key lengths
(with rows that see no key of their own shard), their gradients, and 8-bit
attention with its smoothing's lse shift put back.

On gloo ranks (CPU, the reference path; ``tests/gloo_ranks.py``): tiny Wan and
Flux models patched in a mode, run on one process, then under ring-2 (2 ranks)
and ring-2 x Ulysses-2 (4 ranks), against the one-process output; the refusals
(shards that are not whole blocks, tiles across shards) from the model's
forward; and forward + backward through diffusers' ring autograd function.

Tolerances: exact modes (sparse, TopK, key lengths) run fp32 attention merged
in another order: test_context_parallel's RING_TOLERANCE. 8-bit modes: each
ring step quantizes its own key shard (its own k mean and block scales, and v
scales for FP8 P V), one process quantizes every key at once, so the two differ
by about the quantization's own error: at most twice the one-process 8-bit
result's distance from exact attention (relative L2).
"""

import types
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_cases, spawn_verdicts
from test_context_parallel import (
    RING_TOLERANCE,
    SPAWN_TIMEOUT_S,
    UNIFIED_WORLD,
    WORLD,
    _context_parallel_config,
    _flux,
    _setup_config,
    _Spy,
    _wan,
)

import compile_ops
from compile_ops.integrations.diffusers import ring
from compile_ops.integrations.sparse_attention import Radial, SlidingTile, TopK
from compile_ops.ops.block_sparse import BlockSparseMask, block_means, block_sparse_attention

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

#: Each sparse mode, with the latent frames, height and width (Wan's 4 input channels,
#: (1, 2, 2) patches) that make its layout sparse and its ring shards whole tiles.
SPARSE = {
    "sliding_tile": (lambda: SlidingTile(window=(2, 1, 1), tile=(2, 8, 8)), (4, 32, 32)),
    "radial": (lambda: Radial(dense_frames=0), (4, 32, 64)),
    "topk": (lambda: TopK(coverage=0.5, tile=(2, 8, 8)), (4, 32, 32)),
}
EIGHT_BIT = ("int8", "int8_fp8")
#: A mode: a sparse layout, an 8-bit precision, or both ("sliding_tile_int8_fp8").
MODEL_CASES = {
    WORLD: [("wan", mode, "ring") for mode in (*SPARSE, *EIGHT_BIT, "sliding_tile_int8_fp8")]
    + [("flux", mode, "ring") for mode in EIGHT_BIT],
    UNIFIED_WORLD: [("wan", mode, "unified") for mode in ("sliding_tile", "topk", "int8")],
}
REFUSALS = {
    # 3 x 8 x 8 tokens: ring shards of 96, not whole 128-token blocks.
    "shards-not-whole-blocks": (SlidingTile(window=(1, 1, 1), tile=(1, 8, 8)), (3, 16, 16), "whole 128-token blocks"),
    # 4-frame tiles across shards of 2 frames.
    "tiles-across-shards": (SlidingTile(window=(1, 1, 1), tile=(4, 8, 8)), (4, 32, 32), "moves tokens between ring"),
}
ATTENTION_CASES = {WORLD: ["lengths-ring", "sliding_tile-ring", "topk-ring"], UNIFIED_WORLD: ["lengths-unified"]}


def _relative_l2(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _sparse_and_precision(mode: str) -> tuple:
    """``(SPARSE key or None, precision)`` of a mode name."""
    for sparse in SPARSE:
        if mode.startswith(sparse):
            return sparse, mode[len(sparse) + 1 :] or "exact"
    return None, mode


def _patched(model_name: str, sparse, precision: str, dtype):
    """A tiny Wan or Flux patched with ``sparse``'s layout (Wan: on its latents) in ``precision``."""
    torch.manual_seed(0)
    model, inputs = {"wan": _wan, "flux": _flux}[model_name](dtype)
    options = {} if precision == "exact" else dict(attention_precision=precision)
    if sparse is not None:
        inputs["hidden_states"] = torch.randn(1, 4, *SPARSE[sparse][1], dtype=dtype)
        options["attention"] = SPARSE[sparse][0]()
    compile_ops.patch(model, **options)
    return model, inputs


def _model_case(model_name: str, mode: str, parallelism: str) -> None:
    sparse, precision = _sparse_and_precision(mode)
    dtype = torch.float32 if precision == "exact" else torch.bfloat16
    model, inputs = _patched(model_name, sparse, precision, dtype)
    with torch.no_grad():
        one_process = model(**inputs, return_dict=False)[0]
    with mock.patch("torch.accelerator.device_count", return_value=1):  # a CPU has no accelerator
        model.enable_parallelism(config=_context_parallel_config(parallelism))
    with torch.no_grad(), _Spy() as spy:
        parallel = model(**inputs, return_dict=False)[0]
    assert (precision, sparse is not None) in spy.calls, f"the fused {mode} path did not run: {spy.calls}"
    if precision == "exact":
        torch.testing.assert_close(parallel, one_process, **RING_TOLERANCE)
        return
    exact_model, _ = _patched(model_name, sparse, "exact", dtype)
    with torch.no_grad():
        exact = exact_model(**inputs, return_dict=False)[0]
    quantization = _relative_l2(one_process, exact)
    assert 0 < _relative_l2(parallel, one_process) <= 2 * quantization, (
        f"{mode} under {parallelism}: {_relative_l2(parallel, one_process):.3g} from one process, whose "
        f"quantization error is {quantization:.3g}"
    )


def _refusal_case(name: str) -> None:
    config, latents, message = REFUSALS[name]
    torch.manual_seed(0)
    model, inputs = _wan(torch.float32)
    inputs["hidden_states"] = torch.randn(1, 4, *latents)
    compile_ops.patch(model, attention=config)
    with mock.patch("torch.accelerator.device_count", return_value=1):
        model.enable_parallelism(config=_context_parallel_config("ring"))
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        model(**inputs)


def _attention_case(name: str, rank: int) -> None:
    """Forward and backward of this rank's shard through diffusers' templates
    against the one-process call on the whole sequence."""
    from compile_ops.integrations.diffusers.context_parallel import parallel_attention

    mode, parallelism = name.split("-")
    config = _setup_config(parallelism, rank)
    torch.manual_seed(0)
    b, length, heads, d = (2, 512, 4, 16) if mode == "lengths" else (1, 1024, 4, 16)
    q, k, v = (torch.randn(b, length, heads, d, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, length, heads, d)
    # The second sample's keys end inside the first ring shard: the rest see none of theirs.
    lengths = torch.tensor([length - 100, length // 4]) if mode == "lengths" else None
    layout = None if mode == "lengths" else LAYOUTS[mode]()
    if layout is None:
        full = compile_ops.attention(q, k, v, seq_dim=1, kv_lengths=lengths)
    else:
        full = layout.attend(q, k, v)
    full.backward(grad)
    world = dist.get_world_size()  # rank r holds the r-th sequence chunk, as diffusers' plans split it
    shard = slice(rank * length // world, (rank + 1) * length // world)
    local = [t.detach()[:, shard].clone().requires_grad_() for t in (q, k, v)]
    out = parallel_attention(*local, config, layout=layout, kv_lengths=lengths, kernel="fused")
    out.backward(grad[:, shard])
    torch.testing.assert_close(out, full.detach()[:, shard], **RING_TOLERANCE)
    for which, mine, theirs in zip("qkv", local, (q, k, v)):
        torch.testing.assert_close(
            mine.grad, theirs.grad[:, shard], **RING_TOLERANCE, msg=lambda m, which=which: f"d{which}: {m}"
        )


def _worker(rank: int, world: int, directory: str) -> None:
    """This world size's cases on this rank; writes ``{case: None or the failure}``."""

    def cases():
        named = {"-".join(case): lambda case=case: _model_case(*case) for case in MODEL_CASES[world]}
        named.update({name: lambda name=name: _attention_case(name, rank) for name in ATTENTION_CASES[world]})
        if world == WORLD:
            named.update({f"refused-{name}": lambda name=name: _refusal_case(name) for name in REFUSALS})
        return named

    run_cases(rank, world, directory, cases)


def _case_names(world: int) -> list:
    names = ["-".join(case) for case in MODEL_CASES[world]] + ATTENTION_CASES[world]
    return names + ([f"refused-{name}" for name in REFUSALS] if world == WORLD else [])


@pytest.fixture(scope="module")
def ring_verdicts(tmp_path_factory):
    return spawn_verdicts(_worker, WORLD, str(tmp_path_factory.mktemp("ring")), SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def unified_verdicts(tmp_path_factory):
    return spawn_verdicts(_worker, UNIFIED_WORLD, str(tmp_path_factory.mktemp("ring_unified")), SPAWN_TIMEOUT_S)


@pytest.mark.parametrize("name", _case_names(WORLD))
def test_ring_matches_one_process(ring_verdicts, name):
    if ring_verdicts[name] is not None:
        pytest.fail(ring_verdicts[name], pytrace=False)


@pytest.mark.parametrize("name", _case_names(UNIFIED_WORLD))
def test_ring_and_ulysses_match_one_process(unified_verdicts, name):
    if unified_verdicts[name] is not None:
        pytest.fail(unified_verdicts[name], pytrace=False)


# ---------------------------------------------------------------- in one process: the ring steps


def _ring_config(ring_degree: int, rank: int):
    """What :func:`ring.forward_step` reads of diffusers' ``ParallelConfig`` for ring rank ``rank``."""
    cp = types.SimpleNamespace(ring_degree=ring_degree, _ring_local_rank=rank)
    return types.SimpleNamespace(context_parallel_config=cp)


def _merged(parts: list) -> tuple:
    """diffusers' ring merge (``TemplatedRingAttention.forward``) of ``[(out, lse)]`` in step order."""
    out, lse = parts[0][0].float(), parts[0][1].unsqueeze(-1)
    for step_out, step_lse in parts[1:]:
        step_lse = step_lse.unsqueeze(-1)
        out = out - torch.sigmoid(step_lse - lse) * (out - step_out.float())
        lse = lse - torch.nn.functional.logsigmoid(lse - step_lse)
    return out, lse.squeeze(-1)


def _ring(q, k, v, ring_degree: int, monkeypatch, backward_of=None, **mode) -> tuple:
    """Every ring rank's :func:`ring.forward_step` calls in diffusers' order,
    merged: ``(out, lse)`` of the whole sequence; with ``backward_of`` (the
    output's gradient), the q, k, v gradients of :func:`ring.backward_step`
    summed as diffusers' ring backward sums them. The two collectives a
    step makes read the whole sequence here."""
    shards = [t.split(q.shape[1] // ring_degree, 1) for t in (q, k, v)]
    monkeypatch.setattr(ring, "_key_norm_bound", lambda key, config: torch.linalg.vector_norm(k, dim=-1).amax())

    def all_key_means(key, config):  # each shard's block means, as every rank computes its own
        plan = config.plan
        return torch.cat([block_means(plan.permuted(shard, s), seq_dim=1) for s, shard in enumerate(shards[1])], 2)

    monkeypatch.setattr(ring, "_all_key_means", all_key_means)
    outs, lses, grads = [], [], [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(ring_degree):
        config, ctx, parts = _ring_config(ring_degree, rank), types.SimpleNamespace(), []
        if mode.get("layout") is not None:
            config.plan = ring.ring_layout(mode["layout"], ring_degree, rank, q.shape[1] // ring_degree)
        order = [(rank + step) % ring_degree for step in range(ring_degree)]
        query = shards[0][rank]
        for step, s in enumerate(order):
            parts.append(ring.forward_step(ctx, query, shards[1][s], shards[2][s], None, config, step == 0, **mode))
        out, lse = _merged(parts)
        outs.append(out)
        lses.append(lse)
        if backward_of is None:
            continue
        rows = slice(rank * query.shape[1], (rank + 1) * query.shape[1])
        for s in order:
            keys = slice(s * query.shape[1], (s + 1) * query.shape[1])
            dq, dk, dv = ring.backward_step(ctx, backward_of[:, rows], query, shards[1][s], shards[2][s], out, lse)
            grads[0][:, rows] += dq
            grads[1][:, keys] += dk
            grads[2][:, keys] += dv
    return torch.cat(outs, 1), torch.cat(lses, 1), grads


def _mask_layout():
    """The attention backend's layout of a BlockSparseMask: 8 blocks, each query block seeing its
    own and the block 5 ahead (a block of the other half, under ring-2)."""
    from compile_ops.integrations.attention_backend import _MaskLayout

    eye = torch.eye(8, dtype=torch.bool)
    return _MaskLayout(BlockSparseMask.from_block_mask((eye | eye.roll(5, 1))[None, None]))


LAYOUTS = {
    "sliding_tile": lambda: SPARSE["sliding_tile"][0]().layout((4, 16, 16), "cpu"),
    "radial": lambda: SPARSE["radial"][0]().layout((4, 16, 32), "cpu"),
    "topk": lambda: SPARSE["topk"][0]().layout((4, 16, 16), "cpu"),
    "block_sparse_mask": _mask_layout,
}


@pytest.mark.parametrize(
    "name, ring_degree", [("sliding_tile", 2), ("radial", 2), ("radial", 4), ("topk", 2), ("block_sparse_mask", 2)]
)
def test_ring_steps_of_a_sparse_layout_merge_to_the_whole_sequence(name, ring_degree, monkeypatch):
    layout = LAYOUTS[name]()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1024 if name != "radial" else 2048, 2, 16, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    full = layout.attend(q, k, v)
    full.backward(grad)
    detached = [t.detach() for t in (q, k, v)]
    out, lse, grads = _ring(
        *detached, ring_degree, monkeypatch, grad, precision="exact", layout=layout, kv_lengths=None
    )
    density = getattr(layout, "density", None)
    assert density is None or density < 1, "a dense layout: a weak test"
    torch.testing.assert_close(out, full.detach(), **RING_TOLERANCE)
    for which, got, want in zip("qkv", grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want, **RING_TOLERANCE, msg=lambda m, which=which: f"d{which}: {m}")


@pytest.mark.parametrize("ring_degree", [2, 4])
def test_ring_steps_with_key_lengths_merge_to_one_call(ring_degree, monkeypatch):
    """The second sample's keys end inside the first shard: under ring-4 ranks 1-3 see none of
    theirs in their first step, and the third shard's rows would merge to NaN at -inf."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 512, 2, 16, requires_grad=True) for _ in range(3))
    lengths = torch.tensor([400, 100])
    grad = torch.randn_like(q)
    full, full_lse = compile_ops.attention(q, k, v, seq_dim=1, kv_lengths=lengths, return_lse=True)
    full.backward(grad)
    detached = [t.detach() for t in (q, k, v)]
    mode = dict(precision="exact", layout=None, kv_lengths=lengths)
    out, lse, grads = _ring(*detached, ring_degree, monkeypatch, grad, **mode)
    torch.testing.assert_close(out, full.detach(), **RING_TOLERANCE)
    torch.testing.assert_close(lse, full_lse.transpose(1, 2), **RING_TOLERANCE)
    for which, got, want in zip("qkv", grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want, **RING_TOLERANCE, msg=lambda m, which=which: f"d{which}: {m}")
    monkeypatch.setattr(ring, "floor_empty_rows", lambda lse, *args: lse)
    unfloored, _, _ = _ring(*detached, ring_degree, monkeypatch, **mode)
    assert torch.isnan(unfloored).any() == (ring_degree > 2), "the floor is what keeps the merge finite"


@pytest.mark.parametrize("precision", EIGHT_BIT)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sliding_tile"])
def test_ring_steps_of_8bit_attention_merge_with_the_smoothing_put_back(precision, sparse, monkeypatch):
    """Keys whose mean differs between the two halves (DiT keys carry large
    channel offsets): each step smooths its own shard by its own mean, so
    without the shift the shards' weights are off by ``scale * q . (mean_0 - mean_1)``."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1024, 2, 32) for _ in range(3))
    k[:, :512] += 2 * torch.randn(32)
    k[:, 512:] -= 2 * torch.randn(32)
    q, k, v = (t.bfloat16() for t in (q, k, v))
    layout = LAYOUTS["sliding_tile"]() if sparse else None
    wide = [t.float() for t in (q, k, v)]
    exact = layout.attend(*wide) if sparse else compile_ops.attention(*wide, seq_dim=1)
    if sparse:
        permuted = (t.index_select(1, layout.perm) for t in (q, k, v))
        one_call = block_sparse_attention(*permuted, layout.index, layout.count, seq_dim=1, precision=precision)
        one_call = one_call.index_select(1, layout.inverse)
    else:
        one_call = compile_ops.attention(q, k, v, seq_dim=1, precision=precision)
    quantization = _relative_l2(one_call, exact)
    mode = dict(precision=precision, layout=layout, kv_lengths=None)
    out, _, _ = _ring(q, k, v, 2, monkeypatch, **mode)
    assert _relative_l2(out, one_call) <= 2 * quantization, (_relative_l2(out, one_call), quantization)
    monkeypatch.setattr(ring, "smoothing_shift", lambda query, key, scale: torch.zeros(()))
    unshifted, _, _ = _ring(q, k, v, 2, monkeypatch, **mode)
    assert _relative_l2(unshifted, one_call) > 4 * quantization, "the shift is what merges the shards right"


def test_ring_refuses_layouts_it_cannot_split():
    tiles = SlidingTile(window=(1, 1, 1), tile=(4, 8, 8)).layout((4, 16, 16), "cpu")
    with pytest.raises(ValueError, match=r"moves tokens between ring shards.*ulysses_degree"):
        ring.ring_layout(tiles, 2, 0, 512, "owner")
    radial = Radial().layout((3, 8, 8), "cpu")
    message = r"owner: .*whole 128-token blocks.*sequence of 192 tokens splits into shards of 96 tokens.*by 256"
    with pytest.raises(ValueError, match=message):
        ring.ring_layout(radial, 2, 0, 96, "owner")
