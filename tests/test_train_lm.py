"""scripts/train_lm.py on CPU: a few steps of a tiny model with the reference backend."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import train_bar  # noqa: E402
import train_lm  # noqa: E402


def test_packed_batches_keep_documents_whole_and_in_one_order():
    docs = [bytes([i + 1]) * (5 + 3 * i) for i in range(10)]
    batches = train_lm.packed_batches(docs, 20, seed=3)
    again = train_lm.packed_batches(docs, 20, seed=3)
    assert len(batches) == len(again) and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                              for a, b in zip(batches, again))
    seen = []
    for tokens, offsets in batches:
        assert int(offsets[-1]) == tokens.numel() and (int(offsets[-1]) <= 20 or offsets.numel() == 2)
        seen += [bytes(tokens[a:b].tolist()) for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    assert sorted(seen) == sorted(docs)  # every document once, whole


def test_the_sources_corpus_is_modules_and_hand_written_torch_sources_without_generated_files():
    files = train_lm.corpus_files("sources")
    torch_root = os.path.dirname(torch.__file__)
    stdlib = [f for f in files if not f.startswith(torch_root + os.sep)]
    assert stdlib and files[:len(stdlib)] == stdlib and stdlib == sorted(stdlib)  # the modules, then torch's
    assert not any(part in train_lm.NOT_SOURCES for f in stdlib for part in f.split(os.sep))
    headers = [f for f in files if f.startswith(torch_root + os.sep) and f.endswith(".h")]
    assert headers and any(f.endswith(".py") for f in files[len(stdlib):])
    generated = next(f for f in headers if train_lm.GENERATED in open(f, "rb").read(2048))
    limit = files.index(generated) + 1
    train, validation = train_lm.documents("sources", 4096, limit)
    with open(generated, "rb") as f:
        assert f.read(4096) not in train + validation
    texts = [open(f, "rb").read(4096) for f in files[:limit]]
    kept = [(i, t) for i, t in enumerate(texts) if len(t) >= 2 and train_lm.GENERATED not in t[:2048]]
    assert validation == [t for i, t in kept if i % 20 == 10] and train == [t for i, t in kept if i % 20 != 10]
    assert len(kept) < len(texts)  # the generated header at least


def test_next_byte_loss_never_predicts_across_documents():
    """A model whose logits at each byte name the next byte of the same document has zero loss on
    every byte it predicts, so the first byte of each document (unpredictable) must be left out."""
    tokens = torch.tensor([7, 8, 9, 1, 2, 200, 201, 202, 203])
    offsets = torch.tensor([0, 3, 5, 9])

    class Oracle(torch.nn.Module):
        def forward(self, tokens, offsets, attend):
            nxt = torch.roll(tokens, -1)
            return torch.nn.functional.one_hot(nxt, 256).float() * 100.0

    assert float(train_lm.next_byte_loss(Oracle(), tokens, offsets, None)) < 1e-6


def test_a_few_steps_lower_the_loss(tmp_path):
    runs = train_lm.main(["--attn", "reference", "--steps", "16", "--layers", "1", "--dim", "64", "--heads", "2",
                          "--kv-heads", "1", "--head-dim", "32", "--batch-tokens", "1024", "--max-doc", "256",
                          "--max-files", "60", "--val-batches", "1", "--log-every", "1", "--lr", "1e-2",
                          "--device", "cpu", "--out", str(tmp_path)])
    (run,) = runs
    losses = [loss for _, loss in run["train_log"]]
    assert all(math.isfinite(x) for x in losses) and math.isfinite(run["validation_loss"])
    assert abs(losses[0] - math.log(256)) < 0.3  # a uniform guess at the start
    assert min(losses[-4:]) < losses[0] - 1.0
    saved = json.loads((tmp_path / "train_lm.json").read_text())
    assert saved["runs"][0]["validation_loss"] == run["validation_loss"]
    assert "src:" in saved["version"]
    assert saved["data"]["passes"] == 16 / saved["data"]["train_batches"] and saved["data"]["validation_bytes"] <= 1024


def test_summarize_pools_runs_of_one_configuration_and_seed_and_gives_the_difference_from_bf16(tmp_path, capsys):
    """``--summarize``: runs of one configuration and seed pool (whatever process or file they came from),
    another seed or ``--qk-norm`` is another group, the seeds of one configuration are then paired (the mean of
    each seed's difference from BF16, and its standard error), an older JSON's option that was off (``center_kv``) or a
    JSON without a version joins as the current script would have run it, a JSON from before ``--corpus``
    is a group of the corpus it ran on, our runs of other code are another row, the BF16 peers pool into
    one mean that each of ours is compared with, and a group says what its runs trained on where saved."""
    args = vars(train_lm.parse_args([]))

    def saved(name, runs, version="v1 src:aaaa", **changes):
        content = dict(title="t", args=dict(args, **changes), runs=[dict(attn=a, validation_loss=x) for a, x in runs])
        if version is not None:
            content["version"] = version
        (tmp_path / name).write_text(json.dumps(content))
        return str(tmp_path / name)

    files = [saved("a.json", [("hopper", 1.00), ("varlen", 1.03)]),
             saved("b.json", [("hopper", 1.02), ("fa4", 1.01)], version="v2-dirty src:aaaa", center_kv=False),
             saved("c.json", [("varlen", 1.02)], version=None),
             saved("d.json", [("hopper", 1.50)], version="v0 src:bbbb"),
             saved("e.json", [("hopper", 2.00), ("varlen", 2.10)], seed=1),
             saved("f.json", [("hopper", 3.00)], qk_norm=True),
             saved("g.json", [("hopper", 4.00), ("varlen", 4.10)], version="v3 src:aaaa")]
    with_data = json.loads((tmp_path / "f.json").read_text())
    with_data["data"] = dict(passes=1.4, train_bytes=22.9e6, validation_bytes=1.25e6)
    (tmp_path / "f.json").write_text(json.dumps(with_data))
    stdlib_run = json.loads((tmp_path / "g.json").read_text())
    del stdlib_run["args"]["corpus"]  # saved before --corpus existed: the standard library's text
    (tmp_path / "g.json").write_text(json.dumps(stdlib_run))
    train_lm.main(["--summarize", *files])
    text = capsys.readouterr().out
    groups = {block.splitlines()[0]: block for block in text.split("\n== ")[1:]}
    assert set(groups) == {"no QK-norm, seed 0", "no QK-norm, seed 1", "QK-norm, seed 0",
                           "no QK-norm, seed 0, corpus stdlib", "no QK-norm, seeds paired"}
    assert "hopper src:aaaa - BF16: -0.1000" in groups["no QK-norm, seed 0, corpus stdlib"]
    seed0 = groups["no QK-norm, seed 0"]
    rows = {line[:24].strip(): line[24:].split()[:3] for line in seed0.splitlines()[2:] if " - BF16" not in line}
    assert rows["hopper src:aaaa"] == ["2", "1.0100", "0.0141"]
    assert rows["hopper src:bbbb"] == ["1", "1.5000", "-"]
    assert rows["BF16 (varlen, fa4)"] == ["3", "1.0200", "0.0100"]
    error = math.sqrt(0.02**2 / 2 / 2 + 0.01**2 / 3)
    assert f"hopper src:aaaa - BF16: -0.0100 (standard error {error:.4f})" in seed0
    assert "hopper src:bbbb - BF16: +0.4800 (standard error -)" in seed0
    assert "hopper src:aaaa - BF16: -0.1000 (standard error -)" in groups["no QK-norm, seed 1"]
    paired = groups["no QK-norm, seeds paired"].splitlines()[1:]  # only code that ran with both seeds
    error = statistics.stdev([-0.01, -0.10]) / math.sqrt(2)
    assert paired == [f"hopper src:aaaa - BF16 over 2 seeds: -0.0550 (standard error {error:.4f}; "
                      "per seed 0: -0.0100, 1: -0.1000)"]
    assert "BF16" not in groups["QK-norm, seed 0"]  # no peer ran there: nothing to compare with
    trained_on = groups["QK-norm, seed 0"].splitlines()[1]
    assert trained_on == "1.4 passes over 22.9 MB of training text, validation on 1.25 MB"


def test_summarize_pools_our_runs_of_every_code_version_when_asked(tmp_path, capsys):
    """``--pool-code``: our runs of different code digests are one row (``src:*``), compared with BF16 and
    paired over the seeds as one attention; the BF16 peers are as without it."""
    args = vars(train_lm.parse_args([]))
    runs = [(0, "v1 src:aaaa", dict(hopper=1.00, varlen=1.04)), (0, "v2 src:bbbb", dict(hopper=1.02)),
            (1, "v2 src:bbbb", dict(hopper=2.00, varlen=2.10))]
    files = []
    for i, (seed, version, losses) in enumerate(runs):
        content = dict(title="t", args=dict(args, seed=seed), version=version,
                       runs=[dict(attn=a, validation_loss=x) for a, x in losses.items()])
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(content))
    train_lm.main(["--summarize", *map(str, files), "--pool-code"])
    groups = {block.splitlines()[0]: block for block in capsys.readouterr().out.split("\n== ")[1:]}
    seed0 = groups["no QK-norm, seed 0"]
    assert "src:aaaa" not in seed0 and "src:bbbb" not in seed0
    rows = {line[:24].strip(): line[24:].split()[:2] for line in seed0.splitlines()[2:] if " - BF16" not in line}
    assert rows["hopper src:*"] == ["2", "1.0100"]
    paired = groups["no QK-norm, seeds paired"].splitlines()[1:]
    error = statistics.stdev([-0.03, -0.10]) / math.sqrt(2)
    assert paired == [f"hopper src:* - BF16 over 2 seeds: -0.0650 (standard error {error:.4f}; "
                      "per seed 0: -0.0300, 1: -0.1000)"]


def test_summarize_pairs_the_two_bf16_peers_where_both_ran(tmp_path, capsys):
    """Where FA4 and ``varlen_attn`` both ran a seed, their difference is the check's BF16-against-BF16
    control, printed per seed and paired over the seeds; ours is still compared with both pooled."""
    args = vars(train_lm.parse_args([]))
    losses = {0: dict(hopper=1.00, varlen=1.04, fa4=1.01), 1: dict(hopper=2.00, varlen=2.00, fa4=2.05),
              2: dict(hopper=3.00, varlen=3.10)}
    files = []
    for seed, runs in losses.items():
        content = dict(title="t", args=dict(args, seed=seed), version="v1 src:aaaa",
                       runs=[dict(attn=a, validation_loss=x) for a, x in runs.items()])
        files.append(tmp_path / f"{seed}.json")
        files[-1].write_text(json.dumps(content))
    train_lm.main(["--summarize", *map(str, files)])
    groups = {block.splitlines()[0]: block for block in capsys.readouterr().out.split("\n== ")[1:]}
    assert "fa4 - varlen (BF16 against BF16): -0.0300" in groups["no QK-norm, seed 0"]
    assert "BF16 against BF16" not in groups["no QK-norm, seed 2"]  # FA4 did not run there
    paired = groups["no QK-norm, seeds paired"].splitlines()[1:]
    error = statistics.stdev([-0.03, 0.05]) / math.sqrt(2)
    assert f"fa4 - varlen (BF16 against BF16) over 2 seeds: +0.0100 (standard error {error:.4f}; " \
           "per seed 0: -0.0300, 1: +0.0500)" in paired
    ours = statistics.stdev([1.00 - 1.025, 2.00 - 2.025, -0.10]) / math.sqrt(3)
    assert f"hopper src:aaaa - BF16 over 3 seeds: -0.0500 (standard error {ours:.4f}; " \
           "per seed 0: -0.0250, 1: -0.0250, 2: -0.1000)" in paired


def test_hybrid_attention_takes_its_output_from_one_attention_and_the_named_gradients_from_the_other():
    def plain(q, k, v, offsets, max_len):
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    def scaled(q, k, v, offsets, max_len):  # every input's gradient 3x plain's, its output too
        return 3 * plain(q, k, v, offsets, max_len)

    q, k, v = (torch.randn(4, 5, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(4, 5, 8, dtype=torch.float64)
    expected = torch.autograd.grad(plain(q, k, v, None, 5), (q, k, v), grad_out)
    for grads in ("qkv", "q", "kv"):
        out = train_lm.hybrid_attention(plain, scaled, grads)(q, k, v, None, 5)
        assert torch.allclose(out, plain(q, k, v, None, 5))
        got = torch.autograd.grad(out, (q, k, v), grad_out)
        for name, g, e in zip("qkv", got, expected):
            assert torch.allclose(g, 3 * e if name in grads else e), (grads, name)


def test_attention_choices_parse_hybrids_and_backend_options():
    assert callable(train_lm.attention_function("reference+c+d"))
    assert callable(train_lm.attention_function("reference/reference:q"))
    for bad in ("reference+x", "nothing", "reference/reference:w"):
        try:
            train_lm.attention_function(bad)
        except SystemExit:
            continue
        raise AssertionError(bad)


def test_run_all_keeps_its_parallelism_reports_failures_and_starts_nothing_past_its_budget(tmp_path):
    """Each run in its own process, at most ``parallel`` at once, its exit code reported (a failed run does
    not stop the others); past the budget (time so far plus the longest run) nothing more starts."""
    sleep = [sys.executable, "-c", "import time; time.sleep(1.0)"]
    runs = [train_bar.Run(f"r{i}", sleep, str(tmp_path / f"r{i}.log")) for i in range(4)]
    runs.insert(1, train_bar.Run("fails", [sys.executable, "-c", "raise SystemExit(3)"], str(tmp_path / "f.log")))
    start = time.monotonic()
    codes = train_bar.run_all(runs, parallel=2)
    took = time.monotonic() - start
    assert codes == {"r0": 0, "fails": 3, "r1": 0, "r2": 0, "r3": 0}
    assert 2.0 <= took < 3.6  # four sleeps two at a time (one after another: 4 s)
    codes = train_bar.run_all(runs[2:], parallel=1, budget=1.5)
    assert codes == {"r1": 0, "r2": None, "r3": None}  # 1 s so far + 1 s a run would pass 1.5 s


def test_bar_runs_go_seed_by_seed_and_name_one_folder_each(tmp_path):
    runs = train_bar.bar_runs(["hopper", "varlen/hopper:q"], [3, 4], str(tmp_path), ["--steps", "7"])
    assert [run.name for run in runs[:4]] == ["no-qk-seed3-hopper", "no-qk-seed3-varlen_hopper_q",
                                              "qk-seed3-hopper", "qk-seed3-varlen_hopper_q"]
    assert len(runs) == 8 and all(os.path.dirname(run.log) == str(tmp_path) for run in runs)
    argv = runs[3].argv
    assert argv[argv.index("--attn") + 1] == "varlen/hopper:q" and "--qk-norm" in argv and argv[-2:] == ["--steps", "7"]
    assert argv[argv.index("--out") + 1] == str(tmp_path / "qk-seed3-varlen_hopper_q")
    only_qk = train_bar.bar_runs(["hopper"], [3, 4], str(tmp_path), qk_norm="on")
    assert [run.name for run in only_qk] == ["qk-seed3-hopper", "qk-seed4-hopper"]
    assert all("--qk-norm" in run.argv for run in only_qk)
    without = train_bar.bar_runs(["hopper"], [3], str(tmp_path), qk_norm="off")
    assert [run.name for run in without] == ["no-qk-seed3-hopper"] and "--qk-norm" not in without[0].argv


def test_train_bar_runs_each_seed_with_and_without_qk_norm_and_summarizes_them(tmp_path, capsys):
    tiny = ["--steps", "2", "--layers", "1", "--dim", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
            "--batch-tokens", "1024", "--max-doc", "256", "--max-files", "60", "--val-batches", "1"]
    code = train_bar.main(["--attn", "reference", "--seeds", "5", "--parallel", "2", "--out", str(tmp_path), "--",
                           *tiny])
    assert code == 0
    for qk in (False, True):
        with open(tmp_path / f"{'qk' if qk else 'no-qk'}-seed5-reference" / "train_lm.json") as f:
            result = json.load(f)
        assert result["args"]["seed"] == 5 and result["args"]["qk_norm"] == qk and result["args"]["steps"] == 2
        assert [run["attn"] for run in result["runs"]] == ["reference"]
    printed = capsys.readouterr().out
    assert "== no QK-norm, seed 5" in printed and "== QK-norm, seed 5" in printed
