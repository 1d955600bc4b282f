"""The fp8 family, part one: rowwise e4m3 quantization (``quantize_fp8_rows``) and its kernel.

The specification is compile_ops/reference/fp8.py. Tests here restate it
independently (``_spec_quantize``, tests/fp8_helpers.py) and check the reference
and the op against it: the activation mode, the optional head segment and the
non-finite rule (layer 1); trace the quantize kernel's launches on fake CUDA
tensors, the SCHEDULES table's entries among them, read the sm_90 PTX for the
instructions that make the GPU's bytes the reference's, and check what Inductor
takes the kernel to write (layer 2); compare the kernel's bytes with the
reference's under the interpreter or on the GPU, on every launch path (layers
3/4). FP8Linear and the FP8 GEMM are test_fp8_linear.py's.
"""

import pytest
import torch
import triton
from conftest import KERNEL_DEVICE
from fp8_helpers import _fake_cuda_launches, _same_bytes, _spec_quantize
from hypothesis import given
from hypothesis import strategies as st
from shapes import size

import compile_ops
from compile_ops._library import OP_BODIES
from compile_ops.ops import fp8 as ops
from compile_ops.reference import fp8 as ref


def _same_bytes_but_nan_sign(a, b):
    """Equal bytes, NaN where NaN: e4m3fn has two NaNs (0x7f, 0xff). torch keeps
    the input's sign; the GPU's convert may not, and nothing reads a NaN's sign."""
    a, b = a.view(torch.uint8), b.view(torch.uint8)
    a_nan, b_nan = (a & 0x7F) == 0x7F, (b & 0x7F) == 0x7F
    return torch.equal(a_nan, b_nan) and torch.equal(a[~a_nan], b[~b_nan])


# ---------------------------------------------------------------- layer 1: the recipe


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_and_op_follow_the_recipe(dtype):
    x = (torch.randn(6, 40) * torch.logspace(-3, 3, 6)[:, None]).to(dtype)
    q, scale = compile_ops.quantize_fp8_rows(x)
    want_q, want_scale = _spec_quantize(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (6,)
    assert _same_bytes(q, want_q) and torch.equal(scale, want_scale)
    # Dequantized error. x * inverse lands in [-448, 448]; e4m3 keeps 3 mantissa
    # bits, so a value v in [2^e, 2^(e+1)) with e >= -6 (the normal range) is
    # rounded to a multiple of 2^(e-3): off by at most half of that, 2^(e-4) <=
    # 2^-4 |v|. Multiplying back by scale = 1/inverse (each an fp32 rounding,
    # 2^-24 relative) adds ~3 * 2^-24: |x - q * scale| <= (2^-4 + 1e-6) |x|.
    # Below 2^-6 (subnormals, spacing 2^-9) the error is absolute: half a
    # spacing, 2^-10 * scale.
    back = q.float() * scale[:, None]
    err = (back - x.float()).abs()
    normal = x.float().abs() >= 2.0**-6 * scale[:, None]
    rel = (err / x.float().abs())[normal]
    assert rel.max() <= 2.0**-4 + 1e-6, rel.max()
    assert (err <= 2.0**-10 * scale[:, None] * (1 + 1e-6))[~normal].all()
    # Each row's largest value maps to +-448 exactly.
    assert torch.equal(q.float().abs().amax(-1), torch.full((6,), 448.0))


_TORCH_ACTIVATIONS = {
    "gelu": lambda t: torch.nn.functional.gelu(t),
    "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
    "silu": torch.nn.functional.silu,
}


@pytest.mark.parametrize("activation", _TORCH_ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_mode_quantizes_the_activation_rounded_to_the_input_dtype(activation, dtype):
    """quantize_fp8_rows(x, act) is the recipe applied to act(x) computed in
    fp32 and rounded to x's dtype (what the unquantized activation writes)."""
    torch.manual_seed(0)
    x = (torch.randn(6, 40) * 3).to(dtype)
    q, scale = compile_ops.quantize_fp8_rows(x, activation)
    want_q, want_scale = _spec_quantize(_TORCH_ACTIVATIONS[activation](x.float()).to(dtype))
    assert _same_bytes(q, want_q) and torch.equal(scale, want_scale)
    plain_q, _ = compile_ops.quantize_fp8_rows(x)
    assert not _same_bytes(q, plain_q)  # the mode does something
    # With a head: one scale per row of cat([head, act(x)]), the concatenation never written.
    head = (torch.randn(6, 24) * 5).to(dtype)
    q, scale = compile_ops.quantize_fp8_rows(x, activation, head=head)
    want_q, want_scale = _spec_quantize(torch.cat([head, _TORCH_ACTIVATIONS[activation](x.float()).to(dtype)], -1))
    assert q.shape == (6, 64) and _same_bytes(q, want_q) and torch.equal(scale, want_scale)


def test_an_infinity_makes_its_row_nan_and_a_nan_stays_where_it_is():
    """The non-finite rule: amax counts +-inf and leaves NaN out. A row with an
    infinity gets an infinite scale and the codes ``x * (448 / inf)``: NaN at
    the infinities, +-0 elsewhere, so ``q * scale`` is NaN across the row; a
    NaN without an infinity keeps its row's scale and is NaN only where it
    was. Rows are independent: the others keep their bytes."""
    inf, nan = float("inf"), float("nan")
    x = torch.randn(9, 16)
    x[0, 3], x[1, 5], x[2], x[3], x[4], x[5, 0] = inf, nan, 0.0, nan, -inf, 1e-30
    x[6, 2], x[6, 9], x[7, 1], x[7, 4] = -inf, nan, inf, -inf
    q, scale = compile_ops.quantize_fp8_rows(x)
    want_q, want_scale = _spec_quantize(x)
    assert _same_bytes(q, want_q) and torch.equal(scale, want_scale)
    infinite = torch.tensor([True, False, False, False, True, False, True, True, False])
    assert torch.equal(torch.isinf(scale), infinite) and (scale[infinite] > 0).all()
    assert torch.isfinite(scale[~infinite]).all() and (scale[~infinite] > 0).all()
    back = q.float() * scale[:, None]
    assert back[infinite].isnan().all() and not back[~infinite].isinf().any()
    assert torch.equal(q.float().isnan(), ~torch.isfinite(x))  # NaN codes exactly at the non-finite values
    assert (q[0, [0, 1, 2, 4]].float() == 0).all() and (q[4].float().isnan()).all()
    # A NaN without an infinity is left out of the amax: the row's other values
    # get the scale they would get without it.
    _, without_nan = compile_ops.quantize_fp8_rows(torch.cat([x[1, :5], x[1, 6:]]))
    assert torch.equal(scale[1], without_nan)
    assert q[1, 5].float().isnan() and not q[1, [0, 1, 2, 3, 4, 6]].float().isnan().any()
    assert q[3].float().isnan().all()
    # All-zero and all-NaN rows: the floor's scale, 1e-12 / 448.
    floor = torch.tensor(ref.AMAX_FLOOR, dtype=torch.float32) / ref.E4M3_MAX
    assert torch.equal(scale[[2, 3]], floor.expand(2)) and (q[2].float() == 0).all()
    clean_q, clean_scale = compile_ops.quantize_fp8_rows(x[[5, 8]])
    assert _same_bytes(q[[5, 8]], clean_q) and torch.equal(scale[[5, 8]], clean_scale)


# ---------------------------------------------------------------- layer 2: fake-CUDA tracing


@pytest.mark.parametrize(
    "shape, looped, activation, act",
    [
        ((2, 7, 64), False, "none", -1),
        ((3, 3072), False, "none", -1),
        ((5, 4096 + 37), False, "none", -1),
        ((5, 16384 + 37), True, "none", -1),
        ((2, 2**19, 4096), False, "none", -1),
        ((2**20, 8192), False, "none", -1),
        ((2, 4096, 12288), False, "gelu_tanh", 1),
        ((2, 4096, 12288), False, "head", 1),
        ((2, 64, 16384 + 64), True, "head", 1),
    ],
)
def test_fake_cuda_trace_launches_the_quantize_kernel(shape, looped, activation, act):
    """The Triton branch on fake CUDA tensors (meta-sized past 2^31 elements):
    one launch, rows read once up to 16384 columns (an MLP's hidden activation
    and Flux's concatenation with the attention output among them), the
    looped variant past that, the activation's ACT code, a grid that covers
    every row, outputs shaped like the fake's."""
    with torch.device("meta"):
        x = torch.empty(shape, dtype=torch.bfloat16)
        head = torch.empty((*shape[:-1], 3072), dtype=torch.bfloat16) if activation == "head" else None
    body = OP_BODIES["fused::quantize_fp8_rows"]
    if head is None:
        _, (q, scale), launches = _fake_cuda_launches(lambda t: body(t, activation), x)
    else:  # Flux's single block: the attention output, then the MLP's activation
        _, (q, scale), launches = _fake_cuda_launches(lambda t, h: body(t, "gelu_tanh", h), x, head)
        shape = (*shape[:-1], 3072 + shape[-1])
    assert [name for name, _, _ in launches] == ["quantize_fp8_rows_kernel"]
    _, kwargs, grid = launches[0]
    rows = x.numel() // x.shape[-1]
    assert kwargs["LOOPED"] is looped and kwargs["n_rows"] == rows and kwargs["K"] == x.shape[-1]
    assert kwargs["ACT"] == act and kwargs["HAS_HEAD"] is (head is not None)
    assert kwargs["K_HEAD"] == (0 if head is None else 3072)
    if not looped:  # whole rows in registers: whole blocks of 4096 (or of a narrower row's power of two) cover them
        block_n, chunks, head_chunks = kwargs["BLOCK_N"], kwargs["CHUNKS"], kwargs["HEAD_CHUNKS"]
        assert block_n == min(4096, triton.next_power_of_2(max(x.shape[-1], kwargs["K_HEAD"])))
        assert (chunks, head_chunks) == (triton.cdiv(x.shape[-1], block_n), triton.cdiv(kwargs["K_HEAD"], block_n))
        assert block_n * (chunks + head_chunks) <= 16384
    assert grid[0] == triton.cdiv(rows, kwargs["BLOCK_M"]) and 0 < grid[0] < 2**31  # one tile a program
    assert (q.shape, q.dtype, scale.shape, scale.dtype) == (shape, torch.float8_e4m3fn, shape[:-1], torch.float32)


@pytest.mark.parametrize(
    "schedule, shape, k_head",
    [
        (ops.Schedule(1, 4096, 16), (2, 4096, 12288), 3072),  # Flux's single block
        (ops.Schedule(4, 512, 8), (7, 1536), 0),  # rows across warp groups, M not a multiple of 4
        (ops.Schedule(2, 2048, 4), (3, 20000), 0),  # an entry holds rows the default rule would loop
    ],
)
def test_fake_cuda_trace_launches_the_schedule_table_entry(monkeypatch, schedule, shape, k_head):
    """A SCHEDULES entry keyed by (activation, head width, width) sets the held
    launch: its tile rows, block width and warps, each segment in whole
    blocks, a grid of one tile of BLOCK_M rows a program; other widths keep
    the default rule."""
    activation = "gelu_tanh" if k_head else "none"
    monkeypatch.setattr(ops, "SCHEDULES", {(activation, k_head, shape[-1]): schedule})
    with torch.device("meta"):
        x = torch.empty(shape, dtype=torch.bfloat16)
        other = torch.empty((*shape[:-1], shape[-1] + 16), dtype=torch.bfloat16)  # no entry
        heads = (torch.empty((*shape[:-1], k_head), dtype=torch.bfloat16),) if k_head else ()
    body = OP_BODIES["fused::quantize_fp8_rows"]
    _, _, launches = _fake_cuda_launches(
        lambda t, u, *h: (body(t, activation, *h), body(u, activation, *h)), x, other, *heads
    )
    (_, entry, grid), (_, default, default_grid) = launches
    rows = x.numel() // x.shape[-1]
    block_m, block_n, _ = schedule
    assert not entry["LOOPED"] and (entry["BLOCK_M"], entry["BLOCK_N"]) == schedule[:2]
    assert (entry["CHUNKS"], entry["HEAD_CHUNKS"]) == (triton.cdiv(shape[-1], block_n), triton.cdiv(k_head, block_n))
    assert grid[0] == triton.cdiv(rows, block_m)
    assert default_grid[0] == triton.cdiv(rows, default["BLOCK_M"])


@pytest.mark.parametrize("variant", ["held", "looped", "two_rows"])
@pytest.mark.parametrize("act", [-1, 1])
def test_sm90_code_rounds_like_the_reference(variant, act):
    """What makes the GPU's bytes the reference's, read from the sm_90 PTX (no GPU
    needed; both variants with a head segment, as Flux's single block runs them): IEEE division for the
    scales (not div.approx/div.full, which plain fp32 ``/`` gives), no
    flush-to-zero, and the round-to-nearest-even saturating convert that
    tests/conftest.py's interpreter patch reproduces. With an activation
    (tanh GELU) the forward sigmoid's power of two and reciprocal are the only
    approximate and flushing instructions (``kernels/glu.py``: its bytes are
    the GLU kernels', which the interpreter layer compares). ``two_rows``: a
    tile of two rows a program (a SCHEDULES entry's shape)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from compile_ops.kernels.fp8 import quantize_fp8_rows_kernel

    signature = {
        "X": "*bf16",
        "Q": "*fp8e4nv",
        "S": "*fp32",
        "n_rows": "i32",
        "K": "i32",
        "stride_row": "i32",
        "stride_col": "i32",
        "HEAD": "*bf16",
        "K_HEAD": "i32",
        "stride_head_row": "i32",
        "stride_head_col": "i32",
        "BLOCK_M": "constexpr",
        "BLOCK_N": "constexpr",
        "LOOPED": "constexpr",
        "ACT": "constexpr",
        "HAS_HEAD": "constexpr",
        "CHUNKS": "constexpr",
        "HEAD_CHUNKS": "constexpr",
    }
    looped, block_m = variant == "looped", 2 if variant == "two_rows" else 1
    # Flux's single block as the launcher runs it: 3 + 1 blocks of 4096 held, or the loop.
    src = ASTSource(
        fn=quantize_fp8_rows_kernel,
        signature=signature,
        constexprs={
            "BLOCK_M": block_m,
            "BLOCK_N": 2048 if looped else 4096,
            "LOOPED": looped,
            "ACT": act,
            "HAS_HEAD": True,
            "CHUNKS": 0 if looped else 3,
            "HEAD_CHUNKS": 0 if looped else 1,
        },
    )
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4 if looped else 8}).asm["ptx"]
    assert set(re.findall(r"cvt\.[\w.]*e4m3[\w.]*", ptx)) == {"cvt.rn.satfinite.e4m3x2.f32"}
    divisions = re.findall(r"div\.[\w.]+", ptx)
    assert set(divisions) == {"div.rn.f32"}
    # The scales' two correctly rounded divisions, in each place a row's scale is taken.
    assert 0 < divisions.count("div.rn.f32") <= 4 * block_m
    flushing = set(re.findall(r"\b\w+\.approx\.ftz\.f32|\b\w+\.ftz\.[\w.]+", ptx))
    assert flushing == (set() if act < 0 else {"ex2.approx.ftz.f32", "rcp.approx.ftz.f32"}), flushing


@pytest.mark.parametrize("variant", ["held", "head", "looped", "two_rows"])
def test_inductor_sees_the_quantize_kernel_write_only_its_outputs(variant, monkeypatch):
    """Inductor's analysis of what a user Triton kernel writes (its TTIR, read
    for an sm_90 target: no GPU needed) finds Q and S only. Were X (or HEAD)
    taken for written, a compiled graph would copy the activation before each
    call and CUDA graphs would skip the FP8 Linears (``mutated inputs``)."""
    from torch._higher_order_ops import triton_kernel_wrap
    from triton.backends.compiler import GPUTarget

    from compile_ops.kernels.fp8 import quantize_fp8_rows_kernel

    class Sm90Target:  # the active driver's target, where this machine may have no GPU
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    monkeypatch.setattr(triton.runtime.driver, "_active", Sm90Target(), raising=False)
    with_head, looped = variant == "head", variant == "looped"
    block_m = 2 if variant == "two_rows" else 1
    x = torch.empty(64, 256, dtype=torch.bfloat16)
    kwargs = dict(
        X=x,
        Q=torch.empty(64, 512 if with_head else 256, dtype=torch.float8_e4m3fn),
        S=torch.empty(64),
        n_rows=64,
        K=256,
        stride_row=256,
        stride_col=1,
        HEAD=torch.empty(64, 256, dtype=torch.bfloat16) if with_head else None,
        K_HEAD=256 if with_head else 0,
        stride_head_row=256,
        stride_head_col=1,
        BLOCK_M=block_m,
        BLOCK_N=256,
        LOOPED=looped,
        ACT=1,
        HAS_HEAD=with_head,
        CHUNKS=0 if looped else 1,
        HEAD_CHUNKS=int(with_head and not looped),
    )
    if hasattr(
        triton_kernel_wrap, "identify_accessed_tensors"
    ):  # newer torch; older ones name it identify_mutated_tensors
        accesses = triton_kernel_wrap.identify_accessed_tensors(quantize_fp8_rows_kernel, kwargs, {})
        written = [dep.name for dep in accesses.read_writes.writes]
    else:
        written = triton_kernel_wrap.identify_mutated_tensors(quantize_fp8_rows_kernel, kwargs, {})
    assert sorted(written) == ["Q", "S"]


# ---------------------------------------------------------------- layer 3/4: the kernel


@pytest.mark.kernels
@given(
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    st.integers(0, 5),
    size(st.one_of(st.integers(1, 300), st.sampled_from([3072, 4096, 5000])), [1, 37, 3072, 5000]),
    st.sampled_from(["contiguous", "row_slice", "column_stride"]),
    st.sampled_from(["none", "inf", "nan", "zero_row", "tiny_row"]),
    st.floats(1e-3, 1e3),
)
def test_kernel_writes_the_references_bytes(dtype, rows, k, layout, special, magnitude):
    torch.manual_seed(k)
    if layout == "column_stride":
        x = (torch.randn(rows, 2 * k) * magnitude)[:, ::2]
    elif layout == "row_slice":
        x = (torch.randn(rows, k + 3) * magnitude)[:, 2 : 2 + k]
    else:
        x = torch.randn(rows, k) * magnitude
    x = x.to(dtype)
    if rows and special != "none":
        if special == "zero_row":
            x[0] = 0
        elif special == "tiny_row":
            x[0] = x[0].float().mul(1e-6).to(dtype)
        else:
            x[0, k // 2] = float(special)
    x = x.to(KERNEL_DEVICE)
    q, scale = compile_ops.quantize_fp8_rows(x)
    want_q, want_scale = ref.quantize_fp8_rows(x.cpu())
    assert _same_bytes_but_nan_sign(q.cpu(), want_q), "e4m3 bytes differ from the reference"
    assert torch.equal(scale.cpu(), want_scale)


def _unquantized_activation(x, activation):
    """act(x) at x's dtype from the GLU kernels (``value * act(gate)`` with a
    value of ones: exact), which share the quantize kernel's activation code."""
    ones_and_x = torch.cat([torch.ones_like(x), x], dim=-1)  # value half, gate half
    if activation == "silu":
        return compile_ops.swiglu(ones_and_x)
    return compile_ops.geglu(ones_and_x, approximate="tanh" if activation == "gelu_tanh" else "none")


def _quantized_in_small_chunks(x, activation, head, chunk_n):
    """``quantize_fp8_rows`` under a launch config scaled down to ``chunk_n``-wide
    chunks (so small rows take the held and the looped paths), and the values
    the reference quantizes: ``act(x)`` as the GLU kernels round it, after the head."""
    from compile_ops._library import clear_launch_plans

    saved = ops.CHUNK_N, ops.MAX_ROW_VALUES, ops.LOOP_BLOCK_N
    ops.CHUNK_N, ops.MAX_ROW_VALUES, ops.LOOP_BLOCK_N = chunk_n, 8 * chunk_n, chunk_n
    clear_launch_plans()
    try:
        q, scale = compile_ops.quantize_fp8_rows(x, activation, head=head)
    finally:
        ops.CHUNK_N, ops.MAX_ROW_VALUES, ops.LOOP_BLOCK_N = saved
        clear_launch_plans()
    values = x if activation == "none" else _unquantized_activation(x, activation)
    if head is not None:
        values = torch.cat([head, values], dim=-1)
    return q, scale, values


@pytest.mark.kernels
@given(
    st.integers(1, 5),
    st.integers(1, 600),
    st.integers(0, 300),
    st.sampled_from([16, 64]),
    st.sampled_from(["none", "gelu_tanh", "silu"]),
    st.sampled_from([torch.float32, torch.float16]),
)
def test_kernel_holds_a_row_in_any_number_of_blocks_or_loops_past_them(rows, k, k_head, chunk_n, activation, dtype):
    """The launch config scaled down (blocks of 16 or 64 columns, rows held up to
    8 blocks, looped past that in blocks of the same width), so that small
    rows take every path Flux's rows take at full size: one or many blocks of
    x, of the head, both, a last block partly masked, and the two-pass loop.
    Bytes and scales equal the reference's of the concatenation, with the
    activation the GLU kernels compute (``_unquantized_activation``)."""

    torch.manual_seed(k * 301 + k_head)
    x = (torch.randn(rows, k) * 3).to(dtype).to(KERNEL_DEVICE)
    head = (torch.randn(rows, k_head) * 2).to(dtype).to(KERNEL_DEVICE) if k_head else None
    q, scale, values = _quantized_in_small_chunks(x, activation, head, chunk_n)
    want_q, want_scale = ref.quantize_fp8_rows(values.cpu())
    assert _same_bytes(q.cpu(), want_q) and torch.equal(scale.cpu(), want_scale)


@pytest.mark.kernels
@pytest.mark.parametrize("k", [40, 200])  # 3 blocks held; the two-pass loop
@pytest.mark.parametrize("activation", ["none", "silu"])
@pytest.mark.parametrize("with_head", [False, True])
def test_kernel_follows_the_non_finite_rule(k, activation, with_head):
    """+inf, -inf, NaN and whole infinite rows, in x and in the head, under the
    scaled-down launch config of the test above: the reference's bytes and
    scales, and the rule itself: a row holding an infinity (after the
    activation) gets an infinite scale and dequantizes to NaN across the row,
    a NaN without one keeps its row's finite scale."""

    inf, nan = float("inf"), float("nan")
    torch.manual_seed(k)
    x = torch.randn(9, k) * 3
    x[1, 3], x[2, k - 1], x[3, 5], x[4], x[5], x[6, 1], x[6, k // 2] = inf, -inf, nan, inf, -inf, inf, -inf
    head = torch.randn(9, 24) * 2
    head[7, 20], head[8, 2] = inf, nan
    x, head = x.to(KERNEL_DEVICE), head.to(KERNEL_DEVICE) if with_head else None
    q, scale, values = _quantized_in_small_chunks(x, activation, head, 16)
    want_q, want_scale = ref.quantize_fp8_rows(values.cpu())
    assert _same_bytes_but_nan_sign(q.cpu(), want_q) and torch.equal(scale.cpu(), want_scale)
    infinite = values.isinf().any(-1)
    assert infinite.sum() >= 3
    assert torch.isinf(scale[infinite]).all() and torch.isfinite(scale[~infinite]).all()
    back = q.float() * scale[:, None]
    assert back[infinite].isnan().all() and torch.equal(back[~infinite].isnan(), values[~infinite].isnan())


def _quantized_under_schedule(x, activation, head, schedule):
    """``quantize_fp8_rows`` with ``schedule`` as the SCHEDULES entry of x's rows,
    and the values the reference quantizes (as :func:`_quantized_in_small_chunks`)."""
    from compile_ops._library import clear_launch_plans

    saved = ops.SCHEDULES
    ops.SCHEDULES = {(activation, 0 if head is None else head.shape[-1], x.shape[-1]): schedule}
    clear_launch_plans()
    try:
        q, scale = compile_ops.quantize_fp8_rows(x, activation, head=head)
    finally:
        ops.SCHEDULES = saved
        clear_launch_plans()
    values = x if activation == "none" else _unquantized_activation(x, activation)
    if head is not None:
        values = torch.cat([head, values], dim=-1)
    return q, scale, values


@pytest.mark.kernels
@given(
    st.integers(1, 13),
    st.one_of(st.just(1), st.integers(2, 120)),
    st.sampled_from([0, 5, 40]),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([16, 32]),
    st.sampled_from(["none", "gelu_tanh", "silu"]),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.sampled_from(["none", "zero_rows", "inf", "nan"]),
)
def test_kernel_schedule_entries_write_the_references_bytes(
    rows, k, k_head, block_m, block_n, activation, dtype, special
):
    """A SCHEDULES entry's launch (tiles of ``block_m`` rows, blocks of 16 or
    32 columns): rows that are not a multiple of a tile's, the last tile
    partly past them, K = 1, K not a multiple of the block, with and without a
    head, all-zero rows (the floor), +-inf and NaN. Bytes and scales equal the reference's of the
    concatenation, with the activation the GLU kernels compute."""
    torch.manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k) * 3
    head = torch.randn(rows, k_head) * 2 if k_head else None
    if special == "zero_rows":
        x[0], x[-1] = 0.0, 0.0
        if head is not None:
            head[0], head[-1] = 0.0, 0.0
    elif special != "none":
        x[-1, k // 2] = float(special)
        x[0, 0] = -float(special)
        if head is not None:
            head[rows // 2, k_head - 1] = float(special)
    x = x.to(dtype).to(KERNEL_DEVICE)
    head = None if head is None else head.to(dtype).to(KERNEL_DEVICE)
    schedule = ops.Schedule(block_m, block_n, 4)
    q, scale, values = _quantized_under_schedule(x, activation, head, schedule)
    want_q, want_scale = ref.quantize_fp8_rows(values.cpu())
    assert _same_bytes_but_nan_sign(q.cpu(), want_q) and torch.equal(scale.cpu(), want_scale)
    if special == "zero_rows":
        assert torch.equal(scale.cpu()[[0, -1]], ref.quantize_fp8_rows(torch.zeros(2, 1))[1])  # the floor


@pytest.mark.kernels
@pytest.mark.parametrize("activation", _TORCH_ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shape, layout",
    [
        ((3, 37), "contiguous"),
        ((4, 64), "column_stride"),
        ((2, 4096 + 37), "contiguous"),
        ((2, 16384 + 37), "contiguous"),
    ],
)  # the last: the two-pass loop
def test_kernel_activation_mode_writes_the_bytes_of_quantizing_the_activation(activation, dtype, shape, layout):
    """Bytes and scales equal to quantizing the activation's own kernel output;
    the distance to torch's activation (other tanh/erf/exp) is reported."""
    torch.manual_seed(shape[-1])
    x = torch.randn(shape[0], shape[1] * (2 if layout == "column_stride" else 1)) * 3
    x = (x[:, ::2] if layout == "column_stride" else x).to(dtype).to(KERNEL_DEVICE)
    q, scale = compile_ops.quantize_fp8_rows(x, activation)
    want_q, want_scale = compile_ops.quantize_fp8_rows(_unquantized_activation(x, activation))
    assert _same_bytes(q, want_q) and torch.equal(scale, want_scale)
    # A head segment (strided rows) before the activation: the concatenation's rows.
    head = (torch.randn(shape[0], shape[1] + 8) * 4).to(dtype).to(KERNEL_DEVICE)[:, 3 : 3 + shape[1] // 2]
    q_cat, scale_cat = compile_ops.quantize_fp8_rows(x, activation, head=head)
    want_q, want_scale = compile_ops.quantize_fp8_rows(torch.cat([head, _unquantized_activation(x, activation)], -1))
    assert _same_bytes(q_cat, want_q) and torch.equal(scale_cat, want_scale)
    exact_q, exact_scale = ref.quantize_fp8_rows(x.cpu(), activation)
    deq, exact = q.cpu().float() * scale.cpu()[:, None], exact_q.float() * exact_scale[:, None]
    print(
        f"{activation} {dtype}: relative L2 to quantizing torch's activation "
        f"{((deq - exact).norm() / exact.norm()).item():.1e}"
    )
