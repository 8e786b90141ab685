"""`kernels.transfer`: a step's index tensors to the device and their host copies. On CPU the
tensors pass through unchanged; a tensor `to_device` made elsewhere answers `host_copy` with the
host tensor it came from (exercised on CPU by the fake device of tests/fake_device.py)."""

import pytest
import torch

from deltaserve.kernels.transfer import host_copy, to_device

from ..fake_device import FakeDevice


def test_cpu_tensors_pass_through():
    host = {"a": torch.tensor([0, 3, 5]), "b": torch.arange(4).view(2, 2)}
    out = to_device(host, "cpu")
    assert all(out[k] is host[k] for k in host)
    assert host_copy(out["a"]) is host["a"]


def test_only_host_int64_tensors():
    with pytest.raises(ValueError, match="int64"):
        to_device({"a": torch.tensor([0.5])}, "cpu")


def test_device_tensors_remember_their_host_copy():
    """Under the fake device the copies are new (device) tensors: `host_copy` gives back the host
    ones without a read from the device, and nothing blocks."""
    host = {"cu": torch.tensor([0, 2, 7]), "rows": torch.tensor([[1, 2], [3, 4]])}
    mode = FakeDevice(package="/tests/kernels/")
    with mode:
        mode.active = True
        out = to_device(host, torch.device("cpu"))
        back = host_copy(out["cu"])
    assert back is host["cu"] and out["cu"] is not host["cu"]
    assert torch.equal(out["rows"], host["rows"]) and out["rows"].shape == (2, 2)
    assert not mode.found
