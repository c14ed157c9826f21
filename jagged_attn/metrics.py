"""Accuracy metrics of docs/DESIGN.md section 7: relative L2 error, cosine similarity and the least-squares
scale factor (in float64)."""

from __future__ import annotations

import torch


def relative_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64 (NaN in ``x`` gives NaN: it never passes a threshold)."""
    x, ref = x.detach().to(torch.float64), ref.detach().to(torch.float64)
    return float(torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-300))


def cosine(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors, in float64."""
    x, ref = x.detach().to(torch.float64).flatten(), ref.detach().to(torch.float64).flatten()
    return float(torch.dot(x, ref) / (torch.linalg.vector_norm(x) * torch.linalg.vector_norm(ref)).clamp_min(1e-300))


def least_squares_factor(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``<x, ref> / <ref, ref>``: the factor of ``ref`` that best fits ``x``, 1 when ``x`` is ``ref`` plus
    noise uncorrelated with it; below 1, a bias towards zero, which relative L2 and cosine barely show."""
    x, ref = x.detach().to(torch.float64).flatten(), ref.detach().to(torch.float64).flatten()
    return float(torch.dot(x, ref) / torch.dot(ref, ref).clamp_min(1e-300))
