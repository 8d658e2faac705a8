"""`pdserve bench`: a load generator for any OpenAI-compatible completions endpoint.

Closed loop (`--concurrency C`: C clients, each sends its next request when the last ends) or open
loop (`--rate R`: Poisson arrivals at R requests/s; `--rates R1,R2,..` sweeps). Prompts are random
token ids with lengths uniform in input_len * (1 +- jitter); every request streams exactly
`--output-len` tokens (ignore_eos). Each run of a `--rates` sweep draws its own prompts (seed, run
index): re-sent prompts would come from the server's prefix cache, so every rate after the first would
measure cache hits; `--compare` sends the same prompts to both endpoints. Separate invocations against
one server should differ in `--seed` for the same reason; the summary's `cached_prompt_fraction` (from
the usage's `prompt_tokens_details.cached_tokens`, where the server reports it) shows what was reused.
Reports p50/p90/p99 TTFT, TPOT and end-to-end latency, throughput and goodput (requests/s meeting both the TTFT and the TPOT SLO); writes JSON and PNG plots (latency
CDFs; goodput against rate); `--compare URL` runs the same load against a second endpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import httpx


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    start = time.perf_counter()
    first = None
    tokens = cached = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return {"ok": False, "error": f"HTTP {resp.status_code}", "e2e": time.perf_counter() - start}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return {"ok": False, "error": event["error"]["message"], "e2e": time.perf_counter() - start}
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                    cached = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                if event.get("choices") and event["choices"][0].get("text") and first is None:
                    first = time.perf_counter()
    except httpx.HTTPError as exc:
        return {"ok": False, "error": repr(exc), "e2e": time.perf_counter() - start}
    end = time.perf_counter()
    first = first or end
    return {"ok": True, "ttft": first - start, "e2e": end - start, "tokens": tokens, "cached_tokens": cached,
            "tpot": (end - first) / (tokens - 1) if tokens > 1 else 0.0}


def run_seed(seed: int, run: int) -> int:
    """The prompts' seed of run `run` of a sweep (run 0 keeps `seed`, as a single run always has)."""
    return seed + 7919 * run


def run_name(url: str, rate: float | None, concurrency: int) -> str:
    """A run's name in the report: what `pdserve plan --calibrate` and `simulate --validate` parse."""
    return f"{url} " + (f"rate {rate:g}/s" if rate else f"concurrency {concurrency}")


def write_report(path: str, args, runs: list[tuple[str, list[dict], dict]]) -> None:
    """The `--json` report: the arguments and each (name, results, summary) run."""
    with open(path, "w") as f:
        json.dump({"args": vars(args), "runs": [{"name": n, "summary": s, "results": r} for n, r, s in runs]},
                  f, indent=1)


def make_bodies(args, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    lo, hi = int(args.input_len * (1 - args.jitter)), int(args.input_len * (1 + args.jitter))
    return [{"model": args.model, "prompt": [rng.randrange(100, 30000) for _ in range(rng.randint(max(lo, 1), hi))],
             "max_tokens": args.output_len, "ignore_eos": True, "temperature": args.temperature, "stream": True,
             "stream_options": {"include_usage": True}} for _ in range(n)]


async def run_load(url: str, bodies: list[dict], concurrency: int | None, rate: float | None, seed: int,
                   headers: dict, progress: bool) -> tuple[list[dict], float]:
    from tqdm import tqdm
    bar = tqdm(total=len(bodies), disable=not progress, desc=url, leave=False)
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=600, headers=headers, trust_env=False) as client:
        start = time.perf_counter()

        async def run(body):
            sent = time.perf_counter() - start
            result = await one_request(client, url, body)
            # what the run offered, for `pdserve simulate --validate` to replay exactly
            results.append({**result, "sent": sent, "prompt_tokens": len(body["prompt"])})
            bar.update(1)

        if rate:
            rng = random.Random(seed)
            tasks = []
            for body in bodies:
                tasks.append(asyncio.create_task(run(body)))
                await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
        else:
            queue = list(bodies)

            async def worker():
                while queue:
                    await run(queue.pop())
            await asyncio.gather(*(worker() for _ in range(concurrency or 1)))
        wall = time.perf_counter() - start
    bar.close()
    return results, wall


def summarize(results: list[dict], wall: float, ttft_slo: float, tpot_slo: float) -> dict:
    ok = [r for r in results if r["ok"]]
    good = [r for r in ok if r["ttft"] <= ttft_slo and r["tpot"] <= tpot_slo]
    out = {"requests": len(results), "failed": len(results) - len(ok), "wall_s": wall,
           "req_per_s": len(ok) / wall, "output_tok_per_s": sum(r["tokens"] for r in ok) / wall,
           "goodput_req_per_s": len(good) / wall,
           "cached_prompt_fraction": sum(r.get("cached_tokens", 0) for r in ok)
           / max(1, sum(r.get("prompt_tokens", 0) for r in ok))}
    for key in ("ttft", "tpot", "e2e"):
        for q in (50, 90, 99):
            out[f"{key}_p{q}"] = percentile([r[key] for r in ok], q)
    return out


def table(rows: list[tuple[str, dict]]) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1e3:.0f}"
    lines = ["| run | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | E2E p50/p99 ms | req/s | tok/s | goodput req/s "
             "| failed |", "|---|---|---|---|---:|---:|---:|---:|"]
    for name, s in rows:
        lines.append(f"| {name} | {ms(s['ttft_p50'])}/{ms(s['ttft_p90'])}/{ms(s['ttft_p99'])} | "
                     f"{ms(s['tpot_p50'])}/{ms(s['tpot_p90'])}/{ms(s['tpot_p99'])} | {ms(s['e2e_p50'])}/"
                     f"{ms(s['e2e_p99'])} | {s['req_per_s']:.2f} | {s['output_tok_per_s']:.1f} | "
                     f"{s['goodput_req_per_s']:.2f} | {s['failed']}/{s['requests']} |")
    return "\n".join(lines)


def plot(path: str, runs: list[tuple[str, list[dict], dict]], rates: list[tuple[str, float, float]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3 if rates else 2, figsize=(15 if rates else 10, 4))
    for ax, key in zip(axes, ("ttft", "tpot")):
        for name, results, _ in runs:
            values = sorted(r[key] * 1e3 for r in results if r["ok"])
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
        ax.set_xlabel(f"{key.upper()} (ms)"), ax.set_ylabel("fraction of requests"), ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if rates:
        for name in sorted({n for n, _, _ in rates}):
            pts = [(r, g) for n, r, g in rates if n == name]
            axes[2].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        axes[2].set_xlabel("offered rate (req/s)"), axes[2].set_ylabel("goodput (req/s)"), axes[2].grid(alpha=0.3)
        axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="endpoint base (before /v1)")
    ap.add_argument("--compare", help="a second endpoint to run the same load against")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--api-key", default="")
    ap.add_argument("--requests", type=int, default=32)
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="closed loop with C clients (default 4)")
    load.add_argument("--rates", help="open loop: Poisson rates to sweep, e.g. 0.5,1,2")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--jitter", type=float, default=0.5, help="input lengths uniform in len*(1+-jitter)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (the default: every server does the same work); OpenAI's own default is 1")
    ap.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    ap.add_argument("--tpot-slo", type=float, default=0.2, help="seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--plot", help="PNG with latency CDFs (and goodput against rate for --rates)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    urls = [args.url] + ([args.compare] if args.compare else [])
    rates = [float(r) for r in args.rates.split(",")] if args.rates else [None]
    rows, runs, goodput = [], [], []
    print("command: pdserve bench " + " ".join(argv if argv is not None else sys.argv[1:]), flush=True)
    for url in urls:
        for i, rate in enumerate(rates):
            bodies = make_bodies(args, args.requests, run_seed(args.seed, i))
            results, wall = asyncio.run(run_load(url, bodies, None if rate else (args.concurrency or 4), rate,
                                                 args.seed, headers, not args.no_progress))
            summary = summarize(results, wall, args.ttft_slo, args.tpot_slo)
            name = run_name(url, rate, args.concurrency or 4)
            rows.append((name, summary))
            runs.append((name, results, summary))
            if rate:
                goodput.append((url, rate, summary["goodput_req_per_s"]))
    print(table(rows))
    print(f"goodput: requests/s with TTFT <= {args.ttft_slo} s and TPOT <= {args.tpot_slo} s")
    if args.json_out:
        write_report(args.json_out, args, runs)
    if args.plot:
        plot(args.plot, runs, goodput)
    return 1 if any(s["failed"] for _, s in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
