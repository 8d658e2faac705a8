"""How much two engines on one host slow each other's steps, each on its own core.

    .venv/bin/python benchmarks/core_interference.py [--model DIR] [--batch 4] [--seconds 8] [--json F]

`make serve` runs a prefill and a decode engine (one torch thread each) on the same host. With a core
each they still share the memory bus and the last-level cache (and, in a VM, maybe one physical core),
so a decode step that runs while a prefill step runs takes longer than alone. This measures it with
the real engine and model in two processes:
  1. decode alone: `--batch` sequences decoding, median step time;
  2. prefill alone: 256-token prompts back to back (max_tokens 1), median step time;
  3. both at once: the same two loops in parallel.
It prints each step's slowdown (both / alone); `pdserve simulate --host-interference` takes them
(pdserve/plan/sim_host.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _engine(model: str):
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    torch.set_num_threads(1)
    return LLMEngine(EngineConfig(model=model, num_threads=1, kv_cache_memory="512MiB",
                                  enable_prefix_caching=False))


def _loop(kind: str, model: str, batch: int, seconds: float, start, out) -> None:
    """One engine's steps for `seconds` after `start` is set: decode at `batch`, or prefills."""
    import random

    from engine.sampling_params import SamplingParams
    eng = _engine(model)
    rng = random.Random(kind)
    prompt = (lambda n: [rng.randrange(100, 30000) for _ in range(n)])
    n = 0

    def add():
        nonlocal n
        n += 1
        if kind == "decode":
            eng.add_request(f"d{n}", prompt(256), SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True))
        else:
            eng.add_request(f"p{n}", prompt(256), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    for _ in range(batch if kind == "decode" else 1):
        add()
    if kind == "decode":
        for _ in range(batch + 4):     # the prompts (chunked) and a few warm steps
            eng.step()
    else:
        eng.step()
        add()
    start.wait()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
        if kind == "prefill":
            add()
    out.put((kind, statistics.median(times[1:]), len(times)))


def run(kinds: list[str], args) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_loop, args=(k, args.model, args.batch, args.seconds, start, out)) for k in kinds]
    for p in procs:
        p.start()
    time.sleep(args.load_s)           # both engines loaded before the clock starts
    start.set()
    got = {}
    for _ in procs:
        kind, median, steps = out.get()
        got[kind] = median
    for p in procs:
        p.join()
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / ".cache/models/SmolLM2-135M-Instruct"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--load-s", type=float, default=25.0, help="time to let the engines load before measuring")
    ap.add_argument("--json")
    args = ap.parse_args()
    alone = {**run(["decode"], args), **run(["prefill"], args)}
    both = run(["decode", "prefill"], args)
    res = {k: {"alone_ms": alone[k] * 1e3, "both_ms": both[k] * 1e3, "slowdown": both[k] / alone[k]}
           for k in ("decode", "prefill")}
    for k, v in res.items():
        print(f"{k:<8} step alone {v['alone_ms']:.1f} ms, beside the other engine {v['both_ms']:.1f} ms: "
              f"x{v['slowdown']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **res}, indent=1))


if __name__ == "__main__":
    main()
