"""The fused ops' DTensor sharding rules: 2 CPU processes on gloo, the reference path.

Each case distributes full fp32 tensors over a mesh of 2 ranks (1-D, or 1 x 2
to exercise the expansion of the rules over mesh dims), runs a public
function (or the op itself, to see every output) on the DTensors and on the
full tensors, and checks that:
- the outputs are equal (``full_tensor()``) and have the expected placements:
  ``Shard`` where the op runs locally, so nothing was gathered silently;
- backward gives the full-tensor gradients, in the expected placements
  (``Partial`` for replicated weights, reduced by ``full_tensor()``).

The backward goes through autograd's registered formulas, so every
``fused.*_backward`` op runs on DTensors too.

Here: the row-wise families (norms, modulation, gated residuals, GLUs, FP8 row
quantization and a LoRA adapter on FP8 rows), RoPE, MoE routing, unused outputs
and a 2-D mesh. Attention (dense, 8-bit, block-sparse, sequence shards through
Ulysses, under torch.compile) is in test_distributed_attention.py.

"Not local" cases shard a dim the op cannot split (the channel dim, the head
dim, grid RoPE's sequence): the result must still be right (DTensor
redistributes) and no output may be sharded on that dim. A last check
registers a wrong rule (rmsnorm split along its channel dim) and asserts that
the same comparison catches it: the harness can fail. Another asserts that
every fused op with a rule ran on DTensors in a case of either file.

One spawn runs every case of both files (a process group costs seconds to
start; the harness is tests/distributed_helpers.py); each case is a test of its
own that reads the spawn's verdict.
"""

from functools import partial

import pytest
import torch
import torch.distributed as dist
from distributed_helpers import (
    EVERY_OP,
    HK,
    WORLD,
    WRONG_RULE,
    B,
    C,
    Case,
    D,
    H,
    L,
    P,
    R,
    Shard,
    _as_floats,
    _attention,
    _attention_inputs,
    act,
    every_verdict,
    param,
    table,
)

import compile_ops

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)


# ---------------------------------------------------------------- cases: row-wise families

ROW_AXES = (("batch", 0), ("sequence", 1))


def _row_cases(axis, d):
    s = Shard(d)
    # A per-sample [B, C] / [B, 1, C] tensor follows x's batch, and its gradient
    # too; under sequence sharding it is replicated and its gradient partial.
    sample, d_sample = (Shard(0), Shard(0)) if d == 0 else (R, P)
    eps = 1e-6
    yield Case(
        f"rmsnorm/{axis}",
        lambda x, w, b: compile_ops.rmsnorm(x, w, eps, b),
        lambda: (act(B, L, C), param(C), param(C)),
        (s, R, R),
        (s,),
        (s, P, P),
    )
    yield Case(
        f"layernorm/{axis}",
        lambda x, w, b: compile_ops.layernorm(x, w, b, eps),
        lambda: (act(B, L, C), param(C), param(C)),
        (s, R, R),
        (s,),
        (s, P, P),
    )
    yield Case(
        f"add_rmsnorm/{axis}",
        lambda x, r, w: compile_ops.add_rmsnorm(x, r, w, eps),
        lambda: (act(B, L, C), act(B, L, C), param(C)),
        (s, s, R),
        (s, s),
        (s, s, P),
    )
    yield Case(
        f"modulate/{axis}",
        compile_ops.modulate,
        lambda: (act(B, L, C), act(B, C), act(B, 1, C)),
        (s, sample, sample),
        (s,),
        (s, d_sample, d_sample),
    )
    # Per frame [B, F, 1, C]: frames follow x's tokens; per channel [C]: follows no row.
    yield Case(
        f"modulate_per_frame/{axis}",
        compile_ops.modulate,
        lambda: (act(B, L, C), act(B, 2, 1, C), act(C)),
        (s, s, R),
        (s,),
        (s, s, P),
    )
    # A per-sample scale given replicated under batch sharding: DTensor slices it locally.
    yield Case(
        f"modulate_replicated_scale/{axis}",
        compile_ops.modulate,
        lambda: (act(B, L, C), act(B, C), act(B, L, C)),
        (s, R, s),
        (s,),
        (s, d_sample, s),
    )
    # The forward ops themselves, for their row statistics: layernorm then
    # rmsnorm on the same shapes (RMSNorm's mean is an empty placeholder; a
    # sharding cache that ignored `norm` would reuse layernorm's decision).
    for norm, mean in (("layernorm", s), ("rmsnorm", R)):
        yield Case(
            f"norm_modulate_{norm}/{axis}",
            partial(lambda norm, *t: torch.ops.fused.norm_modulate(*t, norm, eps), norm),
            lambda: (act(B, L, C), act(B, C), act(B, L, C), param(C), param(C)),
            (s, sample, s, R, R),
            (s, mean, s),
            (s, d_sample, s, P, P),
        )
    yield Case(
        f"norm_modulate/{axis}",
        lambda x, sc, sh: compile_ops.norm_modulate(x, sc, sh),
        lambda: (act(B, L, C), act(B, C), act(B, C)),
        (s, sample, sample),
        (s,),
        (s, d_sample, d_sample),
    )
    yield Case(
        f"gated_residual/{axis}",
        compile_ops.gated_residual,
        lambda: (act(B, L, C), act(B, L, C), act(B, C)),
        (s, s, sample),
        (s,),
        (s, s, d_sample),
    )
    yield Case(
        f"gated_residual_norm_modulate/{axis}",
        lambda *t: compile_ops.gated_residual_norm_modulate(*t, norm="rmsnorm", eps=eps),
        lambda: (act(B, L, C), act(B, L, C), act(B, 1, C), act(B, C), act(C), param(C), param(C)),
        (s, s, sample, sample, R, R, R),
        (s, s),
        (s, s, d_sample, d_sample, P, P, P),
    )
    yield Case(f"geglu/{axis}", lambda x: compile_ops.geglu(x, "tanh"), lambda: (act(B, L, 2 * C),), (s,), (s,), (s,))
    yield Case(
        f"swiglu/{axis}",
        lambda x: compile_ops.swiglu(x, gate_first=True),
        lambda: (act(B, L, 2 * C),),
        (s,),
        (s,),
        (s,),
    )


# ---------------------------------------------------------------- cases: RoPE


def _rope_cases(axis, bhld, blhd):
    """``bhld``/``blhd``: the dim ``axis`` is in a ``[B, H, L, D]`` / ``[B, L, H, D]`` tensor."""
    s, t = Shard(bhld), Shard(blhd)
    table_2d = Shard(0) if axis == "sequence" else R  # [L, T]
    table_3d = {"batch": Shard(0), "sequence": Shard(1), "heads": R}[axis]  # [B, L, T]
    yield Case(
        f"rope/{axis}",
        lambda x, c, sn: compile_ops.rope(x, c, sn, interleaved=True, seq_dim=2),
        lambda: (act(B, H, L, D), table(L, D), table(L, D)),
        (s, table_2d, table_2d),
        (s,),
        (s, None, None),
    )
    yield Case(
        f"rope_per_batch_half_table/{axis}",
        lambda x, c, sn: compile_ops.rope(x, c, sn, seq_dim=1),
        lambda: (act(B, L, H, D), table(B, L, D // 2), table(B, L, D // 2)),
        (t, table_3d, table_3d),
        (t,),
        (t, None, None),
    )
    # The head counts differ (GQA): both divide evenly on 2 ranks.
    yield Case(
        f"rope_qk/{axis}",
        lambda q, k, c, sn: compile_ops.rope_qk(q, k, c, sn, seq_dim=1),
        lambda: (act(B, L, H, D), act(B, L, HK, D), table(L, D), table(L, D)),
        (t, t, R, R),
        (t, t),
        (t, t, None, None),
    )
    yield Case(
        f"qk_norm_rope/{axis}",
        lambda q, k, qw, kw, c, sn: compile_ops.qk_norm_rope(q, k, qw, kw, c, sn, interleaved=True, seq_dim=1),
        lambda: (act(B, L, H, D), act(B, L, HK, D), param(D), param(D), table(L, D), table(L, D)),
        (t, t, R, R, table_2d, table_2d),
        (t, t),
        (t, t, P, P, None, None),
    )
    if axis != "heads":  # a norm over the heads: their own case among the dims that are not local
        yield Case(
            f"qk_norm_rope_norm_over_heads/{axis}",
            lambda q, k, qw, kw, c, sn: compile_ops.qk_norm_rope(q, k, qw, kw, c, sn, interleaved=True, seq_dim=1),
            lambda: (act(B, L, H, D), act(B, L, HK, D), param(H * D), param(HK * D), table(L, D), table(L, D)),
            (t, t, R, R, table_2d, table_2d),
            (t, t),
            (t, t, P, P, None, None),
        )


GRID = compile_ops.grid_rope("wan", D)
GRID_LENGTH = 8  # 2 frames of 2 x 2


def _rope_grid(q, k):
    return compile_ops.rope_grid(q, k, GRID, 2, 2, seq_dim=2)


def _rope_grid_inputs():
    return act(B, H, GRID_LENGTH, D), act(B, HK, GRID_LENGTH, D)


# ---------------------------------------------------------------- cases: dims that are not local


def _not_local_cases():
    """Sharded where the op cannot split: DTensor must redistribute, and the
    result must still be right."""
    channel = Shard(2)
    yield Case(
        "rmsnorm/channel",
        lambda x, w: compile_ops.rmsnorm(x, w),
        lambda: (act(B, L, C), param(C)),
        (channel, R),
        None,
        not_sharded_on=2,
    )
    yield Case(
        "norm_modulate/channel",
        lambda x, sc, sh: compile_ops.norm_modulate(x, sc, sh),
        lambda: (act(B, L, C), act(B, C), act(C)),
        (channel, Shard(1), Shard(0)),
        None,
        not_sharded_on=2,
    )
    # GLU splits the channel dim into value and gate halves.
    yield Case("geglu/channel", compile_ops.geglu, lambda: (act(B, L, 2 * C),), (channel,), None, not_sharded_on=2)
    yield Case(
        "rope/head_dim",
        lambda x, c, sn: compile_ops.rope(x, c, sn, seq_dim=2),
        lambda: (act(B, H, L, D), table(L, D), table(L, D)),
        (Shard(3), R, R),
        None,
        not_sharded_on=3,
    )
    yield Case(
        "attention/head_dim",
        partial(_attention, 2),
        _attention_inputs(2),
        (Shard(3), Shard(3), Shard(3), R),
        None,
        not_sharded_on=3,
    )
    # Grid RoPE positions come from the global token index.
    yield Case("rope_grid/sequence", _rope_grid, _rope_grid_inputs, (Shard(2), Shard(2)), None, not_sharded_on=2)
    # A q/k-norm whose weights span the heads (Wan's) reduces over them.
    yield Case(
        "qk_norm_rope_norm_over_heads/heads",
        lambda q, k, qw, kw, c, sn: compile_ops.qk_norm_rope(q, k, qw, kw, c, sn, interleaved=True, seq_dim=1),
        lambda: (act(B, L, H, D), act(B, L, HK, D), param(H * D), param(HK * D), table(L, D), table(L, D)),
        (Shard(2), Shard(2), R, R, R, R),
        None,
        not_sharded_on=2,
    )


def _unused_output_cases():
    """One output of a two-output op feeds the loss: autograd materializes the
    other's gradient as plain zeros, which must not reach DTensor arguments."""
    s = Shard(0)
    yield Case(
        "rope_qk_unused_k/batch",
        lambda q, k, c, sn: compile_ops.rope_qk(q, k, c, sn),
        lambda: (act(B, H, L, D), act(B, HK, L, D), table(L, D), table(L, D)),
        (s, s, R, R),
        (s, s),
        (s, s, None, None),
        differentiate=(0,),
    )
    yield Case(
        "add_rmsnorm_unused_residual/batch",
        lambda x, r, w: compile_ops.add_rmsnorm(x, r, w),
        lambda: (act(B, L, C), act(B, L, C), param(C)),
        (s, s, R),
        (s, s),
        (s, s, P),
        differentiate=(0,),
    )
    yield Case(
        "gated_residual_norm_modulate_unused_out/sequence",
        lambda *t: compile_ops.gated_residual_norm_modulate(*t),
        lambda: (act(B, L, C), act(B, L, C), act(B, C), act(B, C), act(B, C)),
        (Shard(1), Shard(1), R, R, R),
        (Shard(1), Shard(1)),
        (Shard(1), Shard(1), P, None, None),
        differentiate=(0,),
    )


def _two_mesh_dim_cases():
    """Batch on one mesh dim, sequence on the other (a 1 x 2 mesh): the weight
    gradient is partial on both, a per-sample scale's only on the sequence dim."""
    rows, sample = (Shard(0), Shard(1)), (Shard(0), R)
    yield Case(
        "rmsnorm/batch_and_sequence",
        lambda x, w: compile_ops.rmsnorm(x, w),
        lambda: (act(B, L, C), param(C)),
        (rows, (R, R)),
        (rows,),
        (rows, (P, P)),
        mesh=(1, WORLD),
    )
    yield Case(
        "norm_modulate/batch_and_sequence",
        compile_ops.norm_modulate,
        lambda: (act(B, L, C), act(B, C), act(B, C), param(C)),
        (rows, sample, sample, (R, R)),
        (rows,),
        (rows, (Shard(0), P), (Shard(0), P), (P, P)),
        mesh=(1, WORLD),
    )
    yield Case(
        "attention/batch_and_heads",
        partial(_attention, 2),
        _attention_inputs(2),
        ((Shard(0), Shard(1)),) * 3 + ((Shard(0), R),),
        ((Shard(0), Shard(1)),) * 2,
        ((Shard(0), Shard(1)),) * 3 + (None,),
        mesh=(1, WORLD),
    )


def _quantize_fp8(x, activation="none"):
    return _as_floats(compile_ops.quantize_fp8_rows(x, activation))


def _rows_lora(result, x, lora_a, lora_b, scaling_tensor):
    """One LoRA adapter on the FP8 rows of x, quantized on the DTensors (the cases distribute float tensors)."""
    q, scale = compile_ops.quantize_fp8_rows(x)
    return compile_ops.fp8_rows_lora(result, q, scale, lora_a, lora_b, 0.5, scaling_tensor)


def _rows_lora_inputs():
    return torch.randn(B, L, C), torch.randn(B, L, C), torch.randn(4, C), torch.randn(C, 4), torch.tensor(2.0)


def _moe_cases():
    """Routing runs on whole tensors (its rule, compile_ops/distributed.py:
    token_index lists global token ids): token shards are gathered and every
    output is replicated. Its backward is row-wise and gets the replicated
    gradients with x still token-sharded: DTensor picks the placements, so
    only the gradients' values are checked."""
    yield Case(
        "moe_route/tokens",
        lambda x, w: compile_ops.moe_route(x, w, 2),
        lambda: (act(B * L, C), act(4, C)),
        (Shard(0), R),
        (R,) * 5,
    )
    yield Case(
        "moe_route_not_renormalized/tokens",
        lambda x, w: compile_ops.moe_route(x, w, 1, False),
        lambda: (act(B * L, C), act(3, C)),
        (Shard(0), R),
        (R,) * 5,
    )


def _cases():
    for axis, d in ROW_AXES:
        yield from _row_cases(axis, d)
        # One scale per row: every row axis is local (inference only: no gradient).
        yield Case(
            f"quantize_fp8_rows/{axis}",
            _quantize_fp8,
            lambda: (torch.randn(B, L, C),),
            (Shard(d),),
            (Shard(d), Shard(d)),
        )
        yield Case(
            f"quantize_fp8_rows_gelu_tanh/{axis}",
            lambda x: _quantize_fp8(x, "gelu_tanh"),
            lambda: (torch.randn(B, L, C),),
            (Shard(d),),
            (Shard(d), Shard(d)),
        )
        yield Case(
            f"quantize_fp8_rows_concat/{axis}",
            lambda x, head: _as_floats(compile_ops.quantize_fp8_rows(x, "gelu_tanh", head=head)),
            lambda: (torch.randn(B, L, C), torch.randn(B, L, C // 2)),
            (Shard(d), Shard(d)),
            (Shard(d), Shard(d)),
        )
        # Row-wise: result, q and scale follow x's rows, the adapter is replicated.
        yield Case(
            f"fp8_rows_lora/{axis}",
            _rows_lora,
            _rows_lora_inputs,
            (Shard(d), Shard(d), R, R, R),
            (Shard(d),),
        )
        sample = Shard(0) if d == 0 else R
        yield Case(
            f"norm_modulate_fp8/{axis}",
            lambda *t: _as_floats(compile_ops.norm_modulate_fp8(*t)),
            lambda: (torch.randn(B, L, C), torch.randn(B, C), torch.randn(B, C)),
            (Shard(d), sample, sample),
            (Shard(d), Shard(d)),
        )
        yield Case(
            f"gated_residual_norm_modulate_fp8/{axis}",
            lambda r, x, g, sc, sh: _as_floats(compile_ops.gated_residual_norm_modulate_fp8(r, x, g, sc, sh)),
            lambda: (
                torch.randn(B, L, C),
                torch.randn(B, L, C),
                torch.randn(B, C),
                torch.randn(B, C),
                torch.randn(B, C),
            ),
            (Shard(d), Shard(d), sample, sample, sample),
            (Shard(d), Shard(d), Shard(d)),
        )
    for axis, bhld, blhd in (("batch", 0, 0), ("sequence", 2, 1), ("heads", 1, 2)):
        yield from _rope_cases(axis, bhld, blhd)
    for axis, d in (("batch", 0), ("heads", 1)):
        yield Case(
            f"rope_grid/{axis}",
            _rope_grid,
            _rope_grid_inputs,
            (Shard(d), Shard(d)),
            (Shard(d), Shard(d)),
            (Shard(d), Shard(d)),
        )
    yield from _unused_output_cases()
    yield from _two_mesh_dim_cases()
    yield from _not_local_cases()
    yield from _moe_cases()


CASES = {case.name: case for case in _cases()} if dist.is_available() else {}


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """``{case: None or the failure on some rank}`` from the one spawn of 2 ranks (distributed_helpers)."""
    return every_verdict(tmp_path_factory)


@pytest.mark.parametrize("name", [*CASES, WRONG_RULE, EVERY_OP])
def test_sharded_matches_full(verdicts, name):
    failure = verdicts[name]
    if failure is not None:
        pytest.fail(failure, pytrace=False)


# ---------------------------------------------------------------- in-process checks of the rule table


def test_every_op_has_a_rule_that_matches_its_schema():
    from compile_ops import distributed

    distributed.check_rules()  # raises on a missing op, argument or return
