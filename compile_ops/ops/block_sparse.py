"""Block-sparse attention as ``torch.ops.fused`` ops, and the builders of its
block lists.

``fused.block_sparse_attention`` runs the flash-attention kernels of
``kernels/attention.py`` with ``SPARSE``: each query block of 128 visits only
its listed key blocks (forward, dq pass); the dk/dv pass visits, per key
block, the query blocks that list it (the transposed lists, built here with
torch ops). Lists may come in any order: the ops sort them. Deterministic,
like ``fused.attention``; with every block listed the results equal
``fused.attention``'s bit for bit. Its ``precision`` ``"int8"`` and
``"int8_fp8"`` run the same forward kernel on 8-bit attention's operands
(``ops/attention_8bit.py``; the kernel's ``INT8`` and ``PV_FP8`` front
ends), for inference: with every block listed they equal
``fused.attention_int8`` / ``attention_int8_fp8`` bit for bit.

Builders (torch ops only: ``torch.compile`` traces them into the graph, and
Inductor fuses them): :func:`block_index_from_mask`, :func:`sliding_tile_mask`
with :func:`tile_permutation`, :func:`radial_mask` and the dynamic
:func:`topk_block_index` (from :func:`block_means`, by :func:`topk_from_block_means`).
"""

import dataclasses
import math
from typing import Optional, Sequence

import torch
import triton
from torch import Tensor

from compile_ops import _dtensor, meta, reference
from compile_ops._library import fused_op, launcher, register_no_gradient, require_fp8_mma
from compile_ops.kernels.block_sparse import sort_block_lists_kernel
from compile_ops.meta._validate import checked_arguments, softmax_scale
from compile_ops.meta.attention import SPARSE_BLOCK
from compile_ops.ops._launch import unit_last_stride
from compile_ops.ops.attention_8bit import launch_eight_bit, quantized_operands
from compile_ops.ops.attention_launch import launch_backward, launch_forward
from compile_ops.ops.fp8 import FP8Rows, refuse_gradient


def _per_head(index: Tensor, count: Tensor, batch: int, heads: int) -> tuple:
    """Lists broadcast to every (batch, head), without copies (stride 0)."""
    return unit_last_stride(index).expand(batch, heads, -1, -1), count.expand(batch, heads, -1)


def _sorted_lists(q: Tensor, seq_dim: int, index: Tensor, count: Tensor) -> tuple:
    """The lists as the kernels walk them: ascending, one per (batch, head) of q."""
    b, h = meta.attention.dims(q, seq_dim)[:2]
    return _per_head(ascending(index, count), count, b, h)


#: ``sort_block_lists_kernel`` sorts at most 4096 entries a program, and spreads
#: the lists over about SORT_PROGRAMS programs: a static layout's few hundred
#: lists in a handful of programs left the GPU idle for the sort's latency.
SORT_ENTRIES_PER_PROGRAM = 4096
SORT_PROGRAMS = 512


def ascending(index: Tensor, count: Tensor) -> Tensor:
    """``reference.block_sparse.ascending`` of ``index [B1, H1, NQ, W]`` and
    ``count [B1, H1, NQ]``, by ``sort_block_lists_kernel`` (the same values:
    a sort has one result)."""
    out = torch.empty(index.shape, dtype=index.dtype, device=index.device)
    rows, width = index.shape[:3].numel(), index.shape[3]
    if rows == 0 or width == 0:
        return out
    block_w = triton.next_power_of_2(width)
    wanted = triton.next_power_of_2(triton.cdiv(rows, SORT_PROGRAMS) + 1) // 2  # a power of two, at most the share
    per_program = max(1, min(SORT_ENTRIES_PER_PROGRAM // block_w, wanted))
    launcher(sort_block_lists_kernel)[(triton.cdiv(rows, per_program),)](
        index,
        count,
        out,
        index.shape[1],
        index.shape[2],
        width,
        rows,
        *index.stride(),
        *count.stride(),
        BLOCK_W=block_w,
        ROWS=per_program,
        UNUSED=torch.iinfo(index.dtype).max,
        num_warps=max(1, min(4, per_program * block_w // 256)),
    )
    return out


def key_block_lists(block_index: Tensor, block_count: Tensor, num_key_blocks: int) -> tuple[Tensor, Tensor]:
    """The transposed lists: for each key block, the query blocks that list it,
    ascending (``[B, H, NK, NQ]`` / ``[B, H, NK]`` int32)."""
    mask = reference.block_sparse.block_mask_from_lists(block_index, block_count, num_key_blocks)
    return reference.block_sparse.block_index_from_mask(mask.transpose(-1, -2))


@fused_op(
    "block_sparse_attention",
    fake=meta.block_sparse.block_sparse_attention,
    reference=reference.block_sparse.block_sparse_attention,
    autocast="lower",
    eager_check=meta.block_sparse.check_block_lists_eagerly,
)
def _block_sparse_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_index: Tensor,
    block_count: Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[Tensor] = None,
    precision: str = "exact",
    token_order: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    out, lse = meta.block_sparse.block_sparse_attention(
        q, k, v, block_index, block_count, scale, causal, seq_dim, kv_lengths, precision, token_order
    )
    lists = _sorted_lists(q, seq_dim, block_index, block_count)
    if precision == "exact":
        launch_forward(q, k, v, out, lse, scale, causal, seq_dim, kv_lengths, lists)
        return out, lse
    pv_fp8 = precision == "int8_fp8"
    if pv_fp8:
        require_fp8_mma(q, "precision='int8_fp8' block-sparse attention (P V in FP8)")
    operands = quantized_operands(q, k, v, seq_dim, pv_fp8, token_order)
    launch_eight_bit(operands, v, out, scale, causal, seq_dim, kv_lengths, blocks=lists, lse=lse, tokens=token_order)
    return out, lse


@fused_op(
    "block_sparse_attention_int8_fp8_rows",
    fake=meta.block_sparse.block_sparse_attention_int8_fp8_rows,
    reference=reference.block_sparse.block_sparse_attention_int8_fp8_rows,
    eager_check=meta.block_sparse.check_fp8_rows_lists_eagerly,
)
def _block_sparse_attention_int8_fp8_rows_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_index: Tensor,
    block_count: Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[Tensor] = None,
    token_order: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    values, out_scale = meta.block_sparse.block_sparse_attention_int8_fp8_rows(
        q, k, v, block_index, block_count, scale, causal, seq_dim, kv_lengths, token_order
    )
    require_fp8_mma(q, "FP8 output rows of block-sparse 8-bit attention")
    lists = _sorted_lists(q, seq_dim, block_index, block_count)
    operands = quantized_operands(q, k, v, seq_dim, True, token_order)
    launch_eight_bit(
        operands, v, values, scale, causal, seq_dim, kv_lengths, out_scale, blocks=lists, tokens=token_order
    )
    return values, out_scale


register_no_gradient(
    _block_sparse_attention_int8_fp8_rows_op,
    "fused.block_sparse_attention_int8_fp8_rows is inference only (its output is e4m3): train with "
    "precision='exact', or run the call under torch.no_grad()",
)


@fused_op(
    "block_sparse_attention_backward",
    fake=meta.block_sparse.block_sparse_attention_backward,
    reference=reference.block_sparse.block_sparse_attention_backward,
)
def _block_sparse_attention_backward_op(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    block_index: Tensor,
    block_count: Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = meta.block_sparse.block_sparse_attention_backward(
        grad_out, q, k, v, out, lse, block_index, block_count, scale, causal, seq_dim, kv_lengths
    )
    b, h, _, _ = meta.attention.dims(q, seq_dim)
    num_key_blocks = meta.block_sparse.num_blocks(meta.attention.dims(k, seq_dim)[2])
    key_lists = key_block_lists(block_index, block_count, num_key_blocks)
    launch_backward(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        dq,
        dk,
        dv,
        scale,
        causal,
        seq_dim,
        kv_lengths,
        _sorted_lists(q, seq_dim, block_index, block_count),
        _per_head(*key_lists, b, h),
    )
    return dq, dk, dv


def _setup(ctx, inputs, output):
    q, k, v, block_index, block_count, scale, causal, seq_dim, kv_lengths, precision, _token_order = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.precision = precision
    if precision == "exact":  # the 8-bit precisions have no backward: nothing to keep
        ctx.save_for_backward(q, k, v, out, lse, block_index, block_count, kv_lengths)
    ctx.args = (scale, causal, seq_dim)


def _backward(ctx, grad_out, _grad_lse):
    if ctx.precision != "exact":
        raise RuntimeError(
            f"fused.block_sparse_attention with precision={ctx.precision!r} is inference only (its q and k "
            "are rounded to 8 bits, which has no useful gradient): train with precision='exact', or run "
            "the call under torch.no_grad()"
        )
    q, k, v, out, lse, block_index, block_count, kv_lengths = ctx.saved_tensors
    dq, dk, dv = _block_sparse_attention_backward_op(
        grad_out, q, k, v, out, lse, block_index, block_count, *ctx.args, kv_lengths
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None


_block_sparse_attention_op.register_autograd(_backward, setup_context=_setup)


# ---------------------------------------------------------------- public functions


@checked_arguments
def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_index: Tensor,
    block_count: Tensor,
    scale: Optional[float] = None,
    causal: bool = False,
    seq_dim: int = 2,
    kv_lengths: Optional[Tensor] = None,
    return_lse: bool = False,
    precision: str = "exact",
    token_order: Optional[Tensor] = None,
):
    """Attention over the listed key blocks only (128 x 128-token blocks).

    Args:
        q: ``[B, Hq, Lq, D]`` (``seq_dim=2``) or ``[B, Lq, Hq, D]``
            (``seq_dim=1``), any strides; fp16/bf16/fp32 (fp16/bf16 in the
            8-bit precisions); D up to 256.
        k, v: ``[B, Hk, Lk, D]`` / ``[B, Lk, Hk, D]`` in q's layout and dtype,
            ``Hk`` dividing ``Hq`` (GQA/MQA).
        block_index: ``[B or 1, Hq or 1, ceil(Lq / 128), W]`` int32/int64: for
            each query block, the key blocks it attends to (distinct, in
            ``[0, ceil(Lk / 128))``, any order), in its first ``block_count``
            entries.
        block_count: ``[B or 1, Hq or 1, ceil(Lq / 128)]`` int32/int64, at most W.
        scale: a float > 0; None is ``1 / sqrt(D)``.
        causal: query i sees keys ``j <= i`` (as :func:`compile_ops.attention`),
            inside the listed blocks.
        seq_dim: q/k/v's layout: 2 (``[B, H, L, D]``) or 1 (``[B, L, H, D]``).
        kv_lengths: ``[B]`` int32/int64 or None: keys at or past
            ``kv_lengths[b]`` are ignored for batch element b, inside the
            listed blocks too.
        return_lse: also return the log-sum-exp ``[B, Hq, Lq]`` fp32.
        precision: ``"exact"`` (the dots in the inputs' dtype), or for
            inference ``"int8"``: q and k quantized as
            :func:`compile_ops.attention`'s ``precision="int8"`` quantizes
            them (k smoothed by its mean over all Lk keys and rounded per
            block of 128 keys, q per token), then attention over the listed
            blocks with an integer QK product and P V in the inputs' dtype;
            ``"int8_fp8"``: the same with P V in FP8 too (sm_89 or newer).
            Specified in ``compile_ops/reference/block_sparse.py``; with
            every block listed, :func:`compile_ops.attention`'s 8-bit
            precisions. A gradient through them raises; their lse is that
            of the 8-bit scores.
        token_order: ``[Lq]`` int32/int64 or None, self-attention (Lk = Lq)
            without ``causal``: a permutation of the tokens, the order the
            blocks are cut in (a sparse layout's tile order: the blocks,
            ``kv_lengths`` and the 8-bit key blocks count tokens
            ``token_order[0], token_order[1], ...``). The output stays in
            q's order. The result is that of q, k and v permuted along the
            sequence, attended, and the output put back; the 8-bit
            precisions do it inside their kernels (no permuted copies), the
            exact one by torch ops around its kernel (so that autograd sees
            them).

    Returns:
        ``[B, Hq, Lq, D]`` / ``[B, Lq, Hq, D]`` in q's dtype and layout (and the
        lse ``[B, Hq, Lq]``). A query with no listed (or no visible) key gives
        0 and an lse of -inf.
    """
    if precision not in meta.block_sparse.PRECISIONS:
        raise ValueError(
            f"compile_ops.block_sparse_attention: precision must be one of {meta.block_sparse.PRECISIONS}, "
            f"got {precision!r}"
        )
    scale = softmax_scale("compile_ops.block_sparse_attention", q, scale)
    permute = token_order is not None and precision == "exact"

    def attend(q, k, v):
        if permute:
            meta.block_sparse.check_token_order(
                "compile_ops.block_sparse_attention", token_order, q, k, seq_dim, causal
            )
            q, k, v = (t.index_select(seq_dim, token_order) for t in (q, k, v))
        out, lse = _block_sparse_attention_op(
            q,
            k,
            v,
            block_index,
            block_count,
            scale,
            causal,
            seq_dim,
            kv_lengths,
            precision,
            None if permute else token_order,
        )
        if permute:  # each row back at its token's place
            out, lse = (torch.empty_like(t).index_copy(d, token_order, t) for t, d in ((out, seq_dim), (lse, 2)))
        return out, lse

    out, lse = _dtensor.sequence_parallel(attend, q, k, v, seq_dim)
    return (out, lse) if return_lse else out


@checked_arguments
def block_sparse_attention_fp8_rows(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_index: Tensor,
    block_count: Tensor,
    scale: Optional[float] = None,
    causal: bool = False,
    seq_dim: int = 2,
    kv_lengths: Optional[Tensor] = None,
    token_order: Optional[Tensor] = None,
) -> FP8Rows:
    """:func:`block_sparse_attention` with ``precision="int8_fp8"`` whose output
    comes as the FP8 rows an FP8 output projection reads (``FP8Linear``):
    the kernel writes e4m3 values and their scales in its epilogue (in the
    tokens' own order under ``token_order``), as
    :func:`compile_ops.attention_fp8_rows` does for dense attention, so the
    output is never written in 16 bits nor quantized by a pass of its own.
    Inference only (sm_89 or newer on a GPU; the specification,
    ``reference.block_sparse.block_sparse_attention_int8_fp8_rows``, elsewhere).

    Args:
        q, k, v: as :func:`block_sparse_attention`, fp16/bf16.
        block_index, block_count, scale, causal, kv_lengths, token_order: as
            :func:`block_sparse_attention`.
        seq_dim: q/k/v's layout (2: ``[B, H, L, D]``, 1: ``[B, L, H, D]``).

    Returns:
        ``FP8Rows(q=[B, Lq, Hq * D] float8_e4m3fn, scale=[B, Lq] fp32)``, whatever
        ``seq_dim``: the projection's input rows, heads concatenated per token.
    """
    refuse_gradient("compile_ops.block_sparse_attention_fp8_rows", q, k, v)
    scale = softmax_scale("compile_ops.block_sparse_attention_fp8_rows", q, scale)
    values, row_scale = _block_sparse_attention_int8_fp8_rows_op(
        q, k, v, block_index, block_count, scale, causal, seq_dim, kv_lengths, token_order
    )
    return FP8Rows(values.flatten(2, 3), row_scale)


@dataclasses.dataclass(frozen=True)
class BlockSparseMask:
    """Block lists as one mask object, to hand where an attention mask goes:
    ``dispatch_attention_fn(..., attn_mask=BlockSparseMask(...))`` under
    ``set_attention_backend("compile_ops")`` runs :func:`block_sparse_attention`
    (as FlexAttention's ``BlockMask`` does for diffusers' ``flex`` backend).

    Args:
        block_index: ``[B or 1, Hq or 1, ceil(Lq / 128), W]`` int32/int64, as
            :func:`block_sparse_attention` takes it.
        block_count: ``[B or 1, Hq or 1, ceil(Lq / 128)]`` int32/int64.
    """

    block_index: Tensor
    block_count: Tensor

    def __post_init__(self):
        for name in ("block_index", "block_count"):
            t = getattr(self, name)
            if not isinstance(t, Tensor) or t.dtype not in (torch.int32, torch.int64):
                got = t.dtype if isinstance(t, Tensor) else type(t).__name__
                raise TypeError(f"compile_ops.BlockSparseMask: {name} must be an int32 or int64 tensor, got {got}")
        if self.block_count.device != self.block_index.device:
            raise ValueError(
                f"compile_ops.BlockSparseMask: block_count is on {self.block_count.device} but "
                f"block_index is on {self.block_index.device}"
            )
        if self.block_index.dim() != 4 or self.block_count.shape != self.block_index.shape[:-1]:
            raise ValueError(
                "compile_ops.BlockSparseMask: block_index must be [B or 1, Hq or 1, NQ, W] and "
                f"block_count its first three dims, got block_index {tuple(self.block_index.shape)} "
                f"and block_count {tuple(self.block_count.shape)}"
            )

    @classmethod
    def from_block_mask(cls, mask: Tensor) -> "BlockSparseMask":
        """From a dense block mask ``[B or 1, Hq or 1, NQ, NK]`` bool (see :func:`block_index_from_mask`)."""
        return cls(*block_index_from_mask(mask))

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None, causal: bool = False, seq_dim: int = 2
    ) -> Tensor:
        """:func:`block_sparse_attention` of q, k, v over these lists."""
        return block_sparse_attention(
            q, k, v, self.block_index, self.block_count, scale=scale, causal=causal, seq_dim=seq_dim
        )


@checked_arguments
def block_index_from_mask(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Block lists from a dense block mask.

    Args:
        mask: ``[..., NQ, NK]`` bool, True where query block i attends to key block j.

    Returns:
        ``(block_index [..., NQ, NK] int32, block_count [..., NQ] int32)``, each
        row's blocks in ascending order.
    """
    meta.block_sparse.block_index_from_mask(mask)
    return reference.block_sparse.block_index_from_mask(mask)


@checked_arguments
def tile_permutation(
    frames: int, height: int, width: int, tile: Sequence[int], device=None, ragged: bool = False
) -> Tensor:
    """The token order that makes each ``tile = (t, h, w)`` cube of a
    ``(frames, height, width)`` grid (row-major tokens) contiguous: tiles in
    row-major order, tokens row-major inside each tile.

    ``ragged=True`` accepts a tile that does not divide the grid: the tiles
    at the far edge of each such axis are cut short (fewer tokens) and come
    after the whole tiles (each group in row-major order), so that whole
    tiles of 128 tokens stay aligned with the kernels' blocks. Without it
    such a tile is an error.

    Returns:
        ``[frames * height * width]`` int64 ``perm``: ``x[:, perm]`` reorders a
        ``[B, L, ...]`` sequence into tiles; ``torch.argsort(perm)`` undoes it.
    """
    meta.block_sparse.check_tiles("tile_permutation", (frames, height, width), tile, ragged)
    return torch.argsort(_tile_sort_key(frames, height, width, tile, device).reshape(-1), stable=True)


def _tile_sort_key(frames: int, height: int, width: int, tile: Sequence[int], device) -> Tensor:
    """``[frames, height, width]`` int64 ``(cut * n_tiles + tile) * volume + place``:
    ``tile`` a token's tile (row-major over the rounded-up tile grid of
    ``n_tiles``), ``cut`` 1 in a tile cut short at the grid's far edge,
    ``place`` its row-major place in the tile. Distinct per token; sorting by
    it gives :func:`tile_permutation`, and ``key // volume % n_tiles`` is the
    token's tile."""
    t, h, w = tile
    tiles = [-(-n // size) for n, size in zip((frames, height, width), tile)]
    f = torch.arange(frames, device=device).view(-1, 1, 1)
    y = torch.arange(height, device=device).view(1, -1, 1)
    x = torch.arange(width, device=device).view(1, 1, -1)
    tile_id = ((f // t) * tiles[1] + y // h) * tiles[2] + x // w
    # A tile is cut when it is the last along an axis that the tile does not divide.
    cut = ((f // t == frames // t) | (y // h == height // h) | (x // w == width // w)).long()
    return (cut * math.prod(tiles) + tile_id) * (t * h * w) + ((f % t) * h + y % h) * w + x % w


@checked_arguments
def sliding_tile_block_mask(
    frames: int, height: int, width: int, tile: Sequence[int], window: Sequence[int], device=None
) -> tuple[Tensor, Tensor]:
    """Sliding-tile attention on any token grid, at the kernels' 128-token block
    granularity: tokens in :func:`tile_permutation` order (``ragged``: edge
    tiles may be smaller, and come last), and query block i attends to key block j when a
    tile that block i's tokens belong to lies within ``window`` tiles of a
    tile of block j's (the window shifted inward at the grid's edges, as
    :func:`sliding_tile_mask`). With 128-token tiles dividing the grid this is
    :func:`sliding_tile_mask`; otherwise blocks straddle tiles and the mask
    is the smallest block mask covering every tile pair in the window (a
    superset of token-level sliding-tile attention, never a subset).

    Args:
        frames, height, width: the token grid (after patchifying).
        tile: ``(t, h, w)`` tokens per tile (``t * h * w`` near 128 keeps the
            superset tight).
        window: ``(wt, wh, ww)`` tiles, each at most the tile grid's extent.

    Returns:
        ``(perm [frames * height * width] int64, mask [NB, NB] bool)`` with
        ``NB = ceil(frames * height * width / 128)``.
    """
    tile_grid = meta.block_sparse.check_tiles("sliding_tile_block_mask", (frames, height, width), tile, True)
    meta.block_sparse.check_window("sliding_tile_block_mask", tile_grid, window)
    key = _tile_sort_key(frames, height, width, tile, device).reshape(-1)
    perm = torch.argsort(key, stable=True)
    n_tokens, n_tiles = perm.numel(), math.prod(tile_grid)
    tile_of = key[perm] // math.prod(tile) % n_tiles  # each permuted token's tile
    n_blocks = meta.block_sparse.num_blocks(n_tokens)
    touches = torch.zeros(n_blocks, n_tiles, device=device)
    touches[torch.arange(n_tokens, device=device) // SPARSE_BLOCK, tile_of] = 1.0
    near = sliding_tile_mask(tile_grid, window, device=device).float()
    return perm, (touches @ near @ touches.T) > 0


def _window_starts(n: int, size: int, device) -> Tensor:
    # Windows of `size` tiles centred on each tile, shifted inward at the
    # edges so that every tile sees the same number of tiles (as STA does).
    centre = torch.arange(n, device=device) - size // 2
    return centre.clamp(0, max(n - size, 0))


@checked_arguments
def sliding_tile_mask(tile_grid: Sequence[int], window: Sequence[int], device=None) -> Tensor:
    """Sliding-tile attention's block mask (one tile = one 128-token block).

    Args:
        tile_grid: ``(T, H, W)``, the grid of tiles (tokens ordered by
            :func:`tile_permutation` with a 128-token tile, e.g. ``(4, 4, 8)``).
        window: ``(wt, wh, ww)`` tiles: each tile attends to the ``wt x wh x ww``
            tiles around it (shifted inward at the grid's edges).

    Returns:
        ``[T*H*W, T*H*W]`` bool block mask (for :func:`block_index_from_mask`).
    """
    meta.block_sparse.check_window("sliding_tile_mask", tile_grid, window)
    near = []
    for n, size in zip(tile_grid, window):
        start = _window_starts(n, size, device)
        j = torch.arange(n, device=device)
        near.append((j[None, :] >= start[:, None]) & (j[None, :] < start[:, None] + size))  # [n, n]
    t, h, w = near
    mask = t[:, None, None, :, None, None] & h[None, :, None, None, :, None] & w[None, None, :, None, None, :]
    n = math.prod(tile_grid)
    return mask.reshape(n, n)


@checked_arguments
def radial_mask(frames: int, tokens_per_frame: int, dense_frames: int = 1, device=None) -> Tensor:
    """A spatio-temporal radial block mask: dense near the diagonal in time,
    sparser farther away (the energy decay that Radial Attention exploits).

    Query block i and key block j (tokens ordered frame by frame) lie
    ``d = |frame(i) - frame(j)|`` frames apart (frames of the blocks' centre
    tokens). Within ``dense_frames`` frames every block is kept; beyond, a key
    block is kept when its position within its frame lies within
    ``tokens_per_frame / 2**ceil(log2(d / dense_frames))`` tokens of the
    query block's (at least one block): the spatial window halves each time
    the temporal distance doubles.

    Returns:
        ``[N, N]`` bool, ``N = ceil(frames * tokens_per_frame / 128)``.
    """
    meta.block_sparse.check_radial("radial_mask", frames, tokens_per_frame, dense_frames)
    n = meta.block_sparse.num_blocks(frames * tokens_per_frame)
    centre = (torch.arange(n, device=device) * SPARSE_BLOCK + SPARSE_BLOCK // 2).clamp(
        max=frames * tokens_per_frame - 1
    )
    frame, pos = centre // tokens_per_frame, centre % tokens_per_frame
    d = (frame[:, None] - frame[None, :]).abs()
    halvings = torch.ceil(torch.log2(d.clamp(min=1).double() / dense_frames)).clamp(min=0)
    reach = (tokens_per_frame / torch.exp2(halvings)).clamp(min=SPARSE_BLOCK)
    return (d <= dense_frames) | ((pos[:, None] - pos[None, :]).abs() <= reach)


def _block_means(t: Tensor, n_blocks: int) -> Tensor:
    """``[B, H, L, D]`` -> ``[B, H, n_blocks, D]`` fp32 means over each block's tokens."""
    full = t.shape[2] // SPARSE_BLOCK
    # Views and fp32 sums, no padded fp32 copy: one pass over t.
    sums = t[:, :, : full * SPARSE_BLOCK].unflatten(2, (full, SPARSE_BLOCK)).sum(3, dtype=torch.float32)
    if full < n_blocks:
        tail = t[:, :, full * SPARSE_BLOCK :].sum(2, keepdim=True, dtype=torch.float32)
        sums = torch.cat([sums, tail], 2)
    return sums / _block_sizes(t.shape[2], n_blocks, t.device)[:, None]


def _block_sizes(length: int, n_blocks: int, device) -> Tensor:
    starts = torch.arange(n_blocks, device=device) * SPARSE_BLOCK
    return (length - starts).clamp(max=SPARSE_BLOCK).float()


@checked_arguments
def topk_block_index(
    q: Tensor, k: Tensor, coverage: float = 0.9, sink_blocks: int = 1, scale: Optional[float] = None, seq_dim: int = 2
) -> tuple[Tensor, Tensor]:
    """Dynamic block lists: for each query block, the first ``sink_blocks`` key
    blocks (attention sinks) and the fewest further key blocks that bring the
    kept share of its estimated attention mass to ``coverage``.

    The estimate is attention between block means: ``softmax(scale q̄ k̄^T +
    log n_j)`` over key blocks, ``n_j`` the tokens of key block j (so a block
    weighs as its tokens would, each scoring like the mean).

    Args:
        q: ``[B, Hq, Lq, D]`` (or ``[B, Lq, Hq, D]``, ``seq_dim=1``); k: in q's
            layout with Hk dividing Hq.
        coverage: share of the estimated mass to keep, in (0, 1].
        sink_blocks: key blocks always kept (attention sinks).
        scale: defaults to ``1 / sqrt(D)``.

    Returns:
        ``(block_index [B, Hq, NQ, NK] int32, block_count [B, Hq, NQ] int32)``
        for :func:`block_sparse_attention`: sinks first, then by estimated
        mass (not ascending).
    """
    scale = softmax_scale("compile_ops.topk_block_index", q, scale)
    meta.block_sparse.topk_block_index(q, k, coverage, sink_blocks, scale, seq_dim)
    return topk_from_block_means(
        block_means(q, seq_dim), block_means(k, seq_dim), k.shape[seq_dim], coverage, sink_blocks, scale
    )


def block_means(t: Tensor, seq_dim: int = 2) -> Tensor:
    """The mean of each 128-token block of ``t [B, H, L, D]`` (``[B, L, H, D]``
    with ``seq_dim=1``; the last block over the tokens it has), as
    ``[B, H, NB, D]`` fp32: what :func:`topk_block_index` compares. Blocks do
    not cross a cut at a multiple of 128 tokens, so the means of shards cut
    there, concatenated, are the means of the whole sequence."""
    if seq_dim == 1:
        t = t.transpose(1, 2)
    return _block_means(t, meta.block_sparse.num_blocks(t.shape[2]))


def topk_from_block_means(
    q_means: Tensor, k_means: Tensor, key_length: int, coverage: float, sink_blocks: int, scale: float
) -> tuple[Tensor, Tensor]:
    """:func:`topk_block_index` from the blocks' means (:func:`block_means`):
    ``q_means [B, Hq, NQ, D]``, ``k_means [B, Hk, NK, D]`` fp32 with Hk
    dividing Hq, ``key_length`` the keys' count (which sizes the last key
    block); the arguments are :func:`topk_block_index`'s, checked there. Ring
    attention gathers every shard's key means instead of its keys."""
    nk = k_means.shape[2]
    k_means = k_means.repeat_interleave(q_means.shape[1] // k_means.shape[1], 1)
    logits = q_means @ k_means.transpose(-1, -2) * scale + _block_sizes(key_length, nk, q_means.device).log()
    mass = torch.softmax(logits, -1)
    # Sinks rank first, the other blocks by mass; the lists are that ranking
    # (the attention op sorts them), so one sort builds them.
    sinks = torch.arange(nk, device=q_means.device) < sink_blocks
    ranked, order = (mass + 2.0 * sinks).sort(-1, descending=True)
    ranked = ranked - 2.0 * sinks  # the sinks lead the ranking: their boost comes off in place
    # Keep a block while the blocks ranked above it hold less than the
    # coverage: a prefix of the ranking, never shorter than the sinks.
    held_before = ranked.cumsum(-1) - ranked
    count = ((held_before < coverage) | sinks).sum(-1, dtype=torch.int32)
    return order.to(torch.int32), count
