"""Attention's DTensor sharding rules: 2 CPU processes on gloo, the reference path.

The cases and checks of test_distributed.py (see its docstring), on attention:
dense attention (causal, with key lengths, lse returned) and its arguments by
keyword; 8-bit attention (int8, FP8 P V) and its FP8 output rows; block-sparse
attention (per-head lists, shared lists, a token order); q and k quantized by
their rotation, and 8-bit attention on them; qk-norm then attention under
``torch.compile(fullgraph=True)``.

Batch and head shards run locally. On sequence shards the public functions
switch q/k/v to head shards and the results back (Ulysses;
compile_ops._dtensor.sequence_parallel), so the results come back sharded on
the sequence. Attention on head-dim shards and on a 2-D mesh are with the other
"not local" and 2-D mesh cases in test_distributed.py.

These cases run in the same spawn as test_distributed.py's
(tests/distributed_helpers.py); each is a test of its own that reads the
spawn's verdict.
"""

from functools import partial

import pytest
import torch
import torch.distributed as dist
from distributed_helpers import (
    HK,
    B,
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
)

import compile_ops

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)


# ---------------------------------------------------------------- cases: attention


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


def _block_sparse_fp8_rows(q, k, v, index, count, order):
    return _as_floats(compile_ops.block_sparse_attention_fp8_rows(q, k, v, index, count, token_order=order))


def _block_sparse_fp8_rows_inputs():
    """:func:`_block_sparse_ordered_inputs` in 16 bits (8-bit attention's inputs), inference: no gradient."""
    return lambda: tuple(
        t.detach().to(torch.bfloat16) if t.is_floating_point() else t for t in _block_sparse_ordered_inputs()()
    )


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
        # Its FP8 rows: the scale spans every head (attention_fp8_rows' rule), so head shards are gathered.
        yield Case(
            f"block_sparse_attention_fp8_rows/{axis}",
            _block_sparse_fp8_rows,
            _block_sparse_fp8_rows_inputs(),
            (s, s, s, s, s, R),
            (s, s) if axis == "batch" else (R, R),
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


# ---------------------------------------------------------------- cases: under torch.compile


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


def _cases():
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


CASES = {case.name: case for case in _cases()} if dist.is_available() else {}


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """``{case: None or the failure on some rank}`` from the one spawn of 2 ranks (distributed_helpers)."""
    return every_verdict(tmp_path_factory)


@pytest.mark.parametrize("name", [*CASES])
def test_sharded_matches_full(verdicts, name):
    failure = verdicts[name]
    if failure is not None:
        pytest.fail(failure, pytrace=False)
