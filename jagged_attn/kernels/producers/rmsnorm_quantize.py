"""Fused RMSNorm + jagged MXFP8 quantization in one read of the input (Triton).

``rms_norm_quantize`` normalizes every (token, head) row of ``x [total, H, D]`` over D, as
``torch.nn.RMSNorm(D)`` does for the q/k heads of a QK-norm layer, and writes from one read of
``x``: the normalized rows (optional), the fp32 ``rstd`` the backward needs, and the MXFP8 data and
tiled scales for each requested axis.

The numbers, exactly:

* in fp32: ``mean_square = sum(x^2) * (1 / D)`` (``1 / D`` rounded to fp32: exact for D a power
  of two), ``rstd = rsqrt(mean_square + eps)`` and ``y = (x * rstd) * weight``. On the GPU rsqrt is
  the hardware approximation (``rsqrt.approx``, relative error below 2^-22; correctly rounded
  division and square root cost ~30% more instructions, as the per-row math is repeated by the
  16 threads that share a row); in the interpreter it is numpy's ``1 / sqrt``;
* ``normalized = y`` rounded to nearest-even in ``x``'s dtype;
* the MXFP8 is quantized from ``normalized`` (not from the fp32 ``y``), so
  ``mx[axis]`` equals ``jagged_attn.quantize_mxfp8(normalized, offsets, axis=axis, rounding=...)``
  bit for bit.

``normalized`` and ``rstd`` match ``torch.nn.functional.rms_norm`` computed in fp32 up to a few
fp32 units in the last place (the order of the sum and rsqrt differ), i.e. within one unit in the
last place of ``x``'s dtype.

The work split, the slot table and the MX store path are those of ``jagged_attn/kernels/producers/quantize.py``: one
program per head of one 128-token tile of one sequence, all D channels (a row's statistic needs
every channel of its token), laid out by a ``quantize.TileConfig`` whose ``channels`` is None.
With 4 warps each warp holds one 32-token block of all D channels, so the rstd sum (over the
lanes of a row) and the sequence-axis block maxima (over lanes and registers) both stay inside
the warp; with 8 warps a block spans two warps and its maxima pass through shared memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jagged_attn import mx_format
from jagged_attn.mxfp8 import HIGH_PRECISION_DTYPES, MXFP8Jagged, check_finite, mxfp8_without_value_checks

from ..common import fp8
from . import quantize
from .quantize import TileConfig, program_tile, store_mxfp8

# scripts/bench_rmsnorm_quantize.py times them all on the GPU; every configuration writes the same
# bytes. All take 8 channels per thread: the bf16 and e4m3 tiles then share one register layout, so
# the normalized store needs no exchange through shared memory (16 channels: ~20 barriers).
# "all-8w-v8-r128": 8 warps, at most 128 registers so that two programs share an SM (left free
# ptxas takes ~165); a sequence-axis block spans 2 warps. "all-4w-v8": one block per warp, 128
# elements per thread for D = 128 (sm_90 ptxas: ~250 registers, no spills, two programs per SM);
# "-r168": three programs per SM, at the cost of ~400 bytes of spills per thread.
CONFIGS = {
    config.name: config
    for config in (
        TileConfig("all-8w-v8-r128", None, 8, 8, max_registers=128),
        TileConfig("all-4w-v8", None, 4, 8),
        TileConfig("all-4w-v8-r168", None, 4, 8, max_registers=168),
    )
}
# The fastest measured for every set of axes (scripts/bench_rmsnorm_quantize.py; docs/perf-history.md).
DEFAULT_CONFIG = CONFIGS["all-8w-v8-r128"]


@triton.jit
def _rms_norm_quantize_kernel(
    values,
    weight,
    normalized,
    rstd,
    eps,
    tiles,
    offsets,
    total,
    feature_data,
    feature_scales,
    sequence_data,
    sequence_scales,
    nonfinite,
    scale_bytes_per_head,
    n_slots,
    HEADS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    VECTOR: tl.constexpr,
    CHANNEL_TILES: tl.constexpr,
    FEATURE: tl.constexpr,
    SEQUENCE: tl.constexpr,
    FLOOR: tl.constexpr,
    CHECK_FINITE: tl.constexpr,
    INTERPRET: tl.constexpr,
    STORE_NORMALIZED: tl.constexpr,
):
    slot, head, token, row, in_slot, channels, element, inside = program_tile(
        tiles, offsets, total, HEADS, D, BLOCK_D, BLOCK_ROWS, VECTOR
    )
    x = tl.load(values + element, mask=inside, other=0.0).to(tl.float32)
    w = tl.load(weight + channels, mask=channels < D, other=0.0).to(tl.float32)

    mean_square = tl.sum(x * x, axis=1) * (1.0 / D)
    row_rstd = tl.math.rsqrt(mean_square + eps)

    y = fp8.rounded_to(x * row_rstd[:, None] * w[None, :], values.dtype.element_ty, INTERPRET)
    if STORE_NORMALIZED:
        tl.store(normalized + element, y.to(values.dtype.element_ty), mask=inside)
    store_mxfp8(
        y, slot, head, token, channels, element, inside,
        feature_data, feature_scales, sequence_data, sequence_scales, nonfinite, scale_bytes_per_head, n_slots,
        BLOCK_D, BLOCK_ROWS, CHANNEL_TILES, FEATURE, SEQUENCE, FLOOR, CHECK_FINITE, INTERPRET,
    )
    # Last: the one value per row leaves the tile's layout through shared memory (two barriers).
    tl.store(rstd + row * HEADS + head, row_rstd, mask=in_slot)


def rms_norm_quantize_into(x, weight, offsets, outputs: dict, normalized, rstd, *, eps: float, rounding: str,
                           nonfinite=None, config: TileConfig | None = None):
    """Kernel launch only (no checks): contiguous ``x [total, H, D]``, ``weight [D]``; ``outputs``: axis ->
    (data, scales) from ``quantize.empty_outputs``; ``normalized`` like ``x`` or None; ``rstd``
    fp32 ``[total, H]``; ``nonfinite``: optional fp32 ``[1]`` holding 0, set to NaN/Inf if the
    normalized values hold any; ``config``: a layout with all D channels per program (None:
    ``DEFAULT_CONFIG``)."""
    config = config or DEFAULT_CONFIG
    if config.channels is not None:
        raise ValueError(f"config {config.name!r}: RMSNorm needs all D channels of a token in one program")
    quantize.launch_per_tile(
        _rms_norm_quantize_kernel, (x, weight, normalized, rstd, eps), x, offsets, outputs, rounding, nonfinite,
        config, STORE_NORMALIZED=normalized is not None,
    )


def rms_norm_quantize(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    *,
    eps: float = 1e-6,
    axes=("feature",),
    rounding: str = "rceil",
    return_normalized: bool = True,
    nonfinite: torch.Tensor | None = None,
) -> tuple[dict[str, MXFP8Jagged], torch.Tensor | None, torch.Tensor]:
    """RMSNorm over the last dim of jagged ``x`` fused with its MXFP8 quantization, in one read of ``x``.

    Args:
        x: bf16/fp16/fp32 ``[total, H, D]``, D a multiple of 32.
        weight: bf16/fp16/fp32 ``[D]`` (the RMSNorm gain), on ``x``'s device.
        offsets: int32/int64 ``[B + 1]`` (the jagged convention), on ``x``'s device.
        axes: non-empty subset of ``("feature", "sequence")``; all are written from the same read.
        rounding: ``"rceil"`` or ``"floor"`` (``mx_format``'s scale rule).
        return_normalized: also write the normalized values.
        nonfinite: None (NaN/Inf in the normalized values raise ValueError, a wait for the device), or
            an fp32 ``[1]`` tensor holding 0 into which they are flagged instead, for the caller to check.

    Returns ``(mx, normalized, rstd)``: ``mx`` maps each axis to an ``MXFP8Jagged`` equal, bit for
    bit, to ``quantize_mxfp8(normalized, offsets, axis=axis, rounding=rounding)``; ``normalized`` in
    ``x``'s dtype ``[total, H, D]`` (None unless ``return_normalized``); ``rstd`` fp32 ``[total, H]``.
    See the module docstring for the exact rounding. Runs the Triton kernel: CUDA tensors, or any
    tensors in the interpreter (``TRITON_INTERPRET=1``). Raises ValueError/TypeError on bad input before any work, and
    (without ``nonfinite``) ValueError afterwards if the normalized values hold NaN or Inf (as ``quantize_mxfp8`` does).
    """
    quantize.check_axes(axes)
    mx_format.check_rounding(rounding)
    _check_inputs(x, weight, offsets)
    x, weight, offsets = x.contiguous(), weight.contiguous(), offsets.contiguous()
    outputs = {axis: quantize.empty_outputs(x, offsets, axis) for axis in axes}
    normalized = torch.empty_like(x) if return_normalized else None
    rstd = torch.empty(x.shape[:2], dtype=torch.float32, device=x.device)
    flag = torch.zeros(1, dtype=torch.float32, device=x.device) if nonfinite is None else nonfinite
    rms_norm_quantize_into(x, weight, offsets, outputs, normalized, rstd, eps=float(eps), rounding=rounding,
                           nonfinite=flag)
    if nonfinite is None:
        check_finite(flag, "normalized x")
    mx = {
        axis: mxfp8_without_value_checks(data, scales, offsets, axis, rounding)
        for axis, (data, scales) in outputs.items()
    }
    return mx, normalized, rstd


def _check_inputs(x, weight, offsets) -> None:
    quantize.check_jagged_input(x, offsets, "x")  # x's values: the normalized ones are checked instead
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"weight must be float32, bfloat16 or float16, got {weight.dtype}")
    if tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"weight must have shape ({x.shape[-1]},) (x's last dim), got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
