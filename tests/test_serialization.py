"""save / load: bit-exact round trips, and every damaged or inconsistent file rejected with ValueError."""

import hashlib
import json
import os
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from jagged_attn.mxfp8 import MXFP8Jagged
from jagged_attn.offsets import offsets_from_lengths
from jagged_attn.quantize import quantize_mxfp8
from jagged_attn.serialization import (
    FORMAT_VERSION,
    SINGLE_ENTRY_NAME,
    Entry,
    MXFP8FileWriter,
    load,
    save,
    scale_tiles,
)

EDGE_LENGTHS = [0, 1, 31, 32, 33, 127, 128, 129, 0, 300]


def ragged_mx(axis="feature", rounding="rceil", heads=2, head_dim=64, lengths=EDGE_LENGTHS, offsets_dtype=torch.int64):
    offsets = offsets_from_lengths(torch.tensor(lengths, dtype=torch.int64)).to(offsets_dtype)
    shape = (int(offsets[-1]), heads, head_dim) if heads else (int(offsets[-1]), head_dim)
    values = torch.randn(shape) * torch.exp(2 * torch.randn(shape[0], *([1] * (len(shape) - 1))))
    return quantize_mxfp8(values, offsets, axis=axis, rounding=rounding)


def assert_same(a: MXFP8Jagged, b: MXFP8Jagged):
    assert (a.axis, a.rounding) == (b.axis, b.rounding)
    assert a.data.shape == b.data.shape and a.offsets.dtype == b.offsets.dtype
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
    assert torch.equal(a.offsets, b.offsets)


@pytest.mark.parametrize("axis", ["feature", "sequence"])
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("heads", [0, 3])
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_round_trip_is_bit_exact(tmp_path, axis, rounding, heads, offsets_dtype):
    mx = ragged_mx(axis, rounding, heads, head_dim=64 if heads else 160, offsets_dtype=offsets_dtype)
    path = tmp_path / "mx.safetensors"
    checksum = save(path, mx)
    loaded = load(path)
    assert isinstance(loaded, MXFP8Jagged)
    assert_same(loaded, mx)
    assert torch.equal(loaded.dequantize(), mx.dequantize())
    assert checksum.startswith("sha256:") and len(checksum) == len("sha256:") + 64


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(0, 300), min_size=1, max_size=6), axis=st.sampled_from(["feature", "sequence"]))
def test_round_trip_random_lengths(tmp_path_factory, lengths, axis):
    mx = ragged_mx(axis, lengths=lengths, heads=1, head_dim=32)
    path = tmp_path_factory.mktemp("rt") / "mx.safetensors"
    save(path, mx)
    assert_same(load(path), mx)


def test_empty_tensor_round_trip(tmp_path):
    for lengths in ([], [0], [0, 0, 0]):
        mx = ragged_mx(lengths=lengths)
        save(tmp_path / "empty.safetensors", mx)
        assert_same(load(tmp_path / "empty.safetensors"), mx)


def test_dict_round_trip_keeps_names_and_order(tmp_path):
    tensors = {
        "v": ragged_mx("sequence", "floor"),
        "k.layer0": ragged_mx("feature", heads=1, head_dim=128, lengths=[5, 0, 77]),
        "q": ragged_mx("feature", heads=0, offsets_dtype=torch.int32),
    }
    save(tmp_path / "qkv.safetensors", tensors)
    loaded = load(tmp_path / "qkv.safetensors")
    assert list(loaded) == list(tensors)
    for name in tensors:
        assert_same(loaded[name], tensors[name])


def test_files_are_deterministic_and_plain_safetensors(tmp_path):
    mx = ragged_mx("sequence")
    save(tmp_path / "a.safetensors", mx)
    save(tmp_path / "b.safetensors", mx)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    plain = load_file(tmp_path / "a.safetensors")
    assert torch.equal(plain[f"{SINGLE_ENTRY_NAME}.scales"], mx.scales.view(torch.uint8))
    assert torch.equal(plain[f"{SINGLE_ENTRY_NAME}.data"].view(torch.uint8), mx.data.view(torch.uint8))


def test_save_rejects_wrong_types(tmp_path):
    with pytest.raises(TypeError, match="MXFP8Jagged"):
        save(tmp_path / "x.safetensors", torch.zeros(3))
    with pytest.raises(TypeError, match="mx\\['a'\\]"):
        save(tmp_path / "x.safetensors", {"a": torch.zeros(3)})
    with pytest.raises(TypeError, match="non-empty"):
        save(tmp_path / "x.safetensors", {})
    assert not os.listdir(tmp_path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "nothing.safetensors")


def _payload_start(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


def _load_or_error(path):
    """``load`` must either raise ValueError or succeed; returns the result or None."""
    try:
        return load(path)
    except ValueError:
        return None


def test_fuzz_byte_flips_are_detected(tmp_path):
    """Every header byte and 200 random payload bytes, each changed to a random other value."""
    mx = ragged_mx("feature", heads=1, head_dim=32, lengths=[3, 0, 40, 129])
    good = tmp_path / "good.safetensors"
    save(good, mx)
    original = good.read_bytes()
    payload = _payload_start(original)
    bad = tmp_path / "bad.safetensors"
    positions = list(range(payload)) + torch.randint(payload, len(original), (200,)).tolist()
    for position in positions:
        data = bytearray(original)
        data[position] ^= int(torch.randint(1, 256, ()))
        bad.write_bytes(bytes(data))
        result = _load_or_error(bad)
        if position >= payload:
            assert result is None, f"flip at payload byte {position} was not detected"
        elif result is not None:
            assert_same(result, mx)  # a header change that keeps the meaning is harmless


def test_fuzz_truncations_are_rejected(tmp_path):
    mx = ragged_mx("sequence", heads=2, head_dim=32, lengths=[3, 0, 40])
    good = tmp_path / "good.safetensors"
    save(good, mx)
    original = good.read_bytes()
    bad = tmp_path / "bad.safetensors"
    for size in [0, 1, 7, 8, 9, _payload_start(original), len(original) - 1] + torch.randint(
        0, len(original), (60,)
    ).tolist():
        bad.write_bytes(original[:size])
        with pytest.raises(ValueError):
            load(bad)
    bad.write_bytes(original + b"\0")
    with pytest.raises(ValueError):
        load(bad)


def _write_raw(path, entry, offsets, data, scales):
    """A file with a valid checksum whose contents need not make sense."""
    structure = "single" if entry.name == SINGLE_ENTRY_NAME else "dict"
    with MXFP8FileWriter(path, [entry], {entry.name: offsets}, structure) as writer:
        writer.write_data(entry.name, data, 0)
        writer.write_scale_tiles(entry.name, scale_tiles(scales, entry), 0)
        writer.close()


@pytest.mark.parametrize("damage", ["last_offset", "decreasing", "nonzero_start"])
def test_offsets_that_do_not_match_the_data_are_rejected(tmp_path, damage):
    mx = ragged_mx("feature", lengths=[10, 20, 30])
    offsets = mx.offsets.clone()
    if damage == "last_offset":
        offsets[-1] -= 1
    elif damage == "decreasing":
        offsets[1] = offsets[2] + 1
    else:
        offsets[0] = 1
    path = tmp_path / "bad.safetensors"
    _write_raw(path, Entry.of(SINGLE_ENTRY_NAME, mx), offsets, mx.data, mx.scales)
    with pytest.raises(ValueError, match="inconsistent.*offsets"):
        load(path)


@pytest.mark.parametrize("field, byte", [("scales", 0xFF), ("data", 0x7F), ("data", 0xFF)])
def test_nan_bytes_are_rejected(tmp_path, field, byte):
    """E8M0 0xFF and e4m3fn 0x7F / 0xFF are NaN: with a valid checksum, load names the entry and tensor."""
    mx = ragged_mx("sequence")
    tensors = {"data": mx.data.view(torch.uint8).clone(), "scales": mx.scales.view(torch.uint8).clone()}
    flat = tensors[field].view(-1)
    flat[torch.randint(flat.numel(), ())] = byte
    path = tmp_path / "nan.safetensors"
    _write_raw(path, Entry.of("k", mx), mx.offsets, tensors["data"].view(torch.float8_e4m3fn), tensors["scales"])
    with pytest.raises(ValueError, match=f"entry 'k'.*k.{field} holds NaN"):
        load(path)


def _header_and_tensors(path):
    data = path.read_bytes()
    header = json.loads(data[8 : _payload_start(data)])
    return header["__metadata__"], load_file(path)


def test_mismatched_shapes_are_rejected(tmp_path):
    mx = ragged_mx("feature", lengths=[10, 20, 30])
    good = tmp_path / "good.safetensors"
    save(good, mx)
    metadata, tensors = _header_and_tensors(good)
    bad = tmp_path / "bad.safetensors"
    for key, change in [
        (f"{SINGLE_ENTRY_NAME}.data", lambda t: t[:-1]),
        (f"{SINGLE_ENTRY_NAME}.scales", lambda t: t[:, :-512]),
        (f"{SINGLE_ENTRY_NAME}.offsets", lambda t: t[:-1]),
        (f"{SINGLE_ENTRY_NAME}.offsets", lambda t: t.to(torch.float32)),
        (f"{SINGLE_ENTRY_NAME}.data", lambda t: t.view(torch.uint8)),
    ]:
        save_file({**tensors, key: change(tensors[key]).contiguous()}, bad, metadata=metadata)
        with pytest.raises(ValueError, match="bad.safetensors"):
            load(bad)
    save_file({**tensors, "extra": torch.zeros(1)}, bad, metadata=metadata)
    with pytest.raises(ValueError, match="do not match the entries"):
        load(bad)


def test_foreign_and_future_files_say_why(tmp_path):
    mx = ragged_mx("feature", lengths=[4, 5])
    good = tmp_path / "good.safetensors"
    save(good, mx)
    metadata, tensors = _header_and_tensors(good)
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, bad)
    with pytest.raises(ValueError, match="not a jagged_attn.mxfp8 file"):
        load(bad)
    save_file(tensors, bad, metadata={**metadata, "format_version": str(FORMAT_VERSION + 1)})
    with pytest.raises(ValueError, match="newer jagged_attn"):
        load(bad)
    save_file(tensors, bad, metadata={**metadata, "format_version": "0"})
    with pytest.raises(ValueError, match="format version 0 is not readable"):
        load(bad)
    save_file(tensors, bad, metadata={**metadata, "entries": "[{"})
    with pytest.raises(ValueError, match="malformed entries"):
        load(bad)
    save_file(tensors, bad, metadata={**metadata, "axis_note": "extra metadata changes the checksum"})
    with pytest.raises(ValueError, match="checksum mismatch"):
        load(bad)
    bad.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load(bad)


@pytest.mark.gpu
def test_load_to_cuda(tmp_path):
    mx = ragged_mx("sequence")
    save(tmp_path / "mx.safetensors", {"v": mx})
    loaded = load(tmp_path / "mx.safetensors", device="cuda")["v"]
    assert loaded.data.is_cuda and loaded.scales.is_cuda and loaded.offsets.is_cuda
    assert_same(loaded.to("cpu"), mx)


def _documented_checksum(path):
    """The checksum as the module docstring defines it, computed from the raw file."""
    data = path.read_bytes()
    header = json.loads(data[8 : _payload_start(data)])
    metadata = {key: value for key, value in header.pop("__metadata__").items() if key != "checksum"}
    digest = hashlib.sha256(json.dumps(metadata, sort_keys=True).encode())
    for key in sorted(header):
        begin, end = header[key]["data_offsets"]
        digest.update(json.dumps([key, header[key]["dtype"], header[key]["shape"]]).encode())
        digest.update(data[_payload_start(data) + begin : _payload_start(data) + end])
    return "sha256:" + digest.hexdigest()


@pytest.mark.parametrize("structure", ["single", "dict"])
def test_checksum_follows_the_documented_definition(tmp_path, structure):
    mx = ragged_mx("feature", heads=1, head_dim=32, lengths=[5, 0, 140])
    path = tmp_path / "mx.safetensors"
    checksum = save(path, mx if structure == "single" else {"k": mx, "v": ragged_mx("sequence")})
    assert checksum == _documented_checksum(path)


def test_writer_hashes_pieces_in_any_order_and_rejects_rewrites(tmp_path):
    """Data written back to front is read back for the checksum; a byte written twice is an error."""
    mx = ragged_mx("feature", heads=2, head_dim=64, lengths=[40, 0, 300, 17])
    entry = Entry.of(SINGLE_ENTRY_NAME, mx)
    save(tmp_path / "want.safetensors", mx)
    with MXFP8FileWriter(tmp_path / "got.safetensors", [entry], {entry.name: mx.offsets}, "single") as writer:
        writer.write_scale_tiles(entry.name, scale_tiles(mx.scales, entry), 0)
        for start in (300, 100, 0):
            writer.write_data(entry.name, mx.data[start : start + 100 if start else 100], start)
        with pytest.raises(ValueError, match="written a second time"):
            writer.write_data(entry.name, mx.data[:100], 0)
        writer.write_data(entry.name, mx.data[200:300], 200)
        assert writer.close() == _documented_checksum(tmp_path / "got.safetensors")
    assert (tmp_path / "got.safetensors").read_bytes() == (tmp_path / "want.safetensors").read_bytes()


@pytest.mark.parametrize("shape", [(1 << 27, 0), (1 << 27, 0, 64), (64, 0)])
def test_a_file_of_no_data_bytes_cannot_claim_tokens(tmp_path, shape):
    """D = 0 (or no heads): the data tensor holds no bytes whatever the token count it claims. Such a
    file is refused from its header (loaded by a child process capped at 4 GiB of address space, so
    that a regression allocating for the claimed tokens cannot take the test run down)."""
    import subprocess
    import sys

    total = shape[0]
    entry = Entry(SINGLE_ENTRY_NAME, "feature", "rceil", shape, torch.int64, 2)
    path = tmp_path / "empty_claims.safetensors"
    with MXFP8FileWriter(path, [entry], {entry.name: torch.tensor([0, total])}, "single") as writer:
        writer.close()
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
            "from jagged_attn import load\n"
            "try:\n    load(sys.argv[1])\nexcept ValueError as e:\n    print('REFUSED', e)")
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "REFUSED" in result.stdout and "D a positive multiple of 32" in result.stdout
