"""The sampler's time per step by batch size and sampling parameters (random logits of the default
model's vocabulary), and with `--model DIR` the engine's decode throughput with them.

`--baseline FILE`: another engine/sampler.py (say `git show REV:engine/sampler.py > /tmp/old.py`)
measured beside this one in the same run, for a before/after comparison on one host.

    .venv/bin/python benchmarks/sampler_bench.py --baseline /tmp/old.py --model .cache/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import sampler  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

CASES = {"greedy": dict(temperature=0.0), "T=1": dict(temperature=1.0),
         "T=0.7 top_p=0.9": dict(temperature=0.7, top_p=0.9), "T=0.7 top_k=50": dict(temperature=0.7, top_k=50)}
# the sampler alone, also on rows of -inf but a few tokens (a grammar's mask, as structured output leaves them)
MASKED = {"top_p=0.9, 10 ok": (dict(temperature=0.7, top_p=0.9), 10), "T=1, 10 ok": (dict(temperature=1.0), 10)}


def load(path: Path):
    spec = importlib.util.spec_from_file_location("baseline_sampler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module            # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def sampler_ms(module, params: SamplingParams, batch: int, vocab: int, repeats: int,
               allowed: int | None = None) -> float:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=g) * 4
    if allowed is not None:           # -inf but `allowed` random tokens a row
        keep = torch.rand(batch, vocab, generator=g).argsort(dim=-1)[:, :allowed]
        logits = torch.full_like(logits, float("-inf")).scatter(1, keep, logits.gather(1, keep))
    rows = [module.SampleRow(params, module.make_generator(i, torch.device("cpu")), []) for i in range(batch)]
    for _ in range(3):
        module.sample(logits.clone(), rows)
    best = float("inf")
    for _ in range(repeats):
        x = logits.clone()
        t = time.perf_counter()
        module.sample(x, rows)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def engine_tok_s(model: str, modules: dict, batches: list[int], threads: int) -> None:
    import engine.llm_engine as llm_engine
    from engine.config import EngineConfig
    eng = llm_engine.LLMEngine(EngineConfig(model=model, device="cpu", kv_cache_memory="512MiB", num_threads=threads))
    prompts = [[1, 504, 3127, 314, 4110, 30 + i, 2, 198] * 4 for i in range(max(batches))]
    print(f"\nengine decode, {model}, {threads} threads, 48 tokens a request (tok/s):")
    for batch in batches:
        for name, kw in CASES.items():
            params = SamplingParams(**kw, max_tokens=48, ignore_eos=True, seed=1 if kw["temperature"] else None)
            line = []
            for label, module in modules.items():
                llm_engine.sample, llm_engine.SampleRow = module.sample, module.SampleRow
                eng.generate(prompts[:batch], params)
                t = time.perf_counter()
                eng.generate(prompts[:batch], params)
                line.append(f"{label} {batch * 48 / (time.perf_counter() - t):6.0f}")
            print(f"  batch {batch:3d} {name:16s} " + "   ".join(line))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--baseline", type=Path, help="another engine/sampler.py to measure beside this one")
    p.add_argument("--model", help="also the engine's decode tok/s with each case (a model directory)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    modules = {"this": sampler} if args.baseline is None else {"baseline": load(args.baseline), "this": sampler}
    print(f"sampler step, vocabulary {args.vocab}, {args.threads} thread(s), best of {args.repeats} (ms):")
    for batch in batches:
        for name, (kw, allowed) in {**{k: (v, None) for k, v in CASES.items()}, **MASKED}.items():
            times = {label: sampler_ms(m, SamplingParams(**kw), batch, args.vocab, args.repeats, allowed)
                     for label, m in modules.items()}
            ratio = f"  ({times['baseline'] / times['this']:.1f}x)" if "baseline" in times else ""
            print(f"  batch {batch:3d} {name:16s} " + "   ".join(f"{k} {v:7.2f}" for k, v in times.items()) + ratio)
    if args.model:
        engine_tok_s(args.model, modules, [b for b in batches if b <= 32], max(args.threads, 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
