"""Denoising-step schedules of a patched model's attention.

Samplers call a diffusion transformer once or twice (classifier-free
guidance) per denoising step, with the step's timestep. Counting distinct
timesteps gives the step; a timestep above the previous call's starts a new
generation. Approximate attention (sparse layouts, 8-bit) is commonly kept
off for the first steps, which lay out the image's structure: ``dense_steps``.
The count reads the timestep on the host, in a forward pre-hook on the model,
so a schedule wants the blocks compiled (``block.compile()``, diffusers'
``compile_repeated_blocks``), not the whole model.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_dense_steps(owner: str, dense_steps) -> None:
    """Raise a ValueError naming ``owner`` unless ``dense_steps`` is an int >= 0 (a bool is not)."""
    if not isinstance(dense_steps, int) or isinstance(dense_steps, bool) or dense_steps < 0:
        raise ValueError(f"{owner}: dense_steps must be an int >= 0, got {dense_steps!r}")


class DenoisingSteps:
    """The denoising step of the latest model call (``step``, 0-based)."""

    def __init__(self, owner: str):
        self.owner = owner  # who counts, for the error message
        self.step, self._last_timestep = 0, None

    def update(self, timestep) -> None:
        """Count the call with ``timestep`` (a tensor or a number; None: not counted)."""
        if timestep is None:
            return
        if torch.compiler.is_compiling():
            raise RuntimeError(
                f"{self.owner}: dense_steps reads the timestep on the host in the model's forward "
                "pre-hook; compile the transformer blocks (block.compile() / "
                "compile_repeated_blocks) rather than the whole model, or use dense_steps=0"
            )
        t = float(timestep.flatten()[0]) if isinstance(timestep, Tensor) else float(timestep)
        if self._last_timestep is None or t > self._last_timestep:
            self.step = 0  # the first call, or a new generation
        elif t != self._last_timestep:
            self.step += 1
        self._last_timestep = t


class DenseFirst:
    """``patch(attention_precision="int8", attention_dense_steps=N)``: the first
    N denoising steps of each generation run exact attention, the rest 8-bit
    (dense attention, and a sparse plan's block-sparse steps, each counted by
    its own schedule). The processors read ``active``; the model's forward
    pre-hook sets it."""

    def __init__(self, dense_steps: int):
        check_dense_steps("compile_ops.patch: attention_dense_steps", dense_steps)
        self.dense_steps = dense_steps
        self.steps = DenoisingSteps("compile_ops 8-bit attention")
        self.active = dense_steps == 0

    def pre_forward(self, module, args, kwargs) -> None:
        if self.dense_steps:
            self.steps.update(kwargs.get("timestep"))
            self.active = self.steps.step >= self.dense_steps
