"""`serve --data-parallel-size 2 --kv-disk-path DIR`: each replica owns `DIR/replica-<i>` (one
engine per directory; it was refused before), kept across its restarts. A replica killed with
SIGKILL comes back on its own directory, publishes the prefixes its disk holds, and the front
routes the session's next turn there (`resume_disk`), where it resumes from disk with the greedy
answer of an engine with the prefix cache off."""

from __future__ import annotations

import os
import signal

import pytest

from deltaserve.tiny import make_tiny
from tests.server.dp.test_data_parallel import _routed, _until
from tests.server.dp.test_resume_routing_http import _metric, dp_front
from tests.server.dp.test_store_routing_http import UNIT, _complete, _homed, _tier, cache_off


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("dpd") / "k3", family="kimi_k3", preset="tiny", seed=6)


def test_a_restarted_replica_resumes_from_its_own_disk(model, tmp_path):
    oracle, tok = cache_off(model)
    turn1 = tok.encode("An agent reads the repository and plans the next edit. " * 5)
    flags = ["--dtype", "float32", "--no-channel-guard", "--kv-disk-path", str(tmp_path), "--kv-disk-size", "64MiB"]
    with dp_front(model, *flags, start_s=240) as (base, output, pids):
        assert sorted(p.name for p in tmp_path.iterdir()) == ["replica-0", "replica-1"]
        assert _complete(base, turn1) == oracle(turn1)
        home = [i for i, n in enumerate(_routed(base)) if n][0]
        _until(lambda: _tier(base, home, "prefix_cache_tier_objects", "disk") > 0, 60, "".join(output[-30:]))
        assert not list((tmp_path / f"replica-{1 - home}").glob("*/*.safetensors"))
        os.kill(pids[home], signal.SIGKILL)
        label = f'replica="{home}"'
        _until(lambda: _metric(base, "dp_replica_restarts_total", label) == 1, 120, "".join(output[-30:]))
        _until(lambda: _metric(base, "dp_route_boundaries", label) > 0, 120, "".join(output[-30:]))
        turn2 = _homed(turn1 + [41, 42], home, False, 4)
        assert _complete(base, turn2) == oracle(turn2)
        assert _routed(base)[home] == 2
        assert _metric(base, "dp_route_decisions_total", 'reason="resume_disk"') == 1
        assert _tier(base, home, "prefix_cache_tier_hits", "disk") == 1
        assert _tier(base, home, "prefix_cache_tier_hit_tokens", "disk") >= 4 * UNIT
