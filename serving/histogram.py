"""A Prometheus histogram kept by hand (cumulative buckets, sum, count), torch- and Ray-free.

The router keeps its request histograms in one; engine replicas keep theirs (KV transfer time
and size) in one each and ship them to the router inside `ReplicaStats.histograms` as plain
maps (`to_wire` / `from_wire`), where /metrics renders them with pool and replica labels.
"""

from __future__ import annotations

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
QUEUE_BUCKETS = (0.001, 0.0025, 0.005) + LATENCY_BUCKETS   # an idle server queues for about a millisecond
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BYTES_BUCKETS = tuple(float(4**k * 2**16) for k in range(9))   # 64 KiB ... 4 GiB, by 4x

# What engine replicas observe: key (exported as pdserve_<key>) -> (help text, buckets).
REPLICA_HISTOGRAMS = {
    "kv_transfer_seconds": ("KV push time of a successful transfer on the prefill side, send start to the "
                            "decode replica's ack (connection setup, queueing behind other pushes on the "
                            "same pair and waiting for the decode reservation included)", TRANSFER_BUCKETS),
    "kv_transfer_bytes": ("KV bytes moved by a successful transfer", BYTES_BUCKETS),
}


def label_text(labels: dict[str, str]) -> str:
    """`k="v",k2="v2"` with Prometheus escaping (no braces)."""
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return ",".join(f'{k}="{esc(v)}"' for k, v in labels.items())


def _le(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


class Histogram:
    """Cumulative bucket counts: `counts[i]` is the number of observations <= `buckets[i]`."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_text, tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]

    def samples(self, labels: dict[str, str] | None = None) -> list[str]:
        """The bucket, sum and count lines, each with `labels` (for one series of a family)."""
        lab = label_text(labels or {})
        plain, lead = (f"{{{lab}}}", lab + ",") if lab else ("", "")
        out = [f'{self.name}_bucket{{{lead}le="{_le(b)}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{self.name}_bucket{{{lead}le="+Inf"}} {self.count}', f"{self.name}_sum{plain} {self.sum:.6f}",
                      f"{self.name}_count{plain} {self.count}"]

    def lines(self) -> list[str]:
        return self.header() + self.samples()

    def to_wire(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum, "count": self.count}

    @classmethod
    def from_wire(cls, name: str, help_text: str, wire: dict) -> Histogram:
        """Raises ValueError on a map that is not a histogram (the caller skips it)."""
        try:
            h = cls(name, help_text, tuple(float(b) for b in wire["buckets"]))
            counts, h.sum, h.count = [int(c) for c in wire["counts"]], float(wire["sum"]), int(wire["count"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a histogram: {exc!r}") from None
        if len(counts) != len(h.buckets):
            raise ValueError("bucket and count lengths differ")
        h.counts = counts
        return h
