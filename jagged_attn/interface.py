"""``jagged_attention``: validate, quantize if needed, dispatch to a backend."""

from __future__ import annotations

import math

import torch

from . import ops
from .backends import auto_backend_name, backend_name, check_head_dim, check_kernel_device
from .centering import centered_keys_values, uncentered_outputs
from .jagged import split_heads, unpack_jagged
from .mxfp8 import MXFP8Jagged, check_values
from .offsets import (OFFSETS_FACTS, check_offsets_facts, check_offsets_type, known_valid, offsets_facts,
                      skip_value_check, value_checks)
from .reference import default_softmax_scale

V_AXES = {"sequence": "sequence", "token": "feature"}  # v_scaling -> quantization axis of V


def _unpack(x, offsets, name):
    """An MXFP8Jagged or any container of :func:`unpack_jagged` -> (values, offsets, pack)."""
    if isinstance(x, MXFP8Jagged):
        return x, x.offsets if offsets is None else offsets, lambda out, out_offsets: out
    return unpack_jagged(x, offsets, name, other_kinds=("an MXFP8Jagged",))


def _split_heads(q, k, v, heads):
    """2-D ``[total, H * D]`` q, k, v as ``[total, H, D]``: q in ``heads`` heads, k and v in heads of q's D."""
    q = split_heads(q, heads, "q")
    head_dim = q.shape[2]
    for name, x in (("k", k), ("v", v)):
        if not (isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] and x.shape[1] % head_dim == 0):
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be 2-D [total, heads_kv * {head_dim}] (heads of q's head_dim), got {shape}")
    return q, split_heads(k, k.shape[1] // head_dim, "k"), split_heads(v, v.shape[1] // head_dim, "v")


def _under_autocast(device: torch.device) -> bool:
    """Whether torch.autocast is on for ``device``'s type and the ops cast q, k, v to one dtype there."""
    return device.type in ops.AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device.type)


def check_offsets_pair(offsets_q, rows_q: int, offsets_k, rows_k: int, device: torch.device,
                       names=("offsets_q", "offsets_k")) -> None:
    """Both offsets valid for their rows, on ``device`` and of one batch size (``ValueError`` naming
    them otherwise). Offsets not yet known valid are read before anything else runs, both in one wait for
    the device: each wait leaves the GPU idle while the host launches what follows, and nine of them
    cost a training step measurably (docs/perf-history.md)."""
    pairs = [(offsets_q, rows_q, names[0]), (offsets_k, rows_k, names[1])]
    for offsets, _, name in pairs:
        check_offsets_type(offsets, name)
        if offsets.device != device:
            raise ValueError(f"{name} is on {offsets.device} but the values are on {device}")
    unknown = [pair for pair in pairs if not (skip_value_check(pair[0]) or known_valid(pair[0], pair[1]))]
    if unknown:
        facts = torch.cat([offsets_facts(offsets) for offsets, _, _ in unknown]).tolist()  # the one wait
        for i, (offsets, rows, name) in enumerate(unknown):
            check_offsets_facts(offsets, rows, name, facts[OFFSETS_FACTS * i:OFFSETS_FACTS * (i + 1)])
    if offsets_q.numel() != offsets_k.numel():
        raise ValueError(f"{names[0]} and {names[1]} must describe the same batch size, got "
                         f"{offsets_q.numel() - 1} and {offsets_k.numel() - 1}")


def resolve_softmax_scale(softmax_scale, head_dim: int) -> float:
    """``softmax_scale``, ``1/sqrt(head_dim)`` for None; a positive finite number (``ValueError`` otherwise)."""
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(head_dim)
    if isinstance(softmax_scale, bool) or not (
            isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return float(softmax_scale)


def _same_offsets(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b or skip_value_check(a):
        return a.shape == b.shape
    return a.shape == b.shape and bool((a.to(torch.int64) == b.to(torch.int64)).all())


def _check_shapes(q_shape, k_shape, v_shape):
    if len(q_shape) != 3 or len(k_shape) != 3 or len(v_shape) != 3:
        raise ValueError("q, k, v must be [total, heads, head_dim] (2-D [total, heads * head_dim] with heads=)")
    if tuple(k_shape) != tuple(v_shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k_shape)} and {tuple(v_shape)}")
    if q_shape[2] != k_shape[2]:
        raise ValueError(f"q and k must have the same head_dim, got {q_shape[2]} and {k_shape[2]}")
    if k_shape[1] == 0 or q_shape[1] % k_shape[1]:
        raise ValueError(f"q heads ({q_shape[1]}) must be a multiple of k/v heads ({k_shape[1]}) for GQA/MQA")


def jagged_attention(
    q, k, v, offsets_q=None, offsets_k=None, *, causal: bool = False, softmax_scale: float | None = None,
    backend: str = "auto", return_lse: bool = False, deterministic: bool = False, v_scaling: str = "sequence",
    heads: int | None = None, center_kv: bool = False,
):
    """Attention over a ragged batch: ``out[b] = softmax(q_b k_b^T * scale + mask) v_b``.

    Args:
        q: ``[total_q, Hq, D]`` bf16/fp16/fp32, or an ``MXFP8Jagged`` on the feature axis. A
            ``JaggedTensor``, fbgemm's ``(values, [offsets])`` pair, a jagged nested tensor
            (``[B, j, H, D]`` or SDPA's ``[B, H, j, D]``), or any object with ``.values()`` and
            ``.offsets()`` methods (torchrec's ``JaggedTensor``) also works; out then comes in q's
            kind of container (``type(q)(values=..., offsets=...)`` for the last).
        k, v: ``[total_k, Hkv, D]`` (same kinds as q; an MXFP8 k is on the feature axis, v on the
            sequence axis). ``Hq % Hkv == 0`` (GQA/MQA); D a multiple of 32.
        offsets_q, offsets_k: int32/int64 ``[B + 1]`` (taken from the containers when omitted).
            ``offsets_k=None`` means self-attention (``offsets_q``).
        causal: bottom-right aligned: query i of a sequence sees keys ``j <= i + L_k - L_q``.
            Rows that see no key give 0 (and LSE = -inf).
        softmax_scale: defaults to ``1/sqrt(D)``.
        backend: ``"auto"`` (hopper on Hopper, block-scaled on Blackwell, reference elsewhere),
            ``"reference"``, ``"hopper"`` (Hopper, every GEMM in FP8 wgmma),
            ``"hopper-exact-scores"`` (Hopper, S and the backward's dP exact from bf16 wgmma: ~0.85x
            the training step's speed; its backward at the reference backend's accuracy on every input
            kind, through the whole call within ~2e-4 of the cosine bar on heavy-tailed inputs) or
            ``"block-scaled"`` (spec-exact ``tl.dot_scaled``). The old names ``"triton"``,
            ``"triton-fast"``, ``"exact"`` still work, with a DeprecationWarning.
        return_lse: also return the float32 natural-log LSE ``[total_q, Hq]``, differentiable like
            ``out`` (for :func:`jagged_attn.merge_attention`, ring / context-parallel attention).
        deterministic: bit-identical gradients run to run (the Hopper backward then forms dQ
            in a kernel of its own instead of adding partials in L2, which recomputes S and dP:
            a slower backward, docs/perf-history.md).
        v_scaling: ``"sequence"`` (MX blocks of 32 tokens, the GEMM's reduction axis) or
            ``"token"`` (blocks along head_dim, one scale per token and 32 channels). With
            ``"sequence"`` a later token can change how an earlier token's V is rounded; causal
            training that must rule that out uses ``"token"`` with ``center_kv=False`` (reference
            backend only for now). For MXFP8 inputs it is read from ``v.axis``.
        heads: for 2-D high-precision values ``[total, H * D]`` (fbgemm's, torchrec's): q has
            ``heads`` heads, k and v as many heads of q's D as their width holds; out is 2-D too.
        center_kv: quantize high-precision K and V as offsets from their per-sequence means and
            add the mean back to O (exact in exact arithmetic: scores move by a row constant).
            Where K or V has a large common part, as in models without QK-norm, this keeps the
            gradients from drifting off (dQ 25% -> 7% from fp64 on biased keys) and training
            from diverging. Off by default for now: the shift is three passes of its own around
            the attention (sums, shift, and O and the LSE after), not yet folded into the
            quantizing producers and the forward's epilogue (docs/PERF.md). ``False`` quantizes
            K and V as given (the spec's rounding of them, bit for bit).

    Returns:
        ``out [total_q, Hq, D]`` in q's dtype (bf16 for MXFP8 inputs), and LSE if asked.
        High-precision inputs get gradients through autograd (quantization is straight-through).
        Under ``torch.autocast`` q, k, v (of one dtype or mixed) run in the autocast dtype.
    """
    for flag, value in (("causal", causal), ("return_lse", return_lse), ("deterministic", deterministic),
                        ("center_kv", center_kv)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be a bool, got {value!r}")
    q, offsets_q, pack = _unpack(q, offsets_q, "q")
    k, offsets_k, _ = _unpack(k, offsets_k, "k")
    v, offsets_v, _ = _unpack(v, None, "v")
    backend = backend_name(backend)
    if v_scaling not in V_AXES:
        raise ValueError(f"v_scaling must be one of {tuple(V_AXES)}, got {v_scaling!r}")
    v_axis = V_AXES[v_scaling]
    if offsets_q is None:
        raise ValueError("offsets_q is required for tensor inputs")
    kinds = {isinstance(x, MXFP8Jagged) for x in (q, k, v)}
    if len(kinds) != 1:
        raise TypeError("q, k, v must be all MXFP8Jagged or all high-precision tensors")
    quantized = kinds.pop()
    if heads is not None:
        if quantized:
            raise ValueError("heads= splits high-precision 2-D values; quantize them with quantize_mxfp8(..., heads=)")
        q, k, v = _split_heads(q, k, v, heads)
    if quantized:  # an MXFP8Jagged checked its own fields when it was made
        for name, x in (("q", q), ("k", k)):
            if x.axis != "feature":
                raise ValueError(f"{name} must be quantized along the feature axis, got axis={x.axis!r}")
        v_axis = v.axis
        if offsets_k is None:
            offsets_k = k.offsets
        if not _same_offsets(v.offsets, offsets_k):
            raise ValueError("v.offsets must equal k's offsets")
    else:
        for name, x in (("q", q), ("k", k), ("v", v)):
            check_values(x, name, finite=False)  # finiteness below, read once the kernels are queued
        if not (q.dtype == k.dtype == v.dtype or _under_autocast(q.device)):
            raise TypeError(f"q, k, v must share a dtype (or run under torch.autocast), got {q.dtype}, {k.dtype}, "
                            f"{v.dtype}")
    _check_shapes(q.data.shape if quantized else q.shape, k.data.shape if quantized else k.shape,
                  v.data.shape if quantized else v.shape)
    data = (q.data, k.data, v.data) if quantized else (q, k, v)
    device = data[0].device
    if any(x.device != device for x in data):
        raise ValueError("q, k, v must be on the same device")
    if offsets_k is None:
        if data[1].shape[0] != data[0].shape[0]:
            raise ValueError("offsets_k is required when q and k have different numbers of rows")
        offsets_k = offsets_q
    check_offsets_pair(offsets_q, data[0].shape[0], offsets_k, data[1].shape[0], device)
    if not quantized and offsets_v is not None and not _same_offsets(offsets_v, offsets_k):
        raise ValueError("v's offsets must equal k's offsets")
    # NaN/Inf in high-precision inputs: checked by the backend, read after it queues its kernels
    check_finite = not quantized and not any(skip_value_check(x) for x in data)
    softmax_scale = resolve_softmax_scale(softmax_scale, data[0].shape[2])
    name = auto_backend_name(device) if backend == "auto" else backend
    check_kernel_device(name, device)
    check_head_dim(name, data[0].shape[2])
    if v_axis != "sequence" and name != "reference":
        raise ValueError(f"per-token V scales (v_scaling='token' / v.axis='feature') need backend='reference', "
                         f"not {name!r}")

    if quantized:
        if not (_same_offsets(q.offsets, offsets_q) and _same_offsets(k.offsets, offsets_k)):
            raise ValueError("offsets passed explicitly differ from the MXFP8Jagged inputs' offsets")
    with value_checks(False):  # all checked above but NaN/Inf, which check_finite asks of the backend
        if quantized:
            out, lse = ops.mxfp8_attention_op(q.data, q.scales, k.data, k.scales, v.data, v.scales, offsets_q,
                                              offsets_k, bool(causal), softmax_scale, name, v_axis)
        else:
            if center_kv:  # K and V quantized as offsets from their sequence means (centering.py)
                if _under_autocast(device):  # centered in the dtype the attention runs them in
                    q, k, v = ops.autocast_inputs(device.type, q, k, v)
                k, v, k_mean, v_mean = centered_keys_values(k, v, offsets_k)
            out, lse = ops.attention_op(q.contiguous(), k.contiguous(), v.contiguous(), offsets_q, offsets_k,
                                        bool(causal), softmax_scale, name, bool(deterministic), v_axis, check_finite)
            if center_kv:
                out, lse = uncentered_outputs(out, lse, q, k_mean, v_mean, offsets_q, softmax_scale)
    out = pack(out if heads is None else out.flatten(1), offsets_q)
    return (out, lse) if return_lse else out
