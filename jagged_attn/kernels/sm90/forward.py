"""Varlen MXFP8 attention forward for Hopper in Gluon, warp-specialized as in FlashAttention-3.

A work item is a 192-row query tile of one head: a loader warp streams its K and V^T tiles with TMA into
a ring of shared-memory stages, and three consumer warpgroups (64 query rows each) run S = Q K^T, the
online softmax and O += P V on them. The consumers share every K/V tile (a third of the shared-memory
traffic of 64-row programs) and, not being tied by block-wide barriers, run their chains side by side:
each consumer's chain (S, its wait, the softmax, P·V, its wait, the rescale) is latency-bound, and a
third chain keeps the tensor cores and the exponentials busier while the other two wait, which
FlashAttention-3's ping-pong of two consumers did not (docs/perf-history.md). The launch is persistent:
one program per SM, each taking items until none is left, the next one from a launch-wide counter (the
loader warp takes it and hands it to the consumers), so the ring runs on from item to item and the work
list's dearest items go first, each to the program that is free first.

Operands are the portable forward's (``producers.rebase``), Q rebased like K but per token: with
SCORES="fp8" Q and K are e4m3 on one exponent per token / KV tile; with SCORES="bf16" they are their
exact MX values in bf16 (S is exact up to fp32 sums, at the bf16 MMA rate). V^T is e4m3
``[Hkv, D, padded_total]`` on one exponent per (sequence, head, channel). Q is rebased beforehand,
from MXFP8 inputs once and kept across calls, from high-precision inputs by a pass: consumers that
quantized their own Q rows from the values (one read of Q, no write) measured slower at 160
registers than the pass and the TMA load of its result. The softmax follows
``portable.forward``'s: exp2 domain, online row maximum, P on the static 2^8 scale.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon._runtime import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.core import _aggregate as aggregate  # Triton 3.6's Gluon does not export it yet

from jagged_attn.mxfp8 import checked_after

from ..common import bounds, fp8, layout, persistent
from ..common.layout import FINITE_FLOOR, SCORE_MODES
from . import HEAD_DIMS
from ..producers.rebase import (
    kept_rebase_feature,
    kept_rebase_kv,
    quantize_rebase_feature,
    quantize_rebase_kv,
)
from . import backward as sm90_backward
from ..common.schedule import work_list
from ..common.tma import operand_descriptor

CONSUMER_ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (one wgmma M)
CONSUMERS = gl.constexpr(3)
BLOCK_M = CONSUMER_ROWS.value * CONSUMERS.value


def tile_config(head_dim: int, scores: str = "fp8") -> dict:
    """KV tile, pipeline depth (measured: 2 stages about as fast), the registers of the loader warp and of each
    consumer warpgroup (``setmaxnreg``; a program's pool is 512 per thread over four warpgroups, the
    loader's counted as one, and Triton gives the first consumer what the others leave: 168 + 2 x 160 + 24),
    and whether the softmax's row reductions run as trees (``_row_reduce``: measured faster at head_dim 128,
    slower at 64)."""
    if scores not in SCORE_MODES or head_dim not in HEAD_DIMS:
        raise ValueError(f"no configuration for scores={scores!r}, head_dim={head_dim}")
    stages = 4 if scores == "fp8" else 3
    return dict(BLOCK_N=128, STAGES=stages, SCORES=scores, LOADER_REGS=24, CONSUMER_REGS=160,
                ROW_TREE=head_dim == 128)


@aggregate
class KVStages:
    """The ring of KV stages the loader warp fills and both consumers drain: K tiles ``k``
    ``[STAGES, BLOCK_N, D]``, V^T tiles ``v`` ``[STAGES, D, BLOCK_N]``; ``k_ready`` / ``v_ready`` signal
    their loads, ``empty`` both consumers' release."""
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor

    @constexpr_function
    def __init__(self, k, v, k_ready, v_ready, empty):
        self.k, self.v, self.k_ready, self.v_ready, self.empty = k, v, k_ready, v_ready, empty


@aggregate
class QueryTile:
    """One work item: the query rows from ``rows0`` (``CONSUMERS * CONSUMER_ROWS`` of them) of
    sequence ``seq`` (below 0: an empty slot, nothing to do), query head ``head`` (KV head
    ``kv_head``); the sequence's first query and key rows and lengths; Q's column in its descriptor
    and V^T's first column; where the sequence's Q token factors and K tile factors start; the KV
    tiles to stream."""
    seq: gl.tensor
    head: gl.tensor
    kv_head: gl.tensor
    rows0: gl.tensor
    q_start: gl.tensor
    len_q: gl.tensor
    k_start: gl.tensor
    len_k: gl.tensor
    q_col: gl.tensor
    vt_col: gl.tensor
    q_factor_row: gl.tensor
    k_factor_row: gl.tensor
    n_tiles: gl.tensor

    @constexpr_function
    def __init__(self, seq, head, kv_head, rows0, q_start, len_q, k_start, len_k, q_col, vt_col, q_factor_row,
                 k_factor_row, n_tiles):
        self.seq, self.head, self.kv_head, self.rows0 = seq, head, kv_head, rows0
        self.q_start, self.len_q, self.k_start, self.len_k = q_start, len_q, k_start, len_k
        self.q_col, self.vt_col = q_col, vt_col
        self.q_factor_row, self.k_factor_row, self.n_tiles = q_factor_row, k_factor_row, n_tiles


@aggregate
class WorkItems:
    """The work of a launch: the ``schedule.work_list`` table ``work`` (``slots`` rows of (sequence,
    query tile)) for each query head, ``slots * HEADS_Q`` items, head outer; the batch's offsets and
    totals, and the rows per head of the Q token factors and K tile factors (``q_groups``,
    ``k_groups``), from which :func:`_query_tile` describes an item."""
    work: gl.tensor
    slots: gl.tensor
    offsets_q: gl.tensor
    offsets_k: gl.tensor
    total_q: gl.tensor
    total_k: gl.tensor
    q_groups: gl.tensor
    k_groups: gl.tensor

    @constexpr_function
    def __init__(self, work, slots, offsets_q, offsets_k, total_q, total_k, q_groups, k_groups):
        self.work, self.slots, self.offsets_q, self.offsets_k = work, slots, offsets_q, offsets_k
        self.total_q, self.total_k, self.q_groups, self.k_groups = total_q, total_k, q_groups, k_groups


@gluon.jit
def _query_tile(items, item, HEADS_Q: gl.constexpr, HEADS_KV: gl.constexpr, D: gl.constexpr,
                BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """The :class:`QueryTile` of work item ``item``. Head outer, table slots inner: the programs running
    at once mostly hold query tiles of one (sequence, head), which stream the same K and V tiles
    through L2 (faster on causal batches)."""
    slot = item % items.slots
    head = item // items.slots
    seq = gl.load(items.work + 2 * slot)
    row0 = gl.load(items.work + 2 * slot + 1) * (CONSUMERS * CONSUMER_ROWS)
    used_seq = gl.maximum(seq, 0)
    q_start, len_q = layout.sequence_span(items.offsets_q, used_seq, items.total_q)
    k_start, len_k = layout.sequence_span(items.offsets_k, used_seq, items.total_k)
    if CAUSAL:
        col_end = bounds.keys_seen_below(gl.minimum(row0 + CONSUMERS * CONSUMER_ROWS, len_q), len_k,
                                         bounds.diagonal(len_q, len_k))
    else:
        col_end = len_k
    kv_head = head // (HEADS_Q // HEADS_KV)
    q_factor_row = head.to(gl.int64) * items.q_groups + layout.padded_seq_start(q_start, used_seq)
    k_factor_row = kv_head.to(gl.int64) * items.k_groups + layout.padded_seq_start(k_start, used_seq) // BLOCK_N
    vt_col = layout.padded_seq_start(k_start, used_seq).to(gl.int32)
    return QueryTile(seq, head, kv_head, row0, q_start, len_q, k_start.to(gl.int32), len_k, head * D, vt_col,
                     q_factor_row, k_factor_row, gl.cdiv(col_end, BLOCK_N))


@gluon.jit
def _load_kv(items, ring, k_desc, vt_desc, kv, HEADS_Q: gl.constexpr, HEADS_KV: gl.constexpr, D: gl.constexpr,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """Loader warp: takes the program's work items and hands each to the consumers
    (``persistent.ItemRing``), then loads its KV tiles (:func:`_load_item_kv`); the next item is taken
    once this one's loads are issued, i.e. when its consumers are STAGES tiles from its end."""
    n_items = items.slots * HEADS_Q
    first_tile = 0
    k = 0
    item = gl.program_id(0)
    while item < n_items:
        tile = _query_tile(items, item, HEADS_Q, HEADS_KV, D, BLOCK_N, CAUSAL)
        if tile.seq >= 0:  # empty slots are not handed out
            persistent.hand_out(ring, k, item, first_tile, 1)
            _load_item_kv(tile, first_tile, k_desc, vt_desc, kv, D, BLOCK_N, STAGES)
            first_tile += tile.n_tiles
            k += 1
        item = persistent.next_item(ring)
    persistent.hand_out(ring, k, n_items, first_tile, 1)


@gluon.jit
def _load_item_kv(tile, first_tile, k_desc, vt_desc, kv, D: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr):
    """Loader warp on one item: its K and V^T tile i into stage (first_tile + i) % STAGES once both
    consumers released that stage's previous use (the previous item's last tiles too: the ring runs on,
    so the next item's first tiles load under this one's last tiles and epilogue)."""
    k_col = tile.kv_head * D
    for i in range(tile.n_tiles):
        t = first_tile + i
        stage = t % STAGES
        mbarrier.wait(kv.empty.index(stage), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(kv.k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [tile.k_start + i * BLOCK_N, k_col], kv.k_ready.index(stage),
                                        kv.k.index(stage))
        mbarrier.expect(kv.v_ready.index(stage), vt_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(vt_desc, [k_col, tile.vt_col + i * BLOCK_N], kv.v_ready.index(stage),
                                        kv.v.index(stage))


@gluon.jit
def _scores_to_probabilities(s, row_scale, k_tile_factor, row_max, row_sum, col0, last_col, masked,
                             BLOCK_N: gl.constexpr, s_rows: gl.constexpr, s_cols: gl.constexpr,
                             ROW_TREE: gl.constexpr):
    """Online-softmax step on one S tile: (P in (0, 256], alpha, new row max, new row sum).

    The factors (positive) scale S inside exp2's fma: the row maximum of the scaled tile is the
    scaled maximum, so the raw tile needs no multiply of its own."""
    scale = row_scale * k_tile_factor
    if masked:
        cols = col0 + gl.arange(0, BLOCK_N, layout=s_cols)
        s = gl.where(cols[None, :] <= last_col[:, None], s, -float("inf"))
    new_max = gl.maximum(row_max, _row_reduce(s, True, s_rows, ROW_TREE) * scale)
    alpha = gl.exp2(row_max - new_max)
    p = gl.exp2(gl.fma(s, scale[:, None], (layout.P_STATIC_EXP - new_max)[:, None]))
    return p, alpha, new_max, row_sum * alpha + _row_reduce(p, False, s_rows, ROW_TREE)


@gluon.jit
def _row_reduce(x, MAXIMUM: gl.constexpr, rows_layout: gl.constexpr, TREE: gl.constexpr):
    """Row maxima (or sums) of an m64 x 128 wgmma accumulator tile. ``gl.max``/``gl.sum`` chain a
    thread's 32 values of a row one after the other; with TREE, column bits 6 to 3 (held by one
    thread) are first halved away in registers, leaving them 8 columns (a pair per thread, 4 threads)."""
    if TREE:
        for _ in gl.static_range(4):
            low, high = x.reshape([x.shape[0], 2, x.shape[1] // 2]).permute(0, 2, 1).split()
            x = gl.maximum(low, high) if MAXIMUM else low + high
    x = gl.max(x, axis=1) if MAXIMUM else gl.sum(x, axis=1)
    return gl.convert_layout(x, rows_layout, assert_trivial=True)


@gluon.jit
def _as_pv_operand(p, p_layout: gl.constexpr):
    """P (fp32, S's accumulator layout) as the fp8 A operand of P·V, with no data movement: the
    column bits are reordered as ``layout.pv_key_slot`` orders the keys of V^T."""
    keys = layout.gluon_columns_in_key_order(p.to(gl.float8e4nv), layout.PV_KEY_DIMS)
    return gl.convert_layout(keys, p_layout, assert_trivial=True)


@gluon.jit
def _consume(items, ring, q_desc, q_factor, k_factor, v_exponent, out, lse, q_smem, q_ready, kv, scale_log2,
             batch, CONSUMER: gl.constexpr, HEADS_Q: gl.constexpr, HEADS_KV: gl.constexpr, D: gl.constexpr,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, EXACT: gl.constexpr, CAUSAL: gl.constexpr,
             ROW_TREE: gl.constexpr):
    """One consumer warpgroup over the items the loader hands it (``persistent.ItemRing``), each by
    :func:`_consume_item`, from the KV tile the loader put first on the ring for it."""
    n_items = items.slots * HEADS_Q
    k = 0
    item, first_tile = persistent.take(ring, k, 4)
    while item < n_items:
        tile = _query_tile(items, item, HEADS_Q, HEADS_KV, D, BLOCK_N, CAUSAL)
        _consume_item(tile, first_tile, k, q_desc, q_factor, k_factor, v_exponent, out, lse, q_smem.index(CONSUMER),
                      q_ready.index(CONSUMER), kv, scale_log2, batch, CONSUMER, HEADS_Q, D, BLOCK_N, STAGES, EXACT,
                      CAUSAL, ROW_TREE)
        persistent.release(ring, k)
        k += 1
        item, first_tile = persistent.take(ring, k, 4)


@gluon.jit
def _consume_item(tile, first_tile, items_done, q_desc, q_factor, k_factor, v_exponent, out, lse, q_smem, q_ready,
                  kv, scale_log2, batch, CONSUMER: gl.constexpr, HEADS_Q: gl.constexpr, D: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, EXACT: gl.constexpr, CAUSAL: gl.constexpr,
                  ROW_TREE: gl.constexpr):
    """One consumer warpgroup on the program's ``items_done``-th item: its query rows against the item's
    KV tiles (the ring's tiles from ``first_tile`` on), then its rows of O and LSE. Each tile's MMAs are
    waited for at once: FlashAttention-3's ping-pong of the two consumers and its intra-warpgroup
    overlap (S of the next tile under this one's softmax; also on 64-key halves, which leave room for
    it beside the fresh P·V accumulator) measured no faster here: the softmax's own latency, not the
    MMA waits, sets the pace, and halves double its per-tile work (docs/perf-history.md)."""
    seq, head, kv_head, rows0 = tile.seq, tile.head, tile.kv_head, tile.rows0
    q_start, len_q, len_k, q_col = tile.q_start, tile.len_q, tile.len_k, tile.q_col
    q_factor_row, k_factor_row, n_tiles = tile.q_factor_row, tile.k_factor_row, tile.n_tiles
    ROWS: gl.constexpr = CONSUMER_ROWS
    s_layout: gl.constexpr = layout.wgmma_accumulator_layout(BLOCK_N, 16 if EXACT else 8)  # bf16 or e4m3 operands
    o_layout: gl.constexpr = layout.wgmma_accumulator_layout(D)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)

    row0 = rows0 + CONSUMER * ROWS
    rows = row0 + gl.arange(0, ROWS, layout=s_rows)
    in_seq = rows < len_q
    # The previous item's O went out through q_smem: every warp has read it before Q overwrites it.
    gl.thread_barrier()
    fence_async_shared()
    mbarrier.expect(q_ready, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [(q_start + row0).to(gl.int32), q_col], q_ready, q_smem)
    row_scale = gl.load(q_factor + q_factor_row + rows, mask=in_seq, other=1.0) * scale_log2
    diagonal = bounds.diagonal(len_q, len_k)
    # Tiles from the first one some row of this consumer does not fully see need the mask.
    if CAUSAL:
        last_col = bounds.last_key_seen(rows, len_k, diagonal)
        my_end = bounds.keys_seen_below(gl.minimum(row0 + ROWS, len_q), len_k, diagonal)
        first_masked = bounds.keys_seen_below(row0 + 1, len_k, diagonal) // BLOCK_N
    else:
        last_col = gl.full([ROWS], 0, gl.int32, layout=s_rows) + (len_k - 1)
        my_end = len_k
        first_masked = len_k // BLOCK_N
    my_tiles = gl.where(row0 < len_q, gl.cdiv(my_end, BLOCK_N), 0).to(gl.int32)

    acc = gl.zeros([ROWS, D], gl.float32, layout=o_layout)
    row_sum = gl.zeros([ROWS], gl.float32, layout=s_rows)
    row_max = gl.full([ROWS], FINITE_FLOOR, gl.float32, layout=s_rows)
    mbarrier.wait(q_ready, items_done & 1)
    # The tiles before first_masked as a loop without the mask, the rest with it: a branch around the
    # mask inside one loop splits the tile's scheduling (measured on the backward's steps).
    # Loops counted from 0, not as range(first_tile, ...): Triton 3.6 builds such a loop from 0 in a
    # partition (sm90.backward met it), which would split the ring's parities from the loader's.
    unmasked_tiles = gl.minimum(first_masked, my_tiles)
    for i in range(unmasked_tiles):
        acc, row_max, row_sum = _kv_step(first_tile + i, i, acc, row_max, row_sum, q_smem, kv, k_factor + k_factor_row,
                                         row_scale, last_col, BLOCK_N, STAGES, EXACT, ROW_TREE, False)
    for j in range(my_tiles - unmasked_tiles):
        i = unmasked_tiles + j
        acc, row_max, row_sum = _kv_step(first_tile + i, i, acc, row_max, row_sum, q_smem, kv, k_factor + k_factor_row,
                                         row_scale, last_col, BLOCK_N, STAGES, EXACT, ROW_TREE, True)
    # Tiles this consumer's rows never see (causal): released all the same.
    for i in range(my_tiles, n_tiles):
        t = first_tile + i
        mbarrier.wait(kv.k_ready.index(t % STAGES), (t // STAGES) & 1)
        mbarrier.arrive(kv.empty.index(t % STAGES), count=1)

    channels = gl.arange(0, D, layout=o_cols)
    v_factor = layout.scale_value(gl.load(v_exponent + (kv_head * batch + seq) * D + channels))
    seen = row_sum > 0.0
    inverse_sum = gl.where(seen, 1.0 / gl.where(seen, row_sum, 1.0), 0.0)
    o = fp8.saturating_cast(acc * gl.convert_layout(inverse_sum, o_rows)[:, None] * v_factor[None, :],
                            out.dtype.element_ty)
    # Through this consumer's Q buffer, free after the last S wgmma.
    layout.gluon_store_rows_through(o, out + ((q_start + row0) * HEADS_Q + head) * D, HEADS_Q * D, len_q - row0,
                                    q_smem)
    log_sum = (row_max - layout.P_STATIC_EXP + gl.log2(gl.where(seen, row_sum, 1.0))) * layout.LN2
    gl.store(lse + (q_start + rows) * HEADS_Q + head, gl.where(seen, log_sum, -float("inf")), mask=in_seq)


@gluon.jit
def _kv_step(t, i, acc, row_max, row_sum, q_smem, kv, k_factors, row_scale, last_col, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr, EXACT: gl.constexpr, ROW_TREE: gl.constexpr, MASKED: gl.constexpr):
    """A consumer's i-th KV tile of its item, ring tile t: S, the online softmax (MASKED: columns past each
    row's last seen key out), O += P V; returns (acc, row_max, row_sum)."""
    ROWS: gl.constexpr = CONSUMER_ROWS
    D: gl.constexpr = acc.shape[1]
    s_layout: gl.constexpr = layout.wgmma_accumulator_layout(BLOCK_N, 16 if EXACT else 8)  # bf16 or e4m3 operands
    o_layout: gl.constexpr = acc.type.layout
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    stage = t % STAGES
    phase = (t // STAGES) & 1
    mbarrier.wait(kv.k_ready.index(stage), phase)
    k_tile_factor = gl.load(k_factors + i)
    k_view = kv.k.index(stage).permute((1, 0))
    s = warpgroup_mma(q_smem, k_view, gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout), use_acc=False,
                      is_async=True)
    s, _, _ = warpgroup_mma_wait(0, deps=(s, q_smem, k_view))
    p, alpha, row_max, row_sum = _scores_to_probabilities(
        s, row_scale, k_tile_factor, row_max, row_sum, i * BLOCK_N, last_col, MASKED, BLOCK_N, s_rows, s_cols,
        ROW_TREE)
    p8 = _as_pv_operand(p, p_layout)
    mbarrier.wait(kv.v_ready.index(stage), phase)
    v_view = kv.v.index(stage).permute((1, 0))
    # A fresh accumulator per tile: FP8 wgmma adds into its accumulator with truncated
    # alignment, which would bias small late tiles towards zero against a large running O.
    o_tile = warpgroup_mma(p8, v_view, gl.zeros([ROWS, D], gl.float32, layout=o_layout), use_acc=False,
                           is_async=True)
    o_tile, _ = warpgroup_mma_wait(0, deps=(o_tile, v_view))
    mbarrier.arrive(kv.empty.index(stage), count=1)
    return gl.fma(acc, gl.convert_layout(alpha, o_rows)[:, None], o_tile), row_max, row_sum


# WorkItems holds these as tensors: a value of 1 must not become a constexpr.
@gluon.jit(do_not_specialize=("slots", "total_q", "total_k", "q_groups", "k_groups"))
def _attention_forward_kernel(
    q_desc, k_desc, vt_desc, q_factor, k_factor, v_exponent, out, lse, offsets_q, offsets_k, total_q, total_k,
    work, slots, next_item, scale_log2, q_groups, k_groups, batch,
    HEADS_Q: gl.constexpr, HEADS_KV: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    SCORES: gl.constexpr, CAUSAL: gl.constexpr, LOADER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, ROW_TREE: gl.constexpr,
):
    """At most one program per SM, each taking work items until none is left (:func:`_load_kv`) with its
    shared memory, barriers and KV ring set up once, so an item's first KV tiles load under the
    previous item's last tiles and its O stores (a program per item paid each start and finish in
    full: many short items, as ragged and cross batches have, spent much of their time so).
    ``q_desc``: rebased Q's TMA descriptor, its token factors in ``q_factor``."""
    EXACT: gl.constexpr = SCORES == "bf16"
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS, CONSUMER_ROWS, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(vt_desc.dtype, [STAGES, D, BLOCK_N], vt_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ring = persistent.item_ring(next_item, CONSUMERS)
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(c), count=1)
    for stage in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(stage), count=1)
        mbarrier.init(v_ready.index(stage), count=1)
        mbarrier.init(kv_empty.index(stage), count=CONSUMERS)
    fence_async_shared()

    kv = KVStages(k_smem, v_smem, k_ready, v_ready, kv_empty)
    items = WorkItems(work, slots, offsets_q, offsets_k, total_q, total_k, q_groups, k_groups)
    gl.warp_specialize(
        [
            (_consume, (items, ring, q_desc, q_factor, k_factor, v_exponent, out, lse, q_smem, q_ready, kv,
                        scale_log2, batch, 0, HEADS_Q, HEADS_KV, D, BLOCK_N, STAGES, EXACT, CAUSAL, ROW_TREE)),
            (_consume, (items, ring, q_desc, q_factor, k_factor, v_exponent, out, lse, q_smem, q_ready, kv,
                        scale_log2, batch, 1, HEADS_Q, HEADS_KV, D, BLOCK_N, STAGES, EXACT, CAUSAL, ROW_TREE)),
            (_consume, (items, ring, q_desc, q_factor, k_factor, v_exponent, out, lse, q_smem, q_ready, kv,
                        scale_log2, batch, 2, HEADS_Q, HEADS_KV, D, BLOCK_N, STAGES, EXACT, CAUSAL, ROW_TREE)),
            (_load_kv, (items, ring, k_desc, vt_desc, kv, HEADS_Q, HEADS_KV, D, BLOCK_N, STAGES, CAUSAL)),
        ],
        [4, 4, 1],
        [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS],
    )


def _q_descriptor(q_rebased: torch.Tensor):
    """The TMA descriptor of rebased Q, by token rows (``[total, H * D]``), a consumer's rows at a time."""
    total_q, heads_q, dim = q_rebased.shape
    return operand_descriptor(q_rebased.view(total_q, heads_q * dim), [CONSUMER_ROWS.value, dim])


def _kv_descriptors(k_rebased: torch.Tensor, vt: torch.Tensor, block_n: int):
    """The kernel's TMA descriptors of K (by token rows, ``[total, H * D]``) and V^T (by key columns)."""
    total_k, heads_kv, dim = k_rebased.shape
    return (operand_descriptor(k_rebased.view(total_k, heads_kv * dim), [block_n, dim]),
            operand_descriptor(vt.view(heads_kv * dim, vt.shape[2]), [dim, block_n]))


def forward_rebased(q_rebased, q_factor, k_rebased, k_factor, vt, v_exponent, offsets_q, offsets_k, *, causal,
                    softmax_scale, out_dtype, config):
    """The kernel on rebased Q, K (``rebase_feature``: per token / per ``BLOCK_N`` tile) and V^T."""
    total_q, heads_q, dim = q_rebased.shape
    total_k, heads_kv, _ = k_rebased.shape
    out = torch.empty(total_q, heads_q, dim, dtype=out_dtype, device=q_rebased.device)
    lse = torch.empty(total_q, heads_q, dtype=torch.float32, device=q_rebased.device)
    work = work_list(offsets_q, offsets_k, total_q, total_k, BLOCK_M, causal=causal)
    if work.shape[0]:
        programs = persistent.program_count(work.shape[0] * heads_q, q_rebased.device)
        _attention_forward_kernel[(programs,)](
            _q_descriptor(q_rebased), *_kv_descriptors(k_rebased, vt, config["BLOCK_N"]), q_factor, k_factor,
            v_exponent, out, lse, offsets_q, offsets_k, total_q, total_k, work, work.shape[0],
            persistent.counter(q_rebased.device), softmax_scale * layout.LOG2E.value, q_factor.shape[1],
            k_factor.shape[1], offsets_q.numel() - 1, HEADS_Q=heads_q, HEADS_KV=heads_kv, D=dim, CAUSAL=causal,
            num_warps=4, **config,
        )
    return out, lse


def attention_forward(q, k, v, *, causal: bool, softmax_scale: float, out_dtype=torch.bfloat16, scores="fp8"):
    """Jagged attention of MXFP8 inputs on a Hopper GPU: the arguments and results of
    ``portable.forward.attention_forward``. The rebased operands are kept for the next call on the same
    inputs (``rebase.kept_rebase_kv``)."""
    config = tile_config(q.head_dim, scores)
    exact = scores == "bf16"
    rebased_q = kept_rebase_feature(q, group=1, exact=exact)
    rebased_kv = kept_rebase_kv(k, v, config["BLOCK_N"], exact=exact, v_order=layout.PV_ORDER)
    return forward_rebased(*rebased_q, *rebased_kv, q.offsets, k.offsets, causal=causal, softmax_scale=softmax_scale,
                           out_dtype=out_dtype, config=config)


def attention_forward_hp(q, k, v, offsets_q, offsets_k, *, causal: bool, softmax_scale: float, out_dtype=None,
                         scores="fp8", check_finite=False, for_backward=False):
    """Like :func:`attention_forward` for bf16/fp16 q, k, v (``portable.forward.attention_forward_hp``'s
    arguments): Q quantized and rebased by one pass, K and V by another. With ``check_finite`` the passes
    flag NaN/Inf in what they read (``mxfp8.checked_after``). ``for_backward`` (FP8 scores): the K and V
    passes, and Q's, also write the backward's copies of them and keep them for it (``keep_for`` of
    ``rebase.quantize_rebase_kv`` and ``quantize_rebase_feature``), so that the backward does not read Q, K
    and V again."""
    config = tile_config(q.shape[-1], scores)
    exact = scores == "bf16"
    flags = torch.zeros(3, dtype=torch.float32, device=q.device) if check_finite else None  # q, k, v
    q_flag, kv_flags = (None, None) if flags is None else (flags[:1], flags[1:])
    keep_for = sm90_backward.preparation() if for_backward and not exact else None
    q_operand = quantize_rebase_feature(q, offsets_q, group=1, exact=exact, nonfinite=q_flag, keep_for=keep_for)
    kv_operands = quantize_rebase_kv(k, v, offsets_k, config["BLOCK_N"], exact=exact, v_order=layout.PV_ORDER,
                                     nonfinite=kv_flags, keep_for=keep_for)
    return checked_after(flags, ("q", "k", "v"), lambda: forward_rebased(
        *q_operand, *kv_operands, offsets_q, offsets_k, causal=causal, softmax_scale=softmax_scale,
        out_dtype=q.dtype if out_dtype is None else out_dtype, config=config))
