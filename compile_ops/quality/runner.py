"""The generation loop: load the pipeline, run every prompt x seed in every mode, compare to ``exact``.

Each mode gets a freshly loaded transformer: ``precision="fp8"`` quantizes
the Linears in place and releases their weights, so a patched transformer
cannot be unpatched. The transformer alone is reloaded from the pipeline's
``transformer`` folder (not the whole pipeline, whose text encoders may be
far larger, and not a deep copy, which would hold two transformers in
memory at once); the rest of the pipeline is loaded once.
"""

import dataclasses
import gc
import inspect
import os
import time
import traceback
from pathlib import Path
from typing import Optional

import torch

from compile_ops.quality import metrics, report
from compile_ops.quality.modes import Mode

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ReferenceFailed(RuntimeError):
    """The unpatched pipeline's generation failed: no mode can be compared."""


@dataclasses.dataclass
class Settings:
    """What one report runs (the command line's arguments).

    Attributes:
        pipeline: a local pipeline folder or a Hub id (from the local cache
            unless ``allow_download``).
        prompts: the prompts, one generation each per seed and mode.
        modes: :class:`~compile_ops.quality.modes.Mode` list, ``exact`` first.
        seeds: one ``torch.Generator`` seed per generation.
        out: the folder the report is written to.
        steps, height, width, frames: the pipeline call's ``num_inference_steps``,
            ``height``, ``width``, ``num_frames`` (None: the pipeline's default;
            each is passed only to a pipeline whose call takes it).
        device: where the pipeline runs (``"cuda"``, ``"cpu"``).
        dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        allow_download: let diffusers fetch a missing pipeline from the Hub.
        clip: a local CLIP model folder for the CLIP score, or None.
        diff_gain: the factor on the absolute difference in the grids.
    """

    pipeline: str
    prompts: list
    modes: list
    seeds: list
    out: Path
    steps: Optional[int] = None
    height: Optional[int] = None
    width: Optional[int] = None
    frames: Optional[int] = None
    device: str = "cuda"
    dtype: str = "bfloat16"
    allow_download: bool = False
    clip: Optional[str] = None
    diff_gain: float = 4.0


def read_prompts(path, argument: str = "--prompts") -> list:
    """The prompts of a text file, one a line (blank lines and ``#`` comments
    skipped); a missing or empty file raises a ValueError naming ``argument``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{argument}: no such file: {path}")
    prompts = [line.strip() for line in path.read_text().splitlines()]
    prompts = [p for p in prompts if p and not p.startswith("#")]
    if not prompts:
        raise ValueError(f"{argument}: {path} holds no prompt (one a line)")
    return prompts


def _dtype_keyword() -> str:
    # diffusers renamed from_pretrained's torch_dtype to dtype; older versions ignore an unknown dtype
    from diffusers.utils import deprecation_utils

    return "dtype" if hasattr(deprecation_utils, "_TORCH_DTYPE_DEPRECATION_MESSAGE") else "torch_dtype"


def _load_options(settings: Settings) -> dict:
    return {_dtype_keyword(): DTYPES[settings.dtype], "local_files_only": not settings.allow_download}


def load_pipeline(settings: Settings):
    """The diffusers pipeline of ``settings.pipeline`` on ``settings.device``; a
    pipeline that cannot be loaded raises a ValueError naming ``--pipeline``."""
    import diffusers

    try:
        pipe = diffusers.DiffusionPipeline.from_pretrained(settings.pipeline, **_load_options(settings))
    except (OSError, ValueError, EnvironmentError) as error:
        where = "local folder or cached Hub id" if not settings.allow_download else "folder or Hub id"
        hint = "" if settings.allow_download else " (nothing is downloaded unless you pass --allow-download)"
        raise ValueError(
            f"--pipeline: cannot load a diffusers pipeline from {settings.pipeline!r} as a {where}{hint}: {error}"
        ) from error
    if getattr(pipe, "transformer", None) is None:
        raise ValueError(f"--pipeline: {settings.pipeline!r} has no `transformer` component for compile_ops.patch")
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(settings.device)


def reload_transformer(pipe, settings: Settings) -> None:
    """Replace ``pipe.transformer`` by a fresh copy from disk, the old one freed first."""
    cls = type(pipe.transformer)
    pipe.transformer = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    transformer = cls.from_pretrained(settings.pipeline, subfolder="transformer", **_load_options(settings))
    pipe.transformer = transformer.to(settings.device)


def call_arguments(pipe, prompt: str, seed: int, settings: Settings) -> dict:
    """The pipeline call's keyword arguments: those of ``settings`` its ``__call__`` takes."""
    parameters = inspect.signature(pipe.__call__).parameters
    wanted = {
        "num_inference_steps": settings.steps,
        "height": settings.height,
        "width": settings.width,
        "num_frames": settings.frames,
    }
    arguments = {k: v for k, v in wanted.items() if v is not None and k in parameters}
    generator_device = "cpu" if settings.device == "mps" else settings.device
    arguments.update(prompt=prompt, output_type="np", generator=torch.Generator(generator_device).manual_seed(seed))
    return arguments


def generate(pipe, prompt: str, seed: int, settings: Settings):
    """One generation: ``(output, seconds, peak bytes or None)``; the output a float
    array in [0, 1], ``(H, W, C)`` for an image pipeline, ``(F, H, W, C)`` for a video one."""
    import numpy as np

    cuda = torch.device(settings.device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.inference_mode():
        result = pipe(**call_arguments(pipe, prompt, seed, settings))
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else None
    output = result.frames if hasattr(result, "frames") else result.images
    output = np.asarray(output[0], dtype=np.float32)
    return output, seconds, peak


def _patch(pipe, mode: Mode) -> str:
    # compile_ops.patch's diffusers branch, called below the package's __init__ (tests/test_imports.py)
    from compile_ops.integrations.diffusers import patch
    from compile_ops.integrations.options import PatchOptions

    return str(patch(pipe.transformer, PatchOptions.from_keywords(mode.patch_options())))


def run(settings: Settings, log=print) -> dict:
    """Generate every prompt x seed in every mode, write the outputs, grids and
    metrics under ``settings.out``, and return the results (also ``quality.json``)."""
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    pipe = load_pipeline(settings)
    lpips_metric = metrics.LPIPS(settings.device, settings.allow_download)
    clip_metric = metrics.ClipScore(settings.clip, settings.device)
    results = {
        "pipeline": settings.pipeline,
        "pipeline_class": type(pipe).__name__,
        "transformer_class": type(pipe.transformer).__name__,
        "settings": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in dataclasses.asdict(settings).items()
            if k not in ("modes", "prompts")
        },
        "prompts": settings.prompts,
        "ssim": "luminance (BT.601), Gaussian window 11, sigma 1.5, K1 0.01, K2 0.03, data range 1",
        "notes": [m.note for m in (lpips_metric, clip_metric) if not m.available],
        "modes": [],
        "runs": [],
    }
    references = {}
    for index, mode in enumerate(settings.modes):
        entry = {"name": mode.name, "patch": mode.describe(), "status": "ok", "error": None, "patch_report": None}
        results["modes"].append(entry)
        if index > 0:
            reload_transformer(pipe, settings)
        if not mode.is_exact:
            try:
                entry["patch_report"] = _patch(pipe, mode)
            except (TypeError, ValueError, NotImplementedError, RuntimeError) as error:
                entry.update(status="refused", error=f"{type(error).__name__}: {error}")
                log(f"[{mode.name}] refused by compile_ops.patch: {error}")
                continue
        for p, prompt in enumerate(settings.prompts):
            for seed in settings.seeds:
                log(f"[{mode.name}] prompt {p} seed {seed}")
                try:
                    output, seconds, peak = generate(pipe, prompt, seed, settings)
                except Exception as error:  # a failing mode is reported, the others still run
                    if mode.is_exact:
                        raise ReferenceFailed(
                            f"the reference generation (mode exact) failed, nothing to compare against: "
                            f"{type(error).__name__}: {error}"
                        ) from error
                    entry.update(status="failed", error=f"{type(error).__name__}: {error}")
                    log(f"[{mode.name}] generation failed:\n{traceback.format_exc()}")
                    break
                key = (p, seed)
                if mode.is_exact:
                    references[key] = output
                reference = references[key]
                run_entry = {
                    "mode": mode.name,
                    "prompt_index": p,
                    "seed": seed,
                    "seconds": seconds,
                    "peak_memory_bytes": peak,
                    "shape": list(output.shape),
                    "metrics": metrics.compare(reference, output),
                }
                if lpips_metric.available:
                    run_entry["metrics"]["lpips"] = lpips_metric(reference, output)
                if clip_metric.available:
                    run_entry["metrics"]["clip_score"] = clip_metric(prompt, output)
                run_entry["files"] = report.write_output_files(
                    out, mode, p, seed, reference, output, settings.diff_gain
                )
                results["runs"].append(run_entry)
            if entry["status"] == "failed":
                break
    results["notes"] += report.media_notes()
    report.write_report(out, results)
    return results


def default_out(settings_pipeline: str) -> Path:
    """``quality-<pipeline folder name>`` in the working directory."""
    return Path(f"quality-{os.path.basename(os.path.normpath(settings_pipeline)) or 'pipeline'}")
