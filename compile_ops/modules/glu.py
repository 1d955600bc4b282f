"""``GEGLU`` and ``SwiGLU`` modules that drop in for diffusers' (``diffusers.models.activations``).

Same constructor arguments and parameter names (``proj.weight``, ``proj.bias``),
so a diffusers state dict loads unchanged; the projection is the same
``nn.Linear`` and the activation step runs as one ``fused.geglu`` /
``fused.swiglu`` kernel.
"""

from torch import Tensor, nn

from compile_ops.meta._validate import checked_arguments
from compile_ops.modules.hooks import check_input
from compile_ops.ops.glu import geglu, swiglu


class GEGLU(nn.Module):
    """diffusers' ``GEGLU(dim_in, dim_out, bias)``: ``proj(x)`` split into
    ``[value, gate]``, returns ``value * gelu(gate)``.

    Input ``[..., dim_in]``, output ``[..., dim_out]``. ``approximate`` ("none",
    diffusers' choice, or "tanh") is an addition.
    """

    @checked_arguments
    def __init__(self, dim_in: int, dim_out: int, bias: bool = True, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"compile_ops.GEGLU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.proj = nn.Linear(dim_in, dim_out * 2, bias=bias)
        self.approximate = approximate

    def forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
        # *args, **kwargs: diffusers' deprecated ``scale`` argument, ignored as there.
        check_input("compile_ops.GEGLU", "hidden_states", hidden_states, self.proj)
        return geglu(self.proj(hidden_states), self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class SwiGLU(nn.Module):
    """diffusers' ``SwiGLU(dim_in, dim_out, bias)``: ``proj(x)`` split into
    ``[value, gate]``, returns ``value * silu(gate)``.

    Input ``[..., dim_in]``, output ``[..., dim_out]``.
    """

    @checked_arguments
    def __init__(self, dim_in: int, dim_out: int, bias: bool = True):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2, bias=bias)

    def forward(self, hidden_states: Tensor) -> Tensor:
        check_input("compile_ops.SwiGLU", "hidden_states", hidden_states, self.proj)
        return swiglu(self.proj(hidden_states))
