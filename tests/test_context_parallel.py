"""compile_ops under diffusers' context parallelism: 2 CPU processes on gloo, the reference path.

Each model case builds a small Wan, Flux or LTX-Video model, patches it in one attention
mode (exact, int8, int8_fp8, sliding-tile sparse, sliding-tile sparse in int8_fp8),
runs it on one process,
then turns on diffusers' context parallelism (Ulysses-2 or ring-2) and runs it
again. Ulysses moves whole heads between ranks, so each head's computation is
the one the single process ran: Wan's outputs must be equal bit for bit (Flux's
joint keys arrive in another order, LTX differs in the last bit: fp32
attention tolerance). Ring
merges per-shard partial outputs by their log-sum-exp: equal within fp32
attention tolerance, sparse modes included (the 8-bit modes under ring, which
quantize each key shard on its own: tests/test_context_parallel_ring.py). A
spy on the forward op given to diffusers' templates proves the fused path ran
(not the original processor) in the requested mode.

The attention cases run the forward and backward ops through diffusers'
Ulysses and ring autograd functions directly and compare q/k/v gradients with
the single-process op's.

One spawn runs every case (a process group costs seconds to start); each case
is a test of its own that reads the spawn's verdict.
"""

import functools
from unittest import mock

import pytest
import tiny_models
import torch
import torch.distributed as dist
from gloo_ranks import run_cases, spawn_verdicts

import compile_ops

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

WORLD = 2
#: Ring-2 x Ulysses-2 (diffusers' unified attention) needs 4 ranks.
UNIFIED_WORLD = 4
#: Wall-clock limit of a spawn: two (or four) imports of torch, diffusers and compile_ops
#: on a busy 2-core CI box, then a few dozen tiny model runs.
SPAWN_TIMEOUT_S = 300
#: fp32 attention computed in a different order (ring's merge of two shards).
RING_TOLERANCE = dict(rtol=1e-5, atol=1e-5)

#: ``patch``'s options of each attention mode.
MODES = {
    "exact": lambda: {},
    "int8": lambda: dict(attention_precision="int8"),
    "int8_fp8": lambda: dict(attention_precision="int8_fp8"),
    "sliding_tile": lambda: dict(attention=compile_ops.SlidingTile(window=(1, 1, 1), tile=(2, 8, 8))),
    # 8-bit block-sparse attention with FP8 P V (Ulysses: each rank quantizes whole sequences of its heads).
    "sliding_tile_int8_fp8": lambda: dict(
        attention=compile_ops.SlidingTile(window=(1, 1, 1), tile=(2, 8, 8)), attention_precision="int8_fp8"
    ),
}
#: (model, mode, parallelism) of each model case; Flux has no sparse mode, and the 8-bit
#: modes under ring are tests/test_context_parallel_ring.py's (another tolerance).
MODEL_CASES = [
    (model, mode, parallelism)
    for model in ("wan", "flux", "ltx", "hunyuan")
    for mode in MODES
    for parallelism in ("ulysses", "ring")
    if not (model == "flux" and mode.startswith("sliding_tile"))
    and not ("int8" in mode and parallelism == "ring")
    and not (model == "hunyuan" and parallelism == "ring")  # refused: the text is whole on every rank
] + [
    # q/k/v from diffusers' fused projections: views of one GEMM's output reach the exchanges.
    ("flux_fused", "int8_fp8", "ulysses"),
    ("flux_fused", "exact", "ring"),
    ("wan_fused", "sliding_tile", "ulysses"),
    ("wan_fused", "exact", "ring"),
]
UNIFIED_CASES = ["attention-exact-unified", "backend-exact-unified", "backend-sparse-unified"]
ATTENTION_CASES = [
    "attention-exact-ulysses",
    "attention-exact-ulysses_anything",
    "attention-exact-ring",
    "attention-sparse-ulysses",
    "backend-exact-ring",
    "backend-sparse-ring",
    "exchange-exact-ulysses",
    "exchange-int8_fp8-ulysses",
    "exchange-exact-ulysses-pipelined",
    "exchange-int8_fp8-ulysses-pipelined",
    "tail-exact-ulysses",
]


def _wan(dtype):
    # 4 x 16 x 16 latents in (1, 2, 2) patches: 256 tokens, two 128-token blocks, so
    # a sliding-tile window of one (2, 8, 8) tile is sparse (half the blocks).
    model = tiny_models.wan(attention_head_dim=16, freq_dim=16).to(dtype).eval()
    inputs = dict(
        hidden_states=torch.randn(1, 4, 4, 16, 16, dtype=dtype),
        encoder_hidden_states=torch.randn(1, 6, 16, dtype=dtype),
        timestep=torch.tensor([500]),
    )
    return model, inputs


def _flux(dtype):
    model = tiny_models.flux().to(dtype).eval()
    side, text = 8, 8
    grid = torch.meshgrid(torch.zeros(1), torch.arange(float(side)), torch.arange(float(side)), indexing="ij")
    inputs = dict(
        hidden_states=torch.randn(1, side * side, 4, dtype=dtype),
        encoder_hidden_states=torch.randn(1, text, 32, dtype=dtype),
        pooled_projections=torch.randn(1, 32, dtype=dtype),
        timestep=torch.rand(1, dtype=dtype),
        img_ids=torch.stack(grid, -1).reshape(side * side, 3),
        txt_ids=torch.zeros(text, 3),
    )
    return model, inputs


def _ltx(dtype):
    # 4 frames of 16 x 16 tokens: 1024 tokens, (2, 8, 8) tiles of 128. No text padding
    # mask: masked cross-attention goes to diffusers' own processor, whose native backend
    # fails under Ulysses on this mask and refuses ring (no log-sum-exp), patched or not.
    model = (
        diffusers.LTXVideoTransformer3DModel(
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
        .to(dtype)
        .eval()
    )
    frames, side = 4, 16
    inputs = dict(
        hidden_states=torch.randn(1, frames * side * side, 4, dtype=dtype),
        encoder_hidden_states=torch.randn(1, 6, 16, dtype=dtype),
        timestep=torch.tensor([500]),
        encoder_attention_mask=None,
        num_frames=frames,
        height=side,
        width=side,
    )
    return model, inputs


def _hunyuan(dtype):
    # 4 frames of 16 x 16 video tokens (1024: (2, 8, 8) tiles of 128), then 12 text tokens, the last
    # two padding; 4 heads, so that each of two ranks attends two.
    model = tiny_models.hunyuan_video(num_attention_heads=4, attention_head_dim=8, rope_axes_dim=(2, 2, 4))
    model = model.to(dtype).eval()
    inputs = dict(
        hidden_states=torch.randn(1, 4, 4, 16, 16, dtype=dtype),
        timestep=torch.tensor([500.0], dtype=dtype),
        encoder_hidden_states=torch.randn(1, 12, 16, dtype=dtype),
        pooled_projections=torch.randn(1, 8, dtype=dtype),
        encoder_attention_mask=torch.tensor([[1.0] * 10 + [0.0] * 2], dtype=dtype),
        guidance=torch.tensor([300.0], dtype=dtype),
    )
    return model, inputs


def _fused_projections(build):
    """``build`` with diffusers' ``fuse_qkv_projections()`` applied (flux-fast's recipe)."""

    def fused(dtype):
        model, inputs = build(dtype)
        model.fuse_qkv_projections()
        return model, inputs

    return fused


MODELS = {
    "wan": _wan,
    "flux": _flux,
    "ltx": _ltx,
    "hunyuan": _hunyuan,
    "wan_fused": _fused_projections(_wan),
    "flux_fused": _fused_projections(_flux),
}


def _context_parallel_config(parallelism: str):
    """Ulysses-2, ring-2, or both ("unified": ring-2 x Ulysses-2, on 4 ranks)."""
    from diffusers import ContextParallelConfig

    degrees = {
        "ulysses": dict(ulysses_degree=2),
        # Uneven shards (and head counts): diffusers' own Ulysses exchange, with the fused op.
        "ulysses_anything": dict(ulysses_degree=2, ulysses_anything=True),
        "ring": dict(ring_degree=2),
        "unified": dict(ring_degree=2, ulysses_degree=2),
    }[parallelism]
    return ContextParallelConfig(**degrees)


class _Spy:
    """Records the (precision, sparse) of every call of the forward op that
    compile_ops hands to diffusers' context-parallel templates."""

    def __init__(self):
        from compile_ops.integrations.diffusers import context_parallel

        self.module, self.original, self.calls = context_parallel, context_parallel._forward_op, set()

    def __enter__(self):
        def spy(*args, precision, layout, **kwargs):
            self.calls.add((precision, layout is not None))
            return self.original(*args, precision=precision, layout=layout, **kwargs)

        self.module._forward_op = spy
        return self

    def __exit__(self, *exc):
        self.module._forward_op = self.original


def _model_case(model_name: str, mode: str, parallelism: str) -> None:
    options = MODES[mode]()
    precision, sparse = options.get("attention_precision", "exact"), "attention" in options
    # 8-bit attention runs on 16-bit inputs; the exact modes compare in fp32.
    dtype = torch.bfloat16 if precision != "exact" else torch.float32
    torch.manual_seed(0)
    model, inputs = MODELS[model_name](dtype)
    compile_ops.patch(model, **options)
    with torch.no_grad():
        one_process = model(**inputs, return_dict=False)[0]
    # diffusers picks the rank's device as rank % accelerator count; a CPU has none.
    with mock.patch("torch.accelerator.device_count", return_value=1):
        model.enable_parallelism(config=_context_parallel_config(parallelism))
    with torch.no_grad(), _Spy() as spy:
        parallel = model(**inputs, return_dict=False)[0]
    assert (precision, sparse) in spy.calls, (
        f"the fused {mode} path did not run under {parallelism}: forward-op calls {spy.calls}"
    )
    if parallelism == "ulysses" and model_name == "wan":
        difference = (parallel.float() - one_process.float()).abs().max().item()
        assert torch.equal(parallel, one_process), f"Ulysses output differs from one process by {difference}"
    elif parallelism == "ulysses":
        # Flux's joint sequence arrives as [text_0, image_0, text_1, image_1]: keys in another order;
        # LTX's cross-attention runs split too, and differs from one process in the last bit;
        # HunyuanVideo's blocks run their GEMMs on each rank's share of the video tokens. The 8-bit
        # modes (bf16) give the one-process bits: their quantization and sums do not see the order.
        torch.testing.assert_close(
            parallel, one_process, **(RING_TOLERANCE if dtype == torch.float32 else dict(rtol=0, atol=0))
        )
    else:
        torch.testing.assert_close(parallel, one_process, **RING_TOLERANCE)


def _setup_config(parallelism: str, rank: int):
    from diffusers.models._modeling_parallel import ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    cp = _context_parallel_config(parallelism)
    config = ParallelConfig(context_parallel_config=cp)
    mesh = init_device_mesh("cpu", cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
    config.setup(rank, dist.get_world_size(), torch.device("cpu"), mesh=mesh)
    return config


def _attention_case(name: str, rank: int) -> None:
    """Forward and backward of this rank's shard through diffusers' templates
    against the single-process op on the whole sequence."""
    from compile_ops.integrations.attention_backend import compile_ops_attention
    from compile_ops.integrations.diffusers.context_parallel import parallel_attention
    from compile_ops.ops.block_sparse import BlockSparseMask, block_sparse_attention

    kind, mode, parallelism = name.split("-")[:3]
    config = _setup_config(parallelism, rank)
    torch.manual_seed(0)
    b, length, heads, d = 1, 255 if parallelism == "ulysses_anything" else 256, 4, 16  # 127 + 128 tokens
    q, k, v = (torch.randn(b, length, heads, d, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, length, heads, d)
    # Two 128-token blocks: each query block sees its own key block only.
    mask = BlockSparseMask.from_block_mask(torch.eye(2, dtype=torch.bool)[None, None])
    if mode == "sparse":
        full = block_sparse_attention(q, k, v, mask.block_index, mask.block_count, seq_dim=1)
    else:
        full = compile_ops.attention(q, k, v, seq_dim=1)
    full.backward(grad)
    world = dist.get_world_size()  # rank r holds the r-th sequence chunk, as diffusers' plans split it
    shard = slice(rank * length // world, (rank + 1) * length // world)
    local = [t.detach()[:, shard].clone().requires_grad_() for t in (q, k, v)]
    if kind == "backend":
        out = compile_ops_attention(*local, attn_mask=mask if mode == "sparse" else None, _parallel_config=config)
    else:
        layout = None
        if mode == "sparse":
            from compile_ops.integrations.attention_backend import _MaskLayout

            layout = _MaskLayout(mask)
        out = parallel_attention(*local, config, layout=layout, kernel="fused")
    tolerance = RING_TOLERANCE if parallelism in ("ring", "unified") else dict(rtol=0, atol=0)
    torch.testing.assert_close(out, full.detach()[:, shard], **tolerance)
    if parallelism == "ulysses_anything":
        return  # diffusers' uneven Ulysses exchange has no backward
    out.backward(grad[:, shard])
    for which, mine, theirs in zip("qkv", local, (q, k, v)):
        torch.testing.assert_close(
            mine.grad, theirs.grad[:, shard], **RING_TOLERANCE, msg=lambda m, which=which: f"d{which}: {m}"
        )


def _exchange_case(name: str, rank: int) -> None:
    """compile_ops' Ulysses exchange against diffusers' Ulysses template with
    the same per-rank op: equal bit for bit, in two all-to-alls a call (q, k
    and v in one) where the template makes four; pipelined, two a half of the heads."""
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention
    from torch.distributed import _functional_collectives as funcol

    from compile_ops.integrations.diffusers import context_parallel, ulysses

    precision, pipelined = name.split("-")[1], name.endswith("pipelined")
    config = _setup_config("ulysses", rank)
    torch.manual_seed(rank)
    dtype = torch.bfloat16 if precision != "exact" else torch.float32
    q, k, v = (torch.randn(2, 128, 4, 16, dtype=dtype) for _ in range(3))
    # Pipelined (every call, here): each half of the heads in its own two collectives.
    threshold = 0 if pipelined else ulysses.PIPELINE_MIN_BYTES
    raw = torch.ops._c10d_functional.all_to_all_single
    with (
        mock.patch.object(ulysses, "PIPELINE_MIN_BYTES", threshold),
        mock.patch.object(funcol, "all_to_all_single_autograd", wraps=funcol.all_to_all_single_autograd) as spy,
        mock.patch.object(torch.ops._c10d_functional, "all_to_all_single", wraps=raw) as raw_spy,
    ):
        ours = context_parallel.parallel_attention(q, k, v, config, precision=precision, kernel="fused")
    forward_op = functools.partial(
        context_parallel._forward_op, precision=precision, layout=None, kv_lengths=None, kernel="fused"
    )
    theirs = _templated_context_parallel_attention(
        q, k, v, None, 0.0, False, None, False, False, forward_op=forward_op, backward_op=None, _parallel_config=config
    )
    calls, expected = (raw_spy.call_count, 4) if pipelined else (spy.call_count, 2)
    assert calls == expected, f"the exchange made {calls} all-to-alls, expected {expected} (q/k/v, then out)"
    assert torch.equal(ours, theirs), f"max difference {(ours.float() - theirs.float()).abs().max().item()}"


def _tail_case(name: str, rank: int) -> None:
    """Ulysses with a replicated tail (HunyuanVideo's text, whole on every rank)
    against one process attending [every rank's tokens, the tail], forward and
    backward. Every rank's loss counts the tail's output, so the tail's
    gradient summed over the ranks is that of ``<tokens, g> + P <tail, g_tail>``."""
    from compile_ops.integrations.diffusers.context_parallel import parallel_attention

    config = _setup_config("ulysses", rank)
    world = dist.get_world_size()
    torch.manual_seed(0)  # the same on every rank: the whole sequence, the tail, the upstream gradients
    b, length, tail, heads, d = 1, 256, 12, 4, 16
    q, k, v = (torch.randn(b, length + tail, heads, d, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, length + tail, heads, d)
    lengths = torch.tensor([length + tail - 2])  # the tail's last two tokens are padding keys
    full = compile_ops.attention(q, k, v, seq_dim=1, kv_lengths=lengths)
    (full[:, :length] * grad[:, :length]).sum().add((world * full[:, length:] * grad[:, length:]).sum()).backward()
    shard = slice(rank * length // world, (rank + 1) * length // world)
    local = [torch.cat([t.detach()[:, shard], t.detach()[:, length:]], 1).requires_grad_() for t in (q, k, v)]
    out = parallel_attention(*local, config, kv_lengths=lengths, kernel="fused", replicated_tail=tail)
    torch.testing.assert_close(out[:, :-tail], full.detach()[:, shard], rtol=0, atol=0)
    torch.testing.assert_close(out[:, -tail:], full.detach()[:, length:], rtol=0, atol=0)
    out.backward(torch.cat([grad[:, shard], grad[:, length:]], 1))
    for which, mine, theirs in zip("qkv", local, (q, k, v)):
        torch.testing.assert_close(mine.grad[:, :-tail], theirs.grad[:, shard], **RING_TOLERANCE)
        summed = mine.grad[:, -tail:].clone()
        dist.all_reduce(summed)
        torch.testing.assert_close(
            summed, theirs.grad[:, length:], **RING_TOLERANCE, msg=lambda m, which=which: f"d{which} tail: {m}"
        )


#: The per-rank function of each kind of named case (the name's first part).
CASE_KINDS = {"exchange": _exchange_case, "tail": _tail_case}


def _worker(rank: int, world: int, directory: str) -> None:
    """Every case of this world size: the model and attention cases on 2 ranks,
    the unified (ring x Ulysses) attention cases on 4."""

    def cases():
        named = {
            "-".join(case): lambda case=case: _model_case(*case) for case in (MODEL_CASES if world == WORLD else ())
        }
        names = ATTENTION_CASES if world == WORLD else UNIFIED_CASES
        named.update(
            {name: lambda name=name: CASE_KINDS.get(name.split("-")[0], _attention_case)(name, rank) for name in names}
        )
        return named

    run_cases(rank, world, directory, cases)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    return spawn_verdicts(_worker, WORLD, str(tmp_path_factory.mktemp("context_parallel")), SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def unified_verdicts(tmp_path_factory):
    return spawn_verdicts(
        _worker, UNIFIED_WORLD, str(tmp_path_factory.mktemp("context_parallel_unified")), SPAWN_TIMEOUT_S
    )


@pytest.mark.parametrize("name", ["-".join(case) for case in MODEL_CASES] + ATTENTION_CASES)
def test_context_parallel_matches_one_process(verdicts, name):
    failure = verdicts[name]
    if failure is not None:
        pytest.fail(failure, pytrace=False)


@pytest.mark.parametrize("name", UNIFIED_CASES)
def test_unified_ring_and_ulysses_match_one_process(unified_verdicts, name):
    failure = unified_verdicts[name]
    if failure is not None:
        pytest.fail(failure, pytrace=False)


# ---------------------------------------------------------------- in-process: refusals and the report


def _patched_wan(**options):
    torch.manual_seed(0)
    model, inputs = _wan(torch.float32)
    return model, inputs, compile_ops.patch(model, **options)


def _parallel(**degrees):
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    return ParallelConfig(context_parallel_config=ContextParallelConfig(**degrees))


def test_patch_after_enable_parallelism_is_refused():
    model, _ = _wan(torch.float32)
    model._parallel_config = _parallel(ulysses_degree=2)  # what enable_parallelism records
    with pytest.raises(RuntimeError, match=r"call compile_ops.patch\(model\) first, then model.enable_parallelism"):
        compile_ops.patch(model)


def test_tensor_parallelism_on_a_patched_model_is_refused():
    from diffusers.models._modeling_parallel import ParallelConfig, TensorParallelConfig

    model, inputs, _ = _patched_wan()
    model._parallel_config = ParallelConfig(tensor_parallel_config=TensorParallelConfig(tp_degree=2))
    with pytest.raises(RuntimeError, match="TensorParallelConfig.*Use ContextParallelConfig"):
        model(**inputs)


@pytest.mark.parametrize(
    "precision, sparse, lengths, refused",
    [
        ("exact", False, False, False),
        ("int8", False, False, False),
        ("int8_fp8", True, False, True),
        ("exact", True, False, True),
        ("exact", False, True, True),
    ],
)
def test_only_uneven_ring_shards_refuse_what_needs_each_shards_place(precision, sparse, lengths, refused):
    """Every mode runs under Ulysses and ring (tests/test_context_parallel_ring.py);
    ring_anything's uneven shards refuse sparse layouts and key lengths."""
    from compile_ops.integrations.diffusers.context_parallel import check_parallel_mode

    for config, expect_refusal in (
        (_parallel(ulysses_degree=2), False),
        (_parallel(ring_degree=2), False),
        (_parallel(ring_degree=2, ulysses_degree=2), False),
        (_parallel(ring_degree=2, ring_anything=True), refused),
    ):
        if expect_refusal:
            with pytest.raises(ValueError, match=r"ring_anything=True.*ulysses_degree"):
                check_parallel_mode(config, precision, sparse, lengths, "owner")
        else:
            check_parallel_mode(config, precision, sparse, lengths, "owner")  # runs


def test_patch_gives_hunyuan_video_a_context_parallel_plan_and_unpatch_takes_it_back():
    model, _ = _hunyuan(torch.float32)
    assert type(model)._cp_plan is None  # diffusers ships none for HunyuanVideo
    compile_ops.patch(model)
    plan = model._cp_plan
    assert set(plan) == {"rope", "transformer_blocks.0", "proj_out"}
    assert plan["transformer_blocks.0"]["hidden_states"].split_dim == 1  # the video tokens
    assert {plan["rope"][i].split_dim for i in (0, 1)} == {0}  # the rotary tables' rows
    assert "encoder_hidden_states" not in plan["transformer_blocks.0"]  # the text stays whole
    compile_ops.unpatch(model)
    assert "_cp_plan" not in vars(model) and model._cp_plan is None


def test_hunyuan_video_token_replacement_gets_no_plan_and_the_report_says_why():
    torch.manual_seed(0)
    model = tiny_models.hunyuan_video(
        in_channels=8, attention_head_dim=8, rope_axes_dim=(2, 2, 4), image_condition_type="token_replace"
    )
    report = compile_ops.patch(model)
    assert model._cp_plan is None
    assert any("token replacement" in why for _, _, why in report.left), report.left


def test_ring_is_refused_where_every_rank_holds_the_text():
    """HunyuanVideo under compile_ops' plan: the text is whole on every rank, so
    Ulysses runs and ring (which would visit the text's keys once a rank) is refused,
    from the model's forward pre-hook, before any block runs."""
    from compile_ops.integrations.diffusers.context_parallel import check_parallel_mode

    check_parallel_mode(_parallel(ulysses_degree=2), "exact", False, True, "owner", replicated_text=True)  # runs
    with pytest.raises(ValueError, match=r"ulysses_anything=True\) cannot run.*ulysses_degree"):
        uneven = _parallel(ulysses_degree=2, ulysses_anything=True)
        check_parallel_mode(uneven, "exact", False, True, "owner", replicated_text=True)
    model, inputs = _hunyuan(torch.float32)
    compile_ops.patch(model)
    config = _parallel(ring_degree=2)
    model._parallel_config = config  # what enable_parallelism records, on the model and its processors
    for module in model.modules():
        if hasattr(module, "processor"):
            module.processor._parallel_config = config
    with pytest.raises(ValueError, match=r"HunyuanVideoAttnProcessor: ring attention.*ulysses_degree"):
        model(**inputs)


def test_the_report_names_each_layers_kernel_and_parallel_path():
    model, _, report = _patched_wan(attention_precision="int8_fp8")
    paths = {path: (kernel, parallel) for path, kernel, parallel in report.attention_paths()}
    assert set(paths) == {f"blocks.{i}.{a}" for i in range(2) for a in ("attn1", "attn2")}
    assert all(
        kernel.startswith("fused.attention_int8_fp8 (inference)") and parallel == "one rank"
        for kernel, parallel in paths.values()
    ), paths
    for module in model.modules():  # what model.enable_parallelism sets on each processor
        if hasattr(module, "processor") and hasattr(module.processor, "_parallel_config"):
            module.processor._parallel_config = _parallel(ulysses_degree=2)
    paths = {path: parallel for path, _, parallel in report.attention_paths()}
    assert paths["blocks.0.attn1"] == "Ulysses-2" and paths["blocks.0.attn2"].startswith("each rank's queries")
    assert "across ranks: Ulysses-2" in str(report)


def test_the_report_names_the_sparse_kernel():
    _, _, report = _patched_wan(attention=compile_ops.SlidingTile(window=(1, 1, 1), tile=(2, 8, 8)))
    kernels = {path: kernel for path, kernel, _ in report.attention_paths()}
    assert kernels["blocks.0.attn1"].startswith("fused.block_sparse_attention (SlidingTile(")
    assert not kernels["blocks.0.attn2"].startswith("fused.block_sparse_attention")
