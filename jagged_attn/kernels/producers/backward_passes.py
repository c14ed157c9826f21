"""The backward's per-slot passes around its attention kernels (Triton, 128-token slots of the
``schedule.slot_tiles`` table, heads fastest): the producers before them and dQ's finish after; the
Hopper (``sm90.backward``) and portable (``portable.backward``) kernels read the same operands.

Scales (docs/DESIGN.md section 6). The MMAs have no block-scaled mode, so every operand's scale is
kept constant along the reduction of the GEMM that reads it and applied outside it:

* head_dim axis (Q, K for S; dO, V for dP): one scale per token, i.e. the spec's 32-wide MX blocks
  rebased to the token's largest block exponent. The inputs are high precision, so they are quantized
  with that exponent directly (one rounding instead of two). The per-row and per-column factors
  multiply the fp32 S / dP tiles. The e4m3 copies of Q and V may instead share one scale among each
  ``feature_group`` consecutive tokens of a sequence (the largest of their bytes): the Hopper kernel
  then applies one factor to a 64-query step's columns or to a consumer's 64 keys instead of one per
  token. A shift by a power of two keeps an e4m3 value's rounding unless it falls below the smallest
  normal (2^-6), so only elements over ~2^14.8 below their group's largest lose bits. Q's token scales
  (``token_scale``) stay what its sequence copy is normalized by.
* sequence axis (Q, dO for dK, dV; K for dQ): these copies are stored transposed, ``[heads, D,
  padded_total]`` with sequence ``b`` at padded row ``padded_seq_start``, so that the sequence axis is
  contiguous (K-major), as FP8 MMAs need for both operands, with the tokens of each slot in a ``layout``
  token order. Each sequence owns ``ceil(L / 128)`` whole 128-token slots there; the producer writes
  them in full, zeros past the end, so the kernels read these tiles without masks.

  - dO: one scale per (sequence, channel), shared by the query heads of a GQA group, i.e. the spec's
    32-token blocks rebased to the sequence's largest exponent. It is constant along the whole dV
    reduction, so the MMAs chain in their accumulators and the scale is applied once in the epilogue.
    Its copy may hold its e4m3 values as fp16 (``do_sequence_dtype``), for the Hopper kernel's fp16 dV
    wgmma, whose fp32 accumulation chains over the steps unbiased.
  - Q and K: each token divided by its own head_dim scale (the one its feature copy takes when tokens
    do not share one), and no scale along the sequence: the token scales vary along the dK and dQ
    reductions, so they are folded into dS instead (dS times the query's and the key's token scales
    is what gets quantized; dQ rows and dK rows divide them back out). Tokens of small norm then keep
    their precision, and every value already lies on its token's e4m3 grid, at most 448: a further
    power-of-two scale per (sequence, channel) would change no rounding above e4m3's smallest normal,
    2^-6, i.e. none but of elements over ~2^13.8 below their token's largest (whose absolute error
    stays under 2^-10, against up to 16 for the token's largest elements), and it would cost a pass
    over the tensor for its maxima. K's copy holds the same bytes as its feature copy, transposed. On the
    FP8 path K takes the forward's operand form instead (``rebase.key_copies``): one exponent per
    128-key tile for its feature copy (the forward's operand itself) and K^T alike, each token's factor its
    tile's, so K enters the backward's S^T as it entered the forward's S; only elements over ~2^14.8 below
    their tile's largest lose bits there, as in the forward.
* P: the static 2^8 scale. dS: one scale per kernel tile, taken as the running maximum over the tiles
  a program has reduced so far (in the Hopper kernel with FP8 scores, also over the other consumer's
  tiles up to the previous step): the accumulator is rescaled by an exact power of two <= 1 when the
  maximum grows, never overflows, and tiles far below the maximum (whose contribution is as far below)
  are quantized on its grid.

The producers (:func:`quantize_for_backward`: one pass, :func:`_quantize_kernel`, after
:func:`_sequence_amax_kernel` for dO's (sequence, channel) maxima) write those copies; dO's pass also
forms Delta and the LSE in log2 units, and, for the Hopper kernel, the padded per-query vectors
(``ROW_VECTORS`` of them, Q's scales among them).
:class:`Prepared` runs them for one backward call. :func:`finish_dq` turns the Hopper kernel's fp32
dQ sums into dQ.
"""

from functools import cached_property

import torch
import triton
import triton.language as tl

from jagged_attn.offsets import max_length, padded_total

from ..common import fp8
from ..common.layout import (
    LOG2E,
    NATURAL_ORDER,
    P_STATIC_EXP,
    fold_max,
    padded_seq_start,
    scale_byte_of_amax,
    scale_factor,
    scale_inverse,
    scale_value,
    store_sequence_copy,
)
from ..common.schedule import SLOT_TOKENS, claimed_tile, slot_tiles
from .copies import Quantized, token_normalized_pairs, token_scale_byte
from .rebase import key_copies

PRODUCER_TILE = SLOT_TOKENS  # tokens per producer program: one padded slot (a token ORDER permutes within it)
# Warps of the producer's two passes and of the dQ finish pass, the fastest measured (four each against
# eight, then two for the amax pass: docs/perf-history.md). Both passes take their 128-token slot in
# chunks of PRODUCER_CHUNK tokens (a power of two from 16: the token orders' groups): 64 was faster than
# whole slots, and 32 and 16, though lighter on registers, slower; re-swept with the heads of a slot
# fastest, the same choices.
AMAX_WARPS = 2
QUANTIZE_WARPS = 4
PRODUCER_CHUNK = 64
FINISH_DQ_WARPS = 8


def quantize_warps(feature_group: int) -> int:
    """Warps of the quantize pass: QUANTIZE_WARPS, or eight where a chunk's tokens share a feature scale. The
    shared scale's cross-warp maximum keeps the whole chunk live, which at four warps took Q's pass from 167
    to 211 registers (two programs an SM instead of three) and V's from 63 to 113 (four instead of eight); at
    eight warps they take 128 and 62, as many warps an SM as the per-token passes or more (sm_90)."""
    return QUANTIZE_WARPS if feature_group == 1 else 2 * QUANTIZE_WARPS


# The Hopper kernel's per-query vectors, rows of one flat fp32 [ROW_VECTORS, H, padded] buffer that dO's pass
# writes (Prepared(row_vectors=True)): Q_FACTOR, the scale of Q's feature copy (its token scale q, or its group's);
# P_LSE2 = lse2 - log2(P_SCALE), so that exp2(logits - P_LSE2) is P * P_SCALE; Q_DO_FACTOR = q times dO's
# token scale (FP8 scores only: neither written nor read on the exact path); Q_DELTA = q * Delta.
Q_FACTOR, P_LSE2, Q_DO_FACTOR, Q_DELTA = (tl.constexpr(i) for i in range(4))
ROW_VECTORS = tl.constexpr(4)


@triton.jit
def _producer_program(offsets_ptr, total, tiles_ptr, HEADS: tl.constexpr):
    """(tile, sequence, head, sequence start, sequence length) of a per-tile program, grid (slots of
    the ``schedule.tile_list`` table ``tiles`` x HEADS, heads fastest: ``layout.slot_program``); an
    unused slot has length 0, and a tile at or past the sequence's length has nothing to do."""
    b, tile, seq_start, seq_len, _, h = claimed_tile(tiles_ptr, offsets_ptr, total, 1, HEADS)
    used = b >= 0
    return tl.maximum(tile, 0), tl.maximum(b, 0), h, seq_start, tl.where(used, seq_len, 0)


@triton.jit
def _load_tile(x_ptr, seq_start, seq_len, tile, h, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr):
    """fp32 tile ``[TILE, D]`` of the sequence at ``seq_start``, head ``h`` (zeros past its end), its
    natural offsets, its token rows inside the sequence and the in-sequence mask."""
    rows = tile * TILE + tl.arange(0, TILE)
    in_seq = rows < seq_len
    natural = (seq_start + rows)[:, None] * (HEADS * HEAD_DIM) + h * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    x = tl.load(x_ptr + natural, mask=in_seq[:, None], other=0.0).to(tl.float32)
    return x, natural, rows, in_seq


@triton.jit
def _sequence_amax_kernel(
    x_ptr, offsets_ptr, tiles_ptr, amax_ptr, total, batch,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr,
):
    """Absolute maxima of ``x`` per (GROUP of consecutive heads, sequence, channel) into ``amax`` (int32
    bits of the fp32 values, ``[H / GROUP, B, D]``, zero-initialized): non-negative floats order like
    their bits."""
    tile, b, h, seq_start, seq_len = _producer_program(offsets_ptr, total, tiles_ptr, HEADS)
    if tile * TILE >= seq_len:
        return
    amax = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for chunk in range(tile * (TILE // CHUNK), (tile + 1) * (TILE // CHUNK)):
        x, _, _, _ = _load_tile(x_ptr, seq_start, seq_len, chunk, h, HEADS, HEAD_DIM, CHUNK)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
    fold_max(amax_ptr + ((h // GROUP) * batch + b) * HEAD_DIM + tl.arange(0, HEAD_DIM), amax.to(tl.int32, bitcast=True))


@triton.jit
def _quantize_kernel(
    x_ptr, offsets_ptr, tiles_ptr,
    feature_ptr, feature_scale_ptr,  # e4m3 (or its bf16 values) [total, H, D]; fp32 [H, total]: scale per token
    token_scale_ptr,  # fp32 [H, total]: each token's own scale (FEATURE_GROUP > 1)
    query_scale_ptr, query_feature_scale_ptr,  # fp32 [H, total]: Q's token and feature scales (dO's pass, ROWS)
    amax_ptr, sequence_ptr, sequence_scale_ptr,  # amax bits, fp32 scales [H / GROUP, B, D]; e4m3/fp16 [H, D, padded]
    out_ptr, lse_ptr, dlse_ptr, delta_ptr, lse2_ptr,  # O [total, H, D], LSE, dLSE [total, H] -> fp32 [H, total]
    rows_ptr,  # fp32 [ROW_VECTORS, H, padded]: per-query vectors in padded slots (the Hopper kernel's)
    total, padded, batch,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr, NORMALIZE_TOKENS: tl.constexpr,
    GROUP: tl.constexpr, CHUNK: tl.constexpr, FEATURE: tl.constexpr, FEATURE_GROUP: tl.constexpr,
    SEQUENCE: tl.constexpr, DELTA: tl.constexpr, DLSE: tl.constexpr, ORDER: tl.constexpr, ROWS: tl.constexpr,
    DO_FACTOR: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One (TILE-token tile of a sequence, head), CHUNK tokens at a time: read ``x`` once, write the
    requested outputs.

    FEATURE: per-token scale along head_dim (FEATURE_GROUP = CHUNK: one per chunk of tokens, their largest; a
    chunk never crosses a sequence, and the zeros past its end raise nothing). SEQUENCE: data stored
    transposed (tokens in the ``layout`` ORDER inside each slot: as the kernels read them), each token
    divided by its own head_dim scale with NORMALIZE_TOKENS (the kernels fold that scale into dS), else
    on a scale per (sequence, channel), shared by each GROUP of consecutive heads, from the maxima of
    :func:`_sequence_amax_kernel`. DELTA (for dO): ``rowsum(dO * O)`` and ``LSE * log2(e)``
    (+inf where LSE is -inf, so that ``exp2(s - lse2)`` is 0 for rows that see no key). ROWS (with DELTA):
    the per-query vectors into ``rows_ptr``, the whole slot: ``P_LSE2``, ``lse2 - P_STATIC_EXP`` (+inf past
    the sequence's end), ``Q_DELTA``, Delta times Q's token scale (``query_scale_ptr``), and ``Q_FACTOR``,
    Q's feature scale (``query_feature_scale_ptr``), zeros past the end; with DO_FACTOR also ``Q_DO_FACTOR``,
    the feature scales times Q's token scales. DLSE (with DELTA): Delta less the LSE's gradient ``dlse_ptr``
    [total, H] (``reference.softmax_delta``), wherever Delta goes.
    """
    tile, b, h, seq_start, seq_len = _producer_program(offsets_ptr, total, tiles_ptr, HEADS)
    if tile * TILE >= seq_len:
        return
    channels = tl.arange(0, HEAD_DIM)
    if SEQUENCE and not NORMALIZE_TOKENS:
        scales = (h // GROUP * batch + b) * HEAD_DIM + channels
        sequence_byte = scale_byte_of_amax(tl.load(amax_ptr + scales).to(tl.float32, bitcast=True), False)
        tl.store(sequence_scale_ptr + scales, scale_value(sequence_byte))
    for chunk in range(tile * (TILE // CHUNK), (tile + 1) * (TILE // CHUNK)):
        x, natural, rows, in_seq = _load_tile(x_ptr, seq_start, seq_len, chunk, h, HEADS, HEAD_DIM, CHUNK)
        tokens = seq_start + rows
        padded_rows = rows_ptr + h * padded + padded_seq_start(seq_start, b) + rows  # vector 0 of this head
        if DELTA:  # first, so that O's tile is dead before the copies are formed
            o = tl.load(out_ptr + natural, mask=in_seq[:, None], other=0.0).to(tl.float32)
            delta = tl.sum(x * o, axis=1)  # zero past the end: x and o load as zeros there
            if DLSE:
                delta -= tl.load(dlse_ptr + tokens * HEADS + h, mask=in_seq, other=0.0)
            tl.store(delta_ptr + h * total + tokens, delta, mask=in_seq)
            lse = tl.load(lse_ptr + tokens * HEADS + h, mask=in_seq, other=0.0)
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
            tl.store(lse2_ptr + h * total + tokens, lse2, mask=in_seq)
            if ROWS:  # P_LSE2 +inf past the end, so that the Hopper kernel's p is 0 there
                tl.store(padded_rows + P_LSE2 * HEADS * padded, tl.where(in_seq, lse2 - P_STATIC_EXP, float("inf")))
                q_factor = tl.load(query_scale_ptr + h * total + tokens, mask=in_seq, other=0.0)
                tl.store(padded_rows + Q_DELTA * HEADS * padded, q_factor * delta)
                tl.store(padded_rows + Q_FACTOR * HEADS * padded,
                         tl.load(query_feature_scale_ptr + h * total + tokens, mask=in_seq, other=0.0))
        token_byte = token_scale_byte(x)  # the feature copy's (unless a chunk shares one), the normalized copy's
        if FEATURE:
            byte = token_byte
            if FEATURE_GROUP > 1:
                tl.static_assert(FEATURE_GROUP == CHUNK, "a feature scale's group is one chunk of tokens")
                tl.store(token_scale_ptr + h * total + tokens, scale_value(token_byte), mask=in_seq)
                byte = tl.zeros_like(byte) + tl.max(byte, axis=0)
            data = fp8.to_e4m3(x * scale_factor(byte)[:, None], INTERPRET)
            if feature_ptr.dtype.element_ty == tl.bfloat16:  # the MX values: e4m3 times the token scale (exact)
                data = data.to(tl.float32) * scale_value(byte)[:, None]
            tl.store(feature_ptr + natural, data.to(feature_ptr.dtype.element_ty), mask=in_seq[:, None])
            tl.store(feature_scale_ptr + h * total + tokens, scale_value(byte), mask=in_seq)
            if DO_FACTOR:  # q_factor is 0 past the end
                tl.store(padded_rows + Q_DO_FACTOR * HEADS * padded, scale_value(byte) * q_factor)
        if SEQUENCE:  # the whole slot, zeros past the end
            if NORMALIZE_TOKENS:  # K's feature copy (and Q's, one scale per token) casts these very values
                data = token_normalized_pairs(x, token_byte, INTERPRET)
            elif sequence_ptr.dtype.element_ty == tl.float16:
                data = fp8.e4m3_values_in_fp16(x * scale_factor(sequence_byte)[None, :], INTERPRET)
            else:
                data = fp8.to_e4m3(x * scale_factor(sequence_byte)[None, :], INTERPRET)
            store_sequence_copy(sequence_ptr, data.to(sequence_ptr.dtype.element_ty), h, channels, seq_start, b,
                                rows, padded, HEAD_DIM, ORDER)


@triton.jit
def _finish_dq_kernel(
    dq_accum_ptr, q_scale_ptr, dq_ptr, offsets_ptr, tiles_ptr, total, softmax_scale,
    HEADS_Q: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr,
):
    """dQ of one (TILE-token tile of a sequence, query head) from ``sm90.backward``'s sums (kept in units
    of the query's token scale, K^T's copy being token-normalized): times the softmax scale, over the
    token scale, cast to dq's dtype."""
    tile, b, h, seq_start, seq_len = _producer_program(offsets_ptr, total, tiles_ptr, HEADS_Q)
    if tile * TILE >= seq_len:
        return
    sums, natural, rows, in_seq = _load_tile(dq_accum_ptr, seq_start, seq_len, tile, h, HEADS_Q, HEAD_DIM, TILE)
    token_scale = tl.load(q_scale_ptr + h * total + seq_start + rows, mask=in_seq, other=0.0)
    dq = sums * (softmax_scale * scale_inverse(token_scale))[:, None]
    tl.store(dq_ptr + natural, dq.to(dq_ptr.dtype.element_ty), mask=in_seq[:, None])


def check_inputs(dout, q, k, v, out, lse, dlse, head_dims) -> None:
    """ValueError unless a backward's tensors have the shapes its ``attention_backward`` documents, with a
    head_dim in ``head_dims`` (its kernels'): the kernels index by these shapes."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(
            f"expected q/dout/out [total_q, Hq, D] and k/v [total_k, Hkv, D], got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}, dout {tuple(dout.shape)}, out {tuple(out.shape)}"
        )
    if q.shape[2] not in head_dims or k.shape[2] != q.shape[2]:
        raise ValueError(f"head_dim must be one of {head_dims} for q and k, got {q.shape[2]} and {k.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    for name, t in (("lse", lse), ("dlse", dlse)):
        if t is not None and tuple(t.shape) != tuple(q.shape[:2]):
            raise ValueError(f"{name} must be [total_q, Hq] = {tuple(q.shape[:2])}, got {tuple(t.shape)}")


def quantize_for_backward(x, offsets, *, feature, sequence, normalize_tokens=False, group=1, out=None, lse=None,
                          dlse=None, order=NATURAL_ORDER, feature_dtype=torch.float8_e4m3fn, feature_group=1,
                          sequence_dtype=torch.float8_e4m3fn, tiles=None, rows=None, query=None):
    """Quantize high-precision ``x`` ``[total, H, D]`` for the backward kernels.

    ``sequence``: the transposed copy, on scales per (sequence, channel) shared by each ``group`` of
    consecutive heads, or with ``normalize_tokens`` each token over its own head_dim scale and no
    ``sequence_scale`` (None); ``order`` (``layout``'s
    ``PV_ORDER``, ``DS_ORDER``) stores the transposed tokens in that order inside each slot;
    ``feature_dtype`` bf16 stores the feature copy's MX values, e4m3 times the token scale, as bf16
    (exact: bf16 holds every such value, and a bf16 MMA on them accumulates in plain fp32; the
    token scales are written as well, for what the kernels fold into dS); ``feature_group`` (1 or
    ``PRODUCER_CHUNK``): tokens sharing a feature scale, each sequence's from its start (written per token
    all the same); ``sequence_dtype`` fp16 stores
    the sequence copy's e4m3 values as fp16 (exact; its scales are the same).
    With ``out`` and ``lse`` (for dO) also returns Delta and lse2, fp32 ``[H, total]``; ``dlse`` (fp32
    ``[total, H]`` or None), the LSE's gradient, is subtracted from Delta.
    ``tiles``: the slot table of ``offsets`` (``schedule.slot_tiles``: built on the device, so that no
    launch waits for the host to learn the longest sequence), made here when not given.
    ``rows`` (with ``out`` and ``lse``, for dO): the Hopper kernel's per-query vectors, fp32 ``[ROW_VECTORS,
    H, padded]``, each sequence from its ``padded_seq_start``, zeros past its end (P_LSE2: +inf), written from
    ``query``, what this function made of Q (``Q_FACTOR``: its ``feature_scale``; ``P_LSE2``; ``Q_DELTA``
    and, for e4m3 copies only (the kernel's exact dP needs none), ``Q_DO_FACTOR``: Delta and dO's token
    scales times its ``token_scale``).
    """
    total, heads, dim = x.shape
    if feature_group not in (1, PRODUCER_CHUNK):
        raise ValueError(f"feature_group must be 1 or {PRODUCER_CHUNK}, got {feature_group}")
    batch = offsets.numel() - 1
    padded = padded_total(total, batch)
    f32 = dict(dtype=torch.float32, device=x.device)
    result = Quantized.unwritten(x, padded, feature_dtype=feature_dtype if feature else None,
                                 feature_group=feature_group, sequence_dtype=sequence_dtype if sequence else None)
    with_delta = out is not None
    delta = torch.empty(heads, total, **f32) if with_delta else None
    lse2 = torch.empty(heads, total, **f32) if with_delta else None
    channel_scales = sequence and not normalize_tokens
    if channel_scales:
        result.sequence_scale = torch.zeros(heads // group, batch, dim, **f32)
    if total == 0:
        return result, delta, lse2
    tiles = slot_tiles(offsets, total) if tiles is None else tiles
    grid = (tiles.shape[0] * heads,)
    shape = dict(HEADS=heads, HEAD_DIM=dim, TILE=PRODUCER_TILE)
    amax = None
    if channel_scales:
        amax = torch.zeros(heads // group, batch, dim, dtype=torch.int32, device=x.device)
        _sequence_amax_kernel[grid](x, offsets, tiles, amax, total, batch, GROUP=group, CHUNK=PRODUCER_CHUNK,
                                    num_warps=AMAX_WARPS, **shape)
    unused = x  # any tensor: Triton needs a pointer for outputs a launch does not write
    if rows is not None:
        if tuple(rows.shape) != (ROW_VECTORS.value, heads, padded):
            raise ValueError(f"rows must be [{ROW_VECTORS.value}, {heads}, {padded}] (vectors, heads, padded "
                             f"tokens), got {list(rows.shape)}")
        if not with_delta or query is None:
            raise ValueError("the per-query vectors are written by dO's pass (out and lse) from Q's scales (query)")
    _quantize_kernel[grid](
        x, offsets, tiles,
        result.feature if feature else unused, result.feature_scale if feature else unused,
        result.token_scale if feature else unused, *((unused,) * 2 if query is None else
                                                      (query.token_scale, query.feature_scale)),
        amax if channel_scales else unused, result.sequence if sequence else unused,
        result.sequence_scale if channel_scales else unused,
        out if with_delta else unused, lse if with_delta else unused, unused if dlse is None else dlse,
        delta if with_delta else unused, lse2 if with_delta else unused, unused if rows is None else rows,
        total, padded, batch, GROUP=group, CHUNK=PRODUCER_CHUNK, NORMALIZE_TOKENS=normalize_tokens,
        FEATURE=feature, FEATURE_GROUP=feature_group, SEQUENCE=sequence, DELTA=with_delta,
        DLSE=with_delta and dlse is not None, ORDER=order,
        ROWS=rows is not None, DO_FACTOR=rows is not None and feature_dtype != torch.bfloat16,
        INTERPRET=fp8.INTERPRETED,
        num_warps=quantize_warps(feature_group), **shape,
    )
    return result, delta, lse2


class Prepared:
    """The producers' outputs for one backward call, plus the sizes the launches need."""

    def __init__(self, dout, q, k, v, out, lse, offsets_q, offsets_k, query_order=NATURAL_ORDER,
                 key_order=NATURAL_ORDER, do_order=None, do_sequence_dtype=torch.float8_e4m3fn, exact_scores=False,
                 row_vectors=False, query_scale_tokens=1, value_scale_tokens=1, dlse=None, q_copies=None,
                 kv_copies=None):
        """``query_order``: token order of Q^T and of dO^T unless ``do_order`` is given, ``key_order``: of
        K^T (``layout`` orders); ``do_sequence_dtype``: dO^T's (e4m3, or fp16 holding its e4m3 values);
        ``row_vectors``: also the Hopper kernel's per-query vectors in padded slots (``self.rows``);
        ``query_scale_tokens``, ``value_scale_tokens``: tokens sharing a scale in Q's and V's e4m3 feature copies
        (``quantize_for_backward``'s ``feature_group``; the exact-scores copies keep one per token); ``dlse``: the
        LSE's gradient, taken into Delta (None: none); ``q_copies``, ``kv_copies``: Q's, and K's and V's, copies
        (``Quantized``) written beforehand (the forward's passes: ``rebase.take_backward_copies``), or None
        (either of the pair too): made here, K's with FP8 scores in the forward's operand form
        (``rebase.key_copies``)."""
        self.query_order, self.key_order = query_order, key_order
        self.do_order = query_order if do_order is None else do_order
        self.heads_q, self.heads_kv, self.dim = q.shape[1], k.shape[1], q.shape[2]
        self.batch = offsets_q.numel() - 1
        self.total_q, self.total_k = q.shape[0], k.shape[0]
        self.padded_q, self.padded_k = padded_total(self.total_q, self.batch), padded_total(self.total_k, self.batch)
        self.offsets_q, self.offsets_k = offsets_q, offsets_k
        self.tiles_q = slot_tiles(offsets_q, self.total_q)
        same_side = offsets_k is offsets_q and self.total_k == self.total_q
        self.tiles_k = self.tiles_q if same_side else slot_tiles(offsets_k, self.total_k)
        dout, q, k, v, out = (t.contiguous() for t in (dout, q, k, v, out))
        lse = lse.to(torch.float32).contiguous()
        dlse = None if dlse is None else dlse.to(torch.float32).contiguous()
        group = self.heads_q // self.heads_kv
        # exact_scores: the feature copies of Q and K (read only for S) and of V and dO (read only for dP)
        # as bf16 holding their MX values, for the Hopper kernel's exact S and dP.
        score_dtype = torch.bfloat16 if exact_scores else torch.float8_e4m3fn
        self.rows = None
        if row_vectors:
            self.rows = torch.empty(ROW_VECTORS.value, self.heads_q, self.padded_q, dtype=torch.float32,
                                    device=q.device)
        self.query_scale_tokens = 1 if exact_scores else query_scale_tokens
        if q_copies is not None:
            self.q = q_copies
        else:
            self.q, _, _ = quantize_for_backward(q, offsets_q, feature=True, sequence=True, normalize_tokens=True,
                                                 order=query_order, feature_dtype=score_dtype,
                                                 feature_group=self.query_scale_tokens, tiles=self.tiles_q)
        self.value_scale_tokens = 1 if exact_scores else value_scale_tokens
        self.k, self.v = (None, None) if kv_copies is None else kv_copies
        if self.k is None:
            if exact_scores:
                self.k, _, _ = quantize_for_backward(k, offsets_k, feature=True, sequence=True, normalize_tokens=True,
                                                     order=key_order, feature_dtype=score_dtype, tiles=self.tiles_k)
            else:  # K as the forward's operand
                self.k = key_copies(k, offsets_k, key_order, self.tiles_k)
        if self.v is None:
            self.v, _, _ = quantize_for_backward(v, offsets_k, feature=True, sequence=False,
                                                 feature_dtype=score_dtype, feature_group=self.value_scale_tokens,
                                                 tiles=self.tiles_k)
        self.do, self.delta, self.lse2 = quantize_for_backward(
            dout, offsets_q, feature=True, sequence=True, group=group, out=out, lse=lse, dlse=dlse, order=self.do_order,
            feature_dtype=score_dtype, sequence_dtype=do_sequence_dtype, tiles=self.tiles_q, rows=self.rows,
            query=self.q)

    @cached_property
    def max_len_q(self) -> int:
        """The longest query sequence, for the Triton kernels' grids (waits for the device)."""
        return max_length(self.offsets_q, self.total_q)

    @cached_property
    def max_len_k(self) -> int:
        """The longest key sequence, for the Triton kernels' grids (waits for the device)."""
        return max_length(self.offsets_k, self.total_k)


def finish_dq(dq_accum, prep, dq, softmax_scale: float) -> None:
    """dQ into ``dq`` from ``sm90.backward``'s sums ``dq_accum`` of the call ``prep`` prepared."""
    _finish_dq_kernel[(prep.tiles_q.shape[0] * prep.heads_q,)](
        dq_accum, prep.q.token_scale, dq, prep.offsets_q, prep.tiles_q, prep.total_q, softmax_scale,
        HEADS_Q=prep.heads_q, HEAD_DIM=prep.dim, TILE=PRODUCER_TILE, num_warps=FINISH_DQ_WARPS)
