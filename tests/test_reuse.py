"""Derived tensors kept across calls (``jagged_attn/kernels/common/reuse.py``): reused only for the same, unwritten
sources; rebuilt after any write torch sees; never kept for inference tensors; dropped with their source."""

import gc

import pytest
import torch

import jagged_attn as ja
from jagged_attn.kernels.common import reuse
from jagged_attn.kernels.producers import rebase
from jagged_attn.kernels.common.schedule import tile_list, work_list
from jagged_attn.offsets import offsets_from_lengths, padded_rows_of_tokens, sequence_ids
from jagged_attn.reference import reference_forward


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernels run in the interpreter
BACKEND = "hopper" if DEVICE == "cuda" else "portable"  # the interpreter runs the portable kernels


def _offsets(lengths):
    return offsets_from_lengths(torch.tensor(lengths)).to(DEVICE)


def test_work_list_is_built_once_per_offsets_and_rebuilt_after_a_write():
    offsets_q, offsets_k = _offsets([3, 200, 0, 129]), _offsets([5, 17, 300, 1])
    first = work_list(offsets_q, offsets_k, 332, 451, 128, causal=True)
    assert work_list(offsets_q, offsets_k, 332, 451, 128, causal=True) is first
    assert work_list(offsets_q, offsets_k, 332, 451, 128, causal=False) is not first  # other params, other table
    expected_after = work_list(_offsets([200, 3, 0, 129]), offsets_k.clone(), 332, 451, 128, causal=True)
    offsets_q.copy_(_offsets([200, 3, 0, 129]))  # same object, new contents
    rebuilt = work_list(offsets_q, offsets_k, 332, 451, 128, causal=True)
    assert rebuilt is not first and torch.equal(rebuilt, expected_after)
    offsets_k[1:] += 0  # a write to the other source also counts
    assert work_list(offsets_q, offsets_k, 332, 451, 128, causal=True) is not rebuilt


def test_nothing_is_kept_for_inference_tensors_or_after_the_source_dies():
    with torch.inference_mode():
        offsets = _offsets([40, 300])
        assert tile_list(offsets, 340, 128) is not tile_list(offsets, 340, 128)
    offsets = _offsets([40, 300])
    tile_list(offsets, 340, 128)
    kept = len(reuse._kept)
    del offsets
    gc.collect()
    assert len(reuse._kept) == kept - 1


def test_derived_rebuilds_when_a_source_is_another_object_of_the_same_id():
    """The stamp compares objects, not ids: a new tensor at a recycled address is not the old one."""
    a, b = torch.zeros(3), torch.zeros(3)
    assert reuse.derived((a, b), "p", lambda: 1) == 1
    assert reuse.derived((a, b), "p", lambda: 2) == 1
    assert reuse.derived((a, torch.zeros(3)), "p", lambda: 3) == 3


def test_kept_rebase_kv_follows_in_place_writes_to_mxfp8_data():
    offsets = _offsets([0, 1, 129, 40])
    k, v = torch.randn(170, 2, 64, device=DEVICE), torch.randn(170, 2, 64, device=DEVICE)
    mk, mv = ja.quantize_mxfp8(k, offsets), ja.quantize_mxfp8(v, offsets, axis="sequence")
    first = rebase.kept_rebase_kv(mk, mv, 128)
    assert all(a is b for a, b in zip(rebase.kept_rebase_kv(mk, mv, 128), first))
    fresh_v = ja.quantize_mxfp8(torch.randn(170, 2, 64, device=DEVICE), offsets, axis="sequence")
    mv.data.copy_(fresh_v.data)
    mv.scales.copy_(fresh_v.scales)
    after = rebase.kept_rebase_kv(mk, mv, 128)
    expected = rebase.rebase_kv(mk, fresh_v, 128)
    # V^T at each token's padded column (the padding of empty slots is never written) and its exponents
    token_columns = padded_rows_of_tokens(offsets, sequence_ids(offsets, 170))
    assert torch.equal(after[2][..., token_columns].view(torch.uint8),
                       expected[2][..., token_columns].view(torch.uint8))
    assert torch.equal(after[3], expected[3])


def test_attention_on_reused_mxfp8_inputs_rebases_them_once(monkeypatch):
    """Through the public call (the torch.library op rebuilds its MXFP8Jagged operands from their tensors
    on every call): the second call on the same inputs reuses the first call's rebased K and V."""
    builds = []
    rebase_kv = rebase.rebase_kv
    monkeypatch.setattr(rebase, "rebase_kv", lambda *args, **kwargs: builds.append(1) or rebase_kv(*args, **kwargs))
    offsets = _offsets([33, 129])
    mq, mk = (ja.quantize_mxfp8(torch.randn(162, 2, 64, device=DEVICE), offsets) for _ in range(2))
    mv = ja.quantize_mxfp8(torch.randn(162, 2, 64, device=DEVICE), offsets, axis="sequence")
    first = ja.jagged_attention(mq, mk, mv, backend=BACKEND)
    assert torch.equal(ja.jagged_attention(mq, mk, mv, backend=BACKEND), first)
    assert len(builds) == 1


@pytest.mark.slow
def test_attention_on_reused_mxfp8_inputs_sees_their_in_place_updates():
    """Two calls on the same MXFP8 objects with V rewritten between them: the second output is that of
    the new V (the kept Hopper forms are rebuilt), equal to a call on freshly made objects."""
    offsets = _offsets([33, 129])
    q, k = torch.randn(162, 2, 64, device=DEVICE), torch.randn(162, 2, 64, device=DEVICE)
    mq, mk = ja.quantize_mxfp8(q, offsets), ja.quantize_mxfp8(k, offsets)
    mv = ja.quantize_mxfp8(torch.randn(162, 2, 64, device=DEVICE), offsets, axis="sequence")
    ja.jagged_attention(mq, mk, mv, backend=BACKEND)
    new_v = torch.randn(162, 2, 64, device=DEVICE)
    fresh = ja.quantize_mxfp8(new_v, offsets, axis="sequence")
    mv.data.copy_(fresh.data)
    mv.scales.copy_(fresh.scales)
    out = ja.jagged_attention(mq, mk, mv, backend=BACKEND)
    expected = ja.jagged_attention(mq, mk, fresh, backend=BACKEND)
    assert torch.equal(out, expected)
    truth, _ = reference_forward(q.double(), k.double(), new_v.double(), offsets, offsets)
    assert (out.double() - truth).norm() / truth.norm() < 0.1


def test_a_kept_value_is_taken_once_and_only_for_its_unwritten_sources():
    """``keep`` / ``take`` (the forward's copies of K and V handed to the backward): taken once for the same
    params on the same unwritten sources; nothing after a write, for other params, for other sources, or
    for inference tensors."""
    k, v = torch.randn(4, 2), torch.randn(4, 2)
    reuse.keep((k, v), "copies", "value")
    assert reuse.take((k, v), "other") is None
    assert reuse.take((v, k), "copies") is None
    assert reuse.take((k, v), "copies") == "value"
    assert reuse.take((k, v), "copies") is None  # taken: no longer kept
    reuse.keep((k, v), "copies", "value")
    v.add_(1.0)  # a write torch sees
    assert reuse.take((k, v), "copies") is None
    with torch.inference_mode():
        frozen = torch.randn(4, 2)
    reuse.keep((frozen, v), "copies", "value")
    assert reuse.take((frozen, v), "copies") is None
