"""fp64 attention on padded dense tensors (torch SDPA with masks): an oracle independent of the
jagged code paths. Rows that see no key are defined as 0 with LSE = -inf (docs/DESIGN.md section 5)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F



def _token_index(offsets):
    """(sequence id, position) of every row, by plain Python loops."""
    seq, pos = [], []
    offsets = offsets.tolist()
    for b in range(len(offsets) - 1):
        n = offsets[b + 1] - offsets[b]
        seq += [b] * n
        pos += list(range(n))
    return torch.tensor(seq, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64)


def _pad(values, offsets, max_len):
    seq, pos = _token_index(offsets)
    dense = values.new_zeros(offsets.numel() - 1, max_len, *values.shape[1:])
    return dense.index_put((seq, pos), values)


def padded_attention(q, k, v, offsets_q, offsets_k, causal, softmax_scale=None):
    """(out [total_q, Hq, D], lse [total_q, Hq]) in the inputs' dtype from padded attention; differentiable."""
    len_q, len_k = offsets_q.diff(), offsets_k.diff()
    max_q, max_k = max(int(len_q.max()), 1), max(int(len_k.max()), 1)
    group = q.shape[1] // k.shape[1]
    dq = _pad(q, offsets_q, max_q).transpose(1, 2)  # [B, H, Lq, D]
    dk = _pad(k, offsets_k, max_k).repeat_interleave(group, 2).transpose(1, 2)
    dv = _pad(v, offsets_k, max_k).repeat_interleave(group, 2).transpose(1, 2)
    i = torch.arange(max_q, device=q.device).view(1, -1, 1)
    j = torch.arange(max_k, device=q.device).view(1, 1, -1)
    lq, lk = len_q.view(-1, 1, 1), len_k.view(-1, 1, 1)
    mask = (i < lq) & (j < lk)
    if causal:
        mask &= j <= i + lk - lq
    mask = mask.unsqueeze(1)  # [B, 1, Lq, Lk]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    scores = (dq @ dk.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, -1)  # -inf where no key is visible
    finite_lse = lse.unsqueeze(-1).clamp_min(torch.finfo(lse.dtype).min)
    probs = torch.where(mask, torch.exp(scores - finite_lse), torch.zeros_like(scores))
    out = probs @ dv  # [B, H, Lq, D]
    seq, pos = _token_index(offsets_q)
    return out.transpose(1, 2)[seq, pos], lse.transpose(1, 2)[seq, pos]


def sdpa_matches(q, k, v, causal):
    """One sequence through F.scaled_dot_product_attention (a third opinion for the oracle itself)."""
    mask = None
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        mask = torch.arange(lk).view(1, -1) <= torch.arange(lq).view(-1, 1) + lk - lq
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=mask).transpose(0, 1)
