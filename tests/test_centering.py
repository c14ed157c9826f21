"""K and V centered per sequence before quantization (``center_kv``): exact in exact arithmetic, far closer
to exact attention where K or V carries a large common part, and never an overflow."""

import math

import pytest
import torch

import jagged_attn as ja
from attention_oracle import padded_attention
from compile_util import compile_ptx
from jagged_attn import centering
from jagged_attn.centering import centered_keys_values, sequence_centers, uncentered_outputs
from jagged_attn.kernels.common.interpreter import INTERPRETED
from jagged_attn.kernels.producers import center as center_kernels
from jagged_attn.metrics import relative_l2
from jagged_attn.offsets import offsets_from_lengths
from jagged_attn.reference import reference_forward

RAGGED = [0, 1, 31, 32, 33, 127, 128, 129]


@pytest.mark.parametrize("lengths_q, lengths_k, causal", [(RAGGED, RAGGED, True), (RAGGED, RAGGED[::-1], False),
                                                          ([5, 40, 0, 3], [2, 40, 7, 0], True)])
def test_the_shift_is_exact_in_exact_arithmetic(lengths_q, lengths_k, causal):
    """Exact attention (float64, no quantization) on centered K, V with the centers added back gives the
    same O, LSE and gradients as on K, V themselves; rows that see no key keep O = 0, LSE = -inf."""
    offsets_q, offsets_k = offsets_from_lengths(torch.tensor(lengths_q)), offsets_from_lengths(torch.tensor(lengths_k))
    q = torch.randn(sum(lengths_q), 4, 32, dtype=torch.float64)
    k, v = (torch.randn(sum(lengths_k), 2, 32, dtype=torch.float64) + 5 * torch.randn(2, 32, dtype=torch.float64)
            for _ in range(2))
    leaves = [x.requires_grad_(True) for x in (q, k, v)]

    def exact(q, k, v):
        return reference_forward(q, k, v, offsets_q, offsets_k, causal=causal, compute_dtype=torch.float64,
                                 fp8=False)

    out, lse = exact(*leaves)
    k_c, v_c, k_mean, v_mean = centered_keys_values(leaves[1], leaves[2], offsets_k)
    shifted = uncentered_outputs(*exact(leaves[0], k_c, v_c), leaves[0], k_mean, v_mean, offsets_q, 32**-0.5)
    assert torch.equal(torch.isneginf(shifted[1]), torch.isneginf(lse))
    seen = torch.isfinite(lse)
    torch.testing.assert_close(shifted[0], out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(shifted[1][seen], lse[seen], rtol=1e-10, atol=1e-10)
    assert not shifted[0][~seen].any()
    weights = torch.randn_like(lse).masked_fill(~seen, 0.0)
    losses = [(o * dout).sum() + (torch.where(seen, s, 0.0) * weights).sum()
              for (o, s), dout in zip((shifted, (out, lse)), [torch.randn_like(out)] * 2)]
    for got, want in zip(torch.autograd.grad(losses[0], leaves), torch.autograd.grad(losses[1], leaves)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def _errors_against_fp64(q, k, v, offsets, center_kv):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = ja.jagged_attention(*leaves, offsets, causal=True, backend="reference", center_kv=center_kv)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    exact = [x.double().requires_grad_(True) for x in (q, k, v)]
    exact_out = padded_attention(*exact, offsets, offsets, True, q.shape[-1] ** -0.5)[0]
    exact_grads = torch.autograd.grad(exact_out, exact, dout.double())
    return [relative_l2(a, b) for a, b in zip((out, *grads), (exact_out, *exact_grads))]


@pytest.mark.parametrize("biased", ["k", "v"])
def test_centering_keeps_a_common_part_from_swamping_the_gradients(biased):
    """Keys (or values) with a common part four times their spread: uncentered, MXFP8 rounding of that part
    moves dQ far more than on zero-mean inputs (biased keys: ~25%, as dS K relies on rows of dS summing to
    zero; biased values: ~13-16%, V's common part rounded differently in O and in dP - Delta), and O too;
    centered, every error is what zero-mean inputs give (~5-7%)."""
    offsets = offsets_from_lengths(torch.tensor([200, 77, 300]))
    q, k, v = (torch.randn(577, h, 64) for h in (4, 2, 2))
    if biased == "k":
        k = k + 4 * torch.randn(1, 2, 64)
    else:
        v = v + 4 * torch.randn(1, 2, 64)
    q, k, v = (x.bfloat16() for x in (q, k, v))
    raw = _errors_against_fp64(q, k, v, offsets, center_kv=False)
    centered = _errors_against_fp64(q, k, v, offsets, center_kv=True)
    assert max(centered) < 0.1, centered
    assert centered[1] < raw[1] / (2.5 if biased == "k" else 1.5), (centered, raw)  # dQ
    assert centered[0] < raw[0] / 1.5, (centered, raw)  # O


def test_channels_that_could_overflow_are_not_shifted():
    """A channel whose largest magnitude passes half its dtype's range keeps a zero shift (x - mean could
    overflow); the others get their mean."""
    big = torch.finfo(torch.float16).max
    x = torch.randn(40, 1, 32).half()
    x[:, 0, 3] = big * torch.where(torch.arange(40) % 2 == 0, 1.0, 0.9).half()
    offsets = torch.tensor([0, 40])
    centers = sequence_centers(x, offsets)
    assert centers[0, 0, 3] == 0
    torch.testing.assert_close(centers[0, 0, :3], x[:, 0, :3].float().mean(0))
    k_c, v_c, _, _ = centered_keys_values(x, x, offsets)
    assert bool(torch.isfinite(k_c).all()) and bool(torch.isfinite(v_c).all())


def test_center_kv_must_be_a_bool():
    q = torch.randn(10, 1, 32)
    with pytest.raises(TypeError, match="center_kv"):
        ja.jagged_attention(q, q, q, torch.tensor([0, 10]), center_kv=1)


def test_empty_batch_and_empty_sequences():
    offsets = torch.tensor([0, 0, 0])
    empty = torch.randn(0, 2, 32)
    out, lse = ja.jagged_attention(empty, empty, empty, offsets, return_lse=True)
    assert out.shape == (0, 2, 32) and lse.shape == (0, 2)
    assert not sequence_centers(empty, offsets).any()
    assert math.isinf(float(ja.jagged_attention(torch.randn(3, 1, 32), torch.randn(0, 1, 32), torch.randn(0, 1, 32),
                                                torch.tensor([0, 3]), torch.tensor([0, 0]), return_lse=True)[1].max()))


def _kernel_case(device, dtype, lengths, heads_q, heads_kv, dim):
    """q, k, v as a fused projection gives them: views of one ``[total, (Hq + 2 Hkv) * D]`` tensor, not
    contiguous (the kernels must not read them as if they were)."""
    offsets = offsets_from_lengths(torch.tensor(lengths)).to(device)
    total = sum(lengths)
    qkv = (torch.randn(total, (heads_q + 2 * heads_kv) * dim, device=device) + 3).to(dtype)
    q, k, v = qkv.split([heads_q * dim, heads_kv * dim, heads_kv * dim], dim=-1)
    q, k, v = q.unflatten(-1, (heads_q, dim)), k.unflatten(-1, (heads_kv, dim)), v.unflatten(-1, (heads_kv, dim))
    assert not k.is_contiguous() and not v.is_contiguous()
    return q, k, v, offsets


def check_kernels_match_the_torch_forms(device, dtype, lengths, heads_q, heads_kv, dim):
    """``jagged_attn/kernels/producers/center.py`` against the torch forms of ``centering.py``: per-sequence sums and
    maxima (through the per-slot partials), the shift, and its undoing on O and the LSE (rows that see
    no key included)."""
    q, k, v, offsets = _kernel_case(device, dtype, lengths, heads_q, heads_kv, dim)
    sums, amax = center_kernels.slot_partials(k, offsets)
    slots = center_kernels.first_slots(offsets)
    torch.testing.assert_close(torch.segment_reduce(sums, "sum", offsets=slots, axis=0, initial=0),
                               torch.segment_reduce(k.float(), "sum", offsets=offsets, axis=0, initial=0),
                               rtol=1e-5, atol=1e-3)
    assert torch.equal(torch.segment_reduce(amax, "max", offsets=slots, axis=0, initial=0),
                       torch.segment_reduce(k.float().abs(), "max", offsets=offsets, axis=0, initial=0))
    centers = torch.randn(len(lengths), heads_kv, dim, device=device)
    assert torch.equal(center_kernels.shifted(k, centers, offsets), centering.shifted_torch(k, centers, offsets))
    out = torch.randn_like(q)
    lse = torch.randn(q.shape[:2], device=device)
    lse[::3] = -math.inf
    k_centers, v_centers = centers, torch.randn_like(centers)
    got = center_kernels.unshifted_outputs(out, lse, q, k_centers, v_centers, offsets, 0.125)
    want = centering.uncentered_torch(out, lse, q, k_centers, v_centers, offsets, 0.125)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-5)
    assert torch.equal(torch.isneginf(got[1]), torch.isneginf(lse))


@pytest.mark.parametrize("lengths, heads_q, heads_kv, dim", [([0, 1, 129, 33], 4, 2, 64), ([130], 2, 2, 96)])
def test_kernels_match_the_torch_forms(lengths, heads_q, heads_kv, dim):
    if not torch.cuda.is_available() and not INTERPRETED:
        pytest.skip("the Triton kernels need CUDA or the interpreter")
    check_kernels_match_the_torch_forms("cpu" if INTERPRETED else "cuda", torch.bfloat16, lengths, heads_q, heads_kv,
                                        dim)


CENTER_KERNEL_SIGNATURES = {  # runtime arguments and their types; the rest are constexprs
    "_partials_kernel": dict(values="*bf16", tiles="*i32", offsets="*i64", total="i32", sums="*fp32", amax="*fp32"),
    "_shift_kernel": dict(values="*bf16", out="*bf16", centers="*fp32", tiles="*i32", offsets="*i64",
                          total="i32"),
    "_unshift_kernel": dict(out="*bf16", lse="*fp32", q="*bf16", new_out="*bf16", new_lse="*fp32",
                            k_centers="*fp32", v_centers="*fp32", tiles="*i32", offsets="*i64", total="i32",
                            softmax_scale="fp32"),
}


@pytest.mark.parametrize("kernel", sorted(CENTER_KERNEL_SIGNATURES))
def test_center_kernels_compile_for_sm90(kernel):
    """What the interpreter lets pass and a GPU build does not (a kernel reading a plain Python global,
    say) shows here, without a GPU: each centering kernel compiles for sm_90."""
    constexprs = {"HEADS": 8, "D": 128, "GROUP": 4, "INTERPRET": False}
    fn = getattr(center_kernels, kernel)
    constexprs = {name: value for name, value in constexprs.items() if name in fn.arg_names}
    signature = {**CENTER_KERNEL_SIGNATURES[kernel], **{name: "constexpr" for name in constexprs}}
    assert set(signature) == set(fn.arg_names)
    ptx = compile_ptx("jagged_attn.kernels.producers.center", kernel, signature, constexprs, arch=90,
                      num_warps=center_kernels.NUM_WARPS)
    assert ".entry" in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernels_match_the_torch_forms_gpu(dtype):
    check_kernels_match_the_torch_forms("cuda", dtype, RAGGED + [1000], 8, 2, 128)


@pytest.mark.gpu
def test_centered_public_call_on_cuda_matches_the_cpu_one():
    """The public call with ``center_kv=True`` (reference backend: the same math on both devices) gives the
    CPU's output, LSE and gradients on CUDA, where the centering runs on the kernels."""
    q, k, v, offsets = _kernel_case("cpu", torch.float32, RAGGED, 4, 2, 64)
    # Multiples of 1/8 (|x| < 16): every per-sequence sum is exact in fp32 in any order, so both devices
    # shift K and V by the same means and round the same MX values; a mean one ulp apart would move an
    # element across an e4m3 rounding boundary now and then, and a row that sees one key by a whole step.
    # The output's gradient is a fixed weight, not one made from the output itself, for the same reason.
    for x in (q, k, v):  # in place: they stay views of one tensor
        x.mul_(8).round_().clamp_(-127, 127).div_(8)
    weight = torch.randint(-4, 5, q.shape).float() / 4
    results = []
    for device in ("cpu", "cuda"):
        leaves = [x.detach().to(device).requires_grad_(True) for x in (q, k, v)]
        out, lse = ja.jagged_attention(*leaves, offsets.to(device), causal=True, backend="reference", center_kv=True,
                                       return_lse=True)
        ((out * weight.to(device)).sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
        results.append([t.detach().cpu() for t in (out, lse, *(x.grad for x in leaves))])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
