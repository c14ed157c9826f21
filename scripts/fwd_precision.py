"""Forward accuracy against speed for each way of computing S (the portable kernel's ``tile_config`` SCORES).

    python3 scripts/fwd_precision.py        # on an sm_90 GPU

For the issue's four input kinds, prints O's relative L2 and the LSE error against the reference
backend on the same MXFP8 inputs, and the cosine against fp64 minus the reference's; then the
kernel's TFLOP/s on the dense 8 x 8192 x 16 heads workload, for every variant in ``VARIANTS``.
"""

from __future__ import annotations

import math
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import test_hopper_fwd as cases  # noqa: E402  (the GPU tests' inputs and metrics)

from jagged_attn import quantize_mxfp8, reference  # noqa: E402
from jagged_attn.kernels.portable import forward as portable_forward  # noqa: E402
from jagged_attn.kernels.producers import rebase  # noqa: E402
from jagged_attn.offsets import offsets_from_lengths  # noqa: E402

VARIANTS = [dict(SCORES="fp8"), dict(SCORES="bf16"), dict(SCORES="bf16", num_stages=2)]


def label(variant):
    return "/".join(str(value) for value in variant.values())
KINDS = ["gaussian", "outlier_channel", "heavy_tailed", "peaked"]


def forward(mq, mk, mv, causal, scale, variant, out_dtype):
    config = dict(portable_forward.tile_config(mq.head_dim), **variant)
    rebased = (*rebase.rebase_feature(mk, group=config["BLOCK_N"], exact=config["SCORES"] == "bf16"),
               *rebase.rebase_sequence(mv))
    return lambda: portable_forward.forward_rebased(mq.data, mq, *rebased, mq.offsets, mk.offsets, causal=causal,
                                                    softmax_scale=scale, out_dtype=out_dtype, config=config)


def accuracy(case, kind):
    len_q, len_k, heads_q, heads_kv, dim, causal = case
    q, k, v, offsets_q, offsets_k = cases.make_inputs(len_q, len_k, heads_q, heads_kv, dim, kind)
    mq, mk, mv = cases.quantized(q, k, v, offsets_q, offsets_k)
    scale = 1 / math.sqrt(dim)
    _, _, ref_out, ref_lse = cases.forward_and_reference(mq, mk, mv, causal, scale)
    exact, _ = reference.reference_forward(q.double(), k.double(), v.double(), offsets_q, offsets_k, causal=causal,
                                           softmax_scale=scale, compute_dtype=torch.float64, fp8=False)
    finite = torch.isfinite(ref_lse)
    line = f"d{dim} causal={causal:d} {kind:15s}"
    for variant in VARIANTS:
        out, lse = forward(mq, mk, mv, causal, scale, variant, torch.float32)()
        lse_error = float((lse[finite].double() - ref_lse[finite]).abs().amax())
        cosine_gap = cases.cosine(out, exact) - cases.cosine(ref_out, exact)
        error = cases.relative_l2(out, ref_out)
        line += f" | {label(variant)}: O {error:.2e} LSE {lse_error:.1e} dcos {cosine_gap:+.1e}"
    print(line, flush=True)


def speed(dim, causal):
    offsets = offsets_from_lengths(torch.full((8,), 8192)).cuda().int()
    q, k, v = (torch.randn(8 * 8192, 16, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mq, mk, mv = quantize_mxfp8(q, offsets), quantize_mxfp8(k, offsets), quantize_mxfp8(v, offsets, axis="sequence")
    flops = 4 * 8 * 8192 * 8192 * dim * 16 / (2 if causal else 1)
    line = f"dense d{dim} causal={causal:d}"
    for variant in VARIANTS:
        ms = triton.testing.do_bench(forward(mq, mk, mv, causal, dim**-0.5, variant, torch.bfloat16), warmup=25,
                                     rep=150, return_mode="median")
        line += f" | {label(variant)}: {flops / ms / 1e9:.0f} TFLOP/s"
    print(line, flush=True)


def main():
    for case in [cases.GPU_CASES[0], cases.GPU_CASES[2], cases.GPU_CASES[1]]:
        for kind in KINDS:
            accuracy(case, kind)
    for causal in (False, True):
        for dim in (128, 64):
            speed(dim, causal)


if __name__ == "__main__":
    main()
