"""MXFP8 forward: rebasing, the Hopper (``jagged_attn/kernels/sm90/forward.py``) and portable
(``jagged_attn/kernels/portable/forward.py``) kernels against the reference, and their MMAs in the PTX.

CPU runs use the portable kernel in the Triton interpreter on tiny ragged shapes; ``gpu`` tests run
the issue's accuracy criteria on an sm_90 GPU, with the Hopper kernel.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from jagged_attn import quantize_mxfp8, reference
from jagged_attn.kernels.common import layout, persistent
from jagged_attn.kernels.portable import forward as portable_forward
from jagged_attn.kernels.producers import rebase
from jagged_attn.kernels.sm90 import forward as sm90_forward
from jagged_attn.mxfp8 import element_scale_bytes
from jagged_attn.offsets import offsets_from_lengths, padded_rows_of_tokens, padded_seq_start, sequence_ids
from compile_util import (HOPPER_SHARED_BYTES, compile_kernel, compile_ptx, descriptor_type, innermost_loops,
                          ptxas_report, sass)

# Relative L2 of O against the reference on the same MXFP8 inputs. A one-pass kernel rounds each key
# tile's P against the running row max, the reference against the final one: the same rule on another
# grid, so they agree to P's rounding noise (1.18e-2 on one Gaussian d64 draw, exact S, H200 2026-12-02).
O_TOLERANCE = 2e-2
LSE_TOLERANCE = 1e-3  # absolute
COSINE_SLACK = 1e-4  # our cosine vs fp64 may trail the reference's by this much
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The forward this machine runs: the Hopper kernel on a GPU, the portable one in the CPU interpreter.
FORWARD = sm90_forward if DEVICE == "cuda" else portable_forward


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the kernels allocate starts as NaN (floats, fp8) or 0xFF (integers)."""
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan") if t.dtype.is_floating_point else 255 if t.dtype == torch.uint8 else -1)

    monkeypatch.setattr(torch, "empty", poisoned_empty)


def relative_l2(x, ref):
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300))


def cosine(x, ref):
    x, ref = x.double().flatten(), ref.double().flatten()
    return float(x @ ref / (x.norm() * ref.norm()).clamp_min(1e-300))


def make_inputs(len_q, len_k, heads_q, heads_kv, dim, kind="gaussian", dtype=torch.float32):
    offsets_q = offsets_from_lengths(torch.tensor(len_q)).to(DEVICE)
    offsets_k = offsets_from_lengths(torch.tensor(len_k)).to(DEVICE)
    shape_q, shape_k = (int(offsets_q[-1]), heads_q, dim), (int(offsets_k[-1]), heads_kv, dim)
    q, k, v = (torch.randn(s, device=DEVICE) for s in (shape_q, shape_k, shape_k))
    if kind == "outlier_channel":
        channels = torch.randperm(dim, device=DEVICE)[:4]
        q[..., channels] *= 30
        k[..., channels] *= 30
    elif kind == "heavy_tailed":
        for t in (q, k, v):
            t *= torch.exp(1.5 * torch.randn(t.shape[0], t.shape[1], 1, device=DEVICE))
    elif kind == "peaked":
        q *= 4
    elif kind == "biased_k":  # one large mean key per head: every score of a row shifted alike
        k += 4 * torch.randn(heads_kv, dim, device=DEVICE)
    return q.to(dtype), k.to(dtype), v.to(dtype), offsets_q, offsets_k


def quantized(q, k, v, offsets_q, offsets_k, rounding="rceil"):
    return (
        quantize_mxfp8(q, offsets_q, rounding=rounding),
        quantize_mxfp8(k, offsets_k, rounding=rounding),
        quantize_mxfp8(v, offsets_k, axis="sequence", rounding=rounding),
    )


def check_against_reference(out, lse, ref_out, ref_lse):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert relative_l2(out, ref_out) <= O_TOLERANCE
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    lse_error = (lse[finite].double() - ref_lse[finite].double()).abs()
    assert float(lse_error.amax()) <= LSE_TOLERANCE if finite.any() else True
    assert bool((out[~finite] == 0).all())


def test_rebase_feature_is_mx_values(poisoned):
    q, k, _, offsets_q, offsets_k = make_inputs([0, 1, 33, 200], [3, 0, 40, 129], 2, 2, 64, "heavy_tailed")
    for x, offsets in ((q, offsets_q), (k, offsets_k)):
        mx = quantize_mxfp8(x, offsets)
        rows = padded_rows_of_tokens(offsets, sequence_ids(offsets, x.shape[0]))
        for group in (1, 64, 128):  # 128: from bf16 the group spans chunks (its maximum read first)
            data, factor = rebase.rebase_feature(mx, group=group)
            values = data.float() * factor[:, rows // group].t()[:, :, None]
            assert relative_l2(values, mx.dequantize()) < 1e-3
            hp_data, hp_factor = rebase.quantize_rebase_feature(x, offsets, group=group)
            assert torch.equal(hp_data.float(), data.float())
            assert torch.equal(hp_factor[:, rows // group], factor[:, rows // group])
        for group in (1, 128):  # exact: the MX values themselves, every factor 1 (group 128 spans chunks)
            for data, factor in (rebase.rebase_feature(mx, group=group, exact=True),
                                 rebase.quantize_rebase_feature(x, offsets, group=group, exact=True)):
                assert torch.equal(data.float(), mx.dequantize().float())
                assert bool((factor[:, rows // group] == 1).all())


EDGE_LENGTHS = [0, 1, 31, 32, 33, 127, 128, 129, 200]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.sampled_from(EDGE_LENGTHS), min_size=1, max_size=4).filter(any),
       bad=st.sampled_from([None, float("nan"), float("inf"), -float("inf")]))
def test_rebasing_flags_nan_and_inf_for_the_check(poisoned, lengths, bad):
    """From high-precision values every rebasing pass sets the ``nonfinite`` flag it is given (fp32,
    holding 0) to NaN or Inf where its input holds one, wherever it sits, and leaves it 0 otherwise:
    each feature kind (exact or FP8, one exponent per token or per 128-token tile) and V's sequence
    pass, K and V flagged apart (the forward's NaN/Inf check names the input)."""
    _, k, v, _, offsets_k = make_inputs([1], lengths, 1, 2, 64, "heavy_tailed")
    bad_k = bad is not None and bool(torch.rand(()) < 0.5)
    bad_v = bad is not None and not bad_k
    for x, poisoned_input in ((k, bad_k), (v, bad_v)):
        if poisoned_input:
            x.view(-1)[int(torch.randint(x.numel(), ()))] = bad
    for exact, group in ((True, 1), (True, 128), (False, 1), (False, 128)):
        flags = torch.zeros(2, dtype=torch.float32, device=DEVICE)
        rebase.quantize_rebase_kv(k, v, offsets_k, group, exact=exact, nonfinite=flags)
        assert [not math.isfinite(f) for f in flags.tolist()] == [bad_k, bad_v]


@pytest.mark.parametrize("dim", [64, 128])  # on Hopper: Q quantized by a pass / by the kernel's consumers
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_forward_from_high_precision_checks_finiteness(poisoned, name, dim):
    """``attention_forward_hp(check_finite=True)`` raises for NaN or Inf in any input, naming it, and
    runs clean inputs as without the check."""
    inputs = dict(zip("qkv", make_inputs([33, 0, 70], [40, 5, 129], 4, 1, dim, dtype=torch.bfloat16)[:3]))
    offsets = make_inputs([33, 0, 70], [40, 5, 129], 4, 1, dim)[3:]
    options = dict(causal=True, softmax_scale=0.125, scores="bf16")
    checked = FORWARD.attention_forward_hp(*inputs.values(), *offsets, check_finite=True, **options)
    plain = FORWARD.attention_forward_hp(*inputs.values(), *offsets, **options)
    assert all(torch.equal(a, b) for a, b in zip(checked, plain))
    bad = inputs[name].clone()
    bad[int(torch.randint(bad.shape[0], ()))] = float("nan")
    inputs[name] = bad
    with pytest.raises(ValueError, match=f"{name} contains NaN or Inf"):
        FORWARD.attention_forward_hp(*inputs.values(), *offsets, check_finite=True, **options)


def check_rebase_sequence(lengths, heads, dim, rounding):
    """Each (head, sequence, channel) exponent is its largest block byte; each MX element is shifted
    onto it and rounded to e4m3 (bit-exact), stored transposed at its token's padded column, every
    other column of the sequence's slots zero; quantizing from bf16 in the same passes gives the same bytes."""
    _, _, v, _, offsets = make_inputs([1], lengths, 1, heads, dim, "heavy_tailed")
    mx = quantize_mxfp8(v, offsets, axis="sequence", rounding=rounding)
    transposed, exponent = rebase.rebase_sequence(mx)

    byte = element_scale_bytes(mx)  # [total, H, D]
    seq = sequence_ids(offsets, v.shape[0])
    expected_exponent = torch.zeros(heads, len(lengths), dim, dtype=torch.int64, device=v.device)
    for b in range(len(lengths)):
        if lengths[b]:
            expected_exponent[:, b] = byte[offsets[b]:offsets[b + 1]].amax(dim=0)
    assert exponent.dtype == torch.int32 and torch.equal(exponent.long(), expected_exponent)

    shift = torch.exp2((byte - expected_exponent[:, seq].permute(1, 0, 2)).double())  # <= 1, exact
    expected = torch.zeros(transposed.shape, device=v.device)
    rows = padded_rows_of_tokens(offsets, seq)
    expected[:, :, rows] = (mx.data.double() * shift).float().to(torch.float8_e4m3fn).float().permute(1, 2, 0)
    # The contract covers each sequence's whole 128-column tiles (a KV tile may overrun the sequence).
    tiles = [range(padded_seq_start(int(offsets[b]), b), padded_seq_start(int(offsets[b]), b) + -(-n // 128) * 128)
             for b, n in enumerate(lengths)]
    columns = torch.tensor([c for span in tiles for c in span], dtype=torch.int64, device=v.device)
    assert torch.equal(transposed.float()[:, :, columns], expected[:, :, columns])

    hp_transposed, hp_exponent = rebase.quantize_rebase_sequence(v, offsets, rounding=rounding)
    assert torch.equal(hp_transposed.view(torch.uint8)[:, :, columns], transposed.view(torch.uint8)[:, :, columns])
    assert torch.equal(hp_exponent, exponent)


@pytest.mark.parametrize("rounding, channels_per_program", [("floor", None), ("rceil", None), ("rceil", 32)])
def test_rebase_sequence_matches_a_torch_oracle(poisoned, monkeypatch, rounding, channels_per_program):
    """:func:`check_rebase_sequence` on the edge lengths, also with programs over chunks of the channels."""
    if channels_per_program:
        chunked = dict(BLOCK_D=channels_per_program, num_warps=2)
        for passes in ("SEQUENCE_CONFIGS", "EXPONENT_CONFIGS"):
            monkeypatch.setattr(rebase, passes, {"values": chunked, "mxfp8": chunked})
    check_rebase_sequence([0, 1, 31, 32, 33, 127, 128, 129, 300], 2, 64, rounding)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(0, 400), min_size=1, max_size=5), heads=st.integers(1, 2),
       dim=st.sampled_from([32, 64]), rounding=st.sampled_from(["floor", "rceil"]))
def test_rebase_sequence_on_random_ragged_batches(poisoned, lengths, heads, dim, rounding):
    check_rebase_sequence(lengths, heads, dim, rounding)


CPU_CASES = [
    # (len_q, len_k, heads_q, heads_kv, dim, causal)
    ([0, 1, 31, 32, 33, 129], [0, 1, 31, 32, 33, 129], 2, 1, 64, False),
    ([0, 1, 31, 32, 33, 129], [0, 1, 31, 32, 33, 129], 2, 1, 64, True),
    ([5, 130, 40, 0], [70, 3, 40, 9], 4, 2, 128, True),  # causal with Lq < Lk and Lq > Lk
    ([127, 3, 64], [128, 0, 257], 2, 2, 128, False),
]


def forward_and_reference(mq, mk, mv, causal, scale, scores="fp8"):
    """Our forward (fp32 output; S computed as ``scores`` says) and the reference backend's fp64 one
    on the same MXFP8 inputs."""
    out, lse = FORWARD.attention_forward(
        mq, mk, mv, causal=causal, softmax_scale=scale, out_dtype=torch.float32, scores=scores
    )
    ref_out, ref_lse = reference.reference_forward(
        mq.dequantize(),
        mk.dequantize(),
        mv.dequantize(),
        mq.offsets,
        mk.offsets,
        causal=causal,
        softmax_scale=scale,
        compute_dtype=torch.float64,
    )
    return out, lse, ref_out, ref_lse


@pytest.mark.parametrize("len_q, len_k, heads_q, heads_kv, dim, causal", CPU_CASES)
def test_forward_matches_reference(poisoned, len_q, len_k, heads_q, heads_kv, dim, causal):
    q, k, v, offsets_q, offsets_k = make_inputs(len_q, len_k, heads_q, heads_kv, dim)
    mq, mk, mv = quantized(q, k, v, offsets_q, offsets_k)
    out, lse, ref_out, ref_lse = forward_and_reference(mq, mk, mv, causal, 0.7 / math.sqrt(dim))
    assert out.shape == q.shape and out.dtype == torch.float32 and lse.shape == q.shape[:2]
    check_against_reference(out, lse, ref_out, ref_lse)


def test_forward_exact_scores_match_reference(poisoned):
    q, k, v, offsets_q, offsets_k = make_inputs([0, 1, 33, 129], [5, 130, 31, 128], 4, 2, 64, "outlier_channel")
    mq, mk, mv = quantized(q, k, v, offsets_q, offsets_k)
    check_against_reference(*forward_and_reference(mq, mk, mv, True, 0.125, "bf16"))


@pytest.mark.parametrize("dim", [64, 128])  # on Hopper: Q quantized by a pass / by the kernel's consumers
@pytest.mark.parametrize("scores", ["fp8", "bf16"])
def test_forward_high_precision_equals_quantize_then_forward(poisoned, scores, dim):
    """From bf16 the forward gives, bit for bit, what it gives on the same inputs quantized beforehand."""
    q, k, v, offsets_q, offsets_k = make_inputs([33, 0, 70], [40, 5, 129], 4, 1, dim, dtype=torch.bfloat16)
    options = dict(causal=True, softmax_scale=0.125, scores=scores)
    out, lse = FORWARD.attention_forward_hp(q, k, v, offsets_q, offsets_k, **options)
    assert out.dtype == torch.bfloat16
    mx_out, mx_lse = FORWARD.attention_forward(*quantized(q, k, v, offsets_q, offsets_k), **options)
    assert torch.equal(out, mx_out) and torch.equal(lse, mx_lse)


def _kernel_signature(out_type):
    pointers = dict(
        q="*fp8e4nv",
        q_scales="*u8",
        k="*fp8e4nv",
        k_factor="*fp32",
        vt="*fp8e4nv",
        v_exponent="*i32",
        out=out_type,
        lse="*fp32",
        offsets_q="*i32",
        offsets_k="*i32",
        work="*i32",
    )
    scalars = dict(
        scale_log2="fp32", q_scale_bytes_per_head="i32", q_col_tiles="i32", k_groups="i32", t_pad="i32", batch="i32",
        total_q="i32", total_k="i32",
    )
    constexprs = dict(
        HEADS_Q=16,
        HEADS_KV=4,
        D=128,
        CAUSAL=True,
        Q_FROM_HIGH_PRECISION=False,
        INTERPRET=False,
        **_tiles(128),
    )
    return {**pointers, **scalars, **{name: "constexpr" for name in constexprs}}, constexprs


def _tiles(dim):
    config = portable_forward.tile_config(dim)
    return dict(BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], SCORES=config["SCORES"])


def test_portable_kernel_compiles_to_e4m3_mma_for_sm89():
    """What backend ``portable`` runs on sm_89 (``auto`` there): every MMA an e4m3 ``mma.sync`` (Ada's FP8
    tensor cores), in the 99 KB of shared memory an sm_89 block has."""
    signature, constexprs = _kernel_signature("*bf16")
    config = portable_forward.tile_config(128)
    ptx, shared = compile_kernel("jagged_attn.kernels.portable.forward", "_attention_forward_kernel", signature,
                                 constexprs, arch=89, num_warps=config["num_warps"], num_stages=config["num_stages"])
    mmas = [line for line in ptx.splitlines() if "mma.sync" in line]
    assert mmas and all(".e4m3.e4m3." in line for line in mmas) and "wgmma" not in ptx
    assert shared <= 101376


@pytest.mark.parametrize("scores", ["fp8", "bf16"])
def test_compiles_to_fp8_wgmma_for_sm90(scores):
    """Every MMA is FP8 wgmma; with SCORES="bf16", S's is a bf16 wgmma instead."""
    signature, constexprs = _kernel_signature("*bf16")
    constexprs["SCORES"] = scores
    if scores == "bf16":
        signature["k"] = "*bf16"  # K comes as its exact MX values (rebase_feature(..., exact=True))
    config = portable_forward.tile_config(128)
    ptx = compile_ptx(
        "jagged_attn.kernels.portable.forward",
        "_attention_forward_kernel",
        signature,
        constexprs,
        arch=90,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    wgmma = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    fp8 = [line for line in wgmma if "e4m3.e4m3" in line]
    bf16 = [line for line in wgmma if "bf16.bf16" in line]
    assert fp8 and len(fp8) + len(bf16) == len(wgmma) and bool(bf16) == (scores == "bf16")



def _rebase_pass_for_sm90(kernel: str, pointers: dict, constexprs: dict, num_warps: int, aligned: list) -> tuple:
    """(PTX, ptxas report) of ``rebase.<kernel>`` compiled for sm_90: arguments in ``pointers`` of those types,
    the others i32, ``aligned`` marked divisible by 16 as a launch specializes them; its spill stores none."""
    names = getattr(rebase, kernel).arg_names
    signature = {name: pointers.get(name, "i32") for name in names} | {name: "constexpr" for name in constexprs}
    ptx = compile_ptx("jagged_attn.kernels.producers.rebase", kernel, signature, constexprs, arch=90,
                      num_warps=num_warps, aligned=aligned)
    report = ptxas_report(ptx, 90)
    assert "0 bytes spill stores" in report, report
    return ptx, report


def _feature_rebase_from_bf16_for_sm90(exact: bool, group: int, copies: bool, copy_group: int, num_warps: int) -> tuple:
    """(PTX, ptxas report) of the feature rebase from bf16 as the launcher runs it (FEATURE_CHUNK tokens a chunk,
    the NaN/Inf check, K^T's copy in ``DS_ORDER``, whole slots), compiled for sm_90."""
    constexprs = dict(HEADS=16, D=128, BLOCK_T=rebase.TOKENS_PER_PROGRAM, CHUNK=rebase.FEATURE_CHUNK, GROUP=group,
                      FROM_HIGH_PRECISION=True, FLOOR=False, EXACT=exact, CHECK_FINITE=True, COPIES=copies,
                      COPY_GROUP=copy_group, ORDER=int(layout.DS_ORDER), INTERPRET=False)
    pointers = dict(src="*bf16", scales="*u8", offsets="*i32", work="*i32", dst="*bf16" if exact else "*fp8e4nv",
                    factor="*fp32", nonfinite="*fp32", copy_feature="*fp8e4nv", copy_scale="*fp32",
                    copy_token_scale="*fp32", copy_sequence="*fp8e4nv")
    return _rebase_pass_for_sm90("_rebase_feature_kernel", pointers, constexprs, num_warps,
                                 [*pointers, "padded"])  # padded: whole slots


@pytest.mark.parametrize("exact, group, copies, copy_group", [
    (True, 1, False, 1), (False, 1, False, 1), (False, 128, False, 1),
    (False, 128, True, rebase.TOKENS_PER_PROGRAM),  # K's pass as training runs it
    (False, 1, True, 1), (False, 1, True, rebase.FEATURE_CHUNK)])  # Q's
def test_feature_rebase_from_bf16_compiles_lean_for_sm90(exact, group, copies, copy_group):
    """The feature rebase from bf16, as the launcher runs it (chunks of FEATURE_CHUNK tokens; group 128
    spans two chunks, read twice; forming the NaN/Inf check's flag), compiles for sm_90 without
    spills in at most 96 registers (a whole slot at a time took 147-202, 62-69% of copy against 80-83%
    in chunks on an H200, docs/perf-history.md v15; the magnitude formed before the chunk's store took 108, v17),
    also where it writes the backward's copies of K or Q (``copies``: K^T from the operand's own bytes in the
    rebase loop; Q's read again, its copy on one scale per token or per chunk, the largest of the chunk's bytes
    its rebase formed)."""
    config = rebase.FEATURE_COPIES_CONFIG if copies else rebase.FEATURE_CONFIG
    _, report = _feature_rebase_from_bf16_for_sm90(exact, group, copies, copy_group, config["num_warps"])
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 96, report


def test_k_pass_converts_k_transposed_on_its_own_for_sm90():
    """K's pass as training runs it writes K^T from a conversion of its own (``fp8.to_e4m3_paired_apart`` of
    the operand's values), not from the operand's cast: cast once and stored both ways, ptxas merged the
    cast's pairs for the operand's store and left the transpose's byte moves reading registers no conversion
    wrote (K^T's bytes wrong on an H100, docs/perf-history.md v68). So the pass holds more e4m3 conversions
    than without the copies, and its SASS keeps every one."""
    def conversions(copies):  # at one launch config, so that both hold as many elements a thread
        ptx, _ = _feature_rebase_from_bf16_for_sm90(False, rebase.TOKENS_PER_PROGRAM, copies, rebase.TOKENS_PER_PROGRAM,
                                                    rebase.FEATURE_COPIES_CONFIG["num_warps"])
        count = ptx.count("cvt.rn.satfinite.e4m3x2.f32")
        assert sass(ptx, 90).count("F2FP.SATFINITE.E4M3.F32") == count
        return count

    assert conversions(True) > conversions(False) > 0


@pytest.mark.parametrize("copies", [False, True])
def test_sequence_exponent_pass_with_the_finite_check_compiles_lean_for_sm90(copies):
    """V's exponent pass from bf16 as the checked forward runs it (its maxima and the NaN/Inf flag
    from one reduction; with ``copies`` the 64-token scale bytes of the backward's copy of V too) compiles
    for sm_90 without spills in at most 96 registers (two reductions of the same tile took 143; 128 with the
    copies' scales, 120 when compiled)."""
    constexprs = dict(HEADS=16, D=128, BLOCK_T=rebase.TOKENS_PER_PROGRAM, FROM_HIGH_PRECISION=True, FLOOR=False,
                      CHECK_FINITE=True, COPIES=copies, VALUE_GROUP=64, INTERPRET=False,
                      BLOCK_D=rebase.EXPONENT_CONFIGS["values"]["BLOCK_D"])
    pointers = dict(src="*bf16", scales="*u8", offsets="*i32", work="*i32", exponent="*i32", nonfinite="*fp32",
                    group_byte="*i32")
    _, report = _rebase_pass_for_sm90("_sequence_exponent_kernel", pointers, constexprs,
                                      rebase.EXPONENT_CONFIGS["values"]["num_warps"], list(pointers))
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= (128 if copies else 96), report


@pytest.mark.parametrize("source", ["*bf16", "*fp32"])
def test_sequence_rebase_from_high_precision_compiles_lean_for_sm90(source):
    """V's rebase pass from bf16 or fp32 at its launch config, as inference runs it and as training does (also
    writing V's e4m3 feature copy on 64-token scales), compiles for sm_90 without spills, and the copy costs
    no shuffles: the 32-token blocks' maxima take as many ``SHFL.BFLY`` with the copy as without it (the
    copy stored at its plain channel range took 256 against 96 from bf16, and 56% more instructions; in runs
    of 8 channels, 96 against 32 from fp32: docs/perf-history.md v65-v66)."""
    def shuffles(with_copy):
        constexprs = dict(HEADS=16, D=128, BLOCK_T=rebase.TOKENS_PER_PROGRAM, FROM_HIGH_PRECISION=True, FLOOR=False,
                          ORDER=int(layout.PV_ORDER), COPIES=with_copy, VALUE_GROUP=64, INTERPRET=False,
                          BLOCK_D=rebase.SEQUENCE_CONFIGS["values"]["BLOCK_D"])
        pointers = dict(src=source, scales="*u8", offsets="*i32", work="*i32", exponent="*i32", dst="*fp8e4nv",
                        group_byte="*i32", copy_feature="*fp8e4nv", copy_scale="*fp32")
        ptx, _ = _rebase_pass_for_sm90("_rebase_sequence_kernel", pointers, constexprs,
                                       rebase.SEQUENCE_CONFIGS["values"]["num_warps"],
                                       [*pointers, "t_pad"])  # t_pad: whole slots
        return sass(ptx, 90).count("SHFL.BFLY")

    assert shuffles(True) == shuffles(False) > 0


GPU_CASES = [
    # (len_q, len_k, heads_q, heads_kv, dim, causal)
    ([0, 1, 31, 32, 33, 127, 128, 129, 1000, 3000], [0, 1, 31, 32, 33, 127, 128, 129, 1000, 3000], 8, 2, 128, True),
    ([0, 1, 31, 32, 33, 127, 128, 129, 1000, 3000], [0, 1, 31, 32, 33, 127, 128, 129, 1000, 3000], 8, 8, 64, False),
    ([512, 37, 2000, 300], [4000, 1024, 100, 0], 8, 1, 128, True),
    ([512, 37, 2000, 300], [4000, 1024, 100, 0], 4, 4, 64, True),
]
# Hopper's FP8 wgmma adds products with limited alignment precision (about 14 bits kept, as
# DeepSeek-V3 reports for H800), so S carries an error relative to its own magnitude. Where scores
# are large (outlier channels, heavy-tailed norms, peaked attention) that moves P's e4m3 rounding
# against the fp64 reference: measured on an H200, O differs from the reference by 2-4e-2 relative
# L2 while the cosine against fp64 stays within ~1e-4 of the reference's (docs/perf-history.md).
FP8_ACCUMULATION = "Hopper FP8 wgmma accumulation precision; see the comment above GPU_KINDS"
GPU_KINDS = [
    "gaussian",
    pytest.param("outlier_channel", marks=pytest.mark.xfail(reason=FP8_ACCUMULATION, strict=False)),
    pytest.param("heavy_tailed", marks=pytest.mark.xfail(reason=FP8_ACCUMULATION, strict=False)),
    pytest.param("peaked", marks=pytest.mark.xfail(reason=FP8_ACCUMULATION, strict=False)),
]
# FP8 S on Gaussian inputs: O 2-5e-3 from the reference in most draws, 1.07e-2 in one (8 query heads
# on 1 KV head, causal; seed 1566918512, H200 2026-11-30, the same on the code of the day before).
# The issue's 1e-2 is met by the default backend (exact S, test_gpu_precise_scores_meet_the_issue_criteria).
FP8_SCORES_O_TOLERANCE = 2e-2
HARDWARE_O_TOLERANCE = 6e-2  # what the kernel must always meet, whatever the inputs
HARDWARE_COSINE_SLACK = 1e-3
FP8_SCORE_PRECISION = 2.0**-9  # LSE error allowed per unit of the row's largest possible |score|
FP8_SUM_PRECISION = 2.0**-12  # FP8 wgmma's sums keep ~13 bits: the LSE error of Gaussian rows per unit of score


def _gpu_run(kind, len_q, len_k, heads_q, heads_kv, dim, causal, scores="fp8"):
    q, k, v, offsets_q, offsets_k = make_inputs(len_q, len_k, heads_q, heads_kv, dim, kind)
    mq, mk, mv = quantized(q, k, v, offsets_q, offsets_k)
    scale = 1 / math.sqrt(dim)
    out, lse, ref_out, ref_lse = forward_and_reference(mq, mk, mv, causal, scale, scores)
    exact_out, _ = reference.reference_forward(
        q.double(),
        k.double(),
        v.double(),
        offsets_q,
        offsets_k,
        causal=causal,
        softmax_scale=scale,
        compute_dtype=torch.float64,
        fp8=False,
    )
    finite = torch.isfinite(ref_lse)
    lse_error = float((lse[finite].double() - ref_lse[finite]).abs().amax()) if finite.any() else 0.0
    print(
        f"[{scores}] {kind} d{dim} causal={causal}: O rel-L2 vs reference {relative_l2(out, ref_out):.2e}, vs fp64 "
        f"{relative_l2(out, exact_out):.3e} (reference {relative_l2(ref_out, exact_out):.3e}); cosine "
        f"{cosine(out, exact_out):.6f} (reference {cosine(ref_out, exact_out):.6f}); LSE error {lse_error:.1e}"
    )
    return out, lse, ref_out, ref_lse, exact_out, (mq.dequantize(), mk.dequantize(), offsets_q, offsets_k, scale)


# Hopper's FP8 wgmma truncates its sums against the accumulator's magnitude. Each tile's P·V goes
# into a fresh accumulator (sm90_forward._consume): accumulated into the running O instead, a V far
# from zero mean lost a quarter of O over 16k keys (docs/perf-history.md v21). Within a tile's four
# k32 steps the truncation is still there: on such a V the error against fp64 is ~1.26x the reference
# backend's (measured 2026-12-02), where the accuracy policy asks for at most 1.05x.
POLICY_O_RATIO = 1.05
BIASED_V_GAP = "FP8 wgmma truncation inside a tile's P·V on a V of large mean: ~1.26x the reference's error"


@pytest.mark.gpu
@pytest.mark.parametrize("scores", ["fp8", "bf16"])
@pytest.mark.parametrize("v_mean", [0.0, pytest.param(3.0, marks=pytest.mark.xfail(reason=BIASED_V_GAP, strict=True))])
def test_gpu_long_sequence_error_against_fp64_is_the_reference_backends(poisoned, scores, v_mean):
    """One 16,384-token sequence (128 key tiles accumulated), 2 heads: O's error against fp64
    attention on the unquantized inputs at most 1.05x the reference backend's on the same MXFP8 inputs."""
    length, heads, dim = 16384, 2, 128
    q, k, v, offsets_q, offsets_k = make_inputs([length], [length], heads, heads, dim)
    q, k, v = q.bfloat16(), k.bfloat16(), (v + v_mean).bfloat16()
    mq, mk, mv = quantized(q, k, v, offsets_q, offsets_k)
    scale = dim**-0.5
    out, _, ref_out, _ = forward_and_reference(mq, mk, mv, False, scale, scores)
    truth, _ = reference.reference_forward(q.double(), k.double(), v.double(), offsets_q, offsets_k, causal=False,
                                           softmax_scale=scale, compute_dtype=torch.float64, fp8=False)
    ours, theirs = relative_l2(out, truth), relative_l2(ref_out, truth)
    print(f"[{scores}] V mean {v_mean}: O rel-L2 vs fp64 {ours:.4e}, reference backend {theirs:.4e}")
    assert ours <= POLICY_O_RATIO * theirs


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.parametrize("len_q, len_k, heads_q, heads_kv, dim, causal", GPU_CASES)
def test_gpu_accuracy_issue_criteria(poisoned, kind, len_q, len_k, heads_q, heads_kv, dim, causal):
    """FP8 S (backend "hopper"): the issue's cosine bar (vs fp64 within 1e-4 of the reference's);
    O within FP8_SCORES_O_TOLERANCE of the reference (the issue's 1e-2 in most draws); LSE within 1e-3
    plus FP8 wgmma's accumulation error of S (~13 bits of the row's score bound). The flat 1e-3 LSE bar
    is the default's (exact S, test below): FP8 S measured up to 1.3e-3 on Gaussian rows (H200, 2026-11-30)."""
    run = _gpu_run(kind, len_q, len_k, heads_q, heads_kv, dim, causal)
    check_bounds(*run, FP8_SCORES_O_TOLERANCE, COSINE_SLACK, FP8_SUM_PRECISION)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gaussian", "outlier_channel", "heavy_tailed", "peaked"])
@pytest.mark.parametrize("len_q, len_k, heads_q, heads_kv, dim, causal", GPU_CASES[:2])
def test_gpu_accuracy_hardware_bounds(poisoned, kind, len_q, len_k, heads_q, heads_kv, dim, causal):
    """Bounds every input must meet on Hopper: catches indexing, masking and scaling bugs."""
    run = _gpu_run(kind, len_q, len_k, heads_q, heads_kv, dim, causal)
    check_bounds(*run, HARDWARE_O_TOLERANCE, HARDWARE_COSINE_SLACK, FP8_SCORE_PRECISION)


# Outlier channels (4 channels 30x the others in Q and K): every MXFP8 backend is far from fp64 there
# (O's error 0.42-0.43, cosine ~0.91), and FP8 S moves the cosine by up to 1.9e-4 below the reference
# backend's (H200, 2026-12-02; the error itself within 0.1%). The policy's 1e-4 holds on the other kinds.
OUTLIER_COSINE_GAP = 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gaussian", "outlier_channel", "heavy_tailed", "peaked", "biased_k"])
@pytest.mark.parametrize("len_q, len_k, heads_q, heads_kv, dim, causal", GPU_CASES)
def test_gpu_fp8_scores_error_against_fp64_is_the_reference_backends(poisoned, kind, len_q, len_k, heads_q, heads_kv,
                                                                    dim, causal):
    """The accuracy policy for S from FP8 wgmma (the default on Hopper): O's relative L2 error against
    fp64 attention on the unquantized inputs at most 1.05x the reference backend's on the same MXFP8
    inputs, and its cosine against fp64 at most 1e-4 below the reference's, on every input kind but
    outlier channels, where it trails by up to 2e-4 (``OUTLIER_COSINE_GAP``)."""
    out, _, ref_out, _, exact_out, _ = _gpu_run(kind, len_q, len_k, heads_q, heads_kv, dim, causal)
    assert relative_l2(out, exact_out) <= POLICY_O_RATIO * relative_l2(ref_out, exact_out)
    slack = OUTLIER_COSINE_GAP if kind == "outlier_channel" else COSINE_SLACK
    assert cosine(out, exact_out) >= cosine(ref_out, exact_out) - slack


FP32_SCORE_PRECISION = 2.0**-18  # exact products, fp32 sums: LSE error per unit of the row's |score| bound


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gaussian", "outlier_channel", "heavy_tailed", "peaked"])
@pytest.mark.parametrize("len_q, len_k, heads_q, heads_kv, dim, causal", GPU_CASES)
def test_gpu_precise_scores_meet_the_issue_criteria(poisoned, kind, len_q, len_k, heads_q, heads_kv, dim, causal):
    """SCORES="bf16" (backend "hopper-exact-scores"): O within 1e-2 of the reference and cosine within 1e-4
    of its on every kind; LSE within 1e-3 or, where |scores| reach the thousands, fp32's resolution."""
    run = _gpu_run(kind, len_q, len_k, heads_q, heads_kv, dim, causal, scores="bf16")
    check_bounds(*run, O_TOLERANCE, COSINE_SLACK, FP32_SCORE_PRECISION)


def check_bounds(out, lse, ref_out, ref_lse, exact_out, inputs, o_tolerance, cosine_slack, score_precision):
    """O within ``o_tolerance`` of the reference, cosine vs fp64 within ``cosine_slack`` of its, LSE
    within LSE_TOLERANCE + ``score_precision`` x the row's score scale; no NaN; empty rows 0 / -inf."""
    q, k, offsets_q, offsets_k, scale = inputs
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert relative_l2(out, ref_out) <= o_tolerance
    assert cosine(out, exact_out) >= cosine(ref_out, exact_out) - cosine_slack
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    lse_error = (lse[finite].double() - ref_lse[finite]).abs()
    bound = LSE_TOLERANCE + score_precision * score_scale(q, k, offsets_q, offsets_k, scale)[finite]
    assert bool((lse_error <= bound).all())
    assert bool((out[~finite] == 0).all())


def score_scale(q, k, offsets_q, offsets_k, softmax_scale):
    """``[total_q, Hq]``: softmax_scale * |q_i| * max_j |k_j| over the row's keys, the size that an
    accumulation error of S is relative to (Cauchy-Schwarz bound of every score of the row)."""
    q_norm = q.double().norm(dim=-1)
    k_norm = k.double().norm(dim=-1).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    largest = torch.zeros_like(q_norm)
    for b in range(offsets_q.numel() - 1):
        rows, keys = slice(offsets_q[b], offsets_q[b + 1]), slice(offsets_k[b], offsets_k[b + 1])
        if keys.stop > keys.start:
            largest[rows] = k_norm[keys].amax(0)
    return softmax_scale * q_norm * largest


def test_pv_key_slot_is_the_operand_order_of_the_gluon_kernel():
    """``layout.pv_key_slot`` (where V^T stores each key) and the bit reorder that turns P's
    accumulator registers into the P·V operand in ``sm90_forward._as_pv_operand`` agree: operand
    column k holds S column c exactly where k = pv_key_slot(c)."""
    columns = torch.arange(128)
    operand_column_source = columns.reshape(2, 2, 2, 2, 2, 2, 2).permute(0, 1, 2, 4, 5, 3, 6).reshape(128)
    slots = layout.pv_key_slot(columns)
    assert sorted(slots.tolist()) == list(range(128))
    assert torch.equal(slots[operand_column_source], columns)


def test_rebase_kv_in_pv_key_order_permutes_each_tile(poisoned):
    _, k, v, _, offsets_k = make_inputs([3], [0, 1, 129, 200], 1, 2, 64)
    mk, mv = quantize_mxfp8(k, offsets_k), quantize_mxfp8(v, offsets_k, axis="sequence")
    natural = rebase.rebase_kv(mk, mv, 128)
    reordered = rebase.rebase_kv(mk, mv, 128, v_order=layout.PV_ORDER)
    for a, b in zip(natural[:2] + natural[3:], reordered[:2] + reordered[3:]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # K and the V exponents are untouched
    slots = torch.arange(natural[2].shape[2])
    slots = slots // 128 * 128 + layout.pv_key_slot(slots % 128)
    assert torch.equal(reordered[2][..., slots].view(torch.uint8), natural[2].view(torch.uint8))


def test_gluon_descriptors_build_on_the_host():
    """The launcher's TMA descriptors build from CPU tensors with plain int blocks: a ``gl.constexpr``
    block once broke every GPU call of the forward while the CPU suite stayed green."""
    total_q, total_k, heads_q, heads_kv, dim, block_n = 70, 90, 4, 2, 128, 128
    e4m3 = torch.float8_e4m3fn
    q, k = torch.zeros(total_q, heads_q, dim, dtype=e4m3), torch.zeros(total_k, heads_kv, dim, dtype=e4m3)
    vt = torch.zeros(heads_kv, dim, 256, dtype=e4m3)
    descriptors = [sm90_forward._q_descriptor(q), *sm90_forward._kv_descriptors(k, vt, block_n)]
    assert [d.block_shape for d in descriptors] == [[64, dim], [block_n, dim], [dim, block_n]]


@pytest.mark.parametrize("scores, dim", [("fp8", 128), ("bf16", 128), ("fp8", 64)])
def test_gluon_kernel_compiles_to_wgmma_for_sm90(scores, dim):
    """The warp-specialized, persistent kernel: FP8 wgmma for P·V (P straight from registers) and S, or a bf16
    wgmma for S with SCORES="bf16"; a loader warp and three consumer warpgroups at 160 registers
    (setmaxnreg); Q, K and V^T by TMA; each consumer's tiles that need no mask in a loop without it,
    and no tile loop touches local memory."""
    config = sm90_forward.tile_config(dim, scores)
    qk = torch.float8_e4m3fn if scores == "fp8" else torch.bfloat16
    k_desc, vt_desc = (descriptor_type(d) for d in sm90_forward._kv_descriptors(
        torch.zeros(128, 2, dim, dtype=qk), torch.zeros(2, dim, 128, dtype=torch.float8_e4m3fn), config["BLOCK_N"]))
    q_desc = descriptor_type(sm90_forward._q_descriptor(torch.zeros(64, 8, dim, dtype=qk)))
    signature = dict(
        q_desc=q_desc, k_desc=k_desc, vt_desc=vt_desc, q_factor="*fp32", k_factor="*fp32",
        v_exponent="*i32", out="*bf16", lse="*fp32", offsets_q="*i32", offsets_k="*i32", work="*i32", slots="i32",
        next_item="*i32", scale_log2="fp32", q_groups="i32", k_groups="i32", batch="i32", total_q="i32", total_k="i32",
    )
    constexprs = dict(HEADS_Q=8, HEADS_KV=2, D=dim, CAUSAL=True, **config)
    signature.update({name: "constexpr" for name in constexprs})
    ptx, shared = compile_kernel("jagged_attn.kernels.sm90.forward", "_attention_forward_kernel", signature,
                                 constexprs, arch=90, gluon=True, aligned=("out",))
    assert shared <= HOPPER_SHARED_BYTES, f"needs {shared} bytes of shared memory: would not launch"
    wgmma = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    fp8_mma = [line for line in wgmma if "e4m3.e4m3" in line]
    bf16_mma = [line for line in wgmma if "bf16.bf16" in line]
    assert fp8_mma and len(fp8_mma) + len(bf16_mma) == len(wgmma) and bool(bf16_mma) == (scores == "bf16")
    assert sm90_forward.CONSUMERS == 3 and config["CONSUMER_REGS"] == 160
    consumer_regs = config["CONSUMER_REGS"]
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{consumer_regs};", ptx) and "setmaxnreg.dec" in ptx
    # Persistent: the loader warp takes each next item from the launch's counter (one lane's atomic add)
    assert len(re.findall(r"atom\.global\.[a-z_.]*add\.u32", ptx)) == 1
    assert ptx.count("cp.async.bulk.tensor") >= 3
    tile_loops = [body for body in innermost_loops(sass(ptx, 90)) if any("GMMA" in x for x in body)]
    assert sum(not any("FSEL" in x for x in body) for body in tile_loops) == sm90_forward.CONSUMERS
    assert not [x for body in tile_loops for x in body if re.search(r"\b(STL|LDL)", x)]


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [None, 3], ids=["own-count", "3-programs"])
@pytest.mark.parametrize("scores", ["fp8", "bf16"])
@pytest.mark.parametrize("len_q, len_k, heads_q, heads_kv, dim, causal", GPU_CASES)
def test_gpu_gluon_kernel_matches_the_triton_kernel(poisoned, monkeypatch, programs, scores, len_q, len_k, heads_q,
                                                    heads_kv, dim, causal):
    """The Gluon kernel (what runs on GPUs) and the Triton kernel (what CI interprets) compute the
    same thing: equal up to the order of fp32 sums. With the launch's own program count (one per SM)
    each program takes one item or a few; with 3 programs each walks many, of every length and the
    empty slots, the KV ring running on from item to item."""
    if programs is not None:
        monkeypatch.setattr(persistent, "resident_programs", lambda device: programs)
    q, k, v, offsets_q, offsets_k = make_inputs(len_q, len_k, heads_q, heads_kv, dim)
    mq, mk, mv = quantized(q, k, v, offsets_q, offsets_k)
    options = dict(causal=causal, softmax_scale=dim**-0.5, out_dtype=torch.float32)
    out, lse = sm90_forward.attention_forward(mq, mk, mv, scores=scores, **options)
    config = portable_forward.tile_config(dim, scores)
    rebased_kv = rebase.rebase_kv(mk, mv, config["BLOCK_N"], exact=scores == "bf16")
    triton_out, triton_lse = portable_forward.forward_rebased(mq.data, mq, *rebased_kv, offsets_q, offsets_k,
                                                              config=config, **options)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert relative_l2(out, triton_out) <= 2e-3
    assert torch.equal(torch.isinf(lse), torch.isinf(triton_lse))
    finite = torch.isfinite(lse)
    assert float((lse[finite] - triton_lse[finite]).abs().amax()) <= 1e-3 if finite.any() else True
