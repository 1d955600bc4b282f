"""The tolerance policy of docs/design.md, shared by every family's tests.

Two references: ``exact`` computed in fp64 from the same low-precision inputs,
and ``torch_at_dtype``, what plain PyTorch computes at the input dtype. The
kernel may be off from ``exact`` by at most ``factor`` times PyTorch's own
error, plus a floor of one unit in the last place of the output's scale.
"""

import torch


def assert_same_nonfinite(got: torch.Tensor, exact: torch.Tensor) -> None:
    assert torch.equal(torch.isnan(got), torch.isnan(exact)), "NaN positions differ from the reference"
    assert torch.equal(torch.isposinf(got), torch.isposinf(exact)), "+inf positions differ"
    assert torch.equal(torch.isneginf(got), torch.isneginf(exact)), "-inf positions differ"


def assert_within_torch_error(
    got: torch.Tensor,
    exact: torch.Tensor,
    torch_at_dtype: torch.Tensor,
    factor: float,
    what: str = "output",
    terms: int = 1,
    fp32_roundings: int = 0,
) -> None:
    """``terms``: how many values each element of ``got`` sums (the gradient of a
    broadcast input sums over the broadcast dims). Each addition may round, so
    the floor is ``terms`` ulps of the output's scale: a sum of 18 fp32 terms
    is 4 ulps off as often as not, while PyTorch's own error, in another
    summation order, can land near zero by luck.

    ``fp32_roundings``: fp32 roundings at the output's scale that a formula
    makes before terms cancel (a norm's ``dx = rstd (w dy - xhat mean(w dy
    xhat))``): that many fp32 ulps of the scale join the floor. They matter
    for fp32 outputs only; PyTorch's own chain rounds differently and can, by
    luck, land within half an ulp (Hypothesis found a 3-ulp fp32 dk of
    qk_norm_rope against torch's 0.5 on the GPU)."""
    assert got.shape == exact.shape, f"{what}: shape {tuple(got.shape)} != {tuple(exact.shape)}"
    assert_same_nonfinite(got, exact)
    if got.numel() == 0:
        return
    finite = torch.isfinite(exact)
    if not finite.any():
        return
    err = (got.double() - exact.double())[finite].abs().max().item()
    # Where PyTorch itself overflows (an fp16 backward through rsqrt of a tiny
    # variance) it has no finite error to compare with: leave those elements
    # out of its error, not out of the kernel's.
    both = finite & torch.isfinite(torch_at_dtype)
    torch_err = (torch_at_dtype.double() - exact.double())[both].abs().max().item() if both.any() else 0.0
    scale = max(exact.double()[finite].abs().max().item(), 1.0)
    floor = torch.finfo(got.dtype).eps * scale * terms + torch.finfo(torch.float32).eps * scale * fp32_roundings
    bound = factor * torch_err + floor
    assert err <= bound, (
        f"{what}: error {err:.3g} > {factor} x torch's error at the input dtype ({torch_err:.3g}) + floor {floor:.3g}"
    )
