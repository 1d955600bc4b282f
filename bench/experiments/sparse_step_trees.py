"""The patched Wan sparse step alone, from whichever checkout is the working directory, for A/Bs between trees:

    cd TREE && PYTHONPATH=. python /path/to/sparse_step_trees.py OUT.json CASE MODE LABEL

``bench/runners/sparse_e2e.py``'s CASE (``wan_step``, ``wan_step_720p``) and
MODE (a key of its MODES), without its native run: the model patched with the
sliding-tile preset, compiled regionally, three ``do_bench`` medians, the
kernels by ``torch.profiler``, and the eager and compiled steps' relative L2
distance to the unpatched bf16 step. Rows are appended to OUT.json with
LABEL (which tree), so two trees timed in one machine start share a file:
``git archive REV | tar -x -C DIR`` gives the other tree.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())  # the tree under test, before this file's own
# A cache shared by two trees once handed the second tree the first one's compiled graph (the key seems to see
# the fused ops' schemas, not their bodies): each LABEL compiles into a directory of its own.
if len(sys.argv) > 4:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join("/tmp", f"inductor-{sys.argv[4]}"))
import torch  # noqa: E402
import triton  # noqa: E402

import compile_ops  # noqa: E402
from bench.runners import sparse_e2e  # noqa: E402
from bench.runners.diffusers_timing import compiled, profiled, repeated  # noqa: E402


def main(argv=None) -> int:
    out, case, mode, label = (argv or sys.argv[1:])[:4]
    print("compile_ops from", compile_ops.__file__, flush=True)
    model, inputs = sparse_e2e._build_case(case)
    with torch.no_grad():
        exact = model(**inputs).sample
    compile_ops.patch(model, attention=compile_ops.SlidingTile(**sparse_e2e.PRESET), **sparse_e2e.MODES[mode])
    with torch.no_grad():
        eager = model(**inputs).sample
    module = compiled(model, "regional")
    with torch.no_grad():
        start = time.perf_counter()
        module(**inputs)
        first = time.perf_counter() - start
        row = repeated(lambda: module(**inputs).sample, 2000.0, 3)
        profiled(row, lambda: module(**inputs).sample, True)
        got = module(**inputs).sample
    row.update(
        case=case,
        provider=f"{mode}_compiled",
        tree=label,
        first_call_s=first,
        step_rel_l2=sparse_e2e.relative_l2(eager, exact),
        compiled_rel_l2=sparse_e2e.relative_l2(got, exact),
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
    )
    rows = []
    if os.path.exists(out):
        with open(out) as f:
            rows = json.load(f)["rows"]
    with open(out, "w") as f:
        json.dump({"rows": rows + [row]}, f, indent=1)
    top = {name: round(ms, 2) for name, ms, _ in row["kernels"]["top"][:12]}
    print(label, case, mode, f"{row['ms']:.2f} ms ({row['ms_min']:.2f}-{row['ms_max']:.2f})", top, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
