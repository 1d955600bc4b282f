"""The house: comments and docstrings of ``compile_ops`` carry no figures or history.

A comment says what a thing is and why, once, and points to the note that
holds the numbers (CONTRIBUTING.md, "Comments and docstrings"). Figures in code
go stale the day the kernel or the GPU changes; they live in
``bench/results/*.json``, the generated tables and ``docs/notes/``.

The check reads every comment (``tokenize``) and every module, class and
function docstring (``ast``) of every ``.py`` file of ``compile_ops`` and fails
listing ``file:line: text`` for each measurement, ratio, GPU name, date, issue
or session number, or history word it finds. Sizes and specification constants
(``[B, L, C]``, ``fp32``, ``sm_90``, ``e4m3``, ``2**-6``, ``448``, ``128 keys``,
``D = 64``) are not measurements and pass.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: ``(name, pattern)``: what a comment or docstring must not hold.
FORBIDDEN = [
    (
        "time, bandwidth, throughput or memory figure",
        re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s*(?:ms|us|µs|ns|s|GB/s|TB/s|TFLOP/s|TFLOPs|GiB|MB)(?![\w/])"),
    ),
    ("ratio", re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?[x×](?!\w)")),
    ("ratio to a peer", re.compile(r"(?:\d|\b)[x×]\s*(?:cuDNN|FA[23]|FlashAttention|torch|SDPA|Liger|torchao)\b")),
    ("percentage", re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?%")),
    ("GPU name", re.compile(r"\b(?:H100|H200|H800|A100|A10G?|B200|B100|GB200|L4|L40S?|RTX\s?\d{4})\b")),
    ("issue number", re.compile(r"\b(?:issue|PR|pull request)\s*#?\d+", re.I)),
    ("session", re.compile(r"\bsessions?\b", re.I)),
    ("date", re.compile(r"\b20\d\d-\d\d(?:-\d\d)?\b")),
    # Past-tense results and change history; "the scale used to quantize q" passes.
    (
        "history",
        re.compile(
            r"\b(?:used to be|used to (?:run|take|cost|launch|beat|lose|win)|reverted|previously|"
            r"no longer|regressed|we tried|once was|"
            r"(?:was|were|ran|measured)\s+(?:no\s+|a little\s+)?(?:slower|faster))\b",
            re.I,
        ),
    ),
]

#: ``"path:line": reason`` for text that matches a pattern but is no figure.
#: Every entry needs its reason; keep it empty if at all possible.
EXEMPT: dict = {}


def comments(source: str):
    """``(line, text)`` of every ``#`` comment of ``source``."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def docstrings(source: str, filename: str = "<string>"):
    """``(line, text)`` of every module, class and function docstring of ``source``,
    one entry per line of the docstring so that a hit names its own line."""
    tree = ast.parse(source, filename)
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in nodes:
        body = node.body
        if not (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            continue
        first = body[0].value.lineno
        for offset, text in enumerate(body[0].value.value.splitlines()):
            yield first + offset, text


def hits(source: str, filename: str = "<string>") -> list:
    """``(line, kind, text)`` of every forbidden match in the comments and docstrings of ``source``.
    A docstring's line numbers assume one source line per docstring line (no escaped newlines)."""
    found = []
    for line, text in sorted({*comments(source), *docstrings(source, filename)}):
        for kind, pattern in FORBIDDEN:
            if pattern.search(text):
                found.append((line, kind, text.strip()))
    return found


def package_hits(package: str = "compile_ops") -> list:
    """``"path:line: [kind] text"`` of every hit in ``package`` not in ``EXEMPT``."""
    report = []
    for path in sorted((ROOT / package).rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for line, kind, text in hits(path.read_text(), relative):
            if f"{relative}:{line}" not in EXEMPT:
                report.append(f"{relative}:{line}: [{kind}] {text}")
    return report


def test_no_figures_or_history_in_comments():
    report = package_hits()
    assert not report, (
        f"{len(report)} comment/docstring lines hold figures or history; state the rule and point "
        "to the docs/notes/ file that holds the numbers:\n" + "\n".join(report)
    )


def test_every_exemption_has_a_reason_and_a_hit():
    for where, reason in EXEMPT.items():
        assert reason.strip(), f"{where}: an exemption needs its reason"
        path, line = where.rsplit(":", 1)
        assert any(found[0] == int(line) for found in hits((ROOT / path).read_text(), path)), (
            f"{where} is exempt but no longer matches: drop the entry"
        )


def test_the_checker_finds_planted_figures():
    """Not vacuous: each kind of figure or history is caught, in a comment and in a docstring."""
    planted = '''"""Module docstring: 1.2x faster than before."""
def f(x):
    """Runs in 3.4 ms on an H100; reverted in issue 28."""
    y = x  # 650 TFLOP/s, 0.93x cuDNN, 71% of roof
    # 2024-05-01 session 12: 3.1 TB/s, 1.1-1.3x
    return y  # 8 warps ran slower
'''
    found = hits(planted)
    kinds = {kind for _, kind, _ in found}
    assert {
        "ratio",
        "time, bandwidth, throughput or memory figure",
        "GPU name",
        "history",
        "issue number",
        "ratio to a peer",
        "percentage",
        "date",
        "session",
    } <= kinds, kinds
    assert {line for line, _, _ in found} == {1, 3, 4, 5, 6}


def test_the_checker_passes_sizes_and_constants():
    """Shapes, dtypes, architectures and specification constants are not measurements."""
    clean = '''"""Normalizes ``x`` [B, L, C] in fp32 on sm_90; e4m3 saturates at 448."""
def f(x):
    """Scores scaled by 1 / sqrt(D) with D = 64; 128 keys per tile, 2**-6 floor, 0x7F mask."""
    y = x  # 2 heads per program, 16 x 16 tiles, int64 offsets past 2**31 elements, a prefix torch adds
    return y  # the scale used to quantize q; a 4-stage pipeline
'''
    assert hits(clean) == []
