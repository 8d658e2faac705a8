"""Replicas that share one host's CPU with the serving work around them (`pdserve simulate --host-cpu`).

The simulator's default gives every replica its own device and prices only its engine steps. On a CPU
host (pdserve's `make serve`: a prefill and a decode engine, the router, Serve's proxy, Ray and the
load generator on the same cores) three more costs appear, and they grow with the load:
  1. **oversubscribed cores**: each stepping engine keeps `engine_cores` busy; the serving work takes
     `token_cpu` CPU-seconds per streamed token (replicas' event loops, router, proxy, client) plus
     `base_cores` (Ray's processes). While that demand exceeds `cores`, every running step progresses
     at cores / demand of its speed;
  2. **engines slowing each other**: with a core each, two engines stepping at once still share the
     memory bus and caches (and, on a VM, maybe one physical core): while another engine steps, a
     decode step progresses at 1 / `decode_interference` (`benchmarks/core_interference.py` measures
     it; `with_interference`). Prefill steps are not slowed: the same script measures a slowdown for
     two prefill and decode loops that never pause, but in served runs the prefill engine's CPU per
     request stays flat as the decode engine gets busier (`benchmarks/host_cpu.py`: 219-256 ms per
     256-token prompt from 0.5 to 8 req/s, README), so that slowdown does not carry over;
  3. **the decode replica's GIL**: its event loop streams each token under the GIL its engine thread
     needs, so `loop_token_cpu` per sequence in the batch is added to the decode step's work.
Progress rates change whenever a step starts or ends, so `HostLoad` re-prices every running step then
(processor sharing: work left / new rate) and the simulator drops the superseded end events. The token
rate behind the demand is an exponentially weighted average (time constant `tau_s`) of the tokens the
simulated replicas emit. `HostCpu.from_measurement` takes the costs from `benchmarks/host_cpu.py`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path


SERVING_ROLES = ("prefill rest", "decode rest", "router", "proxy", "client")


@dataclass(frozen=True)
class HostCpu:
    cores: float                  # CPUs the fleet shares
    engine_cores: float = 1.0     # cores a stepping engine keeps busy (its torch threads)
    token_cpu: float = 0.0        # s of CPU per streamed token outside the engine threads
    loop_token_cpu: float = 0.0   # of it, in the decode replica's own process (serial with its step)
    base_cores: float = 0.0       # background load (Ray's processes), cores
    decode_interference: float = 1.0    # a decode step's slowdown while another engine steps
    tau_s: float = 1.0

    def __post_init__(self):
        if not self.cores > 0 or not self.engine_cores > 0 or self.tau_s <= 0:
            raise ValueError(f"HostCpu needs positive cores, engine_cores and tau_s: {self}")
        if min(self.token_cpu, self.loop_token_cpu, self.base_cores) < 0 or self.loop_token_cpu > self.token_cpu:
            raise ValueError(f"HostCpu costs must be >= 0 and loop_token_cpu <= token_cpu: {self}")
        if self.decode_interference < 1:
            raise ValueError(f"HostCpu.decode_interference is a slowdown, >= 1: {self}")

    def with_interference(self, path: str | Path) -> "HostCpu":
        """This host with the decode slowdown a `benchmarks/core_interference.py --json` report measured."""
        try:
            rep = json.loads(Path(path).read_text())
            return replace(self, decode_interference=max(1.0, float(rep["decode"]["slowdown"])))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path} is not a benchmarks/core_interference.py report: "
                             f"{type(exc).__name__}: {exc}") from exc

    @classmethod
    def from_measurement(cls, path: str | Path) -> "HostCpu":
        """From a `benchmarks/host_cpu.py --json` report with two or more rates: a least-squares line
        through its runs, cores used against tokens/s, per role. Its slope is the CPU per streamed token
        (the serving roles: replicas' rest, router, proxy, client; the decode replica's rest alone for
        the GIL term); its intercept plus Ray's processes is the background. (A line through the two
        lowest rates alone, as before session 15, read mostly idle background there: 0.60 ms a token
        against 1.81 through all five rates of the README's sweep.) ValueError for a file that is not
        such a report."""
        try:
            rep = json.loads(Path(path).read_text())
            runs = rep["runs"]
            rate = [r["tokens"] / r["wall_s"] for r in runs]
            mean_rate = sum(rate) / len(rate)
            spread = sum((x - mean_rate) ** 2 for x in rate)
            if len(runs) < 2 or not spread > 0:
                raise ValueError("it needs runs that streamed tokens at two or more rates")

            def fit(roles):        # (slope s/token, intercept cores) of the roles' cores against tokens/s
                used = [sum(r["cores"][k] for k in roles) for r in runs]
                mean_used = sum(used) / len(used)
                slope = sum((x - mean_rate) * (y - mean_used) for x, y in zip(rate, used)) / spread
                return max(0.0, slope), max(0.0, mean_used - slope * mean_rate)
            serving, base = fit(SERVING_ROLES)
            loop, _ = fit(["decode rest"])
            return cls(cores=float(rep["cpus"]), token_cpu=serving, loop_token_cpu=min(loop, serving),
                       base_cores=base + sum(r["cores"]["ray"] for r in runs) / len(runs))
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
            raise ValueError(f"{path} is not a benchmarks/host_cpu.py report with two rates: "
                             f"{type(exc).__name__}: {exc}") from exc


class HostLoad:
    """The simulated host: the engine steps running on it (work left in seconds at full speed) and
    the recent token rate. The simulator calls `start` and `finish`; each returns the new end time of
    every running step, and any end time it returned before for a step is void."""

    def __init__(self, host: HostCpu):
        self.host = host
        self.running: dict[int, list] = {}   # id(replica) -> [replica, work left (s), decode seqs]
        self.rate = 0.0                        # tokens/s, exponentially weighted
        self.at = 0.0

    def emitted(self, now: float, tokens: int) -> None:
        self._advance(now)
        self.rate += tokens / self.host.tau_s

    def speed(self, decode_seqs: int) -> float:
        """The progress rate of a running step now (1 = a core of its own, nothing beside it)."""
        h, n = self.host, len(self.running)
        demand = n * h.engine_cores + h.token_cpu * self.rate + h.base_cores
        slowdown = h.decode_interference if decode_seqs and n > 1 else 1.0
        return min(1.0, h.cores / demand) / slowdown

    def start(self, now: float, replica, seconds: float, decode_seqs: int) -> list[tuple[float, object]]:
        """A step of `seconds` at full speed (`decode_seqs` sequences decoding in it) starts now."""
        self._advance(now)
        self.running[id(replica)] = [replica, seconds + self.host.loop_token_cpu * decode_seqs, decode_seqs]
        return self._ends(now)

    def finish(self, now: float, replica) -> list[tuple[float, object]]:
        self._advance(now)
        del self.running[id(replica)]
        return self._ends(now)

    def _advance(self, now: float) -> None:
        """Work done since the last event, at the speeds that held since then; then the rate decays."""
        if now <= self.at:
            return
        for entry in self.running.values():
            entry[1] = max(0.0, entry[1] - (now - self.at) * self.speed(entry[2]))
        self.rate *= math.exp(-(now - self.at) / self.host.tau_s)
        self.at = now

    def _ends(self, now: float) -> list[tuple[float, object]]:
        return [(now + left / self.speed(seqs), r) for r, left, seqs in self.running.values()]
