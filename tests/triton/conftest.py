"""Triton kernel tests (marker `triton`). Each module skips itself when `triton` does not import
(`pytest.importorskip`); without CUDA the kernels run on CPU tensors in Triton's interpreter,
switched on here before any kernel module is imported (it is read when kernels are decorated)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the kernels run: the GPU when there is one, else the CPU interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
