"""The README's multi-GPU example (``bench/runners/distributed_train.py``) end to end.

On CPU (gloo, 2 processes, a tiny fp32 config compiled with aot_eager) in CI;
on CUDA (NCCL, 2 GPUs, bf16, Inductor) where a machine has two GPUs. Checks
what the benchmark checks: FSDP2 + compile training on 2 ranks gives the
per-step losses of 1 rank on the same global batch, and a block with its heads
sharded across ranks gives the unsharded block's output and gradients with
no collective in the forward besides the two row-parallel all-reduces (so
qk-norm and attention ran on each rank's heads, through compile_ops' DTensor
sharding rules).
"""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.runners import distributed_train  # noqa: E402

CONFIGS = {
    "cpu": distributed_train.Config(
        dim=64,
        heads=4,
        depth=2,
        tokens=32,
        steps=4,
        warmup=1,
        dtype="float32",
        compile_backend="aot_eager",
        lr=1e-2,
        loss_rtol=1e-5,
        tp_rtol=1e-5,
    ),
    # bf16: the two runs differ in GEMM shapes and reduction order.
    "cuda": distributed_train.Config(dim=512, heads=4, depth=2, tokens=256, steps=12, warmup=2),
}


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed")
@pytest.mark.parametrize(
    "device_type",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"))],
)
def test_fsdp2_training_on_two_ranks_matches_one_and_heads_shard_locally(device_type):
    config = CONFIGS[device_type]
    single = distributed_train.run_world(config, 1, device_type)
    multi = distributed_train.run_world(config, 2, device_type)
    assert distributed_train.check(config, single, multi) == []
    # Not vacuous: every step was compared, and the updates (the reduced
    # gradients) moved the losses away from those of an untrained model.
    losses = single["training"]["losses"]
    assert len(losses) == len(multi["training"]["losses"]) == config.steps
    frozen = distributed_train.run_world(dataclasses.replace(config, lr=0.0), 1, device_type)["training"]["losses"]
    assert frozen[0] == pytest.approx(losses[0], rel=1e-6)
    assert all(abs(a - b) > 1e-4 * abs(b) for a, b in zip(frozen[1:], losses[1:])), (frozen, losses)
