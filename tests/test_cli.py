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
    for name in ("hopper", "triton-fast", "exact"):  # the deprecated names too, for one release
        assert parser.parse_args(["demo", "--backend", name]).backend == name


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


def _cli(*args):
    """``jagged-attn`` in a child process: (exit code, stdout, stderr)."""
    result = subprocess.run([sys.executable, "-m", "jagged_attn.cli", *map(str, args)], capture_output=True,
                            text=True, timeout=300)
    return result.returncode, result.stdout, result.stderr


def _one_line_error(code, stderr, words):
    assert code == 2 and "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert words in stderr, stderr


def test_preprocess_never_destroys_data_and_fails_in_one_line(tmp_path):
    import safetensors.torch

    source = tmp_path / "in.st"
    safetensors.torch.save_file({"values": torch.randn(40, 64), "lengths": torch.tensor([30, 10])}, source)
    original = source.read_bytes()

    _one_line_error(*_cli("preprocess", source, source, "--force")[::2], "is the input file")
    assert source.read_bytes() == original  # the input was not replaced by its own output

    output = tmp_path / "out.st"
    output.write_bytes(b"precious")
    _one_line_error(*_cli("preprocess", source, output)[::2], "exists")
    assert output.read_bytes() == b"precious"
    assert _cli("preprocess", source, output, "--force")[0] == 0
    assert output.read_bytes() != b"precious"

    _one_line_error(*_cli("preprocess", source, tmp_path)[::2], "is a directory")
    _one_line_error(*_cli("preprocess", source, tmp_path / "missing" / "out.st")[::2], "No such file")
    _one_line_error(*_cli("preprocess", tmp_path / "nothing.st", tmp_path / "new.st")[::2], "no such file")
    if not torch.cuda.is_available():
        _one_line_error(*_cli("preprocess", source, tmp_path / "new.st", "--device", "cuda")[::2], "no CUDA device")
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert leftovers == ["in.st", "out.st"], leftovers  # no temporary files, no half-written outputs


def test_errors_spanning_lines_print_one(tmp_path, capsys):
    """torch.load's refusals span lines (found by tests/test_reliability.py's preprocess fuzzer)."""
    import datetime

    torch.save({"values": torch.randn(4, 32), "lengths": torch.tensor([4]), "when": datetime.date(2026, 1, 1)},
               tmp_path / "in.pt")
    assert main(["preprocess", str(tmp_path / "in.pt"), str(tmp_path / "out.st")]) == 2
    stderr = capsys.readouterr().err
    assert len(stderr.strip().splitlines()) == 1 and "cannot read it as a safetensors or torch file" in stderr


def _cli_on_terminal(*args):
    """``jagged-attn`` in a child process whose stderr is a pseudo-terminal: (exit code, stdout, what the
    terminal received)."""
    import os
    import pty
    import select

    leader, follower = pty.openpty()
    received = []
    try:
        with subprocess.Popen([sys.executable, "-m", "jagged_attn.cli", *map(str, args)], stdout=subprocess.PIPE,
                              stderr=follower, text=True) as child:
            os.close(follower)
            while select.select([leader], [], [], 300)[0]:
                try:
                    data = os.read(leader, 4096)
                except OSError:  # EIO: the child, the last holder of the terminal, has exited
                    break
                if not data:
                    break
                received.append(data)
            else:
                child.kill()
            stdout = child.stdout.read()
    finally:
        os.close(leader)
    return child.returncode, stdout, b"".join(received).decode()


def test_preprocess_progress_only_on_a_terminal(tmp_path):
    import time

    import safetensors.torch

    source = tmp_path / "in.st"
    safetensors.torch.save_file({"values": torch.randn(3200, 64), "lengths": torch.full((200,), 16)}, source)
    command = ("preprocess", source)
    summary = r"^wrote \S+: 200 sequences, 3200 tokens, .* tokens/s, sha256:[0-9a-f]{64}$"

    code, stdout, stderr = _cli(*command, tmp_path / "piped.st", "--chunk-tokens", 16)
    assert code == 0 and stderr == "", stderr  # stderr is a pipe here: no progress
    assert re.match(summary, stdout, re.M), stdout

    started = time.perf_counter()
    code, stdout, terminal = _cli_on_terminal(*command, tmp_path / "tty.st", "--chunk-tokens", 16)
    seconds = time.perf_counter() - started
    assert code == 0 and re.match(summary, stdout, re.M), (stdout, terminal)
    lines = [line.rstrip() for line in re.split(r"[\r\n]+", terminal) if line.strip()]
    assert lines and all(line.startswith("preprocess ") for line in lines), terminal
    assert any(re.search(r"chunk \d+/200 .* tokens/s  ETA \d+:\d\d$", line) for line in lines), terminal
    assert re.search(r"^preprocess 100\.0%  chunk 200/200  3\.2k/3\.2k tokens .* done in \d+:\d\d$", lines[-1])
    assert len(lines) <= 3 + 4 * seconds + 1, lines  # start, first ETA, end, and at most 4 a second
    assert (tmp_path / "tty.st").read_bytes() == (tmp_path / "piped.st").read_bytes()



def test_no_progress_silences_a_terminal(tmp_path, monkeypatch, capsys):
    """In this process (a child costs seconds of imports), with stderr a real pseudo-terminal."""
    import os
    import pty
    import select

    import safetensors.torch

    safetensors.torch.save_file({"values": torch.randn(300, 64), "lengths": torch.full((30,), 10)}, tmp_path / "in.st")
    leader, follower = pty.openpty()
    with os.fdopen(follower, "w") as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        assert main(["preprocess", str(tmp_path / "in.st"), str(tmp_path / "out.st"), "--chunk-tokens", "10",
                     "--no-progress"]) == 0
        assert not select.select([leader], [], [], 0)[0], os.read(leader, 4096)  # nothing reached the terminal
    os.close(leader)
    assert capsys.readouterr().out.startswith("wrote ")
