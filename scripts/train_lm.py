"""Training check: a small byte-level causal LM trained with each attention choice on the same data.

The text is what every machine has without a download (``--corpus sources``): the Python standard
library's modules and torch's own hand-written sources (Python and C++ headers), one document per file
(every 20th for validation), cut to ``--max-doc`` bytes. With Python 3.11 and torch 2.13 that is 22.9 MB
of training text, median document 4.3 KB, so 500 steps of 64k bytes see each document 1.4 times (the run
prints its own counts and saves them in its JSON). The earlier corpus, ``--corpus stdlib``, was the
standard library alone: 3.1 MB on the GPU machine, i.e. ten passes over the same 50 batches in 500
steps, after which the validation loss (29 documents) sat 0.08-0.12 nats above the last batch's
training loss: a model memorizing its batches more than learning the text. Documents are packed,
in one fixed shuffled order, into jagged batches of about ``--batch-tokens`` bytes (the offsets mark
the documents: attention never crosses one). The model: byte embedding, ``--layers`` blocks of
[RMSNorm, attention with RoPE (GQA, head_dim 128 by default, optional QK RMSNorm), RMSNorm, SwiGLU
MLP], tied output head; AdamW with warm-up and cosine decay, float32 weights, bf16 matmuls on CUDA.
Every ``--attn`` choice starts from the same initial weights and sees the same batches:

* one of our backends (``hopper``, ``hopper-exact-scores``, ``block-scaled``, ``reference``): ``jagged_attention``
  (with a ``+c`` suffix, e.g. ``hopper+c``: K and V quantized as offsets from their per-sequence means; ``+d``:
  the deterministic backward);
* ``varlen``: torch ``varlen_attn`` in bf16 (FlashAttention-2);
* ``fa4``: FlashAttention-4's ``flash_attn_varlen_func`` in bf16, where it imports;
* ``FWD/BWD[:GRADS]``: a diagnostic hybrid, FWD's output with BWD's gradients (all, or those of the
  inputs in GRADS, e.g. ``varlen/hopper:q``: dQ from ``hopper``, dK and dV from ``varlen``).

    python3 scripts/train_lm.py --attn hopper hopper+c fa4 [--qk-norm] [--steps 500] --out OUT_DIR

Prints the loss table (train loss, validation loss, median step time) last, writes ``train_lm.json``
(with the code's version, as ``bench.py`` names it) and, with matplotlib, ``train_lm.png`` (loss curves).

Every attention adds its gradients in an order that varies from run to run (dQ by atomics or reduce-adds),
so two runs of one configuration part within a few dozen steps; on the ``stdlib`` corpus they ended up
to ~0.03 nats apart, and one run a side could not hold a 0.01-nat comparison. ``--summarize`` reads the
JSONs of several runs (separate processes, separate device calls) and prints, per configuration and seed,
each attention's mean and spread and its difference from the BF16 peers' pooled mean, with that
difference's standard error; then, where a configuration ran with several seeds (``--seed``: other initial
weights and another data order), the seeds paired: each seed's difference, their mean and its standard error:

    python3 scripts/train_lm.py --summarize docs/train/*.json [--pool-code]

(``--pool-code``: our runs of every code version in one row, for versions whose kernels compute alike.)
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch import nn

import jagged_attn as ja
from bench import fa4_attention, fa4_import, git_version, varlen_causal_kwargs
from jagged_attn.backends import BACKENDS
from jagged_attn.offsets import offsets_from_lengths

BF16_PEERS = ("varlen", "fa4")
ROPE_BASE = 10000.0


CORPORA = ("sources", "stdlib")
SOURCE_SUFFIXES = (".py", ".h", ".hpp", ".cuh")  # torch's Python and its C++ / CUDA headers
NOT_SOURCES = ("test", "tests", "idlelib", "site-packages", "dist-packages")  # test suites, a GUI, installed packages
GENERATED = b"@generated"  # torchgen's mark, near the top of a generated file (7k near-identical op headers)
GENERATED_WITHIN = 2048  # bytes of a file searched for it, whatever --max-doc keeps


def _files(root: str, suffixes: tuple[str, ...], skip: tuple[str, ...] = ()) -> list[str]:
    """The files under ``root`` ending in one of ``suffixes``, sorted by path, folders named in ``skip`` left out."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in skip]
        found += [os.path.join(folder, name) for name in names if name.endswith(suffixes)]
    return sorted(found)


def corpus_files(corpus: str) -> list[str]:
    """The files of ``corpus`` in their fixed order: ``sources``, the standard library's ``.py`` modules
    (``NOT_SOURCES`` left out) then torch's ``SOURCE_SUFFIXES`` files; ``stdlib``, every ``.py`` file under
    the standard library's folder (on some machines the installed packages live there too)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    if corpus == "stdlib":
        return _files(stdlib, (".py",))
    return _files(stdlib, (".py",), NOT_SOURCES) + _files(os.path.dirname(torch.__file__), SOURCE_SUFFIXES)


def documents(corpus: str, max_doc: int, limit: int | None = None) -> tuple[list[bytes], list[bytes]]:
    """(train, validation) byte documents: the first ``limit`` files of :func:`corpus_files`, each cut to
    ``max_doc`` bytes; every 20th file goes to validation. Files of fewer than 2 bytes, and in ``sources``
    generated ones (``GENERATED`` in their first ``GENERATED_WITHIN`` bytes), are left out."""
    train, validation = [], []
    for index, path in enumerate(corpus_files(corpus)[:limit]):
        with open(path, "rb") as source:
            head = source.read(max(max_doc, GENERATED_WITHIN))
        text = head[:max_doc]
        if len(text) < 2 or (corpus == "sources" and GENERATED in head[:GENERATED_WITHIN]):
            continue
        (validation if index % 20 == 10 else train).append(text)
    return train, validation


def packed_batches(docs: list[bytes], batch_tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The documents in one shuffled order, packed into (bytes ``[total]`` int64, offsets ``[B+1]``)
    batches of at most ``batch_tokens`` bytes (a longer document alone)."""
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    batches, current, size = [], [], 0
    for index in order:
        if current and size + len(docs[index]) > batch_tokens:
            batches.append(current)
            current, size = [], 0
        current.append(docs[index])
        size += len(docs[index])
    if current:
        batches.append(current)
    return [(torch.frombuffer(bytearray(b"".join(batch)), dtype=torch.uint8).long(),
             offsets_from_lengths(torch.tensor([len(doc) for doc in batch]))) for batch in batches]


def attention_function(name: str):
    """``attend(q, k, v, offsets, max_len) -> out`` (causal, ``[total, heads, head_dim]``) of an
    ``--attn`` choice: a backend of ours (``+c``: ``center_kv=True``, ``+d``: ``deterministic=True``), a
    BF16 peer, or ``FWD/BWD[:GRADS]``, a diagnostic hybrid (``hybrid_attention``)."""
    if "/" in name:
        forward_name, _, backward_name = name.partition("/")
        backward_name, _, grads = backward_name.partition(":")
        return hybrid_attention(attention_function(forward_name), attention_function(backward_name), grads or "qkv")
    backend, *options = name.split("+")
    if backend in BACKENDS and set(options) <= {"c", "d"}:
        center, deterministic = "c" in options, "d" in options
        return lambda q, k, v, offsets, max_len: ja.jagged_attention(
            q, k, v, offsets, causal=True, backend=backend, center_kv=center, deterministic=deterministic)
    if name == "varlen":
        from torch.nn.attention.varlen import varlen_attn

        options = varlen_causal_kwargs(True)
        native_gqa = "enable_gqa" in inspect.signature(varlen_attn).parameters

        def attend(q, k, v, offsets, max_len):
            if k.shape[1] != q.shape[1]:
                if native_gqa:
                    return varlen_attn(q, k, v, offsets, offsets, max_len, max_len, enable_gqa=True, **options)
                k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
            return varlen_attn(q, k, v, offsets, offsets, max_len, max_len, **options)

        return attend
    if name == "fa4":
        fa4, why = fa4_import()
        if fa4 is None:
            raise SystemExit(f"--attn fa4: FlashAttention-4 does not import here ({why})")
        return lambda q, k, v, offsets, max_len: fa4_attention(fa4, q, k, v, offsets, offsets, max_len, max_len, True)
    raise SystemExit(f"--attn must be one of {(*BACKENDS, *BF16_PEERS)} (backends with +c / +d) or FWD/BWD[:GRADS], "
                     f"got {name!r}")


def hybrid_attention(forward_attend, backward_attend, grads: str):
    """``attend`` whose output is ``forward_attend``'s and whose gradients for the inputs named in
    ``grads`` (a subset of "qkv") are ``backward_attend``'s, each recomputed under autograd in the
    backward from the saved inputs (the others are ``forward_attend``'s own). A diagnostic: which half
    of an attention, or which of its gradients, a training difference comes from."""
    if not grads or not set(grads) <= set("qkv"):
        raise SystemExit(f"GRADS must be a subset of 'qkv', got {grads!r}")

    def input_gradients(attend, q, k, v, offsets, max_len, grad_out):
        with torch.enable_grad():
            inputs = [x.detach().requires_grad_() for x in (q, k, v)]
            return torch.autograd.grad(attend(*inputs, offsets, max_len), inputs, grad_out)

    class Hybrid(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, offsets, max_len):
            ctx.save_for_backward(q, k, v, offsets)
            ctx.max_len = max_len
            return forward_attend(q, k, v, offsets, max_len)

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v, offsets = ctx.saved_tensors
            chosen = input_gradients(backward_attend, q, k, v, offsets, ctx.max_len, grad_out)
            own = chosen if grads == "qkv" else input_gradients(forward_attend, q, k, v, offsets, ctx.max_len, grad_out)
            return (*(c if x in grads else o for x, c, o in zip("qkv", chosen, own)), None, None)

    return Hybrid.apply


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x [total, heads, head_dim]`` at each token's position in its document."""
    half = x.shape[-1] // 2
    frequencies = ROPE_BASE ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions[:, None, None].float() * frequencies
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, qk_norm: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.out = nn.Linear(heads * head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(head_dim) if qk_norm else nn.Identity()
        hidden = 256 * math.ceil(8 * dim / 3 / 256)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, positions, offsets, max_len, attend):
        q, k, v = self.qkv(self.attn_norm(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = rope(self.q_norm(q.unflatten(-1, (self.heads, self.head_dim))), positions)
        k = rope(self.k_norm(k.unflatten(-1, (self.kv_heads, self.head_dim))), positions)
        v = v.unflatten(-1, (self.kv_heads, self.head_dim))
        # Under autocast the norms give float32 and the projections bf16: the attention gets bf16 throughout.
        x = x + self.out(attend(q.to(v.dtype), k.to(v.dtype), v, offsets, max_len).flatten(1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class ByteLM(nn.Module):
    def __init__(self, dim, layers, heads, kv_heads, head_dim, qk_norm):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, head_dim, qk_norm) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        # GPT-2's initialization: logits near zero at the start (loss ln 256), residual branches scaled
        # down with depth. (PyTorch's defaults, N(0, 1) embeddings tied to the head, start at ~800.)
        for name, parameter in self.named_parameters():
            if parameter.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("out.weight", "down.weight")) else 0.02
                nn.init.normal_(parameter, std=std)

    def forward(self, tokens, offsets, attend):
        """Next-byte logits ``[total, 256]`` of each document's bytes."""
        offsets = offsets.to(torch.int32)  # cu_seqlens, as the BF16 peers take them
        lengths = offsets.diff()
        positions = torch.arange(tokens.shape[0], device=tokens.device) - offsets[:-1].repeat_interleave(lengths)
        max_len = int(lengths.max())
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions, offsets, max_len, attend)
        return self.norm(x) @ self.embed.weight.t()


def next_byte_loss(model, tokens, offsets, attend) -> torch.Tensor:
    """Mean cross entropy of each byte but a document's first, predicted from the bytes before it."""
    logits = model(tokens, offsets, attend)
    first = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    first[offsets[:-1][offsets.diff() > 0]] = True
    predicted = ~first  # byte t is predicted at t - 1, inside its document
    return F.cross_entropy(logits[:-1][predicted[1:]].float(), tokens[1:][predicted[1:]])


def autocast_for(device):
    """float32 weights and optimizer state; on CUDA the matmuls in bf16."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def training_setup(args, device):
    """(model, optimizer, schedule) from ``--seed``: the same initial weights for every attention choice."""
    torch.manual_seed(args.seed)
    model = ByteLM(args.dim, args.layers, args.heads, args.kv_heads, args.head_dim, args.qk_norm).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, args.steps - warmup))))))
    return model, optimizer, schedule


def training_step(model, optimizer, schedule, batch, attend, device) -> torch.Tensor:
    """One AdamW step on ``batch`` (tokens, offsets), gradients clipped to norm 1; returns the loss."""
    tokens, offsets = (x.to(device) for x in batch)
    with autocast_for(device):
        loss = next_byte_loss(model, tokens, offsets, attend)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    return loss.detach()


def train(attn: str, args, train_batches, val_batches, device) -> dict:
    """One run: losses every ``--log-every`` steps, final validation loss, median step time."""
    model, optimizer, schedule = training_setup(args, device)
    autocast = autocast_for(device)
    attend = attention_function(attn)
    log, times = [], []
    for step in range(args.steps):
        batch = [x.to(device) for x in train_batches[step % len(train_batches)]]  # the copy is not timed
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = training_step(model, optimizer, schedule, batch, attend, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if step % args.log_every == 0 or step == args.steps - 1:
            log.append((step, float(loss)))
            print(f"[{attn}] step {step:5d} loss {log[-1][1]:.4f}", flush=True)
    model.eval()
    with torch.no_grad(), autocast:
        losses = [(float(next_byte_loss(model, t.to(device), o.to(device), attend)), int(o[-1]))
                  for t, o in val_batches]
    validation = sum(loss * n for loss, n in losses) / sum(n for _, n in losses)
    step_ms = 1e3 * statistics.median(times[min(len(times) - 1, 5):])  # past compiles
    return dict(attn=attn, train_log=log, validation_loss=validation, step_ms=step_ms)


def plot(runs, path, title):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axis = plt.subplots(figsize=(8, 5))
    for run in runs:
        steps, losses = zip(*run["train_log"])
        axis.plot(steps, losses, label=f"{run['attn']} (val {run['validation_loss']:.4f})")
    axis.set(xlabel="step", ylabel="train loss (nats / byte)", title=title)
    axis.legend()
    figure.savefig(path, dpi=110, bbox_inches="tight")


# Arguments that do not change what a run computes: runs differing only in these are one configuration.
NOT_CONFIGURATION = ("attn", "out", "device", "log_every", "summarize")


# Options added since runs were saved, with what the runs saved before them ran as.
BEFORE_OPTION = {"corpus": "stdlib"}


def configuration(args: dict, defaults: dict) -> dict:
    """What a run's saved ``args`` say it computed, for grouping runs: without ``NOT_CONFIGURATION``,
    with ``BEFORE_OPTION``'s values where the run predates an option, and without the options of older
    versions of this script (not in ``defaults``, the current arguments' defaults) that are off (falsy),
    which then ran as the current script does."""
    args = {**BEFORE_OPTION, **args}
    return {k: v for k, v in sorted(args.items()) if k not in NOT_CONFIGURATION and (k in defaults or v)}


def summary(results: list[dict], pool_code: bool = False) -> str:
    """The ``--summarize`` table of ``train_lm.json`` contents ``results``: their runs grouped by
    :func:`configuration` (the seed included), then by attention, ours also by the digest of the code that ran
    (the JSON's ``version``: runs of other code are other rows; with ``pool_code`` one row, ``src:*``, for runs
    of versions whose kernels compute alike, as a record of them must then say). Per attention the runs' count,
    mean validation loss and sample standard deviation; per attention other than the BF16 peers (``BF16_PEERS``,
    pooled) its mean less theirs, with the difference's standard error sqrt(s1^2 / n1 + s2^2 / n2) where both
    sides have two runs or more. Under a group's title, what its runs trained on (passes over how much text: the
    JSONs' ``data``, where they have it).

    Then, per configuration run with two seeds or more, the seeds paired: for each of ours, its difference
    from BF16 in every seed where both ran, their mean and its standard error (the per-seed differences'
    sample standard deviation over the square root of their count). A seed fixes the initial weights and
    the data order, so this difference is the one that holds for other draws of both, not only for the
    run-to-run spread of one. Where both BF16 peers ran, the same for FA4 less ``varlen_attn``: two BF16
    attentions, whose difference is how far numerics alone move this check."""
    defaults = vars(parse_args([]))
    # (QK-norm or not, the other options off their defaults) -> seed -> attention -> validation losses
    groups: dict[tuple[str, str], dict[int, dict[str, list[float]]]] = {}
    data: dict[tuple[str, str], set[str]] = {}  # per configuration, what its runs trained on, where their JSONs say
    for result in results:
        config = configuration(result["args"], defaults)
        others = {k: v for k, v in config.items() if k not in ("qk_norm", "seed") and defaults.get(k) != v}
        label = ("QK-norm" if config.get("qk_norm") else "no QK-norm", "".join(f", {k} {v}" for k, v in others.items()))
        if "data" in result:
            counts = result["data"]
            data.setdefault(label, set()).add(
                f"{counts['passes']:.1f} passes over {counts['train_bytes'] / 1e6:.1f} MB of training text, "
                f"validation on {counts['validation_bytes'] / 1e6:.2f} MB")
        code = result.get("version", "").partition("src:")[2]  # our code's digest (older JSONs have none)
        code = "*" if code and pool_code else code
        by_attn = groups.setdefault(label, {}).setdefault(config.get("seed"), {})
        for run in result["runs"]:
            name = run["attn"] if run["attn"] in BF16_PEERS or not code else f"{run['attn']} src:{code}"
            by_attn.setdefault(name, []).append(run["validation_loss"])
    lines = []
    control = f"{BF16_PEERS[1]} - {BF16_PEERS[0]} (BF16 against BF16)"
    for label, by_seed in groups.items():
        differences: dict[str, dict[int, float]] = {}  # ours -> seed -> its mean less BF16's; control likewise
        for seed, by_attn in by_seed.items():
            lines += ["", f"== {label[0]}, seed {seed}{label[1]}", *sorted(data.get(label, ())),
                      f"{'attention':24s} {'runs':>4s} {'mean':>8s} {'sd':>8s}  validation losses"]
            peers = [name for name in BF16_PEERS if name in by_attn]
            pooled = [x for name in peers for x in by_attn[name]]
            rows = list(by_attn.items()) + ([(f"BF16 ({', '.join(peers)})", pooled)] if pooled else [])
            for name, values in rows:
                sd = f"{statistics.stdev(values):8.4f}" if len(values) > 1 else f"{'-':>8s}"
                lines.append(f"{name:24s} {len(values):4d} {statistics.fmean(values):8.4f} {sd}  "
                             + " ".join(f"{x:.4f}" for x in values))
            for name, values in by_attn.items():
                if name in BF16_PEERS or not pooled:
                    continue
                difference = statistics.fmean(values) - statistics.fmean(pooled)
                differences.setdefault(name, {})[seed] = difference
                error = "-"
                if len(values) > 1 and len(pooled) > 1:
                    spread = statistics.variance(values) / len(values) + statistics.variance(pooled) / len(pooled)
                    error = f"{math.sqrt(spread):.4f}"
                lines.append(f"{name} - BF16: {difference:+.4f} (standard error {error})")
            if all(name in by_attn for name in BF16_PEERS):
                difference = statistics.fmean(by_attn[BF16_PEERS[1]]) - statistics.fmean(by_attn[BF16_PEERS[0]])
                differences.setdefault(control, {})[seed] = difference
                lines.append(f"{control}: {difference:+.4f}")
        paired = {name: by for name, by in differences.items() if len(by) > 1}
        if paired:
            lines += ["", f"== {label[0]}{label[1]}, seeds paired"]
        for name, by in paired.items():
            seeds = sorted(by)
            values = [by[seed] for seed in seeds]
            error = statistics.stdev(values) / math.sqrt(len(values))
            title = name if name == control else f"{name} - BF16"
            lines.append(f"{title} over {len(values)} seeds: {statistics.fmean(values):+.4f} (standard error "
                         f"{error:.4f}; per seed " + ", ".join(f"{s}: {by[s]:+.4f}" for s in seeds) + ")")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attn", nargs="+", default=["hopper", "varlen"])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--qk-norm", action="store_true")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-tokens", type=int, default=65536)
    parser.add_argument("--corpus", choices=CORPORA, default="sources",
                        help="the text: see the module docstring (stdlib: the corpus of runs before 2026-12-05)")
    parser.add_argument("--max-doc", type=int, default=8192, help="bytes kept of each document")
    parser.add_argument("--val-batches", type=int, help="validate on the first N batches (default: all)")
    parser.add_argument("--max-files", type=int, help="the first N files only (quick runs)")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="train_lm_out")
    parser.add_argument("--summarize", nargs="+", metavar="JSON",
                        help="train nothing: summarize these train_lm.json files (mean, spread, difference from BF16)")
    parser.add_argument("--pool-code", action="store_true",
                        help="with --summarize: our runs of every code version as one row (src:*), for versions "
                             "whose kernels compute alike")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.summarize:
        results = []
        for path in args.summarize:
            with open(path) as f:
                results.append(json.load(f))
        print(summary(results, args.pool_code))
        return [run for result in results for run in result["runs"]]
    device = torch.device(args.device)
    train_docs, val_docs = documents(args.corpus, args.max_doc, args.max_files)
    train_batches = packed_batches(train_docs, args.batch_tokens, args.seed)
    val_batches = packed_batches(val_docs, args.batch_tokens, args.seed)[:args.val_batches]
    if not train_batches or not val_batches:
        raise SystemExit(f"too few documents: {len(train_docs)} for training, {len(val_docs)} for validation")
    data = dict(train_documents=len(train_docs), validation_documents=len(val_docs),
                train_bytes=sum(len(d) for d in train_docs), median_document=statistics.median(map(len, train_docs)),
                train_batches=len(train_batches), passes=args.steps / len(train_batches),
                validation_bytes=sum(int(o[-1]) for _, o in val_batches))
    print(f"{len(train_docs)} train / {len(val_docs)} validation documents ({args.corpus}), "
          f"{data['train_bytes'] / 1e6:.1f} MB, median document {data['median_document']:.0f} bytes, "
          f"{len(train_batches)} train batches: {data['passes']:.1f} passes over them in {args.steps} steps; "
          f"validation on {data['validation_bytes'] / 1e6:.2f} MB", flush=True)
    runs = [train(attn, args, train_batches, val_batches, device) for attn in args.attn]
    os.makedirs(args.out, exist_ok=True)
    title = (f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, {args.layers} layers, "
             f"d{args.head_dim}, {'QK-norm' if args.qk_norm else 'no QK-norm'}, "
             f"{args.steps} steps")
    with open(os.path.join(args.out, "train_lm.json"), "w") as f:
        json.dump(dict(title=title, version=git_version(), args=vars(args), data=data, runs=runs), f, indent=1)
    plot(runs, os.path.join(args.out, "train_lm.png"), title)
    print(f"\n{title}\n{'attention':14s} {'final train':>12s} {'validation':>11s} {'step ms':>8s}")
    for run in runs:
        print(f"{run['attn']:14s} {run['train_log'][-1][1]:12.4f} {run['validation_loss']:11.4f} {run['step_ms']:8.1f}")
    return runs


if __name__ == "__main__":
    main()
