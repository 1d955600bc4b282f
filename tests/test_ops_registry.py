"""Cross-op tests driven by the op table of cases/: every op gets them by having a row.

Layer 1 (reference path, CPU): opcheck, fp64 gradcheck, torch.compile with
fullgraph and a dynamic sequence dim. Layer 2: fake-CUDA tracing of the Triton
branch of every op body. On a GPU the same tests run on CUDA, plus the check
that Inductor inlines our kernels.
"""

import pytest
import torch
import torch._dynamo.testing
from conftest import HAS_CUDA, KERNEL_DEVICE, deterministic_algorithms, tf32_dots
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import compile_ops
from cases import OPCHECK_TESTS, OPS
from compile_ops import reference
from compile_ops._library import OP_BODIES

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
DIFFERENTIABLE = [s for s in OPS if s.differentiable]
IDS = [s.name for s in OPS]


def _tensors(args):
    return [a for a in args if isinstance(a, torch.Tensor)]


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


# ---------------------------------------------------------------- layer 1: opcheck, gradcheck


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spec", OPS, ids=IDS)
def test_opcheck(spec, dtype, device):
    # The autograd and dynamic-shape checks do not depend on the dtype: fp32
    # runs them, fp64 checks the schema and the fake's dtype rules. Tracing
    # the reference path with symbolic shapes (test_aot_dispatch_dynamic) is
    # nearly all of opcheck's time on a CPU, so it runs once, in fp32.
    with_grad = spec.differentiable and dtype == torch.float32
    tests = spec.opcheck_tests or OPCHECK_TESTS
    if dtype != torch.float32:
        tests = tuple(t for t in tests if t != "test_aot_dispatch_dynamic")
    for requires_grad in [False, True] if with_grad else [False]:
        for args in spec.edge_inputs(dtype, device, requires_grad):
            torch.library.opcheck(spec.op, args, test_utils=tests)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", DIFFERENTIABLE, ids=[s.name for s in DIFFERENTIABLE])
def test_gradcheck_fp64(spec, device):
    for args in spec.edge_inputs(torch.float64, device, True)[:3]:
        if any(t.numel() == 0 for t in _tensors(args)):
            continue
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

        def f(*grad_inputs):
            it = iter(grad_inputs)
            full = [next(it) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
            return spec.op(*full)

        # The full numerical Jacobian costs two calls per input element: 13k
        # elements (block-sparse's GQA case) took 13 minutes of CI, and its
        # three cases under 4096 elements still 78-256 s. Past a thousand,
        # gradcheck's fast mode compares one random projection of the Jacobian
        # instead, which a wrong gradient still fails.
        fast = sum(t.numel() for t in inputs) > 1024
        assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-5, rtol=1e-4, fast_mode=fast)


@pytest.mark.parametrize("spec", OPS, ids=IDS)
def test_reference_path_matches_reference(spec):
    """The CPU body returns the reference exactly: a wiring test of fused_op."""
    for args in spec.edge_inputs(torch.float32, "cpu", False):
        for got, want in zip(_outputs(spec.op(*args)), _outputs(spec.reference(*args))):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want)


# ---------------------------------------------------------------- layer 1: torch.compile


def _mark_sequence_dynamic(args, seq_len):
    """Mark the sequence dim of every tensor dynamic: the dims of size ``seq_len``
    (the lengths tested differ from every other dim of the inputs)."""
    for a in _tensors(args):
        for d, size in enumerate(a.shape):
            if size == seq_len:
                torch._dynamo.mark_dynamic(a, d)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("spec", DIFFERENTIABLE, ids=[s.name for s in DIFFERENTIABLE])
def test_compile_fullgraph_one_compile_across_lengths(spec, backend):
    """Forward and backward under torch.compile(fullgraph=True): no graph break, and
    one compile serves three sequence lengths when the sequence dim is dynamic."""
    device = "cuda" if HAS_CUDA else "cpu"
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)

    @torch.compile(backend=counter, fullgraph=True)
    def f(*args):
        outs = _outputs(spec.op(*args))
        return sum(o.float().square().sum() for o in outs)

    for seq_len in (5, 9, 17):
        args = spec.make_inputs((2, seq_len, 32), torch.float32, device, True)
        _mark_sequence_dynamic(args, seq_len)
        loss = f(*args)
        loss.backward()
        grads = [a.grad for a in _tensors(args) if a.requires_grad]

        ref_args = [
            a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args
        ]
        ref_loss = sum(o.float().square().sum() for o in _outputs(spec.reference(*ref_args)))
        ref_loss.backward()
        ref_grads = [a.grad for a in _tensors(ref_args) if a.requires_grad]
        tf32 = spec.tf32 and tf32_dots(device)  # 10-bit mantissas in the dots: ~1e-3 relative
        torch.testing.assert_close(loss, ref_loss, rtol=5e-3 if tf32 else 1e-5, atol=1e-5)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-2 if tf32 else 1e-4, atol=1e-2 if tf32 else 1e-4)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 3 sequence lengths"


# ---------------------------------------------------------------- layer 2: fake-CUDA tracing


def _trace_triton_body(spec, args):
    """make_fx of the op's body (not its fake) on fake CUDA tensors: runs the
    launcher's Python (grid, strides, wrap_triton) without a GPU."""
    body = OP_BODIES[spec.qualname]
    return make_fx(lambda *a: body(*a))(*args)


def _fake_cuda(args):
    """The same arguments as fake CUDA tensors with the same strides (call under FakeTensorMode)."""
    return tuple(
        torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cuda") if isinstance(a, torch.Tensor) else a
        for a in args
    )


def _launched_kernels(gm):
    names = []
    for node in gm.graph.nodes:
        if node.target is torch.ops.higher_order.triton_kernel_wrapper_mutation:
            names.append(kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__)
    return names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("spec", OPS, ids=IDS)
def test_fake_cuda_trace_matches_fake(spec, dtype):
    """The Triton branch traces, launches kernels, and returns outputs whose
    shape, dtype and strides equal the registered fake's."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        for args in spec.edge_inputs(dtype, "cpu", False):
            cuda_args = _fake_cuda(args)
            gm = _trace_triton_body(spec, cuda_args)
            kernels = _launched_kernels(gm)
            has_rows = _tensors(args)[0].numel() > 0
            assert kernels or not has_rows, "the Triton branch launched nothing"
            traced = _outputs(gm(*cuda_args))
            fake = _outputs(spec.op(*cuda_args))
            for t, f in zip(traced, fake):
                assert t.device.type == "cuda"
                assert (t.shape, t.dtype, t.stride()) == (f.shape, f.dtype, f.stride())


@pytest.mark.parametrize("spec", [s for s in OPS if s.make_inputs], ids=lambda s: s.name)
def test_fake_cuda_trace_past_2_31_elements(spec):
    """Shape logic at 2**32 elements: no Python-side overflow, grid within CUDA's limit."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        with torch.device("meta"):
            args = spec.make_inputs((2, 2**19, 4096), torch.bfloat16, "meta", False)
        cuda_args = _fake_cuda(args)
        gm = _trace_triton_body(spec, cuda_args)
        for node in gm.graph.nodes:
            if node.target is torch.ops.higher_order.triton_kernel_wrapper_mutation:
                assert all(0 < g < 2**31 for g in node.kwargs["grid"][0])
        assert _outputs(gm(*cuda_args))[0].shape == _outputs(spec.op(*cuda_args))[0].shape


# ---------------------------------------------------------------- layer 3/4: the kernels ran


@pytest.mark.kernels
@pytest.mark.parametrize("spec", DIFFERENTIABLE, ids=[s.name for s in DIFFERENTIABLE])
def test_kernels_run_triton_not_the_reference(spec, monkeypatch):
    """The family tests compare kernels with the references, so they would pass
    vacuously if an op fell back to its reference: make every reference fail,
    then run the op forward and backward (which calls the backward ops)."""

    def no_reference(*args, **kwargs):
        raise AssertionError("the reference ran where the Triton kernel should have")

    for s in OPS:
        monkeypatch.setattr(s.reference, "__code__", no_reference.__code__)
    args = spec.make_inputs((2, 5, 32), torch.float32, KERNEL_DEVICE, True)
    outs = [o for o in _outputs(spec.op(*args)) if o.requires_grad]
    sum(o.sum() for o in outs).backward()
    assert all(a.grad is not None for a in _tensors(args) if a.requires_grad)


INFERENCE_ONLY = [s for s in OPS if not s.differentiable and s.make_inputs is not None]


@pytest.mark.kernels
@pytest.mark.parametrize("spec", INFERENCE_ONLY, ids=[s.name for s in INFERENCE_ONLY])
def test_kernels_run_triton_not_the_reference_for_inference_only_ops(spec, monkeypatch):
    """The same for the ops without a gradient (FP8 quantization, 8-bit
    attention), forward only: their family tests compare the kernel with the
    reference, which would pass if the op ran the reference."""

    def no_reference(*args, **kwargs):
        raise AssertionError("the reference ran where the Triton kernel should have")

    for s in OPS:
        monkeypatch.setattr(s.reference, "__code__", no_reference.__code__)
    with torch.no_grad():
        outs = _outputs(spec.op(*spec.make_inputs((2, 5, 32), torch.float16, KERNEL_DEVICE, False)))
    assert outs and all(o.device.type == torch.device(KERNEL_DEVICE).type for o in outs)


# ---------------------------------------------------------------- layer 4: GPU only


@pytest.mark.gpu
def test_inductor_inlines_the_triton_kernel():
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(2, 64, 3072, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3072, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    f = torch.compile(lambda x, w: torch.ops.fused.rmsnorm(x, w, 1e-6) * 2, fullgraph=True)
    out, codes = run_and_get_code(f, x, w)
    code = "\n".join(codes)
    assert "norm_fwd_kernel" in code
    assert "torch.ops.fused" not in code, "the op ran as an opaque extern call"
    torch.testing.assert_close(out, 2 * reference.norm.rmsnorm(x, w, 1e-6), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- autocast


def _fake_cuda_autocast(fn, dtype=torch.bfloat16):
    """``fn()`` under CUDA autocast on fake CUDA tensors (no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        enabled, previous = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", dtype)
        try:
            return fn()
        finally:
            torch.set_autocast_enabled("cuda", enabled)
            torch.set_autocast_dtype("cuda", previous)


def _autocast_pairs(device):
    """(name, ours, the aten op it replaces) on bf16 activations and fp32 parameters."""
    x = torch.randn(2, 8, 16, device=device, dtype=torch.bfloat16)
    w, b = torch.randn(16, device=device), torch.randn(16, device=device)
    mod = torch.randn(2, 16, device=device, dtype=torch.bfloat16)
    q = torch.randn(1, 2, 130, 16, device=device)  # fp32: autocast lowers it
    index, count = (
        torch.zeros(1, 1, 2, 1, dtype=torch.int32, device=device),
        torch.ones(1, 1, 2, dtype=torch.int32, device=device),
    )
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return [
        ("rmsnorm", lambda: compile_ops.rmsnorm(x, w, 1e-6), lambda: torch.nn.functional.rms_norm(x, (16,), w, 1e-6)),
        (
            "layernorm",
            lambda: compile_ops.layernorm(x, w, b, 1e-6),
            lambda: torch.nn.functional.layer_norm(x, (16,), w, b, 1e-6),
        ),
        (
            "norm_modulate",
            lambda: compile_ops.norm_modulate(x, mod, mod, w, b),
            lambda: torch.nn.functional.layer_norm(x, (16,), w, b, 1e-6) * (1 + mod.unsqueeze(1)) + mod.unsqueeze(1),
        ),
        ("attention", lambda: compile_ops.attention(q, q, q), lambda: sdpa(q, q, q)),
        (
            "block_sparse_attention",
            lambda: compile_ops.block_sparse_attention(q, q, q, index, count),
            lambda: sdpa(q, q, q),
        ),
    ]


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_under_cuda_autocast_ops_take_the_dtype_of_the_aten_op_they_replace(autocast_dtype):
    """Norms compute in fp32 (aten's layer_norm/rms_norm policy), attention in
    the autocast dtype (SDPA's), traced on fake CUDA tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        pairs = _autocast_pairs("cuda")
    for name, ours, theirs in pairs:
        got, want = _fake_cuda_autocast(lambda: (ours(), theirs()), autocast_dtype)
        assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
        if name != "rmsnorm":  # aten's rms_norm: fp32 under CUDA autocast from torch 2.12 or so, else unlisted
            assert got.dtype == (torch.float32 if "norm" in name else autocast_dtype), name


def test_under_cpu_autocast_attention_is_the_op_on_lowered_inputs_and_norms_are_left_alone():
    """CPU autocast (aten: SDPA lowered, the norms have no CPU autocast kernel):
    the same values as calling the op on the cast inputs, gradients back in fp32,
    eager and compiled."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 40, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = compile_ops.attention(q, q, q)
        compiled = torch.compile(lambda t: compile_ops.attention(t, t, t), backend="aot_eager", fullgraph=True)(q)
        x = torch.randn(2, 8, 16, dtype=torch.bfloat16)
        normed = compile_ops.rmsnorm(x, torch.randn(16), 1e-6)
    lowered = q.detach().bfloat16()
    assert got.dtype == compiled.dtype == torch.bfloat16
    assert torch.equal(got, compile_ops.attention(lowered, lowered, lowered)) and torch.equal(compiled, got)
    got.float().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()
    assert normed.dtype == torch.bfloat16  # as torch.nn.functional.rms_norm on CPU under autocast


def test_autocast_kernels_exist_exactly_for_the_ops_with_a_policy():
    from compile_ops._library import aten_autocast_policy

    # The RMS norms mirror aten's rms_norm, which has a CUDA autocast kernel from torch 2.13 on, none in 2.11.
    rms = ("cuda",) if aten_autocast_policy("aten::rms_norm", "fp32") else ()
    with_policy = {
        "rmsnorm": rms,
        "layernorm": ("cuda",),
        "add_rmsnorm": rms,
        "norm_modulate": ("cuda",),
        "gated_residual_norm_modulate": ("cuda",),
        "attention": ("cuda", "cpu"),
        "block_sparse_attention": ("cuda", "cpu"),
    }
    for name in (
        "rmsnorm",
        "layernorm",
        "add_rmsnorm",
        "norm_modulate",
        "gated_residual_norm_modulate",
        "attention",
        "block_sparse_attention",
        "rope",
        "geglu",
        "modulate",
        "quantize_fp8_rows",
    ):
        for device, key in (("cuda", "AutocastCUDA"), ("cpu", "AutocastCPU")):
            has = torch._C._dispatch_has_kernel_for_dispatch_key(f"fused::{name}", key)
            assert has == (device in with_policy.get(name, ())), (name, key)


#: Ops whose eager calls read tensor values on purpose: block-sparse attention,
#: in both output forms, checks its block lists' values (``meta/block_sparse.py``),
#: in eager calls only (never while tracing or capturing a CUDA graph), so those
#: calls get no launch plan either.
EAGER_VALUE_CHECKS = {"block_sparse_attention", "block_sparse_attention_int8_fp8_rows"}


@pytest.mark.gpu
@pytest.mark.parametrize(
    "spec", [s for s in OPS if s.make_inputs and s.name not in EAGER_VALUE_CHECKS], ids=lambda s: s.name
)
def test_launchers_never_synchronize_with_the_device(spec):
    """No launcher reads a CUDA tensor back on the host (``.item()``,
    ``.tolist()``, ``.cpu()``, a data-dependent shape): that would stall the
    stream and break CUDA graphs (``torch.compile(mode="reduce-overhead")``).
    CUDA's sync debug mode turns any synchronizing call into an error; the
    op runs forward and, where it has one, backward (the backward ops run
    there: they have no inputs of their own)."""
    args = spec.make_inputs((2, 64, 64), torch.bfloat16, "cuda", spec.differentiable)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [o for o in _outputs(spec.op(*args)) if o.requires_grad]
        if outs:
            sum(o.float().sum() for o in outs).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


# ---------------------------------------------------------------- eager launch plans (compile_ops/_replay.py)


def test_launch_plan_signature_tells_apart_what_launchers_depend_on():
    """Calls that may launch differently have different keys: dtype, shape,
    strides, pointer alignment, scalar values and their types, argument names,
    torch's fp32 matmul precision and deterministic algorithms; a kind of argument plans do not cover
    (a list) gives no key, so that call runs its body."""
    from compile_ops._replay import signature

    x = torch.randn(4, 8)
    key = signature((x, 1e-6), {})
    assert key == signature((torch.randn(4, 8), 1e-6), {})
    others = [
        signature((x.half(), 1e-6), {}),
        signature((x[:, :4], 1e-6), {}),
        signature((x.t(), 1e-6), {}),
        signature((x.view(-1)[1:].view(31)[:28].view(4, 7), 1e-6), {}),
        signature((x, 1e-5), {}),
        signature((x, 1), {}),
        signature((x,), {"eps": 1e-6}),
        signature((x, True), {}),
    ]
    assert all(o is not None and o != key for o in others) and len(set(others)) == len(others)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if previous == "highest" else "highest")
    try:
        assert signature((x, 1e-6), {}) != key
    finally:
        torch.set_float32_matmul_precision(previous)
    with deterministic_algorithms(not torch.are_deterministic_algorithms_enabled()):
        assert signature((x, 1e-6), {}) != key
    assert signature((x, [1, 2]), {}) is None
    # A module's weight is a Parameter: a plain tensor to plans (the key of its data).
    assert signature((torch.nn.Parameter(x), 1e-6), {}) == key


@pytest.mark.gpu
def test_module_weights_take_the_eager_fast_path():
    """A norm module's call, whose weight is an nn.Parameter, is replayed from
    a launch plan like a call on plain tensors (Parameters were once taken for
    a tensor subclass and always ran the dispatcher's path)."""
    from compile_ops._library import FUSED_OPS, clear_launch_plans
    from compile_ops._replay import Plan

    clear_launch_plans()
    weight = torch.nn.Parameter(torch.randn(256, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(2, 40, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        outputs = [torch.ops.fused.rmsnorm.default(x, weight, 1e-6)] + [
            compile_ops.rmsnorm(x, weight, 1e-6) for _ in range(3)
        ]
    assert all(torch.equal(o, outputs[0]) for o in outputs)
    assert [type(p) for p in FUSED_OPS["rmsnorm"].plans.values()] == [Plan]
    clear_launch_plans()


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [s for s in OPS if s.make_inputs], ids=lambda s: s.name)
def test_eager_launch_plans_replay_the_op_exactly(spec):
    """The second eager call of a signature replays the first one's launches
    on new tensors: its outputs equal the op's through the dispatcher (which
    never replays) bit for bit, for new inputs at other addresses, and for
    inputs whose pointers sit at another 16-byte alignment (a new signature)."""
    from compile_ops._library import FUSED_OPS, clear_launch_plans
    from compile_ops._replay import Plan

    op = FUSED_OPS[spec.op_name or spec.name]
    clear_launch_plans()
    torch.manual_seed(0)

    def shifted(a):  # the same values one element past a 16-byte boundary
        if not isinstance(a, torch.Tensor) or not a.is_contiguous():
            return a
        return torch.empty(a.numel() + 1, dtype=a.dtype, device=a.device)[1:].view(a.shape).copy_(a)

    with torch.no_grad():
        for i in range(4):
            args = spec.make_inputs((2, 40, 256), torch.bfloat16, "cuda", False)
            args = tuple(shifted(a) for a in args) if i == 3 else args
            for got, want in zip(_outputs(op(*args)), _outputs(spec.op(*args))):
                assert (
                    torch.equal(got, want)
                    or (got.isnan() == want.isnan()).all()
                    and torch.equal(got.nan_to_num(), want.nan_to_num())
                )
        planned = [p for p in op.plans.values() if type(p) is Plan]
        print(f"{spec.name}: {len(planned)} of {len(op.plans)} signatures planned")
    if spec.name in PLANNED_OPS:
        assert planned, f"{spec.name}: no launch plan; its eager calls pay the full host cost"
    clear_launch_plans()


#: Ops whose eager calls must get launch plans (every kernel argument is an
#: input, an output, a view of one, or scratch the op's kernels write): a
#: change that breaks planning fails here.
PLANNED_OPS = {
    "rmsnorm",
    "add_rmsnorm",
    "layernorm",
    "modulate",
    "norm_modulate",
    "gated_residual",
    "gated_residual_norm_modulate",
    "rope",
    "rope_qk",
    "rope_grid",
    "qk_norm_rope",
    "geglu",
    "geglu_tanh",
    "swiglu",
    "quantize_fp8_rows",
    "norm_modulate_fp8",
    "gated_residual_norm_modulate_fp8",
    "attention",
    "moe_route",
    "moe_route_hidream",
    "attention_int8",
    "attention_int8_fp8",
    "qk_rope_int8",
    "attention_qk8",
    "attention_int8_fp8_rows",
    "block_sparse_attention",
    "block_sparse_attention_int8_fp8_rows",
}


@pytest.mark.gpu
def test_launch_plans_refuse_what_a_replay_would_get_wrong():
    """A body that reads a tensor value (a sync), or hands a kernel an
    intermediate tensor that torch ops computed (rmsnorm's body on ``2 * x``),
    gets no plan and still returns the right result; scratch that the body's
    own kernels write (8-bit attention's quantized q and k, the FP8 rows'
    scale bound) is replayed."""
    from compile_ops._library import FUSED_OPS, _launch_eagerly, clear_launch_plans
    from compile_ops._replay import UNPLANNED, Plan, run

    plans = {}
    x = torch.randn(8, 64, device="cuda")
    reads_a_value = lambda x: x * float(x.sum())  # noqa: E731
    assert torch.equal(run(plans, reads_a_value, (x,), {}), reads_a_value(x))
    assert list(plans.values()) == [UNPLANNED]
    plans = {}
    spec = next(s for s in OPS if s.name == "rmsnorm")
    args = spec.make_inputs((2, 40, 256), torch.bfloat16, "cuda", False)
    doubled_first = lambda x, *rest: FUSED_OPS["rmsnorm"].body(2 * x, *rest)  # noqa: E731
    for _ in range(2):
        assert torch.equal(_launch_eagerly(doubled_first, args, {}, plans), spec.op(2 * args[0], *args[1:]))
    assert list(plans.values()) == [UNPLANNED]
    clear_launch_plans()
    q, k, v = (torch.randn(1, 2, 130, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    with torch.no_grad():
        compile_ops.attention(q, k, v, precision="int8")
        rows = compile_ops.attention_fp8_rows(q, k, v)
        again = compile_ops.attention_fp8_rows(q, k, v)
    assert [type(p) for p in FUSED_OPS["attention_int8"].plans.values()] == [Plan]
    assert [type(p) for p in FUSED_OPS["attention_int8_fp8_rows"].plans.values()] == [Plan]
    assert torch.equal(rows.q.view(torch.uint8), again.q.view(torch.uint8)) and torch.equal(rows.scale, again.scale)
