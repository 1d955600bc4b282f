"""The poisoned-allocation switch (``tests/poison.py``, ``COMPILE_OPS_POISON_EMPTY``).

Reference layer: what each dtype is filled with, the scope rule, and that
uninstalling puts torch back. Kernel layer (interpreter only: the poison is
for CPU tensors): with a launch that writes a buffer skipped (the 8-bit
quantizing pass's zeroing of its arrival counters, which on plain CPU
memory, often zeros, goes unnoticed), the poison turns the outputs to NaN:
the switch does catch a read of an element nobody wrote.
"""

import poison
import pytest
import torch
from conftest import INTERPRET


def test_each_dtype_gets_its_poison_over_the_whole_storage():
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        t = poison.poison_(torch.zeros(5, dtype=dtype))
        assert t.isnan().all(), dtype
    for dtype in (torch.int8, torch.uint8, torch.int32, torch.int64, torch.float8_e4m3fn, torch.float8_e5m2):
        t = poison.poison_(torch.zeros(3, dtype=dtype))
        assert (t.view(torch.uint8) == poison.POISON_BYTE).all(), dtype
    assert torch.isnan(poison.poison_(torch.zeros(2, dtype=torch.float8_e4m3fn)).float()).all()
    assert poison.poison_(torch.zeros(4, dtype=torch.bool)).all()
    # The gaps of a strided allocation, and a padded buffer's tail behind a narrower view, are poisoned too.
    strided = poison.poison_(torch.zeros(12).as_strided((2, 2), (6, 1)))
    assert torch.tensor([]).set_(strided.untyped_storage()).isnan().all()


def test_the_scope_follows_the_switch(monkeypatch):
    for value, scope in (("0", None), ("", None), ("1", "package"), ("package", "package"), ("ALL", "all")):
        monkeypatch.setenv(poison.SWITCH, value)
        assert poison.scope() == scope, value
    monkeypatch.setenv(poison.SWITCH, "everything")
    with pytest.raises(ValueError, match="COMPILE_OPS_POISON_EMPTY must be 0, 1, package or all"):
        poison.scope()


def test_package_scope_poisons_the_package_allocations_only(monkeypatch):
    from compile_ops.meta import attention as meta_attention

    filled = []
    monkeypatch.setattr(poison, "poison_", filled.append)
    originals = [getattr(owner, name) for owner, name in poison._ALLOCATORS]
    saved = poison.install("package")
    try:
        torch.empty(3), torch.zeros(3).new_empty(3), torch.empty_like(torch.zeros(2))  # the test's own: untouched
        assert filled == []
        q = torch.ones(1, 1, 4, 8, dtype=torch.float16)
        out, lse = meta_attention.attention(q, q, q, 1.0, False)  # the fake's outputs: the package's allocations
        assert [t is out or t is lse for t in filled] == [True, True]
    finally:
        poison.uninstall(saved)
    assert [getattr(owner, name) for owner, name in poison._ALLOCATORS] == originals


class _Skipped:
    """A launcher that launches nothing: ``_Skipped()[grid](*args)``."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.mark.kernels
@pytest.mark.skipif(not INTERPRET, reason="the poison fills CPU tensors: the interpreter's")
def test_kernels_a_skipped_write_turns_the_output_to_nan_under_the_poison(monkeypatch):
    import compile_ops
    from compile_ops.ops import attention_8bit

    launch = attention_8bit.launcher

    def without_the_counters_clear(kernel):
        if kernel is attention_8bit.kv8_counters_clear_kernel:
            return _Skipped()
        return launch(kernel)

    monkeypatch.setattr(attention_8bit, "launcher", without_the_counters_clear)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 130, 16, dtype=torch.float16) for _ in range(3))
    index, count = compile_ops.block_index_from_mask(torch.ones(1, 1, 2, 2, dtype=torch.bool))

    saved = poison.install("package")
    try:
        with torch.no_grad():
            poisoned = compile_ops.block_sparse_attention(q, k, v, index, count, precision="int8_fp8")
    finally:
        poison.uninstall(saved)
    # The arrival counts then start at 0x7F7F7F7F, no program is the head's last, its totals stay poisoned.
    assert poisoned.isnan().all()
