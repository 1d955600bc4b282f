"""Image metrics against the reference mode: PSNR and SSIM in torch, LPIPS and CLIP score when available.

Images are float tensors in [0, 1], ``(..., H, W, C)`` with C = 3 (RGB) or 1,
as a pipeline's ``output_type="np"`` gives them; a video's frames are the
leading axes. SSIM is computed on luminance (ITU-R BT.601 weights), with an
11 x 11 Gaussian window of sigma 1.5, K1 = 0.01, K2 = 0.03, data range 1 and
the window kept inside the image (no padding), as Wang et al. define it.
"""

import math
import os

import torch

#: ITU-R BT.601 luma weights for R, G, B.
LUMA_WEIGHTS = (0.299, 0.587, 0.114)
SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_K1, SSIM_K2 = 0.01, 0.03


def _as_tensor(images) -> torch.Tensor:
    return torch.as_tensor(images).to(torch.float64)


def psnr(reference, images) -> float:
    """Peak signal-to-noise ratio in dB of ``images`` against ``reference``, both
    ``(..., H, W, C)`` in [0, 1] and of one shape: ``-10 log10(MSE)``; ``inf`` when equal."""
    reference, images = _as_tensor(reference), _as_tensor(images)
    if reference.shape != images.shape:
        raise ValueError(f"psnr: shapes differ, {tuple(reference.shape)} and {tuple(images.shape)}")
    mse = torch.mean((reference - images) ** 2).item()
    return math.inf if mse == 0 else -10.0 * math.log10(mse)


def luminance(images) -> torch.Tensor:
    """``(..., H, W)`` luma of ``(..., H, W, C)`` images: BT.601 for C = 3, the channel for C = 1."""
    images = _as_tensor(images)
    if images.shape[-1] == 1:
        return images[..., 0]
    if images.shape[-1] != 3:
        raise ValueError(f"luminance: images must end in 1 or 3 channels, got shape {tuple(images.shape)}")
    return images @ torch.tensor(LUMA_WEIGHTS, dtype=images.dtype)


def _gaussian_window(size: int, sigma: float) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    return g / g.sum()


def _filter(planes: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    # separable 'valid' Gaussian filtering of (N, 1, H, W) planes
    size = window.numel()
    planes = torch.nn.functional.conv2d(planes, window.view(1, 1, 1, size))
    return torch.nn.functional.conv2d(planes, window.view(1, 1, size, 1))


def ssim(reference, images) -> float:
    """Mean structural similarity of ``images`` to ``reference`` (``(..., H, W, C)``
    in [0, 1], one shape) on luminance, averaged over the leading axes; 1 when
    equal. Images smaller than the window use the largest odd window that fits."""
    ref, img = luminance(reference), luminance(images)
    if ref.shape != img.shape:
        raise ValueError(f"ssim: shapes differ, {tuple(ref.shape)} and {tuple(img.shape)}")
    height, width = ref.shape[-2:]
    size = min(SSIM_WINDOW, height, width)
    size -= 1 - size % 2
    window = _gaussian_window(size, SSIM_SIGMA)
    x, y = ref.reshape(-1, 1, height, width), img.reshape(-1, 1, height, width)
    mu_x, mu_y = _filter(x, window), _filter(y, window)
    var_x = _filter(x * x, window) - mu_x**2
    var_y = _filter(y * y, window) - mu_y**2
    cov = _filter(x * y, window) - mu_x * mu_y
    c1, c2 = SSIM_K1**2, SSIM_K2**2
    ssim_map = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
    return ssim_map.mean().item()


def compare(reference, images) -> dict:
    """PSNR and SSIM of one output against the reference's: ``(H, W, C)`` for an
    image, ``(F, H, W, C)`` for a video (then also per frame, and the mean)."""
    reference, images = _as_tensor(reference), _as_tensor(images)
    result = {"psnr": psnr(reference, images), "ssim": ssim(reference, images)}
    if reference.dim() == 4:
        result["psnr_per_frame"] = [psnr(r, i) for r, i in zip(reference, images)]
        result["ssim_per_frame"] = [ssim(r, i) for r, i in zip(reference, images)]
    return result


class LPIPS:
    """LPIPS (AlexNet) distance, when the ``lpips`` package is installed and its
    backbone weights are on disk (torch hub cache) or downloads are allowed.
    ``note`` says why it is off when :attr:`available` is False."""

    ALEXNET_WEIGHTS = "alexnet-owt-7be5be79.pth"

    def __init__(self, device, allow_download: bool = False):
        self.model, self.note = None, ""
        try:
            import lpips
        except ImportError:
            self.note = "LPIPS skipped: the `lpips` package is not installed"
            return
        cached = os.path.join(torch.hub.get_dir(), "checkpoints", self.ALEXNET_WEIGHTS)
        if not allow_download and not os.path.exists(cached):
            self.note = f"LPIPS skipped: AlexNet weights not in {cached} (pass --allow-download to fetch them)"
            return
        self.model = lpips.LPIPS(net="alex", verbose=False).to(device).eval()
        self.device = device

    @property
    def available(self) -> bool:
        return self.model is not None

    @torch.no_grad()
    def __call__(self, reference, images) -> float:
        """Mean LPIPS over the frames of ``(..., H, W, 3)`` images in [0, 1]."""
        ref = _as_tensor(reference).reshape(-1, *reference.shape[-3:]).permute(0, 3, 1, 2)
        img = _as_tensor(images).reshape(-1, *images.shape[-3:]).permute(0, 3, 1, 2)
        ref, img = (t.float().to(self.device) * 2 - 1 for t in (ref, img))
        return self.model(ref, img).mean().item()


class ClipScore:
    """CLIP score, ``100 * max(cos(image, prompt), 0)`` averaged over up to
    ``max_frames`` frames, from a CLIP model on local disk (``--clip PATH``)."""

    def __init__(self, path, device, max_frames: int = 8):
        self.model, self.note, self.max_frames = None, "", max_frames
        if path is None:
            self.note = "CLIP score skipped: pass --clip <local CLIP model path> to compute it"
            return
        import transformers

        self.model = transformers.CLIPModel.from_pretrained(path, local_files_only=True).to(device).eval()
        self.processor = transformers.CLIPProcessor.from_pretrained(path, local_files_only=True)
        self.device = device

    @property
    def available(self) -> bool:
        return self.model is not None

    @torch.no_grad()
    def __call__(self, prompt: str, images) -> float:
        """The score of ``(..., H, W, 3)`` images in [0, 1] against ``prompt``."""
        frames = _as_tensor(images).reshape(-1, *images.shape[-3:])
        if frames.shape[0] > self.max_frames:
            frames = frames[torch.linspace(0, frames.shape[0] - 1, self.max_frames).round().long()]
        pixels = [(f.clamp(0, 1) * 255).round().to(torch.uint8).numpy() for f in frames]
        inputs = self.processor(text=[prompt], images=pixels, return_tensors="pt", padding=True, truncation=True)
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        out = self.model(**inputs)
        image, text = out.image_embeds, out.text_embeds
        cosine = torch.nn.functional.cosine_similarity(image, text.expand_as(image), dim=-1)
        return (100 * cosine.clamp(min=0)).mean().item()
