"""/v1/embeddings under load: inputs a second and tokens a second of a running server, and with
`--compare URL` of a second one (alternated round by round on the same inputs), plus how alike
the two servers' vectors are (cosine similarity of each input's pair).

  .venv/bin/python benchmarks/embed_bench.py --url URL [--compare URL2] [--inputs 64] [--words 96]
      [--batch 8] [--concurrency 2] [--rounds 3] [--seed N]

Each round sends `--inputs` distinct texts of about `--words` words (~1 token a word with
SmolLM2's tokenizer), `--batch` to a request, `--concurrency` requests at once; fresh texts every
round (drawn from `--seed`, by default a new one each run), so no prefix cache serves a repeat.
llama.cpp's server answers /v1/embeddings when started with `--embedding --pooling last`
(pdserve's default pooling for a model without sentence-transformers files). Prints per server:
inputs/s, prompt tokens/s (`usage`), request latency p50 / p90.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community "
         "name president team minute idea kid body information back parent face others level office door health "
         "person art war history party result change morning reason research girl guy moment air teacher force").split()


def texts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + "." for _ in range(n)]


def post(url: str, body: dict, path: str = "/v1/embeddings") -> tuple[dict, float]:
    """The answer to `body` at `path` and how long it took."""
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        out = json.loads(resp.read())
    return out, time.perf_counter() - start


def quantile(ordered: list[float], q: float) -> float:
    """The value at quantile `q` of ascending `ordered` (the nearest rank; two values: p90 the larger)."""
    return ordered[round(q * (len(ordered) - 1))]


def round_trip(url: str, inputs: list[str], batch: int, concurrency: int) -> dict:
    """Every input embedded, `batch` a request, `concurrency` requests at once."""
    batches = [inputs[i:i + batch] for i in range(0, len(inputs), batch)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda b: post(url, {"input": b, "encoding_format": "float"}), batches))
    wall = time.perf_counter() - start
    vectors = [d["embedding"] for out, _ in results for d in sorted(out["data"], key=lambda d: d["index"])]
    tokens = sum(out["usage"]["prompt_tokens"] for out, _ in results)
    return {"wall": wall, "latencies": [s for _, s in results], "tokens": tokens, "vectors": vectors}


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--compare")
    ap.add_argument("--inputs", type=int, default=64)
    ap.add_argument("--words", type=int, default=96)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=None, help="the texts' (default: a new one each run)")
    args = ap.parse_args()
    seed = random.randrange(2**32) if args.seed is None else args.seed
    urls = [args.url] + ([args.compare] if args.compare else [])
    for url in urls:                                   # warm-up: first requests pay one-time costs
        round_trip(url, texts(args.batch, args.words, seed - 1), args.batch, 1)
    runs = {url: [] for url in urls}
    similarity = []
    for r in range(args.rounds):
        inputs = texts(args.inputs, args.words, seed + r)
        got = {url: round_trip(url, inputs, args.batch, args.concurrency) for url in urls}
        for url in urls:
            runs[url].append(got[url])
        if args.compare:
            similarity += [cosine(a, b) for a, b in zip(got[args.url]["vectors"], got[args.compare]["vectors"])]
    print(f"{args.inputs} inputs of ~{args.words} words a round, {args.batch} a request, {args.concurrency} at once, "
          f"{args.rounds} rounds")
    for url in urls:
        wall = sum(x["wall"] for x in runs[url])
        tokens = sum(x["tokens"] for x in runs[url])
        lat = sorted(s for x in runs[url] for s in x["latencies"])
        print(f"{url}: {args.inputs * args.rounds / wall:.1f} inputs/s, {tokens / wall:.0f} prompt tokens/s "
              f"({tokens // (args.inputs * args.rounds)} a input), request p50 {statistics.median(lat) * 1000:.0f} "
              f"ms, p90 {quantile(lat, 0.9) * 1000:.0f} ms")
    if similarity:
        print(f"cosine similarity of the two servers' vectors: min {min(similarity):.4f}, "
              f"mean {statistics.fmean(similarity):.4f}")


if __name__ == "__main__":
    main()
