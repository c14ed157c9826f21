"""The reference backend: MXFP8 attention as the spec writes it, in plain torch, on any device.

It is the oracle every kernel is tested against, so it is written for obviousness, one sequence
at a time. Inputs are the dequantized MXFP8 operands (exact float32 values); S and the softmax run
in ``compute_dtype`` (float32, or float64 for tests); P = exp2(s - rowmax) is cast to e4m3 on the
static 2^8 scale while the row sum uses the unquantized P (docs/DESIGN.md section 3, and
``_softmax_parts`` for why the row max is not rounded). ``fp8=False`` turns every
quantization off, giving exact attention (used to gradcheck the backward formulas).
"""

from __future__ import annotations

import math

import torch

from . import mx_format
from .offsets import bounded_offsets
from .quantize import quantize_mxfp8

LOG2E = 1.0 / math.log(2.0)


def visible_mask(len_q: int, len_k: int, causal: bool, device) -> torch.Tensor:
    """bool ``[len_q, len_k]``; causal is bottom-right aligned: query i sees keys j <= i + len_k - len_q."""
    if not causal:
        return torch.ones(len_q, len_k, dtype=torch.bool, device=device)
    i = torch.arange(len_q, device=device).unsqueeze(1)
    j = torch.arange(len_k, device=device).unsqueeze(0)
    return j <= i + (len_k - len_q)


def _spans(offsets_q, rows_q, offsets_k, rows_k):
    """(query rows, key rows) of each sequence, as slices; the offsets bounded by the rows first
    (``bounded_offsets``), so that offsets changed since their validation index inside the tensors."""
    oq, ok = bounded_offsets(offsets_q, rows_q).tolist(), bounded_offsets(offsets_k, rows_k).tolist()
    for b in range(len(oq) - 1):
        yield slice(oq[b], oq[b + 1]), slice(ok[b], ok[b + 1])


def expand_kv(x: torch.Tensor, heads_q: int) -> torch.Tensor:
    """``[L, Hkv, D]`` -> ``[L, Hq, D]`` by repeating each KV head over its query-head group."""
    return x.repeat_interleave(heads_q // x.shape[1], dim=1)


def reduce_kv(x: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """``[L, Hq, D]`` -> ``[L, Hkv, D]``: sum each KV head's query-head group."""
    return x.reshape(x.shape[0], heads_kv, -1, x.shape[2]).sum(2)


def _softmax_parts(q, k, mask, softmax_scale):
    """Scores in log2 units, the row max (0 where no key is visible), and unquantized P = exp2(s - max),
    exactly 1 at each row's largest score.

    That largest P is exact in e4m3, and it is what the backward's Delta = rowsum(dO * O) leans on
    where attention is peaked: there dS = P * (dP - Delta) is the small difference of two near-equal
    terms, and a rounded P_max (a row max rounded up to an integer left it anywhere in (1/2, 1], up to
    3% off) puts its rounding into O and so into Delta but not into the backward's unrounded P, an
    error that swamps that difference (dQ 25-43% off exact attention on a trained LM's layers against
    13-22% with the exact max, docs/DESIGN.md).
    A one-pass kernel rounds each key tile's P against the running max of the keys met so far, not
    this final one: the same rounding rule on a different grid, so it agrees with this definition to
    P's rounding noise, not bit for bit.
    """
    s2 = torch.einsum("qhd,khd->hqk", q, k) * (softmax_scale * LOG2E)
    s2 = s2.masked_fill(~mask, -math.inf)
    m2 = s2.amax(-1, keepdim=True)
    m2 = torch.where(torch.isfinite(m2), m2, torch.zeros_like(m2))
    return s2, m2, torch.exp2(s2 - m2)


def default_softmax_scale(head_dim: int) -> float:
    """The softmax scale when none is given: 1/sqrt(head_dim)."""
    return head_dim**-0.5


def reference_forward(
    q, k, v, offsets_q, offsets_k, *, causal=False, softmax_scale=None, compute_dtype=torch.float32, fp8=True
):
    """O and LSE of jagged attention.

    q: ``[total_q, Hq, D]``, k/v: ``[total_k, Hkv, D]`` float (already dequantized);
    returns (out ``[total_q, Hq, D]`` compute_dtype, lse ``[total_q, Hq]`` compute_dtype, natural
    log, -inf for rows that see no key; such rows get out = 0).
    """
    softmax_scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    heads_q = q.shape[1]
    out = q.new_zeros(q.shape, dtype=compute_dtype)
    lse = q.new_full(q.shape[:2], -math.inf, dtype=compute_dtype)
    for sq, sk in _spans(offsets_q, q.shape[0], offsets_k, k.shape[0]):
        qb = q[sq].to(compute_dtype)
        kb = expand_kv(k[sk], heads_q).to(compute_dtype)
        vb = expand_kv(v[sk], heads_q).to(compute_dtype)
        if qb.shape[0] == 0 or kb.shape[0] == 0:
            continue
        mask = visible_mask(qb.shape[0], kb.shape[0], causal, q.device)
        _, m2, p = _softmax_parts(qb, kb, mask, softmax_scale)
        row_sum = p.sum(-1, keepdim=True)  # [H, Lq, 1], from unquantized P
        p_used = mx_format.quantize_p(p.float()).to(compute_dtype) if fp8 else p
        # P normalized before it meets V: sum(P V) of large V overflows where O, an average of V's rows, does not
        o = torch.einsum("hqk,khd->qhd", p_used / row_sum.clamp_min(1e-30), vb)
        seen = (row_sum > 0).permute(1, 0, 2)
        out[sq] = torch.where(seen, o, torch.zeros_like(o))
        lse_b = (m2 + torch.log2(row_sum)) / LOG2E  # -inf where nothing is visible
        lse[sq] = lse_b.squeeze(-1).transpose(0, 1)
    return out, lse


def _fake_quantize(x, offsets, axis, fp8):
    """Dequantized MXFP8 copy of high-precision ``x`` along ``axis`` (or ``x`` itself when not fp8)."""
    return quantize_mxfp8(x, offsets, axis=axis).dequantize() if fp8 else x


def softmax_delta(dout, out, dlse=None, dtype=torch.float32):
    """Delta ``[total_q, Hq]`` in ``dtype``: ``rowsum(dO * O) - dLSE`` over head_dim.

    With scores s (scaled), dL/ds = P * (dP - rowsum(dO * O)) through O and dLSE * P through the LSE
    (d lse_i / d s_ij = P_ij), so a gradient of the LSE enters the backward only here. ``dlse``
    ``[total_q, Hq]`` or None (no gradient through the LSE)."""
    delta = (dout.to(dtype) * out.to(dtype)).sum(-1)
    return delta if dlse is None else delta - dlse.to(dtype)


def reference_backward(
    dout, q, k, v, out, lse, offsets_q, offsets_k, *, causal=False, softmax_scale=None,
    compute_dtype=torch.float32, fp8=True, dlse=None,
):
    """dQ, dK, dV (compute_dtype) of jagged attention, FlashAttention-2 dataflow with MXFP8 operands.

    All tensors are high precision; ``out``/``lse`` come from :func:`reference_forward`; ``dlse``
    (``[total_q, Hq]`` or None) is the gradient of the LSE (:func:`softmax_delta`). With
    ``fp8``: S is recomputed from Q, K on the feature axis; P for dV is e4m3 on the static 2^8
    scale; dV = P^T dO (dO on the sequence axis); dP = dO V^T (both on the feature axis);
    dS = P * (dP - Delta) quantized in 32x32 tiles; dQ = dS K, dK = dS^T Q (K, Q on the sequence axis).
    """
    softmax_scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    heads_q, heads_kv = q.shape[1], k.shape[1]
    q_s = _fake_quantize(q, offsets_q, "feature", fp8)
    k_s = _fake_quantize(k, offsets_k, "feature", fp8)
    q_seq = _fake_quantize(q, offsets_q, "sequence", fp8)
    k_seq = _fake_quantize(k, offsets_k, "sequence", fp8)
    v_feat = _fake_quantize(v, offsets_k, "feature", fp8)
    do_feat = _fake_quantize(dout, offsets_q, "feature", fp8)
    do_seq = _fake_quantize(dout, offsets_q, "sequence", fp8)
    delta = softmax_delta(dout, out, dlse, compute_dtype)  # [Tq, Hq]

    dq = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=compute_dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=compute_dtype, device=q.device)
    c = lambda x: x.to(compute_dtype)  # noqa: E731
    for sq, sk in _spans(offsets_q, q.shape[0], offsets_k, k.shape[0]):
        len_q, len_k = sq.stop - sq.start, sk.stop - sk.start
        if len_q == 0 or len_k == 0:
            continue
        mask = visible_mask(len_q, len_k, causal, q.device)
        s = torch.einsum("qhd,khd->hqk", c(q_s[sq]), c(expand_kv(k_s[sk], heads_q))) * softmax_scale
        lse_b = c(lse[sq]).transpose(0, 1).unsqueeze(-1)  # [H, Lq, 1]
        p = torch.where(mask & torch.isfinite(lse_b), torch.exp(s - lse_b), torch.zeros_like(s))
        p_for_dv = mx_format.quantize_p(p.float()).to(compute_dtype) if fp8 else p
        dv_b = torch.einsum("hqk,qhd->khd", p_for_dv, c(do_seq[sq]))
        dp = torch.einsum("qhd,khd->hqk", c(do_feat[sq]), c(expand_kv(v_feat[sk], heads_q)))
        ds = p * (dp - delta[sq].transpose(0, 1).unsqueeze(-1))
        if fp8:
            ds = mx_format.fake_quantize_square_tiles(ds).to(compute_dtype)
        dq[sq] = torch.einsum("hqk,khd->qhd", ds, c(expand_kv(k_seq[sk], heads_q))) * softmax_scale
        dk_b = torch.einsum("hqk,qhd->khd", ds, c(q_seq[sq])) * softmax_scale
        dk[sk] = reduce_kv(dk_b, heads_kv)
        dv[sk] = reduce_kv(dv_b, heads_kv)
    return dq, dk, dv
