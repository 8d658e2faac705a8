"""What a stored response costs a Responses API request, against a running server.

    .venv/bin/pdserve serve --port PORT &     (wait for "pdserve is up")
    .venv/bin/python benchmarks/response_store_bench.py --url http://127.0.0.1:PORT [--requests 30]

Alternates, `--requests` times each, non-streamed one-token responses (so the store's calls are a
visible share): `store` (kept: one call to the ResponseStore before the answer), `no store`
(`store: false`), `chained` (`previous_response_id` of a 64-token answer: a lookup and a save) and
its stateless `twin` (the same conversation sent whole, `store: false`); prints each one's p50 and
p90 latency, then GET /v1/responses/{id} and GET /v1/models (the HTTP path alone) per call.
"""

from __future__ import annotations

import argparse
import statistics
import time
import urllib.request

MODEL = "SmolLM2-135M-Instruct"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--requests", type=int, default=30)
    args = ap.parse_args()
    import openai
    client = openai.OpenAI(base_url=args.url + "/v1", api_key="unused")

    def timed(**fields) -> float:
        start = time.perf_counter()
        client.responses.create(model=MODEL, max_output_tokens=1, temperature=0, **fields)
        return (time.perf_counter() - start) * 1000

    for _ in range(3):
        timed(input="warm up")
    question = "Tell me about Paris in three sentences."
    first = client.responses.create(model=MODEL, input=question, max_output_tokens=64, temperature=0)
    whole = [{"role": "user", "content": question}, *[i.model_dump(exclude_none=True) for i in first.output]]
    times: dict[str, list[float]] = {"store": [], "no store": [], "chained": [], "twin": []}
    for i in range(args.requests):     # every prompt new (no whole-prompt prefix-cache hit), the same length
        times["store"].append(timed(input=f"Hello number {i}a"))
        times["no store"].append(timed(input=f"Hello number {i}b", store=False))
        times["chained"].append(timed(input=f"And number {i}a?", previous_response_id=first.id))
        times["twin"].append(timed(input=[*whole, {"role": "user", "content": f"And number {i}b?"}], store=False))
    for name, values in times.items():
        values.sort()
        print(f"{name:10} p50 {statistics.median(values):6.1f} ms   p90 {values[int(0.9 * len(values))]:6.1f} ms")
    for path in (f"/v1/responses/{first.id}", "/v1/models"):
        start = time.perf_counter()
        for _ in range(50):
            urllib.request.urlopen(args.url + path).read()
        print(f"GET {path}: {(time.perf_counter() - start) * 1000 / 50:.1f} ms a call")


if __name__ == "__main__":
    main()
