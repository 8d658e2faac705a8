#!/usr/bin/env python
"""Engine benchmark: offline throughput against Hugging Face, and decode step time.

One run, one machine, one torch thread setting for every contender:

1. Offline output tokens/s for N chat prompts (default 16, about 30 to 300 tokens, built
   with the tokenizer's chat template) x M new tokens (default 64), greedy, for
     (a) this engine, `LLMEngine.generate` (ignore_eos),
     (b) Hugging Face `model.generate`, one prompt at a time,
     (c) transformers' own continuous batching, `model.generate_batch` (sdpa, paged cache).
   Every contender produces exactly M tokens per prompt: EOS neither stops a request nor is
   banned (engine: `ignore_eos=True`; HF generate: no EOS id in the generation config, so
   `min_new_tokens` has nothing to suppress; generate_batch: `eos_token_id=-1`). The same
   semantics on all three make the greedy tokens comparable: (a) and (c) are checked
   token for token against (b).
2. Decode step time of this engine at several batch sizes (default 1, 8, 32, 64) for each CPU
   weight format (`--formats`, default fp32, bf16, int8, int4): B requests with 32-token
   prompts, stepped until all of them decode, then `eng.step()` timed one step at a time;
   beside each, the roofline bound of that step on this CPU (pdserve.plan: bytes read over
   measured read bandwidth, FLOPs over measured matmul peak in the format's compute dtype: int8
   products for int8 and int4 with the engine's VNNI kernels, `torch._int_mm`'s peak; bf16 on a
   CPU without native bf16, such as an AVX2-only one, fp32's: the engine's kernels widen bf16 and
   multiply in fp32 there) and the efficiency bound / measured.

`--profile` adds a breakdown of decode steps (default batch 1 and 32, in `--profile-format`):
wall time per component (scheduler, `ModelRunner._prepare`, decoder body, paged attention, LM
head, sampler, detokenizer), the top torch ops (torch.profiler) and the top Python functions
(cProfile).

    python benchmarks/engine_bench.py [--threads N] [--skip-hf] [--json out.json] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import io
import json
import logging
import math
import os
import platform
import pstats
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:          # runs without an editable install
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

DEFAULT_MODEL = ".cache/models/SmolLM2-135M-Instruct"
TARGET_VS_CB = 1.25      # (a) >= 1.25 x (c)
TARGET_VS_HF = 4.0       # (a) >= 4 x (b)
TARGET_B1_VS_BOUND = 3.0  # decode batch 1 within 3 x its roofline bound
TARGET_B32_VS_B1 = 2.0    # decode batch 32 at most 2 x batch 1
# format name -> (EngineConfig dtype, quantization)
FORMATS = {"fp32": ("float32", None), "bf16": ("bfloat16", None), "int8": ("bfloat16", "int8"),
           "int4": ("bfloat16", "int4")}
# weight bytes per parameter a decode step reads: the quantized formats read their int weights
# up to engine.linear.quantized_small_rows() rows (with the engine's VNNI kernels: always), a
# dequantized bf16 copy above (int4: + scale and zero per 32)
WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5 + 4 / 32}
ENGINE_KW = dict(dtype="float32", device="cpu", max_num_batched_tokens=512, max_num_seqs=64,
                 kv_cache_memory="1GiB")

# ---- prompts ------------------------------------------------------------------------------------

_QUESTIONS = [
    "What is the capital of France, and why did it become the capital?",
    "Write a short poem about the ocean at night.",
    "Explain how a bicycle stays upright while moving.",
    "List three prime numbers larger than 100 and explain how you checked them.",
    "Translate 'good morning, how are you?' into Spanish, German and Italian.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "Give me a simple recipe for pancakes.",
    "What does a compiler do, step by step?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How many legs does a spider have, and how does it use them?",
    "Describe the water cycle.",
    "Write a limerick about a cat who loves cheese.",
    "What are the main differences between a virus and a bacterium?",
    "Suggest a name for a bakery and explain your choice.",
    "How does a refrigerator keep food cold?",
    "Explain what a hash table is and when to use one.",
]
_CONTEXT = [
    "The history of computing spans centuries, from the abacus to mechanical calculators.",
    "Punched cards stored programs and data for early tabulating machines.",
    "Vacuum tubes were replaced by transistors, which were smaller, cheaper and more reliable.",
    "Integrated circuits put thousands, then billions, of transistors on a single chip.",
    "The ocean covers about seventy percent of the surface of the Earth.",
    "Tides are caused mainly by the gravitational pull of the Moon and, to a lesser extent, the Sun.",
    "Bread rises because yeast ferments sugars and releases carbon dioxide into the dough.",
    "A good recipe lists its ingredients in the order in which they are used.",
    "Shakespeare wrote his plays for the Globe Theatre in London around the year 1600.",
    "Spiders are arachnids, not insects, and most of them spin silk from spinnerets.",
    "Water evaporates from lakes and seas, condenses into clouds and falls back as rain or snow.",
    "Refrigerators move heat from the inside to the outside with a compressor and a refrigerant.",
    "Bacteria are single-celled organisms, while viruses need a host cell to reproduce.",
    "A hash table maps keys to values with a hash function that picks a bucket for every key.",
    "Collisions in a hash table are resolved by chaining or by open addressing.",
    "Rayleigh scattering affects short wavelengths of light much more than long ones.",
    "Bicycles are steered partly by leaning, and the geometry of the fork helps them self-correct.",
    "Prime numbers have exactly two divisors: one and the number itself.",
    "Paris has been the political centre of France for most of the last thousand years.",
    "Compilers translate source code into machine code through parsing, analysis and code generation.",
]
_RAW_TEXT = " ".join(_CONTEXT) * 4


def _chat_ids(tok, content: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def build_prompts(tok, n: int) -> list[list[int]]:
    """n varied chat prompts whose lengths spread geometrically over about 30..300 tokens,
    in mixed order (short and long interleaved)."""
    k = 16
    targets = [round(30 * 10 ** ((i % k) / (k - 1))) for i in range(n)]
    order = []
    lo, hi = 0, n - 1
    while lo <= hi:                                   # interleave: shortest, longest, ...
        order.append(lo)
        if hi != lo:
            order.append(hi)
        lo, hi = lo + 1, hi - 1
    prompts = []
    for j, i in enumerate(order):
        question = _QUESTIONS[j % len(_QUESTIONS)]
        ids = _chat_ids(tok, question)
        ctx: list[str] = []
        c = j * 3
        while len(ids) < targets[i]:
            ctx.append(_CONTEXT[c % len(_CONTEXT)])
            c += 1
            ids = _chat_ids(tok, "Background: " + " ".join(ctx) + "\n\n" + question)
        prompts.append(ids)
    return prompts


def warmup_prompts(tok) -> list[list[int]]:
    """Raw text (no chat template), so warm-up leaves nothing in a prefix cache that the timed
    prompts could hit."""
    ids = tok.encode("Warm-up: " + _RAW_TEXT)
    return [ids[:40], ids[50:75]]


def decode_prompts(tok, batch: int, length: int = 32) -> list[list[int]]:
    """`batch` distinct raw-text prompts of exactly `length` tokens."""
    ids = tok.encode(_RAW_TEXT * (1 + batch * 5 // 300))
    out = []
    for b in range(batch):
        start = (b * 5) % max(1, len(ids) - length)
        out.append([1000 + b % 1000] + ids[start:start + length - 1])   # distinct first token
    return out


# ---- helpers ------------------------------------------------------------------------------------

def log(msg: str = "") -> None:
    print(msg, flush=True)


def load() -> str:
    """The 1-minute load average: this machine may be shared, and timings mean little above ~cores."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "n/a"


def count_identical(a: list[list[int]], b: list[list[int]]) -> tuple[int, list[str]]:
    same, notes = 0, []
    for i, (x, y) in enumerate(zip(a, b)):
        if x == y:
            same += 1
        else:
            first = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            notes.append(f"prompt {i}: first difference at output token {first}")
    return same, notes


def check_lengths(name: str, outs: list[list[int]], n: int) -> bool:
    bad = [(i, len(o)) for i, o in enumerate(outs) if len(o) != n]
    if bad:
        log(f"WARNING: {name}: {len(bad)} request(s) did not produce exactly {n} tokens: {bad}")
    return not bad


# ---- (a) this engine ----------------------------------------------------------------------------

def make_engine(args, fmt: str = "fp32"):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    dtype, quant = FORMATS[fmt]
    kw = {**ENGINE_KW, "dtype": dtype}
    return LLMEngine(EngineConfig(model=args.model, num_threads=args.threads, quantization=quant,
                                  attention_backend=args.attention, **kw))


def roofline(model_dir: str, threads: int):
    """(ModelSpec, Hardware (read bandwidth `mem_bw`, copy `link_bw`), {compute dtype: matmul
    FLOP/s}) of this CPU, measured now."""
    from pdserve.plan.model import resolve_spec
    from pdserve.plan.roofline import measure_cpu
    torch.set_num_threads(threads)
    hw = measure_cpu()
    peaks = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
        a @ b
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        peaks[dtype] = 10 * 2 * 1024**3 / (time.perf_counter() - t0)
    # int8 x int8 -> int32 (oneDNN, VNNI where the CPU has it): the peak of the engine's int8 and
    # int4 kernels, which round the activations to int8
    a, b = (torch.randint(-127, 128, (1024, 1024), dtype=torch.int8) for _ in range(2))
    torch._int_mm(a, b)
    t0 = time.perf_counter()
    for _ in range(10):
        torch._int_mm(a, b)
    peaks[torch.int8] = 10 * 2 * 1024**3 / (time.perf_counter() - t0)
    from engine.linear import cpu_has_native_bf16
    if not cpu_has_native_bf16():
        # torch's bf16 matmul is emulated there (1 GFLOP/s on an AVX2 host); the engine's bf16
        # GEMVs widen the weights and multiply in fp32 FMAs, so fp32's peak is theirs
        peaks[torch.bfloat16] = peaks[torch.float32]
    return resolve_spec(model_dir, dtype="fp32"), hw, peaks


def step_bound_ms(spec, bw: float, peaks: dict, fmt: str, batch: int, context: int) -> float:
    """Roofline lower bound of one decode step: max(FLOPs / peak, bytes / bandwidth)."""
    from engine.kernels import cpu_kernels
    from engine.linear import quantized_small_rows
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    kernels = cpu_kernels()
    few = quantized_small_rows(kernels)
    small = few is None or batch <= few
    if fmt in ("int8", "int4") and small and kernels is not None and kernels.vnni():
        dtype = torch.int8                   # the engine's int8 / int4 kernels: int8 products
    per_param = WEIGHT_BYTES[fmt] if small or fmt in ("fp32", "bf16") else WEIGHT_BYTES["bf16"]
    kv_bytes = spec.kv_bytes_per_token / spec.dtype_bytes * (4 if fmt == "fp32" else 2) * context * batch
    # a mixture of experts: a token computes with its active parameters, the step reads the experts
    # its tokens took (pdserve.plan's ModelSpec)
    return 1e3 * max(2 * spec.active_params * batch / peaks[dtype],
                     (spec.step_params(batch) * per_param + kv_bytes) / bw)


def run_engine_offline(eng, prompts, warm, new_tokens):
    from engine.sampling_params import SamplingParams
    eng.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    results = eng.generate(prompts, params)
    wall = time.perf_counter() - t0
    return wall, [list(r.token_ids) for r in results]


def _drain_until_decoding(eng, rids) -> int:
    """Step until every request has its first token (prompt fully prefilled)."""
    have = set()
    steps = 0
    while len(have) < len(rids):
        for out in eng.step():
            have.add(out.request_id)
        steps += 1
        if steps > 10_000:
            raise RuntimeError("requests never reached decode")
    return steps


def decode_bench(eng, tok, batch: int, steps: int, warm_steps: int = 3) -> dict:
    from engine.sampling_params import SamplingParams
    prompts = decode_prompts(tok, batch)
    params = SamplingParams(temperature=0.0, max_tokens=warm_steps + steps + 8, ignore_eos=True)
    rids = [f"decode-b{batch}-{i}" for i in range(batch)]
    for rid, p in zip(rids, prompts):
        eng.add_request(rid, p, params)
    try:
        prefill_steps = _drain_until_decoding(eng, rids)
        assert len(eng.scheduler.running) == batch, "not all requests are running"
        for _ in range(warm_steps):
            assert len(eng.step()) == batch
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            outs = eng.step()
            times.append(time.perf_counter() - t0)
            assert len(outs) == batch and all(not o.finished for o in outs), "not a pure decode step"
    finally:
        for rid in rids:
            eng.abort(rid)
    med = statistics.median(times)
    return {"batch": batch, "prompt_tokens": len(prompts[0]), "prefill_steps": prefill_steps,
            "steps": steps, "ms_per_step_median": med * 1e3, "ms_per_step_mean": statistics.fmean(times) * 1e3,
            "ms_per_step_min": min(times) * 1e3, "ms_per_step_max": max(times) * 1e3,
            "tokens_per_s": batch / med}


# ---- (b) HF generate, sequential ----------------------------------------------------------------

def load_hf(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


def run_hf_sequential(model_dir, prompts, warm, new_tokens, pad_id):
    model = load_hf(model_dir)
    # No EOS id anywhere in the generation config: generation never stops early and EOS is
    # never banned (same semantics as the engine's ignore_eos); min_new_tokens is then a no-op.
    model.generation_config.eos_token_id = None

    def gen(ids, n):
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=pad_id)
        return out[0, len(ids):].tolist()

    with torch.inference_mode():
        for p in warm:
            gen(p, 4)
        t0 = time.perf_counter()
        outs = [gen(p, new_tokens) for p in prompts]
        wall = time.perf_counter() - t0
    del model
    gc.collect()
    return wall, outs


# ---- (c) HF continuous batching -----------------------------------------------------------------

def run_hf_cb(model_dir, prompts, warm, new_tokens, pad_id, max_batch_tokens, max_seqs):
    from transformers import ContinuousBatchingConfig, GenerationConfig
    model = load_hf(model_dir)
    # eos_token_id=-1: CB's RequestState ignores negative ids, so EOS never ends a request.
    # (min_new_tokens would be dropped: MinNewTokensLengthLogitsProcessor is not CB-supported.)
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=-1, pad_token_id=pad_id)
    page = 256
    need = sum(math.ceil((len(p) + new_tokens) / page) for p in prompts)
    cb_cfg = ContinuousBatchingConfig(
        page_size=page, num_blocks=need + 4,              # explicit: on CPU it would size to 60 % of RAM
        max_batch_tokens=max_batch_tokens, max_requests_per_batch=max_seqs,
        auto_switch_to_flash=False, use_cuda_graph=False, default_compile_level=0)
    # warm-up: builds and warms the manager and keeps it for the timed call
    model.generate_batch(inputs=warm, generation_config=gen_cfg, continuous_batching_config=cb_cfg,
                         persistent_manager=True, max_new_tokens=4)
    t0 = time.perf_counter()
    res = model.generate_batch(inputs=prompts, generation_config=gen_cfg, continuous_batching_config=cb_cfg)
    wall = time.perf_counter() - t0
    model.destroy_cached_continuous_batching_manager()
    outs = [list(r.generated_tokens) for r in res.values()]
    errors = [r.error for r in res.values() if r.error]
    if len(outs) != len(prompts) or errors:
        log(f"WARNING: generate_batch returned {len(outs)}/{len(prompts)} results, errors: {errors[:3]}")
    impl = model.config._attn_implementation
    del model
    gc.collect()
    return wall, outs, impl


# ---- profile --------------------------------------------------------------------------------------

class _Timers:
    def __init__(self):
        self.t: dict[str, float] = {}

    def wrap(self, name, fn):
        @functools.wraps(fn)
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0
        return timed


def profile_decode(eng, tok, batch: int, steps: int = 8) -> dict:
    """Per-component wall time of pure decode steps, then torch.profiler and cProfile tables."""
    import engine.decoder as dec
    import engine.llm_engine as le
    from engine.detokenizer import IncrementalDetokenizer
    from engine.sampling_params import SamplingParams

    timers = _Timers()
    runner, model = eng.runner, eng.runner.model
    saved = dict(prepare=runner._prepare, body=model.forward, head=model.lm_head, attn=dec.paged_attention,
                 fused=dec.fused_attention, sample=le.sample, schedule=eng.scheduler.schedule,
                 detok=IncrementalDetokenizer.add)
    runner._prepare = timers.wrap("ModelRunner._prepare", saved["prepare"])
    model.forward = timers.wrap("decoder body (engine.decoder)", saved["body"])
    model.lm_head = timers.wrap("lm_head", saved["head"])
    le.sample = timers.wrap("sampler.sample", saved["sample"])
    eng.scheduler.schedule = timers.wrap("scheduler.schedule", saved["schedule"])
    IncrementalDetokenizer.add = timers.wrap("detokenizer.add", saved["detok"])
    n_layers = len(model.layers)

    def attn(*a, **kw):
        with torch.profiler.record_function("pdserve_paged_attention"):
            return saved["attn"](*a, **kw)

    def fused(*a, **kw):
        with torch.profiler.record_function("pdserve_paged_attention"):
            return saved["fused"](*a, **kw)
    # either is the step's attention: bf16 CPU decode steps call the fused one (RoPE + store included)
    dec.paged_attention = timers.wrap(f"  paged attention ({n_layers} layers)", attn)
    dec.fused_attention = timers.wrap(f"  paged attention ({n_layers} layers)", fused)

    prompts = decode_prompts(tok, batch)
    params = SamplingParams(temperature=0.0, max_tokens=3 * steps + 12, ignore_eos=True)
    rids = [f"prof-b{batch}-{i}" for i in range(batch)]
    report: dict = {"batch": batch, "steps": steps, "layers": n_layers}
    try:
        for rid, p in zip(rids, prompts):
            eng.add_request(rid, p, params)
        _drain_until_decoding(eng, rids)
        for _ in range(2):
            eng.step()
        # 1. component wall times
        timers.t.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            assert len(eng.step()) == batch
        total = time.perf_counter() - t0
        comp = {k: v / steps * 1e3 for k, v in timers.t.items()}
        comp["step total"] = total / steps * 1e3
        report["components_ms_per_step"] = comp
        # 2. torch.profiler: op-level self time
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                eng.step()
        report["torch_ops"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18,
                                                        max_name_column_width=48)
        # 3. cProfile: Python functions
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            eng.step()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
        report["cprofile"] = s.getvalue()
    finally:
        for rid in rids:
            eng.abort(rid)
        dec.paged_attention = saved["attn"]
        dec.fused_attention = saved["fused"]
        le.sample = saved["sample"]
        IncrementalDetokenizer.add = saved["detok"]
        model.lm_head = saved["head"]
        # the instance attributes shadow the class methods: drop them
        for obj, name in ((runner, "_prepare"), (model, "forward"), (eng.scheduler, "schedule")):
            obj.__dict__.pop(name, None)
    return report


def print_profile(rep: dict) -> None:
    b, comp = rep["batch"], rep["components_ms_per_step"]
    total = comp["step total"]
    att_key = f"  paged attention ({rep['layers']} layers)"
    body = comp.get("decoder body (engine.decoder)", 0.0)
    att = comp.get(att_key, 0.0)
    log(f"\n#### Decode step breakdown, {rep['format']}, batch {b} ({rep['steps']} steps, wall ms per step)\n")
    log("| component | ms/step | share |")
    log("|---|---:|---:|")
    order = ["scheduler.schedule", "ModelRunner._prepare", "decoder body (engine.decoder)",
             att_key, "lm_head", "sampler.sample", "detokenizer.add"]
    for k in order:
        if k in comp:
            log(f"| {k.strip() if not k.startswith('  ') else '  of which ' + k.strip()} | {comp[k]:.2f} | "
                f"{100 * comp[k] / total:.1f} % |")
    log(f"|   of which body outside attention (linears, norms, rope, MLP) | {body - att:.2f} | "
        f"{100 * (body - att) / total:.1f} % |")
    known = sum(comp.get(k, 0.0) for k in order if not k.startswith("  "))
    log(f"| rest of step (postprocess, stop checks, outputs) | {total - known:.2f} | "
        f"{100 * (total - known) / total:.1f} % |")
    log(f"| **step total** | **{total:.2f}** | 100 % |")
    log(f"\ntorch.profiler, batch {b}, {rep['steps']} steps (self CPU time):\n```\n{rep['torch_ops']}```")
    lines = rep["cprofile"].strip().splitlines()
    start = next((i for i, l in enumerate(lines) if "ncalls" in l), 0)
    log(f"\ncProfile, batch {b}, {rep['steps']} steps (top by tottime):\n```\n" + "\n".join(lines[start - 2:])
        + "\n```")


# ---- main -----------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="HF model directory (float32 checkpoint)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for every contender (default: torch's default)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32,64", help="decode step batch sizes")
    ap.add_argument("--formats", default="fp32,bf16,int8,int4",
                    help=f"weight formats whose decode steps are timed ({', '.join(FORMATS)})")
    ap.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per batch size")
    ap.add_argument("--decode-rounds", type=int, default=1,
                    help="rounds over the batch sizes per format; each batch reports its best round's median "
                         "(on a noisy host a slow spell then meets every batch size, not one)")
    ap.add_argument("--skip-hf", action="store_true", help="skip (b) and (c)")
    ap.add_argument("--repeat", type=int, default=2,
                    help="timed runs of (a) and (c), best one reported ((b) runs once: it is the slow one)")
    ap.add_argument("--cb-max-batch-tokens", type=int, default=ENGINE_KW["max_num_batched_tokens"],
                    help="token budget per step of (c); default: the engine's")
    ap.add_argument("--profile", action="store_true",
                    help="also break down decode steps (see --profile-batches)")
    ap.add_argument("--profile-batches", default="1,32", help="batch sizes that --profile breaks down")
    ap.add_argument("--profile-format", default="bf16", choices=list(FORMATS), help="format --profile breaks down")
    ap.add_argument("--attention", default="auto", choices=["auto", "paged", "torch"],
                    help="the engine's decode attention backend")
    ap.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON here")
    args = ap.parse_args()
    if args.decode_rounds < 1:
        ap.error("--decode-rounds must be at least 1")

    warnings.filterwarnings("ignore")
    import transformers
    from transformers import AutoTokenizer
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)   # persistent-manager notice

    if args.threads is None:
        args.threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]

    log("$ " + shlex.join(getattr(sys, "orig_argv", [sys.executable] + sys.argv)))
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads {args.threads} "
        f"(all contenders)")
    log(f"model {args.model}, cpu (offline comparison in float32); engine: max_num_batched_tokens={ENGINE_KW['max_num_batched_tokens']}, "
        f"max_num_seqs={ENGINE_KW['max_num_seqs']}, kv_cache_memory={ENGINE_KW['kv_cache_memory']}, attention_backend={args.attention}")

    tok = AutoTokenizer.from_pretrained(args.model)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts = build_prompts(tok, args.prompts)
    warm = warmup_prompts(tok)
    lens = [len(p) for p in prompts]
    n_new = args.new_tokens
    total_out = n_new * len(prompts)
    log(f"{len(prompts)} chat prompts, {min(lens)}..{max(lens)} tokens (mean {statistics.fmean(lens):.0f}): "
        f"{lens}; {n_new} new tokens each, greedy, EOS ignored\n")

    results: dict = {"command": shlex.join(getattr(sys, "orig_argv", sys.argv)), "threads": args.threads,
                     "torch": torch.__version__, "transformers": transformers.__version__,
                     "prompt_lengths": lens, "new_tokens": n_new, "offline": {}, "decode": []}
    bench_t0 = time.perf_counter()
    log(f"1-minute load average at start: {load()} on {os.cpu_count()} CPUs (while it runs, this benchmark itself "
        f"adds up to {args.threads}; much more than that means other work shares the machine)")

    # (a) + decode steps: one engine
    log(f"running (a) pdserve engine ... (load {load()})")
    walls_a, eng = [], None
    for _ in range(args.repeat):          # a fresh engine per run: no prefix-cache hits across runs
        del eng
        gc.collect()
        eng = make_engine(args)
        wall, outs_a = run_engine_offline(eng, prompts, warm, n_new)
        walls_a.append(wall)
        log(f"  {wall:.2f} s, {n_new * len(prompts) / wall:.1f} tok/s (load {load()})")
    wall_a = min(walls_a)
    ok_a = check_lengths("(a) engine", outs_a, n_new)
    results["offline"]["engine"] = {"wall_s": wall_a, "runs_wall_s": walls_a, "tokens": sum(map(len, outs_a)),
                                    "tokens_per_s": sum(map(len, outs_a)) / wall_a, "exact_length": ok_a}

    assert not eng.has_work()
    del eng
    gc.collect()

    formats = [f for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown formats {unknown}; choose from {', '.join(FORMATS)}")
    spec, hw, peaks = roofline(args.model, args.threads)
    bw = hw.mem_bw
    log(f"this CPU, {args.threads} thread(s): read bandwidth {bw / 1e9:.1f} GB/s (the bound's; copy "
        f"{hw.link_bw / 1e9:.1f} GB/s), matmul peak "
        f"{peaks[torch.float32] / 1e9:.0f} GFLOP/s fp32, {peaks[torch.bfloat16] / 1e9:.0f} GFLOP/s bf16, "
        f"{peaks[torch.int8] / 1e9:.0f} GOP/s int8")
    decode: dict[str, list] = {}
    profiles = []
    for fmt in formats:
        log(f"running decode steps, {fmt} ... (load {load()})")
        eng = make_engine(args, fmt)
        runs: dict[int, list] = {b: [] for b in batches}
        for rnd in range(args.decode_rounds):       # the batch sizes in turn, round after round
            for b in batches:
                r = decode_bench(eng, tok, b, args.decode_steps)
                ctx = r["prompt_tokens"] + 3 + args.decode_steps // 2
                r["bound_ms"] = step_bound_ms(spec, bw, peaks, fmt, b, ctx)
                runs[b].append(r)
                log(f"  batch {b}{f' (round {rnd + 1})' if args.decode_rounds > 1 else ''}: "
                    f"{r['ms_per_step_median']:.1f} ms/step, {r['tokens_per_s']:.1f} tok/s (bound {r['bound_ms']:.1f} ms)")
        decode[fmt] = [{**min(runs[b], key=lambda r: r["ms_per_step_median"]),
                        "round_medians_ms": [r["ms_per_step_median"] for r in runs[b]]} for b in batches]
        if args.profile and fmt == args.profile_format:
            log(f"profiling decode steps, {fmt} ...")
            for b in (int(x) for x in args.profile_batches.split(",") if x.strip()):
                profiles.append({**profile_decode(eng, tok, b), "format": fmt})
        assert not eng.has_work()
        del eng
        gc.collect()
    results["decode"] = decode
    results["roofline"] = {"bandwidth_bytes_per_s": bw, "copy_bandwidth_bytes_per_s": hw.link_bw,
                           "peak_flops": {str(k): v for k, v in peaks.items()}}
    if profiles:
        results["profile"] = [{"format": p["format"], "batch": p["batch"],
                               "components_ms_per_step": p["components_ms_per_step"]} for p in profiles]

    outs_b = outs_c = None
    if not args.skip_hf:
        log(f"running (b) HF generate, sequential (one run) ... (load {load()})")
        wall_b, outs_b = run_hf_sequential(args.model, prompts, warm, n_new, pad_id)
        ok_b = check_lengths("(b) HF generate", outs_b, n_new)
        results["offline"]["hf_generate"] = {"wall_s": wall_b, "tokens": sum(map(len, outs_b)),
                                             "tokens_per_s": sum(map(len, outs_b)) / wall_b, "exact_length": ok_b}
        log(f"  {wall_b:.2f} s, {sum(map(len, outs_b)) / wall_b:.1f} tok/s (load {load()})")

        log(f"running (c) HF generate_batch (continuous batching) ... (load {load()})")
        walls_c = []
        for _ in range(args.repeat):          # a fresh model and manager per run
            wall, outs_c, impl_c = run_hf_cb(args.model, prompts, warm, n_new, pad_id, args.cb_max_batch_tokens,
                                             ENGINE_KW["max_num_seqs"])
            walls_c.append(wall)
            log(f"  {wall:.2f} s, {n_new * len(prompts) / wall:.1f} tok/s, attn_implementation={impl_c!r} "
                f"(load {load()})")
        wall_c = min(walls_c)
        ok_c = check_lengths("(c) HF generate_batch", outs_c, n_new)
        results["offline"]["hf_generate_batch"] = {"wall_s": wall_c, "runs_wall_s": walls_c,
                                                   "tokens": sum(map(len, outs_c)),
                                                   "tokens_per_s": sum(map(len, outs_c)) / wall_c,
                                                   "exact_length": ok_c, "attn_implementation": impl_c,
                                                   "max_batch_tokens": args.cb_max_batch_tokens}

    # ---- report ----
    log(f"\n### Offline throughput: {len(prompts)} prompts x {n_new} new tokens "
        f"({total_out} output tokens), {args.threads} thread(s); (a), (c): best of {args.repeat} runs, (b): one run\n")
    log("| contender | wall s | output tokens | output tok/s | exactly 64 each | greedy tokens = (b) |"
        .replace("64", str(n_new)))
    log("|---|---:|---:|---:|:---:|:---:|")
    off = results["offline"]
    same_ab = same_cb = None
    if outs_b is not None:
        same_ab, notes_ab = count_identical(outs_a, outs_b)
        same_cb, notes_cb = count_identical(outs_c, outs_b)
        results["identical_a_b"] = same_ab
        results["identical_c_b"] = same_cb
    rows = [("(a) pdserve `LLMEngine.generate`", "engine",
             f"{same_ab}/{len(prompts)}" if same_ab is not None else "n/a"),
            ("(b) HF `model.generate`, sequential", "hf_generate", "reference"),
            (f"(c) HF `model.generate_batch` (continuous batching, "
             f"{off.get('hf_generate_batch', {}).get('attn_implementation', 'sdpa')})", "hf_generate_batch",
             f"{same_cb}/{len(prompts)}" if same_cb is not None else "n/a")]
    for label, key, ident in rows:
        if key in off:
            r = off[key]
            log(f"| {label} | {r['wall_s']:.2f} | {r['tokens']} | {r['tokens_per_s']:.1f} | "
                f"{'yes' if r['exact_length'] else 'NO'} | {ident} |")
    if outs_b is not None:
        ra = off["engine"]["tokens_per_s"]
        r_ac = ra / off["hf_generate_batch"]["tokens_per_s"]
        r_ab = ra / off["hf_generate"]["tokens_per_s"]
        results["ratio_a_c"], results["ratio_a_b"] = r_ac, r_ab
        log("")
        log(f"- (a)/(c) = **{r_ac:.2f}x** (target >= {TARGET_VS_CB}x): {'PASS' if r_ac >= TARGET_VS_CB else 'MISS'}")
        log(f"- (a)/(b) = **{r_ab:.2f}x** (target >= {TARGET_VS_HF:g}x): {'PASS' if r_ab >= TARGET_VS_HF else 'MISS'}")
        log(f"- greedy cross-check: (a) vs (b) {same_ab}/{len(prompts)} identical; "
            f"(c) vs (b) {same_cb}/{len(prompts)} identical")
        for note in notes_ab:
            log(f"  - (a) vs (b) {note}")
        for note in notes_cb:
            log(f"  - (c) vs (b) {note}")

    rounds = f", best of {args.decode_rounds} rounds" if args.decode_rounds > 1 else ""
    log(f"\n### Engine decode step time ({args.decode_steps} timed pure-decode steps per batch{rounds}, 32-token "
        f"prompts, {args.threads} thread(s)): median ms/step, and in brackets the roofline bound and "
        f"bound / measured\n")
    log("| batch | " + " | ".join(formats) + " |")
    log("|---:|" + "---:|" * len(formats))
    for i, b in enumerate(batches):
        cells = [f"{r['ms_per_step_median']:.1f} ({r['bound_ms']:.1f}, {100 * r['bound_ms'] / r['ms_per_step_median']:.0f} %)"
                 for r in (decode[f][i] for f in formats)]
        log(f"| {b} | " + " | ".join(cells) + " |")
    log("| decode tok/s at the largest batch | " + " | ".join(
        f"{decode[f][-1]['tokens_per_s']:.0f}" for f in formats) + " |")
    if 1 in batches:
        i1 = batches.index(1)
        log("")
        for f in formats:
            r1 = decode[f][i1]
            ratio = r1["ms_per_step_median"] / r1["bound_ms"]
            line = (f"- {f}: batch 1 at {ratio:.1f}x its bound (target <= {TARGET_B1_VS_BOUND:g}x: "
                    f"{'PASS' if ratio <= TARGET_B1_VS_BOUND else 'MISS'})")
            if 32 in batches:
                d32 = decode[f][batches.index(32)]
                r32 = d32["ms_per_step_median"] / r1["ms_per_step_median"]
                # the ratio two steps exactly at their roofline bounds would have: above the target,
                # no step time reaches it on this CPU (batch 32 compute-bound, batch 1 memory-bound)
                floor = d32["bound_ms"] / r1["bound_ms"]
                line += (f"; batch 32 / batch 1 = {r32:.2f} (target <= {TARGET_B32_VS_B1:g}: "
                         f"{'PASS' if r32 <= TARGET_B32_VS_B1 else 'MISS'}; at the bounds {floor:.2f})")
            log(line)

    for p in profiles:
        print_profile(p)

    results["bench_wall_s"] = time.perf_counter() - bench_t0
    log(f"\n(benchmark wall time {results['bench_wall_s']:.0f} s, 1-minute load average at end {load()})")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
        log(f"results written to {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
