"""The report's files: each output, the comparison grids and GIFs, ``quality.json``, ``index.md`` and ``index.html``.

Layout under the output folder: ``outputs/`` (each generation: a PNG per
image, a GIF per video, an MP4 too with imageio-ffmpeg), ``grids/`` (per
prompt, seed and mode: exact | mode | absolute difference x gain; for a
video, those three rows over a few frames), ``quality.json`` and the pages.
Pillow is imported here only, when files are written.
"""

import html
import importlib.util
import json
import math
import statistics

import numpy as np

#: Frames shown in a video's grid, spread evenly over the video.
GRID_FRAMES = 4
#: Panels are scaled up (nearest) to at least this many pixels on their short side.
MIN_PANEL_SIDE = 128
PANEL_GAP = 4
GIF_FPS = 8


def _uint8(images) -> np.ndarray:
    return (np.clip(np.asarray(images, dtype=np.float32), 0, 1) * 255 + 0.5).astype(np.uint8)


def _rgb(images) -> np.ndarray:
    images = _uint8(images)
    return np.repeat(images, 3, axis=-1) if images.shape[-1] == 1 else images


def difference(reference, images, gain: float) -> np.ndarray:
    """``|images - reference| * gain`` clipped to [0, 1], the shape of the inputs."""
    return np.clip(np.abs(np.asarray(images, np.float32) - np.asarray(reference, np.float32)) * gain, 0, 1)


def _tile(rows: list, min_side: int = MIN_PANEL_SIDE) -> np.ndarray:
    """One ``(H, W, 3)`` uint8 array from rows of equally sized panels, with gaps,
    each panel scaled up (nearest) to at least ``min_side`` pixels on its short side."""
    height, width = rows[0][0].shape[:2]
    scale = max(1, math.ceil(min_side / min(height, width)))
    ph, pw = height * scale, width * scale
    columns = max(len(r) for r in rows)
    canvas = np.full(
        (len(rows) * ph + (len(rows) - 1) * PANEL_GAP, columns * pw + (columns - 1) * PANEL_GAP, 3), 255, np.uint8
    )
    for i, row in enumerate(rows):
        for j, panel in enumerate(row):
            big = np.repeat(np.repeat(_rgb(panel), scale, axis=0), scale, axis=1)
            y, x = i * (ph + PANEL_GAP), j * (pw + PANEL_GAP)
            canvas[y : y + ph, x : x + pw] = big
    return canvas


def comparison_grid(reference, images, gain: float) -> np.ndarray:
    """The grid image: for ``(H, W, C)`` images one row exact | mode | difference;
    for ``(F, H, W, C)`` videos those three rows over :data:`GRID_FRAMES` frames."""
    diff = difference(reference, images, gain)
    if np.ndim(images) == 3:
        return _tile([[reference, images, diff]])
    picks = np.unique(np.linspace(0, len(images) - 1, min(GRID_FRAMES, len(images))).round().astype(int))
    return _tile([[r[i] for i in picks] for r in (reference, images, diff)])


def _save_video(path_stem, frames_rows: list) -> list:
    """A GIF (and an MP4 when imageio-ffmpeg is installed) of the frames of
    ``frames_rows`` side by side (each ``(F, H, W, C)``); the written file names."""
    from PIL import Image

    # not scaled up: a GIF's size grows with its pixels and frames
    frames = [_tile([[row[f] for row in frames_rows]], min_side=0) for f in range(len(frames_rows[0]))]
    gif = path_stem.with_suffix(".gif")
    images = [Image.fromarray(f) for f in frames]
    images[0].save(gif, save_all=True, append_images=images[1:], duration=1000 // GIF_FPS, loop=0)
    written = [gif]
    if has_mp4():
        import imageio

        mp4 = path_stem.with_suffix(".mp4")
        imageio.mimwrite(mp4, frames, fps=GIF_FPS)
        written.append(mp4)
    return written


def has_mp4() -> bool:
    """Whether videos are also written as MP4 (imageio with imageio-ffmpeg installed)."""
    return all(importlib.util.find_spec(name) is not None for name in ("imageio", "imageio_ffmpeg"))


def media_notes() -> list:
    """The notes on file formats left out."""
    return [] if has_mp4() else ["MP4 skipped: install imageio and imageio-ffmpeg to write videos as MP4 too"]


def write_output_files(out, mode, prompt_index: int, seed: int, reference, images, gain: float) -> dict:
    """Write one generation's files under ``out`` and return their paths relative to
    it: ``output`` (and ``animation``, ``mp4`` for a video), ``grid`` for a mode other than exact."""
    from PIL import Image

    stem = f"p{prompt_index}_s{seed}_{mode.file_name}"
    for folder in ("outputs", "grids"):
        (out / folder).mkdir(exist_ok=True)
    files = {}
    if np.ndim(images) == 3:
        Image.fromarray(_rgb(images)).save(out / "outputs" / f"{stem}.png")
        files["output"] = f"outputs/{stem}.png"
    else:
        rows = [images] if mode.is_exact else [reference, images, difference(reference, images, gain)]
        written = _save_video(out / "outputs" / stem, rows)
        files["animation"] = f"outputs/{written[0].name}"
        if len(written) > 1:
            files["mp4"] = f"outputs/{written[1].name}"
    if not mode.is_exact:
        Image.fromarray(comparison_grid(reference, images, gain)).save(out / "grids" / f"{stem}.png")
        files["grid"] = f"grids/{stem}.png"
    return files


def _format(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value:.{digits}f}"


def summarize(results: dict) -> list:
    """One row per mode: status, mean and worst PSNR / SSIM (and LPIPS, CLIP score
    when computed), the first call's seconds, the median of the others, the peak memory."""
    rows = []
    for mode in results["modes"]:
        runs = [r for r in results["runs"] if r["mode"] == mode["name"]]
        row = {"mode": mode["name"], "patch": mode["patch"], "status": mode["status"], "error": mode["error"]}
        if runs:
            psnrs = [r["metrics"]["psnr"] for r in runs]
            ssims = [r["metrics"]["ssim"] for r in runs]
            row.update(
                psnr_mean=statistics.fmean(psnrs),
                psnr_min=min(psnrs),
                ssim_mean=statistics.fmean(ssims),
                ssim_min=min(ssims),
                first_call_s=runs[0]["seconds"],
                median_s=statistics.median(r["seconds"] for r in runs[1:]) if len(runs) > 1 else None,
                peak_memory_gib=max((r["peak_memory_bytes"] or 0) for r in runs) / 2**30
                if runs[0]["peak_memory_bytes"] is not None
                else None,
            )
            for name in ("lpips", "clip_score"):
                if name in runs[0]["metrics"]:
                    row[name] = statistics.fmean(r["metrics"][name] for r in runs)
        rows.append(row)
    return rows


_COLUMNS = [
    ("mode", "mode", None),
    ("status", "status", None),
    ("psnr_mean", "PSNR mean (dB)", 2),
    ("psnr_min", "PSNR min (dB)", 2),
    ("ssim_mean", "SSIM mean", 4),
    ("ssim_min", "SSIM min", 4),
    ("lpips", "LPIPS", 4),
    ("clip_score", "CLIP score", 2),
    ("first_call_s", "first call (s)", 2),
    ("median_s", "median call (s)", 2),
    ("peak_memory_gib", "peak memory (GiB)", 2),
]


def _table(rows: list) -> tuple:
    columns = [c for c in _COLUMNS if any(c[0] in r for r in rows)]
    header = [c[1] for c in columns]
    body = [[str(r.get(k, "-")) if d is None else _format(r.get(k), d) for k, _, d in columns] for r in rows]
    return header, body


def markdown(results: dict) -> str:
    """The report as a Markdown page (links relative to its folder)."""
    rows = summarize(results)
    header, body = _table(rows)
    lines = [
        f"# Quality report: {results['pipeline_class']} ({results['transformer_class']})",
        "",
        f"Pipeline `{results['pipeline']}`; every mode against `exact` (the unpatched transformer), "
        f"same prompt and seed. SSIM: {results['ssim']}; PSNR on RGB in [0, 1]. Grids: exact | mode | "
        f"absolute difference x {results['settings']['diff_gain']:g} (videos: those rows over a few frames).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(cells) + " |" for cells in body),
        "",
        "Modes:",
        "",
        *(
            f"- `{r['mode']}`: `{r['patch']}`" + (f" — **{r['status']}**: {r['error']}" if r["error"] else "")
            for r in rows
        ),
    ]
    if results["notes"]:
        lines += ["", "Notes:", "", *(f"- {n}" for n in results["notes"])]
    for mode in results["modes"]:
        if mode["patch_report"]:
            lines += ["", f"<details><summary><code>{mode['name']}</code>: what patch replaced</summary>", ""]
            lines += ["```", mode["patch_report"].rstrip(), "```", "", "</details>"]
    for p, prompt in enumerate(results["prompts"]):
        for seed in results["settings"]["seeds"]:
            lines += ["", f"## Prompt {p}, seed {seed}", "", f"> {prompt}", ""]
            for run in results["runs"]:
                if run["prompt_index"] != p or run["seed"] != seed:
                    continue
                m = run["metrics"]
                caption = f"`{run['mode']}`: PSNR {_format(m['psnr'])} dB, SSIM {_format(m['ssim'], 4)}"
                image = run["files"].get("grid") or run["files"].get("output") or run["files"].get("animation")
                lines += [f"{caption}", "", f"![{run['mode']}]({image})", ""]
    return "\n".join(lines).rstrip() + "\n"


def html_page(results: dict) -> str:
    """The report as a standalone HTML page (same content as :func:`markdown`)."""
    rows = summarize(results)
    header, body = _table(rows)
    esc = html.escape
    parts = [
        "<!doctype html><meta charset='utf-8'>",
        f"<title>Quality report: {esc(results['pipeline_class'])}</title>",
        "<style>body{font-family:sans-serif}td,th{padding:2px 8px;border-bottom:1px solid #ddd}</style>",
        f"<h1>Quality report: {esc(results['pipeline_class'])} ({esc(results['transformer_class'])})</h1>",
        f"<p>Pipeline <code>{esc(results['pipeline'])}</code>. SSIM: {esc(results['ssim'])}. Grids: exact | mode | "
        f"absolute difference x {results['settings']['diff_gain']:g}.</p>",
        "<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>",
        *("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>" for cells in body),
        "</table><ul>",
        *(
            f"<li><code>{esc(r['mode'])}</code>: <code>{esc(r['patch'])}</code>"
            + (f" — <b>{esc(r['status'])}</b>: {esc(r['error'])}" if r["error"] else "")
            + "</li>"
            for r in rows
        ),
        "</ul>",
    ]
    if results["notes"]:
        parts += ["<p>Notes:</p><ul>", *(f"<li>{esc(n)}</li>" for n in results["notes"]), "</ul>"]
    for run in results["runs"]:
        m = run["metrics"]
        image = run["files"].get("grid") or run["files"].get("output") or run["files"].get("animation")
        parts.append(
            f"<h3>Prompt {run['prompt_index']}, seed {run['seed']}, {esc(run['mode'])}: "
            f"PSNR {_format(m['psnr'])} dB, SSIM {_format(m['ssim'], 4)}</h3><img src='{esc(image)}'>"
        )
    return "\n".join(parts) + "\n"


def strict_json(value):
    """``value`` with every non-finite float as the string ``"inf"``, ``"-inf"`` or
    ``"nan"``: JSON has no such numbers, and parsers other than Python's refuse them."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def write_report(out, results: dict) -> None:
    """Write ``quality.json`` (the summary rows added; PSNR of identical outputs as
    ``"inf"``), ``index.md`` and ``index.html`` under ``out``."""
    results["summary"] = summarize(results)
    (out / "quality.json").write_text(json.dumps(strict_json(results), indent=1, allow_nan=False))
    (out / "index.md").write_text(markdown(results))
    (out / "index.html").write_text(html_page(results))
