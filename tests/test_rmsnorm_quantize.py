"""Fused RMSNorm + MXFP8 quantize (jagged_attn/kernels/producers/rmsnorm_quantize.py) against torch.

The reference composition: torch's RMSNorm in fp32, rounded to x's dtype, then
``jagged_attn.quantize_mxfp8``. The MXFP8 must equal the quantization of the kernel's own normalized
output bit for bit; normalized values and ``rstd`` must match torch within rounding.
CPU: Triton's interpreter on tiny ragged batches. GPU: the same on CUDA at larger sizes.
"""

import pytest
import torch
import triton
import triton.language as tl
from jagged_attn.kernels.common import fp8
from jagged_attn.kernels.producers import quantize as qk
from jagged_attn.kernels.producers import rmsnorm_quantize as rq
from jagged_attn.kernels.common.interpreter import INTERPRETED
from compile_util import divides
from test_quantize_kernel import (
    RAGGED,
    assert_data_identical,
    assert_scales_identical,
    compile_per_tile_kernel,
    poisoned_outputs,
    ragged_offsets,
    torch_reference,
    wide_range_values,
)

from jagged_attn import mx_format, mxfp8, quantize_mxfp8
from jagged_attn.offsets import offsets_from_lengths

EPS = 1e-6
FP32_SUM_ULPS = 8  # fp32 units in the last place the kernel may differ from torch by (order of the sum of squares)
ROUNDED_OTHERWISE = 1e-3  # bound on the fraction of bf16/fp16 values that round differently from torch's


def random_inputs(lengths, heads, dim, dtype, device="cpu", offsets_dtype=torch.int64):
    """(x, weight, offsets): x with a scale varying per token and per channel (bf16/fp32 over 2^+-24
    and 2^+-12; fp16 over a range it can hold), weight of either sign around 1."""
    offsets = ragged_offsets(lengths, offsets_dtype, device)
    total = int(offsets[-1])
    if dtype == torch.float16:
        x = (torch.randn(total, heads, dim, device=device) * 4).to(dtype)
    else:
        x = wide_range_values(total, heads, dim, dtype, device)
    weight = (torch.randn(dim, device=device) * 0.5 + 1).to(dtype)
    return x, weight, offsets


def torch_rms_norm(x, weight):
    """(normalized in x's dtype, rstd fp32 [total, H]): torch's RMSNorm computed in fp32."""
    normalized = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), EPS).to(x.dtype)
    rstd = torch.rsqrt(x.double().pow(2).mean(-1) + EPS).float()
    return normalized, rstd


def run_poisoned(x, weight, offsets, axes, rounding, store_normalized=True, config=None):
    """The kernel on outputs filled with NaN first: (mx outputs, normalized, rstd)."""
    outputs = poisoned_outputs(x, offsets, axes)
    normalized = torch.full_like(x, float("nan")) if store_normalized else None
    rstd = torch.full(x.shape[:2], float("nan"), device=x.device)
    rq.rms_norm_quantize_into(x, weight, offsets, outputs, normalized, rstd, eps=EPS, rounding=rounding,
                              config=config)
    return outputs, normalized, rstd


def assert_within_rounding(got, want):
    """Equal up to one unit in the last place of the dtype, plus fp32 summation differences; in
    bf16/fp16 the same value almost everywhere (only a value within a few fp32 units of a rounding
    boundary may round the other way)."""
    rtol = torch.finfo(want.dtype).eps + FP32_SUM_ULPS * torch.finfo(torch.float32).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=0)
    if want.dtype != torch.float32:
        assert (got != want).float().mean() < ROUNDED_OTHERWISE


def check_against_torch(x, weight, offsets, axes, rounding, config=None):
    outputs, normalized, rstd = run_poisoned(x, weight, offsets, axes, rounding, config=config)
    expected_normalized, expected_rstd = torch_rms_norm(x, weight)
    assert_within_rounding(normalized, expected_normalized)
    assert_within_rounding(rstd, expected_rstd)
    for axis in axes:
        expected_data, expected_scales = torch_reference(normalized, offsets, axis, rounding)
        assert_data_identical(outputs[axis][0], expected_data)
        assert_scales_identical(outputs[axis][1], expected_scales)
        ours = mxfp8.MXFP8Jagged(outputs[axis][0], outputs[axis][1].view(torch.float8_e8m0fnu), offsets, axis,
                                 rounding)
        assert_composition_agrees(ours, quantize_mxfp8(expected_normalized, offsets, axis=axis, rounding=rounding),
                                  normalized == expected_normalized)


def assert_composition_agrees(ours, composed, same_input):
    """The fused MXFP8 ``ours`` equals ``composed`` (torch's RMSNorm, then the quantizer) at every element
    whose normalized value and block scale both agree (``same_input``: the normalized values equal), and
    nearly everywhere: an element may differ only where its own normalized value rounded otherwise or its
    block's scale moved with one that did, so at most a block's elements for each of the rare values
    ``assert_within_rounding`` lets round otherwise. (An error norm would not do: the inputs span 2^+-24,
    so one element that rounds otherwise can carry a visible share of the norm.)"""
    got, want = ours.dequantize(), composed.dequantize()
    agree = same_input & (mxfp8.element_scale_bytes(ours) == mxfp8.element_scale_bytes(composed))
    assert torch.equal(got[agree], want[agree])
    assert (got != want).float().mean() <= mx_format.BLOCK_SIZE * ROUNDED_OTHERWISE


@pytest.mark.parametrize("rounding", mx_format.ROUNDINGS)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads", [1, 3])
def test_both_axes_match_reference(rounding, dim, heads):
    x, weight, offsets = random_inputs(RAGGED, heads, dim, torch.bfloat16)
    check_against_torch(x, weight, offsets, mxfp8.AXES, rounding)


@pytest.mark.parametrize("axis", mxfp8.AXES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_one_axis_other_dtypes(axis, dtype):
    x, weight, offsets = random_inputs([129, 0, 33, 1, 64], 2, 96, dtype, offsets_dtype=torch.int32)
    check_against_torch(x, weight, offsets, (axis,), "rceil")


@pytest.mark.parametrize("config", rq.CONFIGS.values(), ids=rq.CONFIGS)
def test_every_config_matches_reference(config):
    """Each layout places the tokens of its 32-token blocks differently in the tile (BLOCK_ROWS)."""
    x, weight, offsets = random_inputs(RAGGED, 1, 64, torch.bfloat16)
    check_against_torch(x, weight, offsets, mxfp8.AXES, "rceil", config)


def test_the_default_config_is_a_listed_one():
    assert rq.DEFAULT_CONFIG in rq.CONFIGS.values()


def test_configs_that_split_channels_are_refused():
    x, weight, offsets = random_inputs([40], 1, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="all D channels"):
        run_poisoned(x, weight, offsets, ("sequence",), "rceil", config=qk.CONFIGS["c64-4w-v8"])


def test_public_call_returns_mx_normalized_and_rstd():
    x, weight, offsets = random_inputs([40, 0, 7, 130], 2, 64, torch.bfloat16)
    mx, normalized, rstd = rq.rms_norm_quantize(x, weight, offsets, axes=("sequence", "feature"), eps=EPS)
    assert list(mx) == ["sequence", "feature"]
    assert normalized.dtype == x.dtype and normalized.shape == x.shape
    assert rstd.dtype == torch.float32 and rstd.shape == x.shape[:2]
    for axis, got in mx.items():
        expected = quantize_mxfp8(normalized, offsets, axis=axis)
        assert (got.axis, got.rounding, got.offsets) == (axis, "rceil", offsets)
        assert_data_identical(got.data, expected.data)
        assert_scales_identical(got.scales.view(torch.uint8), expected.scales.view(torch.uint8))
    mx_only, none, rstd_again = rq.rms_norm_quantize(x, weight, offsets, eps=EPS, return_normalized=False)
    assert none is None and list(mx_only) == ["feature"]
    assert torch.equal(rstd_again, rstd)
    assert_data_identical(mx_only["feature"].data, mx["feature"].data)


def test_without_normalized_output_the_rest_is_unchanged():
    x, weight, offsets = random_inputs([50, 129], 1, 32, torch.bfloat16)
    with_normalized = run_poisoned(x, weight, offsets, mxfp8.AXES, "floor")
    without = run_poisoned(x, weight, offsets, mxfp8.AXES, "floor", store_normalized=False)
    assert without[1] is None
    assert torch.equal(with_normalized[2], without[2])
    for axis in mxfp8.AXES:
        assert_data_identical(without[0][axis][0], with_normalized[0][axis][0])
        assert_scales_identical(without[0][axis][1], with_normalized[0][axis][1])


@triton.jit
def _rounded_to_kernel(values, rounded, N: tl.constexpr, INTERPRET: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(rounded + i, fp8.rounded_to(tl.load(values + i), tl.bfloat16, INTERPRET))


def test_bf16_rounding_is_to_nearest_even():
    """Ties, just past ties, subnormals and overflow to infinity round as torch's cast does."""
    bits = torch.randint(-(2**31), 2**31 - 1, (4096,), dtype=torch.int64)
    bits[:1024] = (bits[:1024] & ~0xFFFF) | 0x8000  # exact ties
    bits[1024:2048] = (bits[1024:2048] & ~0xFFFF) | torch.randint(0x7FFF, 0x8002, (1024,))
    values = bits.to(torch.int32).view(torch.float32)
    values[:8] = torch.tensor([3.3e38, -3.39e38, 2.0**-130, -(2.0**-135) * 3, 0.0, 1.0, 1 + 2**-8, 1 + 3 * 2**-8])
    values[~torch.isfinite(values)] = 1.0  # NaN payloads are not rounded alike
    rounded = torch.full_like(values, float("nan"))
    _rounded_to_kernel[(1,)](values, rounded, N=values.numel(), INTERPRET=INTERPRETED)
    assert torch.equal(rounded, values.to(torch.bfloat16).float())


@pytest.mark.parametrize("lengths", [[], [0], [0, 0, 0]])
def test_no_tokens(lengths):
    offsets = offsets_from_lengths(torch.tensor(lengths, dtype=torch.int64))
    x = torch.randn(0, 2, 64, dtype=torch.bfloat16)
    mx, normalized, rstd = rq.rms_norm_quantize(x, torch.ones(64), offsets, axes=mxfp8.AXES)
    assert normalized.shape == (0, 2, 64) and rstd.shape == (0, 2)
    for axis in mxfp8.AXES:
        expected = quantize_mxfp8(x, offsets, axis=axis).scales
        assert torch.equal(mx[axis].scales.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.filterwarnings("ignore:All-NaN slice", "ignore:invalid value")  # numpy, inside the interpreter
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_input_raises(bad):
    x, weight, offsets = random_inputs([50, 90], 2, 32, torch.bfloat16)
    x[int(torch.randint(0, 140, ())), 1, 5] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        rq.rms_norm_quantize(x, weight, offsets)
    flag = torch.zeros(1)
    rq.rms_norm_quantize(x, weight, offsets, nonfinite=flag)  # flagged for the caller, no raise
    assert not bool(torch.isfinite(flag).all())


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"weight": torch.ones(32)}, ValueError, r"weight must have shape \(64,\)"),
        ({"weight": torch.ones(1, 64)}, ValueError, "weight must have shape"),
        ({"weight": torch.ones(64, dtype=torch.int32)}, TypeError, "weight must be float32"),
        ({"weight": [1.0] * 64}, TypeError, "weight must be a torch.Tensor"),
        ({"x": torch.randn(10, 2, 48), "weight": torch.ones(48)}, ValueError, "multiple of 32"),
        ({"x": torch.randn(10, 64)}, ValueError, r"x must be \[total, heads, D\]"),
        ({"x": torch.randint(0, 9, (10, 2, 64))}, TypeError, "x must be float32"),
        ({"offsets": torch.tensor([0, 4, 9])}, ValueError, r"offsets\[-1\]"),
        ({"offsets": torch.tensor([0, 4, 10], dtype=torch.float32)}, TypeError, "offsets must be int32"),
        ({"axes": ()}, ValueError, "axes"),
        ({"axes": ("feature", "feature")}, ValueError, "axes"),
        ({"rounding": "nearest"}, ValueError, "rounding"),
    ],
)
def test_bad_inputs_raise(change, error, match):
    arguments = {"x": torch.randn(10, 2, 64), "weight": torch.ones(64), "offsets": torch.tensor([0, 4, 10])}
    arguments.update(change)
    with pytest.raises(error, match=match):
        rq.rms_norm_quantize(**arguments)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setattr(rq.quantize, "INTERPRETED", False)  # the producers' one input check
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        rq.rms_norm_quantize(torch.randn(4, 1, 32), torch.ones(32), torch.tensor([0, 4]))


LEADING = {"values": "*bf16", "weight": "*bf16", "normalized": "*bf16", "rstd": "*fp32", "eps": "fp32"}


@pytest.mark.parametrize("config", rq.CONFIGS.values(), ids=rq.CONFIGS)
def test_compiles_for_sm90(config):
    ptx = compile_per_tile_kernel(
        "jagged_attn.kernels.producers.rmsnorm_quantize", "_rms_norm_quantize_kernel", LEADING, config,
        STORE_NORMALIZED=True,
    )
    assert "rsqrt.approx" in ptx  # rstd as the docstring states
    assert "cvt.rn.bf16" in ptx  # the normalized values rounded to nearest before quantizing
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert not divides(ptx)
    # Nothing else flushes subnormals: rsqrt's input is at least eps.
    assert ptx.count(".ftz") == ptx.count("rsqrt.approx.ftz.f32")
    assert "ld.global.v4" in ptx and "st.global.v2" in ptx  # 8 channels per thread: 16-byte bf16, 8-byte e4m3


def test_warp_local_layout_exchanges_only_the_per_row_values():
    """With one 32-token block per warp (4 warps) the sequence-axis maxima and the rstd sum stay
    inside warps: the barriers left are the weight's (1), the scale bytes' (2) and rstd's (2)."""
    config = rq.CONFIGS["all-4w-v8"]
    ptx = compile_per_tile_kernel(
        "jagged_attn.kernels.producers.rmsnorm_quantize", "_rms_norm_quantize_kernel", LEADING, config,
        STORE_NORMALIZED=True, FEATURE=False, CHECK_FINITE=False,
    )
    assert ptx.count("bar.sync") == 5


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("rounding", mx_format.ROUNDINGS)
@pytest.mark.parametrize("dim, heads", [(128, 4), (64, 3)])
def test_gpu_matches_torch(rounding, dim, heads):
    lengths = RAGGED + torch.randint(1, 3000, (40,)).tolist()
    x, weight, offsets = random_inputs(lengths, heads, dim, torch.bfloat16, "cuda", torch.int32)
    for config in rq.CONFIGS.values():
        check_against_torch(x, weight, offsets, mxfp8.AXES, rounding, config)
    check_against_torch(x, weight, offsets, ("sequence",), rounding)  # the default layout of one axis
    mx, normalized, _ = rq.rms_norm_quantize(x, weight, offsets, axes=mxfp8.AXES, rounding=rounding, eps=EPS)
    for axis in mxfp8.AXES:
        dispatched = quantize_mxfp8(normalized, offsets, axis=axis, rounding=rounding)  # the quantize kernel
        assert_data_identical(mx[axis].data, dispatched.data)
        assert_scales_identical(mx[axis].scales.view(torch.uint8), dispatched.scales.view(torch.uint8))
    x[7, 1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        rq.rms_norm_quantize(x, weight, offsets)
