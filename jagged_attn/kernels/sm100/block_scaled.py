"""Spec-exact MXFP8 attention on ``tl.dot_scaled``, forward and backward (backend ``"block-scaled"``).

Every GEMM takes its operands as e4m3 values plus E8M0 scales per 32 elements along K, read
straight from the tiled jagged scale buffers of :class:`~jagged_attn.mxfp8.MXFP8Jagged` (the
bytes a Blackwell TMA load would move into tensor memory). On sm_100 Triton lowers each
``tl.dot_scaled`` to ``tcgen05.mma ... kind::mxf8f6f4.block_scale`` (this needs 128-row A tiles);
on Hopper it emulates the scaled MMA by upcasting to bf16, so there this path is the slow,
spec-faithful cross-check of the fast kernels.

The arithmetic is the reference backend's (``jagged_attn.reference``), so that the only
difference is the fp32 accumulation order:

* P = exp2(s - rowmax) uses the *final* row max, as the reference, so the forward makes two
  passes over the keys (row max, then P, row sum and P V); P is cast to
  e4m3 as P * 2^8 with the static scale byte 127 - 8, the row sum uses the unquantized P.
* The backward recomputes P = exp(S - LSE); dS = P * (dP - Delta) is quantized with one scale per
  32 x 32 tile, replicated over the tile's 32 rows because ``dot_scaled`` takes one scale per
  (row, 32-wide K block); the same bytes serve dS (for dQ) and dS^T (for dK).

Scale placement comes from ``jagged_attn.kernels.common.layout`` (the owner modules' formulas).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.experimental.gluon._runtime import constexpr_function
from triton.language.core import _aggregate as aggregate  # Triton 3.6 does not export it yet

from jagged_attn import mx_format
from jagged_attn.mxfp8 import MXFP8Jagged, scale_col_tiles
from jagged_attn.offsets import max_length

from ..common import bounds, fp8
from ..common.layout import (
    LN2,
    LOG2E,
    P_SCALE,
    grid_split,
    padded_seq_start,
    scale_byte_of_amax,
    scale_byte_offset,
    scale_factor,
    sequence_span,
)

MX_BLOCK = tl.constexpr(mx_format.BLOCK_SIZE)
P_SCALE_BYTE = tl.constexpr(mx_format.E8M0_BIAS - mx_format.P_STATIC_EXP)

# sm_100's block-scaled MMA needs 128-row A tiles: every dot_scaled below has M = 128.
BLOCK_M = 128
BLOCK_N = 128
DKDV_BLOCK_M = 64  # query tile of the dK/dV kernel (see dkdv_kernel)
HEAD_DIMS = (64, 128)
NUM_WARPS = 8
NUM_STAGES = 3


@aggregate
class Operand:
    """A quantized tensor where a kernel reads it: e4m3 ``data`` ``[total, heads, D]`` and its tiled E8M0
    scale buffer ``scales`` (uint8, ``head_bytes`` from one head to the next)."""

    data: tl.tensor
    scales: tl.tensor
    head_bytes: tl.tensor

    @constexpr_function
    def __init__(self, data, scales, head_bytes):
        self.data, self.scales, self.head_bytes = data, scales, head_bytes


@aggregate
class Span:
    """One sequence of the batch: its first token, its first row in the padded scale layout, its length."""

    start: tl.tensor
    padded: tl.tensor
    length: tl.tensor

    @constexpr_function
    def __init__(self, start, padded, length):
        self.start, self.padded, self.length = start, padded, length


@aggregate
class ScaledRows:
    """One ``tl.dot_scaled`` operand: e4m3 ``values`` ``[R, D]`` (0 past the sequence) and its uint8 ``scales``,
    ``[R, D / 32]`` along head_dim (feature axis) or ``[D, R / 32]`` along the tokens (sequence axis)."""

    values: tl.tensor
    scales: tl.tensor

    @constexpr_function
    def __init__(self, values, scales):
        self.values, self.scales = values, scales


@triton.jit
def span_of(offsets, seq, total):
    """The :class:`Span` of sequence ``seq`` of a batch of ``total`` tokens."""
    start, length = sequence_span(offsets, seq, total)
    return Span(start, padded_seq_start(start, seq), length)


@triton.jit
def load_tokens(ptr, first_token, tokens, length, head, heads, D: tl.constexpr):
    """``[len(tokens), D]`` rows ``first_token + tokens`` of one head of ``[total, heads, D]``; 0 past ``length``."""
    channels = tl.arange(0, D)
    offsets = ((first_token + tokens[:, None]) * heads + head) * D + channels[None, :]
    return tl.load(ptr + offsets, mask=tokens[:, None] < length, other=0.0)


@triton.jit
def feature_rows(src, span, tokens, head, heads, D: tl.constexpr, COL_TILES: tl.constexpr):
    """:class:`ScaledRows` of tokens ``tokens`` of ``span`` in one head of ``src`` (an :class:`Operand`
    quantized along head_dim): scales ``[len(tokens), D / 32]``."""
    values = load_tokens(src.data, span.start, tokens, span.length, head, heads, D)
    blocks = tl.arange(0, D // MX_BLOCK)
    byte = scale_byte_offset(span.padded + tokens[:, None], blocks[None, :], COL_TILES)
    return ScaledRows(values, tl.load(src.scales + head * src.head_bytes + byte))


@triton.jit
def sequence_rows(src, span, first_token, head, heads, col_tiles, D: tl.constexpr, TOKENS: tl.constexpr):
    """:class:`ScaledRows` of tokens ``first_token ...`` (a multiple of 32) of ``span`` in one head of ``src``
    (quantized along the sequence): scales ``[D, TOKENS / 32]``.

    Sequence-axis columns are 32-token blocks of the padded row numbering (``mxfp8.sequence_block_columns``).
    """
    values = load_tokens(src.data, span.start, first_token + tl.arange(0, TOKENS), span.length, head, heads, D)
    channels = tl.arange(0, D)
    columns = (span.padded + first_token) // MX_BLOCK + tl.arange(0, TOKENS // MX_BLOCK)
    byte = scale_byte_offset(channels[:, None], columns[None, :], col_tiles)
    return ScaledRows(values, tl.load(src.scales + head * src.head_bytes + byte))


@triton.jit
def visible(queries, keys, len_q, len_k, CAUSAL: tl.constexpr):
    """bool, the broadcast of 2-D index tiles ``queries`` and ``keys``: in range and, when causal,
    seen (``bounds``)."""
    mask = (queries < len_q) & (keys < len_k)
    if CAUSAL:
        mask = mask & bounds.sees(queries, keys, bounds.diagonal(len_q, len_k))
    return mask


@triton.jit
def visible_keys_end(tile, len_q, len_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """One past the last key that query tile ``tile`` sees."""
    if CAUSAL:
        return bounds.keys_seen_below((tile + 1) * BLOCK_M, len_k, bounds.diagonal(len_q, len_k))
    return len_k


@triton.jit
def per_row(tile_bytes, ROWS: tl.constexpr, COL_BLOCKS: tl.constexpr):
    """uint8 ``[ROWS, COL_BLOCKS]`` from one byte per 32 x 32 tile ``[ROWS / 32, COL_BLOCKS]``."""
    rows = tl.broadcast_to(tile_bytes[:, None, :], (ROWS // MX_BLOCK, MX_BLOCK, COL_BLOCKS))
    return tl.reshape(rows, (ROWS, COL_BLOCKS)).to(tl.uint8)


@triton.jit
def quantize_square_tiles(x, ROWS: tl.constexpr, COLS: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``[ROWS, COLS]`` -> (e4m3 values, int32 rceil scale byte per 32 x 32 tile ``[ROWS/32, COLS/32]``)."""
    tiles = tl.reshape(tl.abs(x), (ROWS // MX_BLOCK, MX_BLOCK, COLS // MX_BLOCK, MX_BLOCK))
    amax = tl.max(tl.max(tiles, axis=3), axis=1)
    byte = scale_byte_of_amax(amax, False)
    inverse_scale = scale_factor(byte)
    per_element = tl.broadcast_to(
        inverse_scale[:, None, :, None], (ROWS // MX_BLOCK, MX_BLOCK, COLS // MX_BLOCK, MX_BLOCK)
    )
    return fp8.to_e4m3(x * tl.reshape(per_element, (ROWS, COLS)), INTERPRET), byte


# Triton 3.6 cannot compile (for sm_100) a scaled MMA inside a loop whose accumulator starts from a
# loop-invariant value such as zeros, so the fresh products start from a term that varies with the
# tile: the mask bias for S, -Delta for dP.


@triton.jit
def scores_log2(lhs, rhs, mask, qk_scale_log2):
    """S = lhs rhs^T * softmax_scale * log2(e) of two feature-axis :class:`ScaledRows`, -inf where ``mask`` is
    false."""
    bias = tl.where(mask, 0.0, float("-inf"))
    return tl.dot_scaled(lhs.values, lhs.scales, "e4m3", tl.trans(rhs.values), rhs.scales, "e4m3", bias) * qk_scale_log2


@triton.jit
def forward_kernel(
    q_ptr, q_scales, k_ptr, k_scales, v_ptr, v_scales, out_ptr, lse_ptr, offsets_q, offsets_k, batch, total_q,
    total_k, q_head_bytes, k_head_bytes, v_head_bytes, v_col_tiles, qk_scale_log2, heads_q, heads_kv,
    D: tl.constexpr, FEATURE_COL_TILES: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One (query tile, sequence, query head): out ``[BLOCK_M, D]`` and LSE, two passes over the keys."""
    tile, seq = grid_split(batch)
    head = tl.program_id(1)
    queries = span_of(offsets_q, seq, total_q)
    keys = span_of(offsets_k, seq, total_k)
    len_q, len_k = queries.length, keys.length
    if tile * BLOCK_M >= len_q:
        return
    kv_head = head // (heads_q // heads_kv)
    k_src = Operand(k_ptr, k_scales, k_head_bytes)
    v_src = Operand(v_ptr, v_scales, v_head_bytes)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    q = feature_rows(Operand(q_ptr, q_scales, q_head_bytes), queries, rows, head, heads_q, D, FEATURE_COL_TILES)
    keys_end = visible_keys_end(tile, len_q, len_k, CAUSAL, BLOCK_M)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for first_key in range(0, keys_end, BLOCK_N):
        cols = first_key + tl.arange(0, BLOCK_N)
        k = feature_rows(k_src, keys, cols, kv_head, heads_kv, D, FEATURE_COL_TILES)
        s = scores_log2(q, k, visible(rows[:, None], cols[None, :], len_q, len_k, CAUSAL), qk_scale_log2)
        row_max = tl.maximum(row_max, tl.max(s, axis=1))
    # the final row max, as the reference; rows that see no key: P = 0
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)

    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    p_scale = tl.full([BLOCK_M, BLOCK_N // MX_BLOCK], P_SCALE_BYTE, tl.uint8)
    for first_key in range(0, keys_end, BLOCK_N):
        cols = first_key + tl.arange(0, BLOCK_N)
        k = feature_rows(k_src, keys, cols, kv_head, heads_kv, D, FEATURE_COL_TILES)
        s = scores_log2(q, k, visible(rows[:, None], cols[None, :], len_q, len_k, CAUSAL), qk_scale_log2)
        p = tl.exp2(s - row_max[:, None])
        row_sum += tl.sum(p, axis=1)
        v = sequence_rows(v_src, keys, first_key, kv_head, heads_kv, v_col_tiles, D, BLOCK_N)
        p8 = fp8.to_e4m3(p * P_SCALE, INTERPRET)
        acc = tl.dot_scaled(p8, p_scale, "e4m3", v.values, v.scales, "e4m3", acc)

    seen = row_sum > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, row_sum, 1.0)[:, None], 0.0)
    lse = tl.where(seen, (row_max + tl.log2(row_sum)) * LN2, float("-inf"))
    channels = tl.arange(0, D)
    token = queries.start + rows
    tl.store(
        out_ptr + (token[:, None] * heads_q + head) * D + channels[None, :],
        fp8.saturating_cast(out, out_ptr.dtype.element_ty),
        mask=rows[:, None] < len_q,
    )
    tl.store(lse_ptr + token * heads_q + head, lse, mask=rows < len_q)


@triton.jit
def score_gradients(s_lhs, s_rhs, dp_lhs, dp_rhs, lse, delta, mask, qk_scale_log2, ROWS: tl.constexpr,
                    COLS: tl.constexpr, INTERPRET: tl.constexpr):
    """P = exp(S - LSE) (fp32) and dS = P * (dP - Delta) as e4m3 with one rceil byte per 32 x 32 tile.

    Either orientation: S = s_lhs s_rhs^T and dP = dp_lhs dp_rhs^T (feature-axis :class:`ScaledRows`) are
    (Q K^T, dO V^T) for query-major tiles or (K Q^T, V dO^T) for key-major ones; ``lse``, ``delta`` and
    ``mask`` come broadcast to match.
    """
    s = scores_log2(s_lhs, s_rhs, mask, qk_scale_log2)
    p = tl.where(mask, tl.exp2(s - lse * LOG2E), 0.0)
    minus_delta = tl.broadcast_to(-delta, (ROWS, COLS))
    dp_minus_delta = tl.dot_scaled(dp_lhs.values, dp_lhs.scales, "e4m3", tl.trans(dp_rhs.values), dp_rhs.scales,
                                   "e4m3", minus_delta)
    ds8, ds_bytes = quantize_square_tiles(tl.where(mask, p * dp_minus_delta, 0.0), ROWS, COLS, INTERPRET)
    return p, ds8, ds_bytes


@triton.jit
def query_rows(q_src, do_src, lse_ptr, delta_ptr, queries, rows, head, heads_q, D: tl.constexpr,
               FEATURE_COL_TILES: tl.constexpr):
    """Q and dO rows ``rows`` of one query head (feature-axis :class:`ScaledRows`), with their LSE and Delta."""
    q = feature_rows(q_src, queries, rows, head, heads_q, D, FEATURE_COL_TILES)
    do = feature_rows(do_src, queries, rows, head, heads_q, D, FEATURE_COL_TILES)
    lse = tl.load(lse_ptr + (queries.start + rows) * heads_q + head, mask=rows < queries.length, other=0.0)
    delta = tl.load(delta_ptr + (queries.start + rows) * heads_q + head, mask=rows < queries.length, other=0.0)
    return q, do, lse, delta


@triton.jit
def dkdv_kernel(
    q_ptr, q_scales, q_seq_ptr, q_seq_scales, do_ptr, do_scales, do_seq_ptr, do_seq_scales, k_ptr, k_scales,
    v_ptr, v_scales, lse_ptr, delta_ptr, dk_ptr, dv_ptr, offsets_q, offsets_k, batch, total_q, total_k,
    q_feature_head_bytes, q_sequence_head_bytes, k_feature_head_bytes, q_col_tiles, softmax_scale, heads_q,
    heads_kv, D: tl.constexpr, FEATURE_COL_TILES: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One (key tile, sequence, KV head): dK, dV ``[BLOCK_N, D]`` summed over the head's query-head group.

    Tiles are key-major (S^T = K Q^T), so every product has the 128 key rows as its M dimension;
    with four fp32 accumulators (S^T, dP^T, dK, dV) in Blackwell's 512 tensor-memory columns, the
    query tile is BLOCK_M = 64 wide.

    dV = P^T dO (P on the static 2^8 scale, dO on the sequence axis); dK = dS^T Q (Q on the sequence
    axis); S and dP from head_dim-axis Q, K, V, dO (docs/DESIGN.md section 3).
    """
    tile, seq = grid_split(batch)
    kv_head = tl.program_id(1)
    queries = span_of(offsets_q, seq, total_q)
    keys = span_of(offsets_k, seq, total_k)
    len_q, len_k = queries.length, keys.length
    if tile * BLOCK_N >= len_k:
        return
    q_src = Operand(q_ptr, q_scales, q_feature_head_bytes)
    do_src = Operand(do_ptr, do_scales, q_feature_head_bytes)
    q_seq_src = Operand(q_seq_ptr, q_seq_scales, q_sequence_head_bytes)
    do_seq_src = Operand(do_seq_ptr, do_seq_scales, q_sequence_head_bytes)

    first_key = tile * BLOCK_N
    cols = first_key + tl.arange(0, BLOCK_N)
    k = feature_rows(Operand(k_ptr, k_scales, k_feature_head_bytes), keys, cols, kv_head, heads_kv, D,
                     FEATURE_COL_TILES)
    v = feature_rows(Operand(v_ptr, v_scales, k_feature_head_bytes), keys, cols, kv_head, heads_kv, D,
                     FEATURE_COL_TILES)

    first_query = 0
    if CAUSAL:  # the first query that sees key `first_key`, rounded down to a tile
        first_query = bounds.first_query_seeing(first_key, bounds.diagonal(len_q, len_k)) // BLOCK_M * BLOCK_M
    p_scale = tl.full([BLOCK_N, BLOCK_M // MX_BLOCK], P_SCALE_BYTE, tl.uint8)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    for head in range(kv_head * (heads_q // heads_kv), (kv_head + 1) * (heads_q // heads_kv)):
        for first_row in range(first_query, len_q, BLOCK_M):
            rows = first_row + tl.arange(0, BLOCK_M)
            q, do, lse, delta = query_rows(q_src, do_src, lse_ptr, delta_ptr, queries, rows, head, heads_q, D,
                                           FEATURE_COL_TILES)
            p_t, ds8_t, ds_t_bytes = score_gradients(
                k, q, v, do, lse[None, :], delta[None, :], visible(rows[None, :], cols[:, None], len_q, len_k, CAUSAL),
                softmax_scale * LOG2E, BLOCK_N, BLOCK_M, INTERPRET,
            )

            do_seq = sequence_rows(do_seq_src, queries, first_row, head, heads_q, q_col_tiles, D, BLOCK_M)
            p8_t = fp8.to_e4m3(p_t * P_SCALE, INTERPRET)
            dv = tl.dot_scaled(p8_t, p_scale, "e4m3", do_seq.values, do_seq.scales, "e4m3", dv)

            q_seq = sequence_rows(q_seq_src, queries, first_row, head, heads_q, q_col_tiles, D, BLOCK_M)
            ds_t_scale = per_row(ds_t_bytes, BLOCK_N, BLOCK_M // MX_BLOCK)
            dk = tl.dot_scaled(ds8_t, ds_t_scale, "e4m3", q_seq.values, q_seq.scales, "e4m3", dk)

    kv_rows = ((keys.start + cols[:, None]) * heads_kv + kv_head) * D + tl.arange(0, D)[None, :]
    tl.store(dk_ptr + kv_rows, (dk * softmax_scale).to(dk_ptr.dtype.element_ty), mask=cols[:, None] < len_k)
    tl.store(dv_ptr + kv_rows, dv.to(dv_ptr.dtype.element_ty), mask=cols[:, None] < len_k)


@triton.jit
def dq_kernel(
    q_ptr, q_scales, do_ptr, do_scales, k_ptr, k_scales, v_ptr, v_scales, k_seq_ptr, k_seq_scales, lse_ptr,
    delta_ptr, dq_ptr, offsets_q, offsets_k, batch, total_q, total_k, q_feature_head_bytes, k_feature_head_bytes,
    k_sequence_head_bytes, k_col_tiles, softmax_scale, heads_q, heads_kv, D: tl.constexpr,
    FEATURE_COL_TILES: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One (query tile, sequence, query head): dQ = dS K ``[BLOCK_M, D]`` (K on the sequence axis).

    It recomputes the same dS tiles as :func:`dkdv_kernel` (no atomics: deterministic).
    """
    tile, seq = grid_split(batch)
    head = tl.program_id(1)
    queries = span_of(offsets_q, seq, total_q)
    keys = span_of(offsets_k, seq, total_k)
    len_q, len_k = queries.length, keys.length
    if tile * BLOCK_M >= len_q:
        return
    kv_head = head // (heads_q // heads_kv)
    k_src = Operand(k_ptr, k_scales, k_feature_head_bytes)
    v_src = Operand(v_ptr, v_scales, k_feature_head_bytes)
    k_seq_src = Operand(k_seq_ptr, k_seq_scales, k_sequence_head_bytes)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    q, do, lse, delta = query_rows(Operand(q_ptr, q_scales, q_feature_head_bytes),
                                   Operand(do_ptr, do_scales, q_feature_head_bytes), lse_ptr, delta_ptr, queries,
                                   rows, head, heads_q, D, FEATURE_COL_TILES)

    dq = tl.zeros([BLOCK_M, D], tl.float32)
    for first_key in range(0, visible_keys_end(tile, len_q, len_k, CAUSAL, BLOCK_M), BLOCK_N):
        cols = first_key + tl.arange(0, BLOCK_N)
        k = feature_rows(k_src, keys, cols, kv_head, heads_kv, D, FEATURE_COL_TILES)
        v = feature_rows(v_src, keys, cols, kv_head, heads_kv, D, FEATURE_COL_TILES)
        _, ds8, ds_bytes = score_gradients(
            q, k, do, v, lse[:, None], delta[:, None], visible(rows[:, None], cols[None, :], len_q, len_k, CAUSAL),
            softmax_scale * LOG2E, BLOCK_M, BLOCK_N, INTERPRET,
        )
        k_seq = sequence_rows(k_seq_src, keys, first_key, kv_head, heads_kv, k_col_tiles, D, BLOCK_N)
        ds_scale = per_row(ds_bytes, BLOCK_M, BLOCK_N // MX_BLOCK)
        dq = tl.dot_scaled(ds8, ds_scale, "e4m3", k_seq.values, k_seq.scales, "e4m3", dq)

    tl.store(
        dq_ptr + ((queries.start + rows[:, None]) * heads_q + head) * D + tl.arange(0, D)[None, :],
        (dq * softmax_scale).to(dq_ptr.dtype.element_ty),
        mask=rows[:, None] < len_q,
    )


def _check_heads(heads_q: int, heads_kv: int, head_dim: int) -> None:
    if heads_q % heads_kv:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"backend 'block-scaled' supports head_dim in {HEAD_DIMS}, got {head_dim}")


def _check_axis(mx: MXFP8Jagged, axis: str, name: str) -> None:
    if not isinstance(mx, MXFP8Jagged):
        raise TypeError(f"{name} must be an MXFP8Jagged, got {type(mx).__name__}")
    if mx.axis != axis or mx.data.dim() != 3:
        raise ValueError(
            f"{name} must be [total, heads, D] quantized along {axis!r}, got axis {mx.axis!r}, "
            f"shape {tuple(mx.data.shape)}"
        )


def _scale_bytes(mx: MXFP8Jagged) -> torch.Tensor:
    """The tiled scale buffer as uint8 ``[heads, bytes]`` (what the kernels index)."""
    return mx.scales.view(torch.uint8)


def _launch_meta(head_dim: int, causal: bool) -> dict:
    """Compile-time parameters and launch options shared by the kernels (all but BLOCK_M)."""
    return dict(D=head_dim, FEATURE_COL_TILES=scale_col_tiles("feature", 0, 0, head_dim),  # depends on D alone
                CAUSAL=causal, BLOCK_N=BLOCK_N, INTERPRET=fp8.INTERPRETED, num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def attention_forward(
    q: MXFP8Jagged, k: MXFP8Jagged, v: MXFP8Jagged, *, causal: bool, softmax_scale: float, out_dtype=torch.bfloat16
):
    """Jagged MXFP8 attention forward with ``tl.dot_scaled``.

    q, k: quantized along ``"feature"``; v: along ``"sequence"`` (``quantize_mxfp8``); offsets in
    ``q.offsets`` / ``k.offsets`` (same batch). Returns out ``[total_q, Hq, D]`` in ``out_dtype`` and
    lse float32 ``[total_q, Hq]`` (natural log; -inf and out = 0 for rows that see no key).
    Causal is bottom-right aligned; GQA when ``Hq % Hkv == 0``.
    """
    _check_axis(q, "feature", "q")
    _check_axis(k, "feature", "k")
    _check_axis(v, "sequence", "v")
    total_q, heads_q, head_dim = q.data.shape
    heads_kv = k.num_heads
    _check_heads(heads_q, heads_kv, head_dim)
    if k.data.shape != v.data.shape or k.head_dim != head_dim:
        raise ValueError(f"k {tuple(k.data.shape)} and v {tuple(v.data.shape)} must match, with D = {head_dim}")
    if q.batch_size != k.batch_size:
        raise ValueError(f"q and k must have the same batch size, got {q.batch_size} and {k.batch_size}")

    out = torch.empty(total_q, heads_q, head_dim, dtype=out_dtype, device=q.device)
    lse = torch.empty(total_q, heads_q, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(max_length(q.offsets, total_q), BLOCK_M) * q.batch_size, heads_q)
    if 0 in grid:
        return out, lse
    q_scales, k_scales, v_scales = _scale_bytes(q), _scale_bytes(k), _scale_bytes(v)
    forward_kernel[grid](
        q.data, q_scales, k.data, k_scales, v.data, v_scales, out, lse, q.offsets, k.offsets, q.batch_size, total_q,
        k.data.shape[0], q_scales.stride(0), k_scales.stride(0), v_scales.stride(0), v.scale_col_tiles(),
        softmax_scale * LOG2E.value, heads_q, heads_kv, BLOCK_M=BLOCK_M, **_launch_meta(head_dim, causal),
    )
    return out, lse


class BackwardOperands(NamedTuple):
    """The backward's MXFP8 operands, as ``reference_backward`` rounds them: Q, K and dO on both axes
    (``feature`` for S and dP, ``sequence`` for dK = dS^T Q, dQ = dS K and dV = P^T dO), V on the
    feature axis (dP = dO V^T). Each ``[total, heads, D]``."""

    q_feature: MXFP8Jagged
    q_sequence: MXFP8Jagged
    k_feature: MXFP8Jagged
    k_sequence: MXFP8Jagged
    v_feature: MXFP8Jagged
    do_feature: MXFP8Jagged
    do_sequence: MXFP8Jagged


def attention_backward(operands: BackwardOperands, lse, delta, *, causal: bool, softmax_scale: float, dtypes):
    """dQ, dK, dV of jagged MXFP8 attention with ``tl.dot_scaled`` (the reference backend's dataflow).

    Deterministic: dQ has its own kernel, no atomics. ``lse`` float32 ``[total_q, Hq]`` from the
    forward; ``delta`` float32 ``[total_q, Hq]``, rowsum(dO * O) less the LSE's gradient
    (``reference.softmax_delta``). Gradients come out in ``dtypes`` (dQ's, dK's, dV's); dK and dV
    are summed over each KV head's query-head group.
    """
    q_feature, q_sequence, k_feature, k_sequence, v_feature, do_feature, do_sequence = operands
    for name, mx in zip(BackwardOperands._fields, operands):
        _check_axis(mx, name.rsplit("_", 1)[1], name)  # each field is named after its axis
    total_q, heads_q, head_dim = q_feature.data.shape
    total_k, heads_kv = k_feature.data.shape[:2]
    _check_heads(heads_q, heads_kv, head_dim)
    offsets_q, offsets_k = q_feature.offsets, k_feature.offsets
    device = q_feature.data.device
    dq = torch.empty(total_q, heads_q, head_dim, dtype=dtypes[0], device=device)
    dk = torch.empty(total_k, heads_kv, head_dim, dtype=dtypes[1], device=device)
    dv = torch.empty(total_k, heads_kv, head_dim, dtype=dtypes[2], device=device)
    batch = offsets_q.numel() - 1
    scales = {name: _scale_bytes(mx) for name, mx in [("q", q_feature), ("q_seq", q_sequence), ("do", do_feature),
                                                       ("do_seq", do_sequence), ("k", k_feature),
                                                       ("k_seq", k_sequence), ("v", v_feature)]}
    lse = lse.contiguous()
    meta = _launch_meta(head_dim, causal)
    dkdv_grid = (triton.cdiv(max_length(offsets_k, total_k), BLOCK_N) * batch, heads_kv)
    if 0 not in dkdv_grid:
        dkdv_kernel[dkdv_grid](
            q_feature.data, scales["q"], q_sequence.data, scales["q_seq"], do_feature.data, scales["do"],
            do_sequence.data, scales["do_seq"], k_feature.data, scales["k"], v_feature.data, scales["v"], lse, delta,
            dk, dv, offsets_q, offsets_k, batch, total_q, total_k, scales["q"].stride(0), scales["q_seq"].stride(0),
            scales["k"].stride(0), q_sequence.scale_col_tiles(), softmax_scale, heads_q, heads_kv,
            BLOCK_M=DKDV_BLOCK_M, **meta,
        )
    dq_grid = (triton.cdiv(max_length(offsets_q, total_q), BLOCK_M) * batch, heads_q)
    if 0 not in dq_grid:
        dq_kernel[dq_grid](
            q_feature.data, scales["q"], do_feature.data, scales["do"], k_feature.data, scales["k"], v_feature.data,
            scales["v"], k_sequence.data, scales["k_seq"], lse, delta, dq, offsets_q, offsets_k, batch, total_q,
            total_k, scales["q"].stride(0), scales["k"].stride(0), scales["k_seq"].stride(0),
            k_sequence.scale_col_tiles(), softmax_scale, heads_q, heads_kv, BLOCK_M=BLOCK_M, **meta,
        )
    return dq, dk, dv
