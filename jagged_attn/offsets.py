"""Jagged offsets: validation and every piece of index math derived from them.

Convention (fbgemm's offsets, FlashAttention's ``cu_seqlens``): ``offsets`` is 1-D int32/int64 of
length ``B + 1``, starts at 0, never decreases, and ends at the number of rows; sequence ``b`` is
``values[offsets[b]:offsets[b + 1]]``. Zero-length sequences are legal.

Scale buffers place sequence ``b`` at padded row ``(offsets[b] // 128 + b) * 128``: 128-aligned,
never overlapping, and computable from ``offsets`` alone (no prefix sum over padded lengths).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import triton.language as tl  # noqa: F401  (the Triton interpreter needs it beside jit-wrapped functions)
from torch.utils.weak import WeakIdKeyDictionary

from .scale_layout import TILE_ROWS

INDEX_DTYPES = (torch.int32, torch.int64)


def padded_seq_start(offset_b, b):
    """First padded row of sequence ``b`` whose data starts at ``offset_b`` (ints, tensors, Triton)."""
    return (offset_b // 128 + b) * 128


def padded_tile(offset_b, b, block):
    """The same placement in ``block``-row tiles: index of sequence ``b``'s first tile when every
    sequence starts a fresh tile and has one more than its data needs (ints, tensors, Triton).
    Sequence ``b`` owns tiles ``[padded_tile(offsets[b], b, block), padded_tile(offsets[b + 1], b + 1,
    block))``, its data in the first ``ceil(L_b / block)``; a batch of ``total`` rows has
    ``padded_tile(total, batch, block)`` tiles, known without reading the offsets."""
    return offset_b // block + b


def padded_total(total: int, batch: int) -> int:
    """Rows of a padded buffer that holds ``batch`` sequences of ``total`` tokens in all."""
    return (total // TILE_ROWS + batch) * TILE_ROWS


def values_unavailable(t: torch.Tensor) -> bool:
    """True where a tensor's values cannot be read: meta / fake tensors, or while torch.compile traces
    (value checks would break the graph; the eager call of the same code checks them)."""
    return t.device.type == "meta" or type(t).__name__ == "FakeTensor" or torch.compiler.is_compiling()


_checks = threading.local()  # .off: value_checks(False) holds in this thread


@contextlib.contextmanager
def value_checks(enabled: bool):
    """Within the block, in the calling thread, the input checks that read tensor values (offsets'
    contents, NaN/Inf in inputs and in the producers' results) run (``True``, the default outside any
    block) or are skipped (``False``). A call whose offsets tensors are new waits for the device once
    before its kernels, which leaves a GPU idle while the host launches what follows (docs/perf-history.md);
    with offsets already checked it waits after queuing its kernels, for its NaN/Inf check alone. A
    training loop over trusted data can skip them. Checks of dtypes, shapes and devices always run. Unchecked
    bad offsets give wrong rows, never an access outside the tensors (``bounded_offsets``, and
    ``jagged_attn/kernels/common/layout.sequence_span`` in the kernels)."""
    previous = getattr(_checks, "off", False)
    _checks.off = not enabled
    try:
        yield
    finally:
        _checks.off = previous


def skip_value_check(t: torch.Tensor) -> bool:
    """True where a check must not read ``t``'s values: they are unavailable, or ``value_checks(False)``."""
    return getattr(_checks, "off", False) or values_unavailable(t)


# Offsets tensors found valid, with (their version counter, the rows they were checked against, their
# longest sequence): the layers of a model share one offsets tensor per batch, so only the first
# validation reads the device.
_valid_offsets = WeakIdKeyDictionary()


def known_valid(offsets: torch.Tensor, rows: int) -> bool:
    """True if ``offsets`` passed :func:`validate_offsets` for ``rows`` and torch has not written it
    since (its version counter: a write around torch, by a kernel of one's own through its pointer, is
    not seen). Never for inference-mode tensors: they keep no version counter, so they are checked
    every time."""
    return known_longest(offsets, rows) is not None


def known_longest(offsets: torch.Tensor, rows: int) -> int | None:
    """The longest sequence of ``offsets`` where it is :func:`known_valid` for ``rows`` (its check read
    it with the rest, no wait of its own), else None."""
    entry = None if offsets.is_inference() else _valid_offsets.get(offsets)
    return entry[2] if entry is not None and entry[:2] == (offsets._version, rows) else None


def check_offsets_type(offsets, name: str = "offsets") -> None:
    """The part of :func:`validate_offsets` that needs no values: a 1-D int32/int64 tensor, not empty."""
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(offsets).__name__}")
    if offsets.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{name} must be 1-D with at least one element, got shape {tuple(offsets.shape)}")


OFFSETS_FACTS = 4  # the length of :func:`offsets_facts`


def offsets_facts(offsets: torch.Tensor) -> torch.Tensor:
    """int64 ``[OFFSETS_FACTS]`` on the offsets' device, formed without waiting for it: the first offset,
    the last, 1 if some offset is below its predecessor (else 0) and the longest sequence. Reading it
    (``.tolist()``) is the one wait."""
    o = offsets.to(torch.int64)
    if o.numel() > 1:
        lengths = lengths_of(o)
        decreases, longest = (lengths < 0).any().to(torch.int64), lengths.max()
    else:
        decreases = longest = torch.zeros((), dtype=torch.int64, device=o.device)
    return torch.stack([o[0], o[-1], decreases, longest])


def validate_offsets(offsets, rows: int, name: str = "offsets") -> torch.Tensor:
    """Check ``offsets`` against the jagged convention for a values tensor with ``rows`` rows (one
    wait for the device, none if it is :func:`known_valid`)."""
    check_offsets_type(offsets, name)
    if not (skip_value_check(offsets) or known_valid(offsets, rows)):
        check_offsets_facts(offsets, rows, name, offsets_facts(offsets).tolist())
    return offsets


def check_offsets_facts(offsets: torch.Tensor, rows: int, name: str, facts) -> None:
    """The value part of :func:`validate_offsets`, on ``facts``: its :func:`offsets_facts` read by the
    caller (so that one wait serves several tensors); remembers ``offsets`` as valid."""
    first, last, decreases, longest = facts
    if first != 0:
        raise ValueError(f"{name}[0] must be 0, got {first}")
    if decreases:
        raise ValueError(f"{name} must be non-decreasing")
    if last != rows:
        raise ValueError(f"{name}[-1] must equal the number of rows ({rows}), got {last}")
    if not offsets.is_inference():
        _valid_offsets[offsets] = (offsets._version, rows, longest)


def single_sequence_offsets(rows: int, device) -> torch.Tensor:
    """Offsets ``[0, rows]``: the whole tensor as one sequence."""
    return torch.tensor([0, rows], dtype=torch.int64, device=device)


def lengths_of(offsets: torch.Tensor) -> torch.Tensor:
    """Per-sequence lengths ``offsets[1:] - offsets[:-1]``."""
    return offsets[1:] - offsets[:-1]


def max_length(offsets: torch.Tensor, rows: int) -> int:
    """The longest sequence's length (0 for an empty batch) of ``offsets`` over ``rows`` rows, as
    :func:`bounded_offsets` has them: at most ``rows`` whatever the offsets hold (a kernel grid sized
    by it stays the tensor's size)."""
    return int(lengths_of(bounded_offsets(offsets, rows)).max()) if offsets.numel() > 1 else 0


def checked_lengths(lengths, device=None) -> torch.Tensor:
    """``lengths`` (a sequence or tensor of per-sequence lengths) as a 1-D integer tensor; ValueError for
    other shapes, fractional or boolean values (never truncated) and negative lengths."""
    lengths = torch.as_tensor(lengths, device=device)
    if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype.is_complex \
            or lengths.dtype == torch.bool or bool((lengths < 0).any()):
        raise ValueError("lengths must be a 1-D tensor of non-negative integers")
    return lengths


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """int64 offsets ``[0, cumsum(lengths)]``."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), 0, out=out[1:])
    return out


def offsets_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """int64 offsets of the sequences of a packed row of tokens, from bool ``starts [total]`` (True where a
    sequence begins; the first token always begins one)."""
    total = starts.numel()
    first = torch.arange(total, device=starts.device) == 0
    return torch.cat([(starts | first).nonzero().flatten(), torch.full((1,), total, device=starts.device)])


def bounded_offsets(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 ``offsets`` forced into the convention for ``rows`` rows (clamped to [0, rows], made
    non-decreasing, the last set to ``rows``), formed without waiting for the device: the offsets
    themselves when valid. The index math below runs on it, so that offsets changed after their
    validation where torch cannot see it (a numpy array under ``torch.from_numpy``, ``.data``) give
    wrong rows at worst, never an index outside the tensors (``repeat_interleave`` trusts its
    ``output_size``: lengths summing to more corrupted the heap)."""
    index = torch.arange(offsets.numel(), device=offsets.device)
    bounded = torch.where(index == 0, 0, offsets.to(torch.int64).clamp(0, rows)).cummax(0).values
    return torch.where(index == offsets.numel() - 1, rows, bounded)


def sequence_ids(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """int64 ``[total]``: which sequence each row belongs to."""
    lengths = lengths_of(bounded_offsets(offsets, total))
    batch = torch.arange(lengths.numel(), device=offsets.device)
    return torch.repeat_interleave(batch, lengths, output_size=total)


def positions_in_sequence(offsets: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """int64 ``[total]``: each row's index inside its own sequence."""
    rows = torch.arange(seq_ids.numel(), device=offsets.device)
    return rows - bounded_offsets(offsets, seq_ids.numel())[seq_ids]


def padded_rows_of_tokens(offsets: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """int64 ``[total]``: each row's row in a padded (scale) buffer."""
    starts = bounded_offsets(offsets, seq_ids.numel())[:-1]
    shifts = padded_seq_start(starts, torch.arange(starts.numel(), device=offsets.device)) - starts
    return shifts[seq_ids] + torch.arange(seq_ids.numel(), device=offsets.device)


def context_parallel_spans(offsets: torch.Tensor, rank: int, world_size: int):
    """int64 ``([B], [B])``: the positions ``[start, end)`` inside each sequence that ``rank`` of
    ``world_size`` holds under context parallelism: ``start = rank * L // world_size``, ``end =
    (rank + 1) * L // world_size`` for a sequence of length ``L`` (contiguous shards, the longer ones last)."""
    lengths = lengths_of(offsets).to(torch.int64)
    return rank * lengths // world_size, (rank + 1) * lengths // world_size


def span_rows(offsets: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor):
    """The rows of positions ``[starts[b], ends[b])`` of each sequence ``b`` of a batch with ``offsets``
    (int64 ``[n]``, sequence by sequence) and the int64 offsets ``[B + 1]`` of those spans as a batch."""
    span_lengths = (ends - starts).clamp_min(0)
    span_offsets = offsets_from_lengths(span_lengths)
    total = int(span_offsets[-1])
    seq_ids = sequence_ids(span_offsets, total)
    rows = offsets.to(torch.int64)[:-1][seq_ids] + starts[seq_ids] + positions_in_sequence(span_offsets, seq_ids)
    return rows, span_offsets
