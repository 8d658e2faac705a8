"""What structured output costs the engine: grammar compile times (done on a replica's grammar
thread, benchmarks/grammar_stall_bench.py), then decode steps of B sampled rows with and without
a JSON schema (the schema holds every row inside one long string, so both runs decode the same
number of tokens), alternated in one run.

  .venv/bin/python benchmarks/structured_bench.py [--format bf16] [--batches 1,8,32] [--threads 1]
      [--tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import llguidance

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.structured_output import GrammarCompiler, StructuredOutput  # noqa: E402
from engine_bench import DEFAULT_MODEL, FORMATS  # noqa: E402

_FIELDS = {f"field_{i}": ({"type": "string", "maxLength": 40}, {"type": "integer", "minimum": 0},
                          {"enum": ["alpha", "beta", "gamma", "delta"]})[i % 3] for i in range(20)}
SPECS = {
    "json_object": StructuredOutput("json_object"),
    "2-field schema": StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]})),
    "20-field nested schema": StructuredOutput("json_schema", json.dumps({"type": "object", "required": list(_FIELDS),
        "properties": {**_FIELDS, "items": {"type": "array", "items": {"type": "object", "properties": _FIELDS}},
                       "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}}})),
    "regex": StructuredOutput("regex", r"(\d{3}-){3}[A-Z][a-z]{2,30}"),
}
LONG_STRING = StructuredOutput("json_schema", json.dumps({"type": "object", "required": ["text"], "properties": {
    "text": {"type": "string", "minLength": 2000}}}))


def compile_times(engine: LLMEngine) -> None:
    """A new grammar's check and compile (best of 3 compilers, each compiling it for the first
    time), and a request's copy of a compiled one (what a replica's engine thread does)."""
    compilers = []
    for _ in range(3):
        t0 = time.perf_counter()
        compilers.append(GrammarCompiler(engine.tokenizer, engine.runner.vocab_size, list(engine.eos_token_ids)))
    print(f"tokenizer view (once per replica): {(time.perf_counter() - t0) * 1e3:.0f} ms")
    for name, spec in SPECS.items():
        best = {"check": 1e9, "compile + first mask": 1e9, "a request's copy": 1e9}
        for compiler in compilers:
            t0 = time.perf_counter()
            assert llguidance.LLMatcher.validate_grammar(spec.grammar()) == ""      # StructuredOutput.problem, uncached
            t1 = time.perf_counter()
            compiler.compile(spec)
            t2 = time.perf_counter()
            compiler.matcher(spec).bitmask()
            t3 = time.perf_counter()
            for key, dt in zip(best, (t1 - t0, t2 - t1, t3 - t2)):
                best[key] = min(best[key], dt)
        print(f"  {name:24}" + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in best.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--format", default="bf16", choices=sorted(FORMATS))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per row")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    dtype, quant = FORMATS[args.format]
    model = args.model if Path(args.model).exists() else str(ROOT / args.model)
    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype=dtype, quantization=quant,
                                    num_threads=args.threads, kv_cache_memory="512MiB"))
    compile_times(engine)
    prompt = engine.tokenizer.encode("Write a long story about a dragon who learns to fly. " * 3)
    runs = {"plain": SamplingParams(temperature=0.8, seed=1, max_tokens=args.tokens, ignore_eos=True),
            "json schema": SamplingParams(temperature=0.8, seed=1, max_tokens=args.tokens, structured=LONG_STRING)}
    engine.generate([prompt], runs["json schema"])          # warm up (the tokenizer view, kernels)
    print(f"decode, {args.format}, {args.threads} thread(s), ms a step (prompt and {args.tokens} steps / {args.tokens}):")
    for batch in (int(b) for b in args.batches.split(",")):
        cells = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, params in runs.items():
                t0 = time.perf_counter()
                outs = engine.generate([prompt] * batch, params)
                cells[name].append((time.perf_counter() - t0) / args.tokens * 1e3)
                assert all(len(o.token_ids) == args.tokens for o in outs), name
        print(f"  batch {batch:3}: " + "; ".join(f"{n} " + " / ".join(f"{v:.2f}" for v in c) for n, c in cells.items()))


if __name__ == "__main__":
    main()
