"""Offline preprocessing: chunked output is byte-identical to saving the whole-tensor quantization."""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from jagged_attn.quantize import quantize_mxfp8
from jagged_attn.offsets import offsets_from_lengths, padded_seq_start
from jagged_attn.preprocess import PADDED_ROWS_PER_TOKEN, inspect_file, preprocess_file, sequence_chunks
from jagged_attn.serialization import Entry, MXFP8FileWriter, load, save

EDGE_LENGTHS = [0, 1, 31, 32, 33, 127, 128, 129, 0, 300, 5]


def ragged_values(lengths, row_shape=(2, 64), dtype=torch.bfloat16):
    total = sum(lengths)
    scale = torch.exp(2 * torch.randn(total, *([1] * len(row_shape))))
    return (torch.randn(total, *row_shape) * scale).to(dtype)


def expected_file(path, values, offsets, axis, rounding):
    """What preprocessing must produce: ``save`` of the whole tensor quantized at once."""
    if axis == "both":
        save(path, {ax: quantize_mxfp8(values, offsets, axis=ax, rounding=rounding) for ax in ("feature", "sequence")})
    else:
        save(path, quantize_mxfp8(values, offsets, axis=axis, rounding=rounding))
    return path.read_bytes()


@pytest.mark.parametrize("axis", ["feature", "sequence", "both"])
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("chunk_tokens", [1, 100, 129, 10**6])
def test_chunked_equals_whole_tensor(tmp_path, axis, rounding, chunk_tokens):
    offsets = offsets_from_lengths(torch.tensor(EDGE_LENGTHS))
    values = ragged_values(EDGE_LENGTHS)
    save_file({"values": values, "offsets": offsets}, tmp_path / "in.safetensors")
    stats = preprocess_file(
        tmp_path / "in.safetensors",
        tmp_path / "out.safetensors",
        axis=axis,
        rounding=rounding,
        chunk_tokens=chunk_tokens,
        progress=False,
    )
    want = expected_file(tmp_path / "want.safetensors", values, offsets, axis, rounding)
    assert (tmp_path / "out.safetensors").read_bytes() == want
    assert stats["tokens"] == sum(EDGE_LENGTHS) and stats["sequences"] == len(EDGE_LENGTHS)
    assert stats["chunks"] == len(list(sequence_chunks(offsets, chunk_tokens)))


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 400), min_size=1, max_size=8),
    chunk_tokens=st.integers(1, 500),
    axis=st.sampled_from(["feature", "sequence"]),
)
def test_chunked_equals_whole_tensor_random(tmp_path_factory, lengths, chunk_tokens, axis):
    directory = tmp_path_factory.mktemp("prop")
    offsets = offsets_from_lengths(torch.tensor(lengths))
    values = ragged_values(lengths, row_shape=(1, 32), dtype=torch.float32)
    save_file({"values": values, "offsets": offsets}, directory / "in.safetensors")
    preprocess_file(
        directory / "in.safetensors",
        directory / "out.safetensors",
        axis=axis,
        chunk_tokens=chunk_tokens,
        progress=False,
    )
    assert (directory / "out.safetensors").read_bytes() == expected_file(
        directory / "want.safetensors", values, offsets, axis, "rceil"
    )


@pytest.mark.parametrize("lengths", [EDGE_LENGTHS, [0] * 3000, [1] * 2000 + [0, 300] * 100])
def test_chunks_cover_whole_sequences(lengths):
    """Whole sequences, at most ``chunk_tokens`` tokens and ``chunk_tokens * PADDED_ROWS_PER_TOKEN`` rows
    of the scale placement (every sequence, empty or not, starts a fresh 128-row tile)."""
    offsets = offsets_from_lengths(torch.tensor(lengths))
    rows = padded_seq_start(offsets, torch.arange(len(lengths) + 1))
    for chunk_tokens in (1, 50, 200, 4096, 10**6):
        chunks = list(sequence_chunks(offsets, chunk_tokens))
        assert chunks[0][0] == 0 and chunks[-1][1] == len(lengths)
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        for first, end in chunks:
            assert end - first == 1 or (int(offsets[end] - offsets[first]) <= chunk_tokens
                                        and int(rows[end] - rows[first]) <= chunk_tokens * PADDED_ROWS_PER_TOKEN)


def test_two_runs_are_identical_and_load_back(tmp_path):
    offsets = offsets_from_lengths(torch.tensor(EDGE_LENGTHS)).to(torch.int32)
    values = ragged_values(EDGE_LENGTHS, dtype=torch.float16)
    save_file({"values": values, "offsets": offsets}, tmp_path / "in.safetensors")
    for name in ("a", "b"):
        preprocess_file(tmp_path / "in.safetensors", tmp_path / name, axis="both", chunk_tokens=150, progress=False)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    loaded = load(tmp_path / "a")
    assert list(loaded) == ["feature", "sequence"]
    for axis, mx in loaded.items():
        want = quantize_mxfp8(values, offsets, axis=axis)
        assert torch.equal(mx.dequantize(), want.dequantize()) and mx.offsets.dtype == torch.int32


@pytest.mark.parametrize("container", ["safetensors", "pt"])
def test_lengths_form_and_heads_reshape(tmp_path, container):
    heads, head_dim = 3, 32
    values = ragged_values(EDGE_LENGTHS, row_shape=(heads * head_dim,))
    lengths = torch.tensor(EDGE_LENGTHS, dtype=torch.int32)
    source = tmp_path / f"in.{container}"
    if container == "pt":
        torch.save({"values": values, "lengths": lengths}, source)
    else:
        save_file({"values": values, "lengths": lengths}, source)
    stats = preprocess_file(source, tmp_path / "out", axis="sequence", heads=heads, chunk_tokens=200, progress=False)
    assert (stats["heads"], stats["head_dim"]) == (heads, head_dim)
    offsets = offsets_from_lengths(lengths)
    want = expected_file(tmp_path / "want", values.view(-1, heads, head_dim), offsets, "sequence", "rceil")
    assert (tmp_path / "out").read_bytes() == want


@pytest.mark.parametrize(
    "tensors, heads, message",
    [
        ({"values": torch.randn(10, 64)}, None, "exactly one of 'offsets' or 'lengths'"),
        (
            {"values": torch.randn(10, 64), "offsets": torch.tensor([0, 10]), "lengths": torch.tensor([10])},
            None,
            "exactly one",
        ),
        ({"offsets": torch.tensor([0, 10])}, None, "no 'values'"),
        ({"values": torch.randn(10, 64), "offsets": torch.tensor([0, 9])}, None, "offsets\\[-1\\]"),
        ({"values": torch.randn(10, 64), "lengths": torch.tensor([4, 7])}, None, "offsets\\[-1\\]"),
        ({"values": torch.randn(10, 64), "lengths": torch.tensor([12, -2])}, None, "non-negative"),
        ({"values": torch.randn(10, 48), "lengths": torch.tensor([10])}, None, "multiple of 32"),
        ({"values": torch.randn(10, 96), "lengths": torch.tensor([10])}, 5, "heads=5"),
        ({"values": torch.randn(10, 2, 64), "lengths": torch.tensor([10])}, 4, "heads=4"),
        (
            {"values": torch.randn(10, 64).to(torch.int32), "lengths": torch.tensor([10])},
            None,
            "float32, bfloat16 or float16",
        ),
        # No tokens, but a row of 2^25 values: its one empty sequence alone would place 512 MiB of scales.
        ({"values": torch.empty(0, 2**25), "lengths": torch.tensor([0])}, None, "at most 16777216"),
        ({"values": torch.empty(0, 2, 2**24), "lengths": torch.tensor([0])}, None, "at most 16777216"),
    ],
)
def test_bad_inputs_are_rejected(tmp_path, tensors, heads, message):
    save_file(tensors, tmp_path / "in.safetensors")
    with pytest.raises((ValueError, TypeError), match=message):
        preprocess_file(tmp_path / "in.safetensors", tmp_path / "out", heads=heads, progress=False)
    assert not (tmp_path / "out").exists()


def test_non_finite_values_leave_no_output(tmp_path):
    values = torch.randn(300, 64)
    values[250, 3] = float("nan")
    save_file({"values": values, "lengths": torch.tensor([100, 100, 100])}, tmp_path / "in.safetensors")
    with pytest.raises(ValueError, match="NaN or Inf"):
        preprocess_file(tmp_path / "in.safetensors", tmp_path / "out", chunk_tokens=100, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors"]


def test_unreadable_input(tmp_path):
    (tmp_path / "in.bin").write_bytes(b"garbage" * 10)
    with pytest.raises(ValueError, match="cannot read it"):
        preprocess_file(tmp_path / "in.bin", tmp_path / "out", progress=False)


def test_quiet_by_default(tmp_path, capsys):
    save_file({"values": torch.randn(100, 32), "lengths": torch.tensor([60, 40])}, tmp_path / "in.safetensors")
    preprocess_file(tmp_path / "in.safetensors", tmp_path / "out", chunk_tokens=50)
    assert capsys.readouterr().err == ""


def test_progress_line(tmp_path, capsys):
    """``progress=True``: the line is rewritten in place: at the start, with the first ETA, at the end."""
    save_file({"values": torch.randn(100, 32), "lengths": torch.tensor([10, 40, 50])}, tmp_path / "in.safetensors")
    preprocess_file(tmp_path / "in.safetensors", tmp_path / "out", chunk_tokens=50, progress=True)
    err = capsys.readouterr().err
    assert err.startswith("\r") and err.endswith("\n") and err.count("\n") == 1, repr(err)
    start, first, final = (line.rstrip() for line in err[1:-1].split("\r"))
    assert start.startswith("preprocess   0.0%  chunk 0/2  0/100 tokens") and start.endswith("ETA ?"), start
    assert first.startswith("preprocess  50.0%  chunk 1/2  50/100 tokens") and re.search(r"ETA \d+:\d\d$", first)
    assert re.fullmatch(r"preprocess 100\.0%  chunk 2/2  100/100 tokens  \S+ tokens/s  done in \d+:\d\d", final), final


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.sampled_from(EDGE_LENGTHS), max_size=8), chunk_tokens=st.sampled_from([1, 100, 129, 10**6]))
def test_progress_callback(tmp_path_factory, lengths, chunk_tokens):
    """Called with chunks_done 0, 1, ..., chunks_total once each, the last with the file complete; the
    file is the one written without progress."""
    directory = tmp_path_factory.mktemp("progress")
    offsets = offsets_from_lengths(torch.tensor(lengths, dtype=torch.int64))
    save_file({"values": ragged_values(lengths), "offsets": offsets}, directory / "in.st")
    states, complete = [], []

    def record(state):
        states.append(state)
        complete.append((directory / "out.st").exists())

    stats = preprocess_file(directory / "in.st", directory / "out.st", chunk_tokens=chunk_tokens, progress=record)
    total = sum(lengths)
    assert [s.chunks_done for s in states] == list(range(stats["chunks"] + 1))
    assert complete == [False] * stats["chunks"] + [True]
    assert {s.chunks_total for s in states} == {stats["chunks"]} and {s.tokens_total for s in states} == {total}
    tokens = [s.tokens_done for s in states]
    assert tokens == sorted(tokens) and tokens[-1] == total and all(s.seconds >= 0 for s in states)
    if stats["chunks"] and total:
        assert states[0].tokens_done == 0 and states[0].eta_seconds is None
    assert states[-1].eta_seconds == 0.0
    assert all(s.eta_seconds >= 0 for s in states[1:] if s.tokens_done)
    preprocess_file(directory / "in.st", directory / "quiet.st", chunk_tokens=chunk_tokens)
    assert (directory / "out.st").read_bytes() == (directory / "quiet.st").read_bytes()


def test_progress_must_be_a_bool_or_a_callable(tmp_path):
    save_file({"values": torch.randn(4, 32), "lengths": torch.tensor([4])}, tmp_path / "in.st")
    with pytest.raises(TypeError, match="progress must be a bool or a callable"):
        preprocess_file(tmp_path / "in.st", tmp_path / "out.st", progress="yes")
    assert not (tmp_path / "out.st").exists()


def test_inspect_reports_the_numbers(tmp_path):
    lengths = [0, 1, 2, 3, 40, 129, 0]
    values = ragged_values(lengths, row_shape=(2, 64))
    save_file({"values": values, "lengths": torch.tensor(lengths)}, tmp_path / "in.safetensors")
    preprocess_file(tmp_path / "in.safetensors", tmp_path / "out", axis="both", rounding="floor", progress=False)
    report = inspect_file(tmp_path / "out")
    mx = quantize_mxfp8(values, offsets_from_lengths(torch.tensor(lengths)), axis="feature", rounding="floor")
    blocks = mx.dequantize().numel() // 32
    exponents = torch.bincount(mx.scale_matrix().reshape(-1).long(), minlength=256)
    top = int(exponents[1:].argmax()) + 1
    for expected in [
        "format version 1, dict",
        "checksum: sha256:",
        " OK",
        "entry 'feature': axis feature, rounding floor, data [175, 2, 64]",
        "entry 'sequence': axis sequence, rounding floor",
        "sequences: 7  tokens: 175",
        "length min/mean/max: 0/25.0/129",
        "length histogram: 0: 2, 1: 1, 2-3: 2, 32-63: 1, 128-255: 1",
        f"{175 * 2 * 64:,} data + ",
        "+ 64 offsets = ",
        f"x the values in bf16 ({175 * 2 * 64 * 2:,})",
        f"scale exponents over {blocks:,} blocks",
        f"2^{top - 127}: {int(exponents[top]):,}",
    ]:
        assert expected in report, (expected, report)

    data = bytearray((tmp_path / "out").read_bytes())
    data[-1] ^= 0x40
    (tmp_path / "out").write_bytes(bytes(data))
    assert "MISMATCH" in inspect_file(tmp_path / "out")


@pytest.mark.parametrize("last", [1 << 62, 1, -1])
def test_inspect_reports_offsets_that_do_not_fit(tmp_path, last):
    """Offsets that do not fit the data (damaged, or written so, with a valid checksum) are reported;
    the statistics read them as lengths and raised OverflowError (found by tests/test_reliability.py)."""
    mx = quantize_mxfp8(torch.zeros(0, 2, 64), torch.tensor([0, 0]), axis="sequence")
    entry = Entry.of("mx", mx)
    with MXFP8FileWriter(tmp_path / "out", [entry], {"mx": torch.tensor([0, last])}, "single") as writer:
        writer.write_scale_tiles("mx", mx.scales.view(torch.uint8).view(entry.scale_tiles_shape()), 0)
        writer.close()
    report = inspect_file(tmp_path / "out").splitlines()
    assert report[-1].startswith("  offsets") and report[-1].endswith(": the file is corrupted"), report


@pytest.mark.parametrize("axis", ["feature", "sequence"])
def test_compiled_quantizer_is_bit_identical(tmp_path, axis):
    """The torch.compile path that large inputs take writes exactly the bytes of the eager path."""
    values = torch.randn(700, 2, 64, dtype=torch.bfloat16) * torch.exp2(torch.randint(-8, 8, (700, 1, 1))).bfloat16()
    offsets = torch.tensor([0, 1, 129, 129, 700])
    save_file({"values": values, "offsets": offsets}, tmp_path / "in.st")
    for compile in (False, True):
        preprocess_file(tmp_path / "in.st", tmp_path / f"{compile}.st", axis=axis, compile=compile, progress=False)
    assert (tmp_path / "False.st").read_bytes() == (tmp_path / "True.st").read_bytes()


def test_empty_input(tmp_path):
    values = torch.randn(0, 2, 64, dtype=torch.bfloat16)
    save_file({"values": values, "lengths": torch.tensor([0, 0])}, tmp_path / "in.st")
    stats = preprocess_file(tmp_path / "in.st", tmp_path / "out.st", axis="both", progress=False)
    assert stats["tokens"] == 0
    offsets = torch.tensor([0, 0, 0])
    assert (tmp_path / "out.st").read_bytes() == expected_file(tmp_path / "want.st", values, offsets, "both", "rceil")


def test_stage_times_and_thread_count_restored(tmp_path):
    save_file({"values": ragged_values(EDGE_LENGTHS), "lengths": torch.tensor(EDGE_LENGTHS)}, tmp_path / "in.st")
    threads = torch.get_num_threads()
    stats = preprocess_file(tmp_path / "in.st", tmp_path / "out.st", chunk_tokens=100, progress=False)
    assert torch.get_num_threads() == threads
    assert set(stats["stage_seconds"]) == {"read", "quantize", "tile", "wait", "hash", "write"}
    assert all(seconds >= 0 for seconds in stats["stage_seconds"].values())


def test_writer_thread_error_surfaces_and_leaves_no_file(tmp_path, monkeypatch):
    save_file({"values": ragged_values(EDGE_LENGTHS), "lengths": torch.tensor(EDGE_LENGTHS)}, tmp_path / "in.st")
    calls = []

    def failing_write(writer, name, rows, start):
        calls.append(start)
        if len(calls) == 3:
            raise OSError("disk full")
        original(writer, name, rows, start)

    original = MXFP8FileWriter.write_data
    monkeypatch.setattr(MXFP8FileWriter, "write_data", failing_write)
    with pytest.raises(OSError, match="disk full"):
        preprocess_file(tmp_path / "in.st", tmp_path / "out.st", chunk_tokens=100, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.st"]


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_tokens", [None, 500])
def test_gpu_preprocessing_is_byte_identical(tmp_path, chunk_tokens):
    """device="cuda" quantizes with the fused Triton kernel; the file must not change by a byte."""
    values = torch.randn(3000, 4, 128, dtype=torch.bfloat16) * torch.exp(2 * torch.randn(3000, 1, 1)).bfloat16()
    save_file({"values": values, "lengths": torch.tensor([1000, 0, 33, 1, 1966])}, tmp_path / "in.st")
    for device in ("cpu", "cuda"):
        preprocess_file(tmp_path / "in.st", tmp_path / f"{device}.st", axis="both", device=device,
                        chunk_tokens=chunk_tokens, progress=False)
    assert (tmp_path / "cpu.st").read_bytes() == (tmp_path / "cuda.st").read_bytes()
    loaded = load(tmp_path / "cuda.st", device="cuda")
    assert loaded["sequence"].data.is_cuda
