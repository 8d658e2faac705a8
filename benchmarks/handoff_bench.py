#!/usr/bin/env python
"""KV hand-off benchmark: one prefill -> decode pair, served end to end (issue 14).

Deploys the disaggregated app (1 PrefillServer + 1 DecodeServer, so every hand-off goes through
one sender/receiver pair of replicas) on a local Ray cluster (loopback, free port) and measures:

  1. hand-offs per second: a closed loop of `--requests` streaming completions (default 64) with
     `--concurrency` in flight (default 16), short prompts (`--prompt-len` random non-special
     token ids, default 16) and `max_tokens` 2, so each request is one prefill, one KV hand-off
     and one decode step; rate = successful requests / wall time of the loop.
  2. the abandoned-client gap: `--rounds` times (default 4), a client streams a 200-token prompt
     and closes the connection at its first token, and right after it another client streams a
     40-token prompt (`max_tokens` 8) to the end; printed: that client's gap between its first and
     second streamed token, per round, beside the same gap with no abandoned client before it.

Run it against two trees in one go to compare (the script lives in each tree's benchmarks/):

    git archive <commit> | tar -x -C /tmp/before
    cp benchmarks/handoff_bench.py /tmp/before/benchmarks/
    PYTHONPATH=/tmp/before .venv/bin/python /tmp/before/benchmarks/handoff_bench.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/handoff_bench.py

Reading the numbers: client, proxy, router and both replicas share this host's cores; the
rate is a served rate (HTTP, router, Serve calls, engine steps), not the transport's alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import service_bench as sb  # noqa: E402  (also puts this tree's root on sys.path)

import httpx  # noqa: E402


def body(prompt: list[int], max_tokens: int) -> dict:
    return {"model": sb.SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}


async def leave_at_first_token(client: httpx.AsyncClient, url: str, prompt: list[int]) -> None:
    async with client.stream("POST", url, json=body(prompt, 50)) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                return                      # closing the stream closes the connection


async def token_times(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of the streamed chunks that carry a choice."""
    times = []
    async with client.stream("POST", url, json=body(prompt, max_tokens)) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                times.append(time.perf_counter())
    return times


async def gaps(url: str, prompts: list[list[int]], long_prompts: list[list[int]] | None) -> list[float]:
    """First-to-second token gap (ms) of each prompt, each right after an abandoned client when
    `long_prompts` is given."""
    out = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(120), trust_env=False,
                                 limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for i, prompt in enumerate(prompts):
            if long_prompts is not None:
                await leave_at_first_token(client, url, long_prompts[i])
            times = await token_times(client, url, prompt, 8)
            out.append(1000 * (times[1] - times[0]) if len(times) > 1 else float("nan"))
    return out


def app_config(args):
    from serving.config import AppConfig
    return AppConfig(mode="disaggregated", model=args.model, served_model_name=sb.SERVED_NAME,
                     engine={"kv_cache_memory": args.kv_cache_memory, "device": "cpu", "num_threads": 1},
                     transfer={"host": "127.0.0.1"}, route_prefix=sb.ROUTE)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(sb.REPO_ROOT / sb.DEFAULT_MODEL))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--kv-cache-memory", default="512MiB")
    args = p.parse_args()
    from ray import serve

    from pdserve.app_builder import build_app
    vocab = sb.plain_vocab(args.model)
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.choice(vocab) for _ in range(length)] for _ in range(n)]

    port = sb.free_port()
    base = f"http://127.0.0.1:{port}{sb.ROUTE}"
    url = base + "/v1/completions"
    with sb.local_serve(port):
        serve.run(build_app(app_config(args)), name=sb.APP_NAME, route_prefix=sb.ROUTE, blocking=False)
        sb.wait_healthy(base, 600)
        asyncio.run(sb.closed_loop(url, prompts(4, args.prompt_len), 2, 2, 120))      # warm-up
        load = os.getloadavg()[0]
        results, wall = asyncio.run(sb.closed_loop(url, prompts(args.requests, args.prompt_len),
                                                   args.concurrency, 2, 120))
        ok = [r for r in results if r["ok"]]
        baseline = asyncio.run(gaps(url, prompts(args.rounds, 40), None))
        after_abandoned = asyncio.run(gaps(url, prompts(args.rounds, 40), prompts(args.rounds, 200)))
        time.sleep(2)
        counters = sb.server_counters(base)
    e2e = sorted(r["e2e"] for r in ok)
    print(f"tree: {sb.REPO_ROOT} (commit {sb.git_commit()}), load average before the loop {load:.2f}")
    print(f"hand-offs/s through one prefill->decode pair: {len(ok) / wall:.1f} "
          f"({len(ok)}/{len(results)} ok in {wall:.2f} s, concurrency {args.concurrency}, "
          f"{args.prompt_len}-token prompts, max_tokens 2; e2e p50 {1000 * e2e[len(e2e) // 2]:.0f} ms)")
    print("first->second token gap, no abandoned client before (ms):", " ".join(f"{g:.0f}" for g in baseline))
    print("first->second token gap right after a client left at its first token (ms):",
          " ".join(f"{g:.0f}" for g in after_abandoned))
    print("KV transfers:", {k: v for k, v in counters.items() if "kv_transfers" in k})
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
