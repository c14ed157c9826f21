"""Test set-up: without a GPU, Triton kernels run in the CPU interpreter.

TRITON_INTERPRET is read when ``triton.jit`` decorates a function, so it must be set before any
kernel module is imported; conftest.py is imported before every test module.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Fresh random inputs every run (never a fixed seed), printed so that a failure can be replayed
    with ``JAGGED_ATTN_SEED=<seed>``."""
    seed = int(os.environ.get("JAGGED_ATTN_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(seed)
    print(f"torch seed {seed}")
    yield
