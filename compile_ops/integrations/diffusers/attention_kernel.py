"""``patch(attention_kernel="auto")``: which kernel runs a processor's exact attention call;
and from how many keys an 8-bit ``attention_precision`` runs ahead of 16-bit attention.

SDPA's cuDNN backend runs 16-bit inference forwards ahead of ``fused.attention``,
except where ``fused.attention``'s sm_90 core is ahead: long key counts,
key counts that end in a ragged tile, and key lengths (a padding mask, which
SDPA takes as a boolean mask). The bounds below come from
bench/results/attention-sm90-core-persistent-h100.json,
attention-ragged-keys-h100.json (and ``-short-``),
attention-sm90-core-d64-h100.json (and ``-d64-lengths-``) and
masked-sdpa-h100.json; the 8-bit bound from short-keys-h100.json
(docs/notes/attention-8bit.md, "8-bit attention on short key sequences").
"""

from __future__ import annotations

import torch

from compile_ops._library import has_wgmma

#: Keys from which the sm_90 core runs a dense 16-bit forward ahead of SDPA's cuDNN backend.
FUSED_AHEAD_FROM_KEYS = 16385
#: Below that, key counts that are not a multiple of the core's key tile
#: (:data:`RAGGED_KEY_TILE`), from this many keys on: there cuDNN's forward
#: slows and the core's masked last tile does not.
FUSED_AHEAD_RAGGED_FROM_KEYS = 3000
#: The core's key tile at D = 128 (``ops.attention_tiles.forward_tiles``): a key
#: count off its multiples ends in one masked tile.
RAGGED_KEY_TILE = 128
#: The head dim at which the bounds above hold; at D = 64 the core is not
#: far enough ahead to leave SDPA for.
FUSED_AHEAD_HEAD_DIM = 128


#: Keys from which 8-bit attention runs a 16-bit inference call on a GPU ahead of
#: 16-bit attention (the FP8 rows' quantization counted where a projection reads
#: them). Below it, text cross-attention for one: each program's fixed work
#: (its queries rounded to int8, its output rounded and stored) is spread over
#: a few key tiles only.
EIGHT_BIT_FROM_KEYS = 2048


def needs_gradient(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def sdpa_is_faster(query, key, value, kv_lengths=None) -> bool:
    """Whether ``attention_kernel="auto"`` sends this call to SDPA: 16-bit
    inference on a GPU, except where the sm_90 core runs it at D = 128
    (:data:`FUSED_AHEAD_HEAD_DIM`): dense at :data:`FUSED_AHEAD_FROM_KEYS`
    keys or more, at a ragged key count (not a multiple of
    :data:`RAGGED_KEY_TILE`) from :data:`FUSED_AHEAD_RAGGED_FROM_KEYS` keys,
    and with key lengths at any length (SDPA runs them as a boolean mask,
    the core as a masked tile that costs nothing). Training keeps
    fused.attention, whose backward is ahead of SDPA's. q, k, v
    ``[B, L, H, D]``; ``kv_lengths`` ``[B]`` or None."""
    if not (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)) or needs_gradient(query, key, value):
        return False
    on_core = has_wgmma(query) and query.shape[-1] == FUSED_AHEAD_HEAD_DIM
    keys = key.shape[1]
    ragged = keys % RAGGED_KEY_TILE != 0 and keys >= FUSED_AHEAD_RAGGED_FROM_KEYS
    return not (on_core and (kv_lengths is not None or keys >= FUSED_AHEAD_FROM_KEYS or ragged))


def eight_bit_pays(query, key) -> bool:
    """Whether an 8-bit ``attention_precision`` runs this 16-bit inference call
    (``[B, L, H, D]`` q and k): on a GPU from :data:`EIGHT_BIT_FROM_KEYS` keys
    (shorter calls keep 16-bit attention, faster and more accurate there);
    elsewhere always (the reference path, the interpreter: the precision the
    caller set, whatever the length)."""
    return not query.is_cuda or key.shape[1] >= EIGHT_BIT_FROM_KEYS
