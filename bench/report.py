"""Tables and a plot from a benchmark JSON written by ``bench/run.py``.

    python bench/report.py bench/results/h100.json                             # print the table
    python bench/report.py bench/results/h100.json --doc docs/performance.md   # also rewrite its block there
    python bench/report.py bench/results/h100.json --plot h100.png             # also draw the plot

    python bench/report.py bench/results/attention-h100.json --doc docs/performance.md  # runners/attention.py's
    python bench/report.py RERUN.json --merge-into bench/results/attention-h100.json --doc docs/performance.md
    python bench/report.py --headline README.md   # the README's end-to-end table, from bench/results

A table's block is everything between the lines ``<!-- perf-table:start -->``
and ``<!-- perf-table:end -->`` of the Markdown file (``attention-table`` /
``attention-causal-table`` for bench/runners/attention.py's JSON,
``block-sparse-table`` for bench/runners/block_sparse.py's,
``diffusers-e2e-table`` for bench/runners/diffusers_e2e.py's,
``distributed-train-table`` for bench/runners/distributed_train.py's,
``context-parallel-<case>-x<W>-table`` for bench/runners/context_parallel.py's
(bench/tables/context_parallel.py), ...;
``headline-table`` for :func:`headline_table`); it is regenerated from the
JSON, never edited by hand. The tables live in docs/performance.md, the
headline in README.md.
"""

import argparse
import json
import math
import os
import sys

if __package__ in (None, ""):  # run as a script: the repository root on the path, for bench.tables
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.tables import context_parallel, run_line  # noqa: E402

#: Table and plot order; peers follow in the order the runner wrote them.
CORE_PROVIDERS = ("fused_eager", "fused_compiled", "native_eager", "native_compiled")
_HEADERS = {
    "fused_eager": "fused eager",
    "fused_compiled": "fused compiled",
    "native_eager": "native eager",
    "native_compiled": "native compiled",
}


def load(json_path: str) -> dict:
    """The benchmark results: ``{"env", "copy_TBps", "rows", "overhead", ...}``."""
    with open(json_path) as f:
        return json.load(f)


def _shape(shape) -> str:
    return "x".join(str(d) for d in shape)


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _ops_and_providers(rows):
    """``[(op, [shape, ...], [provider, ...]), ...]`` in first-seen order, core providers first."""
    ops = {}
    for r in rows:
        shapes, providers = ops.setdefault(r["op"], ([], []))
        if r["shape"] not in shapes:
            shapes.append(r["shape"])
        if r["provider"] != "*" and r["provider"] not in providers:
            providers.append(r["provider"])
    out = []
    for op, (shapes, providers) in ops.items():
        core = [p for p in CORE_PROVIDERS if p in providers]
        out.append((op, shapes, core + [p for p in providers if p not in core]))
    return out


def _lookup(rows) -> dict:
    return {(r["op"], tuple(r["shape"]), r["provider"]): r for r in rows}


def environment_line(data: dict) -> str:
    """One line naming the GPU, the versions and the measured copy bandwidth."""
    env = data["env"]
    parts = [
        f"{env['gpu']} ({env['sms']} SMs)",
        f"torch {env['torch']}",
        f"triton {env['triton']}",
        f"CUDA {env.get('cuda')}",
    ]
    if env.get("liger"):
        parts.append(f"liger-kernel {env['liger']}")
    parts.append(f"device copy {data['copy_TBps']:.2f} TB/s (read+write)")
    runs = data.get("runs")
    if runs and len(runs) > 1:  # bench/run.py --merge: each op's rows come from one run
        parts.append(f"runs of {', '.join(sorted({str(r)[:16].replace('T', ' ') for r in runs}))} UTC")
    else:
        parts.append(str(env.get("date", ""))[:10])
    if data.get("quick"):
        parts.append("--quick run")
    return " | ".join(p for p in parts if p)


def format_table(data: dict) -> str:
    """The plain-text table: one line per (op, shape, provider)."""
    header = (
        "op",
        "shape",
        "provider",
        "fwd µs",
        "fwd GB/s",
        "% copy",
        "fwd+bwd µs",
        "fwd+bwd GB/s",
        "% copy",
        "graph fwd GB/s",
        "graph fwd+bwd GB/s",
    )
    lines = []
    for r in data["rows"]:
        lines.append(
            (
                r["op"],
                _shape(r["shape"]),
                r["provider"],
                _num(r.get("fwd_us"), ".1f"),
                _num(r.get("fwd_GBps"), ".0f"),
                _num(r.get("fwd_pct_copy"), ".1f"),
                _num(r.get("fwdbwd_us"), ".1f"),
                _num(r.get("fwdbwd_GBps"), ".0f"),
                _num(r.get("fwdbwd_pct_copy"), ".1f"),
                _num(r.get("fwd_graph_GBps"), ".0f"),
                _num(r.get("fwdbwd_graph_GBps"), ".0f"),
                r.get("error", ""),
            )
        )
    widths = [
        max(len(header[i]), *(len(line[i]) for line in lines)) if lines else len(header[i]) for i in range(len(header))
    ]
    numeric = set(range(3, len(header)))

    def fmt(cells):
        text = "  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return text.rstrip()

    out = [environment_line(data), "", fmt(header), fmt(["-" * w for w in widths])]
    for line in lines:
        error = " ".join(line[-1].split())  # compile errors span lines; keep the row on one
        out.append(fmt(line[:-1]) + (f"  error: {error[:160]}" if error else ""))
    overhead = data.get("overhead")
    if overhead and "error" not in overhead:
        out.append("")
        if "eager_us" in overhead:  # bench/runners/host.py's row
            out.append(
                f"eager overhead at {_shape(overhead['shape'])}: fused.rmsnorm "
                f"{overhead['eager_us']:.1f} µs/call (through the dispatcher "
                f"{overhead['dispatcher_us']:.1f}), bare Triton launch {overhead['bare_us']:.1f} µs/call "
                f"(x{overhead['ratio']:.2f})"
            )
        else:  # results files written before bench/runners/host.py
            out.append(
                f"eager overhead at {_shape(overhead['shape'])}: fused.rmsnorm "
                f"{overhead['fused_op_us']:.1f} µs/call, bare Triton launch "
                f"{overhead['bare_triton_us']:.1f} µs/call (x{overhead['ratio']:.2f})"
                + (
                    f"; op body without the dispatcher {overhead['op_body_us']:.1f} µs/call"
                    if "op_body_us" in overhead
                    else ""
                )
            )
    elif overhead:
        out.append(f"\neager overhead probe failed: {overhead['error'][:200]}")
    return "\n".join(out)


_TIMINGS = (
    (
        "_graph",
        "CUDA-graph replay: one call captured in a CUDA graph and its replays timed, so "
        "host-side launch overhead is excluded and the GB/s are the kernels' own",
    ),
    (
        "",
        "eager launch: each call launched from Python as a model would, host overhead included "
        "(where the host takes longer than the GPU, this measures the host)",
    ),
)


def markdown_table(data: dict) -> str:
    """README Markdown: an environment line, then for each timing method and op a
    table with one row per shape and one ``fwd / fwd+bwd`` GB/s column per provider."""
    rows = data["rows"]
    lookup = _lookup(rows)
    dtypes = sorted({r.get("dtype", "bfloat16") for r in rows})
    out = [
        f"{environment_line(data)}.",
        "",
        f"Effective GB/s, {', '.join(dtypes)}, forward / forward+backward (median of "
        "`triton.testing.do_bench`, L2 flushed between runs). Bytes: each input read once and "
        "each output written once; forward+backward adds the output gradients, the input "
        "gradients and a second read of the differentiable inputs (5 tensor passes for rmsnorm; "
        "4 for a rotation, whose backward does not read its inputs).",
        "",
    ]
    for suffix, title in _TIMINGS:
        if not any(r.get(f"fwd{suffix}_GBps") is not None for r in rows):
            continue
        out += [f"*{title}.*", ""]
        for op, shapes, providers in _ops_and_providers(rows):
            out.append(f"**{op}**")
            out.append("")
            out.append("| shape | " + " | ".join(_HEADERS.get(p, p) for p in providers) + " |")
            out.append("|---|" + "---:|" * len(providers))
            for shape in shapes:
                cells = []
                for p in providers:
                    r = lookup.get((op, tuple(shape), p)) or lookup.get((op, tuple(shape), "*"))
                    if r is None:
                        cells.append("")
                        continue
                    fwd, fwdbwd = r.get(f"fwd{suffix}_GBps"), r.get(f"fwdbwd{suffix}_GBps")
                    cells.append(
                        f"{'err' if fwd is None else f'{fwd:.0f}'} / {'err' if fwdbwd is None else f'{fwdbwd:.0f}'}"
                    )
                out.append(f"| {_shape(shape)} | " + " | ".join(cells) + " |")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def merge_runs(base: dict, newer: dict, key=("shape", "causal", "provider")) -> dict:
    """``base``'s rows with those of ``newer`` (a rerun of some of its cases,
    same runner) in their place, matched by ``key``; every row keeps its run's
    date, and the env lists both runs. The GPU and versions must agree: rows
    of different machines or versions are not put in one table."""
    for field in ("gpu", "torch", "triton"):
        if base["env"].get(field) != newer["env"].get(field):
            raise SystemExit(
                f"report.py --merge-into: {field} differs: {base['env'].get(field)} against {newer['env'].get(field)}"
            )

    def dated(data):
        return [dict(r, date=r.get("date", data["env"]["date"])) for r in data["rows"]]

    def ident(r):
        return tuple(json.dumps(r.get(k)) for k in key)

    replaced = {ident(r): r for r in dated(newer)}
    rows = [replaced.pop(ident(r), r) for r in dated(base)] + list(replaced.values())
    runs = sorted({r["date"] for r in rows})
    return dict(base, env=dict(newer["env"], runs=runs), rows=rows)


def is_attention(data: dict) -> bool:
    """bench/runners/attention.py's JSON (TFLOP/s rows) rather than bench/run.py's."""
    return any("fwd_TFLOPs" in r or r.get("provider") == "sdpa_flash" for r in data["rows"])


def attention_table(data: dict) -> str:
    """Markdown: TFLOP/s forward / forward+backward per provider and shape, and
    the peak memory of a forward+backward step, ours against SDPA's flash."""
    rows = data["rows"]
    env = data["env"]
    causal = any(r.get("causal") for r in rows)
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in rows))
    by = {(tuple(r["shape"]), r["provider"]): r for r in rows}
    out = [
        run_line(env) + f" | bf16, [B, H, L, D], {'causal' if causal else 'non-causal'} self-attention.",
        "",
        "TFLOP/s forward / forward+backward (CUDA-graph replay; 4·B·H·L²·D per forward"
        f"{', halved for causal' if causal else ''}, 3.5x for forward+backward), and the peak memory "
        "of one forward+backward step above its inputs.",
        "",
        "| shape | " + " | ".join(providers) + " | peak MiB fused / sdpa_flash |",
        "|---|" + "---:|" * (len(providers) + 1),
    ]
    for shape in shapes:
        cells = []
        for prov in providers:
            r = by.get((shape, prov), {})
            cells.append("err" if "error" in r or not r else f"{r['fwd_TFLOPs']:.0f} / {r['fwdbwd_TFLOPs']:.0f}")
        mem = [by.get((shape, p), {}).get("peak_MiB") for p in ("fused_eager", "sdpa_flash")]
        mem_cell = " / ".join("-" if m is None else f"{m:.0f}" for m in mem)
        out.append(f"| {_shape(shape)} | " + " | ".join(cells) + f" | {mem_cell} |")
    return "\n".join(out) + "\n"


def is_attention_int8(data: dict) -> bool:
    """bench/runners/attention.py --int8's JSON: rows per input kind, with their error."""
    return any("inputs" in r and "rel_l2_vs_fp64" in r for r in data["rows"])


def attention_int8_table(data: dict) -> str:
    """Markdown: forward TFLOP/s of 8-bit attention beside cuDNN, our exact
    kernel and SageAttention, each with its relative L2 to fp64 attention,
    per shape and input kind."""
    rows = data["rows"]
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    keys = list(dict.fromkeys((tuple(r["shape"]), r["inputs"]) for r in rows))
    by = {(tuple(r["shape"]), r["inputs"], r["provider"]): r for r in rows}
    out = [
        run_line(data["env"]) + " | [B, H, L, D], non-causal, forward; bf16 inputs, 8-bit providers "
        "quantize inside the timed call.",
        "",
        "TFLOP/s (4·B·H·L²·D per forward, `do_bench` median) and, in brackets, the relative L2 distance "
        "to fp64 attention (and its cosine similarity, where the run recorded it). Inputs: `normal` N(0, 1); "
        "`offset_keys` keys with a per-channel offset of "
        "N(0, 4²) and doubled queries.",
        "",
        "| shape | inputs | " + " | ".join(providers) + " |",
        "|---|---|" + "---:|" * len(providers),
    ]
    for shape, kind in keys:
        cells = []
        for prov in providers:
            r = by.get((shape, kind, prov))
            cosine = f", cos {r['cosine_vs_fp64']:.5f}" if r and "cosine_vs_fp64" in r else ""
            cells.append(
                "err" if not r or "error" in r else f"{r['fwd_TFLOPs']:.0f} ({r['rel_l2_vs_fp64']:.1e}{cosine})"
            )
        out.append(f"| {_shape(shape)} | {kind} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def is_moe(data: dict) -> bool:
    """bench/runners/moe.py's JSON: routing times per provider, in microseconds."""
    return any("fwd_graph_us" in r and "experts" in r for r in data["rows"])


def moe_table(data: dict) -> str:
    """Markdown: MoE routing microseconds per case and provider, forward and
    forward+backward, as plain calls and as CUDA-graph replays, with the
    composites' graph-replay forward over ours."""
    rows = data["rows"]
    by = {(r["op"], r["provider"]): r for r in rows}
    out = [
        run_line(data["env"]) + " | bf16, 4096 tokens.",
        "",
        "Microseconds per call (`do_bench` median, L2 flushed): a plain call (host launch cost included) and "
        "a CUDA-graph replay (the GPU's time alone); forward+backward = the backward of the probabilities "
        "and weights into x and the router weight. Last columns: the composite's graph-replay forward "
        "over this provider's.",
        "",
        "| case | provider | fwd | fwd, graph | fwd+bwd | fwd+bwd, graph | composite_eager / this, graph fwd "
        "| composite_compiled / this, graph fwd |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (op, provider), r in by.items():
        t, e, k = r["shape"][-2:], r["experts"], r["top_k"]
        case = f"{op}: {t[0]} x {t[1]}, E = {e}, k = {k}"
        ratios = []
        for peer in ("composite_eager", "composite_compiled"):
            p = by.get((op, peer))
            ratios.append(
                "-"
                if p is None or provider.startswith("composite")
                else f"{p['fwd_graph_us'] / r['fwd_graph_us']:.1f}x"
            )
        out.append(
            f"| {case} | {provider} | {r['fwd_us']:.1f} | {r['fwd_graph_us']:.1f} | {r['fwdbwd_us']:.1f} "
            f"| {r['fwdbwd_graph_us']:.1f} | " + " | ".join(ratios) + " |"
        )
    return "\n".join(out) + "\n"


def is_host(data: dict) -> bool:
    """bench/runners/host.py's JSON: host microseconds per eager call."""
    return any("bare_us" in r for r in data["rows"])


def host_table(data: dict) -> str:
    """Markdown: host microseconds per eager call of each op, against a bare
    Triton launch of its kernels and the PyTorch composite."""
    out = [
        run_line(data["env"]) + " | host µs per call at [1, 64, 3072] bf16 (median of 5 x 1000 calls; the "
        "kernels themselves take the GPU µs column).",
        "",
        "| op | eager | through the dispatcher | bare Triton launch | eager / bare | PyTorch composite "
        "| GPU µs | launch plan |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in data["rows"]:
        if "error" in r:
            out.append(f"| {r['op']} | err | | | | | | |")
            continue
        out.append(
            f"| {r['op']} | {r['eager_us']:.1f} | {r['dispatcher_us']:.1f} | {r['bare_us']:.1f} | "
            f"{r['ratio']:.2f} | {r['reference_us']:.1f} | {r.get('gpu_us', float('nan')):.1f} | "
            f"{'replayed' if r.get('planned') else 'body'} |"
        )
    return "\n".join(out) + "\n"


def is_aoti(data: dict) -> bool:
    """bench/runners/aoti.py's JSON: a patched model as an AOTInductor package run from C++."""
    return any("aoti_ms" in r for r in data["rows"])


def aoti_table(data: dict) -> str:
    """Markdown: the package's step from C++ against the compiled patched model, and its sizes and times."""
    env = data["env"]
    out = [
        run_line(env, f"diffusers {env.get('diffusers')}") + " | bf16, batch 1, random weights; ms: median "
        "(min-max) of 3 rounds of 10 calls (C++) or 3 do_bench medians (compiled).",
        "",
        "| case | blocks | package GB | compile + package s | C++ load s | AOTI package from C++ ms "
        "| compiled (regional) ms | package vs compiled | rel. L2 vs eager (package; 768 px) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        compiled = r.get("compiled", {})
        out.append(
            f"| {r['case']} | {r['layers'][0]} + {r['layers'][1]} | {r['package_GB']:.1f} | {r['package_s']:.0f} "
            f"| {r['aoti_1024px']['load_s']:.1f} | {r['aoti_ms']:.1f} ({r['aoti_ms_min']:.1f}-{r['aoti_ms_max']:.1f}) "
            f"| {compiled.get('ms', float('nan')):.1f} ({compiled.get('ms_min', float('nan')):.1f}-"
            f"{compiled.get('ms_max', float('nan')):.1f}) | {r.get('aoti_vs_compiled', float('nan')):.2f}x "
            f"| {r['aoti_1024px']['rel_l2_vs_eager']:.1e}; {r['aoti_768px']['rel_l2_vs_eager']:.1e} |"
        )
    return "\n".join(out) + "\n"


def is_compile_modes(data: dict) -> bool:
    """bench/runners/diffusers_e2e.py's JSON from ``--inductor-modes``: a provider in several torch.compile modes."""
    return any("+" in r.get("compile", "") for r in data["rows"])


def compile_modes_table(data: dict) -> str:
    """Markdown: each case's compiled step in every torch.compile mode of the run, against the default mode."""
    env = data["env"]
    out = [
        run_line(env, f"diffusers {env.get('diffusers')}") + " | bf16, batch 1, random weights, inference; "
        "ms: median (min-max) of 3 do_bench medians.",
        "",
        "| case | provider | torch.compile mode | ms | vs default mode | host ms | cudagraph skips | first call s |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    default = {(r["case"], r["provider"]): r["ms"] for r in data["rows"] if "+" not in r.get("compile", "")}
    for r in data["rows"]:
        mode = r["compile"].split("+")[1] if "+" in r["compile"] else "default"
        base = default.get((r["case"], r["provider"]), float("nan"))
        out.append(
            f"| {r['case']} | {r['provider']} | {mode} ({r['compile'].split('+')[0]}) | {r['ms']:.1f} "
            f"({r['ms_min']:.1f}-{r['ms_max']:.1f}) | {base / r['ms']:.3f}x | {r['host_ms']:.1f} "
            f"| {r.get('cudagraph_skips', '-')} | {r['first_call_s']:.0f} |"
        )
    return "\n".join(out) + "\n"


def is_block_sparse(data: dict) -> bool:
    """bench/runners/block_sparse.py's JSON."""
    return any(r.get("provider") == "fused_sparse" for r in data["rows"])


def block_sparse_table(data: dict) -> str:
    """Markdown: ms forward / forward+backward per share of blocks kept, ours
    against FlexAttention with the same BlockMask and our dense attention, and
    the mask builders' times."""
    rows, env = data["rows"], data["env"]
    dense = next(r for r in rows if r["provider"] == "fused_dense")
    cudnn = next((r for r in rows if r["provider"] == "sdpa_cudnn_dense"), None)
    by = {(r["provider"], r["density"]): r for r in rows if "density" in r}
    shape = _shape(dense["shape"])

    def ratio(a, b):
        both = f"{a['fwdbwd_ms'] / b['fwdbwd_ms']:.2f}x" if "fwdbwd_ms" in a and "fwdbwd_ms" in b else "-"
        return f"{a['fwd_ms'] / b['fwd_ms']:.2f}x / {both}"

    def times(r):
        return f"{r['fwd_ms']:.2f} / " + (f"{r['fwdbwd_ms']:.1f}" if "fwdbwd_ms" in r else "-")

    cudnn_text = ""
    if cudnn:
        failed = f"; its backward: {cudnn['fwdbwd_error'][:80]}" if "fwdbwd_error" in cudnn else ""
        cudnn_text = f", SDPA's cuDNN dense attention's ({times(cudnn)} ms{failed})"
    atomic = any(p == "fused_sparse_atomic_dq" for p, _ in by)
    out = [
        run_line(env) + f" | bf16, {shape}, random 128x128 block masks (diagonal and block 0 kept), one for "
        "every head.",
        "",
        "ms forward / forward+backward (CUDA-graph replay); the speed-ups divide our dense attention's time "
        f"({times(dense)} ms){cudnn_text} and FlexAttention's (compiled, same `BlockMask`) by ours"
        + (
            "; `fused_sparse_atomic_dq`: ours after `set_attention_backward(deterministic=False)`, its speed-ups "
            "in the last two columns"
            if atomic
            else ""
        )
        + ".",
        "",
        "| blocks kept | fused_sparse | flex_block_mask | vs fused dense | "
        + ("vs cuDNN dense | " if cudnn else "")
        + "vs flex |"
        + (" fused_sparse_atomic_dq | its vs cuDNN dense | its vs flex |" if atomic else ""),
        "|---:|---:|---:|---:|" + ("---:|" if cudnn else "") + "---:|" + ("---:|---:|---:|" if atomic else ""),
    ]
    for density in sorted({d for p, d in by if p == "fused_sparse"}):
        ours, flex = by[("fused_sparse", density)], by.get(("flex_block_mask", density), {})
        line = (
            f"| {density:.0%} | {times(ours)} | "
            + (f"{times(flex)} | " if flex else "- | ")
            + f"{ratio(dense, ours)} | "
            + (f"{ratio(cudnn, ours)} | " if cudnn else "")
            + (f"{ratio(flex, ours)} |" if flex else "- |")
        )
        if atomic:
            fast = by.get(("fused_sparse_atomic_dq", density))
            line += (
                (
                    f" {times(fast)} | "
                    + (f"{ratio(cudnn, fast)} | " if cudnn else "- | ")
                    + (f"{ratio(flex, fast)} |" if flex else "- |")
                )
                if fast
                else " - | - | - |"
            )
        out.append(line)
    builders = [r for r in rows if "ms" in r]
    if builders:
        out += [
            "",
            "Mask building, compiled: "
            + "; ".join(f"`{r['provider']}` {_shape(r['shape'])} {r['ms'] * 1e3:.0f} us" for r in builders)
            + ".",
        ]
    return "\n".join(out) + "\n"


def is_diffusers_e2e(data: dict) -> bool:
    """bench/runners/diffusers_e2e.py's JSON."""
    return any("case" in r for r in data["rows"])


def is_diffusers_e2e_int8(data: dict) -> bool:
    """diffusers_e2e.py --int8-attention's JSON."""
    return any(r.get("provider") == "int8_attention_compiled" for r in data["rows"])


def diffusers_e2e_int8_table(data: dict) -> str:
    """Markdown: a step with 8-bit attention beside SDPA, our bf16 attention
    and SageAttention, with spreads and each step's distance to the bf16 model."""
    env = data["env"]
    by = {(r["case"], r["provider"]): r for r in data["rows"]}
    cases = list(dict.fromkeys(r["case"] for r in data["rows"]))
    providers = [
        p
        for p in (
            "native_compiled",
            "patched_compiled",
            "int8_attention_compiled",
            "int8_fp8_attention_compiled",
            "int8_fp8_attention_quant_in_attention_compiled",
            "sage_attention_compiled",
        )
        if any(r["provider"] == p for r in data["rows"])
    ]
    out = [
        run_line(env, f"diffusers {env.get('diffusers', '?')}, sageattention {env.get('sageattention', '?')}")
        + " | bf16, batch 1, random weights, regional compile; ms per step, median of 3 (min-max), and the "
        "step output's relative L2 to the bf16 model in eager mode.",
        "",
        "| case | tokens | " + " | ".join(providers) + " | fastest 8-bit vs native |",
        "|---|---:|" + "---:|" * (len(providers) + 1),
    ]
    for case in cases:
        cells = []
        for p in providers:
            r = by.get((case, p))
            cells.append(
                "-"
                if r is None
                else "err"
                if "error" in r
                else f"{r['ms']:.1f} ({r['ms_min']:.1f}-{r['ms_max']:.1f}), {r['rel_l2_vs_bf16']:.1e}"
            )
        native = by.get((case, "native_compiled"))
        eight_bit = [
            r["ms"]
            for p in ("int8_attention_compiled", "int8_fp8_attention_compiled")
            if "ms" in (r := by.get((case, p), {}))
        ]
        speed = f"{native['ms'] / min(eight_bit):.3f}x" if native and "ms" in native and eight_bit else "-"
        tokens = next((r["tokens"] for (c, _), r in by.items() if c == case and "tokens" in r), "")
        out.append(f"| {case} | {tokens} | " + " | ".join(cells) + f" | {speed} |")
    return "\n".join(out) + "\n"


def is_diffusers_e2e_fp8(data: dict) -> bool:
    """diffusers_e2e.py's JSON of an FP8-only run (``--fp8 --providers native_compiled,...``)."""
    providers = {r.get("provider") for r in data["rows"]}
    return "fp8_compiled" in providers and not providers & {"native_eager", "patched_eager", "patched_compiled"}


def diffusers_e2e_fp8_table(data: dict) -> str:
    """Markdown: the FP8 table alone, under the run's environment line."""
    modes = sorted({r.get("compile", "full") for r in data["rows"]})
    return (
        run_line(
            data["env"], f"diffusers {data['env'].get('diffusers', '?')}, torchao {data['env'].get('torchao', '?')}"
        )
        + f" | bf16, batch 1, random weights, compile: "
        f"{', '.join(modes)}.\n" + _fp8_e2e_table({(r["case"], r["provider"]): r for r in data["rows"]})
    )


def diffusers_e2e_table(data: dict) -> str:
    """Markdown: ms and peak MiB per case for native/patched x eager/compiled,
    and the patched speed-ups."""
    rows, env = data["rows"], data["env"]
    by = {(r["case"], r["provider"]): r for r in rows}
    providers = ("native_eager", "native_compiled", "patched_eager", "patched_compiled")
    out = [
        run_line(env, f"diffusers {env.get('diffusers', '?')}") + " | bf16, batch 1, random weights.",
        "",
        "ms per call (peak MiB above the memory in use before it); compiled = `torch.compile` default mode.",
        "",
        "| case | attention kernel | " + " | ".join(providers) + " | patched vs native, compiled / eager |",
        "|---|---|" + "---:|" * (len(providers) + 1),
    ]
    for case in dict.fromkeys(r["case"] for r in rows):
        cells = [
            f"{by[(case, p)]['ms']:.1f} ({by[(case, p)]['peak_MiB']:.0f})" if (case, p) in by else "-"
            for p in providers
        ]
        speed = "-"
        if all((case, p) in by for p in providers):
            speed = (
                f"{by[(case, 'native_compiled')]['ms'] / by[(case, 'patched_compiled')]['ms']:.2f}x / "
                f"{by[(case, 'native_eager')]['ms'] / by[(case, 'patched_eager')]['ms']:.2f}x"
            )
        kernel = by.get((case, "patched_eager"), {}).get("attention_kernel", "?")
        out.append(f"| {case} | {kernel} | " + " | ".join(cells) + f" | {speed} |")
    return "\n".join(out) + "\n" + _fp8_e2e_table(by)


#: The rows of the FP8 table: bf16 compiled, then the FP8 providers (a row not run is left out).
FP8_TABLE_ROWS = (
    "native_compiled",
    "fp8_compiled",
    "fp8_modulation_compiled",
    "fp8_fp32_accum_compiled",
    "fp8_int8_attention_compiled",
    "fp8_int8_fp8_attention_compiled",
    "torchao_fp8_compiled",
)
#: Rows left out of the FP8 table when they were not run.
OPTIONAL_FP8_ROWS = (
    "fp8_modulation_compiled",
    "fp8_fp32_accum_compiled",
    "fp8_int8_attention_compiled",
    "fp8_int8_fp8_attention_compiled",
)


def _fp8_e2e_table(by: dict) -> str:
    """Markdown: the FP8 providers of ``diffusers_e2e.py --fp8`` beside native
    compiled bf16: median ms (spread over the repeats), speed-ups, the output's
    relative L2 error against bf16, weight memory and the first compiled call."""
    cases = [case for case in dict.fromkeys(c for c, _ in by) if (case, "fp8_compiled") in by]
    if not cases:
        return ""
    out = [
        "",
        "FP8 inference, compiled: median ms (min-max over the repeats); error = the step output's relative "
        "L2 distance to the bf16 model's; per Linear = each block Linear's own error on the bf16 model's "
        "input to it, median (max) over the Linears.",
        "",
        "Graph replay = the same step replayed from one CUDA graph (its GPU time without the host's "
        "launches; `--replay`), vs torchao's replay; host ms = a call's return before the GPU finishes (near "
        "ms: the step waits on launching).",
        "",
        "| case | provider | ms | vs native compiled | vs torchao float8 | graph replay ms | host ms | "
        "rel. L2 vs bf16 | per Linear | weights MiB | peak MiB | first call s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        native, torchao = by.get((case, "native_compiled")), by.get((case, "torchao_fp8_compiled"))
        for provider in FP8_TABLE_ROWS:
            r = by.get((case, provider))
            if r is None and provider in OPTIONAL_FP8_ROWS:
                continue
            if r is None or "error" in r:
                reason = "not run" if r is None else r["error"]
                out.append(f"| {case} | {provider} | {reason} | | | | | | | | | |")
                continue
            spread = f" ({r['ms_min']:.1f}-{r['ms_max']:.1f})" if "ms_min" in r else ""
            vs_native = f"{native['ms'] / r['ms']:.2f}x" if native else "-"
            vs_torchao = f"{torchao['ms'] / r['ms']:.2f}x" if torchao and "error" not in torchao else "-"
            err = f"{r['rel_l2_vs_bf16']:.1e}" if "rel_l2_vs_bf16" in r else "-"
            replay = "-"
            if "replay_ms" in r:
                replay = f"{r['replay_ms']:.1f} ({r['replay_ms_min']:.1f}-{r['replay_ms_max']:.1f})"
                if torchao and "replay_ms" in torchao:
                    replay += f", {torchao['replay_ms'] / r['replay_ms']:.2f}x"
            host = f"{r['host_ms']:.1f}" if "host_ms" in r else "-"
            weights = f"{r['weights_MiB']:.0f}" if "weights_MiB" in r else "not measured"
            per_linear = r.get("per_linear_rel_l2")
            per_linear = f"{per_linear['median']:.1e} ({per_linear['max']:.1e})" if per_linear else "-"
            first = f"{r['first_call_s']:.0f}"
            if "first_call_cold_s" in r:  # the row's own first call found warm caches
                first += f" (cold: {r['first_call_cold_s']:.0f})"
            out.append(
                f"| {case} | {provider} | {r['ms']:.1f}{spread} | {vs_native} | {vs_torchao} | {replay} | "
                f"{host} | {err} | "
                f"{per_linear} | {weights} | {r['peak_MiB']:.0f} | {first} |"
            )
    return "\n".join(out) + "\n"


def is_sparse_e2e(data: dict) -> bool:
    """bench/runners/sparse_e2e.py's JSON."""
    return any(r.get("provider") == "sparse_compiled" for r in data["rows"])


def sparse_e2e_table(data: dict) -> str:
    """Markdown: sparse self-attention against native compiled dense per case,
    with the density and the accuracy cost (random and smooth latents)."""
    env = data["env"]
    by = {(r["case"], r["provider"]): r for r in data["rows"]}
    out = [
        run_line(env, f"diffusers {env.get('diffusers', '?')}") + " | bf16, batch 1, random weights, "
        "blocks compiled in place.",
        "",
        "Median ms (min-max over the repeats). Errors: relative L2 to dense; attention = each layer's sparse "
        "output against dense SDPA on the same q/k/v, median (max) over the layers; random / smooth latents.",
        "",
        "| case | tokens | provider | ms | vs native compiled | density | step error | attention error |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for case in dict.fromkeys(r["case"] for r in data["rows"]):
        native = by.get((case, "native_compiled"))
        sparse = [p for c, p in by if c == case and p.startswith("sparse")]
        for provider in ("native_compiled", *sparse):
            r = by.get((case, provider))
            if r is None:
                continue
            speed = f"{native['ms'] / r['ms']:.2f}x" if native else "-"
            if provider != "native_compiled":
                att, att_s = r["attention_rel_l2"], r["attention_rel_l2_smooth"]
                extra = (
                    f"{r['density']:.1%} | {r['step_rel_l2']:.2e} / {r['step_rel_l2_smooth']:.2e} | "
                    f"{att['median']:.2e} ({att['max']:.2e}) / {att_s['median']:.2e} ({att_s['max']:.2e})"
                )
                options = "".join(f", {k}={v!r}" for k, v in r.get("options", {}).items())
                provider = f"{provider}, {r['preset']}{options}"
            else:
                extra = "100% | - | -"
            out.append(
                f"| {case} | {r['tokens']} | {provider} | {r['ms']:.1f} ({r['ms_min']:.1f}-{r['ms_max']:.1f}) "
                f"| {speed} | {extra} |"
            )
    return "\n".join(out) + "\n"


def is_distributed_train(data: dict) -> bool:
    """bench/runners/distributed_train.py's JSON."""
    return any("multi" in r for r in data["rows"])


def compiled_summary(result: dict) -> str:
    """bench/runners/distributed_train.py's compiled timings of a sharded run, in words."""
    if "compile_error" in result:
        return f"compiled: failed, {result['compile_error']}"
    if "compiled_sharded_ms" not in result:
        return "not compiled"
    return f"compiled: {result['compiled_sharded_ms']:.2f} against {result['compiled_unsharded_ms']:.2f}"


def distributed_train_table(data: dict) -> str:
    """Markdown: FSDP2 training throughput on 1 and N GPUs, the loss
    agreement, and the heads-sharded block's check."""
    row, env = data["rows"][0], data["env"]
    config, gpus = row["config"], row["gpus"]
    batch = config["global_batch"]
    runs = (
        ("1 GPU, whole batch", row["single"], 1, batch),
        ("1 GPU", row["baseline"], 1, batch // gpus),
        (f"{gpus} GPUs", row["multi"], gpus, batch // gpus),
    )
    base = row["baseline"]["training"]["samples_per_s"]
    out = [
        run_line(env, gpus=gpus) + f" | {config['depth']} blocks of {config['dim']} wide, "
        f"{config['heads']} heads, {config['tokens']} tokens a sample, {config['dtype']} compute, fp32 parameters "
        f"and gradient reduction, AdamW (fused), {config['steps']} steps ({config['warmup']} untimed).",
        "",
        "| run | samples per GPU | ms per step | samples/s | samples/s per GPU | vs 1 GPU | peak MiB per GPU |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, run, ranks, per_rank in runs:
        t = run["training"]
        out.append(
            f"| {name} | {per_rank} | {t['step_ms']:.1f} | {t['samples_per_s']:.2f} | "
            f"{t['samples_per_s'] / ranks:.2f} | {t['samples_per_s'] / base:.2f}x | {t['peak_MiB']:.0f} |"
        )
    single, multi = row["single"]["training"]["losses"], row["multi"]["training"]["losses"]
    worst = max(abs(a - b) / abs(a) for a, b in zip(single, multi))
    heads = row["multi"]["heads_sharded"]
    collectives = ", ".join(f"{n} x {k.split('.')[-1]}" for k, n in heads["forward_collectives"].items())
    out += [
        "",
        f"Per-step losses, {gpus} GPUs against 1 GPU on the same global batch of {config['global_batch']}: "
        f"largest relative difference {worst:.1e} over {len(single)} steps.",
        f"Heads-sharded block (tensor parallel): forward collectives {collectives}; worst relative "
        f"error against the unsharded block (output and every gradient) "
        f"{max(heads['relative_errors'].values()):.1e}"
        f"; {heads['sharded_ms']:.2f} ms forward+backward against {heads['unsharded_ms']:.2f} unsharded, eager "
        f"({compiled_summary(heads)}).",
    ]
    sequence = row["multi"].get("sequence_sharded")
    if sequence:
        collectives = ", ".join(f"{n} x {k.split('.')[-1]}" for k, n in sequence["forward_collectives"].items())
        out.append(
            f"Sequence-sharded attention ([1, {config['tokens']}, {config['heads']}, "
            f"{config['dim'] // config['heads']}]): output {sequence['output_placements']}, forward "
            f"collectives {collectives}; worst relative error {max(sequence['relative_errors'].values()):.1e}; "
            f"{sequence['sharded_ms']:.2f} ms forward+backward against {sequence['unsharded_ms']:.2f} on one "
            f"GPU, eager ({compiled_summary(sequence)})."
        )
    if row["failures"]:
        out += ["", "Failed: " + "; ".join(row["failures"])]
    return "\n".join(out) + "\n"


#: The README's headline: one end-to-end step per row, compile_ops beside what a user runs instead.
#: (label, results file, case, our provider, patch call, peer provider, peer label).
HEADLINE_ROWS = (
    (
        "Flux.1-dev 1024², bf16",
        "diffusers-e2e-h100.json",
        "flux_step",
        "patched_compiled",
        "`patch(model)`",
        "native_compiled",
        "`torch.compile`",
    ),
    (
        "Wan 2.1 1.3B 480p, bf16",
        "diffusers-e2e-h100.json",
        "wan_step",
        "patched_compiled",
        "`patch(model)`",
        "native_compiled",
        "`torch.compile`",
    ),
    (
        "Flux-size training step, bf16",
        "diffusers-e2e-h100.json",
        "flux_train",
        "patched_compiled",
        "`patch(model)`",
        "native_compiled",
        "`torch.compile`",
    ),
    (
        "Flux.1-dev 1024², FP8 Linears",
        "diffusers-e2e-fp8-h100.json",
        "flux_step",
        "fp8_compiled",
        '`precision="fp8"`',
        "torchao_fp8_compiled",
        "torchao float8",
    ),
    (
        "Wan 2.1 1.3B 480p, FP8 + 8-bit attention",
        "diffusers-e2e-fp8-h100.json",
        "wan_step",
        "fp8_int8_fp8_attention_compiled",
        '`precision="fp8", attention_precision="int8_fp8"`',
        "torchao_fp8_compiled",
        "torchao float8",
    ),
    (
        "Wan 2.1 1.3B 480p, 8-bit attention",
        "diffusers-e2e-int8-h100.json",
        "wan_step",
        "int8_fp8_attention_compiled",
        '`attention_precision="int8_fp8"`',
        "sage_attention_compiled",
        "SageAttention 1.0.6",
    ),
    (
        "Wan 2.1 1.3B 720p, 8-bit attention",
        "diffusers-e2e-int8-h100.json",
        "wan_step_720p",
        "int8_fp8_attention_compiled",
        '`attention_precision="int8_fp8"`',
        "native_compiled",
        "`torch.compile`",
    ),
    (
        "Wan 2.1 1.3B 480p, sparse attention",
        "sparse-e2e-h200.json",
        "wan_step",
        "sparse_compiled",
        "`attention=SlidingTile(...)`",
        "native_compiled",
        "`torch.compile`",
    ),
    (
        "Wan 2.1 1.3B 720p, FP8 + sparse 8-bit attention",
        "sparse-e2e-h200.json",
        "wan_step_720p",
        "sparse_fp8_int8_fp8_compiled",
        '`precision="fp8", attention=SlidingTile(...), attention_precision="int8_fp8"`',
        "native_compiled",
        "`torch.compile`",
    ),
)


def _step_error(row: dict) -> str:
    """The step output's relative L2 distance to the bf16 model (sparse rows: to dense attention)."""
    for key in ("rel_l2_vs_bf16", "step_rel_l2"):
        if key in row:
            return f"{row[key]:.1e}"
    return "-"


def headline_table(results_dir: str, doc_dir: str = ".") -> str:
    """Markdown: :data:`HEADLINE_ROWS` from the committed results files in ``results_dir``:
    each step's time beside its peer's, from the same run, with the step error of both;
    the files are linked relative to ``doc_dir``, the directory of the page that shows it."""
    out = [
        "| step (batch 1) | compile_ops | ms | beside | ms | speed-up | step error, ours / beside | GPU |",
        "|---|---|---:|---|---:|---:|---:|---|",
    ]
    envs = {}
    for label, name, case, ours, call, peer, peer_label in HEADLINE_ROWS:
        data = load(os.path.join(results_dir, name))
        envs[name] = data["env"]
        by = {(r["case"], r["provider"]): r for r in data["rows"]}
        mine, theirs = by[(case, ours)], by[(case, peer)]
        gpu = data["env"]["gpu"].replace("NVIDIA ", "").replace(" 80GB HBM3", "")
        out.append(
            f"| {label} | {call} | {mine['ms']:.1f} | {peer_label} | {theirs['ms']:.1f} | "
            f"{theirs['ms'] / mine['ms']:.2f}x | {_step_error(mine)} / {_step_error(theirs)} | {gpu} |"
        )
    versions = sorted({(e["torch"], e["triton"], e.get("diffusers", "?")) for e in envs.values()})
    dates = sorted({e["date"][:10] for e in envs.values()})
    files = ", ".join(f"[`{name}`]({os.path.relpath(os.path.join(results_dir, name), doc_dir)})" for name in envs)
    out += [
        "",
        "Random weights; ms: a `do_bench` median, or the median of 3 where the run repeated it "
        "(regional or whole-model compile, as each file records); step error: the output's relative L2 "
        "distance to the bf16 model's (sparse: to dense attention). "
        + "; ".join(f"torch {t}, triton {tr}, diffusers {d}" for t, tr, d in versions)
        + f"; runs of {', '.join(dates)}; from {files}.",
    ]
    return "\n".join(out) + "\n"


def update_block(doc_path: str, block: str, marker: str = "perf-table") -> None:
    """Replace the lines between the ``<!-- marker:start -->`` and ``<!-- marker:end -->``
    lines of the Markdown file ``doc_path`` with ``block``."""
    start_line, end_line = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    with open(doc_path) as f:
        lines = f.read().splitlines(keepends=True)
    stripped = [line.strip() for line in lines]
    try:
        start = stripped.index(start_line)
        end = stripped.index(end_line, start + 1)
    except ValueError:
        raise SystemExit(
            f"report.py: {doc_path} needs the lines {start_line} and {end_line} (in that order) around the table"
        ) from None
    new = lines[: start + 1] + [block if block.endswith("\n") else block + "\n"] + lines[end:]
    with open(doc_path, "w") as f:
        f.writelines(new)


def plot(json_path: str, png_path: str):
    """Grouped bars of GB/s per provider: a column per op, forward above and
    forward+backward below, the copy bandwidth dashed. Returns ``png_path``, or
    None (with a message) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; no display on the benchmark machines
        import matplotlib.pyplot as plt
    except ImportError:
        print("report.py: matplotlib is not installed, so no plot", file=sys.stderr)
        return None
    data = load(json_path)
    rows = data["rows"]
    lookup = _lookup(rows)
    ops = _ops_and_providers(rows)
    if not ops:
        print("report.py: no rows, so no plot", file=sys.stderr)
        return None
    all_providers = []
    for _, _, providers in ops:
        all_providers += [p for p in providers if p not in all_providers]
    # One colour per provider across every panel, so a peer reads the same everywhere.
    palette = plt.get_cmap("tab10")
    color = {p: palette(i % 10) for i, p in enumerate(all_providers)}
    copy_GBps = data["copy_TBps"] * 1e3

    fig, axes = plt.subplots(2, len(ops), figsize=(4.5 * len(ops) + 1, 8), squeeze=False, sharey="row")
    for col, (op, shapes, providers) in enumerate(ops):
        width = 0.8 / max(1, len(providers))
        for row_i, (key, title) in enumerate((("fwd_GBps", "forward"), ("fwdbwd_GBps", "forward+backward"))):
            ax = axes[row_i][col]
            for j, p in enumerate(providers):
                values = []
                for shape in shapes:
                    r = lookup.get((op, tuple(shape), p), {})
                    values.append(math.nan if r.get(key) is None else r[key])
                xs = [i + (j - (len(providers) - 1) / 2) * width for i in range(len(shapes))]
                ax.bar(xs, values, width, color=color[p], label=_HEADERS.get(p, p))
            ax.axhline(copy_GBps, color="black", linestyle="--", linewidth=1)
            ax.set_title(f"{op}, {title}", fontsize="medium")
            ax.set_xticks(range(len(shapes)))
            ax.set_xticklabels([_shape(s) for s in shapes], fontsize="small")
            ax.grid(axis="y", alpha=0.3)
            if col == 0:
                ax.set_ylabel("GB/s")
    for ax in axes[:, -1]:
        ax.annotate(
            f"device copy {data['copy_TBps']:.2f} TB/s",
            xy=(1, copy_GBps),
            xycoords=("axes fraction", "data"),
            xytext=(-2, 2),
            textcoords="offset points",
            ha="right",
            fontsize="x-small",
        )
    # One legend for the figure: colours are per provider, the same in every panel.
    handles = [plt.Rectangle((0, 0), 1, 1, color=color[p]) for p in all_providers]
    fig.legend(
        handles,
        [_HEADERS.get(p, p) for p in all_providers],
        loc="lower center",
        ncol=min(len(all_providers), 8),
        fontsize="small",
        frameon=False,
    )
    env = data["env"]
    fig.suptitle(
        f"{env['gpu']} | torch {env['torch']} | triton {env['triton']} | "
        f"{', '.join(sorted({r.get('dtype', 'bfloat16') for r in rows}))}",
        fontsize="medium",
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))  # room for the legend below
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


#: The runners' tables, recognised by their JSON's rows: (recognise, make the table, its block's marker).
#: bench/run.py's op table is the fallback (:func:`doc_table`).
RUNNER_TABLES = (
    (context_parallel.is_context_parallel, context_parallel.context_parallel_table, context_parallel.marker),
    (is_aoti, aoti_table, lambda rows: "aoti-table"),
    (is_compile_modes, compile_modes_table, lambda rows: "compile-modes-table"),
    (is_distributed_train, distributed_train_table, lambda rows: "distributed-train-table"),
    (
        is_sparse_e2e,
        sparse_e2e_table,
        lambda rows: "sparse-e2e-combined-table" if any(r.get("options") for r in rows) else "sparse-e2e-table",
    ),
    (is_diffusers_e2e_int8, diffusers_e2e_int8_table, lambda rows: "diffusers-e2e-int8-table"),
    (is_diffusers_e2e_fp8, diffusers_e2e_fp8_table, lambda rows: "diffusers-e2e-fp8-table"),
    (is_diffusers_e2e, diffusers_e2e_table, lambda rows: "diffusers-e2e-table"),
    (is_block_sparse, block_sparse_table, lambda rows: "block-sparse-table"),
    (is_host, host_table, lambda rows: "host-table"),
    (is_moe, moe_table, lambda rows: "moe-table"),
    (is_attention_int8, attention_int8_table, lambda rows: "attention-int8-table"),
    (
        is_attention,
        attention_table,
        lambda rows: "attention-causal-table" if any(r.get("causal") for r in rows) else "attention-table",
    ),
)


def doc_table(data: dict) -> tuple:
    """``(marker, Markdown)``: the table a results file's ``data`` makes, and the
    block of docs/performance.md it fills."""
    for recognise, make_table, marker in RUNNER_TABLES:
        if recognise(data):
            return marker(data["rows"]), make_table(data)
    return "perf-table", markdown_table(data)


def main(argv=None) -> int:
    """CLI: print the table; optionally rewrite its block in a Markdown file and draw the plot."""
    p = argparse.ArgumentParser(description="Print benchmark tables from bench/run.py's JSON.")
    p.add_argument("json", nargs="?", help="results file, e.g. bench/results/h100.json")
    p.add_argument(
        "--doc",
        "--readme",
        dest="doc",
        help="a Markdown file whose block for this table to rewrite (docs/performance.md)",
    )
    p.add_argument(
        "--headline",
        metavar="MARKDOWN",
        help="rewrite the headline-table block of this file (README.md) from bench/results",
    )
    p.add_argument(
        "--results",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
        help="where --headline reads the results files (default: bench/results)",
    )
    p.add_argument("--plot", help="write the plot to this PNG")
    p.add_argument(
        "--merge-into",
        metavar="BASE_JSON",
        help="a rerun of some of BASE_JSON's cases: its rows replace theirs in BASE_JSON (rewritten, "
        "each row dated), and the table is made from the result",
    )
    args = p.parse_args(argv)
    if args.headline:
        table = headline_table(args.results, os.path.dirname(os.path.abspath(args.headline)))
        print(table)
        update_block(args.headline, table, "headline-table")
        print(f"\nrewrote the headline-table block in {args.headline}")
        if args.json is None:
            return 0
    if args.json is None:
        p.error("a results file is needed (or --headline alone)")
    data = load(args.json)
    if args.merge_into:
        data = merge_runs(load(args.merge_into), data)
        with open(args.merge_into, "w") as f:
            json.dump(data, f, indent=1)
    marker, table = doc_table(data)
    print(format_table(data) if marker == "perf-table" else table)
    if args.doc:
        update_block(args.doc, table, marker)
        print(f"\nrewrote the {marker} block in {args.doc}")
    if marker != "perf-table":
        return 0
    if args.plot and plot(args.json, args.plot):
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
