"""Benchmark: our varlen MXFP8 attention against BF16 peers on one GPU, in one run.

Peers: torch ``varlen_attn`` (FlashAttention-2), cuDNN SDPA (dense workloads only) and
FlexAttention with a document mask (compiled). Workloads are those of DESIGN.md section 8.
TFLOP/s count ``4 * sum_b visible(q, k pairs) * D * H`` (backward: 2.5x that; a training step,
forward + backward through autograd: 3.5x). Every timing is the median of
``triton.testing.do_bench`` on random (never zero) inputs.

    python3 scripts/bench.py --out OUT_DIR [--head-dims 128 64] [--backward] [--no-flex] [--sweep]

Prints a table, writes ``bench.json`` and ``bench.png`` (when matplotlib is there; otherwise
``--plot bench.json`` draws it later on any machine).
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
import subprocess

import torch

WARMUP_MS, REPEAT_MS = 25, 150
LLM_SEED, ADS_SEED = 1234, 4321
FLOP_FACTORS = {"bwd": 2.5, "step": 3.5}  # by the last word of a column name; forward 1


def llm_lengths():
    """48 lengths, lognormal (log-mean ln 1500, sigma 0.8), clamped to [64, 8192], fixed seed."""
    g = torch.Generator().manual_seed(LLM_SEED)
    lengths = torch.exp(math.log(1500) + 0.8 * torch.randn(48, generator=g)).round().clamp(64, 8192)
    return lengths.long(), lengths.long()


def ads_lengths():
    """256 sequences, L_q uniform in [32, 512], L_k uniform in [256, 4096], fixed seed."""
    g = torch.Generator().manual_seed(ADS_SEED)
    return torch.randint(32, 513, (256,), generator=g), torch.randint(256, 4097, (256,), generator=g)


def dense_lengths():
    return torch.full((8,), 8192), torch.full((8,), 8192)


WORKLOADS = [
    # (name, lengths, heads, causal, dense)
    ("dense 8x8192 h16", dense_lengths, 16, False, True),
    ("dense 8x8192 h16 causal", dense_lengths, 16, True, True),
    ("llm 48 ragged h16", llm_lengths, 16, False, False),
    ("llm 48 ragged h16 causal", llm_lengths, 16, True, False),
    ("ads cross 256 h8", ads_lengths, 8, False, False),
]


def visible_pairs(len_q, len_k, causal):
    if not causal:
        return int((len_q * len_k).sum())
    # query i sees keys j <= i + Lk - Lq (bottom-right aligned)
    return sum(
        sum(max(0, min(lk, i + 1 + lk - lq)) for i in range(lq)) for lq, lk in zip(len_q.tolist(), len_k.tolist())
    )


def median_ms(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REPEAT_MS, return_mode="median")


def offsets_of(lengths, device):
    from jagged_attn.offsets import offsets_from_lengths

    return offsets_from_lengths(lengths).to(device=device, dtype=torch.int32)


class Workload:
    """Random bf16 jagged q, k, v (and dO) on the GPU for one workload and head_dim."""

    def __init__(self, name, lengths, heads, causal, dense, dim, device="cuda"):
        self.name, self.heads, self.causal, self.dense, self.dim = name, heads, causal, dense, dim
        self.len_q, self.len_k = lengths()
        self.offsets_q, self.offsets_k = offsets_of(self.len_q, device), offsets_of(self.len_k, device)
        total_q, total_k = int(self.len_q.sum()), int(self.len_k.sum())
        self.q = torch.randn(total_q, heads, dim, device=device, dtype=torch.bfloat16)
        self.k = torch.randn(total_k, heads, dim, device=device, dtype=torch.bfloat16)
        self.v = torch.randn(total_k, heads, dim, device=device, dtype=torch.bfloat16)
        self.dout = torch.randn_like(self.q)
        self.scale = dim**-0.5
        self.flops = 4.0 * visible_pairs(self.len_q, self.len_k, causal) * dim * heads

    def tflops(self, column, ms):
        return self.flops * FLOP_FACTORS.get(column.split()[-1], 1.0) / (ms * 1e-3) / 1e12


def backward_and_step_ms(name, forward, inputs, dout):
    """{"name bwd": median ms of the backward alone of ``forward(*inputs)`` through autograd,
    "name step": of forward + backward}."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    out = forward(*leaves)
    return {
        f"{name} bwd": median_ms(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)),
        f"{name} step": median_ms(lambda: torch.autograd.grad(forward(*leaves), leaves, dout)),
    }


# ---- ours -------------------------------------------------------------------------------------


def ours(w: Workload, backward: bool, sweep_configs=()):
    from jagged_attn import quantize_mxfp8
    from jagged_attn.kernels import hopper_fwd, hopper_fwd_ws, layout, rebase

    mq = quantize_mxfp8(w.q, w.offsets_q)
    mk = quantize_mxfp8(w.k, w.offsets_k)
    mv = quantize_mxfp8(w.v, w.offsets_k, axis="sequence")
    forward = dict(causal=w.causal, softmax_scale=w.scale)
    # "ours": the default backend ("triton": exact S); "fast": backend "triton-fast" (FP8 S).
    results = {}
    for name, scores in (("ours", "bf16"), ("fast", "fp8")):
        results[f"{name} mxfp8"] = median_ms(lambda: hopper_fwd.attention_forward(mq, mk, mv, scores=scores, **forward))
        # The GPU kernel alone (hopper_fwd_ws), on Q, K, V rebased beforehand.
        exact = scores == "bf16"
        config = hopper_fwd_ws.tile_config(w.dim, scores)
        rebase_q = functools.partial(rebase.rebase_feature, mq, group=1, exact=exact)
        rebase_kv = functools.partial(rebase.rebase_kv, mk, mv, config["BLOCK_N"], exact=exact,
                                      v_order=layout.PV_ORDER)
        rebased = (*rebase_q(), *rebase_kv())
        results[f"{name} kernel"] = median_ms(lambda: hopper_fwd_ws._forward(
            *rebased, w.offsets_q, w.offsets_k, out_dtype=torch.bfloat16, config=config, **forward))
        results[f"{name} rebase ms: q"] = median_ms(rebase_q)
        results[f"{name} rebase ms: k, v"] = median_ms(rebase_kv)
    # --sweep: tile configurations of the Triton kernel (the one the CPU interpreter runs).
    for c in sweep_configs:
        rebased = (*rebase.rebase_feature(mk, group=c["BLOCK_N"]), *rebase.rebase_sequence(mv))
        results[f"triton {c['BLOCK_M']}x{c['BLOCK_N']}/{c['num_warps']}w/{c['num_stages']}s"] = median_ms(
            lambda: hopper_fwd._forward(
                mq.data, mq, *rebased, w.offsets_q, w.offsets_k, out_dtype=torch.bfloat16, config=c, **forward
            )
        )
    results["ours bf16 in"] = median_ms(
        lambda: hopper_fwd.attention_forward_hp(w.q, w.k, w.v, w.offsets_q, w.offsets_k, scores="bf16", **forward)
    )
    if backward:
        results.update(ours_backward_and_step(w))
    return results


def ours_backward_and_step(w: Workload):
    """The public ``jagged_attention`` on bf16 inputs, through autograd: "ours" = backend "triton",
    "fast" = "triton-fast" (FP8 S in the forward, the warp-specialized backward)."""
    from jagged_attn import jagged_attention

    results = {}
    for name, backend in (("ours", "triton"), ("fast", "triton-fast")):
        def forward(q, k, v, backend=backend):
            return jagged_attention(q, k, v, w.offsets_q, w.offsets_k, causal=w.causal, softmax_scale=w.scale,
                                    backend=backend)

        results.update(backward_and_step_ms(name, forward, (w.q, w.k, w.v), w.dout))
    return results


# ---- peers ------------------------------------------------------------------------------------


def varlen_causal_kwargs(causal: bool) -> dict:
    """How this torch's ``varlen_attn`` is asked for bottom-right causal masking."""
    from torch.nn.attention.varlen import varlen_attn

    if not causal:
        return {}
    has_window = "window_size" in inspect.signature(varlen_attn).parameters
    return {"window_size": (-1, 0)} if has_window else {"is_causal": True}


def varlen_fa2(w: Workload, backward: bool):
    from torch.nn.attention.varlen import varlen_attn

    causal = varlen_causal_kwargs(w.causal)
    max_q, max_k = int(w.len_q.max()), int(w.len_k.max())

    def forward(q, k, v):
        return varlen_attn(q, k, v, w.offsets_q, w.offsets_k, max_q, max_k, scale=w.scale, **causal)

    results = {"varlen_attn": median_ms(lambda: forward(w.q, w.k, w.v))}
    if backward:
        results.update(backward_and_step_ms("varlen_attn", forward, (w.q, w.k, w.v), w.dout))
    return results


def cudnn_sdpa(w: Workload, backward: bool):
    if not w.dense:
        return {}
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    batch, length = w.len_q.numel(), int(w.len_q[0])

    def dense(x):
        return x.view(batch, length, w.heads, w.dim).transpose(1, 2)

    def forward(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(dense(q), dense(k), dense(v), is_causal=w.causal, scale=w.scale)

    results = {"cudnn sdpa": median_ms(lambda: forward(w.q, w.k, w.v))}
    if backward:
        results.update(backward_and_step_ms("cudnn sdpa", forward, (w.q, w.k, w.v), dense(w.dout)))
    return results


def flex_doc_mask(w: Workload, backward: bool):
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

    def forward(q, k, v):
        return compiled(q, k, v, block_mask=block_mask, scale=w.scale)

    packed = [x.transpose(0, 1).unsqueeze(0).contiguous() for x in (w.q, w.k, w.v, w.dout)]
    results = {"flex": median_ms(lambda: forward(*packed[:3]))}
    if backward:
        results.update(backward_and_step_ms("flex", forward, packed[:3], packed[3]))
    return results


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

BF16_PEERS = ["varlen_attn", "cudnn sdpa", "flex"]
FORWARD_COLUMNS = ["ours mxfp8", "ours kernel", "ours bf16 in", "fast mxfp8", "fast kernel", *BF16_PEERS]
BACKWARD_COLUMNS = ["ours bwd", "fast bwd", *(c + " bwd" for c in BF16_PEERS)]
STEP_COLUMNS = ["ours step", "fast step", *(c + " step" for c in BF16_PEERS)]
PANELS = [("forward", FORWARD_COLUMNS), ("backward", BACKWARD_COLUMNS), ("training step", STEP_COLUMNS)]
SWEEP = [
    dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
    for m, n, w, s in ((128, 128, 8, 3), (64, 128, 4, 2), (64, 128, 4, 4), (64, 64, 4, 3))
]


def table(rows, columns, ours_columns, peer_columns):
    """Rows of TFLOP/s per column, then each of ``ours_columns`` over the best of ``peer_columns``."""
    ratio_names = [f"{c.split()[0]}/best" for c in ours_columns]
    head = f"{'workload':<28}{'D':>4}" + "".join(f"{c:>16}" for c in columns + ratio_names)
    lines = [head, "-" * len(head)]
    for row in rows:
        tf = row["tflops"]
        peers = [tf[c] for c in peer_columns if c in tf]
        cells = "".join(f"{tf[c]:>16.0f}" if c in tf else f"{'-':>16}" for c in columns)
        ratios = "".join(f"{tf[c] / max(peers):>15.2f}x" if peers and c in tf else f"{'':>16}" for c in ours_columns)
        lines.append(f"{row['workload']:<28}{row['head_dim']:>4}{cells}{ratios}")
    return "\n".join(lines)


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: run `scripts/bench.py --plot bench.json` elsewhere for the chart")
        return
    labels = [f"{r['workload']}\nd{r['head_dim']}" for r in rows]
    panels = [(title, [c for c in columns if any(c in r["tflops"] for r in rows)]) for title, columns in PANELS]
    panels = [(title, columns) for title, columns in panels if columns]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 1.6 * len(rows)), 4.5 * len(panels)), squeeze=False)
    for ax, (title, columns) in zip(axes[:, 0], panels):
        width = 0.8 / len(columns)
        for i, column in enumerate(columns):
            values = [r["tflops"].get(column, 0.0) for r in rows]
            ax.bar([x + i * width for x in range(len(rows))], values, width, label=column)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], labels, fontsize=7)
        ax.set_ylabel(f"{title} TFLOP/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def git_version():
    """``git describe`` of the checkout plus a digest of the package's sources (``src:`` 12 hex
    digits), which names the code even where the checkout's history is stale (a copied tree)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        described = subprocess.run(
            ["git", "describe", "--always", "--dirty"],  # "-dirty": the tree differs from that commit
            capture_output=True,
            text=True,
            cwd=here,
        ).stdout.strip() or "unknown"
    except OSError:
        described = "unknown"
    digest = hashlib.sha256()
    root = os.path.dirname(here)
    for folder in ("jagged_attn", "kernels"):
        for name in sorted(os.listdir(os.path.join(root, folder))):
            if name.endswith(".py"):
                with open(os.path.join(root, folder, name), "rb") as source:
                    digest.update(name.encode() + b"\0" + source.read())
    return f"{described} src:{digest.hexdigest()[:12]}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compiles take minutes)")
    parser.add_argument("--flex-head-dims", type=int, nargs="*", default=[128])
    parser.add_argument("--sweep", action="store_true", help="also time other tile configs on the first workload")
    parser.add_argument("--plot", help="only draw the chart of an earlier bench.json")
    args = parser.parse_args()
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f)["rows"], os.path.splitext(args.plot)[0] + ".png")
        return
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for dim in args.head_dims:
        for name, lengths, heads, causal, dense in WORKLOADS:
            w = Workload(name, lengths, heads, causal, dense, dim)
            measured = {}
            sweep = SWEEP if args.sweep and name == WORKLOADS[0][0] else ()
            runners = [lambda w, backward: ours(w, backward, sweep), varlen_fa2, cudnn_sdpa]
            if not args.no_flex and dim in args.flex_head_dims:
                runners.append(flex_doc_mask)
            for runner in runners:
                try:
                    measured.update(runner(w, args.backward))
                except Exception as error:  # a peer missing on this torch must not stop the run
                    print(
                        f"{name} d{dim} {getattr(runner, '__name__', 'ours')} failed: {type(error).__name__}: {error}"
                    )
            tflops = {k: w.tflops(k, ms) for k, ms in measured.items() if " ms" not in k}
            rows.append(
                dict(workload=name, head_dim=dim, heads=heads, causal=causal, flops=w.flops, ms=measured, tflops=tflops)
            )
            print(
                f"{name} d{dim}: "
                + ", ".join(f"{k} {v:.0f}" for k, v in tflops.items())
                + "; "
                + ", ".join(f"{k} {v:.3f}" for k, v in measured.items() if " ms" in k),
                flush=True,
            )
            del w
            torch.cuda.empty_cache()
    result = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        version=git_version(),
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        ceilings=ceilings(),
        rows=rows,
    )
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(rows, os.path.join(args.out, "bench.png"))
    print(f"\n{result['gpu']}, torch {result['torch']}, {result['date']}, version {result['version']}")
    print("ceilings: " + ", ".join(f"{k} {v:.1f}" for k, v in result["ceilings"].items()))
    print("forward TFLOP/s")
    print(table(rows, FORWARD_COLUMNS, ["ours mxfp8", "fast mxfp8"], BF16_PEERS))
    if args.backward:
        print("backward TFLOP/s")
        print(table(rows, BACKWARD_COLUMNS, BACKWARD_COLUMNS[:2], BACKWARD_COLUMNS[2:]))
        print("training step (forward + backward through autograd) TFLOP/s")
        print(table(rows, STEP_COLUMNS, STEP_COLUMNS[:2], STEP_COLUMNS[2:]))


if __name__ == "__main__":
    main()
