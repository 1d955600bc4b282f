"""The docs stay true: links resolve, the README stays a front door, generated tables match their JSON.

Reference layer, no GPU and no kernels: reads Markdown files and the
committed ``bench/results`` JSON only.
"""

import re
from pathlib import Path

import pytest

from bench import report

ROOT = Path(__file__).resolve().parents[1]
#: The README is read first by a newcomer: it links to the docs instead of growing.
README_MAX_LINES = 250

#: ``[text](target)``; the target up to the first space or closing parenthesis.
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_MARKER = re.compile(r"^<!-- ([\w-]+):start -->$(.*?)^<!-- \1:end -->$", re.MULTILINE | re.DOTALL)


def markdown_files() -> list:
    """README.md, CONTRIBUTING.md and every Markdown file under docs/."""
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def relative_links(text: str) -> list:
    """The link targets of ``text`` that name a file of the repository: not URLs, not
    in-page anchors, not inside code; an anchor after the path is dropped."""
    text = _CODE_SPAN.sub("code", _FENCE.sub("", text))
    targets = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def broken_links(path: Path) -> list:
    return [target for target in relative_links(path.read_text()) if not (path.parent / target).exists()]


def test_the_docs_exist():
    for name in ("design.md", "ops.md", "integrations.md", "performance.md", "notes/attention.md"):
        assert (ROOT / "docs" / name).is_file(), name
    assert (ROOT / "CONTRIBUTING.md").is_file()


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files(path):
    assert broken_links(path) == [], f"{path.relative_to(ROOT)} links to missing files"


def test_the_link_check_sees_links_and_skips_code_and_urls():
    text = (
        '[a](docs/design.md) [b](https://example.com) [c](#layout) ![d](img.png "title") '
        "[`e.json`](bench/results/e.json#rows) `[f](nowhere.md)`\n```\n[g](nowhere.md)\n```\n"
    )
    assert relative_links(text) == ["docs/design.md", "img.png", "bench/results/e.json"]


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def _block(path: Path, marker: str) -> str:
    blocks = dict(_MARKER.findall(path.read_text()))
    assert marker in blocks, f"{path.relative_to(ROOT)} has no {marker} block"
    return blocks[marker].strip("\n")


def test_readme_headline_is_what_the_committed_results_give():
    """``python bench/report.py --headline README.md`` would change nothing."""
    want = report.headline_table(str(ROOT / "bench" / "results"), str(ROOT)).strip("\n")
    assert _block(ROOT / "README.md", "headline-table") == want, "rerun: python bench/report.py --headline README.md"


#: Each generated block of docs/performance.md and the committed results file it comes from.
PERFORMANCE_TABLES = {
    "perf-table": "h100.json",
    "attention-table": "attention-h100.json",
    "attention-causal-table": "attention-causal-h100.json",
    "attention-int8-table": "attention-int8-h100.json",
    "diffusers-e2e-table": "diffusers-e2e-h100.json",
    "diffusers-e2e-int8-table": "diffusers-e2e-int8-h100.json",
    "diffusers-e2e-fp8-table": "diffusers-e2e-fp8-h100.json",
    "sparse-e2e-combined-table": "sparse-e2e-h100.json",
    "block-sparse-table": "block-sparse-h100.json",
    "moe-table": "moe-h100.json",
    "host-table": "host-h100.json",
    "aoti-table": "aoti-h100.json",
    "compile-modes-table": "diffusers-e2e-modes-h100.json",
    "distributed-train-table": "distributed-train-h200.json",
    "context-parallel-wan_720p-x2-table": "context-parallel-wan_720p-x2-h200.json",
    "context-parallel-flux-x2-table": "context-parallel-flux-x2-h200.json",
    "context-parallel-wan_720p-x4-table": "context-parallel-wan_720p-x4-h200.json",
    "context-parallel-flux-x4-table": "context-parallel-flux-x4-h200.json",
}


def test_every_block_of_performance_md_has_its_results_file():
    blocks = {name for name, _ in _MARKER.findall((ROOT / "docs" / "performance.md").read_text())}
    assert blocks == set(PERFORMANCE_TABLES)


@pytest.mark.parametrize("marker", sorted(PERFORMANCE_TABLES))
def test_performance_tables_are_what_the_committed_results_give(marker):
    """``python bench/report.py bench/results/<file> --doc docs/performance.md`` would change nothing."""
    made_marker, table = report.doc_table(report.load(str(ROOT / "bench" / "results" / PERFORMANCE_TABLES[marker])))
    assert made_marker == marker
    assert _block(ROOT / "docs" / "performance.md", marker) == table.strip("\n"), (
        f"rerun: python bench/report.py bench/results/{PERFORMANCE_TABLES[marker]} --doc docs/performance.md"
    )


def test_readme_context_parallel_table_is_what_the_committed_results_give():
    """The README's multi-GPU table is docs/performance.md's Wan block, from the same JSON."""
    marker = "context-parallel-wan_720p-x2-table"
    _, table = report.doc_table(report.load(str(ROOT / "bench" / "results" / PERFORMANCE_TABLES[marker])))
    assert _block(ROOT / "README.md", marker) == table.strip("\n"), (
        f"rerun: python bench/report.py bench/results/{PERFORMANCE_TABLES[marker]} --doc README.md"
    )
