"""Linear + quantize (jagged_attn/kernels/producers/linear_quantize.py): the projection against fp64, its MXFP8 bit
for bit against ``quantize_mxfp8`` of the same bf16 result, and wgmma in the sm_90 PTX.

CPU runs use the Triton interpreter on tiny ragged batches; ``gpu`` tests use realistic shapes.
"""

from __future__ import annotations

import pytest
import torch
from compile_util import compile_ptx, divides
from jagged_attn.kernels.producers import linear_quantize as lq
from test_hopper_fwd import poisoned  # noqa: F401  (fixture: every torch.empty starts as NaN / 0xFF)
from test_quantize_kernel import RAGGED, assert_data_identical, assert_scales_identical, ragged_offsets

from jagged_attn import mx_format, quantize_mxfp8
from jagged_attn.offsets import offsets_from_lengths

LENGTHS = [length for length in RAGGED if length <= 129]  # 0, 1, 31, 32, 33, 127, 128, 129
FP32_EPS = 2.0**-24
BF16_HALF_STEP = 2.0**-8  # bf16 rounding moves a value by at most this fraction of its magnitude
CUBLAS_TOLERANCE = 1e-2  # relative L2 between our bf16 y and cuBLAS's (another summation order)


def make_problem(lengths, heads, dim, in_features, *, with_bias, device="cpu", offsets_dtype=torch.int64):
    offsets = ragged_offsets(lengths, offsets_dtype, device)
    total = int(offsets[-1])
    x = torch.randn(total, in_features, device=device).to(torch.bfloat16)
    weight = (torch.randn(heads * dim, in_features, device=device) / in_features**0.5).to(torch.bfloat16)
    bias = torch.randn(heads * dim, device=device).to(torch.bfloat16) if with_bias else None
    return x, weight, bias, offsets


def assert_projection_close(y, x, weight, bias):
    """``y`` [total, out] within bf16 rounding of the fp64 result plus the worst-case fp32 summation
    error (``K * 2^-24 * sum |x w|``, doubled to cover its own bf16 rounding with room to spare)."""
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    bound = BF16_HALF_STEP * exact.abs() + 2 * x.shape[1] * FP32_EPS * magnitude
    excess = (y.double() - exact).abs() - bound
    assert not torch.isnan(y).any()
    assert excess.max() <= 0, (
        f"worst error exceeds the bound by {excess.max():.3g} at {divmod(int(excess.argmax()), y.shape[1])}"
    )


def check_linear_quantize(x, weight, bias, offsets, heads, rounding="rceil", config=lq.CONFIGS[0]):
    mx, y = lq.linear_quantize(x, weight, offsets, heads=heads, bias=bias, rounding=rounding, config=config)
    total = x.shape[0]
    assert y.shape == mx.data.shape == (total, heads, weight.shape[0] // heads)
    assert_projection_close(y.view(total, -1), x, weight, bias)
    expected = quantize_mxfp8(y, offsets, rounding=rounding)
    assert (mx.axis, mx.rounding) == ("feature", rounding) and torch.equal(mx.offsets, offsets)
    assert_data_identical(mx.data, expected.data)
    assert_scales_identical(mx.scales.view(torch.uint8), expected.scales.view(torch.uint8))
    return mx, y


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("rounding", mx_format.ROUNDINGS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads", [1, 3])
def test_matches_reference(heads, dim, with_bias, rounding):
    offsets_dtype = torch.int32 if with_bias else torch.int64
    x, weight, bias, offsets = make_problem(LENGTHS, heads, dim, 96, with_bias=with_bias, offsets_dtype=offsets_dtype)
    check_linear_quantize(x, weight, bias, offsets, heads, rounding)


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("dim", [32, 256])
@pytest.mark.parametrize("config", lq.CONFIGS[1:], ids=lambda config: config.name)
def test_every_config_and_head_dim(config, dim):
    """Several heads per column tile (D = 32) and several column tiles per head (D = 256)."""
    x, weight, bias, offsets = make_problem([129, 0, 40, 1], 2, dim, 72, with_bias=True)
    check_linear_quantize(x, weight, bias, offsets, 2, config=config)


@pytest.mark.usefixtures("poisoned")
def test_plain_linear_is_the_same_projection():
    """The baseline GEMM (no quantizing epilogue) gives the very bytes of the fused kernel's ``y``."""
    x, weight, bias, offsets = make_problem([200, 57], 2, 128, 64, with_bias=True)
    _, y = lq.linear_quantize(x, weight, offsets, heads=2, bias=bias)
    plain = lq.linear(x, weight, bias)
    assert torch.equal(plain.view(torch.int16), y.view(x.shape[0], -1).view(torch.int16))
    mx, none = lq.linear_quantize(x, weight, offsets, heads=2, bias=bias, return_high_precision=False)
    assert none is None
    assert_data_identical(mx.data, quantize_mxfp8(y, offsets).data)


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("lengths", [[], [0], [0, 0, 0]])
def test_no_tokens(lengths):
    offsets = offsets_from_lengths(torch.tensor(lengths, dtype=torch.int64))
    x, weight = torch.randn(0, 32).to(torch.bfloat16), torch.randn(128, 32).to(torch.bfloat16)
    mx, y = lq.linear_quantize(x, weight, offsets, heads=2)
    assert y.shape == (0, 2, 64)
    assert_scales_identical(mx.scales.view(torch.uint8), quantize_mxfp8(y, offsets).scales.view(torch.uint8))


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # numpy, inside the interpreter
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_results_raise(bad):
    x, weight, bias, offsets = make_problem([33, 20], 1, 64, 32, with_bias=True)
    x[int(torch.randint(0, 53, ()))] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        lq.linear_quantize(x, weight, offsets, heads=1, bias=bias)
    flag = torch.zeros(1)
    lq.linear_quantize(x, weight, offsets, heads=1, bias=bias, nonfinite=flag)  # flagged for the caller, no raise
    assert not bool(torch.isfinite(flag).all())


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(x=torch.randn(5, 32)), TypeError, "x must be bfloat16"),
        (dict(weight=torch.randn(128, 32, dtype=torch.float16)), TypeError, "weight must be bfloat16"),
        (dict(x=torch.randn(5, 1, 32).to(torch.bfloat16)), ValueError, "x must be 2-D"),
        (dict(weight=torch.randn(128, 40).to(torch.bfloat16)), ValueError, "weight must be"),
        (
            dict(x=torch.randn(5, 36).to(torch.bfloat16), weight=torch.randn(128, 36).to(torch.bfloat16)),
            ValueError,
            "multiple of 8",
        ),
        (dict(heads=3), ValueError, "heads"),
        (dict(heads=0), ValueError, "heads"),
        (dict(weight=torch.randn(192, 32).to(torch.bfloat16), heads=2), ValueError, "head dim"),
        (dict(bias=torch.randn(64).to(torch.bfloat16)), ValueError, "bias must have shape"),
        (dict(bias=torch.randn(128, dtype=torch.float16)), TypeError, "bias"),
        (dict(offsets=torch.tensor([0, 4])), ValueError, "offsets"),
        (dict(offsets=torch.tensor([0, 3, 2, 5])), ValueError, "non-decreasing"),
        (dict(offsets=torch.tensor([0, 5.0])), TypeError, "offsets"),
        (dict(rounding="nearest"), ValueError, "rounding"),
    ],
)
def test_bad_inputs_raise(change, error, match):
    args = dict(
        x=torch.randn(5, 32).to(torch.bfloat16),
        weight=torch.randn(128, 32).to(torch.bfloat16),
        offsets=torch.tensor([0, 2, 5]),
        heads=2,
        bias=None,
        rounding="rceil",
    )
    args.update(change)
    with pytest.raises(error, match=match):
        lq.linear_quantize(args.pop("x"), args.pop("weight"), args.pop("offsets"), **args)


def _sm90_ptx(quantize: bool) -> str:
    config = lq.CONFIGS[0]
    pointers = dict(bias="*bf16", y="*bf16", data="*fp8e4nv", scale_words_="*i32", offsets="*i32", nonfinite="*fp32")
    scalars = dict.fromkeys(["total", "n_features", "batch", "search_steps", "words_per_head"], "i32")
    constexprs = dict(
        HAS_BIAS=True,
        STORE_Y=True,
        QUANTIZE=quantize,
        D=128,
        FLOOR=False,
        INTERPRET=False,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
    )
    signature = {
        "x_desc": f"tensordesc<bf16[{config.block_m}, {config.block_k}]>",
        "w_desc": f"tensordesc<bf16[{config.block_n}, {config.block_k}]>",
        **pointers,
        **scalars,
        **dict.fromkeys(constexprs, "constexpr"),
    }
    return compile_ptx(
        "jagged_attn.kernels.producers.linear_quantize",
        "_linear_kernel",
        signature,
        constexprs,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def test_compiles_for_sm90_with_wgmma_and_tma():
    for quantize in (False, True):
        ptx = _sm90_ptx(quantize)
        assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ptx
        assert "cp.async.bulk.tensor.2d" in ptx  # TMA loads of x and weight
        assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == quantize
        assert not divides(ptx)


# ---------------------------------------------------------------------------------------------- GPU


def realistic_problem(heads, dim):
    lengths = RAGGED + torch.randint(1, 3000, (24,)).tolist()
    return make_problem(lengths, heads, dim, 4096, with_bias=True, device="cuda", offsets_dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("rounding", mx_format.ROUNDINGS)
@pytest.mark.parametrize("heads, dim", [(32, 128), (8, 128), (16, 64)])
def test_gpu_realistic_projection(heads, dim, rounding):
    x, weight, bias, offsets = realistic_problem(heads, dim)
    _, y = check_linear_quantize(x, weight, bias, offsets, heads, rounding)
    torch_y = torch.nn.functional.linear(x, weight, bias).view(y.shape)
    assert (y.float() - torch_y.float()).norm() / torch_y.float().norm() < CUBLAS_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("config", lq.CONFIGS[1:], ids=lambda config: config.name)
def test_gpu_every_config(config):
    x, weight, bias, offsets = realistic_problem(8, 128)
    check_linear_quantize(x, weight, bias, offsets, 8, config=config)
