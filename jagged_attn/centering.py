"""K and V shifted by their per-sequence means before they are quantized, and the shift undone after.

Attention does not change when every key of a sequence moves by one vector c (each row's scores move
by q_i . c, and the softmax ignores a row constant), and O moves by c when every value does (P's rows
sum to 1). MXFP8 rounding does not share that indifference: an element's error scales with its block's
largest magnitude, so a K or V with a large common component (models without QK-norm grow one) loses
the small per-token differences that attention depends on. Worst hit is the backward: dQ = dS K relies
on each row of dS summing to zero, which quantized dS and a Delta from unquantized O only approximate,
and the remainder multiplies the mean key; dP - Delta cancels the mean value's part of dO V^T after
both were rounded. Quantizing K - mean(K) and V - mean(V) removes both (docs/DESIGN.md, section 3).
``jagged_attention(..., center_kv=True)`` runs it: three passes of their own around the attention (the
centers, the shift, and O and the LSE after), which could fold into the quantizing producers and the
forward's epilogue.

The centers are constants to autograd, which is exact: the attention's output does not depend on c,
and O's dependence on the values' c is the identity that adding c back restores; the LSE's
``scale * q . c`` term gives q its gradient. Rows that see no key keep O = 0. On CUDA the passes are
the kernels of ``jagged_attn/kernels/producers/center.py``; elsewhere (and while torch.compile traces) the torch
forms here, which are also their reference.
"""

from __future__ import annotations

import math

import torch

from .kernels.producers import center as kernels
from .offsets import bounded_offsets, lengths_of, sequence_ids


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or float64 if it is float64: the precision the shift is formed in."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _on_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype != torch.float64 and not torch.compiler.is_compiling()


def sequence_centers(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``[B, H, D]`` float32 (float64 for float64 ``x``): the shift of each (sequence, head, channel) of
    ``x [total, H, D]``: its mean (0 for an empty sequence), or 0 where the channel's largest magnitude
    exceeds half its dtype's range (x - mean could then overflow; any shift is exact, none included)."""
    bounded = bounded_offsets(offsets, x.shape[0])
    if _on_kernels(x):  # per-slot partials, then a reduction over each sequence's slots
        sums, amax = kernels.slot_partials(x, offsets)  # the slot table kept for this offsets tensor
        segments = kernels.first_slots(bounded)
    else:  # a reduction over each sequence's rows
        sums = _wide(x)
        amax, segments = sums.abs(), bounded
    sums = torch.segment_reduce(sums, "sum", offsets=segments, axis=0, initial=0)
    amax = torch.segment_reduce(amax, "max", offsets=segments, axis=0, initial=0)
    means = sums / lengths_of(bounded).clamp_min(1).to(sums.dtype)[:, None, None]
    return torch.where(amax <= torch.finfo(x.dtype).max / 2, means, 0.0)


def shifted_torch(x, centers, offsets):
    """``x [total, H, D] - centers [B, H, D]`` of each row's sequence, in x's dtype (``kernels.shifted``)."""
    return (_wide(x) - centers[sequence_ids(offsets, x.shape[0])]).to(x.dtype)


def uncentered_torch(out, lse, q, k_centers, v_centers, offsets_q, softmax_scale):
    """What ``kernels.unshifted_outputs`` computes (:func:`uncentered_outputs`)."""
    rows = sequence_ids(offsets_q, q.shape[0])
    group = q.shape[1] // k_centers.shape[1]
    v_rows = v_centers[rows].repeat_interleave(group, dim=1)
    k_rows = k_centers[rows].repeat_interleave(group, dim=1)
    seen = (lse != -math.inf).unsqueeze(-1)
    new_out = torch.where(seen, _wide(out) + v_rows, 0.0).to(out.dtype)
    return new_out, lse + (softmax_scale * (_wide(q) * k_rows).sum(-1)).to(lse.dtype)


class _Shifted(torch.autograd.Function):
    """``x - centers[sequence]`` in x's dtype; the centers are constants (gradient: the identity)."""

    @staticmethod
    def forward(ctx, x, centers, offsets):
        return (kernels.shifted if _on_kernels(x) else shifted_torch)(x, centers, offsets)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _Uncentered(torch.autograd.Function):
    """(out + v_centers, lse + scale * q . k_centers) per query row; see :func:`uncentered_outputs`."""

    @staticmethod
    def forward(ctx, out, lse, q, k_centers, v_centers, offsets_q, softmax_scale):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(lse, k_centers, offsets_q)
        ctx.softmax_scale, ctx.group = softmax_scale, q.shape[1] // k_centers.shape[1]
        form = kernels.unshifted_outputs if _on_kernels(q) else uncentered_torch
        return form(out, lse, q, k_centers, v_centers, offsets_q, softmax_scale)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        lse, k_centers, offsets_q = ctx.saved_tensors
        if grad_out is not None:  # rows that see no key: out was 0 whatever the attention gave
            grad_out = torch.where((lse != -math.inf).unsqueeze(-1), grad_out, 0.0)
        grad_q = None
        if grad_lse is not None:
            k_rows = k_centers[sequence_ids(offsets_q, lse.shape[0])].repeat_interleave(ctx.group, dim=1)
            grad_q = ctx.softmax_scale * grad_lse.unsqueeze(-1) * k_rows
        return grad_out, grad_lse, grad_q, None, None, None, None


def centered_keys_values(k: torch.Tensor, v: torch.Tensor, offsets_k: torch.Tensor):
    """(k - shift, v - shift in their dtypes, k's shifts, v's shifts ``[B, Hkv, D]``) per sequence
    (:func:`sequence_centers`, constants to autograd)."""
    with torch.no_grad():
        k_mean, v_mean = sequence_centers(k, offsets_k), sequence_centers(v, offsets_k)
    return _Shifted.apply(k, k_mean, offsets_k), _Shifted.apply(v, v_mean, offsets_k), k_mean, v_mean


def uncentered_outputs(out, lse, q, k_mean, v_mean, offsets_q, softmax_scale: float):
    """``out`` + the mean value, ``lse`` + scale * q . mean key, per query row of attention on centered K, V.

    out ``[total_q, Hq, D]`` (returned in its dtype), lse ``[total_q, Hq]`` (-inf where a row sees no
    key: its out stays 0), q ``[total_q, Hq, D]``, means ``[B, Hkv, D]`` (:func:`centered_keys_values`)."""
    return _Uncentered.apply(out, lse, q, k_mean, v_mean, offsets_q, softmax_scale)
