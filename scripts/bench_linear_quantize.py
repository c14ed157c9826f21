"""Benchmark: the Q/K/V projection with the MXFP8 epilogue against the same GEMM without it.

For each projection shape (bf16 ``x [tokens, in_features]`` of a ragged batch times ``weight.T``)
and each tile configuration of ``jagged_attn/kernels/producers/linear_quantize.py``, times:

* fused: the kernel storing bf16 ``y`` and its MXFP8 (data + tiled scales);
* fused, MXFP8 only: the same without storing ``y`` (default configuration only);
* plain: the same kernel with the quantizing epilogue compiled out (the honest A/B);
* cuBLAS: torch's ``x @ weight.T``, the absolute peer;
* the public ``linear_quantize`` call (allocation and offsets validation included).

TFLOP/s count ``2 * tokens * in_features * out_features``; every timing is the median of
``triton.testing.do_bench`` on random inputs. The target: fused >= 90% of plain.

    python3 scripts/bench_linear_quantize.py [--tokens 65536] [--in-features 4096] [--default-only]
"""

from __future__ import annotations

import argparse
import math

import torch
from jagged_attn.kernels.producers import linear_quantize as lq
from triton.testing import do_bench

from jagged_attn import quantize_mxfp8
from jagged_attn.mxfp8 import scale_matrix_shape
from jagged_attn.offsets import offsets_from_lengths
from jagged_attn.scale_layout import tiled_bytes

WARMUP_MS, REPEAT_MS = 25, 100
HEAD_DIM = 128
PROJECTIONS = [("Q (32 heads)", 32), ("KV, GQA (16 heads)", 16)]  # out_features = heads * 128
SEED = 1234
TARGET = 0.90
CUBLAS = "cuBLAS x @ w.T"


def ragged_offsets(tokens: int, device) -> torch.Tensor:
    """Lognormal lengths (log-mean ln 1500, sigma 0.8) adding up to exactly ``tokens``, fixed seed."""
    g = torch.Generator().manual_seed(SEED)
    lengths = torch.exp(math.log(1500) + 0.8 * torch.randn(4 * tokens // 1500 + 4, generator=g)).long().clamp(min=1)
    lengths = lengths[: int((lengths.cumsum(0) < tokens).sum()) + 1]
    lengths[-1] -= int(lengths.sum()) - tokens
    return offsets_from_lengths(lengths).to(device=device, dtype=torch.int32)


def median_ms(fn) -> float:
    return do_bench(fn, warmup=WARMUP_MS, rep=REPEAT_MS, return_mode="median")


def bench_projection(heads, x, offsets, configs) -> dict[str, float]:
    """Milliseconds per variant for one projection shape; checks the fused result once first."""
    tokens, in_features = x.shape
    out_features = heads * HEAD_DIM
    weight = (torch.randn(out_features, in_features, device=x.device) / in_features**0.5).to(torch.bfloat16)
    scale_rows, scale_cols = scale_matrix_shape("feature", tokens, offsets.numel() - 1, HEAD_DIM)
    y = torch.empty(tokens, out_features, dtype=torch.bfloat16, device=x.device)
    data = torch.empty(tokens, out_features, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(heads, tiled_bytes(scale_rows, scale_cols), dtype=torch.uint8, device=x.device)
    nonfinite = torch.zeros(1, device=x.device)

    def fused(config, store_y=True):
        y_out = y if store_y else None
        return lambda: lq.launch(x, weight, None, y_out, data, scales, offsets, nonfinite, HEAD_DIM, "rceil", config)

    def plain(config):
        return lambda: lq.launch(x, weight, None, y, None, None, None, None, HEAD_DIM, "rceil", config)

    fused(configs[0])()
    expected = quantize_mxfp8(y.view(tokens, heads, HEAD_DIM), offsets)
    assert torch.equal(data.view(torch.uint8), expected.data.view(tokens, -1).view(torch.uint8)), "MXFP8 data differ"
    assert torch.equal(scales, expected.scales.view(torch.uint8)), "MXFP8 scales differ"

    times = {}
    for config in configs:
        times[f"fused {config.name}"] = median_ms(fused(config))
        times[f"plain {config.name}"] = median_ms(plain(config))
    times[f"fused, MXFP8 only {configs[0].name}"] = median_ms(fused(configs[0], store_y=False))
    times[CUBLAS] = median_ms(lambda: x @ weight.T)
    flag = torch.zeros(1, device=x.device)  # NaN/Inf flagged here, unchecked: the call without its wait
    times["linear_quantize() API"] = median_ms(lambda: lq.linear_quantize(x, weight, offsets, heads=heads,
                                                                         nonfinite=flag))
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--in-features", type=int, default=4096)
    parser.add_argument("--default-only", action="store_true", help="time only the default tile configuration")
    args = parser.parse_args()
    configs = lq.CONFIGS[:1] if args.default_only else lq.CONFIGS

    torch.manual_seed(SEED)
    offsets = ragged_offsets(args.tokens, "cuda")
    x = torch.randn(args.tokens, args.in_features, device="cuda").to(torch.bfloat16)
    print(
        f"{torch.cuda.get_device_name()}: {args.tokens} tokens in {offsets.numel() - 1} ragged sequences, "
        f"in_features {args.in_features}, head dim {HEAD_DIM}"
    )
    tflops = {}
    for label, heads in PROJECTIONS:
        tflop = 2 * args.tokens * args.in_features * heads * HEAD_DIM / 1e12
        for variant, ms in bench_projection(heads, x, offsets, configs).items():
            tflops[label, variant] = tflop / ms * 1e3
            print(f"{label:20s} {variant:36s} {ms * 1e3:9.1f} us {tflops[label, variant]:7.1f} TFLOP/s")

    print(f"\nSummary, TFLOP/s (target: fused >= {TARGET:.0%} of plain, the same kernel and tiles)")
    print(
        f"{'projection':20s} {'config':20s} {'fused':>7s} {'plain':>7s} {'cuBLAS':>7s} {'fused/plain':>12s} "
        f"{'fused/cuBLAS':>13s}"
    )
    for label, _ in PROJECTIONS:
        cublas = tflops[label, CUBLAS]
        for config in configs:
            fused, plain = tflops[label, f"fused {config.name}"], tflops[label, f"plain {config.name}"]
            verdict = "ok" if fused >= TARGET * plain else "BELOW TARGET"
            print(
                f"{label:20s} {config.name:20s} {fused:7.1f} {plain:7.1f} {cublas:7.1f} {fused / plain:12.1%} "
                f"{fused / cublas:13.1%}  {verdict}"
            )


if __name__ == "__main__":
    main()
