"""One-call GPU check: install, every GPU test, the demo on CUDA, the backward's accuracy policy over many
draws (``bwd_policy_sweep.py``, the backward alone and the public call), then the benchmark.

    python3 scripts/gpu_check.py [--out DIR] [--policy-draws N] [--bench-args ...]

Logs go under ``--out`` (default ``$OUT`` on the device machine); the accuracy lines and the
benchmark table are printed last, so the tail of the output is the summary.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(command, log_path, env=None):
    """Run ``command`` in the repo, tee its output into ``log_path``; return (exit code, output)."""
    start = time.time()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env=env)
        lines = []
        for line in process.stdout:
            log.write(line)
            log.flush()
            lines.append(line)
        code = process.wait()
    print(f"[{time.time() - start:6.1f} s] exit {code}: {' '.join(command)}", flush=True)
    return code, "".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    parser.add_argument("--tests", nargs="*", default=["tests"])
    parser.add_argument("--policy-draws", type=int, default=20,
                        help="draws of scripts/bwd_policy_sweep.py (the backward's accuracy bars counted; 0: none)")
    parser.add_argument("--bench-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    python = sys.executable
    run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", "."],
        os.path.join(args.out, "install.log"))
    run(["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw", "--format=csv"],
        os.path.join(args.out, "gpu.log"))
    code, tests = run([python, "-m", "pytest", "-q", "-m", "gpu", "-s", "-rfE", *args.tests],
                      os.path.join(args.out, "pytest_gpu.log"))
    demo_code, demo = run([python, "-m", "jagged_attn.cli", "demo", "--device", "cuda"],
                          os.path.join(args.out, "demo.log"))
    policy = []
    for through in ("backward", "public") if args.policy_draws else ():
        _, sweep = run([python, "scripts/bwd_policy_sweep.py", "--draws", str(args.policy_draws), "--through", through,
                        "--json", os.path.join(args.out, f"bwd_policy_{through}.json")],
                       os.path.join(args.out, f"bwd_policy_{through}.log"))
        policy.append(sweep[sweep.rfind("\n== ") + 1:] if "\n== " in sweep else sweep[-3000:])  # its summary
    bench_code, bench = run([python, "scripts/bench.py", "--out", os.path.join(args.out, "bench"), *args.bench_args],
                            os.path.join(args.out, "bench.log"))
    accuracy = [line for line in tests.splitlines() if "rel-L2" in line or "passed" in line or "FAILED" in line]
    print("\n".join(accuracy[-60:]))
    print(demo)
    print("\n".join(policy))
    print(bench[bench.rfind("\n", 0, bench.find("ceilings:")) + 1:] if "ceilings:" in bench else bench[-6000:])
    sys.exit(code or demo_code or bench_code)


if __name__ == "__main__":
    main()
