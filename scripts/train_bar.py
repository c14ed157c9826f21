"""The training bar's runs: ``train_lm.py`` for every seed, without and with QK-norm (``--qk-norm off`` or
``on``: one of the two), and every attention, each in a process of its own, ``--parallel`` at a time, then
the ``--summarize`` table of all of them.

    python3 scripts/train_bar.py --attn hopper varlen --seeds 0 1 2 --parallel 3 --out OUT [--budget S] \\
        [--qk-norm both|off|on] [-- TRAIN_LM_ARGS]

Run ``(seed, qk, attn)`` writes ``OUT/<no-qk|qk>-seed<seed>-<attn>/train_lm.json`` and its log beside the
folder (``.log``; a hybrid's ``/`` and ``:`` become ``_`` there). The runs are ordered seed by seed, so that
what finishes first pairs up. One process per run: a failed run (out of memory, say) costs only itself, and
the table pools what did finish. With ``--budget S`` no run starts once the time so far plus the longest
finished run would pass S seconds; runs already going finish. Runs that share a GPU take longer: their
step times are not speeds. Exits non-zero if a run failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import NamedTuple

import train_lm

TRAIN_LM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_lm.py")


class Run(NamedTuple):
    name: str
    argv: list[str]
    log: str


# --qk-norm: the QK-norm settings each seed runs with, in order
QK_NORM = {"both": (False, True), "off": (False,), "on": (True,)}


def bar_runs(attns, seeds, out, extra=(), qk_norm="both") -> list[Run]:
    """The ``train_lm.py`` runs of the bar: per seed, without then with QK-norm (``qk_norm``: a key of
    ``QK_NORM``), each attention (a hybrid's ``/`` and ``:`` become ``_`` in its run's name, which names a
    folder)."""
    runs = []
    for seed in seeds:
        for qk in QK_NORM[qk_norm]:
            for attn in attns:
                name = f"{'qk' if qk else 'no-qk'}-seed{seed}-{attn.replace('/', '_').replace(':', '_')}"
                argv = [sys.executable, TRAIN_LM, "--attn", attn, "--seed", str(seed),
                        "--out", os.path.join(out, name), *(["--qk-norm"] if qk else []), *extra]
                runs.append(Run(name, argv, os.path.join(out, f"{name}.log")))
    return runs


def run_all(runs: list[Run], parallel: int, budget: float | None = None) -> dict[str, int | None]:
    """Run each of ``runs`` (its output into its log), ``parallel`` at a time, in order; with ``budget``
    (seconds), none is started once the time so far plus the longest successful run would pass it.
    Returns each run's exit code, None for those not started."""
    start = time.monotonic()
    pending, going = list(runs), {}  # going: name -> (process, start time)
    codes: dict[str, int | None] = {run.name: None for run in runs}
    longest = 0.0
    while pending or going:
        for name, (process, began) in list(going.items()):
            if process.poll() is not None:
                del going[name]
                codes[name] = process.returncode
                took = time.monotonic() - began
                if process.returncode == 0:
                    longest = max(longest, took)
                print(f"[{time.monotonic() - start:7.1f} s] {name}: exit {process.returncode} after {took:.1f} s",
                      flush=True)
        while pending and len(going) < parallel:
            if budget is not None and time.monotonic() - start + longest > budget:
                print(f"not started (budget {budget:.0f} s): {', '.join(run.name for run in pending)}", flush=True)
                pending = []
                break
            run = pending.pop(0)
            with open(run.log, "w") as log:
                going[run.name] = (subprocess.Popen(run.argv, stdout=log, stderr=subprocess.STDOUT),
                                   time.monotonic())
            print(f"[{time.monotonic() - start:7.1f} s] {run.name}: started", flush=True)
        time.sleep(0.2)
    return codes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attn", nargs="+", default=["hopper", "varlen"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time (each holds its own model)")
    parser.add_argument("--budget", type=float, help="seconds after which no run starts")
    parser.add_argument("--qk-norm", choices=sorted(QK_NORM), default="both",
                        help="run each seed without QK-norm, with it, or both (default)")
    parser.add_argument("--out", default="train_bar_out")
    parser.add_argument("train_lm_args", nargs=argparse.REMAINDER, help="after --: passed to every train_lm.py run")
    args = parser.parse_args(argv)
    extra = args.train_lm_args[1:] if args.train_lm_args[:1] == ["--"] else args.train_lm_args
    os.makedirs(args.out, exist_ok=True)
    runs = bar_runs(args.attn, args.seeds, args.out, extra, args.qk_norm)
    codes = run_all(runs, args.parallel, args.budget)
    finished = [os.path.join(args.out, run.name, "train_lm.json") for run in runs if codes[run.name] == 0]
    if finished:
        train_lm.main(["--summarize", *finished])
    failed = [f"{run.name} (exit {codes[run.name]}, {run.log})" for run in runs if codes[run.name] not in (0, None)]
    if failed:
        print("failed: " + "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
