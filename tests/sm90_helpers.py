"""What the sm_90 compile files share (test_sm90_compile.py,
test_sm90_compile_gluon.py); it holds no tests.

- ``_launches``: every distinct Triton launch of an op's body (or of a
  function called with the op's arguments), traced on fake CUDA tensors over
  the op's edge inputs and one DiT-sized input, as ``{key: (kernel,
  signature, constexprs)}`` ready for ``triton.compile``; ``_POINTER`` and
  ``_fake_cuda`` serve it.
- ``_compile_with_constant_ints``: each launch compiled for sm_90 with its int
  arguments as arguments and again as constants (as Inductor may pass a
  static int).
- ``_sm90_ptx``: one launch's sm_90 PTX, for tests of what it must hold.
- ``_sm90_ttir``: one launch's Triton IR for sm_90, the front end alone (its
  type errors, and what a scalar's type does to the arithmetic).
- ``_ptxas_report``: ptxas's report of registers and spills for some PTX,
  with the cubin beside it (for cuobjdump).
"""

import torch
import triton
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend

from compile_ops._library import OP_BODIES

_POINTER = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.float64: "*fp64",
    torch.int8: "*i8",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.float8_e4m3fn: "*fp8e4nv",
}


def _fake_cuda(args):
    return tuple(
        torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cuda") if isinstance(a, torch.Tensor) else a
        for a in args
    )


def _launches(spec, dtype, body=None):
    """``{key: (kernel, signature, constexprs)}`` of every launch of the op's body
    (or of ``body``, called with the op's arguments) over its edge inputs and
    one DiT-sized input."""
    body = body or OP_BODIES[spec.qualname]
    cases = list(spec.edge_inputs(dtype, "cpu", False))
    with FakeTensorMode(allow_non_fake_inputs=True):
        if spec.make_inputs is not None:
            with torch.device("meta"):
                cases.append(spec.make_inputs((2, 64, 3072), dtype, "meta", False))
        launches = {}
        for args in cases:
            gm = make_fx(lambda *a: body(*a))(*_fake_cuda(args))
            for node in gm.graph.nodes:
                if node.target is not torch.ops.higher_order.triton_kernel_wrapper_mutation:
                    continue
                kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
                # torch wraps a plain @triton.jit kernel in a no-config Autotuner.
                kernel = kernel if isinstance(kernel, triton.runtime.JITFunction) else kernel.fn
                constants = dict(kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"]))
                signature = {}
                for name, value in node.kwargs["kwargs"].items():
                    value = value.meta["val"] if hasattr(value, "meta") else value
                    if isinstance(value, torch.Tensor):
                        signature[name] = _POINTER[value.dtype]
                    elif isinstance(value, bool) or isinstance(value, triton.language.dtype):
                        constants[name] = value
                    elif isinstance(value, int):
                        signature[name] = "i64" if abs(value) >= 2**31 else "i32"
                    elif isinstance(value, float):
                        signature[name] = "fp32"
                    else:
                        constants[name] = value
                constexpr_params = {p.name for p in kernel.params if p.is_constexpr}
                for name in list(signature):
                    if name in constexpr_params:  # BLOCK sizes and the like arrive as ints
                        constants[name] = node.kwargs["kwargs"][name]
                        del signature[name]
                for name in constants:
                    signature[name] = "constexpr"
                key = (
                    kernel.fn.__name__,
                    tuple(sorted(signature.items())),
                    tuple(sorted((k, str(v)) for k, v in constants.items())),
                )
                launches[key] = (kernel, signature, constants)
    return launches


def _compile_with_constant_ints(launches):
    for kernel, signature, constants in launches:
        ints = [p for p, t in signature.items() if t in ("i32", "i64")]
        for constant_ints in (False, True):
            consts = dict(constants, **({p: 1000 + i for i, p in enumerate(ints)} if constant_ints else {}))
            typed = {p: ("constexpr" if p in consts else t) for p, t in signature.items()}
            ordered = {p: typed[p] for p in kernel.arg_names if p in typed}
            compiled = triton.compile(
                ASTSource(fn=kernel, signature=ordered, constexprs=consts),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": 4},
            )
            assert compiled.asm.get("cubin")


def _sm90_ptx(kernel, signature, constants, attrs=None, num_warps=4) -> str:
    """The PTX of one ``_launches`` entry compiled for sm_90 (``attrs``: triton's
    argument attributes, such as divisibility)."""
    ordered = {p: signature[p] for p in kernel.arg_names if p in signature}
    source = ASTSource(fn=kernel, signature=ordered, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]


def _ptxas_report(ptx: str, directory, name: str) -> str:
    """ptxas ``-v``'s report (registers, spill stores and loads) of ``ptx``
    assembled for sm_90a; the cubin is left at ``directory / f"{name}.cubin"``."""
    import subprocess

    from triton import knobs

    (directory / f"{name}.ptx").write_text(ptx)
    command = [knobs.nvidia.ptxas.path, "-v", "-arch=sm_90a", str(directory / f"{name}.ptx")]
    return subprocess.run(
        command + ["-o", str(directory / f"{name}.cubin")], capture_output=True, text=True, check=True
    ).stderr


def _product_loop_spills(cubin) -> list:
    """``[(spill stores, spill loads)]`` (``STL``, ``LDL``) of each innermost
    loop of a cubin's SASS (``cubin``: its path) that issues tensor-core
    products (``*GMMA``): an attention kernel's key loops. A loop is a
    backward branch and its target; the jumps back from the out-of-line
    mbarrier retries span whole loops and are not innermost."""
    import re

    from bench.experiments.kernel_sass import sass_instructions

    code = [(address, op.split(".")[0], operands) for address, op, operands in sass_instructions(cubin.read_bytes())]
    loops = []
    for address, opcode, operands in code:
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode == "BRA" else None
        if target and int(target.group(1), 16) <= address:
            loops.append((int(target.group(1), 16), address))
    counts = []
    for start, end in loops:
        body = [op for address, op, _ in code if start <= address <= end]
        inner = not any(start <= s and e <= end and (s, e) != (start, end) for s, e in loops)
        if inner and any(op.endswith("GMMA") for op in body):
            counts.append((body.count("STL"), body.count("LDL")))
    return counts


def _sm90_ttir(kernel, signature, constants) -> str:
    """The Triton IR of one ``_launches`` entry for sm_90: the front end and
    the TTIR passes that ``triton.compile`` runs first, without the layouts,
    LLVM and ptxas after them, which are most of a compile's time. Not
    cached, unlike a compile."""
    ordered = {p: signature[p] for p in kernel.arg_names if p in signature}
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": 4})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = ASTSource(fn=kernel, signature=ordered, constexprs=constants)
    stages = {}
    backend.add_stages(stages, options, source.language)
    codegen = backend.get_codegen_implementation(options)
    module = source.make_ir(target, options, codegen, backend.get_module_map(), context)
    return str(stages["ttir"](module, {"hash": "ttir", "target": target, **options.__dict__}))
