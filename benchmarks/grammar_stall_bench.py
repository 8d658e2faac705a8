"""What compiling a request's grammar costs the requests already decoding: B plain streams decode
through one `AsyncEngine` while structured-output requests with new grammars (a forced call over
N tools, each a new tool set: a cache miss) arrive; the same run with the grammars compiled where
admission compiles them (on the engine thread), ahead on the grammar thread
(`AsyncEngine.prepare`, as the replicas do), with one tool set every request sends (an agent's
next turns: compiled before the run, each request copies it), and with the same requests without
a grammar (the reference: what their prompts' prefill alone costs the streams), alternated.

  .venv/bin/python benchmarks/grammar_stall_bench.py [--format bf16] [--threads 2] [--streams 8]
      [--tools 32] [--arrivals 6] [--gap-ms 300] [--repeats 2]

Prints, per mode, the plain streams' time between tokens (p50, p99, max: a compile on the engine
thread shows as a gap), their tokens per second, and the structured requests' time to their first
token (the reference's: the plain requests'). The engine's tokenizer view for grammars is built
before the runs (once per replica).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from engine.async_engine import AsyncEngine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.structured_output import StructuredOutput  # noqa: E402
from engine_bench import DEFAULT_MODEL, FORMATS  # noqa: E402


def tool_set(nonce: str, n: int) -> StructuredOutput:
    """A forced call of one of `n` tools, as router/tools.py writes it (8 arguments each)."""
    kinds = ({"type": "string"}, {"type": "integer"}, {"enum": ["a", "b", "c"]},
             {"type": "array", "items": {"type": "string"}})
    functions = " | ".join(f"f{i}" for i in range(n))
    lines = ["%llguidance {}", "start: call", f'call: "<tool_call>" ({functions}) "</tool_call>"']
    for i in range(n):
        schema = {"type": "object", "required": ["p0", "p1"],
                  "properties": {f"p{j}": kinds[j % 4] for j in range(8)},
                  "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
        head = json.dumps(f'{{"name": "tool_{nonce}_{i}", "arguments": ')
        lines += [f'f{i}: {head} a{i} "}}"', f"a{i}: %json {json.dumps(schema)}"]
    return StructuredOutput("lark", "\n".join(lines))


async def run(aengine: AsyncEngine, args, prompt: list[int], mode: str, nonce: str) -> dict:
    plain = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    gaps: list[float] = []
    tokens = 0

    async def stream(rid: str) -> None:
        nonlocal tokens
        last = None
        async for out in aengine.stream(rid, lambda e: e.add_request(rid, prompt, plain)):
            now = time.perf_counter()
            if last is not None and out.new_token_ids:
                gaps.extend([(now - last) / len(out.new_token_ids)] * len(out.new_token_ids))
            tokens += len(out.new_token_ids)
            last = now

    def params_of(k: int) -> SamplingParams:
        tools = None if mode == "none" else tool_set(nonce if mode == "cached" else f"{nonce}{k}", args.tools)
        return SamplingParams(temperature=0.8, seed=k, max_tokens=8, structured=tools)

    async def structured(k: int) -> float:
        rid = f"s{nonce}-{k}"
        params = params_of(k)
        t0 = time.perf_counter()
        if mode == "ahead":
            await aengine.prepare(params)
        async for _ in aengine.stream(rid, lambda e: e.add_request(rid, prompt, params)):
            return time.perf_counter() - t0
        return float("nan")

    async def arrivals() -> list[float]:
        await asyncio.sleep(args.gap_ms / 1000)
        tasks = []
        for k in range(args.arrivals):
            tasks.append(asyncio.ensure_future(structured(k)))
            await asyncio.sleep(args.gap_ms / 1000)
        return await asyncio.gather(*tasks)

    if mode == "cached":
        await aengine.prepare(params_of(0))
    t0 = time.perf_counter()
    streams = [asyncio.ensure_future(stream(f"p{nonce}-{i}")) for i in range(args.streams)]
    ttfts = await arrivals()
    await asyncio.gather(*streams)
    wall = time.perf_counter() - t0
    gaps.sort()
    return {"p50": statistics.median(gaps) * 1e3, "p99": gaps[int(0.99 * (len(gaps) - 1))] * 1e3,
            "max": gaps[-1] * 1e3, "tok/s": tokens / wall, "ttft": statistics.median(ttfts) * 1e3}


MODES = {"none": "no grammar (reference)", "admission": "compiled at admission (engine thread)",
         "ahead": "compiled ahead (grammar thread)", "cached": "the same tools each time (cached)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--format", default="bf16", choices=sorted(FORMATS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=160, help="output tokens of each plain stream")
    ap.add_argument("--tools", type=int, default=32)
    ap.add_argument("--arrivals", type=int, default=6, help="structured requests during a run")
    ap.add_argument("--gap-ms", type=float, default=300, help="between structured arrivals")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    dtype, quant = FORMATS[args.format]
    model = args.model if Path(args.model).exists() else str(ROOT / args.model)
    aengine = AsyncEngine(lambda: LLMEngine(EngineConfig(model=model, device="cpu", dtype=dtype, quantization=quant,
                                                         num_threads=args.threads, kv_cache_memory="512MiB")))
    prompt = aengine.engine.tokenizer.encode("Write a long story about a dragon who learns to fly. " * 3)
    asyncio.run(aengine.prepare(SamplingParams(structured=StructuredOutput("json_object"))))  # the tokenizer view
    asyncio.run(run(aengine, argparse.Namespace(**{**vars(args), "arrivals": 1, "tokens": 16}), prompt, "ahead", "warm"))
    print(f"{args.format}, {args.threads} thread(s): {args.streams} plain streams of {args.tokens} tokens; "
          f"{args.arrivals} forced calls over {args.tools} new tools, one every {args.gap_ms:.0f} ms")
    for rep in range(args.repeats):
        for mode, name in MODES.items():
            r = asyncio.run(run(aengine, args, prompt, mode, f"{rep}{mode}"))
            print(f"  {name:38} between tokens p50 {r['p50']:6.1f} ms, p99 {r['p99']:6.1f} ms, "
                  f"max {r['max']:6.1f} ms; plain {r['tok/s']:6.1f} tok/s; structured TTFT p50 {r['ttft']:6.1f} ms")
    aengine.shutdown()


if __name__ == "__main__":
    main()
