"""Jagged MXFP8 quantization in one pass over the input (Triton).

``quantize_mxfp8_kernel`` reads high-precision ``values [total, H, D]`` once and writes, for each
requested axis, the e4m3 data at the unpadded token rows and the tiled E8M0 scales, bit-identical
to ``jagged_attn.quantize_mxfp8`` (the torch reference).

One program handles one head of one 128-token tile of one sequence, all D channels or a chunk of
them (``TileConfig``). Tiles start at each sequence's first token, so a 32-token sequence-axis
block never straddles two programs.
Program ``slot`` owns padded row tile ``slot`` of the scale buffers: sequence ``b`` occupies the
slots ``[P_b / 128, P_{b+1} / 128)`` (``P_b = padded_seq_start(offsets[b], b)``), its tiles first,
then slots no token maps to. Those programs still store their scale bytes (zeros), so every byte
of the scale buffers is written once and nothing needs clearing first. A small prologue kernel
tabulates each slot's first token and token count, so the main kernel never searches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from jagged_attn import mx_format
from jagged_attn.mxfp8 import AXES, check_values, scale_matrix_shape
from jagged_attn.offsets import validate_offsets
from jagged_attn.scale_layout import TILE_ROWS, tiled_bytes

from ..common import fp8, layout
from ..common.interpreter import INTERPRETED
from ..common.schedule import SLOT_TOKENS, claimed_tile, slot_tiles

TILE_TOKENS = TILE_ROWS  # tokens per program: one scale row tile (feature) / column tile (sequence)
_SLOT_TOKENS = tl.constexpr(SLOT_TOKENS)  # the slot table's tokens per slot; a kernel reads globals as constexprs
WIDEST_VECTOR = tl.constexpr(16)  # channels per thread Triton gives a tile unless told less: a 128-bit e4m3 store
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
def flag_nonfinite(nonfinite, magnitudes):
    """The producers' NaN/Inf flag: store each of fp32 ``magnitudes`` (|x| maxima, any shape) that is
    NaN or +Inf into ``nonfinite`` (fp32 ``[1]`` holding 0). A masked store, almost always masked off:
    no atomics, and which non-finite value lands does not matter."""
    tl.store(nonfinite + tl.zeros_like(magnitudes).to(tl.int32), magnitudes, mask=~(magnitudes <= FLOAT32_MAX))


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


@triton.constexpr_function
def channel_chunks(dim, block_d):
    """Programs per (slot, head) of ``values [total, H, dim]``: ``block_d``-channel chunks that cover
    the channels of dim's 128-row sequence-axis scale tiles (one if ``block_d`` covers them all)."""
    return triton.cdiv(triton.cdiv(dim, TILE_ROWS) * TILE_ROWS, block_d)


@triton.jit
def program_chunk(D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The chunk of channels this program handles (programs run slot by slot, head by head, chunk by chunk)."""
    return tl.program_id(0) % channel_chunks(D, BLOCK_D)


@triton.jit
def program_tile(tiles, offsets, total, HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_ROWS: tl.constexpr, VECTOR: tl.constexpr):
    """Where this program's tile of ``values [total, HEADS, D]`` lies, from its slot of the
    ``schedule.slot_tiles`` table ``tiles`` of ``offsets``: (slot, head, token [128]: the
    token each tile row holds, counted from the slot's first; row [128]: its row in ``values``;
    in_slot [128]: rows that hold a token; channels [BLOCK_D]: the program's chunk of channels;
    element [128, BLOCK_D]: offsets in ``values``; inside [128, BLOCK_D]: elements in bounds).

    ``BLOCK_ROWS``: tile rows between two consecutive 32-token blocks (below); ``VECTOR``: the
    channels each thread loads and stores at once (offsets are declared contiguous in runs of it).
    """
    CHUNKS: tl.constexpr = channel_chunks(D, BLOCK_D)
    seq, tile, start, length, _, lane = claimed_tile(tiles, offsets, total, _SLOT_TOKENS, HEADS * CHUNKS)
    slot = (tl.program_id(0) // (HEADS * CHUNKS)).to(tl.int64)
    head = lane // CHUNKS
    first_row = start + tl.maximum(tile, 0) * _SLOT_TOKENS
    tokens = tl.where(seq >= 0, tl.minimum(tl.maximum(start + length - first_row, 0), _SLOT_TOKENS), 0)

    # Triton spreads the rows of a tile over (fastest first) the lanes of a warp, the warps, then
    # each thread's registers. Row i holds token 32 (i // S % 4) + (i % S) (32 // S) + i // (4 S),
    # S = BLOCK_ROWS: the block index is on the middle bits of i, the token within its block on the
    # lowest and highest. When S is the rows on a warp's lanes, each warp holds whole blocks and the
    # sequence-axis maxima never leave it (any S is correct; only the speed differs).
    rows = tl.arange(0, 128)
    token = 32 * (rows // BLOCK_ROWS % 4) + rows % BLOCK_ROWS * (32 // BLOCK_ROWS) + rows // (4 * BLOCK_ROWS)
    row = first_row + token
    in_slot = token < tokens
    channels = program_chunk(D, BLOCK_D) * BLOCK_D + tl.arange(0, BLOCK_D)
    inside = in_slot[:, None]
    if BLOCK_D * CHUNKS != D:
        inside = inside & (channels < D)[None, :]
    within = token[:, None] * (HEADS * D) + channels[None, :]  # int32 inside the tile
    if VECTOR < WIDEST_VECTOR:
        within = within // VECTOR * VECTOR + within % VECTOR
    element = (first_row * (HEADS * D) + head * D) + within
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
    BLOCK_ROWS: tl.constexpr,
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
        columns = program_chunk(CHANNEL_TILES * 128, BLOCK_D) * (BLOCK_D // 32) + tl.arange(0, BLOCK_D // 32)
        where = layout.scale_byte_offset(slot * 128 + token[:, None], columns[None, :], CHANNEL_TILES)
        tl.store(feature_scales + head_scales + where, byte.to(tl.uint8), mask=(columns < CHANNEL_TILES * 4)[None, :])
    if SEQUENCE:
        # Blocks of 32 tokens of one channel: row (4 q + k) S + r (S = BLOCK_ROWS) holds a token of
        # block k (program_tile). Scale row = channel, column = the block's padded column.
        blocks = tl.reshape(x, (32 // BLOCK_ROWS, 4, BLOCK_ROWS, BLOCK_D))
        byte, amax = block_scale_bytes(blocks, (0, 1), FLOOR, INTERPRET)
        # Axes restored in the reverse order of the reductions: the factor keeps their layout.
        factor = tl.expand_dims(tl.expand_dims(layout.scale_factor(byte), 1), 0)
        data = fp8.to_e4m3(blocks * factor, INTERPRET)
        tl.store(sequence_data + element, tl.reshape(data, (128, BLOCK_D)), mask=inside)
        columns = slot * 4 + tl.arange(0, 4)
        where = layout.scale_byte_offset(channels[None, :], columns[:, None], n_slots)
        tl.store(
            sequence_scales + head_scales + where, byte.to(tl.uint8), mask=(channels < CHANNEL_TILES * 128)[None, :]
        )
    if CHECK_FINITE:
        # Reduced over the last axis only (inside a warp), then written by every holder of a
        # non-finite maximum: one exchange between warps fewer than a full reduction.
        flag_nonfinite(nonfinite, max_keeping_nan(amax, len(amax.shape) - 1, INTERPRET))


@triton.jit
def _quantize_kernel(
    values,
    tiles,
    offsets,
    total,
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
    BLOCK_ROWS: tl.constexpr,
    VECTOR: tl.constexpr,
    CHANNEL_TILES: tl.constexpr,
    FEATURE: tl.constexpr,
    SEQUENCE: tl.constexpr,
    FLOOR: tl.constexpr,
    CHECK_FINITE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    slot, head, token, _, _, channels, element, inside = program_tile(tiles, offsets, total, HEADS, D, BLOCK_D,
                                                                                BLOCK_ROWS, VECTOR)
    x = tl.load(values + element, mask=inside, other=0.0).to(tl.float32)
    store_mxfp8(
        x, slot, head, token, channels, element, inside,
        feature_data, feature_scales, sequence_data, sequence_scales, nonfinite, scale_bytes_per_head, n_slots,
        BLOCK_D, BLOCK_ROWS, CHANNEL_TILES, FEATURE, SEQUENCE, FLOOR, CHECK_FINITE, INTERPRET,
    )


def empty_outputs(values: torch.Tensor, offsets: torch.Tensor, axis: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized (e4m3 data like ``values``, uint8 scales ``[H, tiled bytes]``) for one axis."""
    total, heads, dim = values.shape
    rows, cols = scale_matrix_shape(axis, total, offsets.numel() - 1, dim)
    data = torch.empty(values.shape, dtype=torch.float8_e4m3fn, device=values.device)
    return data, torch.empty(heads, tiled_bytes(rows, cols), dtype=torch.uint8, device=values.device)


@dataclass(frozen=True)
class TileConfig:
    """How the per-tile kernels split and lay out their work; every choice writes the same bytes.

    ``channels``: channels per program (None: all of D, at least 128, so one program per (slot,
    head)); ``num_warps``: warps per program; ``vector``: consecutive channels each thread loads and
    stores at once (at most ``WIDEST_VECTOR``); ``max_registers``: per thread (None: as ptxas likes).
    """

    name: str
    channels: int | None
    num_warps: int
    vector: int = WIDEST_VECTOR.value
    max_registers: int | None = None

    def block_d(self, dim: int) -> int:
        return self.channels or max(triton.next_power_of_2(dim), TILE_TOKENS)

    def block_rows(self, dim: int) -> int:
        """``BLOCK_ROWS`` of :func:`program_tile`: the tile rows on a warp's lanes (the lanes not on
        channels), times the warps one block spans when there are more than 4 (4 blocks per tile)."""
        rows_on_lanes = max(1, 32 * self.vector // self.block_d(dim))
        return min(32, rows_on_lanes * max(1, self.num_warps // 4))


# scripts/bench_quantize.py times them all on the GPU. "all-8w" keeps all D channels in one program of
# 8 warps, 16 channels per thread: a sequence-axis block spans 2 warps, so its maxima pass through
# shared memory. The "c64"/"c32" configurations take 64 or 32 channels per program on 4 warps, one
# 32-token block per warp: no exchange between warps for the maxima (sm_90 SASS: 1 barrier, for
# the scale bytes, instead of 4); 8 channels per thread put 4 (c64) or 8 (c32) token rows on the
# lanes, 16 channels put 8 or 16, and the per-block scale math is repeated on each of those lanes.
CONFIGS = {
    config.name: config
    for config in (
        TileConfig("all-8w", None, 8),
        TileConfig("c64-4w-v8", 64, 4, 8),
        TileConfig("c64-4w-v16", 64, 4),
        TileConfig("c32-4w-v8", 32, 4, 8),
    )
}
# The configuration quantize_into uses for each set of axes (sorted as in AXES): the fastest measured by
# scripts/bench_quantize.py (docs/perf-history.md).
DEFAULT_CONFIGS = {
    ("feature",): CONFIGS["c64-4w-v16"],
    ("sequence",): CONFIGS["c64-4w-v8"],
    ("feature", "sequence"): CONFIGS["c64-4w-v8"],
}


def default_config(axes) -> TileConfig:
    """The configuration ``DEFAULT_CONFIGS`` gives a set of axes, in any order."""
    return DEFAULT_CONFIGS[tuple(axis for axis in AXES if axis in axes)]


def quantize_into(values, offsets, outputs: dict, rounding: str, nonfinite=None, config: TileConfig | None = None):
    """Quantize ``values [total, H, D]`` into ``outputs`` (axis -> (data, scales) from :func:`empty_outputs`)
    with ``config`` (None: the default for those axes)."""
    config = config or default_config(outputs)
    launch_per_tile(_quantize_kernel, (values,), values, offsets, outputs, rounding, nonfinite, config)


def launch_per_tile(kernel, leading, values, offsets, outputs: dict, rounding: str, nonfinite, config: TileConfig,
                    **options):
    """Launch a kernel built on :func:`program_tile` and :func:`store_mxfp8`, one program per
    (128-token slot, head, chunk of ``config.channels``) of ``values [total, H, D]``.

    The kernel takes ``*leading``, then the slot table, offsets and rows of :func:`program_tile` and the
    arguments of :func:`store_mxfp8`
    (``outputs``: axis -> (data, scales) from :func:`empty_outputs`), then ``HEADS``, ``D``,
    ``BLOCK_D``, ``BLOCK_ROWS``, ``VECTOR``; ``options``: further constexprs or launch options.
    """
    total, heads, dim = values.shape
    table = slot_tiles(offsets, total)
    feature = outputs.get("feature", (None, None))
    sequence = outputs.get("sequence", (None, None))
    scale_bytes_per_head = next(iter(outputs.values()))[1].shape[1]  # the same for both axes
    if table.shape[0] == 0 or heads == 0:
        return
    block_d = config.block_d(dim)
    kernel[(table.shape[0] * heads * channel_chunks(dim, block_d),)](
        *leading,
        table,
        offsets,
        total,
        *feature,
        *sequence,
        nonfinite,
        scale_bytes_per_head,
        table.shape[0],
        HEADS=heads,
        D=dim,
        BLOCK_D=block_d,
        BLOCK_ROWS=config.block_rows(dim),
        VECTOR=config.vector,
        CHANNEL_TILES=triton.cdiv(dim, TILE_TOKENS),
        FEATURE="feature" in outputs,
        SEQUENCE="sequence" in outputs,
        FLOOR=rounding == "floor",
        CHECK_FINITE=nonfinite is not None,
        INTERPRET=INTERPRETED,
        num_warps=config.num_warps,
        maxnreg=config.max_registers,
        **options,
    )


def check_axes(axes) -> None:
    """Raise ValueError unless ``axes`` is a non-empty sequence of distinct names from ``AXES``."""
    if not axes or any(axis not in AXES for axis in axes) or len(set(axes)) != len(axes):
        raise ValueError(f"axes must be distinct names from {AXES}, got {axes!r}")


def check_jagged_input(x, offsets, name: str) -> None:
    """What the producer kernels need of their input, checked before any launch: bf16/fp16/fp32
    ``[total, heads, D]`` with D a positive multiple of 32, valid offsets for its rows on its device,
    and CUDA tensors (or the interpreter). ValueError / TypeError naming ``name`` otherwise."""
    check_values(x, name, finite=False)
    if x.dim() != 3:
        raise ValueError(f"{name} must be [total, heads, D], got shape {tuple(x.shape)}")
    validate_offsets(offsets, x.shape[0], "offsets")
    if offsets.device != x.device:
        raise ValueError(f"offsets is on {offsets.device} but {name} is on {x.device}")
    if not (x.is_cuda or INTERPRETED):
        raise ValueError(f"{name} is on {x.device}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1)")


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
    check_jagged_input(values, offsets, "values")
    if nonfinite is not None and not (isinstance(nonfinite, torch.Tensor) and nonfinite.dtype == torch.float32
                                      and tuple(nonfinite.shape) == (1,) and nonfinite.device == values.device):
        raise ValueError("nonfinite must be a float32 tensor of shape (1,) on the values' device")
    values, offsets = values.contiguous(), offsets.contiguous()
    outputs = {axis: empty_outputs(values, offsets, axis) for axis in axes}
    quantize_into(values, offsets, outputs, mx_format.check_rounding(rounding), nonfinite)
    return tuple(outputs[axis] for axis in axes)
