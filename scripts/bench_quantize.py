"""Benchmark: the fused jagged MXFP8 quantizer (jagged_attn/kernels/producers/quantize.py), every launch configuration,
against a device copy of the same input in the same run.

Input: bf16 ``values [tokens, heads, dim]`` (2 GiB by default) in ragged sequences (fixed seed). For
each set of axes (feature, sequence, both) and each ``TileConfig`` it times ``quantize_into`` (slot
table + kernel, outputs allocated beforehand) and the public entry point of the default
configuration (allocation and the NaN/Inf check included). GB/s = (input bytes + e4m3 bytes +
scale bytes written) / time; the copy is ``torch.empty_like(values).copy_(values)``, counted as
read + write. Every configuration's output is checked bit for bit against the default's once.
Median of ``triton.testing.do_bench``.

    python3 scripts/bench_quantize.py [--tokens 1048576] [--heads 8] [--dim 128] [--configs all-8w c64-4w-v8 ...]

Finishes in well under 90 s on an H200; prints a short table last (``*``: the default configuration).
"""

from __future__ import annotations

import argparse

import torch
import triton
from bench_rmsnorm_quantize import median_ms, nbytes, ragged_offsets
from jagged_attn.kernels.producers import quantize as qk

from jagged_attn.mxfp8 import AXES

AXES_SETS = (("feature",), ("sequence",), AXES)
TARGET = 0.80  # of the copy's GB/s (issue #6)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2**20)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--configs", nargs="+", default=list(qk.CONFIGS), choices=list(qk.CONFIGS))
    args = parser.parse_args()

    offsets = ragged_offsets(args.tokens, "cuda")
    values = torch.randn(args.tokens, args.heads, args.dim, device="cuda", dtype=torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"values bf16 {tuple(values.shape)} = {nbytes(values) / 2**30:.3f} GiB in {offsets.numel() - 1} sequences")
    copy_ms = median_ms(lambda: torch.empty_like(values).copy_(values))
    copy_rate = 2 * nbytes(values) / copy_ms / 1e6
    rows = [("device copy", "", copy_ms, copy_rate)]

    for axes in AXES_SETS:
        default = qk.default_config(axes)
        expected = {axis: qk.empty_outputs(values, offsets, axis) for axis in axes}
        qk.quantize_into(values, offsets, expected, "rceil", config=default)
        moved = nbytes(values, *(t for pair in expected.values() for t in pair))
        name = "+".join(axes)
        for config_name in args.configs:
            config = qk.CONFIGS[config_name]
            outputs = {axis: qk.empty_outputs(values, offsets, axis) for axis in axes}
            ms = median_ms(lambda o=outputs, c=config: qk.quantize_into(values, offsets, o, "rceil", config=c))
            _check_identical(outputs, expected, f"{name}, {config_name}")
            marker = "*" if config == default else ""
            rows.append((name, f"{config_name}{marker}", ms, moved / ms / 1e6))
            del outputs
        flag = torch.zeros(1, device="cuda")
        ms = median_ms(lambda a=axes, f=flag: qk.quantize_mxfp8_kernel(values, offsets, axes=a, nonfinite=f))
        rows.append((name, "entry point*", ms, moved / ms / 1e6))
        del expected

    print(f"\n{'axes':17s} {'config':13s} {'us':>8s} {'GB/s':>6s} {'of copy':>8s}  (target {TARGET:.0%})")
    for axes, config, ms, rate in rows:
        print(f"{axes:17s} {config:13s} {ms * 1e3:8.1f} {rate:6.0f} {rate / copy_rate:8.0%}")


def _check_identical(outputs, expected, what):
    for axis, (data, scales) in outputs.items():
        want_data, want_scales = expected[axis]
        if not (torch.equal(data.view(torch.uint8), want_data.view(torch.uint8)) and torch.equal(scales, want_scales)):
            raise AssertionError(f"{what}: {axis} output differs from the default configuration's")


if __name__ == "__main__":
    main()
