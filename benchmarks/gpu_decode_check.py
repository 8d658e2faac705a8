"""GPU decode step time: eager with the torch attention backend, the Triton paged kernel, and the
paged kernel replayed from CUDA graphs (engine.cuda_graphs), on one GPU.

  python benchmarks/gpu_decode_check.py [--layers 24 --hidden 896 ...]

A random-weight model of Qwen2.5-0.5B's body (24 layers, hidden 896, 14 query / 2 KV heads,
MLP 4864) with a small byte-level vocabulary (no download), bf16. Sequences are admitted as a
decode replica admits them (`reserve` + `add_prefilled`) with `--context` tokens each, then
`--steps` pure decode steps are timed per batch size (median, ms per step, synchronized).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def build_model(path: Path, args) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tiny_models import _builtin_tokenizer
    tok = _builtin_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def time_steps(model: Path, backend: str, graphs: bool, batch: int, args) -> tuple[float, str]:
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    eng = LLMEngine(EngineConfig(model=str(model), dtype="bfloat16", device=args.device, attention_backend=backend,
                                 cuda_graphs=graphs, kv_cache_memory="8GiB" if cuda else "512MiB",
                                 max_num_seqs=max(batch, 1)))
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    for i in range(batch):
        blocks = eng.reserve(args.context)
        eng.add_prefilled(f"r{i}", [3 + (i + j) % 200 for j in range(args.context)], 5, params, blocks)
    for _ in range(3):
        eng.step()
    ts = []
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        eng.step()
        sync()
        ts.append(time.perf_counter() - t0)
    name = eng.runner.attention_backend + (" + CUDA graphs" if eng.runner.graphs is not None else "")
    del eng
    if cuda:
        torch.cuda.empty_cache()
    return statistics.median(ts) * 1e3, name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--intermediate", type=int, default=4864)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only checks the script (no graphs there)")
    args = ap.parse_args()
    import torch
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{where}, torch {torch.__version__}; model: {args.layers} layers, hidden "
          f"{args.hidden}, {args.heads}/{args.kv_heads} heads, bf16; context {args.context} tokens per sequence\n")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", args)
        contenders = (("torch", False), ("paged", False), ("paged", True))
        batches = [int(b) for b in args.batches.split(",")]
        rows = {b: [time_steps(model, be, g, b, args) for be, g in contenders] for b in batches}
    names = [name for _, name in rows[batches[0]]]
    print("| batch | " + " | ".join(f"{n} (ms/step)" for n in names) + " |")
    print("|---:|" + "---:|" * len(names))
    for b in batches:
        print(f"| {b} | " + " | ".join(f"{ms:.2f}" for ms, _ in rows[b]) + " |")


if __name__ == "__main__":
    main()
