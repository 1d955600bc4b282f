"""Sparse self-attention for video DiTs, as :func:`compile_ops.patch` turns it on.

``patch(model, attention=SlidingTile(...))`` (or :class:`Radial`, :class:`TopK`)
gives the model's video self-attention layers one shared
:class:`SparseAttention` plan. A forward pre-hook on the model reads the
latent grid of each call (Wan, HunyuanVideo: the ``[B, C, F, H, W]`` input
and the patch size; LTX-Video: its ``num_frames/height/width`` arguments) and
the denoising step, and picks the layout for it: the token permutation and
block lists, built once per grid and cached. The processors then run
``fused.block_sparse_attention`` on the permuted q/k/v and un-permute the
output, in the processors' attention precision (``attention_precision="int8"``
or ``"int8_fp8"``: on 8-bit operands, for 16-bit inference calls). Text
stays dense: cross-attention (Wan, LTX-Video) is untouched, and
where text tokens follow the video tokens in the same attention
(HunyuanVideo) every query attends to them and they attend to everything;
the text padding mask becomes key lengths (the permutation keeps the
padding last). :class:`TopK` covers video-only self-attention.

Schedule: ``dense_steps=N`` keeps the first N denoising steps dense (a step
= a distinct timestep; a timestep above the previous call's starts a new
generation); those steps run the processors' dense attention, in its own
precision (8-bit from the step ``attention_dense_steps`` says, as a model
without a sparse plan). It reads the timestep on the host once per call, in the
pre-hook: compile the blocks (``block.compile()``, diffusers'
``compile_repeated_blocks``), not the whole model, where a schedule is set.
Compile count, blocks compiled with ``dynamic=True``: one graph per mode
(dense, sparse), shared by the blocks, for every resolution; switching back
and forth costs nothing more (torch.compile keeps both). With static shapes
(the default) a new resolution compiles again, as it does for a dense model.

The block size is the kernels' 128 tokens. A tile that does not divide the
grid leaves smaller tiles at its far edges (no padding, no error): blocks
then straddle tiles, and the block mask is the smallest one covering every
tile pair in the window (``sliding_tile_block_mask``), a superset of the
token-level pattern. A window larger than the tile grid raises, naming both.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
from torch import Tensor

from compile_ops.integrations.schedule import DenoisingSteps, check_dense_steps
from compile_ops.meta.attention import SPARSE_BLOCK
from compile_ops.meta.block_sparse import num_blocks
from compile_ops.ops.block_sparse import (
    block_index_from_mask,
    block_sparse_attention,
    block_sparse_attention_fp8_rows,
    radial_mask,
    sliding_tile_block_mask,
    tile_permutation,
    topk_block_index,
)
from compile_ops.ops.fp8 import FP8Rows


def _check_steps(cls: str, dense_steps) -> None:
    check_dense_steps(f"compile_ops.{cls}", dense_steps)


def _check_triple(cls: str, name: str, value) -> tuple:
    if not (
        isinstance(value, (tuple, list))
        and len(value) == 3
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise ValueError(
            f"compile_ops.{cls}: {name} must be three positive ints (frames, height, width), got {value!r}"
        )
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class SlidingTile:
    """Sliding-tile attention (STA): tokens grouped in ``tile`` cubes of the
    latent grid, each tile attending to the ``window`` tiles around it.

    Args:
        window: ``(wt, wh, ww)`` tiles (at most the tile grid's extent).
        tile: ``(t, h, w)`` latent tokens per tile; ``t * h * w`` = 128 (the
            kernels' block) keeps the block mask exactly the tile pattern on
            grids the tile divides.
        dense_steps: the first denoising steps run dense (module docstring).
    """

    window: tuple = (3, 3, 3)
    tile: tuple = (2, 8, 8)
    dense_steps: int = 0

    def __post_init__(self):
        _check_triple("SlidingTile", "window", self.window)
        _check_triple("SlidingTile", "tile", self.tile)
        _check_steps("SlidingTile", self.dense_steps)

    def layout(self, grid: tuple, device, text_tokens: int = 0) -> "Layout":
        perm, mask = sliding_tile_block_mask(*grid, self.tile, self.window, device=device)
        return Layout.from_mask(perm, mask, perm.numel(), text_tokens)


@dataclasses.dataclass(frozen=True)
class Radial:
    """Radial attention: tokens in frame order; blocks within ``dense_frames``
    frames of each other attend fully, farther ones within a spatial reach
    that halves each time the temporal distance doubles (``radial_mask``).

    Args:
        dense_frames: latent frames of full attention around each frame.
        dense_steps: the first denoising steps run dense.
    """

    dense_frames: int = 1
    dense_steps: int = 0

    def __post_init__(self):
        if not isinstance(self.dense_frames, int) or isinstance(self.dense_frames, bool) or self.dense_frames < 0:
            raise ValueError(f"compile_ops.Radial: dense_frames must be an int >= 0, got {self.dense_frames!r}")
        _check_steps("Radial", self.dense_steps)

    def layout(self, grid: tuple, device, text_tokens: int = 0) -> "Layout":
        frames, height, width = grid
        return Layout.from_mask(
            None,
            radial_mask(frames, height * width, self.dense_frames, device=device),
            frames * height * width,
            text_tokens,
        )


@dataclasses.dataclass(frozen=True)
class TopK:
    """Dynamic block selection: per query block and head, the key blocks that
    hold ``coverage`` of the attention mass estimated from block means
    (``topk_block_index``), on tokens grouped in ``tile`` cubes so that a
    block is a local patch of the video.

    Args:
        coverage: share of the estimated mass to keep, in (0, 1].
        sink_blocks: key blocks always kept.
        tile: as :class:`SlidingTile`'s.
        dense_steps: the first denoising steps run dense.
    """

    coverage: float = 0.9
    sink_blocks: int = 1
    tile: tuple = (2, 8, 8)
    dense_steps: int = 0

    def __post_init__(self):
        if not isinstance(self.coverage, (int, float)) or not 0 < self.coverage <= 1:
            raise ValueError(f"compile_ops.TopK: coverage must be in (0, 1], got {self.coverage!r}")
        if not isinstance(self.sink_blocks, int) or isinstance(self.sink_blocks, bool) or self.sink_blocks < 0:
            raise ValueError(f"compile_ops.TopK: sink_blocks must be an int >= 0, got {self.sink_blocks!r}")
        _check_triple("TopK", "tile", self.tile)
        _check_steps("TopK", self.dense_steps)

    def layout(self, grid: tuple, device, text_tokens: int = 0) -> "Layout":
        if text_tokens:
            raise ValueError(
                "compile_ops.TopK: block lists chosen per call cover video-only self-attention "
                "(Wan, LTX-Video); for joint video + text attention (HunyuanVideo) use SlidingTile "
                "or Radial"
            )
        perm = tile_permutation(*grid, self.tile, device=device, ragged=True)
        return Layout(perm, torch.argsort(perm), None, None, None, topk=self)


#: The configurations ``compile_ops.patch(attention=...)`` takes.
SPARSE_ATTENTION = (SlidingTile, Radial, TopK)


def _with_text(mask: Tensor, video: int, text: int) -> Tensor:
    """The video block mask extended to ``video + text`` tokens (text last): every
    query block attends to every block holding text (the one shared with the
    last video tokens included), and blocks holding text attend to all."""
    n = num_blocks(video + text)
    full = torch.zeros(n, n, dtype=torch.bool, device=mask.device)
    full[: mask.shape[0], : mask.shape[1]] = mask
    first_text = video // SPARSE_BLOCK
    full[:, first_text:] = True
    full[first_text:, :] = True
    return full


@dataclasses.dataclass
class Layout:
    """One (grid, text length)'s sparse attention: ``perm [L]`` of the whole
    sequence (video tokens permuted, text tokens after them in place; None:
    natural order) and its inverse, and static block lists
    ``index [1, 1, NB, W]`` / ``count [1, 1, NB]`` (W the longest list's length)
    with their ``density`` (or None for lists chosen per call: ``topk``)."""

    perm: Optional[Tensor]
    inverse: Optional[Tensor]
    index: Optional[Tensor]
    count: Optional[Tensor]
    density: Optional[float]
    text_tokens: int = 0
    topk: Optional[TopK] = None

    def __post_init__(self):
        # Sizes that follow the grid: dynamic to torch.compile(dynamic=True)
        # from the first compile, so a second resolution is no recompile.
        for t, dims in ((self.perm, (0,)), (self.inverse, (0,)), (self.index, (2, 3)), (self.count, (2,))):
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, dims)

    @classmethod
    def from_mask(cls, perm: Optional[Tensor], mask: Tensor, video: int, text_tokens: int = 0) -> "Layout":
        """``mask [NB, NB]`` over the ``video`` (permuted) video tokens, ``perm``
        their order (None: natural), followed by ``text_tokens`` text tokens."""
        if text_tokens:
            mask = _with_text(mask, video, text_tokens)
            if perm is not None:
                perm = torch.cat([perm, torch.arange(video, video + text_tokens, device=perm.device)])
        index, count = block_index_from_mask(mask)
        # As wide as the longest list, not NB: the op sorts its lists on every call, at a cost
        # that follows their width (padded to a power of two).
        index = index.narrow(-1, 0, max(int(count.max()), 1)).contiguous()
        return cls(
            perm,
            None if perm is None else torch.argsort(perm),
            index[None, None],
            count[None, None],
            mask.float().mean().item(),
            text_tokens,
        )

    def attend(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_lengths: Optional[Tensor] = None,
        scale: Optional[float] = None,
        precision: str = "exact",
        fp8_rows: bool = False,
    ) -> Union[Tensor, FP8Rows]:
        """Block-sparse attention of ``[B, L, H, D]`` q, k, v in this layout;
        ``kv_lengths [B]``: keys past each sample's length are masked (padded
        text at the end, which the permutation leaves there); ``scale``: None
        is ``1 / sqrt(D)``; ``precision``: :func:`block_sparse_attention`'s
        (``"int8"``, ``"int8_fp8"``: 8-bit operands, inference).
        ``fp8_rows`` (with ``"int8_fp8"``): the output as the ``[B, L, H * D]``
        :class:`FP8Rows` an FP8 output projection reads, written by the
        kernel's epilogue (:func:`block_sparse_attention_fp8_rows`)."""
        if fp8_rows and precision != "int8_fp8":
            raise ValueError(
                f"Layout.attend: fp8_rows=True is a mode of precision='int8_fp8' (FP8 P V), got {precision!r}"
            )

        def attend(q, k, v, index, count, token_order=None):
            options = dict(scale=scale, seq_dim=1, kv_lengths=kv_lengths, token_order=token_order)
            if fp8_rows:
                return block_sparse_attention_fp8_rows(q, k, v, index, count, **options)
            return block_sparse_attention(q, k, v, index, count, precision=precision, **options)

        if self.topk is None:
            # The tile order as the op's token_order: the 8-bit kernels read and write through it (no copies).
            return attend(query, key, value, self.index, self.count, self.perm)
        # 16 bits: the op would permute q, k and v itself; permuted once here, they serve the lists too.
        permute_here = self.perm is not None and precision == "exact"
        if permute_here:
            query, key, value = (t.index_select(1, self.perm) for t in (query, key, value))
        order = None if permute_here else self.perm
        # 8 bits: only the block means read permuted q and k (a compiled graph folds those gathers
        # into their sums); the kernels read q, k, v and write the output through the order.
        q, k = (query, key) if order is None else (t.index_select(1, order) for t in (query, key))
        index, count = topk_block_index(q, k, self.topk.coverage, self.topk.sink_blocks, seq_dim=1)
        out = attend(query, key, value, index, count, order)
        return out.index_select(1, self.inverse) if permute_here else out


class SparseAttention:
    """The plan a patched model's self-attention processors share: the config,
    the layouts built so far (one per grid), and the layout of the current
    call (None: dense), which the model's forward pre-hook sets.

    ``describe()`` says which attention runs and at what density per grid.

    Args:
        config: a :data:`SPARSE_ATTENTION` configuration (``PatchOptions`` checks it).
        grid_of: ``(model, args, kwargs) -> (frames, height, width)`` token grid
            of a model call, or None (that call runs dense).
        layers: how many self-attention layers share the plan (for ``describe``).
        text_of: ``(model, args, kwargs) -> int`` text tokens after the video
            tokens in the same attention, or None (text is cross-attended).
    """

    def __init__(self, config, grid_of, layers: int, text_of=None):
        self.config, self.grid_of, self.layers = config, grid_of, layers
        self.text_of = text_of
        self.layouts: dict = {}
        self.layout: Optional[Layout] = None
        self.steps = DenoisingSteps("compile_ops sparse attention")

    def pre_forward(self, module, args, kwargs) -> None:
        """The model's forward pre-hook: the grid of this call, the step, the layout."""
        grid = self.grid_of(module, args, kwargs)
        if self.config.dense_steps:
            self.steps.update(kwargs.get("timestep"))
        if grid is None or self.steps.step < self.config.dense_steps:
            self.layout = None
            return
        device = next(module.parameters()).device
        text = 0 if self.text_of is None else self.text_of(module, args, kwargs)
        key = (grid, text, device)
        if key not in self.layouts:
            self.layouts[key] = self.config.layout(grid, device, text)
        self.layout = self.layouts[key]

    def describe(self) -> str:
        lines = [f"sparse self-attention in {self.layers} layers: {self.config}"]
        for (grid, text, _), layout in self.layouts.items():
            density = "chosen per call (top-k)" if layout.density is None else f"{layout.density:.1%} of blocks"
            tokens = grid[0] * grid[1] * grid[2] + text
            with_text = f" + {text} text tokens" if text else ""
            lines.append(f"  grid {grid}{with_text} ({num_blocks(tokens)} blocks): {density}")
        return "\n".join(lines)
