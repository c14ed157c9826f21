"""Benchmark: our varlen MXFP8 attention against BF16 peers on one GPU, in one run.

Ours: the public ``jagged_attention`` on bf16 inputs ("ours": backend ``hopper-exact-scores``,
"fast": ``hopper``, the default on Hopper; with ``--center-kv`` also "fast centered", ``hopper`` with
``center_kv=True``; value checks on, as a caller gets them), and the forward on
MXFP8 inputs quantized once beforehand ("ours mxfp8", "fast mxfp8": reused inputs, so their Hopper forms
are built by the untimed first call and kept, as for a caller who quantizes once and attends many times).
Peers, all BF16: FlashAttention-4
(``flash_attn.cute.flash_attn_varlen_func``, where this Python imports it, e.g. through PYTHONPATH;
its columns read "-" otherwise), cuDNN SDPA (dense workloads only), torch ``varlen_attn``
(FlashAttention-2) and, with ``--flex``, FlexAttention with a document mask (compiled; its compiles
take minutes). Each ratio column is ours over the row's reference: FA4 where it ran, else cuDNN
(dense rows), else ``varlen_attn``; the last column names it.

Workload sets (``--set``; ``--help`` lists them with the indices ``--workloads`` takes): ``fa4`` (the
default), each workload at its own head_dim, and ``design``, docs/DESIGN.md section 8's, at each of
``--head-dims``. Causal masks are bottom-right aligned. TFLOP/s count
``4 * sum_b visible(q, k pairs) * D * Hq`` (backward: 2.5x that; a training step, forward + backward
through autograd: 3.5x). The backward is timed again and again on one retained graph, so only its first
run takes the K and V copies our forward keeps for it (backends ``hopper`` and ``portable``): our backward
column is a backward that quantizes K and V itself, the step column has the hand-over. Every timing is the
median of ``triton.testing.do_bench`` on random (never zero) inputs; its first call, untimed, absorbs
compiles (Triton's, FA4's ~5 s per shape class). With ``--rounds N`` every peer of a workload is timed N
times over, in turns, and each column reports the median of its N timings (the JSON also their spread):
one timing of a 60 ms training step once read 13% slow while its forward and backward alone did not
(docs/perf-history.md).

    python3 scripts/bench.py --out OUT_DIR [--set fa4|design] [--workloads NAME|INDEX ...]
        [--backward] [--flex] [--kernel] [--sweep] [--head-dims 128 64] [--rounds 2]

Prints a table last, writes ``bench.json`` (every ms and TFLOP/s, the GPU, torch, Triton and FA4
versions, date and commit) and ``bench.png`` (when matplotlib is there; otherwise
``--plot bench.json`` draws it later on any machine, from this script's JSON of any date).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, NamedTuple

import torch

WARMUP_MS, REPEAT_MS = 25, 150
LLM_SEED, ADS_SEED = 1234, 4321
PARETO_SEED, GQA_SEED, ADS_CROSS_SEED, TINY_QUERY_SEED = 99, 3000, 512, 2048
MAX_LENGTH = 16384
FLOP_FACTORS = {"bwd": 2.5, "step": 3.5}  # by the last word of a column name; forward 1
PANELS = {"bwd": "backward", "step": "training step"}  # likewise; the rest: forward


def dense_lengths(batch, length):
    return torch.full((batch,), length), torch.full((batch,), length)


def cross_lengths(batch, q_range, k_range, seed):
    """``batch`` sequences, L_q uniform in ``q_range``, L_k uniform in ``k_range`` (bounds included)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(q_range[0], q_range[1] + 1, (batch,), generator=g),
            torch.randint(k_range[0], k_range[1] + 1, (batch,), generator=g))


def llm_lengths():
    """48 lengths, lognormal (log-mean ln 1500, sigma 0.8), clamped to [64, 8192], fixed seed."""
    g = torch.Generator().manual_seed(LLM_SEED)
    lengths = torch.exp(math.log(1500) + 0.8 * torch.randn(48, generator=g)).round().clamp(64, 8192)
    return lengths.long(), lengths.long()


def ads_lengths():
    """256 sequences, L_q uniform in [32, 512], L_k uniform in [256, 4096], fixed seed."""
    return cross_lengths(256, (32, 512), (256, 4096), ADS_SEED)


def pareto_lengths():
    """200 lengths ``round(700 * ((1 - u)^(-1/1.2) - 1))`` for u uniform in [0, 1) (float64): Pareto type
    II (Lomax) of shape 1.2 and scale 700, clamped to [1, 16384], fixed seed: median 615, 20 above 4000,
    two of 16384; the longest six hold 60% of the (non-causal) pairs."""
    g = torch.Generator().manual_seed(PARETO_SEED)
    u = torch.rand(200, generator=g, dtype=torch.float64)
    lengths = (700 * ((1 - u).pow(-1 / 1.2) - 1)).round().clamp(1, MAX_LENGTH).long()
    return lengths, lengths


def gqa_lengths():
    """40 lengths, lognormal (log-mean ln 3000, sigma 0.6), clamped to [128, 16384], fixed seed
    (median 2712, 1169 to 10620)."""
    g = torch.Generator().manual_seed(GQA_SEED)
    lengths = torch.exp(math.log(3000) + 0.6 * torch.randn(40, generator=g)).round().clamp(128, MAX_LENGTH)
    return lengths.long(), lengths.long()


def ads_cross_lengths():
    """512 sequences, L_q uniform in [16, 256], L_k uniform in [1000, 3000], fixed seed."""
    return cross_lengths(512, (16, 256), (1000, 3000), ADS_CROSS_SEED)


def tiny_query_lengths():
    """2048 sequences, L_q uniform in [1, 64], L_k uniform in [512, 2048], fixed seed."""
    return cross_lengths(2048, (1, 64), (512, 2048), TINY_QUERY_SEED)


class Spec(NamedTuple):
    """One workload: ``lengths()`` gives L_q and L_k per sequence; ``dense``: every sequence of one length
    (cuDNN SDPA runs it too); ``heads_kv``: None for ``heads_q`` (else GQA, ``heads_q % heads_kv == 0``);
    ``dim``: None to run at each of ``--head-dims``."""

    name: str
    lengths: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    heads_q: int
    causal: bool
    dense: bool
    heads_kv: int | None = None
    dim: int | None = None


dense_16k = functools.partial(dense_lengths, 4, 16384)
dense_8k = functools.partial(dense_lengths, 8, 8192)
WORKLOAD_SETS = {
    "fa4": [  # against FlashAttention-4 (BF16)
        Spec("dense 4x16k h16", dense_16k, 16, False, True, dim=128),
        Spec("ragged pareto 200 h16", pareto_lengths, 16, False, False, dim=128),
        Spec("ragged pareto 200 h16 causal", pareto_lengths, 16, True, False, dim=128),
        Spec("llm gqa 32/8 lognormal", gqa_lengths, 32, False, False, heads_kv=8, dim=128),
        Spec("llm gqa 32/8 lognormal causal", gqa_lengths, 32, True, False, heads_kv=8, dim=128),
        Spec("ads cross 512 h4", ads_cross_lengths, 4, False, False, dim=128),
        Spec("tiny-query cross 2048 h8", tiny_query_lengths, 8, False, False, dim=128),
        Spec("dense 8x8k h16 d64", dense_8k, 16, False, True, dim=64),
    ],
    "design": [  # docs/DESIGN.md section 8
        Spec("dense 8x8192 h16", dense_8k, 16, False, True),
        Spec("dense 8x8192 h16 causal", dense_8k, 16, True, True),
        Spec("llm 48 ragged h16", llm_lengths, 16, False, False),
        Spec("llm 48 ragged h16 causal", llm_lengths, 16, True, False),
        Spec("ads cross 256 h8", ads_lengths, 8, False, False),
    ],
}


def select(specs, keys):
    """The specs that ``keys`` name (by name or by index into ``specs``), in that order; all of them for
    no keys. ValueError for a key that names none."""
    if not keys:
        return list(specs)
    by_key = {**{str(i): s for i, s in enumerate(specs)}, **{s.name: s for s in specs}}
    unknown = [key for key in keys if key not in by_key]
    if unknown:
        raise ValueError(f"unknown workloads {unknown}: --help lists each set's names and indices")
    return [by_key[key] for key in keys]


def visible_pairs(len_q, len_k, causal):
    """The (query, key) pairs attention computes, summed over sequences. Causal (bottom-right aligned):
    query i sees keys j <= i + L_k - L_q, which are max(0, i + 1 + L_k - L_q) keys (L_k for the last
    query), summing to T(L_k) - T(max(L_k - L_q, 0)) with T(n) = n (n + 1) / 2."""
    len_q, len_k = len_q.long(), len_k.long()
    if not causal:
        return int((len_q * len_k).sum())
    unseen = (len_k - len_q).clamp(min=0)
    return int((len_k * (len_k + 1) // 2 - unseen * (unseen + 1) // 2).sum())


def median_ms(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REPEAT_MS, return_mode="median")


def offsets_of(lengths, device):
    from jagged_attn.offsets import offsets_from_lengths

    return offsets_from_lengths(lengths).to(device=device, dtype=torch.int32)


class Workload:
    """Random bf16 jagged q ``[total_q, Hq, D]``, k, v ``[total_k, Hkv, D]`` and dO on the GPU for one
    workload at head_dim ``dim`` (the first arguments: a Spec's fields; ``heads``: Hq; ``heads_kv``:
    Hkv, None for Hq)."""

    def __init__(self, name, lengths, heads, causal, dense, dim, device="cuda", heads_kv=None):
        self.name, self.causal, self.dense, self.dim = name, causal, dense, dim
        self.heads, self.heads_kv = heads, heads if heads_kv is None else heads_kv
        self.label = f"{name} d{dim}"
        self.len_q, self.len_k = lengths()
        self.max_q, self.max_k = int(self.len_q.max()), int(self.len_k.max())
        self.offsets_q, self.offsets_k = offsets_of(self.len_q, device), offsets_of(self.len_k, device)
        total_q, total_k = int(self.len_q.sum()), int(self.len_k.sum())
        self.q = torch.randn(total_q, self.heads, dim, device=device, dtype=torch.bfloat16)
        self.k = torch.randn(total_k, self.heads_kv, dim, device=device, dtype=torch.bfloat16)
        self.v = torch.randn(total_k, self.heads_kv, dim, device=device, dtype=torch.bfloat16)
        self.dout = torch.randn_like(self.q)
        self.scale = dim**-0.5
        self.flops = 4.0 * visible_pairs(self.len_q, self.len_k, causal) * dim * heads

    @classmethod
    def of(cls, spec: Spec, dim: int) -> Workload:
        """The workload of ``spec`` at head_dim ``dim``."""
        return cls(*spec[:5], dim, heads_kv=spec.heads_kv)

    def tflops(self, column, ms):
        return self.flops * FLOP_FACTORS.get(column.split()[-1], 1.0) / (ms * 1e-3) / 1e12


def training_step(forward, inputs, dout):
    """(a training step: ``forward`` on leaf copies of ``inputs`` and their gradients for ``dout``, the leaves)."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    return (lambda: torch.autograd.grad(forward(*leaves), leaves, dout)), leaves


def backward_and_step_ms(name, forward, inputs, dout):
    """{"name bwd": median ms of the backward alone of ``forward(*inputs)`` through autograd,
    "name step": of forward + backward}."""
    step, leaves = training_step(forward, inputs, dout)
    out = forward(*leaves)
    return {
        f"{name} bwd": median_ms(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)),
        f"{name} step": median_ms(step),
    }


def attempt(what, measure, into: dict):
    """``into.update(measure())``; a failure (a peer missing on this machine, or refusing this shape) is
    printed, not raised."""
    try:
        into.update(measure())
    except Exception as error:
        print(f"{what} failed: {type(error).__name__}: {str(error)[:500]}", flush=True)


# A peer maps a Workload to (forward, inputs, dout): forward(*inputs) gives the output that dout is the
# gradient of; or to None where it does not apply.


def timed(name, peer, w: Workload, backward: bool):
    """{name: forward ms} of ``peer(w)`` and, with ``backward``, its "name bwd" and "name step" ms ({}
    where the peer does not apply); a backward that fails is reported and leaves the forward's number."""
    setup = peer(w)
    if setup is None:
        return {}
    forward, inputs, dout = setup
    results = {name: median_ms(lambda: forward(*inputs))}
    if backward:
        attempt(f"{w.label} {name} bwd", lambda: backward_and_step_ms(name, forward, inputs, dout), results)
    return results


# ---- ours -------------------------------------------------------------------------------------


def jagged_peer(backend: str, center_kv: bool = False):
    """Ours as a caller runs it: ``jagged_attention`` on bf16 q, k, v (quantized inside; GQA natively)."""

    def peer(w: Workload):
        from jagged_attn import jagged_attention

        def forward(q, k, v):
            return jagged_attention(q, k, v, w.offsets_q, w.offsets_k, causal=w.causal, softmax_scale=w.scale,
                                    backend=backend, center_kv=center_kv)

        return forward, (w.q, w.k, w.v), w.dout

    return peer


def quantized_inputs(w: Workload):
    """(q, k, v) of ``w`` in MXFP8: q, k on the feature axis, v on the sequence axis."""
    from jagged_attn import quantize_mxfp8

    return (quantize_mxfp8(w.q, w.offsets_q), quantize_mxfp8(w.k, w.offsets_k),
            quantize_mxfp8(w.v, w.offsets_k, axis="sequence"))


def forward_kernel_alone(w: Workload, mq, mk, mv, config: dict):
    """(the Gluon forward kernel as a call on Q, K, V rebased beforehand, the Q rebase, the K and V
    rebase) for ``sm90.forward.tile_config``-style ``config``; the call returns (out, lse)."""
    from jagged_attn.kernels.common import layout
    from jagged_attn.kernels.producers import rebase
    from jagged_attn.kernels.sm90 import forward as sm90_forward

    exact = config["SCORES"] == "bf16"
    rebase_q = functools.partial(rebase.rebase_feature, mq, group=1, exact=exact)
    rebase_kv = functools.partial(rebase.rebase_kv, mk, mv, config["BLOCK_N"], exact=exact, v_order=layout.PV_ORDER)
    rebased = (*rebase_q(), *rebase_kv())

    def kernel():
        return sm90_forward.forward_rebased(*rebased, w.offsets_q, w.offsets_k, causal=w.causal,
                                            softmax_scale=w.scale, out_dtype=torch.bfloat16, config=config)

    return kernel, rebase_q, rebase_kv


def ours_mxfp8(w: Workload, kernel: bool, sweep_configs=()):
    """Forward ms from MXFP8 inputs quantized once beforehand (``sm90.forward.attention_forward``; "ours
    mxfp8": exact S as backend ``hopper-exact-scores``, "fast mxfp8": FP8 S as ``hopper``). With ``kernel`` also
    the Gluon kernel alone ("ours kernel", "fast kernel") on Q, K, V rebased beforehand, and the rebase
    passes' ms; ``sweep_configs``: tile configurations of the portable Triton kernel."""
    from jagged_attn.kernels.portable import forward as portable_forward
    from jagged_attn.kernels.producers import rebase
    from jagged_attn.kernels.sm90 import forward as sm90_forward

    mq, mk, mv = quantized_inputs(w)
    forward = dict(causal=w.causal, softmax_scale=w.scale)
    results = {}
    for name, scores in (("ours", "bf16"), ("fast", "fp8")):
        results[f"{name} mxfp8"] = median_ms(
            lambda: sm90_forward.attention_forward(mq, mk, mv, scores=scores, **forward))
        if not kernel:
            continue
        alone, rebase_q, rebase_kv = forward_kernel_alone(w, mq, mk, mv, sm90_forward.tile_config(w.dim, scores))
        results[f"{name} kernel"] = median_ms(alone)
        results[f"{name} rebase ms: q"] = median_ms(rebase_q)
        results[f"{name} rebase ms: k, v"] = median_ms(rebase_kv)
    for c in sweep_configs:
        rebased = (*rebase.rebase_feature(mk, group=c["BLOCK_N"]), *rebase.rebase_sequence(mv))
        results[f"triton {c['BLOCK_M']}x{c['BLOCK_N']}/{c['num_warps']}w/{c['num_stages']}s"] = median_ms(
            lambda: portable_forward.forward_rebased(
                mq.data, mq, *rebased, w.offsets_q, w.offsets_k, out_dtype=torch.bfloat16, config=c, **forward
            )
        )
    return results


# ---- peers ------------------------------------------------------------------------------------


@functools.cache
def fa4_import():
    """(``flash_attn.cute``, None) where this Python imports it (FA4 is installed for some runs only),
    else (None, why not)."""
    try:
        import flash_attn.cute as fa4
    except Exception as error:  # absent, or present with a CUTLASS DSL that does not load
        return None, f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    return fa4, None


def fa4_version():
    """FA4's ``__version__`` and the folder it was imported from, or why it was not."""
    fa4, why = fa4_import()
    if fa4 is None:
        return f"absent ({why})"
    return f"{getattr(fa4, '__version__', 'no __version__')} ({os.path.dirname(fa4.__file__)})"


def fa4_peer(w: Workload):
    """FlashAttention-4's ``flash_attn_varlen_func`` (GQA natively; it returns out, or (out, lse)). Its
    causal mask is bottom-right aligned too (the causal rows here are self-attention anyway)."""
    fa4, _ = fa4_import()
    if fa4 is None:
        return None

    def forward(q, k, v):
        return fa4_attention(fa4, q, k, v, w.offsets_q, w.offsets_k, w.max_q, w.max_k, w.causal, w.scale)

    return forward, (w.q, w.k, w.v), w.dout


def fa4_attention(fa4, q, k, v, offsets_q, offsets_k, max_q, max_k, causal, scale=None):
    """``fa4.flash_attn_varlen_func``'s output (it returns out, or (out, lse)); int32 offsets."""
    out = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=offsets_q, cu_seqlens_k=offsets_k, max_seqlen_q=max_q,
                                     max_seqlen_k=max_k, softmax_scale=scale, causal=causal)
    return out[0] if isinstance(out, tuple) else out


def varlen_causal_kwargs(causal: bool) -> dict:
    """How this torch's ``varlen_attn`` is asked for bottom-right causal masking."""
    from torch.nn.attention.varlen import varlen_attn

    if not causal:
        return {}
    has_window = "window_size" in inspect.signature(varlen_attn).parameters
    return {"window_size": (-1, 0)} if has_window else {"is_causal": True}


def varlen_peer(w: Workload):
    """torch ``varlen_attn`` (FlashAttention-2). GQA through its ``enable_gqa``; a torch without it gets
    k and v with each head repeated Hq / Hkv times beforehand, for this peer only (its backward then
    gives dK, dV per query head, which GQA would go on to sum over each group: not timed)."""
    from torch.nn.attention.varlen import varlen_attn

    options = varlen_causal_kwargs(w.causal)
    k, v = w.k, w.v
    if w.heads_kv != w.heads:
        if "enable_gqa" in inspect.signature(varlen_attn).parameters:
            options["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(w.heads // w.heads_kv, dim=1) for x in (k, v))

    def forward(q, k, v):
        return varlen_attn(q, k, v, w.offsets_q, w.offsets_k, w.max_q, w.max_k, scale=w.scale, **options)

    return forward, (w.q, k, v), w.dout


def cudnn_peer(w: Workload):
    """cuDNN SDPA on the dense view ``[B, H, L, D]`` of a dense workload (GQA through ``enable_gqa``)."""
    if not w.dense:
        return None
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, length = w.len_q.numel(), int(w.len_q[0])
    gqa = {"enable_gqa": True} if w.heads_kv != w.heads else {}

    def dense(x):
        return x.view(batch, length, x.shape[1], w.dim).transpose(1, 2)

    def forward(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(dense(q), dense(k), dense(v), is_causal=w.causal, scale=w.scale,
                                                  **gqa)

    return forward, (w.q, w.k, w.v), dense(w.dout)


def flex_peer(w: Workload):
    """FlexAttention, compiled, with a document mask over the packed sequences (GQA through ``enable_gqa``)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    device = w.q.device
    doc_q = torch.repeat_interleave(torch.arange(w.len_q.numel(), device=device), w.len_q.to(device))
    doc_k = torch.repeat_interleave(torch.arange(w.len_k.numel(), device=device), w.len_k.to(device))
    pos_q = torch.arange(doc_q.numel(), device=device) - w.offsets_q.long()[doc_q]
    pos_k = torch.arange(doc_k.numel(), device=device) - w.offsets_k.long()[doc_k]
    diagonal = (w.len_k - w.len_q).to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_q[q_idx] == doc_k[kv_idx]
        if not w.causal:
            return same
        return same & (pos_k[kv_idx] <= pos_q[q_idx] + diagonal[doc_q[q_idx]])

    # The backward alone is timed by replaying one graph (retain_graph), which compiled graphs with
    # donated buffers refuse (the ragged rows of the 2026-11-30 00:30 run).
    torch._functorch.config.donated_buffer = False
    block_mask = create_block_mask(mask_mod, 1, 1, doc_q.numel(), doc_k.numel(), device=device, _compile=True)
    compiled = torch.compile(flex_attention)
    gqa = w.heads_kv != w.heads

    def forward(q, k, v):
        return compiled(q, k, v, block_mask=block_mask, scale=w.scale, enable_gqa=gqa)

    packed = [x.transpose(0, 1).unsqueeze(0).contiguous() for x in (w.q, w.k, w.v, w.dout)]
    return forward, tuple(packed[:3]), packed[3]


PEERS = [  # (column, peer), in the order they run
    ("ours", jagged_peer("hopper-exact-scores")),
    ("fast", jagged_peer("hopper")),
    ("fast centered", jagged_peer("hopper", center_kv=True)),  # with --center-kv
    ("fa4", fa4_peer),
    ("cudnn sdpa", cudnn_peer),
    ("varlen_attn", varlen_peer),
    ("flex", flex_peer),
]


# ---- ceilings ---------------------------------------------------------------------------------


def ceilings():
    """The copy bandwidth (TB/s, read + write) and 8192^3 GEMM rates (TFLOP/s) of this GPU now."""
    n = 8192
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    bf16_ms = median_ms(lambda: a @ b)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    fp8_ms = median_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
    flops = 2.0 * n**3
    return {
        "copy TB/s": 2 * src.numel() * 4 / copy_ms / 1e9,
        "cublas bf16 TFLOP/s": flops / bf16_ms / 1e9,
        "cublas fp8 TFLOP/s": flops / fp8_ms / 1e9,
    }


# ---- report -----------------------------------------------------------------------------------

PEER_COLUMNS = ["fa4", "cudnn sdpa", "varlen_attn", "flex"]
REFERENCES = PEER_COLUMNS[:3]  # a row's ratios are over the first of these it has
OURS_COLUMNS = ["ours", "fast", "fast centered"]
FORWARD_COLUMNS = [*OURS_COLUMNS, "ours mxfp8", "fast mxfp8", "ours kernel", "fast kernel", *PEER_COLUMNS]
GRADIENT_COLUMNS = [*OURS_COLUMNS, *PEER_COLUMNS]  # as "... bwd" and "... step" columns
SWEEP = [
    dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
    for m, n, w, s in ((128, 128, 8, 3), (64, 128, 4, 2), (64, 128, 4, 4), (64, 64, 4, 3))
]


def table(rows, columns, ours_columns, suffix=""):
    """TFLOP/s of each of ``columns`` (named with ``suffix`` in the rows) that some row has, FA4's
    always ("-" where a row lacks one), then each of ``ours_columns`` over the row's reference: the first
    of REFERENCES that it has, which the last column names."""
    shown = [c for c in columns if c == "fa4" or any(c + suffix in row["tflops"] for row in rows)]
    widths = [len(c) + 6 for c in ours_columns]  # of the ratio columns, "c/ref" and two spaces
    head = (f"{'workload':<31}{'D':>4}" + "".join(f"{c:>12}" for c in shown)
            + "".join(f"{c + '/ref':>{n}}" for c, n in zip(ours_columns, widths)) + f"{'ref':>13}")
    lines = [head, "-" * len(head)]
    for row in rows:
        tf = {column[: len(column) - len(suffix)]: v for column, v in row["tflops"].items() if column.endswith(suffix)}
        ref = next((c for c in REFERENCES if c in tf), None)
        cells = "".join(f"{tf[c]:>12.0f}" if c in tf else f"{'-':>12}" for c in shown)
        ratios = "".join(f"{tf[c] / tf[ref]:>{n - 1}.2f}x" if ref and c in tf else f"{'-':>{n}}"
                         for c, n in zip(ours_columns, widths))
        lines.append(f"{row['workload']:<31}{row['head_dim']:>4}{cells}{ratios}{ref or '-':>13}")
    return "\n".join(lines)


def plot(result, path):
    """Bar charts of ``result["rows"]``' TFLOP/s, a panel per stage (by the last word of each column's
    name), titled with the GPU, date and version: any bench.json of this script, earlier ones included."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: run `scripts/bench.py --plot bench.json` elsewhere for the chart")
        return
    rows = result["rows"]
    columns = {title: [] for title in ("forward", "backward", "training step")}
    for row in rows:
        for column in row["tflops"]:
            panel = columns[PANELS.get(column.split()[-1], "forward")]
            if column not in panel:
                panel.append(column)
    panels = [(title, names) for title, names in columns.items() if names]
    labels = [f"{r['workload']}\nd{r['head_dim']}" for r in rows]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 1.6 * len(rows)), 4.5 * len(panels)), squeeze=False)
    for ax, (title, names) in zip(axes[:, 0], panels):
        width = 0.8 / len(names)
        for i, column in enumerate(names):
            values = [r["tflops"].get(column, 0.0) for r in rows]
            ax.bar([x + i * width for x in range(len(rows))], values, width, label=column)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], labels, fontsize=7)
        ax.set_ylabel(f"{title} TFLOP/s")
        ax.legend(fontsize=7)
    axes[0, 0].set_title(f"{result['gpu']}, {result['date']}, {result['version']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def git_version():
    """What ran: ``git describe`` of the checkout whose tracked ``jagged_attn`` was imported ("copy" where
    the imported package is not one, e.g. another version's put first on ``PYTHONPATH``) plus a digest
    of the imported package's sources (``src:`` 12 hex digits over every ``.py`` file of ``jagged_attn``,
    its kernels included, by path), which names the code even where a checkout's history is stale."""
    import jagged_attn

    package = os.path.dirname(os.path.abspath(jagged_attn.__file__))

    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=package)
        except OSError:
            return None

    tracked = git("ls-files", "--error-unmatch", "__init__.py")
    described = "copy"
    if tracked is not None and tracked.returncode == 0:  # "-dirty": the tree differs from that commit
        described = git("describe", "--always", "--dirty").stdout.strip() or "copy"
    sources = []
    for where, folders, files in os.walk(package):
        folders[:] = [f for f in folders if f != "__pycache__"]
        sources += [(os.path.join("jagged_attn", os.path.relpath(os.path.join(where, f), package)),
                     os.path.join(where, f)) for f in files if f.endswith(".py")]
    digest = hashlib.sha256()
    for relative, path in sorted(sources):
        with open(path, "rb") as source:
            digest.update(relative.encode() + b"\0" + source.read())
    return f"{described} src:{digest.hexdigest()[:12]}"


def workload_listing():
    """The workload sets for ``--help``, each workload with its index."""
    lines = ["workloads (--set NAME, then --workloads by name or index):"]
    for set_name, specs in WORKLOAD_SETS.items():
        lines.append(f"  {set_name}:")
        lines += [f"    {i}  {s.name} (Hq {s.heads_q}, Hkv {s.heads_kv or s.heads_q}, "
                  f"{f'd{s.dim}' if s.dim else 'each --head-dims'})" for i, s in enumerate(specs)]
    return "\n".join(lines)


def parse_args(argv=None):
    """The command line; ``specs``: the chosen workloads of ``--set``."""
    parser = argparse.ArgumentParser(description=__doc__, epilog=workload_listing(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--set", choices=list(WORKLOAD_SETS), default="fa4", help="workload set (listed below)")
    parser.add_argument("--workloads", nargs="+", metavar="NAME|INDEX", help="only these of --set (default: all)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64],
                        help="for workloads without a head_dim of their own (the design set)")
    parser.add_argument("--backward", action="store_true", help="also backward and training-step columns")
    parser.add_argument("--center-kv", action="store_true", help="also fast with center_kv=True (fast centered)")
    parser.add_argument("--flex", action="store_true", help="also FlexAttention (its compiles take minutes)")
    parser.add_argument("--no-flex", dest="flex", action="store_false", help="no FlexAttention (the default)")
    parser.add_argument("--flex-head-dims", type=int, nargs="*", default=[128])
    parser.add_argument("--kernel", action="store_true", help="also our forward kernel alone and its rebase passes")
    parser.add_argument("--sweep", action="store_true", help="also time other tile configs on the first workload")
    parser.add_argument("--rounds", type=int, default=1,
                        help="passes over every peer per workload; each column reports the median of its passes "
                             "and the JSON their spread (2 or more for ratios a slow spell of the GPU cannot skew)")
    parser.add_argument("--plot", help="only draw the chart of an earlier bench.json")
    parser.set_defaults(flex=False)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    try:
        args.specs = select(WORKLOAD_SETS[args.set], args.workloads)
    except ValueError as error:
        parser.error(str(error))
    return args


def combined_rounds(rounds: list[dict]) -> tuple[dict, dict]:
    """({column: median ms over the rounds that measured it}, {column: [fastest, slowest] ms}) of
    ``rounds``, each a {column: ms} of one pass over every peer."""
    names = dict.fromkeys(name for r in rounds for name in r)  # every column, in first-seen order
    columns = {name: [r[name] for r in rounds if name in r] for name in names}
    return ({name: statistics.median(ms) for name, ms in columns.items()},
            {name: [min(ms), max(ms)] for name, ms in columns.items()})


def bench_row(spec: Spec, dim: int, args):
    """The row of ``spec`` at head_dim ``dim``: every column's ms (the median over ``args.rounds`` passes
    over all peers, so that a slow spell of the GPU falls on every peer alike), its spread and TFLOP/s."""
    w = Workload.of(spec, dim)
    sweep = SWEEP if args.sweep and spec is args.specs[0] else ()
    rounds = []
    for _ in range(args.rounds):
        measured = {}
        for name, peer in PEERS:
            if (name != "flex" or (args.flex and dim in args.flex_head_dims)) and (name != "fast centered"
                                                                                   or args.center_kv):
                attempt(f"{w.label} {name}", functools.partial(timed, name, peer, w, args.backward), measured)
        attempt(f"{w.label} ours mxfp8", functools.partial(ours_mxfp8, w, args.kernel, sweep), measured)
        rounds.append(measured)
    measured, spread = combined_rounds(rounds)
    tflops = {k: w.tflops(k, ms) for k, ms in measured.items() if " ms" not in k}
    return dict(
        workload=spec.name, head_dim=dim, heads=w.heads, heads_kv=w.heads_kv, causal=spec.causal,
        batch=w.len_q.numel(), tokens_q=int(w.len_q.sum()), tokens_k=int(w.len_k.sum()), max_q=w.max_q,
        max_k=w.max_k, flops=w.flops, ms=measured, ms_spread=spread, rounds=args.rounds, tflops=tflops,
    )


def save(result, path):
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def main():
    args = parse_args()
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), os.path.splitext(args.plot)[0] + ".png")
        return
    import triton

    start = time.time()
    print(f"FA4: {fa4_version()}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench.json")
    rows = []
    result = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        version=git_version(),
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        fa4=fa4_version(),
        argv=sys.argv[1:],
        rows=rows,
    )
    for spec in args.specs:
        for dim in [spec.dim] if spec.dim else args.head_dims:
            row = bench_row(spec, dim, args)
            torch.cuda.empty_cache()
            rows.append(row)
            save(result, path)  # row by row: a run stopped at a time limit keeps the rows it finished
            print(
                f"[{time.time() - start:4.0f} s] {spec.name} d{dim}: "
                + ", ".join(f"{k} {v:.0f}" for k, v in row["tflops"].items())
                + "; "
                + ", ".join(f"{k} {v:.3f}" for k, v in row["ms"].items() if " ms" in k),
                flush=True,
            )
    result["ceilings"] = ceilings()
    save(result, path)
    plot(result, os.path.join(args.out, "bench.png"))
    print(f"\n{result['gpu']}, torch {result['torch']}, triton {result['triton']}, FA4 {result['fa4']}, "
          f"{result['date']}, version {result['version']}")
    print("ceilings: " + ", ".join(f"{k} {v:.1f}" for k, v in result["ceilings"].items()))
    print("forward TFLOP/s; x/ref: ours over the row's reference peer")
    print(table(rows, FORWARD_COLUMNS, [*OURS_COLUMNS, "ours mxfp8", "fast mxfp8"]))
    if args.backward:
        print("backward TFLOP/s")
        print(table(rows, GRADIENT_COLUMNS, OURS_COLUMNS, " bwd"))
        print("training step (forward + backward through autograd) TFLOP/s")
        print(table(rows, GRADIENT_COLUMNS, OURS_COLUMNS, " step"))


if __name__ == "__main__":
    main()
