"""``python -m compile_ops.quality``: the command line of the quality report (package docstring)."""

import argparse
import sys
from pathlib import Path

import torch

from compile_ops.quality.modes import VALID_MODES, parse_modes
from compile_ops.quality.runner import DTYPES, ReferenceFailed, Settings, default_out, read_prompts


def _seeds(text: str) -> list:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds: expected comma-separated integers, got {text!r}") from None
    if not seeds:
        raise ValueError("--seeds: no seed given")
    return seeds


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m compile_ops.quality",
        description="Compare compile_ops' approximate modes against the unpatched transformer on your own pipeline: "
        "PSNR, SSIM, grids and timings per prompt, seed and mode.",
    )
    p.add_argument("--pipeline", required=True, help="a diffusers pipeline folder or Hub id (from the local cache)")
    p.add_argument("--prompts", required=True, help="a text file, one prompt a line")
    p.add_argument(
        "--modes",
        default="exact,fp8,int8_fp8",
        help=f"comma-separated modes, parts joined with '+': {', '.join(VALID_MODES)}",
    )
    p.add_argument("--seeds", default="0", help="comma-separated generator seeds")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: quality-<pipeline name>)")
    p.add_argument("--steps", type=int, default=None, help="num_inference_steps (default: the pipeline's)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None, help="num_frames, for a video pipeline")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--diff-gain", type=float, default=4.0, help="factor on the absolute difference in the grids")
    p.add_argument("--clip", default=None, help="a local CLIP model folder, for the CLIP score")
    p.add_argument("--allow-download", action="store_true", help="let diffusers fetch a pipeline missing locally")
    return p


def settings_from_args(argv=None) -> Settings:
    """The :class:`Settings` of a command line; a bad argument raises a ValueError naming it."""
    args = parser().parse_args(argv)
    modes = parse_modes(args.modes)
    prompts = read_prompts(args.prompts)
    seeds = _seeds(args.seeds)
    for name in ("steps", "height", "width", "frames"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name}: must be a positive integer, got {value}")
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        raise ValueError(f"--device: {error}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {args.device!r} but CUDA is not available here (pass --device cpu)")
    return Settings(
        pipeline=args.pipeline,
        prompts=prompts,
        modes=modes,
        seeds=seeds,
        out=args.out or default_out(args.pipeline),
        steps=args.steps,
        height=args.height,
        width=args.width,
        frames=args.frames,
        device=args.device,
        dtype=args.dtype,
        allow_download=args.allow_download,
        clip=args.clip,
        diff_gain=args.diff_gain,
    )


def main(argv=None) -> int:
    """Run the report; a bad argument prints ``error: ...`` naming it and returns 2, a failed
    reference generation returns 1."""
    try:
        settings = settings_from_args(argv)
        from compile_ops.quality.runner import run

        results = run(settings, log=lambda line: print(line, file=sys.stderr))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ReferenceFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {settings.out / 'index.md'} ({len(results['runs'])} generations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
