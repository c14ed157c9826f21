"""Varlen MXFP8 attention backward in plain Triton: FlashAttention-2 dataflow, the ``portable`` backend.

Dataflow (docs/DESIGN.md section 3), recomputing P from the forward's LSE:
``Delta = rowsum(dO * O)``; ``P = exp(S - LSE)``; ``dV = P^T dO``; ``dP = dO V^T``;
``dS = P * (dP - Delta)``; ``dQ = dS K * scale``; ``dK = dS^T Q * scale``.

The operands and their scales are the producers' (``producers.backward_passes``: per-token scales on
the feature axis, dO^T's per-(sequence, channel) scales, Q^T and K^T token-normalized with their token
scales folded into dS, P on the static 2^8 scale, dS on
a running per-program scale), as the Hopper kernel reads them. Kernels: the main kernel
(:func:`_dkdv_kernel`, one program per (key tile, sequence, KV head), looping over the query heads of
its GQA group and their query tiles, accumulating dK and dV in registers and, by default, adding dQ
tiles into an fp32 buffer, by TMA bulk reduce-adds where the GPU has TMA); and for
``deterministic=True`` a separate dQ kernel (:func:`_dq_kernel`, which the Hopper backward launches
too). One program per tile and no warp specialization: this is what the CPU interpreter runs (CI) and
what runs on GPUs without a Gluon kernel of ours (sm_89: e4m3 ``mma.sync``).
"""

import torch
import triton
import triton.language as tl
from triton.experimental.gluon._runtime import constexpr_function
from triton.language.core import _aggregate as aggregate  # Triton 3.6 does not export it yet
from triton.tools.tensor_descriptor import TensorDescriptor

from ..common import bounds, fp8
from ..producers import backward_passes
from ..producers.rebase import take_backward_copies
from . import HEAD_DIMS
from ..common.layout import (
    LOG2E,
    NATURAL_ORDER,
    P_SCALE,
    SMALLEST_NORMAL_BYTE,
    grid_split,
    grown_scale_byte,
    padded_seq_start,
    scale_factor,
    scale_inverse,
    scale_value,
    sequence_span,
)

# With ``precise_scores``, S and dP (FP8 wgmma, whose fast accumulation keeps fewer bits than
# fp32) are promoted to fp32 after every 32-wide k step: measured closer to the reference on peaked
# inputs and not slower (docs/perf-history.md), so it is the GPU default.
PRECISE_ACC_STEP = 32


# ----------------------------------------------------------------------------- scale helpers


@triton.jit
def _quantize_running(x, running_byte, INTERPRET: tl.constexpr):
    """Quantize the fp32 tile ``x`` on the grid of ``max(running_byte, its own byte)``.

    Returns (e4m3 tile, the new running byte, ``2^(running_byte - new byte)``: the factor <= 1
    that brings an accumulator kept in units of the old running scale to the new one).
    """
    byte, rescale = grown_scale_byte(tl.max(tl.max(tl.abs(x), axis=1), axis=0), running_byte)
    return fp8.to_e4m3(x * scale_factor(byte), INTERPRET), byte, rescale


# ----------------------------------------------------------------------------- main kernel


@triton.jit
def _visible(n, m, len_k, diagonal, CAUSAL: tl.constexpr):
    """bool, broadcast of key indices ``n`` and query indices ``m``: the key exists and
    (causal) the query sees it."""
    visible = n < len_k
    if CAUSAL:
        visible = visible & bounds.sees(m, n, diagonal)
    return visible


@aggregate
class KeySources:
    """Where key tiles come from: K and V on the feature axis (e4m3 ``[total_k, Hkv, D]`` or bf16 MX
    values) with their per-token scales (fp32 ``[Hkv, total_k]``), and K^T on the sequence axis (e4m3
    ``[Hkv, D, padded_k]``)."""
    k: tl.tensor
    k_scale: tl.tensor
    kt: tl.tensor
    v: tl.tensor
    v_scale: tl.tensor

    @constexpr_function
    def __init__(self, k, k_scale, kt, v, v_scale):
        self.k, self.k_scale, self.kt, self.v, self.v_scale = k, k_scale, kt, v, v_scale


@aggregate
class KeyTile:
    """One key tile in registers: K ``[BLOCK_N, D]`` and V with their per-token scales, K^T ``[D,
    BLOCK_N]``, and the keys' indices in their sequence (``n_idx``); zeros past the sequence's end."""
    k: tl.tensor
    k_scale: tl.tensor
    v: tl.tensor
    v_scale: tl.tensor
    kt: tl.tensor
    n_idx: tl.tensor

    @constexpr_function
    def __init__(self, k, k_scale, v, v_scale, kt, n_idx):
        self.k, self.k_scale, self.v, self.v_scale, self.kt, self.n_idx = k, k_scale, v, v_scale, kt, n_idx


@triton.jit
def _load_kv_tile(
    src, b, kv_head, k_start, len_k, n_start, total_k, padded_k,
    HEADS_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The :class:`KeyTile` of keys ``n_start`` to ``n_start + BLOCK_N`` of ``src`` (a :class:`KeySources`)."""
    n_idx = n_start + tl.arange(0, BLOCK_N)
    n_in = n_idx < len_k
    channels = tl.arange(0, HEAD_DIM)
    natural = (k_start + n_idx)[:, None] * (HEADS_KV * HEAD_DIM) + kv_head * HEAD_DIM + channels[None, :]
    scales = kv_head * total_k + k_start + n_idx
    k = tl.load(src.k + natural, mask=n_in[:, None], other=0.0)
    k_scale = tl.load(src.k_scale + scales, mask=n_in, other=0.0)
    v = tl.load(src.v + natural, mask=n_in[:, None], other=0.0)
    v_scale = tl.load(src.v_scale + scales, mask=n_in, other=0.0)
    rows = (kv_head * HEAD_DIM + channels).to(tl.int64)
    columns = padded_seq_start(k_start, b) + n_idx
    kt = tl.load(src.kt + rows[:, None] * padded_k + columns[None, :])
    return KeyTile(k, k_scale, v, v_scale, kt, n_idx)


@triton.jit
def _in_values(product, operand, token_factors):
    """S or dP from two feature copies (``operand``: one of them) as values: e4m3 copies are in
    units of their token scales (times ``token_factors``), bf16 copies hold the MX values themselves."""
    if operand.dtype == tl.bfloat16:
        return product
    return product * token_factors


@aggregate
class QueryHead:
    """One query head's operands in a dK/dV program, each pointer at its sequence's first row: Q and dO
    (natural rows of ``Hq * D``) with their feature copies' scales, Q's token scales (what Q^T is
    normalized by), Q^T and dO^T (transposed, padded columns), lse2, Delta, and dQ's fp32 accumulator
    (natural rows)."""
    q: tl.tensor
    q_scale: tl.tensor
    q_token: tl.tensor
    qt: tl.tensor
    do: tl.tensor
    do_scale: tl.tensor
    dot: tl.tensor
    lse2: tl.tensor
    delta: tl.tensor
    dq: tl.tensor

    @constexpr_function
    def __init__(self, q, q_scale, q_token, qt, do, do_scale, dot, lse2, delta, dq):
        self.q, self.q_scale, self.q_token, self.qt = q, q_scale, q_token, qt
        self.do, self.do_scale, self.dot = do, do_scale, dot
        self.lse2, self.delta, self.dq = lse2, delta, dq


@triton.jit
def _dkdv_step(
    dk_acc, dv_acc, ds_byte, key, head, m_start, dq_desc, dq_row, dq_col, softmax_scale, len_q, len_k, diagonal,
    padded_q, qk_log2,
    HEADS_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
    MASKED: tl.constexpr, SCORE_ACC_STEP: tl.constexpr, ACCUMULATE_DQ: tl.constexpr, TMA_REDUCE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One query tile of ``head`` (a :class:`QueryHead`) against the program's ``key`` tile (a :class:`KeyTile`).

    Rows past ``len_q`` load as zeros with lse2 = +inf, so their P is 0 without a mask; MASKED
    adds the key-bound and causal masks for the tiles that need them. dS is quantized times
    the Q and K token scales (the sequence-axis copies of Q and K are token-normalized), which Q's
    feature copy may not have (``Prepared(query_scale_tokens)``). dv_acc
    is in units of the dO sequence scales, dk_acc in units of the running dS scale ``2^(ds_byte - 127)``
    times the key's token scale (both in the epilogue).
    """
    m_idx = m_start + tl.arange(0, BLOCK_M)
    m_in = m_idx < len_q
    channels = tl.arange(0, HEAD_DIM)
    natural = m_idx[:, None] * (HEADS_Q * HEAD_DIM) + channels[None, :]
    transposed = channels[:, None].to(tl.int64) * padded_q + m_idx[None, :]

    q = tl.load(head.q + natural, mask=m_in[:, None], other=0.0)
    q_scale = tl.load(head.q_scale + m_idx, mask=m_in, other=0.0)
    q_token = tl.load(head.q_token + m_idx, mask=m_in, other=0.0)
    lse2 = tl.load(head.lse2 + m_idx, mask=m_in, other=float("inf"))
    s_t = _in_values(tl.dot(key.k, tl.trans(q), max_num_imprecise_acc=SCORE_ACC_STEP), q,
                     key.k_scale[:, None] * q_scale[None, :])
    token_scales = key.k_scale[:, None] * q_token[None, :]
    p_t = tl.exp2(s_t * qk_log2 - lse2[None, :])
    if MASKED:
        p_t = tl.where(_visible(key.n_idx[:, None], m_idx[None, :], len_k, diagonal, CAUSAL), p_t, 0.0)

    p8_t = fp8.to_e4m3(p_t * P_SCALE, INTERPRET)
    scaled_p_t = p_t * token_scales  # dS is formed with the token scales folded in
    do_t = tl.load(head.dot + transposed)
    dv_acc = tl.dot(p8_t, tl.trans(do_t), dv_acc)

    do = tl.load(head.do + natural, mask=m_in[:, None], other=0.0)
    do_scale = tl.load(head.do_scale + m_idx, mask=m_in, other=0.0)
    delta = tl.load(head.delta + m_idx, mask=m_in, other=0.0)
    dp_t = _in_values(tl.dot(key.v, tl.trans(do), max_num_imprecise_acc=SCORE_ACC_STEP), do,
                      key.v_scale[:, None] * do_scale[None, :])
    ds8_t, ds_byte, rescale = _quantize_running(scaled_p_t * (dp_t - delta[None, :]), ds_byte, INTERPRET)

    q_t = tl.load(head.qt + transposed)
    dk_acc = tl.dot(ds8_t, tl.trans(q_t), dk_acc * rescale)
    if ACCUMULATE_DQ:
        dq_factor = scale_inverse(q_token) * (softmax_scale * scale_value(ds_byte))
        dq = tl.dot(tl.trans(ds8_t), tl.trans(key.kt)) * dq_factor[:, None]
        if TMA_REDUCE:  # one bulk reduce-add of the tile; rows past len_q add zeros
            dq_desc.atomic_add([dq_row + m_start.to(tl.int32), dq_col], dq)
        else:
            tl.atomic_add(head.dq + natural, dq, mask=m_in[:, None], sem="relaxed")
    return dk_acc, dv_acc, ds_byte


@triton.jit
def _dkdv_kernel(
    q_ptr, q_scale_ptr, q_token_ptr, qt_ptr,
    k_ptr, k_scale_ptr, kt_ptr,
    v_ptr, v_scale_ptr,
    do_ptr, do_scale_ptr, dot_ptr, dot_scale_ptr,
    lse2_ptr, delta_ptr,
    dq_ptr, dq_desc, dk_ptr, dv_ptr,
    offsets_q_ptr, offsets_k_ptr,
    total_q, total_k, padded_q, padded_k, batch, softmax_scale,
    HEADS_Q: tl.constexpr, HEADS_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, SCORE_ACC_STEP: tl.constexpr,
    ACCUMULATE_DQ: tl.constexpr, TMA_REDUCE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """dK, dV of one (BLOCK_N key tile, sequence, KV head), and dQ partials by atomics.

    Layouts as written by ``backward_passes``' producers: natural e4m3 ``[total, H, D]`` with fp32 per-token
    scales ``[H, total]`` (and Q's token scales, ``q_token_ptr``); transposed e4m3 ``[H, D, padded]``, Q's
    and K's over those token scales, dO's on fp32 scales ``[Hkv, B, D]`` (per GQA group); lse2, delta fp32
    ``[Hq, total_q]``; dq fp32 ``[total_q, Hq, D]`` (with TMA_REDUCE, ``dq_desc`` describes it as
    ``[total_q, Hq * D]`` in ``[BLOCK_M, D]`` blocks); dk, dv in the output dtype ``[total_k, Hkv, D]``.
    """
    n_tile, b = grid_split(batch)
    kv_head = tl.program_id(1)
    q_start, len_q = sequence_span(offsets_q_ptr, b, total_q)
    k_start, len_k = sequence_span(offsets_k_ptr, b, total_k)
    n_start = n_tile * BLOCK_N
    if n_start >= len_k:
        return
    diagonal = bounds.diagonal(len_q, len_k)
    channels = tl.arange(0, HEAD_DIM)
    key = _load_kv_tile(KeySources(k_ptr, k_scale_ptr, kt_ptr, v_ptr, v_scale_ptr), b, kv_head, k_start, len_k,
                        n_start, total_k, padded_k, HEADS_KV, HEAD_DIM, BLOCK_N)

    # Query tiles before m_lo see none of these keys; from m_full on they see all of them.
    # (All bounds stay multiples of BLOCK_M so the compiler knows the loads are aligned.)
    m_end = tl.cdiv(len_q, BLOCK_M) * BLOCK_M
    if CAUSAL:
        m_lo = bounds.first_query_seeing(n_start, diagonal) // BLOCK_M * BLOCK_M
    else:
        m_lo = 0
    m_full = bounds.first_query_seeing_all(n_start + BLOCK_N, len_k, m_end, diagonal if CAUSAL else len_k)
    m_full = tl.maximum(tl.cdiv(m_full, BLOCK_M) * BLOCK_M, m_lo)

    dk_acc = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv_acc = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    ds_byte = SMALLEST_NORMAL_BYTE
    group = HEADS_Q // HEADS_KV
    padded_q_start = padded_seq_start(q_start, b)
    for h in tl.range(kv_head * group, (kv_head + 1) * group):
        q_off = q_start * (HEADS_Q * HEAD_DIM) + h * HEAD_DIM
        scale_off = h * total_q + q_start
        t_off = tl.cast(h * HEAD_DIM, tl.int64) * padded_q + padded_q_start
        head = QueryHead(q_ptr + q_off, q_scale_ptr + scale_off, q_token_ptr + scale_off, qt_ptr + t_off,
                         do_ptr + q_off, do_scale_ptr + scale_off, dot_ptr + t_off, lse2_ptr + scale_off,
                         delta_ptr + scale_off, dq_ptr + q_off)
        for phase in tl.static_range(2):  # the masked query tiles, then the fully visible ones
            for m_start in tl.range(m_lo if phase == 0 else m_full, m_full if phase == 0 else m_end, BLOCK_M):
                dk_acc, dv_acc, ds_byte = _dkdv_step(
                    dk_acc, dv_acc, ds_byte, key, head, m_start, dq_desc, q_start.to(tl.int32), h * HEAD_DIM,
                    softmax_scale, len_q, len_k, diagonal, padded_q, softmax_scale * LOG2E,
                    HEADS_Q, HEAD_DIM, BLOCK_M, CAUSAL, phase == 0, SCORE_ACC_STEP, ACCUMULATE_DQ, TMA_REDUCE,
                    INTERPRET,
                )
    dv_scale = tl.load(dot_scale_ptr + (kv_head * batch + b) * HEAD_DIM + channels) * (1.0 / P_SCALE)
    dk = dk_acc * (scale_inverse(key.k_scale) * (scale_value(ds_byte) * softmax_scale))[:, None]
    kv_natural = (k_start + key.n_idx)[:, None] * (HEADS_KV * HEAD_DIM) + kv_head * HEAD_DIM + channels[None, :]
    n_in = key.n_idx < len_k
    tl.store(dk_ptr + kv_natural, dk.to(dk_ptr.dtype.element_ty), mask=n_in[:, None])
    tl.store(dv_ptr + kv_natural, (dv_acc * dv_scale[None, :]).to(dv_ptr.dtype.element_ty), mask=n_in[:, None])


# ----------------------------------------------------------------------------- deterministic dQ


@triton.jit
def _dq_step(
    dq_acc, ds_byte, q, q_scale, q_token, do, do_scale, lse2, delta, m_idx, n_start,
    keys, b, kv_head, k_start, len_k, total_k, padded_k, diagonal, qk_log2,
    HEADS_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, SCORE_ACC_STEP: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One key tile against the program's query tile: ``dq_acc += dS K`` in units of the K
    sequence scales times the running dS scale times the query's token scale (dS is quantized
    times the token scales, as in :func:`_dkdv_step`); ``keys``: a :class:`KeySources`."""
    key = _load_kv_tile(keys, b, kv_head, k_start, len_k, n_start, total_k, padded_k, HEADS_KV, HEAD_DIM, BLOCK_N)
    p = tl.exp2(_in_values(tl.dot(q, tl.trans(key.k), max_num_imprecise_acc=SCORE_ACC_STEP), q,
                           q_scale[:, None] * key.k_scale[None, :]) * qk_log2 - lse2[:, None])
    token_scales = q_token[:, None] * key.k_scale[None, :]
    if MASKED:
        p = tl.where(_visible(key.n_idx[None, :], m_idx[:, None], len_k, diagonal, CAUSAL), p, 0.0)
    scaled_p = p * token_scales  # dS is formed with the token scales folded in
    dp = _in_values(tl.dot(do, tl.trans(key.v), max_num_imprecise_acc=SCORE_ACC_STEP), do,
                    do_scale[:, None] * key.v_scale[None, :])
    ds8, ds_byte, rescale = _quantize_running(scaled_p * (dp - delta[:, None]), ds_byte, INTERPRET)
    return tl.dot(ds8, tl.trans(key.kt), dq_acc * rescale), ds_byte


@triton.jit
def _dq_kernel(
    q_ptr, q_scale_ptr, q_token_ptr, k_ptr, k_scale_ptr, kt_ptr, v_ptr, v_scale_ptr,
    do_ptr, do_scale_ptr, lse2_ptr, delta_ptr, dq_ptr,
    offsets_q_ptr, offsets_k_ptr,
    total_q, total_k, padded_k, batch, softmax_scale,
    HEADS_Q: tl.constexpr, HEADS_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, SCORE_ACC_STEP: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """dQ of one (BLOCK_M query tile, sequence, query head), looping over its key tiles in order
    (no atomics: bit-identical run to run). Layouts as in :func:`_dkdv_kernel`; dq in the output
    dtype ``[total_q, Hq, D]``."""
    m_tile, b = grid_split(batch)
    h = tl.program_id(1)
    q_start, len_q = sequence_span(offsets_q_ptr, b, total_q)
    k_start, len_k = sequence_span(offsets_k_ptr, b, total_k)
    m_start = m_tile * BLOCK_M
    if m_start >= len_q:
        return
    diagonal = bounds.diagonal(len_q, len_k)
    kv_head = h // (HEADS_Q // HEADS_KV)
    m_idx = m_start + tl.arange(0, BLOCK_M)
    m_in = m_idx < len_q
    channels = tl.arange(0, HEAD_DIM)
    natural = (q_start + m_idx)[:, None] * (HEADS_Q * HEAD_DIM) + h * HEAD_DIM + channels[None, :]
    scales = h * total_q + q_start + m_idx
    qk_log2 = softmax_scale * LOG2E
    q = tl.load(q_ptr + natural, mask=m_in[:, None], other=0.0)
    q_scale = tl.load(q_scale_ptr + scales, mask=m_in, other=0.0)
    q_token = tl.load(q_token_ptr + scales, mask=m_in, other=0.0)
    do = tl.load(do_ptr + natural, mask=m_in[:, None], other=0.0)
    do_scale = tl.load(do_scale_ptr + scales, mask=m_in, other=0.0)
    lse2 = tl.load(lse2_ptr + scales, mask=m_in, other=float("inf"))
    delta = tl.load(delta_ptr + scales, mask=m_in, other=0.0)

    # Key tiles before n_full are seen by every query of the tile; from n_end on by none.
    n_end = len_k
    n_full = len_k // BLOCK_N * BLOCK_N
    if CAUSAL:
        n_end = bounds.keys_seen_below(m_start + BLOCK_M, len_k, diagonal)
        n_full = bounds.keys_seen_below(m_start + 1, len_k, diagonal) // BLOCK_N * BLOCK_N
    dq_acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    ds_byte = SMALLEST_NORMAL_BYTE
    keys = KeySources(k_ptr, k_scale_ptr, kt_ptr, v_ptr, v_scale_ptr)
    for phase in tl.static_range(2):  # the fully visible key tiles, then the masked ones
        for n_start in tl.range(0 if phase == 0 else n_full, n_full if phase == 0 else n_end, BLOCK_N):
            dq_acc, ds_byte = _dq_step(
                dq_acc, ds_byte, q, q_scale, q_token, do, do_scale, lse2, delta, m_idx, n_start, keys, b, kv_head,
                k_start, len_k, total_k, padded_k, diagonal, qk_log2, HEADS_KV, HEAD_DIM, BLOCK_N, CAUSAL, phase == 1,
                SCORE_ACC_STEP, INTERPRET,
            )
    dq = dq_acc * (scale_inverse(q_token) * (scale_value(ds_byte) * softmax_scale))[:, None]
    tl.store(dq_ptr + natural, dq.to(dq_ptr.dtype.element_ty), mask=m_in[:, None])


# ----------------------------------------------------------------------------- launchers


# The deterministic dQ kernel's tiles on a GPU (S is [BLOCK_M, BLOCK_N] there).
GPU_DQ_TILES = dict(block_m=128, block_n=64, num_warps=8, num_stages=2)
INTERPRETER_TILES = dict(block_m=32, block_n=32, precise_scores=False, tma_reduce=False, num_warps=4, num_stages=1)


def tile_config(device: torch.device) -> dict:
    """The dK/dV kernel's tiles on ``device``. On CUDA the GPU-tuned ones, dQ's tiles added by TMA
    reduce-adds where the GPU has TMA (sm_90 and newer), by atomics below; in the CPU interpreter small
    tiles (its FP8 dots are exact there, so precise scores are moot)."""
    if device.type != "cuda":
        return dict(INTERPRETER_TILES)
    tma = torch.cuda.get_device_capability(device)[0] >= 9
    return dict(block_m=64, block_n=128, precise_scores=True, tma_reduce=tma, num_warps=8, num_stages=3)


def _shape_constants(prep, block_m, block_n, causal, precise_scores, num_warps, num_stages):
    return dict(HEADS_Q=prep.heads_q, HEADS_KV=prep.heads_kv, HEAD_DIM=prep.dim, BLOCK_M=block_m,
                BLOCK_N=block_n, CAUSAL=causal, SCORE_ACC_STEP=PRECISE_ACC_STEP if precise_scores else None,
                INTERPRET=fp8.INTERPRETED, num_warps=num_warps, num_stages=num_stages)


def _launch_dkdv(prep: backward_passes.Prepared, dq_accum, dk, dv, *, softmax_scale, accumulate_dq, tma_reduce, block_m,
                 block_n, **shape):
    """dK, dV (and, with ``accumulate_dq``, dQ added into the fp32 ``dq_accum``: by TMA bulk
    reduce-adds of whole tiles with ``tma_reduce``, else by per-element atomics)."""
    q, k, v, do = prep.q, prep.k, prep.v, prep.do
    tma_reduce = tma_reduce and accumulate_dq and prep.total_q > 0 and not fp8.INTERPRETED
    dq_desc = dq_accum
    if tma_reduce:
        dq_desc = TensorDescriptor.from_tensor(dq_accum.view(prep.total_q, -1), [block_m, prep.dim])
    _dkdv_kernel[(triton.cdiv(prep.max_len_k, block_n) * prep.batch, prep.heads_kv)](
        q.feature, q.feature_scale, q.token_scale, q.sequence,
        k.feature, k.feature_scale, k.sequence,
        v.feature, v.feature_scale,
        do.feature, do.feature_scale, do.sequence, do.sequence_scale,
        prep.lse2, prep.delta, dq_accum, dq_desc, dk, dv, prep.offsets_q, prep.offsets_k,
        prep.total_q, prep.total_k, prep.padded_q, prep.padded_k, prep.batch, softmax_scale,
        ACCUMULATE_DQ=accumulate_dq, TMA_REDUCE=tma_reduce, **_shape_constants(prep, block_m, block_n, **shape),
    )


def _launch_dq(prep: backward_passes.Prepared, dq, *, softmax_scale, block_m, block_n, **shape):
    """dQ by the deterministic kernel, with the given tiles."""
    q, k, v, do = prep.q, prep.k, prep.v, prep.do
    _dq_kernel[(triton.cdiv(prep.max_len_q, block_m) * prep.batch, prep.heads_q)](
        q.feature, q.feature_scale, q.token_scale, k.feature, k.feature_scale, k.sequence,
        v.feature, v.feature_scale, do.feature, do.feature_scale, prep.lse2, prep.delta, dq,
        prep.offsets_q, prep.offsets_k, prep.total_q, prep.total_k, prep.padded_k, prep.batch, softmax_scale,
        **_shape_constants(prep, block_m, block_n, **shape),
    )


def launch_deterministic_dq(prep: backward_passes.Prepared, dq: torch.Tensor, *, softmax_scale: float,
                            causal: bool) -> None:
    """dQ into ``dq`` by the deterministic kernel: one program per query tile, its key tiles in order, S and
    dP recomputed from ``prep``'s copies (K^T in natural order); bit-identical from run to run."""
    tiles = dict(GPU_DQ_TILES, precise_scores=True) if dq.is_cuda else dict(INTERPRETER_TILES)
    tiles.pop("tma_reduce", None)
    _launch_dq(prep, dq, softmax_scale=softmax_scale, causal=causal, **tiles)


def preparation() -> dict:
    """The copies these kernels read (``backward_passes.Prepared``'s options): every token order natural,
    one scale per token in Q's and V's feature copies."""
    return dict(query_order=NATURAL_ORDER, key_order=NATURAL_ORDER, query_scale_tokens=1, value_scale_tokens=1)


def backward_into(dq, dk, dv, dout, q, k, v, out, lse, offsets_q, offsets_k, *, causal: bool, softmax_scale: float,
                  deterministic: bool = False, dlse=None, tiles: dict | None = None) -> None:
    """:func:`attention_backward` writing dQ, dK, dV into the given buffers (q's, k's and v's shapes
    and dtypes), every element of them."""
    if offsets_q.numel() == 1:
        return
    options = preparation()
    kept_q, kept_kv = take_backward_copies(q, k, v, offsets_q, offsets_k, options)
    prep = backward_passes.Prepared(dout, q, k, v, out, lse, offsets_q, offsets_k, dlse=dlse, q_copies=kept_q,
                                    kv_copies=kept_kv, **options)
    tiles = dict(tile_config(q.device) if tiles is None else tiles)
    tma_reduce = tiles.pop("tma_reduce")
    if prep.total_k > 0:
        dq_accum = dq if deterministic else torch.zeros(dq.shape, dtype=torch.float32, device=dq.device)
        _launch_dkdv(prep, dq_accum, dk, dv, softmax_scale=softmax_scale, causal=causal,
                     accumulate_dq=not deterministic, tma_reduce=tma_reduce, **tiles)
    if prep.total_q == 0:
        return
    if deterministic:
        launch_deterministic_dq(prep, dq, softmax_scale=softmax_scale, causal=causal)
    elif prep.total_k > 0:
        dq.copy_(dq_accum)
    else:
        dq.zero_()


def attention_backward(dout, q, k, v, out, lse, offsets_q, offsets_k, *, causal: bool, softmax_scale: float,
                       deterministic: bool = False, dlse=None, tiles: dict | None = None):
    """dQ, dK, dV of varlen MXFP8 attention (docs/DESIGN.md section 3 dataflow).

    dout, q, out: ``[total_q, Hq, D]``; k, v: ``[total_k, Hkv, D]``, high precision (fp32, bf16
    or fp16); lse: float32 ``[total_q, Hq]``, natural log, -inf for rows that see no key; dlse: None or
    the LSE's gradient, float32 ``[total_q, Hq]`` (subtracted from Delta by dO's producer, where every
    kernel reads Delta from);
    offsets_q / offsets_k: int32 or int64 ``[B + 1]``. Causal is bottom-right aligned; D is 64
    or 128; ``Hq % Hkv == 0`` (dK, dV summed over each KV head's query-head group). Returns
    (dq, dk, dv) in the inputs' dtypes. ``tiles``: the dK/dV kernel's (default :func:`tile_config`).

    ``deterministic=False`` adds each key tile's dQ partial into an fp32 buffer (TMA bulk
    reduce-adds on sm_90+, atomics elsewhere; the order varies run to run). ``deterministic=True``
    computes dQ in a separate kernel per query tile that loops over its key tiles in order:
    bit-identical results, at the price of recomputing S and dP there (docs/perf-history.md).
    """
    backward_passes.check_inputs(dout, q, k, v, out, lse, dlse, HEAD_DIMS)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    backward_into(dq, dk, dv, dout, q, k, v, out, lse, offsets_q, offsets_k, causal=causal,
                  softmax_scale=softmax_scale, deterministic=deterministic, dlse=dlse, tiles=tiles)
    return dq, dk, dv
