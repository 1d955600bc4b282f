"""The fused ops on several GPUs: FSDP2 + torch.compile training of a Flux-size
block stack, and a block with its attention heads sharded across GPUs.

    PYTHONPATH=. python bench/runners/distributed_train.py [--gpus 2] [--out bench/results]

What it runs (each world size in its own processes, ``torch.multiprocessing``;
NCCL on GPUs, gloo on CPU):

1. **FSDP2 training.** A stack of ``bench.demo.DiTBlock`` s (Flux size: 3072
   wide, 24 heads of 128, 4x GELU-tanh MLP; every norm, modulation, gated
   residual and attention a fused op), each block compiled with
   ``fullgraph=True`` and then sharded with ``fully_shard`` (bf16 compute,
   fp32 parameters, fp32 gradient reduction), trained with AdamW on a
   mean-square loss. The global batch is fixed (``--global-batch`` samples of
   ``--tokens`` tokens, the same data every run), so one GPU and N GPUs train
   the same model on the same data: their per-step losses must agree within
   bf16 rounding (``--loss-rtol``; the runs differ only in GEMM shapes and
   reduction order). Throughput is samples/s, total and per GPU, over the
   steps after compilation.
2. **Heads-sharded attention** (N > 1). One block under tensor parallelism:
   q/k/v and the MLP input projections column-sharded (so q, k and v are
   DTensors sharded on heads), the output projections row-sharded, the rest
   replicated. ``fused.rmsnorm`` (qk-norm) and ``fused.attention`` then run on
   each GPU's heads through compile_ops' DTensor sharding rules
   (``compile_ops/distributed.py``). Checked against the unsharded block,
   forward and the gradients, and with ``CommDebugMode``: the forward's only
   collectives must be the two row-parallel all-reduces (attention did not
   gather). Timed eagerly and compiled with ``fullgraph=True`` (DTensor inputs).
3. **Sequence-sharded attention** (N > 1): ``compile_ops.attention`` on q/k/v
   sharded on the sequence, which it runs by all-to-all on head shards
   (``compile_ops._dtensor.sequence_parallel``), against the unsharded
   call; timed eagerly and compiled.

Writes ``<out>/distributed-train-<gpu>.json``; exits non-zero when a check
fails. ``tests/test_distributed_train.py`` runs the same code on CPU with a
tiny config.
"""

import argparse
import copy
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
import warnings
from functools import partial

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from bench.demo import DiTBlock  # noqa: E402
from bench.tables.distributed_train import compiled_summary  # noqa: E402
from bench.toolkit import environment, relative_l2, write_results  # noqa: E402


@dataclasses.dataclass
class Config:
    dim: int = 3072
    heads: int = 24
    depth: int = 8
    tokens: int = 4096
    global_batch: int = 4
    steps: int = 30
    warmup: int = 5
    lr: float = 1e-4
    dtype: str = "bfloat16"
    compile_backend: str = "inductor"  # "" runs eagerly
    loss_rtol: float = 2e-2
    tp_rtol: float = 3e-2


class BlockStack(nn.Module):
    """``depth`` DiT blocks applied in turn: ``forward(x [B, L, dim], temb [B, dim]) -> [B, L, dim]``."""

    def __init__(self, config: Config):
        super().__init__()
        self.blocks = nn.ModuleList(DiTBlock(config.dim, config.heads, fused=True) for _ in range(config.depth))

    def forward(self, x, temb):
        for block in self.blocks:
            x = block(x, temb)
        return x


def _batch(config: Config, step: int, device) -> tuple:
    """The global batch of one step, the same on every rank and in every run."""
    g = torch.Generator(device=device).manual_seed(1000 + step)
    shape = (config.global_batch, config.tokens, config.dim)
    x = torch.randn(shape, generator=g, device=device)
    temb = torch.randn(config.global_batch, config.dim, generator=g, device=device)
    return x, temb, torch.randn(shape, generator=g, device=device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fsdp_training(config: Config, mesh, device) -> dict:
    """Train the stack with FSDP2 on ``mesh``; per-step global losses and the time per step."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world, rank = mesh.size(), mesh.get_rank()
    if config.global_batch % world:
        raise ValueError(f"--global-batch ({config.global_batch}) must be a multiple of the world size ({world})")
    torch.manual_seed(0)
    with torch.device(device):
        model = BlockStack(config)
    if config.compile_backend:
        # Compile each block, then shard it (torchtitan's order): FSDP2's
        # hooks stay outside the compiled region, one graph per block.
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, fullgraph=True, backend=config.compile_backend)
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, config.dtype), reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # Issue block i+1's all-gather when block i starts, not when the CPU reaches i+1.
    for block, following in zip(model.blocks, model.blocks[1:]):
        block.set_modules_to_forward_prefetch([following])
    # One fused kernel per step rather than foreach's dozen passes over the fp32 state.
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, fused=device.type == "cuda")
    local = config.global_batch // world
    rows = slice(rank * local, (rank + 1) * local)
    losses, start = [], None
    for step in range(config.steps):
        if step == config.warmup:
            _sync(device)
            start = time.perf_counter()
        x, temb, target = _batch(config, step, device)
        loss = F.mse_loss(model(x[rows], temb[rows]).float(), target[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    _sync(device)
    seconds = (time.perf_counter() - start) / (config.steps - config.warmup)
    total = torch.stack(losses)
    dist.all_reduce(total)  # each rank's loss is the mean of its equal share of the batch
    return {
        "losses": (total / world).tolist(),
        "step_ms": seconds * 1e3,
        "samples_per_s": config.global_batch / seconds,
        "peak_MiB": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
    }


def _tensor_parallel(block: DiTBlock, mesh) -> DiTBlock:
    """Megatron-style tensor parallelism of one block: q/k/v and the MLP input
    column-sharded, their output projections row-sharded, every other
    parameter replicated; activations stay DTensors throughout, so the fused
    ops between the projections receive DTensors (q/k/v sharded on heads)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    column, row = ColwiseParallel(use_local_output=False), RowwiseParallel(use_local_output=False)
    parallelize_module(
        block, mesh, {"to_q": column, "to_k": column, "to_v": column, "proj": row, "mlp_in": column, "mlp_out": row}
    )
    for module in block.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                module.register_parameter(name, nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()])))
    return block


def heads_sharded_block(config: Config, mesh, device) -> dict:
    """One block with its heads split over ``mesh``, against the same block
    unsharded: output and gradients, the forward's collectives, and times."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.debug import CommDebugMode

    dtype = getattr(torch, config.dtype)
    torch.manual_seed(1)
    with torch.device(device):
        reference = DiTBlock(config.dim, config.heads, fused=True).to(dtype)
    sharded = _tensor_parallel(copy.deepcopy(reference), mesh)
    x, temb, grad = _batch(config, 0, device)
    x, temb, grad = (t[:1].to(dtype) for t in (x, temb, grad))
    replicated = [Replicate()] * mesh.ndim

    def sharded_step(block=sharded):
        sharded.zero_grad(set_to_none=True)
        out = block(DTensor.from_local(x, mesh, replicated), DTensor.from_local(temb, mesh, replicated))
        out.backward(DTensor.from_local(grad, mesh, replicated))
        return out

    def reference_step(block=reference):
        reference.zero_grad(set_to_none=True)
        out = block(x, temb)
        out.backward(grad)
        return out

    with CommDebugMode() as comm:
        sharded(DTensor.from_local(x, mesh, replicated), DTensor.from_local(temb, mesh, replicated))
    forward_collectives = {str(k): v for k, v in comm.get_comm_counts().items()}
    got, want = sharded_step(), reference_step()
    errors = {"output": relative_l2(got.full_tensor(), want)}
    for (name, p), (_, q) in zip(sharded.named_parameters(), reference.named_parameters()):
        errors[name] = relative_l2(p.grad.full_tensor(), q.grad)
    return {
        "forward_collectives": forward_collectives,
        "relative_errors": errors,
        "sharded_ms": _time(sharded_step, device),
        "unsharded_ms": _time(reference_step, device),
        **_compiled_times(
            config,
            partial(sharded_step, _compile(config, sharded)),
            partial(reference_step, _compile(config, reference)),
            device,
        ),
    }


def sequence_sharded_attention(config: Config, mesh, device) -> dict:
    """``compile_ops.attention`` on q/k/v sharded on the sequence (context
    parallelism), against the unsharded call: output and gradients, the
    forward's collectives (all-to-alls on NCCL; gloo has none and DTensor
    emulates them with all-gathers), the output's placement, and times."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    import compile_ops

    torch.manual_seed(2)
    shape = (1, config.tokens, config.heads, config.dim // config.heads)  # [B, L, H, D]
    full = [torch.randn(shape, device=device, dtype=getattr(torch, config.dtype), requires_grad=True) for _ in range(3)]
    grad = torch.randn_like(full[0])
    sharded = [distribute_tensor(t.detach(), mesh, [Shard(1)]).requires_grad_() for t in full]
    sharded_grad = distribute_tensor(grad, mesh, [Shard(1)])
    with CommDebugMode() as comm:
        out = compile_ops.attention(*sharded, seq_dim=1)
    out.backward(sharded_grad)
    want = compile_ops.attention(*full, seq_dim=1)
    want.backward(grad)
    errors = {"output": relative_l2(out.full_tensor(), want)}
    errors.update({f"d{name}": relative_l2(s.grad.full_tensor(), t.grad) for name, s, t in zip("qkv", sharded, full)})

    def attend(q, k, v):
        return compile_ops.attention(q, k, v, seq_dim=1)

    def step(inputs, g, fn=attend):
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(g)

    compiled = _compile(config, attend)
    return {
        "forward_collectives": {str(k): v for k, v in comm.get_comm_counts().items()},
        "output_placements": str(out.placements),
        "relative_errors": errors,
        "backend": dist.get_backend(),
        "sharded_ms": _time(lambda: step(sharded, sharded_grad), device),
        "unsharded_ms": _time(lambda: step(full, grad), device),
        **_compiled_times(
            config, lambda: step(sharded, sharded_grad, compiled), lambda: step(full, grad, compiled), device
        ),
    }


def _compile(config: Config, fn):
    return torch.compile(fn, fullgraph=True, backend=config.compile_backend) if config.compile_backend else fn


def _compiled_times(config: Config, sharded_step, unsharded_step, device) -> dict:
    """``{"compiled_sharded_ms", "compiled_unsharded_ms"}`` (fullgraph), or the
    error that compiling raised: DTensor under compile is newer ground than
    the eager path, and a failure here is a finding, not a crash of the run."""
    if not config.compile_backend:
        return {}
    try:
        return {
            "compiled_sharded_ms": _time(sharded_step, device),
            "compiled_unsharded_ms": _time(unsharded_step, device),
        }
    except Exception as e:  # noqa: BLE001 (reported in the results)
        return {"compile_error": f"{type(e).__name__}: {str(e)[:400]}"}


def _time(step, device, reps: int = 10) -> float:
    """ms per call of ``step`` (a forward+backward that clears its own gradients)."""
    for _ in range(2):
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        step()
    _sync(device)
    return (time.perf_counter() - start) / reps * 1e3


def _worker(rank: int, world: int, config: Config, rendezvous: str, out_path: str, device_type: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    if device_type == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the CPU's cores
    # A file rendezvous, not MASTER_ADDR/MASTER_PORT: no TCPStore server thread
    # on rank 0 (with env:// it ran until the process exited, see
    # teardown_process_group) and no free port to pick and lose in between.
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world
    )
    try:
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        mesh = init_device_mesh(device_type, (world,))
        result = {"world": world, "training": fsdp_training(config, mesh, device)}
        if world > 1:
            result["heads_sharded"] = heads_sharded_block(config, mesh, device)
            result["sequence_sharded"] = sequence_sharded_attention(config, mesh, device)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
    except BaseException:
        # A failed rank leaves at once (its peers may sit in a collective that
        # will never complete; spawn terminates them): no barrier, and the group
        # is not freed, since freeing it joins threads that may be stuck there.
        dist.destroy_process_group()
        raise
    teardown_process_group(device_ids=[rank] if device_type == "cuda" else None)


#: Names (``/proc/self/task/*/comm``) of the threads that the c10d backends and stores start.
_BACKEND_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore", "pt_nccl")


def teardown_process_group(device_ids=None) -> None:
    """Destroy the default process group so that its threads end here, not at interpreter exit.

    Why: gloo has no shutdown, so ``destroy_process_group()`` alone leaves its
    threads (``pt_gloo_runloop``, ``gloo_tcp_loop``; with env:// also rank 0's
    ``pt_tcpstore_uv``) running until the ProcessGroup object is freed, and a
    DeviceMesh holds its groups in ``_pg_registry`` while DTensor's
    module-level caches hold the mesh: the object was never freed, and those
    threads ran on through interpreter finalization and exit(), the likely
    window of the CPU test's rare ``terminate called without an active
    exception`` SIGABRT. So: a barrier (no rank frees its backend while a
    peer is still in a collective with it), destroy, drop every mesh's
    references (a mesh is dead once its groups are; torch.compile's copies of
    the mesh hold them too) and collect: the group's destructor drains its
    queue and joins its threads now, with the interpreter fully alive. Warns
    if a backend thread survives (a torch that holds the group elsewhere).
    """
    dist.barrier(device_ids=device_ids)
    dist.destroy_process_group()
    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():
        if issubclass(type(obj), DeviceMesh):  # not isinstance: gc's list holds weak proxies, which raise there
            getattr(obj, "_pg_registry", {}).clear()
    gc.collect()
    leftover = [name for name in _thread_names() if name.startswith(_BACKEND_THREADS)]
    if leftover:
        warnings.warn(f"threads of the destroyed process group still running: {leftover}", stacklevel=2)


def _thread_names() -> list:
    """This process's threads by name (Linux; empty elsewhere)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names


def run_world(config: Config, world: int, device_type: str) -> dict:
    """Run :func:`_worker` on ``world`` processes; rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        rendezvous = os.path.join(tmp, "rendezvous")
        torch.multiprocessing.spawn(
            _worker, args=(world, config, rendezvous, out_path, device_type), nprocs=world, join=True
        )
        with open(out_path) as f:
            return json.load(f)


def check(config: Config, single: dict, multi: dict) -> list:
    """What failed: per-step losses of the two runs, the sharded block's errors
    and collectives. Empty when everything agrees."""
    failures = []
    for step, (a, b) in enumerate(zip(single["training"]["losses"], multi["training"]["losses"])):
        if abs(a - b) > config.loss_rtol * abs(a):
            failures.append(f"step {step}: loss {b:.6f} on {multi['world']} ranks, {a:.6f} on 1")
    heads = multi["heads_sharded"]
    failures += [
        f"heads-sharded block: {name} relative error {err:.2e} > {config.tp_rtol}"
        for name, err in heads["relative_errors"].items()
        if not err <= config.tp_rtol
    ]
    collectives = heads["forward_collectives"]
    if set(collectives) != {"c10d_functional.all_reduce"} or sum(collectives.values()) != 2:
        failures.append(f"heads-sharded forward: collectives {collectives}, expected the 2 row-parallel all-reduces")
    sequence = multi["sequence_sharded"]
    failures += [
        f"sequence-sharded attention: {name} relative error {err:.2e} > {config.tp_rtol}"
        for name, err in sequence["relative_errors"].items()
        if not err <= config.tp_rtol
    ]
    if sequence["output_placements"] != "(Shard(dim=1),)":
        failures.append(f"sequence-sharded attention: output {sequence['output_placements']}, expected Shard(dim=1)")
    gathers = [k for k in sequence["forward_collectives"] if "all_gather" in k]
    if sequence["backend"] == "nccl" and gathers:  # gloo has no all-to-all: DTensor gathers there
        failures.append(f"sequence-sharded attention gathered: {sequence['forward_collectives']}")
    return failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    for field in dataclasses.fields(Config):
        p.add_argument(f"--{field.name.replace('_', '-')}", type=field.type, default=field.default)
    args = p.parse_args(argv)
    config = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)})
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda" and torch.cuda.device_count() < args.gpus:
        print(f"distributed_train.py: needs {args.gpus} GPUs, found {torch.cuda.device_count()}")
        return 2
    single = run_world(config, 1, device_type)
    multi = run_world(config, args.gpus, device_type)
    # Throughput baseline: one rank with the per-rank batch of the multi-rank
    # run (the loss comparison needs the whole global batch on one rank).
    per_rank = dataclasses.replace(config, global_batch=config.global_batch // args.gpus)
    baseline = run_world(per_rank, 1, device_type) if args.gpus > 1 else single
    failures = check(config, single, multi)
    a, b, c = single["training"], multi["training"], baseline["training"]
    print(
        f"1 rank, batch {config.global_batch}: {a['step_ms']:.1f} ms/step, {a['samples_per_s']:.2f} samples/s; "
        f"1 rank, batch {per_rank.global_batch}: {c['step_ms']:.1f} ms/step, {c['samples_per_s']:.2f} samples/s; "
        f"{args.gpus} ranks: {b['step_ms']:.1f} ms/step, {b['samples_per_s']:.2f} samples/s "
        f"= {b['samples_per_s'] / c['samples_per_s']:.2f}x one rank at the same batch per rank "
        f"({b['samples_per_s'] / a['samples_per_s']:.2f}x one rank with the whole batch)"
    )
    print(
        f"losses: first {a['losses'][0]:.5f} / {b['losses'][0]:.5f}, last {a['losses'][-1]:.5f} / "
        f"{b['losses'][-1]:.5f}, max relative difference "
        f"{max(abs(x - y) / abs(x) for x, y in zip(a['losses'], b['losses'])):.2e}"
    )
    heads = multi["heads_sharded"]
    print(
        f"heads-sharded block: {heads['sharded_ms']:.2f} ms fwd+bwd against {heads['unsharded_ms']:.2f} unsharded "
        f"({compiled_summary(heads)}); "
        f"forward collectives {heads['forward_collectives']}; worst relative error "
        f"{max(heads['relative_errors'].values()):.2e}"
    )
    sequence = multi["sequence_sharded"]
    print(
        f"sequence-sharded attention: {sequence['sharded_ms']:.2f} ms fwd+bwd against "
        f"{sequence['unsharded_ms']:.2f} on one GPU ({compiled_summary(sequence)}); "
        f"output {sequence['output_placements']}; forward collectives "
        f"{sequence['forward_collectives']}; worst relative error {max(sequence['relative_errors'].values()):.2e}"
    )
    if device_type == "cuda":
        print(
            "wrote",
            write_results(
                args.out,
                "distributed-train",
                environment(),
                [
                    {
                        "config": dataclasses.asdict(config),
                        "gpus": args.gpus,
                        "single": single,
                        "baseline": baseline,
                        "multi": multi,
                        "failures": failures,
                    }
                ],
            ),
        )
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
