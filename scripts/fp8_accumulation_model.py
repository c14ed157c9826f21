"""CPU model of FP8 wgmma accumulation in the backward: how far S's and dP's truncation moves dQ, dK, dV.

    python3 scripts/fp8_accumulation_model.py [--kind heavy] [--causal] [--seeds 1 2 3 4]

Hopper's FP8 wgmma sums the reduction in 32-wide chunks and keeps ~13 bits when it adds (the
DeepSeek-V3 report measured ~14). The model: each chunk sum is truncated at
``2^(floor(log2 bound) - BITS)``, ``bound`` the largest product it can hold, and chunks are added
into the accumulator with the same truncation relative to the larger addend ("truncated"), or
exactly ("promoted", as ``max_num_imprecise_acc=32`` does in the Triton kernel). It replaces the
S and dP products of the reference backward (``jagged_attn.reference``) on the GPU accuracy test's
ragged GQA batch and prints, per seed, dQ / dK / dV rel-L2 against the unmodified reference and
how far the cosine against fp64 gradients moves from the reference's (the accuracy test's two
criteria) for: both promoted (the Triton kernel), both truncated (the Gluon kernel with FP8 S),
only S truncated, only dP truncated (the Gluon kernel's default). docs/PERF.md (backward v6, v7)
compares it with the H200.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_hopper_bwd import cosine, exact_gradients, forward_of, make_inputs, rel_l2  # noqa: E402  (the GPU tests')

from jagged_attn import reference  # noqa: E402

BITS = 13
CHUNK = 32
SCORE_PRODUCT = "qhd,khd->hqk"  # the einsum of S and of dP in reference_backward, in that order
MODES = {"promoted": (False, False), "truncated": (True, True), "S truncated": (True, False),
         "dP truncated": (False, True)}  # (S truncated, dP truncated)


def _truncate(x: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    ulp = torch.exp2(torch.floor(torch.log2(bound.clamp_min(1e-300))) - BITS)
    return torch.trunc(x / ulp) * ulp


def fp8_product(a: torch.Tensor, b: torch.Tensor, truncated: bool) -> torch.Tensor:
    """``einsum(SCORE_PRODUCT, a, b)`` summed as the model of FP8 wgmma does (fp64 in between)."""
    total = None
    for start in range(0, a.shape[-1], CHUNK):
        a_chunk, b_chunk = a[..., start:start + CHUNK].double(), b[..., start:start + CHUNK].double()
        bound = torch.einsum("qh,kh->hqk", a_chunk.abs().amax(-1), b_chunk.abs().amax(-1))
        part = _truncate(torch.einsum(SCORE_PRODUCT, a_chunk, b_chunk), bound)
        if total is None:
            total = part
        elif truncated:
            total = _truncate(total + part, torch.maximum(total.abs(), part.abs()))
        else:
            total = total + part
    return total.float()


class _TorchWithModelProducts:
    """``torch`` for ``jagged_attn.reference``, except that S and dP go through :func:`fp8_product`."""

    def __init__(self, truncate_s: bool, truncate_dp: bool):
        self.truncate = (truncate_s, truncate_dp)
        self.calls = 0

    def einsum(self, equation, *operands):
        if equation != SCORE_PRODUCT:
            return torch.einsum(equation, *operands)
        truncated = self.truncate[self.calls % 2]  # per sequence: S first, then dP
        self.calls += 1
        return fp8_product(*operands, truncated)

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def modelled_products(truncate_s: bool, truncate_dp: bool):
    reference.torch = _TorchWithModelProducts(truncate_s, truncate_dp)
    try:
        yield
    finally:
        reference.torch = torch


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
        for mode, truncation in MODES.items():
            with modelled_products(*truncation):
                grads = reference.reference_backward(*backward, causal=args.causal, softmax_scale=scale)
            errors = " ".join(f"{name} {rel_l2(g, r):.2e} (cosine {cosine(g, e) - cosine(r, e):+.1e})"
                              for name, g, r, e in zip(("dq", "dk", "dv"), grads, unmodified, fp64))
            print(f"{args.kind} causal={args.causal:d} seed {seed} {mode:13s} {errors}", flush=True)


if __name__ == "__main__":
    main()
