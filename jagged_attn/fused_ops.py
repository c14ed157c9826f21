"""Differentiable torch.library ops for a layer built from the fused MXFP8 producers.

* ``jagged_attn::linear_quantize``: ``y = x @ weight.T (+ bias)`` as bf16 ``[total, H, D]`` plus
  its feature-axis MXFP8 (data, tiled scales) and a NaN/Inf flag from the GEMM's epilogue
  (``jagged_attn/kernels/producers/linear_quantize.py``). Differentiable in x, weight, bias through ``y``: the ordinary
  linear gradients, in torch.
* ``jagged_attn::rms_norm_quantize``: RMSNorm over D of ``x [total, H, D]`` as (normalized, rstd)
  plus the normalized values' feature-axis MXFP8 and a NaN/Inf flag, from one read of ``x``
  (``jagged_attn/kernels/producers/rmsnorm_quantize.py``). Differentiable in x and weight through ``normalized``: the
  RMSNorm gradients from the saved rstd (torch's fused RMSNorm backward kernel on CUDA).
* ``jagged_attn::prequantized_attention``: attention whose Q and K arrive quantized (data +
  tiled scales, e.g. from the two ops above) next to their high-precision copies; V arrives in
  high precision. The forward uses the MXFP8 Q and K as they are; the backward is
  ``jagged_attn::attention_backward`` on the high-precision q, k, v (quantization is
  straight-through, as for ``jagged_attn::attention``).

The MXFP8 outputs are not differentiable: gradients reach the producers through the
high-precision outputs only. Inputs are validated by the caller (``nn.JaggedAttention``: the offsets
before the producers run; the producers' flags (fp32 ``[1]``, NaN/Inf if the result holds any) go to
``prequantized_attention``, which adds V's and reads them once the attention is queued), so nothing
waits for the device before the kernels are queued.
"""

from __future__ import annotations

from typing import Optional

import torch

from .backends import get_backend
from .devices import on_device_of
from .kernels.producers.linear_quantize import linear_quantize
from .kernels.producers.rmsnorm_quantize import rms_norm_quantize
from .mxfp8 import MXFP8Jagged, checked_after, scale_matrix_shape
from .offsets import value_checks
from .ops import attention_gradients, save_for_attention_backward
from .quantize import quantize_flagging_nonfinite
from .scale_layout import tiled_bytes


def _empty_feature_mxfp8(like: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake (data, scales) of a feature-axis MXFP8 quantization of ``like [total, H, D]``."""
    total, heads, dim = like.shape
    data = like.new_empty(like.shape, dtype=torch.float8_e4m3fn)
    scales = like.new_empty(heads, tiled_bytes(*scale_matrix_shape("feature", total, batch, dim)),
                            dtype=torch.float8_e8m0fnu)
    return data, scales


# The optional bias is annotated ``Optional[...]``: the form every torch's schema inference reads.
@torch.library.custom_op("jagged_attn::linear_quantize", mutates_args=())
def linear_quantize_op(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], offsets: torch.Tensor,  # noqa: UP045
    heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 ``x [total, in]``, ``weight [heads * D, in]`` -> (y bf16 ``[total, heads, D]``, e4m3 data, e8m0 scales,
    the NaN/Inf flag of y)."""
    nonfinite = torch.zeros(1, dtype=torch.float32, device=x.device)
    with on_device_of(x):
        mx, y = linear_quantize(x, weight, offsets, heads=heads, bias=bias, nonfinite=nonfinite)
    return y, mx.data, mx.scales, nonfinite


def _nonfinite_flag(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(1, dtype=torch.float32)


@linear_quantize_op.register_fake
def _(x, weight, bias, offsets, heads):
    y = x.new_empty(x.shape[0], heads, weight.shape[0] // heads)
    return (y, *_empty_feature_mxfp8(y, offsets.shape[0] - 1), _nonfinite_flag(y))


def _linear_setup_context(ctx, inputs, output):
    x, weight, bias, _, _ = inputs
    _, data, scales, nonfinite = output
    ctx.mark_non_differentiable(data, scales, nonfinite)
    ctx.save_for_backward(x, weight)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _linear_backward(ctx, dy, ddata, dscales, dnonfinite):
    x, weight = ctx.saved_tensors
    dy = dy.flatten(-2)
    dx = dy @ weight if ctx.needs_input_grad[0] else None
    dweight = dy.T @ x if ctx.needs_input_grad[1] else None
    dbias = dy.float().sum(0).to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
    return dx, dweight, dbias, None, None


linear_quantize_op.register_autograd(_linear_backward, setup_context=_linear_setup_context)


@torch.library.custom_op("jagged_attn::rms_norm_quantize", mutates_args=())
def rms_norm_quantize_op(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [total, H, D]``, ``weight [D]`` -> (normalized like x, rstd fp32 ``[total, H]``, e4m3 data, e8m0 scales,
    the NaN/Inf flag of the normalized values)."""
    nonfinite = torch.zeros(1, dtype=torch.float32, device=x.device)
    with on_device_of(x):
        mx, normalized, rstd = rms_norm_quantize(x, weight, offsets, eps=eps, nonfinite=nonfinite)
    return normalized, rstd, mx["feature"].data, mx["feature"].scales, nonfinite


@rms_norm_quantize_op.register_fake
def _(x, weight, offsets, eps):
    rstd = x.new_empty(x.shape[:2], dtype=torch.float32)
    return (torch.empty_like(x), rstd, *_empty_feature_mxfp8(x, offsets.shape[0] - 1), _nonfinite_flag(x))


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, _, _ = inputs
    _, rstd, data, scales, nonfinite = output
    ctx.mark_non_differentiable(rstd, data, scales, nonfinite)
    ctx.save_for_backward(x, weight, rstd)


def _rms_norm_backward(ctx, dnormalized, drstd, ddata, dscales, dnonfinite):
    x, weight, rstd = ctx.saved_tensors
    if x.is_cuda and weight.dtype == x.dtype:  # torch's fused kernel (CUDA only; one dtype)
        return (*torch.ops.aten._fused_rms_norm_backward(dnormalized, x, [x.shape[-1]], rstd[..., None], weight,
                                                          [True, True]), None, None)
    return (*_rms_norm_gradients(dnormalized, x, weight, rstd), None, None)


def _rms_norm_gradients(dy, x, weight, rstd):
    """With ``x̂ = x * rstd`` and ``g = dy * weight``: ``dx = rstd * (g - x̂ * mean(g * x̂))`` over D,
    ``dweight = sum(dy * x̂)`` over tokens and heads (fp32 math, results in the inputs' dtypes)."""
    normalized_input = x.float() * rstd[..., None]
    g = dy.float() * weight.float()
    dx = rstd[..., None] * (g - normalized_input * (g * normalized_input).mean(-1, keepdim=True))
    dweight = (dy.float() * normalized_input).sum((0, 1))
    return dx.to(x.dtype), dweight.to(weight.dtype)


rms_norm_quantize_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup_context)


@torch.library.custom_op("jagged_attn::prequantized_attention", mutates_args=())
def prequantized_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_data: torch.Tensor, q_scales: torch.Tensor,
    k_data: torch.Tensor, k_scales: torch.Tensor, offsets_q: torch.Tensor, offsets_k: torch.Tensor, causal: bool,
    softmax_scale: float, backend: str, deterministic: bool, qk_nonfinite: Optional[torch.Tensor] = None,  # noqa: UP045
) -> tuple[torch.Tensor, torch.Tensor]:
    """High-precision ``q [total_q, Hq, D]``, ``k, v [total_k, Hkv, D]`` and the feature-axis MXFP8
    of q and k (rceil) -> (out like q, lse fp32 ``[total_q, Hq]``). The forward reads q, k only
    through their MXFP8; ``deterministic`` only matters to the backward. ``qk_nonfinite``: q's and k's
    producer flags (fp32 ``[2]``), to raise ValueError for NaN/Inf in q, k or v (V's flag from its
    quantization here), read once the attention is queued; None: no check.

    V is quantized along the sequence axis here, then the backend's MXFP8 forward rebases it: the
    same bytes as quantizing it inside the rebasing passes (``attention_forward_hp``: bf16 V read
    twice, for the exponents and the data, ~5 bytes per element either way), one launch and one
    temporary e4m3 V more, through the backend's public entry point whatever kernel it runs."""
    with value_checks(False):  # the caller checks offsets and values (module docstring)
        q_mx = MXFP8Jagged(q_data, q_scales, offsets_q, "feature")
        k_mx = MXFP8Jagged(k_data, k_scales, offsets_k, "feature")
        v_nonfinite = torch.zeros(1, dtype=torch.float32, device=v.device)
        v_mx = quantize_flagging_nonfinite(v, offsets_k, "sequence", v_nonfinite)
        flags = None if qk_nonfinite is None else torch.cat([qk_nonfinite, v_nonfinite])
        return checked_after(flags, ("q", "k", "v"), lambda: get_backend(backend).forward_mx(
            q_mx, k_mx, v_mx, causal, softmax_scale, q.dtype))


@prequantized_attention_op.register_fake
def _(q, k, v, q_data, q_scales, k_data, k_scales, offsets_q, offsets_k, causal, softmax_scale, backend,
      deterministic, qk_nonfinite=None):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


def _attention_setup_context(ctx, inputs, output):
    q, k, v, _, _, _, _, offsets_q, offsets_k, causal, softmax_scale, backend, deterministic, _ = inputs
    ctx.mark_non_differentiable(output[1])
    save_for_attention_backward(ctx, q, k, v, *output, offsets_q, offsets_k, causal, softmax_scale, backend,
                                deterministic)


def _attention_backward(ctx, dout, dlse):
    return *attention_gradients(ctx, dout), *([None] * 11)


prequantized_attention_op.register_autograd(_attention_backward, setup_context=_attention_setup_context)
