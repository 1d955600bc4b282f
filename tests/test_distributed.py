"""The fused ops on DTensors: 2 CPU processes on gloo, the reference path.

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

"Not local" cases shard a dim the op cannot split (the channel dim, the head
dim, grid RoPE's sequence): the result must still be right (DTensor
redistributes) and no output may be sharded on that dim. Attention on
sequence shards is its own case: the public functions switch q/k/v to head
shards and the results back (compile_ops._dtensor.sequence_parallel). A last check
registers a wrong rule (rmsnorm split along its channel dim) and asserts that
the same comparison catches it: the harness can fail.

One spawn runs every case (a process group costs seconds to start); each case
is a test of its own that reads the spawn's verdict.
"""

import datetime
import json
import os
import traceback
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import spawn_verdicts

import compile_ops

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

if dist.is_available():
    from torch.distributed.tensor import Partial, Replicate, Shard

    R, P = Replicate(), Partial()
else:  # the module must import to be skipped
    R = P = Shard = None

WORLD = 2
#: Wall-clock limit of the spawn: two imports of torch + compile_ops on a busy
#: 2-core CI box, then about seventy small cases (about 25 s in all here).
SPAWN_TIMEOUT_S = 240
B, L, C = 2, 4, 8
H, HK, D = 4, 2, 8  # q heads, k/v heads (GQA), head dim


def act(*shape):
    """A differentiable activation."""
    return torch.randn(shape).requires_grad_()


def param(c):
    """A differentiable weight or bias."""
    return (1.0 + 0.1 * torch.randn(c)).requires_grad_()


def table(*shape):
    """A cos or sin table (not differentiable)."""
    return torch.rand(shape) * 2 - 1


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable
    """The public function, options bound: ``fn(*tensors)``."""
    make: Callable[[], tuple]
    """The full tensors; the differentiable ones require grad."""
    shard: tuple
    """The placement each tensor is distributed with."""
    outputs: Optional[tuple]
    """The expected placement of each output; None where the op is not local on ``not_sharded_on``."""
    grads: tuple = ()
    """The expected placement of each input's gradient (None: not differentiable, or not checked)."""
    not_sharded_on: Optional[int] = None
    """A dim that no output may be sharded on."""
    differentiate: Optional[tuple] = None
    """Which outputs to backpropagate from; default: every differentiable one."""
    mesh: tuple = (WORLD,)
    """The mesh shape; on a 2-D mesh each placement above is a tuple, one per mesh dim."""


def _per_mesh_dim(placement) -> tuple:
    return placement if isinstance(placement, tuple) else (placement,)


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


GRID = compile_ops.grid_rope("wan", D)
GRID_LENGTH = 8  # 2 frames of 2 x 2


def _rope_grid(q, k):
    return compile_ops.rope_grid(q, k, GRID, 2, 2, seq_dim=2)


def _rope_grid_inputs():
    return act(B, H, GRID_LENGTH, D), act(B, HK, GRID_LENGTH, D)


# ---------------------------------------------------------------- cases: attention


def _attention(seq_dim, q, k, v, kv_lengths):
    return compile_ops.attention(q, k, v, causal=True, seq_dim=seq_dim, kv_lengths=kv_lengths, return_lse=True)


def _attention_inputs(seq_dim):
    def qkv(heads, length):
        return act(B, heads, length, D) if seq_dim == 2 else act(B, length, heads, D)

    return lambda: (qkv(H, L), qkv(HK, L + 2), qkv(HK, L + 2), torch.tensor([5, 3]))


def _block_sparse(q, k, v, index, count):
    return compile_ops.block_sparse_attention(q, k, v, index, count, return_lse=True)


def _block_sparse_inputs(list_batch, list_heads):
    """Every query block (one: L < 128) lists key block 0, per batch element and
    head or shared (a dim of size 1)."""
    return lambda: (
        act(B, H, L, D),
        act(B, HK, L, D),
        act(B, HK, L, D),
        torch.zeros(list_batch, list_heads, 1, 1, dtype=torch.int32),
        torch.ones(list_batch, list_heads, 1, dtype=torch.int32),
    )


def _block_sparse_ordered(q, k, v, index, count, order):
    return compile_ops.block_sparse_attention(q, k, v, index, count, return_lse=True, token_order=order)


def _block_sparse_ordered_inputs():
    """:func:`_block_sparse_inputs`' self-attention with a token order (a
    replicated ``[L]`` permutation)."""
    return lambda: (*_block_sparse_inputs(B, H)(), torch.randperm(L))


def _attention_int8(seq_dim, q, k, v, precision="int8"):
    return compile_ops.attention(q, k, v, seq_dim=seq_dim, precision=precision)


def _attention_fp8_rows(seq_dim, q, k, v):
    return _as_floats(compile_ops.attention_fp8_rows(q, k, v, seq_dim=seq_dim))


def _attention_int8_inputs(seq_dim):
    """16-bit q, k, v (8-bit attention's inputs), inference: no gradient."""

    def qkv(heads, length):
        shape = (B, heads, length, D) if seq_dim == 2 else (B, length, heads, D)
        return torch.randn(shape).to(torch.bfloat16)

    return lambda: (qkv(H, L), qkv(HK, L), qkv(HK, L))


def _quantizing_rotation(q, k, w, w_k, c, sn):
    return tuple(compile_ops.qk_norm_rope(q, k, w, w_k, c, sn, interleaved=True, seq_dim=1, quantize=True))


def _attention_on_quantized(q, k, w, w_k, c, sn):
    qk = compile_ops.qk_norm_rope(q, k, w, w_k, c, sn, interleaved=True, seq_dim=1, quantize=True)
    return compile_ops.attention(qk, None, k, seq_dim=1, precision="int8_fp8")


def _quantizing_rotation_inputs():
    """16-bit [B, L, H, D] q, k (GQA), norm weights and full tables: inference."""
    return (
        torch.randn(B, L, H, D).to(torch.bfloat16),
        torch.randn(B, L, HK, D).to(torch.bfloat16),
        torch.rand(D) + 0.5,
        torch.rand(D) + 0.5,
        torch.randn(L, D),
        torch.randn(L, D),
    )


def _attention_cases():
    for seq_dim in (2, 1):
        heads = 3 - seq_dim
        for axis, d in (("batch", 0), ("heads", heads), ("sequence", seq_dim)):
            # Sequence shards move to head shards and back (Ulysses): k's mean
            # (the smoothing) is then over whole sequences, as unsharded.
            s = Shard(d)
            yield Case(
                f"attention_int8_seq_dim{seq_dim}/{axis}",
                partial(_attention_int8, seq_dim),
                _attention_int8_inputs(seq_dim),
                (s, s, s),
                (s,),
            )
        # FP8 P V: v's channel scales are over whole sequences too; one case (sequence shards, which
        # move to head shards) suffices beside the int8 ones, the rule being theirs.
        if seq_dim == 1:
            yield Case(
                "attention_int8_fp8_seq_dim1/sequence",
                partial(_attention_int8, 1, precision="int8_fp8"),
                _attention_int8_inputs(1),
                (Shard(1),) * 3,
                (Shard(1),),
            )
        # Its FP8 output rows: the scale is a max over every head of v, so batch
        # shards stay local and head shards are gathered (replicated outputs).
        rows = partial(_attention_fp8_rows, seq_dim)
        yield Case(
            f"attention_fp8_rows_seq_dim{seq_dim}/batch",
            rows,
            _attention_int8_inputs(seq_dim),
            (Shard(0),) * 3,
            (Shard(0), Shard(0)),
        )
        yield Case(
            f"attention_fp8_rows_seq_dim{seq_dim}/heads",
            rows,
            _attention_int8_inputs(seq_dim),
            (Shard(heads),) * 3,
            (R, R),
        )
    for seq_dim in (2, 1):
        heads = 3 - seq_dim
        for axis, d in (("batch", 0), ("heads", heads)):
            s, lse = Shard(d), Shard(0 if axis == "batch" else 1)
            lengths = Shard(0) if axis == "batch" else R
            yield Case(
                f"attention_seq_dim{seq_dim}/{axis}",
                partial(_attention, seq_dim),
                _attention_inputs(seq_dim),
                (s, s, s, lengths),
                (s, lse),
                (s, s, s, None),
            )
    for axis, d in (("batch", 0), ("heads", 1)):
        s = Shard(d)
        yield Case(
            f"block_sparse_attention/{axis}",
            _block_sparse,
            _block_sparse_inputs(B, H),
            (s, s, s, s, s),
            (s, s),
            (s, s, s, None, None),
        )
        yield Case(
            f"block_sparse_attention_shared_lists/{axis}",
            _block_sparse,
            _block_sparse_inputs(1, 1),
            (s, s, s, R, R),
            (s, s),
            (s, s, s, None, None),
        )
        yield Case(
            f"block_sparse_attention_token_order/{axis}",
            _block_sparse_ordered,
            _block_sparse_ordered_inputs(),
            (s, s, s, s, s, R),
            (s, s),
            (s, s, s, None, None, None),
        )
    # q and k quantized by their rotation (k's smoothing mean spans the sequence:
    # batch and head shards only), and 8-bit attention on them.
    for axis, d in (("batch", 0), ("heads", 2)):
        s, scales = Shard(d), Shard(0 if axis == "batch" else 1)
        yield Case(
            f"qk_rope_int8/{axis}",
            _quantizing_rotation,
            _quantizing_rotation_inputs,
            (s, s, R, R, R, R),
            (s, scales, s, scales),
        )
        yield Case(
            f"attention_qk8/{axis}", _attention_on_quantized, _quantizing_rotation_inputs, (s, s, R, R, R, R), (s,)
        )
    # Sequence-sharded q/k/v: the public functions move them to head shards and
    # back (Ulysses), so the results come back sharded on the sequence. (gloo
    # has no all-to-all: DTensor emulates it with all-gathers on CPU;
    # bench/runners/distributed_train.py checks NCCL's all-to-alls.)
    for seq_dim in (2, 1):
        s = Shard(seq_dim)
        yield Case(
            f"attention_seq_dim{seq_dim}/sequence",
            partial(_attention, seq_dim),
            _attention_inputs(seq_dim),
            (s, s, s, R),
            (s, Shard(2)),
            (s, s, s, None),
        )
    yield Case(
        "block_sparse_attention/sequence",
        _block_sparse,
        _block_sparse_inputs(B, H),
        (Shard(2), Shard(2), Shard(2), R, R),
        (Shard(2), Shard(2)),
        (Shard(2), Shard(2), Shard(2), None, None),
    )


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


def _qk_norm_attention(q, k, v, weight):
    return compile_ops.attention(compile_ops.rmsnorm(q, weight), k, v, seq_dim=1)


def _compiled_cases():
    """The rules under ``torch.compile(fullgraph=True)``: Dynamo traces DTensors
    through the ops' sharding rules, and through sequence_parallel's
    redistributes for sequence shards."""
    compiled = torch.compile(_qk_norm_attention, fullgraph=True, backend="aot_eager")
    for axis, d in (("heads", 2), ("sequence", 1)):
        s = Shard(d)
        yield Case(
            f"compiled_qk_norm_attention/{axis}",
            compiled,
            lambda: (act(B, L, H, D), act(B, L, HK, D), act(B, L, HK, D), param(D)),
            (s, s, s, R),
            (s,),
            (s, s, s, P),
        )


def _as_floats(out):
    """FP8 outputs as floats: assert_close has no float8 path."""
    return tuple(t.float() if t.dtype == torch.float8_e4m3fn else t for t in _flatten(out))


def _flatten(out):
    for t in out if isinstance(out, tuple) else (out,):
        yield from (_flatten(t) if isinstance(t, tuple) else (t,))


def _quantize_fp8(x, activation="none"):
    return _as_floats(compile_ops.quantize_fp8_rows(x, activation))


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
    # Tensor and option arguments by keyword: the rule binds them by name.
    yield Case(
        "attention_keyword_arguments/batch",
        lambda q, k, v, n: torch.ops.fused.attention(q, k, v, 0.35, False, seq_dim=1, kv_lengths=n),
        _attention_inputs(1),
        (Shard(0),) * 4,
        (Shard(0), Shard(0)),
        (Shard(0),) * 3 + (None,),
    )
    yield from _attention_cases()
    yield from _compiled_cases()
    yield from _not_local_cases()
    yield from _moe_cases()


CASES = {case.name: case for case in _cases()} if dist.is_available() else {}


# ---------------------------------------------------------------- the check, run on every rank


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def check(case: Case, mesh) -> None:
    """Raise AssertionError where the DTensor run differs from the full-tensor run."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)  # the same tensors on every rank
    full = case.make()
    sharded = [
        distribute_tensor(t.detach(), mesh, _per_mesh_dim(p)).requires_grad_(t.requires_grad)
        for t, p in zip(full, case.shard)
    ]
    out = _as_tuple(case.fn(*sharded))
    want = _as_tuple(case.fn(*full))
    for i, (o, w) in enumerate(zip(out, want)):
        if case.outputs is not None:
            expected = _per_mesh_dim(case.outputs[i])
            assert o.placements == expected, f"output {i}: placements {o.placements}, expected {expected}"
        if case.not_sharded_on is not None:
            assert Shard(case.not_sharded_on) not in o.placements, f"output {i} is sharded on a dim the op cannot split"
        _close(o.full_tensor(), w, f"output {i}")

    chosen = range(len(out)) if case.differentiate is None else case.differentiate
    chosen = [i for i in chosen if want[i].requires_grad]
    cotangents = [torch.randn(want[i].shape) for i in chosen]
    torch.autograd.backward([want[i] for i in chosen], cotangents)
    torch.autograd.backward(
        [out[i] for i in chosen], [distribute_tensor(g, mesh, out[i].placements) for i, g in zip(chosen, cotangents)]
    )
    for i, (t, s) in enumerate(zip(full, sharded)):
        if not t.requires_grad:
            continue
        if t.grad is None:
            assert s.grad is None, f"gradient {i}: the full run has none"
            continue
        expected = case.grads[i] if i < len(case.grads) else None
        if expected is not None:
            expected = _per_mesh_dim(expected)
            assert s.grad.placements == expected, f"gradient {i}: placements {s.grad.placements}, expected {expected}"
        _close(s.grad.full_tensor(), t.grad, f"gradient {i}")


def _run_with_wrong_rule(mesh) -> Optional[str]:
    """Register a rule that lets rmsnorm run on channel shards (each rank then
    normalizes half a row): :func:`check` must fail. None when it did."""
    from torch.distributed.tensor import DTensor

    from compile_ops import distributed

    def every_dim(shape, call):
        return {d: d for d in range(len(shape))}

    def along_x_channels(shape, call):
        return {len(call.primary.shape) - 1: 0}

    op = torch.ops.fused.rmsnorm.default
    propagator = DTensor._op_dispatcher.sharding_propagator
    good = propagator.op_strategy_funcs[op]
    wrong = distributed.Rule(
        {"x": every_dim, "weight": along_x_channels, "bias": distributed.replicated},
        (distributed.Out("x", every_dim),),
        lambda call: range(len(call.primary.shape)),
    )
    case = Case(
        "rmsnorm/channel_with_wrong_rule",
        lambda x, w: compile_ops.rmsnorm(x, w),
        lambda: (act(B, L + 2, C), param(C)),
        (Shard(2), R),
        None,
    )
    propagator.register_op_strategy(op, partial(distributed.sharding_strategy, wrong))
    propagator.propagate_op_sharding.cache_clear()
    try:
        check(case, mesh)
    except AssertionError:
        return None
    finally:
        propagator.register_op_strategy(op, good)
        propagator.propagate_op_sharding.cache_clear()
    return "a rule that splits rmsnorm's channel dim went undetected"


WRONG_RULE = "harness_detects_a_wrong_rule"
EVERY_OP = "every_fused_op_ran_on_dtensors"


def _record_sharded_ops() -> set:
    """Wrap each fused op's strategy so that the names of the ops DTensor
    propagated (forward and backward) collect in the returned set."""
    from torch.distributed.tensor import DTensor

    from compile_ops.distributed import RULES

    propagator = DTensor._op_dispatcher.sharding_propagator
    seen = set()

    def recording(name, strategy, op_schema):
        seen.add(name)
        return strategy(op_schema)

    for name in RULES:
        op = getattr(torch.ops.fused, name).default
        propagator.op_strategy_funcs[op] = partial(recording, name, propagator.op_strategy_funcs[op])
    return seen


def _worker(rank: int, world: int, directory: str) -> None:
    torch.set_num_threads(1)  # two ranks on a 2-core box
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(directory, 'rendezvous')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        from torch.distributed.device_mesh import init_device_mesh

        meshes = {shape: init_device_mesh("cpu", shape) for shape in sorted({c.mesh for c in CASES.values()})}
        sharded_ops = _record_sharded_ops()
        verdicts = {}
        for name, case in CASES.items():
            try:
                check(case, meshes[case.mesh])
                verdicts[name] = None
            except Exception:
                verdicts[name] = traceback.format_exc()
        try:
            verdicts[WRONG_RULE] = _run_with_wrong_rule(meshes[(world,)])
        except Exception:
            verdicts[WRONG_RULE] = traceback.format_exc()
        from compile_ops.distributed import RULES

        missing = sorted(set(RULES) - sharded_ops)
        verdicts[EVERY_OP] = f"never dispatched with DTensors: {missing}" if missing else None
        with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:
            json.dump(verdicts, f)
    except BaseException:
        dist.destroy_process_group()  # leave at once: no barrier, no join of threads a peer may hold up
        raise
    # gloo's threads end here, not during interpreter exit (the likely cause of
    # the FSDP2 test's rare SIGABRT): see teardown_process_group.
    from bench.runners.distributed_train import teardown_process_group

    teardown_process_group()


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """``{case: None or the failure on some rank}`` from one spawn of 2 ranks."""
    return spawn_verdicts(_worker, WORLD, str(tmp_path_factory.mktemp("gloo")), SPAWN_TIMEOUT_S)


@pytest.mark.parametrize("name", [*CASES, WRONG_RULE, EVERY_OP])
def test_sharded_matches_full(verdicts, name):
    failure = verdicts[name]
    if failure is not None:
        pytest.fail(failure, pytrace=False)


# ---------------------------------------------------------------- in-process checks of the rule table


def test_every_op_has_a_rule_that_matches_its_schema():
    from compile_ops import distributed

    distributed.check_rules()  # raises on a missing op, argument or return
