"""Benchmark: the Hopper forward's Gluon kernel alone (``sm90.forward``), on ``bench.py``'s workloads.

Q, K and V are quantized and rebased once beforehand; each row is the median time of the kernel's
launch with the tile configuration of ``sm90.forward.tile_config``, optionally overridden
(``--config STAGES=2``), with FP8 S (``--scores fp8``, default) or exact S, and the sums of |O|
and of the finite LSE so that two versions' outputs can be compared.

To compare two versions side by side, run it twice in one device call, the second time on the other
version's package (``git archive`` of its ``jagged_attn``; before the kernels moved into the package, its
``kernels`` too, copied to ``jagged_attn/kernels``) with
``PYTHONPATH=<that folder>:scripts python3 -P scripts/bench_fwd_kernel.py``
(``-P``: not this checkout's package from the working directory).
"""

from __future__ import annotations

import argparse

import torch
from bench import WORKLOAD_SETS, Workload, forward_kernel_alone, median_ms, quantized_inputs


def time_forward_kernel(w: Workload, scores: str, overrides: dict, label: str) -> None:
    from jagged_attn.kernels.sm90 import forward as sm90_forward

    config = {**sm90_forward.tile_config(w.dim, scores), **overrides}
    kernel, _, _ = forward_kernel_alone(w, *quantized_inputs(w), config)
    out, lse = kernel()
    finite = torch.isfinite(lse)
    sums = f"{float(out.abs().sum(dtype=torch.float64)):.6e} {float(lse[finite].sum(dtype=torch.float64)):.6e}"
    ms = median_ms(kernel)
    print(f"{label:10s} {w.name:30s} S {scores:4s} kernel {ms:7.3f} ms = {w.tflops('fwd', ms):5.0f} TFLOP/s  "
          f"|O| LSE sums {sums}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scores", default="fp8", choices=("fp8", "bf16"))
    parser.add_argument("--config", nargs="*", default=[], help="tile_config overrides, NAME=INT")
    parser.add_argument("--label", default="")
    parser.add_argument("--workloads", nargs="*", help="names of bench.py workloads (default: its fa4 set)")
    args = parser.parse_args()
    overrides = {name: int(value) for name, value in (item.split("=") for item in args.config)}
    specs = {spec.name: spec for specs in WORKLOAD_SETS.values() for spec in specs}
    for name in args.workloads or [spec.name for spec in WORKLOAD_SETS["fa4"]]:
        spec = specs[name]
        time_forward_kernel(Workload.of(spec, spec.dim or 128), args.scores, overrides, args.label)


if __name__ == "__main__":
    main()
