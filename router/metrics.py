"""Prometheus text for GET /metrics: per-pool, per-replica engine gauges from the stats
registry, and the router's own request counters."""

from __future__ import annotations

from collections import Counter

from pdserve import messages

_GAUGES = [
    ("pdserve_kv_blocks_total", "KV blocks in the replica's pool", "kv_blocks_total"),
    ("pdserve_kv_blocks_free", "KV blocks free (cached-but-unused included)", "kv_blocks_free"),
    ("pdserve_running_requests", "Sequences in the running batch", "running"),
    ("pdserve_waiting_requests", "Sequences queued in the engine", "waiting"),
    ("pdserve_waiting_prompt_tokens", "Prompt tokens queued or mid-prefill", "waiting_prompt_tokens"),
]


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(stats: list[messages.ReplicaStats], outcomes: Counter) -> str:
    lines = []
    for name, help_text, attr in _GAUGES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for s in sorted(stats, key=lambda s: (s.pool, s.replica_id)):
            lines.append(f'{name}{{pool="{_esc(s.pool)}",replica="{_esc(s.replica_id)}"}} {getattr(s, attr)}')
    for key in sorted({k for s in stats for k in s.extra}):
        name = f"pdserve_{key}"
        lines += [f"# HELP {name} Replica counter {key}", f"# TYPE {name} counter"]
        for s in sorted(stats, key=lambda s: (s.pool, s.replica_id)):
            if key in s.extra:
                lines.append(f'{name}{{pool="{_esc(s.pool)}",replica="{_esc(s.replica_id)}"}} {s.extra[key]}')
    lines += ["# HELP pdserve_requests_total Requests finished by the router, by outcome",
              "# TYPE pdserve_requests_total counter"]
    for outcome in ("ok", "error", "aborted"):
        lines.append(f'pdserve_requests_total{{outcome="{outcome}"}} {outcomes.get(outcome, 0)}')
    return "\n".join(lines) + "\n"
