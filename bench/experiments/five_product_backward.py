"""The five-product backward's launch options beside cuDNN, flash and the deterministic passes:

    PYTHONPATH=. python bench/experiments/five_product_backward.py OUT.json [--shapes BxHxLxD[c],...]
        [--variants default,unsplit,stages=4,step=64]
        [--deterministic-variants default,triton_dkdv,unpersistent,step=64] [--rounds 3]

Forward+backward steps of ``compile_ops.attention`` with the five-product
backward (``set_attention_backward(deterministic=False)``) in each of
``--variants``: ``default`` (as it launches), ``unsplit`` (no split of the
last round, ``ops.attention_sm90.backward_tail_split``), ``stages=N`` (an
N-deep q/dO ring, ``SM90_BACKWARD_STAGES``) and ``step=N`` (N-query steps
at the shape's head dim, ``SM90_BACKWARD_STEPS``); the deterministic
backward in each of ``--deterministic-variants`` (``default``;
``triton_dkdv``: its dk/dv pass in ``triton.language``, not the sm_90
kernel without dQ, ``SM90_DKDV``; ``unpersistent``: that kernel one
program per key tile, ``SM90_DKDV_PERSISTENT``; ``step=N`` as above);
and SDPA's cuDNN and flash backends. Per shape (a trailing ``c``:
causal), ``--rounds`` times alternated, CUDA-graph replays after a second
of calls.

Why: at D = 64 a q/dO stage takes 16 KB of shared memory where D = 128
takes 32, so a deeper ring fits; and a launch whose items leave a last
round part-empty (1x24x4608: 864 items, 6 rounds of 132 and 72) can split
those items along the queries.
"""

import json

import torch

import compile_ops
from bench.runners.attention import providers
from bench.toolkit import experiment_parser, graph_replay_time, keep_busy, start_experiment, write_rows
from compile_ops.ops import attention_sm90

SHAPES = "1x24x4608x128,1x24x4592x128,2x24x4096x64,1x24x4429x64,1x12x32760x128,1x40x16384x128"


#: The launch options as ``compile_ops`` sets them, which ``default`` restores.
DEFAULTS = (
    attention_sm90.SM90_BACKWARD_STAGES,
    attention_sm90.TAIL_SPLIT_GAIN,
    attention_sm90.SM90_DKDV,
    dict(attention_sm90.SM90_BACKWARD_STEPS),
    attention_sm90.SM90_DKDV_PERSISTENT,
)


def configure(variant: str, d: int = 128) -> None:
    """Set the five-product backward's launch options for ``variant`` (see the module docstring) at head dim ``d``."""
    stages, gain, dkdv, steps, persistent = DEFAULTS
    attention_sm90.SM90_DKDV_PERSISTENT = persistent and variant != "unpersistent"
    attention_sm90.SM90_BACKWARD_STEPS.update(steps)
    if variant.startswith("step="):
        attention_sm90.SM90_BACKWARD_STEPS[d] = int(variant.split("=")[1])
    attention_sm90.SM90_BACKWARD_STAGES = int(variant.split("=")[1]) if variant.startswith("stages=") else stages
    attention_sm90.TAIL_SPLIT_GAIN = 1.0 if variant == "unsplit" else gain  # a gain of 100%: never split
    attention_sm90.SM90_DKDV = dkdv and variant != "triton_dkdv"
    attention_sm90.backward_tail_split.cache_clear()


def main(argv=None) -> int:
    p = experiment_parser(__doc__, shapes=SHAPES, variants="default,unsplit")
    p.add_argument(
        "--deterministic-variants",
        default="default",
        help="the deterministic backward's: default, triton_dkdv (its dk/dv pass in triton.language), "
        "unpersistent, step=N",
    )
    args, timer = start_experiment(p, argv)
    rows = []
    for text in args.shapes.split(","):
        causal = text.endswith("c")
        b, h, length, d = (int(x) for x in text.rstrip("c").split("x"))
        chosen = providers(causal)
        q, k, v = (
            torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
        )
        grad = torch.randn_like(q)
        flops = 3.5 * 4 * b * h * length**2 * d * (0.5 if causal else 1.0)
        runs = [("sdpa_cudnn", chosen["sdpa_cudnn"], None, True), ("sdpa_flash", chosen["sdpa_flash"], None, True)]
        runs += [
            (f"deterministic_{variant}", chosen["fused_eager"], variant, True)
            for variant in args.deterministic_variants.split(",")
            if variant
        ]
        runs += [
            (f"five_product_{variant}", chosen["fused_eager"], variant, False)
            for variant in args.variants.split(",")
            if variant
        ]
        for rnd in range(args.rounds):
            for name, fn, variant, deterministic in runs:

                def step(fn=fn):
                    fn(q, k, v).backward(grad)
                    q.grad = k.grad = v.grad = None

                compile_ops.set_attention_backward(deterministic=deterministic)  # clears the launch plans
                configure(variant or "default", d)
                try:
                    keep_busy(step, 1.0)
                    ms = graph_replay_time(step, timer)
                finally:
                    compile_ops.set_attention_backward(deterministic=True)
                    configure("default")
                rows.append(
                    dict(
                        shape=[b, h, length, d],
                        causal=causal,
                        round=rnd,
                        provider=name,
                        fwdbwd_ms=ms,
                        fwdbwd_TFLOPs=flops / ms / 1e9,
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
        del q, k, v, grad
        torch.cuda.empty_cache()
        write_rows(args.out, rows)  # after every shape: a run stopped midway keeps what it measured
    assert (
        attention_sm90.SM90_BACKWARD_STAGES,
        attention_sm90.TAIL_SPLIT_GAIN,
        attention_sm90.SM90_DKDV,
        attention_sm90.SM90_BACKWARD_STEPS,
        attention_sm90.SM90_DKDV_PERSISTENT,
    ) == DEFAULTS, "configure drifted"
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
