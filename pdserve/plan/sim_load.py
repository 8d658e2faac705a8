"""Load for `pdserve simulate`: Poisson arrivals at a piecewise-constant rate, or a CSV trace.

A trace CSV has one request per row: `arrival_s,input_len,output_len` (a header row is allowed).
Prompt lengths of generated load are uniform in input_len * (1 +- jitter), as `pdserve bench` sends
them; outputs are exactly output_len (bench uses ignore_eos). `cached`: every prompt's first tokens
are a prefix all replicas hold (a shared system prompt): a prefill computes the rest, the hand-off
sends the rest, a decode replica reserves KV for the rest and its output (the prefix is held once per
replica: the simulator's StepModel has that much less KV), and each decode step still reads it.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class Request:
    """One simulated request; the simulator fills in `first` (first token) and `end` (last token)."""
    id: int
    arrival: float
    input_len: int
    output_len: int
    first: float = -1.0
    end: float = -1.0
    cached: int = 0            # leading prompt tokens every replica holds already
    reserved: int = 0          # the KV reserved for it (the simulator's router sets it)

    @property
    def new_tokens(self) -> int:
        """The prompt tokens a prefill computes and the hand-off sends."""
        return self.input_len - self.cached

    @property
    def kv_tokens(self) -> int:
        """The KV the request reserves in its decode (or colocated) replica."""
        return self.new_tokens + self.output_len

    @property
    def ttft(self) -> float:
        return self.first - self.arrival

    @property
    def tpot(self) -> float:
        return (self.end - self.first) / (self.output_len - 1) if self.output_len > 1 else 0.0


def parse_schedule(text: str) -> list[tuple[float, float]]:
    """'0:5,60:50,120:5' -> [(0, 5), (60, 50), (120, 5)]: from each time (s) on, that rate (req/s)."""
    try:
        steps = sorted((float(t), float(r)) for t, r in (part.split(":") for part in text.split(",")))
    except ValueError as exc:
        raise ValueError(f"bad schedule {text!r}: expected 'time:rate,time:rate,...'") from exc
    if not steps or steps[0][0] != 0 or any(r < 0 for _, r in steps):
        raise ValueError(f"bad schedule {text!r}: it must start at time 0 and rates must be >= 0")
    return steps


def prompt_lengths(input_len: int, jitter: float) -> tuple[int, int]:
    """The shortest and longest prompt of generated load: input_len * (1 -+ jitter), at least 1."""
    return max(1, int(input_len * (1 - jitter))), max(1, int(input_len * (1 + jitter)))


def poisson(schedule: list[tuple[float, float]], duration: float, input_len: int, output_len: int,
            jitter: float = 0.0, seed: int = 0, cached: int = 0) -> list[Request]:
    """Poisson arrivals over [0, duration) at the schedule's rate (piecewise constant)."""
    rng = random.Random(seed)
    lo, hi = prompt_lengths(input_len, jitter)
    if not 0 <= cached < lo:
        raise ValueError(f"the cached prefix ({cached} tokens) must be shorter than the shortest prompt ({lo})")
    out, t = [], 0.0
    bounds = [s[0] for s in schedule[1:]] + [duration]
    for (start, rate), stop in zip(schedule, bounds):
        t = max(t, start)
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= min(stop, duration):
                t = stop
                break
            out.append(Request(len(out), t, rng.randint(lo, hi), output_len, cached=cached))
    return out


def read_trace(path: str | Path, cached: int = 0) -> list[Request]:
    """Requests from a CSV of arrival_s,input_len,output_len (sorted by arrival); ValueError if malformed."""
    rows = []
    try:
        with open(path, newline="") as f:
            for i, row in enumerate(csv.reader(f)):
                if not row or (i == 0 and not row[0].replace(".", "", 1).isdigit()):
                    continue
                rows.append((float(row[0]), int(row[1]), int(row[2])))
    except (OSError, ValueError, IndexError) as exc:
        raise ValueError(f"cannot read trace {path}: {exc} (rows: arrival_s,input_len,output_len)") from exc
    if not rows or any(a < 0 or i < 1 or o < 1 for a, i, o in rows):
        raise ValueError(f"trace {path} is empty or has negative times / lengths below 1")
    if any(i <= cached for _, i, _ in rows):
        raise ValueError(f"trace {path} has prompts no longer than the cached prefix ({cached} tokens)")
    rows.sort()
    return [Request(k, a, i, o, cached=cached) for k, (a, i, o) in enumerate(rows)]
