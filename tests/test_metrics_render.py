"""Prometheus text of the router's /metrics (no Ray)."""

from collections import Counter

from pdserve.messages import ReplicaStats
from router.metrics import Histogram, RequestMetrics, render


def test_histogram_is_cumulative():
    h = Histogram("x_seconds", "x", (0.1, 1.0))
    for v in (0.05, 0.5, 5.0):
        h.observe(v)
    lines = h.lines()
    assert 'x_seconds_bucket{le="0.1"} 1' in lines and 'x_seconds_bucket{le="1"} 2' in lines
    assert 'x_seconds_bucket{le="+Inf"} 3' in lines and "x_seconds_count 3" in lines


def test_render_has_per_replica_gauges_counters_and_latencies():
    stats = [ReplicaStats("decode", "r1", 100, 90, 2, 0, 0, {"kv_transfers_landed": 3}),
             ReplicaStats("prefill", "p1", 50, 50, 0, 1, 40, {})]
    latency = RequestMetrics()
    latency.observe(0.0, 0.2, 1.2, 11)
    text = render(stats, Counter(ok=5, error=1), latency)
    assert 'pdserve_kv_blocks_free{pool="decode",replica="r1"} 90' in text
    assert 'pdserve_waiting_prompt_tokens{pool="prefill",replica="p1"} 40' in text
    assert 'pdserve_kv_transfers_landed{pool="decode",replica="r1"} 3' in text
    assert 'pdserve_requests_total{outcome="ok"} 5' in text
    assert "pdserve_ttft_seconds_count 1" in text and "pdserve_tpot_seconds_sum 0.100000" in text
    assert "pdserve_output_tokens_total 11" in text
