"""``merge_attention``: attention over two disjoint key sets from each set's (out, lse)."""

from __future__ import annotations

import math

import torch


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """(out, lse) of attention over the union of two disjoint key sets, for the same queries, from the two
    partial attentions: ``lse = log(exp(lse_a) + exp(lse_b))``, ``out = exp(lse_a - lse) out_a +
    exp(lse_b - lse) out_b`` (exact; what ring and context-parallel attention add up shard by shard).

    out_a, out_b: ``[..., D]`` (e.g. ``[total_q, H, D]``); lse_a, lse_b: ``[...]`` natural log, as
    ``jagged_attention(..., return_lse=True)`` returns them, -inf where a part has no key for a row (its
    out is 0 there). Returns out in the outs' promoted dtype and lse in the LSEs' (computed in at least
    float32); a row empty in both parts gets out 0 and lse -inf. Differentiable in all four inputs, with
    zero (not NaN) gradients for a part whose LSE is -inf.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or tuple(lse_a.shape) != tuple(out_a.shape[:-1]):
        raise ValueError(f"expected out_a, out_b [..., D] and lse_a, lse_b [...] of one shape, got out "
                         f"{tuple(out_a.shape)}, {tuple(out_b.shape)} and lse {tuple(lse_a.shape)}, "
                         f"{tuple(lse_b.shape)}")
    lse_dtype = torch.promote_types(lse_a.dtype, lse_b.dtype)
    out_dtype = torch.promote_types(out_a.dtype, out_b.dtype)
    compute = torch.promote_types(torch.promote_types(lse_dtype, out_dtype), torch.float32)
    lse_a, lse_b = lse_a.to(compute), lse_b.to(compute)
    # Any finite shift gives the same result; a constant one keeps -inf LSEs out of the gradient's path.
    shift = torch.maximum(lse_a, lse_b).detach()
    shift = torch.where(torch.isfinite(shift), shift, 0.0)
    weight_a, weight_b = torch.exp(lse_a - shift), torch.exp(lse_b - shift)
    total = weight_a + weight_b
    empty = total == 0  # NaN stays NaN
    total = torch.where(empty, 1.0, total)
    lse = torch.where(empty, -math.inf, shift + torch.log(total))
    out = (weight_a / total).unsqueeze(-1) * out_a.to(compute) + (weight_b / total).unsqueeze(-1) * out_b.to(compute)
    return out.to(out_dtype), lse.to(lse_dtype)
