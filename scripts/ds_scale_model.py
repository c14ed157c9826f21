"""CPU model of the backward's dS scale policy: does it move dQ and dK against fp64?

    python3 scripts/ds_scale_model.py [--kind heavy] [--causal] [--seeds 1 2 3 4]

The reference backward quantizes dS in 32x32 tiles, each on its own scale. The Gluon kernel
quantizes 64 x 64 tiles (one consumer's keys x one query step) on a running scale per (KV head,
64-key block) that only grows over its steps (query heads of the group outer, query tiles inner),
from the smallest normal. This replaces the reference's dS rule by that one ("running64"), and by
one scale per 64 x 64 tile ("step64"), on the GPU accuracy test's ragged GQA batch, and prints per
seed the rel-L2 of dQ / dK against the unmodified reference and the shift of their cosine against
fp64 gradients (the accuracy test's two criteria). docs/PERF.md (backward v7) has the numbers.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_hopper_bwd import cosine, exact_gradients, forward_of, make_inputs, rel_l2  # noqa: E402  (the GPU tests')

from jagged_attn import mx_format, reference  # noqa: E402

TILE = 64  # queries per step x keys per consumer warpgroup
GROUP = 4  # query heads per KV head in the batch below
REFERENCE_RULE = mx_format.fake_quantize_square_tiles


def quantize_ds(ds: torch.Tensor, running: bool) -> torch.Tensor:
    """``[Hq, Lq, Lk]`` dS of one sequence after e4m3 quantization in ``TILE x TILE`` tiles, each on
    its own scale or (``running``) on the kernel's running scale."""
    heads, len_q, len_k = ds.shape
    padded = torch.nn.functional.pad(ds.float(), (0, -len_k % TILE, 0, -len_q % TILE))
    q_tiles, k_tiles = padded.shape[1] // TILE, padded.shape[2] // TILE
    tiles = padded.reshape(heads, q_tiles, TILE, k_tiles, TILE)
    byte = mx_format.scale_bytes(tiles.abs().amax(dim=(2, 4)))  # [Hq, q tiles, k tiles]
    if running:
        steps = byte.reshape(heads // GROUP, GROUP * q_tiles, k_tiles).clamp_min(1)  # 1: the smallest normal
        byte = torch.cummax(steps, dim=1).values.reshape(heads, q_tiles, k_tiles)
    byte = byte[:, :, None, :, None]
    values = mx_format.quantize_with_factors(tiles, mx_format.scale_factors(byte)).float()
    return (values * mx_format.descale_factors(byte)).reshape(padded.shape)[:, :len_q, :len_k]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", default="heavy", choices=["gaussian", "outlier", "heavy", "peaked"])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4])
    args = parser.parse_args()
    scale = 128**-0.5
    for seed in args.seeds:
        torch.manual_seed(seed)
        q, k, v, dout, offsets_q, offsets_k = make_inputs([1000, 0, 517, 2048, 129], [1100, 64, 517, 1500, 1], 8, 2,
                                                          128, dtype=torch.bfloat16, kind=args.kind)
        out, lse = forward_of(q, k, v, offsets_q, offsets_k, args.causal, scale)
        backward = (dout, q, k, v, out, lse, offsets_q, offsets_k)
        unmodified = reference.reference_backward(*backward, causal=args.causal, softmax_scale=scale)
        fp64 = exact_gradients(q, k, v, dout, offsets_q, offsets_k, args.causal, scale)
        for mode, running in (("step64", False), ("running64", True)):
            mx_format.fake_quantize_square_tiles = lambda ds, running=running: quantize_ds(ds, running)
            try:
                grads = reference.reference_backward(*backward, causal=args.causal, softmax_scale=scale)
            finally:
                mx_format.fake_quantize_square_tiles = REFERENCE_RULE
            errors = " ".join(f"{name} {rel_l2(g, r):.2e} (cosine {cosine(g, e) - cosine(r, e):+.1e})"
                              for name, g, r, e in zip(("dq", "dk"), grads, unmodified, fp64))
            print(f"{args.kind} causal={args.causal:d} seed {seed} {mode:9s} {errors}", flush=True)


if __name__ == "__main__":
    main()
