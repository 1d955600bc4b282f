"""Conformance of ``compile_ops.patch`` with diffusers' own transformer tests.

Runs diffusers' model test files twice, each time in its own pytest
subprocess: unpatched, and with every diffusers transformer model that the
tests build patched by ``compile_ops.patch`` right after it is constructed
(``from_pretrained`` and ``from_config`` construct the model first, so they
are covered too). Then it prints, per test file and mode, the outcome counts
and the wall time, and every test whose outcome differs between the modes.
It exits 1 when some test does worse patched than unpatched, else 0.

    python tests/diffusers_conformance.py --diffusers-tests ~/diffusers/tests \
        [--models flux,wan,sd3,ltx,hunyuan_video,cogvideox,qwenimage] [-k EXPR] \
        [--out results.json] [--workers N] [--processes N] [--timeout SECONDS]

``--diffusers-tests`` is the ``tests/`` directory of a diffusers source
checkout; the model files are ``models/transformers/test_models_transformer_<model>.py``
there. diffusers' test utilities need ``accelerate`` installed (``peft`` for
the LoRA tests, which are skipped without it). The checkout's tests may be
older or newer than the installed diffusers, so some may fail in both modes:
only the differences are about compile_ops. Most of those tests compare a
model with itself (save and reload, LoRA, processors, training), so this checks
behaviour more than numerics; the patched model's agreement with the unpatched
one is ``tests/test_diffusers_patch.py``'s job. Nothing is fetched: both modes
run with ``HF_HUB_OFFLINE=1`` (tests that need a Hub model fail in both, or
use the local Hub cache).

This file is also the pytest plugin of the patched mode: both modes run
pytest with ``-p diffusers_conformance`` (this directory on ``PYTHONPATH``),
and its hooks act only when ``COMPILE_OPS_CONFORMANCE_PATCH=1``, which the
patched mode alone sets. Its name does not start with ``test_``, so the
repository's own pytest run does not collect it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MODELS = ("flux", "wan", "sd3", "ltx", "hunyuan_video", "cogvideox", "qwenimage")
MODES = ("unpatched", "patched")
OUTCOMES = ("passed", "failed", "error", "skipped")
#: How bad an outcome is; a test is worse patched when its rank there is higher.
#: "missing": no outcome at all (the run timed out or the test was not collected).
RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 2, "missing": 3}

PLUGIN = "diffusers_conformance"
PATCH_ENV = "COMPILE_OPS_CONFORMANCE_PATCH"
#: The directory where each pytest process of the patched mode (one, or
#: pytest-xdist's workers) writes how many models of each class it patched (JSON).
COUNTS_ENV = "COMPILE_OPS_CONFORMANCE_COUNTS"
TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent


# ---------------------------------------------------------------- the pytest plugin (patched mode)

_patched = Counter()


def _transformer_classes() -> list:
    """Every ``ModelMixin`` subclass that ``diffusers.models.transformers`` exports."""
    import diffusers.models.transformers as transformers
    from diffusers import ModelMixin

    classes = {
        obj
        for obj in vars(transformers).values()
        if isinstance(obj, type) and issubclass(obj, ModelMixin) and obj is not ModelMixin
    }
    return sorted(classes, key=lambda cls: cls.__name__)


def _patch_after_init(cls: type) -> None:
    """Make ``cls(...)`` return a model already patched by ``compile_ops.patch``.

    The patch runs when ``cls``'s own ``__init__`` returns for an object of
    exactly ``cls``: a subclass's ``super().__init__()`` call is left alone
    (the subclass's wrapper, if it has one, patches the finished object). An
    exception from ``compile_ops.patch`` propagates: the test reports it.
    """
    import compile_ops

    init = cls.__init__

    @functools.wraps(init)  # keeps the signature diffusers' config machinery reads
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if type(self) is cls:
            compile_ops.patch(self)
            _patched[cls.__name__] += 1

    cls.__init__ = __init__


def pytest_configure(config) -> None:
    """Patched mode: wrap the ``__init__`` of every diffusers transformer model."""
    if os.environ.get(PATCH_ENV) != "1":
        return
    for cls in _transformer_classes():
        _patch_after_init(cls)


def pytest_unconfigure(config) -> None:
    """Patched mode: record how many models of each class this process patched."""
    directory = os.environ.get(COUNTS_ENV)
    if os.environ.get(PATCH_ENV) == "1" and directory:
        Path(directory, f"patched-{os.getpid()}.json").write_text(json.dumps(dict(_patched)))


# ---------------------------------------------------------------- the runner


def checkout_version(tests_dir: Path) -> str:
    """The diffusers version in the checkout's ``setup.py`` (beside ``tests_dir``), or "unknown"."""
    setup = tests_dir.parent / "setup.py"
    if not setup.is_file():
        return "unknown"
    found = re.search(r"""version\s*=\s*["']([^"']+)["']""", setup.read_text())
    return found.group(1) if found else "unknown"


def parse_junit(path: Path, module: str) -> dict:
    """``{test id: {"outcome", "message"}}`` from the junit XML of one test file.

    ``module`` is the file's dotted module name; the id is what pytest's node
    id has after the file: ``Class::test[params]`` (a collection error: the
    module's name). ``message`` is the first line of a failure's, error's or
    skip's message. A test reported twice (a teardown error after its call)
    keeps its worse outcome.
    """
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        owner = classname[len(module) + 1 :] if classname.startswith(module + ".") else ""
        test_id = f"{owner.replace('.', '::')}::{name}" if owner else name
        outcome, message = "passed", ""
        for tag, tag_outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            element = case.find(tag)
            if element is not None:
                outcome = tag_outcome
                text = (element.get("message") or element.text or "").strip()
                message = text.splitlines()[0] if text else ""
                break
        previous = results.get(test_id)
        if previous is None or RANK[outcome] > RANK[previous["outcome"]]:
            results[test_id] = {"outcome": outcome, "message": message}
    return results


def run_pytest(root: Path, test_file: Path, mode: str, k_expr: str | None, timeout: float, processes: int = 1) -> dict:
    """Run one test file in one mode (in ``processes`` pytest-xdist workers
    when above 1); return its outcomes, counts, wall time and status.

    ``status`` is "ok", "timeout" (the process group was killed: no outcomes)
    or "no report" (pytest ended without writing its junit XML).
    """
    with tempfile.TemporaryDirectory(prefix="conformance-") as tmp:
        junit, log = Path(tmp, "junit.xml"), Path(tmp, "pytest.log")
        env = dict(os.environ, HF_HUB_OFFLINE="1", **{COUNTS_ENV: tmp})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), str(REPO_ROOT), env.get("PYTHONPATH")]))
        if mode == "patched":
            env[PATCH_ENV] = "1"
        else:
            env.pop(PATCH_ENV, None)
        command = (
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                PLUGIN,
                "-p",
                "no:cacheprovider",
                "-q",
                f"--junitxml={junit}",
                str(test_file.relative_to(root)),
            ]
            + (["-k", k_expr] if k_expr else [])
            + (["-n", str(processes)] if processes > 1 else [])
        )
        start = time.monotonic()
        with open(log, "w") as out:
            process = subprocess.Popen(
                command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )  # its own group: a timeout kills its children too
            try:
                process.wait(timeout=timeout)
                status = "ok" if junit.is_file() else "no report"
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                status = "timeout"
        wall = time.monotonic() - start
        module = ".".join(test_file.relative_to(root).with_suffix("").parts)
        tests = parse_junit(junit, module) if status == "ok" else {}
        patched = Counter()
        for counts_file in Path(tmp).glob("patched-*.json"):
            patched.update(json.loads(counts_file.read_text()))
        tail = "" if status == "ok" else "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    counts = Counter(test["outcome"] for test in tests.values())
    return {
        "status": status,
        "wall_s": round(wall, 1),
        "exit_code": process.returncode,
        "counts": {"collected": len(tests), **{o: counts[o] for o in OUTCOMES}},
        "models_patched": dict(patched),
        "log_tail": tail,
        "tests": tests,
    }


def differences(unpatched: dict, patched: dict) -> list:
    """The tests whose outcome differs between the two runs of one file, each
    with both outcomes and messages (failures and errors only), and whether it
    is worse patched."""
    absent = {"outcome": "missing", "message": ""}
    rows = []
    for test_id in sorted(set(unpatched) | set(patched)):
        before, after = unpatched.get(test_id, absent), patched.get(test_id, absent)
        if before["outcome"] != after["outcome"]:
            rows.append(
                {
                    "test": test_id,
                    "unpatched": before["outcome"],
                    "patched": after["outcome"],
                    "worse_patched": RANK[after["outcome"]] > RANK[before["outcome"]],
                    **{
                        f"{mode}_message": run["message"] if run["outcome"] in ("failed", "error") else ""
                        for mode, run in (("unpatched", before), ("patched", after))
                    },
                }
            )
    return rows


def compare(unpatched: dict, patched: dict) -> dict:
    """The comparison of one file's two runs: the differing tests, and whether
    the file does worse patched. A run that timed out or wrote no report has
    no outcomes to compare: the file is worse patched when only the patched
    run failed that way."""
    if unpatched["status"] != "ok" or patched["status"] != "ok":
        return {
            "compared": False,
            "differences": [],
            "worse_patched": patched["status"] != "ok" and unpatched["status"] == "ok",
        }
    rows = differences(unpatched["tests"], patched["tests"])
    return {"compared": True, "differences": rows, "worse_patched": any(row["worse_patched"] for row in rows)}


def report(results: dict, missing: list) -> None:
    """Print the per-file counts and times, then the differing tests."""
    print(
        f"{'file / mode':<28} {'status':<9} {'collected':>9} {'passed':>7} {'failed':>7} {'error':>6} "
        f"{'skipped':>8} {'wall s':>8}"
    )
    for model, result in results.items():
        for mode in MODES:
            run, c = result[mode], result[mode]["counts"]
            print(
                f"{model + ' / ' + mode:<28} {run['status']:<9} {c['collected']:>9} {c['passed']:>7} "
                f"{c['failed']:>7} {c['error']:>6} {c['skipped']:>8} {run['wall_s']:>8.1f}"
            )
            for line in run["log_tail"].splitlines():  # only when it ended without a report
                print("    | " + line)
        patched = result["patched"]["models_patched"]
        print(f"    models patched: {', '.join(f'{n} x {cls}' for cls, n in patched.items()) or 'none'}")
    for model in missing:
        print(f"{model}: no test file in the checkout, skipped")
    print()
    for model, result in results.items():
        comparison = result["comparison"]
        if not comparison["compared"]:
            print(
                f"{model}: not compared (unpatched {result['unpatched']['status']}, "
                f"patched {result['patched']['status']})" + (": WORSE" if comparison["worse_patched"] else "")
            )
            continue
        rows = comparison["differences"]
        print(f"{model}: {len(rows)} test(s) differ" + (":" if rows else ""))
        for row in rows:
            mark = "WORSE" if row["worse_patched"] else "     "
            print(f"  {mark} {row['test']}: unpatched {row['unpatched']}, patched {row['patched']}")
            if row["patched_message"]:
                print(f"        patched: {row['patched_message']}")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--diffusers-tests",
        type=Path,
        required=True,
        metavar="PATH",
        help="the tests/ directory of a diffusers source checkout",
    )
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        metavar="NAMES",
        help="comma-separated <model>s of test_models_transformer_<model>.py (default: %(default)s)",
    )
    parser.add_argument("-k", dest="k_expr", metavar="EXPR", help="pytest -k expression, passed to every run")
    parser.add_argument("--out", type=Path, help="write the counts, times, outcomes and differences here as JSON")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="pytest runs at a time (each file in each mode is one run; default %(default)s)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="pytest-xdist workers of each run (needs pytest-xdist; default %(default)s: no xdist)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=1200,
        metavar="SECONDS",
        help="seconds one file may run in one mode before it is killed (default %(default)s)",
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Run the conformance check; the exit status is 1 when some test does worse patched."""
    import diffusers

    args = parse_args(argv)
    tests_dir = args.diffusers_tests.resolve()
    root = tests_dir.parent
    checkout = checkout_version(tests_dir)
    if checkout != diffusers.__version__:
        print(
            f"warning: the checkout's diffusers version is {checkout}, the installed diffusers is "
            f"{diffusers.__version__}: some tests may fail in both modes"
        )
    files, missing = {}, []
    for model in filter(None, (m.strip() for m in args.models.split(","))):
        path = tests_dir / "models" / "transformers" / f"test_models_transformer_{model}.py"
        if path.is_file():
            files[model] = path
        else:
            missing.append(model)
    jobs = [(model, mode) for model in files for mode in MODES]
    with ThreadPoolExecutor(max_workers=max(1, args.workers)) as pool:
        futures = {
            job: pool.submit(run_pytest, root, files[job[0]], job[1], args.k_expr, args.timeout, args.processes)
            for job in jobs
        }
        runs = {job: future.result() for job, future in futures.items()}
    results = {}
    for model in files:
        unpatched, patched = runs[model, "unpatched"], runs[model, "patched"]
        results[model] = {"unpatched": unpatched, "patched": patched, "comparison": compare(unpatched, patched)}
    report(results, missing)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "checkout_version": checkout,
                    "installed_diffusers": diffusers.__version__,
                    "k": args.k_expr,
                    "missing_test_files": missing,
                    "results": results,
                },
                indent=2,
            )
        )
    return 1 if any(result["comparison"]["worse_patched"] for result in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
