"""The README's main command on a machine without a GPU: the demo DiT block built
on the fused ops compiles with fullgraph=True and matches plain PyTorch."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import demo  # noqa: E402


def test_demo_dit_block_compiles_and_matches_pytorch():
    assert demo.main() == 0
