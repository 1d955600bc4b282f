"""Quality report: what compile_ops' approximate modes (FP8, 8-bit attention, sparse attention)
do to a diffusers pipeline's images or videos, against the unpatched model.

Run it as ``python -m compile_ops.quality --pipeline PATH --prompts FILE
--modes exact,fp8,int8_fp8 --seeds 0,1`` (``--help`` lists the options;
docs/integrations.md, "Checking quality on your own weights"). diffusers and
Pillow are imported only when a report runs.
"""

from compile_ops.quality.metrics import psnr, ssim
from compile_ops.quality.modes import VALID_MODES, Mode, parse_modes

__all__ = ["VALID_MODES", "Mode", "parse_modes", "psnr", "ssim"]
