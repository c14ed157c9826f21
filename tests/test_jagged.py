"""JaggedTensor: padded, nested and fbgemm round trips, fp8 payloads, bad input."""

import pytest
import torch

from jagged_attn import JaggedTensor, quantize_mxfp8

LENGTHS = [0, 1, 31, 32, 33, 127, 128, 129, 0]


def _batch(dtype=torch.float32, heads=2, dim=32):
    lengths = torch.tensor(LENGTHS)
    values = torch.randn(int(lengths.sum()), heads, dim).to(dtype)
    return JaggedTensor.from_lengths(values, lengths), lengths


def test_properties():
    jt, lengths = _batch()
    assert jt.batch_size == len(LENGTHS) and jt.max_length == 129
    assert torch.equal(jt.lengths, lengths) and jt.feature_shape == (2, 32)
    assert "batch_size=9" in repr(jt)


@pytest.mark.parametrize("use_fbgemm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_padded_round_trip(use_fbgemm, dtype):
    if use_fbgemm:
        pytest.importorskip("fbgemm_gpu")
    jt, lengths = _batch(dtype)
    dense = jt.to_padded(use_fbgemm=use_fbgemm)
    assert dense.shape == (len(LENGTHS), 129, 2, 32) and dense.dtype == dtype
    for b, (start, n) in enumerate(zip(jt.offsets[:-1].tolist(), lengths.tolist())):
        assert torch.equal(dense[b, :n].view(torch.uint8), jt.values[start:start + n].view(torch.uint8))
        assert not dense[b, n:].view(torch.uint8).any()  # zero padding
    back = JaggedTensor.from_padded(dense, lengths, use_fbgemm=use_fbgemm)
    assert torch.equal(back.values.view(torch.uint8), jt.values.view(torch.uint8))
    assert torch.equal(back.offsets, jt.offsets)


def test_padded_value_and_truncation():
    jt, _ = _batch()
    dense = jt.to_padded(padding_value=-7.0, max_length=40)
    assert dense.shape[1] == 40 and bool((dense[1, 1:] == -7.0).all())
    with pytest.raises(ValueError, match="padding_value must be 0"):
        JaggedTensor(jt.values.to(torch.float8_e4m3fn), jt.offsets).to_padded(padding_value=1.0)


def test_nested_round_trip():
    jt, lengths = _batch()
    njt = jt.to_nested()
    assert njt.is_nested and njt.size(0) == len(LENGTHS)
    assert torch.equal(njt.offsets(), jt.offsets)
    back = JaggedTensor.from_nested(njt)
    assert torch.equal(back.values, jt.values) and torch.equal(back.lengths, lengths)
    with pytest.raises(TypeError, match="nested tensor"):
        JaggedTensor.from_nested(torch.randn(3, 4))


def test_mxfp8_payload_through_fbgemm_is_bit_exact():
    pytest.importorskip("fbgemm_gpu")
    jt, lengths = _batch(heads=1, dim=64)
    mx = quantize_mxfp8(jt.values, jt.offsets)
    dense = JaggedTensor(mx.data, mx.offsets).to_padded(use_fbgemm=True)
    back = JaggedTensor.from_padded(dense, lengths, use_fbgemm=True)
    assert torch.equal(back.values.view(torch.uint8), mx.data.view(torch.uint8))


def test_bad_input():
    with pytest.raises(ValueError, match=r"offsets\[-1\]"):
        JaggedTensor(torch.randn(5, 4), torch.tensor([0, 2, 4]))
    with pytest.raises(TypeError, match="int32 or int64"):
        JaggedTensor(torch.randn(5, 4), torch.tensor([0.0, 5.0]))
    with pytest.raises(ValueError, match="non-negative"):
        JaggedTensor.from_lengths(torch.randn(5, 4), [6, -1])
    with pytest.raises(ValueError, match="lengths must lie"):
        JaggedTensor.from_padded(torch.randn(2, 3, 4), [1, 4])
    with pytest.raises(ValueError, match="lengths must have shape"):
        JaggedTensor.from_padded(torch.randn(2, 3, 4), [1, 2, 3])
