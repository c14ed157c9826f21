"""Benchmark offline preprocessing (``preprocess_file``) against this machine's own ceilings.

Measures, in one process: memory copy bandwidth (a 1 GiB ``Tensor.copy_`` into a reused buffer,
1, 2 and all threads, and the same into freshly allocated memory), the rate of writing a new file and
of reading it back from the page cache (in the output directory and in /dev/shm), SHA-256, and the
compiled quantizer alone on one in-memory chunk. Then runs ``preprocess_file`` on a bf16 input
(made here unless ``--input`` is given: ``[tokens, 1024]`` values read with ``heads=8``, lognormal
lengths) and prints input GB/s end to end and per stage (input bytes over that stage's busy
seconds; the writer thread's stages overlap the main thread's).

    python3 scripts/bench_preprocess.py [--gib 1] [--axes feature sequence both] [--repeats 3]
        [--workdir DIR] [--input FILE] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import tempfile
import time

import torch
from safetensors.torch import save_file

from jagged_attn.offsets import offsets_from_lengths
from jagged_attn.quantize import quantize_mxfp8
from jagged_attn.preprocess import DEFAULT_CHUNK_VALUES, preprocess_file

GIB = 1 << 30
ROW_VALUES, HEADS = 1024, 8
PROBE_BYTES = 512 << 20  # size of the file written to measure write and read rates
PROBE_BLOCK = 16 << 20  # one pwrite: about one chunk's FP8 data
STAGES = ("read", "quantize", "tile", "wait", "hash", "write")


def best_seconds(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def copy_rates(threads: int) -> tuple[float, float]:
    """(reused-buffer, fresh-buffer) GB/s of a 1 GiB ``copy_`` with ``threads`` threads (bytes copied / s)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    source = torch.full((GIB,), 3, dtype=torch.uint8)
    target = torch.empty_like(source).fill_(1)
    reused = GIB / best_seconds(lambda: target.copy_(source), 5) / 1e9
    fresh = GIB / best_seconds(lambda: torch.empty_like(source).copy_(source), 3) / 1e9
    torch.set_num_threads(previous)
    return reused, fresh


def file_rates(directory: str) -> tuple[float, float, float]:
    """(new file, overwrite, page-cache read) GB/s of a ``PROBE_BYTES`` file in ``PROBE_BLOCK`` pieces."""
    block = torch.randint(0, 256, (PROBE_BLOCK,), dtype=torch.uint8).numpy()
    path = os.path.join(directory, f".bench_preprocess_probe{os.getpid()}")

    def write(flags):
        fd = os.open(path, flags, 0o644)
        for position in range(0, PROBE_BYTES, PROBE_BLOCK):
            os.pwrite(fd, memoryview(block), position)
        os.close(fd)

    def read():
        fd = os.open(path, os.O_RDONLY)
        for position in range(0, PROBE_BYTES, PROBE_BLOCK):
            os.preadv(fd, [memoryview(block)], position)
        os.close(fd)

    try:
        started = time.perf_counter()
        write(os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        new = PROBE_BYTES / (time.perf_counter() - started) / 1e9
        overwrite = PROBE_BYTES / best_seconds(lambda: write(os.O_WRONLY), 3) / 1e9
        cached = PROBE_BYTES / best_seconds(read, 3) / 1e9
    finally:
        os.unlink(path)
    return new, overwrite, cached


def sha256_rate() -> float:
    block = memoryview(torch.randint(0, 256, (PROBE_BLOCK,), dtype=torch.uint8).numpy())
    return 16 * PROBE_BLOCK / best_seconds(lambda: [hashlib.sha256(block) for _ in range(16)], 3) / 1e9


def make_input(path: str, gib: float) -> None:
    """bf16 ``values [tokens, 1024]`` (N(0,1)) and lognormal ``lengths`` (median 1500, 135 to 16384)."""
    total = int(gib * GIB) // (2 * ROW_VALUES)
    lengths = torch.exp(math.log(1500) + 0.8 * torch.randn(2 * total // 135 + 1)).clamp(135, 16384).long()
    lengths = lengths[: int(torch.searchsorted(torch.cumsum(lengths, 0), total)) + 1]
    lengths[-1] -= int(lengths.sum()) - total
    save_file({"values": torch.randn(total, ROW_VALUES).bfloat16(), "lengths": lengths}, path)


def quantizer_rate(axis: str, device: str) -> float:
    """GB/s of bf16 read by ``quantize_mxfp8`` alone on one default-size in-memory chunk (warm)."""
    tokens = DEFAULT_CHUNK_VALUES // ROW_VALUES
    values = torch.randn(tokens, HEADS, ROW_VALUES // HEADS).bfloat16().to(device)
    offsets = offsets_from_lengths(torch.full((tokens // 1500,), 1500)).to(device)
    offsets[-1] = tokens

    def run():
        quantize_mxfp8(values, offsets, axis=axis, compile=True).data.cpu()

    run()
    return values.nbytes / best_seconds(run, 5) / 1e9


def stage_cell(stats: dict, stage: str) -> str:
    """``GB/s(seconds)`` of one stage: input bytes over its busy seconds."""
    seconds = stats["stage_seconds"].get(stage, 0.0)
    if seconds < 1e-3:
        return f"{'-':>11}"
    return f"{stats['input_bytes'] / seconds / 1e9:5.1f}({seconds:.2f})".rjust(11)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="size of the generated input")
    parser.add_argument("--axes", nargs="+", default=["feature", "sequence", "both"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="where input and output go (default: a temp dir)")
    parser.add_argument("--input", default=None, help="an existing input file (values [tokens, 1024])")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_preprocess_")
    os.makedirs(workdir, exist_ok=True)
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.2f}, workdir {workdir}")
    write_rate = {}
    for directory in (workdir, "/dev/shm"):
        new, overwrite, cached = file_rates(directory)
        write_rate[directory] = new
        print(f"file in {directory}: new file {new:.2f} GB/s, overwrite {overwrite:.2f} GB/s, "
              f"page-cache read {cached:.2f} GB/s")
    copy = {threads: copy_rates(threads) for threads in sorted({1, 2, torch.get_num_threads()})}
    for threads, (reused, fresh) in copy.items():
        print(f"memory copy, {threads} thread(s): {reused:.1f} GB/s into a reused buffer, "
              f"{fresh:.1f} GB/s into fresh memory (bytes copied per s; read + write is twice that)")
    print(f"sha256: {sha256_rate():.2f} GB/s")
    for axis in ("feature", "sequence"):
        print(f"quantize_mxfp8 alone ({args.device}, compiled, one chunk in memory), {axis}: "
              f"{quantizer_rate(axis, args.device):.2f} GB/s of bf16")

    source = args.input or os.path.join(workdir, "input.safetensors")
    if not args.input:
        make_input(source, args.gib)
    output = os.path.join(workdir, "output.safetensors")
    preprocess_file(source, output, heads=HEADS, axis="feature", progress=False, device=args.device,
                    overwrite=True)  # compile
    reference = copy[torch.get_num_threads()][0]
    header = f"{'axis':9} {'run':>3} {'s':>6} {'GB/s':>6} {'%copy':>6} {'x write':>7} " + " ".join(
        f"{stage:>11}" for stage in STAGES
    )
    print(f"\npreprocess_file: GB/s of input; %copy vs {reference:.1f} GB/s copy_ ({torch.get_num_threads()} threads); "
          f"x write vs the new-file rate ({write_rate[workdir]:.2f} GB/s); per stage: input GB/s over its busy "
          "seconds (seconds)")
    print(header)
    for axis in args.axes:
        for run in range(args.repeats):
            if os.path.exists(output):
                os.unlink(output)
            stats = preprocess_file(source, output, heads=HEADS, axis=axis, progress=False, device=args.device,
                                    overwrite=True)
            rate = stats["input_gb_per_s"]
            stages = " ".join(stage_cell(stats, stage) for stage in STAGES)
            print(f"{axis:9} {run:3d} {stats['seconds']:6.2f} {rate:6.3f} {100 * rate / reference:5.1f}% "
                  f"{rate / write_rate[workdir]:7.2f} {stages}")
    os.unlink(output)
    print(f"input: {stats['input_bytes']:,} bytes, {stats['tokens']:,} tokens, {stats['sequences']} sequences, "
          f"{stats['chunks']} chunks; load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
