"""Shape rules and validation of the block_sparse family: block-sparse
attention and the builders of its block lists.

Torch only: the fakes of ``fused.block_sparse_attention``, its backward and
the builder ops.

Block lists (the form of MInference-style kernels): queries and keys are cut
into blocks of ``SPARSE_BLOCK`` (128) tokens, the last one partial.
``block_index [B, H, NQ, W]`` (int32/int64) lists, for each of the
``NQ = ceil(Lq / 128)`` query blocks, the key blocks it attends to, in its
first ``block_count [B, H, NQ]`` entries; entries past the count are ignored.
B and H may be 1 (one list for every batch element or head). Listed key
blocks lie in ``[0, ceil(Lk / 128))``, each at most once; the kernels visit
them in the listed order. Within a listed block, causal masking and
``kv_lengths`` still apply per token.
"""

import weakref
from typing import Optional

import torch

from compile_ops.meta._validate import check_same_device, fail, values_readable
from compile_ops.meta.attention import SPARSE_BLOCK, _eight_bit, attention, attention_backward, dims

INDEX_DTYPES = (torch.int32, torch.int64)
#: Block-sparse attention's precisions, as ``compile_ops.attention``'s: the
#: inputs' dtype, or 8-bit q and k (and FP8 P V) for inference.
PRECISIONS = ("exact", "int8", "int8_fp8")


def num_blocks(length) -> int:
    """Blocks of ``SPARSE_BLOCK`` tokens that cover ``length`` tokens."""
    return (length + SPARSE_BLOCK - 1) // SPARSE_BLOCK


def check_block_lists(
    op: str, block_index: torch.Tensor, block_count: torch.Tensor, batch: int, heads: int, lq, lk, device: torch.device
) -> None:
    """Types, shapes and devices of the lists for q ``[batch, heads, lq]`` and
    ``lk`` keys; their values in eager calls (:func:`check_block_list_values`)."""
    for name, t, ndim in (("block_index", block_index, 4), ("block_count", block_count, 3)):
        if not isinstance(t, torch.Tensor):
            fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
        if t.dtype not in INDEX_DTYPES:
            fail(op, f"{name} must be int32 or int64, got {t.dtype}", TypeError)
        if t.dim() != ndim:
            fail(op, f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    nq = num_blocks(lq)
    bi, hi, rows, _ = block_index.shape
    if bi not in (1, batch) or hi not in (1, heads) or rows != nq:
        fail(
            op,
            f"block_index must have shape [B or 1, H or 1, ceil(Lq / {SPARSE_BLOCK}), W] = "
            f"[{batch} or 1, {heads} or 1, {nq}, W] for q's B={batch}, H={heads}, Lq={lq}, "
            f"got {tuple(block_index.shape)}",
        )
    if tuple(block_count.shape) != (bi, hi, rows):
        fail(
            op,
            f"block_count must have shape {(bi, hi, rows)} (block_index's first three dims), "
            f"got {tuple(block_count.shape)}",
        )
    check_same_device(op, torch.empty(0, device=device), "q", block_index=block_index, block_count=block_count)
    check_block_list_values(op, block_index, block_count, num_blocks(lk), "key")


#: Lists whose values passed :func:`check_block_list_values`, by ``(id(block_index),
#: id(block_count), limit, what)``: weak references to both and their version
#: counters. Reading the values syncs with the GPU; a model passes the same
#: list tensors to every layer and step, and a call with them, unchanged,
#: skips the check (so its launches can be replayed: ``compile_ops._replay``).
#: The weak references tell a live tensor from a new one at a reused id; an
#: in-place change through torch bumps the version. (A write that bypasses
#: torch, such as a user's own kernel storing into the lists, is not seen.)
_CHECKED_LISTS: dict = {}
MAX_CHECKED_LISTS = 64


def _versions(*tensors) -> Optional[tuple]:
    """The tensors' version counters; None where one has none (an inference-mode tensor)."""
    try:
        return tuple(t._version for t in tensors)
    except RuntimeError:
        return None


def _checked_before(key: tuple, block_index: torch.Tensor, block_count: torch.Tensor) -> bool:
    entry = _CHECKED_LISTS.get(key)
    if entry is None:
        return False
    index_ref, count_ref, versions = entry
    return (
        index_ref() is block_index
        and count_ref() is block_count
        and versions is not None
        and versions == _versions(block_index, block_count)
    )


def _remember_checked(key: tuple, block_index: torch.Tensor, block_count: torch.Tensor) -> None:
    if len(_CHECKED_LISTS) >= MAX_CHECKED_LISTS:
        _CHECKED_LISTS.clear()
    _CHECKED_LISTS[key] = (weakref.ref(block_index), weakref.ref(block_count), _versions(block_index, block_count))


def check_block_list_values(op: str, block_index: torch.Tensor, block_count: torch.Tensor, limit, what: str) -> None:
    """Counts in ``[0, W]``; the listed entries in ``[0, limit)`` and distinct.
    Eager calls only: under tracing the lists are data. The same unchanged
    list tensors are checked once (``_CHECKED_LISTS``)."""
    if (
        block_count.numel() == 0
        or isinstance(limit, torch.SymInt)
        or not values_readable(block_index)
        or not values_readable(block_count)
    ):
        return
    key = (id(block_index), id(block_count), limit, what)
    if _checked_before(key, block_index, block_count):
        return
    _check_values(op, block_index, block_count, limit, what)
    _remember_checked(key, block_index, block_count)


def check_token_order(op: str, token_order, q: torch.Tensor, k: torch.Tensor, seq_dim: int, causal) -> None:
    """``token_order``: None, or a permutation of q's Lq tokens (``[Lq]``
    int32/int64 on q's device) for self-attention (Lk = Lq) without a causal
    mask. Its values in eager calls (:func:`check_token_order_values`)."""
    if token_order is None:
        return
    if not isinstance(token_order, torch.Tensor):
        fail(op, f"token_order must be a torch.Tensor or None, got {type(token_order).__name__}", TypeError)
    if token_order.dtype not in INDEX_DTYPES:
        fail(op, f"token_order must be int32 or int64, got {token_order.dtype}", TypeError)
    lq, lk = dims(q, seq_dim)[2], dims(k, seq_dim)[2]
    if token_order.dim() != 1 or token_order.shape[0] != lq:
        fail(op, f"token_order must have shape [Lq] = [{lq}], got {tuple(token_order.shape)}")
    if lk != lq:
        fail(op, f"token_order orders the tokens of self-attention: Lk must equal Lq, got Lq={lq}, Lk={lk}")
    if causal:
        fail(op, "token_order takes causal=False: a causal mask is over the tokens' own order")
    check_same_device(op, q, "q", token_order=token_order)
    check_token_order_values(op, token_order)


def check_token_order_values(op: str, token_order: torch.Tensor) -> None:
    """``token_order`` holds each of ``0 .. Lq - 1`` once. Eager calls only;
    an unchanged tensor is checked once (``_CHECKED_LISTS``)."""
    if token_order.numel() == 0 or not values_readable(token_order):
        return
    key = (id(token_order), id(token_order), token_order.numel(), "token order")
    if _checked_before(key, token_order, token_order):
        return
    expected = torch.arange(token_order.numel(), device=token_order.device, dtype=token_order.dtype)
    if not torch.equal(token_order.sort().values, expected):
        fail(op, f"token_order must be a permutation of 0 .. {token_order.numel() - 1} (each token once)")
    _remember_checked(key, token_order, token_order)


def check_block_lists_eagerly(
    q, k, v, block_index, block_count, scale, causal, seq_dim=2, kv_lengths=None, precision="exact", token_order=None
) -> None:
    """``fused.block_sparse_attention``'s eager check, run before its launches
    are replayed (a replay skips the op's body, hence its fake's validation):
    the lists' and the token order's values (:func:`check_block_list_values`,
    :func:`check_token_order_values`). Malformed arguments are left to the
    body, whose validation names them."""
    _check_lists_eagerly("block_sparse_attention", q, k, block_index, block_count, seq_dim, token_order)


def check_fp8_rows_lists_eagerly(
    q, k, v, block_index, block_count, scale, causal, seq_dim=2, kv_lengths=None, token_order=None
) -> None:
    """:func:`check_block_lists_eagerly` for ``fused.block_sparse_attention_int8_fp8_rows``."""
    _check_lists_eagerly("block_sparse_attention_int8_fp8_rows", q, k, block_index, block_count, seq_dim, token_order)


def _check_lists_eagerly(op: str, q, k, block_index, block_count, seq_dim, token_order) -> None:
    if (
        isinstance(token_order, torch.Tensor)
        and token_order.dim() == 1
        and token_order.dtype in INDEX_DTYPES
        and isinstance(q, torch.Tensor)
        and token_order.device == q.device
    ):
        check_token_order_values(op, token_order)
    if not (
        isinstance(block_index, torch.Tensor)
        and isinstance(block_count, torch.Tensor)
        and isinstance(k, torch.Tensor)
        and k.dim() == 4
        and seq_dim in (1, 2)
        and block_index.dim() == 4
        and block_index.dtype in INDEX_DTYPES
        and block_count.dtype in INDEX_DTYPES
        and tuple(block_count.shape) == tuple(block_index.shape[:3])
        and block_index.device == block_count.device == k.device
    ):
        return
    check_block_list_values(op, block_index, block_count, num_blocks(dims(k, seq_dim)[2]), "key")


def _check_values(op: str, block_index: torch.Tensor, block_count: torch.Tensor, limit, what: str) -> None:
    width = block_index.shape[-1]
    lo, hi = int(block_count.min()), int(block_count.max())
    if lo < 0 or hi > width:
        fail(op, f"block_count must be in [0, {width}] (block_index's width), got values in [{lo}, {hi}]")
    listed = torch.arange(width, device=block_index.device) < block_count[..., None]
    entries = block_index[listed]
    if entries.numel() == 0:
        return
    lo, hi = int(entries.min()), int(entries.max())
    if lo < 0 or hi >= limit:
        fail(
            op,
            f"block_index lists {what} blocks in [{lo}, {hi}], but there are {limit} "
            f"(ceil(L / {SPARSE_BLOCK})); listed entries must be in [0, {limit})",
        )
    ordered = torch.where(listed, block_index, -1 - torch.arange(width, device=block_index.device)).sort(-1).values
    if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        fail(op, "block_index lists a block twice for one query block; listed entries must be distinct")


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    block_count: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[torch.Tensor] = None,
    precision: str = "exact",
    token_order: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` as ``fused.attention``'s, in every precision (the 8-bit
    ones take fp16/bf16 inputs only, as ``fused.attention_int8``);
    ``token_order``: :func:`check_token_order`."""
    op = "block_sparse_attention"
    if not isinstance(precision, str) or precision not in PRECISIONS:
        fail(op, f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "exact":
        out, lse = attention(q, k, v, scale, causal, seq_dim, kv_lengths)  # validates q, k, v and the options
    else:
        out = _eight_bit(op, q, k, v, scale, causal, seq_dim, kv_lengths)
        lse = q.new_empty(dims(q, seq_dim)[:3], dtype=torch.float32)
    b, h, lq, _ = dims(q, seq_dim)
    check_block_lists("block_sparse_attention", block_index, block_count, b, h, lq, dims(k, seq_dim)[2], q.device)
    if token_order is not None and precision == "exact":
        # Exact attention's backward must see the permuted q, k and v its forward saw.
        fail(
            op,
            "token_order runs in the 8-bit precisions ('int8', 'int8_fp8'); for exact attention "
            "compile_ops.block_sparse_attention permutes q, k and v around this op",
        )
    check_token_order(op, token_order, q, k, seq_dim, causal)
    return out, lse


def block_sparse_attention_int8_fp8_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    block_count: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[torch.Tensor] = None,
    token_order: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [B, Lq, Hq, D] float8_e4m3fn, row_scale [B, Lq] fp32)``,
    contiguous, whatever q's layout: ``fused.attention_int8_fp8_rows``'s rows,
    over the listed blocks (``token_order``: :func:`check_token_order`)."""
    op = "block_sparse_attention_int8_fp8_rows"
    _eight_bit(op, q, k, v, scale, causal, seq_dim, kv_lengths)
    b, h, lq, d = dims(q, seq_dim)
    check_block_lists(op, block_index, block_count, b, h, lq, dims(k, seq_dim)[2], q.device)
    check_token_order(op, token_order, q, k, seq_dim, causal)
    return q.new_empty((b, lq, h, d), dtype=torch.float8_e4m3fn), q.new_empty((b, lq), dtype=torch.float32)


def block_sparse_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    block_index: torch.Tensor,
    block_count: torch.Tensor,
    scale: float,
    causal: bool,
    seq_dim: int = 2,
    kv_lengths: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` as ``fused.attention_backward``'s."""
    grads = attention_backward(grad_out, q, k, v, out, lse, scale, causal, seq_dim, kv_lengths)
    b, h, lq, _ = dims(q, seq_dim)
    check_block_lists(
        "block_sparse_attention_backward", block_index, block_count, b, h, lq, dims(k, seq_dim)[2], q.device
    )
    return grads


# ---------------------------------------------------------------- builders


def block_index_from_mask(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``mask [..., NQ, NK]`` bool -> ``(index [..., NQ, NK] int32, count [..., NQ] int32)``."""
    op = "block_index_from_mask"
    if not isinstance(mask, torch.Tensor):
        fail(op, f"mask must be a torch.Tensor, got {type(mask).__name__}", TypeError)
    if mask.dtype != torch.bool:
        fail(op, f"mask must be bool (True: the query block attends to the key block), got {mask.dtype}", TypeError)
    if mask.dim() < 2:
        fail(op, f"mask must be [..., query blocks, key blocks], got shape {tuple(mask.shape)}")
    return (mask.new_empty(mask.shape, dtype=torch.int32), mask.new_empty(mask.shape[:-1], dtype=torch.int32))


def topk_block_index(
    q: torch.Tensor, k: torch.Tensor, coverage: float, sink_blocks: int = 1, scale: float = 1.0, seq_dim: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index [B, H, NQ, NK] int32, count [B, H, NQ] int32)`` for q ``[B, H, Lq, D]``
    (or ``[B, Lq, H, D]``) and k."""
    op = "topk_block_index"
    if seq_dim not in (1, 2) or isinstance(seq_dim, bool):
        fail(op, f"seq_dim must be 2 ([B, H, L, D]) or 1 ([B, L, H, D]), got {seq_dim!r}")
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
        if t.dim() != 4 or not t.dtype.is_floating_point:
            fail(op, f"{name} must be a 4-D floating tensor, got {t.dtype} of shape {tuple(t.shape)}")
    check_same_device(op, q, "q", k=k)
    b, h, lq, d = dims(q, seq_dim)
    bk, hk, lk, dk = dims(k, seq_dim)
    if bk != b or dk != d or hk == 0 or h % hk:
        fail(op, f"k {tuple(k.shape)} must share q's batch and head dim, with heads dividing q's (q {tuple(q.shape)})")
    if not isinstance(coverage, (int, float)) or isinstance(coverage, bool) or not 0.0 < coverage <= 1.0:
        fail(op, f"coverage must be a share of the attention mass in (0, 1], got {coverage!r}")
    if not isinstance(sink_blocks, int) or isinstance(sink_blocks, bool) or sink_blocks < 0:
        fail(op, f"sink_blocks must be an int >= 0, got {sink_blocks!r}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        fail(op, f"scale must be a float > 0, got {scale!r}")
    nq, nk = num_blocks(lq), num_blocks(lk)
    return (q.new_empty((b, h, nq, nk), dtype=torch.int32), q.new_empty((b, h, nq), dtype=torch.int32))


def _positive_ints(op: str, name: str, values, n: int = 3) -> tuple:
    values = tuple(values) if isinstance(values, (tuple, list)) else values
    if (
        not isinstance(values, tuple)
        or len(values) != n
        or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in values)
    ):
        fail(op, f"{name} must be {n} positive ints, got {values!r}")
    return values


def check_tiles(op: str, grid, tile, ragged: bool = False) -> tuple:
    """``(frames, height, width)`` cut into ``tile`` cubes: the tile grid. With
    ``ragged`` a tile that does not divide the grid leaves smaller tiles at
    the far edges (the tile grid rounds up); without, it is an error."""
    grid = _positive_ints(op, "(frames, height, width)", grid)
    tile = _positive_ints(op, "tile", tile)
    if not ragged and any(g % t for g, t in zip(grid, tile)):
        fail(
            op,
            f"tile {tile} must divide the token grid (frames, height, width) = {grid} "
            "(or pass ragged=True: smaller tiles at the far edges)",
        )
    return tuple(-(-g // t) for g, t in zip(grid, tile))


def check_window(op: str, tile_grid, window) -> None:
    tile_grid = _positive_ints(op, "tile_grid", tile_grid)
    window = _positive_ints(op, "window", window)
    if any(w > n for w, n in zip(window, tile_grid)):
        fail(op, f"window {window} must fit in the tile grid {tile_grid}")


def check_radial(op: str, frames: int, tokens_per_frame: int, dense_frames: int) -> None:
    _positive_ints(op, "(frames, tokens_per_frame)", (frames, tokens_per_frame), 2)
    if not isinstance(dense_frames, int) or isinstance(dense_frames, bool) or dense_frames < 0:
        fail(op, f"dense_frames must be an int >= 0, got {dense_frames!r}")
