"""Rebasing MXFP8 operands for FP8 MMAs without block scales (Hopper's wgmma, the portable kernels' dots).

A GEMM can only factor a scale out of its fp32 result if the scale is constant along the
reduction (docs/DESIGN.md section 6). So each operand is re-expressed on one exponent per
non-reduced index, in one pass over the data (two for the sequence axis):

* feature axis (Q, K): the D/32 block exponents of a group of tokens (one token for Q; one KV
  tile for K, so its factor is a scalar per tile) are replaced by their maximum ``e_grp``;
  elements of a block with exponent ``e_blk`` are multiplied by ``2^(e_blk - e_grp)`` and
  re-rounded to e4m3. A shift by a power of two is exact unless the element drops below e4m3's
  smallest normal (2^-6): only elements far below the group's largest block round, and their
  absolute error stays below the rounding error of the group's largest elements.
  Output: e4m3 ``[total, H, D]`` and the fp32 factors ``2^(e_grp - 127)``. (From high-precision
  values with one group per 128-token tile, each tile is read for its maximum first, then again in
  chunks, just read, so mostly from L2 by the measured time: docs/perf-history.md.) The ``exact`` form
  (for S from a bf16 MMA) skips the shift: each element becomes its MX value in bf16, which holds
  every e4m3 value times a power of two exactly, and the factors are 1.
* sequence axis (V): each (sequence, head, channel) gets the maximum exponent of its 32-token
  blocks, the same shift is applied, and the data is stored transposed, ``[H, D, padded_total]``
  with tokens contiguous, so that P·V reads V K-major. Token ``i`` of sequence ``b`` sits at
  column ``padded_seq_start(offsets[b], b) + i``: every sequence starts 128-aligned, so the
  kernel's loads of it are provably 16-byte aligned, and the columns up to its next multiple of
  128 hold zeros, so a tile of up to 128 tokens never needs a bounds check. Output: that tensor
  and the int32 exponent bytes ``[H, B, D]``. Two passes over the tiles in parallel: the first
  folds each tile's channel maxima into the exponents (atomic max), the second rebases and stores
  each tile transposed from registers. (One read would need per-(KV tile, channel) factors in the
  forward's P·V, measured much slower: docs/perf-history.md.)

Each rebasing takes either an ``MXFP8Jagged`` (quantized offline: its bytes are read from the
tiled scale buffer) or high-precision values, quantized here with the same numbers as
``quantize_mxfp8`` and then rebased, in the same pass. The forms of an ``MXFP8Jagged`` are kept while
its tensors live unwritten (:func:`kept_rebase_feature`, :func:`kept_rebase_kv`, ``reuse.py``): MXFP8
inputs are quantized once to be attended many times, so only the first call pays for the passes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jagged_attn import mx_format
from jagged_attn.mxfp8 import MXFP8Jagged, scale_col_tiles
from jagged_attn.offsets import padded_total

from ..common import fp8, layout, reuse
from .copies import Quantized, token_normalized_pairs, token_scale_byte
from .quantize import block_scale_bytes, flag_nonfinite, max_keeping_nan
from ..common.schedule import SLOT_TOKENS, claimed_tile, slot_tiles

# One padded slot: whole MX blocks (sequence-axis blocks never straddle programs), one whole key tile (PV_KEY_BITS).
TOKENS_PER_PROGRAM = SLOT_TOKENS
# Launch choices: warps of a feature-axis program (one (128-token tile, head)); channels and warps
# of a sequence-axis program (each pass: one (128-token tile, head, chunk of channels)), by input:
# high-precision values (quantized in the pass) or MXFP8 (its bytes read), each the fastest measured
# (scripts/bench_rebase.py and bench.py; docs/perf-history.md): from bf16, V's passes are fastest with few
# channels on one warp, which made MXFP8's slower, so MXFP8 keeps 128 channels on 4 warps; the exponent
# pass and the rebase pass of bf16 values want different shapes, so each has its own launch. Programs run
# heads and channel chunks fastest (``layout.slot_program``), measured faster than work slots fastest
# (the configs re-swept in that order).
FEATURE_CONFIG = dict(num_warps=4)
# A feature pass that also writes the backward's copies of K or Q (``COPIES``): its last loop, over chunks of
# half FEATURE_CHUNK tokens, takes 64 registers at eight warps for sm_90 (96 at four; Q's, 80 and 128), 94 and
# 166 where the padded total is not known to be a multiple of 16 (whole chunks: 174 and 255); K's pass so
# launched moves its bytes at the rate of the pass without copies (docs/perf-history.md v64).
FEATURE_COPIES_CONFIG = dict(num_warps=8)
# Tokens a feature-axis program quantizes from bf16 at a time (an exponent group of the whole slot is
# first read for its maximum, then chunk by chunk again); from MXFP8 (56 registers a whole slot) it takes
# whole slots: chunks were faster from bf16 and a little slower from MXFP8 (docs/perf-history.md).
FEATURE_CHUNK = 64
SEQUENCE_CONFIGS = {"values": dict(BLOCK_D=32, num_warps=1), "mxfp8": dict(BLOCK_D=128, num_warps=4)}
EXPONENT_CONFIGS = {"values": dict(BLOCK_D=64, num_warps=2), "mxfp8": dict(BLOCK_D=128, num_warps=4)}


@triton.jit
def quantize_on_bytes(x, byte, INTERPRET: tl.constexpr):
    """fp32 ``x`` divided by ``2^(byte - 127)``, rounded to e4m3, returned as fp32 values."""
    return fp8.to_e4m3(x * layout.scale_factor(byte), INTERPRET).to(tl.float32)


@triton.jit
def quantized_feature_blocks(x, FLOOR: tl.constexpr, INTERPRET: tl.constexpr):
    """High-precision ``x [rows, D / 32, 32]`` (fp32; each row's 32-channel blocks) as MX blocks: (fp32 e4m3
    values, int32 scale bytes ``[rows, D / 32]``)."""
    byte, _ = block_scale_bytes(x, (2,), FLOOR, INTERPRET)
    return quantize_on_bytes(x, byte[:, :, None], INTERPRET), byte


@triton.jit
def block_values(x, byte):
    """MX blocks ``x [rows, D / 32, 32]`` with bytes ``byte [rows, D / 32]`` as their fp32 values."""
    return x * layout.scale_value(byte)[:, :, None]


@triton.jit
def feature_rows(
    src, scales, head, seq, start, length, rows, scale_bytes_per_head, n_col_tiles,
    HEADS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
    FROM_HIGH_PRECISION: tl.constexpr, FLOOR: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Rows ``rows`` of one head of a feature-axis operand as MX blocks: (fp32 e4m3 values
    ``[BLOCK_T, D / 32, 32]``, int32 scale bytes ``[BLOCK_T, D / 32]``); rows past ``length`` are zeros.

    ``src`` holds e4m3 data with its tiled ``scales``, or high-precision values quantized here.
    """
    x = tl.reshape(_load_rows(src, head, start, rows, tl.arange(0, D), length, HEADS, D), (BLOCK_T, D // 32, 32))
    if FROM_HIGH_PRECISION:
        x, byte = quantized_feature_blocks(x, FLOOR, INTERPRET)
    else:
        padded_rows = layout.padded_seq_start(start, seq) + rows
        blocks = tl.arange(0, D // 32)
        where = layout.scale_byte_offset(padded_rows[:, None], blocks[None, :], n_col_tiles)
        in_seq = (rows < length)[:, None]
        byte = tl.load(scales + head.to(tl.int64) * scale_bytes_per_head + where, mask=in_seq, other=0).to(tl.int32)
    return x, byte


@triton.jit
def rebased_feature_rows(
    src, scales, head, seq, start, length, rows, scale_bytes_per_head, n_col_tiles,
    HEADS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, GROUP: tl.constexpr,
    FROM_HIGH_PRECISION: tl.constexpr, FLOOR: tl.constexpr, INTERPRET: tl.constexpr,
):
    """:func:`feature_rows` (``rows`` a run of BLOCK_T starting at a multiple of GROUP) rebased:
    (e4m3 ``[BLOCK_T, D]``, int32 exponent bytes ``[BLOCK_T / GROUP]`` of the groups)."""
    x, byte = feature_rows(src, scales, head, seq, start, length, rows, scale_bytes_per_head, n_col_tiles,
                           HEADS, D, BLOCK_T, FROM_HIGH_PRECISION, FLOOR, INTERPRET)
    group_byte = tl.max(tl.reshape(tl.max(byte, axis=1), (BLOCK_T // GROUP, GROUP)), axis=1)
    return fp8.to_e4m3(_onto_group_values(x, byte, group_byte, D, BLOCK_T, GROUP), INTERPRET), group_byte


@triton.jit
def _onto_group_values(x, byte, group_byte, D: tl.constexpr, BLOCK_T: tl.constexpr, GROUP: tl.constexpr):
    """MX blocks ``x [BLOCK_T, D / 32, 32]`` with bytes ``byte [BLOCK_T, D / 32]`` moved onto the bytes
    ``group_byte [BLOCK_T / GROUP]`` of their GROUP-row groups (none smaller): fp32 ``[BLOCK_T, D]``, to be
    rounded onto e4m3's grid."""
    row_byte = tl.reshape(tl.broadcast_to(group_byte[:, None], (BLOCK_T // GROUP, GROUP)), (BLOCK_T,))
    return tl.reshape(x * layout.byte_ratio(byte, row_byte[:, None])[:, :, None], (BLOCK_T, D))


@triton.jit
def dequantized_feature_rows(
    src, scales, head, seq, start, length, rows, scale_bytes_per_head, n_col_tiles,
    HEADS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
    FROM_HIGH_PRECISION: tl.constexpr, FLOOR: tl.constexpr, INTERPRET: tl.constexpr,
):
    """:func:`feature_rows` as their exact MX values ``[BLOCK_T, D]`` in bf16 (an e4m3 value times a
    power of two always fits bf16), or fp32 when interpreted (Triton 3.6's interpreter gets bf16 dots wrong)."""
    x, byte = feature_rows(src, scales, head, seq, start, length, rows, scale_bytes_per_head, n_col_tiles,
                           HEADS, D, BLOCK_T, FROM_HIGH_PRECISION, FLOOR, INTERPRET)
    values = tl.reshape(block_values(x, byte), (BLOCK_T, D))
    return values.to(tl.float32 if INTERPRET else tl.bfloat16)


@triton.jit
def _rebase_feature_kernel(
    src, scales, offsets, total, work, dst, factor, nonfinite, n_groups, scale_bytes_per_head, n_col_tiles,
    copy_feature, copy_scale, copy_token_scale, copy_sequence, padded,
    HEADS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK: tl.constexpr, GROUP: tl.constexpr,
    FROM_HIGH_PRECISION: tl.constexpr, FLOOR: tl.constexpr, EXACT: tl.constexpr, CHECK_FINITE: tl.constexpr,
    COPIES: tl.constexpr, COPY_GROUP: tl.constexpr, ORDER: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One (BLOCK_T-token tile, head), CHUNK tokens at a time. A chunk holds whole exponent groups,
    or (from high-precision values) GROUP is the whole tile: its byte then comes from a first read of
    the tile's maximum (the byte of the largest element is the largest block byte: the rule is
    monotone), and each chunk is read again (from L2, just read) to be rebased onto it. EXACT: factors all 1.
    CHECK_FINITE (high-precision values): the tile's :func:`_largest_magnitude` flagged in ``nonfinite``.
    COPIES (high-precision values): also the backward's two copies of the operand (Q's or K's), each token
    over its own scale (``token_normalized_pairs``): e4m3 ``copy_feature [total, H, D]`` with its scales in
    ``copy_scale [H, total]``, and the transposed ``copy_sequence [H, D, padded]``, its tokens in ORDER, the
    whole slot (zeros past the end); with COPY_GROUP = CHUNK (and GROUP <= CHUNK) the feature copy instead on
    one scale per CHUNK tokens from the sequence's start, the largest of their own (the largest of the chunk's
    group bytes: the rule is monotone), each token's own in ``copy_token_scale``. With COPY_GROUP = GROUP =
    BLOCK_T (K's in training) the operand itself is the feature copy: only ``copy_sequence`` is written, the
    operand's bytes from its own values in the same loop (no second read), and ``copy_scale`` holds each
    token's tile factor."""
    if COPIES:
        tl.static_assert(FROM_HIGH_PRECISION and not EXACT)
        tl.static_assert(COPY_GROUP == 1 or (COPY_GROUP == CHUNK and GROUP <= CHUNK)
                         or (COPY_GROUP == BLOCK_T and GROUP == BLOCK_T),
                         "a copy's scale group is a token, a chunk of whole exponent groups, or the operand's tile")
    OPERAND_COPIES: tl.constexpr = COPIES and COPY_GROUP == BLOCK_T
    seq, tile, start, length, _, head = claimed_tile(work, offsets, total, BLOCK_T, HEADS)
    if seq < 0:
        return
    slot_start = layout.padded_seq_start(start, seq)  # the sequence's first padded row
    tile_byte = 0
    largest = 0.0
    FIRST_READ: tl.constexpr = not EXACT and GROUP > CHUNK
    if FIRST_READ:
        tl.static_assert(FROM_HIGH_PRECISION and GROUP == BLOCK_T)
        amax = 0.0
        for chunk in range(tile * (BLOCK_T // CHUNK), (tile + 1) * (BLOCK_T // CHUNK)):
            rows = chunk * CHUNK + tl.arange(0, CHUNK)
            x = _load_rows(src, head, start, rows, tl.arange(0, D), length, HEADS, D)
            amax = tl.maximum(amax, _largest_magnitude(x, INTERPRET), propagate_nan=tl.PropagateNan.ALL)
        largest = amax  # what CHECK_FINITE flags
        tile_byte = layout.scale_byte_of_amax(amax, FLOOR)
        tl.store(factor + head.to(tl.int64) * n_groups + (slot_start + tile * BLOCK_T) // GROUP,
                 layout.scale_value(tile_byte))
    CHUNKS: tl.constexpr = BLOCK_T // CHUNK
    chunk_bytes = tl.zeros([CHUNKS], tl.int32)  # each chunk's largest group byte, for COPY_GROUP = CHUNK
    for chunk in range(tile * CHUNKS, (tile + 1) * CHUNKS):
        rows = chunk * CHUNK + tl.arange(0, CHUNK)
        if EXACT:
            rebased = dequantized_feature_rows(
                src, scales, head, seq, start, length, rows, scale_bytes_per_head, n_col_tiles,
                HEADS, D, CHUNK, FROM_HIGH_PRECISION, FLOOR, INTERPRET,
            )
        elif GROUP > CHUNK:
            x, byte = feature_rows(src, scales, head, seq, start, length, rows, scale_bytes_per_head, n_col_tiles,
                                   HEADS, D, CHUNK, FROM_HIGH_PRECISION, FLOOR, INTERPRET)
            values = _onto_group_values(x, byte, tl.zeros((1,), tl.int32) + tile_byte, D, CHUNK, CHUNK)
            rebased = fp8.to_e4m3(values, INTERPRET)
            if OPERAND_COPIES:
                # K^T from a second conversion of the same values, paired apart: cast once and stored both
                # ways, ptxas (Triton 3.6, sm_90a) merged the cast's pairs for the operand's store and left the
                # transpose's byte moves reading registers no conversion wrote (wrong K^T bytes on an H100).
                layout.store_sequence_copy(copy_sequence, fp8.to_e4m3_paired_apart(values, INTERPRET), head,
                                           tl.arange(0, D), start, seq, rows, padded, D, ORDER)  # the whole slot
                tl.store(copy_scale + head.to(tl.int64) * total + start + rows,
                         tl.zeros([CHUNK], tl.float32) + layout.scale_value(tile_byte), mask=rows < length)
        else:
            rebased, group_byte = rebased_feature_rows(
                src, scales, head, seq, start, length, rows, scale_bytes_per_head, n_col_tiles,
                HEADS, D, CHUNK, GROUP, FROM_HIGH_PRECISION, FLOOR, INTERPRET,
            )
            groups = (slot_start + chunk * CHUNK) // GROUP + tl.arange(0, CHUNK // GROUP)
            tl.store(factor + head.to(tl.int64) * n_groups + groups, layout.scale_value(group_byte))
            chunk_bytes = tl.where(tl.arange(0, CHUNKS) == chunk % CHUNKS, tl.max(group_byte, axis=0), chunk_bytes)
        tl.store(dst + _row_elements(head, start, rows, tl.arange(0, D), HEADS, D), rebased,
                 mask=(rows < length)[:, None])
        if CHECK_FINITE and not FIRST_READ:  # the chunk read again (from L1/L2), after its store: fewer registers
            largest = tl.maximum(largest, _largest_magnitude(_load_rows(src, head, start, rows, tl.arange(0, D),
                                                                        length, HEADS, D), INTERPRET),
                                 propagate_nan=tl.PropagateNan.ALL)
    if COPIES and not OPERAND_COPIES:  # after the rebase: no registers of its loop held across
        for chunk in range(tile * CHUNKS, (tile + 1) * CHUNKS):
            chunk_byte = tl.max(tl.where(tl.arange(0, CHUNKS) == chunk % CHUNKS, chunk_bytes, 0), axis=0)
            _store_backward_copies(src, head, seq, start, length, chunk, chunk_byte, total, padded, copy_feature,
                                   copy_scale, copy_token_scale, copy_sequence, HEADS, D, CHUNK, COPY_GROUP, ORDER,
                                   INTERPRET)
    if EXACT:
        groups = (slot_start + tile * BLOCK_T) // GROUP + tl.arange(0, BLOCK_T // GROUP)
        tl.store(factor + head.to(tl.int64) * n_groups + groups, tl.full((BLOCK_T // GROUP,), 1.0, dtype=tl.float32))
    if CHECK_FINITE:
        flag_nonfinite(nonfinite, largest)


@triton.jit
def _store_backward_copies(
    src, head, seq, start, length, chunk, chunk_byte, total, padded,
    copy_feature, copy_scale, copy_token_scale, copy_sequence,
    HEADS: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, COPY_GROUP: tl.constexpr, ORDER: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One chunk of :func:`_rebase_feature_kernel`'s COPIES, the chunk read again (from L2, just read) in
    halves: no registers held across. ``chunk_byte``: the chunk's largest token byte (COPY_GROUP > 1)."""
    HALF: tl.constexpr = CHUNK // 2
    for half in tl.static_range(2):
        rows = chunk * CHUNK + half * HALF + tl.arange(0, HALF)
        in_seq = rows < length
        x = _load_rows(src, head, start, rows, tl.arange(0, D), length, HEADS, D)
        token_byte = token_scale_byte(x)
        feature_byte = token_byte
        if COPY_GROUP > 1:
            feature_byte = tl.zeros_like(token_byte) + chunk_byte
            tl.store(copy_token_scale + head.to(tl.int64) * total + start + rows, layout.scale_value(token_byte),
                     mask=in_seq)
        feature = fp8.to_e4m3(x * layout.scale_factor(feature_byte)[:, None], INTERPRET)
        paired = token_normalized_pairs(x, token_byte, INTERPRET)
        tl.store(copy_feature + _row_elements(head, start, rows, tl.arange(0, D), HEADS, D),
                 feature.to(copy_feature.dtype.element_ty), mask=in_seq[:, None])
        tl.store(copy_scale + head.to(tl.int64) * total + start + rows, layout.scale_value(feature_byte), mask=in_seq)
        layout.store_sequence_copy(copy_sequence, paired.to(copy_sequence.dtype.element_ty), head, tl.arange(0, D),
                                   start, seq, rows, padded, D, ORDER)


@triton.jit
def _largest_magnitude(x, INTERPRET: tl.constexpr):
    """The largest ``|x|`` of an fp32 tile ``[rows, channels]``, NaN if it holds one (``tl.max`` drops
    NaN): what the NaN/Inf flag is formed from (a non-finite input's scale bytes are then the check's
    business, not the rule's)."""
    return max_keeping_nan(max_keeping_nan(tl.abs(x), 1, INTERPRET), 0, INTERPRET)


@triton.jit
def _row_elements(head, start, rows, channels, HEADS: tl.constexpr, D: tl.constexpr):
    """Element offsets ``[len(rows), len(channels)]`` of one head at rows ``start + rows`` of ``[total, HEADS, D]``."""
    return (start + rows)[:, None] * (HEADS * D) + head * D + channels[None, :]


@triton.jit
def _load_rows(src, head, start, rows, channels, length, HEADS: tl.constexpr, D: tl.constexpr):
    """fp32 ``[len(rows), len(channels)]`` of one head at sequence rows ``rows`` (0 past ``length``)."""
    element = _row_elements(head, start, rows, channels, HEADS, D)
    return tl.load(src + element, mask=(rows < length)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _sequence_bytes_from_scales(scales, head, seq, start, length, first_row, channels, scale_bytes_per_head,
                                n_col_tiles, BLOCK_T: tl.constexpr):
    """int32 ``[BLOCK_T / 32, len(channels)]`` stored bytes of the blocks of rows ``first_row + [0, BLOCK_T)``."""
    blocks = tl.arange(0, BLOCK_T // 32)
    column = (layout.padded_seq_start(start, seq) + first_row) // 32 + blocks
    where = layout.scale_byte_offset(channels[None, :], column[:, None], n_col_tiles)
    in_seq = (first_row + blocks * 32 < length)[:, None]
    return tl.load(scales + head.to(tl.int64) * scale_bytes_per_head + where, mask=in_seq, other=0).to(tl.int32)


@triton.jit
def _claimed_chunk(work, offsets, total, exponent, batch, HEADS: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """:func:`schedule.claimed_tile` of a sequence-axis program (grid: work slots x heads x chunks of ``BLOCK_D``
    channels, chunks fastest) with (head, its channels, their ``exponent [H, B, D]`` entries)."""
    seq, tile, start, length, rows, lane = claimed_tile(work, offsets, total, BLOCK_T, HEADS * (D // BLOCK_D))
    head = lane // (D // BLOCK_D)
    channels = lane % (D // BLOCK_D) * BLOCK_D + tl.arange(0, BLOCK_D)
    entries = exponent + (head.to(tl.int64) * batch + tl.maximum(seq, 0)) * D + channels
    return seq, tile, start, length, rows, head, channels, entries


@triton.jit
def _sequence_exponent_kernel(
    src, scales, offsets, total, work, exponent, nonfinite, batch, scale_bytes_per_head, n_col_tiles,
    group_byte, n_value_groups,
    HEADS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    FROM_HIGH_PRECISION: tl.constexpr, FLOOR: tl.constexpr, CHECK_FINITE: tl.constexpr, COPIES: tl.constexpr,
    VALUE_GROUP: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Fold the largest block byte of each channel of this program's tile into ``exponent[head, seq, :]``
    (int32, zero-initialized; the byte of the tile's maximum is the largest block byte, the rule being monotone).
    CHECK_FINITE (high-precision values): a non-finite channel maximum flagged in ``nonfinite``. COPIES
    (high-precision values): also the head_dim-axis scale byte of each VALUE_GROUP tokens from the sequence's
    start (the backward's feature copy of V), folded over the channel chunks into ``group_byte [H,
    n_value_groups]`` (int32, zero-initialized) at the group's padded row / VALUE_GROUP."""
    seq, tile, start, length, rows, head, channels, entries = _claimed_chunk(work, offsets, total, exponent, batch,
                                                                             HEADS, BLOCK_T, D, BLOCK_D)
    if seq < 0:
        return
    if FROM_HIGH_PRECISION:
        magnitudes = tl.abs(_load_rows(src, head, start, rows, channels, length, HEADS, D))
        amax = max_keeping_nan(magnitudes, 0, INTERPRET)
        if COPIES:
            groups = tl.max(tl.reshape(tl.max(magnitudes, axis=1), (BLOCK_T // VALUE_GROUP, VALUE_GROUP)), axis=1)
            first_group = (layout.padded_seq_start(start, seq) + tile * BLOCK_T) // VALUE_GROUP
            layout.fold_max(group_byte + head.to(tl.int64) * n_value_groups + first_group
                            + tl.arange(0, BLOCK_T // VALUE_GROUP), layout.scale_byte_of_amax(groups, False))
        if CHECK_FINITE:
            flag_nonfinite(nonfinite, amax)
        largest = layout.scale_byte_of_amax(amax, FLOOR)
    else:
        largest = tl.max(_sequence_bytes_from_scales(scales, head, seq, start, length, tile * BLOCK_T, channels,
                                                     scale_bytes_per_head, n_col_tiles, BLOCK_T), axis=0)
    layout.fold_max(entries, largest)


@triton.jit
def _in_load_vectors(channels, src):
    """``channels`` (a contiguous range) unchanged, as Triton's axis analysis sees them: runs of one 16-byte load
    of ``src``'s elements (8 bf16 channels). A narrower store at these offsets (V's e4m3 copy) keeps the load's
    layout, a run a thread. At the plain range it takes 16-byte vectors of its own, and the layout it asks for
    (16 channels a thread, 16 tokens across lanes) is where the whole tile gets computed: each 32-token block's
    maximum then takes more shuffle levels over more channels a thread."""
    RUN: tl.constexpr = 128 // src.dtype.element_ty.primitive_bitwidth
    return channels // RUN * RUN + channels % RUN


@triton.jit
def _rebase_sequence_kernel(
    src, scales, offsets, total, work, exponent, dst, batch, t_pad, scale_bytes_per_head, n_col_tiles,
    group_byte, n_value_groups, copy_feature, copy_scale,
    HEADS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    FROM_HIGH_PRECISION: tl.constexpr, FLOOR: tl.constexpr, ORDER: tl.constexpr, COPIES: tl.constexpr,
    VALUE_GROUP: tl.constexpr, INTERPRET: tl.constexpr,
):
    """V rebased onto its (sequence, channel) exponents and stored transposed. COPIES (high-precision values):
    also the backward's feature copy of V, e4m3 ``copy_feature [total, H, D]`` on the VALUE_GROUP-token scales of
    :func:`_sequence_exponent_kernel`'s ``group_byte``, each token's in ``copy_scale [H, total]``."""
    seq, tile, start, length, rows, head, channels, entries = _claimed_chunk(work, offsets, total, exponent, batch,
                                                                             HEADS, BLOCK_T, D, BLOCK_D)
    if seq < 0:
        return
    x = _load_rows(src, head, start, rows, channels, length, HEADS, D)
    if COPIES:
        tl.static_assert(FROM_HIGH_PRECISION)
        row_byte = tl.load(group_byte + head.to(tl.int64) * n_value_groups
                           + (layout.padded_seq_start(start, seq) + rows) // VALUE_GROUP)
        feature = fp8.to_e4m3(x * layout.scale_factor(row_byte)[:, None], INTERPRET)
        in_seq = rows < length
        tl.store(copy_feature + _row_elements(head, start, rows, _in_load_vectors(channels, src), HEADS, D),
                 feature.to(copy_feature.dtype.element_ty), mask=in_seq[:, None])
        tl.store(copy_scale + head.to(tl.int64) * total + start + rows, layout.scale_value(row_byte),
                 mask=in_seq & (tl.min(channels, axis=0) == 0))  # by the programs of the first channel chunk
    if FROM_HIGH_PRECISION:
        x = tl.reshape(x, (BLOCK_T // 32, 32, BLOCK_D))  # each channel's 32-token blocks
        byte, _ = block_scale_bytes(x, (1,), FLOOR, INTERPRET)
        x = quantize_on_bytes(x, byte[:, None, :], INTERPRET)
    else:
        byte = _sequence_bytes_from_scales(scales, head, seq, start, length, tile * BLOCK_T, channels,
                                           scale_bytes_per_head, n_col_tiles, BLOCK_T)
        x = tl.reshape(x, (BLOCK_T // 32, 32, BLOCK_D))
    rebased = fp8.to_e4m3(x * layout.byte_ratio(byte, tl.load(entries)[None, :])[:, None, :], INTERPRET)
    # Columns past the end are zeros: stored too, so a KV tile may overrun the sequence without masks.
    layout.store_sequence_copy(dst, tl.reshape(rebased, (BLOCK_T, BLOCK_D)), head, channels, start, seq, rows, t_pad,
                               D, ORDER)


def scale_args(mx: MXFP8Jagged | None, axis: str, total: int, batch: int, dim: int, device):
    """(scale buffer, bytes per head, column tiles) for a kernel; a dummy buffer for raw values."""
    col_tiles = scale_col_tiles(axis, total, batch, dim)
    if mx is None:
        return torch.empty(1, dtype=torch.uint8, device=device), 0, col_tiles
    return mx.scales.view(torch.uint8), mx.scales.shape[1], col_tiles


def _rebase_feature(values, offsets, mx, rounding, group, exact, work, nonfinite=None, copies=None,
                    order=layout.NATURAL_ORDER, copy_group=1):
    """``copies``: a :class:`Quantized` with the backward's copies of Q allocated (:func:`_token_copies`), written
    in the same pass, the feature copy on one scale per ``copy_group`` tokens, the transposed one's tokens in
    ``order``; or K's (:func:`_key_copies`, no feature copy: ``copy_group`` the whole tile, the operand is it);
    None: none."""
    if TOKENS_PER_PROGRAM % group:
        raise ValueError(f"tokens per exponent must divide {TOKENS_PER_PROGRAM}, got {group}")
    total, heads, dim = values.shape
    n_groups = padded_total(total, offsets.numel() - 1) // group
    dtype = (torch.float32 if fp8.INTERPRETED else torch.bfloat16) if exact else torch.float8_e4m3fn
    data = torch.empty(values.shape, dtype=dtype, device=values.device)
    factor = torch.empty(heads, n_groups, dtype=torch.float32, device=values.device)
    scales, per_head, col_tiles = scale_args(mx, "feature", total, offsets.numel() - 1, dim, values.device)
    chunk = FEATURE_CHUNK if mx is None else TOKENS_PER_PROGRAM  # from MXFP8: whole slots
    if work.shape[0]:
        unused = factor  # any tensor: Triton needs a pointer for outputs a launch does not write
        _rebase_feature_kernel[(work.shape[0] * heads,)](
            values, scales, offsets, total, work, data, factor, factor if nonfinite is None else nonfinite, n_groups,
            per_head, col_tiles, *((unused,) * 4 if copies is None else (
                unused if copies.feature is None else copies.feature, copies.feature_scale, copies.token_scale,
                copies.sequence)),
            padded_total(total, offsets.numel() - 1), HEADS=heads, D=dim, BLOCK_T=TOKENS_PER_PROGRAM, CHUNK=chunk,
            GROUP=group, FROM_HIGH_PRECISION=mx is None, FLOOR=rounding == "floor", EXACT=exact,
            CHECK_FINITE=nonfinite is not None, COPIES=copies is not None, COPY_GROUP=copy_group, ORDER=order,
            INTERPRET=fp8.INTERPRETED, **(FEATURE_CONFIG if copies is None else FEATURE_COPIES_CONFIG),
        )
    return data, factor


def _fitted(config: dict, dim: int) -> dict:
    """A sequence-axis launch ``config`` whose channel chunk divides ``dim`` (else one chunk of all)."""
    return config if dim % config["BLOCK_D"] == 0 else dict(config, BLOCK_D=dim)


def _rebase_sequence(values, offsets, mx, rounding, work, order=layout.NATURAL_ORDER, nonfinite=None, copies=None,
                     value_group=1):
    """``copies``: a :class:`Quantized` with V's backward feature copy allocated (feature, feature_scale),
    written by the same passes on one scale per ``value_group`` tokens from each sequence's start; None: none."""
    total, heads, dim = values.shape
    batch = offsets.numel() - 1
    t_pad = padded_total(total, batch)
    transposed = torch.empty(heads, dim, t_pad, dtype=torch.float8_e4m3fn, device=values.device)
    exponent = torch.zeros(heads, batch, dim, dtype=torch.int32, device=values.device)
    scales, per_head, col_tiles = scale_args(mx, "sequence", total, batch, dim, values.device)
    common = dict(HEADS=heads, D=dim, BLOCK_T=TOKENS_PER_PROGRAM, FROM_HIGH_PRECISION=mx is None,
                  FLOOR=rounding == "floor")
    if work.shape[0]:
        kind = "values" if mx is None else "mxfp8"
        exponent_config, config = (_fitted(configs[kind], dim) for configs in (EXPONENT_CONFIGS, SEQUENCE_CONFIGS))
        if copies is not None and t_pad % value_group:
            raise ValueError(f"tokens sharing V's scale must divide {TOKENS_PER_PROGRAM}, got {value_group}")
        groups = t_pad // value_group
        group_byte = exponent if copies is None else torch.zeros(heads, groups, dtype=torch.int32,
                                                                 device=values.device)
        copy_outputs = (exponent, exponent) if copies is None else (copies.feature, copies.feature_scale)
        common.update(COPIES=copies is not None, VALUE_GROUP=value_group, INTERPRET=fp8.INTERPRETED)
        _sequence_exponent_kernel[(work.shape[0] * heads * (dim // exponent_config["BLOCK_D"]),)](
            values, scales, offsets, total, work, exponent, exponent if nonfinite is None else nonfinite, batch,
            per_head, col_tiles, group_byte, groups, CHECK_FINITE=nonfinite is not None, **common,
            **exponent_config,
        )
        _rebase_sequence_kernel[(work.shape[0] * heads * (dim // config["BLOCK_D"]),)](
            values, scales, offsets, total, work, exponent, transposed, batch, t_pad, per_head, col_tiles,
            group_byte, groups, *copy_outputs, ORDER=order, **common, **config,
        )
    return transposed, exponent


def rebase_feature(mx: MXFP8Jagged, group: int = 1, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Feature-axis MXFP8 ``[total, H, D]`` -> (e4m3 ``[total, H, D]``, fp32 factors ``[H, padded_total / group]``).

    Tokens share one exponent per ``group`` consecutive tokens of a sequence (counted from its
    start; ``group`` divides 128). The factor of token ``i`` of sequence ``b`` sits at index
    ``(padded_seq_start(offsets[b], b) + i) // group``. With ``exact`` the data are the exact MX
    values in bf16 (fp32 when interpreted) and every factor is 1.
    """
    return _rebase_feature(mx.data, mx.offsets, mx, mx.rounding, group, exact, slot_tiles(mx.offsets, mx.total))


def quantize_rebase_feature(values: torch.Tensor, offsets: torch.Tensor, rounding: str = "rceil", group: int = 1,
                            exact: bool = False, nonfinite: torch.Tensor | None = None, keep_for: dict | None = None):
    """Like ``rebase_feature(quantize_mxfp8(values, offsets, axis="feature", rounding=rounding), group, exact)``,
    in one pass over bf16/fp16/fp32 ``values [total, H, D]``. ``nonfinite`` (fp32 ``[1]`` holding 0): set to
    NaN or Inf if ``values`` hold any (the producers' flag, ``quantize_mxfp8_kernel``'s).

    ``keep_for`` (rceil, not ``exact``; ``values`` are Q): the ``preparation`` (``Prepared``'s options) of a
    backward to come. The same pass then also writes that backward's copies of Q, the bytes
    ``quantize_for_backward`` makes (Q's e4m3 feature copy on one scale per ``query_scale_tokens`` tokens,
    1 or ``FEATURE_CHUNK``, and Q^T in ``query_order``, each token over its own scale), and keeps them for it
    (:func:`take_backward_copies`)."""
    rounding = mx_format.check_rounding(rounding)
    copies, spec = None, (layout.NATURAL_ORDER, 1)
    if keep_for is not None:
        if exact or rounding != "rceil":
            raise ValueError("the backward's copies of Q are e4m3 on rceil scales: keep_for needs exact=False, rceil")
        spec = _query_copies_spec(keep_for)
        if spec[1] not in (1, FEATURE_CHUNK):
            raise ValueError(f"Q's copy shares its scale among 1 or {FEATURE_CHUNK} tokens, got {spec[1]}")
        copies = _token_copies(values, padded_total(values.shape[0], offsets.numel() - 1), spec[1])
    operand = _rebase_feature(values, offsets, None, rounding, group, exact, slot_tiles(offsets, values.shape[0]),
                              nonfinite, copies, *spec)
    if keep_for is not None:
        _keep_copies((values, offsets), "backward copies of Q", spec, copies)
    return operand


def rebase_sequence(mx: MXFP8Jagged) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-axis MXFP8 ``[total, H, D]`` -> (e4m3 ``[H, D, padded_total]``, tokens contiguous at
    their padded rows, on one exponent per (sequence, head, channel); int32 exponent bytes ``[H, B, D]``)."""
    return _rebase_sequence(mx.data, mx.offsets, mx, mx.rounding, slot_tiles(mx.offsets, mx.total))


def quantize_rebase_sequence(values: torch.Tensor, offsets: torch.Tensor, rounding: str = "rceil"):
    """Like ``rebase_sequence(quantize_mxfp8(values, offsets, axis="sequence", rounding=rounding))``,
    reading bf16/fp16/fp32 ``values [total, H, D]`` twice (exponents, then data: see the module docstring)."""
    rounding = mx_format.check_rounding(rounding)
    return _rebase_sequence(values, offsets, None, rounding, slot_tiles(offsets, values.shape[0]))


def rebase_kv(k: MXFP8Jagged, v: MXFP8Jagged, group: int, exact: bool = False, v_order=layout.NATURAL_ORDER):
    """``(*rebase_feature(k, group, exact), *rebase_sequence(v))`` with one tile list for both passes;
    ``v_order`` (a ``layout`` token order, e.g. ``PV_ORDER``) orders V^T's keys within each 128-key tile."""
    work = slot_tiles(k.offsets, k.total)
    return (*_rebase_feature(k.data, k.offsets, k, k.rounding, group, exact, work),
            *_rebase_sequence(v.data, v.offsets, v, v.rounding, work, v_order))


def _sources(*operands: MXFP8Jagged) -> tuple[torch.Tensor, ...]:
    return tuple(t for mx in operands for t in (mx.data, mx.scales, mx.offsets))


def kept_rebase_feature(mx: MXFP8Jagged, group: int = 1, exact: bool = False):
    """:func:`rebase_feature`, built once while ``mx``'s tensors live unwritten (``reuse.derived``)."""
    return reuse.derived(_sources(mx), ("feature", group, exact), lambda: rebase_feature(mx, group, exact))


def kept_rebase_kv(k: MXFP8Jagged, v: MXFP8Jagged, group: int, exact: bool = False, v_order=layout.NATURAL_ORDER):
    """:func:`rebase_kv`, built once while ``k``'s and ``v``'s tensors live unwritten (``reuse.derived``)."""
    return reuse.derived(_sources(k, v), ("kv", group, exact, int(v_order)),
                         lambda: rebase_kv(k, v, group, exact, v_order))


def _token_copies(x: torch.Tensor, padded: int, feature_group: int) -> Quantized:
    """Unwritten e4m3 copies of Q or K ``[total, H, D]`` as ``backward_passes.Prepared`` reads them: the
    feature copy on one scale per ``feature_group`` tokens, and the transposed copy ``[H, D, padded]``."""
    return Quantized.unwritten(x, padded, feature_dtype=torch.float8_e4m3fn, feature_group=feature_group,
                               sequence_dtype=torch.float8_e4m3fn)


def _key_copies(k: torch.Tensor, padded: int) -> Quantized:
    """Unwritten e4m3 copies of K as ``backward_passes.Prepared`` reads them on the FP8 path: K^T ``[H, D,
    padded]`` holding the bytes of the forward's own operand (one exponent per key tile) and each token's
    factor, its tile's; the feature copy is that operand itself (set once it is written)."""
    heads, dim = k.shape[1], k.shape[2]
    scale = torch.empty(heads, k.shape[0], dtype=torch.float32, device=k.device)
    return Quantized(feature_scale=scale, token_scale=scale,
                     sequence=torch.empty(heads, dim, padded, dtype=torch.float8_e4m3fn, device=k.device))


def _value_copies(v: torch.Tensor, padded: int) -> Quantized:
    """Unwritten e4m3 copies of V as ``backward_passes.Prepared`` reads them: its feature copy with its scales,
    and no token's own scale (the forward's V passes do not form it, and no backward kernel reads V's)."""
    copies = Quantized.unwritten(v, padded, feature_dtype=torch.float8_e4m3fn)
    copies.token_scale = None
    return copies


def _rebase_key_copies(k, offsets, copies, key_order, work, nonfinite=None):
    """K's forward operand (:func:`quantize_rebase_feature`'s, one exponent per ``TOKENS_PER_PROGRAM`` keys) and,
    in the same pass, K's copies ``copies`` (:func:`_key_copies`) from its bytes, K^T in ``key_order``."""
    operand = _rebase_feature(k, offsets, None, "rceil", TOKENS_PER_PROGRAM, False, work, nonfinite, copies,
                              key_order, copy_group=TOKENS_PER_PROGRAM)
    copies.feature = operand[0]
    return operand


def key_copies(k: torch.Tensor, offsets: torch.Tensor, key_order, tiles: torch.Tensor | None = None) -> Quantized:
    """K's copies for the FP8 backward where the forward kept none (:func:`_key_copies`, K^T in ``key_order``),
    made now by the pass that makes the forward's operand of K, so that the backward reads K in that form
    (``tiles``: ``offsets``' slot table, made here when not given)."""
    copies = _key_copies(k, padded_total(k.shape[0], offsets.numel() - 1))
    _rebase_key_copies(k, offsets, copies, key_order, slot_tiles(offsets, k.shape[0]) if tiles is None else tiles)
    return copies


def _copies_spec(preparation: dict) -> tuple[int, int]:
    """What a backward's copies of K and V depend on in its ``preparation`` (``Prepared``'s options)."""
    return int(preparation["key_order"]), int(preparation["value_scale_tokens"])


def _query_copies_spec(preparation: dict) -> tuple[int, int]:
    """What a backward's copies of Q depend on in its ``preparation``: (Q^T's token order, tokens a scale)."""
    return int(preparation["query_order"]), int(preparation["query_scale_tokens"])


def quantize_rebase_kv(k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, group: int, exact: bool = False,
                       v_order=layout.NATURAL_ORDER, nonfinite: torch.Tensor | None = None,
                       keep_for: dict | None = None):
    """``(*quantize_rebase_feature(k, offsets, "rceil", group, exact), *quantize_rebase_sequence(v, offsets))``
    with one tile list for both passes (``v_order`` as in :func:`rebase_kv`); ``nonfinite``: fp32 ``[2]``
    holding 0, K's and V's NaN/Inf flags (``quantize_rebase_feature``'s ``nonfinite``).

    ``keep_for`` (not ``exact``, ``group`` a whole key tile): the ``preparation`` (``Prepared``'s options) of a
    backward to come. The same passes then also write, from the same reads of K and V, that backward's copies
    of them and keep them for it (:func:`take_backward_copies`; ``reuse.keep``: until taken or until ``k`` is
    freed): K's operand itself and K^T of its bytes in ``key_order`` (:func:`_key_copies`), and the bytes
    ``quantize_for_backward`` makes of V (its e4m3 feature copy on one scale per ``value_scale_tokens``
    tokens)."""
    if keep_for is not None and exact:
        raise ValueError("the backward's copies of K and V are e4m3: keep_for needs exact=False")
    if keep_for is not None and group != TOKENS_PER_PROGRAM:
        raise ValueError(f"the backward reads K's operand in {TOKENS_PER_PROGRAM}-key tiles: keep_for needs "
                         f"group={TOKENS_PER_PROGRAM}, got {group}")
    total = k.shape[0]
    work = slot_tiles(offsets, total)
    k_flag, v_flag = (None, None) if nonfinite is None else (nonfinite[:1], nonfinite[1:])
    if keep_for is None:
        k_operand = _rebase_feature(k, offsets, None, "rceil", group, exact, work, k_flag)
        v_copies, value_group = None, 1
    else:
        padded = padded_total(total, offsets.numel() - 1)
        k_copies, v_copies = _key_copies(k, padded), _value_copies(v, padded)
        key_order, value_group = _copies_spec(keep_for)
        k_operand = _rebase_key_copies(k, offsets, k_copies, key_order, work, k_flag)
    operands = (*k_operand, *_rebase_sequence(v, offsets, None, "rceil", work, v_order, v_flag, v_copies, value_group))
    if keep_for is not None:
        _keep_copies((k, v, offsets), "backward copies", _copies_spec(keep_for), (k_copies, v_copies))
    return operands


def _keep_copies(sources: tuple, label: str, spec: tuple, copies) -> None:
    """Keep a backward's ``copies`` of ``sources`` (``reuse.keep``), with the ``spec`` they were made for."""
    reuse.keep(sources, label, (spec, copies))


def _take_copies(sources: tuple, label: str, spec: tuple):
    """The copies :func:`_keep_copies` kept of ``sources``, None unless made for ``spec``; no longer kept."""
    kept = reuse.take(sources, label)
    return kept[1] if kept is not None and kept[0] == spec else None


def take_kv_copies(k, v, offsets_k, preparation: dict):
    """(K's copies, V's) that :func:`quantize_rebase_kv` kept for the backward of these tensors, None unless made
    for this backward's ``preparation``; no longer kept."""
    return _take_copies((k, v, offsets_k), "backward copies", _copies_spec(preparation))


def take_backward_copies(q, k, v, offsets_q, offsets_k, preparation: dict):
    """(Q's copies, K's and V's) that :func:`quantize_rebase_feature` and :func:`quantize_rebase_kv` kept for the
    backward of these tensors, each None unless made for this backward's ``preparation``; no longer kept."""
    return (_take_copies((q, offsets_q), "backward copies of Q", _query_copies_spec(preparation)),
            take_kv_copies(k, v, offsets_k, preparation))

