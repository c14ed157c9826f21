"""quantize_mxfp8: bit-exact against independent oracles, for both axes and both roundings."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from jagged_attn import MXFP8Jagged, dequantize_mxfp8, quantize_mxfp8, quantize_mxfp8_dual
from jagged_attn import quantize as quantizers
from jagged_attn.mx_format import cast_e4m3, scale_bytes
from mx_oracle import oracle_quantize, round_e4m3, scale_exponent

RAGGED = [0, 1, 31, 32, 33, 127, 128, 129]


def _offsets(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)


def _values(total, heads, dim):
    """Random values over many magnitudes (per-token and per-channel spread), never zero."""
    x = torch.randn(total, heads, dim)
    x *= torch.exp2(torch.randint(-12, 12, (total, 1, 1)).float())
    x *= torch.exp2(torch.randint(-4, 4, (1, 1, dim)).float())
    return x


@pytest.mark.parametrize("axis", ["feature", "sequence"])
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_matches_oracle_on_ragged_lengths(axis, rounding):
    lengths = [0, 1, 31, 33, 129, 0, 40]
    offsets = _offsets(lengths)
    x = _values(int(offsets[-1]), 2, 64)
    mx = quantize_mxfp8(x, offsets, axis=axis, rounding=rounding)
    data, scales = oracle_quantize(x, offsets, axis, rounding)
    assert mx.data.dtype == torch.float8_e4m3fn and mx.scales.dtype == torch.float8_e8m0fnu
    np.testing.assert_array_equal(mx.data.float().numpy(), data)
    assert torch.equal(mx.scales.view(torch.uint8), scales)


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.sampled_from(RAGGED + [200, 300]), min_size=1, max_size=5),
       axis=st.sampled_from(["feature", "sequence"]), rounding=st.sampled_from(["rceil", "floor"]))
def test_matches_oracle_property(lengths, axis, rounding):
    offsets = _offsets(lengths)
    x = _values(int(offsets[-1]), 1, 32)
    mx = quantize_mxfp8(x, offsets, axis=axis, rounding=rounding)
    data, scales = oracle_quantize(x, offsets, axis, rounding)
    np.testing.assert_array_equal(mx.data.float().numpy(), data)
    assert torch.equal(mx.scales.view(torch.uint8), scales)


def test_rceil_byte_from_amax_bits_matches_the_division():
    """The kernels' rceil byte from amax's bits alone equals the byte of ``amax / 448`` (correctly
    rounded) on every exponent at and around the mantissas where the quotient's exponent changes
    (0, 0x600000, 0x7FFFFF), across the subnormal edges, and on random mantissas (all 2^31 - 2^23
    non-negative finite floats agreed when compared once, 57 s)."""
    from jagged_attn.mx_format import rceil_scale_byte

    def byte_of_quotient(ratio_bits):  # the rule's definition: the quotient's exponent, rounded up
        e = (ratio_bits + 0x7FFFFF) >> 23
        return e - ((e + 1) >> 8)

    edges = torch.cat([torch.arange(0, 64), torch.arange(0x600000 - 64, 0x600000 + 64),
                       torch.arange(0x800000 - 64, 0x800000), torch.randint(0, 0x800000, (2048,))])
    exponents = torch.arange(0, 255)
    bits = ((exponents[:, None] << 23) + edges[None, :]).flatten()
    bits = torch.cat([bits, torch.arange(0, 4096)]).to(torch.int32)  # every small subnormal too
    amax = bits.view(torch.float32)
    by_division = byte_of_quotient((amax / torch.full_like(amax, 448.0)).view(torch.int32))
    assert torch.equal(rceil_scale_byte(bits), by_division)


def test_rceil_matches_torch_to_mxfp():
    """torch's own MX quantizer (RCEIL) agrees on normal-range inputs, data and scales."""
    from torch.testing._internal.common_quantized import to_mxfp

    x = _values(256, 4, 128)
    ref_scale, ref_data = to_mxfp(x.reshape(-1, 128).contiguous())
    mx = quantize_mxfp8(x.reshape(-1, 128))
    assert torch.equal(mx.data.view(torch.uint8), ref_data.view(torch.uint8))
    rows = mx.scale_matrix()[0, : x.shape[0] * 4]
    assert torch.equal(rows, ref_scale.view(torch.uint8).reshape(-1, 4))


def test_scale_byte_edge_cases():
    amax = torch.tensor([0.0, 448.0, 448.0 * 1.0000001, 1.0, 2.0**-140, 3.0e38, 1e-45])
    for rounding in ("rceil", "floor"):
        got = scale_bytes(amax, rounding).tolist()
        expected = [scale_exponent(float(a), rounding) for a in amax.tolist()]
        if rounding == "rceil":
            # The spec's bit formula rounds a subnormal amax/448 up to 2^-126 (byte 1), as the
            # hardware cvt.rp.ue8m0 does; exact log2 math would clamp it to byte 0. (1e-45 / 448
            # underflows to 0 in float32, so it stays at byte 0.)
            expected[4] = 1
        assert got == expected, rounding
    assert scale_bytes(torch.tensor([448.0]), "rceil").item() == 127
    assert scale_bytes(torch.tensor([449.0]), "rceil").item() == 128
    assert scale_bytes(torch.tensor([1.0]), "floor").item() == 127 - 8


def test_e4m3_cast_saturates_and_rounds_to_even():
    x = torch.tensor([500.0, -1e6, 448.0, 0.3, 17.0, 19.0, 2.0**-10, 3 * 2.0**-10])
    np.testing.assert_array_equal(cast_e4m3(x).float().numpy(), round_e4m3(x.double().numpy()))


def test_dequantize_and_error_budget():
    offsets = _offsets([5, 0, 300])
    x = torch.randn(305, 3, 128)
    for axis in ("feature", "sequence"):
        mx = quantize_mxfp8(x, offsets, axis=axis)
        deq = dequantize_mxfp8(mx)
        assert deq.dtype == torch.float32 and deq.shape == x.shape
        assert torch.equal(deq, mx.dequantize())
        rel = float((deq - x).norm() / x.norm())
        assert 5e-3 < rel < 4e-2  # e4m3 has 3 mantissa bits: ~2.6e-2 on Gaussian data


def test_two_dimensional_and_single_sequence():
    x = torch.randn(70, 96, dtype=torch.bfloat16)
    mx = quantize_mxfp8(x)
    assert mx.data.shape == (70, 96) and mx.num_heads == 1 and mx.batch_size == 1
    data, scales = oracle_quantize(x.unsqueeze(1), [0, 70], "feature", "rceil")
    np.testing.assert_array_equal(mx.data.float().numpy(), data[:, 0])
    assert torch.equal(mx.scales.view(torch.uint8), scales)


def test_sequence_blocks_never_cross_sequences():
    """A huge value in one sequence must not change the scales or data of its neighbour."""
    offsets = _offsets([20, 20])
    x = torch.randn(40, 1, 32)
    base = quantize_mxfp8(x, offsets, axis="sequence")
    x[0] *= 1e4
    bumped = quantize_mxfp8(x, offsets, axis="sequence")
    assert torch.equal(base.data[20:].view(torch.uint8), bumped.data[20:].view(torch.uint8))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(values=torch.randn(10, 2, 48)), ValueError, "multiple of 32"),
        (dict(values=torch.randn(10, 32, dtype=torch.float64)), TypeError, "values must be"),
        (dict(values=torch.randn(10)), ValueError, "values must be"),
        (dict(values=torch.full((4, 32), float("nan"))), ValueError, "NaN or Inf"),
        (dict(values=torch.randn(10, 32), offsets=torch.tensor([0, 5, 9])), ValueError, r"offsets\[-1\]"),
        (dict(values=torch.randn(10, 32), offsets=torch.tensor([1, 10])), ValueError, r"offsets\[0\]"),
        (dict(values=torch.randn(10, 32), offsets=torch.tensor([0, 6, 4, 10])), ValueError, "non-decreasing"),
        (dict(values=torch.randn(10, 32), offsets=torch.tensor([0.0, 10.0])), TypeError, "offsets must be int"),
        (dict(values=torch.randn(10, 32), offsets=torch.tensor([[0, 10]])), ValueError, "1-D"),
        (dict(values=torch.randn(10, 32), axis="tokens"), ValueError, "axis"),
        (dict(values=torch.randn(10, 32), rounding="nearest"), ValueError, "rounding"),
        (dict(values=[1.0] * 32), TypeError, "torch.Tensor"),
    ],
)
def test_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        quantize_mxfp8(**kwargs)


def test_mxfp8jagged_validates_its_fields():
    mx = quantize_mxfp8(torch.randn(50, 2, 64), torch.tensor([0, 20, 50]))
    with pytest.raises(ValueError, match="scales must have shape"):
        MXFP8Jagged(mx.data, mx.scales[:, :-1], mx.offsets, mx.axis)
    with pytest.raises(TypeError, match="data must be float8_e4m3fn"):
        MXFP8Jagged(mx.data.float(), mx.scales, mx.offsets, mx.axis)
    with pytest.raises(ValueError, match="offsets"):
        MXFP8Jagged(mx.data, mx.scales, torch.tensor([0, 20, 49]), mx.axis)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_dual_equals_two_single_axis_calls(device):
    offsets = _offsets([0, 33, 129, 5]).to(device)
    x = _values(int(offsets[-1]), 2, 64).to(device)
    for rounding in ("rceil", "floor"):
        dual = quantize_mxfp8_dual(x, offsets, rounding=rounding)
        for mx, axis in zip(dual, ("feature", "sequence")):
            single = quantize_mxfp8(x, offsets, axis=axis, rounding=rounding)
            assert mx.axis == axis and mx.rounding == rounding
            assert torch.equal(mx.data.view(torch.uint8), single.data.view(torch.uint8))
            assert torch.equal(mx.scales.view(torch.uint8), single.scales.view(torch.uint8))


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.sampled_from([0, 1, 31, 32, 33, 127, 128, 129, 300]), min_size=1, max_size=6),
       chunk_rows=st.sampled_from([1, 2, 5, 32, 33, 64, 100]),
       axis=st.sampled_from(["feature", "sequence"]), rounding=st.sampled_from(["rceil", "floor"]))
def test_chunked_eager_quantizer_is_bit_identical(lengths, chunk_rows, axis, rounding):
    """The CPU quantizers work in chunks of ``EAGER_CHUNK_VALUES`` input values (whole 32-token blocks of
    padded rows on the sequence axis), so that memory follows the chunk and not the input: any chunk
    size gives the bytes of one chunk for the whole tensor."""
    offsets = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int64)
    values = torch.randn(int(offsets[-1]), 2, 64, dtype=torch.bfloat16) * torch.rand(int(offsets[-1]), 1, 1) * 50
    whole = quantize_mxfp8(values, offsets, axis=axis, rounding=rounding)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quantizers, "EAGER_CHUNK_VALUES", chunk_rows * 2 * 64)
        chunked = quantize_mxfp8(values, offsets, axis=axis, rounding=rounding)
    assert torch.equal(chunked.data.view(torch.uint8), whole.data.view(torch.uint8))
    assert torch.equal(chunked.scales.view(torch.uint8), whole.scales.view(torch.uint8))


@pytest.mark.parametrize("axis", ["feature", "sequence"])
def test_traced_values_quantize_without_reading_them(axis):
    """Meta tensors stand in for what ``torch.compile`` traces: quantize_mxfp8 must not read values
    or offsets then (the chunked sequence quantizer once looked its chunks' token ranges up)."""
    import jagged_attn

    x, offsets = torch.randn(100, 2, 64, device="meta"), torch.tensor([0, 40, 100], device="meta")
    with jagged_attn.value_checks(False):
        mx = quantize_mxfp8(x, offsets, axis=axis)
    assert mx.data.shape == x.shape and mx.data.dtype == torch.float8_e4m3fn
