"""What the kernel test modules share: where kernels run (CUDA, else the CPU interpreter), the
module marks that skip them where neither is available, and a closeness check scaled to the
reference's magnitude."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
KERNEL_MARKS = [
    pytest.mark.triton,
    pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1"),
]
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="bf16 kernels are checked on CUDA only")


def close(got, ref, rtol=1e-5):
    """`got` equals `ref` within rtol of each value plus rtol of ref's largest magnitude."""
    got, ref = got.cpu().double(), ref.cpu().double()
    torch.testing.assert_close(got, ref, rtol=rtol, atol=rtol * float(ref.abs().max()))
