"""Causal attention's program order, swept by group size on a GPU:

    PYTHONPATH=. python bench/experiments/causal_order.py OUT.json [--groups 0,1,3,6,12,all]
        [--launch-order-passes dkdv] [--rounds 2]

Each group size is forced on the causal launches in place of
``ops.attention_tiles.causal_order``'s rule: 0 is the launch order (no
``HEAVY_FIRST``), N deals the tiles out over groups of N (batch, head) rows
(``kernels.attention_common.program_rank``), ``all`` over every row.
``--launch-order-passes`` keeps the named passes (``forward``, ``dkdv``,
``dq``) in launch order whatever the group, to time one pass's order against
the others'. Per shape: SDPA's cuDNN backend, then every group, ``--rounds``
times alternated, forward and forward+backward as CUDA-graph replays of
``compile_ops.attention`` called eagerly (``bench.runners.attention.measure``), and
each group's forward output compared with the first group's, bit for bit.

The sweep behind ``ops.attention_tiles.causal_order`` (docs/notes/attention-forward.md,
"Causal programs, longest first"; ``bench/results/attention-causal-order-sweep-h100.json``)
ran this schedule.
"""

import argparse
import sys

import torch

import compile_ops
from bench.runners.attention import measure, providers
from bench.toolkit import make_timer, warm_up_gpu, write_rows
from compile_ops._library import clear_launch_plans
from compile_ops.ops import attention as attention_ops
from compile_ops.ops import attention_launch, attention_sm90, attention_tiles

SHAPES = ((1, 24, 4608, 128), (1, 12, 32760, 128), (1, 40, 16384, 128), (2, 24, 4096, 64))
#: The modules whose launches look ``causal_order`` up: the Triton kernels' and the sm_90 kernels'.
ORDERED_LAUNCHES = (attention_launch, attention_sm90)


class ForcedOrder:
    """A stand-in for ``causal_order``: ``group`` rows per group (0: launch
    order; None: every row) except in ``launch_order_passes``. The pass is
    told apart by its shared tensor (q for dk/dv, k for the forward and dq)
    and by whether a backward is running (``launch_backward`` is wrapped)."""

    def __init__(self, group, launch_order_passes, q):
        self.group, self.skip, self.q = group, set(launch_order_passes), q
        self.in_backward = False

    def __call__(self, shared, length, rows):
        name = "dkdv" if shared.data_ptr() == self.q.data_ptr() else "dq" if self.in_backward else "forward"
        if self.group == 0 or name in self.skip:
            return attention_tiles.LAUNCH_ORDER
        return dict(HEAVY_FIRST=True), rows if self.group is None else min(self.group, rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--groups", default="0,1,3,6,12,all")
    p.add_argument("--launch-order-passes", default="", help="comma-separated: forward, dkdv, dq")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    groups = [None if g == "all" else int(g) for g in args.groups.split(",")]
    skip = [s for s in args.launch_order_passes.split(",") if s]
    timer = make_timer(False)
    warm_up_gpu(6)
    cudnn, fused = providers(True)["sdpa_cudnn"], lambda q, k, v: compile_ops.attention(q, k, v, None, True)
    # fused.attention's backward looks launch_backward up in ops.attention: wrapped there.
    rule, backward = attention_tiles.causal_order, attention_ops.launch_backward
    rows = []
    try:
        for b, h, length, d in SHAPES:
            q, k, v = (
                torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
            )
            flops = 2 * b * h * length * length * d  # causal: half of 4 B H L^2 D
            reference = None
            for rnd in range(args.rounds):
                for group in ["cudnn"] + groups:
                    if group == "cudnn":
                        fn = cudnn
                    else:
                        forced = ForcedOrder(group, skip, q)

                        def wrapped_backward(*a, forced=forced, **kw):
                            forced.in_backward = True
                            try:
                                return backward(*a, **kw)
                            finally:
                                forced.in_backward = False

                        for module in ORDERED_LAUNCHES:
                            module.causal_order = forced
                        attention_ops.launch_backward = wrapped_backward
                        clear_launch_plans()
                        fn = fused
                        with torch.no_grad():
                            out = fn(q, k, v)
                        reference = out if reference is None else reference
                        if not torch.equal(out, reference):
                            raise AssertionError(f"group {group}: output differs from the first group's")
                    r = measure(fn, q, k, v, timer)
                    row = dict(
                        shape=[b, h, length, d],
                        group="all" if group is None else group,
                        round=rnd,
                        launch_order_passes=skip,
                        fwd_TFLOPs=flops / r["fwd_ms"] / 1e9,
                        fwdbwd_TFLOPs=3.5 * flops / r["fwdbwd_ms"] / 1e9,
                        **r,
                    )
                    print(
                        f"{b}x{h}x{length}x{d} {row['group']!s:>6} r{rnd} fwd {row['fwd_TFLOPs']:.0f} "
                        f"fwd+bwd {row['fwdbwd_TFLOPs']:.0f}",
                        flush=True,
                    )
                    rows.append(row)
            del q, k, v
            torch.cuda.empty_cache()
    finally:
        for module in ORDERED_LAUNCHES:
            module.causal_order = rule
        attention_ops.launch_backward = backward
        clear_launch_plans()
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
