"""What writing a /v1/embeddings answer's JSON costs the router's event loop: the longest gap a 1 ms
ticker on the loop sees while a worker thread encodes N vectors of D float numbers, as one
`json.dumps` of the whole answer (the encoder holds the GIL for the whole call) against the router's
`router.embeddings_api._answer` (a vector at a time). Both give the same JSON (checked).

  .venv/bin/python benchmarks/embed_stall_bench.py [--vectors 512] [--dims 576] [--repeats 2]
"""

from __future__ import annotations

import argparse
import array
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from router.embeddings_api import _answer  # noqa: E402
from tokenize_stall_bench import _ticker  # noqa: E402  (the same 1 ms ticker)


def whole(vectors: list[bytes], encoding_format: str, model: str, tokens: int) -> bytes:
    data = [{"object": "embedding", "index": i, "embedding": array.array("f", v).tolist()}
            for i, v in enumerate(vectors)]
    return json.dumps({"object": "list", "data": data, "model": model,
                       "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}).encode()


async def longest_gap(fn, vectors: list[bytes]) -> tuple[float, float]:
    """(seconds the encoding took in a worker thread, the loop's longest gap meanwhile)."""
    gaps, done = [], asyncio.Event()
    ticker = asyncio.ensure_future(_ticker(done, gaps))
    await asyncio.sleep(0.05)
    start = time.perf_counter()
    await asyncio.to_thread(fn, vectors, "float", "m", 1)
    took = time.perf_counter() - start
    done.set()
    await ticker
    return took, max(gaps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vectors", type=int, default=512)
    ap.add_argument("--dims", type=int, default=576)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    rng = random.Random(0)
    vectors = [array.array("f", [rng.uniform(-1, 1) for _ in range(args.dims)]).tobytes()
               for _ in range(args.vectors)]
    assert json.loads(_answer(vectors, "float", "m", 1)) == json.loads(whole(vectors, "float", "m", 1))
    for _ in range(args.repeats):
        for name, fn in (("one json.dumps", whole), ("a vector at a time", _answer)):
            took, gap = asyncio.run(longest_gap(fn, vectors))
            print(f"{args.vectors} x {args.dims}, {name}: {took * 1000:.0f} ms in the thread, "
                  f"longest event-loop gap {gap * 1000:.1f} ms")


if __name__ == "__main__":
    main()
