"""Benchmark: a training step of ``JaggedAttention`` (projections + MXFP8 attention + backward)
against the same layer in BF16 with torch ``varlen_attn``, same weights, same run, one GPU.

    python3 scripts/bench_module.py [--out DIR]

Workload: the ragged LLM batch of DESIGN.md section 8 (48 lognormal lengths, bench.py's seed),
dim 2048, 16 heads of 128, causal and not, bf16 parameters and activations. A step is forward +
backward to the input and every parameter (``torch.autograd.grad``), timed as the median of
``triton.testing.do_bench``. Prints a table last and writes ``bench_module.json`` under ``--out``.
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
    """The same layer (shares ``layer``'s projections) with torch's BF16 ``varlen_attn``."""

    def __init__(self, layer: JaggedAttention, max_len: int):
        super().__init__()
        self.layer, self.max_len = layer, max_len

    def forward(self, x, offsets):
        from torch.nn.attention.varlen import varlen_attn

        layer = self.layer
        q = layer.q_proj(x).unflatten(-1, (layer.num_heads, layer.head_dim))
        k = layer.k_proj(x).unflatten(-1, (layer.num_kv_heads, layer.head_dim))
        v = layer.v_proj(x).unflatten(-1, (layer.num_kv_heads, layer.head_dim))
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
        layer = JaggedAttention(DIM, HEADS, head_dim=HEAD_DIM, causal=causal, backend="triton", device="cuda",
                                dtype=torch.bfloat16)
        twin = VarlenBf16Twin(layer, int(lengths.max()))
        x = torch.randn(total, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn(total, DIM, device="cuda", dtype=torch.bfloat16)
        ours, peer = step_ms(layer, x, offsets, dout), step_ms(twin, x, offsets, dout)
        rows.append(dict(causal=causal, tokens=total, ours_ms=ours, varlen_bf16_ms=peer, speedup=peer / ours))
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  version=git_version(), gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows,
                  config=dict(dim=DIM, heads=HEADS, head_dim=HEAD_DIM, sequences=len(lengths)))
    with open(os.path.join(args.out, "bench_module.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nJaggedAttention training step, {result['gpu']}, torch {result['torch']}, {result['date']}")
    print(f"{'causal':>7} {'tokens':>8} {'ours ms':>9} {'bf16 varlen ms':>15} {'speedup':>8}")
    for r in rows:
        print(f"{r['causal']!s:>7} {r['tokens']:>8} {r['ours_ms']:>9.2f} {r['varlen_bf16_ms']:>15.2f} "
              f"{r['speedup']:>7.2f}x")


if __name__ == "__main__":
    main()
