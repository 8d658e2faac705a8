"""What a stored response costs a Responses API request, against a running server.

    .venv/bin/pdserve serve --port PORT &     (wait for "pdserve is up")
    .venv/bin/python benchmarks/response_store_bench.py --url http://127.0.0.1:PORT [--requests 30]

Alternates, `--requests` times each, non-streamed one-token responses (so the store's calls are a
visible share): `store` (kept: one call to the ResponseStore before the answer), `no store`
(`store: false`), `chained` (`previous_response_id` of a 64-token answer: a lookup and a save) and
its stateless `twin` (the same conversation sent whole, `store: false`); prints each one's p50 and
p90 latency, then GET /v1/responses/{id} and GET /v1/models (the HTTP path alone) per call.
Then `--streams` times each, alternated, a streamed response of 128 greedy tokens in the foreground
and in the background (its events through the router's writer, sent to the store): the time to its
first text and to its last event, and how long reading all its events again takes (GET
?stream=true, from the store).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request

MODEL = "SmolLM2-135M-Instruct"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--streams", type=int, default=4)
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
    streams(args.url, args.streams)


def _events(request: urllib.request.Request) -> tuple[list[dict], float, float]:
    """A Responses stream's events, and the seconds to its first text and to its end."""
    start, first, events = time.perf_counter(), None, []
    with urllib.request.urlopen(request) as reply:
        for line in reply:
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
                if first is None and events[-1]["type"] == "response.output_text.delta":
                    first = time.perf_counter() - start
    return events, first or 0.0, time.perf_counter() - start


def streams(url: str, n: int) -> None:
    body = {"model": MODEL, "input": "Write a short poem about the sea.", "max_output_tokens": 128,
            "temperature": 0, "stream": True}
    ends: dict[str, list[tuple[float, float]]] = {"foreground": [], "background": []}
    again = []
    for _ in range(n):
        for kind in ends:
            data = json.dumps({**body, "background": kind == "background"}).encode()
            events, first, end = _events(urllib.request.Request(
                url + "/v1/responses", data, {"Content-Type": "application/json"}))
            ends[kind].append((first, end))
            if kind == "background":
                start = time.perf_counter()
                replay, _, _ = _events(urllib.request.Request(
                    f"{url}/v1/responses/{events[0]['response']['id']}?stream=true"))
                again.append(time.perf_counter() - start)
                assert replay == events, "the events read again differ"
    for kind, runs in ends.items():
        print(f"{kind:10} stream: first text " + ", ".join(f"{f * 1000:.0f}" for f, _ in runs)
              + " ms; last event " + ", ".join(f"{e * 1000:.0f}" for _, e in runs) + " ms")
    print("read again (GET ?stream=true, ended): " + ", ".join(f"{a * 1000:.1f}" for a in again) + " ms")


if __name__ == "__main__":
    main()
