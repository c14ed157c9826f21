"""GPU kernels (Triton and Gluon), by architecture and role:
``sm90`` (Hopper attention, Gluon), ``sm100`` (block-scaled attention), ``portable`` (attention in plain
Triton: the CPU interpreter and other GPUs), ``producers`` (the operands' kernels), ``common`` (what they
share).

Importing the package mends Triton's CPU interpreter (``common.interpreter``) before any kernel runs in it.
"""

from .common import interpreter  # noqa: F401
