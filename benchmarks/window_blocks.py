"""What giving back the blocks a sliding window passed saves: a model windowed on every layer, its
blocks held and the preemptions a small pool forces, with and without it.

    .venv/bin/python benchmarks/window_blocks.py [--window 16] [--prompts 8] [--prompt-len 40] [--output-len 120]

A tiny random Mistral (tests/tiny_models.py: 2 layers, blocks of 4 tokens, fp32) with a sliding window
of `--window` keys on every layer runs `--prompts` greedy requests at once in one engine, for each
pool size (in blocks); then again with the engine's window set to 0, as before session 44 (every block
kept to the end). Prints the blocks in use at the fullest step, the preemptions (recompute), the
steps, and whether both runs gave the same tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

BLOCK = 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--output-len", type=int, default=120)
    ap.add_argument("--pools", default="48,96,1024", help="pool sizes, in blocks of 4 tokens")
    args = ap.parse_args()
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from tiny_models import tiny_model_dir

    path = tiny_model_dir(Path(tempfile.mkdtemp()) / "mistral", "mistral", seed=5)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sliding_window"] = args.window
    (path / "config.json").write_text(json.dumps(cfg))
    prompts = [[(7 * i + j) % 200 + 3 for j in range(args.prompt_len)] for i in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    kv_per_block = 2 * 2 * 2 * 16 * 4 * BLOCK          # layers, K and V, kv heads, head size, fp32, tokens
    for blocks in (int(b) for b in args.pools.split(",")):
        runs = {}
        for release in (True, False):
            eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=BLOCK,
                                         kv_cache_memory=str(blocks * kv_per_block), max_num_batched_tokens=64))
            assert eng.block_manager.num_blocks == blocks and eng.block_manager.window == args.window
            if not release:
                eng.block_manager.window = 0
            for i, prompt in enumerate(prompts):
                eng.add_request(str(i), prompt, params)
            tokens, peak, steps, start = {}, 0, 0, time.perf_counter()
            while eng.has_work():
                for out in eng.step():
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                steps += 1
                peak = max(peak, eng.block_manager.num_blocks - eng.block_manager.num_free_blocks)
            runs[release] = tokens
            print(f"pool {blocks:5d} blocks, {'given back' if release else 'kept     '}: fullest step {peak:4d} "
                  f"blocks in use, {eng.scheduler.num_preemptions:3d} preemptions, {steps:4d} steps, "
                  f"{time.perf_counter() - start:.2f} s")
        print(f"  same tokens: {runs[True] == runs[False]}")


if __name__ == "__main__":
    main()
