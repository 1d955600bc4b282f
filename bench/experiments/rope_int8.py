"""The quantizing rotation (``fused.qk_rope_int8``) against the 16-bit rotation, on a GPU:

    PYTHONPATH=. python bench/experiments/rope_int8.py OUT.json [--shapes 4608x24n,16384x40] [--rounds 3]

Shapes are tokens x heads of 128 channels, q and k ``[1, L, H, 128]`` bf16
with interleaved full tables ``[L, 128]``; suffix ``n``: with q/k RMSNorms
per head (``qk_norm_rope``, Flux's), ``h``: over the heads (Wan's), none:
the plain rotation (``rope_qk``); by default those of docs/notes/attention-8bit.md's
table, 4608x24n, 8192x24n, 16384x40 and 32760x12. Providers, forward,
CUDA-graph replays in alternated rounds:

- ``rotation_16bit``: the 16-bit op alone;
- ``fused``: the same op with ``quantize=True``: q and k in INT8 with their
  scales (``Int8QK``), the rotation's two passes and the sums' reduction;
- ``unfused_compiled``: ``torch.compile`` of the 16-bit op then the
  specification's quantization (``reference.attention.smooth_quantize_qk``);
- ``unfused_eager_k``: the 16-bit op then ``quantize_8bit``'s Triton passes
  over k, what 8-bit attention runs given 16-bit q and k (its kernel rounds
  q as it loads it).

Each shape's ``fused`` row also says how its operands compare with the
16-bit op's output through ``smooth_quantize_qk`` on this GPU: q's INT8
values and k's (which may move by one: k's mean is summed in another order),
and the largest relative difference of the scales.
"""

import torch

import compile_ops
from bench.toolkit import experiment_parser, replay_rounds, start_experiment, write_rows
from compile_ops.ops import attention_8bit
from compile_ops.reference.attention import smooth_quantize_qk

HEAD_DIM, EPS = 128, 1e-6
SHAPES = "4608x24n,8192x24n,16384x40,32760x12"


def _parse(shape: str) -> tuple:
    """``(length, heads, norm)`` of ``LxH[n|h]``; norm ``"head"``, ``"heads"`` or None."""
    norm = {"n": "head", "h": "heads"}.get(shape[-1])
    length, heads = shape.rstrip("nh").split("x")
    return int(length), int(heads), norm


def _inputs(length: int, heads: int, norm) -> tuple:
    """``(q, k, q_weight, k_weight, cos, sin)``, seeded; keys offset per channel
    (what the smoothing removes); weights None without a norm."""
    torch.manual_seed(0)
    q = torch.randn(1, length, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = (torch.randn(1, length, heads, HEAD_DIM, device="cuda") + torch.linspace(-3, 3, HEAD_DIM, device="cuda")).to(
        torch.bfloat16
    )
    width = heads * HEAD_DIM if norm == "heads" else HEAD_DIM
    weights = [None, None] if norm is None else [torch.rand(width, device="cuda") + 0.5 for _ in range(2)]
    angles = torch.rand(length, HEAD_DIM // 2, device="cuda") * 6.3
    cos, sin = (f(angles).repeat_interleave(2, -1) for f in (torch.cos, torch.sin))
    return q, k, *weights, cos, sin


def _rotation(q, k, q_w, k_w, cos, sin, quantize=False):
    if q_w is None:
        return compile_ops.rope_qk(q, k, cos, sin, True, 1, quantize=quantize)
    return compile_ops.qk_norm_rope(q, k, q_w, k_w, cos, sin, EPS, True, 1, quantize=quantize)


def _unfused_eager_k(*args):
    q, k = _rotation(*args)
    return q, attention_8bit.quantize_8bit(k, None, 1)


PROVIDERS = {
    "rotation_16bit": _rotation,
    "fused": lambda *args: _rotation(*args, quantize=True),
    "unfused_compiled": torch.compile(lambda *args: smooth_quantize_qk(*_rotation(*args), 1)),
    "unfused_eager_k": _unfused_eager_k,
}


def _agreement(inputs: tuple) -> dict:
    """How the fused operands differ from the 16-bit op's through ``smooth_quantize_qk``."""
    with torch.no_grad():
        got = tuple(_rotation(*inputs, quantize=True))
        want = smooth_quantize_qk(*_rotation(*inputs), 1)
    (q8, q_scale, k8, k_scale), (q8_want, q_scale_want, k8_want, k_scale_want) = got, want
    return dict(
        q8_mismatch_fraction=(q8 != q8_want).float().mean().item(),
        q8_max_diff=(q8.int() - q8_want.int()).abs().max().item(),
        k8_mismatch_fraction=(k8 != k8_want).float().mean().item(),
        k8_max_diff=(k8.int() - k8_want.int()).abs().max().item(),
        q_scale_max_rel_diff=((q_scale - q_scale_want).abs() / q_scale_want).max().item(),
        k_scale_max_rel_diff=((k_scale - k_scale_want).abs() / k_scale_want).max().item(),
    )


def main(argv=None) -> int:
    args, timer = start_experiment(experiment_parser(__doc__, shapes=SHAPES), argv)
    rows = []
    for shape in args.shapes.split(","):
        length, heads, norm = _parse(shape)
        inputs = _inputs(length, heads, norm)
        agreement = _agreement(inputs)
        print(f"L={length} H={heads} norm={norm}: fused against the specification {agreement}", flush=True)
        for rnd, name, ms in replay_rounds(PROVIDERS, inputs, args.rounds, timer):
            row = dict(L=length, H=heads, D=HEAD_DIM, norm=norm, case=name, round=rnd, ms=ms)
            if name == "fused":
                row.update(agreement)
            rows.append(row)
            print(f"L={length} H={heads} norm={norm} r{rnd} {name:18s} {ms:.4f} ms", flush=True)
        write_rows(args.out, rows)  # after each shape: a timed-out run keeps what it measured
        del inputs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
