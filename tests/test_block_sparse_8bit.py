"""Block-sparse attention's 8-bit precisions: ``block_sparse_attention(...,
precision="int8" | "int8_fp8")``, inference only.

Reference layer (CPU, no kernel): the op's reference path against the same
approximation restated here, as the kernel runs it: 8-bit attention's
quantization of q, k and v (``reference.attention.smooth_quantize_qk``,
``quantize_v_fp8``: over every key, listed or not), then, per query block,
an online softmax over 128-key tiles that visits its listed blocks only,
ascending, where the specification masks the unlisted ones. Equal up to one
rounding of the output: the same scores, running maxima and rounded
probabilities, the products summed in another grouping.

Kernel layer (``-m kernels``: the GPU, or the interpreter with small shapes
and fp16): the kernel against the specification at the dense 8-bit kernel's
bounds (``attention_helpers.EIGHT_BIT``: the kernel computes the same tiles and
formulas, with or without lists), its lse within the rounding of its biased
integer scores, and both distances to exact attention printed; with every
block listed it is the dense 8-bit op bit for bit. The specification there
takes k's codes and scales as the ops' Triton pass wrote them for the call
(``_specified_on_the_pass_keys``): the pass sums k's mean in another order.
"""

import contextlib
import math
from unittest import mock

import pytest
import torch
from attention_helpers import _SM90, EIGHT_BIT, _int8_case, _relative_l2
from conftest import INTERPRET, KERNEL_DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st
from shapes import examples
from test_attention_8bit import _e4m3_index
from test_block_sparse import _random_lists

import compile_ops
from compile_ops._library import clear_launch_plans
from compile_ops.integrations.sparse_attention import Layout
from compile_ops.reference import attention as dense_ref
from compile_ops.reference import block_sparse as ref

BLOCK = 128
PRECISIONS = ("int8", "int8_fp8")
LOG2E = 1.4426950408889634


def _lists(b, h, lq, lk, density, seed, empty_row, device):
    """Shuffled random lists (key block 0 always listed, so that every query
    sees a key) and, with ``empty_row`` and more than one query block, one
    query block of the first list that lists nothing."""
    index, count = _random_lists(b, h, lq, lk, density, seed, device)
    if empty_row and count.shape[2] > 1:
        count[0, 0, seed % count.shape[2]] = 0
    return index, count


def _bhld(t, seq_dim):
    return t if seq_dim == 2 else t.transpose(1, 2)


def _with_the_pass_keys(call):
    """``(call(), k8, k_scale)``: an 8-bit op call on the kernel device and the
    k codes and block scales (CPU) that the ops' Triton pass
    (``attention_8bit.quantize_8bit``) made for it."""
    from compile_ops.ops import attention_8bit

    quantize, made = attention_8bit.quantize_8bit, []

    def recording(k, v, seq_dim, tokens=None, q=None):
        operands = quantize(k, v, seq_dim, tokens, q)
        made.append(operands[2:4] if q is not None else operands[:2])
        return operands

    clear_launch_plans()  # a call that replays a launch plan runs no Python body to record
    with mock.patch.object(attention_8bit, "quantize_8bit", recording):
        result = call()
    ((k8, k_scale),) = made
    return result, k8.cpu(), k_scale.cpu()


@contextlib.contextmanager
def _specified_on_the_pass_keys(k8, k_scale):
    """Within: the specification's k codes and block scales
    (``reference.attention.smooth_quantize_qk``) are the pass's. The pass sums
    k's mean in another order than torch's CPU sum, an fp32 ulp apart, which
    can move a code by one and a scale by an ulp: the operands differ, not the
    kernel under test, and one moved code weighs its key's whole probability
    in the lse (3x the lse bound in the case a GPU run found). Each use
    checks the pass's values against the specification's at the bounds of
    ``test_kernels_8bit_quantization_writes_the_specified_operands``."""
    specified = dense_ref.smooth_quantize_qk

    def on_the_pass_keys(q, k, seq_dim):
        q8, q_scale, want_k8, want_k_scale = specified(q, k, seq_dim)
        assert (k8.int() - want_k8.int()).abs().max() <= 1
        torch.testing.assert_close(k_scale, want_k_scale, rtol=1e-6, atol=0)
        return q8, q_scale, k8, k_scale

    with mock.patch.object(dense_ref, "smooth_quantize_qk", on_the_pass_keys):
        yield


def _score_rounding_terms(q_hat, q_scale, k_hat, k_scale, scale):
    """``(row_factor, magnitude)``, each ``[B, Hq, Lq]``: a row's largest
    dequantization factor of its integer scores (the kernel rounds its exponent's
    shift ``row * INT8_BIAS`` to fp32: 1.5 of them) and the largest ``sum |q k|``
    of its scores (the specification's fp32 products of D dequantized terms),
    both times ``scale``."""
    group = q_hat.shape[1] // k_hat.shape[1]
    magnitude = (q_hat.abs() @ k_hat.abs().repeat_interleave(group, 1).transpose(-1, -2)).amax(-1) * scale
    row_factor = q_scale * k_scale.amax(-1).repeat_interleave(group, 1)[..., None] * scale
    return row_factor, magnitude


def _lse_bound(q, k, want_lse, seq_dim):
    """``[B, Hq, Lq]``: how far the kernels' lse may lie from the specification's
    ``want_lse`` (rows in q's order) on this q and k (the specification's
    inputs, full precision): a row's score rounding (:func:`_score_rounding_terms`)
    and the row sums of up to Lk fp32 terms on both sides (an absolute error of
    their log)."""
    d, lk, ulp = q.shape[-1], k.shape[seq_dim], 2.0**-24
    q8, q_scale, k8, k_scale = dense_ref.smooth_quantize_qk(q, k, seq_dim)
    q_hat = dense_ref.dequantize_int8(_bhld(q8, seq_dim), q_scale)
    k_hat = dense_ref.dequantize_int8(_bhld(k8, seq_dim), k_scale, BLOCK)
    row_factor, magnitude = _score_rounding_terms(q_hat, q_scale, k_hat, k_scale, d**-0.5)
    return 1.5 * row_factor + (d + 4) * ulp * magnitude + 16 * ulp * want_lse.abs() + (2 * lk + 16) * ulp


def _exponent_slack(q_hat, q_scale, k_hat, k_scale, scale):
    """``[B, Hq, Lq]``: how far (natural log) a kernel's exponent of a score may lie
    from the specification's: the lse check's per-score terms
    (:func:`_score_rounding_terms`, 2 row factors where it takes 1.5) and the
    exponent's own rounding."""
    row_factor, magnitude = _score_rounding_terms(q_hat, q_scale, k_hat, k_scale, scale)
    return 2 * row_factor + (q_hat.shape[-1] + 4) * 2.0**-24 * magnitude + 2.0**-18


def _to_spec_beyond_flips(got, want, slack, seq_dim):
    """The relative L2 distance of ``got`` to the specification's ``want`` (both in
    the call's layout) once each element's difference is cut by its ``slack``
    (``[B, Hq, Lq, D]``, :func:`_restated`'s): what the flips of p across an e4m3
    rounding boundary do not explain. Without it, one flip in an output of a
    single query moves the relative distance past the bound by itself."""
    got, want = _bhld(got, seq_dim).double(), _bhld(want, seq_dim).double()
    return (((got - want).abs() - slack.double()).clamp(min=0).norm() / want.norm()).item()


def _restated(q, k, v, index, count, scale, causal, seq_dim, kv_lengths, pv_fp8):
    """``(out fp32 [B, Hq, Lq, D], lse [B, Hq, Lq], slack fp32 [B, Hq, Lq, D])`` of
    8-bit block-sparse attention as the kernel runs it: the quantized operands,
    then per (batch, head, query block) an online softmax over the listed key
    blocks only, in ascending order (exponents in base 2; with ``pv_fp8`` the
    probabilities scaled by 2**8 and rounded to e4m3 against the running max,
    v's channel scales applied at the end). An empty list gives 0 and an lse of
    -inf. ``slack`` (0 without ``pv_fp8``): per output element, how far it moves
    if each p that lies within :func:`_exponent_slack` of an e4m3 rounding
    boundary rounds to the other side, as a kernel's fp32 exponent may make it
    (the specification's documented freedom: ``reference.attention.attention_int8_fp8``)."""
    q8, q_scale, k8, k_scale = dense_ref.smooth_quantize_qk(q, k, seq_dim)
    q_hat = dense_ref.dequantize_int8(_bhld(q8, seq_dim), q_scale)
    k_hat = dense_ref.dequantize_int8(_bhld(k8, seq_dim), k_scale, BLOCK)
    widen = torch.exp(_exponent_slack(q_hat, q_scale, k_hat, k_scale, scale))
    values = _bhld(v, seq_dim).float()
    v_scale = None
    if pv_fp8:
        v8, v_scale = dense_ref.quantize_v_fp8(values)
        values = v8.float()
    b, hq, lq, d = q_hat.shape
    hk, lk = k_hat.shape[1:3]
    group = hq // hk
    # The scores once, sliced per tile below: the specification's own products.
    scores = q_hat @ k_hat.repeat_interleave(group, 1).transpose(-1, -2)
    shift = dense_ref.P_FP8_SHIFT if pv_fp8 else 0.0
    c = scale * LOG2E
    out = torch.zeros(b, hq, lq, d)
    slack = torch.zeros(b, hq, lq, d)
    lse = torch.full((b, hq, lq), float("-inf"))
    for bi in range(b):
        kv_len = lk if kv_lengths is None else int(kv_lengths[bi])
        for h in range(hq):
            for qb in range(math.ceil(lq / BLOCK)):
                rows = torch.arange(qb * BLOCK, min(lq, (qb + 1) * BLOCK))
                entry = (bi % index.shape[0], h % index.shape[1], qb)
                listed = sorted(index[entry][: int(count[entry])].tolist())
                m = torch.full((rows.numel(),), float("-inf"))
                l = torch.zeros(rows.numel())
                acc = torch.zeros(rows.numel(), d)
                moved = torch.zeros(rows.numel(), d)
                for kb in listed:
                    cols = torch.arange(kb * BLOCK, min(lk, (kb + 1) * BLOCK))
                    tile = scores[bi, h][rows][:, cols]
                    seen = (cols < kv_len)[None, :] & ((cols[None, :] <= rows[:, None]) | (not causal))
                    tile = tile.masked_fill(~seen, float("-inf"))
                    m_new = torch.maximum(m, tile.amax(-1))
                    m_shift = m_new.masked_fill(torch.isneginf(m_new), 0.0)
                    p = torch.exp2((tile - m_shift[:, None]) * c + shift)
                    alpha = torch.exp2((m - m_shift) * c)
                    l = l * alpha + p.sum(-1)
                    weights = p.to(torch.float8_e4m3fn).float() if pv_fp8 else p
                    acc = acc * alpha[:, None] + weights @ values[bi, h // group][cols]
                    if pv_fp8:  # each p rounded to the farther of the roundings its slack reaches
                        w = widen[bi, h, rows][:, None]
                        low, high = ((p * f).to(torch.float8_e4m3fn).float() for f in (1 / w, w))
                        flips = torch.maximum(high - weights, weights - low)
                        moved = moved * alpha[:, None] + flips @ values[bi, h // group][cols].abs()
                    m = m_new
                seen_any = l > 0
                o = acc / torch.where(seen_any, l, 1.0)[:, None]
                moved = moved / torch.where(seen_any, l, 1.0)[:, None]
                if pv_fp8:
                    o = o * v_scale[bi, h // group][None, :]
                    moved = moved * v_scale[bi, h // group][None, :]
                out[bi, h, rows] = o
                slack[bi, h, rows] = moved
                lse[bi, h, rows] = torch.where(seen_any, m * scale + (torch.log2(l) - shift) * math.log(2), -math.inf)
    return out, lse, slack


@st.composite
def eight_bit_cases(draw, kernels: bool):
    """Shapes, layouts, options and lists of an 8-bit block-sparse call:
    batch 1-2, GQA, ragged lengths (partial last blocks), key lengths,
    per-head or shared lists of every density, one empty list."""
    small = kernels and INTERPRET
    precision = draw(st.sampled_from(PRECISIONS))
    dtype = draw(st.sampled_from([torch.float16] if small else [torch.float16, torch.bfloat16]))
    b = draw(st.integers(1, 2))
    hk = draw(st.integers(1, 2))
    hq = hk * draw(st.sampled_from([1, 2]))
    lq = draw(st.sampled_from([1, 97, 129, 300] if small else [1, 97, 129, 300, 700]))
    lk = draw(st.sampled_from([17, 128, 260] if small else [17, 128, 260, 777]))
    d = draw(st.sampled_from([16, 40, 64] if small else [16, 40, 64, 128]))
    seq_dim = draw(st.sampled_from([1, 2]))
    causal = draw(st.booleans())
    per_head = draw(st.booleans())
    kv_lengths = [draw(st.integers(1, lk)) for _ in range(b)] if draw(st.booleans()) else None
    density = draw(st.sampled_from([0.0, 0.3, 0.6, 1.0]))
    empty_row = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return precision, dtype, b, hq, hk, lq, lk, d, seq_dim, causal, per_head, kv_lengths, density, empty_row, seed


def _call(case, device):
    """The case's inputs on ``device``: ``(q, k, v, index, count, kv_lengths)``."""
    precision, dtype, b, hq, hk, lq, lk, d, seq_dim, causal, per_head, kv_lengths, density, empty_row, seed = case
    torch.manual_seed(seed)
    q, k, v = _int8_case(seq_dim, b, hq, hk, lq, lk, d, dtype, device)
    index, count = _lists(b if per_head else 1, hq if per_head else 1, lq, lk, density, seed, empty_row, device)
    kv = None if kv_lengths is None else torch.tensor(kv_lengths, dtype=torch.int32, device=device)
    return q, k, v, index, count, kv


# ---------------------------------------------------------------- reference layer


@settings(max_examples=30)
@given(eight_bit_cases(kernels=False))
def test_8bit_specification_is_the_listed_blocks_walked_as_the_kernel_walks_them(case):
    """The op off the GPU (its specification) against the restatement: the
    same quantization, the listed blocks only, ascending. Within one rounding
    of the output dtype (the probabilities, their e4m3 rounding included, are
    the same bits; only the grouping of the fp32 sums differs), the lse
    within fp32 rounding."""
    precision, dtype, *_, seq_dim, causal, _, _, _, _, _ = case
    q, k, v, index, count, kv = _call(case, "cpu")
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        got, lse = compile_ops.block_sparse_attention(
            q, k, v, index, count, None, causal, seq_dim, kv, return_lse=True, precision=precision
        )
    want, want_lse, _ = _restated(q, k, v, index, count, scale, causal, seq_dim, kv, precision == "int8_fp8")
    assert got.dtype == dtype and got.shape == q.shape
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    torch.testing.assert_close(_bhld(got, seq_dim).float(), want, rtol=ulp, atol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_8bit_specification_with_every_block_listed_is_dense_8bit_attention(precision):
    """Every block listed, the specification is the dense 8-bit one bit for
    bit (the lists' mask adds nothing to the visibility mask), in both
    layouts, causal or with key lengths, GQA; a query block whose list is
    emptied gives 0 and an lse of -inf, and the others keep their bits."""
    torch.manual_seed(0)
    index, count = ref.block_index_from_mask(torch.ones(1, 1, 3, 3, dtype=torch.bool))
    kv = torch.tensor([260, 131], dtype=torch.int32)
    for seq_dim, causal, lengths in ((1, False, kv), (2, True, None)):
        q, k, v = _int8_case(seq_dim, 2, 4, 2, 300, 260, 24, torch.bfloat16, "cpu")
        with torch.no_grad():
            got = compile_ops.block_sparse_attention(
                q, k, v, index, count, None, causal, seq_dim, lengths, precision=precision
            )
            want = compile_ops.attention(q, k, v, None, causal, seq_dim, lengths, precision=precision)
        assert torch.equal(got, want), seq_dim
    emptied = count.clone()
    emptied[0, 0, 1] = 0
    with torch.no_grad():
        got, lse = compile_ops.block_sparse_attention(
            q, k, v, index, emptied, None, True, 2, None, return_lse=True, precision=precision
        )
    assert torch.equal(got[:, :, 128:256], torch.zeros_like(got[:, :, 128:256]))
    assert torch.isneginf(lse[:, :, 128:256]).all() and torch.isfinite(lse[:, :, :128]).all()
    assert torch.equal(got[:, :, :128], want[:, :, :128]) and torch.equal(got[:, :, 256:], want[:, :, 256:])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_8bit_block_sparse_compiles_with_fullgraph_and_equals_eager(precision):
    torch.manual_seed(0)
    q, k, v = _int8_case(1, 1, 2, 1, 300, 260, 16, torch.float16, "cpu")
    index, count = _lists(1, 2, 300, 260, 0.5, 3, True, "cpu")

    def attend(q, k, v):
        return compile_ops.block_sparse_attention(q, k, v, index, count, seq_dim=1, precision=precision)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), attend(q, k, v), rtol=0, atol=0)
    torch._dynamo.reset()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_8bit_block_sparse_refuses_a_gradient_other_dtypes_and_unknown_precisions(precision):
    q, k, v = _int8_case(2, 1, 2, 2, 300, 300, 16, torch.float16, "cpu")
    index, count = ref.block_index_from_mask(torch.ones(1, 2, 3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"fused.block_sparse_attention: q, k and v must be float16 or bfloat16"):
        compile_ops.block_sparse_attention(q.float(), k.float(), v.float(), index, count, precision=precision)
    with pytest.raises(ValueError, match=r"precision must be one of \('exact', 'int8', 'int8_fp8'\), got 'fp4'"):
        compile_ops.block_sparse_attention(q, k, v, index, count, precision="fp4")
    with pytest.raises(ValueError, match=r"fused.block_sparse_attention: precision must be one of"):
        torch.ops.fused.block_sparse_attention(q, k, v, index, count, 0.25, False, 2, None, "fp4")
    # The lists are checked as in the exact precision.
    with pytest.raises(ValueError, match=r"block_index lists a block twice"):
        compile_ops.block_sparse_attention(q, k, v, torch.zeros_like(index), count, precision=precision)
    with pytest.raises(ValueError, match=r"block_count must be in \[0, 3\]"):
        compile_ops.block_sparse_attention(q, k, v, index, count + 1, precision=precision)
    q.requires_grad_()
    out = compile_ops.block_sparse_attention(q, k, v, index, count, precision=precision)
    with pytest.raises(RuntimeError, match=f"precision='{precision}' is inference only"):
        out.float().sum().backward()


# ---------------------------------------------------------------- kernel layer


@pytest.mark.kernels
@settings(max_examples=examples(cpu=6, gpu=20))
@given(eight_bit_cases(kernels=True))
def test_kernels_8bit_match_the_same_quantization_over_random_lists(case):
    """The kernel against the specification: output within the dense 8-bit
    kernel's bounds (``EIGHT_BIT``), 0 for the queries that see no key; lse
    within the rounding of the kernel's biased scores (their exponent's shift
    ``row * INT8_BIAS`` is rounded to fp32: half an ulp of 1.5 * 2**23 row
    factors is 1.5 of them) plus the specification's fp32 products of D
    dequantized terms. Distances to exact attention printed."""
    precision, dtype, *_, seq_dim, causal, _, _, _, _, _ = case
    q, k, v, index, count, kv = _call(case, KERNEL_DEVICE)
    d = q.shape[-1]
    with torch.no_grad():
        (got, lse), k8, k_scale = _with_the_pass_keys(
            lambda: compile_ops.block_sparse_attention(
                q, k, v, index, count, None, causal, seq_dim, kv, return_lse=True, precision=precision
            )
        )
    cpu = [t.cpu() for t in (q, k, v, index, count)] + [None if kv is None else kv.cpu()]
    qc, kc, vc, index, count, kv = cpu
    with _specified_on_the_pass_keys(k8, k_scale):
        want, want_lse = ref.block_sparse_attention(qc, kc, vc, index, count, d**-0.5, causal, seq_dim, kv, precision)
        exact, _ = ref.block_sparse_attention(
            qc.double(), kc.double(), vc.double(), index, count, d**-0.5, causal, seq_dim, kv
        )
        got, lse = got.cpu(), lse.cpu()
        assert got.dtype == dtype and got.shape == q.shape
        unseen = torch.isneginf(want_lse)
        assert torch.equal(torch.isneginf(lse), unseen)
        assert torch.equal(_bhld(got, seq_dim)[unseen], torch.zeros_like(_bhld(got, seq_dim)[unseen]))
        if unseen.all():
            return
        to_spec, to_exact = _relative_l2(got, want), _relative_l2(got, exact)
        slack = _restated(qc, kc, vc, index, count, d**-0.5, causal, seq_dim, kv, precision == "int8_fp8")[2]
        beyond = _to_spec_beyond_flips(got, want, slack, seq_dim)
        print(
            f"{dtype} {precision} block-sparse kernel: to the specification {to_spec:.2e} "
            f"({beyond:.2e} beyond the flips of p), to exact {to_exact:.2e}"
        )
        assert beyond < EIGHT_BIT[precision][1][dtype], (to_spec, beyond)

        bound = _lse_bound(qc, kc, want_lse, seq_dim)
        seen = ~unseen
        assert ((lse - want_lse).abs()[seen] <= bound[seen]).all(), (lse - want_lse).abs()[seen].max()


@pytest.mark.kernels
@pytest.mark.parametrize("precision", PRECISIONS)
def test_kernels_8bit_every_block_listed_equals_dense_8bit_attention_bit_for_bit(precision):
    """With every block listed the block-sparse kernel runs the dense 8-bit
    kernel's tiles in the same order on the same operands (GQA, both
    layouts, causal, key lengths, partial last blocks): the same bits."""
    torch.manual_seed(0)
    for seq_dim, causal in ((1, False), (2, True)):
        q, k, v = _int8_case(seq_dim, 2, 4, 2, 300, 260, 32, torch.float16, KERNEL_DEVICE)
        kv = torch.tensor([260, 131], dtype=torch.int32, device=KERNEL_DEVICE)
        mask = torch.ones(1, 1, 3, 3, dtype=torch.bool, device=KERNEL_DEVICE)
        index, count = compile_ops.block_index_from_mask(mask)
        with torch.no_grad():
            sparse = compile_ops.block_sparse_attention(
                q, k, v, index, count, None, causal, seq_dim, kv, precision=precision
            )
            dense = compile_ops.attention(q, k, v, None, causal, seq_dim, kv, precision=precision)
        assert torch.equal(sparse, dense), (seq_dim, causal)


@pytest.mark.skipif(not _SM90, reason="the Gluon core runs on sm_90 GPUs only")
def test_sm90_core_8bit_over_block_lists_computes_what_the_portable_kernel_does(monkeypatch):
    """The core's INT8_FP8 mode over block lists (each listed block's tile
    takes its k scale), forced on with q given in int8: the portable
    kernel's result (the same formulas: equal up to one rounding of the
    output) over random lists with empty rows, GQA, causal with key lengths
    and both layouts."""
    from compile_ops.ops import attention_8bit, attention_launch, attention_tiles, block_sparse

    for b, h, hk, lq, lk, seq_dim, causal, lengths in [
        (1, 4, 4, 1000, 1000, 2, False, None),
        (2, 8, 2, 333, 4096, 1, False, None),
        (2, 2, 1, 513, 700, 1, True, [600, 1]),
    ]:
        torch.manual_seed(lq + lk)
        q, k, v = _int8_case(seq_dim, b, h, hk, lq, lk, 128, torch.bfloat16, "cuda", key_offset=4.0)
        kv = None if lengths is None else torch.tensor(lengths, dtype=torch.int32, device="cuda")
        index, count = _lists(b, h, lq, lk, 0.5, lq, True, "cuda")
        index = block_sparse.ascending(index, count)
        q8, q_scale, k8, k_scale = dense_ref.smooth_quantize_qk(q, k, seq_dim)
        vt8, v_scale = attention_8bit.quantized_operands(None, None, v, seq_dim, True)

        def forward():
            out = torch.full_like(q, float("nan"))
            lse = torch.empty(b, h, lq, device="cuda")
            attention_launch.launch_forward(
                q8,
                k8,
                vt8,
                out,
                lse,
                128**-0.5,
                causal,
                seq_dim,
                kv,
                (index, count),
                int8_scales=(q_scale, k_scale),
                v_scale=v_scale,
            )
            return out, lse

        with torch.no_grad():
            clear_launch_plans()
            want, want_lse = forward()
            with monkeypatch.context() as m:
                m.setattr(attention_tiles, "SM90_CORE_PRECISIONS", ("exact", "int8_fp8"))
                clear_launch_plans()
                got, got_lse = forward()
        case = (b, h, hk, lq, lk, seq_dim, causal)
        torch.testing.assert_close(got, want, rtol=2.0**-7, atol=1e-5, msg=lambda m: f"{case}: {m}")
        torch.testing.assert_close(got_lse, want_lse, rtol=1e-6, atol=1e-5, msg=lambda m: f"{case}: {m}")
    clear_launch_plans()


# ---------------------------------------------------------------- a token order


def _ordered_call(dtype, seq_dim, b, hq, hk, length, d, per_head, lengths, density, seed, device):
    """Self-attention inputs, random lists and a random token order on ``device``:
    ``(q, k, v, index, count, kv_lengths, token_order)``."""
    torch.manual_seed(seed)
    q, k, v = _int8_case(seq_dim, b, hq, hk, length, length, d, dtype, device)
    index, count = _lists(b if per_head else 1, hq if per_head else 1, length, length, density, seed, False, device)
    kv = None if lengths is None else torch.tensor(lengths, dtype=torch.int32, device=device)
    return q, k, v, index, count, kv, torch.randperm(length).to(device)


def test_a_token_order_is_the_permuted_call_with_its_rows_put_back():
    """``token_order`` (a layout's tile order) is q, k and v permuted along the
    sequence, attended over the lists, and the output and lse rows put back
    at their tokens: bit for bit, in every precision and both layouts, the
    exact one's gradients included (its permutation is torch ops, which
    autograd sees); the result differs from the call without the order."""
    for precision in ("exact", *PRECISIONS):
        for seq_dim in (1, 2):
            q, k, v, index, count, kv, order = _ordered_call(
                torch.bfloat16, seq_dim, 2, 4, 2, 300, 16, True, [300, 170], 0.5, 7, "cpu"
            )
            grad = precision == "exact"
            inputs = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
            with torch.set_grad_enabled(grad):
                got, lse = compile_ops.block_sparse_attention(
                    *inputs, index, count, None, False, seq_dim, kv, True, precision, order
                )
                permuted = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
                out, want_lse = compile_ops.block_sparse_attention(
                    *(t.index_select(seq_dim, order) for t in permuted),
                    index,
                    count,
                    None,
                    False,
                    seq_dim,
                    kv,
                    True,
                    precision,
                )
            want = torch.empty_like(out).index_copy(seq_dim, order, out)
            assert torch.equal(got, want), (precision, seq_dim)
            assert torch.equal(lse, torch.empty_like(want_lse).index_copy(2, order, want_lse))
            unordered = compile_ops.block_sparse_attention(
                q, k, v, index, count, None, False, seq_dim, kv, precision=precision
            )
            assert _relative_l2(got.detach(), unordered) > 0.1
            if grad:
                g = torch.randn_like(got)
                torch.autograd.backward(got, g)
                torch.autograd.backward(want, g)
                for mine, theirs in zip(inputs, permuted):
                    assert torch.equal(mine.grad, theirs.grad)


def test_a_token_order_is_refused_where_it_has_no_meaning():
    q, k, v, index, count, _, order = _ordered_call(torch.float16, 1, 1, 2, 2, 300, 16, False, None, 1.0, 1, "cpu")
    call = compile_ops.block_sparse_attention
    with pytest.raises(ValueError, match=r"token_order must have shape \[Lq\] = \[300\], got \(299,\)"):
        call(q, k, v, index, count, seq_dim=1, precision="int8", token_order=order[:299])
    with pytest.raises(TypeError, match=r"token_order must be int32 or int64, got torch.float32"):
        call(q, k, v, index, count, seq_dim=1, precision="int8", token_order=order.float())
    with pytest.raises(ValueError, match=r"token_order must be a permutation of 0 \.\. 299"):
        call(q, k, v, index, count, seq_dim=1, precision="int8", token_order=torch.zeros_like(order))
    with pytest.raises(ValueError, match=r"token_order must be a permutation"):
        call(q, k, v, index, count, seq_dim=1, token_order=order.flip(0).clamp(max=298))
    with pytest.raises(ValueError, match=r"token_order takes causal=False"):
        call(q, k, v, index, count, causal=True, seq_dim=1, precision="int8_fp8", token_order=order)
    with pytest.raises(ValueError, match=r"Lk must equal Lq, got Lq=300, Lk=128"):
        call(q, k[:, :128], v[:, :128], index[..., :1], count.clamp(max=1), seq_dim=1, token_order=order)
    # The op itself: exact attention in a token order is the public function's (its backward).
    with pytest.raises(ValueError, match=r"fused.block_sparse_attention: token_order runs in the 8-bit precisions"):
        torch.ops.fused.block_sparse_attention(q, k, v, index, count, 0.25, False, 1, None, "exact", order)


@st.composite
def ordered_cases(draw):
    """An 8-bit self-attention call in a random token order: batch 1-2, GQA,
    ragged lengths (a partial last block), key lengths, per-head or shared
    lists of every density."""
    small = INTERPRET
    precision = draw(st.sampled_from(PRECISIONS))
    dtype = draw(st.sampled_from([torch.float16] if small else [torch.float16, torch.bfloat16]))
    b = draw(st.integers(1, 2))
    hk = draw(st.integers(1, 2))
    hq = hk * draw(st.sampled_from([1, 2]))
    length = draw(st.sampled_from([97, 129, 300] if small else [97, 129, 300, 777]))
    d = draw(st.sampled_from([16, 64] if small else [16, 64, 128]))
    seq_dim = draw(st.sampled_from([1, 2]))
    per_head = draw(st.booleans())
    lengths = [draw(st.integers(1, length)) for _ in range(b)] if draw(st.booleans()) else None
    density = draw(st.sampled_from([0.3, 0.6, 1.0]))
    seed = draw(st.integers(0, 2**16))
    return precision, dtype, seq_dim, b, hq, hk, length, d, per_head, lengths, density, seed


@pytest.mark.kernels
@settings(max_examples=examples(cpu=4, gpu=20))
@given(ordered_cases())
def test_kernels_8bit_in_a_token_order_match_the_specification(case):
    """The kernels reading q, k and v through a token order (the attention
    kernel's q rows and the quantizing pass's k and v rows gathered, the
    output and lse rows stored at their tokens) against the specification
    of the permuted call: output within the dense 8-bit kernel's bounds, 0
    where a query sees no key; the lse within the rounding bound of
    ``test_kernels_8bit_match_the_same_quantization_over_random_lists``, taken
    on the permuted call (a row stored at another token's place is off by
    far more)."""
    precision, dtype, seq_dim = case[:3]
    q, k, v, index, count, kv, order = _ordered_call(*case[1:], KERNEL_DEVICE)
    with torch.no_grad():
        (got, lse), k8, k_scale = _with_the_pass_keys(
            lambda: compile_ops.block_sparse_attention(
                q, k, v, index, count, None, False, seq_dim, kv, True, precision, order
            )
        )
    qc, kc, vc, index, count, order = (t.cpu() for t in (q, k, v, index, count, order))
    kv = None if kv is None else kv.cpu()
    with _specified_on_the_pass_keys(k8, k_scale):
        d = q.shape[-1]
        want, want_lse = ref.block_sparse_attention(
            qc, kc, vc, index, count, d**-0.5, False, seq_dim, kv, precision, order
        )
        got, lse = got.cpu(), lse.cpu()
        unseen = torch.isneginf(want_lse)
        assert torch.equal(torch.isneginf(lse), unseen)
        assert torch.equal(_bhld(got, seq_dim)[unseen], torch.zeros_like(_bhld(got, seq_dim)[unseen]))
        if unseen.all():
            return
        to_spec = _relative_l2(got, want)
        # The flips' slack of the permuted call (q, k, v in tile order), its rows put back at their tokens.
        tiled = (t.index_select(seq_dim, order) for t in (qc, kc, vc))
        slack = torch.empty(_bhld(want, seq_dim).shape)
        slack[:, :, order] = _restated(*tiled, index, count, d**-0.5, False, seq_dim, kv, precision == "int8_fp8")[2]
        beyond = _to_spec_beyond_flips(got, want, slack, seq_dim)
        print(
            f"{dtype} {precision} block-sparse kernel in a token order: to the specification {to_spec:.2e} "
            f"({beyond:.2e} beyond the flips of p)"
        )
        assert beyond < EIGHT_BIT[precision][1][dtype], (to_spec, beyond)
        # The lse within the other property's bound, taken on the permuted call, its rows put back at their tokens.
        tiled_q, tiled_k = (t.index_select(seq_dim, order) for t in (qc, kc))
        bound = torch.empty_like(want_lse)
        bound[:, :, order] = _lse_bound(tiled_q, tiled_k, want_lse[:, :, order], seq_dim)
        seen = ~unseen
        assert ((lse - want_lse).abs()[seen] <= bound[seen]).all(), (lse - want_lse).abs()[seen].max()


# ---------------------------------------------------------------- FP8 output rows


@pytest.mark.kernels
@pytest.mark.parametrize(
    "seq_dim, b, hq, hk, length, d, per_head, lengths",
    [
        (1, 2, 2, 1, 300, 64, True, [300, 170]),  # GQA, a partial last block, key lengths, per-head lists
        (2, 1, 2, 2, 129, 16, False, None),  # SDPA's layout in, [B, L, H, D] rows out; shared lists
    ],
)
def test_kernels_fp8_rows_in_a_token_order_are_the_16bit_output_rounded_once(
    seq_dim, b, hq, hk, length, d, per_head, lengths
):
    """``block_sparse_attention_fp8_rows`` in a token order (the epilogue
    scattering e4m3 rows and their scales to the tokens' places): its scales
    equal the specification's exactly; its values are the same kernel's
    16-bit ``"int8_fp8"`` output times the scale's reciprocal rounded to e4m3,
    within one step (that output was rounded once more) and rarely off at
    all; a query block that lists nothing gives zeros. Against the
    specification as a whole, dequantized, within the 16-bit kernel's bound
    plus e4m3's rounding; printed with the distance to exact attention."""
    q, k, v, index, count, kv, order = _ordered_call(
        torch.float16, seq_dim, b, hq, hk, length, d, per_head, lengths, 0.5, 3, KERNEL_DEVICE
    )
    count[0, 0, 1] = 0  # query block 1 of the first list sees nothing
    with torch.no_grad():
        rows = compile_ops.block_sparse_attention_fp8_rows(q, k, v, index, count, None, False, seq_dim, kv, order)
        out16 = compile_ops.block_sparse_attention(
            q, k, v, index, count, None, False, seq_dim, kv, precision="int8_fp8", token_order=order
        )
    assert rows.q.shape == (b, length, hq * d) and rows.q.dtype == torch.float8_e4m3fn
    qc, kc, vc, index, count, order = (t.cpu() for t in (q, k, v, index, count, order))
    kv = None if kv is None else kv.cpu()
    want, want_scale = ref.block_sparse_attention_int8_fp8_rows(
        qc, kc, vc, index, count, d**-0.5, False, seq_dim, kv, order
    )
    assert torch.equal(rows.scale.cpu(), want_scale)
    out16 = (out16 if seq_dim == 1 else out16.transpose(1, 2)).flatten(2, 3).cpu().float()
    inverse = torch.ones_like(want_scale) / want_scale
    rounded = (out16 * inverse[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    steps = (_e4m3_index(rows.q.cpu()) - _e4m3_index(rounded)).abs()
    assert steps.max() <= 1 and steps.float().mean() < 0.01, (steps.max(), steps.float().mean())
    unseen = order[BLOCK : 2 * BLOCK]  # the tokens of query block 1 in the token order
    head0 = rows.q.cpu().unflatten(2, (hq, d))[0][unseen, 0].float()
    assert torch.equal(head0, torch.zeros_like(head0))
    dequantized = rows.q.cpu().double() * want_scale[..., None].double()
    to_spec = _relative_l2(dequantized, want.flatten(2, 3).double() * want_scale[..., None].double())
    exact = dense_ref.attention(qc.double(), kc.double(), vc.double(), d**-0.5, False, seq_dim, kv)[0]
    to_exact = _relative_l2(dequantized, (exact if seq_dim == 1 else exact.transpose(1, 2)).flatten(2, 3))
    print(
        f"block-sparse FP8 rows: {steps.float().mean():.2%} of values a step from the 16-bit output's; to the "
        f"specification {to_spec:.2e}, to exact attention (every key) {to_exact:.2e}"
    )
    assert to_spec < 3e-2, to_spec  # a wrong scale, layout or token is O(1)


def test_fp8_rows_refuse_a_gradient_other_dtypes_and_a_layout_mode_without_fp8_pv():
    q, k, v, index, count, _, order = _ordered_call(torch.float16, 1, 1, 2, 2, 300, 16, False, None, 1.0, 1, "cpu")
    call = compile_ops.block_sparse_attention_fp8_rows
    with pytest.raises(TypeError, match="fused.block_sparse_attention_int8_fp8_rows: q, k and v must be float16"):
        call(q.float(), k.float(), v.float(), index, count, seq_dim=1, token_order=order)
    with pytest.raises(ValueError, match=r"fused.block_sparse_attention_int8_fp8_rows: token_order must have shape"):
        call(q, k, v, index, count, seq_dim=1, token_order=order[:-1])
    with pytest.raises(RuntimeError, match="compile_ops.block_sparse_attention_fp8_rows: an input requires grad"):
        call(q.requires_grad_(), k, v, index, count, seq_dim=1)
    layout = Layout.from_mask(None, torch.ones(3, 3, dtype=torch.bool), 300)
    with pytest.raises(ValueError, match=r"fp8_rows=True is a mode of precision='int8_fp8' \(FP8 P V\), got 'int8'"):
        layout.attend(q.detach(), k, v, precision="int8", fp8_rows=True)
