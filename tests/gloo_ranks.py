"""Run test cases on several CPU processes over gloo, and read back each case's verdict.

A worker ``worker(rank, world, directory)`` runs every case on its rank and
writes ``{case: None or the failure}`` to ``<directory>/rank<rank>.json``;
:func:`spawn_verdicts` starts the ranks, waits with a deadline, and merges the
files: a case fails when it failed on any rank (the first rank's failure).

:func:`run_cases` is a worker's body: join the gloo group, run the cases,
write the verdicts, leave the group.
"""

import datetime
import json
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_cases(rank: int, world: int, directory: str, cases) -> None:
    """On this rank, join the gloo group of ``world`` ranks (rendezvous in
    ``directory``), call ``cases()`` for ``{name: callable}`` and run each,
    writing ``{name: None or the failure}`` to ``<directory>/rank<rank>.json``."""
    torch.set_num_threads(1)  # the ranks share a 2-core box
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(directory, 'rendezvous')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        verdicts = {}
        for name, case in cases().items():
            try:
                case()
                verdicts[name] = None
            except Exception:
                verdicts[name] = traceback.format_exc()
        with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:
            json.dump(verdicts, f)
    except BaseException:
        dist.destroy_process_group()
        raise
    from bench.runners.distributed_train import teardown_process_group

    teardown_process_group()


def spawn_verdicts(worker, world: int, directory: str, timeout_s: float) -> dict:
    """``{case: None or "rank r:\\n<failure>"}`` from one spawn of ``world`` ranks of ``worker``."""
    context = mp.start_processes(worker, args=(world, directory), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {world} gloo ranks did not finish in {timeout_s} s")
    merged = {}
    for rank in range(world):
        with open(os.path.join(directory, f"rank{rank}.json")) as f:
            for name, failure in json.load(f).items():
                if failure is not None and merged.get(name) is None:
                    merged[name] = f"rank {rank}:\n{failure}"
                merged.setdefault(name, None)
    return merged
