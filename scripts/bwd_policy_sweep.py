"""The backward's accuracy policy over many fresh draws: how often, and by how much, each gradient of the
Hopper backward misses the bars of the GPU accuracy test on its input families.

    python3 scripts/bwd_policy_sweep.py [--scores fp8|bf16] [--through backward|public] [--kinds outlier heavy]
        [--draws 40] [--first 0] [--exact-products S|dP] [--json OUT.json]

The GPU test (``tests/test_hopper_bwd.py``, the FP8-score policy) checks one fresh draw per (kind, causal):
each gradient's rel-L2 against fp64 gradients of the unquantized inputs at most ``POLICY_GRADIENT_RATIO``
times the reference backend's, its cosine at most ``COSINE_SLACK`` below the reference's
(``OUTLIER_COSINE_GAP`` on outlier channels). One draw says little where a family sits near a bar; this
runs ``--draws`` seeds (seed ``first + i`` gives draw ``i``, the same inputs for either ``--scores``) on the
test's ragged GQA batch and prints, per draw, each gradient's ratio and cosine gap, then per (kind, causal,
gradient) the largest of each and how many draws miss each bar. On CPU it runs the portable kernel in the
Triton interpreter (slow: for small ``--lengths-q`` / ``--lengths-k`` only).

``--through backward`` (the test's setup) runs the backward kernel alone after the reference forward, so its
errors are the backward's; ``--through public`` takes both gradients through ``jagged_attention`` and
autograd (ours: ``hopper`` or ``hopper-exact-scores`` by ``--scores``, ``portable`` on CPU; against backend
``reference``), forward included, as a training step has them.

``--exact-products S`` (or ``dP``) is a diagnostic of where FP8 ``wgmma`` accumulation loses a draw: it puts the
two operands of S, q and k (of dP: dO and v), on grids whose products every accumulation sums exactly
(:func:`on_integer_grid`), so that GEMM's FP8 sums equal exact ones and a miss left over is the other GEMM's.
The input families keep their token scales and outlier channels, coarsened; fp64 and the reference backend
see the same inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import jagged_attn as ja

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_hopper_bwd import (COSINE_SLACK, OUTLIER_COSINE_GAP, POLICY_BATCH,  # noqa: E402  (the GPU test's)
                             POLICY_GRADIENT_RATIO, cosine, exact_gradients, make_inputs, policy_cosine_slack,
                             policy_gradients, rel_l2)

GRADIENTS = ("dq", "dk", "dv")
EXACT_PRODUCT_OPERANDS = {"S": ("q", "k"), "dP": ("dout", "v")}
GRID_BITS = 3  # |integers| <= 7: a product <= 49 units, a 128-channel sum <= 6272 < 2^13 units


def on_integer_grid(x: torch.Tensor) -> torch.Tensor:
    """``x`` (``[tokens, heads, D]``) with each token's values rounded to integers of at most ``GRID_BITS`` bits
    times a power of two of its own (its largest value's ``2^-GRID_BITS``, rounded up). MXFP8 holds such
    values exactly, per-token rebasing keeps them, and a dot product of two such rows is a sum of integers
    below 2^13 units, which FP8 ``wgmma``'s ~13-bit accumulation sums exactly."""
    top = 2**GRID_BITS - 1
    amax = x.float().abs().amax(-1, keepdim=True)
    unit = torch.exp2(torch.ceil(torch.log2(amax.clamp_min(torch.finfo(torch.float32).tiny))) - GRID_BITS)
    return (torch.round(x.float() / unit).clamp(-top, top) * unit).to(x.dtype)


def public_gradients(backend, q, k, v, dout, offsets_q, offsets_k, causal, scale):
    """dQ, dK, dV of ``jagged_attention(backend=backend)`` through autograd, forward included."""
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = ja.jagged_attention(*inputs, offsets_q, offsets_k, causal=causal, softmax_scale=scale, backend=backend)
    return torch.autograd.grad(out, inputs, dout)


def draw(seed, kind, causal, scores, through, lengths_q, lengths_k, device, exact_products=None):
    """One draw: per gradient, (rel-L2 against fp64 over the reference backend's, reference's cosine against
    fp64 minus ours)."""
    torch.manual_seed(seed)
    q, k, v, dout, offsets_q, offsets_k = make_inputs(lengths_q, lengths_k, 8, 2, 128, device=device,
                                                      dtype=torch.bfloat16, kind=kind)
    tensors = dict(q=q, k=k, v=v, dout=dout)
    for name in EXACT_PRODUCT_OPERANDS.get(exact_products, ()):
        tensors[name] = on_integer_grid(tensors[name])
    q, k, v, dout = tensors.values()
    scale = 128**-0.5
    if through == "public":
        ours = {"fp8": "hopper", "bf16": "hopper-exact-scores"}[scores] if device == "cuda" else "portable"
        exact = exact_gradients(q, k, v, dout, offsets_q, offsets_k, causal, scale)
        reference = public_gradients("reference", q, k, v, dout, offsets_q, offsets_k, causal, scale)
        got = public_gradients(ours, q, k, v, dout, offsets_q, offsets_k, causal, scale)
    else:
        options = dict(scores=scores) if device == "cuda" else {}
        got, reference, exact = policy_gradients(q, k, v, dout, offsets_q, offsets_k, causal, scale, **options)
    return {name: (rel_l2(g, e) / rel_l2(r, e), cosine(r, e) - cosine(g, e))
            for name, g, r, e in zip(GRADIENTS, got, reference, exact)}


def summarize(rows):
    """Per (kind, causal, gradient) over ``rows`` (dicts with kind, causal and per gradient (ratio, gap)):
    draws, the largest ratio and gap, and how many draws miss the ratio bar and the cosine bar."""
    summary = {}
    for row in rows:
        for name in GRADIENTS:
            ratio, gap = row[name]
            entry = summary.setdefault((row["kind"], row["causal"], name),
                                       dict(draws=0, max_ratio=-1.0, max_gap=-1.0, ratio_misses=0, cosine_misses=0))
            entry["draws"] += 1
            entry["max_ratio"], entry["max_gap"] = max(entry["max_ratio"], ratio), max(entry["max_gap"], gap)
            entry["ratio_misses"] += ratio > POLICY_GRADIENT_RATIO
            entry["cosine_misses"] += gap > policy_cosine_slack(row["kind"])
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scores", default="fp8", choices=["fp8", "bf16"], help="the Hopper backward's S and dP")
    parser.add_argument("--through", default="backward", choices=["backward", "public"],
                        help="the backward kernel after the reference forward, or the public call with autograd")
    parser.add_argument("--kinds", nargs="+", default=["outlier", "heavy"])
    parser.add_argument("--draws", type=int, default=40)
    parser.add_argument("--first", type=int, default=0, help="the first draw's seed")
    parser.add_argument("--lengths-q", type=int, nargs="+", default=POLICY_BATCH[0])
    parser.add_argument("--lengths-k", type=int, nargs="+", default=POLICY_BATCH[1])
    parser.add_argument("--exact-products", choices=sorted(EXACT_PRODUCT_OPERANDS),
                        help="diagnostic: S's (or dP's) operands on grids that FP8 accumulation sums exactly")
    parser.add_argument("--json", help="write every draw and the summary here")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for seed in range(args.first, args.first + args.draws):
        for kind in args.kinds:
            for causal in (False, True):
                row = dict(seed=seed, kind=kind, causal=causal,
                           **draw(seed, kind, causal, args.scores, args.through, args.lengths_q, args.lengths_k,
                                  device, args.exact_products))
                rows.append(row)
                print(f"seed {seed} {kind:8s} causal={causal:d} | "
                      + " | ".join(f"{n} {row[n][0]:.4f} {row[n][1]:+.5f}" for n in GRADIENTS), flush=True)
    summary = summarize(rows)
    ours = f"hopper, {args.scores} S and dP" if device == "cuda" else "portable (CPU)"
    ours += ", public call (forward and backward)" if args.through == "public" else ", backward alone"
    ours += f", {args.exact_products}'s products exact" if args.exact_products else ""
    print(f"\n== bwd_policy_sweep: {ours}: ratio bar {POLICY_GRADIENT_RATIO}, cosine bar {COSINE_SLACK} "
          f"({OUTLIER_COSINE_GAP} outlier)")
    print("kind     causal grad  draws  max ratio  ratio misses  max cosine gap  cosine misses")
    for (kind, causal, name), s in summary.items():
        print(f"{kind:8s} {causal:6d} {name:4s} {s['draws']:6d} {s['max_ratio']:10.4f} {s['ratio_misses']:13d} "
              f"{s['max_gap']:+15.5f} {s['cosine_misses']:14d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(scores=args.scores, through=args.through, exact_products=args.exact_products, device=device,
                           rows=rows,
                           summary=[dict(kind=k, causal=c, gradient=n, **s) for (k, c, n), s in summary.items()]),
                      f, indent=1)


if __name__ == "__main__":
    main()
