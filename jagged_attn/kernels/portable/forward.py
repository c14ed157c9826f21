"""Varlen MXFP8 attention forward in plain Triton (backend ``portable``): FP8 MMAs on rebased operands.

FP8 MMAs without block scales (Hopper's and Ada's) need the operands rebased (``producers.rebase``): Q
to one exponent per token (by each program, on its own Q tile), K to one per KV tile, V to one per
(sequence, head, channel), stored transposed so both MMA operands are K-major. Those factors
leave the MMAs: Q's per-row and K's per-tile factors fold into the softmax scale of each row,
V's scale each output channel in the epilogue. (A per-key factor would cost a broadcast column
vector, ~32 registers per thread, and spilled at 128x128 tiles.)

The softmax runs online in the exp2 domain with the running row maximum ``m``. P = ``exp2(s - m + 8)``
lies in (0, 256], 256 exactly at the row's largest score so far, and is cast to e4m3 on that static
2^8 scale (``mx_format.P_STATIC_EXP``); the row sum uses the unrounded P. A tile's P is rounded
against the maximum of the keys met so far (``reference._softmax_parts`` says why the maximum is
not rounded to an integer).

One program computes one (query tile, head): KV tiles that every row of the tile sees run
without masks, the diagonal (causal) and ragged-end tiles with them. Programs are launched in
the longest-first order of ``schedule.work_list``. No warp specialization: this is what the CPU interpreter runs
(CI) and what runs on GPUs without a Gluon kernel of ours (sm_89: e4m3 ``mma.sync``); on Hopper the
``sm90.forward`` kernel runs the same algorithm warp-specialized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jagged_attn.mxfp8 import MXFP8Jagged, checked_after, largest_magnitudes

from ..common import bounds, fp8, layout
from ..common.layout import FINITE_FLOOR, SCORE_MODES
from . import HEAD_DIMS  # noqa: F401  (the backend table reads it here)
from ..producers.rebase import (
    dequantized_feature_rows,
    kept_rebase_kv,
    quantize_rebase_kv,
    rebased_feature_rows,
    scale_args,
)
from ..common.schedule import work_list
from . import backward as portable_backward


def tile_config(head_dim: int, scores: str = "fp8") -> dict:
    """Block sizes, warps and pipeline depth (the best of a sweep on an H200, docs/perf-history.md; sm_89
    takes the same): one warpgroup per program.

    SCORES (``layout.SCORE_MODES``) picks how S = Q K^T is computed: "fp8" is an FP8 MMA with its fast
    accumulation over all of D; "bf16" upcasts the e4m3 operands (exactly) and runs a bf16 MMA, so S is
    exact up to fp32 accumulation, at half the MMA rate for this product (bf16 K tiles take twice the
    shared memory: two stages at d128). Measured with ``scripts/fwd_precision.py`` (docs/perf-history.md)."""
    if scores not in SCORE_MODES:
        raise ValueError(f"scores must be one of {SCORE_MODES}, got {scores!r}")
    stages = 2 if scores == "bf16" and head_dim > 64 else 3
    return dict(BLOCK_M=64, BLOCK_N=128, SCORES=scores, num_warps=4, num_stages=stages)


@triton.jit
def _attend_tiles(
    acc,
    row_sum,
    row_max,
    q,
    row_scale,
    last_col,
    k_block,
    vt_block,
    k_tile_factor,
    col_begin,
    col_end,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    SCORES: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Online softmax over KV tiles ``[col_begin, col_end)``; when MASKED, row i sees columns <= last_col[i]."""
    k_block = tl.advance(k_block, (col_begin, 0))
    vt_block = tl.advance(vt_block, (0, col_begin))
    # The K tile's factor is loaded one iteration ahead: a load used at once would stall each tile.
    next_k_factor = tl.load(k_tile_factor + col_begin // BLOCK_N, mask=col_begin < col_end, other=0.0)
    for col0 in range(col_begin, col_end, BLOCK_N):
        k_factor = next_k_factor
        next_k_factor = tl.load(k_tile_factor + col0 // BLOCK_N + 1, mask=col0 + BLOCK_N < col_end, other=0.0)
        if MASKED:
            k = tl.load(k_block, boundary_check=(0,), padding_option="zero")
        else:
            k = tl.load(k_block)
        if SCORES == "bf16":
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s *= (row_scale * k_factor)[:, None]
        if MASKED:
            cols = col0 + tl.arange(0, BLOCK_N)
            s = tl.where(cols[None, :] <= last_col[:, None], s, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        alpha = tl.exp2(row_max - new_max)
        p = tl.exp2(s - (new_max - layout.P_STATIC_EXP)[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        if INTERPRET:
            p = fp8.snap_to_e4m3_grid(p)
        vt = tl.load(vt_block)  # zero-padded to a multiple of 128 tokens (rebase.py)
        # A fresh accumulator per tile: FP8 wgmma adds into its accumulator with truncated
        # alignment, which biases small late tiles towards zero when added to a large running O.
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float8e4nv), tl.trans(vt))
        row_max = new_max
        k_block = tl.advance(k_block, (BLOCK_N, 0))
        vt_block = tl.advance(vt_block, (0, BLOCK_N))
    return acc, row_sum, row_max


@triton.jit
def _attention_forward_kernel(
    q,
    q_scales,
    k,
    k_factor,
    vt,
    v_exponent,
    out,
    lse,
    offsets_q,
    offsets_k,
    total_q,
    total_k,
    work,
    scale_log2,
    q_scale_bytes_per_head,
    q_col_tiles,
    k_groups,
    t_pad,
    batch,
    HEADS_Q: tl.constexpr,
    HEADS_KV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCORES: tl.constexpr,
    CAUSAL: tl.constexpr,
    Q_FROM_HIGH_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    slot = tl.program_id(0) // HEADS_Q
    head = tl.program_id(0) % HEADS_Q
    seq = tl.load(work + 2 * slot)
    if seq < 0:
        return
    tile = tl.load(work + 2 * slot + 1)
    kv_head = (head // (HEADS_Q // HEADS_KV)).to(tl.int64)
    q_start, len_q = layout.sequence_span(offsets_q, seq, total_q)
    k_start, len_k = layout.sequence_span(offsets_k, seq, total_k)

    row0 = tile * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    in_seq = rows < len_q
    if SCORES == "bf16":
        q_tile = dequantized_feature_rows(q, q_scales, head, seq, q_start, len_q, rows, q_scale_bytes_per_head,
                                          q_col_tiles, HEADS_Q, D, BLOCK_M, Q_FROM_HIGH_PRECISION, False, INTERPRET)
        row_scale = tl.full((BLOCK_M,), 1.0, dtype=tl.float32) * scale_log2
    else:
        q_tile, q_byte = rebased_feature_rows(q, q_scales, head, seq, q_start, len_q, rows, q_scale_bytes_per_head,
                                              q_col_tiles, HEADS_Q, D, BLOCK_M, 1, Q_FROM_HIGH_PRECISION, False,
                                              INTERPRET)
        row_scale = layout.scale_value(q_byte) * scale_log2
    k_block = tl.make_block_ptr(
        k + k_start * (HEADS_KV * D) + kv_head * D,
        shape=(len_k, D),
        strides=(HEADS_KV * D, 1),
        offsets=(0, 0),
        block_shape=(BLOCK_N, D),
        order=(1, 0),
    )
    vt_block = tl.make_block_ptr(
        vt + kv_head * D * t_pad + layout.padded_seq_start(k_start, seq),
        shape=(D, len_k),
        strides=(t_pad, 1),
        offsets=(0, 0),
        block_shape=(D, BLOCK_N),
        order=(1, 0),
    )
    k_tile_factor = k_factor + kv_head * k_groups + layout.padded_seq_start(k_start, seq) // BLOCK_N

    diagonal = bounds.diagonal(len_q, len_k)
    if CAUSAL:
        unmasked_end = bounds.keys_seen_below(row0 + 1, len_k, diagonal)
        col_end = bounds.keys_seen_below(tl.minimum(row0 + BLOCK_M, len_q), len_k, diagonal)
        last_col = bounds.last_key_seen(rows, len_k, diagonal)
    else:
        unmasked_end = len_k
        col_end = len_k
        last_col = tl.full((BLOCK_M,), len_k - 1, dtype=tl.int32)
    unmasked_end = unmasked_end // BLOCK_N * BLOCK_N

    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    row_max = tl.full((BLOCK_M,), FINITE_FLOOR, dtype=tl.float32)
    # KV tiles every row sees fully, without masks; then the diagonal (causal) and ragged-end ones.
    acc, row_sum, row_max = _attend_tiles(acc, row_sum, row_max, q_tile, row_scale, last_col, k_block, vt_block,
                                          k_tile_factor, 0, unmasked_end, BLOCK_N, False, SCORES, INTERPRET)
    acc, row_sum, row_max = _attend_tiles(acc, row_sum, row_max, q_tile, row_scale, last_col, k_block, vt_block,
                                          k_tile_factor, unmasked_end, col_end, BLOCK_N, True, SCORES, INTERPRET)

    channels = tl.arange(0, D)
    v_factor = layout.scale_value(tl.load(v_exponent + (kv_head * batch + seq) * D + channels))
    seen = row_sum > 0.0
    inverse_sum = tl.where(seen, 1.0 / tl.where(seen, row_sum, 1.0), 0.0)
    o = acc * inverse_sum[:, None] * v_factor[None, :]
    tokens = q_start + rows
    tl.store(
        out + (tokens * HEADS_Q + head)[:, None] * D + channels[None, :],
        fp8.saturating_cast(o, out.dtype.element_ty),
        mask=in_seq[:, None],
    )
    log_sum = (row_max - layout.P_STATIC_EXP + tl.log2(tl.where(seen, row_sum, 1.0))) * layout.LN2
    tl.store(lse + tokens * HEADS_Q + head, tl.where(seen, log_sum, -float("inf")), mask=in_seq)


def forward_rebased(
    q,
    q_mx,
    k8,
    k_factor,
    vt,
    v_exponent,
    offsets_q,
    offsets_k,
    *,
    causal,
    softmax_scale,
    out_dtype,
    config=None,
):
    """The kernel on rebased K, V and on Q as it comes: ``q`` is the e4m3 data of ``q_mx`` or, with
    ``q_mx=None``, high-precision values; the kernel quantizes (rceil) and rebases its own
    Q tile. ``config`` (default ``tile_config``) must have the BLOCK_N that K was rebased with."""
    total_q, heads_q, dim = q.shape
    total_k, heads_kv, _ = k8.shape
    config = tile_config(dim) if config is None else config
    q_scales, q_per_head, q_col_tiles = scale_args(q_mx, "feature", total_q, offsets_q.numel() - 1, dim, q.device)
    out = torch.empty(total_q, heads_q, dim, dtype=out_dtype, device=q.device)
    lse = torch.empty(total_q, heads_q, dtype=torch.float32, device=q.device)
    work = work_list(offsets_q, offsets_k, total_q, total_k, config["BLOCK_M"], causal=causal)
    if work.shape[0]:
        _attention_forward_kernel[(work.shape[0] * heads_q,)](
            q,
            q_scales,
            k8,
            k_factor,
            vt,
            v_exponent,
            out,
            lse,
            offsets_q,
            offsets_k,
            total_q,
            total_k,
            work,
            softmax_scale * layout.LOG2E.value,
            q_per_head,
            q_col_tiles,
            k_factor.shape[1],
            vt.shape[2],
            offsets_q.numel() - 1,
            HEADS_Q=heads_q,
            HEADS_KV=heads_kv,
            D=dim,
            CAUSAL=causal,
            Q_FROM_HIGH_PRECISION=q_mx is None,
            INTERPRET=fp8.INTERPRETED,
            **config,
        )
    return out, lse


def attention_forward(
    q: MXFP8Jagged,
    k: MXFP8Jagged,
    v: MXFP8Jagged,
    *,
    causal: bool,
    softmax_scale: float,
    out_dtype=torch.bfloat16,
    scores="fp8",
):
    """Jagged attention of MXFP8 inputs (validated by the caller).

    q, k: feature-axis ``MXFP8Jagged`` (``[total_q, Hq, D]``, ``[total_k, Hkv, D]``); v: sequence-axis,
    offsets equal to k's. Returns (out ``[total_q, Hq, D]`` out_dtype, lse fp32 ``[total_q, Hq]``, natural
    log; rows that see no key get out = 0 and lse = -inf). Causal is bottom-right aligned.
    K and V are rebased in one pass each (kept for later calls on the same k and v:
    ``rebase.kept_rebase_kv``); Q is rebased inside the kernel. ``scores`` picks how S is computed
    (:func:`tile_config`).
    """
    config = tile_config(q.head_dim, scores)
    rebased_kv = kept_rebase_kv(k, v, config["BLOCK_N"], exact=config["SCORES"] == "bf16")
    return forward_rebased(
        q.data,
        q,
        *rebased_kv,
        q.offsets,
        k.offsets,
        causal=causal,
        softmax_scale=softmax_scale,
        out_dtype=out_dtype,
        config=config,
    )


def attention_forward_hp(
    q, k, v, offsets_q, offsets_k, *, causal: bool, softmax_scale: float, out_dtype=None, scores="fp8",
    check_finite=False, for_backward=False,
):
    """Like :func:`attention_forward` for bf16/fp16 ``q [total_q, Hq, D]``, ``k, v [total_k, Hkv, D]``:
    K and V are quantized to MXFP8 (rceil) and rebased in one pass each, Q inside the kernel. With
    ``check_finite``, ValueError for NaN/Inf in q, k or v, read once the kernels are queued.
    ``for_backward`` (FP8 scores): the K and V passes also write the backward's copies of them and keep them
    for it (``rebase.quantize_rebase_kv``'s ``keep_for``)."""
    config = tile_config(q.shape[-1], scores)
    flags = torch.zeros(2, dtype=torch.float32, device=k.device) if check_finite else None  # k, v
    exact = config["SCORES"] == "bf16"
    rebased_kv = quantize_rebase_kv(k, v, offsets_k, config["BLOCK_N"], exact=exact, nonfinite=flags,
                                    keep_for=portable_backward.preparation() if for_backward and not exact else None)
    # Q is quantized inside the kernel: its largest magnitude from a reduction of its own.
    magnitudes = torch.cat([largest_magnitudes((q,)), flags.to(torch.float64)]) if check_finite else None
    return checked_after(magnitudes, ("q", "k", "v"), lambda: forward_rebased(
        q, None, *rebased_kv, offsets_q, offsets_k, causal=causal, softmax_scale=softmax_scale,
        out_dtype=q.dtype if out_dtype is None else out_dtype, config=config))
