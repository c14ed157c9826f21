"""Which device kernels launch on.

Triton launches on the current CUDA device, not on its arguments' device; a process that keeps
tensors on several GPUs (model parallelism, or a GPU other than the one it made current) would send a
kernel's pointers to the wrong GPU. Every entry point that launches kernels runs inside
:func:`on_device_of` its main input.
"""

from __future__ import annotations

import contextlib

import torch


def on_device_of(t: torch.Tensor):
    """A context in which ``t``'s CUDA device is current (nothing for other devices)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
