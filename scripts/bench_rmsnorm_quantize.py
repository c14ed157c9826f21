"""Benchmark: fused RMSNorm + MXFP8 quantize (jagged_attn/kernels/producers/rmsnorm_quantize.py), every launch
configuration, against a device copy of the same bytes in the same run.

Input: bf16 ``x [total, H, D]`` of at least 1 GiB in ragged sequences (fixed seed). For each set of
axes (feature, sequence, both) and each configuration of ``rmsnorm_quantize.CONFIGS`` it times the
kernel launch (``rms_norm_quantize_into``: slot table + kernel, outputs allocated beforehand) and
reports GB/s of the bytes it moves (x and weight read; normalized, rstd, e4m3 data and scales
written), against ``torch.empty_like(buf).copy_(buf)`` of a uint8 buffer moving the same bytes (half
read, half written). Every configuration's outputs are checked: MXFP8 equal to the quantize kernel's
of the normalized output, normalized and rstd those of the default configuration (within rounding). Also timed, for
scale: the unfused path (torch RMSNorm in fp32, cast, then the quantize kernel) and the public call
of the default configuration (checks, allocation and its NaN check included). Median of
``triton.testing.do_bench``.

    python3 scripts/bench_rmsnorm_quantize.py [--tokens 1048576] [--heads 4] [--dim 128] [--configs all-4w-v8 ...]

Finishes in well under a minute on an H200; prints a short table last (``*``: the default configuration).
"""

from __future__ import annotations

import argparse
import time

import torch
import triton.testing
from jagged_attn.kernels.producers import quantize as qk
from jagged_attn.kernels.producers import rmsnorm_quantize as rq

from jagged_attn.mxfp8 import AXES
from jagged_attn.offsets import offsets_from_lengths

SEED = 2026
MAX_LENGTH = 4096
EPS = 1e-6
AXES_SETS = (("feature",), ("sequence",), AXES)
TARGET = 0.80  # of the copy's GB/s (issue #6)
FP32_SUM_TOLERANCE = 8 * torch.finfo(torch.float32).eps


def ragged_offsets(tokens: int, device) -> torch.Tensor:
    """Lengths uniform in [1, MAX_LENGTH] (fixed seed) summing to exactly ``tokens``."""
    g = torch.Generator().manual_seed(SEED)
    lengths = torch.randint(1, MAX_LENGTH + 1, (4 * tokens // MAX_LENGTH + 1,), generator=g)  # sum ~ 2x tokens
    cumulative = lengths.cumsum(0)
    lengths = lengths[: int((cumulative < tokens).sum()) + 1]
    lengths[-1] -= int(lengths.sum()) - tokens
    return offsets_from_lengths(lengths).to(device=device, dtype=torch.int32)


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, return_mode="median")


def copy_ms(moved_bytes: int) -> float:
    """Median ms of a device-to-device copy that reads and writes ``moved_bytes`` in all."""
    buffer = torch.empty(moved_bytes // 2, dtype=torch.uint8, device="cuda")
    return median_ms(lambda: torch.empty_like(buffer).copy_(buffer))


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2**20)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--configs", nargs="+", default=list(rq.CONFIGS), choices=list(rq.CONFIGS))
    args = parser.parse_args()
    started = time.perf_counter()

    offsets = ragged_offsets(args.tokens, "cuda")
    x = torch.randn(args.tokens, args.heads, args.dim, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(args.dim, device="cuda") * 0.5 + 1).to(torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"x bf16 {tuple(x.shape)} = {nbytes(x) / 2**30:.3f} GiB in {offsets.numel() - 1} sequences")

    rows = []
    for axes in AXES_SETS:
        name = "+".join(axes)
        default = rq.DEFAULT_CONFIG
        outputs = {axis: qk.empty_outputs(x, offsets, axis) for axis in axes}
        normalized, rstd = torch.empty_like(x), torch.empty(x.shape[:2], device="cuda")
        rq.rms_norm_quantize_into(x, weight, offsets, outputs, normalized, rstd, eps=EPS, rounding="rceil",
                                  config=default)
        expected = normalized.clone(), rstd.clone()
        moved = nbytes(x, weight, normalized, rstd, *(t for pair in outputs.values() for t in pair))
        copy = copy_ms(moved)
        rows.append((name, "device copy", copy, moved, copy))
        for config_name in args.configs:
            config = rq.CONFIGS[config_name]
            ms = median_ms(lambda o=outputs, n=normalized, r=rstd, c=config: rq.rms_norm_quantize_into(
                x, weight, offsets, o, n, r, eps=EPS, rounding="rceil", config=c))
            _check(offsets, outputs, normalized, rstd, expected, f"{name}, {config_name}")
            rows.append((name, config_name + ("*" if config == default else ""), ms, moved, copy))

        def unfused(o=outputs):
            y = torch.nn.functional.rms_norm(x.float(), (args.dim,), weight.float(), EPS).to(x.dtype)
            qk.quantize_into(y, offsets, o, "rceil")

        rows.append((name, "torch RMSNorm + quantize", median_ms(unfused), moved, copy))
        public = median_ms(lambda a=axes: rq.rms_norm_quantize(x, weight, offsets, axes=a, eps=EPS))
        rows.append((name, "public call*", public, moved, copy))
        del outputs, normalized, rstd, expected

    print(f"\n{'axes':17s} {'config':24s} {'us':>8s} {'GB moved':>9s} {'GB/s':>6s} {'of copy':>8s}  "
          f"(target {TARGET:.0%})")
    for axes, what, ms, moved, copy in rows:
        rate = moved / ms / 1e6
        print(f"{axes:17s} {what:24s} {ms * 1e3:8.1f} {moved / 1e9:9.3f} {rate:6.0f} {copy / ms:8.0%}")
    print(f"({time.perf_counter() - started:.0f} s)")


def _check(offsets, outputs, normalized, rstd, expected, what):
    """The timed outputs are right (guards the numbers): MXFP8 equal to the quantize kernel's of the
    normalized output; normalized and rstd those of the default configuration, up to the order of the
    sum of squares (a few fp32 units in the last place, so at most one of bf16)."""
    torch.testing.assert_close(rstd, expected[1], rtol=FP32_SUM_TOLERANCE, atol=0, msg=f"{what}: rstd")
    torch.testing.assert_close(normalized.float(), expected[0].float(), rtol=torch.finfo(normalized.dtype).eps, atol=0,
                               msg=f"{what}: normalized")
    for axis, (data, scales) in outputs.items():
        (expected_data, expected_scales), = qk.quantize_mxfp8_kernel(normalized, offsets, axes=(axis,))
        if not (torch.equal(data.view(torch.uint8), expected_data.view(torch.uint8))
                and torch.equal(scales, expected_scales)):
            raise AssertionError(f"{what}: {axis} output differs from quantize_mxfp8(normalized)")


if __name__ == "__main__":
    main()
