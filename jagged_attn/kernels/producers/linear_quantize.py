"""Linear + quantize: a Triton GEMM whose epilogue emits MXFP8 (feature axis) with tiled scales.

``linear_quantize`` computes the Q, K or V projection ``y = x @ weight.T (+ bias)`` of a jagged
batch and, in the same kernel, quantizes ``y`` along each head's D channels into an
``MXFP8Jagged`` ``[total, heads, D]`` whose scales sit in the jagged tile layout
(``scale_layout``, placement ``offsets.padded_seq_start``), ready for the attention kernels.

Rounding contract (what makes the result bit-exact): the fp32 accumulator plus the fp32 bias is
rounded once to bf16 (round to nearest even) giving ``y``; the MXFP8 result is then exactly
``quantize_mxfp8(y.view(total, heads, D), offsets, rounding=rounding)``: the kernel quantizes the
bf16 values it stores, by ``jagged_attn/kernels/producers/quantize.py``'s block rule. ``y`` itself matches
``x @ weight.T + bias`` up to the order of the fp32 accumulation.

The attention output ``[total, Hq, D]`` bf16 is already the out projection's operand
(``out.flatten(-2)``), so a bf16 out projection needs no producer kernel.

Tiling: one program per ``BLOCK_M x BLOCK_N`` tile of ``y`` in grouped order (``GROUP_M`` row
tiles share the weight columns they read while those are in L2); TMA tensor-descriptor loads of
``x`` and ``weight`` feed bf16 ``tl.dot`` (wgmma on sm_90) in a ``num_stages`` pipeline. Row
tiles run over tokens regardless of sequence boundaries (no work wasted on padding); the
epilogue finds each row's sequence by a branch-free binary search of ``offsets``. A tile holds
whole 32-channel blocks (``BLOCK_N`` is a multiple of 128, and D is 32, 64 or a multiple of 128),
so it reduces its blocks alone. The scale bytes of a token for one head's four consecutive
blocks are four consecutive bytes of a tile, so the epilogue stores them as one 32-bit word
(zero-padded when D < 128). ``batch`` extra programs write zero words to the scale rows no token
maps to, so every scale byte is written once and nothing is cleared first.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from jagged_attn import mx_format
from jagged_attn.mxfp8 import MXFP8Jagged, check_finite, mxfp8_without_value_checks, scale_matrix_shape
from jagged_attn.offsets import validate_offsets
from jagged_attn.scale_layout import TILE_COLS, TILE_ROWS, tiled_bytes

from ..common import fp8, layout
from ..common.interpreter import INTERPRETED
from .quantize import block_scale_bytes, flag_nonfinite

# Kernel constants (Triton reads module globals only when they are constexpr).
WORD_CHANNELS = tl.constexpr(TILE_COLS * mx_format.BLOCK_SIZE)  # 128 channels: the 4 scale bytes of one word
TILE_WORDS = tl.constexpr(TILE_ROWS * TILE_COLS // 4)  # 32-bit words per 512-byte scale tile
MAX_PADDING_ROWS = tl.constexpr(2 * TILE_ROWS)  # a sequence leaves fewer than 256 scale rows without a token
TMA_ALIGNMENT = 16  # bytes: TMA needs 16-byte-aligned bases and row strides


class Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}-w{self.num_warps}-s{self.num_stages}"


# The first is the default; the benchmark times them all. 128x256x64 on 8 warps (two consumer
# warpgroups of 64 rows) is the usual best bf16 tile on Hopper: 3 stages of 48 KiB fit in shared
# memory with room for the epilogue. The others trade tile size for occupancy.
CONFIGS = (
    Config(128, 256, 64, 8, num_warps=8, num_stages=3),
    Config(128, 256, 64, 8, num_warps=8, num_stages=4),
    Config(128, 128, 64, 8, num_warps=4, num_stages=4),
    Config(128, 128, 64, 8, num_warps=8, num_stages=3),
)


@triton.jit
def scale_words(byte, BLOCK_M: tl.constexpr, WORDS: tl.constexpr, BLOCKS_PER_WORD: tl.constexpr):
    """int32 ``[BLOCK_M, WORDS]``: each run of ``BLOCKS_PER_WORD`` bytes of ``byte`` packed
    little-endian into one word (a tile row's four columns; missing columns are zero)."""
    byte = tl.reshape(byte.to(tl.uint32), (BLOCK_M, WORDS, BLOCKS_PER_WORD))
    shift = 8 * tl.arange(0, BLOCKS_PER_WORD)
    return tl.sum(byte << shift[None, None, :], axis=2).to(tl.int32, bitcast=True)


@triton.jit
def zero_padding_rows(offsets, total, scale_words_, seq, heads, words_per_head, N_COL_TILES: tl.constexpr):
    """Zero words for the scale rows of sequence ``seq`` that no token maps to, in every head."""
    start, length = layout.sequence_span(offsets, seq, total)
    first = layout.padded_seq_start(start, seq) + length
    end = layout.padded_seq_start(start + length, seq + 1)
    row = first + tl.arange(0, MAX_PADDING_ROWS)
    word = layout.scale_byte_offset(row, 0, N_COL_TILES) // 4  # (row, column tile 0) of head 0
    for head in range(heads):
        for col_tile in tl.static_range(N_COL_TILES):
            where = head * words_per_head + word + col_tile * TILE_WORDS
            tl.store(scale_words_ + where, tl.zeros_like(row).to(tl.int32), mask=row < end)


@triton.jit
def _linear_kernel(
    x_desc,
    w_desc,
    bias,
    y,
    data,
    scale_words_,
    offsets,
    nonfinite,
    total,
    n_features,
    batch,
    search_steps,
    words_per_head,
    HAS_BIAS: tl.constexpr,
    STORE_Y: tl.constexpr,
    QUANTIZE: tl.constexpr,
    D: tl.constexpr,
    FLOOR: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(total, BLOCK_M)
    n_tiles = tl.cdiv(n_features, BLOCK_N)
    word_channels: tl.constexpr = min(WORD_CHANNELS, D)
    n_col_tiles: tl.constexpr = (D + WORD_CHANNELS - 1) // WORD_CHANNELS
    if pid < m_tiles * n_tiles:
        # Grouped order: GROUP_M row tiles sweep the column tiles together.
        tiles_per_group = GROUP_M * n_tiles
        first_m = pid // tiles_per_group * GROUP_M
        group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
        tile_m = first_m + pid % tiles_per_group % group_rows
        tile_n = pid % tiles_per_group // group_rows
        k_features = x_desc.shape[1]
        # The launcher guarantees a non-empty K loop. Without the hint ptxas also zeroes the
        # accumulator on the path that skips the loop and then serializes the wgmmas (C7515).
        tl.assume(k_features > 0)

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_features, BLOCK_K):
            a = x_desc.load([tile_m * BLOCK_M, k])
            b = w_desc.load([tile_n * BLOCK_N, k])
            if INTERPRET:  # Triton 3.6's interpreter multiplies bf16 bit patterns as integers
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b.T, acc)

        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            acc += tl.load(bias + cols, mask=cols < n_features).to(tl.float32)[None, :]
        y_tile = fp8.rounded_to(acc, tl.bfloat16, INTERPRET).to(tl.bfloat16)
        inside = (rows < total)[:, None] & (cols < n_features)[None, :]
        element = rows.to(tl.int64)[:, None] * n_features + cols[None, :]
        if STORE_Y:
            tl.store(y + element, y_tile, mask=inside)
        if QUANTIZE:
            blocks = tl.reshape(y_tile.to(tl.float32), (BLOCK_M, BLOCK_N // 32, 32))
            byte, amax = block_scale_bytes(blocks, (2,), FLOOR, INTERPRET)
            e4m3 = fp8.to_e4m3(blocks * layout.scale_factor(byte)[:, :, None], INTERPRET)
            tl.store(data + element, tl.reshape(e4m3, (BLOCK_M, BLOCK_N)), mask=inside)

            # Scales: one word per (token, head, 128 channels) at the token's row of the padded buffer.
            words: tl.constexpr = BLOCK_N // word_channels
            word = scale_words(byte, BLOCK_M, words, word_channels // 32)
            channel = tile_n * BLOCK_N + word_channels * tl.arange(0, words)
            head_word = (channel // D) * words_per_head + (channel % D) // WORD_CHANNELS * TILE_WORDS
            padded_rows = layout.padded_rows_of(rows, offsets, batch, search_steps, total)
            row_word = layout.scale_byte_offset(padded_rows, 0, n_col_tiles) // 4
            word_inside = (rows < total)[:, None] & (channel < n_features)[None, :]
            tl.store(scale_words_ + row_word[:, None] + head_word[None, :], word, mask=word_inside)

            # Flag a non-finite block maximum without reducing the tile: the mask is almost always all false.
            flag_nonfinite(nonfinite, amax)
    elif QUANTIZE:  # the ``batch`` programs after the tiles
        zero_padding_rows(offsets, total, scale_words_, pid - m_tiles * n_tiles, n_features // D, words_per_head,
                          n_col_tiles)


def _check_operands(x, weight, bias):
    """Validate the GEMM operands (``ValueError``/``TypeError``)."""
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{name} must be bfloat16, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    in_features = x.shape[1]
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one output feature")
    if weight.shape[1] != in_features:
        raise ValueError(f"weight must be [out_features, {in_features}] (x's in_features), got {tuple(weight.shape)}")
    if in_features == 0 or in_features * x.element_size() % TMA_ALIGNMENT:
        raise ValueError(f"in_features must be a positive multiple of 8 (TMA row alignment), got {in_features}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"bias must be a bfloat16 or float32 tensor, got {getattr(bias, 'dtype', type(bias))}")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if any(t.device != x.device for t in (weight, bias) if t is not None):
        raise ValueError("x, weight and bias must be on one device")


def _check_head_dim(out_features, heads) -> int:
    if not isinstance(heads, int) or heads < 1 or out_features % heads:
        raise ValueError(f"heads must be a positive int dividing out_features ({out_features}), got {heads!r}")
    dim = out_features // heads
    if dim not in (32, 64) and (dim == 0 or dim % WORD_CHANNELS.value):
        raise ValueError(f"head dim (out_features / heads = {dim}) must be 32, 64 or a multiple of 128")
    return dim


def _tma_operand(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % TMA_ALIGNMENT == 0 else t.clone()


def launch(x, weight, bias, y, data, scales, offsets, nonfinite, dim, rounding, config):
    """Run the kernel on validated inputs into preallocated outputs (no checks, no host syncs).

    ``y``: bf16 ``[total, out_features]`` or None; ``data`` (e4m3 like ``y``), ``scales`` (uint8
    ``[heads, tiled bytes]``), ``offsets`` and ``nonfinite`` (fp32 ``[1]`` holding 0): all None for
    the plain GEMM. ``dim``: the head dim D.
    """
    total, n_features = x.shape[0], weight.shape[0]
    quantize = data is not None
    if total == 0:  # nothing to multiply (TMA needs a non-empty tensor): every scale byte is padding
        if quantize:
            scales.zero_()
        return
    batch = offsets.numel() - 1 if quantize else 0
    x_desc = TensorDescriptor.from_tensor(_tma_operand(x), [config.block_m, config.block_k])
    w_desc = TensorDescriptor.from_tensor(_tma_operand(weight), [config.block_n, config.block_k])
    tiles = triton.cdiv(total, config.block_m) * triton.cdiv(n_features, config.block_n)
    _linear_kernel[(tiles + batch,)](
        x_desc,
        w_desc,
        None if bias is None else bias.contiguous(),
        y,
        data,
        None if scales is None else scales.view(torch.int32),
        offsets,
        nonfinite,
        total,
        n_features,
        batch,
        batch.bit_length(),
        0 if scales is None else scales.shape[1] // 4,
        HAS_BIAS=bias is not None,
        STORE_Y=y is not None,
        QUANTIZE=quantize,
        D=dim,
        FLOOR=rounding == "floor",
        INTERPRET=INTERPRETED,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def linear_quantize(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    *,
    heads: int,
    bias: torch.Tensor | None = None,
    rounding: str = "rceil",
    return_high_precision: bool = True,
    nonfinite: torch.Tensor | None = None,
    config: Config = CONFIGS[0],
) -> tuple[MXFP8Jagged, torch.Tensor | None]:
    """Project a jagged batch and quantize the result to MXFP8 in one kernel.

    ``x``: bf16 ``[total, in_features]`` (in_features a multiple of 8), the tokens of a jagged
    batch with ``offsets`` (int32/int64 ``[B + 1]``). ``weight``: bf16 ``[heads * D, in_features]``
    (``nn.Linear`` layout), D = 32, 64 or a multiple of 128. ``bias``: optional bf16/fp32
    ``[heads * D]``. Returns ``(mx, y)``: ``mx`` the feature-axis ``MXFP8Jagged`` ``[total, heads,
    D]`` of ``y``, bit-identical to ``quantize_mxfp8(y, offsets, rounding=rounding)``; ``y`` bf16
    ``[total, heads, D]`` = bf16(fp32 ``x @ weight.T`` + bias), or None unless
    ``return_high_precision``. Non-finite results raise ``ValueError`` (a wait for the device), or,
    given ``nonfinite`` (fp32 ``[1]`` holding 0), are flagged there (NaN/Inf afterwards) for the caller
    to check with its other checks. ``config``: a tile configuration (``CONFIGS``).
    """
    _check_operands(x, weight, bias)
    total, dim = x.shape[0], _check_head_dim(weight.shape[0], heads)
    mx_format.check_rounding(rounding)
    validate_offsets(offsets, total, "offsets")
    if offsets.device != x.device:
        raise ValueError(f"offsets is on {offsets.device} but x is on {x.device}")
    offsets = offsets.contiguous()
    batch = offsets.numel() - 1
    data = torch.empty(total, heads, dim, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(
        heads, tiled_bytes(*scale_matrix_shape("feature", total, batch, dim)), dtype=torch.uint8, device=x.device
    )
    y = torch.empty(total, heads, dim, dtype=torch.bfloat16, device=x.device) if return_high_precision else None
    flag = torch.zeros(1, dtype=torch.float32, device=x.device) if nonfinite is None else nonfinite
    launch(x, weight, bias, y, data, scales, offsets, flag, dim, rounding, config)
    if nonfinite is None:
        check_finite(flag, "x @ weight.T + bias")
    mx = mxfp8_without_value_checks(data, scales, offsets, "feature", rounding)
    return mx, y


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, config: Config = CONFIGS[0]
) -> torch.Tensor:
    """bf16 ``x @ weight.T (+ bias)`` ``[total, out_features]`` by the same kernel without the
    quantizing epilogue: the baseline ``linear_quantize`` is measured against."""
    _check_operands(x, weight, bias)
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16, device=x.device)
    launch(x, weight, bias, y, None, None, None, None, WORD_CHANNELS.value, "rceil", config)
    return y
