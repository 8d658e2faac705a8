"""What a LoRA adapter costs the engine: decode step time at several batch sizes with every row on
the base model, every row on one adapter, and the rows split between two adapters and the base
model, one engine, alternated in one run; a prompt chunk's prefill with and without; and what
loading an adapter at run time costs (the router's check of the directory; a replica's read at the
adapter's first request, ahead on a worker thread, and then its placement on the engine thread,
before the step that starts the request); and what `max_loras` trades (`--queue-adapters`): two
requests for each of that many adapters loaded at run time, queued at once in engines of several
`max_loras`, a smaller one running fewer adapters a step and queueing the rest.
The adapters are random, in PEFT's format, on every attention and MLP projection (`--rank`),
written for the model to a temporary directory.

  .venv/bin/python benchmarks/lora_bench.py [--format bf16] [--threads 2] [--rank 16]
      [--batches 1,8,32] [--steps 16] [--rounds 2] [--prefill 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.lora_config import check_adapter  # noqa: E402
from engine.model_dims import Dims  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine_bench import DEFAULT_MODEL, FORMATS, _drain_until_decoding  # noqa: E402


def random_adapter(path: Path, model_dir: str, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter on every projection of the model at `model_dir` (its config's shapes)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    dims = Dims.of_config(cfg)
    hidden, inter, heads, kv, d = dims.hidden_size, dims.intermediate_size, dims.num_heads, dims.num_kv_heads, \
        dims.head_dim
    shapes = {"self_attn.q_proj": (hidden, heads * d), "self_attn.k_proj": (hidden, kv * d),
              "self_attn.v_proj": (hidden, kv * d), "self_attn.o_proj": (heads * d, hidden),
              "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter), "mlp.down_proj": (inter, hidden)}
    g, tensors = torch.Generator().manual_seed(seed), {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}))
    return path


def decode_ms(eng: LLMEngine, loras: list[str | None], steps: int) -> float:
    """Median decode step (ms) of one request per entry of `loras` (its adapter, or None)."""
    rids = [f"b{len(loras)}-{i}-{time.monotonic_ns()}" for i in range(len(loras))]
    for i, (rid, lora) in enumerate(zip(rids, loras)):
        prompt = [100 + (i * 37 + k * 11) % 20000 for k in range(32)]
        eng.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=steps + 12, ignore_eos=True,
                                                    lora=lora))
    try:
        _drain_until_decoding(eng, rids)
        for _ in range(3):
            eng.step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            assert len(eng.step()) == len(rids)
            times.append(time.perf_counter() - t0)
    finally:
        for rid in rids:
            eng.abort(rid)
    return statistics.median(times) * 1e3


def prefill_ms(eng: LLMEngine, tokens: int, lora: str | None) -> float:
    prompt = [100 + (k * 13) % 20000 for k in range(tokens)]
    params = SamplingParams(temperature=0.0, max_tokens=1, lora=lora)
    t0 = time.perf_counter()
    eng.generate([prompt], params)
    return (time.perf_counter() - t0) * 1e3


def queue_run(args, dtype, quant, paths: list[str], max_loras: int) -> dict:
    """Two requests for each adapter of `paths` (loaded at run time, read ahead as a replica's
    worker thread does) queued at once in an engine of `max_loras`, run to their ends: seconds to the
    last token, each request's seconds to its end (mean), steps, the mean running batch and the
    adapters placed (loads; an adapter evicted and placed again counts again)."""
    eng = LLMEngine(EngineConfig(model=args.model, dtype=dtype, quantization=quant, num_threads=args.threads,
                                 enable_prefix_caching=False, max_loras=max_loras))
    params = [SamplingParams(temperature=0.0, max_tokens=args.queue_tokens, ignore_eos=True, lora=f"q{i}",
                             lora_path=path, lora_id=i + 1) for i, path in enumerate(paths)]
    for r in range(2 * len(paths)):
        eng.prepare(params[r % len(paths)])
        prompt = [100 + (r * 31 + k * 7) % 20000 for k in range(64)]
        assert eng.add_request(f"q{r}", prompt, params[r % len(paths)]) is None
    t0, ends, steps, batch = time.perf_counter(), [], 0, 0
    while eng.has_work():
        ends += [time.perf_counter() - t0 for out in eng.step() if out.finished]
        steps, batch = steps + 1, batch + len(eng.scheduler.running)
    return {"s": time.perf_counter() - t0, "mean_s": statistics.mean(ends), "steps": steps,
            "batch": batch / steps, "loads": eng.runner.loras.loads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--format", default="bf16", choices=list(FORMATS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill timing (one chunk)")
    ap.add_argument("--queue-adapters", type=int, default=8, help="adapters of the max_loras runs (0: none)")
    ap.add_argument("--queue-max-loras", default="8,4,2")
    ap.add_argument("--queue-tokens", type=int, default=32, help="output tokens of each request there")
    args = ap.parse_args()
    dtype, quant = FORMATS[args.format]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {name: str(random_adapter(Path(tmp) / name, args.model, args.rank, seed))
                    for seed, name in enumerate(("a", "b"))}
        eng = LLMEngine(EngineConfig(model=args.model, dtype=dtype, quantization=quant, num_threads=args.threads,
                                     max_num_batched_tokens=max(512, args.prefill), enable_prefix_caching=False,
                                     lora_modules=adapters))
        print(f"{args.model}, {args.format}, {args.threads} threads, rank {args.rank} on q/k/v/o/gate/up/down; "
              f"decode step ms (median of {args.steps}), {args.rounds} alternated rounds")
        mixes = {"base": lambda b: [None] * b, "one adapter": lambda b: ["a"] * b,
                 "a/b/base mixed": lambda b: [("a", "b", None)[i % 3] for i in range(b)]}
        results: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for batch in map(int, args.batches.split(",")):
                for name, mix in mixes.items():
                    results.setdefault((name, batch), []).append(decode_ms(eng, mix(batch), args.steps))
        for batch in map(int, args.batches.split(",")):
            base = min(results[("base", batch)])
            cells = [f"{name} {min(results[(name, batch)]):.2f} ({min(results[(name, batch)]) / base:.2f}x)"
                     for name in mixes]
            print(f"  batch {batch:3d}: " + ", ".join(cells))
        prefill: dict[str | None, list[float]] = {None: [], "a": []}
        prefill_ms(eng, args.prefill, None)                 # warm
        for _ in range(args.rounds + 1):
            for lora in prefill:
                prefill[lora].append(prefill_ms(eng, args.prefill, lora))
        base = min(prefill[None])
        print(f"  prefill {args.prefill} tokens: base {base:.1f} ms, one adapter {min(prefill['a']):.1f} ms "
              f"({min(prefill['a']) / base:.2f}x)")
        loras, times = eng.runner.loras, {"check": [], "read": [], "place": [], "unread": []}
        for i in range(args.rounds + 3):        # a new load id each time: read and laid out again

            def timed(what, fn, *fn_args):
                t0 = time.perf_counter()
                result = fn(*fn_args)
                times[what].append(time.perf_counter() - t0)
                return result

            assert not isinstance(timed("check", check_adapter, adapters["b"], loras.dims), str)
            timed("read", loras.prepare, "runtime", 2 * i + 1, adapters["b"])      # a worker thread's part
            assert timed("place", loras.use, "runtime", 2 * i + 1, adapters["b"], set()) is None
            assert timed("unread", loras.use, "runtime", 2 * i + 2, adapters["b"], set()) is None
        size = (Path(adapters["b"]) / "adapter_model.safetensors").stat().st_size / 2**20
        ms = {what: statistics.median(t) * 1e3 for what, t in times.items()}
        print(f"  loaded at run time ({size:.1f} MiB file, medians of {len(times['read'])}): the router's check "
              f"{ms['check']:.2f} ms; a replica's read ahead (worker thread) {ms['read']:.1f} ms, then its "
              f"placement {ms['place']:.2f} ms (engine thread; {ms['unread']:.1f} ms without the read ahead)")
        if args.queue_adapters:
            paths = [str(random_adapter(Path(tmp) / f"q{i}", args.model, args.rank, 10 + i))
                     for i in range(args.queue_adapters)]
            print(f"  {2 * len(paths)} requests over {len(paths)} adapters loaded at run time, 64 -> "
                  f"{args.queue_tokens} tokens each, queued at once:")
            for max_loras in map(int, args.queue_max_loras.split(",")):
                r = queue_run(args, dtype, quant, paths, max_loras)
                print(f"    max_loras {max_loras}: {r['s']:.2f} s to the last token (a request's end "
                      f"{r['mean_s']:.2f} s on average), {r['steps']} steps of {r['batch']:.1f} running on "
                      f"average, {r['loads']} adapters placed")


if __name__ == "__main__":
    main()
