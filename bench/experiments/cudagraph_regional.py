"""Which Flux steps run under CUDA graphs with regional compile, with and without a
step mark, on a GPU:

    PYTHONPATH=. python bench/experiments/cudagraph_regional.py [native] [bf16] [fp8]

A Flux of two double- and two single-stream blocks at Flux.1-dev's widths (1024 image
tokens, 512 text), each block compiled with ``mode="reduce-overhead"`` as
bench/runners/diffusers_timing.py compiles them; the model as diffusers builds it
(``native``), after ``compile_ops.patch`` (``bf16``) or after
``patch(precision="fp8")`` (``fp8``). Four calls each, first without
``torch.compiler.cudagraph_mark_step_begin()`` (the runner's hook that marks a step is
removed); where that fails, again with a mark before every call. Prints ``OK`` or
``FAIL`` and the failure's traceback; CUDA-graph history recording is on, so the error
names where the overwritten tensor was made.
"""

import sys
import traceback

import torch
import torch._inductor.config as inductor_config

import compile_ops
from bench.runners import diffusers_models
from bench.runners.diffusers_timing import compiled

inductor_config.triton.cudagraph_trees_history_recording = True


def runs(how: str, mark: bool) -> bool:
    """Whether four calls of the ``how`` model run; prints the outcome."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model, inputs = diffusers_models.flux(2, 2, 32, 32)
        torch.set_default_dtype(torch.float32)
    inputs = {
        k: v.to("cuda", torch.bfloat16 if v.is_floating_point() and "ids" not in k else v.dtype)
        for k, v in inputs.items()
    }
    model = model.eval().requires_grad_(False)
    if how == "bf16":
        compile_ops.patch(model)
    elif how == "fp8":
        compile_ops.patch(model, precision="fp8")
    compiled(model, "regional", inductor_mode="reduce-overhead")
    if not mark:  # the runner's hook marks each step: off, to see what happens without it
        model._step_begins.remove()
    label = f"{how} mark={mark}"
    try:
        with torch.no_grad():
            for _ in range(4):
                if mark:
                    torch.compiler.cudagraph_mark_step_begin()
                out = model(**inputs, return_dict=False)[0]
                total = out.float().sum().item()
    except Exception as e:
        print(f"{label}: FAIL {type(e).__name__}", flush=True)
        print("\n".join(traceback.format_exc().splitlines()[-60:]), flush=True)
        return False
    print(f"{label}: OK sum={total:.4f}", flush=True)
    return True


def main(argv=None) -> int:
    for how in (argv if argv is not None else sys.argv[1:]) or ("native", "bf16", "fp8"):
        if not runs(how, mark=False):
            runs(how, mark=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
