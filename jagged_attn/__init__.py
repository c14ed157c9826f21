"""jagged_attn: varlen (jagged) MXFP8 attention, forward and backward, for ragged batches."""

from . import fused_ops, ops  # noqa: F401  (registers the torch.library ops: torch.ops.jagged_attn.*)
from .context_parallel import context_parallel_attention, context_parallel_shard
from .flash_attn import flash_attn_varlen_func
from .interface import jagged_attention
from .jagged import JaggedTensor
from .merge import merge_attention
from .mxfp8 import MXFP8Jagged, dequantize_mxfp8
from .offsets import value_checks
from .quantize import quantize_mxfp8, quantize_mxfp8_dual
from .serialization import load, save

__all__ = [
    "JaggedTensor", "MXFP8Jagged", "quantize_mxfp8", "quantize_mxfp8_dual", "dequantize_mxfp8", "jagged_attention",
    "merge_attention", "context_parallel_attention", "context_parallel_shard", "flash_attn_varlen_func", "save",
    "load", "value_checks",
]
__version__ = "0.1.0"
