"""The SLO policy's decision, shared by the Serve policy (serving/slo_autoscaling.py) and the simulator.

Each tick, from an `Observation` of the last window (arrival rate, mean prompt/output lengths, the
mean prompt tokens served from prefix caches, the rate and mean size of local prefills, measured
TTFT/TPOT p90 at the router):
  1. correct: compare the measured p90s with what the model predicts at the current counts and this
     load; move each correction factor (prefill, decode) geometrically toward measured / predicted
     (`gain` per tick, each step within x0.5..x2, the factor within `bounds`); needs `min_samples`;
     the prefill factor holds while the local prefills' TTFT is the predicted p90;
  2. size: `size_fleet` gives the least prefill and decode counts meeting both SLOs at the arrival rate
     plus the backlog drained over `drain_s` (queued prompt tokens for prefill; for decode, requests
     waiting for a decode slot plus the rate of requests refused for want of decode KV): a fleet sized
     for the arrival rate alone never drains a queue built while replicas were starting;
  3. hysteresis, per pool: scale up to the sized count at once; scale down one replica per tick, only
     when the load / (1 - hysteresis) still fits one replica fewer and no replica is warming up;
  4. no observation (the router has not reported) holds both pools; an SLO no replica count can meet
     holds them too, with the reason.
Bounds (min/max) and Serve's upscale/downscale delays are applied by the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from serving.slo_model import StepModel, Workload, local_ttft, mixed_ttft_p90, size_fleet


@dataclass(frozen=True)
class SloTargets:
    ttft_slo: float
    tpot_slo: float
    utilization: float = 0.8       # decode pool's busy fraction at its SLO batch
    hysteresis: float = 0.2
    gain: float = 0.5              # how far one tick moves a correction toward measured / predicted
    bounds: tuple[float, float] = (0.25, 8.0)
    min_samples: int = 20          # completed requests in the window before correcting
    drain_s: float = 20.0          # a backlog is sized to drain within this long

    def __post_init__(self):
        if not (self.ttft_slo > 0 and self.tpot_slo > 0 and 0 < self.utilization <= 1
                and 0 <= self.hysteresis < 1 and 0 <= self.gain <= 1 and self.drain_s > 0 and 0 < self.bounds[0] <= 1 <= self.bounds[1]):
            raise ValueError(f"invalid SLO targets {self}")


@dataclass(frozen=True)
class Observation:
    rate: float                    # arrivals/s over the window
    input_len: float               # mean prompt tokens of the window's requests
    output_len: float              # mean output tokens
    ttft_p90: float | None = None  # measured at the router; None without enough samples
    tpot_p90: float | None = None
    samples: int = 0               # completed requests behind the percentiles
    queued_prompt_tokens: float = 0.0   # prefill backlog now (the prefill replicas' autoscaling metric)
    waiting_requests: float = 0.0       # requests waiting for decode: in the decode engines' queues (live),
                                        # at the router for want of KV (simulator)
    refused_rate: float = 0.0           # requests/s refused for want of decode KV (503 at the reservation)
    cached_len: float = 0.0             # mean prompt tokens the prefills found in their prefix caches
    local_rate: float = 0.0             # prompts/s decode replicas prefilled themselves (local prefill)
    local_len: float = 0.0              # mean prompt tokens such a prefill computed

    def workload(self) -> Workload:
        rate = max(self.rate, 0.0)
        share = min(1.0, self.local_rate / rate) if rate > 0 else 0.0
        return Workload(rate, max(self.input_len, 1.0), max(self.output_len, 1.0), max(self.cached_len, 0.0),
                        share, max(self.local_len, 0.0))


@dataclass(frozen=True)
class SloDecision:
    prefill: int
    decode: int
    correction: tuple[float, float]
    predicted_ttft_p90: float
    predicted_tpot: float
    reason: str


def predicted_batch(m: StepModel, w: Workload, decode: int, correction: float) -> float:
    """The decode batch B at `decode` replicas: B = rate * (out - 1) * tpot(B) / decode (Little)."""
    batch = 1.0
    for _ in range(20):
        tpot = m.tpot(batch, w.context, w.local_rows) * correction
        batch = min(max(1.0, w.rate * max(w.output_len - 1, 0) * tpot / decode), m.max_num_seqs)
    return batch


def predicted_tpot(m: StepModel, w: Workload, decode: int, correction: float) -> float:
    """TPOT at `decode` replicas (at `predicted_batch`)."""
    return m.tpot(predicted_batch(m, w, decode, correction), w.context, w.local_rows) * correction


def predicted_ttft_p90(m: StepModel, w: Workload, prefill: int, decode: int,
                       correction: tuple[float, float]) -> tuple[float, float]:
    """TTFT p90 over every request at these counts (the prefill pool's and local prefills'), and the
    local prefills' TTFT (0 without any)."""
    cp, cd = correction
    local = local_ttft(m, w, predicted_batch(m, w, decode, cd), cd)
    return mixed_ttft_p90(m.prefill_time(w.computed_len) * cp, w, prefill, local), local


def _corrected(factor: float, measured: float | None, predicted: float, slo: float, t: SloTargets,
               samples: int) -> float:
    """Only where the model predicts the SLO is met at the current counts: beyond it the fleet is short,
    a backlog (which the model does not price) is expected, and scaling up, not a correction, is the fix."""
    if measured is None or samples < t.min_samples or not 0 < predicted <= slo or measured <= 0:
        return factor
    step = min(2.0, max(0.5, (measured / predicted) ** t.gain))
    return min(t.bounds[1], max(t.bounds[0], factor * step))


def _step(current: int, sized: int, sized_with_margin: int, warming: bool) -> int:
    if sized > current:
        return sized
    if current > 1 and not warming and sized_with_margin <= current - 1:
        return current - 1
    return current


def has_backlog(m: StepModel, obs: Observation | None, prefill: int) -> bool:
    """More queued prompt tokens than one step of every prefill replica, a request or more waiting for
    decode (on average: one landing between two steps is not a backlog), or any refused for want of KV."""
    return obs is not None and (obs.waiting_requests >= 1 or obs.refused_rate > 0
                                or obs.queued_prompt_tokens > prefill * m.max_batched_tokens)


def decide(m: StepModel, t: SloTargets, obs: Observation | None, prefill: int, decode: int,
           correction: tuple[float, float] = (1.0, 1.0), warming: bool = False, quiet: bool = True) -> SloDecision:
    """Replica counts for both pools (see the module docstring); `prefill`/`decode` are the current counts.
    `quiet`: no backlog during the measurement window (the caller tracks it with `has_backlog`); the
    window's percentiles of requests that waited through a backlog would teach the model queueing."""
    prefill, decode = max(prefill, 1), max(decode, 1)
    if obs is None:
        return SloDecision(prefill, decode, correction, math.nan, math.nan, "no router metrics yet")
    w = obs.workload()
    cp, cd = correction
    backlog_p = obs.queued_prompt_tokens / w.input_len / t.drain_s
    backlog_d = obs.waiting_requests / t.drain_s + obs.refused_rate
    if w.rate > 0 and not warming and quiet and not has_backlog(m, obs, prefill):
        predicted, local = predicted_ttft_p90(m, w, prefill, decode, (cp, cd))
        if predicted != local:       # else the local prefills' steps set the p90, not the pool
            cp = _corrected(cp, obs.ttft_p90, predicted, t.ttft_slo, t, obs.samples)
        cd = _corrected(cd, obs.tpot_p90, predicted_tpot(m, w, decode, cd), t.tpot_slo, t, obs.samples)
    def sized(scale: float):
        with_queue = w.rate + backlog_p       # the queued prompts are the prefill pool's, none local
        share = w.local_share * w.rate / with_queue if with_queue > 0 else 0.0
        cached = w.input_len - share * w.local_len - (1 - share) * w.computed_len   # computed_len kept
        size_p = size_fleet(m, replace(w, rate=with_queue * scale, local_share=share, cached_len=cached),
                            t.ttft_slo, t.tpot_slo, t.utilization, (cp, cd))
        size_d = size_fleet(m, replace(w, rate=(w.rate + backlog_d) * scale), t.ttft_slo, t.tpot_slo,
                            t.utilization, (cp, cd))
        return size_p, size_d.decode

    (size, need_d) = sized(1.0)
    if size.prefill == 0:
        return SloDecision(prefill, decode, (cp, cd), size.ttft_p90, size.tpot, "hold: " + size.reason)
    margin, margin_d = sized(1 / (1 - t.hysteresis))
    new_p = _step(prefill, size.prefill, margin.prefill, warming)
    new_d = _step(decode, need_d, margin_d, warming)
    return SloDecision(new_p, new_d, (cp, cd), size.ttft_p90, size.tpot,
                       f"{w.rate:.3g} req/s of {w.input_len:.0f}/{w.output_len:.0f} tokens"
                       f"{' + backlog' if backlog_p or backlog_d else ''} needs {size.prefill}P:{need_d}D "
                       f"({size.reason}, correction {cp:.2f}/{cd:.2f})")
