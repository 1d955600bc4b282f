"""The capped 8-bit forward through ``torch.compile``, on an sm_90 GPU:

    PYTHONPATH=. python bench/experiments/attention_8bit_cap_compiled.py

Why: Inductor's launch configs drop ``maxnreg``, so traced calls of the
``int8_fp8`` forward reach it through the opaque
``fused_gluon.attention_forward_capped_``. For Wan's 480p sliding-tile call
(token order), its FP8-rows form and a dense 1x4608x12x128 call, each
compiled with ``fullgraph=True``: whether Inductor's code calls the op, and
whether the output equals the eager call's bit for bit. Exits 1 otherwise.
"""

import sys

import torch
from torch._inductor.utils import run_and_get_code

import compile_ops
from bench.runners.block_sparse import WAN_HEADS, as_models_call, sliding_tile_inputs


def main() -> int:
    layout, _, (q, k, v) = sliding_tile_inputs("wan_480p", WAN_HEADS, "cuda")
    sparse, rows = as_models_call(layout, "int8_fp8"), as_models_call(layout, "int8_fp8 rows")

    def dense(q, k, v):
        return compile_ops.attention(q[:, :4608], k[:, :4608], v[:, :4608], seq_dim=1, precision="int8_fp8")

    ok = True
    with torch.no_grad():
        for name, fn in (("sparse", sparse), ("rows", rows), ("dense", dense)):
            eager = fn(q, k, v)
            got, code = run_and_get_code(torch.compile(fn, fullgraph=True), q, k, v)
            eager, got = (t if isinstance(t, torch.Tensor) else t[0] for t in (eager, got))
            through_op = "attention_forward_capped_" in "\n".join(code)
            same = torch.equal(eager.view(torch.uint8), got.view(torch.uint8))
            print(f"{name}: compiled through the capped op: {through_op}, bit-equal to eager: {same}", flush=True)
            ok &= through_op and same
            torch._dynamo.reset()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
