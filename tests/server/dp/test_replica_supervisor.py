"""The data-parallel front's replica supervisor and routing, on stand-in processes (no model): a
replica that does not answer within the start deadline is killed and counted, one that exits is
respawned after its backoff (doubling, capped), a live one that dies is noticed and comes back;
the front routes only to live replicas and answers 503 when none is."""

from __future__ import annotations

import sys
import time

import pytest

from deltaserve.engine.dp.routing import rendezvous
from deltaserve.replica_front import Front, routing_key
from deltaserve.server import replica_supervisor as rs
from deltaserve.server.errors import APIError
from deltaserve.server.replica_supervisor import Replica, Supervisor, backoff

HEALTHY = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def python(code: str):
    return lambda port: [sys.executable, "-c", code, str(port)]


def test_a_replica_that_does_not_come_up_in_time_is_killed_and_counted():
    sup = Supervisor([Replica(0, python("import time; time.sleep(120)"))], start_timeout=0.5)
    t0 = time.monotonic()
    assert sup.start() == 0
    r = sup.replicas[0]
    assert r.proc.returncode is not None and time.monotonic() - t0 < 60
    assert r.failures == {"start_timeout": 1} and not r.live and r.retry_at is not None
    sup.stop()


def test_a_replica_that_keeps_exiting_is_retried_with_capped_backoff(caplog):
    sup = Supervisor([Replica(0, python("raise SystemExit(3)"))], start_timeout=30, cap=4.0)
    assert sup.start() == 0
    r = sup.replicas[0]
    delays = []
    for _ in range(5):
        assert r.retry_at is not None and sup.step(r, r.retry_at - 0.01) == "down"  # not before its time
        delays.append(r.retry_at)
        assert sup.step(r, r.retry_at) == "starting"
        r.proc.wait(30)
        assert sup.step(r, time.monotonic()) == "down"
        delays[-1] = r.retry_at - time.monotonic()
    assert r.restarts == 5 and r.failures == {"exited": 6} and r.streak == 6
    assert [round(d) for d in delays] == [2, 4, 4, 4, 4]  # after failures 2..6: 2 s, then the 4 s cap
    assert "exited with code 3" in caplog.text and "restarting replica 0 (try 6)" in caplog.text
    assert [backoff(k, 60.0) for k in (1, 2, 3, 7, 8)] == [1.0, 2.0, 4.0, 60.0, 60.0]
    sup.stop()
    assert sup.step(r, time.monotonic() + 100) == "closed" and r.restarts == 5  # nothing after stop


def test_a_live_replica_that_dies_comes_back_on_a_new_process(monkeypatch):
    monkeypatch.setattr(rs, "STABLE_S", 0.0)
    sup = Supervisor([Replica(0, python(HEALTHY))], start_timeout=30)
    assert sup.start() == 1
    r = sup.replicas[0]
    first, url = r.proc, r.url
    first.kill()
    first.wait()
    assert sup.step(r, time.monotonic()) == "down" and not r.live and r.failures == {"exited": 1}
    assert sup.step(r, r.retry_at) == "starting" and r.proc is not first and r.url != url
    deadline = time.monotonic() + 30
    while sup.step(r, time.monotonic()) == "starting" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.live and r.restarts == 1
    r.proc.kill()
    r.proc.wait()
    sup.step(r, time.monotonic())
    assert r.streak == 1  # it had been live STABLE_S: its count started afresh
    sup.stop()
    assert r.proc.poll() is not None


def test_the_front_routes_only_to_live_replicas():
    replicas = [Replica(i, None, url=f"http://127.0.0.1:{i + 1}", live=True) for i in range(3)]
    front = Front(replicas)
    key = routing_key({"prompt": "hello there"})
    home = rendezvous(key, 3)
    assert front.pick(key).index == home
    replicas[home].live = False
    other = front.pick(key).index
    assert other != home and front.pick(key, {other}).index not in (home, other)
    replicas[home].live = True
    assert front.pick(key).index == home  # back where its prefix is cached
    for r in replicas:
        r.live = False
    with pytest.raises(APIError) as e:
        front.pick(key)
    assert e.value.status == 503 and "(0 of 3 live; they are being restarted)" in e.value.message
    text = front.metrics()
    assert "deltaserve:dp_replicas_live 0\n" in text and "deltaserve:dp_replicas 3\n" in text
    assert 'deltaserve:dp_replica_failures_total{replica="2",reason="start_timeout"} 0' in text
