"""Benchmark: fused RMSNorm + MXFP8 quantize (kernels/rmsnorm_quantize.py) against a device copy.

Input: bf16 ``x [total, H, D]`` of at least 1 GiB in ragged sequences (fixed seed). For each set of
axes (feature, sequence, both) it times the kernel launch (``rms_norm_quantize_into``: slot table +
kernel, outputs allocated beforehand) and reports GB/s of the bytes it moves (x and weight read;
normalized, rstd, e4m3 data and scales written), against ``torch.empty_like(buf).copy_(buf)`` of a
uint8 buffer moving the same bytes (half read, half written), timed in the same run. Also timed, for
scale: the unfused path (torch RMSNorm in fp32, cast, then the quantize kernel) and the public call
(checks, allocation and its NaN check included). Median of ``triton.testing.do_bench``.

    python3 scripts/bench_rmsnorm_quantize.py [--tokens 1048576] [--heads 4] [--dim 128] [--configs 8:128 8 16]

``--configs``: launch configurations, ``WARPS[:MAX_REGISTERS]`` (the default is the first).

Finishes in well under a minute on an H200; prints a short table last.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing
from jagged_attn.kernels import quantize as qk
from jagged_attn.kernels import rmsnorm_quantize as rq

from jagged_attn.mxfp8 import AXES
from jagged_attn.offsets import offsets_from_lengths

SEED = 2026
MAX_LENGTH = 4096
EPS = 1e-6
AXES_SETS = (("feature",), ("sequence",), AXES)


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
    parser.add_argument("--configs", nargs="+", default=[f"{rq.NUM_WARPS}:{rq.MAX_REGISTERS}", "8", "16"])
    args = parser.parse_args()

    offsets = ragged_offsets(args.tokens, "cuda")
    x = torch.randn(args.tokens, args.heads, args.dim, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(args.dim, device="cuda") * 0.5 + 1).to(torch.bfloat16)
    normalized, rstd = torch.empty_like(x), torch.empty(x.shape[:2], device="cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"x bf16 {tuple(x.shape)} = {nbytes(x) / 2**30:.3f} GiB in {offsets.numel() - 1} sequences")

    rows = []
    for axes in AXES_SETS:
        outputs = {axis: qk.empty_outputs(x, offsets, axis) for axis in axes}
        moved = nbytes(x, weight, normalized, rstd, *(t for pair in outputs.values() for t in pair))
        copy = copy_ms(moved)
        name = "+".join(axes)
        for config in args.configs:
            warps, _, registers = config.partition(":")
            launch = {"num_warps": int(warps), "max_registers": int(registers) if registers else None}
            ms = median_ms(lambda o=outputs, c=launch: rq.rms_norm_quantize_into(
                x, weight, offsets, o, normalized, rstd, eps=EPS, rounding="rceil", **c))
            rows.append((f"{name}, {warps} warps, {registers or 'any'} registers", ms, moved, copy))
        _check(x, weight, offsets, outputs, normalized)

        def unfused(o=outputs):
            y = torch.nn.functional.rms_norm(x.float(), (args.dim,), weight.float(), EPS).to(x.dtype)
            qk.quantize_into(y, offsets, o, "rceil")

        rows.append((f"{name}, unfused torch + quantize", median_ms(unfused), moved, copy))
        public = median_ms(lambda a=axes: rq.rms_norm_quantize(x, weight, offsets, axes=a, eps=EPS))
        rows.append((f"{name}, public call", public, moved, copy))
        del outputs

    print(f"\n{'what':44s} {'ms':>8s} {'GB moved':>9s} {'GB/s':>7s} {'copy GB/s':>10s} {'of copy':>8s}")
    for what, ms, moved, copy in rows:
        rate, copy_rate = moved / ms / 1e6, moved / copy / 1e6
        print(f"{what:44s} {ms:8.3f} {moved / 1e9:9.3f} {rate:7.0f} {copy_rate:10.0f} {rate / copy_rate:8.0%}")


def _check(x, weight, offsets, outputs, normalized):
    """The timed outputs equal the quantization of the normalized output (guards the numbers)."""
    for axis, (data, scales) in outputs.items():
        (expected_data, expected_scales), = qk.quantize_mxfp8_kernel(normalized, offsets, axes=(axis,))
        if not (torch.equal(data.view(torch.uint8), expected_data.view(torch.uint8))
                and torch.equal(scales, expected_scales)):
            raise AssertionError(f"{axis}: the fused output differs from quantize_mxfp8(normalized)")


if __name__ == "__main__":
    main()
