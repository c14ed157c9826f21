"""Attention backends: what each one runs, and which one ``backend="auto"`` picks.

Every backend offers the same three entry points:

* ``forward_mx(q, k, v, causal, softmax_scale, out_dtype) -> (out, lse)`` on ``MXFP8Jagged`` inputs
  (q, k on the feature axis, v on the sequence axis, or on the feature axis = per-token scales);
* ``forward_hp(q, k, v, offsets_q, offsets_k, causal, softmax_scale, v_axis, check_finite, for_backward)
  -> (out, lse)`` on bf16 / fp16 / fp32 tensors (quantizes them first, V along ``v_axis``; out in q's
  dtype; with ``check_finite`` raises ValueError for NaN/Inf in q, k or v, read once its kernels are
  queued: the Hopper kernels flag NaN/Inf in their own pass over the inputs; with ``for_backward``, a
  backward on these inputs is to come: the kernel backends' passes over K and V then also write the
  backward's copies of them, kept for it);
* ``backward(dout, q, k, v, out, lse, offsets_q, offsets_k, causal, softmax_scale, deterministic, dlse=None)
  -> (dq, dk, dv)`` on the high-precision tensors saved by the forward; ``dlse`` (fp32 ``[total_q, Hq]``,
  zero where the LSE is -inf) is the gradient of the LSE, None where it has none.

``reference`` is the spec in plain torch (any device). The kernel backends are named for the
hardware path they run:

* ``hopper`` (what ``auto`` picks on sm_90): the Hopper Gluon kernels with every GEMM in FP8 wgmma,
  S and dP included, whose reduced-precision accumulation puts O 1-4e-2 and the gradients 2e-2 to
  2e-1 from the reference where scores are large (outlier channels, heavy-tailed norms, peaked
  attention);
* ``hopper-exact-scores``: the same kernels with S = QK^T (and the backward's dP = dO V^T) exact
  from bf16 wgmma on the MX values: O within ~4e-3 and gradients within ~5e-3 of the reference on
  every input kind (docs/perf-history.md), at ~0.9x the forward's and 0.8-0.9x the backward's speed
  at head_dim 128;
* ``block-scaled``: the spec-exact ``tl.dot_scaled`` kernels (native block-scaled MMA on sm_100+,
  emulated by Triton on sm_90);
* ``portable``: the same algorithm and operands as ``hopper`` in plain Triton, one program per tile
  (``jagged_attn/kernels/portable``): what ``auto`` picks on sm_89 (e4m3 ``mma.sync``) and what the CPU
  interpreter runs (CI); it runs on Hopper too, slower.

The names of the previous release (``triton``, ``triton-fast``, ``exact``) still resolve, with a
DeprecationWarning (``DEPRECATED_NAMES``).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import triton

from .devices import on_device_of
from .kernels.portable import backward as portable_bwd, forward as portable_fwd
from .kernels.sm90 import backward as hopper_bwd, forward as hopper_fwd
from .kernels.sm100 import block_scaled as block_scaled_kernels
from .mx_format import saturating_cast
from .mxfp8 import checked_after, largest_magnitudes
from .quantize import quantize_mxfp8, quantize_mxfp8_dual
from .reference import reference_backward, reference_forward, softmax_delta

BACKENDS = ("auto", "reference", "hopper", "hopper-exact-scores", "block-scaled", "portable")
# The previous release's names: resolved with a DeprecationWarning until the next release drops them.
DEPRECATED_NAMES = {"triton": "hopper-exact-scores", "triton-fast": "hopper", "exact": "block-scaled"}


@dataclass(frozen=True)
class Backend:
    name: str
    forward_mx: Callable
    forward_hp: Callable
    backward: Callable
    head_dims: tuple[int, ...] | None  # what its kernels support, forward and backward; None: any multiple of 32


def _reference_forward_mx(q, k, v, causal, softmax_scale, out_dtype):
    out, lse = reference_forward(
        q.dequantize(), k.dequantize(), v.dequantize(), q.offsets, k.offsets, causal=causal, softmax_scale=softmax_scale
    )
    return saturating_cast(out, out_dtype), lse.to(torch.float32)


def _quantize_inputs(q, k, v, offsets_q, offsets_k, v_axis="sequence"):
    """The forward's MXFP8 operands: Q, K along head_dim, V along ``v_axis`` (RCEIL)."""
    return (
        quantize_mxfp8(q, offsets_q, axis="feature"),
        quantize_mxfp8(k, offsets_k, axis="feature"),
        quantize_mxfp8(v, offsets_k, axis=v_axis),
    )


def _with_finite_check(check_finite, q, k, v, forward):
    """``forward()``, with (if ``check_finite``) q, k, v's NaN/Inf check read once it is queued."""
    return checked_after(largest_magnitudes((q, k, v)) if check_finite else None, ("q", "k", "v"), forward)


def _reference_forward_hp(q, k, v, offsets_q, offsets_k, causal, softmax_scale, v_axis, check_finite, for_backward):
    def forward():
        mx = _quantize_inputs(q, k, v, offsets_q, offsets_k, v_axis)
        return _reference_forward_mx(*mx, causal, softmax_scale, q.dtype)

    return _with_finite_check(check_finite, q, k, v, forward)


def _reference_backward(dout, q, k, v, out, lse, offsets_q, offsets_k, causal, softmax_scale, deterministic,
                        dlse=None):
    grads = reference_backward(
        dout, q, k, v, out, lse, offsets_q, offsets_k, causal=causal, softmax_scale=softmax_scale, dlse=dlse
    )
    return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))


def _block_scaled_backward(dout, q, k, v, out, lse, offsets_q, offsets_k, causal, softmax_scale, deterministic,
                           dlse=None):
    """The block-scaled kernels' backward on operands rounded exactly as ``reference_backward`` rounds
    them (on CUDA one read of Q, K and dO makes both of their layouts); deterministic whatever
    ``deterministic`` says (dQ has its own kernel, no atomics)."""
    with on_device_of(q):
        operands = block_scaled_kernels.BackwardOperands(
            *quantize_mxfp8_dual(q, offsets_q), *quantize_mxfp8_dual(k, offsets_k),
            quantize_mxfp8(v, offsets_k, axis="feature"), *quantize_mxfp8_dual(dout, offsets_q))
        return block_scaled_kernels.attention_backward(
            operands, lse, softmax_delta(dout, out, dlse), causal=causal, softmax_scale=softmax_scale,
            dtypes=(q.dtype, k.dtype, v.dtype))


def _kernel_backend(name: str, fwd, bwd, options: dict, backward: Callable | None = None) -> Backend:
    """A backend whose kernels are the modules ``fwd`` and ``bwd`` of ``jagged_attn.kernels``; every entry
    point gets ``options`` as keywords. ``backward`` replaces the backward module's own
    ``attention_backward`` where the front end rounds the operands."""

    def forward_mx(q, k, v, causal, softmax_scale, out_dtype):
        with on_device_of(q.data):
            return fwd.attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, out_dtype=out_dtype,
                                         **options)

    def forward_hp(q, k, v, offsets_q, offsets_k, causal, softmax_scale, v_axis, check_finite, for_backward):
        if not hasattr(fwd, "attention_forward_hp"):
            return _with_finite_check(check_finite, q, k, v, lambda: forward_mx(
                *_quantize_inputs(q, k, v, offsets_q, offsets_k), causal, softmax_scale, q.dtype))
        with on_device_of(q):
            return fwd.attention_forward_hp(q, k, v, offsets_q, offsets_k, causal=causal, softmax_scale=softmax_scale,
                                            check_finite=check_finite, for_backward=for_backward, **options)

    def module_backward(dout, q, k, v, out, lse, offsets_q, offsets_k, causal, softmax_scale, deterministic,
                        dlse=None):
        with on_device_of(q):
            return bwd.attention_backward(dout, q, k, v, out, lse, offsets_q, offsets_k, causal=causal,
                                          softmax_scale=softmax_scale, deterministic=deterministic, dlse=dlse,
                                          **options)

    head_dims = tuple(sorted(set(fwd.HEAD_DIMS) & set(bwd.HEAD_DIMS)))
    return Backend(name, forward_mx, forward_hp, backward or module_backward, head_dims)


_REFERENCE = Backend("reference", _reference_forward_mx, _reference_forward_hp, _reference_backward, None)
_KERNEL_BACKENDS = {  # name: (forward module, backward module, options of both[, the front end's backward])
    "hopper": (hopper_fwd, hopper_bwd, {"scores": "fp8"}),
    "hopper-exact-scores": (hopper_fwd, hopper_bwd, {"scores": "bf16"}),
    "block-scaled": (block_scaled_kernels, block_scaled_kernels, {}, _block_scaled_backward),
    "portable": (portable_fwd, portable_bwd, {}),
}
HOPPER_BACKENDS = ("hopper", "hopper-exact-scores")
INTERPRETED_BACKENDS = ("portable", "block-scaled")  # plain Triton: the CPU interpreter runs them
PORTABLE_CAPABILITY = (8, 9)  # the oldest GPU with e4m3 MMAs, which the portable kernels need


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def check_kernel_device(name: str, device: torch.device) -> None:
    """Raise ValueError unless backend ``name`` can run on ``device``."""
    if name == "reference":
        return
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        sm = f"sm_{capability[0]}{capability[1]}"
        if name in HOPPER_BACKENDS and capability[0] != 9:
            raise ValueError(f"backend={name!r} is a Hopper (sm_90) path; this GPU is {sm}: use 'auto'")
        if name == "block-scaled" and capability[0] < 9:
            raise ValueError(f"backend='block-scaled' needs sm_90 or newer; this GPU is {sm}")
        if name == "portable" and capability < PORTABLE_CAPABILITY:
            raise ValueError(f"backend='portable' needs e4m3 MMAs (sm_89 or newer); this GPU is {sm}: "
                             "use 'reference'")
        return
    if device.type == "cpu" and _interpreting():  # the Triton CPU interpreter (tests)
        if name in INTERPRETED_BACKENDS:
            return
        raise ValueError(f"backend={name!r} runs Gluon kernels, which the Triton CPU interpreter cannot run: "
                         f"use one of {INTERPRETED_BACKENDS} there")
    raise ValueError(f"backend={name!r} needs a CUDA GPU (or TRITON_INTERPRET=1 on CPU); use backend='reference'")


def check_head_dim(name: str, head_dim: int) -> None:
    """Raise ValueError unless backend ``name``'s kernels run at ``head_dim``."""
    head_dims = get_backend(name).head_dims
    if head_dims is not None and head_dim not in head_dims:
        raise ValueError(f"backend={name!r} supports head_dim in {head_dims}, got {head_dim}")


# Run, not traced, under torch.compile: the warning is a side effect dynamo cannot trace.
@torch.compiler.assume_constant_result
def auto_backend_name(device: torch.device) -> str:
    """``hopper`` on Hopper, ``block-scaled`` on Blackwell and newer, ``portable`` on sm_89, ``reference``
    elsewhere: quietly on CPU, on older CUDA GPUs with a UserWarning (once per process for each sm).

    On Hopper, S and dP from FP8 wgmma are as close to exact attention (fp64, unquantized inputs) as the
    reference backend is on most draws of every input kind of the accuracy tests, not on all: on heavy-tailed
    and outlier-channel inputs some draws' gradients miss the tests' bars, which S's FP8 accumulation makes
    (docs/DESIGN.md section 6); ``hopper-exact-scores`` meets them, slower."""
    if device.type != "cuda":
        return "reference"
    capability = torch.cuda.get_device_capability(device)
    if capability[0] == 9:
        return "hopper"
    if capability[0] >= 10:
        return "block-scaled"
    if capability >= PORTABLE_CAPABILITY:
        return "portable"
    _warn_reference_on_gpu(f"sm_{capability[0]}{capability[1]}")
    return "reference"


@functools.lru_cache(maxsize=None)
def _warn_reference_on_gpu(sm: str) -> None:
    warnings.warn(f"backend='auto' runs the reference backend (MXFP8 attention in plain PyTorch, far slower than "
                  f"the kernels) on this {sm} GPU: the kernel backends need e4m3 MMAs (sm_89 or newer). "
                  "Pass backend='reference' to choose it without this warning.", UserWarning, stacklevel=4)


# Run, not traced, under torch.compile, as auto_backend_name: the warning is a side effect.
@torch.compiler.assume_constant_result
def backend_name(name: str) -> str:
    """The backend ``name`` means: itself for a name in ``BACKENDS``, the new name for a deprecated one
    (with a DeprecationWarning, once per process for each name); ValueError for any other."""
    if name in DEPRECATED_NAMES:
        _warn_deprecated_name(name)
        return DEPRECATED_NAMES[name]
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


@functools.lru_cache(maxsize=None)
def _warn_deprecated_name(name: str) -> None:
    warnings.warn(f"backend={name!r} is deprecated and will be removed in the next release: it is now called "
                  f"{DEPRECATED_NAMES[name]!r}", DeprecationWarning, stacklevel=4)


@functools.lru_cache(maxsize=None)
def get_backend(name: str) -> Backend:
    """The backend called ``name`` (a name of ``BACKENDS`` other than ``auto``)."""
    if name == "reference":
        return _REFERENCE
    if name not in _KERNEL_BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return _kernel_backend(name, *_KERNEL_BACKENDS[name])
