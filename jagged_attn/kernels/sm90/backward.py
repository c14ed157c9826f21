"""Varlen MXFP8 attention backward for Hopper in Gluon, warp-specialized as in FlashAttention-3.

Each work item is a 128-key tile of one (sequence, KV head); a program takes one item or, on
batches of short tiles, one every ``programs`` items (``program_count``). The default warpgroup streams, for
every 64-row query tile of every query head of the KV head's group, the query-side operands into
a ring of shared-memory stages with TMA (Q and dO on the feature axis, Q^T and dO^T on the
sequence axis, and the per-query vectors: token scales, lse2, Delta) and computes dQ. Two
consumer warpgroups, 64 keys each, run per stage::

    S^T = K Q^T,  dP^T = V dO^T                (bf16 or FP8 wgmma, fp32 in registers)
    P^T = exp2(S^T - LSE),  dS^T = P^T (dP^T - Delta),  publish dS
    dV += P^T dO,  dK += dS^T Q                (fp16 / FP8 wgmma, P^T and dS^T straight from registers)

where publishing stores dS (e4m3, queries x keys) in shared memory from registers as 16-bit key pairs
by transposing ``stmatrix`` stores (keys in ``layout.ds_key_slot`` order, which the producer gives K^T
too); the default warpgroup then forms the tile's dQ partial = dS K over both consumers' keys, 32
columns at a time, and adds it to global memory with TMA bulk reduce-adds (with FP8 scores it stages
two pieces per fence and barrier: ``DqStaging``). So the consumers never wait for each other (an earlier
form coupled them through the per-step dS exchange, each computing half of dQ).

FP8 wgmma accumulates with truncated alignment: each add loses low bits towards zero against the
running sum, so a sum chained over many small steps comes out biased small. dK's FP8 wgmma therefore
starts from a zero accumulator each step and is added in fp32 (chained in an fp16 wgmma instead, as dV
is, and waited for with dV's, it saved a wait but its doubled tensor time on the consumers' chain made
the kernel slower: docs/perf-history.md v63). dV's wgmma is fp16 on P^T's e4m3
values and an fp16 copy of dO^T's (both exact in fp16; the producer writes dO^T so), whose fp32
accumulation chains over the steps without that bias: the chained FP8 dV had shrunk the dV of keys that
many queries see (3-5e-4 of its least-squares factor at 4k keys of flat attention), which rel-L2 does
not show and which kept a QK-norm LM's training 0.03 nats behind BF16's (docs/PERF.md). A fresh FP8
tile per step added in fp32, as for dK, needs 64 registers more than the consumers have (taken in
two halves it spilled nothing but was slower). dS^T's accumulator registers are the A operand of dK's
FP8 wgmma without any shuffle because the producer stores Q^T with its tokens in
``layout.pv_key_slot`` order (the forward's trick for V^T, here along queries); P^T's, as 16-bit
values, are the fp16 wgmma's A operand in natural token order, in which dO^T is stored. dQ's partials
are added in L2, in bf16 on batches of at most 16k keys a sequence (``dq_accum_dtype``), in units that
``backward_passes.finish_dq`` scales.

S^T and dP^T come from bf16 wgmmas when the producer stored Q, K, V and dO's MX values as bf16
(``scores="bf16"``, backend ``hopper-exact-scores``: fp32 accumulation, so S and dP are exact, with no
token scales left to apply) and from FP8 wgmma
otherwise (~13-bit accumulation: FP8 S moves the gradients by 3e-2 to 2e-1 on heavy-tailed and
outlier inputs, FP8 dP heavy-tailed dK's cosine against fp64 by up to 2.5e-3; docs/perf-history.md). S^T
is one chained wgmma: its head_dim halves summed apart in fp32 spilled here and, even with the forward doing
the same, brought the public call's gradients no closer to fp64 (docs/perf-history.md v72).
Operands, scales and their folding are those of ``producers.backward_passes`` (its docstring
and producers): per-token scales on the feature axis (applied to S^T and dP^T), dO^T's per-(sequence,
channel) scales (applied in dV's epilogue), Q^T holding each token over its own scale and K^T on its key
tile's (the forward's operand form), each folded into dS, P on the static 2^8 scale and dS on a running
per-warpgroup power-of-two scale (rescaling dK's accumulator when it grows). With FP8 scores each
consumer's running scale also takes the other's of the item's previous step (waited for:
``_other_byte``), so both agree on every step but those where one grows and the default warpgroup
chains their dQ products without bringing one onto the other's scale first. The scales are a function
of the inputs alone, so dK and dV are the same on every run; a power-of-two raise of an e4m3 grid
changes the rounding only of values below its smallest normal.

Exact S and dP keep the gradients within 5e-3 of the reference backend on every input kind of the
tests, cosine against fp64 within 1e-4 of the reference's; FP8 S and dP (backend ``hopper``, faster)
1.5e-2 to 2e-1 from it on heavy-tailed and outlier inputs (docs/perf-history.md). The
consumers are at their register ceiling and sensitive to every instruction, and the dQ warpgroup's
steps (publishing, wgmmas, staging, reduce-adds) are about as long as theirs: lengthening them slows the
kernel, but hiding their wgmmas' latency (the next piece's products issued while a piece is staged) does not
pay for its registers: at the dQ warpgroup's 56, two pieces in flight make ptxas serialize every wgmma of
the kernel, and consumers at 216 to give it 72 lose more than it gains. dQ formed in the consumers instead,
each over its own keys, was measured slower still: their chains are latency-bound, and dQ's round trips
then lengthen each of them (docs/perf-history.md; speed: docs/PERF.md).
"""


import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon._runtime import constexpr_function
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.core import _aggregate as aggregate  # Triton 3.6's Gluon does not export it yet

from jagged_attn.offsets import known_longest

from ..common import bounds, layout
from ..common.layout import SCORE_MODES
from ..common.persistent import resident_programs
from ..common.schedule import work_list
from ..common.tma import operand_descriptor
from ..portable.backward import launch_deterministic_dq
from ..producers.rebase import take_backward_copies
from ..producers.backward_passes import (
    Q_DO_FACTOR,
    P_LSE2,
    Q_DELTA,
    Q_FACTOR,
    ROW_VECTORS,
    Prepared,
    check_inputs,
    finish_dq,
)
from . import HEAD_DIMS

KEYS_PER_CONSUMER = gl.constexpr(64)  # one wgmma M
CONSUMERS = gl.constexpr(2)
BLOCK_N = gl.constexpr(KEYS_PER_CONSUMER.value * CONSUMERS.value)  # keys per program
BLOCK_M = gl.constexpr(64)  # queries per stage
QUERY_DIMS = gl.constexpr(layout.key_order_dims(layout.pv_key_slot, BLOCK_M.value.bit_length() - 1))
# Per-query vectors a TMA load brings, Q's (Q_FACTOR, P_LSE2) or dO's (Q_DO_FACTOR, Q_DELTA): one box of two
# rows, since each load the default warpgroup issues costs its step a warpgroup barrier and address work.
VECTORS_PER_LOAD = gl.constexpr(2)
# The per-query vectors in shared memory: unswizzled fp32 rows, read one [BLOCK_M] row at a time by the
# consumers (VECTOR_LAYOUT) and written a [VECTORS_PER_LOAD, BLOCK_M] box at a time by TMA (VECTOR_BOX_LAYOUT).
VECTOR_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1))
VECTOR_BOX_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
# Columns of one dQ reduce-add box (the piece's accumulator: 16 registers); ``dq_piece`` halves it where
# shared memory is short, and the kernel takes the width from its dQ descriptor's box.
DQ_PIECE = 32


@constexpr_function
def _dq_group(exact, pieces):
    """dQ pieces staged and added per fence and barrier (:class:`DqStaging`): two with FP8 scores, where a
    step's pieces come in whole pairs of groups; one with exact scores, whose bf16 operands leave no
    shared memory for the two more buffers."""
    return 1 if exact or pieces % 4 else 2


# dQ's partials are staged and added in bf16 where every key sequence is known to hold at most this many
# keys: half the bytes of fp32 through shared memory, in the L2's reduce-adds, the zero fill and the finish
# pass. Each add rounds the running sum to 8 bits: simulated, dQ moves by 0.5% at 2k keys, 1.3% at 16k and
# 2.4% at 64k, beside the ~5% that the FP8 operands already put on it (docs/perf-history.md v34), so past
# 16k keys (or where the longest is not known without a wait: value checks off) the sums stay fp32.
BF16_DQ_MAX_KEYS = 16384
# dQ chains consumer 0's product (|sum| < 64 * 448^2 < 2^24) times scale0 / scale1 into one fp32
# accumulator, so that ratio must stay below 2^100. Only when consumer 1's dS scale is below 2^-100
# of consumer 0's (in practice: its key tile is empty, still on the smallest scale) is it raised to
# meet the bound, which moves consumer 1's product by at most 2^24 * 2^-100 * scale0: nothing at
# the scale of consumer 0's product, to which it is added.
MAX_SCALE_RATIO = gl.constexpr(2.0**100)
# The dS exchange buffers' swizzle (their 64-byte rows): e4m3 for the dQ wgmmas, 16-bit key pairs for the
# consumers' stores (_share_ds).
DS_SWIZZLE_BYTES = gl.constexpr(64)
# A query row past every sequence's (the causal mask's "no query sees this key").
NO_QUERY = gl.constexpr(1 << 30)
# A [1] tensor whose one value every thread holds (scalars through shared memory).
EVERY_THREAD = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))


def tile_config(head_dim: int) -> dict:
    """Pipeline depth and the registers of the consumer warpgroups (the default warpgroup, loads and
    dQ, gets the rest of the register file)."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"no configuration for head_dim={head_dim}")
    return dict(STAGES=2, CONSUMER_REGS=224)


# Mean query tiles per program (query tiles of a sequence times the heads of a KV group) up to which
# a batch's programs count as short (short_programs).
SHORT_PROGRAM_STEPS = 16


def short_programs(prep: Prepared) -> bool:
    """Whether a batch's key tiles are short by the host's estimate (no read of the offsets): at most
    ``SHORT_PROGRAM_STEPS`` query tiles each on average, as on cross-attention batches with short
    queries, where starting and finishing a tile is much of its cost."""
    mean_steps = prep.heads_q // prep.heads_kv * prep.total_q / (max(prep.batch, 1) * BLOCK_M.value)
    return mean_steps <= SHORT_PROGRAM_STEPS


@aggregate
class QueryStages:
    """The ring of query-side stages the default warpgroup fills and the consumers drain: per stage
    Q and dO on the feature axis (``[BLOCK_M, D]``), Q^T (e4m3) and dO^T (fp16) on the sequence axis
    (``[D, BLOCK_M]``), ``ROW_VECTORS`` per-query vectors (``rows``, ``[STAGES * ROW_VECTORS,
    BLOCK_M]``); ``q_ready`` / ``do_ready`` signal Q's and dO's loads, ``empty`` both consumers'
    release."""
    q: gl.shared_memory_descriptor
    qt: gl.shared_memory_descriptor
    do: gl.shared_memory_descriptor
    dot: gl.shared_memory_descriptor
    rows: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    do_ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor

    @constexpr_function
    def __init__(self, q, qt, do, dot, rows, q_ready, do_ready, empty):
        self.q, self.qt, self.do, self.dot, self.rows = q, qt, do, dot, rows
        self.q_ready, self.do_ready, self.empty = q_ready, do_ready, empty


@aggregate
class DsExchange:
    """Each step's dS from the consumers to the dQ warpgroup, double-buffered: ``ds`` e4m3 ``[2 *
    CONSUMERS, BLOCK_M, KEYS_PER_CONSUMER]`` and ``byte`` int32 ``[2 * CONSUMERS, 1]``, the dS scale's
    E8M0 byte (buffer b, consumer c at slot ``b * CONSUMERS + c``); ``ready[b]`` when both consumers published
    into buffer b, ``free[b]`` when the dQ warpgroup is done with it. The consumers also read each other's
    bytes of the previous step (:func:`_other_byte`)."""
    ds: gl.shared_memory_descriptor
    byte: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    free: gl.shared_memory_descriptor

    @constexpr_function
    def __init__(self, ds, byte, ready, free):
        self.ds, self.byte, self.ready, self.free = ds, byte, ready, free


@aggregate
class DqStaging:
    """Shared memory the dQ warpgroup stages its pieces in for their TMA reduce-adds (``[BLOCK_M, dq_piece]``
    each). The pieces go in groups of ``group`` with one fence and one barrier a group (:func:`_dq_pieces`); the
    groups alternate between two sets of ``group`` buffers (``even*`` and ``odd*``), so that one group is
    written while the adds of the one before read the other set. Each buffer is an allocation of its own:
    with one allocation of several slots Triton puts a barrier before each store, as it cannot see that
    the store misses the slot an add reads. With ``group`` 1, ``even1`` and ``odd1`` are ``even0`` and
    ``odd0``."""
    even0: gl.shared_memory_descriptor
    even1: gl.shared_memory_descriptor
    odd0: gl.shared_memory_descriptor
    odd1: gl.shared_memory_descriptor
    group: gl.constexpr

    @constexpr_function
    def __init__(self, even0, even1, odd0, odd1, group):
        self.even0, self.even1, self.odd0, self.odd1 = even0, even1, odd0, odd1
        self.group = gl.constexpr(group)

    @gluon.jit
    def buffer(self, group_index: gl.constexpr, index: gl.constexpr):
        """Group ``group_index``'s buffer for its piece ``index``."""
        if group_index % 2 == 0:
            buffer = self.even0 if index == 0 else self.even1
        else:
            buffer = self.odd0 if index == 0 else self.odd1
        return buffer


@aggregate
class KeyOperands:
    """The current key tile's operands, one per consumer: K and V on the feature axis (``k``, ``v``:
    ``[CONSUMERS, KEYS_PER_CONSUMER, D]``, for S^T and dP^T; each consumer loads its own, ``ready[c]``
    once they arrived) and K^T on the sequence axis (``kt``: ``[CONSUMERS, D, KEYS_PER_CONSUMER]``,
    for the dQ warpgroup's wgmmas, which loads both halves itself, ``kt_ready`` once they arrived), and
    their TMA descriptors."""
    k_desc: tma.tensor_descriptor
    kt_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    k: gl.shared_memory_descriptor
    kt: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    kt_ready: gl.shared_memory_descriptor

    @constexpr_function
    def __init__(self, k_desc, kt_desc, v_desc, k, kt, v, ready, kt_ready):
        self.k_desc, self.kt_desc, self.v_desc = k_desc, kt_desc, v_desc
        self.k, self.kt, self.v, self.ready, self.kt_ready = k, kt, v, ready, kt_ready


@aggregate
class KeyGradients:
    """What the consumers fold in and write: K's and V's per-token scales (``k_scale``, ``v_scale``:
    fp32 ``[Hkv, total_k]``), dO^T's per-(sequence, channel) scales (``dot_scale``: fp32 ``[Hkv, B, D]``,
    dV's column factors), and the outputs ``dk``, ``dv`` (``[total_k, Hkv, D]``)."""
    k_scale: gl.tensor
    v_scale: gl.tensor
    dot_scale: gl.tensor
    dk: gl.tensor
    dv: gl.tensor

    @constexpr_function
    def __init__(self, k_scale, v_scale, dot_scale, dk, dv):
        self.k_scale, self.v_scale, self.dot_scale = k_scale, v_scale, dot_scale
        self.dk, self.dv = dk, dv


@aggregate
class KeyTile:
    """One work item: key tile ``n_start`` (``BLOCK_N`` keys from there) of sequence ``seq`` (below 0:
    an empty slot, nothing to do), KV head ``kv_head``; the sequence's first query row ``q_start``
    (int32, for TMA coordinates) and first key row ``k_start``, its lengths, its first padded columns
    (``layout.padded_seq_start``); the steps: query tiles ``[m_lo, m_end)`` of each query head of the
    group from ``first_head`` on, ``n_steps`` in all."""
    seq: gl.tensor
    kv_head: gl.tensor
    n_start: gl.tensor
    q_start: gl.tensor
    len_q: gl.tensor
    k_start: gl.tensor
    len_k: gl.tensor
    padded_q_start: gl.tensor
    padded_k_start: gl.tensor
    first_head: gl.tensor
    m_lo: gl.tensor
    m_end: gl.tensor
    n_steps: gl.tensor

    @constexpr_function
    def __init__(self, seq, kv_head, n_start, q_start, len_q, k_start, len_k, padded_q_start, padded_k_start,
                 first_head, m_lo, m_end, n_steps):
        self.seq, self.kv_head, self.n_start = seq, kv_head, n_start
        self.q_start, self.len_q, self.k_start, self.len_k = q_start, len_q, k_start, len_k
        self.padded_q_start, self.padded_k_start = padded_q_start, padded_k_start
        self.first_head, self.m_lo, self.m_end, self.n_steps = first_head, m_lo, m_end, n_steps


@aggregate
class WorkItems:
    """The work of a launch: the ``schedule.work_list`` table ``work`` (``slots`` rows of (sequence, key
    tile)) for each KV head, ``slots * HEADS_KV`` items, KV head outer; and the batch's offsets and
    totals, from which :func:`_key_tile` describes an item."""
    work: gl.tensor
    slots: gl.tensor
    offsets_q: gl.tensor
    offsets_k: gl.tensor
    total_q: gl.tensor
    total_k: gl.tensor

    @constexpr_function
    def __init__(self, work, slots, offsets_q, offsets_k, total_q, total_k):
        self.work, self.slots, self.offsets_q, self.offsets_k = work, slots, offsets_q, offsets_k
        self.total_q, self.total_k = total_q, total_k


@gluon.jit
def _key_tile(items, item, HEADS_Q: gl.constexpr, HEADS_KV: gl.constexpr, CAUSAL: gl.constexpr):
    """The :class:`KeyTile` of work item ``item`` (each partition describes its tiles itself:
    :func:`_for_each_tile`). KV head outer, table slots inner: the programs running at once mostly hold
    key tiles of one (sequence, head), which read the same Q / dO tiles and add dQ to the same rows at
    about the same time, so L2 serves them (the key tiles of many heads at once thrashed it, causal batches
    most)."""
    slot = item % items.slots
    kv_head = item // items.slots
    seq = gl.load(items.work + 2 * slot)
    n_start = gl.load(items.work + 2 * slot + 1) * BLOCK_N
    used_seq = gl.maximum(seq, 0)
    q_start, len_q = layout.sequence_span(items.offsets_q, used_seq, items.total_q)
    k_start, len_k = layout.sequence_span(items.offsets_k, used_seq, items.total_k)
    # Query tiles before m_lo see none of the tile's keys (causal, bottom-right aligned).
    if CAUSAL:
        m_lo = bounds.first_query_seeing(n_start, bounds.diagonal(len_q, len_k)) // BLOCK_M * BLOCK_M
    else:
        m_lo = 0
    tiles_per_head = gl.maximum(gl.cdiv(len_q, BLOCK_M) - m_lo // BLOCK_M, 0)
    group: gl.constexpr = HEADS_Q // HEADS_KV
    return KeyTile(seq, kv_head, n_start, q_start.to(gl.int32), len_q, k_start, len_k,
                   layout.padded_seq_start(q_start, used_seq).to(gl.int32),
                   layout.padded_seq_start(k_start, used_seq), kv_head * group, m_lo,
                   m_lo + tiles_per_head * BLOCK_M, group * tiles_per_head)


@gluon.jit
def _next_query_tile(head, m0, m_lo, m_end):
    """(query head, first query row) of the step after the one at (head, m0): query tiles inner,
    from m_lo up to m_end, heads outer (counted along, not divided out of the step index)."""
    m0 = m0 + BLOCK_M
    if m0 >= m_end:
        head += 1
        m0 = m_lo
    return head, m0


@gluon.jit
def _for_each_tile(items, per_tile: gl.constexpr, args, HEADS_Q: gl.constexpr, HEADS_KV: gl.constexpr,
                   CAUSAL: gl.constexpr, IN_TURN: gl.constexpr):
    """``per_tile(item, tile, first_step, kv_phase, *args)`` for each of the program's work items that is
    not an empty slot (:func:`_key_tile`): its one item or, IN_TURN, items ``program, program + programs,
    ...``. ``first_step`` counts the earlier tiles' steps (the stage ring and the dS buffers run on from
    tile to tile), ``kv_phase`` is the parity of the tiles done (the per-tile barriers' phase). Every
    partition walks the items so, and agrees with the others on each tile without exchanging it. One item
    compiles without the loop: its counters would cost long tiles' steps instructions and registers."""
    if IN_TURN:
        step = 0
        tiles_done = 0
        for item in range(gl.program_id(0), items.slots * HEADS_KV, gl.num_programs(0)):
            tile = _key_tile(items, item, HEADS_Q, HEADS_KV, CAUSAL)
            if tile.seq >= 0:
                per_tile(item, tile, step, tiles_done & 1, *args)
                step += tile.n_steps
                tiles_done += 1
    else:
        item = gl.program_id(0)
        tile = _key_tile(items, item, HEADS_Q, HEADS_KV, CAUSAL)
        if tile.seq >= 0:
            per_tile(item, tile, 0, 0, *args)


@gluon.jit
def _load_pair(feature_desc, transposed_desc, rows_desc, feature_smem, transposed_smem, row_smem, ready, stage,
               head, row, column, padded_q, FIRST_VECTOR: gl.constexpr, D: gl.constexpr):
    """One query tile of a tensor on both axes (feature ``[BLOCK_M, D]``, transposed ``[D, BLOCK_M]``)
    and ``VECTORS_PER_LOAD`` of its per-query vectors from FIRST_VECTOR on into ``stage``, all signalled
    on ``ready``."""
    gl.static_assert(FIRST_VECTOR % VECTORS_PER_LOAD == 0, "a load's vectors start on a box boundary")
    mbarrier.expect(ready, feature_desc.block_type.nbytes + transposed_desc.block_type.nbytes
                    + rows_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(feature_desc, [row, head * D], ready, feature_smem.index(stage))
    tma.async_copy_global_to_shared(transposed_desc, [head * D, column], ready, transposed_smem.index(stage))
    boxes = row_smem._reinterpret(gl.float32, [row_smem.shape[0] // VECTORS_PER_LOAD, VECTORS_PER_LOAD, BLOCK_M],
                                  rows_desc.layout)
    tma.async_copy_global_to_shared(rows_desc, [FIRST_VECTOR, head * padded_q + column], ready,
                                    boxes.index((stage * ROW_VECTORS + FIRST_VECTOR) // VECTORS_PER_LOAD))


@gluon.jit
def _load_step(i, head, m0, q_desc, qt_desc, do_desc, dot_desc, rows_desc, stages, q_start, padded_q_start, padded_q,
               D: gl.constexpr, STAGES: gl.constexpr):
    """The operands of step i (query head ``head``, rows from ``m0``) into stage i % STAGES once both
    consumers released it; with Q its token scales and P_LSE2, with dO Q_DO_FACTOR and Q_DELTA
    (``rows_desc``: the ``[ROW_VECTORS, Hq * padded_q]`` vectors of :func:`_padded_row_vectors`; the exact
    path reads no Q_DO_FACTOR, which its producer leaves unwritten, but it loads with Q_DELTA all the same)."""
    gl.static_assert((P_LSE2 == Q_FACTOR + 1) & (Q_DELTA == Q_DO_FACTOR + 1),
                     "each load's two vectors are adjacent rows of the vector buffer")
    stage = i % STAGES
    mbarrier.wait(stages.empty.index(stage), ((i // STAGES) & 1) ^ 1)
    row = q_start + m0
    column = padded_q_start + m0
    _load_pair(q_desc, qt_desc, rows_desc, stages.q, stages.qt, stages.rows, stages.q_ready.index(stage), stage, head,
               row, column, padded_q, Q_FACTOR, D)
    _load_pair(do_desc, dot_desc, rows_desc, stages.do, stages.dot, stages.rows, stages.do_ready.index(stage), stage,
               head, row, column, padded_q, Q_DO_FACTOR, D)


@gluon.jit
def _as_query_operand(x, operand_layout: gl.constexpr):
    """An e4m3 ``[keys, BLOCK_M]`` tile in S^T's accumulator layout as the A operand of a wgmma
    reducing over queries, with no data movement: the query bits are reordered as
    ``layout.pv_key_slot`` orders the tokens of Q^T (dK's wgmma)."""
    return gl.convert_layout(layout.gluon_columns_in_key_order(x, QUERY_DIMS), operand_layout, assert_trivial=True)


@gluon.jit
def _published_key_pairs(ds8):
    """dS^T ``[keys, BLOCK_M]`` (e4m3, S^T's accumulator layout) as dS ``[BLOCK_M, keys / 2]`` of int16 e4m3
    pairs: keys r and r + 8 of each 16 in one pair (r in the low byte), the ``layout.ds_key_slot`` order of
    dS's key-contiguous rows. A thread holds both keys of a pair (rows r and r + 8 of its warp's 16), so one
    byte permute makes two pairs of the bytes its conversion to e4m3 packed for dK's wgmma."""
    KEYS: gl.constexpr = ds8.shape[0]
    # rows: (warp, register bit: r or r + 8, lane bits 2-4)
    split = ds8.to(gl.int8, bitcast=True).reshape([KEYS // 16, 2, 8, BLOCK_M]).permute((0, 2, 3, 1))
    low, high = split.split()
    pairs = gl.inline_asm_elementwise("prmt.b32 $0, $2, $3, 0x5140; prmt.b32 $1, $2, $3, 0x7362;", "=r,=r,r,r",
                                      [low, high], dtype=gl.int16, is_pure=True, pack=4)
    return pairs.reshape([KEYS // 2, BLOCK_M]).permute((1, 0))


@builtin
def _reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA bulk ``global[coord:] += src`` (fp32 adds in L2, asynchronous: ``tma.store_wait`` waits
    for the read of ``src``). Triton 3.6 builds the op but Gluon does not export it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _shared_scalar(smem):
    """The one value of a ``[1]`` shared buffer, in every thread (the layout replicates it over
    lanes and warps, so no shuffles reduce it)."""
    return gl.max(smem.load(EVERY_THREAD), axis=0)


@gluon.jit
def _share_ds(ds8, ds_byte, exchange, i, CONSUMER: gl.constexpr):
    """Publish this warpgroup's dS (e4m3 dS^T on the running scale ``ds_byte``), queries x keys,
    keys contiguous (FP8 wgmma reads only K-major operands), and its scale's byte (``[1]``) in buffer
    i % 2 for the dQ warpgroup's wgmmas."""
    buffer = i % 2
    slot = buffer * CONSUMERS + CONSUMER
    pairs = _published_key_pairs(ds8)
    mbarrier.wait(exchange.free.index(buffer), ((i // 2) & 1) ^ 1)
    pair_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=DS_SWIZZLE_BYTES, element_bitwidth=16,
                                                     rank=2)
    exchange.ds.index(slot)._reinterpret(gl.int16, [BLOCK_M, KEYS_PER_CONSUMER // 2], pair_layout).store(pairs)
    exchange.byte.index(slot).store(gl.full([1], 0, gl.int32, layout=EVERY_THREAD) + ds_byte)
    fence_async_shared()
    gl.thread_barrier()  # every warp's part written before the warpgroup arrives
    mbarrier.arrive(exchange.ready.index(buffer), count=1)


@gluon.jit
def _other_byte(exchange, i, item_first, CONSUMER: gl.constexpr):
    """The other consumer's dS byte of step i - 1 where that is a step of the same item (0 at an item's
    first step), once both published it. Taking it keeps both consumers' scales equal on every step but
    those where either grows (so the dQ warpgroup chains their products); being waited for, it makes
    every scale a function of the inputs, not of which consumer ran ahead. Every step past the program's
    first waits, an item's first too, so the other's step i + 1 cannot rewrite the slot before this
    consumer, which publishes step i only after reading it, is done with it. No cycle: the other's step
    i - 1 waited only for this consumer's step i - 2."""
    byte = gl.to_tensor(0)
    if i > 0:
        previous = i - 1
        buffer = previous % 2
        mbarrier.wait(exchange.ready.index(buffer), (previous // 2) & 1)
        byte = gl.where(i > item_first, _shared_scalar(exchange.byte.index(buffer * CONSUMERS + (1 - CONSUMER))), 0)
    return byte


@gluon.jit
def _dq_step(i, head, m0, exchange, kt_smem, staging, dq_desc, q_start, D: gl.constexpr):
    """Step i's dQ partial over both consumers' keys, a box of ``dq_desc`` (``dq_piece`` columns) at a time,
    added into ``dq_desc`` by TMA reduce-adds from ``staging`` (:class:`DqStaging`).
    Where both consumers' dS are on one scale (most steps: :func:`_other_byte`), each piece's two products
    chain in one accumulator without a wait in between; elsewhere consumer 0's product is waited for and
    brought to consumer 1's scale (a power-of-two ratio: exact) before consumer 1's product adds to it; see
    ``MAX_SCALE_RATIO`` for the one case where that scale is raised."""
    buffer = i % 2
    mbarrier.wait(exchange.ready.index(buffer), (i // 2) & 1)
    byte0 = _shared_scalar(exchange.byte.index(buffer * CONSUMERS))
    byte1 = _shared_scalar(exchange.byte.index(buffer * CONSUMERS + 1))
    if byte0 == byte1:
        _dq_pieces(buffer, 1.0, layout.scale_value(byte1), head, m0, exchange, kt_smem, staging, dq_desc, q_start,
                   D, False)
    else:
        scale0 = layout.scale_value(byte0)
        scale1 = gl.maximum(layout.scale_value(byte1), scale0 * (1.0 / MAX_SCALE_RATIO))
        _dq_pieces(buffer, scale0 / scale1, scale1, head, m0, exchange, kt_smem, staging, dq_desc, q_start, D,
                   True)
    mbarrier.arrive(exchange.free.index(buffer), count=1)


@gluon.jit
def _dq_pieces(buffer, ratio, scale1, head, m0, exchange, kt_smem, staging, dq_desc, q_start, D: gl.constexpr,
               RESCALED: gl.constexpr):
    """:func:`_dq_step`'s pieces from dS buffer ``buffer``: consumer 0's product times ``ratio`` (RESCALED:
    waited for first; else ``ratio`` is 1 and the two products chain), plus consumer 1's, times ``scale1``;
    staged and added ``staging.group`` pieces at a time."""
    COLUMNS: gl.constexpr = dq_desc.block_type.shape[1]
    PIECES: gl.constexpr = D // COLUMNS
    GROUP: gl.constexpr = staging.group
    # A step's groups end on the odd set, so the next step's first group writes the even one.
    gl.static_assert(PIECES % (2 * GROUP) == 0)
    piece_layout: gl.constexpr = layout.wgmma_accumulator_layout(COLUMNS)
    zero = gl.zeros([BLOCK_M, COLUMNS], gl.float32, layout=piece_layout)
    ds0 = exchange.ds.index(buffer * CONSUMERS)
    ds1 = exchange.ds.index(buffer * CONSUMERS + 1)
    for group in gl.static_range(PIECES // GROUP):
        for index in gl.static_range(GROUP):
            # (A name bound to the piece's index in these unrolled loops would be a tensor, not a constexpr.)
            k0 = kt_smem.index(0).slice((group * GROUP + index) * COLUMNS, COLUMNS, dim=0).permute((1, 0))
            k1 = kt_smem.index(1).slice((group * GROUP + index) * COLUMNS, COLUMNS, dim=0).permute((1, 0))
            part = warpgroup_mma(ds0, k0, zero, use_acc=False, is_async=True)
            if RESCALED:
                part, _, _ = warpgroup_mma_wait(0, deps=(part, ds0, k0))
                part = part * ratio
            part = warpgroup_mma(ds1, k1, part, is_async=True)
            part, _, _, _, _ = warpgroup_mma_wait(0, deps=(part, ds0, k0, ds1, k1))
            staging.buffer(group, index).store((part * scale1).to(dq_desc.dtype))
        fence_async_shared()
        # One barrier per group: every thread's parts are written, and the issuing thread has seen the
        # previous group's adds read the other set, which the next group writes.
        tma.store_wait(0)
        gl.thread_barrier()
        for index in gl.static_range(GROUP):
            column = head * D + (group * GROUP + index) * COLUMNS
            _reduce_add(dq_desc, [(q_start + m0).to(gl.int32), column], staging.buffer(group, index))


@gluon.jit
def _load_and_accumulate_dq(q_desc, qt_desc, do_desc, dot_desc, rows_desc, stages, exchange, kv, staging, dq_desc,
                            items, padded_q, HEADS_Q: gl.constexpr, HEADS_KV: gl.constexpr,
                            D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, ACCUMULATE_DQ: gl.constexpr,
                            IN_TURN: gl.constexpr):
    """The default warpgroup over the program's work items (:func:`_for_each_tile`), each by
    :func:`_load_tile_and_accumulate_dq`."""
    _for_each_tile(items, _load_tile_and_accumulate_dq,
                   (q_desc, qt_desc, do_desc, dot_desc, rows_desc, stages, exchange, kv, staging, dq_desc, padded_q,
                    D, STAGES, ACCUMULATE_DQ), HEADS_Q, HEADS_KV, CAUSAL, IN_TURN)
    if ACCUMULATE_DQ:
        tma.store_wait(0)  # the last adds have read the staging buffers before the program exits


@gluon.jit
def _load_tile_and_accumulate_dq(item, tile, first_step, kt_phase, q_desc, qt_desc, do_desc, dot_desc, rows_desc,
                                 stages, exchange, kv, staging, dq_desc, padded_q, D: gl.constexpr,
                                 STAGES: gl.constexpr, ACCUMULATE_DQ: gl.constexpr):
    """The default warpgroup on one key tile (``item``'s, unused: ``tile`` describes it): streams each
    step's query-side operands into the stage ring (the ring's steps from ``first_step`` on), STAGES steps
    ahead of the consumers, and
    (ACCUMULATE_DQ) loads the tile's K^T and adds each step's dQ partial once both consumers published
    their dS, so the consumers never wait for each other."""
    if ACCUMULATE_DQ:  # the previous tile's dQ wgmmas, the only readers of K^T, are done
        mbarrier.expect(kv.kt_ready, CONSUMERS * kv.kt_desc.block_type.nbytes)
        for c in gl.static_range(CONSUMERS):
            tma.async_copy_global_to_shared(
                kv.kt_desc, [tile.kv_head * D, (tile.padded_k_start + tile.n_start + c * KEYS_PER_CONSUMER)
                             .to(gl.int32)], kv.kt_ready, kv.kt.index(c))
    n_steps = tile.n_steps
    load_head, load_m0 = tile.first_head, tile.m_lo  # the query tile of the next step to load
    for i in range(gl.minimum(n_steps, STAGES)):
        _load_step(first_step + i, load_head, load_m0, q_desc, qt_desc, do_desc, dot_desc, rows_desc, stages,
                   tile.q_start, tile.padded_q_start, padded_q, D, STAGES)
        load_head, load_m0 = _next_query_tile(load_head, load_m0, tile.m_lo, tile.m_end)
    if ACCUMULATE_DQ:
        mbarrier.wait(kv.kt_ready, kt_phase)
    head, m0 = tile.first_head, tile.m_lo
    for i in range(n_steps):
        if i + STAGES < n_steps:
            _load_step(first_step + i + STAGES, load_head, load_m0, q_desc, qt_desc, do_desc, dot_desc, rows_desc,
                       stages, tile.q_start, tile.padded_q_start, padded_q, D, STAGES)
            load_head, load_m0 = _next_query_tile(load_head, load_m0, tile.m_lo, tile.m_end)
        if ACCUMULATE_DQ:
            _dq_step(first_step + i, head, m0, exchange, kv.kt, staging, dq_desc, tile.q_start, D)
        head, m0 = _next_query_tile(head, m0, tile.m_lo, tile.m_end)


@gluon.jit
def _tile_amax(x, row_factor, exchange_smem):
    """max over a consumer's ``[KEYS_PER_CONSUMER, BLOCK_M]`` tile (wgmma accumulator layout) of ``row_factor``
    (``[KEYS_PER_CONSUMER]``, >= 0) times each row's max |x|, with one barrier and no shuffles: each thread's
    row maxima (its registers split out by a reshape: row bit 3 and column bits 0, 3-5) times their factors,
    one ``redux.sync`` per warp on the bits (non-negative floats order as integers), the four warps' maxima
    through ``exchange_smem`` (``[32, 4]`` int32, lane x warp). ``gl.max`` over both axes took five shuffle
    rounds and two barriers (a large share of the consumers' stall samples in ncu)."""
    gl.static_assert((x.shape[0] == 64) & (x.shape[1] == 64), "the register split assumes an m64n64 tile")
    # rows: (warp, register, lane bits 2-4); columns: (register, lane bits 0-1, register)
    row_maxima = gl.max(gl.max(gl.abs(x).reshape([4, 2, 8, 8, 4, 2]), axis=5), axis=3)
    factors = gl.convert_layout(row_factor.reshape([4, 2, 8]), gl.SliceLayout(3, row_maxima.type.layout),
                                assert_trivial=True)
    per_thread = gl.max(row_maxima * gl.expand_dims(factors, 3), axis=1)
    lane_by_warp: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, 4], [1, 0])
    per_thread = gl.convert_layout(per_thread.permute((1, 2, 0)).reshape([32, 4]), lane_by_warp, assert_trivial=True)
    per_warp = gl.inline_asm_elementwise("redux.sync.max.s32 $0, $1, 0xffffffff;", "=r,r",
                                         [per_thread.to(gl.int32, bitcast=True)], dtype=gl.int32, is_pure=True, pack=1)
    exchange_smem.store(per_warp)
    gl.thread_barrier()
    every_warp: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [4, 1], [1, 0])  # lane 0's row, in every thread
    warps = exchange_smem.slice(0, 1, dim=0).load(every_warp)
    return gl.max(gl.max(warps, axis=1), axis=0).to(gl.float32, bitcast=True)


@gluon.jit
def _first_ds_byte(ds_factor, amax_smem):
    """Where a consumer's running dS scale starts for keys of dS factors ``ds_factor`` (``[KEYS_PER_CONSUMER]``,
    >= 0): the smallest normal's E8M0 byte, or the byte of the largest factor's power of two where that is
    higher, so that every key's factor times the scale's (``layout.scale_factor``) stays finite in fp32 (a
    tile whose dS is all zero keeps the scale where it was; in a causal item the second consumer's keys see
    none of its first query tile, so the start is a scale the steps use). Only factors of 4 and more (K's
    token scales of 2^10 and more) move it. The maximum is :func:`_tile_amax`'s."""
    ones = gl.full([KEYS_PER_CONSUMER, BLOCK_M], 1.0, gl.float32, layout=layout.wgmma_accumulator_layout(BLOCK_M))
    largest = _tile_amax(ones, ds_factor, amax_smem)
    gl.thread_barrier()  # every warp has read the exchange before the first step writes it
    return gl.maximum((largest.to(gl.int32, bitcast=True) >> 23) - 127, layout.SMALLEST_NORMAL_BYTE)


@gluon.jit
def _consume(kv, stages, exchange, amax_smem, grads, items, batch, softmax_scale,
             CONSUMER: gl.constexpr, HEADS_Q: gl.constexpr, HEADS_KV: gl.constexpr, D: gl.constexpr,
             STAGES: gl.constexpr, CAUSAL: gl.constexpr, EXACT: gl.constexpr, ACCUMULATE_DQ: gl.constexpr,
             IN_TURN: gl.constexpr):
    """One consumer warpgroup over the program's work items (:func:`_for_each_tile`), each by
    :func:`_consume_tile`."""
    _for_each_tile(items, _consume_tile,
                   (kv, stages, exchange, amax_smem, grads, items, batch, softmax_scale, CONSUMER, HEADS_Q, HEADS_KV,
                    D, STAGES, CAUSAL, EXACT, ACCUMULATE_DQ, IN_TURN), HEADS_Q, HEADS_KV, CAUSAL,
                   IN_TURN)


@gluon.jit
def _consume_tile(item, tile, first_step, kv_phase, kv, stages, exchange, amax_smem, grads, items, batch,
                  softmax_scale, CONSUMER: gl.constexpr, HEADS_Q: gl.constexpr, HEADS_KV: gl.constexpr,
                  D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, EXACT: gl.constexpr,
                  ACCUMULATE_DQ: gl.constexpr, IN_TURN: gl.constexpr):
    """One consumer warpgroup on work item ``item``, described by ``tile`` (:func:`_key_tile`, not an
    empty slot): its dK and dV, accumulated and stored."""
    dk_acc, dv_acc, ds_byte = _accumulate_key_gradients(
        kv, stages, exchange, amax_smem, grads, tile, first_step, kv_phase, items.total_k, softmax_scale,
        CONSUMER, HEADS_Q // HEADS_KV, D, STAGES, CAUSAL, EXACT, ACCUMULATE_DQ, IN_TURN)
    # The tile described again from its item, not kept: its fields would hold registers through the
    # steps' loop, where the consumers have none to spare.
    tile = _key_tile(items, item, HEADS_Q, HEADS_KV, CAUSAL)
    _store_key_gradients(dk_acc, dv_acc, ds_byte, kv, grads, tile, items.total_k, batch, softmax_scale,
                         CONSUMER, HEADS_KV, D)


@aggregate
class KeyRows:
    """What a consumer's steps read of its 64 keys: their K and V tiles in shared memory, per key the
    factors applied to S^T (``score``, FP8 scores only) and dS (``ds``), the one factor of V's copy for
    all 64 (``value``, applied to dP^T's columns, FP8 only), and per key the first query row that sees it
    (``first_seeing``: NO_QUERY past the sequence's keys)."""
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    score: gl.tensor
    value: gl.tensor
    ds: gl.tensor
    first_seeing: gl.tensor

    @constexpr_function
    def __init__(self, k, v, score, value, ds, first_seeing):
        self.k, self.v, self.score, self.value, self.ds, self.first_seeing = k, v, score, value, ds, first_seeing


@gluon.jit
def _accumulate_key_gradients(kv, stages, exchange, amax_smem, grads, tile, first_step, kv_phase, total_k,
                              softmax_scale, CONSUMER: gl.constexpr, GROUP: gl.constexpr, D: gl.constexpr,
                              STAGES: gl.constexpr, CAUSAL: gl.constexpr, EXACT: gl.constexpr,
                              ACCUMULATE_DQ: gl.constexpr, IN_TURN: gl.constexpr):
    """One consumer warpgroup on one key tile: dK and dV of its 64 keys (fp32 accumulators in the
    wgmma layout, dK on the running dS scale ``ds_byte``, returned with it) over every streamed query
    tile (the ring's steps from ``first_step`` on: the query tiles of each of the GROUP query heads in
    turn), and each step's dS for the dQ warpgroup. Each head's steps before the first query row that
    sees every key (causal), or all of them when the key tile runs past the sequence, are masked; they
    run as a loop of their own, so that the other steps carry no mask, not even a branch around it
    (a branch inside the step splits its scheduling: measured slower than 32 predicated selects)."""
    kv_head, n_start = tile.kv_head, tile.n_start
    len_q, k_start, len_k = tile.len_q, tile.k_start, tile.len_k
    m_lo, m_end = tile.m_lo, tile.m_end
    KEYS: gl.constexpr = KEYS_PER_CONSUMER
    o_layout: gl.constexpr = layout.wgmma_accumulator_layout(D)
    s_rows: gl.constexpr = gl.SliceLayout(1, layout.wgmma_accumulator_layout(BLOCK_M))

    key0 = n_start + CONSUMER * KEYS
    k_smem = kv.k.index(CONSUMER)
    v_smem = kv.v.index(CONSUMER)
    ready = kv.ready.index(CONSUMER)
    if IN_TURN:  # the previous tile's last reads of K and V (wgmmas, staged stores) done in every warp
        gl.thread_barrier()
        fence_async_shared()
    mbarrier.expect(ready, kv.k_desc.block_type.nbytes + kv.v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(kv.k_desc, [(k_start + key0).to(gl.int32), kv_head * D], ready, k_smem)
    tma.async_copy_global_to_shared(kv.v_desc, [(k_start + key0).to(gl.int32), kv_head * D], ready, v_smem)

    keys = key0 + gl.arange(0, KEYS, layout=s_rows)
    sequence_scales = kv_head.to(gl.int64) * total_k + k_start  # its first key's in the [Hkv, total_k] scales
    k_factor = gl.load(grads.k_scale + sequence_scales + keys, mask=keys < len_k, other=0.0)
    # S^T and dP^T come from bf16 copies holding the MX values (EXACT: fp32 accumulation) or from
    # e4m3 copies in units of the token scales, applied in the steps.
    if EXACT:
        score_factor = k_factor  # not read
        v_factor = k_factor  # not read
    else:
        score_factor = k_factor * (softmax_scale * layout.LOG2E)
        # V's e4m3 copy has one scale for each 64 keys from the sequence's start (preparation()), this
        # consumer's: a step multiplies dP^T's 16 column factors a thread holds by it, not 32 elements.
        v_factor = gl.load(grads.v_scale + sequence_scales + key0, mask=key0 < len_k, other=0.0)
    # p is P * P_SCALE (the e4m3 operand of dV as it comes out of exp2) and dS is formed times both
    # token scales (backward_passes) and the running dS scale: dS' = p (k / P_SCALE) q (dP - Delta) / 2^(e - 127).
    ds_factor = k_factor * (1.0 / layout.P_SCALE)
    # Without CAUSAL every query row sees every key of the sequence.
    diagonal = bounds.diagonal(len_q, len_k) if CAUSAL else len_k
    first_seeing = gl.where(keys < len_k, bounds.first_query_seeing(keys, diagonal), NO_QUERY)
    key_rows = KeyRows(k_smem, v_smem, score_factor, v_factor, ds_factor, first_seeing)
    unmasked_from = bounds.first_query_seeing_all(n_start + BLOCK_N, len_k, m_end, diagonal)
    masked_steps = gl.maximum(gl.cdiv(unmasked_from - m_lo, BLOCK_M), 0)
    unmasked_steps = (m_end - m_lo) // BLOCK_M - masked_steps
    dk_acc = gl.zeros([KEYS, D], gl.float32, layout=o_layout)
    dv_acc = gl.zeros([KEYS, D], gl.float32, layout=layout.wgmma_accumulator_layout(D, 16))
    ds_byte = _first_ds_byte(ds_factor, amax_smem)
    mbarrier.wait(ready, kv_phase)
    # Loops counted from 0: Triton 3.6 built a loop from first_step from 0 in the consumers (the
    # ring's parities then split from the loader's, which hung the kernel).
    if IN_TURN:
        # Short tiles taken in turn (program_count: unmasked batches): one loop over the steps, each
        # masked where it needs it (without CAUSAL by a select on the keys past the sequence's end); the
        # split loops' setup cost these tiles of a step or two more than their steps gained (4-10% on the
        # cross batches, docs/perf-history.md v38).
        head, m0 = tile.first_head, m_lo
        for j in range(tile.n_steps):
            dk_acc, dv_acc, ds_byte = _key_step(first_step + j, first_step, m0, dk_acc, dv_acc, ds_byte, key_rows,
                                                stages, exchange, amax_smem, softmax_scale, m0 < unmasked_from,
                                                CONSUMER, D, STAGES, EXACT, ACCUMULATE_DQ, not CAUSAL)
            head, m0 = _next_query_tile(head, m0, m_lo, m_end)
    else:
        i = first_step
        for _ in range(GROUP):
            for j in range(masked_steps):
                dk_acc, dv_acc, ds_byte = _key_step(i, first_step, m_lo + j * BLOCK_M, dk_acc, dv_acc, ds_byte,
                                                    key_rows, stages, exchange, amax_smem, softmax_scale, True,
                                                    CONSUMER, D, STAGES, EXACT, ACCUMULATE_DQ, False)
                i += 1
            for j in range(unmasked_steps):
                dk_acc, dv_acc, ds_byte = _key_step(i, first_step, 0, dk_acc, dv_acc, ds_byte, key_rows, stages,
                                                    exchange, amax_smem, softmax_scale, False, CONSUMER, D, STAGES,
                                                    EXACT, ACCUMULATE_DQ, False)
                i += 1
    return dk_acc, dv_acc, ds_byte


@gluon.jit
def _key_step(i, item_first, m0, dk_acc, dv_acc, ds_byte, key_rows, stages, exchange, amax_smem, softmax_scale,
              masked, CONSUMER: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, EXACT: gl.constexpr,
              ACCUMULATE_DQ: gl.constexpr, KEYS_ONLY: gl.constexpr):
    """Step i of a consumer: S^T and dP^T of its keys (``key_rows``) against stage i % STAGES, P^T and dS^T,
    dS published for the dQ warpgroup, dV and dK accumulated; returns (dk_acc, dv_acc, ds_byte). Where
    ``masked`` (a constant, or a tile's flag), P^T is 0 where a key is not seen by the query tile from
    row ``m0`` on, or, KEYS_ONLY, only at the keys past the sequence's end."""
    KEYS: gl.constexpr = KEYS_PER_CONSUMER
    s_layout: gl.constexpr = layout.wgmma_accumulator_layout(BLOCK_M)
    o_layout: gl.constexpr = layout.wgmma_accumulator_layout(D)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    dv_a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_acc.type.layout, k_width=2)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    score_layout: gl.constexpr = layout.wgmma_accumulator_layout(BLOCK_M, key_rows.k.dtype.primitive_bitwidth)
    score_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, layout=score_layout)
    o_zero = gl.zeros([KEYS, D], gl.float32, layout=o_layout)
    stage = i % STAGES
    phase = (i // STAGES) & 1
    rows = stage * ROW_VECTORS

    mbarrier.wait(stages.q_ready.index(stage), phase)
    q_view = stages.q.index(stage).permute((1, 0))
    s = warpgroup_mma(key_rows.k, q_view, score_zero, use_acc=False, is_async=True)
    mbarrier.wait(stages.do_ready.index(stage), phase)
    do_view = stages.do.index(stage).permute((1, 0))
    dp = warpgroup_mma(key_rows.v, do_view, score_zero, use_acc=False, is_async=True)
    s, dp, _, _, _, _ = warpgroup_mma_wait(0, deps=(s, dp, key_rows.k, q_view, key_rows.v, do_view))
    s = gl.convert_layout(s, s_layout, assert_trivial=True)
    dp = gl.convert_layout(dp, s_layout, assert_trivial=True)

    # Past the sequence the padded vectors hold P_LSE2 = +inf: p = 0 there, no mask.
    p_lse2 = stages.rows.index(rows + P_LSE2).load(s_cols)
    if EXACT:
        p = gl.exp2(s * (softmax_scale * layout.LOG2E) - p_lse2[None, :])
    else:
        # Q's e4m3 copy has one scale for the step's 64 queries (preparation()), a factor of each row.
        q_factor = _shared_scalar(stages.rows.index(rows + Q_FACTOR).slice(0, 1))
        p = gl.exp2(s * (key_rows.score * q_factor)[:, None] - p_lse2[None, :])
    if masked:
        if KEYS_ONLY:
            p = gl.where((key_rows.first_seeing < NO_QUERY)[:, None], p, 0.0)
        else:
            # One compare per element: the tile's column against the first one each key is visible to.
            # A thread's columns are 8a + 2l + c (a, c: its registers, l: lane bits 0-1); compared as
            # 8a + c against the threshold less 2l, the columns are constants and each row one
            # register, not 16 live column indices.
            first_column = key_rows.first_seeing - m0
            columns = gl.arange(0, BLOCK_M, layout=s_cols)
            p = gl.where((columns & ~6)[None, :] >= first_column[:, None] - (columns & 6)[None, :], p, 0.0)
    q_delta = stages.rows.index(rows + Q_DELTA).load(s_cols)
    if EXACT:  # Q's token scales (the exact copies keep one per token), for dS
        q_dp = dp * stages.rows.index(rows + Q_FACTOR).load(s_cols)[None, :] - q_delta[None, :]
    else:
        q_do_factor = stages.rows.index(rows + Q_DO_FACTOR).load(s_cols)
        q_dp = dp * (q_do_factor * key_rows.value)[None, :] - q_delta[None, :]
    # dS' = pq times each key's factor on the running scale, which the tile's maximum may grow first: the
    # maximum takes the factor per row, so every element is multiplied once, by its key's final factor.
    pq = p * q_dp
    # Both consumers on one scale past an item's first step (_other_byte); not with exact scores, whose
    # masked steps have no registers for it (they spill).
    SHARED_SCALE: gl.constexpr = ACCUMULATE_DQ and not EXACT
    if SHARED_SCALE:
        other_byte = _other_byte(exchange, i, item_first, CONSUMER)
    tile_byte = layout.scale_byte_of_amax(_tile_amax(pq, key_rows.ds, amax_smem), False)
    if SHARED_SCALE:
        tile_byte = gl.maximum(tile_byte, other_byte)
    ds_byte, rescale = layout.raised_scale_byte(tile_byte, ds_byte)
    ds = pq * (key_rows.ds * layout.scale_factor(ds_byte))[:, None]
    ds8 = ds.to(gl.float8e4nv)
    # dV's fp16 wgmma (see the module docstring), issued before dS is published and waited for before
    # dK's: P^T's 16 operand registers and dK's fresh tile are never live together (both at once spill).
    p16 = gl.convert_layout(p.to(gl.float8e4nv).to(gl.float16), dv_a_layout, assert_trivial=True)
    dot_view = stages.dot.index(stage).permute((1, 0))
    dv_acc = warpgroup_mma(p16, dot_view, dv_acc, is_async=True)
    if ACCUMULATE_DQ:  # in units of the query's token scale (backward_passes.finish_dq)
        _share_ds(ds8, ds_byte, exchange, i, CONSUMER)
    dv_acc, _, _ = warpgroup_mma_wait(0, deps=(dv_acc, p16, dot_view))
    # dK from a fresh FP8 accumulator, added in fp32 (chained, heavy-tailed inputs' dK missed the 2e-2 bar).
    qt_view = stages.qt.index(stage).permute((1, 0))
    dk_tile = warpgroup_mma(_as_query_operand(ds8, a_layout), qt_view, o_zero, use_acc=False, is_async=True)
    dk_tile, _ = warpgroup_mma_wait(0, deps=(dk_tile, qt_view))
    dk_acc = dk_acc * rescale + dk_tile
    mbarrier.arrive(stages.empty.index(stage), count=1)
    return dk_acc, dv_acc, ds_byte


@gluon.jit
def _store_key_gradients(dk_acc, dv_acc, ds_byte, kv, grads, tile, total_k, batch, softmax_scale,
                         CONSUMER: gl.constexpr, HEADS_KV: gl.constexpr, D: gl.constexpr):
    """dK and dV of the consumer's 64 keys of ``tile`` from its accumulators: dV's sequence-axis column
    scales, dK's running dS scale and its keys' token scales applied, stored in the gradients'
    dtype through the consumer's K and V buffers (``layout.gluon_store_rows_through``: whole rows per
    warp, saving each tile's stores a few microseconds, which short tiles and causal batches' many
    short programs feel most)."""
    o_layout: gl.constexpr = dk_acc.type.layout
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)
    KEYS: gl.constexpr = KEYS_PER_CONSUMER
    seq, kv_head, k_start, len_k = tile.seq, tile.kv_head, tile.k_start, tile.len_k
    key0 = tile.n_start + CONSUMER * KEYS
    k_smem = kv.k.index(CONSUMER)
    v_smem = kv.v.index(CONSUMER)
    first_key_scale = kv_head.to(gl.int64) * total_k + k_start + key0
    channels = gl.arange(0, D, layout=o_cols)
    key_rows = key0 + gl.arange(0, KEYS, layout=o_rows)
    dv_scale = gl.load(grads.dot_scale + (kv_head * batch + seq) * D + channels) * (1.0 / layout.P_SCALE)
    k_row_factor = gl.load(grads.k_scale + first_key_scale + gl.arange(0, KEYS, layout=o_rows),
                           mask=key_rows < len_k, other=0.0)
    dk_rows = dk_acc * (layout.scale_inverse(k_row_factor) * (layout.scale_value(ds_byte) * softmax_scale))[:, None]
    dk_out = dk_rows.to(grads.dk.dtype.element_ty)
    dv_rows = gl.convert_layout(dv_acc, o_layout, assert_trivial=True) * dv_scale[None, :]
    dv_out = dv_rows.to(grads.dv.dtype.element_ty)
    # Through this consumer's K and V buffers, free after the last step's wgmmas.
    first_row = ((k_start + key0) * HEADS_KV + kv_head) * D
    layout.gluon_store_rows_through(dk_out, grads.dk + first_row, HEADS_KV * D, len_k - key0, k_smem)
    layout.gluon_store_rows_through(dv_out, grads.dv + first_row, HEADS_KV * D, len_k - key0, v_smem)


# WorkItems holds these as tensors: a value of 1 must not become a constexpr.
@gluon.jit(do_not_specialize=("slots", "total_q", "total_k"))
def _attention_backward_kernel(
    q_desc, qt_desc, k_desc, kt_desc, v_desc, do_desc, dot_desc, rows_desc, dq_desc,
    k_scale, v_scale, dot_scale, dk, dv, offsets_q, offsets_k, work, slots, total_q, total_k, padded_q,
    batch, softmax_scale,
    HEADS_Q: gl.constexpr, HEADS_KV: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    ACCUMULATE_DQ: gl.constexpr, CONSUMER_REGS: gl.constexpr, IN_TURN: gl.constexpr,
):
    """Program p takes work item p (:func:`_key_tile`) or, IN_TURN (fewer programs than items:
    :func:`program_count`), items ``p, p + programs, ...`` with its shared memory, barriers and stage
    ring set up once, so a tile's first loads overlap the previous tile's last steps and its dK / dV
    stores (short key tiles, as on cross-attention batches, spent much of a program's life starting
    and finishing it); every partition walks the items by :func:`_for_each_tile`."""
    # The producers' bf16 feature copies hold the MX values: S and dP come out exact, in value units.
    EXACT: gl.constexpr = k_desc.dtype == gl.bfloat16

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_M, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES, BLOCK_M, D], do_desc.layout)
    qt_smem = gl.allocate_shared_memory(qt_desc.dtype, [STAGES, D, BLOCK_M], qt_desc.layout)
    dot_smem = gl.allocate_shared_memory(dot_desc.dtype, [STAGES, D, BLOCK_M], dot_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [CONSUMERS, KEYS_PER_CONSUMER, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [CONSUMERS, KEYS_PER_CONSUMER, D], v_desc.layout)
    kt_smem = gl.allocate_shared_memory(kt_desc.dtype, [CONSUMERS, D, KEYS_PER_CONSUMER], kt_desc.layout)
    row_smem = gl.allocate_shared_memory(gl.float32, [STAGES * ROW_VECTORS, BLOCK_M], VECTOR_LAYOUT)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=DS_SWIZZLE_BYTES, element_bitwidth=8, rank=2)
    ds_smem = gl.allocate_shared_memory(gl.float8e4nv, [2 * CONSUMERS, BLOCK_M, KEYS_PER_CONSUMER], ds_layout)
    byte_smem = gl.allocate_shared_memory(gl.int32, [2 * CONSUMERS, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    DQ_GROUP: gl.constexpr = _dq_group(EXACT, D // dq_desc.block_type.shape[1])
    even0 = gl.allocate_shared_memory(dq_desc.dtype, dq_desc.block_type.shape, dq_desc.layout)
    odd0 = gl.allocate_shared_memory(dq_desc.dtype, dq_desc.block_type.shape, dq_desc.layout)
    if DQ_GROUP == 2:
        even1 = gl.allocate_shared_memory(dq_desc.dtype, dq_desc.block_type.shape, dq_desc.layout)
        odd1 = gl.allocate_shared_memory(dq_desc.dtype, dq_desc.block_type.shape, dq_desc.layout)
        staging = DqStaging(even0, even1, odd0, odd1, DQ_GROUP)
    else:
        staging = DqStaging(even0, even0, odd0, odd0, DQ_GROUP)
    # Each consumer's [32, 4] exchange of its warps' |dS| maxima (_tile_amax).
    amax_smem = gl.allocate_shared_memory(gl.int32, [CONSUMERS * 32, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    kt_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(kv_ready.index(c), count=1)
    mbarrier.init(kt_ready, count=1)
    for buffer in gl.static_range(2):
        mbarrier.init(ds_ready.index(buffer), count=CONSUMERS)
        mbarrier.init(ds_free.index(buffer), count=1)
    for stage in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(stage), count=1)
        mbarrier.init(do_ready.index(stage), count=1)
        mbarrier.init(empty.index(stage), count=CONSUMERS)
    fence_async_shared()
    stages = QueryStages(q_smem, qt_smem, do_smem, dot_smem, row_smem, q_ready, do_ready, empty)
    exchange = DsExchange(ds_smem, byte_smem, ds_ready, ds_free)
    kv = KeyOperands(k_desc, kt_desc, v_desc, k_smem, kt_smem, v_smem, kv_ready, kt_ready)
    grads = KeyGradients(k_scale, v_scale, dot_scale, dk, dv)
    items = WorkItems(work, slots, offsets_q, offsets_k, total_q, total_k)
    gl.warp_specialize(
        [
            (_load_and_accumulate_dq, (q_desc, qt_desc, do_desc, dot_desc, rows_desc, stages, exchange, kv,
                                       staging, dq_desc, items, padded_q, HEADS_Q, HEADS_KV, D, STAGES,
                                       CAUSAL, ACCUMULATE_DQ, IN_TURN)),
            (_consume, (kv, stages, exchange, amax_smem.slice(0, 32, dim=0), grads, items, batch,
                        softmax_scale, 0, HEADS_Q, HEADS_KV, D, STAGES, CAUSAL, EXACT, ACCUMULATE_DQ,
                        IN_TURN)),
            (_consume, (kv, stages, exchange, amax_smem.slice(32, 32, dim=0), grads, items, batch,
                        softmax_scale, 1, HEADS_Q, HEADS_KV, D, STAGES, CAUSAL, EXACT, ACCUMULATE_DQ,
                        IN_TURN)),
        ],
        [4, 4],
        [CONSUMER_REGS, CONSUMER_REGS],
    )


def _padded_row_vectors(prep: Prepared) -> TensorDescriptor:
    """The per-query vectors (``Q_FACTOR``, ``P_LSE2``, ``Q_DO_FACTOR``, ``Q_DELTA``) as the producers wrote
    them (``backward_passes.Prepared(row_vectors=True)``): one ``[ROW_VECTORS, Hq, padded_q]`` fp32 buffer,
    sequence ``b`` at ``padded_seq_start``, zeros past its end (P_LSE2: +inf), read as ``[ROW_VECTORS, Hq *
    padded_q]`` in boxes of ``VECTORS_PER_LOAD`` vectors x ``BLOCK_M`` queries (TMA needs a 16-byte aligned
    start, which sequences at arbitrary offsets do not give)."""
    if prep.rows is None:
        raise ValueError("the Gluon kernel needs the producers' padded per-query vectors: "
                         "backward_passes.Prepared(row_vectors=True)")
    vectors = prep.rows.view(ROW_VECTORS.value, -1)
    box = [VECTORS_PER_LOAD.value, BLOCK_M.value]
    return TensorDescriptor(vectors, list(vectors.shape), [vectors.shape[1], 1], box, VECTOR_BOX_LAYOUT.value)


def dq_piece(prep: Prepared, dq_dtype: torch.dtype) -> int:
    """Columns of the kernel's dQ pieces: ``DQ_PIECE``, or half of it with exact scores and fp32 sums, whose
    bf16 operand copies and 32-column fp32 staging buffers would need 528 bytes more shared memory than
    Hopper's."""
    exact = prep.k.feature.dtype == torch.bfloat16
    return DQ_PIECE // 2 if exact and dq_dtype == torch.float32 else DQ_PIECE


def _descriptors(prep: Prepared, dq_accum: torch.Tensor) -> tuple:
    """The kernel's TMA descriptors, in its argument order: Q, Q^T, K, K^T, V, dO, dO^T (query tiles of
    ``BLOCK_M`` tokens, key tiles of one consumer's keys), the padded per-query vectors and
    ``dq_accum`` (:func:`dq_accumulator`'s, ``[BLOCK_M, dq_piece]`` boxes, swizzled by their row's bytes)."""
    q, k, v, do = prep.q, prep.k, prep.v, prep.do
    dim, keys = prep.dim, KEYS_PER_CONSUMER.value
    feature, transposed = [BLOCK_M.value, dim], [dim, BLOCK_M.value]
    piece = dq_piece(prep, dq_accum.dtype)
    return (
        operand_descriptor(q.feature.view(prep.total_q, -1), feature),
        operand_descriptor(q.sequence.view(prep.heads_q * dim, -1), transposed),
        operand_descriptor(k.feature.view(prep.total_k, -1), [keys, dim]),
        operand_descriptor(k.sequence.view(prep.heads_kv * dim, -1), [dim, keys]),
        operand_descriptor(v.feature.view(prep.total_k, -1), [keys, dim]),
        operand_descriptor(do.feature.view(prep.total_q, -1), feature),
        operand_descriptor(do.sequence.view(prep.heads_q * dim, -1), transposed),
        _padded_row_vectors(prep),
        TensorDescriptor.from_tensor(dq_accum.view(dq_accum.shape[0], -1), [BLOCK_M.value, piece],
                                     gl.NVMMASharedLayout(swizzle_byte_width=piece * dq_accum.element_size(),
                                                          element_bitwidth=8 * dq_accum.element_size(), rank=2)),
    )


def launch(prep: Prepared, dq_accum: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *, softmax_scale: float,
           causal: bool, accumulate_dq: bool) -> None:
    """dK, dV into ``dk``, ``dv`` and, with ``accumulate_dq``, dQ added into ``dq_accum``
    (:func:`dq_accumulator`'s); without ``accumulate_dq`` it is never touched (one without ``adds`` serves
    its descriptor).
    ``prep`` is the producers' output (:class:`Prepared`), made with :func:`preparation`'s token orders
    and dO^T dtype (K^T's order matters only with ``accumulate_dq``)."""
    wanted = preparation()
    got = dict(query_order=prep.query_order, do_order=prep.do_order, do_sequence_dtype=prep.do.sequence.dtype)
    if accumulate_dq:
        got["key_order"] = prep.key_order
    if prep.v.feature.dtype != torch.bfloat16:  # the exact-scores copies keep a scale per token
        got.update(query_scale_tokens=prep.query_scale_tokens, value_scale_tokens=prep.value_scale_tokens)
    wrong = [f"{name} is {_shown(name, value)}, it needs {_shown(name, wanted[name])}" for name, value in got.items()
             if value != wanted[name]]
    if wrong:
        raise ValueError("the Gluon kernel reads the copies Prepared(**preparation()) makes: " + "; ".join(wrong))
    work = work_list(prep.offsets_k, prep.offsets_q, prep.total_k, prep.total_q, BLOCK_N.value, causal=causal,
                     rows_are_queries=False)
    items = work.shape[0] * prep.heads_kv
    if not items:
        return
    programs = program_count(items, prep, causal, dk.device)
    _attention_backward_kernel[(programs,)](
        *_descriptors(prep, dq_accum), prep.k.feature_scale, prep.v.feature_scale,
        prep.do.sequence_scale, dk, dv, prep.offsets_q, prep.offsets_k, work, work.shape[0], prep.total_q,
        prep.total_k, prep.padded_q, prep.batch, softmax_scale,
        HEADS_Q=prep.heads_q, HEADS_KV=prep.heads_kv, D=prep.dim, CAUSAL=causal, ACCUMULATE_DQ=accumulate_dq,
        IN_TURN=programs < items, num_warps=4,
        **tile_config(prep.dim),
    )


def _shown(name: str, choice) -> str:
    """A :func:`preparation` value as a message names it: a token order by its ``layout`` name."""
    if not name.endswith("_order"):
        return str(choice)
    return layout.ORDER_NAMES[int(getattr(choice, "value", choice))]


def dq_accum_dtype(prep: Prepared) -> torch.dtype:
    """What the kernel adds dQ's partials in: bf16 where the longest key sequence is known to be at most
    ``BF16_DQ_MAX_KEYS`` (``offsets.known_longest``: read by the offsets' check), fp32 elsewhere."""
    longest = known_longest(prep.offsets_k, prep.total_k)
    return torch.bfloat16 if longest is not None and longest <= BF16_DQ_MAX_KEYS else torch.float32


def dq_accumulator(prep: Prepared, device, *, adds: bool = True, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Zeroed ``[total_q + BLOCK_M, Hq, D]`` for the kernel's dQ sums of the call ``prep`` prepared, in ``dtype``
    (:func:`dq_accum_dtype` unless given): the kernel adds its tiles unmasked, and the ``BLOCK_M`` spare rows
    take what overhangs the last sequence (zeros). Without ``adds`` (no dQ accumulated) ``[BLOCK_M, Hq, D]``,
    for the descriptor alone."""
    rows = BLOCK_M.value + (prep.total_q if adds else 0)
    return torch.zeros(rows, prep.heads_q, prep.dim, dtype=dtype or dq_accum_dtype(prep), device=device)


def program_count(items: int, prep: Prepared, causal: bool, device: torch.device) -> int:
    """Programs of a launch of ``items`` work items. Where tiles are short and unmasked
    (:func:`short_programs`, not causal), one per SM (its shared memory holds one), each taking the
    items in turn: a tile's first loads then overlap the previous tile's last steps and its stores, and
    the setup is paid once; a sequence's key tiles cost the same and the longest sequences come first,
    so taking them in turn shares the work out evenly. Elsewhere one program per item, which the
    hardware starts on the SM the last one freed: long tiles gain little from the overlap, and taking
    them in turn lost up to 12% (the first programs drew the dearest item of each round), causal
    batches most (a causal tile's cost falls along its sequence, docs/perf-history.md)."""
    if short_programs(prep) and not causal:
        return min(items, resident_programs(device))
    return items


def preparation(deterministic: bool = False) -> dict:
    """What :class:`Prepared` makes for this kernel: Q^T in ``PV_ORDER``, dO^T as fp16 in natural order
    (dV's fp16 wgmma), K^T in ``DS_ORDER`` (natural order when deterministic: the portable dQ kernel reads
    it then, this kernel not), the e4m3 copies of Q with one scale per step's queries and of V with one per
    consumer's keys, and the padded per-query vectors."""
    key_order = layout.NATURAL_ORDER if deterministic else layout.DS_ORDER
    return dict(query_order=layout.PV_ORDER, key_order=key_order, do_order=layout.NATURAL_ORDER,
                do_sequence_dtype=torch.float16, query_scale_tokens=BLOCK_M.value,
                value_scale_tokens=KEYS_PER_CONSUMER.value, row_vectors=True)


def backward_into(dq, dk, dv, dout, q, k, v, out, lse, offsets_q, offsets_k, *, causal: bool, softmax_scale: float,
                  deterministic: bool = False, scores: str = "bf16", dlse=None) -> None:
    """:func:`attention_backward` writing dQ, dK, dV into the given buffers (q's, k's and v's shapes
    and dtypes), every element of them."""
    if scores not in SCORE_MODES:
        raise ValueError(f"scores must be one of {SCORE_MODES}, got {scores!r}")
    if offsets_q.numel() == 1:
        return
    options = preparation(deterministic)
    # Q's, K's and V's copies from the forward's passes, if it wrote them for this preparation (FP8 scores only).
    kept_q, kept_kv = take_backward_copies(q, k, v, offsets_q, offsets_k, options)
    exact = scores == "bf16"
    prep = Prepared(dout, q, k, v, out, lse, offsets_q, offsets_k, exact_scores=exact, dlse=dlse,
                    q_copies=None if exact else kept_q, kv_copies=None if exact else kept_kv, **options)
    if prep.total_k > 0:
        dq_accum = dq_accumulator(prep, dq.device, adds=not deterministic)
        launch(prep, dq_accum, dk, dv, softmax_scale=softmax_scale, causal=causal, accumulate_dq=not deterministic)
    if prep.total_q == 0:
        return
    if deterministic:
        launch_deterministic_dq(prep, dq, softmax_scale=softmax_scale, causal=causal)
    elif prep.total_k > 0:
        finish_dq(dq_accum, prep, dq, softmax_scale)
    else:
        dq.zero_()


def attention_backward(dout, q, k, v, out, lse, offsets_q, offsets_k, *, causal: bool, softmax_scale: float,
                       deterministic: bool = False, scores: str = "bf16", dlse=None):
    """dQ, dK, dV of varlen MXFP8 attention on a Hopper GPU; the arguments and results of
    ``portable.backward.attention_backward``.

    ``scores="bf16"``: S and dP from bf16 wgmmas on the MX values of Q, K, V and dO (exact, fp32
    accumulation); "fp8": from FP8 wgmma (~13-bit accumulation; gradients 1.5e-2 to 2e-1 from the
    reference backend on heavy-tailed and outlier inputs, docs/perf-history.md). dQ's partials
    are added into a bf16 or fp32 buffer (``dq_accum_dtype``) by TMA reduce-adds (the order varies run
    to run) and scaled by ``backward_passes.finish_dq``; ``deterministic=True`` leaves dQ to the portable deterministic
    kernel (bit-identical results, S and dP recomputed there)."""
    check_inputs(dout, q, k, v, out, lse, dlse, HEAD_DIMS)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    backward_into(dq, dk, dv, dout, q, k, v, out, lse, offsets_q, offsets_k, causal=causal,
                  softmax_scale=softmax_scale, deterministic=deterministic, scores=scores, dlse=dlse)
    return dq, dk, dv
