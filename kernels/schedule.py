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

EMPTY_SLOT = -1


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
    device = offsets_rows.device
    batch = offsets_rows.numel() - 1
    slots = tile_slots(total_rows, batch, block)
    len_rows = lengths_of(offsets_rows).to(torch.int64)
    len_cols = lengths_of(offsets_cols).to(torch.int64)
    tiles_per_seq = (len_rows + block - 1) // block
    tile_end = torch.cumsum(tiles_per_seq, 0)
    slot = torch.arange(slots, device=device, dtype=torch.int64)
    if batch == 0:
        return torch.full((slots, 2), EMPTY_SLOT, dtype=torch.int32, device=device)
    seq = torch.searchsorted(tile_end, slot, right=True)
    used = seq < batch
    seq = seq.clamp(max=batch - 1)
    tile = slot - (tile_end[seq] - tiles_per_seq[seq])
    tile_start = tile * block
    tile_rows = (len_rows[seq] - tile_start).clamp(max=block)
    cost = visible_columns(tile_start, tile_rows, len_rows[seq], len_cols[seq], causal, rows_are_queries)
    cost = torch.where(used, cost, torch.full_like(cost, -1))
    order = torch.argsort(cost, descending=True, stable=True)
    table = torch.stack([torch.where(used, seq, EMPTY_SLOT), torch.where(used, tile, EMPTY_SLOT)], dim=1)
    return table[order].to(torch.int32)

