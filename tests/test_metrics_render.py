"""Prometheus text of the router's /metrics (no Ray)."""

from collections import Counter

import pytest

from router.metrics import Histogram, RequestMetrics, render
from serving.histogram import REPLICA_HISTOGRAMS
from serving.messages import ReplicaStats


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


def test_queue_and_prefill_histograms_after_observe_prefill():
    latency = RequestMetrics()
    latency.observe_prefill(0.002, 0.3)
    latency.observe_prefill(0.2, 0.4)
    lines = render([], Counter(), latency).splitlines()
    assert "# TYPE pdserve_queue_seconds histogram" in lines and "# TYPE pdserve_prefill_seconds histogram" in lines
    for le, n in (("0.001", 0), ("0.0025", 1), ("0.1", 1), ("0.25", 2), ("+Inf", 2)):
        assert f'pdserve_queue_seconds_bucket{{le="{le}"}} {n}' in lines
    assert "pdserve_queue_seconds_sum 0.202000" in lines and "pdserve_queue_seconds_count 2" in lines
    for le, n in (("0.25", 0), ("0.5", 2), ("+Inf", 2)):
        assert f'pdserve_prefill_seconds_bucket{{le="{le}"}} {n}' in lines
    assert "pdserve_prefill_seconds_sum 0.700000" in lines and "pdserve_prefill_seconds_count 2" in lines


def test_outcomes_and_observations_reach_the_export():
    class Export:
        errors = 0

        def __init__(self):
            self.calls = []

        def request(self, *a):
            self.calls.append(("request", a))

        def prefill(self, *a):
            self.calls.append(("prefill", a))

        def outcome(self, o):
            self.calls.append(("outcome", o))

        def migrated(self):
            self.calls.append(("migrated",))

        def response_saved(self, result):
            self.calls.append(("saved", result))

    export = Export()
    latency = RequestMetrics(export)
    latency.observe(0.0, 0.5, 1.5, 3)
    latency.observe_prefill(0.1, 0.4)
    latency.migrated()
    latency.finish("ok")
    latency.response_saved(True)
    latency.response_saved(True)
    latency.response_saved(False)
    assert export.calls == [("request", (0.5, 0.5, 1.5, 3, False)), ("prefill", (0.1, 0.4)), ("migrated",),
                            ("outcome", "ok"), ("saved", "stored"), ("saved", "stored"), ("saved", "not_stored")]
    text = render([], latency.outcomes, latency)
    assert 'pdserve_requests_total{outcome="ok"} 1' in text and "pdserve_router_ray_metrics_errors_total 0" in text
    assert "pdserve_request_migrations_total 1" in text
    assert ('pdserve_responses_saved_total{result="stored"} 2' in text
            and 'pdserve_responses_saved_total{result="not_stored"} 1' in text)


def test_goodput_counts_requests_meeting_both_targets():
    latency = RequestMetrics(goodput=(0.5, 0.05))
    latency.observe(0.0, 0.4, 0.4 + 10 * 0.04, 11)     # meets both
    latency.observe(0.0, 0.6, 0.6 + 10 * 0.04, 11)     # TTFT too slow
    latency.observe(0.0, 0.1, 0.1 + 10 * 0.06, 11)     # TPOT too slow
    latency.observe(0.0, 0.5, 0.5, 1)                  # one token: TTFT alone decides (at the target)
    lines = render([], latency.outcomes, latency).splitlines()
    assert "pdserve_goodput_requests_total 2" in lines
    assert "# HELP pdserve_goodput_requests_total Finished requests with TTFT <= 0.5 s and TPOT <= 0.05 s" in lines


def test_goodput_targets_follow_the_slo_policy_unless_set():
    from serving.config import AppConfig
    assert AppConfig().goodput_targets == (1.0, 0.1)
    slo = {"ttft_slo": 2.0, "tpot_slo": 0.2}
    assert AppConfig(autoscaling=slo).goodput_targets == (2.0, 0.2)
    both = AppConfig(autoscaling=slo, goodput={"ttft_s": 0.3, "tpot_s": 0.03})
    assert both.goodput_targets == (0.3, 0.03)
    assert AppConfig.model_validate(both.model_dump()).goodput_targets == (0.3, 0.03)


def test_replica_histograms_render_with_pool_and_replica_labels():
    seconds = Histogram("pdserve_kv_transfer_seconds", "t", REPLICA_HISTOGRAMS["kv_transfer_seconds"][1])
    nbytes = Histogram("pdserve_kv_transfer_bytes", "b", REPLICA_HISTOGRAMS["kv_transfer_bytes"][1])
    for s, b in ((0.004, 3 * 2**20), (0.03, 2**30)):
        seconds.observe(s)
        nbytes.observe(b)
    stats = [ReplicaStats("prefill", "p1", 50, 50, 0, 0, 0, {},
                          {"kv_transfer_seconds": seconds.to_wire(), "kv_transfer_bytes": nbytes.to_wire()}),
             ReplicaStats("prefill", "p2", 50, 50, 0, 0, 0, {}, {"kv_transfer_seconds": {"buckets": [1]}}),
             ReplicaStats("decode", "d1", 50, 50, 0, 0, 0, {})]
    text = render(stats, Counter())
    lines = text.splitlines()
    assert lines.count("# TYPE pdserve_kv_transfer_seconds histogram") == 1
    assert 'pdserve_kv_transfer_seconds_bucket{pool="prefill",replica="p1",le="0.005"} 1' in lines
    assert 'pdserve_kv_transfer_seconds_bucket{pool="prefill",replica="p1",le="0.05"} 2' in lines
    assert 'pdserve_kv_transfer_seconds_bucket{pool="prefill",replica="p1",le="+Inf"} 2' in lines
    assert 'pdserve_kv_transfer_seconds_sum{pool="prefill",replica="p1"} 0.034000' in lines
    assert 'pdserve_kv_transfer_seconds_count{pool="prefill",replica="p1"} 2' in lines
    assert 'pdserve_kv_transfer_bytes_bucket{pool="prefill",replica="p1",le="4194304"} 1' in lines
    assert 'pdserve_kv_transfer_bytes_bucket{pool="prefill",replica="p1",le="1073741824"} 2' in lines
    assert 'pdserve_kv_transfer_bytes_bucket{pool="prefill",replica="p1",le="4294967296"} 2' in lines
    assert 'replica="p2"' not in text.split("# TYPE pdserve_kv_transfer_seconds")[1]   # malformed: skipped
    # every family's samples follow its own TYPE line, once
    types = [ln.split()[2] for ln in lines if ln.startswith("# TYPE")]
    assert len(types) == len(set(types))


def test_histogram_wire_round_trip_and_rejection():
    h = Histogram("x_seconds", "x", (0.1, 1.0))
    h.observe(0.5)
    back = Histogram.from_wire("x_seconds", "x", h.to_wire())
    assert back.lines() == h.lines()
    bad_maps = ({}, {"buckets": [1], "counts": [1, 2], "sum": 0, "count": 0},
                {"buckets": "x", "counts": [], "sum": 0, "count": 0})
    for bad in bad_maps:
        with pytest.raises(ValueError):
            Histogram.from_wire("x_seconds", "x", bad)
