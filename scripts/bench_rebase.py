"""Benchmark: the Hopper forward's rebasing producers (jagged_attn/kernels/producers/rebase.py) against a device copy.

For bf16 K and V ``[tokens, heads, dim]`` in four batches of the same token count (dense 8
sequences, one long sequence, ragged lengths up to 4096, 256-token sequences) it times, as ``sm90.forward`` calls them:
K's feature rebase (exact: bf16 copies of the MX values; fp8: e4m3 on one exponent per KV tile) and
V's sequence rebase (both passes: exponents, then the transposed e4m3), from the bf16 values and
from their MXFP8 form (``quantize_mxfp8``: e4m3 data and tiled scales read instead), and both
as training runs them (``quantize_rebase_kv(..., keep_for=<the Hopper backward's preparation>)``: the
same passes also writing the backward's e4m3 copies of K and V, which count among the bytes written).
GB/s = (input bytes read once + bytes written) / time, against a device-to-device copy that reads
and writes the same total in the same run (the V rebase reads its input twice: its share of
copy speed can reach ~3/5 at most). Median of ``triton.testing.do_bench``.

    python3 scripts/bench_rebase.py [--tokens 65536] [--heads 16] [--dim 128] [--feature-warps 4 8]
                                    [--sequence-configs 128:4 64:4 32:4]

``--feature-warps`` and ``--sequence-configs`` (``channels:warps``) time other launch choices of
the same kernels (``rebase.FEATURE_CONFIG``; ``rebase.SEQUENCE_CONFIGS``, the rebase pass's entry for
the input's kind; the exponent pass keeps ``rebase.EXPONENT_CONFIGS``), checked bit for bit against the
default's output. Prints one table; seconds on an H200.
"""

from __future__ import annotations

import argparse

import torch
import triton
from bench_rmsnorm_quantize import copy_ms, median_ms, nbytes, ragged_offsets
from jagged_attn import quantize_mxfp8
from jagged_attn.kernels.common import layout
from jagged_attn.kernels.producers import rebase
from jagged_attn.kernels.sm90 import backward as sm90_backward

BLOCK_N = 128  # the Gluon forward's KV tile: one K exponent per tile


def batches(tokens: int) -> dict:
    """Offsets of the batches (all of ``tokens`` tokens)."""
    dense = torch.arange(0, tokens + 1, tokens // 8, dtype=torch.int32)
    short = torch.arange(0, tokens + 1, 256, dtype=torch.int32)
    return {"dense 8 sequences": dense, "one sequence": torch.tensor([0, tokens], dtype=torch.int32),
            "ragged <= 4096": ragged_offsets(tokens, "cpu"), "256-token sequences": short}


def kv_for_training(k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor) -> list:
    """K's and V's forward operands as ``sm90.forward`` makes them when a backward is to come, and the
    backward's copies of K and V the same passes wrote (taken back, so each call keeps nothing; K's feature
    copy is its operand)."""
    preparation = sm90_backward.preparation()
    operands = rebase.quantize_rebase_kv(k, v, offsets, BLOCK_N, v_order=layout.PV_ORDER, keep_for=preparation)
    k_copies, v_copies = rebase.take_kv_copies(k, v, offsets, preparation)
    return [*operands, k_copies.feature_scale, k_copies.sequence, v_copies.feature, v_copies.feature_scale]


def output_bytes(producer) -> list:
    """``producer()``'s outputs as bytes, its allocations zero-filled: the producers leave padding no
    kernel reads uninitialized (columns between sequences' slots, factors of unused groups)."""
    empty = torch.empty
    torch.empty = torch.zeros
    try:
        return [t.contiguous().view(torch.uint8) for t in producer()]
    finally:
        torch.empty = empty


def timed(producer, config_name: str, config: dict, expected=None):
    """(median ms, outputs) of ``producer`` with ``rebase.<config_name>`` set to ``config``; the
    outputs must equal ``expected`` byte for byte where given."""
    default = getattr(rebase, config_name)
    setattr(rebase, config_name, config)
    try:
        outputs = output_bytes(producer)
        if expected is not None and not all(torch.equal(a, b) for a, b in zip(outputs, expected)):
            raise AssertionError(f"{config_name}={config} changed the output")
        return median_ms(producer), outputs
    finally:
        setattr(rebase, config_name, default)


def sequence_configs(args, kind: str) -> list:
    """(config name, SEQUENCE_CONFIGS with ``kind``'s entry replaced, label) for each ``--sequence-configs``
    entry, the default first."""
    default = rebase.SEQUENCE_CONFIGS[kind]
    specs = [f"{default['BLOCK_D']}:{default['num_warps']}", *args.sequence_configs]
    return [("SEQUENCE_CONFIGS", {**rebase.SEQUENCE_CONFIGS, kind: dict(BLOCK_D=int(c), num_warps=int(w))},
             f"{c} ch, {w} warps") for c, w in dict.fromkeys(tuple(spec.split(":")) for spec in specs)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--feature-warps", type=int, nargs="+", default=[rebase.FEATURE_CONFIG["num_warps"]])
    parser.add_argument("--sequence-configs", nargs="+", default=[])
    args = parser.parse_args()
    k, v = (torch.randn(args.tokens, args.heads, args.dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"K, V bf16 {tuple(k.shape)} = {nbytes(k) / 2**30:.3f} GiB each; * = default")
    feature = [("FEATURE_CONFIG", dict(num_warps=w), f"{w} warps") for w in args.feature_warps]
    rows = []
    for name, offsets in batches(args.tokens).items():
        offsets = offsets.cuda()
        mk, mv = quantize_mxfp8(k, offsets), quantize_mxfp8(v, offsets, axis="sequence")
        producers = (
            ("K feature, exact", (k,), lambda: rebase.quantize_rebase_feature(k, offsets, group=BLOCK_N, exact=True),
             feature),
            ("K feature, fp8", (k,), lambda: rebase.quantize_rebase_feature(k, offsets, group=BLOCK_N), feature),
            ("V sequence", (v,), lambda: rebase.quantize_rebase_sequence(v, offsets), sequence_configs(args, "values")),
            ("K feature, MX, exact", (mk.data, mk.scales), lambda: rebase.rebase_feature(mk, BLOCK_N, exact=True),
             feature),
            ("V sequence, MX", (mv.data, mv.scales), lambda: rebase.rebase_sequence(mv),
             sequence_configs(args, "mxfp8")),
            ("K + V, training", (k, v), lambda: kv_for_training(k, v, offsets), sequence_configs(args, "values")),
        )
        for what, sources, producer, configs in producers:
            expected = output_bytes(producer)
            moved = nbytes(*sources) + sum(t.numel() for t in expected)
            copy = copy_ms(moved)
            for config_name, config, label in configs:
                ms, _ = timed(producer, config_name, config, expected)
                marker = "*" if config == getattr(rebase, config_name) else ""
                rows.append((name, what, label + marker, ms * 1e3, moved / ms / 1e6, copy / ms))
    print(f"{'batch':<22}{'producer':<22}{'launch':<18}{'us':>8}{'GB/s':>8}{'of copy':>9}")
    for name, what, label, us, rate, share in rows:
        print(f"{name:<22}{what:<22}{label:<18}{us:8.0f}{rate:8.0f}{share:9.0%}")


if __name__ == "__main__":
    main()
