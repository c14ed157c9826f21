"""The command line: ``jagged-attn demo`` runs on CPU and prints accuracy and time."""

import re
import subprocess
import sys

from jagged_attn.cli import build_parser, main


def test_demo_runs_on_cpu_and_reports_accuracy():
    cmd = [sys.executable, "-m", "jagged_attn.cli", "demo", "--lengths", "0,1,33,129", "--heads", "4",
           "--kv-heads", "2", "--head-dim", "64", "--device", "cpu"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for name in ("O", "dQ", "dK", "dV"):
        match = re.search(rf"^{name}\s+([0-9.e+-]+)\s+([0-9.]+)$", result.stdout, re.M)
        assert match, result.stdout
        assert float(match.group(1)) < 0.15 and float(match.group(2)) > 0.98
    assert "backend=reference" in result.stdout and "ms" in result.stdout


def test_demo_error_is_reported_not_raised(capsys):
    assert main(["demo", "--lengths", "3,4", "--head-dim", "48", "--device", "cpu"]) == 2
    assert "multiple of 32" in capsys.readouterr().err


def test_parser_knows_the_subcommands():
    parser = build_parser()
    assert parser.parse_args(["preprocess", "in.safetensors", "out.safetensors", "--axis", "both"]).axis == "both"
    assert parser.parse_args(["inspect", "f"]).file == "f"
