"""Benchmark: the backward's dO producer (``hopper_bwd._quantize`` with Delta: one launch of
``_producer_kernel``) in every work split, against a device copy of the same bytes in the same run.

Input: dense 8 x 8192 tokens, 16 heads, d128, bf16 dO and O, fp32 LSE (random, fixed seed; the
kernel is memory-bound, the values do not matter). GB/s counts each byte once: dO and O read, e4m3
dO written in both layouts, the LSE read, and per (token, head) the token scale, Delta and lse2
written; the copy reads and writes that many bytes in all. Each split's outputs are checked against
the default split's (bit for bit; Delta, summed in another order, to rounding). Then the default split
on a GQA problem (each sequence-axis scale shared by 4 heads), without the sequence-axis copy
(each unit read once, no maxima: what they cost) and on ragged lengths (uniform in [1, 4096],
as many tokens). Median of ``triton.testing.do_bench``; the times include the
producer's allocations and the zeroing of its workspace, as in the backward.

    python3 scripts/bench_bwd_producer.py [--batch 8] [--length 8192] [--heads 16] [--dim 128]

Finishes in well under 60 s on an H200 (most of it compiling the splits); prints a table last
(``*``: the default split, ``<``: the fastest).
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import triton
from bench_rmsnorm_quantize import copy_ms, median_ms, nbytes, ragged_offsets
from jagged_attn.kernels import hopper_bwd

from jagged_attn.offsets import max_length, offsets_from_lengths

TARGET = 0.70  # of the copy's GB/s (issue #4)
TILES_AND_WARPS = ((32, 4), (32, 8), (64, 4), (64, 8))
GROUPS_SIDE_BY_SIDE = (1, 4)
PROGRAMS_PER_SM = (2, 3, 4)
GQA_GROUP = 4
DEFAULT = hopper_bwd.ProducerConfig()


def produce(dout, out, lse, offsets, max_len, config=DEFAULT, group=1, sequence=True):
    return hopper_bwd._quantize(dout, offsets, max_len, feature=True, sequence=sequence, group=group, out=out,
                                lse=lse, config=config)


def counted_bytes(dout, out, lse, outputs) -> int:
    """Bytes the producer moves at least (the sequence-axis copy counted without its padding)."""
    result, delta, lse2 = outputs
    e4m3_copies = (1 if result.sequence is None else 2) * dout.numel()
    return nbytes(dout, out, lse, result.feature_scale, result.sequence_scale, delta, lse2) + e4m3_copies


def same_outputs(outputs, expected, columns) -> bool:
    """Bit for bit the same (Delta: to rounding, its sums run in another order)."""
    (result, delta, lse2), (want, want_delta, want_lse2) = outputs, expected
    pairs = [(result.feature, want.feature), (result.feature_scale, want.feature_scale),
             (result.sequence[..., columns], want.sequence[..., columns]),
             (result.sequence_scale, want.sequence_scale), (lse2, want_lse2)]
    identical = all(torch.equal(got.view(torch.uint8), ref.view(torch.uint8)) for got, ref in pairs)
    return identical and torch.allclose(delta, want_delta, rtol=1e-5, atol=1e-4)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    started = time.perf_counter()
    torch.manual_seed(0)
    tokens = args.batch * args.length
    dout, out = (torch.randn(tokens, args.heads, args.dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lse = torch.randn(tokens, args.heads, device="cuda")
    tensors = (dout, out, lse)
    dense = offsets_from_lengths(torch.full((args.batch,), args.length)).to("cuda", torch.int32)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"dO, O bf16 {tuple(dout.shape)}, {nbytes(dout) / 2**20:.0f} MiB each")

    dense_len, columns = max_length(dense), hopper_bwd._written_columns(dense)
    expected = produce(*tensors, dense, dense_len)
    moved = counted_bytes(*tensors, expected)
    copy = moved / copy_ms(moved) / 1e6
    rows = [("device copy of as many bytes", moved / copy / 1e6, copy)]
    for (tile, warps), side_by_side, per_sm in itertools.product(TILES_AND_WARPS, GROUPS_SIDE_BY_SIDE, PROGRAMS_PER_SM):
        config = hopper_bwd.ProducerConfig(tile, warps, side_by_side, per_sm)
        same = same_outputs(produce(*tensors, dense, dense_len, config), expected, columns)
        ms = median_ms(lambda c=config: produce(*tensors, dense, dense_len, c))
        marker = ("*" if config == DEFAULT else "") + ("" if same else " OUTPUTS DIFFER")
        name = f"tile {tile:3d}, {warps} warps, {side_by_side} side by side, {per_sm}/SM{marker}"
        rows.append((name, ms, moved / ms / 1e6))
    fastest = max(range(1, len(rows)), key=lambda i: rows[i][2])
    rows[fastest] = (rows[fastest][0] + " <", *rows[fastest][1:])

    gqa_moved = counted_bytes(*tensors, produce(*tensors, dense, dense_len, group=GQA_GROUP))
    gqa_ms = median_ms(lambda: produce(*tensors, dense, dense_len, group=GQA_GROUP))
    rows.append((f"GQA, scales shared by {GQA_GROUP} heads, default split", gqa_ms, gqa_moved / gqa_ms / 1e6))
    # Diagnostic: without the sequence-axis copy the kernel reads each unit once and folds no maxima.
    single_moved = counted_bytes(*tensors, produce(*tensors, dense, dense_len, sequence=False))
    single_ms = median_ms(lambda: produce(*tensors, dense, dense_len, sequence=False))
    rows.append(("without the sequence-axis copy, default split", single_ms, single_moved / single_ms / 1e6))
    ragged = ragged_offsets(tokens, "cuda")
    ragged_len = max_length(ragged)
    ragged_moved = counted_bytes(*tensors, produce(*tensors, ragged, ragged_len))
    ragged_ms = median_ms(lambda: produce(*tensors, ragged, ragged_len))
    rows.append((f"ragged, {ragged.numel() - 1} sequences, default split", ragged_ms, ragged_moved / ragged_ms / 1e6))

    print(f"\n{'dO producer (dense unless said)':58s} {'us':>8s} {'GB/s':>6s} {'of copy':>8s}  (target {TARGET:.0%})")
    for name, ms, rate in rows:
        print(f"{name:58s} {ms * 1e3:8.1f} {rate:6.0f} {rate / copy:8.0%}")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
