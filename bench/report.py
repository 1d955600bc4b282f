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
``context-parallel-<case>-x<W>-table`` for bench/runners/context_parallel.py's, ...;
``headline-table`` for :func:`headline_table`); it is regenerated from the
JSON, never edited by hand. The tables live in docs/performance.md, the
headline in README.md. This file makes bench/run.py's op table and the headline, and
dispatches a runner's JSON to its table in bench/tables/<runner>.py (:data:`RUNNER_TABLES`).
"""

import argparse
import json
import math
import os
import sys

if __package__ in (None, ""):  # run as a script: the repository root on the path, for bench.tables
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.tables import (  # noqa: E402
    aoti,
    attention,
    block_sparse,
    context_parallel,
    diffusers_e2e,
    distributed_train,
    host,
    moe,
    shape_name,
    sparse_e2e,
)

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
                shape_name(r["shape"]),
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
                f"eager overhead at {shape_name(overhead['shape'])}: fused.rmsnorm "
                f"{overhead['eager_us']:.1f} µs/call (through the dispatcher "
                f"{overhead['dispatcher_us']:.1f}), bare Triton launch {overhead['bare_us']:.1f} µs/call "
                f"(x{overhead['ratio']:.2f})"
            )
        else:  # results files written before bench/runners/host.py
            out.append(
                f"eager overhead at {shape_name(overhead['shape'])}: fused.rmsnorm "
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
                out.append(f"| {shape_name(shape)} | " + " | ".join(cells) + " |")
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
        "sparse-e2e-h100.json",
        "wan_step",
        "sparse_compiled",
        "`attention=SlidingTile(...)`",
        "native_compiled",
        "`torch.compile`",
    ),
    (
        "Wan 2.1 1.3B 720p, FP8 + sparse 8-bit attention",
        "sparse-e2e-720p-gluon-8bit-h100.json",
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
            ax.set_xticklabels([shape_name(s) for s in shapes], fontsize="small")
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
    (aoti.is_aoti, aoti.aoti_table, lambda rows: "aoti-table"),
    (aoti.is_compile_modes, aoti.compile_modes_table, lambda rows: "compile-modes-table"),
    (
        distributed_train.is_distributed_train,
        distributed_train.distributed_train_table,
        lambda rows: "distributed-train-table",
    ),
    (
        sparse_e2e.is_sparse_e2e,
        sparse_e2e.sparse_e2e_table,
        lambda rows: "sparse-e2e-combined-table" if any(r.get("options") for r in rows) else "sparse-e2e-table",
    ),
    (
        diffusers_e2e.is_diffusers_e2e_int8,
        diffusers_e2e.diffusers_e2e_int8_table,
        lambda rows: "diffusers-e2e-int8-table",
    ),
    (diffusers_e2e.is_diffusers_e2e_fp8, diffusers_e2e.diffusers_e2e_fp8_table, lambda rows: "diffusers-e2e-fp8-table"),
    (diffusers_e2e.is_diffusers_e2e, diffusers_e2e.diffusers_e2e_table, lambda rows: "diffusers-e2e-table"),
    (block_sparse.is_block_sparse, block_sparse.block_sparse_table, lambda rows: "block-sparse-table"),
    (host.is_host, host.host_table, lambda rows: "host-table"),
    (moe.is_moe, moe.moe_table, lambda rows: "moe-table"),
    (attention.is_attention_int8, attention.attention_int8_table, lambda rows: "attention-int8-table"),
    (
        attention.is_attention,
        attention.attention_table,
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
