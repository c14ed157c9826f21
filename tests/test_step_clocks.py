"""scripts/step_clocks.py on the CPU: what it reads from nvidia-smi's rows, and its command line."""

import importlib.util
import os
import subprocess
import sys

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
sys.path.insert(0, SCRIPTS)  # it imports bench.py as its sibling
spec = importlib.util.spec_from_file_location("step_clocks", os.path.join(SCRIPTS, "step_clocks.py"))
step_clocks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step_clocks)


def test_sampler_summarizes_the_rows_of_a_window_and_skips_malformed_ones():
    sampler = step_clocks.SmiSampler()
    sampler.samples = [(0.5, "1980, 120.5, 0x0000000000000000"), (1.0, "1965, 690.0, 0x0000000000000004"),
                       (1.5, "[N/A], 700.0, 0x0000000000000004"), (2.0, "1800, 698.2, 0x0000000000000004"),
                       (3.0, "1995, 100.0, 0x0000000000000000")]
    assert sampler.between(0.9, 2.1) == "1800-1965 MHz, 698 W, throttle ['0x0000000000000004']"
    assert sampler.between(0.0, 0.6) == "1980-1980 MHz, 120 W, throttle ['0x0000000000000000']"
    assert sampler.between(5.0, 6.0) == "no sample"


def test_help_runs_without_a_gpu():
    result = subprocess.run([sys.executable, os.path.join(SCRIPTS, "step_clocks.py"), "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "power" in result.stdout
