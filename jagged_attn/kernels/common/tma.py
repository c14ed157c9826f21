"""Host-side TMA descriptors shared by the Gluon kernels (``sm90.forward``, ``sm90.backward``)."""
from __future__ import annotations

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_GLUON_DTYPES = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def operand_descriptor(t2d: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """TMA descriptor of a 2-D e4m3, bf16 or fp16 view that a kernel reads in ``block`` tiles as wgmma
    operands: the default NVMMA (swizzled) shared layout of its dtype, plain-int shape and block."""
    layout = gl.NVMMASharedLayout.get_default_for(block, _GLUON_DTYPES[t2d.dtype])
    return TensorDescriptor(t2d, list(t2d.shape), list(t2d.stride()), block, layout)
