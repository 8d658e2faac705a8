"""What `n` choices of one prompt cost the decode pool, against a running server.

    .venv/bin/pdserve serve --port PORT &     (wait for "pdserve is up")
    .venv/bin/python benchmarks/choices_bench.py --url http://127.0.0.1:PORT [--requests 6] [--n 8] \
        [--prompt-tokens 1000] [--max-tokens 32] [--stream]

Sends `--requests` completions one after the other, each `--n` sampled choices of its own prompt
(`--prompt-tokens` random token ids, new every request: no prefix-cache hit from an earlier one),
`--max-tokens` each (ignore_eos), not streamed (`--stream`: streamed, and the time to the first
chunk with text is printed too). Prints the latency p50 / max, the KV bytes the
prefill pool pushed and the blocks the decode pool reused per request (from /metrics), and the
most KV blocks the decode pool held at once (/metrics sampled every 20 ms during the requests).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))   # service_bench, next to this file
from service_bench import server_counters  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stream", action="store_true")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    client = httpx.Client(timeout=600, trust_env=False)
    client.post(args.url + "/v1/completions", json={"model": MODEL, "prompt": "warm up", "max_tokens": 4})
    peak, stop = [0.0], threading.Event()

    def sample() -> None:
        with httpx.Client(timeout=10, trust_env=False) as probe:
            while not stop.is_set():
                c = server_counters(args.url, gauges=True, client=probe)
                peak[0] = max(peak[0], c.get("pdserve_kv_blocks_total[decode]", 0) - c.get("pdserve_kv_blocks_free[decode]", 0))
                time.sleep(0.02)

    before = server_counters(args.url, client=client)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    latencies, firsts = [], []
    for _ in range(args.requests):
        prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
        body = {"model": MODEL, "prompt": prompt, "n": args.n, "max_tokens": args.max_tokens, "temperature": 1.0,
                "ignore_eos": True, "stream": args.stream}
        start = time.perf_counter()
        with client.stream("POST", args.url + "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            if args.stream:
                indexes = set()
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:])["choices"]:
                            if choice["text"] and not firsts[len(latencies):]:
                                firsts.append(time.perf_counter() - start)
                            indexes.add(choice["index"])
            else:
                indexes = {c["index"] for c in json.loads(resp.read())["choices"]}
        latencies.append(time.perf_counter() - start)
        assert indexes == set(range(args.n)), indexes
    time.sleep(2)          # the replicas' counters follow their pushes' ends
    stop.set()
    sampler.join()
    after = server_counters(args.url, client=client)

    def per_request(key: str) -> float:
        return (after.get(key, 0) - before.get(key, 0)) / args.requests

    print(f"{args.requests} requests, n = {args.n}, {args.prompt_tokens} prompt tokens, {args.max_tokens} tokens each")
    print(f"latency p50 {statistics.median(latencies) * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms")
    if firsts:
        print(f"first chunk p50 {statistics.median(firsts) * 1000:.0f} ms, max {max(firsts) * 1000:.0f} ms")
    print(f"KV pushed per request {per_request('pdserve_kv_bytes_sent[prefill]') / 2**20:.1f} MiB, "
          f"decode blocks reused per request {per_request('pdserve_kv_blocks_reused[decode]'):.0f}")
    print(f"most decode KV blocks held at once {peak[0]:.0f}")


if __name__ == "__main__":
    main()
