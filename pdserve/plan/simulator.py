"""`pdserve simulate`'s discrete-event simulator of a P/D (or colocated) fleet; pure Python, one heap.

The life of a simulated request (disaggregated), in event order:
  1. ARRIVAL: the router picks the decode replica with the most free KV (fraction) that can reserve
     prompt + output tokens (else the request waits in the router's FIFO until KV frees), then the
     prefill replica with the fewest queued prompt tokens (pdserve's DecodeRouter and
     QueuedPromptTokensRouter without their prefix affinity: the prompts share no prefix but,
     with `Request.cached`, one every replica holds; beyond `EXACT_ROUTING` replicas the best of
     `SAMPLE` random ones);
     With `Fleet.local_prefill_tokens`, a prompt whose cached prefix the decode replica holds and
     whose computed tokens, with those the replica has queued, are within it goes no further: the
     decode replica computes it in its own steps (local prefill; steps 2-3 skipped);
  2. prefill steps (STEP events) until its prompt is done: first token then (TTFT);
  3. KV transfer: KV event after kappa * (S - cached) / link bandwidth;
  4. decode steps until output_len tokens: last token (TPOT = (end - first) / (out - 1)); its KV frees.
Colocated: the router picks the replica with the most free KV; prefill and decode share its steps.
Autoscaling (TICK events every `tick_s`): `PerPoolScaler` or `SloScaler` (pdserve/plan/sim_scaling.py)
returns counts; new replicas serve after `startup_s`; removed ones drain (take no new requests, leave
when empty). Replica-seconds count every replica from creation to removal, within [0, duration].
With a `HostCpu` (pdserve/plan/sim_host.py) the replicas share one host's cores with the serving work:
every running step slows while the host is oversubscribed (re-priced at each step's start and end), a
decode step beside another engine's step slows by the measured interference, and decode steps pay
their event loop's GIL.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass, field

from pdserve.plan.sim_host import HostCpu, HostLoad
from pdserve.plan.sim_load import Request
from pdserve.plan.sim_replicas import ColocatedReplica, DecodeReplica, PrefillReplica
from serving.slo_model import StepModel

ARRIVAL, STEP, KV, TICK, READY = range(5)
EXACT_ROUTING, SAMPLE = 64, 8


@dataclass
class Fleet:
    """What to simulate: colocated N (prefill = N, decode = 0) or P:D, fixed or autoscaled."""
    mode: str                       # "disaggregated" | "colocated"
    prefill: int                    # initial prefill (or colocated) replicas
    decode: int = 0
    scaler: object | None = None    # sim_scaling.PerPoolScaler / SloScaler
    startup_s: float = 30.0
    tick_s: float = 1.0
    local_prefill_tokens: int = 0   # pdserve's `routing.local_prefill_tokens` (0: every prompt handed off)


@dataclass
class Result:
    requests: list[Request]
    duration: float
    intervals: list[tuple[float, float]]                                   # each replica's (created, removed)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)   # (t, prefill, decode) per tick


class Simulator:
    def __init__(self, model: StepModel, fleet: Fleet, seed: int = 0, decode_model: StepModel | None = None,
                 host: HostCpu | None = None):
        self.m, self.dm, self.fleet = model, decode_model or model, fleet
        self.host = HostLoad(host) if host is not None else None
        self.version: dict[int, int] = {}       # id(replica) -> its current STEP event (with a host: re-priced)
        self.rng = random.Random(seed)
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.pools: dict[str, list] = {"prefill": [], "decode": []}
        self.retired: list = []
        self.waiting: deque[Request] = deque()   # router FIFO: no KV anywhere
        self.timeline: list = []
        self.home: dict[int, DecodeReplica] = {}   # request id -> the decode replica holding its KV
        self.finished = 0
        for _ in range(fleet.prefill):
            self._add("prefill", ready=True)
        for _ in range(fleet.decode if fleet.mode == "disaggregated" else 0):
            self._add("decode", ready=True)

    # ---- bookkeeping --------------------------------------------------------------------------
    def _push(self, t: float, kind: int, obj) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj))

    def _add(self, pool: str, ready: bool = False) -> None:
        cls = ColocatedReplica if self.fleet.mode == "colocated" else (PrefillReplica if pool == "prefill"
                                                                       else DecodeReplica)
        ready_at = self.now if ready else self.now + self.fleet.startup_s
        r = cls(self.seq, self.dm if pool == "decode" else self.m, self.now, ready_at)
        self.pools[pool].append(r)
        if not ready:
            self._push(ready_at, READY, r)

    def active(self, pool: str) -> list:
        return [r for r in self.pools[pool] if not r.draining and r.ready_at <= self.now]

    def counts(self, pool: str) -> int:
        """Replicas counted against the target: not draining (starting ones included)."""
        return sum(not r.draining for r in self.pools[pool])

    def resize(self, pool: str, target: int) -> None:
        live = [r for r in self.pools[pool] if not r.draining]
        for _ in range(target - len(live)):
            self._add(pool)
        for r in sorted(live, key=lambda r: (r.ready_at <= self.now, -r.created))[:max(0, len(live) - target)]:
            r.draining = True            # the youngest (or still starting) go first
            self._retire_if_empty(pool, r)

    def _retire_if_empty(self, pool: str, r) -> None:
        if r.draining and r.idle() and r.kv_reserved == 0 and r in self.pools[pool]:
            r.removed = self.now
            self.pools[pool].remove(r)
            self.retired.append(r)

    # ---- routing ------------------------------------------------------------------------------
    def _candidates(self, pool: str) -> list:
        live = self.active(pool)
        return live if len(live) <= EXACT_ROUTING else self.rng.sample(live, SAMPLE)

    def _route(self, req: Request) -> bool:
        kv_pool = "decode" if self.fleet.mode == "disaggregated" else "prefill"
        model = self.dm if kv_pool == "decode" else self.m
        need = req.reserved = round(model.held_tokens(req.kv_tokens, req.new_tokens))
        fits = [r for r in self._candidates(kv_pool) if r.kv_free() >= need]
        if not fits:
            return False
        target = max(fits, key=lambda r: r.kv_free() / r.m.kv_tokens)
        target.kv_reserved += need
        if self.fleet.mode == "disaggregated" and req.cached > 0 \
                and req.new_tokens + target.queued_tokens <= self.fleet.local_prefill_tokens:
            target.add_local(req)         # prefilled where its KV is reserved: no hand-off
            if self.fleet.scaler is not None:
                self.fleet.scaler.local(req, self.now)
        else:
            if self.fleet.mode == "disaggregated":
                self.home[req.id] = target
                target = min(self._candidates("prefill"), key=lambda r: r.queued_tokens)
            target.add(req)
        self._kick(target)
        return True

    def _kick(self, r) -> None:
        if not r.busy:
            end = r.start(self.now)
            if end is None:
                return
            if self.host is None:
                self._push(end, STEP, (r, 0))
            else:
                self._reprice(self.host.start(self.now, r, end - self.now, getattr(r, "stepping", 0)))

    def _reprice(self, ends: list) -> None:
        """New end times of the host's running steps: each supersedes that replica's pending STEP event."""
        for t, r in ends:
            v = self.version[id(r)] = self.version.get(id(r), 0) + 1
            self._push(t, STEP, (r, v))

    def _drain_router(self) -> None:
        while self.waiting and self._route(self.waiting[0]):
            self.waiting.popleft()

    # ---- events -------------------------------------------------------------------------------
    def _step_done(self, r) -> None:
        decoded = getattr(r, "stepping", 0)
        done = r.end(self.now)
        if self.host is not None:
            self._reprice(self.host.finish(self.now, r))
            self.host.emitted(self.now, decoded + (len(done) if type(r) is PrefillReplica else 0))
        if type(r) is PrefillReplica:
            for req in done:
                self._push(self.now + self.m.transfer_time(req.new_tokens), KV, (self.home.pop(req.id), req))
            pool = "prefill"
        else:
            pool = "decode" if type(r) is DecodeReplica else "prefill"
            self._ended(done)
        self._kick(r)
        self._retire_if_empty(pool, r)

    def _ended(self, done: list[Request]) -> None:
        if done:
            self.finished += len(done)
            if self.fleet.scaler is not None:
                for req in done:
                    self.fleet.scaler.finished(req, self.now)
            self._drain_router()

    def _kv_arrived(self, home, req: Request) -> None:
        if req.output_len <= 1:
            req.end = self.now
            home.kv_reserved -= req.reserved
            self._ended([req])
        else:
            home.add(req)
            self._kick(home)
        self._retire_if_empty("decode", home)

    def run(self, requests: list[Request], duration: float, drain_s: float | None = None) -> Result:
        """Simulate until every request ends or `duration + drain_s` (unfinished requests keep end = -1)."""
        stop = duration + (drain_s if drain_s is not None else max(60.0, duration))
        arrivals = iter(requests)
        nxt = next(arrivals, None)
        if nxt is not None:
            self._push(nxt.arrival, ARRIVAL, nxt)
        if self.fleet.scaler is not None:
            self._push(0.0, TICK, None)
        while self.heap and self.finished < len(requests):
            t, _, kind, obj = heapq.heappop(self.heap)
            if t > stop:
                break
            self.now = t
            if kind == ARRIVAL:
                if self.waiting or not self._route(obj):
                    self.waiting.append(obj)
                nxt = next(arrivals, None)
                if nxt is not None:
                    self._push(nxt.arrival, ARRIVAL, nxt)
                if self.fleet.scaler is not None:
                    self.fleet.scaler.arrived(obj, t)
            elif kind == STEP:
                if self.host is None or obj[1] == self.version[id(obj[0])]:     # else superseded
                    self._step_done(obj[0])
            elif kind == KV:
                self._kv_arrived(*obj)
            elif kind == TICK:
                self._tick()
            elif kind == READY:
                self._drain_router()
        return Result(requests, duration, self._intervals(), self.timeline)

    def _tick(self) -> None:
        scaler = self.fleet.scaler
        p, d = scaler.decide(self, self.now)
        self.resize("prefill", p)
        if self.fleet.mode == "disaggregated":
            self.resize("decode", d)
        self.timeline.append((self.now, self.counts("prefill"), self.counts("decode")))
        self._push(self.now + self.fleet.tick_s, TICK, None)

    def _intervals(self) -> list[tuple[float, float]]:
        return [(r.created, r.removed if r.removed >= 0 else float("inf"))
                for r in self.retired + self.pools["prefill"] + self.pools["decode"]]


def replica_seconds(res: Result, start: float = 0.0) -> float:
    """Replica-seconds spent within [start, duration]."""
    return sum(max(0.0, min(end, res.duration) - max(created, start)) for created, end in res.intervals)
