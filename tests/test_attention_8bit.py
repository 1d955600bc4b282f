"""8-bit attention: ``precision="int8"`` (INT8 q k) and ``"int8_fp8"`` (P V in FP8
too), ``attention_fp8_rows`` (FP8 output rows) and attention on q and k
quantized beforehand (``Int8QK``); inference only.

Reference layer: the specification in reference.attention by its properties
(per-token and per-block INT8 quantization after k's smoothing, v's
per-channel e4m3 scales, p rounded against the running max, the FP8 rows'
scale bound) and the statistics pass's chunks; the ops compile with
fullgraph, trace to the Triton quantization passes, and refuse other dtypes,
a gradient, an lse and a GPU without FP8 tensor cores. Kernel layer: the
kernels and quantization passes against the specification (``EIGHT_BIT``'s
bounds), with the distances to exact attention printed. The sm_90 core's
8-bit mode is in test_attention_sm90.py.
"""

import math
import types

import pytest
import torch
from attention_helpers import EIGHT_BIT, _int8_case, _relative_l2
from conftest import INTERPRET, KERNEL_DEVICE
from hypothesis import given
from hypothesis import strategies as st

import compile_ops
from compile_ops.reference import attention as ref


@pytest.mark.kernels
@pytest.mark.parametrize(
    "seq_dim, hq, hk, lq, lk, d",
    [
        (1, 4, 2, 50, 300, 64),  # GQA, a partial last key block
        (2, 2, 2, 130, 256, 128),  # whole key blocks: v needs no row padding
    ],
)
def test_kernels_attention_on_quantized_qk_is_the_8bit_ops(seq_dim, hq, hk, lq, lk, d):
    """``attention(Int8QK, None, v, precision=...)`` (``fused.attention_qk8``)
    given k quantized by the 8-bit ops' own Triton pass and q by the
    specification is bit for bit those ops, whose kernel rounds q itself
    (the same products on the same operands, v quantized alone), in all
    three output forms."""
    from compile_ops.ops import attention_8bit

    torch.manual_seed(0)
    q, k, v = _int8_case(seq_dim, 2, hq, hk, lq, lk, d, torch.float16, KERNEL_DEVICE)
    # q as the kernel rounds it (the specification's, exactly); k from the ops' own Triton pass.
    qk = compile_ops.Int8QK(*ref.smooth_quantize_qk(q, k, seq_dim)[:2], *attention_8bit.quantize_8bit(k, None, seq_dim))
    with torch.no_grad():
        for precision in EIGHT_BIT:
            got = compile_ops.attention(qk, None, v, seq_dim=seq_dim, precision=precision)
            want = compile_ops.attention(q, k, v, seq_dim=seq_dim, precision=precision)
            assert got.dtype == v.dtype and torch.equal(got, want), precision
        got, want = (compile_ops.attention_fp8_rows(a, b, v, seq_dim=seq_dim) for a, b in ((qk, None), (q, k)))
        assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8)) and torch.equal(got.scale, want.scale)


def test_int8_specification_quantizes_per_token_and_smoothing_leaves_attention_exact():
    """The specification in reference.attention: INT8 values in [-127, 127]
    with scales ``amax / 127`` per query token and per block of 128 keys
    (each row's or block's largest value maps to +-127), k's mean removed
    first, which changes no exact attention output; the approximation's
    distance to exact attention is printed."""
    torch.manual_seed(0)
    q, k, v = _int8_case(1, 2, 4, 2, 37, 300, 24, torch.bfloat16, "cpu", key_offset=4.0)
    q8, q_scale, k8, k_scale = ref.smooth_quantize_qk(q, k, seq_dim=1)
    assert q8.dtype == k8.dtype == torch.int8 and q8.shape == q.shape and k8.shape == k.shape
    assert q_scale.shape == (2, 4, 37) and k_scale.shape == (2, 2, 3) and q_scale.is_contiguous()
    assert k_scale.is_contiguous()
    assert int(q8.abs().max()) == 127 and (q8.abs().amax(-1) == 127).all()  # every token uses the full range
    torch.testing.assert_close(q_scale, q.float().abs().amax(-1).transpose(1, 2) / 127)
    smoothed = k.float() - k.float().mean(dim=1, keepdim=True)
    blocks = [smoothed[:, i : i + 128].abs().amax(dim=(1, 3)) for i in (0, 128, 256)]  # [B, Hk] each
    torch.testing.assert_close(k_scale, torch.stack(blocks, dim=-1) / 127)
    for i, start in enumerate((0, 128, 256)):  # every block uses the full range, the last (44 keys) too
        assert (k8[:, start : start + 128].abs().amax(dim=(1, 3)) == 127).all(), i
    torch.testing.assert_close(
        ref.dequantize_int8(k8.transpose(1, 2), k_scale, 128),
        smoothed.transpose(1, 2),
        rtol=0,
        atol=float(k_scale.max()) / 2 * 1.001,
    )
    # Softmax ignores the shift: exact attention with and without the smoothing agree (fp64).
    exact, _ = ref.attention(q.double(), k.double(), v.double(), 0.2, False, 1)
    shifted, _ = ref.attention(q.double(), k.double() - k.double().mean(dim=1, keepdim=True), v.double(), 0.2, False, 1)
    torch.testing.assert_close(shifted, exact, rtol=1e-10, atol=1e-10)
    approx = ref.attention_int8(q, k, v, 0.2, False, 1)
    err = _relative_l2(approx, exact)
    print(f"int8 specification vs exact attention: relative L2 {err:.2e}")
    assert err < 5e-2  # 8-bit q.k: ~1e-2 here; a wrong scale or a missing smoothing is O(1)


@given(
    st.integers(1, 300),
    st.sampled_from([1, 16, 128]),
    st.integers(1, 40),
    st.sampled_from(["normal", "outlier", "zero_block"]),
    st.integers(0, 2**16),
)
def test_int8_block_quantization_properties(length, block, d, kind, seed):
    """quantize_int8 for any length and block: scales ``[B, H, ceil(L / block)]``
    equal to each block's amax / 127 (the floor for an all-zero block, whose
    values stay 0), every value in [-127, 127], the block's largest value at
    +-127, and each dequantized value within half a step of the input (and
    fp32's rounding of the reciprocal scale and of the two products)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, length, d, generator=g)
    if kind == "outlier":
        x[..., length // 2, d // 2] = 1e4
    elif kind == "zero_block":
        x[..., : min(block, length), :] = 0
    q, scale = ref.quantize_int8(x, block)
    blocks = -(-length // block)
    assert q.dtype == torch.int8 and scale.shape == (2, 3, blocks) and scale.dtype == torch.float32
    assert int(q.abs().max()) <= 127
    padded = torch.cat([x.abs().amax(-1), x.new_zeros(2, 3, blocks * block - length)], -1)
    amax = padded.view(2, 3, blocks, block).amax(-1)
    torch.testing.assert_close(scale, (amax / 127).clamp(min=torch.finfo(torch.float32).tiny), rtol=0, atol=0)
    q_amax = torch.cat([q.abs().amax(-1).float(), q.new_zeros(2, 3, blocks * block - length).float()], -1)
    q_amax = q_amax.view(2, 3, blocks, block).amax(-1)
    assert torch.equal(q_amax == 127, amax > 0)  # full range used, zero blocks stay zero
    step = ref.dequantize_int8(q, scale, block) - x
    per_row = scale.repeat_interleave(block, -1)[..., :length, None]
    # Half a step, plus the fp32 rounding of 1 / scale, x * (1 / scale) and q * scale (each at most
    # 127 * 2**-24 steps for |q| <= 127): 1.7e-6 steps over the half were found with a division
    # (length 209, seed 740); a wrong rounding mode errs by up to a whole step.
    assert (step.abs() <= per_row * (0.5 + 3 * 127 * 2.0**-24)).all()


def _exact_of(q, k, v, *args):
    return ref.attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), *args)[0]


def test_fp8_pv_specification_rounds_v_per_channel_and_p_against_the_running_max():
    """quantize_v_fp8: scales ``amax / 448`` per (batch, head, channel) over the
    sequence, each channel's largest value at +-448, values within half an
    e4m3 step. attention_int8_fp8 with one key tile is the direct formula
    (p against the row's max, shifted by 2**8 and rounded, over the sum of
    the unrounded p); with several tiles it stays within e4m3's rounding of
    that formula. Distances to exact attention are printed."""
    torch.manual_seed(0)
    v = torch.randn(2, 3, 200, 24)
    v[0, 1, 5, 7] = 300.0  # an outlier only moves its own channel's scale
    v8, scale = ref.quantize_v_fp8(v)
    assert v8.dtype == torch.float8_e4m3fn and scale.shape == (2, 3, 24)
    torch.testing.assert_close(scale, v.abs().amax(2) / 448, rtol=0, atol=0)
    assert (v8.float().abs().amax(2) == 448).all()
    step = (v8.float() * scale.unsqueeze(2) - v).abs()
    assert (step <= v.abs() / 16 * (1 + 1e-6) + scale.unsqueeze(2) * 2**-10).all()  # 3 mantissa bits, subnormals

    q, k, vv = _int8_case(2, 1, 2, 2, 20, 100, 32, torch.float16, "cpu")
    scale = 32**-0.5
    q8, q_scale, k8, k_scale = ref.smooth_quantize_qk(q, k, 2)
    s = ref.dequantize_int8(q8, q_scale) @ ref.dequantize_int8(k8, k_scale, ref.INT8_KEY_BLOCK).transpose(-1, -2)
    p = torch.exp2((s - s.amax(-1, keepdim=True)) * scale * math.log2(math.e) + ref.P_FP8_SHIFT)
    v8, v_scale = ref.quantize_v_fp8(vv.float())
    direct = (p.to(torch.float8_e4m3fn).float() @ v8.float()) * v_scale.unsqueeze(2) / p.sum(-1, keepdim=True)
    got = ref.attention_int8_fp8(q, k, vv, scale, False, 2)
    torch.testing.assert_close(got, direct.half(), rtol=2e-3, atol=1e-3)  # one tile: the same p up to fp32 ulps

    q, k, vv = _int8_case(1, 2, 4, 2, 37, 300, 24, torch.bfloat16, "cpu", key_offset=4.0)
    tiled = ref.attention_int8_fp8(q, k, vv, 0.2, False, 1)
    int8 = ref.attention_int8(q, k, vv, 0.2, False, 1)
    exact = _exact_of(q, k, vv, 0.2, False, 1)
    err, err_int8 = _relative_l2(tiled, exact), _relative_l2(int8, exact)
    print(f"int8_fp8 specification vs exact attention: relative L2 {err:.2e} (int8 q k alone: {err_int8:.2e})")
    assert err < 6e-2 and _relative_l2(tiled, int8) < 6e-2  # e4m3's 3 mantissa bits: ~3.5e-2; a wrong scale is O(1)


@given(
    st.integers(1, 300),
    st.integers(1, 40),
    st.sampled_from(["normal", "outlier", "zero_channel", "tiny"]),
    st.integers(0, 2**16),
)
def test_fp8_v_quantization_properties(length, d, kind, seed):
    """quantize_v_fp8 for any length and width: scales ``[B, H, D]`` equal to
    each channel's amax / 448 (the floor for an all-zero channel, whose values
    stay 0), each channel's largest value at +-448, and every dequantized value
    within half an e4m3 step of the input: 2**-4 of it in e4m3's normal range,
    2**-10 of the scale below (subnormals), plus fp32's rounding of v * (1 / scale)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(2, 3, length, d, generator=g)
    if kind == "outlier":
        v[..., length // 2, d // 2] = 1e4
    elif kind == "zero_channel":
        v[..., d // 2] = 0
    elif kind == "tiny":
        v = v * 1e-30
    v8, scale = ref.quantize_v_fp8(v)
    assert v8.dtype == torch.float8_e4m3fn and scale.shape == (2, 3, d) and scale.dtype == torch.float32
    amax = v.abs().amax(2)
    torch.testing.assert_close(scale, (amax / 448).clamp(min=torch.finfo(torch.float32).tiny), rtol=0, atol=0)
    values = v8.float()
    assert torch.equal(values.abs().amax(2) == 448, amax > 0)  # full range used, zero channels stay zero
    step = (values * scale.unsqueeze(2) - v).abs()
    bound = torch.maximum(v.abs() * 2.0**-4, scale.unsqueeze(2) * 2.0**-10) * (1 + 2.0**-20)
    assert (step <= bound).all()


@pytest.mark.kernels
@pytest.mark.parametrize("precision", list(EIGHT_BIT))
@pytest.mark.parametrize(
    "seq_dim, causal, lengths, hq, hk, lq, lk, d",
    [
        (2, False, None, 2, 2, 130, 300, 64),  # two query tiles, three key tiles (the last partial)
        (1, True, None, 4, 2, 50, 166, 40),  # [B, L, H, D], GQA, Lq != Lk, D padded
        (2, False, (30, 266), 2, 1, 33, 266, 128),  # padded keys, MQA
        (1, False, None, 2, 2, 40, 256, 32),  # Lk a multiple of 16: FP8 P V's transposed v needs no row padding
    ],
)
def test_kernels_int8_match_the_same_quantization(precision, seq_dim, causal, lengths, hq, hk, lq, lk, d):
    """The kernel against its specification (``EIGHT_BIT``: same quantized
    operands, the same steps); the distance of both to exact attention is
    printed."""
    spec, bounds = EIGHT_BIT[precision]
    torch.manual_seed(0)
    dtypes = [torch.float16] + ([] if INTERPRET else [torch.bfloat16])
    for dtype in dtypes:
        q, k, v = _int8_case(seq_dim, 2, hq, hk, lq, lk, d, dtype, KERNEL_DEVICE)
        kv_lengths = None if lengths is None else torch.tensor(lengths, device=KERNEL_DEVICE)
        with torch.no_grad():
            got = compile_ops.attention(
                q, k, v, causal=causal, seq_dim=seq_dim, kv_lengths=kv_lengths, precision=precision
            )
        assert got.dtype == dtype and got.shape == q.shape
        lengths_cpu = None if kv_lengths is None else kv_lengths.cpu()
        want = spec(q.cpu(), k.cpu(), v.cpu(), d**-0.5, causal, seq_dim, lengths_cpu)
        exact = _exact_of(q, k, v, d**-0.5, causal, seq_dim, lengths_cpu)
        to_spec, to_exact = _relative_l2(got.cpu(), want), _relative_l2(got.cpu(), exact)
        print(f"{dtype} {precision} kernel: to the specification {to_spec:.2e}, to exact attention {to_exact:.2e}")
        assert to_spec < bounds[dtype], to_spec


def _e4m3_index(x: torch.Tensor) -> torch.Tensor:
    """Each e4m3 value's signed position on e4m3's number line (+-0 at 0):
    adjacent representable values differ by 1."""
    bits = x.view(torch.uint8).int()
    magnitude = bits & 0x7F
    return torch.where(bits & 0x80 > 0, -magnitude, magnitude)


@pytest.mark.kernels
@pytest.mark.parametrize("b, hk, d", [(3, 2, 16), (2, 40, 128), (1, 1, 5)])
def test_kernels_fp8_rows_scale_bound_is_the_reference_bit_for_bit(b, hk, d):
    """The FP8 rows' scale bound that eager calls compute by a kernel
    (``fp8_rows_scale_kernel``) equals ``reference.attention.fp8_rows_scale``
    exactly: the largest channel scale of each batch element (placed last,
    past the kernel loop's first block at Hk * D = 5120), the floor for an
    all-zero v (batch element 0), and the headroom factor."""
    from compile_ops.ops.attention_8bit import fp8_rows_scale

    torch.manual_seed(0)
    v_scale = torch.rand(b, hk, d) * torch.logspace(-6, 2, b)[:, None, None]
    v_scale[1:, -1, -1] *= 4.0  # each largest in the last channel: past the loop's first block at 5120
    v_scale[0] = 0.0
    v_scale = v_scale.to(KERNEL_DEVICE)
    got = fp8_rows_scale(v_scale)
    assert got.shape == (b,) and got.dtype == torch.float32
    assert torch.equal(got, ref.fp8_rows_scale(v_scale))


def test_fp8_rows_specification_bounds_the_output_by_v_and_rounds_it_once():
    """attention_int8_fp8_rows: one scale per batch element, twice the largest
    of v's channel scales (the floor for an all-zero v), on every row; no
    value saturates (|out| <= 448 * v_scale of its channel, p's rounding
    adds at most 2**-4); every value is out's fp32 result rounded once to
    e4m3 (within half a step of attention_int8_fp8's, which rounds out to
    16 bits first). The cost of the bound against a per-row amax scale is
    printed: e4m3's exponent keeps it small."""
    from compile_ops.reference import fp8 as ref_fp8

    torch.manual_seed(0)
    q, k, v = _int8_case(1, 2, 4, 2, 70, 300, 32, torch.bfloat16, "cpu")
    v[1, :, 1, 5] *= 40.0  # an outlier channel in one batch element: only its scale moves
    values, row_scale = ref.attention_int8_fp8_rows(q, k, v, 0.2, False, 1)
    assert values.shape == (2, 70, 4, 32) and values.dtype == torch.float8_e4m3fn
    assert row_scale.shape == (2, 70) and row_scale.dtype == torch.float32
    _, v_scale = ref.quantize_v_fp8(v.float().transpose(1, 2))
    want_scale = 2 * v_scale.flatten(1).amax(1)
    assert torch.equal(row_scale, want_scale[:, None].expand(2, 70))
    assert want_scale[1] > 10 * want_scale[0]
    assert values.float().abs().max() < 448 * 17 / 32  # |out| / scale <= 224 (1 + 2**-4): nothing clamps
    out16 = ref.attention_int8_fp8(q, k, v, 0.2, False, 1).float()
    dequantized = values.float() * row_scale[:, :, None, None]
    step = torch.maximum(out16.abs() * 2.0**-4, row_scale[:, :, None, None] * 2.0**-9)
    assert ((dequantized - out16).abs() <= step).all()  # half a step from fp32, plus bf16's rounding of out16
    per_row = ref_fp8.quantize_fp8_rows(out16.flatten(2, 3))
    per_row = (per_row[0].float() * per_row[1][..., None]).unflatten(2, (4, 32))
    for b in range(2):  # batch 1's rows are dominated by the outlier channel, which a per-row scale hits exactly
        err, per_row_err = _relative_l2(dequantized[b], out16[b]), _relative_l2(per_row[b], out16[b])
        print(
            f"FP8 rows against the 16-bit output, batch {b}: bound scale {err:.2e}, per-row amax scale "
            f"{per_row_err:.2e}"
        )
        assert err < 4e-2

    zeros, zero_scale = ref.attention_int8_fp8_rows(q, k, torch.zeros_like(v), 0.2, False, 1)
    assert (zeros.float() == 0).all() and torch.isfinite(zero_scale).all() and (zero_scale > 0).all()


@pytest.mark.kernels
@pytest.mark.parametrize(
    "seq_dim, causal, lengths, hq, hk, lq, lk, d",
    [
        (1, False, None, 2, 2, 130, 300, 64),  # two query tiles, a partial last key tile
        (2, True, (30, 266), 4, 2, 50, 266, 40),  # SDPA's layout in, [B, L, H, D] rows out; GQA, padded keys, D padded
    ],
)
def test_kernels_fp8_rows_match_the_specification(seq_dim, causal, lengths, hq, hk, lq, lk, d):
    """The FP8 output epilogue. Exactly: its scales equal the specification's,
    and its values are the same kernel's 16-bit output (``precision="int8_fp8"``)
    times the scale's reciprocal rounded to e4m3, within one step (the 16-bit
    output was rounded once more) and rarely off at all. Against the
    specification (attention_int8_fp8_rows) as a whole, dequantized: the
    16-bit kernel's distance to its specification plus e4m3's rounding of
    that difference. Distances are printed, with the rows' to exact attention."""
    torch.manual_seed(0)
    q, k, v = _int8_case(seq_dim, 2, hq, hk, lq, lk, d, torch.float16, KERNEL_DEVICE)
    kv_lengths = None if lengths is None else torch.tensor(lengths, device=KERNEL_DEVICE)
    with torch.no_grad():
        rows = compile_ops.attention_fp8_rows(q, k, v, causal=causal, seq_dim=seq_dim, kv_lengths=kv_lengths)
        out16 = compile_ops.attention(
            q, k, v, causal=causal, seq_dim=seq_dim, kv_lengths=kv_lengths, precision="int8_fp8"
        )
    assert rows.q.shape == (2, lq, hq * d) and rows.q.dtype == torch.float8_e4m3fn and rows.scale.shape == (2, lq)
    lengths_cpu = None if kv_lengths is None else kv_lengths.cpu()
    want, want_scale = ref.attention_int8_fp8_rows(q.cpu(), k.cpu(), v.cpu(), d**-0.5, causal, seq_dim, lengths_cpu)
    assert torch.equal(rows.scale.cpu(), want_scale)
    out16 = (out16 if seq_dim == 1 else out16.transpose(1, 2)).flatten(2, 3).cpu().float()
    inverse = torch.ones_like(want_scale) / want_scale
    rounded = (out16 * inverse[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    steps = (_e4m3_index(rows.q.cpu()) - _e4m3_index(rounded)).abs()
    assert steps.max() <= 1 and steps.float().mean() < 0.01, (steps.max(), steps.float().mean())
    dequantized = rows.q.cpu().double() * want_scale[..., None].double()
    to_spec = _relative_l2(dequantized, want.flatten(2, 3).double() * want_scale[..., None].double())
    exact = _exact_of(q, k, v, d**-0.5, causal, seq_dim, lengths_cpu)
    to_exact = _relative_l2(dequantized, (exact if seq_dim == 1 else exact.transpose(1, 2)).flatten(2, 3))
    print(
        f"FP8 rows kernel: {steps.float().mean():.2%} of values a step from its 16-bit output's; to the "
        f"specification {to_spec:.2e}, to exact attention {to_exact:.2e}"
    )
    assert to_spec < 3e-2, to_spec  # a wrong scale or layout is O(1)


def test_fp8_rows_compile_with_fullgraph_and_refuse_a_gradient():
    torch.manual_seed(0)
    q, k, v = _int8_case(1, 1, 2, 2, 9, 9, 16, torch.float16, "cpu")
    attend = lambda q, k, v: compile_ops.attention_fp8_rows(q, k, v, seq_dim=1)  # noqa: E731
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, v), attend(q, k, v)
    assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8)) and torch.equal(got.scale, want.scale)
    torch._dynamo.reset()
    q.requires_grad_()
    with pytest.raises(RuntimeError, match="compile_ops.attention_fp8_rows: an input requires grad"):
        compile_ops.attention_fp8_rows(q, k, v, seq_dim=1)
    with pytest.raises(TypeError, match="fused.attention_int8_fp8_rows: q, k and v must be float16 or bfloat16"):
        with torch.no_grad():
            compile_ops.attention_fp8_rows(q.float(), k.float(), v.float(), seq_dim=1)


@pytest.mark.kernels
@pytest.mark.parametrize("stat_step, stat_chunk_rows", [(128, 1024), (64, 64), (16, 16)])
@pytest.mark.parametrize(
    "seq_dim, b, hq, hk, lq, lk, d",
    [
        (1, 2, 4, 2, 50, 300, 40),  # GQA, D padded, a partial last key block, v's rows padded to 16
        (2, 1, 2, 2, 130, 256, 64),  # two q tiles, whole key blocks, no row padding
        (2, 2, 2, 1, 20, 100, 64),  # one key block
    ],
)
def test_kernels_8bit_quantization_writes_the_specified_operands(
    seq_dim, b, hq, hk, lq, lk, d, stat_step, stat_chunk_rows, monkeypatch
):
    """quantize_8bit (the Triton passes the 8-bit ops run) against the torch
    specification: v's channel scales and e4m3 bytes identical; k's int8
    values within 1 of it (its mean is summed in another order) and its
    block scales within an fp32 rounding. (q is rounded by the attention
    kernel: ``test_kernels_attention_on_quantized_qk_is_the_8bit_ops``.)
    The statistics pass as launched (one chunk a head at these lengths),
    in 64-key chunks (2 to 5 a head) and in 16-key ones: up to 19 chunks a
    head, so that the last chunk's sum of the head's partials takes two of
    its 16-row steps (a wrong step, or a total summed before every chunk
    arrived, shows). v's row padding (4 and 12 keys in the first and third
    cases) holds zero keys, and its keys are in the operand order."""
    from compile_ops.ops import attention_8bit

    monkeypatch.setattr(attention_8bit, "STAT_STEP", stat_step)
    monkeypatch.setattr(attention_8bit, "STAT_CHUNK_ROWS", stat_chunk_rows)
    launched, launcher = [], attention_8bit.launcher
    monkeypatch.setattr(
        attention_8bit, "launcher", lambda kernel: launched.append(kernel.fn.__name__) or launcher(kernel)
    )
    torch.manual_seed(0)
    q, k, v = _int8_case(seq_dim, b, hq, hk, lq, lk, d, torch.float16, KERNEL_DEVICE, key_offset=3.0)
    operands = attention_8bit.quantize_8bit(k, v, seq_dim)
    assert launched == ["kv8_counters_clear_kernel", "kv8_stats_kernel", "kv8_quantize_kernel"], launched
    k8, k_scale, vt8, v_scale = (t.cpu() for t in operands)
    want_k8, want_k_scale = ref.smooth_quantize_qk(q.cpu(), k.cpu(), seq_dim)[2:]
    want_vt8, want_v_scale = attention_8bit.fp8_values_transposed(v.cpu(), seq_dim)
    assert torch.equal(v_scale, want_v_scale)
    # v's rows are padded to 16 keys, with zero keys, and hold them in the FP8 operand's order.
    assert vt8.shape[-1] == lk + -lk % 16 and vt8.stride(3) == 1
    assert torch.equal(vt8.view(torch.uint8), want_vt8.view(torch.uint8))
    in_key_order = torch.empty_like(vt8.view(torch.uint8))
    in_key_order[..., attention_8bit.fp8_operand_key_order(vt8.shape[-1])] = vt8.view(torch.uint8)
    plain = ref.quantize_v_fp8(v.cpu().float() if seq_dim == 2 else v.cpu().float().transpose(1, 2))[0]
    assert torch.equal(in_key_order[..., :lk], plain.transpose(2, 3).view(torch.uint8))
    assert not in_key_order[..., lk:].any()
    assert (k8.int() - want_k8.int()).abs().max() <= 1 and (k8 != want_k8).float().mean() < 1e-3
    torch.testing.assert_close(k_scale, want_k_scale, rtol=1e-6, atol=0)


@pytest.mark.parametrize("lk", [1, 127, 1024, 1025, 4608, 32760, 131072, 131073, 10**6])
def test_8bit_statistics_chunks_cover_the_keys_within_their_bounds(lk):
    """The statistics pass's chunks (``stat_rows_per_chunk``): whole steps
    of STAT_STEP keys that cover the keys with no chunk empty, STAT_CHUNK_ROWS
    keys each up to MAX_STAT_CHUNKS a head, longer past it (where no fewer
    steps a chunk keep within MAX_STAT_CHUNKS)."""
    from compile_ops.ops import attention_8bit

    step, most = attention_8bit.STAT_STEP, attention_8bit.MAX_STAT_CHUNKS
    rows = attention_8bit.stat_rows_per_chunk(lk)
    chunks = -(-lk // rows)
    assert rows % step == 0 and (chunks - 1) * rows < lk <= chunks * rows
    assert 1 <= chunks <= most
    if lk <= most * attention_8bit.STAT_CHUNK_ROWS:
        assert rows == attention_8bit.STAT_CHUNK_ROWS
    else:
        assert -(-lk // (rows - step)) > most, (rows, chunks)


@pytest.mark.parametrize("precision", list(EIGHT_BIT))
def test_8bit_ops_quantize_by_the_triton_passes_when_traced_too(precision):
    """Traced on fake tensors (what torch.compile lowers, torch.export), the
    op body is ``quantize_8bit``'s Triton passes and the attention kernel: k's
    (and for FP8 P V v's) sequence statistics, k's (and v's) quantization,
    then attention, which rounds q itself (``QUANTIZE_Q``); not the
    specification's torch ops, which Inductor fused into slower code
    (docs/notes/attention-8bit.md, "The 8-bit quantization passes")."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from compile_ops._library import OP_BODIES

    op = {"int8": "fused::attention_int8", "int8_fp8": "fused::attention_int8_fp8"}[precision]
    with FakeTensorMode():
        q, k, v = (torch.empty(1, 200, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        gm = make_fx(lambda *a: OP_BODIES[op](*a))(q, k, v, 0.125, False, 1, None)
    launched = [
        kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__
        for n in gm.graph.nodes
        if n.target is torch.ops.higher_order.triton_kernel_wrapper_mutation
    ]
    assert launched == ["kv8_counters_clear_kernel", "kv8_stats_kernel", "kv8_quantize_kernel", "attn_fwd_kernel"], (
        launched
    )
    attention = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.triton_kernel_wrapper_mutation][-1]
    arguments = dict(
        attention.kwargs["kwargs"], **kernel_side_table.get_constant_args(attention.kwargs["constant_args_idx"])
    )
    assert arguments["QUANTIZE_Q"] is True and arguments["INT8"] is True and arguments["Q_SCALE"] is None
    assert arguments["Q"].meta["val"].dtype == torch.bfloat16
    torch_ops = {n.target for n in gm.graph.nodes if n.op == "call_function"} - {
        torch.ops.higher_order.triton_kernel_wrapper_mutation
    }
    assert not any("div" in str(t) or "round" in str(t) or "amax" in str(t) for t in torch_ops), torch_ops


@pytest.mark.parametrize("precision", list(EIGHT_BIT))
def test_int8_compiles_with_fullgraph_and_equals_eager(precision):
    torch.manual_seed(0)
    q, k, v = _int8_case(1, 1, 2, 2, 9, 9, 16, torch.float16, "cpu")
    attend = lambda q, k, v: compile_ops.attention(q, k, v, seq_dim=1, precision=precision)  # noqa: E731
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), attend(q, k, v), rtol=0, atol=0)
    torch._dynamo.reset()


@pytest.mark.parametrize("precision", list(EIGHT_BIT))
def test_int8_refuses_other_dtypes_a_gradient_and_an_lse(precision):
    op = EIGHT_BIT[precision][0].__name__
    q, k, v = _int8_case(2, 1, 2, 2, 8, 8, 16, torch.float16, "cpu")
    with pytest.raises(TypeError, match=f"fused.{op}: q, k and v must be float16 or bfloat16"):
        compile_ops.attention(q.float(), k.float(), v.float(), precision=precision)
    with pytest.raises(ValueError, match=f"precision='{precision}' returns no lse"):
        compile_ops.attention(q, k, v, precision=precision, return_lse=True)
    with pytest.raises(ValueError, match="precision must be one of"):
        compile_ops.attention(q, k, v, precision="fp4")
    q.requires_grad_()
    out = compile_ops.attention(q, k, v, precision=precision)
    with pytest.raises(RuntimeError, match=f"fused.{op} is inference only"):
        out.float().sum().backward()


def test_fp8_pv_refuses_a_gpu_without_fp8_tensor_cores(monkeypatch):
    """On a CUDA GPU below sm_89 the op names the capability it needs (checked
    with the capability lookup faked: no such GPU here)."""
    from compile_ops import _library

    monkeypatch.setattr(_library, "HAS_CUDA", True)
    monkeypatch.setattr(_library, "cuda_capability", lambda index: (8, 0, "NVIDIA A100"))
    on_cuda = types.SimpleNamespace(device=torch.device("cuda", 0))  # all the check reads
    with pytest.raises(RuntimeError, match=r"P V in FP8\) needs FP8 tensor cores \(sm_89 or newer.*A100 is sm_80"):
        _library.require_fp8_mma(on_cuda, "precision='int8_fp8' attention (P V in FP8)")
    monkeypatch.setattr(_library, "cuda_capability", lambda index: (9, 0, "NVIDIA H100"))
    assert _library.require_fp8_mma(on_cuda, "FP8 P V")


@pytest.mark.kernels
@pytest.mark.parametrize("mode", ["q rounded by the kernel", "fp8 rows", "block lists in a token order"])
def test_kernels_capped_forward_op_is_the_uncapped_launch_bit_for_bit(mode, monkeypatch):
    """FP8 P V on sm_90 runs under a register cap (``attention_tiles.INT8_FP8_MAXNREG``,
    2 stages), which traced calls reach through the opaque
    ``fused_gluon.attention_forward_capped_``. Here the cap is forced on
    (``can_run_gluon``) and ``launch_forward`` called outside an op, as a
    traced call runs it: the launch goes through the op once, and its output
    and lse (the FP8 rows and their scales) equal the uncapped 3-stage
    launch's bit for bit, with q rounded by the kernel or, in a token order
    over block lists, given in int8. On a GPU the cap is real; the
    interpreter ignores it, so there this checks what the op passes on."""
    from compile_ops._library import launch_untraced
    from compile_ops.ops import attention_8bit, attention_launch

    torch.manual_seed(0)
    b, h, length, d, seq_dim = 1, 2, 300, 64, 1
    q, k, v = (torch.randn(b, length, h, d, dtype=torch.float16, device=KERNEL_DEVICE) for _ in range(3))
    blocks = tokens = None
    if mode == "block lists in a token order":
        blocks_per_row = 3  # ceil(300 / 128) key blocks, ascending; the last query block's list empty
        index = torch.arange(blocks_per_row, dtype=torch.int32).expand(b, h, 3, blocks_per_row).contiguous()
        count = torch.tensor([[[3, 2, 0], [1, 3, 0]]], dtype=torch.int32)
        blocks = (index.to(KERNEL_DEVICE), count.to(KERNEL_DEVICE))
        tokens = torch.randperm(length, device=KERNEL_DEVICE)
    fp8_rows = mode == "fp8 rows"

    def forward(capped: bool):
        opened = []

        def through_op(body, *args, **kwargs):
            opened.append(body)
            return launch_untraced(body, *args, **kwargs)

        monkeypatch.setattr(attention_launch, "can_run_gluon", lambda t: capped)
        monkeypatch.setattr(attention_launch, "launch_untraced", through_op)
        operands = attention_8bit.quantized_operands(q, k, v, seq_dim, True, tokens)
        shape = (b, length, h, d)
        out = torch.empty(shape, dtype=torch.float8_e4m3fn if fp8_rows else q.dtype, device=KERNEL_DEVICE)
        scales = torch.empty(b, length, device=KERNEL_DEVICE) if fp8_rows else None
        lse = torch.empty(b, h, length, device=KERNEL_DEVICE)
        attention_8bit.launch_eight_bit(operands, v, out, d**-0.5, False, seq_dim, None, scales, blocks, lse, tokens)
        return out.view(torch.uint8), lse if scales is None else scales, len(opened)

    capped, uncapped = forward(True), forward(False)
    assert capped[2] == 1 and uncapped[2] == 0
    assert torch.equal(capped[0], uncapped[0]) and torch.equal(capped[1], uncapped[1])
