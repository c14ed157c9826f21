"""Diagnostic: a workload's training steps one by one, each beside the SM clock, board power and throttle
reasons that ``nvidia-smi`` reported while it ran; then the same steps interleaved with other peers'.

    python3 scripts/step_clocks.py [--workload NAME] [--steps N] [--peers fast fa4 ...]

Why: the H200 holds its board power at a cap, and under sustained FP8 load it lowers the SM clock to
stay there, so one peer's time depends on how hot the GPU was when its turn came. The first table
shows the steps slowing as the clock drops; the second times each peer's step by ``do_bench`` in
turns, twice round, in one process (as ``bench.py --rounds 2`` does for whole columns), with the
caching allocator's device allocations, frees and retries in each timed phase.

Peers: ``bench.py``'s columns (``fast`` = backend ``hopper``, ``ours`` = ``hopper-exact-scores``,
``fa4`` when FlashAttention-4 is importable).
"""

from __future__ import annotations

import argparse
import subprocess
import threading
import time

import torch

from bench import PEERS, WORKLOAD_SETS, Workload, median_ms, training_step

SMI_FIELDS = "clocks.sm,power.draw,clocks_throttle_reasons.active"


class SmiSampler:
    """``nvidia-smi`` every 50 ms in a thread: (host time, clock MHz, power W, throttle reasons) rows."""

    def __init__(self):
        self.samples: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits",
                                "-lms", "50"], stdout=subprocess.PIPE, text=True)
        while not self._stop.is_set():
            line = smi.stdout.readline()
            if line:
                self.samples.append((time.perf_counter(), line.strip()))
        smi.kill()

    def __enter__(self):
        self._thread.start()
        time.sleep(1.0)  # nvidia-smi's first rows
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def between(self, t0: float, t1: float) -> str:
        """The clock range, largest power and throttle reasons sampled in ``[t0, t1]``."""
        rows = [line.split(", ") for t, line in self.samples if t0 <= t <= t1]
        rows = [r for r in rows if len(r) == 3 and r[0].isdigit()]
        if not rows:
            return "no sample"
        clocks = [int(r[0]) for r in rows]
        power = max(float(r[1]) for r in rows)
        return f"{min(clocks)}-{max(clocks)} MHz, {power:.0f} W, throttle {sorted({r[2] for r in rows})}"


def stepper(peer, w: Workload):
    """A training step (forward + gradients of q, k, v) of ``peer`` on ``w``, or None if unavailable."""
    made = peer(w)
    return None if made is None else training_step(*made)[0]


def timed_phase(label: str, step) -> None:
    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    ms = median_ms(step)
    after = torch.cuda.memory_stats()
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}
    print(f"  {label:28s} {ms:8.2f} ms   allocator {grew}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="ragged pareto 200 h16 causal", help="a bench.py workload name")
    parser.add_argument("--steps", type=int, default=40, help="steps timed one by one")
    parser.add_argument("--peers", nargs="+", default=["fast", "ours", "fa4"], help="bench.py columns")
    args = parser.parse_args()
    spec = {s.name: s for specs in WORKLOAD_SETS.values() for s in specs}[args.workload]
    w = Workload.of(spec, spec.dim or 128)
    peers = dict(PEERS)
    steps = {name: stepper(peers[name], w) for name in args.peers}
    steps = {name: step for name, step in steps.items() if step is not None}
    first = steps[args.peers[0]]
    for _ in range(3):
        first()
    torch.cuda.synchronize()
    print(f"{args.workload}, {args.peers[0]}: steps one by one", flush=True)
    with SmiSampler() as smi:
        for _ in range(args.steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            first()
            end.record()
            torch.cuda.synchronize()
            print(f"  {start.elapsed_time(end):8.2f} ms   {smi.between(t0, time.perf_counter())}", flush=True)
    print(f"{args.workload}: peers in turns", flush=True)
    for round_ in range(2):
        for name, step in steps.items():
            timed_phase(f"{name} (round {round_})", step)


if __name__ == "__main__":
    main()
