#!/usr/bin/env python
"""Prefix-cache affinity benchmark: multi-turn conversations on two prefill replicas, with the
prefill router's prefix affinity on and then off (`routing.prefix_affinity`), same load; or with
`--pool decode`, on two decode replicas: the K/V a decode replica holds already is not pushed
again (decode_service/server.py step 1), with decode affinity on, off, and with the decode
pool's prefix cache off (`decode.engine.enable_prefix_caching: false`: every push whole).

Deploys a disaggregated app (2 prefill replicas and 1 decode replica; `--pool decode`: 1 and 2;
real model, fp32 CPU) on a local Ray cluster per setting, one setting at a time. Load: C conversations run at once; each has
T turns sent one after the other. Turn 1's prompt is a conversation-specific opening of
--opening tokens (random ids, seeded: a system prompt plus a first question); turn k's prompt is
turn k-1's prompt, that turn's answer and a new --turn-tokens message (random ids), as a chat
client resends the whole history. Every request: streaming completion, --output-len tokens
(ignore_eos, temperature 0).

Before each setting's measured load, --warmup requests of random 64-token prompts (2 at a time)
warm the fresh replicas up; they are excluded, also from the counters.

With `--pool local` (1 prefill + 1 decode replica), each turn resends the previous turn's reply as
its own tokens (vLLM's return_token_ids), as a chat client resends the reply's text: the decode
replica holds that turn's K/V, and with local prefill (`routing.local_prefill_tokens` 64) computes
the new turn itself; against 0, every prompt through the prefill pool. `--repeat N`: N rounds of
the settings, in alternating order.

Printed per setting: TTFT p50/p90 of turns >= 2 (turn 1 can never hit), the prefix-cache hit
ratio of the prefill pool (hit tokens / prompt tokens looked up, from /metrics), the prompt
tokens actually computed by the prefill pool, and the wall time; with `--pool decode` instead:
the KV bytes pushed, the blocks the decode pool reused, and for turns >= 2 the gap from the first
streamed token to the second (it spans the push: the first token comes from the prefill replica,
the second after the K/V landed) and TPOT, p50/p90.

    python benchmarks/prefix_routing_bench.py [--pool prefill|decode|local] [--conversations 4] [--turns 6] \
        [--opening 400] [--turn-tokens 48] [--output-len 8] [--dtype float32|bfloat16] [--repeat 1] \
        [--model DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # service_bench, next to this file
import service_bench as sb  # noqa: E402

# name -> (routing.prefix_affinity, the decode pool's prefix cache, routing.local_prefill_tokens)
SETTINGS = {"prefill": (("affinity on", (True, True, 0)), ("affinity off", (False, True, 0))),
            "decode": (("decode reuse, affinity on", (True, True, 0)), ("decode reuse, affinity off", (False, True, 0)),
                       ("no decode reuse", (True, False, 0))),
            "local": (("local prefill (64)", (True, True, 64)), ("every prefill in the prefill pool", (True, True, 0)))}


def app_config(args, affinity: bool, decode_cache: bool, local: int):
    from serving.config import AppConfig
    two = {"num_replicas": 2}
    return AppConfig(mode="disaggregated", model=args.model, served_model_name=sb.SERVED_NAME,
                     engine={"kv_cache_memory": args.kv_cache_memory, "dtype": args.dtype, "device": "cpu",
                             "num_threads": 1},
                     prefill=two if args.pool == "prefill" else {},
                     decode={**(two if args.pool == "decode" else {}),
                             "engine": {"enable_prefix_caching": decode_cache}},
                     routing={"prefix_affinity": affinity, "local_prefill_tokens": local},
                     transfer={"host": "127.0.0.1"}, route_prefix=sb.ROUTE)


async def conversations(url: str, args, vocab: list[int]) -> list[dict]:
    """Every turn's record (service_bench.one_request's, plus `turn`)."""
    import httpx
    records: list[dict] = []

    async def conversation(client, c: int) -> None:
        rng = random.Random(args.seed * 1000 + c)
        prompt = [rng.choice(vocab) for _ in range(args.opening)]
        for turn in range(1, args.turns + 1):
            rec = await sb.one_request(client, url, prompt, args.output_len, token_ids=args.pool == "local")
            rec["turn"] = turn
            records.append(rec)
            answer = [rng.choice(vocab) for _ in range(args.output_len)]   # ids standing for the reply
            if args.pool == "local":     # the reply itself, as a chat client resends it
                answer = rec["token_ids"] or answer
            prompt = prompt + answer + [rng.choice(vocab) for _ in range(args.turn_tokens)]

    limits = httpx.Limits(max_connections=args.conversations + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits, trust_env=False) as client:
        await asyncio.gather(*(conversation(client, c) for c in range(args.conversations)))
    return records


def prefill_counter(counters: dict, name: str, pool: str = "prefill") -> float:
    return counters.get(f"{name}[{pool}]", 0.0)


def run_setting(args, base: str, vocab, affinity: bool, decode_cache: bool, local: int) -> dict:
    from ray import serve

    from pdserve.app_builder import build_app
    serve.run(build_app(app_config(args, affinity, decode_cache, local)), name=sb.APP_NAME, route_prefix=sb.ROUTE,
              blocking=False)
    try:
        sb.wait_healthy(base, args.health_timeout)
        rng = random.Random(args.seed + 77)
        warm = [[rng.choice(vocab) for _ in range(64)] for _ in range(args.warmup)]
        asyncio.run(sb.closed_loop(base + "/v1/completions", warm, 2, args.output_len, args.request_timeout))
        before = sb.server_counters(base)
        t0 = time.perf_counter()
        records = asyncio.run(conversations(base + "/v1/completions", args, vocab))
        wall = time.perf_counter() - t0
        time.sleep(3)   # let the replicas' stats (pushed every second) catch up
        after = sb.server_counters(base)
    finally:
        serve.delete(sb.APP_NAME)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    later = [r["ttft"] for r in records if r["ok"] and r["turn"] >= 2]
    gaps = [r["second_gap"] for r in records if r["ok"] and r["turn"] >= 2 and r["second_gap"] is not None]
    tpots = [r["tpot"] for r in records if r["ok"] and r["turn"] >= 2]
    queried = prefill_counter(delta, "pdserve_prefix_cache_query_tokens")
    hit = prefill_counter(delta, "pdserve_prefix_cache_hit_tokens")
    return {"affinity": affinity, "decode_cache": decode_cache, "wall_s": wall, "requests": len(records),
            "kv_bytes_sent": prefill_counter(delta, "pdserve_kv_bytes_sent"),
            "kv_blocks_reused": prefill_counter(delta, "pdserve_kv_blocks_reused", "decode"),
            "prefills_local": prefill_counter(delta, "pdserve_prefills_local", "decode"),
            "second_gap_later_p50_s": sb.pct(gaps, 50), "second_gap_later_p90_s": sb.pct(gaps, 90),
            "tpot_later_p50_s": sb.pct(tpots, 50), "tpot_later_p90_s": sb.pct(tpots, 90),
            "failed": sum(not r["ok"] for r in records), "errors": [r["error"] for r in records if not r["ok"]],
            "ttft_later_p50_s": sb.pct(later, 50), "ttft_later_p90_s": sb.pct(later, 90),
            "ttft_first_p50_s": sb.pct([r["ttft"] for r in records if r["ok"] and r["turn"] == 1], 50),
            "prefix_query_tokens": queried, "prefix_hit_tokens": hit,
            "hit_ratio": hit / queried if queried else None, "computed_prompt_tokens": queried - hit}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pool", choices=sorted(SETTINGS), default="prefill",
                   help="the pool with two replicas whose prefix reuse is compared")
    p.add_argument("--model", default=sb.DEFAULT_MODEL)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--opening", type=int, default=400, help="turn 1 prompt tokens")
    p.add_argument("--turn-tokens", type=int, default=48, help="new user tokens per later turn")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=4, help="excluded warm-up requests per setting")
    p.add_argument("--repeat", type=int, default=1, help="rounds of every setting, in alternating order")
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--health-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    if min(args.conversations, args.turns, args.opening, args.turn_tokens, args.repeat) < 1 or args.output_len < 2:
        p.error("counts must be >= 1 and --output-len >= 2")
    if not Path(args.model).is_dir():
        p.error(f"--model {args.model}: not a directory (prepare it with `make model`)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cmd, commit = sb.command_line(), sb.git_commit()
    print(f"$ {cmd}", flush=True)
    vocab = sb.plain_vocab(args.model)
    port = sb.free_port()
    base = f"http://127.0.0.1:{port}{sb.ROUTE}"
    rows = []
    with sb.local_serve(port):
        for repeat in range(args.repeat):     # the settings' order reversed every other round
            settings = SETTINGS[args.pool] if repeat % 2 == 0 else SETTINGS[args.pool][::-1]
            for name, (affinity, decode_cache, local) in settings:
                print(f"[{name}] deploying ...", file=sys.stderr, flush=True)
                rows.append({"setting": name if args.repeat == 1 else f"{name}, round {repeat + 1}",
                             **run_setting(args, base, vocab, affinity, decode_cache, local)})

    print()
    print(f"pdserve prefix-affinity benchmark — {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}, "
          f"commit {commit}; {platform.machine()}, {os.cpu_count()} CPU cores, everything on this host")
    pools = {"prefill": "2 prefill + 1 decode", "decode": "1 prefill + 2 decode", "local": "1 prefill + 1 decode"}
    print(f"app: {pools[args.pool]} replicas, {Path(args.model).name} {args.dtype} CPU, 1 torch thread each; load: "
          f"{args.conversations} conversations at once x {args.turns} turns, opening {args.opening} tokens, "
          f"+{args.output_len} answer +{args.turn_tokens} user tokens per turn, output {args.output_len}; "
          f"{args.warmup} warm-up requests per setting excluded")
    print()
    if args.pool == "prefill":
        print("| setting | TTFT p50, turns >= 2 (ms) | TTFT p90, turns >= 2 (ms) | TTFT p50, turn 1 (ms) "
              "| prefix hit ratio | prompt tokens computed | wall (s) | failed |")
        print("|---|---|---|---|---|---|---|---|")
    elif args.pool == "local":
        print("| setting | TTFT p50 / p90, turns >= 2 (ms) | TPOT p50 / p90, turns >= 2 (ms) | TTFT p50, turn 1 (ms) "
              "| prefilled in the decode replica | KV pushed (MiB) | prompt tokens the prefill pool computed "
              "| wall (s) | failed |")
        print("|---|---|---|---|---|---|---|---|---|")
    else:
        print("| setting | KV pushed (MiB) | decode blocks reused | 1st -> 2nd token p50 / p90, turns >= 2 (ms) "
              "| TPOT p50 / p90, turns >= 2 (ms) | TTFT p50, turns >= 2 (ms) | wall (s) | failed |")
        print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if args.pool == "prefill":
            print(f"| {r['setting']} | {sb.fmt(r['ttft_later_p50_s'], 1e3)} | {sb.fmt(r['ttft_later_p90_s'], 1e3)} "
                  f"| {sb.fmt(r['ttft_first_p50_s'], 1e3)} | {sb.fmt(r['hit_ratio'], 100, 1)} % "
                  f"| {r['computed_prompt_tokens']:.0f} | {r['wall_s']:.1f} | {r['failed']}/{r['requests']} |")
        elif args.pool == "local":
            print(f"| {r['setting']} | {sb.fmt(r['ttft_later_p50_s'], 1e3)} / {sb.fmt(r['ttft_later_p90_s'], 1e3)} "
                  f"| {sb.fmt(r['tpot_later_p50_s'], 1e3)} / {sb.fmt(r['tpot_later_p90_s'], 1e3)} "
                  f"| {sb.fmt(r['ttft_first_p50_s'], 1e3)} | {r['prefills_local']:.0f} "
                  f"| {r['kv_bytes_sent'] / 2**20:.1f} | {r['computed_prompt_tokens']:.0f} | {r['wall_s']:.1f} "
                  f"| {r['failed']}/{r['requests']} |")
        else:
            print(f"| {r['setting']} | {r['kv_bytes_sent'] / 2**20:.1f} | {r['kv_blocks_reused']:.0f} "
                  f"| {sb.fmt(r['second_gap_later_p50_s'], 1e3)} / {sb.fmt(r['second_gap_later_p90_s'], 1e3)} "
                  f"| {sb.fmt(r['tpot_later_p50_s'], 1e3)} / {sb.fmt(r['tpot_later_p90_s'], 1e3)} "
                  f"| {sb.fmt(r['ttft_later_p50_s'], 1e3)} | {r['wall_s']:.1f} | {r['failed']}/{r['requests']} |")
        for e in sorted(set(r["errors"]))[:5]:
            print(f"    error: {e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": cmd, "commit": commit, "rows": rows}, indent=1))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
