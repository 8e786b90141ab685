"""`--device`: `auto` picks CUDA only where torch sees a GPU; asking for CUDA without one fails at
once with a message that says so."""

import pytest
import torch

from deltaserve import LLM
from deltaserve.engine.core.builder import resolve_device
from deltaserve.tiny import make_tiny


def test_auto_and_explicit_devices():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    path = make_tiny(tmp_path / "m", family="kimi_k3", preset="tiny")
    with pytest.raises(ValueError, match="--device cuda: no CUDA device is available"):
        LLM(path, "float32", device="cuda", progress=False)
