"""Scale-tile layout and jagged placement: against torch's to_blocked and the closed-form rules."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

pytest.importorskip("expecttest")  # torch's internal test helpers need it (the [test] extra installs it)
from torch.testing._internal.common_quantized import from_blocked, to_blocked  # noqa: E402

from jagged_attn.offsets import offsets_from_lengths, padded_rows_of_tokens, padded_total, sequence_ids
from jagged_attn.scale_layout import TILE_BYTES, from_tiles, scale_byte_offset, scale_tile_offset, to_tiles


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 300), cols=st.integers(1, 11))
def test_to_tiles_matches_torch_to_blocked(rows, cols):
    matrix = torch.randint(1, 255, (2, rows, cols), dtype=torch.uint8)
    tiled = to_tiles(matrix)
    for h in range(2):
        assert torch.equal(tiled[h], to_blocked(matrix[h]))
        assert torch.equal(from_blocked(torch.empty(rows, cols * 32), tiled[h], 32), matrix[h])
    assert torch.equal(from_tiles(tiled, rows, cols), matrix)


def test_byte_offset_formula_agrees_with_to_tiles():
    rows, cols = 384, 12
    matrix = torch.arange(rows * cols, dtype=torch.int64).reshape(1, rows, cols)
    tiled = to_tiles(matrix)[0]
    r = torch.arange(rows).unsqueeze(1).expand(rows, cols)
    c = torch.arange(cols).unsqueeze(0).expand(rows, cols)
    assert torch.equal(tiled[scale_byte_offset(r, c, cols // 4)], matrix[0])
    assert scale_tile_offset(33, 2) == 16 + 4 + 2 and TILE_BYTES == 512


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(0, 400), min_size=1, max_size=12))
def test_jagged_placement_is_aligned_disjoint_and_in_bounds(lengths):
    offsets = offsets_from_lengths(torch.tensor(lengths))
    total, batch = int(offsets[-1]), len(lengths)
    rows = padded_rows_of_tokens(offsets, sequence_ids(offsets, total))
    assert rows.unique().numel() == total  # never overlaps
    assert total == 0 or int(rows.max()) < padded_total(total, batch)
    starts = [(int(offsets[b]) // 128 + b) * 128 for b in range(batch)]
    for b in range(batch):
        assert starts[b] % 128 == 0
        if lengths[b]:
            assert int(rows[int(offsets[b])]) == starts[b]
        if b + 1 < batch:
            assert starts[b + 1] >= starts[b] + lengths[b]
