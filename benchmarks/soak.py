"""Soak-and-fault run (a script, not a test): minutes of mixed load on a local disaggregated
deployment while replicas are killed periodically. Prints requests ok/failed (and whether each
failure falls right after a kill), p99 latency, KV blocks leaked and replica memory growth.
Half the requests go on their client's conversation (its last prompt, the reply's tokens and a
few new ones, as a chat client resends them), which the decode replica that holds the rest
prefills itself (`routing.local_prefill_tokens`); the others are new prompts. A share of the
requests (`--rerank-share`) are /v1/rerank calls of 2-16 documents instead, which the prefill pool
alone runs.

  .venv/bin/python benchmarks/soak.py --minutes 5 --kill-every 60

Traffic goes to 127.0.0.1 only; the run stops by itself after --minutes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

import psutil
import ray
from ray import serve

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from pdserve import local_ray  # noqa: E402
from pdserve.app_builder import build_app  # noqa: E402
from serving.config import AppConfig  # noqa: E402
from serving.models import resolve_model  # noqa: E402
from service_util import http, metrics, pools_all_free, quiet_port, wait_healthy  # noqa: E402


def replica_rss_mib() -> float:
    total = 0
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if "ServeReplica:soak:PrefillServer" in cmd or "ServeReplica:soak:DecodeServer" in cmd:
            total += p.memory_info().rss
    return total / 2**20


def reply_ids(text: str, stream: bool) -> list[int]:
    """The output token ids of a completion's answer (vLLM's return_token_ids), streamed or not."""
    events = [json.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: {")] if stream else [json.loads(text)]
    return [t for e in events for c in e.get("choices") or () for t in c.get("token_ids") or ()]


def kill_random_replica(rng: random.Random) -> str:
    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(("SERVE_REPLICA::soak#PrefillServer#", "SERVE_REPLICA::soak#DecodeServer#"))]
    victim = rng.choice(names)
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    return victim["name"].split("#")[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--kill-every", type=float, default=60.0, help="seconds between replica kills")
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--model-cache", default=str(ROOT / ".cache" / "models"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rerank-share", type=float, default=0.15, help="requests that are /v1/rerank calls")
    args = ap.parse_args()
    print("command:", " ".join(sys.argv), flush=True)
    model_dir = resolve_model(args.model, args.model_cache, progress=False)
    port = quiet_port()
    local_ray.init(num_cpus=8, logging_level="ERROR", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    cfg = AppConfig(mode="disaggregated", model=str(model_dir), served_model_name="m", route_prefix="/soak",
                    engine={"kv_cache_memory": "128MiB", "num_threads": 1}, transfer={"host": "127.0.0.1"},
                    decode={"num_replicas": 2}, request_timeout_s=120)
    base = f"http://127.0.0.1:{port}/soak"
    try:
        serve.run(build_app(cfg), name="soak", route_prefix="/soak", blocking=False)
        wait_healthy(base)
        rng = random.Random(args.seed)
        results: list[tuple[float, float, int]] = []     # (start, latency, status)
        kills: list[tuple[float, str]] = []
        rerank_statuses: list[int] = []
        stop_at = time.monotonic() + args.minutes * 60

        def rerank(r: random.Random) -> tuple[float, float, int]:
            words = lambda n: " ".join(str(r.randrange(10**6)) for _ in range(n))   # noqa: E731
            docs = [words(r.randrange(5, 120)) for _ in range(r.randrange(2, 17))]
            t0 = time.monotonic()
            try:
                status, text = http(base, "/v1/rerank", {"model": "m", "query": words(r.randrange(5, 60)),
                                                         "documents": docs}, timeout=150)
                if status == 200 and len(json.loads(text)["results"]) != len(docs):
                    status = 598   # an answer short of its documents
            except Exception:  # noqa: BLE001 - a hang past the timeout counts as a failure
                status = 0
            rerank_statuses.append(status)
            return t0, time.monotonic() - t0, status

        def client(i: int) -> None:
            r = random.Random(args.seed * 1000 + i)
            history: list[int] = []                   # the conversation: its last prompt and reply
            while time.monotonic() < stop_at:
                if r.random() < args.rerank_share:
                    results.append(rerank(r))
                    continue
                new = [r.randrange(100, 40000) for _ in range(r.randrange(10, 400))]
                if history and len(history) < 1500 and r.random() < 0.5:
                    new = history + new[:r.randrange(5, 40)]
                body = {"model": "m", "prompt": new, "max_tokens": r.randrange(1, 48),
                        "temperature": r.choice([0, 0.8]), "stream": r.random() < 0.5, "return_token_ids": True}
                t0 = time.monotonic()
                try:
                    status, text = http(base, "/v1/completions", body, timeout=150)
                    if status == 200 and body["stream"] and '"error"' in text:
                        status = 599   # an error event inside the stream
                    history = new + reply_ids(text, body["stream"]) if status == 200 else []
                except Exception:  # noqa: BLE001 - a hang past the timeout counts as a failure
                    status = 0
                results.append((t0, time.monotonic() - t0, status))

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(20)
        rss_start = replica_rss_mib()
        next_kill = time.monotonic() + args.kill_every - 20
        while time.monotonic() < stop_at:
            if time.monotonic() >= next_kill and time.monotonic() < stop_at - 30:
                kills.append((time.monotonic(), kill_random_replica(rng)))
                print(f"  t={kills[-1][0] - (stop_at - args.minutes * 60):6.1f}s killed a {kills[-1][1]} replica",
                      flush=True)
                next_kill += args.kill_every
            time.sleep(1)
        for t in threads:
            t.join(timeout=200)
        time.sleep(15)                                    # let replacements settle and report
        rss_end = replica_rss_mib()
        ok = [lat for _, lat, s in results if s == 200]
        reranks = rerank_statuses.count(200)
        failed = [(t0, s) for t0, _, s in results if s != 200]
        near_kill = [f for f in failed if any(k - 130 <= f[0] <= k + 30 for k, _ in kills)]
        lat = sorted(ok)
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")
        free = pools_all_free(base, {"prefill", "decode"}, timeout=60)
        m = metrics(base)
        leaked = sum(v for (n, _, _), v in m.items() if n == "pdserve_kv_blocks_total") - \
            sum(v for (n, _, _), v in m.items() if n == "pdserve_kv_blocks_free")
        print(f"\nduration {args.minutes:.1f} min, {args.clients} clients, {len(kills)} replica kills "
              f"({', '.join(k for _, k in kills)})")
        print(f"requests ok {len(ok)} ({reranks} of them reranks), failed {len(failed)} (in flight around a kill: "
              f"{len(near_kill)}, elsewhere: {len(failed) - len(near_kill)}); statuses of failures: "
              f"{sorted({s for _, s in failed})}")
        print(f"latency p50 {lat[len(lat) // 2]:.2f} s, p99 {p99:.2f} s" if lat else "no successful request")
        print(f"KV blocks leaked: {int(leaked)} (all pools free: {free})")
        local = sum(v for (n, _, _), v in m.items() if n == "pdserve_prefills_local")
        print(f"prefilled in a decode replica: {int(local)} requests (the live replicas' counts)")
        print(f"replica memory: {rss_start:.0f} MiB after warm-up -> {rss_end:.0f} MiB at the end "
              f"(replaced replicas start fresh)")
        return 0 if free and len(failed) == len(near_kill) else 1
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
