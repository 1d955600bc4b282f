"""q/k norms over all heads fused into the rotation, against the unfused ops, on a GPU:

    PYTHONPATH=. python bench/experiments/norm_over_heads.py OUT.json [--lengths 32760,75600] [--rounds 3]

Wan 2.1's self-attention q and k (12 heads of 128, ``[B, L, H, D]``, bf16) go
through an RMSNorm over each position's 1536 channels, then the rotation.
Providers, forward, CUDA-graph replays in alternated rounds:

- ``fused``: ``compile_ops.qk_norm_rope`` with ``[H * D]`` weights (one launch);
- ``ours_unfused``: ``compile_ops.rmsnorm`` on each flat projection, then
  ``compile_ops.rope_qk``, what the patched Wan ran before;
- ``compiled``: ``torch.compile`` of ``F.rms_norm`` on the flat projections
  and diffusers' rotation formula (``bench/peers/rope.py``).

Each row has the time, the rate of the op's own bytes (q and k read once,
written once), and the output's relative L2 distance to the fp64 reference.
"""

import torch
import torch.nn.functional as F

import compile_ops
from bench.peers.rope import rope_qk as formula_rope_qk
from bench.toolkit import experiment_parser, relative_l2, replay_rounds, start_experiment, write_rows
from compile_ops import reference

HEADS, HEAD_DIM, EPS = 12, 128, 1e-6


def wan_inputs(length: int) -> tuple:
    """``(q, k, q_w, k_w, cos, sin)``: Wan's self-attention q and k ``[1, L, 12, 128]`` bf16, their
    ``[H * D]`` norm weights, and interleaved rotation tables ``[L, D]``, seeded."""
    torch.manual_seed(0)
    q, k = (torch.randn(1, length, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q_w, k_w = ((1 + 0.1 * torch.randn(HEADS * HEAD_DIM, device="cuda")).to(torch.bfloat16) for _ in range(2))
    angles = torch.rand(length, HEAD_DIM // 2, device="cuda") * 6.3
    cos, sin = (f(angles).repeat_interleave(2, -1) for f in (torch.cos, torch.sin))
    return q, k, q_w, k_w, cos, sin


def _unfused(q, k, q_w, k_w, cos, sin):
    q, k = (compile_ops.rmsnorm(t.flatten(2), w, EPS).unflatten(2, t.shape[2:]) for t, w in ((q, q_w), (k, k_w)))
    return compile_ops.rope_qk(q, k, cos, sin, interleaved=True, seq_dim=1)


def _formula(q, k, q_w, k_w, cos, sin):
    q, k = (
        F.rms_norm(t.flatten(2), (t.shape[2] * t.shape[3],), w, EPS).unflatten(2, t.shape[2:])
        for t, w in ((q, q_w), (k, k_w))
    )
    return formula_rope_qk(q, k, cos, sin, True, 1)


PROVIDERS = {
    "fused": lambda q, k, q_w, k_w, cos, sin: compile_ops.qk_norm_rope(q, k, q_w, k_w, cos, sin, EPS, True, 1),
    "ours_unfused": _unfused,
    "compiled": torch.compile(_formula),
}


def main(argv=None) -> int:
    args, timer = start_experiment(experiment_parser(__doc__, lengths="32760,75600"), argv)
    rows = []
    for length in map(int, args.lengths.split(",")):
        inputs = wan_inputs(length)
        q, k, q_w, k_w, cos, sin = inputs
        exact = reference.rope.qk_norm_rope(*(t.double() for t in inputs[:4]), cos.double(), sin.double(), EPS, True, 1)
        errors = {}
        for name, fn in PROVIDERS.items():
            with torch.no_grad():
                got = fn(*inputs)
            errors[name] = max(relative_l2(g, e) for g, e in zip(got, exact))
        moved = 4 * q.numel() * q.element_size()  # q and k read and written once
        for rnd, name, ms in replay_rounds(PROVIDERS, inputs, args.rounds, timer):
            row = dict(
                shape=[1, length, HEADS, HEAD_DIM],
                provider=name,
                round=rnd,
                ms=ms,
                GBps=moved / ms / 1e6,
                rel_l2_to_fp64=errors[name],
            )
            rows.append(row)
            print(f"L={length} round {rnd} {name:14s} {ms:.4f} ms {row['GBps']:7.0f} GB/s err {errors[name]:.2e}")
        write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
