"""An independent MXFP8 oracle in numpy: written from docs/DESIGN.md's text, sharing no code with
``jagged_attn`` (no bit tricks for the exponent, a table search for e4m3 rounding, loops for the
jagged placement, and torch's own ``to_blocked`` for the tile swizzle)."""

from __future__ import annotations

import numpy as np
import torch


def e4m3_table() -> np.ndarray:
    """All finite non-negative float8_e4m3fn values, decoded from the format definition, by code."""
    values = []
    for code in range(0x7F):  # 0x7F is NaN
        exponent, mantissa = code >> 3, code & 7
        if exponent == 0:
            values.append(mantissa / 8 * 2.0**-6)
        else:
            values.append((1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return np.array(values)


_TABLE = e4m3_table()


def round_e4m3(x: np.ndarray) -> np.ndarray:
    """Round float64 values to e4m3: nearest, ties to the even code, saturating at 448."""
    mag = np.minimum(np.abs(x), 448.0)
    hi = np.clip(np.searchsorted(_TABLE, mag), 1, len(_TABLE) - 1)
    lo = hi - 1
    d_lo, d_hi = mag - _TABLE[lo], _TABLE[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return np.sign(x) * np.where(pick_hi, _TABLE[hi], _TABLE[lo])


def scale_exponent(amax: float, rounding: str) -> int:
    """Biased E8M0 byte for one block maximum."""
    if amax == 0:
        return 0
    if rounding == "rceil":
        ratio = np.float32(np.float32(amax) / np.float32(448.0))
        if ratio == 0:  # underflow in float32
            return 0
        mantissa, exp = np.frexp(np.float64(ratio))  # ratio = mantissa * 2^exp, mantissa in [0.5, 1)
        e = exp - 1 if mantissa == 0.5 else exp  # ceil(log2(ratio))
    else:
        mantissa, exp = np.frexp(np.float64(np.float32(amax)))
        e = (exp - 1) - 8  # floor(log2(amax)) - emax(e4m3)
    return int(min(max(e + 127, 0), 254))


def quantize_block(x: np.ndarray, rounding: str) -> tuple[np.ndarray, int]:
    """One block -> (e4m3 values as float64, biased byte)."""
    byte = scale_exponent(float(np.abs(x).max()), rounding)
    return round_e4m3(x.astype(np.float64) / 2.0 ** (byte - 127)), byte


def oracle_quantize(values: torch.Tensor, offsets, axis: str, rounding: str):
    """(e4m3 values float64 [total, H, D], scales uint8 [H, tiled bytes]) for a 3-D float tensor."""
    from torch.testing._internal.common_quantized import to_blocked

    x = values.to(torch.float32).numpy().astype(np.float64)
    total, heads, dim = x.shape
    offsets = [int(o) for o in offsets]
    batch = len(offsets) - 1
    padded_rows = (total // 128 + batch) * 128
    data = np.zeros_like(x)
    if axis == "feature":
        matrix = np.zeros((heads, padded_rows, dim // 32), dtype=np.uint8)
        for b in range(batch):
            start = (offsets[b] // 128 + b) * 128
            for i, t in enumerate(range(offsets[b], offsets[b + 1])):
                for h in range(heads):
                    for blk in range(dim // 32):
                        cols = slice(32 * blk, 32 * blk + 32)
                        data[t, h, cols], matrix[h, start + i, blk] = quantize_block(x[t, h, cols], rounding)
    else:
        matrix = np.zeros((heads, dim, padded_rows // 32), dtype=np.uint8)
        for b in range(batch):
            first_col = (offsets[b] // 128 + b) * 4
            for blk, t0 in enumerate(range(offsets[b], offsets[b + 1], 32)):
                rows = slice(t0, min(t0 + 32, offsets[b + 1]))
                for h in range(heads):
                    for d in range(dim):
                        data[rows, h, d], matrix[h, d, first_col + blk] = quantize_block(x[rows, h, d], rounding)
    scales = torch.stack([to_blocked(torch.from_numpy(m)) for m in matrix])
    return data, scales
