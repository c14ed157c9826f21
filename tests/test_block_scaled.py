"""The spec-exact ``tl.dot_scaled`` path (``jagged_attn.kernels.sm100.block_scaled``).

* CPU, in CI: every kernel compiles for sm_100 to ``tcgen05.mma ... kind::mxf8f6f4.block_scale``
  with no bf16 upcast of its fp8 operands, and builds for sm_90 (where Triton emulates it).
* CPU interpreter and GPU: forward and backward on ragged batches against the reference backend on the same
  MXFP8 operands. Triton's interpreter runs ``tl.dot_scaled`` from 3.8 on; below that these tests give it
  the op as the MX spec defines it (``interpreted_dot_scaled``), so the kernels' own indexing, masks and
  scale placement run on the CPU.
"""

import math
import re

import numpy as np
import pytest
import torch
import triton.language as tl
from compile_util import compile_ptx
from triton.language import semantic
from triton.runtime import interpreter

from jagged_attn import mx_format
from jagged_attn.backends import get_backend
from jagged_attn.kernels.common import fp8
from jagged_attn.kernels.sm100 import block_scaled
from jagged_attn.mxfp8 import scale_col_tiles
from jagged_attn.offsets import offsets_from_lengths
from jagged_attn.quantize import quantize_mxfp8, quantize_mxfp8_dual
from jagged_attn.reference import reference_backward, reference_forward

MODULE = "jagged_attn.kernels.sm100.block_scaled"
# (kernel, dot_scaled call sites, BLOCK_M)
KERNELS = [
    ("forward_kernel", 3, block_scaled.BLOCK_M),
    ("dkdv_kernel", 4, block_scaled.DKDV_BLOCK_M),
    ("dq_kernel", 3, block_scaled.BLOCK_M),
]
SCALED_MMA = "tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale"
# Emulation on targets without a block-scaled MMA: fp8 -> f16/bf16 conversions, then bf16 scale multiplies.
FP8_UPCAST = re.compile(r"cvt\.\S*\.e[45]m[23]x2\s")
BF16_ARITHMETIC = re.compile(r"\b(?:mul|fma\.rn)\.bf16")
NON_TCGEN05_MMA = re.compile(r"\b(?:wgmma\.mma_async|mma\.sync)")

TOLERANCE = 5e-3  # relative L2 against the reference on the same MXFP8 operands


def _mx_values(operand, scales, k_axis: int) -> torch.Tensor:
    """float32 values of an e4m3 ``tl.dot_scaled`` operand (the interpreter holds its bytes): each element
    times the value of its 32-element block's E8M0 byte along K (``scales``: ``[rows, K / 32]``, the rows
    being M for the left operand, N for the right)."""
    values = torch.from_numpy(operand.data).view(torch.float8_e4m3fn).float()
    factors = mx_format.descale_factors(torch.from_numpy(scales.data)).repeat_interleave(mx_format.BLOCK_SIZE, dim=1)
    return values * (factors if k_axis == 1 else factors.T)


def _create_dot_scaled(self, lhs, lhs_scale, lhs_format, rhs, rhs_scale, rhs_format, fast_math, lhs_k_pack,
                       rhs_k_pack, acc):
    formats = {str(lhs_format), str(rhs_format)}
    if not all(name.endswith("E4M3") for name in formats):
        raise NotImplementedError(f"interpreted tl.dot_scaled takes e4m3 operands only, got {formats}")
    product = (_mx_values(lhs, lhs_scale, 1) @ _mx_values(rhs, rhs_scale, 0)).numpy()
    return interpreter.TensorHandle(product + acc.data.astype(np.float32), tl.float32)


@pytest.fixture
def interpreted_dot_scaled(monkeypatch):
    """``tl.dot_scaled`` in Triton's CPU interpreter where it lacks the op (before 3.8): e4m3 operands with
    E8M0 block scales, multiplied out and summed in fp32 into the accumulator. (The interpreter also hands
    the op's formats over as ``str`` where the front end reads ``constexpr``.)"""
    if fp8.INTERPRETED and not hasattr(interpreter.InterpreterBuilder, "create_dot_scaled"):
        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot_scaled", _create_dot_scaled, raising=False)
        front_end = semantic.TritonSemantic.dot_scaled

        def dot_scaled(self, lhs, lhs_scale, lhs_format, rhs, rhs_scale, rhs_format, *args, **kwargs):
            return front_end(self, lhs, lhs_scale, tl.constexpr(lhs_format), rhs, rhs_scale, tl.constexpr(rhs_format),
                             *args, **kwargs)

        monkeypatch.setattr(semantic.TritonSemantic, "dot_scaled", dot_scaled)


def signature(kernel: str, constexprs: dict) -> dict:
    """Triton types of ``kernel``'s arguments, by naming convention of jagged_attn/kernels/sm100/block_scaled.py."""
    types = {}
    for name in getattr(block_scaled, kernel).arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name.endswith("_scales"):
            types[name] = "*u8"
        elif name in ("out_ptr", "dq_ptr", "dk_ptr", "dv_ptr"):
            types[name] = "*bf16"
        elif name in ("lse_ptr", "delta_ptr"):
            types[name] = "*fp32"
        elif name.startswith("offsets"):
            types[name] = "*i64"
        elif name.endswith("_ptr"):
            types[name] = "*fp8e4nv"
        elif name in ("softmax_scale", "qk_scale_log2"):
            types[name] = "fp32"
        else:
            types[name] = "i32"
    return types


def compile_kernel(kernel: str, block_m: int, head_dim: int, causal: bool, arch: int) -> str:
    constexprs = dict(D=head_dim, FEATURE_COL_TILES=scale_col_tiles("feature", 0, 0, head_dim), CAUSAL=causal,
                      BLOCK_M=block_m, BLOCK_N=block_scaled.BLOCK_N, INTERPRET=False)
    return compile_ptx(MODULE, kernel, signature(kernel, constexprs), constexprs, arch=arch,
                       num_warps=block_scaled.NUM_WARPS, num_stages=block_scaled.NUM_STAGES)


@pytest.mark.parametrize("head_dim,causal", [(128, True), (64, False)])
@pytest.mark.parametrize("kernel,dot_sites,block_m", KERNELS)
def test_sm100_uses_block_scaled_tcgen05_mma(kernel, dot_sites, block_m, head_dim, causal):
    ptx = compile_kernel(kernel, block_m, head_dim, causal, arch=100)
    mmas = re.findall(r"tcgen05\.mma\S*", ptx)
    assert len(mmas) >= dot_sites, f"{kernel}: expected >= {dot_sites} tcgen05.mma, found {mmas}"
    assert all(mma.startswith(SCALED_MMA) for mma in mmas), f"{kernel}: non-block-scaled MMA in {set(mmas)}"
    assert not FP8_UPCAST.search(ptx), f"{kernel}: fp8 operands converted to 16-bit floats"
    assert not BF16_ARITHMETIC.search(ptx), f"{kernel}: bf16 arithmetic (emulated MX scaling)"
    assert not NON_TCGEN05_MMA.search(ptx), f"{kernel}: Hopper/Ampere MMA instead of tcgen05"


@pytest.mark.parametrize("kernel,dot_sites,block_m", KERNELS)
def test_sm90_builds_with_emulated_scaling(kernel, dot_sites, block_m):
    """Hopper has no block-scaled MMA: the same source builds, and the upcast checks above do fire."""
    ptx = compile_kernel(kernel, block_m, 128, True, arch=90)
    assert "wgmma.mma_async" in ptx and "tcgen05" not in ptx
    assert FP8_UPCAST.search(ptx) and BF16_ARITHMETIC.search(ptx)


# ---------------------------------------------------------------------------------------------
# Execution against the reference backend


def make_inputs(kind: str, total: int, heads: int, head_dim: int, device) -> torch.Tensor:
    """float32 ``[total, heads, D]`` test values of one of the docs/DESIGN.md section 7 families."""
    x = torch.randn(total, heads, head_dim, device=device)
    if kind == "outlier":  # a few channels 30x larger
        x[..., torch.randperm(head_dim, device=device)[:4]] *= 30.0
    elif kind == "heavy":  # log-normal token norms
        x *= torch.exp(torch.randn(total, heads, 1, device=device))
    elif kind == "peaked":  # sharp softmax
        x *= 2.0
    return x


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def cosine(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(x.double().flatten(), ref.double().flatten(), dim=0))


def poison_cuda_cache() -> None:
    """Leave NaN-filled blocks in the CUDA caching allocator so unwritten outputs show as NaN."""
    if torch.cuda.is_available():
        for numel in (1 << 10, 1 << 16, 1 << 20, 1 << 24):
            torch.full((numel,), float("nan"), device="cuda")


def check_attention(lengths_q, lengths_k, heads_q, heads_kv, head_dim, causal, kind, dtype, device,
                    offsets_dtype=torch.int64, with_dlse=False):
    """Forward and backward of the block-scaled kernels vs the reference (float64) on the same MXFP8 operands;
    ``with_dlse``: the backward with a gradient of the LSE as well."""
    offsets_q = offsets_from_lengths(torch.tensor(lengths_q)).to(device, offsets_dtype)
    offsets_k = offsets_from_lengths(torch.tensor(lengths_k)).to(device, offsets_dtype)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = make_inputs(kind, total_q, heads_q, head_dim, device).to(dtype)
    k = make_inputs(kind, total_k, heads_kv, head_dim, device).to(dtype)
    v = make_inputs(kind, total_k, heads_kv, head_dim, device).to(dtype)
    dout = torch.randn(total_q, heads_q, head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    q_mx = quantize_mxfp8(q, offsets_q, axis="feature")
    k_mx = quantize_mxfp8(k, offsets_k, axis="feature")
    v_mx = quantize_mxfp8(v, offsets_k, axis="sequence")

    poison_cuda_cache()
    out, lse = block_scaled.attention_forward(q_mx, k_mx, v_mx, causal=causal, softmax_scale=scale, out_dtype=dtype)
    ref_out, ref_lse = reference_forward(q_mx.dequantize(), k_mx.dequantize(), v_mx.dequantize(), offsets_q,
                                         offsets_k, causal=causal, softmax_scale=scale, compute_dtype=torch.float64)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen) and bool((lse[~seen] == -math.inf).all())
    assert bool((out[~seen] == 0).all())
    lse_error = (lse[seen].double() - ref_lse[seen]).abs() / (1 + ref_lse[seen].abs())
    assert lse_error.numel() == 0 or float(lse_error.max()) < 1e-5
    # The reference is rounded to the output dtype like the kernel's results, so that the
    # comparison measures the kernel (fp32 accumulation order), not the bf16 rounding of outputs.
    errors = {"out": rel_l2(out, ref_out.to(dtype))}

    dlse = torch.where(seen, torch.randn(lse.shape, device=device), 0.0) if with_dlse else None
    poison_cuda_cache()
    grads = get_backend("block-scaled").backward(dout, q, k, v, out, lse, offsets_q, offsets_k, causal, scale, True,
                                                 dlse=dlse)
    ref_grads = reference_backward(dout, q, k, v, out, lse, offsets_q, offsets_k, causal=causal,
                                   softmax_scale=scale, compute_dtype=torch.float64, dlse=dlse)
    for name, grad, ref, like in zip(("dq", "dk", "dv"), grads, ref_grads, (q, k, v)):
        assert grad.shape == like.shape and grad.dtype == like.dtype
        assert torch.isfinite(grad).all(), name
        errors[name] = rel_l2(grad, ref.to(dtype))
        assert cosine(grad, ref) > 0.9999, name
    print(kind, causal, heads_q, heads_kv, head_dim, dtype, {n: f"{e:.2e}" for n, e in errors.items()})
    assert max(errors.values()) < TOLERANCE, errors


@pytest.mark.parametrize("causal,heads_q,heads_kv,head_dim,with_dlse", [(True, 4, 2, 64, True),
                                                                       (False, 2, 2, 128, False)])
def test_block_scaled_matches_reference_tiny(causal, heads_q, heads_kv, head_dim, with_dlse, interpreted_dot_scaled):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check_attention([0, 1, 33, 130, 31], [5, 0, 64, 129, 160], heads_q, heads_kv, head_dim, causal, "gaussian",
                    torch.float32, device, offsets_dtype=torch.int32, with_dlse=with_dlse)


RAGGED_Q = [0, 1, 31, 32, 33, 127, 128, 129, 300, 5]
RAGGED_K = [7, 0, 64, 31, 200, 129, 1, 128, 257, 0]


@pytest.mark.parametrize("kind,causal", [("heavy", True), ("outlier", False)])
def test_block_scaled_matches_reference_ragged(kind, causal, interpreted_dot_scaled):
    """The ragged lengths around the tile sizes, cross-attention with empty sequences on either side, MQA."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check_attention(RAGGED_Q, RAGGED_K, 2, 1, 64, causal, kind, torch.float32, device)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gaussian", "outlier", "heavy", "peaked"])
@pytest.mark.parametrize(
    "lengths_k,causal,heads_q,heads_kv,head_dim",
    [
        (RAGGED_Q, True, 4, 2, 128),  # self-attention, causal, GQA
        (RAGGED_K, True, 4, 1, 64),  # cross, causal with Lq < Lk and Lq > Lk, MQA
        (RAGGED_K, False, 2, 2, 128),  # cross
        (RAGGED_Q, False, 4, 2, 64),
    ],
)
def test_block_scaled_matches_reference_gpu(kind, lengths_k, causal, heads_q, heads_kv, head_dim):
    check_attention(RAGGED_Q, lengths_k, heads_q, heads_kv, head_dim, causal, kind, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_block_scaled_lse_gradient_gpu(causal):
    """The backward with a gradient of the LSE too (taken into Delta) on ragged cross-attention."""
    check_attention(RAGGED_Q, RAGGED_K, 4, 2, 128, causal, "gaussian", torch.bfloat16, "cuda", with_dlse=True)


@pytest.mark.gpu
def test_block_scaled_float32_int32_offsets_gpu():
    check_attention(RAGGED_Q, RAGGED_K, 4, 2, 128, True, "gaussian", torch.float32, "cuda", offsets_dtype=torch.int32)


def test_rejects_bad_operands():
    offsets = offsets_from_lengths(torch.tensor([3, 40]))
    x = torch.randn(43, 4, 64)
    q, k = quantize_mxfp8(x, offsets, axis="feature"), quantize_mxfp8(x[:, :3], offsets, axis="feature")
    v_wrong_axis = quantize_mxfp8(x, offsets, axis="feature")
    with pytest.raises(ValueError, match="v must be"):
        block_scaled.attention_forward(q, q, v_wrong_axis, causal=False, softmax_scale=0.125)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        block_scaled.attention_forward(q, k, quantize_mxfp8(x[:, :3], offsets, axis="sequence"), causal=False,
                                softmax_scale=0.125)
    wide = torch.randn(43, 4, 96)
    both_axes = quantize_mxfp8_dual(wide, offsets)
    v_feature = quantize_mxfp8(wide, offsets, axis="feature")
    operands = block_scaled.BackwardOperands(*both_axes, *both_axes, v_feature, *both_axes)
    with pytest.raises(ValueError, match="head_dim"):
        block_scaled.attention_backward(operands, torch.zeros(43, 4), torch.zeros(43, 4), causal=False,
                                        softmax_scale=0.1, dtypes=(torch.float32,) * 3)
    with pytest.raises(ValueError, match="v_feature must be"):
        block_scaled.attention_backward(operands._replace(v_feature=operands.k_sequence), torch.zeros(43, 4),
                                        torch.zeros(43, 4), causal=False, softmax_scale=0.1,
                                        dtypes=(torch.float32,) * 3)
