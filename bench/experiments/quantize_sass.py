"""SASS instructions a value of ``quantize_fp8_rows_kernel`` for sm_90, counted without a GPU.

    PYTHONPATH=. python bench/experiments/quantize_sass.py OUT.json [--tree DIR]

Each case compiles the kernel as the launcher runs it at that shape (``ops.fp8``'s schedule for
the rows, unit column strides and 16-divisible sizes specialized as triton's JIT specializes
them), disassembles it with triton's bundled ``cuobjdump`` and divides the instructions by the
values a thread holds. A thread has about 30 issue slots a value at the copy's rate, so the
count says whether a quantization is bound by issue (docs/notes/fp8.md, "The activation's
instruction count"). ``--tree DIR``: count the kernel of another checkout (``DIR/compile_ops``),
such as ``git archive`` of an earlier commit.
"""

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(__file__, "..", "..", ".."))

#: ``name: (activation, head width, width)``: the standalone quantizations of bench/sweeps/fp8.py.
CASES = {
    "flux_mlp": ("gelu_tanh", 0, 12288),
    "flux_single": ("gelu_tanh", 3072, 12288),
    "wan_mlp": ("gelu_tanh", 0, 8960),
    "flux_attention_out": ("none", 0, 3072),
}


def _compiled(activation: str, k_head: int, k: int):
    """``(compiled kernel, values a thread holds, schedule)`` of one case, for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from compile_ops.kernels.fp8 import quantize_fp8_rows_kernel
    from compile_ops.kernels.glu import ACTIVATION_CODES
    from compile_ops.ops import fp8

    schedule = fp8.SCHEDULES.get((activation, k_head, k)) or fp8.default_schedule(activation, k_head, k)
    block_m, block_n, warps = schedule
    chunks, head_chunks = triton.cdiv(k, block_n), triton.cdiv(k_head, block_n)
    pointer = {"X": "*bf16", "Q": "*fp8e4nv", "S": "*fp32", "HEAD": "*bf16"}
    ints = ("n_rows", "K", "stride_row", "K_HEAD", "stride_head_row")
    constants = {
        "stride_col": 1,
        "stride_head_col": 1,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "LOOPED": False,
        "ACT": ACTIVATION_CODES.get(activation, -1),
        "HAS_HEAD": k_head > 0,
        "CHUNKS": chunks,
        "HEAD_CHUNKS": head_chunks,
    }
    names = ["X", "Q", "S", "n_rows", "K", "stride_row", "stride_col", "HEAD", "K_HEAD", "stride_head_row"]
    names += ["stride_head_col", "BLOCK_M", "BLOCK_N", "LOOPED", "ACT", "HAS_HEAD", "CHUNKS", "HEAD_CHUNKS"]
    signature = {n: pointer.get(n) or ("i32" if n in ints else "constexpr") for n in names}
    divisible = ("X", "Q", "S", "HEAD", "K", "stride_row", "K_HEAD", "stride_head_row")  # n_rows: any
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    source = ASTSource(fn=quantize_fp8_rows_kernel, signature=signature, constexprs=constants, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return kernel, block_m * block_n * (chunks + head_chunks) / (32 * warps), schedule


def sass_opcodes(cubin: bytes) -> collections.Counter:
    """``{opcode: count}`` of a cubin's SASS (``cuobjdump -sass``, triton's own copy)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        listing = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    opcodes = collections.Counter()
    for line in listing.splitlines():
        match = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if match:
            opcodes[match.group(1)] += 1
    return opcodes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSON to write")
    parser.add_argument("--tree", default=ROOT, help="the checkout whose compile_ops is compiled")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.tree))
    rows = []
    for name, (activation, k_head, k) in CASES.items():
        kernel, per_thread, schedule = _compiled(activation, k_head, k)
        opcodes = sass_opcodes(kernel.asm["cubin"])
        total = sum(opcodes.values())
        rows.append(
            dict(
                case=name,
                schedule=list(schedule),
                instructions=total,
                values_per_thread=per_thread,
                per_value=total / per_thread,
                mufu=opcodes["MUFU"],
                top=opcodes.most_common(12),
            )
        )
        print(f"{name:20s} {tuple(schedule)}  {total} instructions, {total / per_thread:.1f} a value", flush=True)
    import triton

    results = dict(
        tree=os.path.relpath(os.path.abspath(args.tree), ROOT), triton=triton.__version__, target="sm_90", rows=rows
    )
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
