"""Speculative decoding by prompt lookup: decode time per output token with and without drafts
(`engine.speculative_tokens`), same engine settings, alternated in one run, on prompts that repeat
their context more or less (a text to copy, code to edit, a story, random tokens), at batch 1 and
more. Prints ms per output token, the speed-up and the share of drafts kept.

  .venv/bin/python benchmarks/spec_bench.py [--format bf16] [--threads 1] [--k 4] [--batches 1,4]
      [--tokens 96] [--repeats 2]

With `--url URL` it measures a running server instead (the chat asks, one at a time, streamed,
greedy, `--tokens` at most): TPOT p50 per ask over `--repeats` requests. Run it against the same
server deployed with and without `engine.speculative_tokens` in its decode pool. With `--url URL
--predict`: the asks that have an input to predict from (the text to copy, the code to edit) without
and with it as OpenAI's `prediction` (`engine.prediction_tokens`), alternated on that one server.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine_bench import DEFAULT_MODEL, FORMATS  # noqa: E402

TEXT = ("The committee met on Tuesday to review the budget. After a long discussion, it approved the new "
        "library, postponed the road repairs until spring, and asked the treasurer to publish the accounts "
        "every quarter so that residents can follow how their money is spent.")
CODE = '''def mean(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total = total + (v - m) ** 2
    return total / len(values)
'''
ASKS = {"copy a text": f"Repeat this text exactly:\n\n{TEXT}",
        "edit code": f"Add type hints to this Python code and return the whole code:\n\n{CODE}",
        "a story": "Tell me a story about a dragon who learns to fly."}


def prompts(engine: LLMEngine) -> dict[str, list[int]]:
    out = {}
    for name, ask in ASKS.items():
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True,
                                                   tokenize=True)
        out[name] = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    out["random tokens"] = torch.randint(100, 40000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    return out


def _streamed(url: str, body: dict) -> tuple[float, int, str, dict]:
    """One streamed chat request: its TPOT (ms), output tokens, text and usage."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    arrivals, usage, text = [], None, []
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
                text.append(event["choices"][0]["delta"]["content"])
    n = usage["completion_tokens"]
    return (arrivals[-1] - arrivals[0]) / (n - 1) * 1e3, n, "".join(text), usage


def served(url: str, model: str, tokens: int, repeats: int) -> None:
    print(f"{url}: chat, greedy, at most {tokens} tokens, streamed: TPOT p50 (ms) over {repeats} requests")
    for name, ask in ASKS.items():
        body = {"model": model, "messages": [{"role": "user", "content": ask}], "max_tokens": tokens, "temperature": 0}
        tpots, counts = zip(*[_streamed(url, body)[:2] for _ in range(repeats)])
        print(f"  {name:14} {statistics.median(tpots):.1f} ms ({' / '.join(f'{t:.1f}' for t in tpots)}), "
              f"{statistics.median(counts):.0f} tokens")


PREDICTIONS = {"copy a text": TEXT, "edit code": CODE}    # what the client knows before the answer


def predicted(url: str, model: str, tokens: int, repeats: int) -> None:
    """The asks that have a prediction (the text to copy, the code to edit), without and with it as
    OpenAI's `prediction`, alternated on one server."""
    print(f"{url}: chat, greedy, at most {tokens} tokens, streamed, without / with the input as `prediction`: "
          f"TPOT p50 (ms) over {repeats} requests each")
    for name, prediction in PREDICTIONS.items():
        body = {"model": model, "messages": [{"role": "user", "content": ASKS[name]}], "max_tokens": tokens,
                "temperature": 0}
        runs = {False: [], True: []}
        for _ in range(repeats):
            for guess in (False, True):
                extra = {"prediction": {"type": "content", "content": prediction}} if guess else {}
                runs[guess].append(_streamed(url, {**body, **extra}))
        assert len({text for _, _, text, _ in runs[False] + runs[True]}) == 1, "the outputs differ"
        plain, fast = (statistics.median(t for t, _, _, _ in runs[g]) for g in (False, True))
        details = runs[True][0][3]["completion_tokens_details"]
        print(f"  {name:14} {plain:.1f} -> {fast:.1f} ms, x{plain / fast:.2f} "
              f"({' / '.join(f'{t:.1f}' for t, _, _, _ in runs[False])} -> "
              f"{' / '.join(f'{t:.1f}' for t, _, _, _ in runs[True])}), {runs[True][0][1]} tokens, same output; "
              f"prediction tokens accepted {details['accepted_prediction_tokens']}, "
              f"rejected {details['rejected_prediction_tokens']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--format", default="bf16", choices=sorted(FORMATS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--k", type=int, default=4, help="speculative_tokens")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--tokens", type=int, default=96, help="output tokens (ignore_eos)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--url", help="measure this server instead of two local engines")
    ap.add_argument("--served-model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--predict", action="store_true", help="with --url: the asks without and with their input "
                    "as OpenAI's `prediction` (engine.prediction_tokens)")
    args = ap.parse_args()
    if args.url:
        (predicted if args.predict else served)(args.url.rstrip("/"), args.served_model, args.tokens, args.repeats)
        return
    dtype, quant = FORMATS[args.format]
    model = args.model if Path(args.model).exists() else str(ROOT / args.model)
    engines = {k: LLMEngine(EngineConfig(model=model, device="cpu", dtype=dtype, quantization=quant,
                                         num_threads=args.threads, kv_cache_memory="512MiB", speculative_tokens=k,
                                         enable_prefix_caching=False))
               for k in (0, args.k)}
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    print(f"{args.format}, {args.threads} thread(s), greedy, {args.tokens} output tokens, k = {args.k}: "
          "ms per output token (decode only) without / with drafts, speed-up, drafts kept")
    for name, prompt in prompts(engines[0]).items():
        for batch in (int(b) for b in args.batches.split(",")):
            times = {k: [] for k in engines}
            kept = []
            for _ in range(args.repeats):
                for k, engine in engines.items():
                    engine.generate([prompt] * batch, SamplingParams(temperature=0, max_tokens=1))   # the prefill alone
                    t1 = time.perf_counter()
                    engine.generate([prompt] * batch, SamplingParams(temperature=0, max_tokens=1))
                    prefill = time.perf_counter() - t1
                    drafted, accepted = engine.num_draft_tokens, engine.num_accepted_tokens
                    t0 = time.perf_counter()
                    outs = engine.generate([prompt] * batch, params)
                    decode = time.perf_counter() - t0 - prefill
                    times[k].append(decode / (args.tokens - 1) * 1e3)
                    if k:
                        kept.append((engine.num_accepted_tokens - accepted) / max(engine.num_draft_tokens - drafted, 1))
                    assert all(len(o.token_ids) == args.tokens for o in outs)
            plain, spec = min(times[0]), min(times[args.k])
            print(f"  {name:14} batch {batch}: {' / '.join(f'{t:.1f}' for t in times[0])} -> "
                  f"{' / '.join(f'{t:.1f}' for t in times[args.k])} ms, x{plain / spec:.2f}, "
                  f"kept {100 * sum(kept) / len(kept):.0f} %")


if __name__ == "__main__":
    main()
