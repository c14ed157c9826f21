"""Reliability (issue #27): no input, file or command line corrupts memory, exhausts it, or returns a
silent wrong answer. What could crash or exhaust the interpreter runs in a child process, so that a
regression fails its test instead of the test run."""

import subprocess
import sys
import textwrap

CHILD_TIMEOUT_S = 300


def run_child(code: str, *args, memory_gib: int | None = None) -> str:
    """``code`` in a fresh interpreter (optionally capped at ``memory_gib`` GiB of address space);
    returns its stdout, fails the test on a non-zero exit, a signal or a traceback."""
    limit = (f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({memory_gib} << 30, {memory_gib} << 30))\n"
             if memory_gib else "")
    result = subprocess.run([sys.executable, "-c", limit + textwrap.dedent(code), *map(str, args)],
                            capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def test_preprocess_peak_memory_is_bounded_by_a_chunk_for_many_empty_sequences(tmp_path):
    """Every sequence, empty or not, starts a fresh 128-row scale tile: 20,000 empty sequences of 8 heads
    (D = 128) are 78 MiB of scales per axis. They were one chunk (peak ~3x the scales: 0.39 GiB above
    the start here for both axes, 2.6 GB for the issue's 200,000); chunks bounded by the placement
    keep the peak to a few of their scale buffers."""
    peak_mib = float(run_child("""
        import resource, sys, torch
        from safetensors.torch import save_file
        from jagged_attn.preprocess import preprocess_file
        source, output = sys.argv[1:]
        save_file({"values": torch.zeros(0, 8 * 128, dtype=torch.bfloat16),
                   "offsets": torch.zeros(20_001, dtype=torch.int64)}, source)
        start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        stats = preprocess_file(source, output, axis="both", heads=8, chunk_tokens=1024, progress=False)
        assert stats["output_bytes"] > 2 * 78 * 2**20, stats
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) / 1024)
    """, tmp_path / "in.safetensors", tmp_path / "out.safetensors"))
    assert peak_mib < 64, f"peak RSS grew by {peak_mib:.0f} MiB"
