"""The Ray Serve export (serving.serve_metrics) never raises into a request. No Ray cluster needed:
outside a replica Ray's metric objects are created and record without Serve's tags."""

from serving.messages import ReplicaStats
from serving.serve_metrics import ReplicaSeries, RouterSeries, _Export


def test_router_and_replica_series_record_without_errors():
    router = RouterSeries()
    router.request(0.1, 0.02, 0.5, 20, True)
    router.request(0.1, None, 0.1, 0)        # one token: no TPOT; zero tokens: no inc (Ray rejects inc(0))
    router.prefill(0.0, 0.08)
    for outcome in ("ok", "error", "aborted"):
        router.outcome(outcome)
    router.migrated()
    router.response_saved("stored")
    router.response_saved("not_stored")
    router.lora_request("sql")
    router.lora_output("sql", 12)
    router.lora_output("sql", 0)             # none: no inc
    replica = ReplicaSeries("prefill")
    replica.load(ReplicaStats("prefill", "p1", 100, 60, 3, 2, 50))
    replica.observe("kv_transfer_seconds", 0.01)
    replica.observe("kv_transfer_bytes", 2**20)
    assert router.enabled and replica.enabled and router.errors == replica.errors == 0


def test_a_failing_export_is_counted_once_and_turned_off():
    def broken_build():
        raise RuntimeError("no metrics agent")
    dead = _Export("test", broken_build)
    assert not dead.enabled and dead.errors == 1
    dead._record(lambda m: m["x"])           # disabled: not called, nothing raised
    assert dead.errors == 1

    calls = []
    flaky = _Export("test", lambda: {"h": None})
    flaky._record(lambda m: calls.append(1) or m["h"].observe(1.0))   # AttributeError inside
    flaky._record(lambda m: calls.append(2))
    assert calls == [1] and flaky.errors == 1 and not flaky.enabled
