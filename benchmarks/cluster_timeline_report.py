"""The report of benchmarks/cluster_timeline.py: its events read off the samples, the printed timeline
and the plot. A report is the JSON that script writes: `samples` (every 0.5 s: `t`, `running` and
`wanted` replicas per pool, `nodes` per type, `replicas` {id: pool, node}, `landed` KV per replica),
`events`, `autoscaler_events`, `requests`, `checks`."""

from __future__ import annotations

import json
from pathlib import Path

POOLS = ("prefill", "decode")


def events_of(samples: list[dict], load_start: float, load_stop: float, first_node: str) -> dict:
    """The moments (s after the deploy) read off the samples."""
    def first(pred, after=-1.0):
        return next((s["t"] for s in samples if s["t"] >= after and pred(s)), None)
    ev = {"load_start": load_start, "load_stop": load_stop}
    ev["scale_up_decision"] = first(lambda s: s["wanted"]["decode"] >= 2, load_start)
    ev["node_launched"] = first(lambda s: s["nodes"]["decode_gpu"] >= 2, load_start)
    ev["replica_placed"] = first(lambda s: any(r["pool"] == "decode" and r["node_id"] != first_node
                                               and r["node_type"] == "decode_gpu" for r in s["replicas"].values())
                                 and s["running"]["decode"] >= 2, load_start)
    new_ids = {rid for s in samples for rid, r in s["replicas"].items()
               if r["pool"] == "decode" and r["node_id"] != first_node}
    ev["kv_on_new_node"] = first(lambda s: any(s["landed"].get(rid, 0) > 0 for rid in new_ids), load_start)
    ev["scale_down"] = first(lambda s: s["running"]["decode"] == 1 and s["wanted"]["decode"] == 1, load_stop)
    ev["node_terminated"] = first(lambda s: s["nodes"]["decode_gpu"] == 1, load_stop)
    return ev


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s, ev = report["samples"], report["events"]
    t = [x["t"] for x in s]
    fig, (a1, a2) = plt.subplots(2, 1, sharex=True, figsize=(9, 5.5))
    for pool in POOLS:
        a1.step(t, [x["running"][pool] for x in s], where="post", label=f"{pool} replicas running",
                lw=3 if pool == "prefill" else 1.5)
    a1.step(t, [x["wanted"]["decode"] for x in s], where="post", ls=":", label="decode replicas wanted")
    for typ in ("prefill_gpu", "decode_gpu"):
        a2.step(t, [x["nodes"][typ] for x in s], where="post", label=f"{typ} nodes", lw=3 if typ == "prefill_gpu" else 1.5)
    for name, at in ev.items():
        if at is not None and not name.startswith("autoscaler_"):
            for ax in (a1, a2):
                ax.axvline(at, color="grey", lw=0.7, ls="--")
            a2.annotate(name, (at, 0.2), rotation=90, fontsize=7, va="bottom", ha="right")
    for at, text in report.get("autoscaler_events", []):      # as the autoscaler logged them
        if at >= 0:
            a2.plot([at], [2.45], marker="v" if text.startswith("Adding") else "^", color="black")
            a2.annotate("autoscaler: " + text.split(" node")[0].lower() + " node", (at, 2.55), fontsize=7,
                        ha="right" if at > s[-1]["t"] / 2 else "left")
    a1.set_ylabel("replicas")
    a2.set_ylabel("nodes")
    a2.set_xlabel("seconds since pdserve was healthy")
    for ax in (a1, a2):
        ax.set_ylim(0, 3.6)
        ax.legend(loc="upper center", fontsize=8, ncol=3)
    a1.set_title("decode pool scale-up and down on the local multi-node cluster (Ray autoscaler v1, fake nodes)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_timeline(report: dict) -> None:
    print(f"startup (cluster + deploy) {report.get('startup_s')} s; total {report.get('total_s')} s")
    print(f"placement: {report.get('placement')}")
    print("   t(s)  prefill  decode(wanted)  prefill_gpu  decode_gpu  nodes")
    last = None
    for s in report.get("samples", []):
        row = (s["running"]["prefill"], s["running"]["decode"], s["wanted"]["decode"],
               s["nodes"]["prefill_gpu"], s["nodes"]["decode_gpu"])
        if row != last:
            print(f"{s['t']:7.1f}  {row[0]:7d}  {row[1]:6d}({row[2]})  {row[3]:11d}  {row[4]:10d}")
            last = row
    print("events (s):", json.dumps(report.get("events")))
    for at, text in report.get("autoscaler_events", []):
        print(f"  autoscaler at {at:7.1f} s: {text}")
    print("requests:", json.dumps(report.get("requests")))
    for k in ("launch_after_decision_s", "terminated_after_scale_down_s", "idle_timeout_s"):
        print(f"{k}: {report.get(k)}")
    print("checks:", json.dumps(report["checks"]))
