"""The first run on a GPU: each op family against torch.compile, attention, one end-to-end step.

    python bench/run.py                                  # its default on a GPU
    PYTHONPATH=. python bench/runners/first_run.py [--out bench/results] [--quick] [--verbose] [--budget-s 270]

Minutes from a cold machine, bf16, medians of ``triton.testing.do_bench``:

- each op family's fused op (:data:`FAMILY_OPS`, at its first registry benchmark
  shape) under ``torch.compile(fullgraph=True)`` against ``torch.compile`` of
  its PyTorch reference: the training step (forward+backward; the forward for
  an inference-only op) as CUDA-graph replays, and the fused op's bytes per
  second (``bench/runners/ops.py``'s byte count) as a share of the device copy
  bandwidth, the memory roof;
- attention at Flux's shape (:data:`ATTENTION_SHAPE`): ``compile_ops.attention``
  compiled against ``torch.compile`` of ``F.scaled_dot_product_attention``, the
  training step as CUDA-graph replays, its TFLOP/s as a share of a large bf16
  matmul's, the compute roof;
- one end-to-end step (:data:`E2E`): a stack of ``bench.demo.DiTBlock`` s at
  Flux's width and sequence, one forward (an inference step) as a model runs
  it, each block compiled in place: the blocks on the fused ops against the
  same blocks, with the same weights, written with ``torch.nn.functional``.

The per-measurement lines go to ``<out>/first-run-<gpu>.log`` (``--verbose``:
to the screen as well); the screen shows the progress and, at the end,
:func:`summary_lines`. Writes ``<out>/first-run-<gpu>.json`` and, where
matplotlib is installed, ``<out>/first-run-<gpu>.png``. A stage that would end
past ``--budget-s`` seconds after the process started (by
:data:`STAGE_SECONDS`) is skipped and named in the summary. Every op at every
shape, the peers and the other runners: ``python bench/run.py --full``.
"""

import argparse
import json
import os
import sys
import time
import traceback

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from bench.toolkit import (  # noqa: E402
    KIND_LABELS,
    TIMING,
    Progress,
    copy_bandwidth_TBps,
    environment,
    error_text,
    gpu_slug,
    keep_busy,
    log,
    machine_line,
    make_timer,
    matmul_TFLOPs,
    output_to,
    relative_l2,
    shape_str,
    timed_call,
    warm_up_gpu,
)

#: One op per family, ``(family, registry name)``, in summary order, each at its first benchmark shape.
FAMILY_OPS = (
    ("norm", "rmsnorm"),
    ("modulate", "gated_residual_norm_modulate"),
    ("rope", "qk_norm_rope"),
    ("glu", "geglu_tanh"),
    ("moe", "moe_route"),
    ("fp8", "quantize_fp8_rows"),
)
#: The providers of each family's op (``bench/runners/ops.py``'s names): fused first.
PROVIDERS = ("fused_compiled", "native_compiled")
#: Flux at 1024x1024: 24 heads of 128 over 4096 image + 512 text tokens, ``[B, H, L, D]``.
ATTENTION_SHAPE = (1, 24, 4608, 128)
ATTENTION_PROVIDERS = ("fused_compiled", "sdpa_compiled")
#: The end-to-end step: DiT blocks at Flux's width, heads and sequence, batch 1.
E2E = {"depth": 2, "dim": 3072, "heads": 24, "tokens": 4608}
E2E_PROVIDERS = ("compile_ops", "torch_compile")
#: The family of each op of :data:`FAMILY_OPS`.
FAMILY_OF = {op: family for family, op in FAMILY_OPS}
#: Seconds each stage is allowed when checking the budget (compiles included, cold caches).
STAGE_SECONDS = {"setup": 15, "e2e": 75, "attention": 40, "family": 30}
#: Seconds a provider runs untimed right before its timing (``toolkit.keep_busy``), full and ``--quick``.
BUSY_SECONDS = {False: 1.0, True: 0.2}


def plan() -> list:
    """The stages in run order, ``[(stage, name, measurements)]``: the progress counts these."""
    stages = [
        ("setup", "warm-up and roofs", 1),
        ("e2e", "end-to-end step", len(E2E_PROVIDERS)),
        ("attention", "attention", len(ATTENTION_PROVIDERS)),
    ]
    return stages + [("family", op, len(PROVIDERS)) for _, op in FAMILY_OPS]


def family_kind(spec) -> str:
    """The training step for an op with a backward, the forward for an inference-only one."""
    return "fwdbwd_graph" if spec.differentiable else "fwd_graph"


# ---------------------------------------------------------------- stages


def _setup(data: dict, timer, progress: Progress) -> None:
    warm_up_gpu()
    data["copy_TBps"] = copy_bandwidth_TBps(timer)
    data["matmul_TFLOPs"] = matmul_TFLOPs(timer)
    progress(
        f"warm-up; roofs: device copy {data['copy_TBps']:.2f} TB/s, bf16 matmul {data['matmul_TFLOPs']:.0f} TFLOP/s"
    )


def _family(data: dict, family: str, op: str, timer, progress: Progress) -> None:
    from bench.runners import ops
    from cases import BY_NAME

    spec = BY_NAME[op]
    shape, kind = tuple(spec.bench_shapes[0]), family_kind(spec)
    data["families"].append({"family": family, "op": op, "shape": list(shape), "kind": kind})
    providers = {name: fn for name, fn in ops.make_providers(spec, {}).items() if name in PROVIDERS}
    data["rows"] += ops.bench_shape(spec, shape, providers, timer, data["copy_TBps"], progress, kinds=(kind,))


def _attention(data: dict, timer, busy_s: float, progress: Progress) -> None:
    import compile_ops

    b, h, length, d = ATTENTION_SHAPE
    q, k, v = (torch.randn(ATTENTION_SHAPE, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    flops = 3.5 * 4 * b * h * length * length * d  # forward 4·B·H·L²·D, the backward 2.5x that

    def fused(q, k, v):
        return compile_ops.attention(q, k, v)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    providers = {"fused_compiled": torch.compile(fused, fullgraph=True), "sdpa_compiled": torch.compile(sdpa)}
    rows = []
    for name in ATTENTION_PROVIDERS:
        row = {"op": "attention", "shape": list(ATTENTION_SHAPE), "provider": name, "kind": "fwdbwd_graph"}
        where = f"attention {shape_str(ATTENTION_SHAPE)} {name:<16} {KIND_LABELS['fwdbwd_graph']}"
        try:
            step = timed_call(providers[name], (q, k, v), "fwdbwd_graph")
            keep_busy(step, busy_s)
            ms = timer(step)
            row.update(ms=ms, TFLOPs=flops / (ms * 1e-3) / 1e12)
            row["pct_matmul"] = 100.0 * row["TFLOPs"] / data["matmul_TFLOPs"]
            progress(f"{where} {ms * 1e3:9.1f} us {row['TFLOPs']:6.0f} TFLOP/s {row['pct_matmul']:5.1f}% matmul")
        except Exception as e:  # noqa: BLE001 (a failing provider is a result; the other still runs)
            row["error"] = error_text(e)
            progress(f"{where} FAILED {row['error'][:160]}")
        rows.append(row)
        q.grad = k.grad = v.grad = None
    data["attention"] = {"shape": list(ATTENTION_SHAPE), "rows": rows}


class BlockStack(nn.Module):
    """``depth`` ``bench.demo.DiTBlock`` s in turn: ``forward(x [B, L, dim], temb [B, dim]) -> [B, L, dim]``."""

    def __init__(self, depth: int, dim: int, heads: int, fused: bool):
        from bench.demo import DiTBlock

        super().__init__()
        self.blocks = nn.ModuleList(DiTBlock(dim, heads, fused=fused) for _ in range(depth))

    def forward(self, x, temb):
        for block in self.blocks:
            x = block(x, temb)
        return x


def _e2e(data: dict, timer, busy_s: float, progress: Progress) -> None:
    depth, dim, heads, tokens = E2E["depth"], E2E["dim"], E2E["heads"], E2E["tokens"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        stacks = {
            "compile_ops": BlockStack(depth, dim, heads, fused=True),
            "torch_compile": BlockStack(depth, dim, heads, fused=False),
        }
    stacks["torch_compile"].load_state_dict(stacks["compile_ops"].state_dict())
    x = torch.randn(1, tokens, dim, device="cuda", dtype=torch.bfloat16)
    temb = torch.randn(1, dim, device="cuda", dtype=torch.bfloat16)
    rows, outputs = [], {}
    for name in E2E_PROVIDERS:
        stack = stacks[name].to(torch.bfloat16).eval().requires_grad_(False)
        row = {"provider": name, "kind": "fwd"}
        where = f"e2e {depth} DiT blocks {dim} wide, {tokens} tokens {name:<14} fwd"
        try:
            for block in stack.blocks:  # in place, as diffusers' compile_repeated_blocks does
                block.compile(fullgraph=True)
            call = timed_call(stack, (x, temb), "fwd")  # compiles
            outputs[name] = call()
            keep_busy(call, busy_s)
            row["ms"] = timer(call)
            progress(f"{where} {row['ms']:9.3f} ms")
        except Exception as e:  # noqa: BLE001 (a failing provider is a result; the other still runs)
            row["error"] = error_text(e)
            progress(f"{where} FAILED {row['error'][:160]}")
        rows.append(row)
    data["e2e"] = {"config": dict(E2E), "batch": 1, "rows": rows}
    if len(outputs) == 2:  # the same weights: the outputs agree up to bf16 rounding
        data["e2e"]["rel_l2"] = relative_l2(outputs["compile_ops"], outputs["torch_compile"])


# ---------------------------------------------------------------- the run


def measure(data: dict, quick: bool, start: float, budget_s: float, screen=None) -> dict:
    """Every stage of :func:`plan` into ``data`` (``rows``, ``families``,
    ``attention``, ``e2e``; ``skipped`` and ``errors`` name what did not run)."""
    stages = plan()
    progress = Progress(sum(count for *_, count in stages), screen, every_step=True)
    timer = make_timer(quick)
    data.update(rows=[], families=[], skipped=[], errors=[])
    torch.manual_seed(0)
    for stage, name, count in stages:
        elapsed = time.perf_counter() - start
        if stage != "setup" and elapsed + STAGE_SECONDS[stage] > budget_s:
            data["skipped"].append(name)
            progress.skip(count, f"{name}: {elapsed:.0f} s of the {budget_s:.0f} s budget spent")
            continue
        done = progress.done
        try:
            if stage == "setup":
                _setup(data, timer, progress)
            elif stage == "e2e":
                _e2e(data, timer, BUSY_SECONDS[quick], progress)
            elif stage == "attention":
                _attention(data, timer, BUSY_SECONDS[quick], progress)
            else:
                _family(data, FAMILY_OF[name], name, timer, progress)
        except Exception as e:  # noqa: BLE001 (a stage that fails is named; the others still run)
            traceback.print_exc()
            data["errors"].append(f"{name}: {error_text(e)}")
            progress.skip(count - (progress.done - done), f"{name} failed")
            if stage == "setup":
                raise
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return data


def run(out: str, quick: bool = False, verbose: bool = False, budget_s: float = 270.0, start=None) -> int:
    """The first run (see the module docstring); returns 1 when a fused provider
    or a stage failed, else 0. ``start``: ``time.perf_counter()`` at the process
    start, which the budget counts from."""
    start = time.perf_counter() if start is None else start
    env = environment()
    stem = os.path.join(out, f"first-run-{gpu_slug(env['gpu'])}")
    os.makedirs(out, exist_ok=True)
    files = {"json": stem + ".json", "png": stem + ".png", "log": stem + ".log"}
    if os.path.exists(files["log"]):
        os.remove(files["log"])
    data = {
        "env": env,
        "quick": bool(quick),
        "timing_ms": dict(zip(("warmup", "rep"), TIMING[bool(quick)])),
        "budget_s": budget_s,
    }
    with output_to(files["log"], echo=verbose) as screen:
        screen.write(
            f"compile_ops first run on {machine_line(env)}\n"
            f"each op family against torch.compile, attention, one end-to-end step; "
            f"details in {os.path.relpath(files['log'])}\n"
        )
        try:
            measure(data, quick, start, budget_s, None if verbose else screen)
        finally:
            data["wall_s"] = time.perf_counter() - start
            with open(files["json"], "w") as f:
                json.dump(data, f, indent=1)
            log(f"wrote {files['json']}")
        if not plot(data, files["png"]):
            files["png"] = None
    print("\n".join(summary_lines(data, {k: v and os.path.relpath(v) for k, v in files.items()})), flush=True)
    return 1 if failures(data) else 0


# ---------------------------------------------------------------- the summary


def failures(data: dict) -> list:
    """What failed: the stages' errors and the fused providers' (a peer's failure is a result)."""
    rows = data.get("rows", []) + data.get("attention", {}).get("rows", []) + data.get("e2e", {}).get("rows", [])
    return data.get("errors", []) + [
        f"{r.get('op', 'e2e')} {r['provider']}: {r['error']}"
        for r in rows
        if "error" in r and r["provider"] in ("fused_compiled", "compile_ops")
    ]


def families_in(rows: list) -> list:
    """:data:`FAMILY_OPS`' ops found in an op table's ``rows`` (``bench/run.py --full``'s
    ``<gpu>.json``), each at its first shape, with the training step where it was timed."""
    found = []
    for family, op in FAMILY_OPS:
        fused = [r for r in rows if r["op"] == op and r["provider"] == "fused_compiled"]
        if fused:
            kind = "fwdbwd_graph" if fused[0].get("fwdbwd_graph_us") is not None else "fwd_graph"
            found.append({"family": family, "op": op, "shape": fused[0]["shape"], "kind": kind})
    return found


def family_lines(rows: list, families: list) -> list:
    """A table of one line per family: the fused op's speed against ``torch.compile`` of
    its reference (native / fused time: above 1, fused is faster) and its share of the copy roof."""
    by = {(r["op"], tuple(r["shape"]), r["provider"]): r for r in rows}
    lines = [f"{'family':<10} {'op':<30} {'shape':<14} {'pass':<8} {'vs torch.compile':>16}  share of roof"]
    for f in families:
        fused = by.get((f["op"], tuple(f["shape"]), "fused_compiled"), {})
        native = by.get((f["op"], tuple(f["shape"]), "native_compiled"), {})
        us, native_us = fused.get(f"{f['kind']}_us"), native.get(f"{f['kind']}_us")
        speed = "failed" if us is None else "ref. failed" if native_us is None else f"{native_us / us:.2f}x"
        pct = fused.get(f"{f['kind']}_pct_copy")
        share = f"{pct:.0f}% of copy" if pct is not None else "-"
        pass_name = "fwd+bwd" if f["kind"].startswith("fwdbwd") else "fwd"
        lines.append(f"{f['family']:<10} {f['op']:<30} {shape_str(f['shape']):<14} {pass_name:<8} {speed:>16}  {share}")
    return lines


def _attention_line(attention: dict) -> str:
    by = {r["provider"]: r for r in attention["rows"]}
    fused, sdpa = by.get("fused_compiled", {}), by.get("sdpa_compiled", {})
    speed = "failed" if "ms" not in fused else "SDPA failed" if "ms" not in sdpa else f"{sdpa['ms'] / fused['ms']:.2f}x"
    share = f"{fused['pct_matmul']:.0f}% of matmul" if "pct_matmul" in fused else "-"
    return (
        f"{'attention':<10} {'attention (vs SDPA)':<30} {shape_str(attention['shape']):<14} {'fwd+bwd':<8} "
        f"{speed:>16}  {share}"
    )


def _e2e_lines(e2e: dict) -> list:
    c = e2e["config"]
    by = {r["provider"]: r for r in e2e["rows"]}
    head = (
        f"End to end: {c['depth']} DiT blocks ({c['dim']} wide, {c['heads']} heads, {c['tokens']} tokens, "
        f"bf16), one forward, each block compiled in place:"
    )
    if "ms" not in by.get("compile_ops", {}) or "ms" not in by.get("torch_compile", {}):
        errors = "; ".join(f"{n}: {r['error'][:100]}" for n, r in by.items() if "error" in r)
        return [head, f"  failed ({errors or 'not run'})"]
    ours, plain = by["compile_ops"]["ms"], by["torch_compile"]["ms"]
    agree = f"; outputs agree to {e2e['rel_l2']:.1e} rel. L2" if "rel_l2" in e2e else ""
    return [head, f"  compile_ops {ours:.2f} ms, plain torch.compile {plain:.2f} ms: {plain / ours:.2f}x{agree}"]


def summary_lines(data: dict, files: dict) -> list:
    """What the first run prints at its end, from its results ``data`` (the JSON
    it writes) and ``files`` (``{"json", "png", "log"}`` paths, None where not written)."""
    env = data["env"]
    out = ["", f"compile_ops on {machine_line(env)}"]
    if "copy_TBps" in data:
        out.append(
            f"Roofs: device copy {data['copy_TBps']:.2f} TB/s (read+write), "
            f"bf16 matmul {data['matmul_TFLOPs']:.0f} TFLOP/s."
        )
    out += [
        "",
        "Fused op under torch.compile against torch.compile of its PyTorch reference (above 1x: fused is "
        "faster), CUDA-graph replays:",
        "",
    ]
    out += family_lines(data.get("rows", []), data.get("families", []))
    if "attention" in data:
        out.append(_attention_line(data["attention"]))
    if "e2e" in data:
        out += [""] + _e2e_lines(data["e2e"])
    if data.get("skipped"):
        out += [
            "",
            f"Skipped for the {data['budget_s']:.0f} s budget: {', '.join(data['skipped'])} "
            "(python bench/run.py --budget-s 600 runs them).",
        ]
    failed = failures(data)
    if failed:
        out += ["", "Failed (details in the log):"] + [f"  {f[:200]}" for f in failed]
    out += [
        "",
        f"Results {files['json']} | plot {files.get('png') or 'not drawn (no matplotlib)'} | log {files['log']}",
    ]
    if "wall_s" in data:
        out.append(
            f"Done in {data['wall_s']:.0f} s. Every op at every shape with its peers, and every runner: "
            "python bench/run.py --full."
        )
    return out


def plot(data: dict, png_path: str):
    """Horizontal bars of the fused speed-up per family, attention and the
    end-to-end step; returns ``png_path``, or None without matplotlib or results."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; no display on the benchmark machines
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels, ratios = [], []
    by = {(r["op"], r["provider"]): r for r in data.get("rows", [])}
    for f in data.get("families", []):
        fused, native = by.get((f["op"], "fused_compiled"), {}), by.get((f["op"], "native_compiled"), {})
        key = f"{f['kind']}_us"
        if fused.get(key) and native.get(key):
            labels.append(f"{f['family']}: {f['op']}")
            ratios.append(native[key] / fused[key])
    for label, part, ours, theirs in (
        ("attention (vs SDPA)", "attention", "fused_compiled", "sdpa_compiled"),
        ("end to end, forward", "e2e", "compile_ops", "torch_compile"),
    ):
        rows = {r["provider"]: r for r in data.get(part, {}).get("rows", [])}
        if "ms" in rows.get(ours, {}) and "ms" in rows.get(theirs, {}):
            labels.append(label)
            ratios.append(rows[theirs]["ms"] / rows[ours]["ms"])
    if not ratios:
        return None
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(ratios) + 1.2))
    ax.barh(range(len(ratios)), ratios, color=["tab:blue" if r >= 1 else "tab:red" for r in ratios])
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(ratios)))
    ax.set_yticklabels(labels, fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel("speed-up over torch.compile (x)")
    ax.set_title(machine_line(data["env"]), fontsize="small")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--quick", action="store_true", help="short timing runs (a smoke test)")
    p.add_argument("--verbose", action="store_true", help="every measurement line on the screen too")
    p.add_argument("--budget-s", type=float, default=270.0, help="skip the stages that would end past this")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/runners/first_run.py: no CUDA device here (python bench/run.py runs the CPU demo)")
    return run(args.out, args.quick, args.verbose, args.budget_s)


if __name__ == "__main__":
    sys.exit(main())
