"""MoE routing forward, the committed kernels against other versions of them, side by
side on a GPU (CUDA-graph replays of ``_launch_route``, the op's launches):

    PYTHONPATH=. python bench/experiments/moe_fusion.py OUT.json [LABEL=KERNELS.py,OPS.py ...]

Each other version is a pair of files (``git show REV:compile_ops/kernels/moe.py``
and ``git show REV:compile_ops/ops/moe.py``): its ``_launch_route`` is run
against its own kernels. Shapes: the registry's moe_route (4096 x 4096,
E = 64, k = 2) and moe_route_hidream (4096 x 2560, E = 4, k = 2), bf16; every
version's outputs are compared with the committed one's, bit for bit.
Used for the fusion of the routing's launches (docs/notes/moe.md,
"MoE routing in fewer launches: measured no faster"): the two-launch version
is commit 07bc05a (``two_launches=K.py,O.py`` from ``git show 07bc05a:...``),
``bench/results/moe-fusion-two-launches-h100.json`` its run (its ``committed``
row is 07bc05a, ``three_launches`` the committed kernels).
"""

import importlib.util
import sys

import torch

from bench.toolkit import graph_replay_time, make_timer, write_rows
from compile_ops import meta
from compile_ops.ops import moe as moe_ops


def version_launch(label, kernels_path, ops_path):
    """``_launch_route`` of another version, executed against its kernels."""
    spec = importlib.util.spec_from_file_location(f"moe_kernels_{label}", kernels_path)
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    source = open(ops_path).read()
    start = source.index("@dataclass(frozen=True)")
    end = source.index("# ---------------------------------------------------------------- ops")
    namespace = {"__name__": f"moe_ops_{label}"}
    exec(
        "from dataclasses import dataclass\nimport torch, triton\nfrom torch import Tensor\n"
        "from compile_ops._library import launcher\n"
        "from compile_ops.ops._launch import TRITON_DTYPES, acc_dtype, dot_precision\n",
        namespace,
    )
    namespace.update({k: getattr(kernels, k) for k in dir(kernels) if k.endswith("_kernel")})
    exec(source[start:end], namespace)
    return namespace["_launch_route"]


def main(out_path, *versions):
    launchers = {"committed": moe_ops._launch_route}
    for v in versions:
        label, paths = v.split("=")
        launchers[label] = version_launch(label, *paths.split(","))
    timer = make_timer(quick=False)
    rows = []
    for op, (t, h, e) in {"moe_route": (4096, 4096, 64), "moe_route_hidream": (4096, 2560, 4)}.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(e, h, device="cuda", dtype=torch.bfloat16, generator=g) * h**-0.5
        outs = meta.moe.moe_route(x, w, 2, True)
        committed = None
        for label, launch_route in launchers.items():

            def launch(launch_route=launch_route):
                launch_route(x, w, 2, True, outs)

            for o in outs:
                o.fill_(-1)
            launch()
            torch.cuda.synchronize()
            got = [o.clone() for o in outs]
            committed = committed or got
            same = all(torch.equal(a, b) for a, b in zip(got, committed))
            us = graph_replay_time(launch, timer) * 1000
            rows.append({"op": op, "version": label, "us": us, "same_outputs_as_committed": same})
            print(f"{op:18s} {label:15s} {us:7.1f} us  same outputs as committed: {same}", flush=True)
    write_rows(out_path, rows)


if __name__ == "__main__":
    main(*sys.argv[1:])
