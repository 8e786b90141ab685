"""The module tree built from the real configs has the published parameter counts (spec §1.3),
checked on the meta device (no memory)."""

import torch

from deltaserve.model import KimiForCausalLM, ModelConfig
from tests.model.test_config import k3_config, kimi_linear_config


def count(cfg_dict) -> int:
    with torch.device("meta"):
        model = KimiForCausalLM(ModelConfig.from_dict(cfg_dict))
    return sum(p.numel() for p in model.parameters())


def test_k3_text_parameter_count():
    # spec §1.3: text 2.7795T (A_log stored unpadded: 69 * 32 fewer than the file's 128-entry form)
    assert abs(count(k3_config()) / 1e12 - 2.7795) < 5e-4


def test_kimi_linear_parameter_count():
    assert abs(count(kimi_linear_config()) / 1e9 - 49.1) < 0.1
