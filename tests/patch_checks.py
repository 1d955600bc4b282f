"""What the patch tests of every model family (diffusers, transformers) compare:
a patched copy against the unpatched model, forward and parameter gradients."""

import torch
from conftest import HAS_CUDA

DEVICE = "cuda" if HAS_CUDA else "cpu"
# fp32 models: the CPU runs the ops' fp32 references; on the GPU the kernels sum
# in other orders (and fp32 attention uses TF32 where the test session allows
# it), so outputs are compared to ~1e-3 there.
TOL = dict(rtol=2e-3, atol=2e-3) if HAS_CUDA else dict(rtol=1e-4, atol=1e-5)


def assert_gradient_close(got, want, path):
    if got is None or want is None:  # a parameter no call reads (diffusers' unfused q/k/v after fusing)
        assert got is None and want is None, f"{path}: a gradient on one side only"
        return
    if HAS_CUDA:  # a weight's gradient sums every token's tf32-rounded term: compare as a whole
        if want.norm() < 1e-7:
            # Zero in exact arithmetic: a key bias (or a LayerNorm bias on keys),
            # softmax being blind to a shift shared by all keys. Both sides are
            # rounding noise (1e-12 to 3e-9 seen); real gradients here are 3e-6 or more.
            assert got.norm() < 1e-6, f"{path}: {got.norm():.2e} where the unpatched gradient is {want.norm():.2e}"
            return
        err = ((got - want).norm() / want.norm()).item()
        assert err < 5e-3, f"{path}: relative error {err:.2e}"
    else:
        torch.testing.assert_close(got, want, **TOL, msg=path)


def assert_patched_matches_forward_and_backward(model, patched, args: dict, output) -> None:
    """``output(module(**args))`` (the model's output tensor) of ``patched``
    equals ``model``'s within TOL, and so do the gradients of every parameter
    under one random weighting of that output (replacements share
    parameters: the same names hold the same tensors)."""
    want = output(model(**args))
    got = output(patched(**args))
    torch.testing.assert_close(got, want, **TOL)
    weights = torch.randn_like(want)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    grads = dict(model.named_parameters())
    for path, p in patched.named_parameters():
        assert_gradient_close(p.grad, grads[path].grad, path)
