"""The Grafana dashboard (docs/grafana/pdserve.json): it is pdserve/dashboard.py's output, and every
series it queries is one that a live deployment exports (the router's /metrics, Ray's metrics port),
or, for those that appear only after a failure or on an autoscaled cluster, one Ray declares."""

import json
import re
import urllib.request
from pathlib import Path

from pdserve.dashboard import dashboard
from service_util import http, ray_metrics_url, wait_until

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
# Series that exist only after an event this deployment does not have: name -> where it is declared.
ONLY_AFTER_FAILURE = {"pdserve_kv_transfers_failed"}
RAY_DECLARED = {                     # Ray source file under ray/ that declares it, without the `ray_` prefix
    "ray_serve_autoscaling_target_replicas": "serve/_private/deployment_state.py",     # autoscaled deployments
    "ray_serve_health_check_failures_total": "serve/_private/deployment_state.py",     # after a failed check
    "autoscaler_active_nodes": "autoscaler/_private/prom_metrics.py",                  # with a cluster autoscaler
    "autoscaler_pending_nodes": "autoscaler/_private/prom_metrics.py",
}


def _series() -> set[str]:
    names = set()
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            names |= {re.sub(r"_bucket$", "", n) for n in re.findall(r"\b((?:pdserve|ray|autoscaler)_\w+)\s*\{?",
                                                                    target["expr"])}
    return names


def test_committed_json_is_the_generated_dashboard():
    committed = json.loads((ROOT / "docs" / "grafana" / "pdserve.json").read_text())
    assert committed == dashboard(), "run: python -m pdserve.dashboard > docs/grafana/pdserve.json"
    ids = [p["id"] for p in committed["panels"]]
    assert len(ids) == len(set(ids))
    assert all(t["expr"].count("(") == t["expr"].count(")") for p in committed["panels"] for t in p.get("targets", []))


def test_every_series_of_the_dashboard_is_exported(disagg):
    import ray
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
    assert http(disagg, "/v1/completions", body)[0] == 200
    assert http(disagg, "/v1/completions", {**body, "max_tokens": -1})[0] == 400     # an HTTP error series
    series = _series()
    pd = {s for s in series if s.startswith("pdserve_")}
    assert {"pdserve_ttft_seconds", "pdserve_goodput_requests_total", "pdserve_kv_transfers_sent"} <= pd
    declared: set[str] = set()

    def on_router() -> bool:     # replicas report every 0.5 s; a push's counters follow its end
        declared.update(re.findall(r"^# TYPE (\S+) ", http(disagg, "/metrics")[1], re.M))
        return pd - ONLY_AFTER_FAILURE <= declared
    assert wait_until(on_router, 30), f"not on the router's /metrics: {pd - ONLY_AFTER_FAILURE - declared}"

    ray_dir = Path(ray.__file__).parent
    for name, where in RAY_DECLARED.items():
        bare = name.removeprefix("ray_").removeprefix("autoscaler_")
        assert f'"{bare}"' in (ray_dir / where).read_text(), f"{name} is not declared in ray/{where}"
    wanted = {s for s in series if s.startswith("ray_")} - set(RAY_DECLARED)
    url = ray_metrics_url()
    missing: set[str] = set()

    def exported() -> bool:
        ray_text = urllib.request.urlopen(url, timeout=5).read().decode()
        missing.clear()
        missing.update(w for w in wanted if not re.search(rf"^{w}(_bucket)?\{{", ray_text, re.M))
        return not missing
    assert wait_until(exported, 90, every=2), f"not on Ray's metrics port: {missing}"
