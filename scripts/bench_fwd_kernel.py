"""Benchmark: the Hopper forward's Gluon kernel alone (``hopper_fwd_ws``), on ``bench.py``'s workloads.

Q, K and V are quantized and rebased once beforehand; each row is the median time of the kernel's
launch with the tile configuration of ``hopper_fwd_ws.tile_config``, optionally overridden
(``--set PINGPONG=0``), with FP8 S (``--scores fp8``, default) or exact S, and the sums of |O|
and of the finite LSE so that two versions' outputs can be compared.

To compare two versions side by side, run it twice in one device call, the second time on the other
version's package (``git archive`` of its ``jagged_attn`` and ``kernels``, the latter copied to
``jagged_attn/kernels``) with ``PYTHONPATH=<that folder>:scripts python3 -P scripts/bench_fwd_kernel.py``
(``-P``: not this checkout's package from the working directory).
"""

from __future__ import annotations

import argparse

import torch
from bench import WORKLOAD_SETS, Workload, median_ms


def time_forward_kernel(w: Workload, scores: str, overrides: dict, label: str) -> None:
    from jagged_attn import quantize_mxfp8
    from jagged_attn.kernels import hopper_fwd_ws, layout, rebase

    config = {**hopper_fwd_ws.tile_config(w.dim, scores), **overrides}
    exact = scores == "bf16"
    mq, mk = quantize_mxfp8(w.q, w.offsets_q), quantize_mxfp8(w.k, w.offsets_k)
    mv = quantize_mxfp8(w.v, w.offsets_k, axis="sequence")
    rebased = (*rebase.rebase_feature(mq, group=1, exact=exact),
               *rebase.rebase_kv(mk, mv, config["BLOCK_N"], exact=exact, v_order=layout.PV_ORDER))

    def kernel():
        return hopper_fwd_ws._forward(*rebased, w.offsets_q, w.offsets_k, causal=w.causal, softmax_scale=w.scale,
                                      out_dtype=torch.bfloat16, config=config)

    out, lse = kernel()
    finite = torch.isfinite(lse)
    sums = f"{float(out.double().abs().sum()):.6e} {float(lse[finite].double().sum()):.6e}"
    ms = median_ms(kernel)
    print(f"{label:10s} {w.name:30s} S {scores:4s} kernel {ms:7.3f} ms = {w.tflops('fwd', ms):5.0f} TFLOP/s  "
          f"|O| LSE sums {sums}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scores", default="fp8", choices=("fp8", "bf16"))
    parser.add_argument("--set", nargs="*", default=[], help="tile_config overrides, NAME=INT")
    parser.add_argument("--label", default="")
    parser.add_argument("--workloads", nargs="*", help="names of bench.py workloads (default: its fa4 set)")
    args = parser.parse_args()
    overrides = {name: int(value) for name, value in (item.split("=") for item in args.set)}
    specs = {spec.name: spec for specs in WORKLOAD_SETS.values() for spec in specs}
    for name in args.workloads or [spec.name for spec in WORKLOAD_SETS["fa4"]]:
        spec = specs[name]
        w = Workload(spec.name, spec.lengths, spec.heads_q, spec.causal, spec.dense, spec.dim or 128,
                     heads_kv=spec.heads_kv)
        time_forward_kernel(w, args.scores, overrides, args.label)


if __name__ == "__main__":
    main()
