"""HuggingFace transformers: ``jagged_attention`` as an attention implementation of its models.

``register()`` adds it to ``transformers.AttentionInterface`` with FlashAttention 2's mask function in
``AttentionMaskInterface`` (no 4-D mask is built: the attention gets None or the 2-D padding mask). Then
``model.set_attn_implementation("jagged_mxfp8")`` (or ``attn_implementation=`` when loading) runs every
attention layer through it. Needs ``transformers`` (this module imports it).
"""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from ..interface import jagged_attention
from ..offsets import offsets_from_lengths, offsets_from_starts


def register(name: str = "jagged_mxfp8", *, backend: str = "auto") -> str:
    """Register the attention (running ``jagged_attention`` with ``backend``) and its mask function under
    ``name`` in transformers' interfaces; returns ``name``, for ``model.set_attn_implementation``."""
    AttentionInterface.register(name, functools.partial(attention_forward, backend=backend))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return name


def _unsupported(dropout, kwargs) -> list[str]:
    asked = [(dropout != 0, f"dropout={dropout}")]
    asked += [(kwargs.get(key) is not None, key) for key in ("sliding_window", "softcap", "s_aux")]
    return [what for is_asked, what in asked if is_asked]


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, *, backend: str = "auto", **kwargs):
    """transformers' attention-function contract: query ``[B, Hq, Lq, D]``, key/value ``[B, Hkv, Lk, D]``
    (Lk includes a KV cache) -> (``[B, Lq, Hq, D]``, None). The sequences, in this order of precedence:

    * a 2-D boolean ``attention_mask`` ``[B, Lk]`` (padded batches, left or right; queries are the last Lq
      columns): its True tokens, per row; padded query rows give 0;
    * ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (packed rows, B = 1): those offsets;
    * ``position_ids`` when Lq == Lk: a new sequence wherever a position is not its predecessor's plus one
      (packed rows, DataCollatorWithFlattening; a plain batch is one sequence per row);
    * otherwise one sequence per row (KV-cache decoding: Lq queries against Lk keys).

    Causal masking is bottom-right aligned (``is_causal``, else ``module.is_causal``), which is what decoding
    with a KV cache needs. Dropout, sliding windows, softcap and attention sinks raise NotImplementedError.
    """
    refused = _unsupported(dropout, kwargs)
    if refused:
        raise NotImplementedError(f"jagged_attn's attention does not support {', '.join(refused)}")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    batch, heads, len_q, dim = query.shape
    len_k = key.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, L, H, D]
    options = dict(causal=causal, softmax_scale=scaling, backend=backend)
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(f"expected a 2-D padding mask [batch, keys] (register()'s mask function makes one), "
                             f"got {attention_mask.dim()}-D: a model's own 4-D masks are not supported")
        keys = attention_mask[:, -len_k:].to(torch.bool)
        queries = keys[:, -len_q:]
        out = jagged_attention(q[queries], k[keys], v[keys], offsets_from_lengths(queries.sum(1)),
                               offsets_from_lengths(keys.sum(1)), **options)
        padded = out.new_zeros(batch, len_q, heads, dim)
        padded[queries] = out
        return padded, None
    offsets_q = kwargs.get("cu_seq_lens_q")
    offsets_k = kwargs.get("cu_seq_lens_k")
    position_ids = kwargs.get("position_ids")
    if offsets_q is None and position_ids is not None and len_q == len_k:
        positions = position_ids.expand(batch, len_q)
        starts = torch.ones_like(positions, dtype=torch.bool)
        starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
        offsets_q = offsets_from_starts(starts.flatten())
    if offsets_q is None:
        offsets_q = torch.arange(batch + 1, device=query.device) * len_q
        offsets_k = torch.arange(batch + 1, device=query.device) * len_k
    out = jagged_attention(q.reshape(batch * len_q, heads, dim), k.reshape(batch * len_k, -1, dim),
                           v.reshape(batch * len_k, -1, dim), offsets_q, offsets_k if offsets_k is not None
                           else offsets_q, **options)
    return out.view(batch, len_q, heads, dim), None
