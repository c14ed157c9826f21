"""Jagged MXFP8 quantization in one pass over the input (Triton).

``quantize_mxfp8_kernel`` reads high-precision ``values [total, H, D]`` once and writes, for each
requested axis, the e4m3 data at the unpadded token rows and the tiled E8M0 scales, bit-identical
to ``jagged_attn.quantize_mxfp8`` (the torch reference).

One program handles one head of one 128-token tile of one sequence, all D channels. Tiles start
at each sequence's first token, so a 32-token sequence-axis block never straddles two programs.
Program ``slot`` owns padded row tile ``slot`` of the scale buffers: sequence ``b`` occupies the
slots ``[P_b / 128, P_{b+1} / 128)`` (``P_b = padded_seq_start(offsets[b], b)``), its tiles first,
then slots no token maps to. Those programs still store their scale bytes (zeros), so every byte
of the scale buffers is written once and nothing needs clearing first. A small prologue kernel
tabulates each slot's first token and token count, so the main kernel never searches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jagged_attn import mx_format
from jagged_attn.mxfp8 import AXES, scale_matrix_shape
from jagged_attn.offsets import padded_total
from jagged_attn.scale_layout import TILE_ROWS, tiled_bytes

from . import fp8, layout
from .interpreter import INTERPRETED

TILE_TOKENS = TILE_ROWS  # tokens per program: one scale row tile (feature) / column tile (sequence)
NUM_WARPS = 8
SLOTS_PER_STEP = 1024  # slots the prologue fills per loop step
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _larger_or_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def max_keeping_nan(x, axis: tl.constexpr, INTERPRET: tl.constexpr):
    """``tl.max`` that returns NaN where a NaN is reduced (the GPU's plain max drops NaN)."""
    if INTERPRET:  # the interpreter runs a custom combine element by element: mark NaN separately
        has_nan = tl.max((x != x).to(tl.int32), axis=axis) > 0  # noqa: PLR0124 (x != x: NaN)
        return tl.where(has_nan, float("nan"), tl.max(x, axis=axis))
    return tl.reduce(x, axis, _larger_or_nan)


@triton.jit
def block_scale_bytes(blocks, AXES: tl.constexpr, FLOOR: tl.constexpr, INTERPRET: tl.constexpr):
    """(int32 E8M0 bytes, fp32 maxima) of the blocks of fp32 ``blocks``: the maxima of their magnitudes
    reduced over ``AXES`` in turn (each an axis of what the previous reduction left).

    A block's maximum is NaN if it holds a NaN (then its byte is meaningless).
    """
    amax = tl.abs(blocks)
    for i in tl.static_range(len(AXES)):
        amax = max_keeping_nan(amax, AXES[i], INTERPRET)
    return layout.scale_byte_of_amax(amax, FLOOR), amax


@triton.jit
def _slot_table_kernel(offsets, table, SLOTS_PER_STEP: tl.constexpr):
    """table[slot] = (first token row, tokens) of every slot of sequence ``program_id`` (tokens 0 past its end)."""
    seq = tl.program_id(0)
    start, length = layout.sequence_span(offsets, seq)
    end = start + length
    first_slot = layout.padded_seq_start(start, seq) // 128
    n_slots = (layout.padded_seq_start(end, seq + 1) // 128 - first_slot).to(tl.int32)
    for step in range(0, n_slots, SLOTS_PER_STEP):
        tile = step + tl.arange(0, SLOTS_PER_STEP)
        first_row = start + tile.to(tl.int64) * 128
        tokens = tl.minimum(tl.maximum(end - first_row, 0), 128)
        slot = first_slot + tile
        tl.store(table + 2 * slot, first_row, mask=tile < n_slots)
        tl.store(table + 2 * slot + 1, tokens, mask=tile < n_slots)


@triton.jit
def program_tile(slot_table, HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Where this program's tile of ``values [total, HEADS, D]`` lies: (slot, head, token [128]: the
    token each tile row holds, counted from the slot's first; row [128]: its row in ``values``;
    in_slot [128]: rows that hold a token; channels [BLOCK_D]; element [128, BLOCK_D]: offsets in
    ``values``; inside [128, BLOCK_D]: elements in bounds).
    """
    pid = tl.program_id(0)
    slot = (pid // HEADS).to(tl.int64)
    head = pid % HEADS
    first_row = tl.load(slot_table + 2 * slot)
    tokens = tl.load(slot_table + 2 * slot + 1)

    # Row i of the tile holds token 4 * (i % 32) + i // 32. With 8 warps Triton gives each thread
    # rows 32 apart, which then are 4 consecutive tokens of one 32-token block: the sequence-axis
    # maxima need fewer exchanges and fewer threads repeat each block's math (any layout is correct).
    rows = tl.arange(0, 128)
    token = (rows % 32) * 4 + rows // 32
    row = first_row + token
    in_slot = token < tokens
    channels = tl.arange(0, BLOCK_D)
    inside = in_slot[:, None]
    if BLOCK_D != D:
        inside = inside & (channels < D)[None, :]
    element = row[:, None] * (HEADS * D) + head * D + channels[None, :]
    return slot, head, token, row, in_slot, channels, element, inside


@triton.jit
def store_mxfp8(
    x,
    slot,
    head,
    token,
    channels,
    element,
    inside,
    feature_data,
    feature_scales,
    sequence_data,
    sequence_scales,
    nonfinite,
    scale_bytes_per_head,
    n_slots,
    BLOCK_D: tl.constexpr,
    CHANNEL_TILES: tl.constexpr,
    FEATURE: tl.constexpr,
    SEQUENCE: tl.constexpr,
    FLOOR: tl.constexpr,
    CHECK_FINITE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Quantize the fp32 tile ``x [128, BLOCK_D]`` placed by :func:`program_tile` (elements outside
    hold 0) and store its e4m3 data and scale bytes for each requested axis; flag NaN/Inf in ``nonfinite``."""
    head_scales = head.to(tl.int64) * scale_bytes_per_head
    if FEATURE:
        # Blocks of 32 channels of one token; scale row = the token's padded row, column = block.
        blocks = tl.reshape(x, (128, BLOCK_D // 32, 32))
        byte, amax = block_scale_bytes(blocks, (2,), FLOOR, INTERPRET)
        data = fp8.to_e4m3(blocks * layout.scale_factor(byte)[:, :, None], INTERPRET)
        tl.store(feature_data + element, tl.reshape(data, (128, BLOCK_D)), mask=inside)
        columns = tl.arange(0, BLOCK_D // 32)
        where = layout.scale_byte_offset(slot * 128 + token[:, None], columns[None, :], CHANNEL_TILES)
        tl.store(feature_scales + head_scales + where, byte.to(tl.uint8), mask=(columns < CHANNEL_TILES * 4)[None, :])
    if SEQUENCE:
        # Blocks of 32 tokens of one channel. Row 32 q + 8 k + r holds token 32 k + 4 r + q: block k.
        # Scale row = channel, column = the block's padded column.
        blocks = tl.reshape(x, (4, 4, 8, BLOCK_D))
        byte, amax = block_scale_bytes(blocks, (0, 1), FLOOR, INTERPRET)
        data = fp8.to_e4m3(blocks * layout.scale_factor(byte)[None, :, None, :], INTERPRET)
        tl.store(sequence_data + element, tl.reshape(data, (128, BLOCK_D)), mask=inside)
        columns = slot * 4 + tl.arange(0, 4)
        where = layout.scale_byte_offset(channels[None, :], columns[:, None], n_slots)
        tl.store(
            sequence_scales + head_scales + where, byte.to(tl.uint8), mask=(channels < CHANNEL_TILES * 128)[None, :]
        )
    if CHECK_FINITE:
        largest = max_keeping_nan(amax, None, INTERPRET)
        tl.store(nonfinite, largest, mask=~(largest <= FLOAT32_MAX))


@triton.jit
def _quantize_kernel(
    values,
    slot_table,
    feature_data,
    feature_scales,
    sequence_data,
    sequence_scales,
    nonfinite,
    scale_bytes_per_head,
    n_slots,
    HEADS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHANNEL_TILES: tl.constexpr,
    FEATURE: tl.constexpr,
    SEQUENCE: tl.constexpr,
    FLOOR: tl.constexpr,
    CHECK_FINITE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    slot, head, token, _, _, channels, element, inside = program_tile(slot_table, HEADS, D, BLOCK_D)
    x = tl.load(values + element, mask=inside, other=0.0).to(tl.float32)
    store_mxfp8(
        x, slot, head, token, channels, element, inside,
        feature_data, feature_scales, sequence_data, sequence_scales, nonfinite, scale_bytes_per_head, n_slots,
        BLOCK_D, CHANNEL_TILES, FEATURE, SEQUENCE, FLOOR, CHECK_FINITE, INTERPRET,
    )


def slot_table(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """int64 ``[padded_total / 128, 2]``: (first token row, token count) of every 128-token slot."""
    batch = offsets.numel() - 1
    table = torch.empty(padded_total(total, batch) // TILE_TOKENS, 2, dtype=torch.int64, device=offsets.device)
    if batch:
        _slot_table_kernel[(batch,)](offsets, table, SLOTS_PER_STEP=SLOTS_PER_STEP)
    return table


def empty_outputs(values: torch.Tensor, offsets: torch.Tensor, axis: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized (e4m3 data like ``values``, uint8 scales ``[H, tiled bytes]``) for one axis."""
    total, heads, dim = values.shape
    rows, cols = scale_matrix_shape(axis, total, offsets.numel() - 1, dim)
    data = torch.empty(values.shape, dtype=torch.float8_e4m3fn, device=values.device)
    return data, torch.empty(heads, tiled_bytes(rows, cols), dtype=torch.uint8, device=values.device)


def quantize_into(values, offsets, outputs: dict, rounding: str, nonfinite=None, num_warps: int = NUM_WARPS):
    """Quantize ``values [total, H, D]`` into ``outputs`` (axis -> (data, scales) from :func:`empty_outputs`)."""
    launch_per_tile(_quantize_kernel, (values,), values, offsets, outputs, rounding, nonfinite, num_warps)


def launch_per_tile(kernel, leading, values, offsets, outputs: dict, rounding: str, nonfinite, num_warps: int,
                    **options):
    """Launch a kernel built on :func:`program_tile` and :func:`store_mxfp8`, one program per
    (128-token slot, head) of ``values [total, H, D]``.

    The kernel takes ``*leading``, then the slot table and the arguments of :func:`store_mxfp8`
    (``outputs``: axis -> (data, scales) from :func:`empty_outputs`), then ``HEADS``, ``D``,
    ``BLOCK_D``; ``options``: further constexprs or launch options.
    """
    total, heads, dim = values.shape
    table = slot_table(offsets, total)
    feature = outputs.get("feature", (None, None))
    sequence = outputs.get("sequence", (None, None))
    scale_bytes_per_head = next(iter(outputs.values()))[1].shape[1]  # the same for both axes
    if table.shape[0] == 0 or heads == 0:
        return
    kernel[(table.shape[0] * heads,)](
        *leading,
        table,
        *feature,
        *sequence,
        nonfinite,
        scale_bytes_per_head,
        table.shape[0],
        HEADS=heads,
        D=dim,
        BLOCK_D=max(triton.next_power_of_2(dim), TILE_TOKENS),
        CHANNEL_TILES=triton.cdiv(dim, TILE_TOKENS),
        FEATURE="feature" in outputs,
        SEQUENCE="sequence" in outputs,
        FLOOR=rounding == "floor",
        CHECK_FINITE=nonfinite is not None,
        INTERPRET=INTERPRETED,
        num_warps=num_warps,
        **options,
    )


def check_axes(axes) -> None:
    """Raise ValueError unless ``axes`` is a non-empty sequence of distinct names from ``AXES``."""
    if not axes or any(axis not in AXES for axis in axes) or len(set(axes)) != len(axes):
        raise ValueError(f"axes must be distinct names from {AXES}, got {axes!r}")


def quantize_mxfp8_kernel(
    values: torch.Tensor,
    offsets: torch.Tensor,
    *,
    axes=("feature",),
    rounding: str = "rceil",
    nonfinite: torch.Tensor | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Quantize jagged ``values`` (bf16/fp16/fp32 ``[total, H, D]``, D a multiple of 32) to MXFP8 in one read.

    ``offsets``: validated int32/int64 ``[B + 1]``. ``axes``: ``"feature"`` and/or ``"sequence"``.
    Returns one (e4m3 data ``[total, H, D]``, uint8 tiled scales ``[H, bytes]``) pair per axis, in
    the order of ``axes``, bit-identical to ``quantize_mxfp8(values, offsets, axis=...)``.
    ``nonfinite``: optional float32 ``[1]`` holding 0, set to NaN or Inf if ``values`` holds any
    (the scales are then meaningless).
    """
    check_axes(axes)
    values, offsets = values.contiguous(), offsets.contiguous()
    outputs = {axis: empty_outputs(values, offsets, axis) for axis in axes}
    quantize_into(values, offsets, outputs, mx_format.check_rounding(rounding), nonfinite)
    return tuple(outputs[axis] for axis in axes)
