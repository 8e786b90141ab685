"""The prefix benchmark's ideal is exact, and a small replay is never better than the ideal."""

from deltaserve.bench.prefix import OURS, VLLM_LIKE, replay
from deltaserve.bench.workload import WorkloadSpec, build_sessions, ideal_computed
from deltaserve.tiny import make_tiny


def test_ideal_counts_tokens_past_the_longest_seen_prefix():
    seen = [[1, 2, 3, 4]]
    assert ideal_computed([[1, 2, 3, 9, 9], [1, 2, 3, 9, 8], [1, 2, 3, 4]], seen) == 2 + 1 + 1
    assert seen[-1] == [1, 2, 3, 4] and len(seen) == 4


def test_sessions_share_the_system_prefix_and_branch():
    spec = WorkloadSpec(sessions=6, rounds=2, system_tokens=50, tool_tokens=20, user_tokens=(5, 9), seed=3)
    sessions = build_sessions(spec, 100, avoid={0, 1})
    assert all(s.history[:70] == sessions[0].history[:70] for s in sessions)
    assert any(len(s.history) > 70 for s in sessions), "some sessions branch off another's first turn"
    assert all(len(s.turns) == 2 and not {0, 1} & set(sum(s.turns, [])) for s in sessions)


def test_replay_is_exact_and_bounded_by_the_ideal(tmp_path):
    ckpt = make_tiny(tmp_path / "k3", family="kimi_k3", preset="tiny", seed=2)
    spec = WorkloadSpec(sessions=3, rounds=2, system_tokens=300, tool_tokens=100, user_tokens=(20, 60), seed=1)
    for run in (OURS, VLLM_LIKE):
        r = replay(str(ckpt), run, spec, answer_tokens=8, kv_cache_memory=256 * 2**20, dtype="float32")
        assert r["hits"] > 0 and r["computed"] >= r["ideal"], r


def test_tiers_recover_what_a_small_device_pool_drops(tmp_path):
    ckpt = make_tiny(tmp_path / "k3", family="kimi_k3", preset="tiny", seed=2)
    spec = WorkloadSpec(sessions=8, rounds=2, system_tokens=200, tool_tokens=60, user_tokens=(20, 60), seed=1)
    args = (str(ckpt), OURS, spec, 8, 300_000, "float32", 1, 512)
    alone = replay(*args)
    tiered = replay(*args, kv_offload_memory=200_000, kv_disk_path=str(tmp_path / "kv"), kv_disk_size=1 << 26)
    assert alone["working_set_x"] > 1.5 and tiered["tier_hits"] != "0/0", tiered
    assert alone["ideal"] == tiered["ideal"] <= tiered["computed"] < alone["computed"], (alone, tiered)


def test_the_shared_store_alone_recovers_what_a_small_device_pool_drops(tmp_path):
    from tests.engine.mooncake_master import Master, master_binary

    master_binary()
    master = Master(tmp_path / "master.log")
    try:
        ckpt = make_tiny(tmp_path / "k3", family="kimi_k3", preset="tiny", seed=2)
        spec = WorkloadSpec(sessions=8, rounds=2, system_tokens=200, tool_tokens=60, user_tokens=(20, 60), seed=1)
        args = (str(ckpt), OURS, spec, 8, 300_000, "float32", 1, 512)
        alone = replay(*args)
        shared = replay(*args, kv_store=master.url, kv_store_size=1 << 26)
    finally:
        master.stop()
    assert shared["policy"] == "deltaserve + store" and int(shared["tier_hits"]) > 0, shared
    assert alone["ideal"] == shared["ideal"] <= shared["computed"] < alone["computed"], (alone, shared)
