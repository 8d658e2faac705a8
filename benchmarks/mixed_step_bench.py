#!/usr/bin/env python
"""What a prompt chunk costs a decode step: one engine decoding a batch, its step time alone and with
one new prompt of N tokens in the same step (what a decode replica's steps carry when it prefills a
conversation's next turn itself, `routing.local_prefill_tokens`).

One engine (default model, `--dtype`, `--threads` torch threads) decodes `--batch` greedy sequences
of `--context` random prompt tokens; after a warm-up, each chunk size runs `--rounds` times: a
one-token request of N random tokens added, the step that prefills it timed, then `--rounds` pure
decode steps timed beside it. Prints the median of each.

    python benchmarks/mixed_step_bench.py [--dtype bfloat16] [--threads 1] [--batch 8] [--context 150] \
        [--chunks 16,32,64,128,256] [--rounds 3] [--model DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_MODEL = str(Path(__file__).resolve().parents[1] / ".cache" / "models" / "SmolLM2-135M-Instruct")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=150)
    p.add_argument("--chunks", default="16,32,64,128,256")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    args.chunks = [int(c) for c in args.chunks.split(",")]
    if min(args.threads, args.batch, args.context, args.rounds, *args.chunks) < 1:
        p.error("every count must be >= 1")
    if not Path(args.model).is_dir():
        p.error(f"--model {args.model}: not a directory (prepare it with `make model`)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device="cpu", kv_cache_memory="512MiB",
                                    num_threads=args.threads))
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 30000) for _ in range(n)]

    steps = 30 + len(args.chunks) * args.rounds * (args.rounds + 1) + 8
    for i in range(args.batch):
        engine.add_request(f"r{i}", prompt(args.context), SamplingParams(max_tokens=steps, ignore_eos=True,
                                                                           temperature=0))
    for _ in range(30):                      # every prompt prefilled, the kernels warm
        engine.step()

    def timed_step() -> float:
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    print(f"$ {' '.join(sys.argv)}")
    print(f"{Path(args.model).name} {args.dtype}, {args.threads} thread(s), batch {args.batch} decoding at "
          f"~{args.context + 30} tokens; medians of {args.rounds}")
    print("| prompt tokens in the step | step with them (ms) | decode step alone (ms) | added (ms) |")
    print("|---:|---:|---:|---:|")
    for n in args.chunks:
        mixed, alone = [], []
        for r in range(args.rounds):
            engine.add_request(f"x{n}-{r}", prompt(n), SamplingParams(max_tokens=1, temperature=0))
            mixed.append(timed_step())
            alone += [timed_step() for _ in range(args.rounds)]
        m, a = statistics.median(mixed) * 1e3, statistics.median(alone) * 1e3
        print(f"| {n} | {m:.1f} | {a:.1f} | {m - a:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
