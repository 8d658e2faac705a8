"""What templating and tokenizing a long chat costs the router's event loop: a ticker task sleeps
1 ms at a time (as the streams of other requests wait for their next chunk) while a conversation
of `--turns` turns goes through `chat_prompt_ids` on the loop and then in a worker thread (what
router/app.py does; the tokenizers' encode releases the GIL). Prints the time per call and the
ticker's longest gap and p99 gap each way.

    .venv/bin/python benchmarks/tokenize_stall_bench.py [--turns 80] [--calls 5]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from transformers import AutoTokenizer

from router.chat_prompt import chat_prompt_ids
from router.chat_protocol import ChatCompletionRequest
from serving.models import DEFAULT_MODEL_ID, resolve_model

TURN = "The quick brown fox jumps over the lazy dog near the river bank, and then it runs away. " * 10


async def _ticker(stop: asyncio.Event, gaps: list[float]) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


async def _run(tokenizer, body, calls: int, in_thread: bool) -> list[float]:
    stop, gaps = asyncio.Event(), []
    ticker = asyncio.create_task(_ticker(stop, gaps))
    await asyncio.sleep(0.05)
    for _ in range(calls):
        if in_thread:
            await asyncio.to_thread(chat_prompt_ids, tokenizer, body, False)
        else:
            chat_prompt_ids(tokenizer, body, False)
        await asyncio.sleep(0.01)
    stop.set()
    await ticker
    return sorted(gaps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a local model directory (default: the default model)")
    p.add_argument("--model-cache", default=".cache/models")
    p.add_argument("--turns", type=int, default=80)
    p.add_argument("--calls", type=int, default=5)
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model or resolve_model(DEFAULT_MODEL_ID, args.model_cache,
                                                                          progress=False))
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": TURN} for i in range(args.turns)]
    body = ChatCompletionRequest.model_validate({"messages": messages})
    ids = chat_prompt_ids(tokenizer, body, False)
    times = []
    for _ in range(args.calls):
        start = time.perf_counter()
        chat_prompt_ids(tokenizer, body, False)
        times.append(time.perf_counter() - start)
    print(f"{args.turns} turns, {len(ids)} tokens: chat_prompt_ids {1000 * min(times):.1f} ms "
          f"(min of {args.calls})")
    for in_thread in (False, True):
        gaps = asyncio.run(_run(tokenizer, body, args.calls, in_thread))
        print(f"{'in a worker thread' if in_thread else 'on the event loop':>20}: the loop's longest gap "
              f"{1000 * gaps[-1]:.1f} ms, p99 {1000 * gaps[int(0.99 * len(gaps))]:.1f} ms "
              f"({len(gaps)} ticks of 1 ms)")


if __name__ == "__main__":
    main()
