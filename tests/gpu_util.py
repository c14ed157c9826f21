"""Helpers of the ``gpu``-marked tests."""

from __future__ import annotations

import torch

import jagged_attn as ja


def device_to_host_copies(step, *, value_checks: bool = True) -> list[str]:
    """The device-to-host copies (each a wait of the host for the GPU) of one call of ``step`` after a
    first, untimed call (compiles kernels, validates offsets), under ``jagged_attn.value_checks``."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with ja.value_checks(value_checks), profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "DtoH" in e.name]
