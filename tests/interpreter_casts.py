"""Triton 3.6's interpreter, made to cast floats as the GPU does (tests/conftest.py applies it
under TRITON_INTERPRET=1; bench/experiments/fp8_gemm_lora.py's ``--check`` too)."""

import torch


def cast_like_the_gpu():
    """Make triton 3.6's interpreter do the three float casts it gets wrong the way the GPU does.

    - fp32 -> bf16: the interpreter truncates (0.569 -> 0.5664) where the GPU
      rounds to nearest even (-> 0.5703), even with an explicit
      ``fp_downcast_rounding="rtne"``.
    - fp32 -> fp8e4nv (``.to(tl.float8e4nv)``): the interpreter drops the carry
      when rounding up crosses a power of two (-7.8248 -> -4.0, 31.92 -> 16.0,
      where the GPU gives -8.0 and 32.0; 2120 of 100k N(0, 50) values wrong) and
      turns NaN into 384. The GPU's ``cvt.rn.satfinite.e4m3x2.f32`` rounds to
      nearest even, saturates finite overflow to +-448 and keeps NaN: torch's
      float8_e4m3fn conversion after a clamp to [-448, 448] (which makes the
      saturation explicit instead of relying on torch's overflow rule).
    - fp8e4nv -> fp32, fp16 or bf16, in casts and in the fp16 operands a dot
      of e4m3 tiles is taken on (``fp8_rows_lora`` reading codes, 8-bit
      attention's P.V): the interpreter reads the NaN codes as +-480, where
      they are NaN; torch's exact conversion.

    Only these casts are patched, so that CPU runs of the kernels produce the
    GPU's bits; every other cast is left to the interpreter."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    truncating_cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return truncating_cast(self, src, dst_type)

    # (torch dtype, its same-width int, the bits' numpy dtype) of the wider formats.
    widened = {
        tl.float32: (torch.float32, torch.int32, np.uint32),
        tl.float16: (torch.float16, torch.int16, np.uint16),
        tl.bfloat16: (torch.bfloat16, torch.int16, np.uint16),
    }
    bit_converting = interpreter._convert_float

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        # Casts and dots both widen e4m3 here; the interpreter reads the NaN codes (0x7f, 0xff) as +-480.
        if input_dtype == tl.float8e4nv and output_dtype in widened:
            dtype, same_width, bits = widened[output_dtype]
            codes = torch.from_numpy(np.ascontiguousarray(input).view(np.uint8)).view(torch.float8_e4m3fn)
            return codes.to(dtype).view(same_width).numpy().view(bits)
        return bit_converting(input, input_dtype, output_dtype, rounding_mode)

    misrounding_fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            # The interpreter's fp32 -> e4m3 convert misrounds (-7.8248 -> -4.0 where
            # the GPU's cvt.rn.satfinite gives -8.0). Round to nearest even with
            # finite overflow saturated to +-448 and NaN kept, as the GPU does.
            values = torch.from_numpy(np.ascontiguousarray(src.data))
            rounded = torch.where(values.isnan(), values, values.clamp(-448.0, 448.0)).to(torch.float8_e4m3fn)
            return interpreter.TensorHandle(rounded.view(torch.uint8).numpy(), tl.float8e4nv)
        return misrounding_fp_to_fp(self, src, dst_type, rounding_mode)

    interpreter._convert_float = convert_float
    interpreter.InterpreterBuilder.cast_impl = cast_impl
    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp
