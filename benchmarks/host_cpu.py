"""Where a served run's CPU goes, by role: the engines' threads, the rest of each replica, the router,
Serve's proxy, Ray, and the load generator itself (this process).

`pdserve simulate --host-cpu` prices the serving work around the engines (streaming a token through
the decode replica's event loop, the router and the proxy; admitting a request) as CPU that shares the
host's cores with the engines. This script measures those costs on a running `pdserve serve`: it
snapshots the CPU time of every process of the server's tree and of every thread of its replicas,
runs `pdserve bench` once per rate from this process, and prints per role the cores used and the CPU
per streamed token and per request. The busiest thread of a replica process is its engine thread
(one torch thread per replica by default, so the engine's ops run on it); the rest of that process is
its event loop and Ray's threads.

    .venv/bin/pdserve serve --port 8123 &       # then, with its PID:
    .venv/bin/python benchmarks/host_cpu.py --pid PID --url http://127.0.0.1:8123 --rates 0.5,2 \
        --requests 40 --input-len 256 --output-len 32 --json docs/host_cpu.json --bench-json docs/bench_cpu_validate.json

`--bench-json` also writes the runs as a `pdserve bench --json` report (same prompts, arrivals and
SLOs), so `pdserve simulate --validate` can check the simulation against the very runs whose CPU
costs `--host-cpu` uses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import defaultdict

import psutil

from pdserve import bench

ROLES = ("prefill engine", "prefill rest", "decode engine", "decode rest", "router", "proxy", "ray", "client")


def _role(name: str) -> str:
    for key, role in (("PrefillServer", "prefill"), ("DecodeServer", "decode"), ("ColocatedServer", "prefill"),
                      ("Router", "router"), ("ProxyActor", "proxy")):
        if key in name:
            return role
    return "ray"


def snapshot(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far, by role; replica processes split into engine / rest."""
    out: dict[str, float] = defaultdict(float)
    me = psutil.Process()
    out["client"] = sum(me.cpu_times()[:2])
    for p in psutil.Process(root).children(recursive=True) + [psutil.Process(root)]:
        try:
            role, threads = _role(p.name() + " " + " ".join(p.cmdline()[:1])), p.threads()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        total = sum(t.user_time + t.system_time for t in threads)
        if role in ("prefill", "decode"):
            engine = max(t.user_time + t.system_time for t in threads)
            out[f"{role} engine"] += engine
            out[f"{role} rest"] += total - engine
        else:
            out[role] += total
    return out


def measure(root: int, url: str, rate: float, seed: int, bench_args: argparse.Namespace) -> dict:
    bodies = bench.make_bodies(bench_args, bench_args.requests, seed)   # fresh prompts: no prefix-cache hits
    before, t0 = snapshot(root), time.perf_counter()
    results, wall = asyncio.run(bench.run_load(url, bodies, None, rate, seed, {}, False))
    after, elapsed = snapshot(root), time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    cpu = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ROLES}
    return {"rate": rate, "requests": len(ok), "results": results, "tokens": tokens, "wall_s": elapsed,
            "cores": {k: v / elapsed for k, v in cpu.items()},
            "ms_per_token": {k: 1e3 * v / max(tokens, 1) for k, v in cpu.items()},
            "ms_per_request": {k: 1e3 * v / max(len(ok), 1) for k, v in cpu.items()},
            "summary": bench.summarize(results, wall, bench_args.ttft_slo, bench_args.tpot_slo)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pid", type=int, required=True, help="the `pdserve serve` process")
    ap.add_argument("--url", required=True)
    ap.add_argument("--rates", default="0.5,2")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--jitter", type=float, default=0.5)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--tpot-slo", type=float, default=0.2)
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--bench-json", help="the runs as a `pdserve bench --json` report")
    args = ap.parse_args(argv)
    runs = []
    print(f"host: {os.cpu_count()} CPUs; load average before: {os.getloadavg()[0]:.2f}")
    for i, rate in enumerate(float(r) for r in args.rates.split(",")):
        run = measure(args.pid, args.url, rate, bench.run_seed(args.seed, i), args)
        runs.append(run)
        s = run["summary"]
        print(f"\nrate {rate:g}/s: {run['requests']} requests, {run['tokens']} tokens in {run['wall_s']:.1f} s; "
              f"TTFT p50 {s['ttft_p50'] * 1e3:.0f} ms, TPOT p50 {s['tpot_p50'] * 1e3:.0f} ms")
        print(f"{'role':<16}{'cores':>8}{'ms/token':>10}{'ms/request':>12}")
        for k in ROLES:
            print(f"{k:<16}{run['cores'][k]:>8.3f}{run['ms_per_token'][k]:>10.2f}{run['ms_per_request'][k]:>12.1f}")
        print(f"{'all':<16}{sum(run['cores'].values()):>8.3f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "cpus": os.cpu_count(),
                       "runs": [{k: v for k, v in r.items() if k != "results"} for r in runs]}, f, indent=1)
    if args.bench_json:
        bench.write_report(args.bench_json, args, [(bench.run_name(args.url, r["rate"], 0), r["results"], r["summary"])
                                                   for r in runs])
    return 0


if __name__ == "__main__":
    sys.exit(main())
