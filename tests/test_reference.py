"""The reference backend against fp64 attention on padded dense inputs, forward and backward."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from attention_oracle import padded_attention, sdpa_matches
from jagged_attn.metrics import cosine, least_squares_factor, relative_l2
from jagged_attn.offsets import offsets_from_lengths
from jagged_attn.quantize import quantize_mxfp8
from jagged_attn.reference import reference_backward, reference_forward

F64 = torch.float64
RAGGED = [0, 1, 31, 32, 33, 127, 128, 129]


def _inputs(lengths_q, lengths_k, heads_q, heads_kv, dim, dtype=F64):
    oq, ok = offsets_from_lengths(torch.tensor(lengths_q)), offsets_from_lengths(torch.tensor(lengths_k))
    q = torch.randn(int(oq[-1]), heads_q, dim, dtype=dtype)
    k = torch.randn(int(ok[-1]), heads_kv, dim, dtype=dtype)
    v = torch.randn(int(ok[-1]), heads_kv, dim, dtype=dtype)
    return q, k, v, oq, ok


def _check_exact(lengths_q, lengths_k, heads_q, heads_kv, dim, causal, scale=None, lse_gradient=False):
    """fp8=False in fp64 is exact attention: it must match the padded oracle to rounding, fwd + bwd;
    with ``lse_gradient`` the loss takes the LSE in as well (``dlse``, random on every row, also where
    the LSE is -inf: those rows have no gradient to give)."""
    q, k, v, oq, ok = _inputs(lengths_q, lengths_k, heads_q, heads_kv, dim)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref_out, ref_lse = padded_attention(*leaves, oq, ok, causal, scale)
    out, lse = reference_forward(q, k, v, oq, ok, causal=causal, softmax_scale=scale, compute_dtype=F64, fp8=False)
    torch.testing.assert_close(out, ref_out.detach(), rtol=1e-10, atol=1e-10)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    seen = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[seen], ref_lse.detach()[seen], rtol=1e-10, atol=1e-10)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if lse_gradient else None
    outputs, grad_outputs = ((ref_out, ref_lse), (dout, dlse)) if lse_gradient else ((ref_out,), (dout,))
    grads = torch.autograd.grad(outputs, leaves, grad_outputs, allow_unused=True)
    mine = reference_backward(dout, q, k, v, out, lse, oq, ok, causal=causal, softmax_scale=scale,
                              compute_dtype=F64, fp8=False, dlse=dlse)
    for g_ref, g in zip(grads, mine):
        torch.testing.assert_close(g, torch.zeros_like(g) if g_ref is None else g_ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dim", [64, 128])
def test_exact_self_attention_ragged(causal, dim):
    _check_exact(RAGGED, RAGGED, 2, 2, dim, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_exact_cross_attention_gqa(causal):
    # L_q < L_k, L_q > L_k, empty on either side
    _check_exact([5, 40, 0, 33, 129, 7], [60, 3, 9, 0, 31, 7], 4, 2, 64, causal, scale=0.3)


def test_exact_long_sequence():
    _check_exact([2000], [2000], 1, 1, 64, True)


@settings(max_examples=12, deadline=None)
@given(pairs=st.lists(st.tuples(st.sampled_from(RAGGED + [200]), st.sampled_from(RAGGED + [200])), min_size=1,
                      max_size=4), causal=st.booleans(), group=st.sampled_from([1, 2, 4]), lse_gradient=st.booleans())
def test_exact_property(pairs, causal, group, lse_gradient):
    _check_exact([p[0] for p in pairs], [p[1] for p in pairs], 4, 4 // group, 32, causal, lse_gradient=lse_gradient)


@pytest.mark.parametrize("causal", [False, True])
def test_exact_lse_gradient(causal):
    """d lse_i / d s_ij = P_ij: the LSE's gradient (alone, and with O's) enters through Delta; exact in
    fp64 against autograd of the padded oracle, with L_q > L_k (rows that see no key), GQA, a softmax scale."""
    _check_exact([5, 40, 0, 33, 129, 7], [60, 3, 9, 0, 31, 7], 4, 2, 64, causal, scale=0.3, lse_gradient=True)


def test_lse_gradient_alone_is_the_softmax_weighted_key_sum():
    """With dO = 0 and dLSE = 1 on one row: dQ_i = scale * sum_j P_ij k_j, dK_j = scale * P_ij q_i, dV = 0."""
    q, k, v, oq, ok = _inputs([3], [20], 1, 1, 32)
    out, lse = reference_forward(q, k, v, oq, ok, softmax_scale=0.5, compute_dtype=F64, fp8=False)
    dlse = torch.zeros_like(lse)
    dlse[1] = 1.0
    dq, dk, dv = reference_backward(torch.zeros_like(out), q, k, v, out, lse, oq, ok, softmax_scale=0.5,
                                    compute_dtype=F64, fp8=False, dlse=dlse)
    p = torch.softmax(0.5 * k[:, 0] @ q[1, 0], 0)
    torch.testing.assert_close(dq[1, 0], 0.5 * p @ k[:, 0], rtol=1e-12, atol=1e-12)
    assert not dq[[0, 2]].any() and not dv.any()
    torch.testing.assert_close(dk[:, 0], 0.5 * p[:, None] * q[1, 0], rtol=1e-12, atol=1e-12)


def test_padded_oracle_agrees_with_sdpa():
    q, k, v, oq, ok = _inputs([50], [70], 2, 2, 32)
    for causal in (False, True):
        out, _ = padded_attention(q, k, v, oq, ok, causal)
        torch.testing.assert_close(out, sdpa_matches(q, k, v, causal))


def test_rows_that_see_no_key():
    """Causal with L_q > L_k: the first L_q - L_k queries see nothing -> 0 and LSE -inf."""
    q, k, v, oq, ok = _inputs([10], [4], 1, 1, 32)
    out, lse = reference_forward(q, k, v, oq, ok, causal=True, compute_dtype=F64)
    assert bool((out[:6] == 0).all()) and bool(torch.isneginf(lse[:6]).all())
    assert bool(torch.isfinite(lse[6:]).all())


@pytest.mark.parametrize("causal", [False, True])
def test_mxfp8_forward_accuracy_vs_fp64(causal):
    """Spec emulation: close to fp64 on the unquantized inputs, as docs/DESIGN.md section 7 measured."""
    q, k, v, oq, ok = _inputs([300, 129, 0, 700], [300, 64, 5, 700], 4, 2, 128, dtype=torch.float32)
    ref, _ = padded_attention(q.double(), k.double(), v.double(), oq, ok, causal)
    qd = quantize_mxfp8(q, oq).dequantize()
    kd = quantize_mxfp8(k, ok).dequantize()
    vd = quantize_mxfp8(v, ok, axis="sequence").dequantize()
    out, _ = reference_forward(qd, kd, vd, oq, ok, causal=causal)
    assert 5e-3 < relative_l2(out, ref) < 8e-2
    assert cosine(out, ref) > 0.996


def test_p_quantization_matters_but_is_small():
    """Only P quantized (exact inputs): error is small but present, so the FP8 P path is exercised."""
    q, k, v, oq, ok = _inputs([257], [257], 2, 2, 64)
    exact, _ = reference_forward(q, k, v, oq, ok, compute_dtype=F64, fp8=False)
    with_p, lse = reference_forward(q, k, v, oq, ok, compute_dtype=F64, fp8=True)
    err = relative_l2(with_p, exact)
    assert 1e-4 < err < 3e-2
    ref_lse = reference_forward(q, k, v, oq, ok, compute_dtype=F64, fp8=False)[1]
    torch.testing.assert_close(lse, ref_lse)  # the row sum uses unquantized P


@pytest.mark.parametrize("causal", [False, True])
def test_mxfp8_gradients_vs_autograd_of_dequantized_fp64(causal):
    """The quantized backward stays close to the exact gradient of the dequantized computation."""
    q, k, v, oq, ok = _inputs([200, 33, 1, 400], [150, 90, 1, 400], 4, 2, 64, dtype=torch.float32)
    qd = quantize_mxfp8(q, oq).dequantize().double().requires_grad_(True)
    kd = quantize_mxfp8(k, ok).dequantize().double().requires_grad_(True)
    vd = quantize_mxfp8(v, ok, axis="sequence").dequantize().double().requires_grad_(True)
    ref_out, _ = padded_attention(qd, kd, vd, oq, ok, causal)
    dout = torch.randn(ref_out.shape, dtype=torch.float32)
    grads_ref = torch.autograd.grad(ref_out, (qd, kd, vd), dout.double())
    out, lse = reference_forward(qd.detach().float(), kd.detach().float(), vd.detach().float(), oq, ok, causal=causal)
    grads = reference_backward(dout, q, k, v, out, lse, oq, ok, causal=causal)
    for g, g_ref in zip(grads, grads_ref):
        assert torch.isfinite(g).all()
        assert relative_l2(g, g_ref) < 0.12
        assert cosine(g, g_ref) > 0.99


def test_softmax_scale_is_used():
    q, k, v, oq, ok = _inputs([40], [40], 1, 1, 32)
    a, _ = reference_forward(q, k, v, oq, ok, softmax_scale=0.01, compute_dtype=F64, fp8=False)
    b, _ = reference_forward(q, k, v, oq, ok, softmax_scale=1 / math.sqrt(32), compute_dtype=F64, fp8=False)
    assert relative_l2(a, b) > 1e-2


def test_least_squares_factor_sees_a_shrink_that_relative_l2_barely_does():
    ref = torch.randn(4096, dtype=torch.float64)
    noise = 0.03 * torch.randn(4096, dtype=torch.float64)
    assert least_squares_factor(ref, ref) == 1.0
    shrunk = 0.99 * ref + noise
    assert abs(least_squares_factor(shrunk, ref) - 0.99) < 2e-3
    assert abs(relative_l2(shrunk, ref) - relative_l2(ref + noise, ref)) < 3e-3
