"""The Grafana dashboard for pdserve (docs/grafana/pdserve.json), built from the panel list below.

    python -m pdserve.dashboard > docs/grafana/pdserve.json

It reads two Prometheus scrapes (README, Observability): the router's GET /metrics (the `pdserve_*`
series, picked by the `$job` variable) and Ray's metrics export (Ray Serve's `ray_serve_*` series and
the cluster autoscaler's `autoscaler_*`, picked by `$application`). tests/test_dashboard.py checks
that the committed JSON is this module's output and that every series it queries is one pdserve or
Ray produces. A tool: nothing at run time imports it.
"""

from __future__ import annotations

import json
import sys

PD = '{job=~"$job"}'
PD_OK = '{job=~"$job",outcome="ok"}'
RATE = "[$__rate_interval]"


def _app(extra: str = "") -> str:
    return '{application=~"$application"' + (f",{extra}" if extra else "") + "}"


def _quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
    group = f"le{', ' + by if by else ''}"
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{PD}{RATE})))",
             f"p{int(q * 100)}" + (f" {{{{{by}}}}}" if by else "")) for q in (0.5, 0.9, 0.99)]


# (row title, [(panel title, unit, [(expr, legend)], description)])
ROWS = [
    ("Requests (router)", [
        ("Requests by outcome", "reqps",
         [(f"sum by (outcome) (rate(pdserve_requests_total{PD}{RATE}))", "{{outcome}}"),
          (f"sum(rate(pdserve_request_migrations_total{PD}{RATE}))", "migrated (attempts/s)")],
         "Requests finished by the router: ok, error (4xx/5xx after admission), aborted (client gone, deadline); "
         "and attempts that moved a request on after a replica died with its output partly sent."),
        ("Goodput and SLO attainment", "reqps",
         [(f"sum(rate(pdserve_goodput_requests_total{PD}{RATE}))", "goodput (req/s)"),
          (f"sum(rate(pdserve_goodput_requests_total{PD}{RATE})) / "
           f"sum(rate(pdserve_requests_total{PD_OK}{RATE}))", "attainment (fraction of ok)")],
         "Requests that met the `goodput` TTFT and TPOT targets (the SLO policy's when it is on)."),
        ("Output tokens", "short",
         [(f"sum(rate(pdserve_output_tokens_total{PD}{RATE}))", "tokens/s")], "Tokens returned per second."),
        ("TTFT", "s", _quantiles("pdserve_ttft_seconds"), "Time to first token, from arrival at the router."),
        ("TPOT", "s", _quantiles("pdserve_tpot_seconds"), "Mean time per output token after the first."),
        ("End-to-end latency", "s", _quantiles("pdserve_e2e_seconds"), "Arrival to last token."),
        ("Queue and prefill", "s",
         _quantiles("pdserve_queue_seconds")[1:2] + _quantiles("pdserve_prefill_seconds")[1:2],
         "p90 of the wait until the prefill engine scheduled the request (queue) and of the prefill itself."),
    ]),
    ("Pools", [
        ("Replicas per pool", "short",
         [(f"count by (pool) (pdserve_kv_blocks_total{PD})", "{{pool}} (reporting)"),
          (f"sum by (deployment) (ray_serve_deployment_replica_healthy{_app()})", "{{deployment}} (healthy, Serve)"),
          (f"max by (deployment) (ray_serve_autoscaling_target_replicas{_app()})", "{{deployment}} (target)")],
         "Engine replicas reporting to the router, Serve's healthy replicas and its autoscaling target."),
        ("Nodes per type", "short",
         [("sum by (NodeType) (autoscaler_active_nodes)", "{{NodeType}} active"),
          ("sum by (NodeType) (autoscaler_pending_nodes)", "{{NodeType}} pending")],
         "Cluster autoscaler's nodes (on a cluster started with an autoscaling config)."),
        ("KV utilization", "percentunit",
         [(f"1 - sum by (pool) (pdserve_kv_blocks_free{PD}) / sum by (pool) (pdserve_kv_blocks_total{PD})",
           "{{pool}}"),
          (f"max by (pool) (1 - pdserve_kv_blocks_free{PD} / pdserve_kv_blocks_total{PD})", "{{pool}} (fullest)")],
         "Fraction of KV blocks in use per pool, and of its fullest replica."),
        ("Engine queues", "short",
         [(f"sum by (pool) (pdserve_running_requests{PD})", "{{pool}} running"),
          (f"sum by (pool) (pdserve_waiting_requests{PD})", "{{pool}} waiting"),
          (f"sum by (pool) (pdserve_lora_waiting_requests{PD})", "{{pool}} waiting for a LoRA place")],
         "Sequences in the engines' running batches and queues; of the queued, those whose LoRA adapter "
         "loaded at run time waits for a place (max_loras)."),
        ("Queued prompt tokens", "short",
         [(f"sum by (pool) (pdserve_waiting_prompt_tokens{PD})", "{{pool}}")],
         "Prompt tokens queued or mid-prefill (the prefill pool's scaling signal)."),
        ("Serve queues", "short",
         [(f"sum by (deployment) (ray_serve_deployment_queued_queries{_app()})", "{{deployment}}")],
         "Requests waiting in Serve's handles for a replica of each deployment."),
    ]),
    ("KV transfer", [
        ("Transfers", "ops",
         [(f"sum(rate(pdserve_kv_transfers_sent{PD}{RATE}))", "sent (prefill)"),
          (f"sum(rate(pdserve_kv_transfers_landed{PD}{RATE}))", "landed (decode)"),
          (f"sum by (pool) (rate(pdserve_kv_transfers_failed{PD}{RATE}))", "failed ({{pool}})")],
         "KV pushes per second; failures by the side that saw them."),
        ("Transfer rate", "Bps",
         [(f"sum(rate(pdserve_kv_bytes_sent{PD}{RATE}))", "sent"),
          (f"sum(rate(pdserve_kv_bytes_received{PD}{RATE}))", "received")], "KV bytes per second."),
        ("Transfer time", "s", _quantiles("pdserve_kv_transfer_seconds"),
         "One push, send start to the decode replica's ack."),
        ("Blocks not sent", "ops",
         [(f"sum(rate(pdserve_kv_blocks_reused{PD}{RATE}))", "reused (decode)")],
         "KV blocks per second that decode replicas already held (their prefix caches): the prefill "
         "replicas did not push them."),
    ]),
    ("Ray Serve", [
        ("HTTP requests", "reqps",
         [(f"sum by (route) (rate(ray_serve_num_http_requests_total{_app()}{RATE}))", "{{route}}")],
         "Requests through Serve's proxy."),
        ("HTTP errors", "reqps",
         [(f"sum by (error_code) (rate(ray_serve_num_http_error_requests_total{_app()}{RATE}))", "{{error_code}}")],
         "Error responses by status code."),
        ("Replica health-check failures", "short",
         [(f"sum by (deployment) (increase(ray_serve_health_check_failures_total{_app()}{RATE}))",
           "{{deployment}}")], "Failed health checks (a replica failing them is replaced)."),
    ]),
]


def _variables() -> list[dict]:
    def query(name: str, label: str, metric: str, default: str) -> dict:
        return {"name": name, "label": label, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "query": {"query": f"label_values({metric}, {name})", "refId": name},
                "definition": f"label_values({metric}, {name})", "includeAll": True, "multi": True,
                "allValue": ".*", "current": {"text": default, "value": default}, "refresh": 2}
    return [{"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
            query("job", "pdserve scrape job", "pdserve_requests_total", "All"),
            query("application", "Serve application", "ray_serve_deployment_replica_healthy", "All")]


def dashboard() -> dict:
    panels, y, pid = [], 0, 1
    for row, items in ROWS:
        panels.append({"id": pid, "type": "row", "title": row, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y = pid + 1, y + 1
        for i, (title, unit, exprs, desc) in enumerate(items):
            panels.append({
                "id": pid, "type": "timeseries", "title": title, "description": desc,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
                "targets": [{"expr": e, "legendFormat": legend, "refId": chr(ord("A") + k)}
                            for k, (e, legend) in enumerate(exprs)]})
            pid += 1
        y += 8 * ((len(items) + 2) // 3)
    return {"title": "pdserve", "uid": "pdserve", "schemaVersion": 39, "version": 1, "editable": True,
            "tags": ["pdserve", "ray-serve"], "time": {"from": "now-30m", "to": "now"}, "refresh": "10s",
            "templating": {"list": _variables()}, "panels": panels}


def main() -> int:
    json.dump(dashboard(), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
