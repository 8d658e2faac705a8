"""The router's sliding window of traffic for the SLO autoscaling policy (serving/slo_autoscaling.py).

Called by the router: `arrived` once per request as it is admitted (after validation), `finished`
once per completed request (from `RequestMetrics.observe`), `refused` once per request a decode
replica refused for want of KV blocks (the orchestrator, at the reservation), `local` once per
prompt a decode replica prefilled itself (the orchestrator, at that first token); `snapshot` by Serve's
`record_autoscaling_stats` hook about every `metrics_interval_s`. Pure Python, no locks (the
router's event loop is its only caller). Memory: one tuple per request of the last `window_s`.
"""

from __future__ import annotations

from collections import deque

from serving.slo_autoscaling import (CACHED, INPUT, LOCAL_RATE, LOCAL_TOKENS, OUTPUT, RATE, REFUSED, SAMPLES,
                                     TPOT_P90, TTFT_P90)


def _p90(values: list[float]) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]


class SloWindow:
    def __init__(self, window_s: float = 30.0):
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self.arrivals: deque = deque()     # (t, prompt tokens)
        self.done: deque = deque()         # (t, ttft, tpot or None, output tokens, prefix-cached prompt tokens)
        self.refusals: deque = deque()     # t
        self.locals: deque = deque()       # (t, prompt tokens computed)
        self.started: float | None = None

    def arrived(self, now: float, prompt_tokens: int) -> None:
        self.started = now if self.started is None else self.started
        self.arrivals.append((now, prompt_tokens))

    def finished(self, now: float, ttft: float, tpot: float | None, output_tokens: int,
                 cached_tokens: float = 0.0) -> None:
        """`cached_tokens`: of its prompt, the tokens its prefill found in a prefix cache (per choice)."""
        self.done.append((now, ttft, tpot, output_tokens, cached_tokens))

    def refused(self, now: float) -> None:
        self.refusals.append(now)

    def local(self, now: float, computed_tokens: int) -> None:
        """A prompt (a choice's) that its decode replica prefilled itself, computing `computed_tokens`."""
        self.locals.append((now, computed_tokens))

    def snapshot(self, now: float) -> dict[str, float]:
        """Rates per second over the window (or since the first arrival, if shorter); p90s of the
        requests that finished in it (0 without any); mean lengths (0 without requests): prompts over
        the arrivals, outputs and prefix-cached prompt tokens over the finished requests, tokens
        computed by local prefills over those."""
        for q in (self.arrivals, self.done, self.locals):
            while q and q[0][0] < now - self.window_s:
                q.popleft()
        while self.refusals and self.refusals[0] < now - self.window_s:
            self.refusals.popleft()
        span = min(self.window_s, max(now - self.started, 1.0)) if self.started is not None else self.window_s
        n, k, local = len(self.arrivals), len(self.done), len(self.locals)
        return {RATE: n / span,
                INPUT: sum(a[1] for a in self.arrivals) / n if n else 0.0,
                OUTPUT: sum(d[3] for d in self.done) / k if k else 0.0,
                TTFT_P90: _p90([d[1] for d in self.done]),
                TPOT_P90: _p90([d[2] for d in self.done if d[2] is not None]),
                SAMPLES: float(k), REFUSED: len(self.refusals) / span,
                CACHED: sum(d[4] for d in self.done) / k if k else 0.0,
                LOCAL_RATE: local / span, LOCAL_TOKENS: sum(a[1] for a in self.locals) / local if local else 0.0}
