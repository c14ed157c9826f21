"""Longest-first work lists for ragged attention kernels.

A kernel that tiles one side of attention (query rows in the forward, key rows in a KV-tile
backward) into ``block`` rows runs one program per (tile, head). Every tile of every sequence
gets a slot in an int32 ``[slots, 2]`` table of (sequence, tile index) rows, ordered by the
number of columns the tile visits, most first: the GPU hands programs out in launch order, so
the long tiles start first and the short ones fill the gaps (longest-processing-time-first).

The slot count is the bound ``rows_total // block + batch``, known without reading the offsets
on the host, so building the table never synchronizes; unused slots hold sequence -1 and sit at
the end. Extra memory: 8 bytes per slot.
"""

from __future__ import annotations

import torch

from jagged_attn.offsets import lengths_of
from jagged_attn.scale_layout import TILE_ROWS

EMPTY_SLOT = -1
SLOT_TOKENS = TILE_ROWS  # tokens of one padded slot: ``offsets.padded_seq_start`` aligns every sequence to it


def tile_slots(total_rows: int, batch: int, block: int) -> int:
    """Upper bound on ``sum_b ceil(L_b / block)`` for ``batch`` sequences of ``total_rows`` rows."""
    return total_rows // block + batch


def visible_columns(tile_start, tile_rows, len_rows, len_cols, causal: bool, rows_are_queries: bool):
    """Columns that the most-seeing row of a tile visits (bottom-right causal alignment).

    Query ``i`` sees keys ``j <= i + len_k - len_q``. For query tiles the last row sees the most
    keys; for key tiles (``rows_are_queries=False``) the first key is seen by the most queries.
    """
    if not causal:
        return len_cols
    if rows_are_queries:
        last_row = tile_start + tile_rows - 1
        return (last_row + 1 + len_cols - len_rows).clamp(0).minimum(len_cols)
    first_key = tile_start
    return (len_cols - (first_key - (len_rows - len_cols)).clamp(0)).clamp(0)


def _row_tiles(offsets_rows: torch.Tensor, total_rows: int, block: int):
    """(sequence, tile, used) of every slot: slot ``s`` is tile ``tile`` of sequence ``sequence``
    (in sequence order) where ``used``; the slots past the last tile have ``used`` False."""
    batch = offsets_rows.numel() - 1
    tiles_per_seq = (lengths_of(offsets_rows).to(torch.int64) + block - 1) // block
    tile_end = torch.cumsum(tiles_per_seq, 0)
    slot = torch.arange(tile_slots(total_rows, batch, block), device=offsets_rows.device, dtype=torch.int64)
    seq = torch.searchsorted(tile_end, slot, right=True)
    used = seq < batch
    seq = seq.clamp(max=batch - 1)
    return seq, slot - (tile_end[seq] - tiles_per_seq[seq]), used


def _table(seq, tile, used) -> torch.Tensor:
    return torch.stack([torch.where(used, seq, EMPTY_SLOT), torch.where(used, tile, EMPTY_SLOT)], dim=1)


def tile_list(offsets_rows: torch.Tensor, total_rows: int, block: int) -> torch.Tensor:
    """int32 ``[slots, 2]``: (sequence, tile) of every ``block``-row tile in sequence order, unused
    slots ``(-1, -1)`` at the end: for passes whose tiles all cost the same (no sort)."""
    if offsets_rows.numel() == 1:
        return torch.full((tile_slots(total_rows, 0, block), 2), EMPTY_SLOT, dtype=torch.int32,
                          device=offsets_rows.device)
    return _table(*_row_tiles(offsets_rows, total_rows, block)).to(torch.int32)


def slot_tiles(offsets_rows: torch.Tensor, total_rows: int) -> torch.Tensor:
    """:func:`tile_list` of ``SLOT_TOKENS``-row tiles: the work of the per-tile passes that each take
    one whole padded slot of a sequence (the backward's producers, the forward's rebasing)."""
    return tile_list(offsets_rows, total_rows, SLOT_TOKENS)


def work_list(
    offsets_rows: torch.Tensor,
    offsets_cols: torch.Tensor,
    total_rows: int,
    block: int,
    *,
    causal: bool,
    rows_are_queries: bool = True,
) -> torch.Tensor:
    """int32 ``[slots, 2]``: (sequence, tile) of every row tile, the most expensive first.

    ``offsets_rows`` are the offsets of the tiled side (``total_rows`` rows in all: the values'
    first dimension, so no host read is needed), ``offsets_cols`` those of the other side
    (same batch). A tile's cost is ``visible_columns`` of its most-seeing row; ties keep sequence
    order. Tiles that see no column still get a slot (their rows must be written); unused slots
    are ``(-1, -1)`` at the end.
    """
    if offsets_rows.numel() == 1:
        return tile_list(offsets_rows, total_rows, block)
    seq, tile, used = _row_tiles(offsets_rows, total_rows, block)
    len_rows = lengths_of(offsets_rows).to(torch.int64)[seq]
    len_cols = lengths_of(offsets_cols).to(torch.int64)[seq]
    tile_start = tile * block
    tile_rows = (len_rows - tile_start).clamp(max=block)
    cost = visible_columns(tile_start, tile_rows, len_rows, len_cols, causal, rows_are_queries)
    cost = torch.where(used, cost, torch.full_like(cost, -1))
    order = torch.argsort(cost, descending=True, stable=True)
    return _table(seq, tile, used)[order].to(torch.int32)
