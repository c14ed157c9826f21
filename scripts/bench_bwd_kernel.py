"""Benchmark: where a training step's time goes, and the Hopper backward's Gluon kernel alone.

On a workload set of ``bench.py`` (``--set``: the design set unless named; head_dim 128 unless the spec fixes one):

* ``--profile``: CUDA time per kernel of one ``jagged_attention`` training step (backend ``hopper``,
  or ``hopper-exact-scores`` with ``--exact-scores``; forward + backward through autograd;
  ``torch.profiler`` over five steps), every kernel, largest first;
* otherwise: the Gluon backward kernel alone (``sm90.backward.launch``, the producers run once
  beforehand), with dQ accumulated or not (``--no-dq``), with FP8 S and dP (backend ``hopper``'s) or
  exact ones (``--exact-scores``), as median ms and TFLOP/s, with the sums of
  ``|dQ|``, ``|dK|``, ``|dV|`` so that two versions' outputs can be compared.

To compare two versions side by side, run it twice in one device call, the second time on the other
version's package (``git archive`` of its ``jagged_attn``; before the kernels moved into the package, its
``kernels`` too, copied to ``jagged_attn/kernels``) with
``PYTHONPATH=<that folder>:scripts python3 -P scripts/bench_bwd_kernel.py``
(``-P``: not this checkout's package from the working directory).
"""

from __future__ import annotations

import argparse

import torch
from bench import WORKLOAD_SETS, Workload, median_ms, select

HEAD_DIM = 128


def profile_step(w: Workload, backend: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    from jagged_attn import jagged_attention

    leaves = [x.detach().requires_grad_() for x in (w.q, w.k, w.v)]

    def step():
        out = jagged_attention(*leaves, w.offsets_q, w.offsets_k, causal=w.causal, softmax_scale=w.scale,
                               backend=backend)
        torch.autograd.grad(out, leaves, w.dout)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    steps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = sorted(((e.device_time_total / 1e3 / steps, e.count // steps, e.key) for e in prof.key_averages()
                      if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0), reverse=True)
    print(f"== {w.name}, {backend}: kernel time per step {sum(k[0] for k in kernels):.2f} ms "
          f"(wall step {median_ms(step):.2f} ms)")
    for ms, count, name in kernels:
        print(f"  {ms:7.3f} ms x{count:<3d} {name[:110]}")


def time_backward_kernel(w: Workload, accumulate_dq: bool, exact_scores: bool) -> None:
    from jagged_attn.kernels.producers import backward_passes
    from jagged_attn.kernels.sm90 import backward as sm90_backward
    from jagged_attn.offsets import validate_offsets

    for offsets, rows in ((w.offsets_q, w.q.shape[0]), (w.offsets_k, w.k.shape[0])):
        validate_offsets(offsets, rows)  # as the public call does (dQ's accumulator dtype reads what it learns)
    out = torch.randn_like(w.q)
    lse = torch.randn(w.q.shape[0], w.heads, device="cuda") + 8
    prep = backward_passes.Prepared(w.dout, w.q, w.k, w.v, out, lse, w.offsets_q, w.offsets_k,
                                    exact_scores=exact_scores, **sm90_backward.preparation(not accumulate_dq))
    dq_accum = sm90_backward.dq_accumulator(prep, "cuda")
    dk, dv = torch.full_like(w.k, float("nan")), torch.full_like(w.v, float("nan"))

    def kernel():
        sm90_backward.launch(prep, dq_accum, dk, dv, softmax_scale=w.scale, causal=w.causal,
                             accumulate_dq=accumulate_dq)

    kernel()
    sums = " ".join(f"{float(x.abs().sum(dtype=torch.float64)):.6e}" for x in (dq_accum, dk, dv))  # no fp64 copy
    ms = median_ms(kernel)
    scores = "exact" if exact_scores else "FP8"
    print(f"{w.name:28s} dQ={accumulate_dq!s:5s} ({str(dq_accum.dtype)[6:]}) S, dP {scores:5s} kernel {ms:7.3f} ms = "
          f"{w.tflops('bwd', ms):5.0f} TFLOP/s  |dQ| |dK| |dV| sums {sums}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", action="store_true", help="time per kernel of a training step")
    parser.add_argument("--no-dq", action="store_true", help="the backward kernel without dQ")
    parser.add_argument("--exact-scores", action="store_true",
                        help="S and dP exact from bf16 copies (backend hopper-exact-scores); default: FP8 (hopper)")
    parser.add_argument("--set", default="design", choices=sorted(WORKLOAD_SETS), help="bench.py's workload set")
    parser.add_argument("--workloads", nargs="*", help="names or indices in the set (default: all)")
    args = parser.parse_args()
    from jagged_attn.kernels.sm90 import backward as sm90_backward

    print("kernels from", sm90_backward.__file__)
    for spec in select(WORKLOAD_SETS[args.set], args.workloads):
        w = Workload.of(spec, spec.dim or HEAD_DIM)
        if args.profile:
            profile_step(w, "hopper-exact-scores" if args.exact_scores else "hopper")
        else:
            time_backward_kernel(w, accumulate_dq=not args.no_dq, exact_scores=args.exact_scores)


if __name__ == "__main__":
    main()
