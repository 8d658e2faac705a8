"""What starting a pdserve application costs: on a fresh local Ray cluster (as `pdserve serve`
starts it) left idle, an application is deployed, timed to /health's 200 and to its first answer,
and the CPU each process spent meanwhile is listed (psutil, the replicas by their Ray titles);
then it is deleted, and the next round deploys it again. Each app start is also what a pool's new
replica pays (its process's imports, the model's load) before it takes a request.

  .venv/bin/python benchmarks/app_start_bench.py [--model DIR] [--model-cache .cache/models]
      [--mode disaggregated|colocated] [--rounds 2]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import psutil  # noqa: E402

from service_util import http, quiet_port  # noqa: E402

NAME = "start"


def cpu_by_process() -> dict[int, tuple[float, str]]:
    out = {}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            times = proc.cpu_times()
            out[proc.pid] = (times.user + times.system, " ".join(proc.info["cmdline"] or [])[:60])
        except psutil.Error:
            pass
    return out


def until(pred, timeout: float) -> None:
    start = time.monotonic()
    while not pred():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model directory (default: the default model)")
    p.add_argument("--model-cache", default=".cache/models")
    p.add_argument("--mode", default="disaggregated", choices=("disaggregated", "colocated"))
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    from ray import serve

    from pdserve import local_ray
    from pdserve.serve_config import deploy
    from serving.config import AppConfig
    port = quiet_port()
    local_ray.init(num_cpus=8)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    fields = {"mode": args.mode, "model_cache": args.model_cache, "transfer": {"host": "127.0.0.1"},
              "engine": {"kv_cache_memory": "64MiB", "num_threads": 1}}
    cfg = AppConfig(**fields, **({"model": args.model} if args.model else {}))
    base = f"http://127.0.0.1:{port}/{NAME}"
    time.sleep(10)                 # the cluster's own start settles
    try:
        for r in range(args.rounds):
            before, start = cpu_by_process(), time.monotonic()
            deploy(cfg, NAME, f"/{NAME}")
            until(lambda: _status(base) == 200, 600)
            healthy = time.monotonic() - start
            status, _ = http(base, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
            answered = time.monotonic() - start
            after = cpu_by_process()
            spent = collections.Counter()
            for pid, (cpu, title) in after.items():
                spent[title] += cpu - before.get(pid, (0.0, ""))[0]
            print(f"round {r}: healthy after {healthy:.1f} s, first answer ({status}) after {answered:.1f} s, "
                  f"{sum(spent.values()):.1f} CPU-s in all")
            for title, cpu in spent.most_common(8):
                print(f"  {cpu:6.2f} CPU-s  {title}")
            serve.delete(NAME)
            time.sleep(10)         # the replicas' processes exit
    finally:
        serve.shutdown()


def _status(base: str) -> int:
    try:
        return http(base, "/health", timeout=5)[0]
    except OSError:
        return 0


if __name__ == "__main__":
    main()
