"""flash_attn_varlen_func: FlashAttention 2's varlen signature on jagged_attention."""

import inspect

import pytest
import torch

import jagged_attn as ja
from jagged_attn.offsets import offsets_from_lengths

# flash_attn/flash_attn_interface.py (FlashAttention 2.x), flash_attn_varlen_func: names and defaults in order.
FA2_PARAMETERS = [
    ("q", None), ("k", None), ("v", None), ("cu_seqlens_q", None), ("cu_seqlens_k", None), ("max_seqlen_q", None),
    ("max_seqlen_k", None), ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
    ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False),
    ("return_attn_probs", False), ("block_table", None),
]


def _inputs(lengths_q=(3, 0, 40, 33), lengths_k=(50, 2, 0, 20), hq=4, hkv=2, dim=64, device="cpu"):
    cu_q = offsets_from_lengths(torch.tensor(lengths_q)).to(device, torch.int32)
    cu_k = offsets_from_lengths(torch.tensor(lengths_k)).to(device, torch.int32)
    q = torch.randn(sum(lengths_q), hq, dim, dtype=torch.bfloat16, device=device)
    k = torch.randn(sum(lengths_k), hkv, dim, dtype=torch.bfloat16, device=device)
    v = torch.randn(sum(lengths_k), hkv, dim, dtype=torch.bfloat16, device=device)
    return q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k)


def test_signature_is_flash_attention_2s():
    parameters = list(inspect.signature(ja.flash_attn_varlen_func).parameters.values())
    positional = [(p.name, None if p.default is inspect.Parameter.empty else p.default)
                  for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == FA2_PARAMETERS
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters[len(positional):])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("causal", [False, True])
def test_same_as_jagged_attention_positionally_and_by_keyword(causal, device):
    """Arguments as a FlashAttention call passes them (positionally, int32 cu_seqlens): out, gradients and
    the LSE (in FlashAttention's [heads, total_q] layout) of jagged_attention on the same inputs (on CUDA:
    the default backend's kernels, deterministic as both calls ask)."""
    q, k, v, cu_q, cu_k, max_q, max_k = _inputs(device=device)
    dout = torch.randn_like(q)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = ja.flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, 0.0, 0.2, causal, (-1, -1), 0.0, None, True)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref, ref_lse = ja.jagged_attention(*ref_leaves, cu_q, cu_k, causal=causal, softmax_scale=0.2, deterministic=True,
                                       return_lse=True)
    assert torch.equal(out, ref)
    for g, r in zip(grads, torch.autograd.grad(ref, ref_leaves, dout)):
        assert torch.equal(g, r)
    by_keyword, lse = ja.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                                max_seqlen_k=max_k, softmax_scale=0.2, causal=causal, return_lse=True)
    assert torch.equal(by_keyword, ref)
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous() and torch.equal(lse, ref_lse.T)


def test_lse_is_differentiable():
    q, k, v, cu_q, cu_k, max_q, max_k = _inputs()
    q.requires_grad_(True)
    _, lse = ja.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True)
    torch.where(torch.isfinite(lse), lse, 0.0).sum().backward()
    assert q.grad[:3].any() and torch.isfinite(q.grad).all()


def test_causal_is_bottom_right_aligned_as_flash_attentions():
    """FlashAttention's docstring: seqlen_q = 2, seqlen_k = 5 -> rows see keys 0-3 and 0-4; seqlen_q = 5,
    seqlen_k = 2 -> rows 0-2 see nothing (out 0), row 3 key 0, row 4 keys 0-1. The LSE depends only on Q and
    K (each key quantized on its own, without centering), so changing key j moves exactly the LSE of the rows
    that see it."""
    q, k, v, cu_q, cu_k, max_q, max_k = _inputs(lengths_q=(2, 5), lengths_k=(5, 2), hq=1, hkv=1, dim=32)
    out, lse = ja.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True,
                                         center_kv=False)
    assert not out[2:5].any() and bool(torch.isneginf(lse[0, 2:5]).all()) and torch.isfinite(lse[0, 5:]).all()
    visible = {0: [[0, 1, 2, 3], [0, 1, 2, 3, 4]], 1: [[], [], [], [0], [0, 1]]}  # per sequence: keys of each row
    for b, rows in visible.items():
        for key in range(int(cu_k[b + 1] - cu_k[b])):
            moved = k.clone()
            moved[int(cu_k[b]) + key] *= -2
            _, lse_moved = ja.flash_attn_varlen_func(q, moved, v, cu_q, cu_k, max_q, max_k, causal=True,
                                                     return_lse=True, center_kv=False)
            changed = (lse_moved[0] != lse[0]) & ~(torch.isneginf(lse_moved[0]) & torch.isneginf(lse[0]))
            expected = [key in keys for keys in rows]
            assert changed[int(cu_q[b]):int(cu_q[b + 1])].tolist() == expected, (b, key)


@pytest.mark.parametrize("argument, value, named", [
    ("dropout_p", 0.1, "dropout_p=0.1"), ("window_size", (128, 0), "window_size=(128, 0)"),
    ("softcap", 30.0, "softcap=30.0"), ("alibi_slopes", torch.ones(4), "alibi_slopes"),
    ("return_attn_probs", True, "return_attn_probs"), ("block_table", torch.zeros(1, 1, dtype=torch.int32),
                                                        "block_table"),
])
def test_what_flash_attention_has_and_this_lacks_is_refused_by_name(argument, value, named):
    q, k, v, cu_q, cu_k, max_q, max_k = _inputs()
    with pytest.raises(NotImplementedError, match=named.replace("(", r"\(").replace(")", r"\)")):
        ja.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **{argument: value})


def test_every_refusal_is_named_at_once_and_bad_input_is_jagged_attentions_error():
    q, k, v, cu_q, cu_k, max_q, max_k = _inputs()
    with pytest.raises(NotImplementedError, match="dropout_p=0.5.*softcap=1.0"):
        ja.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.5, softcap=1.0)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        ja.flash_attn_varlen_func(q[:, :3], k, v, cu_q, cu_k, max_q, max_k)
    unbounded_window = ja.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, window_size=[-1, -1])
    assert torch.equal(unbounded_window, ja.jagged_attention(q, k, v, cu_q, cu_k))
