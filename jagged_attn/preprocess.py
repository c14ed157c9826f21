"""Offline MXFP8 preprocessing: quantize a jagged tensor file once, in bounded memory.

Input file (safetensors, or a torch ``.pt`` dict saved with ``torch.save``):

* ``values``: bfloat16 / float16 / float32, ``[total, heads, D]`` or ``[total, D]``
  (``heads=H`` reads ``[total, H * D]`` as ``[total, H, D]``); D a multiple of 32, ``heads * D`` at most
  ``MAX_ROW_VALUES`` (16M);
* and exactly one of ``offsets`` (int32/int64 ``[B + 1]``, starting at 0, ending at ``total``) or
  ``lengths`` (fbgemm's form: int32/int64 ``[B]``, turned into int64 offsets).

The input is memory-mapped and quantized in chunks of whole sequences (``chunk_tokens`` tokens, or
one longer sequence), so memory is bounded by the chunk, never by the file. A writer thread hashes
and writes chunk ``i`` while chunk ``i + 1`` is quantized (torch ops, ``pwrite`` and SHA-256 all
release the GIL). The output is exactly the file that
``save(output, quantize_mxfp8(values, offsets, axis=..., rounding=...))`` would write (with
``axis="both"``: ``save(output, {"feature": ..., "sequence": ...})``), byte for byte.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import mmap
import os
import sys
import time
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors import safe_open

from .mx_format import BLOCK_SIZE, check_rounding
from .mxfp8 import AXES, check_values
from .offsets import INDEX_DTYPES, lengths_of, offsets_from_lengths, padded_seq_start, padded_tile, validate_offsets
from .quantize import quantize_mxfp8
from .scale_layout import TILE_ROWS, num_tiles
from .serialization import (
    SINGLE_ENTRY_NAME,
    Entry,
    MXFP8FileWriter,
    read_header,
    scale_tiles,
    tensor_regions,
    token_tile_dim,
)

# One chunk holds about this many values (its fp32/fp64 working copies are a few hundred MB).
DEFAULT_CHUNK_VALUES = 1 << 24
# Scale-placement rows a chunk may hold per token of its budget: a padded row's scale bytes (heads * D / 32)
# are a 32nd of a token's values, so a chunk's scales stay within one byte per value of a full chunk.
PADDED_ROWS_PER_TOKEN = BLOCK_SIZE
COMPILE_MIN_VALUES = 1 << 22  # below this, compiling the quantizer costs more than it saves
# A token's values (heads * D), at most: every sequence, an empty one too, places 128 rows of scales (4 bytes
# per value of a row), so wider rows would let a small file of empty sequences ask for gigabytes at once.
MAX_ROW_VALUES = DEFAULT_CHUNK_VALUES
INDEX_KEYS = ("offsets", "lengths")
CHUNKS_IN_FLIGHT = 2  # quantized chunks waiting for the writer thread, at most
WRITER_CORES = 1  # cores the CPU quantizer leaves to the writer thread
_PROGRESS_INTERVAL_S = 0.25  # the terminal line is rewritten at most 4 times a second


class _JaggedSource:
    """Row ranges of ``values`` (``row_values`` values a token, at most ``MAX_ROW_VALUES``) and the whole
    offsets of an input file, read lazily."""

    def __init__(self, path, heads):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"{self.path}: no such file")
        try:
            open_input = _open_torch if zipfile.is_zipfile(self.path) else _open_safetensors
            self._read, shape, tensors = open_input(self.path)
        except Exception as error:  # torch and safetensors each have their own exception classes
            raise ValueError(f"{self.path}: cannot read it as a safetensors or torch file: {error}") from error
        if shape is None:
            raise ValueError(f"{self.path}: no 'values' tensor (keys: {sorted(tensors)})")
        self.offsets = _offsets_of(tensors, self.path)
        self.shape = _heads_shape(shape, heads, self.path)
        self.row_values = self.shape[1] * (self.shape[2] if len(self.shape) == 3 else 1)  # values a token
        if self.row_values > MAX_ROW_VALUES:
            raise ValueError(f"{self.path}: {self.row_values} values a token, at most {MAX_ROW_VALUES} here (each "
                             f"sequence, even an empty one, places 128 rows of their scales)")
        empty = self.rows(0, 0)
        check_values(empty, f"{self.path}: values")
        self.dtype = empty.dtype
        validate_offsets(self.offsets, self.shape[0], f"{self.path}: offsets")

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """``values[start:stop]``, shaped like the output (``heads`` applied)."""
        return self._read(slice(start, stop)).reshape(stop - start, *self.shape[1:])


def _open_torch(path):
    """(values row reader, values shape, {name: tensor}) of a ``torch.save``-d dict, memory-mapped."""
    tensors = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(tensors, dict):
        raise TypeError(f"expected a dict of tensors, found a {type(tensors).__name__}")
    values = tensors.get("values")
    if not isinstance(values, torch.Tensor):
        return None, None, tensors
    return values.__getitem__, tuple(values.shape), tensors


def _open_safetensors(path):
    """(values row reader, values shape, {name: offsets or lengths tensor, or None}) of a safetensors file.

    ``values`` is a view of the memory-mapped file (copy-on-write, never written): rows are read
    from the page cache by the quantizer itself, with no copy in between.
    """
    file = safe_open(path, framework="pt", device="cpu")
    tensors = {key: file.get_tensor(key) if key in INDEX_KEYS else None for key in file.keys()}
    if "values" not in tensors:
        return None, None, tensors
    shape = tuple(file.get_slice("values").get_shape())
    dtype = file.get_slice("values")[0:0].dtype
    header_bytes, regions = tensor_regions(path)
    begin, end = regions["values"]
    if begin == end:
        return torch.empty(shape, dtype=dtype).__getitem__, shape, tensors
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    count = (end - begin) // dtype.itemsize
    values = torch.frombuffer(mapped, dtype=dtype, count=count, offset=header_bytes + begin).view(shape)
    return values.__getitem__, shape, tensors


def _offsets_of(tensors, path) -> torch.Tensor:
    has_offsets, has_lengths = "offsets" in tensors, "lengths" in tensors
    if has_offsets == has_lengths:
        raise ValueError(f"{path}: needs exactly one of 'offsets' or 'lengths' (keys: {sorted(tensors)})")
    if has_offsets:
        return tensors["offsets"]
    lengths = tensors["lengths"]
    if not isinstance(lengths, torch.Tensor) or lengths.dtype not in INDEX_DTYPES or lengths.dim() != 1:
        raise ValueError(f"{path}: lengths must be a 1-D int32/int64 tensor, got {lengths!r:.80}")
    if bool((lengths < 0).any()):
        raise ValueError(f"{path}: lengths must be non-negative")
    return offsets_from_lengths(lengths)


def _heads_shape(shape, heads, path) -> tuple[int, ...]:
    if heads is None:
        return shape
    if len(shape) == 3 and shape[1] == heads:
        return shape
    if len(shape) != 2 or heads < 1 or shape[1] % heads:
        raise ValueError(f"{path}: heads={heads} needs values [total, heads * D], got {list(shape)}")
    return (shape[0], heads, shape[1] // heads)


def sequence_chunks(offsets: torch.Tensor, chunk_tokens: int):
    """Yield ``(first, end)`` sequence ranges (at least one sequence each) of at most ``chunk_tokens``
    tokens and at most ``chunk_tokens * PADDED_ROWS_PER_TOKEN`` rows of the padded scale placement.

    Every sequence, empty ones too, starts a fresh 128-row scale tile, so a chunk's scale buffers
    grow with its sequences as well as its tokens (200,000 empty sequences made one chunk of
    783 MiB of scales, 2.6 GB at the peak); bounding both keeps memory to a chunk."""
    batch = offsets.numel() - 1
    tiles = padded_tile(offsets, torch.arange(batch + 1), TILE_ROWS)  # strictly increasing
    tile_budget = chunk_tokens * PADDED_ROWS_PER_TOKEN // TILE_ROWS
    first = 0
    while first < batch:
        by_tokens = int(torch.searchsorted(offsets, offsets[first] + chunk_tokens, right=True)) - 1
        by_tiles = int(torch.searchsorted(tiles, tiles[first] + tile_budget, right=True)) - 1
        end = min(max(min(by_tokens, by_tiles), first + 1), batch)
        yield first, end
        first = end


def _token_tiles(offsets: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
    """First 128-token scale tile of each sequence: its padded start over the tile height."""
    return padded_seq_start(offsets[sequences], sequences) // TILE_ROWS


def _global_scale_tiles(local, entry, chunk_offsets, first, end, offsets):
    """The whole tiles that sequences ``first:end`` occupy in the full tensor's scale buffer.

    Every sequence owns whole 128-token tiles starting at its padded start, in both axes, and no
    other sequence writes into them. So the tiles of the chunk quantized on its own (local offsets)
    move to the full buffer by a whole-tile shift per sequence: no re-tiling, no scale math. The
    returned block covers tiles ``[start, stop)`` of the full buffer (padding tiles zero), where
    ``stop`` is the next chunk's ``start``.
    """
    dim = token_tile_dim(entry.axis)
    local_tiles = scale_tiles(local.scales, Entry.of(entry.name, local))
    sequences = torch.arange(first, end)
    start, stop = (int(t) for t in _token_tiles(offsets, torch.tensor([first, end])))
    lengths = lengths_of(chunk_offsets)
    counts = num_tiles(lengths, TILE_ROWS)
    within = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    source = torch.repeat_interleave(_token_tiles(chunk_offsets, sequences - first), counts) + within
    target = torch.repeat_interleave(_token_tiles(offsets, sequences), counts) + within - start
    shape = list(local_tiles.shape)
    shape[dim] = stop - start
    block = local_tiles.new_zeros(shape)
    block.index_copy_(dim, target, local_tiles.index_select(dim, source))
    return block, start


@contextlib.contextmanager
def _quantizer_threads(device):
    """Leave ``WRITER_CORES`` of torch's intra-op threads to the writer while quantizing on the CPU.

    OpenMP regions wait for their slowest thread, so a quantizer that keeps every core busy stalls
    each time the writer thread takes one of them (on 2 cores, under load, whole runs took 2-6x
    longer that way). torch's thread count is restored afterwards.
    """
    previous = torch.get_num_threads()
    if torch.device(device).type == "cpu":
        torch.set_num_threads(max(1, previous - WRITER_CORES))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class _StageClock:
    """Seconds spent in each main-thread stage of the pipeline."""

    def __init__(self):
        self.seconds = dict.fromkeys(("read", "quantize", "tile", "wait"), 0.0)

    @contextlib.contextmanager
    def __call__(self, stage: str):
        started = time.perf_counter()
        yield
        self.seconds[stage] += time.perf_counter() - started


def _store(writer, name, data, row_start, tiles) -> None:
    """Writer-thread work for one quantized chunk: its data rows and its whole scale tiles."""
    writer.write_data(name, data, row_start)
    writer.write_scale_tiles(name, *tiles)


@dataclasses.dataclass(frozen=True)
class PreprocessProgress:
    """Where a ``preprocess_file`` run stands, as passed to its ``progress`` callback."""

    chunks_done: int
    chunks_total: int
    tokens_done: int
    tokens_total: int
    seconds: float  # since the run started

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_done / self.seconds if self.seconds > 0 else 0.0

    @property
    def eta_seconds(self) -> float | None:
        """Seconds left at the rate so far: ``None`` until a token is done, 0 once all are."""
        left = self.tokens_total - self.tokens_done
        if left == 0:
            return 0.0
        rate = self.tokens_per_s
        return left / rate if rate > 0 else None


class _TerminalProgress:
    """``progress=True``: one line on ``stream``, rewritten in place (``\\r``) at most every
    ``_PROGRESS_INTERVAL_S``; shown at once at the start, with the first ETA, and at the end (then a newline)."""

    def __init__(self, stream):
        self.stream = stream
        self.shown_at = None
        self.estimated = False
        self.width = 0

    def __call__(self, state: PreprocessProgress) -> None:
        now = time.perf_counter()
        final = state.chunks_done == state.chunks_total
        first_estimate = not self.estimated and state.eta_seconds is not None
        if not (final or first_estimate or self.shown_at is None or now - self.shown_at >= _PROGRESS_INTERVAL_S):
            return
        self.shown_at, self.estimated = now, self.estimated or first_estimate
        line = _progress_line(state, final)
        self.stream.write("\r" + line.ljust(self.width) + ("\n" if final else ""))  # ljust: cover a longer line
        self.stream.flush()
        self.width = len(line)


def _progress_line(state: PreprocessProgress, final: bool) -> str:
    if state.tokens_total:
        percent = 100.0 * state.tokens_done / state.tokens_total
    else:  # only empty sequences
        percent = 100.0 * state.chunks_done / max(state.chunks_total, 1)
    eta = state.eta_seconds
    timing = f"done in {_clock(state.seconds)}" if final else f"ETA {'?' if eta is None else _clock(eta)}"
    return (f"preprocess {percent:5.1f}%  chunk {state.chunks_done:,}/{state.chunks_total:,}  "
            f"{_short(state.tokens_done)}/{_short(state.tokens_total)} tokens  "
            f"{_short(state.tokens_per_s)} tokens/s  {timing}")


def _short(count: float) -> str:
    """``count`` in a few characters: 950, 12.3k, 4.5M, 1.2G."""
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return f"{count:.0f}"


def _clock(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour on."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02}:{secs:02}" if hours else f"{minutes}:{secs:02}"


def _progress_callback(progress) -> Callable[[PreprocessProgress], None] | None:
    if isinstance(progress, bool):
        return _TerminalProgress(sys.stderr) if progress else None
    if callable(progress):
        return progress
    raise TypeError(f"progress must be a bool or a callable, got {type(progress).__name__}")


def _check_output_path(input_path, output_path, overwrite: bool) -> None:
    """Refuse an output that is the input (the rename at the end would replace what is being read), a
    directory, or an existing file without ``overwrite``."""
    output_path = os.fspath(output_path)
    if os.path.isdir(output_path):
        raise IsADirectoryError(f"output {output_path!r} is a directory")
    if not os.path.exists(output_path):
        return
    if os.path.exists(input_path) and os.path.samefile(input_path, output_path):
        raise ValueError(f"output {output_path!r} is the input file: write to another path")
    if not overwrite:
        raise FileExistsError(f"output {output_path!r} exists: pass overwrite=True (--force) to replace it")


def preprocess_file(
    input_path,
    output_path,
    *,
    axis: str = "feature",
    rounding: str = "rceil",
    heads: int | None = None,
    chunk_tokens: int | None = None,
    progress: bool | Callable[[PreprocessProgress], None] = False,
    compile: bool | None = None,
    device: str | torch.device = "cpu",
    overwrite: bool = False,
) -> dict:
    """Quantize the jagged tensor in ``input_path`` to MXFP8 and write it to ``output_path``.

    The file appears whole or not at all (written to a temporary file beside it, renamed into place;
    an error removes the temporary file). An existing ``output_path`` is replaced only with
    ``overwrite``, and never when it is the input itself.

    Args:
        input_path: safetensors or torch file with ``values`` and ``offsets`` or ``lengths``
            (module docstring).
        output_path: the file to write; ``jagged_attn.load`` reads it back, verified.
        axis: ``"feature"``, ``"sequence"``, or ``"both"`` (a dict file ``{"feature", "sequence"}``).
        rounding: ``"rceil"`` or ``"floor"``.
        heads: split ``values [total, H * D]`` into ``H`` heads.
        chunk_tokens: tokens per chunk (default: about 16M values per chunk).
        progress: ``False`` (quiet), ``True`` (a line on stderr, rewritten in place a few times a
            second: chunks and tokens done, tokens/s, ETA; ``jagged-attn preprocess`` shows it when
            stderr is a terminal), or a callable given a ``PreprocessProgress`` with
            ``chunks_done`` 0, 1, ..., ``chunks_total`` in order, once each; the last call comes after
            the file is complete. It runs on the calling thread; what it raises aborts the run.
        compile: quantize through ``torch.compile`` (bit-identical, several times faster; the
            first chunk pays a few seconds of compilation). Default: only for inputs of more than
            ``COMPILE_MIN_VALUES`` values.
        device: where chunks are quantized: ``"cuda"`` runs the fused Triton quantize kernel
            (``jagged_attn.kernels.producers.quantize``, bit-identical to the CPU path); files are read and
            written on the host either way.
        overwrite: replace an existing ``output_path`` (``FileExistsError`` otherwise).

    Returns:
        Statistics: sequences, tokens, heads, head_dim, axis, rounding, chunks, input/output bytes,
        seconds, tokens_per_s, input_gb_per_s, checksum, and ``stage_seconds``: busy seconds of each
        stage (``read``: views of the mapped input, plus the copy to ``device``; ``quantize``;
        ``tile``: placing scale tiles; ``wait``: the main thread waiting for the writer; ``hash``
        and ``write``: the writer thread, closing included).
    """
    if axis not in (*AXES, "both"):
        raise ValueError(f"axis must be 'feature', 'sequence' or 'both', got {axis!r}")
    check_rounding(rounding)
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    _check_output_path(input_path, output_path, overwrite)
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: no CUDA device is available here")
    source = _JaggedSource(input_path, heads)
    offsets, shape = source.offsets.to(torch.int64), source.shape
    total, batch = shape[0], offsets.numel() - 1
    row_values = source.row_values
    chunk_tokens = chunk_tokens or max(1, DEFAULT_CHUNK_VALUES // row_values)
    if compile is None:
        compile = total * row_values > COMPILE_MIN_VALUES
    axes = AXES if axis == "both" else (axis,)
    names = {ax: (ax if axis == "both" else SINGLE_ENTRY_NAME) for ax in axes}
    entries = {ax: Entry(names[ax], ax, rounding, shape, source.offsets.dtype, batch + 1) for ax in axes}
    structure = "dict" if axis == "both" else "single"

    row_bytes = row_values * source.dtype.itemsize
    notify = _progress_callback(progress)
    clock = _StageClock()
    started = time.perf_counter()
    plan = list(sequence_chunks(offsets, chunk_tokens))  # (first, end) sequences of each chunk

    def report(chunks_done: int, tokens_done: int) -> None:
        if notify is not None:
            notify(PreprocessProgress(chunks_done, len(plan), tokens_done, total, time.perf_counter() - started))

    stored_offsets = {names[ax]: source.offsets for ax in axes}
    writer = MXFP8FileWriter(output_path, list(entries.values()), stored_offsets, structure)
    # The pool closes (waiting for queued writes) before the writer, which removes the file on error.
    with writer, ThreadPoolExecutor(1, "jagged-attn-writer") as sink, _quantizer_threads(device):
        queued = collections.deque()
        if plan:
            report(0, 0)
        for index, (first, end) in enumerate(plan):
            row_start, row_stop = int(offsets[first]), int(offsets[end])
            chunk_offsets = offsets[first : end + 1] - row_start
            with clock("read"):
                values = source.rows(row_start, row_stop).to(device)
                device_offsets = chunk_offsets.to(device)
            for ax, entry in entries.items():
                with clock("quantize"):
                    local = quantize_mxfp8(values, device_offsets, axis=ax, rounding=rounding, compile=compile)
                    local = local.to("cpu")
                with clock("tile"):
                    tiles = _global_scale_tiles(local, entry, chunk_offsets, first, end, offsets)
                queued.append(sink.submit(_store, writer, entry.name, local.data, row_start, tiles))
            with clock("wait"):
                while len(queued) > CHUNKS_IN_FLIGHT * len(entries):
                    queued.popleft().result()
            if index + 1 < len(plan):  # the last chunk is reported once the file is complete
                report(index + 1, row_stop)
        with clock("wait"):
            for job in queued:
                job.result()
        checksum = writer.close()
    seconds = time.perf_counter() - started
    report(len(plan), total)
    return {
        "input": os.fspath(input_path),
        "output": os.fspath(output_path),
        "axis": axis,
        "rounding": rounding,
        "sequences": batch,
        "tokens": total,
        "heads": shape[1] if len(shape) == 3 else 1,
        "head_dim": shape[-1],
        "chunks": len(plan),
        "input_bytes": total * row_bytes,
        "output_bytes": os.path.getsize(output_path),
        "seconds": seconds,
        "tokens_per_s": total / seconds,
        "input_gb_per_s": total * row_bytes / seconds / 1e9,
        "checksum": checksum,
        "stage_seconds": {**clock.seconds, **writer.seconds},
    }


def inspect_file(path) -> str:
    """A human-readable report on a saved MXFP8 file.

    Shows per entry: axis, rounding, shapes, sequences, tokens, a length histogram, bytes against the
    same values in bfloat16, and a histogram of scale exponents (over real blocks, padding left out);
    and for the file: format version and whether the checksum matches its contents. Raises
    ``ValueError`` only if the header cannot be read.
    """
    contents = read_header(path)
    actual = contents.actual_checksum()
    status = (
        "OK" if actual == contents.stored_checksum else f"MISMATCH (contents hash to {actual}): the file is corrupted"
    )
    size = os.path.getsize(contents.path)
    lines = [
        f"{contents.path}: jagged_attn.mxfp8 format version {contents.metadata['format_version']}, "
        f"{contents.structure}",
        f"  file bytes: {size:,}",
        f"  checksum: {contents.stored_checksum} {status}",
    ]
    for entry in contents.entries:
        lines += _describe_entry(contents, entry)
    return "\n".join(lines)


def _describe_entry(contents, entry) -> list[str]:
    offsets = contents.read_tensor(f"{entry.name}.offsets").to(torch.int64)
    scale_bytes = contents.read_tensor(f"{entry.name}.scales").reshape(-1)
    title = (f"entry {entry.name!r}: axis {entry.axis}, rounding {entry.rounding}, data {list(entry.shape)} "
             f"float8_e4m3fn, scales {entry.heads} x {scale_bytes.numel() // entry.heads:,} bytes float8_e8m0fnu")
    try:  # the statistics below read the offsets as lengths
        validate_offsets(offsets, entry.shape[0], "offsets")
    except ValueError as error:
        return [title, f"  {error}: the file is corrupted"]
    lengths = lengths_of(offsets)
    total, dim = entry.shape[0], entry.shape[-1]
    values = total * entry.heads * dim
    offsets_bytes = offsets.numel() * entry.offsets_dtype.itemsize
    stored_bytes = values + scale_bytes.numel() + offsets_bytes
    bf16_bytes = 2 * values
    if entry.axis == "feature":
        real_blocks = values // BLOCK_SIZE
    else:
        real_blocks = int(num_tiles(lengths, BLOCK_SIZE).sum()) * entry.heads * dim
    counts = torch.bincount(scale_bytes.to(torch.int64), minlength=256)
    counts[0] -= scale_bytes.numel() - real_blocks  # padding bytes are all 0
    exponents = ", ".join(f"2^{byte - 127}: {int(n):,}" for byte, n in enumerate(counts.tolist()) if n)
    sequences = f"sequences: {lengths.numel():,}  tokens: {total:,}"
    if lengths.numel():
        sequences += f"  length min/mean/max: {int(lengths.min())}/{total / lengths.numel():.1f}/{int(lengths.max())}"
    return [
        title,
        f"  {sequences}",
        f"  length histogram: {_length_histogram(lengths)}",
        f"  bytes: {stored_bytes:,} = {values:,} data + {scale_bytes.numel():,} scales + {offsets_bytes:,} offsets"
        f" = {stored_bytes / max(bf16_bytes, 1):.3f}x the values in bf16 ({bf16_bytes:,})",
        f"  scale exponents over {real_blocks:,} blocks: {exponents or 'none'}",
    ]


def _length_histogram(lengths: torch.Tensor) -> str:
    """Counts of lengths in power-of-two bins: 0, 1, 2-3, 4-7, ..."""
    if lengths.numel() == 0:
        return "empty"
    bins = torch.where(lengths > 0, torch.floor(torch.log2(lengths.clamp(min=1).double())).long() + 1, 0)
    counts = torch.bincount(bins)
    labels = []
    for b, n in enumerate(counts.tolist()):
        if n:
            low, high = (0, 0) if b == 0 else (1 << (b - 1), (1 << b) - 1)
            labels.append(f"{low}: {n:,}" if low == high else f"{low}-{high}: {n:,}")
    return ", ".join(labels)
