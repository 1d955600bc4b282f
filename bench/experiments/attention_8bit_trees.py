"""The 8-bit attention kernel alone, from whichever checkout is the working directory, for A/Bs between trees:

    cd TREE && PYTHONPATH=. python /path/to/attention_8bit_trees.py OUT.json LABEL [ROUNDS]

These calls, each as its model makes it, timed by the profiler (the attention kernel's
time, five calls, ``ROUNDS`` rounds):

- Wan 2.1's sliding-tile lists at 480p (11.5% of blocks) and 720p (4.7%), q, k and v in
  token order with the layout's tile order as ``token_order``: the 16-bit block-sparse call
  (``exact``, the sm_90 core) and the 8-bit call Wan's self-attention makes before an FP8
  ``to_out`` (``int8_fp8 rows``: on sm_90 ``attn8_fwd_sm90_kernel``, before it the capped launch);
- Flux's dense shape, 1x24x4608x128, ``int8_fp8`` with q rounded in the kernel, and with q and
  k given in int8 (``attention_qk8``, as after ``fused.qk_rope_int8``), and the latter at Wan
  2.1 480p's dense 1x12x32760x128.

Each row has a digest of the output's bytes, so two trees that should compute the same
bits can be checked. Rows are appended to OUT.json with LABEL (which tree):
``git archive REV | tar -x -C DIR`` gives the other tree.
"""

import functools
import hashlib
import json
import os
import sys

sys.path.insert(0, os.getcwd())  # the tree under test, before this file's own
import torch  # noqa: E402
import triton  # noqa: E402

import compile_ops  # noqa: E402
from bench.runners.block_sparse import WAN_HEADS, as_models_call, sliding_tile_inputs  # noqa: E402
from bench.toolkit import kernel_profile  # noqa: E402
from compile_ops.reference.attention import smooth_quantize_qk  # noqa: E402


def _calls() -> list:
    """``[(shape name, provider, fn)]``."""
    calls = []
    for grid in ("wan_480p", "wan_720p"):
        layout, _, (q, k, v) = sliding_tile_inputs(grid, WAN_HEADS, "cuda")
        for provider in ("exact", "int8_fp8 rows"):
            calls.append((grid, provider, functools.partial(as_models_call(layout, provider), q, k, v)))
    generator = torch.Generator(device="cuda").manual_seed(0)
    for name, heads, length in (("flux_4608", 24, 4608), ("wan_480p_dense", 12, 32760)):
        q, k, v = (
            torch.randn(1, heads, length, 128, device="cuda", generator=generator, dtype=torch.bfloat16) for _ in "qkv"
        )
        if name == "flux_4608":
            calls.append((name, "int8_fp8", functools.partial(compile_ops.attention, q, k, v, precision="int8_fp8")))
        q8, q_scale, k8, k_scale = smooth_quantize_qk(q, k, 2)
        qk8 = functools.partial(torch.ops.fused.attention_qk8, q8, q_scale, k8, k_scale, v, 128**-0.5, False, 2, None)
        calls.append((name, "int8_fp8 q8", functools.partial(qk8, True)))
    return calls


def main(argv=None) -> int:
    args = argv or sys.argv[1:]
    out, label = args[:2]
    rounds = int(args[2]) if len(args) > 2 else 3
    print("compile_ops from", compile_ops.__file__, flush=True)
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    results = json.load(open(out)) if os.path.exists(out) else {"env": env, "rows": []}
    with torch.no_grad():
        calls = _calls()
        for rnd in range(rounds):
            for shape, provider, fn in calls:
                got = fn()
                first = got[0] if isinstance(got, tuple) else got
                digest = hashlib.sha256(first.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]
                profile = kernel_profile(fn, calls=5, top=1)
                kernel, ms = profile["top"][0][:2]
                row = dict(tree=label, shape=shape, provider=provider, round=rnd, kernel=kernel, kernel_ms=ms)
                results["rows"].append(dict(row, digest=digest))
                print(f"{label} {shape} r{rnd} {provider:14s} {ms:.4f} {kernel[:40]} {digest}", flush=True)
            with open(out, "w") as f:
                json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
