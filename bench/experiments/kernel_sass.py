"""SASS instructions a value of compile_ops' kernels for sm_90, counted without a GPU.

    PYTHONPATH=. python bench/experiments/kernel_sass.py OUT.json [--tree DIR] [--parts quantize,modulate,attention]

Each launch is traced from its op's body on fake CUDA tensors, compiled for sm_90 with unit
column strides and 16-divisible sizes specialized, as triton's JIT specializes them,
disassembled with triton's bundled ``cuobjdump``, and its instructions divided by the values a
thread holds a step. A thread has about 30 issue slots a value at the copy's rate, so the count
says whether a row kernel is bound by issue.

- ``quantize``: ``quantize_fp8_rows_kernel`` at each standalone quantization of
  bench/sweeps/fp8.py, under the launcher's schedule (docs/notes/fp8.md, "The activation's
  instruction count").
- ``modulate``: ``modulate_fwd_kernel`` in the FP8 output mode (``norm_modulate_fp8``,
  LayerNorm without affine, Wan's 1536 and Flux's 3072 columns), under the shipped forward
  config and one to four warps a row, the row padded to a power of two or held as
  ``held_chunks`` blocks; ``per_column`` divides by the row's real columns, not the
  padded ones (docs/notes/modulate.md).
- ``attention``: ``attn_fwd_kernel`` of ``attention_int8_fp8`` at 1x24x4608x128 (off a GPU
  the trace takes the loads without TMA; the softmax is the same), its key loop's
  instructions a thread a 128-key tile by opcode (docs/notes/attention-8bit.md).

``--tree DIR``: count the kernels of another checkout (``DIR/compile_ops``), such as ``git
archive`` of an earlier commit.
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

#: ``quantize``: ``name: (activation, head width, width)``, the standalone quantizations of bench/sweeps/fp8.py.
QUANTIZE_CASES = {
    "flux_mlp": ("gelu_tanh", 0, 12288),
    "flux_single": ("gelu_tanh", 3072, 12288),
    "wan_mlp": ("gelu_tanh", 0, 8960),
    "flux_attention_out": ("none", 0, 3072),
}


#: ``modulate``: ``name: (tokens, width)`` of ``norm_modulate_fp8``, and the ``(rows, warps)`` a
#: step each is compiled under besides the shipped forward config.
MODULATE_CASES = {"wan_1536": (32760, 1536), "flux_3072": (4096, 3072)}
MODULATE_CONFIGS = ((1, 1), (1, 2), (2, 2), (2, 4), (4, 4))


def sass_instructions(cubin: bytes) -> list:
    """``[(address, opcode with its modifiers, operands)]`` of a cubin's SASS
    (``cuobjdump -sass``, triton's own copy), predicates dropped."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        listing = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    instructions = []
    for line in listing.splitlines():
        match = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", line)
        if match:
            instructions.append((int(match.group(1), 16), match.group(2), match.group(3).strip()))
    return instructions


def sass_opcodes(cubin: bytes) -> collections.Counter:
    """``{opcode: count}`` of a cubin's SASS, modifiers dropped."""
    return collections.Counter(op.split(".")[0] for _, op, _ in sass_instructions(cubin))


def loop_body(instructions: list, marker: str) -> collections.Counter:
    """``{opcode with modifiers: count}`` of the loop (a backward branch and its
    target) holding the most ``marker`` instructions."""
    loops = []
    for address, op, operands in instructions:
        target = re.search(r"0x([0-9a-f]+)", operands) if op == "BRA" else None
        if target and int(target.group(1), 16) < address:
            body = [op2 for a, op2, _ in instructions if int(target.group(1), 16) <= a <= address]
            loops.append(collections.Counter(body))
    return max(loops, key=lambda body: body[marker])


def _traced_launches(body, inputs) -> dict:
    """``{kernel name: (kernel, signature, constants, attrs)}`` of the Triton launches of ``body``
    on fake CUDA tensors of ``inputs`` (``[(shape, dtype)]``): ints of 1 as constants and
    16-divisible ints and pointers marked so, as triton's JIT specializes a launch."""
    import torch
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode(allow_non_fake_inputs=True):
        graph = make_fx(body)(*(torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in inputs))
    launches = {}
    for node in (n for n in graph.graph.nodes if n.target is torch.ops.higher_order.triton_kernel_wrapper_mutation):
        kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        launches[_name(kernel)] = _specialized(kernel, node)
    return launches


def _name(kernel) -> str:
    import triton

    return (kernel if isinstance(kernel, triton.runtime.JITFunction) else kernel.fn).fn.__name__


def _specialized(kernel, node) -> tuple:
    """``(kernel, signature, constants, attrs)`` of one traced launch (:func:`_traced_launches`)."""
    import torch
    import triton
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    pointer = {
        torch.bfloat16: "*bf16",
        torch.float32: "*fp32",
        torch.float8_e4m3fn: "*fp8e4nv",
        torch.int8: "*i8",
        torch.int32: "*i32",
        torch.int64: "*i64",
    }
    kernel = kernel if isinstance(kernel, triton.runtime.JITFunction) else kernel.fn
    constants = dict(kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"]))
    signature, divisible = {}, []
    for name, value in node.kwargs["kwargs"].items():
        value = value.meta["val"] if hasattr(value, "meta") else value
        if isinstance(value, torch.Tensor):
            signature[name] = pointer[value.dtype]
            divisible.append(name)
        elif isinstance(value, bool) or value is None or isinstance(value, triton.language.dtype):
            constants[name] = value
        elif isinstance(value, int) and value == 1:
            constants[name] = 1
        elif isinstance(value, int):
            signature[name] = "i32"
            if value % 16 == 0:
                divisible.append(name)
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            constants[name] = value
    constexpr_params = {p.name for p in kernel.params if p.is_constexpr}
    for name in [n for n in signature if n in constexpr_params]:
        constants[name] = node.kwargs["kwargs"][name]
        del signature[name]
    ordered = {
        p: "constexpr" if p in constants else signature[p] for p in kernel.arg_names if p in signature or p in constants
    }
    names = list(ordered)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible if n in names}
    return kernel, ordered, constants, attrs


def _cubin(kernel, signature, constants, attrs, warps: int, stages: int = 3) -> bytes:
    """The kernel compiled for sm_90 with ``warps`` warps and ``stages`` pipeline stages."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]


def _row(case: str, config: list, opcodes: collections.Counter, per_thread: float) -> dict:
    total = sum(opcodes.values())
    print(f"{case:20s} {tuple(config)}  {total} instructions, {total / per_thread:.1f} a value", flush=True)
    top = opcodes.most_common(12)
    return dict(
        case=case,
        config=config,
        instructions=total,
        values_per_thread=per_thread,
        per_value=total / per_thread,
        top=top,
    )


def quantize_rows() -> list:
    """``quantize_fp8_rows`` at each QUANTIZE_CASES shape, under the launcher's schedule."""
    import torch

    from compile_ops._library import OP_BODIES
    from compile_ops.ops import fp8

    body = OP_BODIES["fused::quantize_fp8_rows"]
    rows = []
    for name, (activation, k_head, k) in QUANTIZE_CASES.items():
        schedule = fp8.SCHEDULES.get((activation, k_head, k)) or fp8.default_schedule(activation, k_head, k)
        inputs = [((4096, k), torch.bfloat16)] + ([((4096, k_head), torch.bfloat16)] if k_head else [])
        launches = _traced_launches(lambda x, *head: body(x, activation, *head), inputs)
        kernel, signature, constants, attrs = launches["quantize_fp8_rows_kernel"]
        blocks = constants["CHUNKS"] + constants["HEAD_CHUNKS"]
        per_thread = constants["BLOCK_M"] * constants["BLOCK_N"] * blocks / (32 * schedule.warps)
        opcodes = sass_opcodes(_cubin(kernel, signature, constants, attrs, schedule.warps))
        rows.append(_row(name, list(schedule), opcodes, per_thread))
    return rows


def modulate_rows() -> list:
    """``norm_modulate_fp8`` at each MODULATE_CASES shape, under the shipped config
    (``ops.modulate_launch.forward_config``), each of MODULATE_CONFIGS with the row padded
    to a power of two, and each with the row held as ``held_chunks`` blocks."""
    import torch
    import triton

    from compile_ops._library import OP_BODIES
    from compile_ops.ops.modulate_launch import forward_config, held_chunks

    body = OP_BODIES["fused::norm_modulate_fp8"]
    rows = []
    for name, (tokens, width) in MODULATE_CASES.items():
        inputs = [
            ((1, tokens, width), torch.bfloat16),
            ((1, 1, width), torch.bfloat16),
            ((1, 1, width), torch.bfloat16),
        ]
        launches = _traced_launches(
            lambda x, scale, shift: body(x, scale, shift, None, None, "layernorm", 1e-6), inputs
        )
        kernel, signature, constants, attrs = launches["modulate_fwd_kernel"]
        shipped = forward_config(width, False)
        configs = [(shipped.block_m, shipped.num_warps, shipped.held_chunks)]
        configs += [(m, w, chunks) for chunks in sorted({1, held_chunks(width)}) for m, w in MODULATE_CONFIGS]
        for block_m, warps, chunks in dict.fromkeys(configs):
            block_n = triton.next_power_of_2(width) if chunks == 1 else width // chunks
            variant = dict(constants, BLOCK_M=block_m, BLOCK_N=block_n, CHUNKS=chunks)
            opcodes = sass_opcodes(_cubin(kernel, signature, variant, attrs, warps))
            per_thread = block_m * block_n * chunks / (32 * warps)
            shipped_key = (shipped.block_m, shipped.num_warps, shipped.held_chunks)
            row = _row(name, [block_m, warps, chunks], opcodes, per_thread)
            per_column = row["instructions"] / (block_m * width / (32 * warps))
            kind = "shipped" if (block_m, warps, chunks) == shipped_key else "candidate"
            rows.append(dict(row, per_column=per_column, config_kind=kind))
    return rows


def attention_rows() -> list:
    """``attention_int8_fp8``'s kernel at 1x24x4608x128 under ``forward_tiles``' int8_fp8 tiles
    (64 queries, 4 warps, 3 stages): its key loop by opcode, a thread a 128-key tile."""
    import torch

    from compile_ops._library import OP_BODIES
    from compile_ops.ops.attention_tiles import Tiles

    body = OP_BODIES["fused::attention_int8_fp8"]
    shape, tiles = (1, 4608, 24, 128), Tiles(64, 128, 4, 3)
    inputs = [(shape, torch.bfloat16)] * 3
    launches = _traced_launches(lambda q, k, v: body(q, k, v, shape[-1] ** -0.5, False, 1, None), inputs)
    kernel, signature, constants, attrs = launches["attn_fwd_kernel"]
    assert (constants["BLOCK_M"], constants["BLOCK_N"]) == (tiles.block_m, tiles.block_n), constants
    cubin = _cubin(kernel, signature, constants, attrs, tiles.num_warps, tiles.num_stages)
    body_opcodes = loop_body(sass_instructions(cubin), "MUFU.EX2")
    total = sum(body_opcodes.values())
    scores = tiles.block_m * tiles.block_n / (32 * tiles.num_warps)
    print(f"attention key loop: {total} instructions a thread a tile, {total / scores:.1f} a score", flush=True)
    config = [tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages]
    top = body_opcodes.most_common(16)
    return [dict(case="int8_fp8_4608", config=config, instructions=total, scores_per_thread=scores, top=top)]


PARTS = {"quantize": quantize_rows, "modulate": modulate_rows, "attention": attention_rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSON to write")
    parser.add_argument("--tree", default=ROOT, help="the checkout whose compile_ops is compiled")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {list(PARTS)}")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; the parts are {list(PARTS)}")
    sys.path.insert(0, os.path.abspath(args.tree))
    rows = [dict(row, part=part) for part in parts for row in PARTS[part]()]
    import triton

    results = dict(
        tree=os.path.relpath(os.path.abspath(args.tree), ROOT), triton=triton.__version__, target="sm_90", rows=rows
    )
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
