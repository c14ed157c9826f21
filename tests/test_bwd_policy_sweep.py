"""scripts/bwd_policy_sweep.py: the GPU accuracy policy's bars counted over many draws."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bwd_policy_sweep as sweep  # noqa: E402
from jagged_attn.quantize import quantize_mxfp8  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bwd_policy_sweep.py")


def test_summary_counts_misses_past_each_kinds_bars():
    """A ratio at the bar passes and one just past it misses; a cosine gap that outlier channels may have
    misses on any other kind."""
    bar, slack, outlier_gap = sweep.POLICY_GRADIENT_RATIO, sweep.COSINE_SLACK, sweep.OUTLIER_COSINE_GAP
    rows = [dict(kind=kind, causal=False, dq=(bar, 0.0), dk=(1.0, gap), dv=(bar + 1e-4, -1.0))
            for kind, gap in (("outlier", (slack + outlier_gap) / 2), ("heavy", (slack + outlier_gap) / 2),
                              ("heavy", slack))]
    summary = sweep.summarize(rows)
    assert summary[("outlier", False, "dk")]["cosine_misses"] == 0
    assert summary[("heavy", False, "dk")] == dict(draws=2, max_ratio=1.0, max_gap=(slack + outlier_gap) / 2,
                                                   ratio_misses=0, cosine_misses=1)
    assert summary[("heavy", False, "dq")]["ratio_misses"] == 0
    assert summary[("heavy", False, "dv")]["ratio_misses"] == 2
    assert summary[("outlier", False, "dv")]["ratio_misses"] == 1


@pytest.mark.parametrize("through", ["backward", "public"])
def test_sweep_runs_the_portable_backend_on_cpu(tmp_path, through):
    """One draw of Gaussian inputs on a tiny ragged batch through the script, the backward kernel alone or the
    public call: every gradient of the portable kernels within the bars, each (causal, gradient) counted
    once, the summary last."""
    out = tmp_path / "sweep.json"
    run = subprocess.run([sys.executable, SCRIPT, "--draws", "1", "--first", "3", "--kinds", "gaussian", "--through",
                          through, "--lengths-q", "33", "0", "1", "--lengths-k", "40", "7", "5", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr[-2000:]
    summary = run.stdout[run.stdout.rfind("\n== ") + 1:].splitlines()
    assert summary[0].startswith("== bwd_policy_sweep: portable (CPU)") and len(summary) == 2 + 6
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["through"] == through and len(result["rows"]) == 2
    assert {(s["causal"], s["gradient"]) for s in result["summary"]} == {(c, n) for c in (False, True)
                                                                         for n in sweep.GRADIENTS}
    for s in result["summary"]:
        assert s["draws"] == 1 and s["ratio_misses"] == 0 and s["cosine_misses"] == 0, s
        assert 0.9 < s["max_ratio"] < sweep.POLICY_GRADIENT_RATIO, s


def test_integer_grid_holds_small_integers_times_a_power_of_two_per_token_whose_dot_products_are_exact():
    """Every token's values are integers of at most GRID_BITS bits times one power of two (its largest near the
    top of the range), MXFP8 holds them exactly, and a float32 dot product of two grid rows equals the
    float64 one: no sum of their products needs more than float32's, or FP8 accumulation's, 13 bits past
    the units."""
    torch.manual_seed(0)
    x = torch.randn(300, 4, 128) * torch.exp(2 * torch.randn(300, 4, 1))
    x[:, :, [3, 77]] *= 30.0
    grid = sweep.on_integer_grid(x)
    unit = torch.exp2(torch.ceil(torch.log2(x.abs().amax(-1, keepdim=True))) - sweep.GRID_BITS)
    units = grid / unit
    assert torch.equal(units, units.round()) and units.abs().max() <= 2**sweep.GRID_BITS - 1
    assert (units.abs().amax(-1) >= 2 ** (sweep.GRID_BITS - 1)).all()  # each token's largest near the top
    offsets = torch.tensor([0, 100, 300])
    assert torch.equal(quantize_mxfp8(grid, offsets, axis="feature").dequantize(), grid)
    a, b = units[:150].flatten(0, 1), units[150:].flatten(0, 1)
    assert torch.equal((a @ b.T).double(), a.double() @ b.double().T)
    assert (a @ b.T).abs().max() < 2**13
