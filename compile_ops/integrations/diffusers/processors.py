"""diffusers' attention processors with the fused ops: the attention extension point.

Each processor runs the same projections, q/k-norm and rotary embeddings as
the one it replaces, with ``fused.qk_norm_rope`` (or the norms and
``fused.rope_qk``) and attention with ``fused.attention`` or SDPA
(``attention_kernel``), and hands any call it does not cover (an attention
mask, image conditioning) to the original processor. Projections fused by
diffusers' ``fuse_qkv_projections()`` (``to_qkv``, ``to_added_qkv``,
``to_kv``) are read where diffusers' processors read them.
Under diffusers' context parallelism (``enable_parallelism``) attention runs
through diffusers' Ulysses/ring templates with the same kernel choices
(:mod:`.context_parallel`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from compile_ops.integrations.diffusers.attention_kernel import (
    EIGHT_BIT_FROM_KEYS,
    eight_bit_pays,
    needs_gradient,
    sdpa_is_faster,
)
from compile_ops.integrations.diffusers.context_parallel import context_parallel, parallel_attention
from compile_ops.integrations.diffusers.module_rules import FUSED_PROJECTIONS, diffusers_modules
from compile_ops.integrations.schedule import DenseFirst
from compile_ops.modules.fp8 import takes_fp8_rows
from compile_ops.modules.hooks import must_call
from compile_ops.modules.norm import RMSNorm
from compile_ops.ops.attention import Int8QK, attention, attention_fp8_rows
from compile_ops.ops.fp8 import FP8Rows, quantize_fp8_rows
from compile_ops.ops.rope import qk_norm_rope, rope_qk

#: Self-attention from this many tokens up takes q and k quantized by their
#: rotation's kernel (``fused.qk_rope_int8``); shorter sequences let 8-bit
#: attention quantize them, since the rotation's programs are too few to fill
#: the GPU there (bench/results/rope-int8-sweep-h100.json).
QUANTIZE_IN_ROTATION_MIN_TOKENS = 8192


class FusedProcessor:
    """Base of our processors: the original processor runs every call that the
    fused path does not cover. ``kernel`` picks the attention kernel (see
    :func:`compile_ops.patch`)."""

    #: Attributes diffusers sets on a model's processors
    #: (``set_attention_backend``, ``enable_parallelism``): they live on the
    #: original; ours reads ``_parallel_config`` from there (:meth:`parallel_config`).
    _ORIGINALS = ("_attention_backend", "_parallel_config")

    def __init__(self, original=None, kernel: str = "auto"):
        # No original: diffusers rebuilding the processors it keeps by calling
        # their class with no arguments (loading or unloading an IP-Adapter on
        # Flux and SD3); ours then wraps a fresh diffusers processor of the
        # class it replaces, with the default kernel choice.
        self.original = self._diffusers_processor()() if original is None else original
        self.kernel = kernel
        #: The model's SparseAttention plan for a video self-attention layer
        #: (``patch(attention=...)``), else None.
        self.sparse = None
        # Resolved here, not while Dynamo traces a call.
        self.rms_norm_classes = (RMSNorm, nn.RMSNorm, diffusers_modules().normalization.RMSNorm)

    @classmethod
    def _diffusers_processor(cls) -> type:
        """The diffusers processor class this one replaces."""
        return next(theirs for (_, theirs), (_, ours) in processor_rules().items() if ours is cls)

    def __getattr__(self, name):  # only for names not set on this object
        original = self.__dict__.get("original")  # absent while copy/pickle rebuild the object
        if original is None:
            raise AttributeError(name)
        return getattr(original, name)

    def __setattr__(self, name, value):
        if name in self._ORIGINALS:
            setattr(self.original, name, value)
        else:
            super().__setattr__(name, value)

    #: ``patch(attention_precision=...)``: "int8" ("int8_fp8") runs dense
    #: attention as ``fused.attention_int8`` (``attention_int8_fp8``), and a
    #: sparse plan's layouts as ``fused.block_sparse_attention`` in that
    #: precision, where it applies (:meth:`eight_bit`), from the step
    #: ``int8_schedule`` (a :class:`DenseFirst`, or None: every step) says.
    attention_precision = "exact"
    int8_schedule: Optional[DenseFirst] = None
    #: Under context parallelism, every rank holds the layer's text tokens
    #: whole and only the other tokens are sharded (HunyuanVideo under
    #: compile_ops' plan, ``.cp_plans``): Ulysses only.
    replicates_text = False

    def parallel_config(self):
        """diffusers' ``ParallelConfig`` of this layer when it has context
        parallelism (``model.enable_parallelism``), else None."""
        config = getattr(self, "_parallel_config", None)
        return config if context_parallel(config) is not None else None

    def attention_precision_of(self, query, key, value) -> str:
        """The precision :meth:`attend` runs these q, k, v in: "exact" unless :meth:`eight_bit`."""
        return self.attention_precision if self.eight_bit(query, key, value) else "exact"

    def attend(self, query, key, value, kv_lengths=None, fp8_rows: bool = False, parallel=None, replicated_tail=0):
        """Attention of ``[B, L, H, D]`` q, k, v; ``kv_lengths [B]``: keys past
        each sample's length are masked (padded text tokens at the end).
        ``parallel``: the layer's context-parallel ``ParallelConfig``
        (:meth:`parallel_config`) for a call diffusers splits across ranks
        (q, k, v are this rank's sequence shard), else None.
        Under ``attention_precision="int8"`` or ``"int8_fp8"``, 16-bit
        inference calls run 8-bit attention; calls that need a gradient
        (training) and fp32 ones keep the exact kernels. ``fp8_rows`` (the
        caller's output projection takes them, ``takes_fp8_rows``): where
        ``"int8_fp8"`` runs, the output comes as :class:`FP8Rows` ``[B, L, H * D]``
        from the kernel's epilogue (:func:`attention_fp8_rows`), else as a tensor
        (always under ``parallel``: the output travels back to its ranks).
        ``replicated_tail``: under ``parallel``, the tokens at the end that
        every rank holds whole (:attr:`replicates_text`)."""
        if parallel is not None:
            return parallel_attention(
                query,
                key,
                value,
                parallel,
                kv_lengths=kv_lengths,
                kernel=self.kernel,
                precision=self.attention_precision_of(query, key, value),
                owner=f"compile_ops {type(self).__name__}",
                replicated_tail=replicated_tail,
            )
        if isinstance(query, Int8QK) or self.eight_bit(query, key, value):
            if fp8_rows and self.attention_precision == "int8_fp8":
                return attention_fp8_rows(query, key, value, seq_dim=1, kv_lengths=kv_lengths)
            return attention(query, key, value, seq_dim=1, kv_lengths=kv_lengths, precision=self.attention_precision)
        if self.kernel == "sdpa" or (self.kernel == "auto" and sdpa_is_faster(query, key, value, kv_lengths)):
            mask = None
            if kv_lengths is not None:
                keys = torch.arange(key.shape[1], device=key.device)
                mask = (keys < kv_lengths.unsqueeze(1)).unsqueeze(1).unsqueeze(1)  # [B, 1, 1, Lk]
            out = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (query, key, value)), attn_mask=mask
            )
            return out.transpose(1, 2)
        return attention(query, key, value, seq_dim=1, kv_lengths=kv_lengths)

    def splits_across_ranks(self, attn) -> bool:
        """Whether ``attn``'s calls split across ranks under context parallelism
        (not the layers diffusers runs on each rank's queries: Wan's cross-attention)."""
        return True

    def describe(self, attn) -> tuple[str, str]:
        """``(kernel, parallel path)`` of this layer's attention calls now, in words (``PatchReport``)."""
        from compile_ops.integrations.diffusers.context_parallel import parallel_path

        exact = {
            "auto": "fused.attention or SDPA (attention_kernel='auto')",
            "fused": "fused.attention",
            "sdpa": "SDPA",
        }.get(self.kernel, self.kernel)
        kernel, precision = exact, self.attention_precision
        if self.sparse is not None and precision != "exact":  # set on self-attention layers only
            kernel = (
                f"fused.block_sparse_attention ({self.sparse.config}) in precision={precision!r}, "
                f"fused.attention_{precision} on its dense steps (inference); exact kernels under autograd"
            )
        elif self.sparse is not None:
            kernel = f"fused.block_sparse_attention ({self.sparse.config}), {exact} on its dense steps"
        elif precision != "exact":
            kernel = (
                f"fused.attention_{precision} (inference) from {EIGHT_BIT_FROM_KEYS} keys on a GPU, "
                f"{exact} under autograd and on fewer keys"
            )
        parallel = parallel_path(self.parallel_config())
        if parallel != "one rank" and not self.splits_across_ranks(attn):
            parallel = f"each rank's queries ({parallel} elsewhere)"
        elif parallel != "one rank" and self.replicates_text:
            parallel = f"{parallel}, the text whole on every rank"
        return kernel, parallel

    def eight_bit(self, query, key, value) -> bool:
        """Whether :meth:`attend` runs these 16-bit q, k, v as 8-bit attention:
        an 8-bit ``attention_precision``, a step the schedule says, no gradient,
        and enough keys for it to pay (:func:`eight_bit_pays`)."""
        return (
            self.attention_precision != "exact"
            and (self.int8_schedule is None or self.int8_schedule.active)
            and query.dtype in (torch.float16, torch.bfloat16)
            and not needs_gradient(query, key, value)
            and eight_bit_pays(query, key)
        )

    def quantizes_qk(self, query, key, value) -> bool:
        """Whether q and k of a self-attention call come quantized from their
        rotation (``rope_qk``/``qk_norm_rope(..., quantize=True)``): 8-bit
        attention runs (:meth:`eight_bit`), no sparse plan takes the call, the
        sequence is long enough (:data:`QUANTIZE_IN_ROTATION_MIN_TOKENS`), and
        no context parallelism moves q and k between ranks first."""
        return (
            self.eight_bit(query, key, value)
            and (self.sparse is None or self.sparse.layout is None)
            and query.shape[1] >= QUANTIZE_IN_ROTATION_MIN_TOKENS
            and self.parallel_config() is None
        )

    def attend_self(
        self,
        query,
        key,
        value,
        text_tokens: int = 0,
        kv_lengths=None,
        fp8_rows: bool = False,
        parallel=None,
        replicated_tail: int = 0,
    ):
        """Video self-attention of ``[B, L, H, D]`` q, k, v (the last
        ``text_tokens`` of L text, attended densely): the sparse plan's layout
        for this call where one is set, in :meth:`attention_precision_of`'s
        precision (the output in the tokens' order; as FP8 rows from the
        kernel's epilogue where ``fp8_rows`` and ``"int8_fp8"`` runs), else
        :meth:`attend` (``fp8_rows``, ``parallel`` and ``replicated_tail`` as
        there; under ``parallel`` the layout spans every rank's tokens)."""
        layout = None if self.sparse is None else self.sparse.layout
        if layout is None or isinstance(query, Int8QK):
            return self.attend(query, key, value, kv_lengths, fp8_rows, parallel, replicated_tail)
        if layout.text_tokens != text_tokens:
            raise RuntimeError(
                f"compile_ops sparse attention: the layout was built for {layout.text_tokens} text "
                f"tokens, this attention has {text_tokens}; this is a compile_ops bug"
            )
        precision = self.attention_precision_of(query, key, value)
        if parallel is not None:
            return parallel_attention(
                query,
                key,
                value,
                parallel,
                precision=precision,
                layout=layout,
                kv_lengths=kv_lengths,
                owner=f"compile_ops {type(self).__name__}",
                replicated_tail=replicated_tail,
            )
        fp8_rows = fp8_rows and precision == "int8_fp8"
        return layout.attend(query, key, value, kv_lengths, precision=precision, fp8_rows=fp8_rows)

    def rms_weight(self, norm: nn.Module) -> Optional[tuple]:
        """``(weight, eps)`` of an RMSNorm that ``fused.qk_norm_rope`` can run
        (weighted, no bias, a set eps); None for any other norm, and for one
        whose call is hooked (offloading, casting: :func:`must_call`)."""
        if type(norm) not in self.rms_norm_classes or must_call(norm):
            return None
        weight, eps = getattr(norm, "weight", None), getattr(norm, "eps", None)
        if weight is None or getattr(norm, "bias", None) is not None or eps is None:
            return None
        return weight, eps

    def norm_rope(self, query, key, norm_q, norm_k, rope, quantize: bool = False, spans_heads: bool = False):
        """q/k-norm then rotary embedding of ``[B, L, H, D]`` q and k (``rope``:
        ``(cos, sin)`` tables ``[L, D]`` with pairs interleaved, or None): one
        ``fused.qk_norm_rope`` launch when both norms are weighted RMSNorms with
        one eps, else the norms and ``fused.rope_qk``. ``spans_heads``: the
        norms normalize a position's ``H * D`` channels together (Wan's), not
        each head. ``quantize`` (with rope; :meth:`quantizes_qk`):
        ``(Int8QK, None)`` for 8-bit attention, from the same kernel."""
        q_norm, k_norm = self.rms_weight(norm_q), self.rms_weight(norm_k)
        quantize = quantize and rope is not None
        if rope is not None and q_norm is not None and k_norm is not None and q_norm[1] == k_norm[1]:
            out = qk_norm_rope(
                query, key, q_norm[0], k_norm[0], *rope, eps=q_norm[1], interleaved=True, seq_dim=1, quantize=quantize
            )
            return (out, None) if quantize else out
        if spans_heads:
            query, key = (norm(t.flatten(2)).unflatten(2, t.shape[2:]) for norm, t in ((norm_q, query), (norm_k, key)))
        else:
            query, key = norm_q(query), norm_k(key)
        if rope is None:
            return query, key
        out = rope_qk(query, key, *rope, interleaved=True, seq_dim=1, quantize=quantize)
        return (out, None) if quantize else out


def _shared_input(x, *linears: nn.Module):
    """``x`` for projections that all read it: quantized once to FP8 rows when
    every one of them takes them (``takes_fp8_rows``: q, k and v after
    ``patch(precision="fp8")``, LoRA layers over them included), instead of
    once per projection. FP8 rows (a norm's FP8 output mode) pass as they are."""
    if isinstance(x, FP8Rows):
        return x
    if all(takes_fp8_rows(linear) for linear in linears):
        return quantize_fp8_rows(x)
    return x


#: ``(fused Linear, the Linears it replaces)`` of diffusers' ``fuse_qkv_projections()``
#: that the processors read: self-attention's q/k/v, a joint block's text q/k/v,
#: cross-attention's k/v.
QKV, ADDED_QKV, KV = ((name, FUSED_PROJECTIONS[name]) for name in ("to_qkv", "to_added_qkv", "to_kv"))


def _readers(attn, projections: tuple, fused: bool) -> list:
    """The Linears that project one input for ``projections`` (:data:`QKV`,
    :data:`ADDED_QKV` or :data:`KV`): diffusers' fused Linear when ``fused``
    (``attn.fused_projections`` for the processors of diffusers' that read
    it then, Flux's and Wan's), else the separate ones."""
    fused_name, separate = projections
    return [getattr(attn, fused_name)] if fused else [getattr(attn, name) for name in separate]


def _project(attn, x, projections: tuple, fused: bool) -> list:
    """``[B, L, C]`` outputs of ``projections`` over ``x`` (:func:`_readers`;
    ``x`` quantized once to FP8 rows where every reader takes them): a fused
    Linear's output split along its channels into views, as diffusers' ``chunk``."""
    readers = _readers(attn, projections, fused)
    x = _shared_input(x, *readers)
    if fused:
        return list(readers[0](x).chunk(len(projections[1]), dim=-1))
    return [linear(x) for linear in readers]


def _qkv(attn, hidden_states, encoder_hidden_states=None, fused: bool = False) -> list:
    """``[q, k, v]`` (``[B, L, C]``) of a self-attention layer, or of a
    cross-attention layer whose keys and values come from ``encoder_hidden_states``
    (``fused``: :func:`_readers`)."""
    if encoder_hidden_states is None:
        return _project(attn, hidden_states, QKV, fused)
    return [attn.to_q(hidden_states), *_project(attn, encoder_hidden_states, KV, fused)]


def _heads_joined(out, dtype: torch.dtype):
    """Attention's ``[B, L, H, D]`` output as the ``[B, L, H * D]`` rows of
    the output projection, in ``dtype``; FP8 rows (already joined) as they are."""
    return out if isinstance(out, FP8Rows) else out.flatten(2, 3).to(dtype)


def _tokens(x) -> int:
    """The sequence length of ``[B, L, C]`` hidden states or of their FP8 rows."""
    return (x.q if isinstance(x, FP8Rows) else x).shape[1]


class FluxAttnProcessor(FusedProcessor):
    """diffusers' ``FluxAttnProcessor`` (Flux double- and single-stream attention)
    with q/k-norm and rotary embedding in one fused op, and attention as a
    fused op (or SDPA, see :func:`compile_ops.patch`)."""

    def covers(self, attn, encoder_hidden_states, attention_mask) -> bool:
        """Whether the fused path runs this call (else the original processor does)."""
        return not (
            attention_mask is not None
            or (encoder_hidden_states is not None and attn.added_kv_proj_dim is None)
            or (encoder_hidden_states is not None and attn.fused_projections and not hasattr(attn, "to_added_qkv"))
        )

    @staticmethod
    def takes_fp8_rows(attn, encoder_hidden_states=None, joint_attention_kwargs=None) -> bool:
        """Whether ``attn(hidden_states=FP8Rows, ...)`` is safe for a block to call:
        ``attn``'s processor is ours, covers the call, and every projection that
        reads the hidden states (and the text states, when given) is an
        FP8Linear or a LoRA layer over one (``takes_fp8_rows``), so the norm
        before can write FP8 rows directly."""
        processor, kwargs = attn.processor, joint_attention_kwargs or {}
        if (
            not isinstance(processor, FluxAttnProcessor)
            or set(kwargs) - {"attention_mask"}
            or not processor.covers(attn, encoder_hidden_states, kwargs.get("attention_mask"))
        ):
            return False
        linears = _readers(attn, QKV, attn.fused_projections)
        if encoder_hidden_states is not None:
            linears += _readers(attn, ADDED_QKV, attn.fused_projections)
        return all(takes_fp8_rows(linear) for linear in linears)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if not self.covers(attn, encoder_hidden_states, attention_mask):
            if isinstance(hidden_states, FP8Rows) or isinstance(encoder_hidden_states, FP8Rows):
                raise RuntimeError(
                    "compile_ops FluxAttnProcessor: FP8 rows reached a call the fused path does "
                    "not cover (a mask since the block checked); this is a compile_ops bug"
                )
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

        def heads(t):
            return t.unflatten(-1, (-1, attn.head_dim))

        def rows(start, end):  # the rotary tables' rows of one stream
            return None if image_rotary_emb is None else tuple(t[start:end] for t in image_rotary_emb)

        image_rope = rows(-_tokens(hidden_states), None)
        query, key, value = (heads(t) for t in _qkv(attn, hidden_states, fused=attn.fused_projections))
        # A single-stream call's q and k can come quantized from their rotation;
        # a double-stream call's text and image streams are joined after it,
        # and k's smoothing mean spans both, so its attention quantizes them.
        quantize = encoder_hidden_states is None and self.quantizes_qk(query, key, value)
        query, key = self.norm_rope(query, key, attn.norm_q, attn.norm_k, image_rope, quantize)
        if encoder_hidden_states is not None:
            # Text tokens come first in the joint sequence and in the tables;
            # each stream is normed with its own weights and rotated with its rows.
            text = _project(attn, encoder_hidden_states, ADDED_QKV, attn.fused_projections)
            text_query, text_key, text_value = (heads(t) for t in text)
            text_query, text_key = self.norm_rope(
                text_query, text_key, attn.norm_added_q, attn.norm_added_k, rows(0, _tokens(encoder_hidden_states))
            )
            query, key = torch.cat([text_query, query], dim=1), torch.cat([text_key, key], dim=1)
            value = torch.cat([text_value, value], dim=1)
        # Double-stream blocks' output projections can read FP8 rows; the
        # single-stream block concatenates the output with its MLP's first.
        fp8_rows = (
            encoder_hidden_states is not None and takes_fp8_rows(attn.to_out[0]) and takes_fp8_rows(attn.to_add_out)
        )
        out = _heads_joined(
            self.attend(query, key, value, fp8_rows=fp8_rows, parallel=self.parallel_config()), value.dtype
        )
        if encoder_hidden_states is None:
            return out
        sizes = [_tokens(encoder_hidden_states), _tokens(hidden_states)]
        if isinstance(out, FP8Rows):
            text, image = (
                FP8Rows(*parts)
                for parts in zip(out.q.split_with_sizes(sizes, dim=1), out.scale.split_with_sizes(sizes, dim=1))
            )
        else:
            text, image = out.split_with_sizes(sizes, dim=1)
        image = attn.to_out[1](attn.to_out[0](image))
        return image, attn.to_add_out(text)


class WanAttnProcessor(FusedProcessor):
    """diffusers' ``WanAttnProcessor`` (self- and text cross-attention) with
    rotary embedding and attention as fused ops; image-conditioned (I2V)
    attention stays with the original."""

    @staticmethod
    def takes_fp8_rows(attn, cross: bool = False) -> bool:
        """Whether this layer's fused path runs and can take its input (the
        query's, for ``cross``-attention) as FP8 rows: its projections that
        read it are FP8 Linears and the call is one this processor covers."""
        processor = getattr(attn, "processor", None)
        if type(processor) is not WanAttnProcessor or attn.add_k_proj is not None:
            return False
        readers = [attn.to_q] if cross else _readers(attn, QKV, attn.fused_projections)
        return all(takes_fp8_rows(linear) for linear in readers)

    def splits_across_ranks(self, attn) -> bool:
        return not attn.is_cross_attention

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if attention_mask is not None or attn.add_k_proj is not None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        qkv = _qkv(attn, hidden_states, encoder_hidden_states, attn.fused_projections)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in qkv)
        # Wan's q/k norms span the heads; [1, L, 1, D] tables with each pair's
        # angle repeated: Wan rotates (2i, 2i + 1) pairs.
        rope = None if rotary_emb is None else tuple(t[0, :, 0] for t in rotary_emb)
        quantize = rope is not None and self.quantizes_qk(query, key, value)
        query, key = self.norm_rope(query, key, attn.norm_q, attn.norm_k, rope, quantize, spans_heads=True)
        # As diffusers' processor: self-attention splits across ranks, cross-attention
        # (every rank holds the whole text) runs on each rank's queries.
        attend, parallel = (
            (self.attend, None) if encoder_hidden_states is not None else (self.attend_self, self.parallel_config())
        )
        out = _heads_joined(
            attend(query, key, value, fp8_rows=takes_fp8_rows(attn.to_out[0]), parallel=parallel), value.dtype
        )
        return attn.to_out[1](attn.to_out[0](out))


class JointAttnProcessor(FusedProcessor):
    """diffusers' ``JointAttnProcessor2_0`` (SD3 / SD3.5 joint attention) with
    attention as a fused op (SD3 has no rotary embedding)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        if attention_mask is not None or args or kwargs:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)

        def heads(t):
            return t.unflatten(-1, (attn.heads, -1))

        def normed(norm, t):
            return t if norm is None else norm(t)

        query, key, value = (heads(t) for t in _qkv(attn, hidden_states))
        query, key = normed(attn.norm_q, query), normed(attn.norm_k, key)
        if encoder_hidden_states is not None:
            text_query, text_key, text_value = (
                heads(t) for t in _project(attn, encoder_hidden_states, ADDED_QKV, fused=False)
            )
            query = torch.cat([query, normed(attn.norm_added_q, text_query)], 1)
            key = torch.cat([key, normed(attn.norm_added_k, text_key)], 1)
            value = torch.cat([value, text_value], 1)
        out = self.attend(query, key, value).flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](out))
        out, context = out[:, : hidden_states.shape[1]], out[:, hidden_states.shape[1] :]
        if not attn.context_pre_only:
            context = attn.to_add_out(context)
        return attn.to_out[1](attn.to_out[0](out)), context


class LTXVideoAttnProcessor(FusedProcessor):
    """diffusers' ``LTXVideoAttnProcessor`` with rotary embedding and attention
    as fused ops; masked (text cross-) attention stays with the original."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        query, key, value = _qkv(attn, hidden_states, encoder_hidden_states)
        # LTX's q/k norms and tables span all heads' channels ([B, L, heads * D],
        # pairs (2i, 2i + 1)): norm and rotate the projections as one wide head.
        query, key = (t.unsqueeze(2) for t in (query, key))
        query, key = (t.squeeze(2) for t in self.norm_rope(query, key, attn.norm_q, attn.norm_k, image_rotary_emb))
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        attend = self.attend if encoder_hidden_states is not None else self.attend_self
        out = attend(query, key, value, fp8_rows=takes_fp8_rows(attn.to_out[0]), parallel=self.parallel_config())
        return attn.to_out[1](attn.to_out[0](_heads_joined(out, query.dtype)))


def _prefix_lengths(mask):
    """``[B]`` int32 key lengths of a ``[B, 1, 1, N]`` (or ``[B, N]``) boolean key
    mask that keeps a prefix of each row (HunyuanVideo builds it so: video
    tokens, then the valid text tokens); checked on the device, without a sync."""
    mask = mask.reshape(mask.shape[0], mask.shape[-1])
    lengths = mask.sum(-1, dtype=torch.int32)
    keys = torch.arange(mask.shape[-1], device=mask.device)
    torch._assert_async(
        (mask == (keys < lengths.unsqueeze(1))).all(),
        "compile_ops HunyuanVideoAttnProcessor: the attention mask is not a prefix of each row",
    )
    return lengths


class HunyuanVideoAttnProcessor(FusedProcessor):
    """diffusers' ``HunyuanVideoAttnProcessor2_0`` (double-stream joint attention
    and single-stream attention; video tokens first, text last) with q/k-norm
    and rotary embedding fused, the text padding mask as key lengths, and
    sparse self-attention over the video tokens when ``patch(attention=...)``
    set a plan (the text tokens attend and are attended densely). Under
    context parallelism (compile_ops' plan, ``.cp_plans``) the video tokens
    are sharded and every rank holds the whole text."""

    replicates_text = True

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        joint = attn.add_q_proj is not None and encoder_hidden_states is not None
        text_tokens = 0 if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        if not joint and encoder_hidden_states is not None:
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)

        def heads(t):
            return t.unflatten(2, (attn.heads, -1))

        query, key, value = (heads(t) for t in _qkv(attn, hidden_states))
        if joint or not text_tokens:
            query, key = self.norm_rope(query, key, attn.norm_q, attn.norm_k, image_rotary_emb)
        else:  # single-stream: the rotary embedding on the video tokens only, the q/k norms on all
            video = query.shape[1] - text_tokens
            video_qk = self.norm_rope(query[:, :video], key[:, :video], attn.norm_q, attn.norm_k, image_rotary_emb)
            text_qk = self.norm_rope(query[:, video:], key[:, video:], attn.norm_q, attn.norm_k, None)
            query, key = (torch.cat(pair, dim=1) for pair in zip(video_qk, text_qk))
        if joint:
            text_query, text_key, text_value = (
                heads(t) for t in _project(attn, encoder_hidden_states, ADDED_QKV, fused=False)
            )
            text_query, text_key = self.norm_rope(text_query, text_key, attn.norm_added_q, attn.norm_added_k, None)
            query, key = torch.cat([query, text_query], dim=1), torch.cat([key, text_key], dim=1)
            value = torch.cat([value, text_value], dim=1)
        parallel = self.parallel_config()
        tail = 0
        if parallel is not None:
            # compile_ops' plan: this rank's video tokens, then the whole text; the mask spans every rank's.
            tail, world = text_tokens, context_parallel(parallel).ulysses_degree
            whole = world * (key.shape[1] - text_tokens) + text_tokens
            if attention_mask is not None and attention_mask.shape[-1] != whole:
                raise ValueError(
                    "compile_ops HunyuanVideoAttnProcessor: under context parallelism the video tokens "
                    "are sharded and the text is whole on every rank (compile_ops' cp_plan, which "
                    f"patch() installs), so the text padding mask spans {whole} keys; got "
                    f"{attention_mask.shape[-1]}. Enable parallelism with the model's own plan "
                    "(model.enable_parallelism(config=...), no cp_plan argument)"
                )
        lengths = None if attention_mask is None else _prefix_lengths(attention_mask)
        out = self.attend_self(query, key, value, text_tokens, lengths, parallel=parallel, replicated_tail=tail)
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out, None
        out, text = out[:, :-text_tokens], out[:, -text_tokens:]
        if getattr(attn, "to_out", None) is not None:
            out = attn.to_out[1](attn.to_out[0](out))
        if getattr(attn, "to_add_out", None) is not None:
            text = attn.to_add_out(text)
        return out, text


def processor_rules() -> dict:
    """``{(attention class, exact processor class): (what, our processor class)}``."""
    from diffusers.models import attention_processor
    from diffusers.models.transformers import transformer_hunyuan_video as hunyuan

    modules = diffusers_modules()
    flux, wan, ltx = modules.flux, modules.wan, modules.ltx
    return {
        (flux.FluxAttention, flux.FluxAttnProcessor): ("diffusers FluxAttnProcessor", FluxAttnProcessor),
        (wan.WanAttention, wan.WanAttnProcessor): ("diffusers WanAttnProcessor", WanAttnProcessor),
        (attention_processor.Attention, attention_processor.JointAttnProcessor2_0): (
            "diffusers JointAttnProcessor2_0",
            JointAttnProcessor,
        ),
        (ltx.LTXAttention, ltx.LTXVideoAttnProcessor): ("diffusers LTXVideoAttnProcessor", LTXVideoAttnProcessor),
        (attention_processor.Attention, hunyuan.HunyuanVideoAttnProcessor2_0): (
            "diffusers HunyuanVideoAttnProcessor2_0",
            HunyuanVideoAttnProcessor,
        ),
    }
