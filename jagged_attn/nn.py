"""``JaggedAttention``: a multi-head attention layer over jagged batches, MXFP8 inside."""

from __future__ import annotations

import torch
from torch import nn

from . import fused_ops
from .backends import HOPPER_BACKENDS, auto_backend_name, backend_name, check_head_dim
from .interface import check_offsets_pair, jagged_attention, resolve_softmax_scale
from .kernels.common.interpreter import INTERPRETED
from .kernels.producers import linear_quantize
from .offsets import skip_value_check


class JaggedAttention(nn.Module):
    """Self- or cross-attention on jagged batches: projections, optional QK RMSNorm, MXFP8
    ``jagged_attention``, output projection.

    ``forward(x, offsets, context=None, offsets_kv=None)``: ``x [total_q, dim]`` with ``offsets``;
    for cross-attention ``context [total_kv, kv_dim]`` with ``offsets_kv`` (same batch size).
    Returns ``[total_q, dim]``. Grouped-query attention with ``num_kv_heads < num_heads``.

    ``fused_producers``: build Q and K from the fused producers, whose kernels also write the
    MXFP8 the attention reads (the Q/K projection GEMMs quantize in their epilogue, or with
    ``qk_norm`` the RMSNorm kernels do), so the attention does not quantize Q and K again; the
    backward still runs on their bf16 copies (quantization is straight-through). ``None`` (auto)
    fuses on CUDA with the Hopper backends (``hopper``, ``hopper-exact-scores``) when the layer computes
    in bf16 (bf16 parameters or bf16 autocast) and the shapes fit the producers (head_dim 32, 64 or
    a multiple of 128 and in-features a multiple of 8 without ``qk_norm``); ``True`` insists (a
    ``ValueError`` where it cannot), ``False`` keeps ``nn.Linear`` / ``nn.RMSNorm`` and lets the
    attention quantize.

    ``center_kv``: as ``jagged_attention``'s (K and V quantized as offsets from their sequence means).
    The fused producers quantize K as it leaves the projection, before its means are known, so they
    run only with ``center_kv=False``.
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                 kv_dim: int | None = None, causal: bool = False, qk_norm: bool = False, bias: bool = False,
                 softmax_scale: float | None = None, backend: str = "auto", fused_producers: bool | None = None,
                 center_kv: bool = False, device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_dim = dim // num_heads if head_dim is None else head_dim
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if head_dim % 32:
            raise ValueError(f"head_dim ({head_dim}) must be a multiple of 32 (the MX block size)")
        self.dim, self.num_heads, self.num_kv_heads, self.head_dim = dim, num_heads, num_kv_heads, head_dim
        self.kv_dim = dim if kv_dim is None else kv_dim
        self.causal, self.qk_norm, self.softmax_scale = causal, qk_norm, softmax_scale
        self.backend = backend_name(backend)
        self.fused_producers, self.center_kv = fused_producers, center_kv
        factory = dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kv_dim, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(self.kv_dim, num_kv_heads * head_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(num_heads * head_dim, dim, bias=bias, **factory)
        if qk_norm:
            self.q_norm = nn.RMSNorm(head_dim, **factory)
            self.k_norm = nn.RMSNorm(head_dim, **factory)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, context: torch.Tensor | None = None,
                offsets_kv: torch.Tensor | None = None) -> torch.Tensor:
        if (context is None) != (offsets_kv is None):
            raise ValueError("pass context and offsets_kv together (cross-attention) or neither")
        source = x if context is None else context
        backend = auto_backend_name(x.device) if self.backend == "auto" else self.backend
        if self._fuses_producers(x, backend):
            out = self._attend_from_fused_producers(x, offsets, source, offsets_kv, backend)
        else:
            out = self._attend(x, offsets, source, offsets_kv)
        return self.out_proj(out.flatten(-2))

    def _attend(self, x, offsets, source, offsets_kv):
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(source).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(source).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return jagged_attention(q, k, v, offsets, offsets_kv, causal=self.causal, softmax_scale=self.softmax_scale,
                                backend=self.backend, center_kv=self.center_kv)

    def _attend_from_fused_producers(self, x, offsets, source, offsets_kv, backend):
        check_head_dim(backend, self.head_dim)  # this path reaches the kernels without jagged_attention's checks
        offsets_kv = offsets if offsets_kv is None else offsets_kv
        # The offsets before the producers use them (a wait only the first time a tensor is seen); after
        # them the producers' NaN/Inf flags of q and k, which the attention op reads with V's (from its
        # quantization) once it has queued its kernels.
        check_offsets_pair(offsets, x.shape[0], offsets_kv, source.shape[0], x.device, names=("offsets", "offsets_kv"))
        q, q_data, q_scales, q_flag = self._quantized_projection(x, offsets, self.q_proj, "q_norm", self.num_heads)
        k, k_data, k_scales, k_flag = self._quantized_projection(source, offsets_kv, self.k_proj, "k_norm",
                                                                 self.num_kv_heads)
        v = self.v_proj(source).unflatten(-1, (self.num_kv_heads, self.head_dim)).to(q.dtype)
        qk_nonfinite = None if skip_value_check(q_flag) else torch.cat([q_flag, k_flag])
        softmax_scale = resolve_softmax_scale(self.softmax_scale, self.head_dim)
        out, _ = fused_ops.prequantized_attention_op(q, k, v, q_data, q_scales, k_data, k_scales, offsets,
                                                     offsets_kv, self.causal, softmax_scale, backend, False,
                                                     qk_nonfinite)
        return out

    def _quantized_projection(self, x, offsets, projection, norm_name, heads):
        """(bf16 ``[total, heads, head_dim]``, its MXFP8 data, scales, NaN/Inf flag): the projection,
        normalized if ``qk_norm``, from the producer kernel that also quantizes it."""
        if not self.qk_norm:
            bias = projection.bias
            return fused_ops.linear_quantize_op(x.to(torch.bfloat16), projection.weight.to(torch.bfloat16),
                                                None if bias is None else bias.to(torch.bfloat16), offsets, heads)
        y = projection(x).unflatten(-1, (heads, self.head_dim)).to(torch.bfloat16)
        norm = getattr(self, norm_name)
        eps = torch.finfo(torch.float32).eps if norm.eps is None else norm.eps  # what F.rms_norm uses for None
        normalized, _, data, scales, nonfinite = fused_ops.rms_norm_quantize_op(y, norm.weight, offsets, eps)
        return normalized, data, scales, nonfinite

    def _fuses_producers(self, x: torch.Tensor, backend: str) -> bool:
        if self.fused_producers is None:
            return x.is_cuda and backend in HOPPER_BACKENDS and self._fusion_obstacle(x) is None
        if self.fused_producers:
            obstacle = self._fusion_obstacle(x)
            if obstacle is not None:
                raise ValueError(f"fused_producers=True: {obstacle}")
        return self.fused_producers

    def _fusion_obstacle(self, x: torch.Tensor) -> str | None:
        """Why the fused producers cannot run here, or None."""
        if self.center_kv:
            return "the producers quantize K before its sequence means are known: pass center_kv=False"
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.q_proj.weight.dtype
        if dtype != torch.bfloat16:
            return f"the producers compute in bfloat16, this layer in {dtype} (use bf16 parameters or autocast)"
        if not x.is_cuda:
            if not INTERPRETED:
                return f"the producer kernels need CUDA tensors (or TRITON_INTERPRET=1), x is on {x.device}"
        if not self.qk_norm:  # the quantizing GEMM's own shape rules
            try:
                linear_quantize._check_head_dim(self.num_heads * self.head_dim, self.num_heads)
            except ValueError as error:
                return str(error)
            if (self.dim * 2) % linear_quantize.TMA_ALIGNMENT or (self.kv_dim * 2) % linear_quantize.TMA_ALIGNMENT:
                return "the quantizing projection needs in-features that are multiples of 8 (16-byte bf16 rows)"
        return None

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, kv_dim={self.kv_dim}, causal={self.causal}, qk_norm={self.qk_norm}, "
                f"backend={self.backend!r}, fused_producers={self.fused_producers}, center_kv={self.center_kv}")
