"""Quantization of high-precision jagged values to :class:`~jagged_attn.mxfp8.MXFP8Jagged` (the front end).

CUDA tensors go through the fused one-pass Triton kernel (``jagged_attn/kernels/producers/quantize.py``); elsewhere
(and for values torch.compile traces) the torch quantizers here, which are also the kernel's reference:
bit-identical. Both read the MX rounding rule from ``mx_format`` and place the scales as
``mxfp8`` describes.
"""

from __future__ import annotations

import functools

import torch

from . import mx_format
from .devices import on_device_of
from .jagged import split_heads, unpack_jagged
from .kernels.producers.quantize import quantize_mxfp8_kernel
from .mx_format import BLOCK_SIZE
from .mxfp8 import (
    AXES,
    MXFP8Jagged,
    as_3d,
    check_finite,
    check_values,
    max_magnitude,
    mxfp8_without_value_checks,
    scale_matrix_shape,
)
from .offsets import padded_rows_of_tokens, sequence_ids, single_sequence_offsets, validate_offsets, values_unavailable
from .scale_layout import to_tiles


EAGER_CHUNK_VALUES = 1 << 24  # input values per chunk of the CPU quantizers (float32 temporaries: 64 MiB)


def quantize_mxfp8(values, offsets=None, *, axis: str = "feature", rounding: str = "rceil",
                   compile: bool = False, heads: int | None = None) -> MXFP8Jagged:
    """Quantize jagged ``values`` (``[total, heads, D]`` or ``[total, D]``) to MXFP8.

    ``values`` may also come in the containers ``jagged_attention`` takes (a JaggedTensor, a jagged
    nested tensor, fbgemm's ``(values, [offsets])`` pair, an object with ``.values()`` and
    ``.offsets()``), whose offsets are used unless ``offsets`` is given; ``heads=H`` reads 2-D
    ``[total, H * D]`` values as ``[total, H, D]``. ``offsets=None`` for a bare tensor treats it as one
    sequence. ``axis="feature"`` puts the 32-blocks along D (for Q and K in S = QK^T),
    ``axis="sequence"`` along each sequence's tokens (for V in O = PV). ``compile=True`` runs the
    element work through ``torch.compile`` (one fused pass, much faster on large CPU inputs,
    bit-identical; the first call compiles). CUDA tensors always go through the fused Triton kernel
    (``jagged_attn/kernels/producers/quantize.py``, bit-identical). Raises ValueError/TypeError on bad input
    before any work.
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
    x = as_3d(values)
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
    row, so 32-token blocks are plain reshapes (faster than a scatter-max on CPU)."""
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
