"""Prometheus text for GET /metrics: per-pool, per-replica engine gauges, counters and
histograms from the stats registry, and the router's own request counters and histograms.

Where each request series is measured (disaggregated mode; colocated requests, and those a decode
replica prefilled itself, have no prefill result, so they add to TTFT/TPOT/e2e but not to queue
and prefill):
  queue    the router's wait for a decode slot (arrival to prefill dispatch) plus the prefill
           replica's wait from receiving the call to the engine first scheduling the request
           (Serve's own handle queue and the transit in between are not in it; they are in TTFT)
  prefill  first scheduling to first token, measured in the prefill replica (`PrefillResult`)
  ttft, tpot, e2e  at the router, from arrival (after tokenization and validation)
KV transfer time and size are per prefill replica (`ReplicaStats.histograms`): the push ends
after the router already has the first token, so no per-request message can carry it.
"""

from __future__ import annotations

from collections import Counter

from router.prefix_affinity import DECISIONS
from router.slo_window import SloWindow
from serving import messages
from serving.histogram import LATENCY_BUCKETS, QUEUE_BUCKETS, REPLICA_HISTOGRAMS, Histogram, label_text
from serving.serve_metrics import GAUGE_HELP

__all__ = ["Histogram", "RequestMetrics", "render"]

_GAUGES = [(name, GAUGE_HELP[name], attr) for name, attr in (   # (name, help, ReplicaStats field)
    ("pdserve_kv_blocks_total", "kv_blocks_total"), ("pdserve_kv_blocks_free", "kv_blocks_free"),
    ("pdserve_running_requests", "running"), ("pdserve_waiting_requests", "waiting"),
    ("pdserve_waiting_prompt_tokens", "waiting_prompt_tokens"), ("pdserve_lora_waiting_requests", "lora_waiting"))]
OUTCOMES = ("ok", "error", "aborted")


class RequestMetrics:
    """What the router sees per request. `export` (a `serving.serve_metrics.RouterSeries`, or
    None) receives the same observations for Ray's metrics port."""

    def __init__(self, export=None, window_s: float = 30.0, goodput: tuple[float, float] = (1.0, 0.1)):
        self.ttft = Histogram("pdserve_ttft_seconds", "Time to first token, from request arrival", LATENCY_BUCKETS)
        self.tpot = Histogram("pdserve_tpot_seconds", "Mean time per output token after the first", LATENCY_BUCKETS)
        self.e2e = Histogram("pdserve_e2e_seconds", "Request latency, arrival to last token", LATENCY_BUCKETS)
        self.queue = Histogram("pdserve_queue_seconds", "Time from arrival until the prefill engine first "
                               "scheduled the request (router wait for a decode slot + prefill engine queue)",
                               QUEUE_BUCKETS)
        self.prefill = Histogram("pdserve_prefill_seconds", "Prefill time, first scheduling to first token, "
                                 "measured in the prefill replica", LATENCY_BUCKETS)
        self.output_tokens = 0
        self.goodput_targets, self.goodput = goodput, 0   # (TTFT, TPOT) seconds; requests meeting both
        self.outcomes: Counter = Counter()
        self.migrations = 0       # attempts that resumed a request after a replica died (orchestrator)
        self.responses_saved: Counter = Counter()    # "stored" / "not_stored" (router/responses_api.py)
        self.lora_requests: Counter = Counter()      # adapter name -> requests that ran it
        self.lora_tokens: Counter = Counter()        # adapter name -> output tokens of its finished requests
        self.export = export
        self.window = SloWindow(window_s)      # the SLO autoscaling policy's view (router/slo_window.py)

    def observe(self, start: float, first: float, end: float, output_tokens: int,
                stream_tokens: int | None = None, cached_tokens: float = 0.0) -> None:
        """One finished request. `stream_tokens`: the tokens of its longest choice, which sets
        TPOT when n > 1 choices decode side by side (default: `output_tokens`). `cached_tokens`:
        the prompt tokens its choices' prefills found in a prefix cache, per choice (the SLO window's)."""
        ttft, e2e = first - start, end - start
        per_stream = output_tokens if stream_tokens is None else stream_tokens
        tpot = (end - first) / (per_stream - 1) if per_stream > 1 else None
        self.ttft.observe(ttft)
        self.e2e.observe(e2e)
        if tpot is not None:
            self.tpot.observe(tpot)
        self.window.finished(end, ttft, tpot, per_stream, cached_tokens)
        self.output_tokens += output_tokens
        good = ttft <= self.goodput_targets[0] and (tpot is None or tpot <= self.goodput_targets[1])
        self.goodput += good
        if self.export is not None:
            self.export.request(ttft, tpot, e2e, output_tokens, good)

    def observe_prefill(self, queue_seconds: float, prefill_seconds: float) -> None:
        self.queue.observe(queue_seconds)
        self.prefill.observe(prefill_seconds)
        if self.export is not None:
            self.export.prefill(queue_seconds, prefill_seconds)

    def migrated(self) -> None:
        """One request moved on after a replica died with its tokens partly out."""
        self.migrations += 1
        if self.export is not None:
            self.export.migrated()

    def response_saved(self, kept: bool) -> None:
        """One Responses API answer the router tried to store: kept, or not (the store failed,
        timed out, or the response was larger than its bound)."""
        result = "stored" if kept else "not_stored"
        self.responses_saved[result] += 1
        if self.export is not None:
            self.export.response_saved(result)

    def lora_request(self, adapter: str) -> None:
        """One request that runs LoRA adapter `adapter` (counted when it starts)."""
        self.lora_requests[adapter] += 1
        if self.export is not None:
            self.export.lora_request(adapter)

    def lora_output(self, adapter: str, tokens: int) -> None:
        """The output tokens of a finished request that ran LoRA adapter `adapter`."""
        self.lora_tokens[adapter] += tokens
        if self.export is not None:
            self.export.lora_output(adapter, tokens)

    def finish(self, outcome: str) -> None:
        """Count one request that ended as `outcome` (one of OUTCOMES)."""
        self.outcomes[outcome] += 1
        if self.export is not None:
            self.export.outcome(outcome)

    def lines(self) -> list[str]:
        out = []
        for h in (self.ttft, self.tpot, self.e2e, self.queue, self.prefill):
            out += h.lines()
        out += ["# HELP pdserve_output_tokens_total Output tokens returned",
                "# TYPE pdserve_output_tokens_total counter", f"pdserve_output_tokens_total {self.output_tokens}",
                f"# HELP pdserve_goodput_requests_total Finished requests with TTFT <= {self.goodput_targets[0]:g} s "
                f"and TPOT <= {self.goodput_targets[1]:g} s", "# TYPE pdserve_goodput_requests_total counter",
                f"pdserve_goodput_requests_total {self.goodput}",
                "# HELP pdserve_request_migrations_total Attempts that resumed a request on other replicas "
                "after one died with its output partly sent", "# TYPE pdserve_request_migrations_total counter",
                f"pdserve_request_migrations_total {self.migrations}",
                "# HELP pdserve_responses_saved_total Responses API answers the router tried to store, by result",
                "# TYPE pdserve_responses_saved_total counter",
                *(f'pdserve_responses_saved_total{{result="{r}"}} {self.responses_saved[r]}'
                  for r in ("stored", "not_stored")),
                "# HELP pdserve_lora_requests_total Requests that ran a LoRA adapter, by adapter",
                "# TYPE pdserve_lora_requests_total counter",
                *(f'pdserve_lora_requests_total{{{label_text({"adapter": a})}}} {n}'
                  for a, n in sorted(self.lora_requests.items())),
                "# HELP pdserve_lora_output_tokens_total Output tokens of finished requests that ran a LoRA "
                "adapter, by adapter", "# TYPE pdserve_lora_output_tokens_total counter",
                *(f'pdserve_lora_output_tokens_total{{{label_text({"adapter": a})}}} {n}'
                  for a, n in sorted(self.lora_tokens.items()))]
        if self.export is not None:
            out += ["# HELP pdserve_router_ray_metrics_errors_total Errors exporting the router's series to "
                    "Ray's metrics port (the first one turns the export off)",
                    "# TYPE pdserve_router_ray_metrics_errors_total counter",
                    f"pdserve_router_ray_metrics_errors_total {self.export.errors}"]
        return out


def _replica_labels(s: messages.ReplicaStats) -> dict[str, str]:
    return {"pool": s.pool, "replica": s.replica_id}


def _replica_lines(stats: list[messages.ReplicaStats]) -> list[str]:
    stats = sorted(stats, key=lambda s: (s.pool, s.replica_id))
    lines = []
    for name, help_text, attr in _GAUGES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        lines += [f"{name}{{{label_text(_replica_labels(s))}}} {getattr(s, attr)}" for s in stats]
    for key in sorted({k for s in stats for k in s.extra}):
        name = f"pdserve_{key}"
        lines += [f"# HELP {name} Replica counter {key}", f"# TYPE {name} counter"]
        lines += [f"{name}{{{label_text(_replica_labels(s))}}} {s.extra[key]}" for s in stats if key in s.extra]
    for key in sorted({k for s in stats for k in s.histograms}):
        help_text = REPLICA_HISTOGRAMS.get(key, (f"Replica histogram {key}",))[0]
        family = Histogram(f"pdserve_{key}", help_text, ())
        lines += family.header()
        for s in stats:
            if key in s.histograms:
                try:
                    h = Histogram.from_wire(family.name, help_text, s.histograms[key])
                except ValueError:
                    continue  # a malformed report never breaks /metrics
                lines += h.samples(_replica_labels(s))
    return lines


def render(stats: list[messages.ReplicaStats], outcomes: Counter, latency: RequestMetrics | None = None) -> str:
    lines = _replica_lines(stats)
    lines += ["# HELP pdserve_requests_total Requests finished by the router, by outcome",
              "# TYPE pdserve_requests_total counter"]
    for outcome in OUTCOMES:
        lines.append(f'pdserve_requests_total{{outcome="{outcome}"}} {outcomes.get(outcome, 0)}')
    if latency is not None:
        lines += latency.lines()
    lines += ["# HELP pdserve_prefix_affinity_decisions_total Prompts routed by this router, by pool and "
              "decision: affinity (sent to the replica with the longest cached prefix), imbalanced (matched, "
              "but that replica was too loaded), no_match",
              "# TYPE pdserve_prefix_affinity_decisions_total counter"]
    for (pool, decision), count in sorted(DECISIONS.items()):
        lines.append(f'pdserve_prefix_affinity_decisions_total{{pool="{pool}",decision="{decision}"}} {count}')
    return "\n".join(lines) + "\n"
