"""GPU kernels (Triton), imported as ``jagged_attn.kernels``; one module per kernel family.

Importing the package mends Triton's CPU interpreter (``interpreter``) before any kernel runs in it.
"""

from . import interpreter  # noqa: F401
