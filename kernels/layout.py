"""Triton versions of the layout and rounding rules, built from their one owner module each.

Kernels import these instead of re-deriving offsets: ``triton.jit`` wraps the very functions the
torch front end calls (they are plain integer arithmetic), so there is one source of truth.
"""

import triton
import triton.language as tl  # noqa: F401  (the Triton interpreter needs it in scope)

from jagged_attn import mx_format, offsets, scale_layout

padded_seq_start = triton.jit(offsets.padded_seq_start)
scale_tile_offset = triton.jit(scale_layout.scale_tile_offset)
scale_tile_base = triton.jit(scale_layout.scale_tile_base)
rceil_scale_byte = triton.jit(mx_format.rceil_scale_byte)
floor_scale_byte = triton.jit(mx_format.floor_scale_byte)


@triton.jit
def scale_byte_offset(row, col, n_col_tiles):
    """Byte offset of scale-matrix entry (row, col) in one head's tiled buffer."""
    return scale_tile_base(row // 128, col // 4, n_col_tiles) + scale_tile_offset(row % 128, col % 4)
