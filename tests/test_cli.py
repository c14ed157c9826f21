"""The command line: ``jagged-attn demo`` runs on CPU and prints accuracy and time."""

import re
import subprocess
import sys

import torch

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
    args = parser.parse_args(["preprocess", "a", "b", "--device", "cuda", "--chunk-tokens", "4096"])
    assert (args.device, args.chunk_tokens) == ("cuda", 4096)


def test_preprocess_then_inspect_then_load(tmp_path):
    import safetensors.torch

    import jagged_attn as ja

    values = torch.randn(300, 2, 64, dtype=torch.bfloat16)
    safetensors.torch.save_file({"values": values, "lengths": torch.tensor([100, 0, 200])}, tmp_path / "in.st")
    command = ["preprocess", str(tmp_path / "in.st"), str(tmp_path / "out.st"), "--axis", "both",
               "--chunk-tokens", "150"]
    assert main(command) == 0
    assert main(["inspect", str(tmp_path / "out.st")]) == 0
    loaded = ja.load(tmp_path / "out.st")
    expected = ja.quantize_mxfp8(values, torch.tensor([0, 100, 100, 300]), axis="sequence")
    assert torch.equal(loaded["sequence"].data.view(torch.uint8), expected.data.view(torch.uint8))
    (tmp_path / "bad.st").write_bytes((tmp_path / "out.st").read_bytes()[:-7])
    assert main(["inspect", str(tmp_path / "bad.st")]) == 2
