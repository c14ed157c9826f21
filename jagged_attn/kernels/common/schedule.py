"""Work lists for ragged attention kernels, built on the device without waiting for it.

A kernel that tiles one side of attention (query rows in the forward, key rows in a KV-tile
backward) into ``block`` rows runs one program per (slot, head) of an int32 ``[slots, 2]`` table
of (sequence, tile index) rows; a slot holding ``EMPTY_SLOT`` in both columns has no work.

:func:`tile_list` lays the slots out as ``offsets.padded_tile`` places tiles (sequence ``b``'s tiles
in order from ``padded_tile(offsets[b], b, block)``, then its spare slot, empty), so the slot count
is known on the host without reading the offsets; a slot finds its sequence by binary search.
:func:`work_list` orders the same slots sequence by sequence, the most work first, and within a
sequence by the number of columns each tile visits, most first: the GPU hands programs out in
launch order (and a persistent kernel, ``sm90.forward``, takes items from a counter in that order),
so the long work starts first and the short fills the gaps
(longest-processing-time-first), while the programs running at once share a sequence's data in L2;
empty slots sit at the end. Either costs one kernel launch
(plus a sort for the work list): a training step builds six tables, and launching a few dozen small
torch ops per table left the GPU idle while the host worked (docs/perf-history.md). Both are kept
while their offsets tensors live unwritten (``reuse.py``): the layers of a model share one offsets
tensor per batch, so a step builds each table once. Extra memory: 8 bytes per slot. Callers must not
write into a returned table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jagged_attn.offsets import padded_tile
from jagged_attn.scale_layout import TILE_ROWS

from . import bounds, layout, reuse

EMPTY_SLOT = -1
_EMPTY = tl.constexpr(EMPTY_SLOT)
_LAST_KEY = tl.constexpr(2**63 - 1)  # an empty slot's order key: after every sequence's
SLOT_TOKENS = TILE_ROWS  # tokens of one padded slot: ``offsets.padded_seq_start`` aligns every sequence to it
SLOTS_PER_PROGRAM = 1024


def tile_slots(total_rows: int, batch: int, block: int) -> int:
    """Slots of a table of ``block``-row tiles for ``batch`` sequences of ``total_rows`` rows."""
    return padded_tile(total_rows, batch, block)


@triton.jit
def claimed_tile(tiles, offsets, total, BLOCK: tl.constexpr, LANES: tl.constexpr):
    """(sequence, tile, sequence start, sequence length, the tile's ``BLOCK`` rows inside the sequence, lane)
    of this program's slot of a :func:`tile_list` table ``tiles`` of ``offsets`` over ``total`` rows (grid:
    slots x LANES, lanes fastest: ``layout.slot_program``); sequence ``EMPTY_SLOT`` marks an unused slot
    (the rest is then meaningless). The span is ``layout.sequence_span``'s: inside the rows whatever the
    offsets hold, so a program that masks its rows by the length stays inside the tensor."""
    slot, lane = layout.slot_program(LANES)
    seq = tl.load(tiles + 2 * slot)
    tile = tl.load(tiles + 2 * slot + 1)
    start, length = layout.sequence_span(offsets, tl.maximum(seq, 0), total)
    return seq, tile, start, length, tile * BLOCK + tl.arange(0, BLOCK), lane


@triton.jit
def _visible_columns(tile_start, tile_rows, len_rows, len_cols, CAUSAL: tl.constexpr, ROWS_ARE_QUERIES: tl.constexpr):
    """Columns that the most-seeing row of a tile visits (``bounds``' causal rule). For query tiles the
    last row sees the most keys; for key tiles (``ROWS_ARE_QUERIES`` False) the first key is seen by the
    most queries."""
    if not CAUSAL:
        seen = len_cols + tl.zeros_like(tile_start)
    elif ROWS_ARE_QUERIES:
        seen = bounds.keys_seen_below(tile_start + tile_rows, len_cols, bounds.diagonal(len_rows, len_cols))
    else:
        seen = tl.maximum(len_cols - bounds.first_query_seeing(tile_start, bounds.diagonal(len_cols, len_rows)), 0)
    return seen


@triton.jit
def _visible_pairs(len_rows, len_cols, CAUSAL: tl.constexpr):
    """int64 (query, key) pairs a sequence attends: the same whichever side is tiled."""
    a = len_rows.to(tl.int64)
    b = len_cols.to(tl.int64)
    if not CAUSAL:
        return a * b
    # Bottom-right alignment: the shorter side's elements see a triangle, the longer side's surplus
    # (queries only: keys past the diagonal's start are seen by every query) the whole shorter side.
    short = tl.minimum(a, b)
    return short * (short + 1) // 2 + tl.where(a <= b, short * (b - short), 0)


@triton.jit
def _slot_table_kernel(offsets_rows, offsets_cols, table, costs, order_keys, slots, total_rows, total_cols, batch,
                       search_steps, block, CAUSAL: tl.constexpr, ROWS_ARE_QUERIES: tl.constexpr,
                       WITH_COSTS: tl.constexpr, SLOTS_PER_PROGRAM: tl.constexpr):
    """``table[slot]`` = (sequence, tile) of a batch's slots, ``EMPTY_SLOT`` in each sequence's spare
    one; with ``WITH_COSTS``, ``costs[slot]`` = the tile's visible columns (-1 for an empty slot) and
    ``order_keys[slot]`` = ``-pairs(sequence) * (batch + 1) + sequence`` (int64; the largest int64 for an
    empty slot): ascending, the sequences with the most work first, ties in sequence order."""
    slot = tl.program_id(0) * SLOTS_PER_PROGRAM + tl.arange(0, SLOTS_PER_PROGRAM)
    inside = slot < slots
    seq = layout.owning_sequence(slot, offsets_rows, batch, search_steps, block, True)
    start, len_rows = layout.sequence_span(offsets_rows, seq, total_rows)
    tile = (slot - layout.padded_tile(start, seq, block)).to(tl.int32)
    used = (tile >= 0) & (tile * block < len_rows)  # (tile < 0 only where the offsets are not valid)
    tl.store(table + 2 * slot, tl.where(used, seq, _EMPTY), mask=inside)
    tl.store(table + 2 * slot + 1, tl.where(used, tile, _EMPTY), mask=inside)
    if WITH_COSTS:
        len_cols = layout.sequence_span(offsets_cols, seq, total_cols)[1]
        tile_start = tile * block
        tile_rows = tl.minimum(len_rows - tile_start, block)
        cost = _visible_columns(tile_start, tile_rows, len_rows, len_cols, CAUSAL, ROWS_ARE_QUERIES)
        tl.store(costs + slot, tl.where(used, cost, -1), mask=inside)
        len_q, len_k = (len_rows, len_cols) if ROWS_ARE_QUERIES else (len_cols, len_rows)
        key = -_visible_pairs(len_q, len_k, CAUSAL) * (batch + 1) + seq
        tl.store(order_keys + slot, tl.where(used, key, _LAST_KEY), mask=inside)


def _slot_table(offsets_rows, offsets_cols, total_rows: int, total_cols: int, block: int, causal: bool,
                rows_are_queries: bool, with_costs: bool):
    """(int32 ``[slots, 2]`` table in padded-tile order, and int32 ``[slots]`` costs and int64 ``[slots]``
    order keys, or None and None)."""
    batch = offsets_rows.numel() - 1
    slots = tile_slots(total_rows, batch, block)
    device = offsets_rows.device
    table = torch.empty(slots, 2, dtype=torch.int32, device=device)
    costs = torch.empty(slots, dtype=torch.int32, device=device) if with_costs else None
    order_keys = torch.empty(slots, dtype=torch.int64, device=device) if with_costs else None
    if slots:
        _slot_table_kernel[(triton.cdiv(slots, SLOTS_PER_PROGRAM),)](
            offsets_rows, offsets_cols, table, costs, order_keys, slots, total_rows, total_cols, batch,
            batch.bit_length(), block,
            CAUSAL=causal, ROWS_ARE_QUERIES=rows_are_queries, WITH_COSTS=with_costs,
            SLOTS_PER_PROGRAM=SLOTS_PER_PROGRAM,
        )
    return table, costs, order_keys


def tile_list(offsets_rows: torch.Tensor, total_rows: int, block: int) -> torch.Tensor:
    """int32 ``[slots, 2]``: (sequence, tile) of every ``block``-row tile, in sequence order with
    each sequence's spare slot empty: for passes whose tiles all cost the same (no sort)."""
    return reuse.derived((offsets_rows,), ("tiles", total_rows, block), lambda: _slot_table(
        offsets_rows, None, total_rows, 0, block, False, True, with_costs=False)[0])


def slot_tiles(offsets_rows: torch.Tensor, total_rows: int) -> torch.Tensor:
    """:func:`tile_list` of ``SLOT_TOKENS``-row tiles: the work of the per-tile passes that each take
    one whole padded slot of a sequence (the backward's producers, the forward's rebasing)."""
    return tile_list(offsets_rows, total_rows, SLOT_TOKENS)


def work_list(
    offsets_rows: torch.Tensor,
    offsets_cols: torch.Tensor,
    total_rows: int,
    total_cols: int,
    block: int,
    *,
    causal: bool,
    rows_are_queries: bool = True,
) -> torch.Tensor:
    """int32 ``[slots, 2]``: (sequence, tile) of every row tile, the sequences with the most work
    first, each sequence's tiles the most expensive first.

    ``offsets_rows`` are the offsets of the tiled side (``total_rows`` rows in all: the values'
    first dimension, so no host read is needed), ``offsets_cols`` those of the other side
    (same batch, ``total_cols`` rows). A sequence's work is its visible (query, key) pairs, a tile's cost the number of
    columns its most-seeing row visits; ties keep sequence order, then tile order. Tiles that see no
    column still get a slot (their rows must be written); empty slots are ``(-1, -1)`` at the end.

    Sequence by sequence rather than all tiles by cost: the programs running at once then mostly
    share one sequence's other side in L2. By cost alone, a causal batch's costs (which fall along
    each sequence) interleave the tiles of every sequence.
    """
    def build():
        table, costs, order_keys = _slot_table(offsets_rows, offsets_cols, total_rows, total_cols, block, causal,
                                               rows_are_queries, with_costs=True)
        by_cost = torch.argsort(costs, descending=True, stable=True)
        return table[by_cost[torch.argsort(order_keys[by_cost], stable=True)]]

    key = ("work", total_rows, total_cols, block, causal, rows_are_queries)
    return reuse.derived((offsets_rows, offsets_cols), key, build)

