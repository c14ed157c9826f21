"""CPU model of the Hopper backward's numerics: how far FP8 accumulation of S and dP, and the
Gluon kernel's dS scale policy, move dQ, dK, dV.

    python3 scripts/bwd_numerics_model.py [--kind heavy] [--causal] [--seeds 1 2 3 4]

Hopper's FP8 wgmma sums the reduction in 32-wide chunks and keeps ~13 bits when it adds (the
DeepSeek-V3 report measured ~14). The model: each chunk sum is truncated at
``2^(floor(log2 bound) - BITS)``, ``bound`` the largest product it can hold, and chunks are added
into the accumulator with the same truncation relative to the larger addend ("truncated"), or
exactly ("promoted", as ``max_num_imprecise_acc=32`` does in the Triton kernel). It replaces the
S and dP products of the reference backward (``jagged_attn.reference``) on the GPU accuracy test's
ragged GQA batch and prints, per seed, dQ / dK / dV rel-L2 against the unmodified reference and
how far the cosine against fp64 gradients moves from the reference's (the accuracy test's two
criteria) for: both promoted (the Triton kernel), both truncated (the Gluon kernel with FP8 S),
only S truncated, only dP truncated (the Gluon kernel's default).

The dS modes keep exact products and change only dS's quantization: the reference quantizes 32x32
tiles, each on its own scale; the Gluon kernel quantizes 64 x 64 tiles (one consumer's keys x one
query step) on a running scale per (KV head, 64-key block) that only grows over its steps (query
heads of the group outer, query tiles inner) from the smallest normal ("dS running64"), here
also one scale per 64 x 64 tile ("dS step64"). docs/perf-history.md (the backward's exact S and dP) compares all of it
with the H200.

The dK modes keep the reference's S, dP and dS and model how the Gluon kernel sums dK = dS^T Q over
its steps (query heads of a group outer, 64-query tiles inner, per 64-key tile): each k32 wgmma's
chunk truncated as above, chained into the wgmma accumulator for ``N`` steps and then added exactly
into an fp32 total ("dK chained N"). N = 1 is the kernel's fresh accumulator per step; "all" chains
every step (as the kernel's FP8 dV once was). ``--dk-only`` runs just these.

``--dv-drift`` models dV = P^T dO summed the same two ways (chained over every step, as the kernel's
FP8 dV did before its fp16 wgmma, or a fresh accumulator per step) on flat causal attention, as a
QK-norm model's layers have it (unit-norm q and k times sqrt(D), scores of spread ``--sigma``; one
sequence per length in ``--lengths``, four query heads on one KV head), and prints each sum's shrink
(alpha, the least-squares factor of dV on the exact one: a systematic bias towards zero, which rel-L2
barely shows) and rel-L2 against exact dV of the unrounded inputs. The model's shrink is far larger
than the H200's (chained: 1.2e-2 at 4k keys here; the kernel's FP8 dV was 3-5e-4 below the reference
backend's on batches of 4k-8k keys): its 13-bit truncation of every add gets the bias's direction,
not its size.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_hopper_bwd import cosine, exact_gradients, forward_of, make_inputs, rel_l2  # noqa: E402  (the GPU tests')

from jagged_attn import mx_format, reference  # noqa: E402
from jagged_attn.metrics import least_squares_factor, relative_l2  # noqa: E402
from jagged_attn.quantize import quantize_mxfp8  # noqa: E402

BITS = 13
CHUNK = 32
SCORE_PRODUCT = "qhd,khd->hqk"  # the einsum of S and of dP in reference_backward, in that order
DS_TILE = 64  # queries per step x keys per consumer warpgroup of the Gluon kernel
GROUP = 4  # query heads per KV head in the batch of main()
# (S truncated, dP truncated: None for exact products; dS rule: None for the reference's, else running or not)
MODES = {"promoted": (False, False, None), "truncated": (True, True, None), "S truncated": (True, False, None),
         "dP truncated": (False, True, None), "dS step64": (None, None, False), "dS running64": (None, None, True)}


def _truncate(x: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    ulp = torch.exp2(torch.floor(torch.log2(bound.clamp_min(1e-300))) - BITS)
    return torch.trunc(x / ulp) * ulp


def fp8_product(a: torch.Tensor, b: torch.Tensor, truncated: bool) -> torch.Tensor:
    """``einsum(SCORE_PRODUCT, a, b)`` summed as the model of FP8 wgmma does (fp64 in between)."""
    total = None
    for start in range(0, a.shape[-1], CHUNK):
        a_chunk, b_chunk = a[..., start:start + CHUNK].double(), b[..., start:start + CHUNK].double()
        bound = torch.einsum("qh,kh->hqk", a_chunk.abs().amax(-1), b_chunk.abs().amax(-1))
        part = _truncate(torch.einsum(SCORE_PRODUCT, a_chunk, b_chunk), bound)
        if total is None:
            total = part
        elif truncated:
            total = _truncate(total + part, torch.maximum(total.abs(), part.abs()))
        else:
            total = total + part
    return total.float()


class _TorchWithModelledEinsum:
    """``torch`` for ``jagged_attn.reference``, except that each einsum of ``equation`` is
    ``product(i, *operands)``, i counting those einsums (per sequence the reference makes two: S then
    dP, or dV then dK)."""

    def __init__(self, equation: str, product):
        self.equation, self.product = equation, product
        self.calls = 0

    def einsum(self, equation, *operands):
        if equation != self.equation:
            return torch.einsum(equation, *operands)
        self.calls += 1
        return self.product(self.calls - 1, *operands)

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def _reference_torch(proxy):
    reference.torch = proxy
    try:
        yield
    finally:
        reference.torch = torch


def quantize_ds_tiles(ds: torch.Tensor, running: bool) -> torch.Tensor:
    """``[Hq, Lq, Lk]`` dS of one sequence after e4m3 quantization in ``DS_TILE`` square tiles, each
    on its own scale or (``running``) on the Gluon kernel's running scale."""
    heads, len_q, len_k = ds.shape
    padded = torch.nn.functional.pad(ds.float(), (0, -len_k % DS_TILE, 0, -len_q % DS_TILE))
    q_tiles, k_tiles = padded.shape[1] // DS_TILE, padded.shape[2] // DS_TILE
    tiles = padded.reshape(heads, q_tiles, DS_TILE, k_tiles, DS_TILE)
    byte = mx_format.scale_bytes(tiles.abs().amax(dim=(2, 4)))  # [Hq, q tiles, k tiles]
    if running:
        steps = byte.reshape(heads // GROUP, GROUP * q_tiles, k_tiles).clamp_min(1)  # 1: the smallest normal
        byte = torch.cummax(steps, dim=1).values.reshape(heads, q_tiles, k_tiles)
    byte = byte[:, :, None, :, None]
    values = mx_format.quantize_with_factors(tiles, mx_format.scale_factors(byte)).float()
    return (values * mx_format.descale_factors(byte)).reshape(padded.shape)[:, :len_q, :len_k]


KEY_PRODUCT = "hqk,qhd->khd"  # dV = P^T dO, then dK = dS^T Q in reference_backward, per sequence
DK_FLUSHES = {"dK chained 1": 1, "dK chained 4": 4, "dK chained 16": 16, "dK chained all": None}


def chained_key_product(weights: torch.Tensor, rows: torch.Tensor, flush_every: int | None) -> torch.Tensor:
    """``einsum(KEY_PRODUCT, weights, rows)`` of one sequence (``[Hq, Lq, Lk]``, ``[Lq, Hq, D]``: dS and Q
    for dK, P and dO for dV) with each KV head's group sum in its first query head (``reference.reduce_kv``
    then gives the group's gradient), summed as the kernel's steps sum it: per 32-query chunk truncated
    at its bound, chunks chained into the wgmma accumulator with truncation against the larger addend,
    and every ``flush_every`` 64-query steps (never for None) added exactly into the total."""
    heads, len_q, len_k = weights.shape
    out = torch.zeros(len_k, heads, rows.shape[-1], dtype=torch.float64)
    chunks_per_flush = None if flush_every is None else flush_every * DS_TILE // CHUNK
    for first in range(0, heads, GROUP):
        total = torch.zeros(len_k, rows.shape[-1], dtype=torch.float64)
        acc, chained = torch.zeros_like(total), 0
        for h in range(first, first + GROUP):
            for start in range(0, len_q, CHUNK):
                a = weights[h, start:start + CHUNK].double()  # [chunk, Lk]
                b = rows[start:start + CHUNK, h].double()  # [chunk, D]
                if not a.any():
                    continue  # a causal step the kernel skips
                part = _truncate(a.T @ b, a.abs().amax(0)[:, None] * b.abs().amax(0)[None, :])
                acc = _truncate(acc + part, torch.maximum(acc.abs(), part.abs())) if chained else part
                chained += 1
                if chunks_per_flush is not None and chained == chunks_per_flush:
                    total, acc, chained = total + acc, torch.zeros_like(acc), 0
        out[:, first] = total + acc
    return out.to(weights.dtype)


def dv_drift(length: int, sigma: float, seed: int) -> dict[str, tuple[float, float]]:
    """{summation: (alpha, rel-L2)} of dV on one flat causal sequence (``--dv-drift``): P on its static
    scale and dO along the sequence rounded as the kernel rounds them, then summed by
    :func:`chained_key_product` with a fresh accumulator per step or chained over all of them. The draw
    is ``seed``'s; the caller's random stream is left as it was."""
    dim = 128
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        q, k, _, dout, _, _ = make_inputs([length], [length], GROUP, 1, dim, kind="flat")
    q, k, dout = q.double() * sigma, k.double().expand(length, GROUP, dim), dout.double()
    scores = torch.einsum(SCORE_PRODUCT, q, k) * dim**-0.5
    p = torch.softmax(scores.masked_fill(~reference.visible_mask(length, length, True, "cpu"), -torch.inf), -1)
    exact = torch.einsum(KEY_PRODUCT, p, dout).sum(1)
    p_operand = mx_format.quantize_p(p.float()).double() * 2.0**mx_format.P_STATIC_EXP
    do_operand = quantize_mxfp8(dout.float(), torch.tensor([0, length]), axis="sequence").dequantize().double()
    result = {}
    for name, flush in (("fresh per step", 1), ("chained", None)):
        got = chained_key_product(p_operand, do_operand, flush)[:, 0] * 2.0**-mx_format.P_STATIC_EXP
        result[name] = (least_squares_factor(got, exact), relative_l2(got, exact))
    return result


def modelled_dk(flush_every: int | None):
    """The reference backward with dK summed as :func:`chained_key_product` sums it."""
    def product(call, *operands):  # dV first, then dK
        return chained_key_product(*operands, flush_every) if call % 2 else torch.einsum(KEY_PRODUCT, *operands)

    return _reference_torch(_TorchWithModelledEinsum(KEY_PRODUCT, product))


@contextlib.contextmanager
def modelled_backward(truncate_s: bool, truncate_dp: bool, running_ds):
    """The reference backward with the modelled S / dP products (``truncate_s`` not None) and dS rule
    (``running_ds`` not None)."""
    reference_rule = mx_format.fake_quantize_square_tiles
    if truncate_s is not None:  # per sequence: S first, then dP
        truncated = (truncate_s, truncate_dp)
        reference.torch = _TorchWithModelledEinsum(
            SCORE_PRODUCT, lambda call, a, b: fp8_product(a, b, truncated[call % 2]))
    if running_ds is not None:
        mx_format.fake_quantize_square_tiles = lambda ds: quantize_ds_tiles(ds, running_ds)
    try:
        yield
    finally:
        reference.torch = torch
        mx_format.fake_quantize_square_tiles = reference_rule


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", default="heavy", choices=["gaussian", "outlier", "heavy", "peaked"])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--dk-only", action="store_true", help="only the dK accumulation modes")
    parser.add_argument("--dv-drift", action="store_true", help="only dV's summations on flat causal attention")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--sigma", type=float, default=1.0)
    args = parser.parse_args()
    if args.dv_drift:
        for length in args.lengths:
            for seed in args.seeds:
                for name, (alpha, rel) in dv_drift(length, args.sigma, seed).items():
                    print(f"length {length} sigma {args.sigma} seed {seed} dV {name:15s} alpha {alpha:.4f} "
                          f"rel {rel:.4f}", flush=True)
        return
    modes = {} if args.dk_only else {mode: functools.partial(modelled_backward, *m) for mode, m in MODES.items()}
    modes.update({mode: functools.partial(modelled_dk, flush) for mode, flush in DK_FLUSHES.items()})
    scale = 128**-0.5
    for seed in args.seeds:
        torch.manual_seed(seed)
        q, k, v, dout, offsets_q, offsets_k = make_inputs([1000, 0, 517, 2048, 129], [1100, 64, 517, 1500, 1], 8, 2,
                                                          128, dtype=torch.bfloat16, kind=args.kind)
        out, lse = forward_of(q, k, v, offsets_q, offsets_k, args.causal, scale)
        backward = (dout, q, k, v, out, lse, offsets_q, offsets_k)
        unmodified = reference.reference_backward(*backward, causal=args.causal, softmax_scale=scale)
        fp64 = exact_gradients(q, k, v, dout, offsets_q, offsets_k, args.causal, scale)
        for mode, modelled in modes.items():
            with modelled():
                grads = reference.reference_backward(*backward, causal=args.causal, softmax_scale=scale)
            errors = " ".join(f"{name} {rel_l2(g, r):.2e} (cosine {cosine(g, e) - cosine(r, e):+.1e})"
                              for name, g, r, e in zip(("dq", "dk", "dv"), grads, unmodified, fp64))
            print(f"{args.kind} causal={args.causal:d} seed {seed} {mode:15s} {errors}", flush=True)


if __name__ == "__main__":
    main()
