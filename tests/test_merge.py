"""merge_attention: two partial attentions over disjoint key sets merge into the attention over all keys,
values and gradients (through the differentiable LSE of jagged_attention)."""

import functools
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import jagged_attn as ja
from attention_oracle import padded_attention
from jagged_attn.metrics import cosine, relative_l2
from jagged_attn.offsets import offsets_from_lengths

RAGGED = [0, 1, 31, 32, 33, 127, 128, 129]


def split_batch(lengths_q, lengths_a, lengths_b, heads_q, heads_kv, dim, dtype=torch.float64, device="cpu"):
    """Random q, k, v and offsets where sequence b's keys are its ``lengths_a[b]`` keys of part A followed by
    its ``lengths_b[b]`` of part B; also the row indices of each part in k and their offsets."""
    lengths_k = [a + b for a, b in zip(lengths_a, lengths_b)]
    oq, ok = (offsets_from_lengths(torch.tensor(x)).to(device) for x in (lengths_q, lengths_k))
    oa, ob = (offsets_from_lengths(torch.tensor(x)).to(device) for x in (lengths_a, lengths_b))
    starts = ok[:-1].tolist()
    rows_a = torch.tensor([s + i for s, n in zip(starts, lengths_a) for i in range(n)], dtype=torch.int64)
    rows_b = torch.tensor([s + a + i for s, a, n in zip(starts, lengths_a, lengths_b) for i in range(n)],
                          dtype=torch.int64)
    q = torch.randn(sum(lengths_q), heads_q, dim, dtype=dtype, device=device)
    k = torch.randn(sum(lengths_k), heads_kv, dim, dtype=dtype, device=device)
    v = torch.randn(sum(lengths_k), heads_kv, dim, dtype=dtype, device=device)
    return q, k, v, oq, ok, rows_a.to(device), oa, rows_b.to(device), ob


def merged_and_whole(attention, q, k, v, oq, ok, rows_a, oa, rows_b, ob, causal, dout):
    """((out, lse) merged from parts A and B, their gradients) and the same of one call over all keys.
    ``attention(q, k, v, offsets_q, offsets_k, causal) -> (out, lse)``. With ``causal`` part A is the keys
    every query sees (attended without a mask) and part B the bottom-right causal rest."""
    results = []
    for merged in (True, False):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        lq, lk, lv = leaves
        if merged:
            out_a, lse_a = attention(lq, lk[rows_a], lv[rows_a], oq, oa, False)
            out_b, lse_b = attention(lq, lk[rows_b], lv[rows_b], oq, ob, causal)
            out, lse = ja.merge_attention(out_a, lse_a, out_b, lse_b)
        else:
            out, lse = attention(lq, lk, lv, oq, ok, causal)
        results.append((out, lse, torch.autograd.grad(out, leaves, dout)))
    return results


@settings(max_examples=15, deadline=None)
@given(parts=st.lists(st.tuples(*[st.sampled_from(RAGGED + [200])] * 3), min_size=1, max_size=4),
       causal=st.booleans(), group=st.sampled_from([1, 2]))
def test_merging_two_key_parts_is_one_attention_fp64(parts, causal, group):
    """Exact in fp64 (padded oracle): any split of each sequence's keys, empty parts and rows that see no key
    in either part included; causal with every query after part A (bottom-right in part B, L_b >= L_q)."""
    lengths_q = [p[0] for p in parts]
    lengths_b = [max(p[2], p[0]) if causal else p[2] for p in parts]
    batch = split_batch(lengths_q, [p[1] for p in parts], lengths_b, 2, 2 // group, 32)
    dout = torch.randn_like(batch[0])
    (out, lse, grads), (ref_out, ref_lse, ref_grads) = merged_and_whole(padded_attention, *batch, causal, dout)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=1e-9, atol=1e-9)


def test_empty_parts():
    """A part without keys for a row leaves the other part as it is (bit for bit); rows without keys in both get
    out 0, lse -inf and zero (not NaN) gradients for all four inputs."""
    out_a, out_b = (torch.randn(5, 3, 32, dtype=torch.float64) for _ in range(2))
    lse_a, lse_b = (torch.randn(5, 3, dtype=torch.float64) for _ in range(2))
    for lse_part, out_part, rows in ((lse_a, out_a, [0, 2]), (lse_b, out_b, [1, 2])):
        lse_part[rows], out_part[rows] = -math.inf, 0.0  # what attention gives where a part has no key
    for x in (out_a, lse_a, out_b, lse_b):
        x.requires_grad_(True)
    out, lse = ja.merge_attention(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out[0], out_b[0]) and torch.equal(lse[0], lse_b[0])
    assert torch.equal(out[1], out_a[1]) and torch.equal(lse[1], lse_a[1])
    assert not out[2].any() and bool(torch.isneginf(lse[2]).all())
    grads = torch.autograd.grad((out, lse), (out_a, lse_a, out_b, lse_b),
                                (torch.randn_like(out), torch.randn_like(lse)))
    assert all(torch.isfinite(g).all() for g in grads)
    assert not any(g[2].any() for g in grads)
    assert not grads[0][0].any() and not grads[1][0].any()  # part A of row 0 had no say


def test_merge_gradcheck():
    out_a, out_b = (torch.randn(4, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    lse_a, lse_b = ((3 * torch.randn(4, 2, dtype=torch.float64)).requires_grad_(True) for _ in range(2))
    assert torch.autograd.gradcheck(ja.merge_attention, (out_a, lse_a, out_b, lse_b))


def test_dtypes_and_shapes():
    out_a, out_b = (torch.randn(7, 2, 32, dtype=torch.bfloat16) for _ in range(2))
    lse_a, lse_b = (torch.randn(7, 2) for _ in range(2))
    out, lse = ja.merge_attention(out_a, lse_a, out_b, lse_b)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (7, 2)
    with pytest.raises(ValueError, match="one shape"):
        ja.merge_attention(out_a, lse_a, out_b[:6], lse_b[:6])
    with pytest.raises(ValueError, match="one shape"):
        ja.merge_attention(out_a, lse_a[..., :1], out_b, lse_b[..., :1])


def mxfp8_attention(q, k, v, offsets_q, offsets_k, causal, backend="reference"):
    """Uncentered: a key part centered on its own means would round K and V differently from the whole."""
    return ja.jagged_attention(q, k, v, offsets_q, offsets_k, causal=causal, return_lse=True, backend=backend,
                               center_kv=False)


def check_mxfp8_merge(device, backend="reference", dtype=torch.float32):
    """The public call on two key parts, merged, against one call over all keys: the LSE to rounding; O (each
    part rounds P against its own row maximum) and the gradients (dO reaches each part scaled by its weight)
    rounded on other grids, so as far from fp64 attention as the one call's (docs/DESIGN.md section 7 bars:
    1.1x its relative L2, cosine within 1e-3)."""
    attention = functools.partial(mxfp8_attention, backend=backend)
    lengths_q, lengths_a, lengths_b = [3, 0, 40, 33, 129, 1, 7], [20, 5, 0, 64, 100, 0, 0], [45, 0, 40, 64, 131, 2, 0]
    batch = split_batch(lengths_q, lengths_a, lengths_b, 4, 2, 64, dtype=torch.float32, device=device)
    q, k, v, oq, ok = batch[:5]
    dout = torch.randn_like(q)
    for causal in (False, True):
        leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
        truth_out = padded_attention(*leaves, oq, ok, causal)[0]
        truth = torch.autograd.grad(truth_out, leaves, dout.double())
        inputs = [x.to(dtype) for x in batch[:3]] + list(batch[3:])
        (out, lse, grads), (ref_out, ref_lse, ref_grads) = merged_and_whole(attention, *inputs, causal, dout.to(dtype))
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), seen)
        assert relative_l2(lse[seen], ref_lse[seen]) < 1e-5
        for name, g, ref, exact in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads),
                                       (truth_out.detach(), *truth)):
            assert torch.isfinite(g).all(), name
            assert relative_l2(g, exact) <= 1.1 * relative_l2(ref, exact), name
            assert cosine(g, exact) >= cosine(ref, exact) - 1e-3, name


def test_merging_mxfp8_attention_over_two_key_parts():
    check_mxfp8_merge("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hopper-exact-scores", "hopper", "block-scaled"])
def test_merging_mxfp8_attention_over_two_key_parts_gpu(backend):
    """As the CPU test, with the kernel backends: their backward takes the LSE's gradient."""
    check_mxfp8_merge("cuda", backend, torch.bfloat16)
