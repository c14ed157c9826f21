"""Triton versions of the layout and rounding rules, built from their one owner module each.

Kernels import these instead of re-deriving offsets: ``triton.jit`` wraps the very functions the
torch front end calls (they are plain integer arithmetic), so there is one source of truth. The
token orders of the sequence-axis copies live here too, with their register relabeling for both
Triton and Gluon tensors, and the Gluon kernels' wgmma accumulator layout.
"""

import math

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from jagged_attn import mx_format, offsets, scale_layout

padded_seq_start = triton.jit(offsets.padded_seq_start)
padded_tile = triton.jit(offsets.padded_tile)
# Constants of the attention math every kernel shares (``gl.constexpr`` is the same type).
LOG2E = tl.constexpr(1.0 / math.log(2.0))
LN2 = tl.constexpr(math.log(2.0))
P_STATIC_EXP = tl.constexpr(mx_format.P_STATIC_EXP)  # P is cast to e4m3 as P * 2^P_STATIC_EXP
P_SCALE = tl.constexpr(2.0**mx_format.P_STATIC_EXP)
FINITE_FLOOR = tl.constexpr(-1.0e30)  # initial row maximum: finite, so exp2(m_old - m_new) never sees inf - inf
# How the attention kernels compute S (and the backward's dP): FP8 MMA on the rebased e4m3 operands, or a
# bf16 MMA on the exact MX values (fp32 accumulation: exact S).
SCORE_MODES = ("fp8", "bf16")


def pv_key_slot(key):
    """Column of a key (its index within a 128-key tile) in the V^T copy that ``sm90.forward``
    reads: key bits 1, 2, 3 move to 2, 3, 1. In that order the registers of P as the S wgmma's
    accumulator are, unchanged, the A operand of the P·V wgmma (no shuffles). The map stays
    inside each 16-key group, so it serves any multiple of 16 keys as reduction: the backward
    (``sm90.backward``) stores its 64-token Q^T and dO^T tiles in this order too."""
    return (key & ~0xE) | ((key & 0x2) << 1) | ((key & 0x4) << 1) | ((key >> 2) & 0x2)


def ds_key_slot(key):
    """Column of a key in the K^T copy that ``sm90.backward``'s dQ wgmmas read: key bit 3 moves to
    bit 0, bits 0-2 to 1-3 (inside each 16-key group). A thread holds keys r and r + 8 of each 16
    of dS^T (a wgmma accumulator, keys as rows); in this order they are adjacent bytes of dS's
    key-contiguous rows (FP8 wgmma reads only K-major operands): each thread packs its pairs into 16-bit
    elements, which a transposing ``stmatrix`` writes as those rows, with no bytes moved between registers."""
    return (key & ~0xF) | ((key >> 3) & 0x1) | ((key & 0x7) << 1)


PV_KEY_BITS = 7  # a 128-key tile


def key_order_dims(key_slot, bits: int = PV_KEY_BITS) -> list[int]:
    """A key order (``pv_key_slot``, ``ds_key_slot``) as a dimension order: a ``[rows, 2^bits]``
    tile reshaped to ``[rows, 2, ..., 2]`` (key bit ``bits - 1`` first) and permuted by this order
    holds, at column ``key_slot(c)``, column ``c``."""
    source_bit = {key_slot(1 << bit).bit_length() - 1: bit for bit in range(bits)}
    return [0] + [bits - source_bit[bit] for bit in reversed(range(bits))]


PV_KEY_DIMS = tl.constexpr(tuple(key_order_dims(pv_key_slot)))
# Token orders of a sequence-axis copy inside each 128-token slot (``store_sequence_copy``).
NATURAL_ORDER, PV_ORDER, DS_ORDER = (tl.constexpr(order) for order in range(3))
ORDER_NAMES = ("NATURAL_ORDER", "PV_ORDER", "DS_ORDER")  # by value, for messages


@gluon.constexpr_function
def _column_bits_shape(rows, columns):
    """``[rows, 2, ..., 2]``: a ``[rows, columns]`` tile (columns a power of two) with each column bit
    as a dimension of its own, the highest bit first (what ``key_order_dims`` orders)."""
    return [rows] + [2] * (columns.bit_length() - 1)


@triton.jit
def columns_in_key_order(x, KEY_DIMS: tl.constexpr):
    """A ``[rows, 2^bits]`` tile with column ``c`` moved to column ``key_slot(c)`` of the order whose
    ``key_order_dims`` are KEY_DIMS, in registers: how the producers store V^T, Q^T, dO^T
    (``pv_key_slot``) and K^T (``ds_key_slot``) for the Gluon kernels."""
    split = tl.reshape(x, _column_bits_shape(x.shape[0], x.shape[1]))
    return tl.reshape(tl.permute(split, KEY_DIMS.value), [x.shape[0], x.shape[1]])


@gluon.constexpr_function
def wgmma_accumulator_layout(columns, operand_bits=8):
    """Register layout of a warpgroup's m64 x ``columns`` wgmma accumulator (four warps over its 64
    rows) whose operands are ``operand_bits`` wide: one instruction reduces 32 bytes of them."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, columns, 256 // operand_bits])


@gluon.jit
def gluon_columns_in_key_order(x, KEY_DIMS: gl.constexpr):
    """:func:`columns_in_key_order` of a Gluon register tensor. On a wgmma accumulator it is a pure
    relabeling of registers, which is what the Gluon kernels build on: in ``pv_key_slot`` order an
    accumulator's registers are an A operand as they lie, in ``ds_key_slot`` order a transposed
    accumulator's key pairs are adjacent bytes."""
    split = x.reshape(_column_bits_shape(x.shape[0], x.shape[1]))
    return split.permute(KEY_DIMS.value).reshape([x.shape[0], x.shape[1]])


@gluon.constexpr_function
def whole_rows_layout(columns, warps):
    """A register layout of ``[rows, columns]`` tiles in which each warp holds whole rows, 8 values
    (16 bytes at 16 bits) per thread: its global stores write whole rows, where a wgmma accumulator's
    write 16-byte pieces of 8 rows per instruction."""
    return gl.BlockedLayout([1, 8], [32 // (columns // 8), columns // 8], [warps, 1], [1, 0])


@gluon.constexpr_function
def staging_pieces(tile_bits, tile_columns, buffer_bits, buffer_columns):
    """Column pieces in which :func:`gluon_store_rows_through` moves a tile through a shared buffer of
    the same rows (elements of ``tile_bits`` and ``buffer_bits``): 1 or less, whole; 2, in halves;
    more, not at all (stored straight)."""
    return (tile_bits * tile_columns) // (buffer_bits * buffer_columns)


@gluon.jit
def _store_rows(tile, dst, column0, row_stride, valid_rows):
    """``tile`` stored from its own register layout at ``dst + r * row_stride + column0 + c`` for rows
    r < valid_rows."""
    rows = gl.arange(0, tile.shape[0], layout=gl.SliceLayout(1, tile.type.layout))
    columns = column0 + gl.arange(0, tile.shape[1], layout=gl.SliceLayout(0, tile.type.layout))
    gl.store(dst + rows[:, None] * row_stride + columns[None, :], tile, mask=(rows < valid_rows)[:, None])


@gluon.jit
def _store_rows_piece(piece, dst, column0, row_stride, valid_rows, buffer):
    """``piece`` through ``buffer`` (reinterpreted to its shape and dtype) into whole rows, then
    :func:`_store_rows`."""
    stage_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([piece.shape[0], piece.shape[1]], piece.dtype)
    stage = buffer._reinterpret(piece.dtype, [piece.shape[0], piece.shape[1]], stage_layout)
    stage.store(piece)
    gl.thread_barrier()
    _store_rows(stage.load(whole_rows_layout(piece.shape[1], gl.num_warps())), dst, column0, row_stride, valid_rows)


@gluon.jit
def gluon_store_rows_through(tile, dst, row_stride, valid_rows, buffer):
    """Store the register tile ``tile`` (``[rows, columns]``, any layout) at ``dst + r * row_stride + c``
    for rows r < valid_rows, moved through the calling warps' free shared ``buffer`` (``rows`` rows of
    the tile's bytes, or of half of them: then one column half after the other) into
    :func:`whole_rows_layout` first: straight from a wgmma accumulator layout each store writes 16-byte
    pieces of 8 rows, which costs short programs much of their time (docs/perf-history.md). Barriers of
    the calling warps lie between each piece's store and load and between the pieces. A tile of more than
    twice the buffer's bytes is stored straight."""
    PIECES: gl.constexpr = staging_pieces(tile.dtype.primitive_bitwidth, tile.shape[1],
                                          buffer.dtype.primitive_bitwidth, buffer.shape[1])
    gl.static_assert(tile.shape[0] == buffer.shape[0], "the buffer holds the tile's rows")
    if PIECES <= 1:
        _store_rows_piece(tile, dst, 0, row_stride, valid_rows, buffer)
    elif PIECES == 2:
        # The top column bit of a wgmma accumulator is a register bit: the split moves no data.
        HALF: gl.constexpr = tile.shape[1] // 2
        left, right = tile.reshape([tile.shape[0], 2, HALF]).permute((0, 2, 1)).split()
        _store_rows_piece(left, dst, 0, row_stride, valid_rows, buffer)
        gl.thread_barrier()  # every warp has read the left half before the right one overwrites it
        _store_rows_piece(right, dst, HALF, row_stride, valid_rows, buffer)
    else:
        _store_rows(tile, dst, 0, row_stride, valid_rows)


# key_order_dims of each order for tiles of 2^4 .. 2^7 tokens: both orders move tokens only inside
# 16-token groups, so any power of two from 16 has one.
_ORDER_DIMS = tl.constexpr(tuple(tuple(tuple(key_order_dims(slot, bits)) for bits in range(4, PV_KEY_BITS + 1))
                                 for slot in (pv_key_slot, ds_key_slot)))


@gluon.constexpr_function
def _order_dims(order, columns):
    """``key_order_dims`` of token ORDER ``PV_ORDER`` or ``DS_ORDER`` for a tile of ``columns`` tokens."""
    return tl.constexpr(_ORDER_DIMS.value[order - PV_ORDER.value][columns.bit_length() - 5])


@triton.jit
def store_sequence_copy(dst, tile, head, channels, seq_start, seq, rows, padded_total, D: tl.constexpr,
                        ORDER: tl.constexpr):
    """Store one head's ``[len(rows), len(channels)]`` tile of sequence ``seq`` (``rows`` counted
    inside it) transposed into a sequence-axis copy ``[H, D, padded_total]``: each channel's tokens
    contiguous, token ``i`` at column ``padded_seq_start + i``; with ORDER ``PV_ORDER`` or
    ``DS_ORDER`` the tile is whole 16-token groups of a slot (a power of two of them), its tokens in
    ``pv_key_slot`` or ``ds_key_slot`` order (what the Gluon kernels read)."""
    data = tl.trans(tile)  # in registers, so that each channel's tokens are stored contiguously
    if ORDER != NATURAL_ORDER:
        data = columns_in_key_order(data, _order_dims(ORDER, data.shape[1]))
    columns = padded_seq_start(seq_start, seq) + rows
    tl.store(dst + (head.to(tl.int64) * D + channels[:, None]) * padded_total + columns[None, :], data)


scale_tile_offset = triton.jit(scale_layout.scale_tile_offset)
scale_tile_base = triton.jit(scale_layout.scale_tile_base)
rceil_scale_byte = triton.jit(mx_format.rceil_scale_byte)
floor_scale_byte = triton.jit(mx_format.floor_scale_byte)


@triton.jit
def sequence_span(offsets, seq, total):
    """(first row as int64, length as int32) of sequence ``seq`` of a jagged ``offsets`` array over
    ``total`` rows, forced into ``[0, total]``: valid offsets give their own span, and offsets rewritten
    after they were validated (where torch's version counter does not see: a numpy array under
    ``torch.from_numpy``, ``.data``) give wrong rows, never a row outside the tensor, to a kernel that
    keeps inside its sequence's span."""
    start = tl.minimum(tl.maximum(tl.load(offsets + seq).to(tl.int64), 0), total)
    end = tl.minimum(tl.maximum(tl.load(offsets + seq + 1).to(tl.int64), start), total)
    return start, (end - start).to(tl.int32)


@triton.jit
def owning_sequence(index, offsets, batch, search_steps, block, PADDED_TILES: tl.constexpr):
    """The sequence that owns each ``index``: of a token row (< total), the last ``b`` with
    ``offsets[b] <= index``; with ``PADDED_TILES``, of a tile in the ``offsets.padded_tile`` placement
    of ``block``-row tiles, the last ``b`` with ``padded_tile(offsets[b], b, block) <= index``. Found
    in ``search_steps = batch.bit_length()`` halving steps."""
    seq = tl.zeros_like(index)
    for i in range(search_steps):
        probe = seq + (1 << (search_steps - 1 - i))
        below = probe < batch  # sequence ``batch`` starts past every index: never the answer
        first = tl.load(offsets + probe, mask=below, other=0)
        if PADDED_TILES:
            first = padded_tile(first, probe, block)
        seq = tl.where(below & (first <= index), probe, seq)
    return seq


@triton.jit
def padded_rows_of(rows, offsets, batch, search_steps, total):
    """Padded row (``offsets.padded_seq_start`` placement) of each token row in ``rows`` (< ``total``), for
    kernels whose tiles ignore sequence boundaries (``search_steps = batch.bit_length()``); inside the
    padded rows of ``total`` whatever ``offsets`` hold (see :func:`sequence_span`)."""
    seq = owning_sequence(rows, offsets, batch, search_steps, 1, False)
    start = tl.minimum(sequence_span(offsets, seq, total)[0], rows)
    return padded_seq_start(start, seq) + rows - start


@triton.jit
def scale_byte_offset(row, col, n_col_tiles):
    """Byte offset of scale-matrix entry (row, col) in one head's tiled buffer."""
    return scale_tile_base(row // 128, col // 4, n_col_tiles) + scale_tile_offset(row % 128, col % 4)


@triton.jit
def scale_byte_of_amax(amax, FLOOR: tl.constexpr):
    """int32 E8M0 byte of fp32 block maxima by ``mx_format``'s rule (rceil, or floor), from their bits."""
    bits = amax.to(tl.int32, bitcast=True)
    if FLOOR:
        return floor_scale_byte(bits)
    return rceil_scale_byte(bits)


@triton.jit
def scale_factor(byte):
    """Exact fp32 ``2^(127 - byte)`` for E8M0 bytes in [0, 254] (byte 254 gives the subnormal
    2^-127): multiplying a block by it maps the block onto the e4m3 range."""
    bits = tl.where(byte < 254, (254 - byte) << 23, 0x00400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def scale_value(byte):
    """Exact fp32 ``2^(byte - 127)``, the value of an E8M0 byte in [0, 254] (byte 0: subnormal 2^-127)."""
    bits = tl.where(byte > 0, byte << 23, 0x00400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def scale_inverse(scale):
    """``1 / scale`` for fp32 power-of-two scales (exact), 0 where the scale is 0 (an all-zero token)."""
    return tl.where(scale > 0, 1.0 / tl.maximum(scale, 2.0**-126), 0.0)


@triton.jit
def byte_ratio(byte, larger_byte):
    """Exact fp32 ``2^(byte - larger_byte)`` (<= 1) for E8M0 bytes ``byte <= larger_byte``: the factor
    that moves values from one block scale onto a larger one (below 2^-127 it stays 2^-127, far
    under anything an e4m3 grid or an fp32 accumulator of such values resolves)."""
    return scale_value(tl.maximum(byte - larger_byte + 127, 0))


SMALLEST_NORMAL_BYTE = tl.constexpr(1)  # E8M0 byte of 2^-126: where a running tile scale starts


@triton.jit
def grown_scale_byte(amax, running_byte):
    """A running per-tile E8M0 scale (rceil) after one more tile of absolute maximum ``amax``: (new
    byte = max(running_byte, the tile's own byte), ``2^(running_byte - new byte)`` <= 1, the factor
    that brings an accumulator kept in units of the old scale to the new one)."""
    return raised_scale_byte(scale_byte_of_amax(amax, False), running_byte)


@triton.jit
def raised_scale_byte(byte, running_byte):
    """:func:`grown_scale_byte` from a byte the running scale must reach: (max(running_byte, byte), the
    factor ``2^(running_byte - that)``)."""
    raised = tl.maximum(byte, running_byte)
    return raised, byte_ratio(running_byte, raised)


@triton.jit
def slot_program(LANES: tl.constexpr):
    """(work slot, lane) of this program when grid axis 0 runs over ``slots x LANES`` programs, lanes
    fastest: the programs of one slot (its heads, its channel chunks) run together, so that the token
    rows they share are read and written whole at about the same time."""
    program = tl.program_id(0)
    return program // LANES, program % LANES


@triton.jit
def fold_max(target, values):
    """``target = max(target, values)`` for int32 (a scalar or a vector of addresses), by atomics only
    where ``values`` exceed what ``target`` held when read. The programs folding into the same few
    addresses (a sequence's channel maxima) mostly bring nothing new, and their atomics queue on
    those addresses; a stale read only costs an atomic."""
    tl.atomic_max(target, values, mask=values > tl.load(target), sem="relaxed")


@triton.jit
def grid_split(outer):
    """(inner, outer) index of this program when grid axis 0 runs over ``inner x outer`` programs,
    inner fastest: (tile, sequence) where a grid holds more sequences than axes 1 and 2 allow
    (65535)."""
    inner = tl.num_programs(0) // outer
    program = tl.program_id(0)
    return program % inner, program // inner
