"""Reliability (issue #27): no input, file or command line corrupts memory, exhausts it, or returns a
silent wrong answer. What could crash or exhaust the interpreter runs in a child process, so that a
regression fails its test instead of the test run."""

import contextlib
import hashlib
import io
import json
import math
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from attention_oracle import padded_attention
from jagged_attn.centering import centered_keys_values, uncentered_outputs
from mx_oracle import e4m3_table, oracle_quantize

import jagged_attn as ja
from jagged_attn import cli, mxfp8
from jagged_attn.kernels.producers.linear_quantize import linear_quantize
from jagged_attn.kernels.producers.rmsnorm_quantize import rms_norm_quantize
from jagged_attn.kernels.portable import forward as portable_forward
from jagged_attn.kernels.sm90 import forward as sm90_forward
from jagged_attn.metrics import relative_l2
from jagged_attn.mx_format import saturating_cast
from jagged_attn.offsets import offsets_from_lengths
from jagged_attn.preprocess import inspect_file
from jagged_attn.reference import reference_forward

CHILD_TIMEOUT_S = 300
EDGE_LENGTHS = [0, 1, 31, 32, 33, 127, 128, 129, 0, 300]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton kernels run in the interpreter
FORWARD = sm90_forward if DEVICE == "cuda" else portable_forward  # the forward kernel this machine runs


def run_child(code: str, *args, memory_gib: int | None = None) -> str:
    """``code`` in a fresh interpreter (optionally capped at ``memory_gib`` GiB of address space);
    returns its stdout, fails the test on a non-zero exit, a signal or a traceback."""
    limit = (f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({memory_gib} << 30, {memory_gib} << 30))\n"
             if memory_gib else "")
    result = subprocess.run([sys.executable, "-c", limit + textwrap.dedent(code), *map(str, args)],
                            capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def test_backward_producer_refuses_row_vectors_of_another_shape():
    """The per-query vectors go into padded slots: a ``rows`` buffer of unpadded tokens, or of other heads,
    is refused before a kernel writes past its end (which crashed the CPU interpreter: in a child)."""
    assert run_child("""
        import torch
        from jagged_attn.kernels.producers import backward_passes
        from jagged_attn.kernels.producers.copies import Quantized
        from jagged_attn.offsets import offsets_from_lengths, padded_total
        dout = torch.randn(75, 2, 64)
        offsets = offsets_from_lengths(torch.tensor([70, 5]))
        out, lse, token_scale = torch.randn_like(dout), torch.randn(75, 2), torch.ones(2, 75)
        for tokens, heads in ((75, 2), (padded_total(75, 2), 3)):
            rows = torch.empty(backward_passes.ROW_VECTORS.value, heads, tokens)
            try:
                backward_passes.quantize_for_backward(dout, offsets, feature=True, sequence=True, out=out, lse=lse,
                                                      rows=rows, query=Quantized(
                                                          feature_scale=token_scale, token_scale=token_scale))
            except ValueError as error:
                assert "rows must be" in str(error), error
                print("refused")
    """).split() == ["refused", "refused"]


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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("axis", ["feature", "sequence"])
@pytest.mark.parametrize("field, byte", [("data", 0x7F), ("data", 0xFF), ("scales", 0xFF)])
def test_mxfp8_made_from_raw_tensors_refuses_nan_bytes(axis, field, byte, device):
    """NaN bytes (e4m3fn 0x7F / 0xFF, E8M0 0xFF) used to make whole attention rows 0. An MXFP8Jagged made
    from raw tensors refuses them, naming the tensor; under value_checks(False) it is made, and
    dequantize gives NaN exactly where a NaN byte acts (a 0xFF scale read as 2^128 gave +-inf or NaN)."""
    values, offsets = (x.to(device) for x in ragged())
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
    quantizers, by .to, or per attention call (compiled ones included)."""
    scans = []
    scan = mxfp8.nan_byte_flags
    monkeypatch.setattr(mxfp8, "nan_byte_flags", lambda *tensors: scans.append(1) or scan(*tensors))
    q, offsets = ragged([3, 0, 40], heads=2)
    q8, k8 = (ja.quantize_mxfp8(x, offsets) for x in (q, q.flip(0)))
    v8 = ja.quantize_mxfp8(q, offsets, axis="sequence")
    ja.quantize_mxfp8_dual(q, offsets)
    q8.to("cpu")
    ja.jagged_attention(q8, k8, v8)
    torch.ops.jagged_attn.mxfp8_attention(q8.data, q8.scales, k8.data, k8.scales, v8.data, v8.scales, offsets,
                                          offsets, False, 0.125, "reference", "sequence")  # as compiled graphs call it
    rms_norm_quantize(q, torch.ones(q.shape[-1]), offsets)
    linear_quantize(q.flatten(1).to(torch.bfloat16), torch.eye(128, dtype=torch.bfloat16), offsets, heads=2)
    assert not scans
    ja.MXFP8Jagged(q8.data, q8.scales, q8.offsets, q8.axis)
    assert len(scans) == 1
    ja.save(tmp_path / "q.safetensors", {"q": q8, "v": v8})
    ja.load(tmp_path / "q.safetensors")
    assert len(scans) == 3  # once per entry


def test_dequantize_checks_offsets_written_in_place_again():
    """Offsets edited by torch after the MXFP8Jagged was made: dequantize read them unchecked (a
    RuntimeError, an abort of the process, or values placed by offsets that do not fit; found by the
    fuzzer below). In a child process: such a regression can take the interpreter down."""
    run_child("""
        import pytest, torch, jagged_attn as ja
        offsets = torch.tensor([0, 3, 43, 48])
        mx = ja.quantize_mxfp8(torch.randn(48, 2, 64), offsets, axis="sequence")
        mx.dequantize()
        offsets[1] = 50
        with pytest.raises(ValueError, match="mx.offsets must be non-decreasing"):
            mx.dequantize()
        offsets[1] = 10  # valid again: the same tokens placed otherwise
        fresh = ja.MXFP8Jagged(mx.data, mx.scales, offsets.clone(), "sequence")
        assert torch.equal(mx.dequantize(), fresh.dequantize())
    """)


def test_offsets_rewritten_behind_torchs_back_cannot_corrupt_memory():
    """Offsets checked, then rewritten where torch's version counter does not see it (a numpy array
    under ``torch.from_numpy``): nothing checks them again (README), but the torch paths bound every
    index by the tensors' sizes (``offsets.bounded_offsets``): quantize_mxfp8 and dequantize on the
    CPU, the reference backend's forward and backward, JaggedTensor.to_padded run on the offsets
    forced into the convention, never outside the tensors (the first two aborted the process: "double
    free or corruption"; the reference backward allocated for the claimed lengths; to_padded read past
    the values). The kernels' side is the next test."""
    assert run_child("""
        import numpy as np, torch, jagged_attn as ja
        good = np.array([0, 3, 43, 48])
        held = good.copy()
        offsets = torch.from_numpy(held)
        q, k, v = (torch.randn(48, 2, 64) for _ in range(3))
        leaf = q.clone().requires_grad_(True)
        mx = [ja.quantize_mxfp8(x, offsets, axis=axis) for x, axis in ((q, "feature"), (k, "feature"), (v, "sequence"))]
        jagged = ja.JaggedTensor(v, offsets)
        calls = [lambda: [m.dequantize() for m in mx], lambda: ja.jagged_attention(*mx),
                 lambda: ja.jagged_attention(leaf, k, v, offsets, causal=True).sum().backward(),
                 lambda: [ja.quantize_mxfp8(v, offsets, axis=axis) for axis in ("feature", "sequence")],
                 lambda: jagged.to_padded(max_length=64)]
        for call in calls:
            call()  # checked here; from now on the offsets are known valid
        for bad in ([0, 60, 2, 48], [0, -100, 10**9, 48], [5, 3, 2, 1], [0, 48, 48, 48], [0, 1, 2, 10**12],
                    [-(10**12), 0, 0, 48]):
            held[:] = bad
            for call in calls:
                call()
            forced = np.maximum.accumulate(np.clip(bad, 0, 48) * (np.arange(4) > 0))
            forced[-1] = 48
            assert torch.equal(jagged.to_padded(max_length=64),
                               ja.JaggedTensor(v, torch.from_numpy(forced)).to_padded(max_length=64))
            held[:] = good
        print("no corruption")
    """).endswith("no corruption\n")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_kernels_stay_inside_the_tensors_whatever_the_offsets_hold(device):
    """The kernels' side of the case above: offsets checked, then rewritten behind torch's back
    (``.data``: its own version counter), reach the Triton and Gluon kernels of the Hopper backend and
    the quantizer unchecked. Every kernel takes its sequence's span from ``layout.sequence_span``
    (forced into the tensor's rows) and every grid sized by a length from ``offsets.max_length(offsets,
    rows)``, so they compute wrong rows at worst and never touch memory outside the tensors (offsets of
    10^12 read and wrote past them before). CPU: the portable kernels in the interpreter; CUDA: the Hopper
    and the portable kernels, an out-of-bounds access failing the child at the synchronization."""
    env = "import os; os.environ['TRITON_INTERPRET'] = '1'\n" if device == "cpu" else ""
    assert run_child(env + textwrap.dedent("""
        import sys, torch, jagged_attn as ja
        device = sys.argv[1]
        offsets = torch.tensor([0, 3, 43, 48], device=device)
        leaves = [torch.randn(48, 2, 64, device=device, dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
        q, k, v = (x.detach() for x in leaves)
        calls = [lambda: [ja.quantize_mxfp8(x, offsets, axis=axis) for x, axis in ((q, "feature"), (v, "sequence"))]]
        mx = lambda: (ja.quantize_mxfp8(q, offsets), ja.quantize_mxfp8(k, offsets),
                      ja.quantize_mxfp8(v, offsets, axis="sequence"))
        for backend in ["hopper", "portable"] if device == "cuda" else ["portable"]:
            calls += [lambda b=backend: ja.jagged_attention(*leaves, offsets, causal=True, backend=b).float().sum()
                      .backward(),
                      lambda b=backend: ja.jagged_attention(*mx(), backend=b)]
        for call in calls:
            call()  # checked here; from now on the offsets are known valid
        for bad in ([0, 60, 2, 48], [0, -100, 10**9, 48], [5, 3, 2, 1], [0, 1, 2, 10**12]):
            offsets.data.copy_(torch.tensor(bad))
            for call in calls:
                call()
            if device == "cuda":
                torch.cuda.synchronize()
        print("in bounds")
    """), device).endswith("in bounds\n")


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
    out = ja.jagged_attention(q, k, v, offsets, causal=causal, center_kv=False)  # as the kernels below round K
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    assert torch.equal(ja.jagged_attention(q, k, v, offsets, causal=causal).isfinite(), out.isfinite())
    ratio = out.double() / v.double()  # each row's average of V, rounded: P's e4m3 rounding moves it
    assert 0.9 < float(ratio.min()) and float(ratio.max()) <= 1
    if dtype == torch.float16:  # q and k at fp16's limits too: S stays far inside float32
        q_max = (q.sign() * big).to(dtype)
        assert bool(torch.isfinite(ja.jagged_attention(q_max, q_max, v, offsets, causal=causal)).all())
    for scores in ("bf16", "fp8"):
        kernel_out, _ = FORWARD.attention_forward_hp(q, k, v, offsets, offsets, causal=causal,
                                                     softmax_scale=q.shape[-1] ** -0.5, scores=scores)
        assert bool(torch.isfinite(kernel_out).all())
        torch.testing.assert_close(kernel_out, out, rtol=2.0**-7 if dtype == torch.bfloat16 else 1e-2, atol=0)



# Fuzzing. Each fuzzer runs in a child process (a crash fails its test, not the run) for a few seconds:
# a valid input with at most one corruption drawn from a list; the call must raise a clear ValueError /
# TypeError (naming what is wrong) exactly when something is corrupted, and otherwise return what the
# reference backend (or an independent oracle) gives. Tensors come from a drawn seed: examples replay.

FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
FUZZ_LENGTHS = st.lists(st.sampled_from([0, 1, 31, 32, 33, 127, 128, 129]) | st.integers(0, 70), min_size=1,
                        max_size=4)
HIGH_PRECISION = [torch.float32, torch.bfloat16, torch.float16]


def run_fuzzer(name: str, memory_gib: int | None = None) -> None:
    run_child(f"""
        import os, sys
        os.environ.setdefault("TRITON_INTERPRET", "1")
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import test_reliability
        test_reliability.{name}()
    """, memory_gib=memory_gib)


def fuzz_each(case, corruptions, valid_examples=10, corrupted_examples=2):
    """Hypothesis runs of ``case(data, corruption)`` for each corruption name, and for None (valid input)."""
    for corruption in (None, *corruptions):
        examples = corrupted_examples if corruption else valid_examples

        @given(data=st.data())
        @settings(FUZZ, max_examples=examples)
        def run(data):
            case(data, corruption)

        run()


def expect_outcome(call, corruption, keyword):
    """``call()``: a ValueError / TypeError whose message matches ``keyword`` iff ``corruption`` (else
    its result)."""
    try:
        result = call()
    except (ValueError, TypeError) as error:
        assert corruption is not None, f"valid input refused: {error!r}"
        assert re.search(keyword, str(error)), f"{corruption}: unclear error {error!r}"
        return None
    assert corruption is None, f"{corruption} was accepted"
    return result


def fuzz_values(shape, dtype, kind, generator):
    """``kind``: "normal" N(0, 1), "heavy_tailed" (token norms e^(3 N(0, 1)), within the dtype's range),
    "large" (+-the dtype's largest value) or "tiny" (N(0, 1) * 1e-30)."""
    x = torch.randn(shape, generator=generator, dtype=torch.float64)
    big = torch.finfo(dtype).max
    if kind == "heavy_tailed":
        x = (x * torch.exp(3 * torch.randn(shape[0], *[1] * (len(shape) - 1), generator=generator,
                                           dtype=torch.float64))).clamp(-big, big)
    elif kind == "large":
        x = torch.where(x < 0, -big, big)
    elif kind == "tiny":
        x = x * 1e-30
    return x.to(dtype)


def poison(x, value, generator):
    """``x`` with one element set to ``value``; None if it has none."""
    if x.numel() == 0:
        return None
    x = x.clone()
    x.view(-1)[int(torch.randint(x.numel(), (), generator=generator))] = value
    return x


OFFSETS_CORRUPTIONS = ("offsets_first", "offsets_decreasing", "offsets_last", "offsets_float", "offsets_2d",
                       "offsets_list")


def corrupt_offsets(offsets, corruption):
    """``offsets`` broken as ``corruption`` says (None if a batch this small cannot be broken so)."""
    o = offsets.clone()
    if corruption == "offsets_first":
        o[0] = 1
    elif corruption == "offsets_decreasing":
        if o.numel() < 3:
            return None
        o[-2] = o[-1] + 1
    elif corruption == "offsets_last":
        o[-1] += 1
    elif corruption == "offsets_float":
        return o.float()
    elif corruption == "offsets_2d":
        return o.unsqueeze(0)
    elif corruption == "offsets_list":
        return o.tolist()
    return o


def reference_attention(q, k, v, offsets_q, offsets_k, causal, softmax_scale, out_dtype, center_kv=False):
    """The reference backend's answer composed from its parts: high-precision K and V centered (with
    ``center_kv``), MXFP8 operands dequantized, the reference forward, O cast saturating, the centers
    added back."""
    centered = center_kv and not isinstance(q, ja.MXFP8Jagged)
    if centered:
        k, v, k_mean, v_mean = centered_keys_values(k, v, offsets_k)
    operands = [x if isinstance(x, ja.MXFP8Jagged) else ja.quantize_mxfp8(x, o, axis=axis)
                for x, o, axis in ((q, offsets_q, "feature"), (k, offsets_k, "feature"), (v, offsets_k, "sequence"))]
    out, lse = reference_forward(*(x.dequantize() for x in operands), offsets_q, offsets_k, causal=causal,
                                 softmax_scale=softmax_scale)
    out = saturating_cast(out, out_dtype)
    return uncentered_outputs(out, lse, q, k_mean, v_mean, offsets_q, softmax_scale)[0] if centered else out


ATTENTION_CORRUPTIONS = {  # name: what the error must mention
    **dict.fromkeys(OFFSETS_CORRUPTIONS, "offsets"), "batch": "batch|offsets", "v_offsets": "offsets",
    "dtype_fp64": "float", "dtype_int": "float", "dtype_mixed": "dtype", "head_dim": "32|head_dim",
    "heads": "heads", "nan_q": "NaN", "inf_k": "Inf", "nan_v": "NaN", "causal": "causal",
    "scale_bool": "softmax_scale", "scale_negative": "softmax_scale", "scale_nan": "softmax_scale",
}
MXFP8_ATTENTION_CORRUPTIONS = {"offsets_first", "offsets_decreasing", "offsets_last", "batch", "heads", "causal",
                               "scale_bool", "scale_negative", "scale_nan"}


def fuzz_jagged_attention():
    fuzz_each(attention_case, ATTENTION_CORRUPTIONS)


def attention_case(data, corruption):
    """jagged_attention over input forms, ragged lengths, GQA, dtypes, value ranges, flags."""
    draw = data.draw
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1), "seed"))
    lengths_q = draw(FUZZ_LENGTHS, "lengths_q")
    cross = draw(st.booleans(), "cross")
    lengths_k = [draw(st.sampled_from([0, 1, 33, 129]) | st.integers(0, 70)) for _ in lengths_q] if cross \
        else lengths_q
    offsets_dtype = draw(st.sampled_from([torch.int32, torch.int64]), "offsets dtype")
    offsets_q = offsets_from_lengths(torch.tensor(lengths_q)).to(offsets_dtype)
    offsets_k = offsets_from_lengths(torch.tensor(lengths_k)).to(offsets_dtype) if cross else offsets_q
    heads_kv, group = draw(st.sampled_from([1, 2]), "heads_kv"), draw(st.sampled_from([1, 2]), "group")
    dim, dtype = draw(st.sampled_from([32, 64]), "dim"), draw(st.sampled_from(HIGH_PRECISION), "dtype")
    kinds = [draw(st.sampled_from(["normal", "heavy_tailed", "tiny"]), "q, k kind")] * 2
    kinds.append(draw(st.sampled_from(["normal", "heavy_tailed", "tiny", "large"]), "v kind"))
    causal, softmax_scale = draw(st.booleans(), "causal"), draw(st.sampled_from([None, 0.05, 1.0]), "scale")
    form = draw(st.sampled_from(["tensor", "jagged", "fbgemm", "mxfp8"]), "form")
    if form == "mxfp8" and corruption not in MXFP8_ATTENTION_CORRUPTIONS | {None}:
        form = "tensor"  # what an MXFP8Jagged cannot hold: its own construction refuses it
    if corruption == "heads":
        heads_kv = 2  # and an odd number of query heads
    heads_q = heads_kv * group + (corruption == "heads")
    dim = 48 if corruption == "head_dim" else dim
    shapes = [(int(offsets_q[-1]), heads_q, dim)] + [(int(offsets_k[-1]), heads_kv, dim)] * 2
    q, k, v = (fuzz_values(shape, dtype, kind, generator) for shape, kind in zip(shapes, kinds))
    flags = dict(causal=causal, softmax_scale=softmax_scale, center_kv=draw(st.booleans(), "center_kv"))
    given_k = offsets_k if cross else None
    v_offsets = offsets_k
    if corruption in ("nan_q", "inf_k", "nan_v"):
        index, value = {"nan_q": (0, math.nan), "inf_k": (1, -math.inf), "nan_v": (2, math.nan)}[corruption]
        poisoned = poison((q, k, v)[index], value, generator)
        corruption = corruption if poisoned is not None else None
        q, k, v = [poisoned if i == index and poisoned is not None else x for i, x in enumerate((q, k, v))]
    elif corruption in ("dtype_fp64", "dtype_int"):
        q, k, v = (x.to(torch.float64 if corruption == "dtype_fp64" else torch.int32) for x in (q, k, v))
    elif corruption == "dtype_mixed":
        k = k.to(torch.float16 if dtype != torch.float16 else torch.float32)
    elif corruption == "batch":
        given_k = torch.cat([offsets_k, offsets_k[-1:]])  # one (empty) sequence more
    elif corruption in OFFSETS_CORRUPTIONS:
        given_k = corrupt_offsets(offsets_k, corruption)
        corruption = corruption if given_k is not None else None
        given_k = offsets_k if given_k is None else given_k
    elif corruption == "v_offsets":
        v_offsets = offsets_k.clone()
        v_offsets[1:-1] = 0  # every token in the last sequence: V's own offsets, unlike K's
        corruption = corruption if not torch.equal(v_offsets, offsets_k) else None
        form = "jagged" if form == "tensor" else form
    elif corruption == "causal":
        flags["causal"] = "no"
    elif corruption is not None and corruption.startswith("scale"):
        flags["softmax_scale"] = {"scale_bool": True, "scale_negative": -0.5, "scale_nan": math.nan}[corruption]
    if form == "mxfp8":
        operands = (ja.quantize_mxfp8(q, offsets_q), ja.quantize_mxfp8(k, offsets_k),
                    ja.quantize_mxfp8(v, offsets_k, axis="sequence"))
    else:
        operands = (q, k, v)

    def call():
        if form == "jagged":
            args = (ja.JaggedTensor(q, offsets_q), ja.JaggedTensor(k, offsets_k if given_k is None else given_k),
                    ja.JaggedTensor(v, v_offsets))
        elif form == "fbgemm":
            args = ((q, [offsets_q]), (k, [offsets_k if given_k is None else given_k]), (v, [v_offsets]))
        else:
            args = (*operands, offsets_q, given_k)
        return ja.jagged_attention(*args, **flags)

    out = expect_outcome(call, corruption, ATTENTION_CORRUPTIONS.get(corruption, ""))
    if out is None:
        return
    if form in ("jagged", "fbgemm"):  # out comes in q's kind of container
        out, out_offsets = (out.values, out.offsets) if form == "jagged" else (out[0], out[1][0])
        assert torch.equal(out_offsets, offsets_q)
    scale = dim**-0.5 if softmax_scale is None else softmax_scale
    out_dtype = torch.bfloat16 if form == "mxfp8" else dtype
    want = reference_attention(*operands, offsets_q, offsets_k, causal, scale, out_dtype, flags["center_kv"])
    assert out.dtype == out_dtype and torch.equal(out, want)
    assert bool(torch.isfinite(out).all())
    if kinds == ["normal"] * 3 and dtype == torch.float32 and form != "mxfp8":  # an oracle sharing no code
        exact, _ = padded_attention(q.double(), k.double(), v.double(), offsets_q, offsets_k, causal, scale)
        assert relative_l2(out, exact) < 0.1


def test_fuzz_jagged_attention():
    run_fuzzer("fuzz_jagged_attention")


INPLACE_EDITS = {"first": "offsets", "decreasing": "offsets", "last": "offsets", "negative": "offsets"}


def fuzz_offsets_written_in_place():
    fuzz_each(offsets_written_in_place_case, INPLACE_EDITS)


def offsets_written_in_place_case(data, corruption):
    """A call, then its offsets written in place by torch ops (a new valid placement of the same tokens,
    or a broken one), then the call again: it sees the new offsets, never a validation cached from the
    first call: a clear error, or exactly the result of a fresh copy of the offsets."""
    draw = data.draw
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1), "seed"))
    lengths = draw(st.lists(st.sampled_from([0, 1, 31, 32, 33, 129]) | st.integers(0, 70), min_size=2,
                            max_size=4), "lengths")
    offsets = offsets_from_lengths(torch.tensor(lengths)).to(draw(st.sampled_from([torch.int32, torch.int64])))
    total, causal = int(offsets[-1]), draw(st.booleans(), "causal")
    q, k, v = (torch.randn(total, 2, 32, generator=generator) for _ in range(3))
    target = draw(st.sampled_from(["attention", "mxfp8 attention", "quantize", "dequantize"]), "target")
    mx = [ja.quantize_mxfp8(x, offsets, axis=axis) for x, axis in ((q, "feature"), (k, "feature"), (v, "sequence"))]
    calls = {
        "attention": lambda: ja.jagged_attention(q, k, v, offsets, causal=causal),
        "mxfp8 attention": lambda: ja.jagged_attention(*mx, causal=causal),
        "quantize": lambda: ja.quantize_mxfp8(v, offsets, axis="sequence"),
        "dequantize": lambda: mx[2].dequantize(),
    }
    calls[target]()
    if corruption is None:  # the same tokens cut at other places
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=len(lengths) - 1, max_size=len(lengths) - 1)))
        offsets[1:-1] = torch.tensor(cuts, dtype=offsets.dtype)
    elif corruption == "first":
        offsets[0] = 1
    elif corruption == "decreasing":
        offsets[1] = total + 1
    elif corruption == "last":
        offsets[-1] += 1
    else:
        offsets[1] = -1
    got = expect_outcome(calls[target], corruption, INPLACE_EDITS.get(corruption, ""))
    if got is None:
        return
    fresh = offsets.clone()
    if target == "attention":
        assert torch.equal(got, reference_attention(q, k, v, fresh, fresh, causal, 32**-0.5, torch.float32))
    elif target == "mxfp8 attention":
        renewed = [ja.MXFP8Jagged(x.data, x.scales, fresh, x.axis) for x in mx]
        assert torch.equal(got, reference_attention(*renewed, fresh, fresh, causal, 32**-0.5, torch.bfloat16))
    elif target == "quantize":
        want = ja.quantize_mxfp8(v, fresh, axis="sequence")
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scales.view(torch.uint8), want.scales.view(torch.uint8))
    else:
        assert torch.equal(got, ja.MXFP8Jagged(mx[2].data, mx[2].scales, fresh, "sequence").dequantize())


def test_fuzz_offsets_written_in_place():
    run_fuzzer("fuzz_offsets_written_in_place")


def decoded_mxfp8(data, matrix, offsets, axis):
    """float64 values of e4m3 bytes ``data [total, H, D]`` scaled by the untiled E8M0 bytes ``matrix [H,
    rows, cols]``, placed by docs/DESIGN.md's rule in plain loops, saturated at float32's largest
    value (an oracle sharing no code with ours)."""
    table = np.concatenate([e4m3_table(), [np.nan]])  # codes 0..127 (0x7F: NaN)
    codes = data.numpy().astype(np.int64)
    values = np.where(codes & 0x80, -1.0, 1.0) * table[codes & 0x7F]
    scales = np.zeros(values.shape)
    offsets = [int(o) for o in offsets]
    for b in range(len(offsets) - 1):
        start = (offsets[b] // 128 + b) * 128
        for i, t in enumerate(range(offsets[b], offsets[b + 1])):
            if axis == "feature":
                scales[t] = np.repeat(matrix[:, start + i, :].numpy(), 32, axis=-1)
            else:
                scales[t] = matrix[:, :, (start + i) // 32].numpy()
    big = float(torch.finfo(torch.float32).max)
    return torch.from_numpy(np.clip(values * 2.0 ** (scales - 127), -big, big))


MXFP8_CORRUPTIONS = {
    "nan_data": "data holds NaN", "nan_scales": "scales holds NaN", "scales_shape": "scales must have shape",
    "data_dtype": "float8_e4m3fn", "scales_dtype": "float8_e8m0fnu", "head_dim": "multiple of 32",
    "no_heads": "heads > 0", "axis": "axis", "rounding": "rounding", "offsets_last": "offsets",
    "offsets_decreasing": "offsets",
}


def fuzz_mxfp8_from_raw_tensors():
    fuzz_each(mxfp8_from_raw_tensors_case, MXFP8_CORRUPTIONS)


def mxfp8_from_raw_tensors_case(data, corruption):
    """MXFP8Jagged of random bytes (any scale 0..254, any e4m3 value): refused with a clear error
    exactly when corrupted, else dequantize equals the independent decoding."""
    from torch.testing._internal.common_quantized import to_blocked  # needs expecttest: this test only

    draw = data.draw
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1), "seed"))
    lengths = draw(FUZZ_LENGTHS, "lengths")
    offsets = offsets_from_lengths(torch.tensor(lengths))
    heads, dim = draw(st.sampled_from([0, 1, 3]), "heads"), draw(st.sampled_from([32, 64, 160]), "dim")
    dim = 64 if corruption == "head_dim" else dim  # cut to 48 below
    axis, rounding = draw(st.sampled_from(["feature", "sequence"]), "axis"), "rceil"
    total, batch = int(offsets[-1]), len(lengths)
    codes = torch.randint(0, 256, (total, max(heads, 1), dim), generator=generator, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    rows = (total // 128 + batch) * 128
    matrix_shape = (max(heads, 1), rows, dim // 32) if axis == "feature" else (max(heads, 1), dim, rows // 32)
    matrix = torch.randint(0, 255, matrix_shape, generator=generator, dtype=torch.uint8)
    scales = torch.stack([to_blocked(m) for m in matrix]).reshape(matrix_shape[0], -1)
    data_bytes = codes if heads else codes[:, 0]
    if corruption == "nan_data":
        data_bytes = poison(data_bytes, 0x7F | (int(torch.randint(2, ())) << 7), generator)
    elif corruption == "nan_scales":
        scales = poison(scales, 0xFF, generator)
    elif corruption == "scales_shape":
        scales = scales[:, :-1]
    elif corruption == "head_dim":
        data_bytes = data_bytes[..., :48]
    elif corruption == "no_heads":
        data_bytes = codes[:, :0]
    elif corruption == "axis":
        axis = "tokens"
    elif corruption == "rounding":
        rounding = "nearest"
    elif corruption in ("offsets_last", "offsets_decreasing"):
        offsets = corrupt_offsets(offsets, corruption)
    if data_bytes is None or scales is None or offsets is None:
        return  # nothing to corrupt in so small a tensor
    data_tensor = data_bytes if corruption == "data_dtype" else data_bytes.view(torch.float8_e4m3fn)
    scales_tensor = scales.to(torch.int32) if corruption == "scales_dtype" else scales.view(torch.float8_e8m0fnu)
    mx = expect_outcome(lambda: ja.MXFP8Jagged(data_tensor, scales_tensor, offsets, axis, rounding), corruption,
                        MXFP8_CORRUPTIONS.get(corruption, ""))
    if mx is not None:
        want = decoded_mxfp8(codes, matrix, offsets, axis)
        assert torch.equal(mx.dequantize(), want.reshape(mx.data.shape).to(torch.float32))


def test_fuzz_mxfp8_from_raw_tensors():
    pytest.importorskip("expecttest")  # torch's to_blocked imports it (the [test] extra installs it)
    run_fuzzer("fuzz_mxfp8_from_raw_tensors")


QUANTIZE_CORRUPTIONS = {
    "dtype_fp64": "float", "dtype_int": "float", "head_dim": "multiple of 32", "one_dim": "total",
    "nan": "NaN", "inf": "NaN|Inf", "axis": "axis", "rounding": "rounding", "offsets_first": "offsets",
    "offsets_decreasing": "offsets", "offsets_last": "offsets", "offsets_float": "offsets",
}


def fuzz_quantize_mxfp8():
    fuzz_each(quantize_case, QUANTIZE_CORRUPTIONS)


def quantize_case(data, corruption):
    """quantize_mxfp8 over ragged lengths, heads, dtypes, value ranges, axes and roundings: a clear error
    exactly when corrupted, else bit-identical to the independent numpy oracle (tests/mx_oracle.py)."""
    draw = data.draw
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1), "seed"))
    lengths = draw(FUZZ_LENGTHS, "lengths")
    offsets = offsets_from_lengths(torch.tensor(lengths)).to(draw(st.sampled_from([torch.int32, torch.int64])))
    heads, dim = draw(st.sampled_from([0, 1, 2]), "heads"), draw(st.sampled_from([32, 64]), "dim")
    dim = 64 if corruption == "head_dim" else dim  # cut to 48 below
    dtype = draw(st.sampled_from(HIGH_PRECISION), "dtype")
    kind = draw(st.sampled_from(["normal", "heavy_tailed", "large", "tiny"]), "kind")
    axis, rounding = draw(st.sampled_from(["feature", "sequence"])), draw(st.sampled_from(["rceil", "floor"]))
    shape = (int(offsets[-1]), heads, dim) if heads else (int(offsets[-1]), dim)
    values = fuzz_values(shape, dtype, kind, generator)
    if corruption in ("nan", "inf"):
        values = poison(values, math.nan if corruption == "nan" else math.inf, generator)
    elif corruption in ("dtype_fp64", "dtype_int"):
        values = values.to(torch.float64 if corruption == "dtype_fp64" else torch.int32)
    elif corruption == "head_dim":
        values = values[..., :48]
    elif corruption == "one_dim":
        values = values.reshape(-1)
    elif corruption == "axis":
        axis = "head_dim"
    elif corruption == "rounding":
        rounding = "even"
    elif corruption in OFFSETS_CORRUPTIONS:
        offsets = corrupt_offsets(offsets, corruption)
    if values is None or offsets is None:
        return  # nothing to corrupt in so small a tensor
    mx = expect_outcome(lambda: ja.quantize_mxfp8(values, offsets, axis=axis, rounding=rounding), corruption,
                        QUANTIZE_CORRUPTIONS.get(corruption, ""))
    if mx is None:
        return
    x = values if heads else values.unsqueeze(1)
    want_data, want_scales = oracle_quantize(x, offsets, axis, rounding)
    np.testing.assert_array_equal(mx.data.float().reshape(x.shape).numpy(), want_data)
    assert torch.equal(mx.scales.view(torch.uint8), want_scales)


def test_fuzz_quantize_mxfp8():
    run_fuzzer("fuzz_quantize_mxfp8")


BYTE_DAMAGE = ("truncate", "flip")


def damaged_bytes(raw: bytes, damage: str, draw) -> bytes:
    """A file's contents cut short (``"truncate"``) or with one to four bytes flipped (``"flip"``)."""
    if damage == "truncate":
        return raw[:draw(st.integers(0, len(raw) - 1), "size")]
    flipped = bytearray(raw)
    for position in draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=4), "positions"):
        flipped[position] ^= draw(st.integers(1, 255))
    return bytes(flipped)


def _header(raw: bytes) -> tuple[dict, bytes]:
    """(safetensors JSON header, the bytes after it) of a file's contents."""
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def _with_header(header: dict, payload: bytes) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + payload


def _resealed(raw: bytes) -> bytes:
    """``raw`` with its checksum recomputed as serialization.py defines it: a lie only the contents'
    own checks can catch."""
    header, payload = _header(raw)
    metadata = {key: value for key, value in header["__metadata__"].items() if key != "checksum"}
    digest = hashlib.sha256(json.dumps(metadata, sort_keys=True).encode())
    for key in sorted(k for k in header if k != "__metadata__"):
        begin, end = header[key]["data_offsets"]
        digest.update(json.dumps([key, header[key]["dtype"], header[key]["shape"]]).encode())
        digest.update(payload[begin:end])
    header["__metadata__"]["checksum"] = "sha256:" + digest.hexdigest()
    return _with_header(header, payload)


HUGE_SIZES = st.sampled_from([2**31, 2**40, 2**62, 2**64 + 1, -1, 0])
FILE_DAMAGE = {  # name: the error must mention (files that keep their meaning may load)
    "truncate": "", "flip": "", "header_length": "", "shape_claim": "", "extent_claim": "",
    "entry_shape_claim": "", "offsets_claim": "offsets", "nan": "NaN", "format_version": "version",
    "drop_tensor": "", "extra_tensor": "do not match",
}


def fuzz_damaged_files():
    fuzz_each(damaged_file_case, FILE_DAMAGE, valid_examples=3, corrupted_examples=4)


def damaged_file_case(data, damage):
    """A saved file (one tensor or a dict), damaged: cut short, bytes flipped, its header lying about
    its size, a tensor's shape or extent (huge ones too), or, resealed with a valid checksum, about its
    entries, offsets or values. load raises ValueError (or returns exactly what was saved, where the
    damage kept the meaning); inspect_file and ``jagged-attn inspect`` report or fail in one line."""
    draw = data.draw
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1), "seed"))
    entries = {}
    for name in draw(st.sampled_from([["mx"], ["k", "v"]]), "entries"):
        values, offsets = ragged(draw(FUZZ_LENGTHS, f"{name} lengths"), heads=draw(st.sampled_from([1, 2])),
                                 dim=draw(st.sampled_from([32, 64])), generator=generator)
        entries[name] = ja.quantize_mxfp8(values, offsets, axis=draw(st.sampled_from(["feature", "sequence"])))
    directory = Path(tempfile.mkdtemp())
    path = directory / "x.safetensors"
    ja.save(path, entries["mx"] if list(entries) == ["mx"] else entries)
    raw = path.read_bytes()
    header, payload = _header(raw)
    keys = sorted(k for k in header if k != "__metadata__")
    key = draw(st.sampled_from(keys), "tensor")
    if damage in BYTE_DAMAGE:
        raw = damaged_bytes(raw, damage, draw)
    elif damage == "header_length":
        raw = struct.pack("<Q", draw(st.sampled_from([0, 7, len(raw), 2**40, 2**64 - 1]))) + raw[8:]
    elif damage == "shape_claim":
        header[key]["shape"] = [draw(HUGE_SIZES)] + header[key]["shape"][1:]
        raw = _with_header(header, payload)
    elif damage == "extent_claim":
        header[key]["data_offsets"][draw(st.sampled_from([0, 1]))] = draw(HUGE_SIZES)
        raw = _with_header(header, payload)
    elif damage == "entry_shape_claim":  # the metadata's entry and its data tensor agree on a huge shape
        described = json.loads(header["__metadata__"]["entries"])
        claim = draw(HUGE_SIZES)
        described[0]["shape"][0] = claim
        header[f"{described[0]['name']}.data"]["shape"][0] = claim
        header["__metadata__"]["entries"] = json.dumps(described, sort_keys=True)
        raw = _resealed(_with_header(header, payload))
    elif damage in ("offsets_claim", "nan"):
        tensor = key.rsplit(".", 1)[0] + (".offsets" if damage == "offsets_claim" else ".data")
        begin, end = header[tensor]["data_offsets"]
        if damage == "offsets_claim":
            itemsize = 8 if header[tensor]["dtype"] == "I64" else 4
            position = begin + itemsize * draw(st.integers(0, (end - begin) // itemsize - 1), "offset")
            value = draw(HUGE_SIZES).to_bytes(16, "little", signed=True)[:itemsize]
            payload = payload[:position] + value + payload[position + itemsize:]
        elif end > begin:
            position = draw(st.integers(begin, end - 1), "byte")
            payload = payload[:position] + bytes([0x7F | (draw(st.booleans()) << 7)]) + payload[position + 1:]
        else:
            damage = None  # no data bytes to poison
        raw = _resealed(_with_header(header, payload))
    elif damage == "format_version":
        header["__metadata__"]["format_version"] = draw(st.sampled_from(["2", "0", "x", "-1", "1.0", ""]))
        raw = _resealed(_with_header(header, payload))
    elif damage == "drop_tensor":
        del header[key]
        raw = _with_header(header, payload)
    elif damage == "extra_tensor":
        header["extra"] = {"dtype": "U8", "shape": [0], "data_offsets": [len(payload), len(payload)]}
        raw = _resealed(_with_header(header, payload))
    if raw == path.read_bytes():
        damage = None  # the lie told the truth (a claim of the value there already)
    path.write_bytes(raw)
    try:
        loaded = ja.load(path)
    except ValueError as error:
        assert damage is not None, f"an undamaged file refused: {error!r}"
        assert re.search(FILE_DAMAGE[damage], str(error)), f"{damage}: unclear error {error!r}"
    else:
        assert damage in (None, "flip", "offsets_claim"), f"{damage} was accepted"
        for name, mx in (loaded.items() if isinstance(loaded, dict) else [("mx", loaded)]):
            if damage == "offsets_claim":  # a claim that happens to be valid: the offsets are checked
                ja.MXFP8Jagged(mx.data, mx.scales, mx.offsets.clone(), mx.axis)
                continue
            for field in ("data", "scales", "offsets"):
                a, b = getattr(mx, field), getattr(entries[name], field)
                assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    try:
        inspect_file(path)
    except ValueError:
        pass
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["inspect", str(path)])
    assert code in (0, 2) and "Traceback" not in stderr.getvalue()
    assert code == 0 or len(stderr.getvalue().strip().splitlines()) == 1, stderr.getvalue()
    shutil.rmtree(directory)


def test_fuzz_damaged_files():
    run_fuzzer("fuzz_damaged_files", memory_gib=4)


INPUT_DAMAGE = {  # name: the error must mention
    "truncate": "", "flip": "", "header_length": "", "values_shape_claim": "", "values_extent_claim": "",
    "offsets_last": "offsets", "offsets_decreasing": "offsets", "lengths_negative": "non-negative",
    "both_index": "exactly one", "no_values": "values", "values_dtype": "float", "head_dim": "multiple of 32",
    "heads_flag": "heads", "nan": "NaN", "chunk_tokens": "chunk_tokens",
}


def fuzz_preprocess_command():
    fuzz_each(preprocess_command_case, INPUT_DAMAGE, valid_examples=6)


def preprocess_command_case(data, damage):
    """``jagged-attn preprocess`` on a damaged input (safetensors or torch file): cut short, flipped,
    lying about its size or its values' shape (huge too), or holding bad offsets, lengths, dtypes,
    head dims or NaN; bad flags. Exit 0 with the output quantize_mxfp8 gives for what the input holds
    as read by its own library, or exit 2 with one line and no output or temporary file left."""
    draw = data.draw
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1), "seed"))
    lengths = draw(FUZZ_LENGTHS, "lengths")
    heads, dim = draw(st.sampled_from([1, 2]), "heads"), draw(st.sampled_from([32, 64]), "dim")
    dim = 64 if damage == "head_dim" else dim  # cut to 48 below
    dtype, axis = draw(st.sampled_from(HIGH_PRECISION), "dtype"), draw(st.sampled_from(["feature", "sequence", "both"]))
    values = fuzz_values((sum(lengths), heads * dim), dtype, "heavy_tailed", generator)
    index = {"offsets": offsets_from_lengths(torch.tensor(lengths))} if draw(st.booleans(), "offsets") \
        else {"lengths": torch.tensor(lengths)}
    tensors = {"values": values, **index}
    arguments = ["--axis", axis, "--heads", str(heads), "--chunk-tokens", str(draw(st.sampled_from([1, 40, 10**6])))]
    if damage in ("offsets_last", "offsets_decreasing"):
        broken = corrupt_offsets(offsets_from_lengths(torch.tensor(lengths)), damage)
        if broken is None:
            damage = None  # a single sequence cannot decrease
        else:
            tensors = {"values": values, "offsets": broken}
    elif damage == "lengths_negative":
        tensors = {"values": values, "lengths": torch.tensor(lengths[:-1] + [-1])}
    elif damage == "both_index":
        tensors = {"values": values, "offsets": offsets_from_lengths(torch.tensor(lengths)),
                   "lengths": torch.tensor(lengths)}
    elif damage == "no_values":
        del tensors["values"]
    elif damage == "values_dtype":
        tensors["values"] = values.to(torch.int32)
    elif damage == "head_dim":
        tensors["values"] = values.reshape(-1, heads, dim)[..., :48].reshape(-1, heads * 48).contiguous()
    elif damage == "heads_flag":
        arguments[3] = str(draw(st.sampled_from([0, -2, 3, 5])))
    elif damage == "nan":
        poisoned = poison(values, math.nan, generator)
        damage, tensors["values"] = (damage, poisoned) if poisoned is not None else (None, values)
    elif damage == "chunk_tokens":
        arguments[5] = str(draw(st.sampled_from([0, -1])))
    directory = Path(tempfile.mkdtemp())
    source, output = directory / "in", directory / "out"
    container = draw(st.sampled_from(["safetensors", "torch"]), "container")
    if container == "safetensors":
        save_file(tensors, source)
    else:
        torch.save(tensors, source)
    raw = source.read_bytes()
    if damage in ("header_length", "values_shape_claim", "values_extent_claim") and container == "torch":
        damage = "truncate"  # a torch file has no safetensors header to lie in
    if damage in BYTE_DAMAGE:
        raw = damaged_bytes(raw, damage, draw)
    elif damage == "header_length":
        raw = struct.pack("<Q", draw(st.sampled_from([0, 7, len(raw), 2**40, 2**64 - 1]))) + raw[8:]
    elif damage == "values_shape_claim":
        header, payload = _header(raw)
        header["values"]["shape"][draw(st.sampled_from([0, 1]))] = draw(HUGE_SIZES)
        raw = _with_header(header, payload)
    elif damage == "values_extent_claim":
        header, payload = _header(raw)
        header["values"]["data_offsets"][draw(st.sampled_from([0, 1]))] = draw(HUGE_SIZES)
        raw = _with_header(header, payload)
    if damage in ("flip", "header_length", "values_shape_claim", "values_extent_claim") and raw == source.read_bytes():
        damage = None  # the lie told the truth (a claim of the value there already)
    source.write_bytes(raw)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["preprocess", str(source), str(output), *arguments])
    lines = stderr.getvalue().strip().splitlines()
    assert code in (0, 2) and "Traceback" not in stderr.getvalue(), stderr.getvalue()
    if code == 2:
        assert damage is not None, f"an undamaged input refused: {lines}"
        assert lines[-1].startswith("jagged-attn preprocess: error: "), lines
        assert re.search(INPUT_DAMAGE[damage], lines[-1]), f"{damage}: unclear error {lines[-1]}"
        assert sorted(p.name for p in directory.iterdir()) == ["in"]  # no output, no temporary file
    else:
        assert damage in (None, "flip"), f"{damage} was accepted"
        held = load_file(source) if container == "safetensors" else torch.load(source, weights_only=True)
        offsets = held["offsets"] if "offsets" in held else offsets_from_lengths(held["lengths"])
        held_values = held["values"].reshape(held["values"].shape[0], heads, held["values"].shape[1] // heads)
        loaded = ja.load(output)
        for ax in ("feature", "sequence") if axis == "both" else (axis,):
            mx, want = loaded[ax] if axis == "both" else loaded, ja.quantize_mxfp8(held_values, offsets, axis=ax)
            assert torch.equal(mx.data.view(torch.uint8), want.data.view(torch.uint8))
            assert torch.equal(mx.scales.view(torch.uint8), want.scales.view(torch.uint8))
    shutil.rmtree(directory)


def test_fuzz_preprocess_command():
    run_fuzzer("fuzz_preprocess_command", memory_gib=4)
