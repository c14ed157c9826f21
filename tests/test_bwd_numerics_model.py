"""scripts/bwd_numerics_model.py's model of how the Gluon backward sums dK and dV over its steps."""

from __future__ import annotations

import os
import sys

import torch

from jagged_attn.reference import reduce_kv

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bwd_numerics_model as model  # noqa: E402


def test_chained_dk_is_the_group_sum_when_nothing_is_truncated():
    """Small integers: every chunk sum and running sum fits the modelled 13 bits, so every flush rule gives
    the exact product, summed over each KV head's query heads."""
    heads, len_q, len_k, dim = 2 * model.GROUP, 3 * model.DS_TILE + 5, 70, 16
    ds = torch.randint(-3, 4, (heads, len_q, len_k)).double()
    q = torch.randint(-3, 4, (len_q, heads, dim)).double()
    want = reduce_kv(torch.einsum(model.KEY_PRODUCT, ds, q), heads // model.GROUP)
    for flush in model.DK_FLUSHES.values():
        assert torch.equal(reduce_kv(model.chained_key_product(ds, q, flush), heads // model.GROUP), want), flush


def test_chaining_truncates_small_steps_against_a_large_sum():
    """One large first step, then many small ones: chained into one accumulator the small steps lose their
    low bits against the large sum; flushed every step they are added exactly."""
    heads, steps, len_k, dim = model.GROUP, 16, 64, 8
    len_q = steps * model.DS_TILE
    ds = torch.full((heads, len_q, len_k), 1.0 + 2**-10, dtype=torch.float64)
    ds[0, :model.DS_TILE] = 2.0**12
    q = torch.ones(len_q, heads, dim, dtype=torch.float64)
    exact = torch.einsum(model.KEY_PRODUCT, ds, q).sum(1)
    errors = {flush: float((model.chained_key_product(ds, q, flush)[:, 0] - exact).abs().max() / exact.abs().max())
              for flush in (1, None)}
    assert errors[1] < 1e-6 < errors[None], errors


def test_chained_dv_shrinks_on_flat_causal_attention():
    """An FP8 wgmma chain of dV over every step (the kernel's dV before its fp16 wgmma) on flat causal
    attention (a QK-norm model's): each add truncates the running sum towards zero, so dV comes out
    smaller than when each step's sum is added exactly, while rel-L2 barely moves. (Per-step sums keep
    the in-step chunks' truncation: their factor is 0.997-1.000 over draws, chained 0.0027-0.0029 below.)"""
    drift = model.dv_drift(1024, 1.0, seed=1)
    (fresh_alpha, fresh_rel), (chained_alpha, chained_rel) = drift["fresh per step"], drift["chained"]
    assert chained_alpha < fresh_alpha - 2e-3 and fresh_alpha > 0.995, drift
    assert abs(chained_rel - fresh_rel) < 0.005 and fresh_rel < 0.05, drift
