"""The kernels behind ``jagged_attn.centering`` (Triton): K and V shifted by per-sequence vectors, and
the shift undone on O and the LSE.

Every kernel runs one program per (128-token slot, head) of ``schedule.slot_tiles`` (kept per offsets
tensor, so the layers of a step share it; a sequence's tokens start a fresh slot, so no tile holds two
sequences, and a slot knows its sequence):

* :func:`slot_partials`: each slot's channel sums and largest magnitudes, fp32 ``[slots, H, D]``
  (a per-sequence reduction over slots then needs 128x fewer steps than one over tokens, and stays
  deterministic where atomics would not);
* :func:`shifted`: ``values - centers[sequence]`` in the values' dtype;
* :func:`unshifted_outputs`: ``out + v_centers[sequence]`` (0 where the row sees no key) and
  ``lse + scale * q . k_centers[sequence]``, GQA heads mapped to their KV head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jagged_attn.offsets import padded_tile

from ..common import fp8, layout
from ..common.interpreter import INTERPRETED
from ..common.schedule import SLOT_TOKENS, claimed_tile, slot_tiles

NUM_WARPS = 4
_SLOT_ROWS = tl.constexpr(SLOT_TOKENS)  # a global read inside a kernel must be a constexpr instance


@triton.constexpr_function
def _power_of_two_at_least(d):
    return triton.next_power_of_2(d)


@triton.jit
def _slot_tile(tiles, offsets, total, HEADS: tl.constexpr, D: tl.constexpr):
    """(slot, sequence (0 for an unused slot), head, element offsets [SLOT, D'] in ``[total, HEADS, D]``
    values, inside [SLOT, D'], token rows [SLOT], in_seq [SLOT], channels [D'] (D rounded up to a power of
    two), in_d [D'])."""
    seq, _, start, length, rows, head = claimed_tile(tiles, offsets, total, _SLOT_ROWS, HEADS)
    in_seq = (rows < length) & (seq >= 0)
    channels = tl.arange(0, _power_of_two_at_least(D))
    in_d = channels < D
    element = (start + rows)[:, None] * (HEADS * D) + head * D + channels[None, :]
    slot, _ = layout.slot_program(HEADS)
    return slot, tl.maximum(seq, 0), head, element, in_seq[:, None] & in_d[None, :], start + rows, in_seq, \
        channels, in_d


@triton.jit
def _partials_kernel(values, tiles, offsets, total, sums, amax, HEADS: tl.constexpr, D: tl.constexpr):
    slot, _, head, element, inside, _, _, channels, in_d = _slot_tile(tiles, offsets, total, HEADS, D)
    x = tl.load(values + element, mask=inside, other=0.0).to(tl.float32)
    partial = (slot.to(tl.int64) * HEADS + head) * D + channels
    tl.store(sums + partial, tl.sum(x, axis=0), mask=in_d)
    tl.store(amax + partial, tl.max(tl.abs(x), axis=0), mask=in_d)


@triton.jit
def _shift_kernel(values, out, centers, tiles, offsets, total, HEADS: tl.constexpr, D: tl.constexpr,
                  INTERPRET: tl.constexpr):
    _, seq, head, element, inside, _, _, channels, in_d = _slot_tile(tiles, offsets, total, HEADS, D)
    center = tl.load(centers + (seq * HEADS + head) * D + channels, mask=in_d)
    x = tl.load(values + element, mask=inside, other=0.0).to(tl.float32)
    dtype: tl.constexpr = out.dtype.element_ty
    tl.store(out + element, fp8.rounded_to(x - center[None, :], dtype, INTERPRET).to(dtype), mask=inside)


@triton.jit
def _unshift_kernel(out, lse, q, new_out, new_lse, k_centers, v_centers, tiles, offsets, total, softmax_scale,
                    HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, INTERPRET: tl.constexpr):
    _, seq, head, element, inside, rows, in_seq, channels, in_d = _slot_tile(tiles, offsets, total, HEADS, D)
    center = (seq * (HEADS // GROUP) + head // GROUP) * D + channels
    row_lse = tl.load(lse + rows * HEADS + head, mask=in_seq, other=0.0)
    seen = row_lse != float("-inf")
    o = tl.load(out + element, mask=inside, other=0.0).to(tl.float32)
    o = tl.where(seen[:, None], o + tl.load(v_centers + center, mask=in_d, other=0.0)[None, :], 0.0)
    dtype: tl.constexpr = new_out.dtype.element_ty
    tl.store(new_out + element, fp8.rounded_to(o, dtype, INTERPRET).to(dtype), mask=inside)
    x = tl.load(q + element, mask=inside, other=0.0).to(tl.float32)
    shift = softmax_scale * tl.sum(x * tl.load(k_centers + center, mask=in_d, other=0.0)[None, :], axis=1)
    tl.store(new_lse + rows * HEADS + head, row_lse + shift, mask=in_seq)


def first_slots(offsets: torch.Tensor) -> torch.Tensor:
    """int64 ``[B + 1]``: each sequence's first slot of ``slot_tiles`` (and the slot count last)."""
    batch = torch.arange(offsets.numel(), device=offsets.device)
    return padded_tile(offsets.to(torch.int64), batch, SLOT_TOKENS)


def slot_partials(values: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums, largest magnitudes): fp32 ``[slots, H, D]`` of each 128-token slot of ``values [total, H, D]``
    (bf16/fp16/fp32, any strides; zeros for a sequence's spare slot), offsets valid for its rows; sequence b
    owns slots ``first_slots(offsets)[b:b + 2]``."""
    values = values.contiguous()  # the kernels index rows of [total, H, D] as laid out densely
    total, heads, dim = values.shape
    tiles = slot_tiles(offsets, total)
    sums = torch.empty(tiles.shape[0], heads, dim, dtype=torch.float32, device=values.device)
    amax = torch.empty_like(sums)
    if sums.numel():
        _partials_kernel[(tiles.shape[0] * heads,)](values, tiles, offsets, total, sums, amax, HEADS=heads, D=dim,
                                                    num_warps=NUM_WARPS)
    return sums, amax


def shifted(values: torch.Tensor, centers: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``values [total, H, D] - centers [B, H, D]`` (fp32) of each row's sequence, in the values' dtype
    (contiguous, whatever the values' strides)."""
    values, centers = values.contiguous(), centers.contiguous()
    total, heads, dim = values.shape
    out = torch.empty_like(values)
    tiles = slot_tiles(offsets, total)
    if tiles.shape[0] and heads:
        _shift_kernel[(tiles.shape[0] * heads,)](values, out, centers, tiles, offsets, total, HEADS=heads, D=dim,
                                                 INTERPRET=INTERPRETED, num_warps=NUM_WARPS)
    return out


def unshifted_outputs(out, lse, q, k_centers, v_centers, offsets_q, softmax_scale: float):
    """(out + v_centers, lse + scale * q . k_centers) per query row, as ``centering.uncentered_outputs``:
    out, q ``[total_q, Hq, D]``, lse fp32 ``[total_q, Hq]``, centers fp32 ``[B, Hkv, D]`` (any strides)."""
    out, lse, q, k_centers, v_centers = (x.contiguous() for x in (out, lse, q, k_centers, v_centers))
    total, heads, dim = q.shape
    new_out, new_lse = torch.empty_like(out), torch.empty_like(lse)
    tiles = slot_tiles(offsets_q, total)
    if tiles.shape[0] and heads:
        _unshift_kernel[(tiles.shape[0] * heads,)](
            out, lse, q, new_out, new_lse, k_centers, v_centers, tiles, offsets_q, total, softmax_scale,
            HEADS=heads, GROUP=heads // k_centers.shape[1], D=dim, INTERPRET=INTERPRETED, num_warps=NUM_WARPS)
    return new_out, new_lse
