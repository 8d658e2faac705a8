"""Prometheus text for GET /metrics: per-pool, per-replica engine gauges from the stats
registry, and the router's own request counters and latency histograms."""

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


class Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count) kept in the router replica."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * len(buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        out += [f'{self.name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {self.sum:.6f}",
                      f"{self.name}_count {self.count}"]


_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RequestMetrics:
    """Latencies the router sees per request: TTFT, TPOT (mean inter-token), end to end."""

    def __init__(self):
        self.ttft = Histogram("pdserve_ttft_seconds", "Time to first token, from request arrival", _LATENCY)
        self.tpot = Histogram("pdserve_tpot_seconds", "Mean time per output token after the first", _LATENCY)
        self.e2e = Histogram("pdserve_e2e_seconds", "Request latency, arrival to last token", _LATENCY)
        self.output_tokens = 0

    def observe(self, start: float, first: float, end: float, output_tokens: int) -> None:
        self.ttft.observe(first - start)
        self.e2e.observe(end - start)
        if output_tokens > 1:
            self.tpot.observe((end - first) / (output_tokens - 1))
        self.output_tokens += output_tokens

    def lines(self) -> list[str]:
        return (self.ttft.lines() + self.tpot.lines() + self.e2e.lines()
                + ["# HELP pdserve_output_tokens_total Output tokens returned",
                   "# TYPE pdserve_output_tokens_total counter", f"pdserve_output_tokens_total {self.output_tokens}"])


def render(stats: list[messages.ReplicaStats], outcomes: Counter, latency: RequestMetrics | None = None) -> str:
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
    if latency is not None:
        lines += latency.lines()
    return "\n".join(lines) + "\n"
