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
    # Fractional or boolean lengths are refused, never truncated (from_padded took 2.7 as 2).
    for bad in ([2.7, 1.0], [True, False]):
        with pytest.raises(ValueError, match="non-negative integers"):
            JaggedTensor.from_padded(torch.randn(2, 3, 4), bad)
        with pytest.raises(ValueError, match="non-negative integers"):
            JaggedTensor.from_lengths(torch.randn(3, 4), bad)
    with pytest.raises(ValueError, match="non-negative integers"):
        JaggedTensor.from_padded(torch.randn(2, 3, 4), [1, -1])


def test_fbgemm_pipeline_dense_to_jagged_quantize_attention_back_to_padded():
    """fbgemm's dense_to_jagged -> MXFP8 -> jagged_attention on (values, [offsets]) pairs ->
    fbgemm's jagged_to_padded_dense, against the same attention on the reference path."""
    pytest.importorskip("fbgemm_gpu")
    import jagged_attn as ja
    from jagged_attn.metrics import relative_l2

    lengths = torch.tensor([3, 0, 40, 33])
    batch, max_len, heads, dim = 4, 40, 2, 64
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    dense = {name: torch.randn(batch, max_len, heads * dim) for name in "qkv"}
    jagged = {name: torch.ops.fbgemm.dense_to_jagged(x, [offsets])[0].view(-1, heads, dim)
              for name, x in dense.items()}
    q8 = ja.quantize_mxfp8(jagged["q"], offsets)
    k8 = ja.quantize_mxfp8(jagged["k"], offsets)
    v8 = ja.quantize_mxfp8(jagged["v"], offsets, axis="sequence")
    out = ja.jagged_attention(q8, k8, v8, causal=True)
    padded = torch.ops.fbgemm.jagged_to_padded_dense(out.float().flatten(1), [offsets], [max_len], 0.0)
    assert padded.shape == (batch, max_len, heads * dim)
    expected, _ = ja.jagged_attention((jagged["q"], [offsets]), (jagged["k"], [offsets]), (jagged["v"], [offsets]),
                                      causal=True, center_kv=False)  # K, V rounded as quantize_mxfp8 rounds them
    back = JaggedTensor.from_padded(padded.view(batch, max_len, heads, dim), lengths, use_fbgemm=True).values
    assert relative_l2(back, expected) < 1e-2  # bf16 output rounding only
    assert not padded[1].any() and not padded[0, 3:].any()  # padding rows stay zero


def test_offsets_from_starts():
    from jagged_attn.offsets import offsets_from_starts

    starts = torch.tensor([False, False, True, True, False, False, True])  # the first token always starts one
    assert offsets_from_starts(starts).tolist() == [0, 2, 3, 6, 7]
    assert offsets_from_starts(torch.zeros(0, dtype=torch.bool)).tolist() == [0]
