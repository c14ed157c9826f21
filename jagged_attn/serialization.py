"""Save and load ``MXFP8Jagged`` tensors: safetensors files that ``load`` verifies before use.

A file holds one tensor (``save(path, mx)``) or a dict of them (``save(path, {"q": mx_q, ...})``;
``jagged-attn preprocess --axis both`` writes ``{"feature": ..., "sequence": ...}``). Each entry
``name`` is three safetensors tensors, stored exactly as ``MXFP8Jagged`` holds them, so loading is
a plain copy with no re-tiling:

* ``{name}.offsets``: int32/int64 ``[B + 1]``,
* ``{name}.data``: ``F8_E4M3`` ``[total, heads, D]`` or ``[total, D]`` (values at unpadded offsets),
* ``{name}.scales``: ``U8`` ``[heads, tiled bytes]``: the E8M0 bytes in the 128x4 tile layout
  (stored as bytes because safetensors has no E8M0 dtype in every version).

The safetensors metadata holds ``format`` (``"jagged_attn.mxfp8"``), ``format_version``,
``structure`` (``"single"`` or ``"dict"``), ``entries`` (JSON: name, axis, rounding, data shape,
dtypes and scale-matrix shape of each entry, in the order they were given) and ``checksum``:
SHA-256 over the other metadata, then every tensor's key, dtype, shape and raw bytes in key order.
Files are written to a temporary name and renamed, and are byte-identical for identical inputs.
The writer hashes bytes as they are written wherever they arrive in that order (an entry's data
written front to back, as preprocessing does) and reads back only the rest when it closes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from dataclasses import dataclass

import torch
from safetensors import safe_open

from .mx_format import ROUNDINGS
from .mxfp8 import AXES, MXFP8Jagged, check_data_shape, check_mxfp8, mxfp8_without_value_checks, scale_matrix_shape
from .scale_layout import TILE_BYTES, TILE_COLS, TILE_ROWS, num_tiles, tiled_bytes

FORMAT_NAME = "jagged_attn.mxfp8"
FORMAT_VERSION = 1
READABLE_VERSIONS = (1,)
SINGLE_ENTRY_NAME = "mx"

_FILE_DTYPES = {torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64"}
_OFFSETS_DTYPES = {"I32": torch.int32, "I64": torch.int64}
_CHECKSUM_PREFIX = "sha256:"
_HEADER_ALIGNMENT = 8
_READ_BLOCK_BYTES = 1 << 24


@dataclass(frozen=True)
class Entry:
    """What a file says about one stored tensor: everything but its bytes."""

    name: str
    axis: str
    rounding: str
    shape: tuple[int, ...]
    offsets_dtype: torch.dtype
    offsets_len: int

    @staticmethod
    def of(name: str, mx: MXFP8Jagged) -> "Entry":
        return Entry(name, mx.axis, mx.rounding, tuple(mx.data.shape), mx.offsets.dtype, mx.offsets.numel())

    @property
    def heads(self) -> int:
        return self.shape[1] if len(self.shape) == 3 else 1

    def scale_matrix_shape(self) -> tuple[int, int]:
        return scale_matrix_shape(self.axis, self.shape[0], self.offsets_len - 1, self.shape[-1])

    def scale_tiles_shape(self) -> tuple[int, int, int, int]:
        """``[heads, row tiles, column tiles, 512]``: the tiled scale buffer cut into its tiles."""
        rows, cols = self.scale_matrix_shape()
        return self.heads, num_tiles(rows, TILE_ROWS), num_tiles(cols, TILE_COLS), TILE_BYTES

    def tensor_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """safetensors key -> (file dtype, shape) of this entry's three tensors."""
        return {
            f"{self.name}.offsets": (_FILE_DTYPES[self.offsets_dtype], (self.offsets_len,)),
            f"{self.name}.data": ("F8_E4M3", tuple(self.shape)),
            f"{self.name}.scales": ("U8", (self.heads, tiled_bytes(*self.scale_matrix_shape()))),
        }

    def metadata(self) -> dict:
        return {
            "name": self.name,
            "axis": self.axis,
            "rounding": self.rounding,
            "shape": list(self.shape),
            "dtype": "float8_e4m3fn",
            "scale_dtype": "float8_e8m0fnu",
            "scale_matrix": list(self.scale_matrix_shape()),
        }


def scale_tiles(scales: torch.Tensor, entry: Entry) -> torch.Tensor:
    """uint8 view ``[heads, row tiles, column tiles, 512]`` of a tiled scale buffer ``[heads, bytes]``."""
    return scales.view(torch.uint8).view(entry.scale_tiles_shape())


def token_tile_dim(axis: str) -> int:
    """The dim of :func:`scale_tiles` that walks the tokens in 128-token steps (the other one walks D)."""
    return 1 if axis == "feature" else 2


class MXFP8FileWriter:
    """Writes a file of MXFP8 entries piece by piece (bounded memory), then seals it with the checksum.

    Construct with the entries' layouts and offsets; fill each entry with :meth:`write_data` (token
    rows) and :meth:`write_scale_tiles` (whole 128-token tiles) in any order, every byte once;
    :meth:`close` checks that every byte was written, finishes the checksum, writes the final header
    and renames the file into place. Used as a context manager, an exception removes the partial
    file. Not thread-safe: call it from one thread at a time. ``seconds`` holds the time spent
    hashing and writing so far.
    """

    def __init__(self, path, entries: list[Entry], offsets: dict[str, torch.Tensor], structure: str):
        self._path = os.fspath(path)
        self._specs = {key: spec for entry in entries for key, spec in entry.tensor_specs().items()}
        self._entries = {entry.name: entry for entry in entries}
        self._metadata = {
            "format": FORMAT_NAME,
            "format_version": str(FORMAT_VERSION),
            "structure": structure,
            "entries": json.dumps([entry.metadata() for entry in entries], sort_keys=True),
        }
        # int64 offsets first, so that every multi-byte tensor starts 8-byte aligned.
        order = sorted(self._specs, key=lambda key: -_itemsize(self._specs[key][0]))
        self._regions, buffer_bytes = {}, 0
        for key in order:
            size = _num_bytes(*self._specs[key])
            self._regions[key] = (buffer_bytes, buffer_bytes + size)
            buffer_bytes += size
        self._unwritten = {key: end - begin for key, (begin, end) in self._regions.items()}
        self._digest = _ChecksumStream(self._metadata, self._specs)
        self.seconds = {"hash": 0.0, "write": 0.0}
        self._header = self._encode_header(_CHECKSUM_PREFIX + "0" * 64)
        self._tmp_path = f"{self._path}.tmp{os.getpid()}"
        self._fd = os.open(self._tmp_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(self._fd, len(self._header) + buffer_bytes)
            for name, entry_offsets in offsets.items():
                self._write(f"{name}.offsets", entry_offsets, 0, 0, (entry_offsets.numel(),))
        except BaseException:
            self.abort()
            raise

    def write_data(self, name: str, rows: torch.Tensor, start: int) -> None:
        """Store ``rows`` (e4m3, ``[n, (heads,) D]``) as data rows ``start : start + n`` of entry ``name``."""
        self._write(f"{name}.data", rows, start, 0, self._specs[f"{name}.data"][1])

    def write_scale_tiles(self, name: str, tiles: torch.Tensor, start: int) -> None:
        """Store 128-token scale tiles ``start : start + n`` of entry ``name``.

        ``tiles`` is shaped like :func:`scale_tiles` of the whole buffer, except that its
        :func:`token_tile_dim` has ``n`` tiles.
        """
        entry = self._entries[name]
        self._write(
            f"{name}.scales", tiles.view(torch.uint8), start, token_tile_dim(entry.axis), entry.scale_tiles_shape()
        )

    def _write(self, key, block, start, dim, shape):
        expected = (*shape[:dim], block.shape[dim], *shape[dim + 1 :])
        if tuple(block.shape) != expected or start + block.shape[dim] > shape[dim]:
            raise ValueError(
                f"{key}: block of shape {tuple(block.shape)} at {start} does not fit {tuple(shape)} along dim {dim}"
            )
        if _FILE_DTYPES.get(block.dtype) != self._specs[key][0]:
            raise TypeError(f"{key}: block of dtype {block.dtype} for a {self._specs[key][0]} tensor")
        leading = _prod(shape[:dim])
        runs = block.detach().cpu().contiguous().view(torch.uint8).reshape(leading, -1).numpy()
        itemsize = _itemsize(self._specs[key][0])
        stride = _prod(shape[dim:]) * itemsize
        first = start * _prod(shape[dim + 1 :]) * itemsize  # byte of the first run within the tensor
        if runs.size and self._digest.passed(key, first):
            raise ValueError(f"{key}: bytes at {first} are written a second time")
        started = time.perf_counter()
        if leading == 1:
            self._digest.feed(key, first, runs[0])
        hashed = time.perf_counter()
        base = len(self._header) + self._regions[key][0] + first
        for i in range(leading):
            _pwrite_all(self._fd, memoryview(runs[i]), base + i * stride)
        self.seconds["hash"] += hashed - started
        self.seconds["write"] += time.perf_counter() - hashed
        self._unwritten[key] -= runs.size

    def close(self) -> str:
        """Finish the file; returns its checksum (``"sha256:<hex>"``)."""
        incomplete = {key: n for key, n in self._unwritten.items() if n}
        if incomplete:
            raise RuntimeError(f"{self._path}: bytes left unwritten: {incomplete}")
        started = time.perf_counter()
        checksum = self._digest.finish(self._fd, len(self._header), self._regions)
        self.seconds["hash"] += time.perf_counter() - started
        header = self._encode_header(checksum)
        assert len(header) == len(self._header)
        _pwrite_all(self._fd, memoryview(header), 0)
        os.close(self._fd)
        self._fd = None
        os.replace(self._tmp_path, self._path)
        return checksum

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            os.unlink(self._tmp_path)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.abort()

    def _encode_header(self, checksum: str) -> bytes:
        header = {"__metadata__": {**self._metadata, "checksum": checksum}}
        for key, (begin, end) in self._regions.items():
            dtype, shape = self._specs[key]
            header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % _HEADER_ALIGNMENT)
        return struct.pack("<Q", len(text)) + text


def save(path, mx) -> str:
    """Write ``mx`` (an ``MXFP8Jagged`` or a dict ``{name: MXFP8Jagged}``) to ``path``.

    Returns the checksum stored in the file. ``load(path)`` gives back the same structure with
    bit-identical data, scales and offsets.
    """
    if isinstance(mx, MXFP8Jagged):
        tensors, structure = {SINGLE_ENTRY_NAME: mx}, "single"
    elif isinstance(mx, dict) and mx:
        tensors, structure = mx, "dict"
        for name, value in tensors.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"mx: dict keys must be non-empty strings, got {name!r}")
            if not isinstance(value, MXFP8Jagged):
                raise TypeError(f"mx[{name!r}] must be an MXFP8Jagged, got {type(value).__name__}")
    else:
        raise TypeError(f"mx must be an MXFP8Jagged or a non-empty dict of them, got {type(mx).__name__}")
    entries = [Entry.of(name, value) for name, value in tensors.items()]
    with MXFP8FileWriter(path, entries, {name: value.offsets for name, value in tensors.items()}, structure) as writer:
        for entry in entries:
            value = tensors[entry.name]
            writer.write_data(entry.name, value.data, 0)
            writer.write_scale_tiles(entry.name, scale_tiles(value.scales, entry), 0)
        return writer.close()


@dataclass(frozen=True)
class FileHeader:
    """A verified-readable file's header: its entries, structure, checksums and tensor layout."""

    path: str
    structure: str
    entries: list[Entry]
    stored_checksum: str
    metadata: dict
    specs: dict
    header_bytes: int
    regions: dict

    def actual_checksum(self) -> str:
        """SHA-256 of what the file holds now (reads it once, in bounded memory)."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            return _ChecksumStream(self.metadata, self.specs).finish(fd, self.header_bytes, self.regions)
        finally:
            os.close(fd)

    def read_tensor(self, key: str) -> torch.Tensor:
        try:
            with safe_open(self.path, framework="pt", device="cpu") as file:
                return file.get_tensor(key)
        except Exception as error:  # safetensors reports truncation and I/O problems with its own class
            raise ValueError(f"{self.path}: cannot read tensor {key!r}: {error}") from error


def read_header(path) -> FileHeader:
    """Parse and check a file's header (format, version, entries, tensor dtypes and shapes); reads no data."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    try:
        with safe_open(path, framework="pt", device="cpu") as file:
            metadata = file.metadata() or {}
            found = {
                key: (file.get_slice(key).get_dtype(), tuple(file.get_slice(key).get_shape())) for key in file.keys()
            }
        header_bytes, regions = tensor_regions(path)
    except Exception as error:  # safetensors reports a broken file with its own exception class
        raise ValueError(f"{path}: not a readable safetensors file (truncated or corrupted?): {error}") from error
    if metadata.get("format") != FORMAT_NAME:
        raise _bad_file(path, f"not a {FORMAT_NAME} file (metadata format is {metadata.get('format')!r})")
    version = metadata.get("format_version", "")
    if not version.isdigit():
        raise _bad_file(path, f"bad format_version {version!r}")
    if int(version) not in READABLE_VERSIONS:
        advice = "; it was written by a newer jagged_attn: upgrade to read it" if int(version) > FORMAT_VERSION else ""
        raise _bad_file(
            path, f"format version {version} is not readable by this jagged_attn (it reads {READABLE_VERSIONS}){advice}"
        )
    stored_checksum = metadata.get("checksum", "")
    if not stored_checksum.startswith(_CHECKSUM_PREFIX):
        raise _bad_file(path, f"missing or malformed checksum {stored_checksum!r}")
    structure = metadata.get("structure")
    entries = _parse_entries(metadata.get("entries"), found, path)
    if structure not in ("single", "dict") or (
        structure == "single" and [e.name for e in entries] != [SINGLE_ENTRY_NAME]
    ):
        raise _bad_file(path, f"bad structure {structure!r} for entries {[e.name for e in entries]}")
    specs = {key: spec for entry in entries for key, spec in entry.tensor_specs().items()}
    if specs.keys() != found.keys():
        raise _bad_file(path, f"tensors {sorted(found)} do not match the entries (expected {sorted(specs)})")
    for key, spec in specs.items():
        if found[key] != spec:
            raise _bad_file(path, f"tensor {key!r} is {found[key]}, expected {spec}")
    hashed_metadata = {key: value for key, value in metadata.items() if key != "checksum"}
    return FileHeader(path, structure, entries, stored_checksum, hashed_metadata, specs, header_bytes, regions)


def load(path, device="cpu"):
    """Read a file written by :func:`save` (or ``jagged-attn preprocess``) and verify it.

    Returns an ``MXFP8Jagged``, or a dict ``{name: MXFP8Jagged}`` in the saved order for a file
    saved from a dict. Checks the format and version, the checksum, the dtypes and shapes, and that
    offsets fit the data, before returning anything; any failure raises ``ValueError`` saying what
    is wrong (``FileNotFoundError`` if there is no file), NaN bytes in data or scales included: a
    loaded tensor needs no further check. The buffers are stored in the kernel-ready
    tiled layout, so ``device="cuda"`` is one host-to-device copy per buffer.
    """
    contents = read_header(path)
    actual = contents.actual_checksum()
    if actual != contents.stored_checksum:
        raise _bad_file(
            contents.path, f"checksum mismatch: the file says {contents.stored_checksum}, its contents hash to {actual}"
        )
    loaded = {}
    for entry in contents.entries:
        tensors = {field: contents.read_tensor(f"{entry.name}.{field}") for field in ("offsets", "data", "scales")}
        try:  # every check of an MXFP8Jagged made from raw tensors, NaN bytes included, once, here
            mx = mxfp8_without_value_checks(
                tensors["data"], tensors["scales"], tensors["offsets"], entry.axis, entry.rounding
            )
            check_mxfp8(mx, entry.name)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{contents.path}: entry {entry.name!r} is inconsistent: {error}") from error
        loaded[entry.name] = mx.to(device)
    return loaded[SINGLE_ENTRY_NAME] if contents.structure == "single" else loaded


def _bad_file(path, message: str) -> ValueError:
    return ValueError(f"{path}: {message}")


def _parse_entries(text, found, path) -> list[Entry]:
    try:
        described = json.loads(text)
        entries = []
        for item in described:
            name, axis, rounding, shape = item["name"], item["axis"], item["rounding"], tuple(item["shape"])
            if not isinstance(name, str) or axis not in AXES or rounding not in ROUNDINGS:
                raise _bad_file(path, f"entry {item!r} has a bad name, axis or rounding")
            if len(shape) not in (2, 3) or not all(isinstance(n, int) and n >= 0 for n in shape):
                raise _bad_file(path, f"entry {name!r} has a bad shape {list(shape)}")
            try:  # before anything is allocated for the tokens it claims
                check_data_shape(shape, f"entry {name!r}: the data")
            except ValueError as error:
                raise _bad_file(path, str(error))
            offsets_dtype, offsets_shape = found.get(f"{name}.offsets", (None, ()))
            if offsets_dtype not in _OFFSETS_DTYPES or len(offsets_shape) != 1 or offsets_shape[0] < 1:
                raise _bad_file(
                    path,
                    f"entry {name!r}: offsets tensor is {offsets_dtype} {list(offsets_shape)}, "
                    "expected 1-D int32/int64",
                )
            entry = Entry(name, axis, rounding, shape, _OFFSETS_DTYPES[offsets_dtype], offsets_shape[0])
            if list(entry.scale_matrix_shape()) != item.get("scale_matrix"):
                raise _bad_file(
                    path,
                    f"entry {name!r}: scale matrix {item.get('scale_matrix')} does not match "
                    f"{entry.scale_matrix_shape()}",
                )
            entries.append(entry)
    except (TypeError, KeyError, AttributeError, json.JSONDecodeError) as error:
        raise _bad_file(path, f"malformed entries metadata: {error!r}")
    if not entries or len({entry.name for entry in entries}) != len(entries):
        raise _bad_file(path, "entries metadata is empty or names an entry twice")
    return entries


def tensor_regions(path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(bytes before the tensor buffer, key -> (begin, end) in the buffer) from any safetensors file's header."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    regions = {key: tuple(value["data_offsets"]) for key, value in header.items() if key != "__metadata__"}
    return 8 + length, regions


class _ChecksumStream:
    """The file checksum: SHA-256 of the metadata (checksum left out), then each tensor's key, dtype,
    shape and bytes, in key order.

    :meth:`feed` takes bytes at the point the hash has reached (others are skipped);
    :meth:`finish` reads the rest from the file.
    """

    def __init__(self, metadata: dict, specs: dict):
        self._digest = hashlib.sha256(json.dumps(metadata, sort_keys=True).encode())
        self._specs = specs
        self._keys = sorted(specs)
        self._index, self._done = -1, 0  # bytes of tensor self._keys[self._index] hashed so far
        self._next_tensor()

    def passed(self, key: str, position: int) -> bool:
        """Whether byte ``position`` of tensor ``key`` has been hashed already."""
        index = self._keys.index(key)
        return index < self._index or (index == self._index and position < self._done)

    def feed(self, key: str, position: int, run) -> None:
        """Hash ``run`` (bytes at ``position`` of tensor ``key``) if that is exactly where the hash is."""
        if self._index < len(self._keys) and key == self._keys[self._index] and position == self._done:
            self._digest.update(run)
            self._done += len(run)
            self._next_tensor()

    def finish(self, fd, header_bytes: int, regions: dict) -> str:
        """Hash what was not fed, reading it from the file ``fd``; returns ``"sha256:<hex>"``."""
        block = bytearray(_READ_BLOCK_BYTES)
        while self._index < len(self._keys):
            key = self._keys[self._index]
            begin, end = regions[key]
            size = min(_READ_BLOCK_BYTES, end - begin - self._done)
            view = memoryview(block)[: max(size, 0)]
            if size <= 0 or os.preadv(fd, [view], header_bytes + begin + self._done) != size:
                raise ValueError(f"file ends inside tensor {key!r}")
            self.feed(key, self._done, view)
        return _CHECKSUM_PREFIX + self._digest.hexdigest()

    def _next_tensor(self) -> None:
        """Step past finished tensors, hashing the description of each tensor stepped onto."""
        while self._index < len(self._keys) and (
            self._index < 0 or self._done == _num_bytes(*self._specs[self._keys[self._index]])
        ):
            self._index, self._done = self._index + 1, 0
            if self._index < len(self._keys):
                dtype, shape = self._specs[self._keys[self._index]]
                self._digest.update(json.dumps([self._keys[self._index], dtype, list(shape)]).encode())


def _pwrite_all(fd, buffer: memoryview, position: int) -> None:
    """``os.pwrite`` until all of ``buffer`` is written (one call writes at most ~2 GiB on Linux)."""
    while buffer.nbytes:
        written = os.pwrite(fd, buffer, position)
        buffer, position = buffer[written:], position + written


def _itemsize(file_dtype: str) -> int:
    return {"F8_E4M3": 1, "U8": 1, "I32": 4, "I64": 8}[file_dtype]


def _num_bytes(file_dtype: str, shape) -> int:
    return _prod(shape) * _itemsize(file_dtype)


def _prod(values) -> int:
    result = 1
    for value in values:
        result *= value
    return result
