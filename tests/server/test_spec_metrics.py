"""Speculative decoding's counters reach /metrics under the `deltaserve:` prefix."""

from prometheus_client import CollectorRegistry, generate_latest

from deltaserve.engine.spec.adaptive import SpecMetrics
from deltaserve.server.metrics import _EngineCollector


def test_spec_counters_by_position_and_mean_length():
    m = SpecMetrics(3)
    m.observe(3, 1)
    m.observe(2, 2)
    collector = _EngineCollector("tiny")
    collector.snapshot = {"spec_decode": m.stats()}
    reg = CollectorRegistry()
    reg.register(collector)
    text = generate_latest(reg).decode()
    assert 'deltaserve:spec_decode_num_draft_tokens_total{model_name="tiny"} 5.0' in text
    assert 'deltaserve:spec_decode_num_accepted_tokens_total{model_name="tiny"} 3.0' in text
    assert 'deltaserve:spec_decode_num_drafts_total{model_name="tiny"} 2.0' in text
    assert 'deltaserve:spec_decode_mean_accepted_length{model_name="tiny"} 2.5' in text
    assert (
        'deltaserve:spec_decode_num_accepted_tokens_per_pos_total{kind="accepted",model_name="tiny",position="1"} 1.0'
        in text
    )
    assert (
        'deltaserve:spec_decode_num_accepted_tokens_per_pos_total{kind="drafted",model_name="tiny",position="2"} 1.0'
        in text
    )
