"""The fused jagged MXFP8 quantizer (jagged_attn/kernels/producers/quantize.py) against the torch reference, bit for
bit.

CPU: Triton's interpreter on tiny ragged batches. GPU: the same on CUDA, then bandwidth against a
device-to-device copy of the same input.
"""

import pytest
import torch
import triton
import triton.language as tl
from compile_util import compile_ptx, divides
from jagged_attn.kernels.common import layout
from jagged_attn.kernels.producers import quantize as qk
from jagged_attn.kernels.common.interpreter import INTERPRETED

from jagged_attn import mx_format, mxfp8, quantize_mxfp8
from jagged_attn import quantize as quantizers
from jagged_attn.offsets import offsets_from_lengths

RAGGED = [0, 1, 31, 32, 33, 127, 128, 129, 300]
E4M3_NAN = 0x7F
POISON_SCALE = 0xFF  # a NaN scale byte: the kernel writes every byte, padding included
SIGN = 0x80


def ragged_offsets(lengths, dtype=torch.int64, device="cpu"):
    order = torch.randperm(len(lengths)).tolist()
    return offsets_from_lengths(torch.tensor([lengths[i] for i in order])).to(dtype=dtype, device=device)


def wide_range_values(total, heads, dim, dtype, device="cpu"):
    """Gaussian values whose scale varies over 2^+-24 per token and 2^+-12 per channel."""
    per_token = torch.randint(-24, 25, (total, heads, 1), device=device).to(torch.float32).exp2()
    per_channel = torch.randint(-12, 13, (1, heads, dim), device=device).to(torch.float32).exp2()
    return (torch.randn(total, heads, dim, device=device) * per_token * per_channel).to(dtype)


def poisoned_outputs(values, offsets, axes):
    outputs = {axis: qk.empty_outputs(values, offsets, axis) for axis in axes}
    for data, scales in outputs.values():
        data.view(torch.uint8).fill_(E4M3_NAN)
        scales.fill_(POISON_SCALE)
    return outputs


def torch_reference(values, offsets, axis, rounding):
    """(e4m3 data, uint8 tiled scales) from the torch path of ``quantize_mxfp8`` (the only one on CPU;
    on CUDA ``quantize_mxfp8`` runs the kernel under test), on the values' device."""
    quantize = quantizers._quantize_feature if axis == "feature" else quantizers._quantize_sequence
    return quantize(values, offsets, rounding, False)


def assert_data_identical(data, expected):
    got, want = data.view(torch.uint8), expected.view(torch.uint8)
    if INTERPRETED:  # the interpreter's e4m3 rounding may lose the sign of a zero (jagged_attn/kernels/common/fp8.py)
        zero = (got & ~SIGN) == 0
        got = torch.where(zero & ((want & ~SIGN) == 0), want, got)
    mismatches = (got != want).nonzero()
    assert mismatches.numel() == 0, (
        f"{mismatches.shape[0]} data bytes differ, first at {mismatches[:4].tolist()}: "
        f"got {got[tuple(mismatches[0])].item():#x}, want {want[tuple(mismatches[0])].item():#x}"
    )


def assert_scales_identical(scales, expected):
    mismatches = (scales != expected).nonzero()
    assert mismatches.numel() == 0, (
        f"{mismatches.shape[0]} scale bytes differ, first at {mismatches[:4].tolist()}: "
        f"got {scales[tuple(mismatches[0])].item()}, want {expected[tuple(mismatches[0])].item()}"
    )


def check_against_reference(values, offsets, axes, rounding, config=None):
    outputs = poisoned_outputs(values, offsets, axes)
    qk.quantize_into(values, offsets, outputs, rounding, config=config)
    for axis in axes:
        expected_data, expected_scales = torch_reference(values, offsets, axis, rounding)
        assert_data_identical(outputs[axis][0], expected_data)
        assert_scales_identical(outputs[axis][1], expected_scales)


@pytest.mark.parametrize("rounding", mx_format.ROUNDINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_dual_matches_reference(rounding, dtype, offsets_dtype):
    offsets = ragged_offsets(RAGGED, offsets_dtype)
    values = wide_range_values(int(offsets[-1]), 2, 64, dtype)
    check_against_reference(values, offsets, ("feature", "sequence"), rounding)


@pytest.mark.parametrize("axis", mxfp8.AXES)
@pytest.mark.parametrize("dim", [32, 96, 128])
def test_one_axis_matches_reference(axis, dim):
    offsets = ragged_offsets([129, 0, 33, 1])
    values = wide_range_values(int(offsets[-1]), 1, dim, torch.bfloat16)
    check_against_reference(values, offsets, (axis,), "rceil")


@pytest.mark.parametrize("config", qk.CONFIGS.values(), ids=qk.CONFIGS)
@pytest.mark.parametrize("dim", [32, 96])
def test_every_config_matches_reference(config, dim):
    """Chunks of channels past D (D 32, 96), ragged lengths, both axes from one read."""
    offsets = ragged_offsets(RAGGED)
    values = wide_range_values(int(offsets[-1]), 2, dim, torch.bfloat16)
    check_against_reference(values, offsets, ("feature", "sequence"), "rceil", config)
    check_against_reference(values, offsets, ("sequence",), "floor", config)


def test_every_set_of_axes_has_a_default_config():
    for axes in (("feature",), ("sequence",), ("feature", "sequence"), ("sequence", "feature")):
        assert qk.default_config(axes) in qk.CONFIGS.values()


def test_results_follow_the_order_of_axes():
    offsets = ragged_offsets([40, 7])
    values = wide_range_values(47, 2, 32, torch.bfloat16)
    (seq_data, seq_scales), (feat_data, feat_scales) = qk.quantize_mxfp8_kernel(
        values, offsets, axes=("sequence", "feature")
    )
    for axis, data, scales in (("sequence", seq_data, seq_scales), ("feature", feat_data, feat_scales)):
        expected = quantize_mxfp8(values, offsets, axis=axis)
        assert_data_identical(data, expected.data)
        assert_scales_identical(scales, expected.scales.view(torch.uint8))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("rounding", mx_format.ROUNDINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_extreme_magnitudes(rounding, dtype, device):
    """Blocks near the largest finite value and among the subnormals, beside ordinary and zero blocks."""
    offsets = ragged_offsets([70, 33], device=device)
    largest = torch.finfo(dtype).max
    magnitudes = torch.tensor([largest, largest / 3, 1.0, 2.0**-130, 2.0**-140, 1e-45, 0.0, 448.0])
    if INTERPRETED and dtype == torch.bfloat16:
        # Triton 3.6's interpreter converts bf16 subnormals to fp32 wrongly; the GPU run covers them.
        magnitudes = magnitudes[(magnitudes >= torch.finfo(dtype).tiny) | (magnitudes == 0)]
    values = torch.rand(103, 2, 256) * 2 - 1
    values = values * magnitudes[torch.randint(0, len(magnitudes), (103, 2, 8))].repeat_interleave(32, dim=2)
    values[5, 0, 0] = largest  # a block whose maximum is exactly the largest value
    values[6, 1, :32] = -(2.0**-149)  # the smallest fp32 subnormal (0 in bf16)
    check_against_reference(values.to(device=device, dtype=dtype), offsets, ("feature", "sequence"), rounding)


@triton.jit
def _scale_factor_kernel(bytes_, factors, values, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(factors + i, layout.scale_factor(tl.load(bytes_ + i)))
    tl.store(values + i, layout.scale_value(tl.load(bytes_ + i)))


def test_scale_factor_and_value_are_exact_for_every_byte():
    bytes_ = torch.arange(256, dtype=torch.int32).clamp(max=254)
    factors, values = torch.full((256,), float("nan")), torch.full((256,), float("nan"))
    _scale_factor_kernel[(1,)](bytes_, factors, values, N=256)
    assert torch.equal(factors.view(torch.int32), mx_format.scale_factors(bytes_).view(torch.int32))
    assert torch.equal(values.view(torch.int32), mx_format.descale_factors(bytes_).view(torch.int32))


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # numpy, inside the interpreter
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_values_are_flagged(bad):
    offsets = ragged_offsets([50, 90])
    values = torch.randn(140, 2, 32, dtype=torch.bfloat16)
    flag = torch.zeros(1)
    qk.quantize_mxfp8_kernel(values, offsets, axes=("feature", "sequence"), nonfinite=flag)
    assert flag.item() == 0
    values[int(torch.randint(0, 140, ()))] = bad
    for axes in (("feature",), ("sequence",)):
        flag = torch.zeros(1)
        qk.quantize_mxfp8_kernel(values, offsets, axes=axes, nonfinite=flag)
        assert not torch.isfinite(flag).all()


@pytest.mark.parametrize("lengths", [[], [0], [0, 0, 0]])
def test_no_tokens(lengths):
    offsets = offsets_from_lengths(torch.tensor(lengths, dtype=torch.int64))
    values = torch.randn(0, 2, 64)
    check_against_reference(values, offsets, ("feature", "sequence"), "rceil")


@pytest.mark.parametrize("change, error, match", [
    ({"offsets": torch.tensor([0, 3, 2, 6])}, ValueError, "non-decreasing"),
    ({"offsets": torch.tensor([0, 3, 9])}, ValueError, r"offsets\[-1\]"),
    ({"offsets": torch.tensor([0, 3, 6], dtype=torch.float32)}, TypeError, "offsets must be int32"),
    ({"offsets": torch.tensor([0, 3, 6], device="meta")}, ValueError, "offsets"),
    ({"values": torch.randn(6, 2, 48)}, ValueError, "multiple of 32"),
    ({"values": torch.randn(6, 2, 32, dtype=torch.float64)}, TypeError, "values must be float32"),
    ({"values": torch.randn(6, 64)}, ValueError, r"values must be \[total, heads, D\]"),
    ({"nonfinite": torch.zeros(2)}, ValueError, "nonfinite must be"),
])
def test_bad_inputs_raise_before_any_launch(change, error, match):
    """The README names this kernel: it validates what it is given (it used to read out of bounds on
    decreasing or out-of-range offsets and fail inside Triton on D = 48, fp64 or 2-D values)."""
    arguments = {"values": torch.randn(6, 2, 32), "offsets": torch.tensor([0, 3, 6])}
    arguments.update(change)
    with pytest.raises(error, match=match):
        qk.quantize_mxfp8_kernel(**arguments)


def test_bad_axes_raise():
    offsets = ragged_offsets([3])
    values = torch.randn(3, 1, 32)
    for axes in ((), ("tokens",), ("feature", "feature")):
        with pytest.raises(ValueError, match="axes"):
            qk.quantize_mxfp8_kernel(values, offsets, axes=axes)


def compile_per_tile_kernel(module: str, kernel: str, leading: dict, config=qk.CONFIGS["all-8w"], **constexprs) -> str:
    """sm_90 PTX of a kernel launched by ``qk.launch_per_tile`` with ``config`` (``leading``: its first
    arguments, name -> Triton type), for both axes, rceil, the finite check, 8 heads of D 128, and
    further ``constexprs``."""
    constexprs = {
        "HEADS": 8,
        "D": 128,
        "BLOCK_D": config.block_d(128),
        "BLOCK_ROWS": config.block_rows(128),
        "VECTOR": config.vector,
        "CHANNEL_TILES": 1,
        "FEATURE": True,
        "SEQUENCE": True,
        "FLOOR": False,
        "CHECK_FINITE": True,
        "INTERPRET": False,
        **constexprs,
    }
    signature = {
        **leading,
        "tiles": "*i32",
        "offsets": "*i64",
        "total": "i32",
        "feature_data": "*fp8e4nv",
        "feature_scales": "*u8",
        "sequence_data": "*fp8e4nv",
        "sequence_scales": "*u8",
        "nonfinite": "*fp32",
        "scale_bytes_per_head": "i64",
        "n_slots": "i64",
        **dict.fromkeys(constexprs, "constexpr"),
    }
    aligned = [name for name, kind in signature.items() if kind.startswith("*")] + ["scale_bytes_per_head"]
    return compile_ptx(module, kernel, signature, constexprs, num_warps=config.num_warps, aligned=aligned)


@pytest.mark.parametrize("config", qk.CONFIGS.values(), ids=qk.CONFIGS)
def test_compiles_for_sm90_with_hardware_e4m3_conversion(config):
    ptx = compile_per_tile_kernel("jagged_attn.kernels.producers.quantize", "_quantize_kernel", {"values": "*bf16"},
                                  config)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert not divides(ptx)
    assert "max.NaN.f32" in ptx  # NaN survives the block maxima, so it can be flagged
    assert ".ftz" not in ptx  # subnormal inputs and the 2^-127 factor must not be flushed


@pytest.mark.parametrize("config", [c for c in qk.CONFIGS.values() if c.num_warps <= 4], ids=lambda c: c.name)
def test_sequence_axis_maxima_stay_inside_warps(config):
    """With one 32-token block per warp the only exchange between warps is the scale bytes' (one
    barrier); the 8-warp layout, whose blocks span two warps, needs four."""
    ptx = compile_per_tile_kernel(
        "jagged_attn.kernels.producers.quantize", "_quantize_kernel", {"values": "*bf16"}, config,
        FEATURE=False, CHECK_FINITE=False,
    )
    assert ptx.count("bar.sync") == 1
    assert "ld.global.v4" in ptx  # 16-byte loads: the layout program_tile assumes


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("rounding", mx_format.ROUNDINGS)
def test_gpu_matches_torch_path(rounding):
    lengths = RAGGED + torch.randint(1, 3000, (40,)).tolist()
    offsets = ragged_offsets(lengths, torch.int32, "cuda")
    values = wide_range_values(int(offsets[-1]), 4, 128, torch.bfloat16, "cuda")
    for config in qk.CONFIGS.values():
        check_against_reference(values, offsets, mxfp8.AXES, rounding, config)
    outputs = poisoned_outputs(values, offsets, mxfp8.AXES)
    qk.quantize_into(values, offsets, outputs, rounding)
    for axis in mxfp8.AXES:
        expected_data, expected_scales = torch_reference(values, offsets, axis, rounding)
        assert_data_identical(outputs[axis][0], expected_data)
        assert_scales_identical(outputs[axis][1], expected_scales)
        on_cpu = quantize_mxfp8(values.cpu(), offsets.cpu(), axis=axis, rounding=rounding)
        assert_data_identical(outputs[axis][0].cpu(), on_cpu.data)
        dispatched = quantize_mxfp8(values, offsets, axis=axis, rounding=rounding)
        assert_scales_identical(dispatched.scales.view(torch.uint8), expected_scales)
    values[7, 1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_mxfp8(values, offsets)


@pytest.mark.gpu
def test_gpu_bandwidth_vs_copy():
    """bf16 [~2^20 tokens, 8, 128] (2 GiB) in ragged sequences: (bytes read + written) / time."""
    from triton.testing import do_bench

    lengths = torch.randint(1, 2048, (1100,))
    lengths = (lengths * (2**20 / lengths.sum())).long().clamp(min=1)
    offsets = offsets_from_lengths(lengths).cuda()
    total = int(offsets[-1])
    values = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16)
    in_bytes = values.numel() * values.element_size()
    copy_ms = do_bench(lambda: torch.empty_like(values).copy_(values))
    copy_gbs = 2 * in_bytes / copy_ms / 1e6
    name = torch.cuda.get_device_name()
    print(f"\n{name}: input {in_bytes / 2**30:.3f} GiB bf16 {tuple(values.shape)}, {len(lengths)} sequences")
    print(f"device copy: {copy_ms * 1e3:.1f} us, {copy_gbs:.0f} GB/s (read + write)")
    for axes in (("feature",), ("sequence",), ("feature", "sequence")):
        outputs = {axis: qk.empty_outputs(values, offsets, axis) for axis in axes}
        moved = in_bytes + sum(data.numel() + scales.numel() for data, scales in outputs.values())
        for config in qk.CONFIGS.values():
            ms = do_bench(lambda out=outputs, c=config: qk.quantize_into(values, offsets, out, "rceil", config=c))
            print(
                f"{'+'.join(axes):17s} {config.name:10s}: {ms * 1e3:7.1f} us, {moved / ms / 1e6:6.0f} GB/s "
                f"= {moved / ms / 1e6 / copy_gbs:.0%} of copy"
            )
        flag = torch.zeros(1, device="cuda")
        ms = do_bench(lambda a=axes, f=flag: qk.quantize_mxfp8_kernel(values, offsets, axes=a, nonfinite=f))
        print(
            f"{'+'.join(axes):17s} entry point with allocation and NaN check: {ms * 1e3:7.1f} us, "
            f"{moved / ms / 1e6:6.0f} GB/s = {moved / ms / 1e6 / copy_gbs:.0%} of copy"
        )
    for axis in mxfp8.AXES:
        ms = do_bench(lambda a=axis: quantize_mxfp8(values, offsets, axis=a))
        print(f"quantize_mxfp8(axis={axis!r}) public call (validation syncs included): {ms * 1e3:7.1f} us")
    outputs = {axis: qk.empty_outputs(values, offsets, axis) for axis in mxfp8.AXES}
    qk.quantize_into(values, offsets, outputs, "rceil")
    for axis in mxfp8.AXES:
        expected_data, expected_scales = torch_reference(values, offsets, axis, "rceil")
        assert_data_identical(outputs[axis][0], expected_data)
        assert_scales_identical(outputs[axis][1], expected_scales)
