"""The MXFP8 format rules: element type, block size, and the shared-scale rounding rule.

Elements are ``float8_e4m3fn`` (round to nearest even, saturating at +-448); every block of 32
consecutive elements along the quantization axis shares one ``2^e`` scale stored as an E8M0
biased-exponent byte (bias 127). Two rules pick ``e`` from the block's absolute maximum:

* ``rceil`` (default; cuBLAS, Transformer Engine, ``cvt.rp.ue8m0x2.f32``):
  ``e = ceil(log2(amax / 448))`` of the correctly rounded quotient, computed on amax's bits with no
  division, so it is exact (:func:`rceil_scale_byte`).
* ``floor`` (OCP MX v1.0): ``e = floor(log2(amax)) - 8``; elements are then clamped to +-448.

Bytes are clamped to [0, 254]; ``amax == 0`` gives byte 0. The byte functions are plain integer
arithmetic so the same source runs on Python ints, torch tensors and inside Triton kernels.
"""

from __future__ import annotations

import torch
import triton.language as tl  # noqa: F401  (the Triton interpreter needs it beside jit-wrapped functions)

E4M3_MAX = 448.0
BLOCK_SIZE = 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF  # the one E8M0 byte that is no power of two
E4M3_NAN_BITS = 0x7F  # float8_e4m3fn is NaN where its low 7 bits are all set (0x7F, 0xFF)
ROUNDINGS = ("rceil", "floor")
# P = exp(s - rowmax) lies in (0, 1]; it is multiplied by 2^P_STATIC_EXP before the e4m3 cast.
P_STATIC_EXP = 8


def rceil_scale_byte(bits):
    """E8M0 byte from the fp32 bit pattern of ``amax`` (non-negative, finite): the byte of
    ``ceil(log2(amax / 448))`` with the quotient rounded to nearest, without dividing. With ``amax =
    m 2^E``, ``m`` in [1, 2), ``amax / 448 = (m / 1.75) 2^(E - 8)``: its exponent rounds up past
    ``E - 8`` exactly when ``m > 1.75`` (mantissa field above 0x600000); quotients up to the
    smallest normal take byte 1, and those that round to zero (``amax`` at most 224 subnormal steps,
    1.75 * 2^-142) byte 0; finite ``amax`` never reaches 255. The same byte as the division form
    for all 2^31 - 2^23 such floats (compared on the CPU, 2026-11-30; the tests check every exponent
    near its edges)."""
    e = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000)
    e = e + (1 - e) * (e < 1)
    return e * (bits > 224)


def floor_scale_byte(bits):
    """E8M0 byte from the fp32 bit pattern of ``amax`` (non-negative, finite)."""
    e = (bits >> 23) - 8
    return e * (e > 0)


def check_rounding(rounding: str) -> str:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    return rounding


def scale_bytes(amax: torch.Tensor, rounding: str = "rceil") -> torch.Tensor:
    """int32 E8M0 bytes for float32 block maxima ``amax`` (>= 0, finite)."""
    amax = amax.to(torch.float32)
    bits = amax.view(torch.int32)
    return rceil_scale_byte(bits) if check_rounding(rounding) == "rceil" else floor_scale_byte(bits)


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact ``2.0 ** exponent`` (float64) for integer exponents in [-1022, 1023]."""
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


def scale_factors(byte: torch.Tensor) -> torch.Tensor:
    """float32 ``2^(127 - byte)``: multiplying a block by it maps the block onto the e4m3 range.

    Exact: bytes 0..254 give 2^127 .. 2^-127 (the last a float32 subnormal), and a power-of-two
    product is exact unless it underflows below 2^-126, far under e4m3's smallest step (2^-9).
    """
    return pow2(E8M0_BIAS - byte).to(torch.float32)


def descale_factors(byte: torch.Tensor) -> torch.Tensor:
    """float32 ``2^(byte - 127)``, the value of an E8M0 scale byte (exact); NaN for 0xFF, E8M0's NaN."""
    factors = pow2(byte.to(torch.int64) - E8M0_BIAS).to(torch.float32)
    return factors.masked_fill_(byte == E8M0_NAN, float("nan"))


def saturating_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` cast to the floating ``dtype`` with values beyond its finite range clamped to +-its max
    (NaN stays NaN), where a plain cast rounds them to +-inf."""
    bound = torch.finfo(dtype).max
    return x.clamp(-bound, bound).to(dtype)


def cast_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even cast to float8_e4m3fn (clamp first: older torch wraps)."""
    return saturating_cast(x, torch.float8_e4m3fn)


def quantize_with_factors(x: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """e4m3 ``x * factors`` (``factors`` from :func:`scale_factors`, broadcast against ``x``)."""
    return (x.to(torch.float32) * factors).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_p(p: torch.Tensor) -> torch.Tensor:
    """P in [0, 1] -> the fp32 value its e4m3 copy (static scale 2^8) stands for."""
    return cast_e4m3(p * 2.0**P_STATIC_EXP).to(torch.float32) * 2.0**-P_STATIC_EXP


def fake_quantize_square_tiles(x: torch.Tensor, rounding: str = "rceil") -> torch.Tensor:
    """``[..., M, N]`` -> float32 values after MXFP8 quantization in 32x32 square tiles.

    One scale per tile (partial edge tiles zero-padded for the amax), so the same bytes and scale
    serve the matrix and its transpose: the dS rule of the backward.
    """
    *lead, m, n = x.shape
    pm, pn = -m % BLOCK_SIZE, -n % BLOCK_SIZE
    padded = torch.nn.functional.pad(x.to(torch.float32), (0, pn, 0, pm))
    tiles = padded.reshape(*lead, (m + pm) // BLOCK_SIZE, BLOCK_SIZE, (n + pn) // BLOCK_SIZE, BLOCK_SIZE)
    byte = scale_bytes(tiles.abs().amax(dim=(-3, -1), keepdim=True), rounding)
    values = quantize_with_factors(tiles, scale_factors(byte)).to(torch.float32) * descale_factors(byte)
    return values.reshape(*padded.shape)[..., :m, :n]
