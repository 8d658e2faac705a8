"""`pdserve run-batch`: an OpenAI batch input file run against a running pdserve (or any
OpenAI-compatible server), and its output file written, as vLLM's `vllm run-batch` and OpenAI's
Batch API take and give them.

  pdserve run-batch -i requests.jsonl -o results.jsonl [--url http://127.0.0.1:8000] [--concurrency 16]

Each input line is a request: {"custom_id": "...", "method": "POST", "url": one of URLS, "body":
{...}}. Each output line, in the input's order: {"id": "batch_req_...", "custom_id": ...,
"response": {"status_code", "request_id", "body"}, "error": null}. A request the server refused
(a 4xx or 5xx) has its answer, OpenAI's error object, as the response's body; a line that is no
request (not JSON, a field missing, another method or URL, `stream: true`: a batch takes whole
answers) and a request that got no answer (the server unreachable, the timeout) have `response`
null and `error` {"code", "message"} instead. Up to `--concurrency` requests are in flight at
once (the server batches them); output lines are written as soon as every line before them is.
Exit status 0 when every line got a 2xx answer, 1 otherwise (the output file is complete either
way); a summary goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import uuid
from typing import Iterable, TextIO

import httpx

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--input", required=True, help="the batch input file (JSONL; - for stdin)")
    p.add_argument("-o", "--output", required=True, help="the output file to write (JSONL; - for stdout)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL, its route prefix "
                   "included (default http://127.0.0.1:8000, `make serve`'s)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at once (default 16)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    p.add_argument("--api-key", default="", help="sent as 'Authorization: Bearer KEY' (the server's api_key)")


def request_of(line: str) -> tuple[str | None, dict | str]:
    """A line's custom_id (None where it has none) and its request (url and body), or why it is none."""
    try:
        item = json.loads(line)
    except ValueError as exc:
        return None, f"not JSON: {exc}"
    if not isinstance(item, dict):
        return None, "not a JSON object"
    custom_id = item.get("custom_id") if isinstance(item.get("custom_id"), str) else None
    if custom_id is None:
        return None, "custom_id (a string) is missing"
    if item.get("method") != "POST":
        return custom_id, f"method must be POST, got {item.get('method')!r}"
    if item.get("url") not in URLS:
        return custom_id, f"url must be one of {', '.join(URLS)}, got {item.get('url')!r}"
    if not isinstance(item.get("body"), dict):
        return custom_id, "body (a JSON object) is missing"
    if item["body"].get("stream"):
        return custom_id, "stream: a batch request is answered whole"
    return custom_id, {"url": item["url"], "body": item["body"]}


def _result(custom_id: str | None, response: dict | None = None, error: str | None = None,
            code: str = "invalid_request") -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
            "error": None if error is None else {"code": code, "message": error}}


async def _answer(client: httpx.AsyncClient, base: str, line: str) -> dict:
    custom_id, request = request_of(line)
    if isinstance(request, str):
        return _result(custom_id, error=request)
    try:
        r = await client.post(base + request["url"], json=request["body"])
    except httpx.HTTPError as exc:
        return _result(custom_id, error=f"no answer: {type(exc).__name__}: {exc}", code="request_failed")
    try:
        body = r.json()
    except ValueError:
        body = {"error": {"message": r.text[:1000], "type": "server_error", "param": None, "code": None}}
    return _result(custom_id, {"status_code": r.status_code, "request_id": r.headers.get("x-request-id", ""),
                               "body": body})


async def run(lines: Iterable[str], base: str, out: TextIO, concurrency: int = 16, timeout: float = 600.0,
              api_key: str = "") -> collections.Counter:
    """Answer every non-blank line, writing each result to `out` in the lines' order; the counts of
    results by kind ("ok": a 2xx answer, "refused": another status, "error": no request or no answer)."""
    counts: collections.Counter = collections.Counter()
    gate = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    def write(result: dict) -> None:
        status = (result["response"] or {}).get("status_code")
        counts["error" if status is None else "ok" if status < 300 else "refused"] += 1
        out.write(json.dumps(result) + "\n")

    async def answer(client, line):
        try:
            return await _answer(client, base.rstrip("/"), line)
        finally:
            gate.release()

    async with httpx.AsyncClient(timeout=timeout, headers=headers, limits=limits) as client:
        pending: collections.deque[asyncio.Task] = collections.deque()
        for line in lines:
            if not line.strip():
                continue
            await gate.acquire()
            pending.append(asyncio.ensure_future(answer(client, line)))
            while pending and pending[0].done():
                write(pending.popleft().result())
        while pending:
            write(await pending.popleft())
    return counts


def main(args: argparse.Namespace) -> int:
    if args.concurrency < 1:
        print("pdserve run-batch: --concurrency must be at least 1", file=sys.stderr)
        return 2
    try:
        src = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    except OSError as exc:
        print(f"pdserve run-batch: cannot read {args.input}: {exc.strerror}", file=sys.stderr)
        return 2
    dst = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")
    try:
        counts = asyncio.run(run(src, args.url, dst, args.concurrency, args.timeout, args.api_key))
    finally:
        for f in (src, dst):
            if f not in (sys.stdin, sys.stdout):
                f.close()
    print(f"pdserve run-batch: {sum(counts.values())} lines: {counts['ok']} answered, {counts['refused']} "
          f"refused by the server, {counts['error']} not run (see each line's error)", file=sys.stderr)
    return 0 if counts["ok"] == sum(counts.values()) else 1
