"""Which MXFP8 rounding costs a trained model's attention gradients the most: a float64 emulation.

Trains ``train_lm.py``'s model (same arguments) with a BF16 attention (``--attn fa4`` on the GPU) and at
each ``--checkpoints`` step captures every layer's q, k, v (bf16, after RoPE) and dO on the first
``--probe-tokens`` of one batch. For each layer it then runs the spec's forward and backward in float64
(``emulate``: causal self-attention, GQA) with each operand's MXFP8 rounding switched on or off, and
with alternative rules (the row max of P rounded up to an integer, as before; P on the exact row max,
the rule now; a Delta consistent with dP; a row sum of the rounded P; K and V centered; Hadamard-rotated
Q and K; dS in 32-blocks along rows instead of 32x32 tiles), and prints the relative L2 error of O, dQ,
dK, dV against exact attention of the same bf16 inputs, with each layer's statistics (median row max
of P, channel bias, outliers). It also compares whole-model parameter gradients of ``--compare``
attentions (``train_lm.py --attn`` choices: ``hopper+c``, hybrids such as ``varlen/hopper:q``) with the
BF16 attention's at the same weights: on one batch, and with ``--bias-batches N`` over N batches, which
tensors' differences persist from batch to batch (a fixed error, which AdamW's momentum follows).

    python3 scripts/operand_probe.py --attn fa4 --compare hopper hopper+c --checkpoints 300 --out OUT [--quick]

Writes ``OUT/probe.json``. ``--quick`` leaves out the per-operand rows (each operand alone, each left out).
The emulation is written for obviousness, one sequence at a time, and is not a backend: the kernels'
own reference is ``jagged_attn.reference``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_lm  # noqa: E402
from jagged_attn import mx_format  # noqa: E402
from jagged_attn.centering import sequence_centers  # noqa: E402
from jagged_attn.metrics import cosine, relative_l2  # noqa: E402
from jagged_attn.offsets import sequence_ids  # noqa: E402
from jagged_attn.quantize import quantize_mxfp8  # noqa: E402
from jagged_attn.reference import default_softmax_scale, expand_kv, reduce_kv, visible_mask  # noqa: E402

# Each operand by the GEMM that reads it: forward q_f, k_f (S), p, v_s (P V); backward do_f, v_f (dP),
# do_s, p_dv (dV), ds (dQ, dK), q_s (dK), k_s (dQ). "_f": 32-blocks along head_dim, "_s": along tokens.
OPERANDS = ("q_f", "k_f", "p", "v_s", "do_f", "v_f", "do_s", "p_dv", "ds", "q_s", "k_s")
P_RULES = ("integer-max", "exact-max", "rounded-sum")


def _mx(x, offsets, axis):
    return quantize_mxfp8(x.float().contiguous(), offsets, axis=axis).dequantize().double()


def _hadamard(n, device):
    h = torch.ones(1, 1, dtype=torch.float64, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def _sequence_means(x, offsets):
    """float64 ``x [T, H, D]``: each row's sequence mean (``centering.sequence_centers``, broadcast to rows)."""
    return sequence_centers(x, offsets)[sequence_ids(offsets, x.shape[0])]


def _row_blocks(x):
    """``[..., M, N]`` MXFP8-rounded in 32-blocks along N (feature-axis MXFP8 of its rows, N zero-padded)."""
    *lead, m, n = x.shape
    pad = -n % 32
    rows = torch.nn.functional.pad(x.float(), (0, pad)).reshape(-1, n + pad)
    return _mx(rows, None, "feature").reshape(*lead, m, n + pad)[..., :n]


def emulate(q, k, v, do, offsets, rounded=(), *, p_rule="exact-max", delta="dout", center=False, rotate=False,
            ds_blocks="tiles"):
    """float64 (O, dQ, dK, dV) of causal attention with the ``rounded`` operands (``OPERANDS``) MXFP8-rounded.

    q, do ``[T, Hq, D]``, k, v ``[T, Hkv, D]``, offsets int64 ``[B + 1]``. ``p_rule``: P for P V as
    e4m3(exp2(s - m) * 2^8) with m the row max rounded up to an integer, or the exact row max, or the
    integer max with O and the LSE normalized by the rounded P's sum (and the backward's P from that LSE).
    ``delta``: Delta = rowsum(dO * O) from "dout" or from its MX values "do_f", or "consistent":
    rowsum(P * dP). ``center``: K and V less their sequence means (O gets V's back); ``rotate``: Q and K
    times a Hadamard matrix; ``ds_blocks``: "tiles" (32 x 32, the spec) or "rows"."""
    if p_rule not in P_RULES:
        raise ValueError(f"p_rule must be one of {P_RULES}")
    rounded = set(rounded)
    q, k, v, do = (x.double() for x in (q, k, v, do))
    heads_q, heads_kv, scale = q.shape[1], k.shape[1], default_softmax_scale(q.shape[-1])
    v_mean = _sequence_means(v, offsets) if center else torch.zeros_like(v)
    k = k - _sequence_means(k, offsets) if center else k
    v = v - v_mean
    if rotate:
        hadamard = _hadamard(q.shape[-1], q.device)
        q, k = q @ hadamard, k @ hadamard

    def operand(name, x, axis):
        return _mx(x, offsets, axis) if name in rounded else x

    q_f, k_f = operand("q_f", q, "feature"), operand("k_f", k, "feature")
    q_s, k_s = operand("q_s", q, "sequence"), operand("k_s", k, "sequence")
    v_s, v_f = operand("v_s", v, "sequence"), operand("v_f", v, "feature")
    do_f, do_s = operand("do_f", do, "feature"), operand("do_s", do, "sequence")
    out, dq, dk, dv = torch.zeros_like(q), torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    bounds = offsets.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue
        rows = slice(a, b)
        s = torch.einsum("qhd,khd->hqk", q_f[rows], expand_kv(k_f[rows], heads_q)) * scale
        s = s.masked_fill(~visible_mask(b - a, b - a, True, q.device), -math.inf)
        row_max = s.amax(-1, keepdim=True)
        row_sum = torch.exp(s - row_max).sum(-1, keepdim=True)
        p_fwd = torch.exp(s - row_max) / row_sum
        p_bwd = p_fwd
        if "p" in rounded:
            m2 = row_max / math.log(2)
            anchor = m2 if p_rule == "exact-max" else torch.ceil(m2)
            p_rounded = mx_format.quantize_p(torch.exp2(s / math.log(2) - anchor).float()).double()
            if p_rule == "rounded-sum":
                rounded_sum = p_rounded.sum(-1, keepdim=True)
                p_fwd = p_rounded / rounded_sum
                p_bwd = torch.exp(s - anchor * math.log(2) - rounded_sum.log())
            else:
                p_fwd = p_rounded / (row_sum * torch.exp2(m2 - anchor))
        o = torch.einsum("hqk,khd->qhd", p_fwd, expand_kv(v_s[rows], heads_q))
        out[rows] = o
        p_dv = mx_format.quantize_p(p_bwd.float()).double() if "p_dv" in rounded else p_bwd
        dv[rows] = reduce_kv(torch.einsum("hqk,qhd->khd", p_dv, do_s[rows]), heads_kv)
        dp = torch.einsum("qhd,khd->hqk", do_f[rows], expand_kv(v_f[rows], heads_q))
        if delta == "consistent":
            row_delta = (p_bwd * dp).sum(-1, keepdim=True)
        else:
            source = do_f[rows] if delta == "do_f" else do[rows]
            row_delta = (source * o).sum(-1).transpose(0, 1).unsqueeze(-1)
        ds = p_bwd * (dp - row_delta)
        ds_q = ds_k = ds
        if "ds" in rounded and ds_blocks == "tiles":
            ds_q = ds_k = mx_format.fake_quantize_square_tiles(ds.float()).double()
        elif "ds" in rounded:
            ds_q, ds_k = _row_blocks(ds), _row_blocks(ds.transpose(-1, -2)).transpose(-1, -2)
        dq[rows] = torch.einsum("hqk,khd->qhd", ds_q, expand_kv(k_s[rows], heads_q)) * scale
        dk[rows] = reduce_kv(torch.einsum("hqk,qhd->khd", ds_k, q_s[rows]) * scale, heads_kv)
    if rotate:
        dq, dk = dq @ hadamard.T, dk @ hadamard.T
    return out + expand_kv(v_mean, heads_q), dq, dk, dv


def layer_statistics(q, k, v, do, offsets):
    """Per tensor: largest and mean |channel mean| / channel spread, largest channel amax over the
    median; for the attention of the first sequence of >= 64 tokens: median row max of P."""
    stats = {}
    for name, x in (("q", q), ("k", k), ("v", v), ("do", do)):
        x = x.double()
        mean = _sequence_means(x, offsets)
        bias = mean.abs().mean(0) / (x - mean).pow(2).mean(0).sqrt().clamp_min(1e-30)
        amax = x.abs().amax(0)
        stats[name] = dict(bias_max=float(bias.max()), bias_mean=float(bias.mean()),
                           outlier=float((amax.amax(-1) / amax.median(-1).values).max()))
    bounds = offsets.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b - a >= 64:
            s = torch.einsum("qhd,khd->hqk", q[a:b].double(), expand_kv(k[a:b].double(), q.shape[1]))
            s = s * default_softmax_scale(q.shape[-1])
            s = s.masked_fill(~visible_mask(b - a, b - a, True, q.device), -math.inf)
            stats["median_row_max_of_p"] = float(torch.softmax(s, -1).amax(-1).median())
            break
    return stats


def layer_errors(q, k, v, do, offsets, quick):
    """config -> [O, dQ, dK, dV] relative errors against exact attention."""
    exact = emulate(q, k, v, do, offsets)
    configs = {
        "spec, P on the integer max": dict(rounded=OPERANDS, p_rule="integer-max"),
        "spec, P on the integer max, centered": dict(rounded=OPERANDS, p_rule="integer-max", center=True),
        "spec, P on the integer max, Delta consistent": dict(rounded=OPERANDS, p_rule="integer-max",
                                                               delta="consistent"),
        "spec, P on the integer max, rounded-P row sum": dict(rounded=OPERANDS, p_rule="rounded-sum"),
        "spec (P on the exact max)": dict(rounded=OPERANDS),
        "spec, centered": dict(rounded=OPERANDS, center=True),
        "spec, Delta from dO's MX values": dict(rounded=OPERANDS, delta="do_f"),
        "spec, dS in row blocks": dict(rounded=OPERANDS, ds_blocks="rows"),
        "spec, Hadamard Q and K": dict(rounded=OPERANDS, rotate=True),
    }
    if not quick:
        configs.update({f"all but {x}": dict(rounded=[o for o in OPERANDS if o != x]) for x in OPERANDS})
        configs.update({f"only {x}": dict(rounded=[x]) for x in OPERANDS})
    return {name: [relative_l2(g, e) for g, e in zip(emulate(q, k, v, do, offsets, **kw), exact)]
            for name, kw in configs.items()}


def _capture(model, batch, attend, device):
    """[q, k, v, dO] of every layer's attention on ``batch`` (one forward and backward)."""
    layers = []

    def capturing(q, k, v, offsets, max_len):
        out = attend(q, k, v, offsets, max_len)
        entry = [q.detach().clone(), k.detach().clone(), v.detach().clone(), None]
        layers.append(entry)
        out.register_hook(lambda g: entry.__setitem__(3, g.detach().clone()))
        return out

    _gradients(model, batch, capturing, device)
    return layers


def _gradients(model, batch, attend, device):
    """({parameter name: its gradient flattened in float64}, loss) on ``batch``."""
    tokens, offsets = (x.to(device) for x in batch)
    model.zero_grad(set_to_none=True)
    with train_lm.autocast_for(device):
        loss = train_lm.next_byte_loss(model, tokens, offsets, attend)
    loss.backward()
    grads = {name: p.grad.flatten().double() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads, float(loss.detach())


def _agreement(grad, reference):
    """Cosine and relative L2 difference of a gradient against the reference one."""
    return dict(cosine=cosine(grad, reference), relative=relative_l2(grad, reference))


def probe(model, batch, probe_batch, attend, compare, device, quick):
    """Per compared backend, the whole model's gradient against the BF16 attention's and each parameter
    tensor's (AdamW scales every tensor's update by its own gradient's size, so a small tensor's
    direction error counts as much as a large one's), and per layer the emulated operand errors."""
    reference, loss = _gradients(model, batch, attend, device)
    report = dict(loss=loss, gradients={}, layers=[])
    for name, other in compare.items():
        grads, other_loss = _gradients(model, batch, other, device)
        report["gradients"][name] = dict(
            **_agreement(torch.cat(list(grads.values())), torch.cat(list(reference.values()))), loss=other_loss,
            tensors={tensor: _agreement(grads[tensor], reference[tensor]) for tensor in reference})
    offsets = probe_batch[1].to(device)
    for q, k, v, do in _capture(model, probe_batch, attend, device):
        report["layers"].append(dict(statistics=layer_statistics(q, k, v, do, offsets),
                                     errors=layer_errors(q, k, v, do, offsets, quick)))
    return report


def gradient_bias(model, batches, attend, compare, device):
    """Per compared backend and parameter tensor, the gradient differences from the BF16 attention's on
    each of ``batches`` at the same weights, d_b: ``persistence`` = |sum d_b|^2 / sum |d_b|^2 (1 when
    the differences are independent from batch to batch, len(batches) when they are one fixed error) and
    ``drift`` = |sum d_b| / |sum g_b| (the persistent part against the gradient that survives averaging,
    which is what AdamW's momentum follows)."""
    totals = {name: {} for name in compare}
    for batch in batches:
        reference, _ = _gradients(model, batch, attend, device)
        for name, other in compare.items():
            grads, _ = _gradients(model, batch, other, device)
            for tensor, g in reference.items():
                d = grads[tensor] - g
                acc = totals[name].setdefault(tensor, dict(d=torch.zeros_like(g), g=torch.zeros_like(g),
                                                           d2=g.new_zeros(())))
                acc["d"] += d
                acc["g"] += g
                acc["d2"] += d.square().sum()  # on the device: no wait per tensor and batch
    return {name: {tensor: dict(persistence=float(a["d"].square().sum() / a["d2"].clamp_min(1e-300)),
                                drift=float(a["d"].norm() / a["g"].norm().clamp_min(1e-300)))
                   for tensor, a in per_tensor.items()}
            for name, per_tensor in totals.items()}


WORST_TENSORS = 6


def print_bias(step, bias, count):
    print(f"\n=== step {step}: gradient differences over {count} batches (persistence 1: independent, "
          f"{count}: one fixed error)")
    for name, tensors in bias.items():
        ranked = sorted(tensors.items(), key=lambda item: -item[1]["drift"])
        print(f"  {name}: largest drift (persistent difference / averaged gradient, persistence):")
        for tensor, b in ranked[:2 * WORST_TENSORS]:
            print(f"    {tensor:32s} drift {b['drift']:.4f}  persistence {b['persistence']:.2f}")


def print_report(step, report):
    print(f"\n=== step {step}, loss {report['loss']:.4f}: model gradients against the BF16 attention's")
    for name, g in report["gradients"].items():
        print(f"  {name:12s} cosine {g['cosine']:.5f}, relative difference {g['relative']:.4f}, loss {g['loss']:.4f}")
        worst = sorted(g["tensors"].items(), key=lambda item: item[1]["cosine"])[:WORST_TENSORS]
        print("    least aligned tensors: " + ", ".join(f"{t} {a['cosine']:.4f} ({a['relative']:.3f})"
                                                        for t, a in worst))
    for i, layer in enumerate(report["layers"]):
        print(f"--- layer {i}: {json.dumps(layer['statistics'])}")
        print(f"    {'configuration':48s}      O     dQ     dK     dV")
        for name, errors in layer["errors"].items():
            print(f"    {name:48s} " + " ".join(f"{e:6.3f}" for e in errors))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", nargs="*", default=["hopper"], help="train_lm --attn choices")
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[300])
    parser.add_argument("--probe-tokens", type=int, default=20000)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--bias-batches", type=int, default=0,
                        help="also: which tensors' gradient differences persist over this many batches")
    ours, rest = parser.parse_known_args(argv)
    args = train_lm.parse_args(rest)  # --attn (one), model, data and optimizer as train_lm's
    device = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)
    train_docs, _ = train_lm.documents(args.corpus, args.max_doc, args.max_files)
    batches = train_lm.packed_batches(train_docs, args.batch_tokens, args.seed)
    tokens, offsets = batches[-1]
    cut = int((offsets <= ours.probe_tokens).nonzero().max())
    probe_batch = (tokens[:int(offsets[cut])], offsets[:cut + 1])
    attend = train_lm.attention_function(args.attn[0])
    compare = {name: train_lm.attention_function(name) for name in ours.compare}
    model, optimizer, schedule = train_lm.training_setup(args, device)
    reports = {}
    for step in range(max(ours.checkpoints) + 1):
        if step in ours.checkpoints:
            start = time.time()
            reports[step] = probe(model, batches[step % len(batches)], probe_batch, attend, compare, device, ours.quick)
            print_report(step, reports[step])
            if ours.bias_batches:
                following = [batches[(step + 1 + b) % len(batches)] for b in range(ours.bias_batches)]
                reports[step]["bias"] = gradient_bias(model, following, attend, compare, device)
                print_bias(step, reports[step]["bias"], ours.bias_batches)
            print(f"(probe of step {step}: {time.time() - start:.0f} s)")
            with open(os.path.join(args.out, "probe.json"), "w") as f:
                json.dump(reports, f, indent=1)
        if step < max(ours.checkpoints):
            train_lm.training_step(model, optimizer, schedule, batches[step % len(batches)], attend, device)
    return reports


if __name__ == "__main__":
    main()
