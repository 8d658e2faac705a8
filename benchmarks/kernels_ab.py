"""Whole decode steps with the engine's CPU kernels on and off, interleaved in one process.

  .venv/bin/python benchmarks/kernels_ab.py [bf16|int8|int4] [context tokens, default 128]

One engine (the real model, one torch thread); for batch 1, 8 and 32 it alternates six times
between the kernels (in-place paged attention, one-pass RMSNorm) and the torch ops they replace
(gather + sdpa, aten rms_norm), 5 timed steps each, and prints the medians: alternating keeps a
shared host's drift out of the comparison.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    fmt = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    torch.set_num_threads(1)
    eng = LLMEngine(EngineConfig(model=str(ROOT / ".cache/models/SmolLM2-135M-Instruct"),
                                 quantization=None if fmt == "bf16" else fmt, dtype="bfloat16",
                                 kv_cache_memory="1GiB", num_threads=1))
    runner, model = eng.runner, eng.runner.model
    attention, norms = runner.kernels, model._kernels
    assert attention is not None and norms is not None, "the CPU kernels are not available here"

    def use_kernels(on: bool) -> None:
        runner.kernels = attention if on else None
        model._kernels = norms if on else None

    params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    print(f"{fmt}, context ~{ctx} tokens, 1 thread; median ms per decode step")
    for batch in (1, 8, 32):
        rids = [f"b{batch}-{i}" for i in range(batch)]
        for i, rid in enumerate(rids):
            eng.add_request(rid, [100 + (i * 7 + j) % 5000 for j in range(ctx)], params)
        while len(eng.step()) < batch or eng.scheduler.waiting:
            pass
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(6):
            for on in (False, True):
                use_kernels(on)
                eng.step()
                for _ in range(5):
                    t0 = time.perf_counter()
                    eng.step()
                    times[on].append(time.perf_counter() - t0)
        off, on = (statistics.median(times[k]) * 1e3 for k in (False, True))
        print(f"batch {batch}: torch ops {off:.1f} ms, kernels {on:.1f} ms ({off / on:.2f}x)")
        for rid in rids:
            eng.abort(rid)


if __name__ == "__main__":
    main()
