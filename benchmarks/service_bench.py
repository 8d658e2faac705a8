#!/usr/bin/env python
"""Service benchmark: the HTTP API end to end, disaggregated vs colocated, same load, one run.

For each mode in `--modes` (default: disaggregated, then colocated) the script deploys one
Serve app on a local Ray cluster (loopback only, free port), waits for GET /health, sends a
short warm-up (excluded), then a closed loop of N streaming completions (default 32) with C
in flight (default 8), and deletes the app before the next mode, so the modes never compete
for the CPU cores.

  * disaggregated: Router -> 1 PrefillServer replica -> KV over gloo -> 1 DecodeServer replica
  * colocated:     Router -> 1 ColocatedServer replica (prefill and decode in one engine)

Load (identical for every mode): prompts of random token ids (seeded, lengths uniform in
[--min-prompt, --max-prompt], default 50..600; special tokens excluded; random ids also keep
the prefix cache from hitting), POST /v1/completions with `"stream": true`,
`"max_tokens": L` (default 32), `"ignore_eos": true`, `"temperature": 0`.

Per request, client side (httpx, streaming):
  TTFT  = first SSE chunk carrying non-empty text - request sent
  TPOT  = (end - first token time) / (output tokens - 1), output tokens from the usage chunk
  E2E   = end - request sent, where end = `data: [DONE]` received
A request fails on a non-200 status, an error event in the stream, a missing [DONE], a
transport error, or fewer/more than L output tokens. Throughput = tokens (and requests) of
successful requests / wall time of the measured loop (first send to last end).

Reading the numbers: client, proxy, router and every replica share this host's cores. With
`--threads T`, disaggregated runs two engine processes (2 x T torch threads: prefill and decode
proceed in parallel), colocated one (T threads, prefill chunks and decode steps share each engine
step). On a small CPU box this compares "two engines on the cores" with "one engine", not the
scale-out setting disaggregation is built for (separate accelerators, KV over a real network);
with few requests, p99 is essentially the slowest request, and the closed loop's opening burst
(C prompts at once) dominates the TTFT tail.

    python benchmarks/service_bench.py [--requests 32] [--concurrency 8] [--output-len 32] \
        [--modes disaggregated,colocated] [--model DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import random
import re
import shlex
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:          # runs without an editable install
    sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

DEFAULT_MODEL = ".cache/models/SmolLM2-135M-Instruct"
SERVED_NAME = "SmolLM2-135M-Instruct"
MODES = ("disaggregated", "colocated")
APP_NAME = "pd"
ROUTE = "/pd"


# ---- load ----------------------------------------------------------------------------------------

def plain_vocab(model_dir: str) -> list[int]:
    """The tokenizer's ids that are not special tokens."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    special = set(tok.all_special_ids)
    return [i for i in range(len(tok)) if i not in special]


@contextlib.contextmanager
def local_serve(port: int):
    """A local Ray cluster (loopback, pdserve/local_ray.py) with Serve's HTTP proxy on `port`, shut down on exit."""
    import ray
    from ray import serve

    from pdserve import local_ray
    local_ray.init(num_cpus=8)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def make_prompts(model_dir: str, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """n prompts of random non-special token ids, lengths uniform in [lo, hi]; deterministic in seed."""
    vocab = plain_vocab(model_dir)
    rng = random.Random(seed)
    return [[rng.choice(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def request_body(prompt: list[int], output_len: int, token_ids: bool = False) -> dict:
    return {"model": SERVED_NAME, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            **({"return_token_ids": True} if token_ids else {})}


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], output_len: int,
                      token_ids: bool = False) -> dict:
    """One streamed completion's record; `token_ids`: also the output's ids (vLLM's return_token_ids)."""
    rec = {"prompt_tokens": len(prompt), "ok": False, "error": None, "ttft": None, "tpot": None, "e2e": None,
           "output_tokens": 0, "cached_tokens": 0, "text": "", "start": None, "end": None, "second_gap": None,
           "token_ids": []}
    t0 = time.perf_counter()
    rec["start"] = t0
    first = second = None
    done = False
    text = []
    try:
        async with client.stream("POST", url, json=request_body(prompt, output_len, token_ids)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec["error"] = f"HTTP {resp.status_code}: {body[:200]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    done = True
                    break
                obj = json.loads(payload)
                if "error" in obj:
                    rec["error"] = f"stream error: {json.dumps(obj['error'])[:200]}"
                    continue
                for choice in obj.get("choices") or ():
                    rec["token_ids"] += choice.get("token_ids") or []
                    piece = choice.get("text") or ""
                    if piece:
                        if first is None:
                            first = time.perf_counter()
                        elif second is None:
                            second = time.perf_counter()
                        text.append(piece)
                if obj.get("usage"):
                    rec["output_tokens"] = obj["usage"]["completion_tokens"]
                    rec["cached_tokens"] = (obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except (httpx.HTTPError, OSError, ValueError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:200]
        return rec
    end = time.perf_counter()
    rec["end"] = end
    rec["text"] = "".join(text)
    if rec["error"] is None and not done:
        rec["error"] = "stream ended without [DONE]"
    if rec["error"] is None and first is None:
        rec["error"] = "no chunk with text"
    if rec["error"] is None and rec["output_tokens"] != output_len:
        rec["error"] = f"{rec['output_tokens']} output tokens, expected {output_len}"
    if rec["error"] is None:
        rec["ok"] = True
        rec["ttft"] = first - t0
        rec["e2e"] = end - t0
        rec["tpot"] = (end - first) / (rec["output_tokens"] - 1) if rec["output_tokens"] > 1 else None
        rec["second_gap"] = None if second is None else second - first   # disaggregated: spans the KV hand-off
    return rec


async def closed_loop(url: str, prompts: list[list[int]], concurrency: int, output_len: int,
                      timeout_s: float) -> tuple[list[dict], float]:
    """`concurrency` workers, each sending its next request as soon as its previous one ends."""
    results: list[dict | None] = [None] * len(prompts)
    next_index = iter(range(len(prompts)))
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    # trust_env=False: no proxy from the environment; traffic goes to 127.0.0.1 only
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, trust_env=False) as client:
        async def worker():
            for i in next_index:
                results[i] = await one_request(client, url, prompts[i], output_len)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
        wall = time.perf_counter() - t0
    return results, wall


# ---- service ------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with httpx.Client(timeout=5, trust_env=False) as client:
        while time.monotonic() < deadline:
            try:
                r = client.get(base + "/health")
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(1)
    raise TimeoutError(f"service not healthy after {timeout_s:.0f} s ({last})")


GAUGES = ("pdserve_kv_blocks_total", "pdserve_kv_blocks_free", "pdserve_running_requests",
          "pdserve_waiting_requests", "pdserve_waiting_prompt_tokens")


def server_counters(base: str, gauges: bool = False, client: httpx.Client | None = None) -> dict[str, float]:
    """Router outcomes and per-replica counters from /metrics, summed over replicas of a pool
    (`name[pool]`); with `gauges`, the replicas' gauges (GAUGES) too. `client`: one to reuse."""
    try:
        if client is not None:
            text = client.get(base + "/metrics").text
        else:
            with httpx.Client(timeout=10, trust_env=False) as own:
                text = own.get(base + "/metrics").text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for m in re.finditer(r'^(pdserve_\w+)\{(\w+)="([^"]*)"(?:,replica="[^"]*")?\} (\S+)$', text, re.M):
        name, label, value = m.group(1), m.group(3), float(m.group(4))
        if name in GAUGES and not gauges:
            continue
        key = f"{name}[{label}]"
        out[key] = out.get(key, 0.0) + value
    return out


def app_config(mode: str, args):
    from serving.config import AppConfig
    return AppConfig(mode=mode, model=args.model, served_model_name=SERVED_NAME,
                     engine={"kv_cache_memory": args.kv_cache_memory, "dtype": "float32", "device": "cpu",
                             "num_threads": args.threads},
                     transfer={"host": "127.0.0.1"}, route_prefix=ROUTE)


def replicas_text(mode: str) -> str:
    return "1 prefill + 1 decode" if mode == "disaggregated" else "1 colocated"


def run_mode(mode: str, args, base: str, warm_prompts, prompts) -> dict:
    from ray import serve

    from pdserve.app_builder import build_app
    cfg = app_config(mode, args)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        serve.run(build_app(cfg), name=APP_NAME, route_prefix=ROUTE, blocking=False)
        wait_healthy(base, args.health_timeout)
        startup = time.perf_counter() - t0
        url = base + "/v1/completions"
        warm, _ = asyncio.run(closed_loop(url, warm_prompts, 1, args.output_len, args.request_timeout))
        warm_failed = [r["error"] for r in warm if not r["ok"]]
        before = server_counters(base)
        results, wall = asyncio.run(closed_loop(url, prompts, args.concurrency, args.output_len,
                                                args.request_timeout))
        after = server_counters(base)
    finally:
        try:
            serve.delete(APP_NAME)
        except Exception as exc:   # noqa: BLE001 - report and go on to the next mode
            print(f"[{mode}] serve.delete failed: {exc!r}", file=sys.stderr, flush=True)
    counters = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(after) | set(before))}
    row = summarize(mode, results, wall, startup, warm_failed, counters)
    row["loadavg_1m_before"] = load_before   # other work on the host competes for the cores
    return row


# ---- statistics ---------------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None   # linear interpolation


def summarize(mode, results, wall, startup, warm_failed, counters) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    e2e = [r["e2e"] for r in ok]
    out_tokens = sum(r["output_tokens"] for r in ok)
    return {
        "mode": mode, "replicas": replicas_text(mode), "startup_s": startup, "wall_s": wall,
        "requests": len(results), "ok": len(ok), "failed": len(results) - len(ok),
        "errors": [r["error"] for r in results if not r["ok"]],
        "warmup_failed": warm_failed,
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99),
        "e2e_p50_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99),
        "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / wall if wall > 0 else None,
        "req_per_s": len(ok) / wall if wall > 0 else None,
        "cached_prompt_tokens": sum(r["cached_tokens"] for r in ok),
        "server_counters": counters,
        "per_request": [{k: r[k] for k in ("prompt_tokens", "ok", "error", "ttft", "tpot", "e2e", "output_tokens",
                                           "cached_tokens", "text")} for r in results],
    }


def fmt(v: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "—" if v is None else f"{v * scale:.{digits}f}"


def table(rows: list[dict]) -> str:
    head = ("| mode | replicas | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) "
            "| E2E p50 (s) | E2E p99 (s) | output tok/s | req/s | failed |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['replicas']} | {fmt(r['ttft_p50_s'], 1e3)} | {fmt(r['ttft_p99_s'], 1e3)} "
            f"| {fmt(r['tpot_p50_s'], 1e3, 1)} | {fmt(r['tpot_p99_s'], 1e3, 1)} "
            f"| {fmt(r['e2e_p50_s'], 1, 2)} | {fmt(r['e2e_p99_s'], 1, 2)} "
            f"| {fmt(r['output_tok_per_s'], 1, 1)} | {fmt(r['req_per_s'], 1, 2)} | {r['failed']}/{r['requests']} |")
    return "\n".join(lines)


def git_commit() -> str:
    """Short HEAD, flagged when tracked files differ from it (replicas import the working tree)."""
    def git(*cmd) -> str:
        return subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD") or "?"
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "?"
    return head + (f" + uncommitted changes in {len(dirty.splitlines())} tracked file(s)" if dirty else "")


def command_line() -> str:
    exe = sys.executable
    try:
        rel = os.path.relpath(exe)
        if not rel.startswith(".."):
            exe = rel
    except ValueError:
        pass
    return shlex.join([exe] + sys.argv)


# ---- main ---------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="local HF model directory (default: %(default)s)")
    p.add_argument("--requests", type=int, default=32, help="measured requests per mode (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop concurrency (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request (default: %(default)s)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, run in order (default: %(default)s)")
    p.add_argument("--min-prompt", type=int, default=50, help="shortest prompt, tokens (default: %(default)s)")
    p.add_argument("--max-prompt", type=int, default=600, help="longest prompt, tokens (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per mode, excluded (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default: %(default)s)")
    p.add_argument("--kv-cache-memory", default="256MiB", help="KV pool per replica (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica (default: %(default)s)")
    p.add_argument("--health-timeout", type=float, default=300.0, help="s to wait for /health (default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="s per request (default: %(default)s)")
    p.add_argument("--json", metavar="OUT", help="also write config, summaries and per-request records here")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        p.error(f"--modes: choose from {', '.join(MODES)} (got {bad or 'nothing'})")
    if args.requests < 1 or args.concurrency < 1 or args.output_len < 2 or args.warmup < 0:
        p.error("--requests and --concurrency must be >= 1, --output-len >= 2 (TPOT), --warmup >= 0")
    if not 1 <= args.min_prompt <= args.max_prompt:
        p.error("need 1 <= --min-prompt <= --max-prompt")
    if not Path(args.model).is_dir():
        p.error(f"--model {args.model}: not a directory (prepare it with `make model` or the tests' fixture)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cmd = command_line()
    print(f"$ {cmd}", flush=True)
    commit = git_commit()   # at start: the replicas import the code as it is now
    prompts = make_prompts(args.model, args.requests, args.min_prompt, args.max_prompt, args.seed)
    warm_prompts = make_prompts(args.model, args.warmup, args.min_prompt, args.max_prompt, args.seed + 10_000)
    lens = [len(p) for p in prompts]

    import ray
    port = free_port()
    base = f"http://127.0.0.1:{port}{ROUTE}"
    rows = []
    with local_serve(port):
        for mode in args.modes:
            print(f"[{mode}] deploying ...", file=sys.stderr, flush=True)
            try:
                rows.append(run_mode(mode, args, base, warm_prompts, prompts))
            except Exception as exc:   # noqa: BLE001 - the mode failed as a whole: every request counts as failed
                print(f"[{mode}] failed: {exc!r}", file=sys.stderr, flush=True)
                failed = [{"ok": False, "error": f"mode failed: {exc!r}"[:300], "prompt_tokens": len(p),
                           "ttft": None, "tpot": None, "e2e": None, "output_tokens": 0, "cached_tokens": 0,
                           "text": ""} for p in prompts]
                rows.append(summarize(mode, failed, 0.0, None, [], {}))
            r = rows[-1]
            print(f"[{mode}] done: {r['ok']}/{r['requests']} ok in {r['wall_s']:.1f} s", file=sys.stderr, flush=True)

    import torch
    print()
    print(f"pdserve service benchmark — {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}, "
          f"commit {commit}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
          f"torch {torch.__version__}, ray {ray.__version__}; everything (client, router, replicas) on this host")
    print(f"model: {Path(args.model).name}, fp32, CPU, {args.threads} torch thread(s) per replica, "
          f"KV pool {args.kv_cache_memory} per replica")
    print(f"load: {args.requests} requests, closed loop, concurrency {args.concurrency}; prompts of random token "
          f"ids, {min(lens)}..{max(lens)} tokens (mean {np.mean(lens):.0f}, total {sum(lens)}, seed {args.seed}); "
          f"output {args.output_len} tokens each (ignore_eos, temperature 0, streaming); "
          f"{args.warmup} warm-up request(s) per mode excluded; modes run one at a time")
    print()
    print(table(rows))
    print()
    for r in rows:
        c = r["server_counters"]
        extra = ""
        if r["mode"] == "disaggregated":
            sent = sum(v for k, v in c.items() if k.startswith("pdserve_kv_transfers_sent"))
            landed = sum(v for k, v in c.items() if k.startswith("pdserve_kv_transfers_landed"))
            extra = f", KV transfers sent/landed {sent:.0f}/{landed:.0f}"
        print(f"- {r['mode']}: startup to healthy {fmt(r['startup_s'], 1, 1)} s, measured wall {r['wall_s']:.1f} s, "
              f"{r['output_tokens']} output tokens, cached prompt tokens {r['cached_prompt_tokens']}, "
              f"router outcomes ok/error/aborted {c.get('pdserve_requests_total[ok]', 0):.0f}/"
              f"{c.get('pdserve_requests_total[error]', 0):.0f}/{c.get('pdserve_requests_total[aborted]', 0):.0f}"
              f"{extra}" + (f"; host 1-min load average before deploy {r['loadavg_1m_before']:.1f}"
                            if "loadavg_1m_before" in r else "")
              + (f"; warm-up failures: {r['warmup_failed']}" if r["warmup_failed"] else ""))
        for e, n in Counter(r["errors"]).most_common(5):
            print(f"    failed ({n}x): {e}")
    if len(rows) == 2 and all(r["ok"] == r["requests"] for r in rows):
        same = sum(a["text"] == b["text"] for a, b in zip(rows[0]["per_request"], rows[1]["per_request"]))
        print(f"- greedy output text identical across modes: {same}/{args.requests} requests")
    print(f"- compute: disaggregated = 2 engine processes x {args.threads} torch thread(s), colocated = 1 x "
          f"{args.threads}; client, proxy and router share the same {os.cpu_count()} cores (see the docstring)")
    print("- TTFT: first SSE chunk with text; TPOT: (end - first token) / (output tokens - 1); "
          "E2E: send to [DONE]; p99 of "
          f"{args.requests} samples is interpolated between the two slowest; tok/s and req/s: successful "
          "requests / wall time of the measured loop")

    if args.json:
        out = {"command": cmd, "config": {k: v for k, v in vars(args).items()}, "prompt_lengths": lens,
               "git_commit": commit, "cpu_count": os.cpu_count(), "results": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"- JSON written to {args.json}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
