"""``MXFP8Jagged``: jagged FP8 values at their unpadded offsets plus tiled E8M0 scales.

Two quantization axes (docs/DESIGN.md section 3-4):

* ``"feature"``: 32-element blocks along head_dim. Scale matrix per head: rows = tokens at their
  padded rows ``(offsets[b] // 128 + b) * 128 + i`` (``padded_total`` rows), columns = D/32 blocks.
* ``"sequence"``: 32-token blocks inside each sequence (never crossing a sequence boundary; a
  partial last block is zero-padded for the amax). Scale matrix per head: rows = D channels,
  sequence ``b``'s blocks start at column ``(offsets[b] // 128 + b) * 4`` (``padded_total / 32``
  columns).

Each head's matrix is stored cut into 128x4 tiles (``scale_layout``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import mx_format
from .mx_format import BLOCK_SIZE
from .offsets import (
    check_offsets_facts,
    check_offsets_type,
    known_valid,
    offsets_facts,
    padded_rows_of_tokens,
    padded_total,
    sequence_ids,
    skip_value_check,
    validate_offsets,
    value_checks,
)
from .scale_layout import TILE_COLS, from_tiles, num_tiles, tiled_bytes

AXES = ("feature", "sequence")
HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MXFP8Jagged:
    """A jagged MXFP8 tensor. Made from raw tensors it checks them (:func:`check_mxfp8`): NaN bytes
    included, one pass over data and scales and one wait for the device, skipped under
    ``value_checks(False)``; the quantizers of this package make theirs without that pass.

    Attributes:
        data: float8_e4m3fn, ``[total, heads, D]`` or ``[total, D]`` (the input's shape).
        scales: float8_e8m0fnu, ``[heads, tiled bytes]`` (one implicit head for 2-D data).
        offsets: int32/int64 ``[B + 1]``.
        axis: ``"feature"`` or ``"sequence"``.
        rounding: ``"rceil"`` or ``"floor"`` (how the scales were chosen).
    """

    data: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    axis: str
    rounding: str = "rceil"

    def __post_init__(self):
        check_mxfp8(self)

    @property
    def total(self) -> int:
        return self.data.shape[0]

    @property
    def num_heads(self) -> int:
        return self.data.shape[1] if self.data.dim() == 3 else 1

    @property
    def head_dim(self) -> int:
        return self.data.shape[-1]

    @property
    def batch_size(self) -> int:
        return self.offsets.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.data.device

    def scale_matrix_shape(self) -> tuple[int, int]:
        """(rows, columns) of each head's scale matrix before tiling."""
        return scale_matrix_shape(self.axis, self.total, self.batch_size, self.head_dim)

    def scale_col_tiles(self) -> int:
        """Tiles per row of tiles in each head's scale buffer."""
        return scale_col_tiles(self.axis, self.total, self.batch_size, self.head_dim)

    def scale_matrix(self) -> torch.Tensor:
        """uint8 ``[heads, rows, columns]``: the scale bytes untiled (padding rows/columns kept)."""
        return from_tiles(self.scales.view(torch.uint8), *self.scale_matrix_shape())

    def dequantize(self) -> torch.Tensor:
        """float32 tensor shaped like ``data``: every element times its block's scale."""
        return dequantize_mxfp8(self)

    def to(self, device) -> "MXFP8Jagged":
        return mxfp8_without_value_checks(
            self.data.to(device), self.scales.to(device), self.offsets.to(device), self.axis, self.rounding
        )


def mxfp8_without_value_checks(data, scales, offsets, axis: str, rounding: str = "rceil") -> MXFP8Jagged:
    """An MXFP8Jagged of parts whose values need no reading: offsets already validated, bytes from
    this package's quantizers (whose inputs are checked for NaN/Inf, or flagged for the caller to
    check) or from another MXFP8Jagged. Dtypes and shapes are checked; no pass over the data, no
    wait for the device. ``scales``: float8_e8m0fnu, or their uint8 bytes (viewed as such); E8M0
    scales are kept as the very tensor given, which the Hopper forms kept across calls are stamped with
    (``jagged_attn/kernels/common/reuse.py``): a new view per call would rebuild them every time."""
    if scales.dtype == torch.uint8:
        scales = scales.view(torch.float8_e8m0fnu)
    with value_checks(False):
        return MXFP8Jagged(data, scales, offsets, axis, rounding)


def scale_matrix_shape(axis: str, total: int, batch: int, head_dim: int) -> tuple[int, int]:
    """(rows, columns) of one head's scale matrix for the given axis."""
    if axis == "feature":
        return padded_total(total, batch), head_dim // BLOCK_SIZE
    return head_dim, padded_total(total, batch) // BLOCK_SIZE


def scale_col_tiles(axis: str, total: int, batch: int, head_dim: int) -> int:
    """Tiles per row of tiles in one head's scale buffer (the ``n_col_tiles`` of ``scale_byte_offset``)."""
    return num_tiles(scale_matrix_shape(axis, total, batch, head_dim)[1], TILE_COLS)


def check_data_shape(shape: tuple, name: str) -> None:
    """ValueError unless ``shape`` is ``[total, (heads,) D]`` with heads > 0 and D a positive multiple of
    32. (D = 0 or no heads: a data tensor of no bytes, which could claim any number of tokens.)"""
    if len(shape) not in (2, 3) or shape[-1] == 0 or shape[-1] % BLOCK_SIZE or (len(shape) == 3 and shape[1] == 0):
        raise ValueError(f"{name} must be [total, (heads > 0,) D] with D a positive multiple of 32, got {shape}")


def check_mxfp8(mx: MXFP8Jagged, name: str = "mx") -> None:
    """Validate the fields of an MXFP8Jagged: dtypes, shapes, devices and, unless ``value_checks(False)``,
    values: offsets (as :func:`validate_offsets`) and NaN bytes in data (e4m3fn 0x7F / 0xFF) or scales
    (E8M0 0xFF), all read in one wait for the device. NaN bytes would make attention rows silently 0."""
    if mx.axis not in AXES:
        raise ValueError(f"{name}.axis must be one of {AXES}, got {mx.axis!r}")
    mx_format.check_rounding(mx.rounding)
    if mx.data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}.data must be float8_e4m3fn, got {mx.data.dtype}")
    if mx.scales.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"{name}.scales must be float8_e8m0fnu, got {mx.scales.dtype}")
    check_data_shape(tuple(mx.data.shape), f"{name}.data")
    check_offsets_type(mx.offsets, f"{name}.offsets")
    heads = mx.data.shape[1] if mx.data.dim() == 3 else 1
    rows, cols = scale_matrix_shape(mx.axis, mx.data.shape[0], mx.offsets.numel() - 1, mx.data.shape[-1])
    expected = (heads, tiled_bytes(rows, cols))
    if tuple(mx.scales.shape) != expected:
        raise ValueError(f"{name}.scales must have shape {expected}, got {tuple(mx.scales.shape)}")
    if not (mx.data.device == mx.scales.device == mx.offsets.device):
        raise ValueError(f"{name}: data, scales and offsets must be on one device")
    if skip_value_check(mx.data):
        return
    total = mx.data.shape[0]
    offsets_unknown = not known_valid(mx.offsets, total)
    facts = torch.cat([nan_byte_flags(mx.data, mx.scales)]
                      + ([offsets_facts(mx.offsets)] if offsets_unknown else [])).tolist()  # the one wait
    if offsets_unknown:
        check_offsets_facts(mx.offsets, total, f"{name}.offsets", facts[2:])
    if facts[0]:
        raise ValueError(f"{name}.data holds NaN (float8_e4m3fn bytes 0x7F / 0xFF)")
    if facts[1]:
        raise ValueError(f"{name}.scales holds NaN (float8_e8m0fnu byte 0xFF)")


def nan_byte_flags(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int64 ``[2]`` on the tensors' device, formed without waiting: whether e4m3fn ``data`` holds a
    NaN byte (0x7F: the largest int8, 0xFF: the largest uint8) and whether E8M0 ``scales`` holds one
    (0xFF). Reductions only, no temporaries the size of the data."""
    flags = [torch.zeros((), dtype=torch.bool, device=data.device)] * 2
    if data.numel():
        flags[0] = (data.view(torch.int8).amax() == mx_format.E4M3_NAN_BITS) | (
            data.view(torch.uint8).amax() == 0x80 | mx_format.E4M3_NAN_BITS)
    if scales.numel():
        flags[1] = scales.view(torch.uint8).amax() == mx_format.E8M0_NAN
    return torch.stack(flags).to(torch.int64)


def check_values(values, name: str = "values", *, finite: bool = True) -> None:
    """Validate a high-precision jagged values tensor (``finite``: also scan it for NaN/Inf)."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    if values.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {values.dtype}")
    if values.dim() not in (2, 3):
        raise ValueError(f"{name} must be [total, heads, D] or [total, D], got shape {tuple(values.shape)}")
    if values.shape[-1] == 0 or values.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"{name}: the last dimension (D = {values.shape[-1]}) must be a positive multiple of 32")
    if finite and not skip_value_check(values) and values.numel():
        check_finite(values, name)


def max_magnitude(x: torch.Tensor) -> torch.Tensor:
    """0-dim tensor on ``x``'s device, formed without waiting for it: the largest ``|x|`` (0 if empty),
    NaN or Inf where ``x`` holds one (both propagate through the reduction). One read of ``x``
    (``isfinite(x).all()`` takes four)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.linalg.vector_norm(x, float("inf"))


def nonfinite_error(name: str) -> ValueError:
    return ValueError(f"{name} contains NaN or Inf: MX block scales are undefined for non-finite values")


def check_finite(x: torch.Tensor, name: str) -> None:
    """Raise unless ``x`` is all finite (a tensor, or its block maxima: NaN and Inf propagate into them)."""
    if not skip_value_check(x) and not math.isfinite(max_magnitude(x)):
        raise nonfinite_error(name)


def largest_magnitudes(tensors) -> torch.Tensor:
    """float64 ``[len(tensors)]`` of their :func:`max_magnitude`, formed without waiting."""
    return torch.stack([max_magnitude(x).to(torch.float64) for x in tensors])


def checked_after(magnitudes: torch.Tensor | None, names, run):
    """``run()``, with the NaN/Inf check of the inputs whose largest magnitudes (a float tensor, one per
    name, NaN or Inf where an input holds one; None: no check) are being formed, read once ``run`` has
    queued the kernels that read them: raises ValueError naming the first non-finite one. NaN/Inf cannot
    send a kernel out of bounds, so the check need not come first. The magnitudes go to pinned host
    memory in a copy queued behind what forms them, and the host waits for that copy alone, not for the
    kernels queued after it (a wait drains the GPU's queue, which then idles while the host launches
    what follows; docs/perf-history.md)."""
    if magnitudes is None:
        return run()
    copied = None
    if magnitudes.is_cuda:
        device = magnitudes.device
        magnitudes = magnitudes.to("cpu", non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(device))  # the copy's stream, whichever device is current
    result = run()
    if copied is not None:
        copied.synchronize()
    for name, magnitude in zip(names, magnitudes.tolist()):
        if not math.isfinite(magnitude):
            raise nonfinite_error(name)
    return result


def as_3d(x: torch.Tensor) -> torch.Tensor:
    """``[total, D]`` values as ``[total, 1, D]``; ``[total, H, D]`` as they are."""
    return x if x.dim() == 3 else x.unsqueeze(1)


def sequence_block_columns(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """int64 ``[total]``: the sequence-axis scale column of each token."""
    return padded_rows_of_tokens(offsets, sequence_ids(offsets, total)) // BLOCK_SIZE


def element_scale_bytes(mx: MXFP8Jagged) -> torch.Tensor:
    """int64 ``[total, heads, D]``: the E8M0 byte that scales each element of ``mx.data``."""
    matrix = mx.scale_matrix().to(torch.int64)  # [H, rows, cols]
    total = mx.total
    if mx.axis == "feature":
        token_rows = padded_rows_of_tokens(mx.offsets, sequence_ids(mx.offsets, total))
        per_block = matrix[:, token_rows, :].permute(1, 0, 2)  # [total, H, D/32]
        return per_block.repeat_interleave(BLOCK_SIZE, dim=2)
    columns = sequence_block_columns(mx.offsets, total)
    return matrix[:, :, columns].permute(2, 0, 1)


def dequantize_mxfp8(mx: MXFP8Jagged) -> torch.Tensor:
    """float32 values shaped like ``mx.data``: every element times its block's scale. Values beyond
    float32's range (2^128: rceil rounds bf16/fp32 values from 248 * 2^120 ~ 3.3e38 up to it) are
    saturated to +-3.4028e38; NaN bytes give NaN. ``mx.offsets`` written in place since it was checked
    are checked again (ValueError)."""
    if not isinstance(mx, MXFP8Jagged):
        raise TypeError(f"mx must be an MXFP8Jagged, got {type(mx).__name__}")
    validate_offsets(mx.offsets, mx.total, "mx.offsets")
    values = as_3d(mx.data).to(torch.float32) * mx_format.descale_factors(element_scale_bytes(mx))
    return mx_format.saturating_cast(values, torch.float32).reshape(mx.data.shape)
