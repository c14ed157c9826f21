"""torch.library custom ops (with fake implementations and autograd) behind ``jagged_attention``.

* ``jagged_attn::attention``: high-precision q, k, v -> (out, lse); differentiable in q, k, v through
  both outputs (quantization is straight-through), its backward is ``jagged_attn::attention_backward``.
  Under ``torch.autocast`` (CPU or CUDA) q, k, v are cast to the autocast dtype first, as SDPA's are.
* ``jagged_attn::mxfp8_attention``: pre-quantized operands (data + tiled scales) -> (out, lse).

All three run with autocast off inside.

The ops take a resolved backend name; validation happens in ``interface.py`` before they run.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .backends import get_backend
from .mxfp8 import mxfp8_without_value_checks


@torch.library.custom_op("jagged_attn::attention", mutates_args=())
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets_q: torch.Tensor, offsets_k: torch.Tensor,
    causal: bool, softmax_scale: float, backend: str, deterministic: bool, v_axis: str, check_finite: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``deterministic`` only matters to the backward (bit-identical gradients run to run); with
    ``check_finite`` NaN/Inf in q, k or v raise ValueError (the backend reads them with its kernels)."""
    # Whether a backward is to come: inside the op autograd is off, but inputs made with it keep requires_grad
    # (inputs that require a gradient under no_grad make the passes write copies no backward takes; they
    # are freed with k).
    for_backward = any(t.requires_grad for t in (q, k, v))
    return get_backend(backend).forward_hp(q, k, v, offsets_q, offsets_k, causal, softmax_scale, v_axis, check_finite,
                                           for_backward)


@attention_op.register_fake
def _(q, k, v, offsets_q, offsets_k, causal, softmax_scale, backend, deterministic, v_axis, check_finite):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("jagged_attn::attention_backward", mutates_args=())
def attention_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    offsets_q: torch.Tensor, offsets_k: torch.Tensor, causal: bool, softmax_scale: float, backend: str,
    deterministic: bool, dlse: Optional[torch.Tensor] = None,  # noqa: UP045
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the gradient of O (``dout``) and, unless None, of the LSE (``dlse`` ``[total_q, Hq]``;
    rows whose LSE is -inf saw no key and get no gradient from it)."""
    if dlse is not None:
        dlse = torch.where(lse == -math.inf, 0.0, dlse.to(torch.float32)).contiguous()
    grads = get_backend(backend).backward(
        dout.contiguous(), q, k, v, out, lse, offsets_q, offsets_k, causal, softmax_scale, deterministic, dlse
    )
    return tuple(g.contiguous() for g in grads)


@attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, offsets_q, offsets_k, causal, softmax_scale, backend, deterministic, dlse=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def save_for_attention_backward(ctx, q, k, v, out, lse, offsets_q, offsets_k, causal, softmax_scale, backend,
                                deterministic):
    """What :func:`attention_gradients` needs, saved on an autograd ``ctx`` (by every attention op)."""
    ctx.save_for_backward(q, k, v, out, lse, offsets_q, offsets_k)
    ctx.causal, ctx.softmax_scale, ctx.backend, ctx.deterministic = causal, softmax_scale, backend, deterministic


def attention_gradients(ctx, dout, dlse=None):
    """(dq, dk, dv) from ``jagged_attn::attention_backward`` on what the forward saved; ``dout`` may be None
    (O took no part in the loss) when ``dlse`` is not."""
    q, k, v, out, lse, offsets_q, offsets_k = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    return attention_backward_op(
        dout, q, k, v, out, lse, offsets_q, offsets_k, ctx.causal, ctx.softmax_scale, ctx.backend, ctx.deterministic,
        dlse,
    )


def _setup_context(ctx, inputs, output):
    q, k, v, offsets_q, offsets_k, causal, softmax_scale, backend, deterministic, v_axis, check_finite = inputs
    # An output the loss does not use gets None, not zeros: the backward then skips the LSE's term.
    ctx.set_materialize_grads(False)
    save_for_attention_backward(ctx, q, k, v, *output, offsets_q, offsets_k, causal, softmax_scale, backend,
                                deterministic)


def _backward(ctx, dout, dlse):
    if dout is None and dlse is None:
        return (None,) * 11
    return *attention_gradients(ctx, dout, dlse), None, None, None, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("jagged_attn::mxfp8_attention", mutates_args=())
def mxfp8_attention_op(
    q_data: torch.Tensor, q_scales: torch.Tensor, k_data: torch.Tensor, k_scales: torch.Tensor,
    v_data: torch.Tensor, v_scales: torch.Tensor, offsets_q: torch.Tensor, offsets_k: torch.Tensor,
    causal: bool, softmax_scale: float, backend: str, v_axis: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    # checked by their MXFP8Jagged when it was made: not read again per call (a compiled graph calls this
    # op outside jagged_attention, whose value_checks(False) would cover it)
    q = mxfp8_without_value_checks(q_data, q_scales, offsets_q, "feature")
    k = mxfp8_without_value_checks(k_data, k_scales, offsets_k, "feature")
    v = mxfp8_without_value_checks(v_data, v_scales, offsets_k, v_axis)
    return get_backend(backend).forward_mx(q, k, v, causal, softmax_scale, torch.bfloat16)


@mxfp8_attention_op.register_fake
def _(q_data, q_scales, k_data, k_scales, v_data, v_scales, offsets_q, offsets_k, causal, softmax_scale, backend,
      v_axis):
    out = torch.empty(q_data.shape, dtype=torch.bfloat16, device=q_data.device)
    return out, q_data.new_empty(q_data.shape[:2], dtype=torch.float32)


_LIBRARY = torch.library.Library("jagged_attn", "FRAGMENT")  # holds the autocast kernels below


def autocast_inputs(device_type: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` as the attention runs them under autocast on ``device_type``: in its autocast dtype
    (float64 left as it is, as torch's autocast does)."""
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(x if x.dtype == torch.float64 else x.to(dtype) for x in tensors)


def _register_autocast(device_type: str) -> None:
    """Under autocast on ``device_type`` the attention casts q, k, v to the autocast dtype of that device
    type, read at the call (``torch.library.register_autocast`` fixes one dtype at registration), and
    leaves float64 as torch's autocast does; autograd records the casts, so gradients reach the inputs
    in their own dtypes. Every op then runs with autocast off: it would move the reference's float32
    math to the autocast dtype (a backward called inside the autocast region included)."""
    key = f"Autocast{device_type.upper()}"

    def attention_under_autocast(_keyset, q, k, v, *rest):
        q, k, v = autocast_inputs(device_type, q, k, v)
        with torch.autocast(device_type, enabled=False):
            return attention_op(q, k, v, *rest)

    def without_autocast(op):
        def kernel(_keyset, *args):
            with torch.autocast(device_type, enabled=False):
                return op(*args)

        return kernel

    _LIBRARY.impl("attention", attention_under_autocast, key, with_keyset=True)
    for name, op in (("attention_backward", attention_backward_op), ("mxfp8_attention", mxfp8_attention_op)):
        _LIBRARY.impl(name, without_autocast(op), key, with_keyset=True)


AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")
for _device_type in AUTOCAST_DEVICE_TYPES:
    _register_autocast(_device_type)
