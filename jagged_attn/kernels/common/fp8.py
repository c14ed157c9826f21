"""Rounding to FP8 (e4m3) and bf16 inside Triton kernels, exact in the CPU interpreter too.

On a GPU the hardware cast rounds to nearest even. The Triton CPU interpreter's fp32 -> fp8 cast
drops the rounding carry, so when interpreted we first snap the value onto the e4m3 grid with
exact integer / fp32 arithmetic; the cast of a representable value is then exact everywhere
(the interpreter may still turn -0.0 into +0.0: compare fp8 results by value, not by byte).
"""

import torch
import triton
import triton.language as tl

from .interpreter import INTERPRETED  # noqa: F401  (launchers pass it as the INTERPRET constexpr)

E4M3_MIN_NORMAL = 0.015625  # 2^-6
E4M3_SUBNORMAL_STEPS = 512.0  # 1 / 2^-9, the subnormal quantum
RNE_SHIFTER = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds to an integer, ties to even
BF16_ROUNDING_BIAS = tl.constexpr(0x7FFF)  # added to the fp32 bits bf16 drops: round to nearest (ties: + lsb)
BF16_KEPT_BITS = tl.constexpr(-65536)  # 0xFFFF0000 as int32: sign, exponent and the 7 mantissa bits of bf16
FP16_MAX = tl.constexpr(torch.finfo(torch.float16).max)
BF16_MAX = tl.constexpr(torch.finfo(torch.bfloat16).max)
FP32_MAX = tl.constexpr(torch.finfo(torch.float32).max)


@triton.jit
def snap_to_e4m3_grid(x):
    """fp32 ``x`` with |x| <= 448 -> nearest e4m3 value (ties to even), still fp32."""
    bits = x.to(tl.int32, bitcast=True)
    keep_lsb = (bits >> 20) & 1  # lowest of the 3 mantissa bits e4m3 keeps
    normal = ((bits + 0x7FFFF + keep_lsb) & -1048576).to(tl.float32, bitcast=True)  # clear 20 low bits
    subnormal = ((x * E4M3_SUBNORMAL_STEPS + RNE_SHIFTER) - RNE_SHIFTER) / E4M3_SUBNORMAL_STEPS
    return tl.where(tl.abs(x) < E4M3_MIN_NORMAL, subnormal, normal)


@triton.jit
def to_e4m3(x, INTERPRET: tl.constexpr):
    """fp32 -> float8e4nv, round to nearest even, saturating at +-448 (on the GPU the conversion
    itself saturates: ``cvt.rn.satfinite``; NaN stays NaN).

    Pass ``INTERPRET=fp8.INTERPRETED`` from the launcher.
    """
    if INTERPRET:
        x = snap_to_e4m3_grid(tl.minimum(tl.maximum(x, -448.0), 448.0))
    return x.to(tl.float8e4nv)


@triton.jit
def to_e4m3_paired_apart(x, INTERPRET: tl.constexpr):
    """:func:`to_e4m3`, by conversions that pair each thread's elements (1, 3) and (2, 4) where the
    cast pairs (1, 2) and (3, 4). For a second e4m3 copy of values a kernel also casts: Triton 3.6's
    ptxas (CUDA 12.8, sm_90a) merges identical ``cvt.rn.satfinite.e4m3x2.f32`` and then leaves some
    consumers of the merged results reading registers no conversion wrote (seen in the SASS, and as
    non-finite bf16 copies on an H100); conversions of other pairs are not identical."""
    if INTERPRET:
        return to_e4m3(x, INTERPRET)
    bytes4 = tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; .reg .b32 mixed; "
        "cvt.rn.satfinite.e4m3x2.f32 lo, $3, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $2; "
        "mov.b32 mixed, {lo, hi}; prmt.b32 $0, mixed, 0, 0x3120; }",
        "=r,r,r,r,r", [x], dtype=tl.int8, is_pure=True, pack=4)
    return bytes4.to(tl.float8e4nv, bitcast=True)


@triton.jit
def e4m3_values_in_fp16(x, INTERPRET: tl.constexpr):
    """:func:`to_e4m3` of fp32 ``x`` as fp16 (which holds every e4m3 value exactly), with no 8-bit tensor
    between: a layout conversion Triton places after the cast then moves 16-bit elements (whole
    ``stmatrix``/``ldmatrix`` rows in a transpose), not single bytes."""
    if INTERPRET:
        return to_e4m3(x, INTERPRET).to(tl.float16)
    return tl.inline_asm_elementwise(
        "{ .reg .b16 pair; cvt.rn.satfinite.e4m3x2.f32 pair, $2, $1; cvt.rn.f16x2.e4m3x2 $0, pair; }",
        "=r,r,r", [x], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def rounded_to(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in ``dtype`` (bf16, fp16 or fp32), returned as fp32, which
    holds that value exactly. The interpreter's fp32 -> bf16 cast truncates (and its bf16 subnormals
    convert back wrongly), so there the bits are rounded in fp32."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        return ((bits + BF16_ROUNDING_BIAS + ((bits >> 16) & 1)) & BF16_KEPT_BITS).to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


@triton.jit
def saturating_cast(x, dtype: tl.constexpr):
    """fp32 ``x`` cast to ``dtype`` (fp16, bf16 or fp32) with values beyond its finite range clamped to
    +-its max, NaN kept (``mx_format.saturating_cast`` in a kernel). For the attention output O: a
    convex combination of V's rows never exceeds V's range, but V's MX rounding can (fp16 65504 is
    stored as 65536), and a plain cast would turn that into inf."""
    if dtype == tl.float16:
        bound = FP16_MAX
    elif dtype == tl.bfloat16:
        bound = BF16_MAX
    else:
        bound = FP32_MAX
    return tl.where(x > bound, bound, tl.where(x < -bound, -bound, x)).to(dtype)
