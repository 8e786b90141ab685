"""The training path on the tiny preset: it learns, resumes on the same trajectory, trains experts
through their MXFP4 rounding, and exports a checkpoint the engine loads to the same logits."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from deltaserve.model.context import ForwardContext
from deltaserve.model.weights import load_model
from deltaserve.train.curriculum import batches
from deltaserve.train.export import expert_params, mxfp4_roundtrip
from deltaserve.train.trainer import TrainConfig, Trainer

CFG = TrainConfig(family="kimi_k3", preset="tiny", steps=4, tokens_per_step=768, warmup=2, checkpoint_every=2)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_fixed_batch_is_learned(tmp_path):
    t = Trainer(dataclasses.replace(CFG, steps=40, lr=1e-2), tmp_path)
    batch = next(batches(t.tokenizer, "kimi_k3", 0, 512, chat_template=t.template))
    losses = [t.train_step(batch) for _ in range(12)]
    assert losses[-1] < 0.5 * losses[0], losses


def test_resume_continues_the_same_trajectory(tmp_path):
    straight = Trainer(CFG, tmp_path / "a")
    straight.run(progress=False)
    first = Trainer(CFG, tmp_path / "b")
    assert first.run(progress=False, until=2) is None and first.step == 2
    resumed = Trainer(CFG, tmp_path / "b")
    assert resumed.step == 2
    resumed.run(progress=False)
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in straight.history]
    for name, p in straight.params.items():
        assert torch.equal(p, resumed.params[name]), name
    with pytest.raises(ValueError, match="another training config"):
        Trainer(dataclasses.replace(CFG, lr=1.0), tmp_path / "b")


def test_qat_steps_update_the_fp32_masters(tmp_path):
    t = Trainer(dataclasses.replace(CFG, qat_from=0.0), tmp_path)
    batch = next(batches(t.tokenizer, "kimi_k3", 0, 512, chat_template=t.template))
    t.train_step(batch)
    for p in t.experts:
        assert not torch.equal(p, mxfp4_roundtrip(p))  # the update lands on the masters, not the rounding


@pytest.mark.parametrize("family", ["kimi_k3", "kimi_linear"])
def test_export_loads_to_the_trained_logits(tmp_path, family):
    t = Trainer(dataclasses.replace(CFG, family=family, steps=2, qat_from=0.5), tmp_path)
    out = t.run(progress=False)
    assert expert_params(t.model)
    for p in t.experts:
        assert torch.equal(p, mxfp4_roundtrip(p))  # exported as MXFP4 stores them
    ids = torch.tensor(t.tokenizer.encode("What is 17 + 25? The code of Alice is 4821."))
    served = load_model(out, dtype=torch.float32, progress=False)
    loaded = dict(served.named_parameters())
    for name, p in t.model.named_parameters():  # each tensor exact at its stored dtype (bf16 or fp32)
        q = loaded[name].detach()
        assert torch.equal(q, p.detach()) or torch.equal(q, p.detach().bfloat16().float()), name
    with torch.no_grad():  # the training forward at the stored weights is the served forward
        for name, p in t.model.named_parameters():
            p.copy_(loaded[name])
        want = t.model.compute_logits(t.model(ids, ForwardContext.single(ids.numel())))
    torch.testing.assert_close(served.forward_full(ids), want, rtol=1e-4, atol=1e-4)
    fresh = load_model(t.init_dir, dtype=torch.float32, progress=False)
    assert not torch.allclose(fresh.forward_full(ids), want, atol=1e-3)  # the weights did change
    assert sorted(p.name for p in out.iterdir()) == sorted([p.name for p in t.init_dir.iterdir()] + ["training.json"])
    record = json.loads((out / "training.json").read_text())
    assert record["steps"] == 2 and [s for s, _ in record["loss"]] == [2] and record["config"]["family"] == family
