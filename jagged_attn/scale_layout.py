"""Scale-factor tiles: the 128x4 swizzled layout that Blackwell's block-scaled MMA reads.

A scale matrix (rows = the non-reduced dimension, columns = 32-element K blocks) is cut into
tiles of ``TILE_ROWS x TILE_COLS`` bytes, stored tile after tile in row-tile-major order. Inside
a tile, the byte of (row r, column c) sits at ``(r % 32) * 16 + (r // 32) * 4 + c`` (torch's
``SWIZZLE_32_4_4``, cuBLAS's "1D block scaling factors layout"). Padding bytes are 0.

The offset functions use only ``%``, ``//``, ``*`` and ``+`` on non-negative integers, so the
same source serves Python ints, torch tensors and (wrapped with ``triton.jit``) Triton kernels.
Triton functions cannot read module globals, hence the literal numbers inside them;
``jagged_attn.kernels.common.layout`` holds their Triton versions.
"""

from __future__ import annotations

import torch
import triton.language as tl  # noqa: F401  (the Triton interpreter needs it beside jit-wrapped functions)

TILE_ROWS = 128
TILE_COLS = 4
TILE_BYTES = TILE_ROWS * TILE_COLS  # 512


def scale_tile_offset(r, c):
    """Byte offset of (row ``r`` < 128, column ``c`` < 4) inside one 512-byte tile."""
    return (r % 32) * 16 + (r // 32) * 4 + c


def scale_tile_base(row_tile, col_tile, n_col_tiles):
    """Byte offset of tile (row_tile, col_tile) in one head's buffer (row-tile-major order)."""
    return (row_tile * n_col_tiles + col_tile) * 512


def scale_byte_offset(row, col, n_col_tiles):
    """Byte offset of scale-matrix entry (row, col) in one head's tiled buffer (Python / torch)."""
    return scale_tile_base(row // 128, col // 4, n_col_tiles) + scale_tile_offset(row % 128, col % 4)


def num_tiles(n: int, tile: int) -> int:
    """How many tiles of size ``tile`` cover ``n`` rows or columns."""
    return -(-n // tile)


def tiled_bytes(rows: int, cols: int) -> int:
    """Bytes per head of the tiled buffer for a ``rows x cols`` scale matrix."""
    return num_tiles(rows, TILE_ROWS) * num_tiles(cols, TILE_COLS) * TILE_BYTES


def to_tiles(matrix: torch.Tensor) -> torch.Tensor:
    """``[H, rows, cols]`` uint8 scale matrices -> ``[H, tiled_bytes(rows, cols)]`` uint8."""
    heads, rows, cols = matrix.shape
    n_rt, n_ct = num_tiles(rows, TILE_ROWS), num_tiles(cols, TILE_COLS)
    padded = matrix.new_zeros(heads, n_rt * TILE_ROWS, n_ct * TILE_COLS)
    padded[:, :rows, :cols] = matrix
    # [H, rt, r_hi(4), r_lo(32), ct, c(4)] -> [H, rt, ct, r_lo, r_hi, c]
    tiles = padded.view(heads, n_rt, 4, 32, n_ct, TILE_COLS).permute(0, 1, 4, 3, 2, 5)
    return tiles.reshape(heads, n_rt * n_ct * TILE_BYTES)


def from_tiles(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_tiles`: ``[H, bytes]`` -> ``[H, rows, cols]`` (padding dropped)."""
    heads = buffer.shape[0]
    n_rt, n_ct = num_tiles(rows, TILE_ROWS), num_tiles(cols, TILE_COLS)
    if buffer.shape[1] != n_rt * n_ct * TILE_BYTES:
        raise ValueError(
            f"scales: expected {n_rt * n_ct * TILE_BYTES} bytes per head for a {rows}x{cols} "
            f"scale matrix, got {buffer.shape[1]}"
        )
    tiles = buffer.reshape(heads, n_rt, n_ct, 32, 4, TILE_COLS).permute(0, 1, 4, 3, 2, 5)
    return tiles.reshape(heads, n_rt * TILE_ROWS, n_ct * TILE_COLS)[:, :rows, :cols]
