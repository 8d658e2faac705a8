"""/v1/rerank under load: documents a second and prompt tokens a second of a running server.

  .venv/bin/python benchmarks/rerank_bench.py --url URL [--documents 32] [--query-words 48]
      [--words 96] [--concurrency 2] [--requests 8] [--seed N]

Each request reranks `--documents` distinct documents of about `--words` words against a query of
about `--query-words` words (~1 token a word with SmolLM2's tokenizer), `--concurrency` requests at
once, `--requests` in all; every request has its own query and documents (drawn from `--seed`, by
default a new one each run), so only the query repeats within a request (the prefix cache's share).
Prints documents/s, prompt tokens/s (`usage`, the query counted once a document, as computed
without a cache) and request latency p50 / p90.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from embed_bench import post, quantile, texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--documents", type=int, default=32)
    ap.add_argument("--query-words", type=int, default=48)
    ap.add_argument("--words", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    bodies = []
    for i in range(args.requests):
        query = texts(1, args.query_words, seed + 2 * i)[0] + " Is the document below about it? Answer yes or no.\n"
        docs = [d + "\nAnswer:" for d in texts(args.documents, args.words, seed + 2 * i + 1)]
        bodies.append({"query": query, "documents": docs, "return_documents": False})
    post(args.url, {"query": "warm", "documents": ["up"]}, "/v1/rerank")
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(lambda body: post(args.url, body, "/v1/rerank"), bodies))
    wall = time.perf_counter() - start
    assert all(len(out["results"]) == args.documents for out, _ in results)
    tokens = sum(out["usage"]["prompt_tokens"] for out, _ in results)
    latencies = sorted(s for _, s in results)
    print(f"seed {seed}: {args.requests} requests of {args.documents} documents, {args.concurrency} at once")
    print(f"documents/s {args.requests * args.documents / wall:.1f}, prompt tokens/s {tokens / wall:.0f}, "
          f"latency p50 {statistics.median(latencies):.2f} s, p90 {quantile(latencies, 0.9):.2f} s")


if __name__ == "__main__":
    main()
