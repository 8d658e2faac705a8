"""Prefill time: N prompts of L random tokens, one output token each (`max_tokens=1`), through
`LLMEngine.step()` until done, so the time is the prompts' forward passes (in chunks of
`--chunk` tokens) and one sampled token. Prints the minimum and median over the repeats.

  .venv/bin/python benchmarks/prefill_bench.py [--format bf16] [--tokens 2000] [--prompts 1]
      [--threads 1] [--chunk 2048] [--repeats 3]

For an A/B of two commits, run it in a worktree of each, alternating (the engine and its kernels
come from the working directory; each checkout path builds its kernels under a name of its own).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine_bench import DEFAULT_MODEL, FORMATS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--format", default="bf16", choices=sorted(FORMATS))
    ap.add_argument("--tokens", type=int, default=2000, help="tokens per prompt")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (the prefill chunk)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    dtype, quant = FORMATS[args.format]
    model = args.model if Path(args.model).exists() else str(ROOT / args.model)     # the default: under the repo
    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype=dtype, quantization=quant, num_threads=args.threads,
                                    max_num_batched_tokens=args.chunk, kv_cache_memory="1GiB"))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    times = []
    for rep in range(args.repeats + 1):                 # the first run warms up, untimed
        prompts = [torch.randint(100, 40000, (args.tokens,), generator=g).tolist() for _ in range(args.prompts)]
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"{rep}-{i}", p, params)
        while engine.has_work():
            engine.step()
        if rep:
            times.append(time.perf_counter() - t0)
    print(f"{args.format}, {args.prompts} x {args.tokens} tokens, chunks of {args.chunk}, {args.threads} thread(s): "
          f"min {min(times) * 1e3:.1f} ms, median {statistics.median(times) * 1e3:.1f} ms over {args.repeats}")


if __name__ == "__main__":
    main()
