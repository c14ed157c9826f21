"""Benchmark: a training step of ``JaggedAttention`` (projections + MXFP8 attention + backward)
with the fused producers (``fused_producers=True``: Q/K projections, or the QK RMSNorms, emit the
MXFP8 the attention reads) and without (``nn.Linear`` / ``nn.RMSNorm``, the attention quantizes),
against the same layer in BF16 with torch ``varlen_attn``, same weights, same run, one GPU.

    python3 scripts/bench_module.py [--out DIR]

Workload: the ragged LLM batch of docs/DESIGN.md section 8 (48 lognormal lengths, bench.py's seed),
dim 2048, 16 heads of 128, causal and not, with and without QK RMSNorm, bf16 parameters and
activations. A step is forward + backward to the input and every parameter
(``torch.autograd.grad``), timed as the median of ``triton.testing.do_bench``. Prints a table
last and writes ``bench_module.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch

from bench import git_version, llm_lengths, median_ms, offsets_of, varlen_causal_kwargs
from jagged_attn.nn import JaggedAttention

DIM, HEADS, HEAD_DIM = 2048, 16, 128


class VarlenBf16Twin(torch.nn.Module):
    """The same layer (shares ``layer``'s projections and norms) with torch's BF16 ``varlen_attn``."""

    def __init__(self, layer: JaggedAttention, max_len: int):
        super().__init__()
        self.layer, self.max_len = layer, max_len

    def forward(self, x, offsets):
        from torch.nn.attention.varlen import varlen_attn

        layer = self.layer
        q = layer.q_proj(x).unflatten(-1, (layer.num_heads, layer.head_dim))
        k = layer.k_proj(x).unflatten(-1, (layer.num_kv_heads, layer.head_dim))
        v = layer.v_proj(x).unflatten(-1, (layer.num_kv_heads, layer.head_dim))
        if layer.qk_norm:
            q, k = layer.q_norm(q), layer.k_norm(k)
        out = varlen_attn(q, k, v, offsets, offsets, self.max_len, self.max_len, **varlen_causal_kwargs(layer.causal))
        return layer.out_proj(out.flatten(-2))


def step_ms(module, x, offsets, dout):
    leaves = [x, *module.parameters()]
    return median_ms(lambda: torch.autograd.grad(module(x, offsets), leaves, dout))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    lengths, _ = llm_lengths()
    offsets = offsets_of(lengths, "cuda")
    total = int(lengths.sum())
    rows = []
    for causal in (False, True):
        for qk_norm in (False, True):
            layer = JaggedAttention(DIM, HEADS, head_dim=HEAD_DIM, causal=causal, qk_norm=qk_norm,
                                    backend="hopper-exact-scores", device="cuda", dtype=torch.bfloat16)
            twin = VarlenBf16Twin(layer, int(lengths.max()))
            x = torch.randn(total, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dout = torch.randn(total, DIM, device="cuda", dtype=torch.bfloat16)
            times = {}
            for fused in (True, False):
                layer.fused_producers = fused
                times[fused] = step_ms(layer, x, offsets, dout)
            peer = step_ms(twin, x, offsets, dout)
            rows.append(dict(causal=causal, qk_norm=qk_norm, tokens=total, fused_ms=times[True],
                             unfused_ms=times[False], varlen_bf16_ms=peer, fused_speedup=times[False] / times[True],
                             fused_vs_bf16=peer / times[True]))
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  version=git_version(), gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows,
                  config=dict(dim=DIM, heads=HEADS, head_dim=HEAD_DIM, sequences=len(lengths)))
    with open(os.path.join(args.out, "bench_module.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nJaggedAttention training step (ms), {result['gpu']}, torch {result['torch']}, {result['date']}")
    print(f"{'causal':>7} {'qk_norm':>8} {'tokens':>7} {'fused':>7} {'unfused':>8} {'bf16 varlen':>12} "
          f"{'unfused/fused':>14} {'bf16/fused':>11}")
    for r in rows:
        print(f"{r['causal']!s:>7} {r['qk_norm']!s:>8} {r['tokens']:>7} {r['fused_ms']:>7.2f} {r['unfused_ms']:>8.2f} "
              f"{r['varlen_bf16_ms']:>12.2f} {r['fused_speedup']:>13.2f}x {r['fused_vs_bf16']:>10.2f}x")


if __name__ == "__main__":
    main()
