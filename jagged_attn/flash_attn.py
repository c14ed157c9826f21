"""FlashAttention 2's varlen entry point on ``jagged_attention``, so that code written for it switches with
one import: ``from jagged_attn import flash_attn_varlen_func``."""

from __future__ import annotations

from .interface import jagged_attention


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None, *, return_lse=False, backend="auto", center_kv=False,
):
    """``flash_attn.flash_attn_varlen_func`` (FlashAttention 2, same arguments in the same order) computed
    by :func:`jagged_attn.jagged_attention` in MXFP8.

    q: ``[total_q, Hq, D]``, k, v: ``[total_k, Hkv, D]`` (GQA/MQA: ``Hq % Hkv == 0``; D a multiple of 32);
    cu_seqlens_q / cu_seqlens_k: int32 (or int64) ``[B + 1]`` offsets. ``max_seqlen_q`` / ``max_seqlen_k``
    are accepted and not needed (the offsets give every length). ``causal`` is bottom-right aligned, as
    FlashAttention's (query i sees keys ``j <= i + L_k - L_q``; rows that see no key give 0).
    ``softmax_scale`` defaults to ``1/sqrt(D)``; ``deterministic``: bit-identical gradients run to run.

    What FlashAttention offers and this does not raises NotImplementedError naming it: ``dropout_p > 0``,
    a sliding ``window_size`` other than ``(-1, -1)``, ``softcap``, ``alibi_slopes``, ``return_attn_probs``
    and a paged KV cache (``block_table``).

    Returns ``out [total_q, Hq, D]`` in q's dtype, as FlashAttention does without ``return_attn_probs``;
    with ``return_lse=True`` (ours) ``(out, lse)``, lse float32 in FlashAttention's ``softmax_lse`` layout
    ``[Hq, total_q]`` (natural log, -inf for rows that see no key), differentiable like ``out``. ``backend``
    and ``center_kv`` (ours): as for ``jagged_attention``.
    """
    unsupported = [
        (dropout_p != 0, f"dropout_p={dropout_p!r} (attention dropout)"),
        (tuple(window_size) != (-1, -1), f"window_size={tuple(window_size)!r} (sliding-window attention)"),
        (softcap != 0, f"softcap={softcap!r} (score soft-capping)"),
        (alibi_slopes is not None, "alibi_slopes (ALiBi biases)"),
        (return_attn_probs, "return_attn_probs=True (use return_lse=True for the LSE)"),
        (block_table is not None, "block_table (a paged KV cache)"),
    ]
    refused = [what for asked, what in unsupported if asked]
    if refused:
        raise NotImplementedError(f"jagged_attn.flash_attn_varlen_func does not support {', '.join(refused)}")
    result = jagged_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, softmax_scale=softmax_scale,
                              backend=backend, return_lse=return_lse, deterministic=deterministic, center_kv=center_kv)
    if not return_lse:
        return result
    out, lse = result
    return out, lse.transpose(0, 1).contiguous()
