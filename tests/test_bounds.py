"""The kernels' causal bounds (``jagged_attn/kernels/common/bounds.py``) against the reference backend's mask, the
spec's rule stated in torch on its own: every question the kernels ask of the diagonal has the answer
the mask gives, on ragged, cross (either side longer) and empty lengths."""

import torch
import triton
import triton.language as tl
from hypothesis import given, settings, strategies as st

from jagged_attn.kernels.common import bounds
from jagged_attn.reference import visible_mask

BLOCK = 64  # queries and keys per test: lengths below it


@triton.jit
def _bounds_kernel(sees, last_key, keys_below, first_query, first_all, first_all_open, len_q, len_k,
                   BLOCK: tl.constexpr):
    index = tl.arange(0, BLOCK)
    diagonal = bounds.diagonal(len_q, len_k)
    tile = index[:, None] * BLOCK + index[None, :]
    tl.store(sees + tile, bounds.sees(index[:, None], index[None, :], diagonal).to(tl.int8))
    tl.store(last_key + index, bounds.last_key_seen(index, len_k, diagonal))
    tl.store(keys_below + index, bounds.keys_seen_below(index, len_k, diagonal))
    tl.store(first_query + index, bounds.first_query_seeing(index, diagonal))
    # keys [0, index + 1): causal, and with every query seeing every key (diagonal len_k)
    tl.store(first_all + index, bounds.first_query_seeing_all(index + 1, len_k, len_q, diagonal))
    tl.store(first_all_open + index, bounds.first_query_seeing_all(index + 1, len_k, len_q, len_k))


LENGTHS = st.sampled_from([0, 1, 31, 32, 33, BLOCK - 1]) | st.integers(0, BLOCK - 1)


@settings(deadline=None, max_examples=30)
@given(len_q=LENGTHS, len_k=LENGTHS)
def test_causal_bounds_answer_as_the_reference_mask(len_q, len_k):
    sees = torch.zeros(BLOCK, BLOCK, dtype=torch.int8)
    last_key, keys_below, first_query, first_all, first_all_open = (
        torch.full((BLOCK,), -7, dtype=torch.int32) for _ in range(5))
    _bounds_kernel[(1,)](sees, last_key, keys_below, first_query, first_all, first_all_open, len_q, len_k,
                         BLOCK=BLOCK)
    mask = visible_mask(len_q, len_k, True, "cpu")
    assert torch.equal(sees[:len_q, :len_k].bool(), mask)
    for i in range(len_q):
        seen = mask[i].nonzero().flatten()
        if seen.numel():
            assert int(last_key[i]) == int(seen.max()), i
        else:
            assert int(last_key[i]) < 0, i
        # what queries [0, i] see together: a prefix of the keys, keys_seen_below(i + 1) long
        union = mask[: i + 1].any(0)
        assert int(keys_below[i + 1]) == int(union.sum()), i
        assert bool(union[: int(union.sum())].all()), i
    for j in range(len_k if len_q else 0):  # the last query sees every key, so each has a first one
        assert bool(mask[:, j].any()) and int(first_query[j]) == int(mask[:, j].int().argmax()), j
    # first_query_seeing_all: the first query from which every query up to len_q sees keys [0, key_end)
    # (len_q where the keys run past len_k); without the causal mask, 0 unless they do
    for key_end in range(1, BLOCK + 1):
        if key_end > len_k:
            expected = len_q
        else:
            sees_all = [bool(mask[i:, :key_end].all()) for i in range(len_q)] + [True]
            expected = sees_all.index(True)
        assert int(first_all[key_end - 1]) == expected, key_end
        assert int(first_all_open[key_end - 1]) == (len_q if key_end > len_k else 0), key_end
