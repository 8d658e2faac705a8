"""How much a busy event loop in the same process slows the engine's decode steps (the GIL).

    .venv/bin/python benchmarks/gil_contention.py [--model DIR] [--tokens 64] [--repeat 2]

A replica runs its engine on a thread (engine/async_engine.py) beside the asyncio loop that serves
Serve's calls. Every torch op of a step releases the GIL while it computes and takes it back after;
when the loop's thread holds it (Ray callbacks, msgpack, other requests' Python), the engine waits.
This prints the single-stream decode time per token (bf16 or the CPU default, one thread):
  1. `LLMEngine.step()` in a plain loop (no other thread);
  2. the same request through `AsyncEngine.stream` with the consuming event loop idle between tokens;
  3. the same with the event loop never idle (a task that yields to it continuously): the worst case
     of a busy replica, where the engine's steps stretch.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / ".cache/models/SmolLM2-135M-Instruct"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    import torch

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    torch.set_num_threads(1)
    eng = LLMEngine(EngineConfig(model=args.model, num_threads=1, kv_cache_memory="256MiB"))
    prompt = list(range(1000, 1128))
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    rows: dict[str, list[float]] = {"plain step loop": [], "AsyncEngine, loop idle": [], "AsyncEngine, loop busy": []}
    for rep in range(args.repeat):
        eng.add_request(f"plain{rep}", prompt, params)
        ts = []
        while eng.has_work():
            t0 = time.perf_counter()
            eng.step()
            ts.append(time.perf_counter() - t0)
        rows["plain step loop"].append(statistics.median(ts[2:]) * 1e3)
    ae = AsyncEngine(lambda: eng)

    async def stream(rid: str, busy: bool) -> float:
        stop = False

        async def spin():
            while not stop:
                await asyncio.sleep(0)
        spinner = asyncio.ensure_future(spin()) if busy else None
        times = [time.perf_counter() async for _ in ae.stream(rid, lambda e: e.add_request(rid, prompt, params))]
        stop = True
        if spinner is not None:
            await spinner
        return statistics.median(b - a for a, b in zip(times[2:], times[3:])) * 1e3
    for rep in range(args.repeat):
        for busy in (False, True):
            key = f"AsyncEngine, loop {'busy' if busy else 'idle'}"
            rows[key].append(asyncio.run(stream(f"{key}{rep}", busy)))
    ae.shutdown()
    print(f"$ {' '.join([Path(sys.executable).name, *sys.argv])}\n")
    print(f"| single-stream decode, {eng.runner.weight_format}, 1 thread | ms per token (median of each run) |")
    print("|---|---|")
    for key, values in rows.items():
        print(f"| {key} | {' / '.join(f'{v:.1f}' for v in values)} |")
    import os
    print(f"\n(1-minute load average at end {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
