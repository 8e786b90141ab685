"""`KimiForCausalLM.forward_full` (fp32) against the float64 spec oracle in `spec_oracle`, which
reads the checkpoint on its own and evaluates spec/model.md formula by formula."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.model import load_model
from deltaserve.tiny import make_tiny

from .spec_oracle import load_spec_checkpoint, spec_logits

# max |model - oracle| / max |oracle|, fp32 model, 70-100 tokens, seeds 0-5: K3 2.1e-6..7.2e-6
# (8.3e-6 on the shrunk checkpoints below), Kimi-Linear 1.1e-6..2.3e-6. About 2x headroom.
TOL = {"kimi_k3": 1.5e-5, "kimi_linear": 5e-6}
N_TOKENS = 72  # crosses the KDA chunk size 64
CASES = [("kimi_k3", False, 0), ("kimi_k3", True, 0), ("kimi_linear", False, 1)]


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


def token_ids(vocab: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(100 + seed))


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """Cached (checkpoint dir, oracle checkpoint, ids, oracle logits) per (family, mxfp4, seed)."""
    cache = {}

    def get(family, mxfp4, seed):
        if (family, mxfp4, seed) not in cache:
            out = make_tiny(tmp_path_factory.mktemp(family), family=family, preset="tiny", mxfp4=mxfp4, seed=seed)
            ck = load_spec_checkpoint(out)
            ids = token_ids(ck.cfg["vocab_size"], N_TOKENS, seed)
            cache[family, mxfp4, seed] = out, ck, ids, spec_logits(ck, ids)
        return cache[family, mxfp4, seed]

    return get


@pytest.mark.parametrize("family, mxfp4, seed", CASES, ids=["kimi_k3", "kimi_k3-mxfp4", "kimi_linear"])
def test_forward_full_matches_spec_oracle(build, family, mxfp4, seed):
    out, _, ids, ref = build(family, mxfp4, seed)
    logits = load_model(out, dtype=torch.float32, progress=False).forward_full(ids)
    assert logits.shape == ref.shape == (N_TOKENS, ref.shape[1])
    assert ref.abs().max() > 1.0
    assert rel_err(logits, ref) <= TOL[family]


def test_mxfp4_oracle_equals_bf16_oracle(build):
    """Same seed, experts packed or not: the oracle's MXFP4 decode gives the same model exactly."""
    (_, ck_bf16, _, ref_bf16), (_, ck_fp4, _, ref_fp4) = (build("kimi_k3", m, 0) for m in (False, True))
    for ck in (ck_bf16, ck_fp4):
        assert "layers.1.block_sparse_moe.experts.0.w1.weight" in ck.w
        assert not any(k.endswith(("_packed", "_scale")) for k in ck.w)
    torch.testing.assert_close(ref_fp4, ref_bf16, rtol=0, atol=0)


def shrink_normed_inputs(path: Path, factor: float) -> None:
    """Scale, in place, every projection whose output is L2/RMS-normalised before use (KDA q/k,
    MLA q_a and the latent rows of kv_a), so the norm eps is no longer negligible."""
    top = json.loads((path / "config.json").read_text())
    rank = top.get("text_config", top)["kv_lora_rank"]
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in sorted(set(weight_map.values())):
        tensors = load_file(str(path / shard))
        for name, t in tensors.items():
            w = t.float().clone()
            if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
                if name.replace("_proj", "_conv1d") in weight_map:  # KDA, not Kimi-Linear MLA
                    w *= factor
            elif name.endswith("self_attn.q_a_proj.weight"):
                w *= factor
            elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
                w[:rank] *= factor
            tensors[name] = w.to(t.dtype)
        save_file(tensors, str(path / shard), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def shrunk(request, tmp_path_factory):
    family = request.param
    out = make_tiny(tmp_path_factory.mktemp(f"{family}_shrunk"), family=family, preset="tiny", seed=2)
    shrink_normed_inputs(out, 0.1)
    ck = load_spec_checkpoint(out)
    ids = token_ids(ck.cfg["vocab_size"], N_TOKENS, 2)
    logits = load_model(out, dtype=torch.float32, progress=False).forward_full(ids)
    return family, ck, ids, logits, spec_logits(ck, ids)


def test_shrunk_forward_full_matches_spec_oracle(shrunk):
    """Where the norm eps matter (see below), the model still matches the oracle within TOL."""
    family, _, _, logits, ref = shrunk
    assert rel_err(logits, ref) <= TOL[family]


@pytest.mark.parametrize("wrong", [{"kda_l2_eps": 1e-5}, {"mla_latent_eps": 1e-5}], ids=["kda", "mla"])
def test_tolerance_catches_eps_mistakes(shrunk, wrong):
    """On the unmodified tiny models a 1e-6 -> 1e-5 slip of the KDA L2 or MLA latent eps moves
    the logits by only 1.7e-6 .. 7.5e-6 relative (q/k/latent norms are O(1)), below the fp32
    error floor. With the normalised projections scaled by 0.1 it moves them by 1.5e-4 ..
    1.1e-3 (seeds 0-3), so the test above catches such a slip with >= 10x margin."""
    family, ck, ids, _, ref = shrunk
    assert rel_err(spec_logits(ck, ids, **wrong), ref) > 5 * TOL[family]
