"""`/disagg/match` on a real engine reports how far a prompt resumes from its host or disk tier:
after the device copy is dropped, the device hit is 0 and the tier's length is exactly what the
next admission then restores from that tier; answering reads and installs nothing."""

import pytest

from deltaserve import SamplingParams
from deltaserve.disagg.matching import _match

from ..engine.test_prefix_cache import make

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
TIER_ARGS = {"host": dict(kv_offload_memory="16MiB"), "disk": dict(kv_disk_size="64MiB")}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from deltaserve.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("k3"), family="kimi_k3", preset="tiny", seed=21)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_match_reports_the_lower_tier_resume(ckpt, tmp_path, tier):
    kw = dict(TIER_ARGS[tier], **({"kv_disk_path": str(tmp_path)} if tier == "disk" else {}))
    llm = make(ckpt, True, **kw)
    prompt = [(7 * i) % 500 + 20 for i in range(61)]
    llm.generate([prompt], ONE, use_tqdm=False)
    llm.cache.tier.flush()
    assert llm.reset_prefix_cache()
    stats = llm.stats()["prefix_cache"]["tiers"][tier]
    got = _match(llm.engine, prompt)
    assert (got.num_tokens, got.joint_tokens, got.mla_tokens) == (61, 0, 0)
    assert getattr(got, f"{tier}_tokens") == 56  # the checkpoint at the prompt's last whole unit
    assert getattr(got, f"{'disk' if tier == 'host' else 'host'}_tokens") == 0
    assert not llm.cache.index.units and llm.stats()["prefix_cache"]["tiers"][tier] == stats  # nothing read
    assert not getattr(llm.cache.tier.disk, "staged", None)
    llm.generate([prompt], ONE, use_tqdm=False)
    assert llm.stats()["prefix_cache"]["tiers"][tier]["hit_tokens"] == getattr(got, f"{tier}_tokens")
