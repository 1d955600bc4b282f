"""DTensor sharding rules for every ``torch.ops.fused`` op, forward and backward.

Why: a DTensor reaching an op without a rule fails ("no sharding strategy
registered"), and a rule that is too generous computes silently wrong results
(a norm over a sharded channel dim normalizes each shard separately). These
rules let DTensors sharded on batch, sequence or heads run every fused op on
their local shards and keep their placement, and tell DTensor to redistribute
(gather) everything else. The backward ops have rules too: autograd runs the
registered backward formulas on DTensors, so ``fused.*_backward`` is
dispatched with DTensor arguments.

How the rules are written: each op has one :class:`Rule` in :data:`RULES` that
names, for each tensor argument and each output, its *role*: a function from
the tensor's shape to the op's **axes** it is indexed by (``{axis: dim}``).
Axes are what may be split across ranks without changing the math: the leading
(row) dims of x for the row-wise families, ``batch``/``sequence``/``heads``
for RoPE, ``batch``/``heads`` for attention. Sharding one axis gives, per
tensor, ``Shard(dim)`` where the tensor is indexed by that axis, ``Replicate``
where it is not (weights, per-sample tables under sequence sharding), and for
gradient outputs of such a broadcast input ``Partial()``: each rank summed its
own rows, the sum over ranks is the gradient (weight gradients, the gradient
of a per-sample scale under sequence sharding). A channel dim is never an axis,
so a DTensor sharded on it is redistributed before the op runs.

Not offered, on purpose:
- sequence sharding in attention's rule: every query needs every key. The
  public ``attention`` and ``block_sparse_attention`` instead move
  sequence-sharded q/k/v to head shards with all-to-all and the results back
  (``compile_ops._dtensor.sequence_parallel``, DeepSpeed-Ulysses); a direct call of the op
  on sequence shards is gathered by DTensor;
- sequence sharding of ``rope_grid``: positions come from the token index, and
  a shard does not know its offset;
- an axis along which the sharded tensors have different sizes (GQA heads,
  per-frame modulation against tokens) unless every size divides evenly by the
  mesh size: with uneven chunks the shards would pair the wrong heads or frames.

Registration happens at ``import compile_ops`` when ``torch.distributed`` is
available (:func:`register`, idempotent): a rule must exist before the first
DTensor reaches an op, including the backward ops that autograd reaches from
deep inside ``loss.backward()``, and an explicit opt-in would turn a forgotten
call into an error far from its cause. It is cheap: one small record per op;
``torch.distributed.tensor`` (a slow import on its own) is already imported by
then, through ``torch._inductor`` that the op registration pulls in (torch 2.11
and 2.13 alike; the cost: docs/notes/multi-gpu.md).

The rules go through DTensor's op-strategy API (the layer under the
experimental ``register_sharding``, identical in torch 2.11 and 2.13) rather
than ``register_sharding`` itself, because the latter hashes only the
arguments from the first ``int`` onward into DTensor's sharding cache, and
``norm_modulate``'s rule reads its ``norm`` string (RMSNorm returns an empty
``mean``): a cached decision for ``"layernorm"`` would be reused for
``"rmsnorm"``. :func:`_schema_info` hashes every non-tensor argument.

Where this module sits: above ``ops/`` (its :func:`check_rules` reads the
registered schemas), registered by ``compile_ops/__init__.py``. What the op
wrappers themselves need from DTensor (gradient and layout wrappers,
sequence-parallel attention) is in ``compile_ops/_dtensor.py``, below every
op, so no op imports this module.
"""

from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

import torch

from compile_ops import meta

# The rules are checked against the schemas these modules register.
from compile_ops.ops import attention, block_sparse, fp8, glu, modulate, moe, norm, rope  # noqa: F401

#: The op's shardable axes of the attention and RoPE families. The row-wise
#: families use x's leading dims (ints) as their axes.
BATCH, SEQUENCE, HEADS = "batch", "sequence", "heads"

Axes = dict
"""``{axis: tensor dim}``: the dims of a tensor that an axis indexes."""


class Call:
    """An op call's arguments by name: tensors as DTensor specs (``.shape``),
    None, or Python values; schema defaults filled in."""

    def __init__(self, values: dict, primary: str):
        self.values = values
        self.primary = values[primary]
        """The tensor the row-wise roles are relative to (x, or h of the modulation backward)."""

    def __getitem__(self, name: str):
        return self.values[name]


Role = Callable[[tuple, Call], Axes]
"""``(shape, call) -> {axis: dim}`` of one tensor argument or output."""


# ---------------------------------------------------------------- roles


def leading_dims(shape, call: Call) -> Axes:
    """A row-wise tensor ``[..., C]`` (x, residual, gradients, the GLU input and
    output): every dim but the channel dim is an axis, named by its index."""
    return {d: d for d in range(len(shape) - 1)}


def replicated(shape, call: Call) -> Axes:
    """Weights, biases, the grid RoPE constants: every rank needs all of it."""
    return {}


def row_statistics(shape, call: Call) -> Axes:
    """A norm's ``mean``/``rstd`` argument: ``x.shape[:-1]``, indexed like x's
    rows; or the empty placeholder that RMSNorm passes for its mean."""
    if tuple(shape) != tuple(call.primary.shape[:-1]):
        return {}
    return {d: d for d in range(len(shape))}


def mean_output(shape, call: Call) -> Axes:
    """The ``mean`` output of the forward norms (``shape`` is x's): empty for RMSNorm."""
    return {} if call["norm"] == "rmsnorm" else leading_dims(shape, call)


def modulation(shape, call: Call) -> Axes:
    """scale/shift/gate broadcast to x ``[B, *tokens, C]`` by the forms of
    ``compile_ops/meta/modulate.py``: 0-dim and ``[C]`` follow no row;
    ``[B, C]`` follows the batch; a tensor of x's rank follows each dim it does
    not broadcast (size 1); ``[B, F, 1, C]`` on a 3-D x follows the batch, and
    its frames follow x's tokens (consecutive frames cover consecutive tokens)."""
    n, nx = len(shape), len(call.primary.shape)
    if n == 2 and nx > 2:
        axes = {0: 0}
    elif n == nx:
        axes = {d: d for d in range(n - 1)}
    elif nx == 3 and n == 4:
        axes = {0: 0, 1: 1}
    else:  # 0-dim, [C], or a form the op's own validation rejects
        axes = {}
    return {axis: d for axis, d in axes.items() if shape[d] != 1}


def heads_layout(shape, call: Call) -> Axes:
    """q/k/v/out and RoPE's x: ``[B, H, L, D]`` (``seq_dim=2``) or ``[B, L, H, D]`` (``seq_dim=1``)."""
    seq_dim = call["seq_dim"]
    if len(shape) != 4 or seq_dim not in (1, 2):
        return {}  # the op's validation reports it
    return {BATCH: 0, SEQUENCE: seq_dim, HEADS: 3 - seq_dim}


def rotary_table(shape, call: Call) -> Axes:
    """cos/sin ``[L, T]`` or per batch ``[B or 1, L, T]``: positions follow the sequence."""
    if len(shape) == 2:
        return {SEQUENCE: 0}
    if len(shape) == 3:
        return {SEQUENCE: 1, **({BATCH: 0} if shape[0] != 1 else {})}
    return {}


def log_sum_exp(shape, call: Call) -> Axes:
    """Attention's lse ``[B, H, Lq]`` in either q layout."""
    return {BATCH: 0, HEADS: 1, SEQUENCE: 2}


def fp8_rows(shape, call: Call) -> Axes:
    """8-bit attention's FP8 output rows: values ``[B, Lq, Hq, D]`` and scales
    ``[B, Lq]``, in that layout whatever q's."""
    return {BATCH: 0, SEQUENCE: 1, **({HEADS: 2} if len(shape) == 4 else {})}


def key_block_scales(shape, call: Call) -> Axes:
    """8-bit attention's k scales ``[B, Hk, key blocks]``: a block's scale
    depends on k's mean over the whole sequence, so only batch and heads shard."""
    return {BATCH: 0, HEADS: 1}


def qk8_output(shape, call: Call) -> Axes:
    """``fused.attention_qk8``'s outputs: out in q's layout, or with
    ``fp8_rows`` the FP8 rows (:func:`fp8_rows`); the empty placeholder
    scale of the former is replicated."""
    if call["fp8_rows"]:
        return fp8_rows(shape, call)
    return heads_layout(shape, call) if len(shape) == 4 else {}


def qk8_axes(call: Call) -> tuple:
    """FP8 rows' scale spans every head: batch shards only, then."""
    return (BATCH,) if call["fp8_rows"] else (BATCH, HEADS)


def per_sample(shape, call: Call) -> Axes:
    """kv_lengths ``[B]``."""
    return {BATCH: 0}


def block_lists(shape, call: Call) -> Axes:
    """block_index ``[B or 1, H or 1, NQ, W]`` and block_count ``[B or 1, H or 1, NQ]``
    (``compile_ops/meta/block_sparse.py``): one list per batch element and head, or shared."""
    return {axis: d for axis, d in ((BATCH, 0), (HEADS, 1)) if shape[d] != 1}


# ---------------------------------------------------------------- rules


@dataclass(frozen=True)
class Out:
    """One output of an op: indexed like its ``source`` argument by ``role``.

    ``gradient``: the output is the gradient of ``source``, summed over every
    axis that ``source`` broadcasts along, so it is ``Partial()`` where that
    axis is sharded. An output whose source is None is the op's empty
    placeholder (no gradient to compute) and is replicated."""

    source: str
    role: Role
    gradient: bool = False


@dataclass(frozen=True)
class Rule:
    """How one fused op shards: a role per tensor argument, one :class:`Out` per output."""

    inputs: dict
    """``{argument name: Role}`` for every tensor argument of the schema."""
    outputs: tuple
    """One :class:`Out` per return of the schema, in order."""
    axes: Callable[[Call], Sequence]
    """The axes that the op may run sharded on, for this call."""
    primary: str = "x"
    """The argument whose rows the row-wise roles count (x; h for the modulation backward)."""


def row_axes(call: Call) -> range:
    """Every dim of x but the channel (last) dim: norms reduce over it, GLU splits it."""
    return range(len(call.primary.shape) - 1)


def batch_sequence_heads(call: Call) -> tuple:
    return (BATCH, SEQUENCE, HEADS)


def batch_sequence_and_heads_unless_norm_spans_them(call: Call) -> tuple:
    """A q/k-norm whose weights span the heads (``[H * D]``) reduces over them."""
    return (BATCH, SEQUENCE) if _norms_span_heads(call) else (BATCH, SEQUENCE, HEADS)


def batch_heads_unless_norm_spans_them(call: Call) -> tuple:
    """The quantizing rotation: k's smoothing mean spans the sequence, and a
    norm whose weights span the heads reduces over them."""
    return (BATCH,) if _norms_span_heads(call) else (BATCH, HEADS)


def _norms_span_heads(call: Call) -> bool:
    return meta.rope.norms_span_heads(call["q_weight"], call["k_weight"], call["q"], call["k"])


def batch_heads(call: Call) -> tuple:
    """Attention needs every key for each query, and grid RoPE the global token index."""
    return (BATCH, HEADS)


def batch_only(call: Call) -> tuple:
    """An op that reduces over every head and position of a batch element."""
    return (BATCH,)


def no_axes(call: Call) -> tuple:
    """An op that runs on whole tensors only: DTensor gathers its inputs."""
    return ()


def _rows_rule(inputs: dict, outputs: tuple, primary: str = "x") -> Rule:
    return Rule(inputs, outputs, row_axes, primary)


_ROW_OUT = Out("x", leading_dims)
_NORM_STATS = (Out("x", mean_output), Out("x", leading_dims))
_AFFINE = {"weight": replicated, "bias": replicated}
_QK = {"q": heads_layout, "k": heads_layout}
_TABLES = {"cos": rotary_table, "sin": rotary_table}
_QK_OUT = (Out("q", heads_layout), Out("k", heads_layout))
_ATTENTION_ARGS = {"q": heads_layout, "k": heads_layout, "v": heads_layout, "kv_lengths": per_sample}
_ATTENTION_BACKWARD_ARGS = {**_ATTENTION_ARGS, "grad_out": heads_layout, "out": heads_layout, "lse": log_sum_exp}
_ATTENTION_GRADS = (Out("q", heads_layout), Out("k", heads_layout), Out("v", heads_layout))
_BLOCK_LISTS = {"block_index": block_lists, "block_count": block_lists}
_GLU = {"x": leading_dims}

RULES: dict[str, Rule] = {
    # ------------------------------------------------------------ norm
    "rmsnorm": _rows_rule({"x": leading_dims, **_AFFINE}, (_ROW_OUT,)),
    "layernorm": _rows_rule({"x": leading_dims, **_AFFINE}, (_ROW_OUT,)),
    "add_rmsnorm": _rows_rule(
        {"x": leading_dims, "residual": leading_dims, "weight": replicated}, (_ROW_OUT, _ROW_OUT)
    ),
    "norm_backward": _rows_rule(
        {"grad_out": leading_dims, "grad_residual": leading_dims, "x": leading_dims, **_AFFINE},
        (_ROW_OUT, Out("weight", replicated, gradient=True), Out("bias", replicated, gradient=True)),
    ),
    # ------------------------------------------------------------ modulate
    "modulate": _rows_rule({"x": leading_dims, "scale": modulation, "shift": modulation}, (_ROW_OUT,)),
    "norm_modulate": _rows_rule(
        {"x": leading_dims, "scale": modulation, "shift": modulation, **_AFFINE}, (_ROW_OUT, *_NORM_STATS)
    ),
    "gated_residual": _rows_rule({"residual": leading_dims, "x": leading_dims, "gate": modulation}, (_ROW_OUT,)),
    "gated_residual_norm_modulate": _rows_rule(
        {
            "residual": leading_dims,
            "x": leading_dims,
            "gate": modulation,
            "scale": modulation,
            "shift": modulation,
            **_AFFINE,
        },
        (_ROW_OUT, _ROW_OUT, *_NORM_STATS),
    ),
    # FP8 output modes (inference only: no backward op): the normed output's
    # e4m3 values and one scale per row, both indexed like x's rows.
    "norm_modulate_fp8": _rows_rule(
        {"x": leading_dims, "scale": modulation, "shift": modulation, **_AFFINE}, (_ROW_OUT, _ROW_OUT)
    ),
    "gated_residual_norm_modulate_fp8": _rows_rule(
        {
            "residual": leading_dims,
            "x": leading_dims,
            "gate": modulation,
            "scale": modulation,
            "shift": modulation,
            **_AFFINE,
        },
        (_ROW_OUT, _ROW_OUT, _ROW_OUT),
    ),
    "modulate_backward": _rows_rule(
        {
            "grad_out": leading_dims,
            "grad_h": leading_dims,
            "h": leading_dims,
            "mean": row_statistics,
            "rstd": row_statistics,
            "x_branch": leading_dims,
            "gate": modulation,
            "scale": modulation,
            "shift": modulation,
            **_AFFINE,
        },
        (
            Out("grad_out", leading_dims),
            Out("x_branch", leading_dims),
            *(Out(name, modulation, gradient=True) for name in ("gate", "scale", "shift")),
            Out("weight", replicated, gradient=True),
            Out("bias", replicated, gradient=True),
        ),
        primary="h",
    ),
    # ------------------------------------------------------------ glu
    "geglu": _rows_rule(_GLU, (_ROW_OUT,)),
    "swiglu": _rows_rule(_GLU, (_ROW_OUT,)),
    "glu_backward": _rows_rule({"grad_out": leading_dims, "x": leading_dims}, (_ROW_OUT,)),
    # ------------------------------------------------------------ rope
    "rope": Rule({"x": heads_layout, **_TABLES}, (Out("x", heads_layout),), batch_sequence_heads),
    "rope_qk": Rule({**_QK, **_TABLES}, _QK_OUT, batch_sequence_heads, "q"),
    "rope_grid": Rule({**_QK, "constants": replicated}, _QK_OUT, batch_heads, "q"),
    "qk_norm_rope": Rule(
        {**_QK, "q_weight": replicated, "k_weight": replicated, **_TABLES},
        _QK_OUT,
        batch_sequence_and_heads_unless_norm_spans_them,
        "q",
    ),
    # q and k for 8-bit attention: k's smoothing mean spans the sequence.
    "qk_rope_int8": Rule(
        {**_QK, "q_weight": replicated, "k_weight": replicated, **_TABLES},
        (Out("q", heads_layout), Out("q", log_sum_exp), Out("k", heads_layout), Out("k", key_block_scales)),
        batch_heads_unless_norm_spans_them,
        "q",
    ),
    "qk_norm_rope_backward": Rule(
        {
            "grad_q": heads_layout,
            "grad_k": heads_layout,
            **_QK,
            "q_weight": replicated,
            "k_weight": replicated,
            **_TABLES,
        },
        (*_QK_OUT, Out("q_weight", replicated, gradient=True), Out("k_weight", replicated, gradient=True)),
        batch_sequence_and_heads_unless_norm_spans_them,
        "q",
    ),
    # ------------------------------------------------------------ fp8
    "quantize_fp8_rows": _rows_rule({"x": leading_dims, "head": leading_dims}, (_ROW_OUT, _ROW_OUT)),
    # One LoRA adapter on FP8 rows: each output row reads its own rows of result, q and
    # scale, and the whole (replicated) adapter.
    "fp8_rows_lora": _rows_rule(
        {
            "result": leading_dims,
            "q": leading_dims,
            "scale": row_statistics,
            "lora_a": replicated,
            "lora_b": replicated,
            "scaling_tensor": replicated,
        },
        (Out("result", leading_dims),),
        primary="result",
    ),
    # ------------------------------------------------------------ moe
    # Routing runs replicated (x gathered): token shards would give correct
    # probs, weights and experts (row-wise) and counts (a Partial sum), but
    # token_index holds global token ids in one ascending list per expert
    # over all tokens, which neither Shard nor Partial of the local lists
    # describes (a shard's ids are local and its lists are pieces of the
    # global ones). The backward is row-wise again: dx follows x's token
    # shards, the router weight's gradient is Partial.
    "moe_route": Rule(
        {"x": leading_dims, "router_weight": replicated},
        (*(Out("x", leading_dims),) * 3, Out("router_weight", replicated), Out("router_weight", replicated)),
        no_axes,
    ),
    "moe_route_backward": _rows_rule(
        {
            "grad_probs": leading_dims,
            "grad_weights": leading_dims,
            "x": leading_dims,
            "router_weight": replicated,
            "probs": leading_dims,
            "experts": leading_dims,
        },
        (Out("x", leading_dims), Out("router_weight", replicated, gradient=True)),
    ),
    # ------------------------------------------------------------ attention
    "attention": Rule(_ATTENTION_ARGS, (Out("q", heads_layout), Out("q", log_sum_exp)), batch_heads, "q"),
    "attention_backward": Rule(_ATTENTION_BACKWARD_ARGS, _ATTENTION_GRADS, batch_heads, "q"),
    # 8-bit attention: k's mean (the smoothing) is over each (batch, head)'s
    # whole sequence, which batch and head shards keep whole.
    "attention_int8": Rule(_ATTENTION_ARGS, (Out("q", heads_layout),), batch_heads, "q"),
    "attention_int8_fp8": Rule(_ATTENTION_ARGS, (Out("q", heads_layout),), batch_heads, "q"),
    # Its FP8 rows: the rows' scale is a max over every head of v, so only
    # batch shards keep it whole; the values are [B, Lq, Hq, D] and the
    # scales [B, Lq] whatever q's layout.
    "attention_int8_fp8_rows": Rule(_ATTENTION_ARGS, (Out("q", fp8_rows), Out("q", fp8_rows)), batch_only, "q"),
    # ... and on q and k quantized by fused.qk_rope_int8.
    "attention_qk8": Rule(
        {**_ATTENTION_ARGS, "q_scale": log_sum_exp, "k_scale": key_block_scales},
        (Out("q", qk8_output), Out("q", qk8_output)),
        qk8_axes,
        "q",
    ),
    "block_sparse_attention": Rule(
        # The token order runs along the sequence, which these axes never shard.
        {**_ATTENTION_ARGS, **_BLOCK_LISTS, "token_order": replicated},
        (Out("q", heads_layout), Out("q", log_sum_exp)),
        batch_heads,
        "q",
    ),
    # Its FP8 rows: the scale is a max over every head, so batch shards only (as attention_int8_fp8_rows).
    "block_sparse_attention_int8_fp8_rows": Rule(
        {**_ATTENTION_ARGS, **_BLOCK_LISTS, "token_order": replicated},
        (Out("q", fp8_rows), Out("q", fp8_rows)),
        batch_only,
        "q",
    ),
    "block_sparse_attention_backward": Rule(
        {**_ATTENTION_BACKWARD_ARGS, **_BLOCK_LISTS}, _ATTENTION_GRADS, batch_heads, "q"
    ),
}


# ---------------------------------------------------------------- rule -> placements


def _is_tensor_argument(argument) -> bool:
    t = argument.type
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


def _bind(op_schema, primary: str) -> Call:
    """The call's arguments by schema name: tensors as the DTensor spec they arrive with."""
    from torch.distributed.tensor._op_schema import OpStrategy

    def value(v):
        return v.strategies[0].output_spec if isinstance(v, OpStrategy) else v

    arguments = op_schema.op._schema.arguments
    values = {a.name: a.default_value for a in arguments}
    values.update({a.name: value(v) for a, v in zip(arguments, op_schema.args_schema)})
    values.update({k: value(v) for k, v in op_schema.kwargs_schema.items()})
    return Call(values, primary)


def _tensor_inputs_in_dispatch_order(op_schema) -> list:
    """Names of the DTensor arguments in the order DTensor lists their
    strategies: positional ones, then keyword ones."""
    from torch.distributed.tensor._op_schema import OpStrategy

    names = [a.name for a in op_schema.op._schema.arguments]
    positional = [names[i] for i, v in enumerate(op_schema.args_schema) if isinstance(v, OpStrategy)]
    return positional + [k for k, v in op_schema.kwargs_schema.items() if isinstance(v, OpStrategy)]


def _mesh_of(op_schema):
    """The mesh of the first DTensor argument. (``OpSchema.get_mesh_from_args``
    reads only the first argument in torch 2.11, which is None for some calls
    of the backward ops: ``modulate_backward`` of a gated residual has no
    ``grad_out``.)"""
    return next(strategy.mesh for strategy in (*op_schema.args_strategy, *op_schema.kwargs_strategy))


def _shards_evenly(rule: Rule, call: Call, axis, mesh_size: int) -> bool:
    """Local shards line up along ``axis``: the sharded tensors have one size
    there, or every size divides evenly by the mesh (GQA heads, frames against
    tokens), so that chunk r of each covers the same slice of the axis."""
    sizes = set()
    for name, role in rule.inputs.items():
        spec = call[name]
        if spec is not None:
            d = role(spec.shape, call).get(axis)
            if d is not None:
                sizes.add(spec.shape[d])
    if not sizes:
        return False
    return len(sizes) == 1 or all(s % mesh_size == 0 for s in sizes)


def _placements(rule: Rule, call: Call, inputs: list, axis) -> list:
    """``[*output placements, *input placements]`` of sharding ``axis`` on one
    mesh dim (``axis=None``: everything replicated)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    def placement(role: Role, shape, absent):
        d = None if axis is None else role(shape, call).get(axis)
        return Shard(d) if d is not None else absent

    outputs = []
    for out in rule.outputs:
        source = call[out.source]
        if source is None or axis is None:
            outputs.append(Replicate())
        else:
            outputs.append(placement(out.role, source.shape, Partial() if out.gradient else Replicate()))
    return outputs + [placement(rule.inputs[name], call[name].shape, Replicate()) for name in inputs]


def sharding_strategy(rule: Rule, op_schema):
    """DTensor's op strategy for one call: all-replicated, plus one sharded
    strategy per axis the op offers, expanded over the mesh dims. DTensor picks
    the one that is cheapest to redistribute the inputs to."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    mesh = _mesh_of(op_schema)
    call = _bind(op_schema, rule.primary)
    inputs = _tensor_inputs_in_dispatch_order(op_schema)
    strategies = [_placements(rule, call, inputs, None)]
    for axis in rule.axes(call):
        if _shards_evenly(rule, call, axis, mesh.size()):
            strategies.append(_placements(rule, call, inputs, axis))
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=len(rule.outputs))


def _schema_info(op):
    """Hash every non-tensor argument into DTensor's sharding cache: a rule may
    read any of them (``seq_dim``, ``norm``)."""
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    arguments = op._schema.arguments
    static = [i for i, a in enumerate(arguments) if not _is_tensor_argument(a)]
    return RuntimeSchemaInfo(
        static_argnum=min(static, default=len(arguments)), static_kwargkey=[arguments[i].name for i in static] or None
    )


def check_rules() -> None:
    """Every ``torch.ops.fused`` op has a rule naming each tensor argument and
    each return, and nothing else: a new op (or a changed schema) fails here,
    not under DTensor."""
    ops = {name for name in dir(torch.ops.fused) if not name.startswith("_") and name != "name"}
    if ops != set(RULES):
        raise RuntimeError(
            f"compile_ops.distributed: ops without a sharding rule: {sorted(ops - set(RULES))}; "
            f"rules without an op: {sorted(set(RULES) - ops)}"
        )
    for name, rule in RULES.items():
        schema = getattr(torch.ops.fused, name).default._schema
        tensors = {a.name for a in schema.arguments if _is_tensor_argument(a)}
        if (
            set(rule.inputs) != tensors
            or len(rule.outputs) != len(schema.returns)
            or rule.primary not in tensors
            or any(out.source not in tensors for out in rule.outputs)
        ):
            raise RuntimeError(f"compile_ops.distributed: the rule of fused.{name} does not match its schema {schema}")


# ---------------------------------------------------------------- registration

_registered = False


def register() -> bool:
    """Register the rules of every fused op with DTensor (idempotent). False
    when this torch build has no ``torch.distributed``."""
    global _registered
    if _registered:
        return True
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    check_rules()
    propagator = DTensor._op_dispatcher.sharding_propagator
    for name, rule in RULES.items():
        op = getattr(torch.ops.fused, name).default
        propagator.register_op_strategy(op, partial(sharding_strategy, rule), _schema_info(op))
    _registered = True
    return True
