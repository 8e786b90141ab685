"""`--device cuda` without the `gpu` extra runs the reference ops (`TorchOps`) on the GPU: no op of
a step may meet host and device tensors there (CUDA refuses it). Checked on CPU under
`FakeDevice`, which tracks where each tensor would live. Reads back to the host are allowed on
this path (the reference plans from device values); the Triton backend is held to that too
(tests/triton/test_device_discipline.py)."""

import pytest
import torch
from PIL import Image

from deltaserve import LLM
from deltaserve.ops.backends.torch import REFERENCE
from deltaserve.tiny import make_tiny

from ..fake_device import FakeDevice, step_workload, watch_steps


def _image() -> Image.Image:
    g = torch.Generator().manual_seed(1)
    return Image.fromarray(torch.randint(0, 256, (28, 40, 3), generator=g, dtype=torch.uint8).numpy())


def _llm(ckpt, device: str) -> LLM:
    return LLM(
        ckpt, "float32", device=device, max_num_seqs=2, page_size=4, max_model_len=256,
        kv_cache_memory=16 * 2**20, enable_prefix_caching=True, prefix_match_unit=8, progress=False,
    )  # fmt: skip


@pytest.mark.parametrize("family", ["kimi_k3", "kimi_linear"])
def test_reference_steps_keep_every_op_on_one_device(tmp_path, monkeypatch, family):
    monkeypatch.setenv("DELTASERVE_TRITON", "0")
    ckpt = make_tiny(tmp_path / family, family=family, preset="tiny", seed=4)
    image = _image() if family == "kimi_k3" else None
    mode = FakeDevice()
    with mode:
        watch_steps(mode, monkeypatch)
        llm = _llm(ckpt, "cpu:0")
        got = step_workload(llm, image)
    assert llm.model.ops is REFERENCE
    assert llm.cache.prefix_stats()["hits"] >= 1
    assert mode.checked > 1000  # the step's tensors were on the fake device
    mixed = {k: n for k, n in mode.found.items() if k[0] == "mix"}
    assert not mixed, sorted(mixed.items())
    monkeypatch.undo()
    monkeypatch.setenv("DELTASERVE_TRITON", "0")
    assert step_workload(_llm(ckpt, "cpu"), image) == got  # the mode changed no result
