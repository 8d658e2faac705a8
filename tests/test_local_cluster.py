"""pdserve on the local multi-node cluster (cluster.local.yaml: Ray's autoscaler v1 with its fake multi-node
provider), end to end, driven by benchmarks/cluster_timeline.py in its own process (its own Ray, RAY_TMPDIR and
token; nothing of it reaches this pytest process or a later `ray.init()`):

- placement: the router, the stats registry, Serve's controller and proxy on the head node; the prefill replicas
  only on prefill_gpu nodes, the decode replicas only on decode_gpu nodes;
- KV across Ray nodes: requests succeed with prefill and decode on different nodes, and the decode replica's
  landed-transfer counter in /metrics goes up;
- a load step grows the decode pool; the autoscaler launches a decode node within MAX_LAUNCH_S of the scale-up
  decision and the new replica receives KV there; after the load the replica goes and the node is terminated
  after the idle timeout; every request succeeds, every stream completes, every block is free at the end;
- every process of the cluster is stopped (by process id; checked here too).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_pools_scale_across_nodes_that_the_autoscaler_adds_and_removes(tmp_path):
    out = tmp_path / "timeline.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cluster_timeline.py"), "--json", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    summary = run.stdout[run.stdout.find("startup (cluster"):]
    print(summary)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["placement"] == {"ServeController": ["ray.head.default"], "ProxyActor": ["ray.head.default"],
                                   "Router": ["ray.head.default"], "StatsRegistry": ["ray.head.default"],
                                   "ResponseStore": ["ray.head.default"],
                                   "PrefillServer": ["prefill_gpu"], "DecodeServer": ["decode_gpu"]}
    failed = [name for name, ok in report["checks"].items() if not ok]
    assert not failed, f"failed checks {failed}\n{summary}"
    assert report["requests"]["ok"] == report["requests"]["total"] > 0
    assert report["requests"]["streams_complete"] == report["requests"]["streams"] > 0
    assert report["terminated_after_scale_down_s"] >= 0.8 * report["idle_timeout_s"]
    mark = report["tmp_dir"].encode()
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark in (entry / "cmdline").read_bytes():
                    alive.append(int(entry.name))
            except OSError:
                pass
    assert not alive, f"processes of the local cluster still alive: {alive}"
    assert run.returncode == 0, run.stdout[-2000:]
