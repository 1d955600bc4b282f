"""Size strategies of the kernel tests: wide on CPU, few and repeating on a GPU.

Why two: on a GPU every distinct kernel *variant* compiles anew (about a
second each, from a cold Triton cache), and a variant is keyed not only by the
constexpr arguments (channel block, head dim, dtype, flags) but by Triton's
specialization of every integer argument (equal to 1, divisible by 16). A
size drawn from ``integers(1, 200)`` gives almost every example a fresh
combination of lengths and strides, so the GPU layer spent its time compiling
(7 tests in 330 s cold). Under the interpreter nothing compiles and the wide
ranges are what find the edge cases, so CPU CI keeps them unchanged.

On the GPU the choices below are few but still cover what the kernels branch
on: 1, odd sizes that leave a partial tile, exact multiples of 16, sizes past
one tile, and the model sizes.
"""

import os

import torch
from hypothesis import strategies as st

#: The GPU layer (not the interpreter): sizes come from the fixed choices.
ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"


def size(cpu: st.SearchStrategy, gpu: list) -> st.SearchStrategy:
    """``cpu`` on the CPU (the interpreter), ``sampled_from(gpu)`` on a GPU."""
    return st.sampled_from(gpu) if ON_GPU else cpu


def examples(cpu: int, gpu: int) -> int:
    """An explicit per-test example count (tests whose examples are slow), by where they run."""
    return gpu if ON_GPU else cpu
