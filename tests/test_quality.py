"""The quality report (``python -m compile_ops.quality``): metrics, mode parsing, errors, and end to end
on tiny random Flux (image) and Wan (video) pipelines saved to a temporary folder.

Reference layer: CPU, float32, 2 denoising steps at 16 x 16 pixels.
"""

import json
import math

import numpy as np
import pytest
import tiny_models
import torch

from compile_ops.quality import metrics
from compile_ops.quality.__main__ import main
from compile_ops.quality.modes import VALID_MODES, parse_modes

pytestmark = pytest.mark.filterwarnings("ignore")


# --- metrics ---


@pytest.mark.parametrize("offset", [0.01, 0.1, 0.25])
def test_psnr_of_a_constant_offset(offset):
    reference = torch.rand(8, 12, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 0.5
    assert metrics.psnr(reference, reference + offset) == pytest.approx(-20 * math.log10(offset), abs=1e-9)


def test_identical_images_give_psnr_inf_and_ssim_one():
    image = torch.rand(2, 24, 24, 3, generator=torch.Generator().manual_seed(1))
    assert math.isinf(metrics.psnr(image, image))
    assert metrics.ssim(image, image) == pytest.approx(1.0, abs=1e-12)
    result = metrics.compare(image, image)  # two frames: per-frame lists too
    assert result["psnr_per_frame"] == [math.inf, math.inf] and result["ssim_per_frame"] == pytest.approx([1, 1])


def test_ssim_of_constant_images_is_the_luminance_term():
    # no variance: SSIM reduces to (2 a b + C1) / (a^2 + b^2 + C1)
    a, b = 0.3, 0.6
    c1 = metrics.SSIM_K1**2
    expected = (2 * a * b + c1) / (a * a + b * b + c1)
    assert metrics.ssim(torch.full((16, 16, 3), a), torch.full((16, 16, 3), b)) == pytest.approx(expected, rel=1e-9)


def test_ssim_is_symmetric_and_falls_with_noise():
    gen = torch.Generator().manual_seed(2)
    image = torch.rand(32, 32, 3, generator=gen)
    noise = torch.randn(32, 32, 3, generator=gen)
    noisy = [(image + s * noise).clamp(0, 1) for s in (0.02, 0.1, 0.3)]
    assert metrics.ssim(image, noisy[1]) == pytest.approx(metrics.ssim(noisy[1], image), rel=1e-12)
    scores = [metrics.ssim(image, n) for n in noisy]
    assert 1 > scores[0] > scores[1] > scores[2]


def test_ssim_works_on_luminance_and_small_images():
    gray = torch.rand(16, 16, 1, generator=torch.Generator().manual_seed(3))
    assert metrics.ssim(gray.expand(16, 16, 3), (gray * 0.9).expand(16, 16, 3)) == pytest.approx(
        metrics.ssim(gray, gray * 0.9), rel=1e-9
    )
    tiny = torch.rand(6, 5, 3, generator=torch.Generator().manual_seed(4))  # smaller than the 11 x 11 window
    assert metrics.ssim(tiny, tiny) == pytest.approx(1.0)


def test_metrics_refuse_mismatched_shapes():
    with pytest.raises(ValueError, match="shapes differ"):
        metrics.psnr(torch.zeros(4, 4, 3), torch.zeros(4, 5, 3))


# --- modes and arguments ---


def test_modes_parse_to_patch_options():
    modes = parse_modes("fp8+int8_fp8,sparse:radial,patched")
    assert [m.name for m in modes] == ["exact", "fp8+int8_fp8", "sparse:radial", "patched"]  # exact added, first
    assert modes[1].options == {"precision": "fp8", "attention_precision": "int8_fp8"}
    assert type(modes[2].patch_options()["attention"]).__name__ == "Radial"
    assert modes[3].patch_options() == {} and modes[0].is_exact


@pytest.mark.parametrize(
    "text, message",
    [
        ("exact,fp4", "--modes: unknown mode 'fp4'"),
        ("fp8+bogus", "unknown mode 'bogus' in 'fp8+bogus'"),
        ("int8+int8_fp8", "sets attention_precision twice"),
        ("fp8,fp8", "given twice"),
    ],
)
def test_bad_modes_are_refused_by_name(text, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+")) as info:
        parse_modes(text)
    if "unknown" in message:
        assert all(name in str(info.value) for name in VALID_MODES)


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_missing_prompts_file_names_the_argument(tmp_path, capsys):
    err = _error(capsys, ["--pipeline", str(tmp_path), "--prompts", str(tmp_path / "none.txt")])
    assert "--prompts: no such file" in err


def test_unknown_mode_on_the_command_line(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    err = _error(capsys, ["--pipeline", str(tmp_path), "--prompts", str(prompts), "--modes", "exact,fp16"])
    assert "--modes: unknown mode 'fp16'" in err and "int8_fp8" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_device_without_cuda_names_the_argument(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    err = _error(capsys, ["--pipeline", str(tmp_path), "--prompts", str(prompts)])  # --device defaults to cuda
    assert "--device: 'cuda' but CUDA is not available" in err


def test_missing_pipeline_names_the_argument(tmp_path, capsys):
    pytest.importorskip("diffusers")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    argv = ["--pipeline", str(tmp_path / "no-such-pipeline"), "--prompts", str(prompts), "--device", "cpu"]
    err = _error(capsys, argv + ["--out", str(tmp_path / "out")])
    assert "--pipeline: cannot load" in err and "--allow-download" in err


# --- end to end on tiny pipelines ---


def _tokenizer(max_length: int):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "</s>", "<unk>"] + [f"w{i}" for i in range(61)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=max_length
    )


def tiny_flux(folder):
    """A FluxPipeline of random tiny components (diffusers' own test sizes), saved to ``folder``."""
    diffusers = pytest.importorskip("diffusers")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    clip = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(
            bos_token_id=0, eos_token_id=1, pad_token_id=0, hidden_size=32, intermediate_size=37,
            num_attention_heads=4, num_hidden_layers=1, vocab_size=64, projection_dim=32, max_position_embeddings=16,
        )
    )  # fmt: skip
    t5 = transformers.T5EncoderModel(
        transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=16, num_layers=1, num_heads=2,
            relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        )
    )  # fmt: skip
    transformer = tiny_models.flux(axes_dims_rope=[4, 4, 8])
    vae = diffusers.AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
        latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.0609, scaling_factor=1.5035,
    )  # fmt: skip
    pipe = diffusers.FluxPipeline(
        transformer=transformer, vae=vae, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        text_encoder=clip, tokenizer=_tokenizer(16), text_encoder_2=t5, tokenizer_2=_tokenizer(16),
    )  # fmt: skip
    pipe.save_pretrained(folder)
    return folder


def tiny_wan(folder):
    """A WanPipeline of random tiny components, saved to ``folder``: diffusers' own test sizes,
    but heads of 16 so that FP8 takes the blocks' Linears (multiples of 16)."""
    diffusers = pytest.importorskip("diffusers")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    text_encoder = transformers.UMT5EncoderModel(
        transformers.UMT5Config(
            vocab_size=64, d_model=16, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
            relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        )
    )  # fmt: skip
    transformer = tiny_models.wan(attention_head_dim=16, in_channels=16, out_channels=16)
    vae = diffusers.AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    pipe = diffusers.WanPipeline(
        transformer=transformer, vae=vae, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder=text_encoder, tokenizer=_tokenizer(16),
    )  # fmt: skip
    pipe.save_pretrained(folder)
    return folder


def tiny_clip(folder):
    """A CLIP model and processor of random tiny components, saved to ``folder`` (for ``--clip``)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    text = dict(hidden_size=16, intermediate_size=16, num_attention_heads=2, num_hidden_layers=1, vocab_size=64)
    text.update(max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    vision = dict(hidden_size=16, intermediate_size=16, num_attention_heads=2, num_hidden_layers=1, image_size=32)
    model = transformers.CLIPModel(
        transformers.CLIPConfig(text_config=text, vision_config=dict(vision, patch_size=8), projection_dim=16)
    )
    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = transformers.CLIPProcessor(image_processor=image_processor, tokenizer=_tokenizer(16))
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def _run(tmp_path, pipeline, modes, seeds, *extra, device="cpu", dtype="float32"):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2 w3\n")
    out = tmp_path / "report"
    argv = ["--pipeline", str(pipeline), "--prompts", str(prompts), "--modes", modes, "--seeds", seeds]
    argv += ["--steps", "2", "--height", "16", "--width", "16", "--device", device, "--dtype", dtype]
    assert main(argv + ["--out", str(out), *extra]) == 0
    results = json.loads((out / "quality.json").read_text())
    for page in ("index.md", "index.html"):
        assert (out / page).read_text().startswith(("# Quality report", "<!doctype html>"))
    return out, results


def test_image_pipeline_end_to_end(tmp_path):
    from PIL import Image

    pipeline = tiny_flux(tmp_path / "flux")
    clip = tiny_clip(tmp_path / "clip")
    out, results = _run(tmp_path, pipeline, "exact,fp8,sparse", "0,1", "--clip", str(clip))
    assert {"pipeline", "pipeline_class", "settings", "prompts", "modes", "runs", "summary", "notes", "ssim"} <= set(
        results
    )
    assert results["pipeline_class"] == "FluxPipeline"
    modes = {m["name"]: m for m in results["modes"]}
    assert modes["exact"]["status"] == "ok" and modes["fp8"]["status"] == "ok"
    # sparse attention is for video DiTs: reported as refused with patch's error, not dropped
    assert modes["sparse"]["status"] == "refused" and "sparse attention covers" in modes["sparse"]["error"]
    assert "refused" in (out / "index.md").read_text()
    runs = results["runs"]
    assert sorted((r["mode"], r["seed"]) for r in runs) == [("exact", 0), ("exact", 1), ("fp8", 0), ("fp8", 1)]
    for run in runs:
        assert run["seconds"] > 0 and run["peak_memory_bytes"] is None  # CPU: no peak memory
        assert run["shape"] == [16, 16, 3]
        with Image.open(out / run["files"]["output"]) as image:
            assert image.size == (16, 16)
        if run["mode"] == "exact":
            # Strict JSON: an identical output's infinite PSNR is written as the string "inf".
            assert run["metrics"]["psnr"] == "inf" and run["metrics"]["ssim"] == pytest.approx(1.0)
        else:
            with Image.open(out / run["files"]["grid"]) as grid:
                assert grid.width > 3 * grid.height - 1  # exact | mode | difference
            assert run["metrics"]["psnr"] > 0 and -1 <= run["metrics"]["ssim"] <= 1
    assert any("LPIPS" in n for n in results["notes"]) == (not metrics.LPIPS("cpu").available)
    assert all(0 <= r["metrics"]["clip_score"] <= 100 for r in runs)
    assert "CLIP score" in (out / "index.md").read_text()
    # the seed is honoured: the two seeds' exact images differ
    exact = [np.asarray(Image.open(out / r["files"]["output"])) for r in runs if r["mode"] == "exact"]
    assert not np.array_equal(*exact)


def test_video_pipeline_end_to_end(tmp_path):
    from PIL import Image

    pipeline = tiny_wan(tmp_path / "wan")
    out, results = _run(tmp_path, pipeline, "exact,sparse:radial,sparse", "0", "--frames", "5")
    assert [m["status"] for m in results["modes"]] == ["ok", "ok", "failed"]
    # SlidingTile's default window does not fit this tiny grid: the generation's error is reported
    assert "must fit in the tile grid" in results["modes"][2]["error"]
    assert any("CLIP score skipped" in n for n in results["notes"])
    for run in results["runs"]:
        assert run["shape"] == [5, 16, 16, 3]
        assert len(run["metrics"]["psnr_per_frame"]) == 5 and len(run["metrics"]["ssim_per_frame"]) == 5
        with Image.open(out / run["files"]["animation"]) as gif:
            assert gif.format == "GIF" and gif.n_frames == 5
    (radial,) = [r for r in results["runs"] if r["mode"] == "sparse:radial"]
    with Image.open(out / radial["files"]["grid"]) as grid:
        assert grid.height > grid.width / 2  # rows exact, mode, difference over a few frames


@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the fused kernels on a CUDA device")
@pytest.mark.parametrize(
    "build, modes, extra",
    [
        (tiny_flux, "exact,fp8,int8_fp8,fp8+int8_fp8", ()),
        (tiny_wan, "exact,int8_fp8,sparse:radial,fp8+int8_fp8+sparse:radial", ("--frames", "5")),
    ],
    ids=["flux", "wan"],
)
def test_pipelines_end_to_end_on_cuda(tmp_path, build, modes, extra):
    pipeline = build(tmp_path / "pipeline")
    _, results = _run(tmp_path, pipeline, modes, "0", *extra, device="cuda", dtype="bfloat16")
    assert [m["status"] for m in results["modes"]] == ["ok"] * len(modes.split(","))
    for run in results["runs"]:
        assert run["peak_memory_bytes"] > 0
        if run["mode"] == "exact":
            assert run["metrics"]["psnr"] == "inf"
        else:  # an approximation moves the output, by a finite amount
            assert run["metrics"]["psnr"] != "inf" and run["metrics"]["psnr"] > 0
