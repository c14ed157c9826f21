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

import functools
import math
from dataclasses import dataclass

import torch

from . import mx_format
from .devices import on_device_of
from .jagged import split_heads, unpack_jagged
from .mx_format import BLOCK_SIZE
from .offsets import (
    check_offsets_facts,
    check_offsets_type,
    known_valid,
    offsets_facts,
    padded_rows_of_tokens,
    padded_total,
    sequence_ids,
    single_sequence_offsets,
    skip_value_check,
    validate_offsets,
    value_checks,
    values_unavailable,
)
from .scale_layout import TILE_COLS, from_tiles, num_tiles, tiled_bytes, to_tiles

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
    (``kernels/common/reuse.py``): a new view per call would rebuild them every time."""
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
    (``isfinite(x).all()`` took four passes, 0.5 ms per bf16 [65536, 16, 128] tensor on an H200)."""
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
    what follows: reading the check after the kernels took 0.25-0.68 ms off an H200 training step,
    docs/perf-history.md v16)."""
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


EAGER_CHUNK_VALUES = 1 << 24  # input values per chunk of the CPU quantizers (float32 temporaries: 64 MiB)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 3 else x.unsqueeze(1)


def quantize_mxfp8(values, offsets=None, *, axis: str = "feature", rounding: str = "rceil",
                   compile: bool = False, heads: int | None = None) -> MXFP8Jagged:
    """Quantize jagged ``values`` (``[total, heads, D]`` or ``[total, D]``) to MXFP8.

    ``values`` may also come in the containers ``jagged_attention`` takes (a JaggedTensor, a jagged
    nested tensor, fbgemm's ``(values, [offsets])`` pair, an object with ``.values()`` and
    ``.offsets()``), whose offsets are used unless ``offsets`` is given; ``heads=H`` reads 2-D
    ``[total, H * D]`` values as ``[total, H, D]``. ``offsets=None`` for a bare tensor treats it as one
    sequence. ``axis="feature"`` puts the 32-blocks along D (for Q and K in S = QK^T),
    ``axis="sequence"`` along each sequence's tokens (for V in O = PV). ``compile=True`` runs the
    element work through ``torch.compile`` (one fused pass, about 10x faster on large CPU inputs,
    bit-identical; the first call compiles). CUDA tensors always go through the fused Triton kernel
    (``kernels/producers/quantize.py``, bit-identical). Raises ValueError/TypeError on bad input before any work.
    """
    if axis not in AXES:
        raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
    (mx,) = _quantize_axes(values, offsets, (axis,), rounding, compile, heads=heads)
    return mx


def quantize_flagging_nonfinite(values, offsets, axis: str, nonfinite: torch.Tensor) -> MXFP8Jagged:
    """:func:`quantize_mxfp8` (rceil) whose NaN/Inf check is left to the caller: NaN or Inf in ``values``
    sets ``nonfinite`` (fp32 ``[1]`` holding 0) instead of raising, so nothing waits for the device
    (:func:`checked_after` reads it once later kernels are queued)."""
    (mx,) = _quantize_axes(values, offsets, (axis,), "rceil", False, nonfinite)
    return mx


def quantize_mxfp8_dual(values, offsets=None, *, rounding: str = "rceil",
                        heads: int | None = None) -> tuple[MXFP8Jagged, MXFP8Jagged]:
    """Both layouts of one tensor, ``(feature-axis, sequence-axis)`` MXFP8Jagged, as two
    :func:`quantize_mxfp8` calls would give them; on CUDA one read of ``values`` makes both."""
    return _quantize_axes(values, offsets, AXES, rounding, False, heads=heads)


def _quantize_axes(values, offsets, axes, rounding, compile, nonfinite=None, *, heads=None):
    """The quantizers of ``axes``; NaN/Inf in the block maxima raise, or set ``nonfinite`` if given."""
    values, offsets, _ = unpack_jagged(values, offsets, "values")
    if heads is not None:
        values = split_heads(values, heads, "values")
    check_values(values, "values", finite=False)  # the block maxima are checked instead
    mx_format.check_rounding(rounding)
    total = values.shape[0]
    if offsets is None:
        offsets = single_sequence_offsets(total, values.device)
    validate_offsets(offsets, total, "offsets")
    if offsets.device != values.device:
        raise ValueError(f"offsets is on {offsets.device} but values is on {values.device}")
    x = _as_3d(values)
    if x.is_cuda and not values_unavailable(x):
        results = _quantize_with_kernel(x, offsets, axes, rounding, nonfinite)
    else:
        quantizers = {"feature": _quantize_feature, "sequence": _quantize_sequence}
        results = [quantizers[axis](x, offsets, rounding, compile, nonfinite) for axis in axes]
    return tuple(
        mxfp8_without_value_checks(data.reshape(values.shape), scales, offsets, axis, rounding)
        for axis, (data, scales) in zip(axes, results)
    )


def _quantize_with_kernel(x, offsets, axes, rounding, nonfinite):
    """CUDA tensors: the fused one-pass Triton kernel (bit-identical to the torch reference below)."""
    from .kernels.producers.quantize import quantize_mxfp8_kernel  # imported here: the kernels import this module

    flag = torch.zeros(1, dtype=torch.float32, device=x.device) if nonfinite is None else nonfinite
    with on_device_of(x):
        results = quantize_mxfp8_kernel(x, offsets, axes=axes, rounding=rounding, nonfinite=flag)
    if nonfinite is None:
        check_finite(flag, "values")
    return results


def _check_or_flag(amax: torch.Tensor, nonfinite) -> None:
    """Raise for NaN/Inf in the block maxima ``amax`` (a wait for the device), or, given the fp32 ``[1]``
    flag ``nonfinite``, add a non-finite value to it (nothing otherwise) for the caller to read later,
    as the kernel's flag does."""
    if nonfinite is None:
        check_finite(amax, "values")
    else:
        largest = max_magnitude(amax).reshape(1).to(torch.float32)
        nonfinite.add_(torch.where(torch.isfinite(largest), 0.0, largest))


def _feature_blocks(x, rounding: str):
    """``[T, H, D]`` -> (e4m3 data ``[T, H, D]``, int32 bytes ``[T, H, D/32]``, block maxima)."""
    total, heads, dim = x.shape
    blocks = x.reshape(total, heads, dim // BLOCK_SIZE, BLOCK_SIZE)
    amax = blocks.abs().amax(-1).to(torch.float32)
    byte = mx_format.scale_bytes(amax, rounding)
    data = mx_format.quantize_with_factors(blocks, mx_format.scale_factors(byte).unsqueeze(-1))
    return data.reshape(total, heads, dim), byte, amax


def _sequence_blocks(x, rows, n_columns: int, rounding: str):
    """``[T, H, D]`` + each token's padded row -> (e4m3 data, int32 bytes ``[n_columns, H, D]``, maxima).

    The block maxima come from a zero-padded copy in which every sequence starts at its padded
    row, so 32-token blocks are plain reshapes (1.4x faster than a scatter-max on CPU)."""
    padded = x.new_zeros((n_columns * BLOCK_SIZE, *x.shape[1:]))
    padded[rows] = x
    amax = padded.view(n_columns, BLOCK_SIZE, *x.shape[1:]).abs().amax(1).to(torch.float32)
    byte = mx_format.scale_bytes(amax, rounding)
    return mx_format.quantize_with_factors(x, mx_format.scale_factors(byte)[rows // BLOCK_SIZE]), byte, amax


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def _chunk_rows(x, align: int = 1) -> int:
    """Rows of ``x [T, H, D]`` per chunk of the eager quantizers' element work (a multiple of
    ``align``): their float32 temporaries stay near ``EAGER_CHUNK_VALUES`` values, not the input's size."""
    per_row = x.shape[1] * x.shape[2]
    return max(align, EAGER_CHUNK_VALUES // max(1, per_row) // align * align)


def _quantize_feature(x, offsets, rounding, compile, nonfinite=None):
    total, heads, dim = x.shape
    blocks = _compiled(_feature_blocks) if compile else _feature_blocks
    rows, cols = scale_matrix_shape("feature", total, offsets.numel() - 1, dim)
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    matrix = torch.zeros(heads, rows, cols, dtype=torch.uint8, device=x.device)
    token_rows = padded_rows_of_tokens(offsets, sequence_ids(offsets, total))
    step = _chunk_rows(x)
    for start in range(0, total, step):  # blocks lie within a token: any token range is a chunk
        data[start:start + step], byte, amax = blocks(x[start:start + step], rounding)
        _check_or_flag(amax, nonfinite)
        matrix[:, token_rows[start:start + step], :] = byte.to(torch.uint8).permute(1, 0, 2)
    return data, to_tiles(matrix)


def sequence_block_columns(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """int64 ``[total]``: the sequence-axis scale column of each token."""
    return padded_rows_of_tokens(offsets, sequence_ids(offsets, total)) // BLOCK_SIZE


def _quantize_sequence(x, offsets, rounding, compile, nonfinite=None):
    total, heads, dim = x.shape
    _, cols = scale_matrix_shape("sequence", total, offsets.numel() - 1, dim)
    blocks = _compiled(_sequence_blocks) if compile else _sequence_blocks
    rows = padded_rows_of_tokens(offsets, sequence_ids(offsets, total))
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    byte = torch.zeros(cols, heads, dim, dtype=torch.uint8, device=x.device)
    # Chunks of padded rows, whole 32-token blocks each: the tokens placed in one are a token range,
    # looked up once for all chunks. One chunk needs no lookup (and traced values cannot be read).
    padded_rows, step = cols * BLOCK_SIZE, _chunk_rows(x, BLOCK_SIZE)
    starts = list(range(0, padded_rows, step))
    if len(starts) == 1 or values_unavailable(x):
        starts, tokens = [0], [0, total]
    else:
        tokens = torch.searchsorted(rows, torch.tensor([*starts, padded_rows], device=x.device)).tolist()
    for i, (first_row, last_row) in enumerate(zip(starts, [*starts[1:], padded_rows])):
        first, end = tokens[i], tokens[i + 1]
        if first == end:
            continue  # padding only: its scale bytes stay 0
        column = first_row // BLOCK_SIZE
        data[first:end], chunk_bytes, amax = blocks(x[first:end], rows[first:end] - first_row,
                                                    (last_row - first_row) // BLOCK_SIZE, rounding)
        _check_or_flag(amax, nonfinite)
        byte[column:column + chunk_bytes.shape[0]] = chunk_bytes.to(torch.uint8)
    return data, to_tiles(byte.permute(1, 2, 0))  # [H, D, cols]: rows are the D channels


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
    values = _as_3d(mx.data).to(torch.float32) * mx_format.descale_factors(element_scale_bytes(mx))
    return mx_format.saturating_cast(values, torch.float32).reshape(mx.data.shape)
