"""Calibrate the roofline with a `pdserve bench` JSON report measured against a real deployment.

The roofline gives lower bounds; a real deployment adds kernel inefficiency, HTTP and scheduling
overhead, KV transfer and (under load) queueing. Calibration folds all of it into two factors:
  1. pick the calibration run: the lowest-load run of the report's primary endpoint (`args.url`),
     lowest offered rate (open loop) or lowest concurrency (closed loop), because queueing inflates
     latencies at high load and the factors should describe service time, not waiting time;
  2. prefill efficiency = ttft_bound(S) / measured TTFT p50, with S the bench's `input_len` (prompts
     are uniform around it, so it is also the median prompt);
  3. decode efficiency = tpot_bound(S + output_len/2, B) / measured TPOT p50, with B the mean number
     of requests decoding at once by Little's law: B = req/s * (E2E p50 - TTFT p50), at least 1;
  4. `plan(..., prefill_eff, decode_eff)` then predicts bound / eff at any other shape or batch.
One factor per phase assumes the gap to the roofline does not depend on S or B; `ratio_table` shows
how well that holds across the report's other runs. Factors above 1 mean the deployment beat the
roofline: the hardware or model spec given to the planner is wrong.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from pdserve.plan.roofline import Hardware, ModelSpec, decode_context, tpot_bound, ttft_bound

_LOAD = re.compile(r" (rate|concurrency) ([0-9.eE+-]+)(?:/s)?$")


@dataclass(frozen=True)
class RunPoint:
    """One bench run reduced to what calibration uses (times in seconds)."""
    name: str
    load: float            # offered rate (req/s) or concurrency, from the run's name
    ttft_p50: float
    tpot_p50: float
    decode_batch: int      # Little's law estimate, see the module docstring


@dataclass(frozen=True)
class Calibration:
    """Efficiency factors (roofline bound / measured) from one calibration run."""
    run: RunPoint
    input_len: int
    output_len: int
    ttft_bound: float
    tpot_bound: float

    def __post_init__(self):
        if not (self.run.ttft_p50 > 0 and self.run.tpot_p50 > 0):
            raise ValueError(f"run {self.run.name!r} has no positive TTFT/TPOT p50 to calibrate with")

    @property
    def prefill_eff(self) -> float:
        return self.ttft_bound / self.run.ttft_p50

    @property
    def decode_eff(self) -> float:
        return self.tpot_bound / self.run.tpot_p50


def load_report(path: str | Path) -> dict:
    """The bench report; ValueError unless it has `args` (url, input_len, output_len) and `runs`."""
    try:
        rep = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read bench report {path}: {exc}") from exc
    args = rep.get("args") if isinstance(rep, dict) else None
    if not isinstance(args, dict) or not all(k in args for k in ("url", "input_len", "output_len")) \
            or not isinstance(rep.get("runs"), list):
        raise ValueError(f"{path} is not a `pdserve bench --json` report (needs args.url/input_len/output_len, runs)")
    return rep


def run_points(report: dict) -> list[RunPoint]:
    """The primary endpoint's runs that completed requests, lowest load first."""
    points = []
    for run in report["runs"]:
        name, s = run.get("name", ""), run.get("summary", {})
        m = _LOAD.search(name)
        if not name.startswith(report["args"]["url"] + " ") or not m or not s.get("ttft_p50"):
            continue
        batch = s["req_per_s"] * (s["e2e_p50"] - s["ttft_p50"])
        points.append(RunPoint(name, float(m.group(2)), s["ttft_p50"], s["tpot_p50"], max(1, round(batch))))
    if not points:
        raise ValueError("the bench report has no successful run of its primary endpoint")
    return sorted(points, key=lambda p: p.load)


def calibrate(report: dict, m: ModelSpec, hw: Hardware, run: str | None = None) -> Calibration:
    """Efficiencies from the report's lowest-load run (or the run whose name ends with `run`, e.g.
    "rate 0.5/s": when the lowest-load run ran on cold replicas) against this model and hardware's roofline."""
    points = run_points(report)
    chosen = [p for p in points if run is None or p.name.endswith(run)]
    if not chosen:
        raise ValueError(f"no run of the bench report ends with {run!r}: {', '.join(p.name for p in points)}")
    point = chosen[0]
    s, out = report["args"]["input_len"], report["args"]["output_len"]
    return Calibration(point, s, out, ttft_bound(m, hw, s),
                       tpot_bound(m, hw, decode_context(s, out), point.decode_batch))


def ratio_table(report: dict, m: ModelSpec, hw: Hardware, cal: Calibration) -> str:
    """Markdown: every run's measured p50s against the roofline bound and the calibrated prediction.

    The calibration run reads 1.00 by construction; ratios above 1 at higher load are mostly queueing.
    """
    ctx = decode_context(cal.input_len, cal.output_len)
    rows = ["| run | decode B | TTFT p50 ms | bound ms | calibrated ms | measured/calibrated "
            "| TPOT p50 ms | bound ms | calibrated ms | measured/calibrated |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in run_points(report):
        tb, db = ttft_bound(m, hw, cal.input_len), tpot_bound(m, hw, ctx, p.decode_batch)
        tc, dc = tb / cal.prefill_eff, db / cal.decode_eff
        rows.append(f"| {p.name}{' (calibration)' if p == cal.run else ''} | {p.decode_batch} "
                    f"| {p.ttft_p50 * 1e3:.1f} | {tb * 1e3:.2f} | {tc * 1e3:.1f} | {p.ttft_p50 / tc:.2f} "
                    f"| {p.tpot_p50 * 1e3:.1f} | {db * 1e3:.2f} | {dc * 1e3:.1f} | {p.tpot_p50 / dc:.2f} |")
    return "\n".join(rows)


def describe(cal: Calibration) -> str:
    """The lines `pdserve plan --calibrate` prints about the calibration point and its factors."""
    lines = [f"calibration run: {cal.run.name} (unless chosen, the lowest-load run: queueing inflates latencies "
             f"at higher load), {cal.input_len} in / {cal.output_len} out tokens, decode batch ~{cal.run.decode_batch} "
             "(Little's law)",
             f"prefill efficiency {cal.prefill_eff:.3g} (TTFT bound {cal.ttft_bound * 1e3:.2f} ms / measured p50 "
             f"{cal.run.ttft_p50 * 1e3:.1f} ms); decode efficiency {cal.decode_eff:.3g} (TPOT bound "
             f"{cal.tpot_bound * 1e3:.2f} ms / measured p50 {cal.run.tpot_p50 * 1e3:.1f} ms)"]
    if cal.prefill_eff > 1 or cal.decode_eff > 1:
        lines.append("warning: an efficiency above 1 means the deployment beat the roofline; "
                     "check --hardware, --model and --dtype")
    return "\n".join(lines)
