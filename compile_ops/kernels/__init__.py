"""@triton.jit kernels only, one module per op family."""
