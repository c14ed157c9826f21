"""The ``jagged-attn demo`` job: a ragged batch through MXFP8 attention, forward and backward,
with its accuracy against float64 attention on the unquantized inputs and its time."""

from __future__ import annotations

import time

import torch

from .backends import auto_backend_name
from .interface import jagged_attention
from .jagged import JaggedTensor
from .metrics import cosine, relative_l2
from .quantize import quantize_mxfp8
from .reference import reference_backward, reference_forward

DEFAULT_LENGTHS = (0, 1, 31, 33, 128, 129, 257, 700)


def _synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_demo(lengths=DEFAULT_LENGTHS, heads_q=8, heads_kv=2, head_dim=128, causal=True, backend="auto",
             device=None, repeats=3, print_fn=print) -> dict:
    """Run the demo and return its measurements (also printed through ``print_fn``)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend_name = auto_backend_name(device) if backend == "auto" else backend
    lengths = torch.tensor(lengths, dtype=torch.int64)
    total = int(lengths.sum())

    def make(heads):
        return torch.randn(total, heads, head_dim, device=device, dtype=dtype)

    q, k, v = make(heads_q), make(heads_kv), make(heads_kv)
    batch = JaggedTensor.from_lengths(q, lengths.to(device))
    offsets = batch.offsets
    print_fn(f"ragged batch: {batch.batch_size} sequences, lengths {lengths.tolist()}, {total} tokens, "
             f"Hq={heads_q} Hkv={heads_kv} D={head_dim}, {dtype}, causal={causal}, device={device}")

    q_mx = quantize_mxfp8(q, offsets, axis="feature")
    print_fn(f"MXFP8 Q: data {tuple(q_mx.data.shape)} {q_mx.data.dtype}, scales {tuple(q_mx.scales.shape)} "
             f"{q_mx.scales.dtype}; quantization rel-L2 {relative_l2(q_mx.dequantize(), q):.2e}")

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    dout = torch.randn_like(q)
    times = []
    for _ in range(repeats):
        for x in leaves:
            x.grad = None
        _synchronize(device)
        start = time.perf_counter()
        out = jagged_attention(*leaves, offsets, causal=causal, backend=backend_name)
        out.backward(dout)
        _synchronize(device)
        times.append(time.perf_counter() - start)

    exact = [x.to(torch.float64) for x in (q, k, v)]
    ref_out, ref_lse = reference_forward(*exact, offsets, offsets, causal=causal, compute_dtype=torch.float64,
                                         fp8=False)
    ref_grads = reference_backward(dout.to(torch.float64), *exact, ref_out, ref_lse, offsets, offsets, causal=causal,
                                   compute_dtype=torch.float64, fp8=False)
    results = {"backend": backend_name, "device": str(device), "seconds_fwd_bwd": min(times)}
    print_fn(f"\n{'tensor':<6} {'rel-L2 vs fp64':>15} {'cosine vs fp64':>15}")
    for name, got, ref in zip(("O", "dQ", "dK", "dV"), (out, *(x.grad for x in leaves)), (ref_out, *ref_grads)):
        results[name] = {"rel_l2": relative_l2(got, ref), "cosine": cosine(got, ref)}
        print_fn(f"{name:<6} {results[name]['rel_l2']:>15.3e} {results[name]['cosine']:>15.6f}")
    print_fn(f"\nbackend={backend_name}: forward+backward {1e3 * results['seconds_fwd_bwd']:.1f} ms "
             f"(best of {repeats})")
    return results
