"""What the fp8 test files share (test_fp8.py, test_fp8_linear.py); it holds no tests.

- ``_spec_quantize``: the rowwise e4m3 recipe restated in a few lines, for
  cross-checking the reference, the op and the modules (not the library's code).
- ``_same_bytes``: two float8 tensors hold the same bytes.
- ``_fake_cuda_launches``: ``make_fx`` of a function on fake CUDA tensors, with
  the Triton kernels it launches (name, arguments, grid).
"""

import torch
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx


def _spec_quantize(x):
    """The recipe in a few lines, for cross-checking (not the library's code)."""
    xf = x.double().float()
    counted = torch.where(torch.isnan(xf), torch.zeros_like(xf), xf.abs())  # NaN left out, +-inf counted
    amax = counted.amax(-1, keepdim=True).clamp(min=1e-12)
    q = torch.clamp(xf * (torch.tensor(448.0) / amax), -448.0, 448.0).to(torch.float8_e4m3fn)
    return q, (amax / 448.0).squeeze(-1)


def _same_bytes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _fake_cuda_launches(fn, *args):
    """make_fx of ``fn`` on fake CUDA tensors like ``args``: ``(graph, [(kernel, kwargs, grid)])``."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        cuda_args = tuple(
            torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cuda") if isinstance(a, torch.Tensor) else a
            for a in args
        )
        gm = make_fx(fn)(*cuda_args)
        out = gm(*cuda_args)
    launches = [
        (
            kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__,
            {**n.kwargs["kwargs"], **kernel_side_table.get_constant_args(n.kwargs["constant_args_idx"])},
            n.kwargs["grid"][0],
        )
        for n in gm.graph.nodes
        if n.target is torch.ops.higher_order.triton_kernel_wrapper_mutation
    ]
    return gm, out, launches
