"""The work tables: every row tile exactly once (the tile list in padded-tile order, the work list
longest first), built on the device without a host sync."""

import torch
from hypothesis import given, settings, strategies as st

from jagged_attn.kernels.common.schedule import EMPTY_SLOT, tile_list, tile_slots, work_list
from jagged_attn.offsets import offsets_from_lengths, padded_tile
from jagged_attn.reference import visible_mask


def _expected_tiles(len_rows, len_cols, block, causal, rows_are_queries):
    """({(seq, tile): visible columns of the tile's most-seeing row}, [visible pairs of each sequence]),
    by brute force on the mask."""
    tiles, pairs = {}, []
    for b, (lr, lc) in enumerate(zip(len_rows, len_cols)):
        len_q, len_k = (lr, lc) if rows_are_queries else (lc, lr)
        mask = visible_mask(len_q, len_k, causal, "cpu")
        pairs.append(int(mask.sum()))
        per_row = mask.sum(1) if rows_are_queries else mask.sum(0)
        for t in range(-(-lr // block)):
            tiles[(b, t)] = int(per_row[t * block:(t + 1) * block].max()) if len_q and len_k else 0
    return tiles, pairs


EDGE_LENGTHS = [0, 1, 31, 32, 33, 63, 64, 65, 127, 128, 129, 700]
lengths_strategy = st.lists(st.sampled_from(EDGE_LENGTHS), min_size=1, max_size=10)


@settings(deadline=None, max_examples=40)
@given(len_rows=lengths_strategy, len_cols=lengths_strategy, block=st.sampled_from([64, 128]),
       causal=st.booleans(), rows_are_queries=st.booleans(), dtype=st.sampled_from([torch.int32, torch.int64]))
def test_work_list_covers_every_tile_longest_sequence_and_tile_first(len_rows, len_cols, block, causal,
                                                                    rows_are_queries, dtype):
    batch = min(len(len_rows), len(len_cols))
    len_rows, len_cols = len_rows[:batch], len_cols[:batch]
    offsets_rows = offsets_from_lengths(torch.tensor(len_rows)).to(dtype)
    offsets_cols = offsets_from_lengths(torch.tensor(len_cols)).to(dtype)
    total = sum(len_rows)
    table = work_list(offsets_rows, offsets_cols, total, sum(len_cols), block, causal=causal,
                      rows_are_queries=rows_are_queries)
    assert table.dtype == torch.int32 and table.shape == (tile_slots(total, batch, block), 2)

    expected, pairs = _expected_tiles(len_rows, len_cols, block, causal, rows_are_queries)
    used = table[:, 0] != EMPTY_SLOT
    assert int(used.sum()) == len(expected)
    assert bool(used[: len(expected)].all()), "unused slots must come last"
    assert bool((table[~used] == EMPTY_SLOT).all())
    listed = [tuple(row) for row in table[used].tolist()]
    assert sorted(listed) == sorted(expected)
    ranked = [(-pairs[seq], seq, -expected[(seq, tile)], tile) for seq, tile in listed]
    assert ranked == sorted(ranked), "sequences with the most pairs first, then their tiles by visible columns"


def test_work_list_empty_batch_and_all_empty_sequences():
    empty = torch.zeros(1, dtype=torch.int64)
    assert work_list(empty, empty, 0, 0, 128, causal=True).shape == (0, 2)
    zeros = torch.zeros(4, dtype=torch.int32)
    table = work_list(zeros, zeros, 0, 0, 128, causal=False)
    assert table.shape == (3, 2) and bool((table == EMPTY_SLOT).all())


def test_work_list_hundred_thousand_sequences():
    lengths = torch.randint(0, 4, (100_000,))
    offsets = offsets_from_lengths(lengths).to(torch.int32)
    total = int(lengths.sum())
    table = work_list(offsets, offsets, total, total, 128, causal=True)
    used = table[:, 0] != EMPTY_SLOT
    assert int(used.sum()) == int((lengths > 0).sum())
    assert bool((lengths[table[used, 0].long()] > 0).all()) and bool((table[used, 1] == 0).all())


@settings(deadline=None, max_examples=40)
@given(lengths=lengths_strategy, block=st.sampled_from([64, 128]))
def test_tile_list_places_each_sequence_at_its_padded_tile(lengths, block):
    offsets = offsets_from_lengths(torch.tensor(lengths)).to(torch.int32)
    total = sum(lengths)
    table = tile_list(offsets, total, block)
    assert table.dtype == torch.int32 and table.shape == (tile_slots(total, len(lengths), block), 2)
    expected = torch.full_like(table, EMPTY_SLOT)
    for b, length in enumerate(lengths):
        first = padded_tile(int(offsets[b]), b, block)
        for t in range(-(-length // block)):
            expected[first + t] = torch.tensor([b, t])
    assert torch.equal(table, expected)
