"""A/B benchmark of the working tree against a git ref, in one run on one GPU.

    python bench/tools/ab.py --ref main --ops rmsnorm,attention [--shapes 1x4608x3072,...] [--all-shapes]
                             [--kinds fwd_graph,fwdbwd_graph] [--rounds 5] [--compiled] [--quick] [--out FILE]

The ref is checked out into a temporary worktree (``git worktree add
--detach``). Each side runs in a worker process of its own that imports that
side's ``compile_ops`` (its kernels) and op table (its inputs for each op:
``cases/``, or ``compile_ops/registry.py`` in a ref without ``cases/``) and
times with the working tree's ``bench/toolkit.py``, so both sides share one
method: ``toolkit.timed_call`` (the forward under ``no_grad`` or the
training step, as plain calls or CUDA-graph replays), ``toolkit.keep_busy``
right before, and ``toolkit.make_timer``'s ``do_bench`` median. The driver
interleaves the sides: each round times every case on both, the side that
goes first alternating by round and case, so drift falls on both alike.

Cases: each op of ``--ops`` (registry names, e.g. ``rmsnorm``, ``attention``,
``moe_route``) at ``--shapes`` (activation shapes ``[B, L, C]``, as the
registry's input makers take them), else at its first benchmark shape
(``--all-shapes``: every one), else at :data:`DEFAULT_SHAPE`; bf16; each kind
of ``--kinds``, the backward ones only for differentiable ops. Per case and
side, the median over the rounds and the spread ((max - min) / median); the
speed-up is ref ms / tree ms (above 1: the working tree is faster).

Writes one JSON (``--out``, default ``bench/results/ab-<ref>-<gpu>.json``):
the machine line and environment, both commits, the method, and per case both
sides' runs, medians and spreads and the speed-up; the workers' output goes
to the same path with ``.log``. Needs a CUDA device; without one it refuses.
"""

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
TOOLKIT = os.path.join(ROOT, "bench", "toolkit.py")

#: Flux's activation at 1024x1024 (4608 tokens, 3072 wide; attention: 24 heads of 128), for
#: ops without benchmark shapes.
DEFAULT_SHAPE = (1, 4608, 3072)
#: The sides, in the JSON's order: the git ref and the working tree.
SIDES = ("ref", "tree")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", default="main", help="git ref to compare against (default: main)")
    p.add_argument("--ops", required=True, help="comma-separated registry op names")
    p.add_argument("--shapes", default="", help="comma-separated BxLxC shapes for every op")
    p.add_argument("--all-shapes", action="store_true", help="every benchmark shape of each op, not the first")
    p.add_argument(
        "--kinds",
        default="fwd_graph,fwdbwd_graph",
        help="comma-separated timing kinds: fwd, fwdbwd, fwd_graph, fwdbwd_graph",
    )
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (each times every case on both sides)")
    p.add_argument("--compiled", action="store_true", help="time the op under torch.compile(fullgraph=True)")
    p.add_argument("--quick", action="store_true", help="short do_bench runs")
    p.add_argument("--busy-s", type=float, default=0.5, help="seconds each call runs untimed before its timing")
    p.add_argument("--out", default="", help="results JSON (default: bench/results/ab-<ref>-<gpu>.json)")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)  # a side's worker: its source root
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in ("fwd", "fwdbwd", "fwd_graph", "fwdbwd_graph")]
    if unknown:
        p.error(f"unknown kinds {unknown}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.kinds = kinds
    args.ops = [o for o in args.ops.split(",") if o]
    args.shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    return args


def plan_cases(specs: dict, ops: list, shapes: list, kinds: list, all_shapes: bool = False) -> list:
    """``[(op, shape, kind)]`` to time, from registry specs ``{name: OpSpec}``."""
    cases = []
    for op in ops:
        spec = specs.get(op)
        if spec is None or spec.make_inputs is None:
            known = sorted(n for n, s in specs.items() if s.make_inputs is not None)
            raise SystemExit(f"ab.py: {op!r} is not a registry op with inputs; choose from {known}")
        chosen = shapes or [tuple(s) for s in (spec.bench_shapes if all_shapes else spec.bench_shapes[:1])]
        for shape in chosen or [DEFAULT_SHAPE]:
            cases += [
                (op, tuple(shape), kind) for kind in kinds if spec.differentiable or not kind.startswith("fwdbwd")
            ]
    return cases


def round_order(round_index: int, case_index: int) -> tuple:
    """Which side goes first: alternating by round and by case."""
    return SIDES if (round_index + case_index) % 2 == 0 else SIDES[::-1]


def spread(runs: list) -> float:
    """(max - min) / median of a side's runs."""
    return (max(runs) - min(runs)) / statistics.median(runs)


def assemble(cases: list, times: dict, errors: dict, env: dict, commits: dict, method: dict) -> dict:
    """The results JSON: ``times[side][i]`` are case ``i``'s ms per round on
    ``side`` (``"ref"``, ``"tree"``), ``errors[side][i]`` a failure's text."""
    from bench.toolkit import machine_line

    rows = []
    for i, (op, shape, kind) in enumerate(cases):
        row = {"op": op, "shape": list(shape), "kind": kind}
        for side in SIDES:
            runs = times[side].get(i, [])
            if runs:
                row.update(
                    {f"{side}_ms": statistics.median(runs), f"{side}_spread": spread(runs), f"{side}_runs": runs}
                )
            if i in errors[side]:
                row[f"{side}_error"] = errors[side][i]
        if "ref_ms" in row and "tree_ms" in row:
            row["speedup"] = row["ref_ms"] / row["tree_ms"]
        rows.append(row)
    return {"machine": machine_line(env), "env": env, "commits": commits, "method": method, "rows": rows}


def format_rows(data: dict) -> list:
    """The table printed at the end: one line per case."""
    ref = data["commits"]["ref"]["name"]
    lines = [
        data["machine"],
        f"ref {ref} ({data['commits']['ref']['commit'][:10]}) against the working tree "
        f"({data['commits']['tree']['commit'][:10]}{', with changes' if data['commits']['tree']['dirty'] else ''})"
        f"; medians of {data['method']['rounds']} interleaved rounds, (spread)",
        "",
        f"{'op':<28} {'shape':<16} {'kind':<13} {'ref us':>16} {'tree us':>16} {'ref/tree':>9}",
    ]
    for r in data["rows"]:
        cells = []
        for side in SIDES:
            ms = r.get(f"{side}_ms")
            cells.append("failed" if ms is None else f"{ms * 1e3:.1f} ({100 * r[f'{side}_spread']:.1f}%)")
        speedup = f"{r['speedup']:.3f}x" if "speedup" in r else "-"
        shape = "x".join(map(str, r["shape"]))
        lines.append(f"{r['op']:<28} {shape:<16} {r['kind']:<13} {cells[0]:>16} {cells[1]:>16} {speedup:>9}")
    return lines


def default_out(ref: str, gpu_name: str) -> str:
    from bench.toolkit import gpu_slug

    ref_slug = re.sub(r"[^A-Za-z0-9._-]+", "-", ref).strip("-") or "ref"
    return os.path.join(ROOT, "bench", "results", f"ab-{ref_slug}-{gpu_slug(gpu_name)}.json")


# ---------------------------------------------------------------- the worker (one per side)


def _toolkit():
    """The working tree's bench/toolkit.py, loaded by path: the ref's worker times
    with the same code as the tree's, whatever the ref's bench/ holds."""
    spec = importlib.util.spec_from_file_location("ab_toolkit", TOOLKIT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def op_table_module(root: str) -> str:
    """The module that holds ``root``'s op table (``BY_NAME``): the ``cases``
    package, or ``compile_ops.registry`` in a tree without ``cases/``."""
    return "cases" if os.path.isfile(os.path.join(root, "cases", "__init__.py")) else "compile_ops.registry"


def worker(root: str, quick: bool, compiled: bool, busy_s: float) -> int:
    """Serve timing requests on stdin (JSON lines ``{"op", "shape", "kind"}``) with
    ``root``'s compile_ops; answers ``{"ms"}`` or ``{"error"}`` on the original stdout."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what torch, triton and the ops print goes to the log, not into the answers
    sys.path.insert(0, root)
    import torch

    import compile_ops

    table = importlib.import_module(op_table_module(root))
    for module in (compile_ops, table):
        if not os.path.abspath(module.__file__).startswith(os.path.join(root, "")):
            raise SystemExit(f"ab.py worker: {module.__name__} came from {module.__file__}, not {root}")
    toolkit = _toolkit()
    timer = toolkit.make_timer(quick)
    toolkit.warm_up_gpu()
    answers.write(
        json.dumps({"ready": True, "env": toolkit.environment(), "compile_ops": os.path.dirname(compile_ops.__file__)})
        + "\n"
    )
    current, args, fn = None, None, None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            case = (request["op"], tuple(request["shape"]))
            if case != current:  # inputs and the callable of the case, kept while it is timed
                current, args, fn = None, None, None
                torch._dynamo.reset()
                torch.cuda.empty_cache()
                spec = table.BY_NAME[request["op"]]
                torch.manual_seed(0)
                args = spec.make_inputs(case[1], torch.bfloat16, "cuda", True)
                fn = spec.op
                if compiled:

                    def fused(*call_args, op=spec.op):
                        return op(*call_args)

                    fn = torch.compile(fused, fullgraph=True)
                current = case
            call = toolkit.timed_call(fn, args, request["kind"])
            toolkit.keep_busy(call, busy_s)
            answers.write(json.dumps({"ms": timer(call)}) + "\n")
        except Exception as e:  # noqa: BLE001 (a side that fails a case is a result)
            answers.write(json.dumps({"error": toolkit.error_text(e)}) + "\n")
    return 0


# ---------------------------------------------------------------- the driver


def _git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


class Side:
    """A worker process for one side, and the conversation with it."""

    def __init__(self, name: str, root: str, args, log_file):
        self.name = name
        command = (
            [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                root,
                "--ops",
                ",".join(args.ops),
                "--busy-s",
                str(args.busy_s),
            ]
            + ["--quick"] * args.quick
            + ["--compiled"] * args.compiled
        )
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self.process = subprocess.Popen(
            command,
            cwd=root,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
            bufsize=1,
        )
        self.log_path = log_file.name

    def read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            with open(self.log_path) as f:
                tail = f.read()[-3000:]
            raise SystemExit(
                f"ab.py: the {self.name} worker exited (status {self.process.poll()}); its log ends:\n{tail}"
            )
        return json.loads(line)

    def time(self, op: str, shape, kind: str) -> dict:
        self.process.stdin.write(json.dumps({"op": op, "shape": list(shape), "kind": kind}) + "\n")
        return self.read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)


def compare(args) -> dict:
    """Check the ref out, start both workers, time :func:`plan_cases` in
    interleaved rounds; returns :func:`assemble`'s JSON."""
    from cases import BY_NAME

    cases = plan_cases(BY_NAME, args.ops, args.shapes, args.kinds, args.all_shapes)
    ref_commit = _git("rev-parse", "--verify", f"{args.ref}^{{commit}}")
    commits = {
        "ref": {"name": args.ref, "commit": ref_commit},
        "tree": {
            "commit": _git("rev-parse", "HEAD"),
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        },
    }
    worktree = tempfile.mkdtemp(prefix="compile-ops-ab-")
    try:
        _git("worktree", "add", "--detach", worktree, ref_commit)
    except subprocess.CalledProcessError as e:
        os.rmdir(worktree)
        raise SystemExit(f"ab.py: git worktree add failed: {e.stderr.strip()}") from None
    sides = {}
    try:
        with open(args.out + ".log", "w") as log_file:
            sides = {"ref": Side("ref", worktree, args, log_file), "tree": Side("tree", ROOT, args, log_file)}
            ready = {name: side.read() for name, side in sides.items()}
            env = ready["tree"]["env"]
            if ready["ref"]["env"]["gpu"] != env["gpu"]:
                raise SystemExit(f"ab.py: the sides see different GPUs: {ready['ref']['env']['gpu']}, {env['gpu']}")
            times = {side: {} for side in SIDES}
            errors = {side: {} for side in SIDES}
            for r in range(args.rounds):
                for i, (op, shape, kind) in enumerate(cases):
                    for side in round_order(r, i):
                        if i in errors[side]:
                            continue
                        answer = sides[side].time(op, shape, kind)
                        if "error" in answer:
                            errors[side][i] = answer["error"]
                        else:
                            times[side].setdefault(i, []).append(answer["ms"])
                    got = {s: times[s].get(i, [None])[-1] for s in SIDES}
                    print(
                        f"round {r + 1}/{args.rounds} {op} {'x'.join(map(str, shape))} {kind}: "
                        + ", ".join(f"{s} {'failed' if ms is None else f'{ms * 1e3:.1f} us'}" for s, ms in got.items()),
                        flush=True,
                    )
    finally:
        for side in sides.values():
            side.close()
        _git("worktree", "remove", "--force", worktree)
    method = {
        "rounds": args.rounds,
        "kinds": args.kinds,
        "compiled": args.compiled,
        "quick": args.quick,
        "busy_s": args.busy_s,
        "dtype": "bfloat16",
        "timer": "triton.testing.do_bench median, L2 flushed",
    }
    return assemble(cases, times, errors, env, commits, method)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker, args.quick, args.compiled, args.busy_s)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(
            "ab.py: no CUDA device here. The A/B benchmark times both sides' kernels on one GPU; "
            "run it on a GPU machine."
        )
    args.out = args.out or default_out(args.ref, torch.cuda.get_device_name())
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    data = compare(args)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    print("\n".join(["", *format_rows(data), "", f"wrote {args.out} (workers' output: {args.out}.log)"]))
    return 1 if any("ref_ms" not in r or "tree_ms" not in r for r in data["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
