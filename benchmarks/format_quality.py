#!/usr/bin/env python
"""What each weight format costs in quality: the engine in fp32, bf16, int8 and int4 against
Hugging Face `generate` and against fp32.

For each format it prints
  - greedy agreement: for each prompt, how many tokens the engine's greedy output shares
    with Hugging Face `generate` in the same compute dtype (fp32 for fp32; bf16 for bf16 and
    the quantized int8/int4 formats, whose activations between the linears are bf16; their
    VNNI kernels round them to int8 inside each linear) before the first difference, out of
    --new-tokens;
  - mean log-likelihood per token of a fixed English text (the engine's prompt logprobs),
    beside fp32's: a perplexity-style check of how much the format moves the model.

    python benchmarks/format_quality.py [--model DIR] [--formats fp32,bf16,int8,int4] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

DEFAULT_MODEL = ".cache/models/SmolLM2-135M-Instruct"
# format name -> (EngineConfig dtype, quantization, HF reference dtype)
FORMATS = {"fp32": ("float32", None, torch.float32), "bf16": ("bfloat16", None, torch.bfloat16),
           "int8": ("bfloat16", "int8", torch.bfloat16), "int4": ("bfloat16", "int4", torch.bfloat16)}
QUESTIONS = ["What is the capital of France?", "Write a short poem about the sea.",
             "Explain how a bicycle stays upright.", "Give me a recipe for pancakes.",
             "Why is the sky blue?", "What does a compiler do?", "Describe the water cycle.",
             "What is a hash table?"]
TEXT = ("The history of computing spans centuries, from the abacus to mechanical calculators and "
        "the first programmable machines. Punched cards stored programs and data for early tabulating "
        "machines, and vacuum tubes gave way to transistors and then to integrated circuits. Each step "
        "made computers smaller, faster and cheaper, until a device more powerful than a room-sized "
        "mainframe fit in a pocket. Software grew alongside the hardware: assemblers, compilers, "
        "operating systems and networks turned a calculating engine into the general-purpose tool that "
        "now runs much of the world. The ocean covers most of the planet and holds most of its water. "
        "Sunlight warms its surface, water evaporates, clouds form and rain falls back on land and sea.")


def engine_for(model: str, fmt: str) -> LLMEngine:
    dtype, quant, _ = FORMATS[fmt]
    return LLMEngine(EngineConfig(model=model, dtype=dtype, quantization=quant, device="cpu",
                                  kv_cache_memory="256MiB"))


def greedy_outputs(eng: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [c.token_ids for c in eng.generate(prompts, params)]


def mean_loglik(eng: LLMEngine, ids: list[int]) -> float:
    """Mean log-probability per token of `ids[1:]` given the tokens before it."""
    [c] = eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    return statistics.fmean(t.logprob for t in c.prompt_logprobs)


def hf_greedy(model: str, dtype: torch.dtype, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
    hf.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for p in prompts:
            x = torch.tensor([p])
            y = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                            min_new_tokens=n, pad_token_id=0)
            outs.append(y[0, len(p):].tolist())
    return outs


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--formats", default="fp32,bf16,int8,int4")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in QUESTIONS]
    prompts = [list(p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p) for p in prompts]
    text_ids = tok(TEXT)["input_ids"]
    print("$ " + shlex.join(getattr(sys, "orig_argv", sys.argv)))
    print(f"{len(prompts)} chat prompts x {args.new_tokens} greedy tokens; log-likelihood over "
          f"{len(text_ids) - 1} tokens of a fixed text\n")
    refs: dict[torch.dtype, list[list[int]]] = {}
    rows, base_ll = [], None
    for fmt in args.formats.split(","):
        _, _, ref_dtype = FORMATS[fmt]
        if ref_dtype not in refs:
            refs[ref_dtype] = hf_greedy(args.model, ref_dtype, prompts, args.new_tokens)
        eng = engine_for(args.model, fmt)
        outs = greedy_outputs(eng, prompts, args.new_tokens)
        ll = mean_loglik(eng, text_ids)
        base_ll = ll if fmt == "fp32" else base_ll
        agree = [common_prefix(o, r) for o, r in zip(outs, refs[ref_dtype])]
        rows.append((fmt, str(ref_dtype).split(".")[-1], agree, ll))
        del eng
    print("| format | HF reference | greedy tokens before first difference (per prompt) | identical prompts "
          "| mean log-lik / token | perplexity | vs fp32 |")
    print("|---|---|---|---:|---:|---:|---:|")
    for fmt, ref, agree, ll in rows:
        delta = f"{ll - base_ll:+.4f}" if base_ll is not None else "n/a"
        print(f"| {fmt} | {ref} | {', '.join(map(str, agree))} | {sum(a == args.new_tokens for a in agree)}/"
              f"{len(agree)} | {ll:.4f} | {math.exp(-ll):.3f} | {delta} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
