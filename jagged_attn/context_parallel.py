"""``context_parallel_attention``: attention over sequences whose tokens are sharded across the ranks of a
``torch.distributed`` group, from partial attentions merged through their LSE.

Sharding (:func:`jagged_attn.offsets.context_parallel_spans`): rank ``r`` of ``W`` holds positions
``[r * L // W, (r + 1) * L // W)`` of every sequence of length ``L``, queries by their lengths and keys by
theirs, sequences in batch order. Each rank gathers every rank's K and V shard (one all-gather each; its
backward sends the K/V gradients back to their owners) and attends its queries against each key shard.

Causal masking stays bottom-right aligned per sequence: query ``i`` sees key ``j`` iff ``j <= i + d`` with
``d = L_k - L_q``. Against a key shard ``[ka, kb)`` the query shard ``[qa, qb)`` splits at
``q1 = clamp(kb - d, qa, qb)``: queries ``[qa, q1)`` see keys up to ``i + d`` only, and a causal call on keys
``[ka, q1 + d)`` masks them exactly (its bottom-right alignment puts its last query's last key at ``q1 - 1 + d``;
an empty key span where ``q1 + d <= ka``); queries ``[q1, qb)`` see the whole shard (a call without a mask).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .interface import jagged_attention
from .merge import merge_attention
from .offsets import check_offsets_type, context_parallel_spans, lengths_of, span_rows, validate_offsets


def context_parallel_shard(x: torch.Tensor, offsets: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The rows of ``x`` (``[total, ...]``, a batch with ``offsets``) that ``rank`` of ``world_size`` holds:
    positions ``[rank * L // world_size, (rank + 1) * L // world_size)`` of each sequence of length ``L``."""
    rows, _ = span_rows(offsets, *context_parallel_spans(offsets, rank, world_size))
    return x[rows.to(x.device)]


class _AllGatherRows(torch.autograd.Function):
    """Every rank's ``[n, ...]`` tensor as one ``[world_size * n, ...]``, rank by rank; the backward
    reduce-scatters the gradient, so each rank gets the sum of its rows' gradients over all ranks."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_x = grad.new_empty(grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:])
        dist.reduce_scatter_single(grad_x, grad.contiguous(), group=ctx.group)
        return grad_x, None


def _gather_shards(x: torch.Tensor, sizes: list[int], group) -> list[torch.Tensor]:
    """Every rank's ``x`` (``sizes[r]`` rows on rank ``r``), padded to one size for the all-gather."""
    rows = max(max(sizes), 1)
    padded = torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])
    parts = _AllGatherRows.apply(padded, group).split(rows)
    return [part[:size] for part, size in zip(parts, sizes)]


def _place(out, lse, rows, total):
    """A call's (out, lse) over ``rows`` of the query shard as (out, lse) over all ``total`` rows: 0 and -inf
    for the rows the call did not cover (a part without keys, to :func:`merge_attention`)."""
    full_out = out.new_zeros(total, *out.shape[1:]).index_copy(0, rows, out)
    return full_out, lse.new_full((total, *lse.shape[1:]), -math.inf).index_copy(0, rows, lse)


def _context_parallel(attention, q, k, v, offsets_q, offsets_k, causal, group):
    """(out, lse) of the local queries against all ranks' keys; ``attention(q, k, v, offsets_q, offsets_k,
    causal) -> (out, lse)`` computes each partial attention. Every rank makes the same calls, empty ones too,
    so that each rank's backward reaches the all-gathers' (collective) backward."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    q_start, q_end = context_parallel_spans(offsets_q, rank, world_size)
    local_rows, local_offsets_q = span_rows(offsets_q, q_start, q_end)
    k_spans = [context_parallel_spans(offsets_k, r, world_size) for r in range(world_size)]
    k_sizes = [int((end - start).sum()) for start, end in k_spans]
    for name, x, rows in (("q", q, local_rows.numel()), ("k", k, k_sizes[rank]), ("v", v, k_sizes[rank])):
        if x.shape[0] != rows:
            raise ValueError(f"{name} has {x.shape[0]} rows but rank {rank} of {world_size} holds {rows} of the "
                             f"batch's tokens (context_parallel_shard)")
    device = q.device
    k_shards, v_shards = _gather_shards(k, k_sizes, group), _gather_shards(v, k_sizes, group)
    shift = (lengths_of(offsets_k) - lengths_of(offsets_q)).to(torch.int64)  # d = L_k - L_q per sequence
    local_q_offsets = local_offsets_q.to(device)
    partials = []
    for (k_start, k_end), k_shard, v_shard in zip(k_spans, k_shards, v_shards):
        shard_offsets_k = span_rows(offsets_k, k_start, k_end)[1]
        if not causal:
            partials.append(attention(q, k_shard, v_shard, local_q_offsets, shard_offsets_k.to(device), False))
            continue
        split = torch.minimum(torch.maximum(k_end - shift, q_start), q_end)  # q1
        key_end = torch.minimum(torch.maximum(split + shift, k_start), k_end)
        zeros = torch.zeros_like(q_start)
        # queries [qa, q1) against keys [ka, q1 + d), causal; queries [q1, qb) against the whole shard
        q_rows, offsets_a = span_rows(local_offsets_q, zeros, split - q_start)
        k_rows, offsets_b = span_rows(shard_offsets_k, zeros, key_end - k_start)
        q_rows, k_rows = q_rows.to(device), k_rows.to(device)
        out, lse = attention(q[q_rows], k_shard[k_rows], v_shard[k_rows], offsets_a.to(device),
                             offsets_b.to(device), True)
        partials.append(_place(out, lse, q_rows, q.shape[0]))
        q_rows, offsets_a = span_rows(local_offsets_q, split - q_start, q_end - q_start)
        q_rows = q_rows.to(device)
        out, lse = attention(q[q_rows], k_shard, v_shard, offsets_a.to(device), shard_offsets_k.to(device), False)
        partials.append(_place(out, lse, q_rows, q.shape[0]))
    out, lse = partials[0]
    for part_out, part_lse in partials[1:]:
        out, lse = merge_attention(out, lse, part_out, part_lse)
    return out, lse


def context_parallel_attention(q, k, v, offsets_q, offsets_k=None, *, group=None, causal: bool = False,
                               softmax_scale: float | None = None, backend: str = "auto", return_lse: bool = False,
                               center_kv: bool = False):
    """Attention over a ragged batch whose tokens are sharded across the ranks of ``group`` (the default
    process group for None): the output and gradients of ``jagged_attention`` on the whole batch, each rank
    getting its own queries' rows.

    Args:
        q: ``[local_q, Hq, D]``, this rank's query shard (:func:`context_parallel_shard` of the batch's q):
            positions ``[r * L_q // W, (r + 1) * L_q // W)`` of each sequence, rank ``r`` of ``W``.
        k, v: ``[local_k, Hkv, D]``, this rank's key/value shard by the same rule on the key lengths.
        offsets_q, offsets_k: the whole batch's offsets ``[B + 1]`` (the same on every rank; CPU tensors
            save a wait per call); ``offsets_k=None`` for self-attention.
        causal: bottom-right aligned per sequence, as ``jagged_attention``'s.
        softmax_scale, backend: as ``jagged_attention``'s; return_lse: also return the float32 LSE ``[local_q, Hq]``.
        center_kv: as ``jagged_attention``'s, each key part centered on its own means.

    Returns ``out [local_q, Hq, D]`` in q's dtype (and the LSE). Every rank must call it (all-gathers of K and V)
    and run the backward. Differentiable through autograd: K and V gradients reach the ranks that hold them.
    With MXFP8 backends a shard's V blocks (32 tokens) and each part's rounding differ from the whole call's
    (see the README): the result matches it to MXFP8 rounding, not bit for bit.
    """
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    offsets_k = offsets_q if offsets_k is None else offsets_k
    for name, offsets in (("offsets_q", offsets_q), ("offsets_k", offsets_k)):
        check_offsets_type(offsets, name)
        validate_offsets(offsets, int(offsets[-1]), name)  # starts at 0, never decreases

    def attention(q_part, k_part, v_part, offsets_a, offsets_b, part_causal):
        return jagged_attention(q_part, k_part, v_part, offsets_a, offsets_b, causal=part_causal,
                                softmax_scale=softmax_scale, backend=backend, return_lse=True, center_kv=center_kv)

    out, lse = _context_parallel(attention, q, k, v, offsets_q.cpu(), offsets_k.cpu(), causal, group)
    return (out, lse) if return_lse else out
