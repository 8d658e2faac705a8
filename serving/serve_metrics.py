"""The key pdserve series, also exported through `ray.serve.metrics` to Ray's metrics port.

Ray prefixes every application metric with `ray_` (so `pdserve_ttft_seconds` is scraped as
`ray_pdserve_ttft_seconds`) and Serve adds the `deployment`, `replica` and `application` tags.
The router's GET /metrics text is built separately (router/metrics.py) and does not depend on this.

Contract: nothing here ever raises into a request. Creating or recording a Ray metric that
fails is logged once, counted in `errors`, and turns that object's export off.
"""

from __future__ import annotations

import logging

from serving.histogram import LATENCY_BUCKETS, QUEUE_BUCKETS, REPLICA_HISTOGRAMS

log = logging.getLogger(__name__)

ROUTER_HISTOGRAMS = {
    "ttft": ("pdserve_ttft_seconds", "Time to first token, from request arrival at the router"),
    "tpot": ("pdserve_tpot_seconds", "Mean time per output token after the first"),
    "e2e": ("pdserve_e2e_seconds", "Request latency, arrival to last token"),
    "queue": ("pdserve_queue_seconds", "Time from arrival until the prefill engine first scheduled the request"),
    "prefill": ("pdserve_prefill_seconds", "Prefill time, first scheduling to first token"),
}
# Every replica gauge's help text, written once: the router's GET /metrics (router/metrics.py) and
# Ray's port (REPLICA_GAUGES below) show them.
GAUGE_HELP = {
    "pdserve_kv_blocks_total": "KV blocks in the replica's pool",
    "pdserve_kv_blocks_used": "KV blocks in use (total minus free)",
    "pdserve_kv_blocks_free": "KV blocks free (cached-but-unused included)",
    "pdserve_running_requests": "Sequences in the running batch",
    "pdserve_waiting_requests": "Sequences queued in the engine",
    "pdserve_waiting_prompt_tokens": "Prompt tokens queued or mid-prefill",
    "pdserve_lora_waiting_requests": "Sequences queued whose LoRA adapter loaded at run time has no place yet "
                                     "(max_loras all in use)",
}
# Those exported to Ray's port: ReplicaStats field (kv_blocks_used: total minus free) -> (name, help).
REPLICA_GAUGES = {key: (name, GAUGE_HELP[name]) for key, name in (
    ("kv_blocks_used", "pdserve_kv_blocks_used"), ("kv_blocks_free", "pdserve_kv_blocks_free"),
    ("running", "pdserve_running_requests"), ("waiting", "pdserve_waiting_requests"),
    ("lora_waiting", "pdserve_lora_waiting_requests"))}


class _Export:
    """Holds Ray metric objects built by `build`; `_record` runs a recording function on them."""

    def __init__(self, what: str, build):
        self.what, self.errors, self._m = what, 0, None
        try:
            self._m = build()
        except Exception as exc:  # noqa: BLE001 - a metrics failure must never break serving
            self._fail(exc)

    @property
    def enabled(self) -> bool:
        return self._m is not None

    def _record(self, fn) -> None:
        if self._m is None:
            return
        try:
            fn(self._m)
        except Exception as exc:  # noqa: BLE001 - a metrics failure must never break serving
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        self.errors += 1
        self._m = None
        log.warning("exporting %s series to Ray's metrics port is off after an error: %r", self.what, exc)


class RouterSeries(_Export):
    """The router deployment's request series: latency histograms, outcomes, output tokens,
    migrations, stored responses."""

    def __init__(self):
        super().__init__("router", self._build)

    @staticmethod
    def _build() -> dict:
        from ray.serve import metrics
        m = {key: metrics.Histogram(name, help_text,
                                    boundaries=list(QUEUE_BUCKETS if key == "queue" else LATENCY_BUCKETS))
             for key, (name, help_text) in ROUTER_HISTOGRAMS.items()}
        m["requests"] = metrics.Counter("pdserve_requests_total", "Requests finished by the router, by outcome",
                                        tag_keys=("outcome",))
        m["output_tokens"] = metrics.Counter("pdserve_output_tokens_total", "Output tokens returned")
        m["goodput"] = metrics.Counter("pdserve_goodput_requests_total",
                                       "Finished requests that met the goodput TTFT and TPOT targets")
        m["migrations"] = metrics.Counter("pdserve_request_migrations_total",
                                          "Attempts that resumed a request after a replica died")
        m["responses_saved"] = metrics.Counter("pdserve_responses_saved_total", "Responses API answers the router "
                                               "tried to store, by result", tag_keys=("result",))
        m["lora_requests"] = metrics.Counter("pdserve_lora_requests_total", "Requests that ran a LoRA adapter, by "
                                             "adapter", tag_keys=("adapter",))
        m["lora_tokens"] = metrics.Counter("pdserve_lora_output_tokens_total", "Output tokens of finished requests "
                                           "that ran a LoRA adapter, by adapter", tag_keys=("adapter",))
        return m

    def request(self, ttft: float, tpot: float | None, e2e: float, output_tokens: int, good: bool = False) -> None:
        def record(m):
            m["ttft"].observe(ttft)
            m["e2e"].observe(e2e)
            if tpot is not None:
                m["tpot"].observe(tpot)
            if output_tokens > 0:
                m["output_tokens"].inc(output_tokens)
            if good:
                m["goodput"].inc(1)
        self._record(record)

    def prefill(self, queue_seconds: float, prefill_seconds: float) -> None:
        self._record(lambda m: (m["queue"].observe(queue_seconds), m["prefill"].observe(prefill_seconds)))

    def outcome(self, outcome: str) -> None:
        self._record(lambda m: m["requests"].inc(1, tags={"outcome": outcome}))

    def migrated(self) -> None:
        self._record(lambda m: m["migrations"].inc(1))

    def response_saved(self, result: str) -> None:
        self._record(lambda m: m["responses_saved"].inc(1, tags={"result": result}))

    def lora_request(self, adapter: str) -> None:
        self._record(lambda m: m["lora_requests"].inc(1, tags={"adapter": adapter}))

    def lora_output(self, adapter: str, tokens: int) -> None:
        if tokens > 0:
            self._record(lambda m: m["lora_tokens"].inc(tokens, tags={"adapter": adapter}))


class ReplicaSeries(_Export):
    """An engine replica's load gauges (set from each stats push) and its histograms
    (`REPLICA_HISTOGRAMS`: KV transfer time and size), tagged with the pool."""

    def __init__(self, pool: str):
        self.pool = pool
        super().__init__(f"{pool} replica", self._build)

    def _build(self) -> dict:
        from ray.serve import metrics
        m = {key: metrics.Gauge(name, help_text, tag_keys=("pool",))
             for key, (name, help_text) in REPLICA_GAUGES.items()}
        for key, (help_text, buckets) in REPLICA_HISTOGRAMS.items():
            m[key] = metrics.Histogram(f"pdserve_{key}", help_text, boundaries=list(buckets), tag_keys=("pool",))
        for metric in m.values():
            metric.set_default_tags({"pool": self.pool})   # Serve's override returns None: no chaining
        return m

    def load(self, stats) -> None:
        """Set the gauges from a `messages.ReplicaStats`."""
        def record(m):
            m["kv_blocks_used"].set(stats.kv_blocks_total - stats.kv_blocks_free)
            m["kv_blocks_free"].set(stats.kv_blocks_free)
            m["running"].set(stats.running)
            m["waiting"].set(stats.waiting)
            m["lora_waiting"].set(stats.lora_waiting)
        self._record(record)

    def observe(self, key: str, value: float) -> None:
        self._record(lambda m: m[key].observe(value))
