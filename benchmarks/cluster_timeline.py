"""pdserve on the one-machine multi-node cluster of cluster.local.yaml, under Ray's real autoscaler:
a load step grows the decode pool, the autoscaler launches a decode node for the new replica, KV
crosses to it from the prefill node; after the load the replica goes and the idle node is terminated.

    PYTHONPATH=. .venv/bin/python benchmarks/cluster_timeline.py \
        --json docs/cluster_timeline.json --plot docs/cluster_timeline.png

Life cycle:
  1. start   the fake multi-node cluster (pdserve/local_cluster.py: own RAY_TMPDIR, free ports) and wait
             for its min_workers: one prefill node, one decode node
  2. deploy  serve_config.cluster.local.yaml with a tiny random-weight model (tests/tiny_models.py), the
             prefill pool fixed at 1 replica and the decode pool autoscaled 1-2, Serve's proxy on the head
  3. check   placement: the router and the registry on the head, each pool only on its node type, prefill
             and decode on different Ray nodes; a few requests land KV on the decode replica
  4. load    closed-loop clients (half of them streaming) until the decode pool's 2nd replica runs on a
             2nd decode node and has received KV, then a few seconds more
  5. idle    stop the load; wait for the pool to return to 1 replica and the idle node to be terminated
  6. report  the timeline (replicas per pool, nodes per type, sampled every 0.5 s) and its events, the
             checks; JSON and a plot (cluster_timeline_report.py); exit status 1 when a check failed
  7. stop    the driver, then every process of the cluster by process id (none may survive; Serve
             is not shut down first: its replicas' graceful drain took 7 s for a cluster going anyway)
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from cluster_timeline_report import events_of, plot, print_timeline  # noqa: E402
from pdserve.local_cluster import LocalCluster  # noqa: E402
from service_util import free_port, http, metrics, pools_all_free, sse_events, wait_healthy  # noqa: E402

APP = "pdserve"
POOLS = {"prefill": "PrefillServer", "decode": "DecodeServer"}
DECODE_SCALING = {"min_replicas": 1, "max_replicas": 2, "target_running": 2, "target_kv_utilization": 0.9,
                  "upscale_delay_s": 1, "downscale_delay_s": 3, "look_back_period_s": 2,
                  "metrics_interval_s": 0.5, "warmup_s": 4}
MAX_LAUNCH_S = 60        # the node must be up this soon after the scale-up decision


def app_config(model_dir: Path):
    from serving.config import AppConfig
    data = AppConfig.from_yaml(ROOT / "serve_config.cluster.local.yaml").model_dump()
    data.update(model=str(model_dir), served_model_name="tiny", request_timeout_s=120,
                engine={**data["engine"], "kv_cache_memory": "32MiB"})
    data["prefill"].update(autoscaling=None, num_replicas=1, graceful_shutdown_timeout_s=20)
    data["decode"].update(autoscaling=DECODE_SCALING, graceful_shutdown_timeout_s=20)
    return AppConfig.model_validate(data)


def actors_by_node() -> list[dict]:
    """Alive actors of this cluster: class, name and node (from the GCS; no dashboard needed)."""
    import ray
    return [{"cls": a["ActorClassName"], "name": a["Name"], "node_id": a["Address"]["NodeID"]}
            for a in ray._private.state.actors().values() if a["State"] == "ALIVE"]


class Sampler(threading.Thread):
    """Every 0.5 s: running and wanted replicas per pool, alive nodes per type, each replica's node, and
    (every 1 s) each decode replica's landed KV transfers from /metrics."""

    def __init__(self, cluster: LocalCluster, base: str, t0: float):
        super().__init__(daemon=True)
        self.cluster, self.base, self.t0 = cluster, base, t0
        self.samples: list[dict] = []
        self.stop = threading.Event()

    def run(self):
        from ray import serve
        last_metrics, landed = 0.0, {}
        while not self.stop.is_set():
            try:
                deps = serve.status().applications[APP].deployments
                nodes = self.cluster.nodes()
                types = {n["node_id"]: n["type"] for n in nodes}
                if time.time() - last_metrics >= 1:
                    m = metrics(self.base)
                    landed = {r: v for (n, p, r), v in m.items() if n == "pdserve_kv_transfers_landed"}
                    last_metrics = time.time()
                placed = {}
                for a in actors_by_node():
                    for pool, dep in POOLS.items():
                        if a["name"].startswith(f"SERVE_REPLICA::{APP}#{dep}#"):
                            placed[a["name"].rsplit("#", 1)[1]] = {"pool": pool, "node_id": a["node_id"],
                                                                   "node_type": types.get(a["node_id"])}
                counts = {name: 0 for name in self.cluster.config["available_node_types"]}
                for n in nodes:
                    counts[n["type"]] = counts.get(n["type"], 0) + 1
                self.samples.append({
                    "t": round(time.time() - self.t0, 2),
                    "running": {p: deps[d].replica_states.get("RUNNING", 0) for p, d in POOLS.items()},
                    "wanted": {p: sum(n for s, n in deps[d].replica_states.items() if s != "STOPPING")
                               for p, d in POOLS.items()},
                    "status": {p: str(deps[d].status) for p, d in POOLS.items()},
                    "nodes": counts, "replicas": placed, "landed": dict(landed)})
            except Exception as exc:  # noqa: BLE001 - a missed sample is not a failure
                print(f"sample failed: {exc!r}", flush=True)
            self.stop.wait(0.5)

    def latest(self) -> dict:
        while not self.samples:
            time.sleep(0.2)
        return self.samples[-1]


def wait_for(sampler: Sampler, pred, timeout_s: float) -> dict | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = sampler.latest()
        if pred(s):
            return s
        time.sleep(0.25)
    return None


class Load:
    """`clients` closed-loop clients (odd ones stream), 200-400 random prompt tokens, 150 output tokens."""

    def __init__(self, base: str, clients: int):
        self.base, self.stop, self.results = base, threading.Event(), []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, seed: int):
        rng = random.Random(seed)
        while not self.stop.is_set():
            body = {"model": "tiny", "prompt": [rng.randrange(100, 40000) for _ in range(rng.randrange(200, 400))],
                    "max_tokens": 150, "ignore_eos": True, "temperature": 0, "stream": seed % 2 == 1}
            status, text = http(self.base, "/v1/completions", body, timeout=180)
            complete = status == 200 and (not body["stream"] or (sse_events(text)[-1:] == ["[DONE]"]
                                                                 and '"error"' not in text))
            self.results.append({"stream": body["stream"], "status": status, "complete": complete})

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()


def placement_checks(cluster: LocalCluster) -> dict:
    types = {n["node_id"]: n["type"] for n in cluster.nodes()}
    on = {}
    for a in actors_by_node():
        for cls in ("Router", "StatsRegistry", "ResponseStore", "PrefillServer", "DecodeServer", "ServeController",
                    "ProxyActor"):
            if a["cls"].endswith(cls):
                on.setdefault(cls, set()).add(types.get(a["node_id"]))
    return {k: sorted(str(t) for t in v) for k, v in on.items()}


def run(args) -> dict:
    from ray import serve

    from pdserve.app_builder import build_app
    from serving.models import DEFAULT_MODEL_ID, resolve_model
    from tiny_models import tiny_model_dir

    tokenizer = resolve_model(DEFAULT_MODEL_ID, cache_dir=ROOT / ".cache" / "models", progress=False)
    model = tiny_model_dir(Path(tempfile.mkdtemp(prefix="tiny-")), "llama", tokenizer_dir=tokenizer)
    t_start = time.time()
    cluster = LocalCluster.start(ROOT / "cluster.local.yaml")
    report: dict = {"checks": {}, "tmp_dir": str(cluster.tmp_dir)}
    try:
        cluster.connect()
        assert cluster.wait_for_nodes({"prefill_gpu": 1, "decode_gpu": 1}, 180), cluster.node_counts()
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        serve.run(build_app(app_config(model)), name=APP, route_prefix="/", blocking=False)
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, 300)
        t0 = time.time()
        report["startup_s"] = round(t0 - t_start, 1)
        sampler = Sampler(cluster, base, t0)
        sampler.start()
        # 3. placement and KV across nodes
        smoke = [http(base, "/v1/completions", {"model": "tiny", "prompt": [200 + i] * 40, "max_tokens": 8})[0]
                 for i in range(4)]
        s = wait_for(sampler, lambda s: any(v > 0 for v in s["landed"].values()), 30) or sampler.latest()
        placed = {r["pool"]: r["node_id"] for r in s["replicas"].values()}
        report["placement"] = placement_checks(cluster)
        first_node = placed.get("decode")
        report["checks"]["placement"] = (report["placement"].get("Router") == ["ray.head.default"]
                                         and report["placement"].get("StatsRegistry") == ["ray.head.default"]
                                         and report["placement"].get("ResponseStore") == ["ray.head.default"]
                                         and report["placement"].get("PrefillServer") == ["prefill_gpu"]
                                         and report["placement"].get("DecodeServer") == ["decode_gpu"])
        report["checks"]["kv_across_nodes"] = (smoke == [200] * 4 and placed.get("prefill") != first_node
                                               and sum(s["landed"].values()) > 0)
        # 4. load until the new replica on the new node has received KV
        load_start = round(time.time() - t0, 2)
        with Load(base, args.clients) as load:
            def grown(s):
                new = [rid for rid, r in s["replicas"].items() if r["pool"] == "decode" and r["node_id"] != first_node]
                return s["running"]["decode"] >= 2 and any(s["landed"].get(rid, 0) > 0 for rid in new)
            report["checks"]["scaled_up"] = wait_for(sampler, grown, args.up_timeout) is not None
            time.sleep(3)
        load_stop = round(time.time() - t0, 2)
        # 5. idle: replica removed, node terminated
        report["checks"]["scaled_down"] = wait_for(
            sampler, lambda s: s["running"]["decode"] == 1 and s["wanted"]["decode"] == 1, 90) is not None
        report["checks"]["node_terminated"] = wait_for(sampler, lambda s: s["nodes"]["decode_gpu"] == 1,
                                                       args.down_timeout) is not None
        report["checks"]["all_blocks_free"] = pools_all_free(base, {"prefill", "decode"}, timeout=30)
        time.sleep(1)
        sampler.stop.set()
        sampler.join()
        results = load.results
        report["requests"] = {"total": len(results), "ok": sum(r["status"] == 200 for r in results),
                              "streams": sum(r["stream"] for r in results),
                              "streams_complete": sum(r["stream"] and r["complete"] for r in results)}
        report["checks"]["no_failed_request"] = bool(results) and all(r["complete"] for r in results)
        ev = events_of(sampler.samples, load_start, load_stop, first_node)
        report["events"] = ev
        idle_s = 60 * cluster.config["idle_timeout_minutes"]
        report["idle_timeout_s"] = idle_s
        if ev["scale_up_decision"] is not None and ev["node_launched"] is not None:
            report["launch_after_decision_s"] = round(ev["node_launched"] - ev["scale_up_decision"], 2)
            report["checks"]["launch_within_s"] = report["launch_after_decision_s"] <= MAX_LAUNCH_S
        if ev["scale_down"] is not None and ev["node_terminated"] is not None:
            report["terminated_after_scale_down_s"] = round(ev["node_terminated"] - ev["scale_down"], 2)
            report["checks"]["terminated_after_idle"] = report["terminated_after_scale_down_s"] >= 0.8 * idle_s
        report["samples"] = sampler.samples
        report["checks"]["pools_only_on_their_types"] = all(   # every replica seen, at every sample
            r["node_type"] in (None, f"{r['pool']}_gpu") for x in sampler.samples for r in x["replicas"].values())
        report["autoscaler_events"] = auto = [(round(at - t0, 2), text) for at, text in cluster.autoscaler_events()
                                              if " node" in text]
        ev["autoscaler_adds_decode_node"] = next((at for at, text in auto if at >= load_start
                                                  and text.startswith("Adding") and "decode_gpu" in text), None)
        ev["autoscaler_removes_decode_node"] = next((at for at, text in auto if at >= load_stop
                                                     and text.startswith("Removing") and "decode_gpu" in text), None)
    finally:
        import ray
        ray.shutdown()
        failed = not report["checks"] or not all(report["checks"].values())
        left = cluster.stop(keep_logs=args.logs if failed and args.logs else None)
        shutil.rmtree(model, ignore_errors=True)
        report["checks"]["nothing_survives"] = not left
        report["total_s"] = round(time.time() - t_start, 1)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--up-timeout", type=float, default=150, help="seconds for the scale-up to show")
    p.add_argument("--down-timeout", type=float, default=120, help="seconds for the idle node to go")
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    p.add_argument("--logs", type=Path, help="where to copy the cluster's Ray logs when a check failed")
    p.add_argument("--from-json", type=Path, help="print and plot a saved report instead of running")
    args = p.parse_args(argv)
    report = json.loads(args.from_json.read_text()) if args.from_json else run(args)
    print_timeline(report)
    if args.json and not args.from_json:
        args.json.write_text(json.dumps(report, indent=1))
    if args.plot and report.get("samples"):
        plot(report, args.plot)
    return 0 if report["checks"] and all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
