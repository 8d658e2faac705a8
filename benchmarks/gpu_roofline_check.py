"""GPU check (a script, under ~5 minutes on one H200): prefill MFU and decode memory-bandwidth
utilization of a random-weight model shaped like Qwen2.5-7B (bf16), printed beside what
`pdserve plan` predicts for the same shapes.

  python benchmarks/gpu_roofline_check.py            # --hardware h100|h200|...: auto reads the GPU's name

Prefill: one forward over B x S tokens; MFU = 2 N S B / time / peak. Decode: steps of one token for B
sequences with an S-token KV cache; bandwidth utilization = (weights + KV read) / time / peak bandwidth.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from anywhere, no install needed
from pdserve.plan.roofline import HARDWARE, MODELS, decode_intensity, prefill_intensity, tpot_bound, ttft_bound


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def hardware_of(name: str) -> str | None:
    """The planner's hardware key for a CUDA device name ("NVIDIA H100 80GB HBM3" -> h100), or None."""
    return next((key for key in HARDWARE if key in name.lower().replace(" ", "")), None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default="auto", choices=["auto", *sorted(HARDWARE)])
    ap.add_argument("--prefill-lens", default="1024,4096")
    ap.add_argument("--decode-batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    key = hardware_of(torch.cuda.get_device_name()) if args.hardware == "auto" else args.hardware
    if key is None:
        print(f"{torch.cuda.get_device_name()}: not among {', '.join(HARDWARE)}; name one with --hardware")
        return 2
    hw, spec = HARDWARE[key], MODELS["qwen2.5-7b"]
    cfg = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                      num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    n = sum(p.numel() for p in model.parameters())
    print(f"{torch.cuda.get_device_name()}: random Qwen2.5-7B shape, {n / 1e9:.2f} B params, bf16; "
          f"peak {hw.peak_flops / 1e12:.0f} TFLOP/s, {hw.mem_bw / 1e12:.2f} TB/s")
    print("\n| prefill S | ms | MFU | planner TTFT bound ms | intensity FLOP/B |\n|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for s in map(int, args.prefill_lens.split(",")):
            ids = torch.randint(0, cfg.vocab_size, (1, s), device="cuda")
            t = timed(lambda: model.model(input_ids=ids), 3)
            print(f"| {s} | {t * 1e3:.1f} | {2 * n * s / t / hw.peak_flops:.1%} | "
                  f"{ttft_bound(spec, hw, s) * 1e3:.1f} | {prefill_intensity(spec, s):.0f} |")
        print("\n| decode batch | context | ms/step | bandwidth util | planner TPOT bound ms | intensity FLOP/B |"
              "\n|---:|---:|---:|---:|---:|---:|")
        kv_per_token = spec.kv_bytes_per_token
        for b in map(int, args.decode_batches.split(",")):
            ctx = torch.randint(0, cfg.vocab_size, (b, args.context), device="cuda")
            cache = DynamicCache(config=cfg)
            model(input_ids=ctx, past_key_values=cache, use_cache=True)
            step_ids = torch.randint(0, cfg.vocab_size, (b, 1), device="cuda")
            base_len = cache.get_seq_length()

            def step():
                model(input_ids=step_ids, past_key_values=cache, use_cache=True)
                cache.crop(base_len - cache.get_seq_length())   # drop the token just added
            t = timed(step, 10)
            moved = n * 2 + kv_per_token * args.context * b
            print(f"| {b} | {args.context} | {t * 1e3:.2f} | {moved / t / hw.mem_bw:.1%} | "
                  f"{tpot_bound(spec, hw, args.context, b) * 1e3:.2f} | {decode_intensity(spec, args.context, b):.1f} |")
            del cache
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
