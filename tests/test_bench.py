"""scripts/bench.py on the CPU: workload lengths, visible-pair counts, selection, the table and the chart."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench.py")
spec = importlib.util.spec_from_file_location("bench", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def brute_force_pairs(len_q, len_k, causal):
    total = 0
    for lq, lk in zip(len_q.tolist(), len_k.tolist()):
        i = torch.arange(lq).unsqueeze(1)
        j = torch.arange(lk).unsqueeze(0)
        total += int((j <= i + lk - lq).sum()) if causal else lq * lk
    return total


@pytest.mark.parametrize("causal", [False, True])
def test_visible_pairs_closed_form_matches_brute_force(causal):
    g = torch.Generator().manual_seed(7)
    len_q = torch.cat([torch.tensor([0, 5, 1, 7, 0, 3]), torch.randint(0, 70, (40,), generator=g)])
    len_k = torch.cat([torch.tensor([4, 0, 1, 3, 0, 9]), torch.randint(0, 70, (40,), generator=g)])
    assert bench.visible_pairs(len_q, len_k, causal) == brute_force_pairs(len_q, len_k, causal)


def test_fa4_set_lengths():
    shapes = {s.name: s.lengths() for s in bench.WORKLOAD_SETS["fa4"]}
    for s in bench.WORKLOAD_SETS["fa4"]:  # fixed seeds: the same lengths every call
        assert all(torch.equal(a, b) for a, b in zip(s.lengths(), shapes[s.name]))
        assert s.dim in (64, 128) and s.heads_q % (s.heads_kv or s.heads_q) == 0
    len_q, len_k = shapes["dense 4x16k h16"]
    assert len_q.tolist() == [16384] * 4 and torch.equal(len_q, len_k)
    len_q, len_k = shapes["ragged pareto 200 h16"]
    assert len_q.numel() == 200 and torch.equal(len_q, len_k)
    assert int(len_q.min()) >= 1 and int(len_q.max()) == 16384 and 300 <= int(len_q.median()) <= 1000
    len_q, _ = shapes["llm gqa 32/8 lognormal"]
    assert len_q.numel() == 40 and 128 <= int(len_q.min()) and int(len_q.max()) <= 16384
    assert 2000 <= int(len_q.median()) <= 4000
    len_q, len_k = shapes["ads cross 512 h4"]
    assert len_q.numel() == 512 and 16 <= int(len_q.min()) and int(len_q.max()) <= 256
    assert 1000 <= int(len_k.min()) and int(len_k.max()) <= 3000
    len_q, len_k = shapes["tiny-query cross 2048 h8"]
    assert len_q.numel() == 2048 and 1 <= int(len_q.min()) and int(len_q.max()) <= 64
    assert 512 <= int(len_k.min()) and int(len_k.max()) <= 2048


def test_workload_on_cpu_with_gqa():
    spec_ = bench.Spec("tiny gqa", lambda: (torch.tensor([3, 0, 5]), torch.tensor([4, 2, 5])), 4, True, False,
                       heads_kv=2, dim=32)
    w = bench.Workload(*spec_[:5], spec_.dim, device="cpu", heads_kv=spec_.heads_kv)
    assert w.q.shape == (8, 4, 32) and w.k.shape == (11, 2, 32) and w.v.shape == (11, 2, 32)
    assert w.offsets_k.tolist() == [0, 4, 6, 11] and (w.max_q, w.max_k) == (5, 5)
    assert w.flops == 4.0 * brute_force_pairs(*spec_.lengths(), True) * 32 * 4


def test_select_by_name_or_index():
    specs = bench.WORKLOAD_SETS["fa4"]
    assert bench.select(specs, None) == specs
    chosen = bench.select(specs, ["7", "ads cross 512 h4"])
    assert [s.name for s in chosen] == ["dense 8x8k h16 d64", "ads cross 512 h4"]
    with pytest.raises(ValueError, match="unknown workloads"):
        bench.select(specs, ["8"])
    assert bench.parse_args(["--workloads", "0", "2"]).specs == [specs[0], specs[2]]


def test_table_falls_back_to_cudnn_then_varlen_without_fa4():
    rows = [
        dict(workload="dense", head_dim=128, tflops={"ours": 600.0, "cudnn sdpa": 500.0, "varlen_attn": 400.0}),
        dict(workload="ragged", head_dim=128, tflops={"ours": 300.0, "varlen_attn": 200.0, "ours bwd": 90.0}),
        dict(workload="both", head_dim=64, tflops={"ours": 300.0, "fa4": 600.0, "varlen_attn": 200.0}),
    ]
    lines = bench.table(rows, bench.FORWARD_COLUMNS, ["ours", "fast"]).splitlines()
    assert lines[0].split()[:6] == ["workload", "D", "ours", "fa4", "cudnn", "sdpa"]
    assert lines[2].split()[3:] == ["-", "500", "400", "1.20x", "-", "cudnn", "sdpa"]
    assert lines[3].split()[3:] == ["-", "-", "200", "1.50x", "-", "varlen_attn"]
    assert lines[4].split()[3:] == ["600", "-", "200", "0.50x", "-", "fa4"]
    backward = bench.table(rows, bench.GRADIENT_COLUMNS, ["ours", "fast"], " bwd").splitlines()
    assert backward[0].split() == ["workload", "D", "ours", "fa4", "ours/ref", "fast/ref", "ref"]
    assert backward[3].split() == ["ragged", "128", "90", "-", "-", "-", "-"]


def test_plot_reads_old_and_new_json(tmp_path):
    pytest.importorskip("matplotlib")
    docs = os.path.join(os.path.dirname(SCRIPT), "..", "docs", "bench")
    old = sorted(name for name in os.listdir(docs) if name.endswith(".json"))[0]
    with open(os.path.join(docs, old)) as f:
        bench.plot(json.load(f), tmp_path / "old.png")
    new = dict(gpu="H200", date="2026-12-01T00:00:00+00:00", version="abc src:0",
               rows=[dict(workload="w", head_dim=128, tflops={"ours": 1.0, "fa4": 2.0, "ours bwd": 1.0})])
    bench.plot(new, tmp_path / "new.png")
    assert (tmp_path / "old.png").stat().st_size and (tmp_path / "new.png").stat().st_size


def test_rounds_combine_to_each_columns_median_and_spread():
    """``--rounds``: a column's ms is the median of the passes that measured it, with its fastest and
    slowest pass; a column one pass lacks (a peer that failed once) keeps the others'."""
    rounds = [{"fast step": 57.8, "fa4 step": 53.6}, {"fast step": 65.2, "fa4 step": 53.9},
              {"fast step": 57.9}]
    ms, spread = bench.combined_rounds(rounds)
    assert ms == {"fast step": 57.9, "fa4 step": (53.6 + 53.9) / 2}
    assert spread == {"fast step": [57.8, 65.2], "fa4 step": [53.6, 53.9]}
    assert bench.parse_args(["--rounds", "3"]).rounds == 3 and bench.parse_args([]).rounds == 1
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])


def test_version_names_the_imported_package_not_the_checkout(tmp_path):
    """A copy of the package put first on ``PYTHONPATH`` (how two versions are timed side by side) is
    reported as a copy with its own source digest, equal to the checkout's for the same sources and
    different once a kernel file differs."""
    root = os.path.dirname(os.path.dirname(SCRIPT))
    copy = tmp_path / "copy"
    shutil.copytree(os.path.join(root, "jagged_attn"), copy / "jagged_attn",
                    ignore=shutil.ignore_patterns("__pycache__"))

    def version(path):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path), os.path.dirname(SCRIPT)]))
        return subprocess.run([sys.executable, "-P", "-c", "import bench; print(bench.git_version())"], env=env,
                              capture_output=True, text=True, check=True, cwd=tmp_path).stdout.split()

    digest = bench.git_version().split()[1]
    assert version(copy) == ["copy", digest]
    with open(copy / "jagged_attn" / "kernels" / "sm90" / "backward.py", "a") as source:
        source.write("\n# changed\n")
    changed = version(copy)
    assert changed[0] == "copy" and changed[1] != digest
