"""Reliability (issue #27): no input, file or command line corrupts memory, exhausts it, or returns a
silent wrong answer. What could crash or exhaust the interpreter runs in a child process, so that a
regression fails its test instead of the test run."""

import subprocess
import sys
import textwrap

import pytest
import torch

import jagged_attn as ja
from jagged_attn import mxfp8
from jagged_attn.kernels.sm90 import hopper_fwd
from jagged_attn.kernels.producers.linear_quantize import linear_quantize
from jagged_attn.kernels.producers.rmsnorm_quantize import rms_norm_quantize
from jagged_attn.offsets import offsets_from_lengths

CHILD_TIMEOUT_S = 300
EDGE_LENGTHS = [0, 1, 31, 32, 33, 127, 128, 129, 0, 300]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton kernels run in the interpreter


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


def ragged(lengths=EDGE_LENGTHS, heads=2, dim=64, dtype=torch.float32, generator=None):
    """(values ``[total, heads, dim]`` of N(0, 1), offsets) for ``lengths``."""
    offsets = offsets_from_lengths(torch.tensor(lengths, dtype=torch.int64))
    return torch.randn(int(offsets[-1]), heads, dim, generator=generator).to(dtype), offsets


@pytest.mark.parametrize("axis", ["feature", "sequence"])
@pytest.mark.parametrize("field, byte", [("data", 0x7F), ("data", 0xFF), ("scales", 0xFF)])
def test_mxfp8_made_from_raw_tensors_refuses_nan_bytes(axis, field, byte):
    """NaN bytes (e4m3fn 0x7F / 0xFF, E8M0 0xFF) used to make whole attention rows 0. An MXFP8Jagged made
    from raw tensors refuses them, naming the tensor; under value_checks(False) it is made, and
    dequantize gives NaN exactly where a NaN byte acts (a 0xFF scale read as 2^128 gave +-inf or NaN)."""
    values, offsets = ragged()
    good = ja.quantize_mxfp8(values, offsets, axis=axis)
    raw = {"data": good.data.view(torch.uint8).clone(), "scales": good.scales.view(torch.uint8).clone()}
    if field == "data":
        raw["data"].view(-1)[torch.randint(raw["data"].numel(), ())] = byte
    else:
        raw["scales"][1] = byte  # every scale of head 1, padding included
    parts = (raw["data"].view(torch.float8_e4m3fn), raw["scales"].view(torch.float8_e8m0fnu), offsets, axis)
    with pytest.raises(ValueError, match=f"mx.{field} holds NaN"):
        ja.MXFP8Jagged(*parts)
    with ja.value_checks(False):
        unchecked = ja.MXFP8Jagged(*parts)
    got, want = unchecked.dequantize(), good.dequantize()
    nan = torch.zeros_like(want, dtype=torch.bool)
    if field == "data":
        nan.view(-1)[(raw["data"].view(-1) & 0x7F) == 0x7F] = True
    else:
        nan[:, 1] = True
    assert torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan], want[~nan])


def test_only_mxfp8_made_from_raw_tensors_is_scanned_for_nan(monkeypatch, tmp_path):
    """The scan is a pass over data and scales and a wait for the device: paid once where a caller
    makes an MXFP8Jagged from tensors of its own (or load reads a file), never by this package's
    quantizers, by .to, or per attention call."""
    scans = []
    scan = mxfp8.nan_byte_flags
    monkeypatch.setattr(mxfp8, "nan_byte_flags", lambda *tensors: scans.append(1) or scan(*tensors))
    q, offsets = ragged([3, 0, 40], heads=2)
    q8, k8 = (ja.quantize_mxfp8(x, offsets) for x in (q, q.flip(0)))
    v8 = ja.quantize_mxfp8(q, offsets, axis="sequence")
    ja.quantize_mxfp8_dual(q, offsets)
    q8.to("cpu")
    ja.jagged_attention(q8, k8, v8)
    rms_norm_quantize(q, torch.ones(q.shape[-1]), offsets)
    linear_quantize(q.flatten(1).to(torch.bfloat16), torch.eye(128, dtype=torch.bfloat16), offsets, heads=2)
    assert not scans
    ja.MXFP8Jagged(q8.data, q8.scales, q8.offsets, q8.axis)
    assert len(scans) == 1
    ja.save(tmp_path / "q.safetensors", {"q": q8, "v": v8})
    ja.load(tmp_path / "q.safetensors")
    assert len(scans) == 3  # once per entry


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_outputs_saturate_instead_of_overflowing(dtype, causal):
    """O is an average of V's rows, so it never exceeds V's largest value; but V's MX rounding can
    (fp16 65504 is stored as 65536, bf16 3.38e38 as 2^128, past float32 too), and the output cast
    gave inf. Every backend now clamps O to its dtype's finite range: V filled with +-max (a sign per
    channel) gives finite outputs near it, on the reference backend and on the interpreted Triton
    forward (whose output casts to bf16 truncate: one bf16 unit apart at most); on a GPU, the Hopper
    backend and the Gluon forward."""
    big = torch.finfo(dtype).max
    generator = torch.Generator().manual_seed(0)
    q, offsets = ragged([0, 1, 33, 70], heads=1, dtype=dtype, generator=generator)
    k = torch.randn(q.shape, generator=generator).to(dtype)
    v = (torch.where(torch.rand(1, 1, 64, generator=generator) < 0.5, -big, big) * torch.ones(q.shape)).to(dtype)
    q, k, v, offsets = (t.to(DEVICE) for t in (q, k, v, offsets))
    out = ja.jagged_attention(q, k, v, offsets, causal=causal)
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    ratio = out.double() / v.double()  # each row's average of V, rounded: P's e4m3 rounding moves it
    assert 0.9 < float(ratio.min()) and float(ratio.max()) <= 1
    if dtype == torch.float16:  # q and k at fp16's limits too: S stays far inside float32
        q_max = (q.sign() * big).to(dtype)
        assert bool(torch.isfinite(ja.jagged_attention(q_max, q_max, v, offsets, causal=causal)).all())
    for scores in ("bf16", "fp8"):
        kernel_out, _ = hopper_fwd.attention_forward_hp(q, k, v, offsets, offsets, causal=causal,
                                                        softmax_scale=q.shape[-1] ** -0.5, scores=scores)
        assert bool(torch.isfinite(kernel_out).all())
        torch.testing.assert_close(kernel_out, out, rtol=2.0**-7 if dtype == torch.bfloat16 else 1e-2, atol=0)


