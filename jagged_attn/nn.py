"""``JaggedAttention``: a multi-head attention layer over jagged batches, MXFP8 inside."""

from __future__ import annotations

import torch
from torch import nn

from .interface import jagged_attention


class JaggedAttention(nn.Module):
    """Self- or cross-attention on jagged batches: projections, optional QK RMSNorm, MXFP8
    ``jagged_attention``, output projection.

    ``forward(x, offsets, context=None, offsets_kv=None)``: ``x [total_q, dim]`` with ``offsets``;
    for cross-attention ``context [total_kv, kv_dim]`` with ``offsets_kv`` (same batch size).
    Returns ``[total_q, dim]``. Grouped-query attention with ``num_kv_heads < num_heads``.
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                 kv_dim: int | None = None, causal: bool = False, qk_norm: bool = False, bias: bool = False,
                 softmax_scale: float | None = None, backend: str = "auto", device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_dim = dim // num_heads if head_dim is None else head_dim
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if head_dim % 32:
            raise ValueError(f"head_dim ({head_dim}) must be a multiple of 32 (the MX block size)")
        self.dim, self.num_heads, self.num_kv_heads, self.head_dim = dim, num_heads, num_kv_heads, head_dim
        self.kv_dim = dim if kv_dim is None else kv_dim
        self.causal, self.qk_norm, self.softmax_scale, self.backend = causal, qk_norm, softmax_scale, backend
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
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(source).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(source).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = jagged_attention(q, k, v, offsets, offsets_kv, causal=self.causal, softmax_scale=self.softmax_scale,
                               backend=self.backend)
        return self.out_proj(out.flatten(-2))

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, kv_dim={self.kv_dim}, causal={self.causal}, qk_norm={self.qk_norm}, "
                f"backend={self.backend!r}")
