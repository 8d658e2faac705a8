"""Autoscaling inside `pdserve simulate`: the same decision functions the Serve policies run.

  PerPoolScaler  serving.autoscaling.decide on each pool's own signal (prefill: queued prompt tokens;
                 decode / colocated: KV utilization and running sequences), as PrefillPolicy/DecodePolicy;
  SloScaler      serving.slo_policy.decide on the router's view of the last `window_s` (arrival rate,
                 mean lengths, local prefills' rate and size, TTFT/TPOT p90 of the requests that
                 finished in it), as SloPolicy.
Both clamp to [min_replicas, max_replicas] and apply Serve's delays (`Delays`): a change must be wanted
continuously for upscale_delay_s / downscale_delay_s before it happens. Metrics are read instantly
(Serve averages them over look_back_period_s; the SLO window plays that part for SloScaler). The SLO
policy corrects its model only 2 windows after the last backlog: requests that queued through it
finish (and are measured) up to a window later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdserve.plan.sim_load import Request
from serving.autoscaling import decide as pool_decide
from serving.slo_model import StepModel
from serving.slo_policy import Observation, SloTargets, has_backlog
from serving.slo_policy import decide as slo_decide


@dataclass
class Bounds:
    min_replicas: int = 1
    max_replicas: int = 1000
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0
    warmup_s: float = 10.0


class Delays:
    """Serve's upscale/downscale delay for one pool: returns the count to apply now."""

    def __init__(self, b: Bounds):
        self.b, self.since, self.direction = b, 0.0, 0

    def apply(self, current: int, desired: int, now: float) -> int:
        desired = min(max(desired, self.b.min_replicas), self.b.max_replicas)
        direction = (desired > current) - (desired < current)
        if direction != self.direction:
            self.direction, self.since = direction, now
        delay = self.b.upscale_delay_s if direction > 0 else self.b.downscale_delay_s
        if direction and now - self.since >= delay:
            self.since = now
            return desired
        return current


def _warming(sim, pool: str, now: float, warmup_s: float) -> bool:
    return any(now - r.created < warmup_s for r in sim.pools[pool] if not r.draining)


class _Scaler:
    def __init__(self, prefill: Bounds, decode: Bounds):
        self.bounds = {"prefill": prefill, "decode": decode}
        self.delays = {"prefill": Delays(prefill), "decode": Delays(decode)}

    def arrived(self, req: Request, now: float) -> None:
        pass

    def finished(self, req: Request, now: float) -> None:
        pass

    def local(self, req: Request, now: float) -> None:
        """`req` went to a decode replica's own steps (local prefill)."""

    def _apply(self, sim, now: float, desired: dict[str, int]) -> tuple[int, int]:
        out = [self.delays[p].apply(sim.counts(p), desired.get(p, sim.counts(p)), now) for p in ("prefill", "decode")]
        return out[0], out[1]


class PerPoolScaler(_Scaler):
    def __init__(self, prefill: Bounds, decode: Bounds, target_queued_tokens: float = 2048,
                 target_kv_utilization: float = 0.7, target_running: float = 32, hysteresis: float = 0.2):
        super().__init__(prefill, decode)
        self.tq, self.tkv, self.trun, self.h = target_queued_tokens, target_kv_utilization, target_running, hysteresis

    def _decode_need(self, replicas) -> float:
        kv = sum(r.kv_reserved / r.m.kv_tokens for r in replicas)
        return max(kv / self.tkv, sum(r.running for r in replicas) / self.trun)

    def decide(self, sim, now: float) -> tuple[int, int]:
        desired = {}
        if sim.fleet.mode == "colocated":
            pools = {"prefill": self._decode_need(sim.pools["prefill"])}
        else:
            pools = {"prefill": sum(r.queued_tokens for r in sim.pools["prefill"]) / self.tq,
                     "decode": self._decode_need(sim.pools["decode"])}
        for pool, needed in pools.items():
            current = max(sim.counts(pool), 1)
            desired[pool] = pool_decide(needed, current, self.h,
                                        _warming(sim, pool, now, self.bounds[pool].warmup_s)).replicas
        return self._apply(sim, now, desired)


class SloScaler(_Scaler):
    def __init__(self, model: StepModel, targets: SloTargets, prefill: Bounds, decode: Bounds,
                 window_s: float = 10.0):
        super().__init__(prefill, decode)
        self.m, self.t, self.window_s = model, targets, window_s
        self.arrivals: deque = deque()     # (t, input_len, output_len, cached)
        self.done: deque = deque()         # (t, ttft, tpot)
        self.locals: deque = deque()       # (t, prompt tokens computed): local prefills
        self.correction = (1.0, 1.0)
        self.last = None
        self.backlog_at = 0.0              # when a backlog was last seen

    def arrived(self, req: Request, now: float) -> None:
        self.arrivals.append((now, req.input_len, req.output_len, req.cached))

    def finished(self, req: Request, now: float) -> None:
        self.done.append((now, req.ttft, req.tpot))

    def local(self, req: Request, now: float) -> None:
        self.locals.append((now, req.new_tokens))

    def observation(self, sim, now: float) -> Observation | None:
        for q in (self.arrivals, self.done, self.locals):
            while q and q[0][0] < now - self.window_s:
                q.popleft()
        if now < self.window_s / 2:
            return None
        n = len(self.arrivals)
        span = min(self.window_s, now)
        ttfts, tpots = sorted(d[1] for d in self.done), sorted(d[2] for d in self.done)
        p90 = (lambda xs: xs[int(0.9 * (len(xs) - 1))] if xs else None)
        return Observation(n / span, sum(a[1] for a in self.arrivals) / n if n else 1.0,
                           sum(a[2] for a in self.arrivals) / n if n else 1.0, p90(ttfts), p90(tpots), len(self.done),
                           sum(r.queued_tokens for r in sim.pools["prefill"]), len(sim.waiting),
                           cached_len=sum(a[3] for a in self.arrivals) / n if n else 0.0,
                           local_rate=len(self.locals) / span,
                           local_len=sum(a[1] for a in self.locals) / len(self.locals) if self.locals else 0.0)

    def decide(self, sim, now: float) -> tuple[int, int]:
        warming = _warming(sim, "prefill", now, self.bounds["prefill"].warmup_s) or \
            _warming(sim, "decode", now, self.bounds["decode"].warmup_s)
        obs = self.observation(sim, now)
        if has_backlog(self.m, obs, sim.counts("prefill")):
            self.backlog_at = now
        d = slo_decide(self.m, self.t, obs, sim.counts("prefill"), sim.counts("decode"),
                       self.correction, warming, quiet=now - self.backlog_at > 2 * self.window_s)
        self.correction, self.last = d.correction, d
        return self._apply(sim, now, {"prefill": d.prefill, "decode": d.decode})
