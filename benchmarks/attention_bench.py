"""Decode attention: the in-place CPU kernel against the torch backend (gather + sdpa).

  .venv/bin/python benchmarks/attention_bench.py [--threads 1] [--model DIR] [--rss-batch 64 --rss-context 2048]
  .venv/bin/python benchmarks/attention_bench.py --chunks      (only 3.)
  .venv/bin/python benchmarks/attention_bench.py --prefills    (only 4.)
  .venv/bin/python benchmarks/attention_bench.py --layers [--dtype fp32]   (only 5.)

1. Per-layer decode attention time of each backend (SmolLM2-135M's shape: 9 query heads, 3 KV
   heads, head size 64, 30 layers, block size 16), at batch x context from 1 x 64 to 64 x 2048,
   bf16 and fp32, on a pool with shuffled block tables (as a busy pool has them).
2. Decode steps of the real model at batch `--rss-batch` x `--rss-context` tokens of context,
   each backend in a fresh process: step time and the process's peak RSS above the RSS right
   after the engine is built (weights + KV pool), i.e. what the steps themselves allocate. The
   prompts are admitted as a decode replica admits them (`reserve` + `add_prefilled`, KV left as
   allocated: attention costs the same whatever the values), so no prefill of 64 x 2k tokens.
3. `--chunks`: a prompt chunk of n tokens after a past (a prefix-cache tail, a later chunk of a
   long prompt), per layer: its context gathered + sdpa with the offset-causal mask (what the
   engine runs above backends.KERNEL_CHUNK_ROWS tokens in fp32), the paged decode kernel with
   one row per token over its own causal context (what it runs at or below), and in bf16 the
   prefill kernel (`paged_prefill_attention`, what a bf16 engine runs above); then fresh prompts
   of n tokens (past 0): sdpa on the chunk's own K/V with `is_causal` (fp32) against the prefill
   kernel (bf16).
4. `--prefills`: whole prefills of the real model in bf16 (one prompt, `max_tokens=1`) of 128-2048
   tokens, one engine with its prefill kernel off (sdpa; RoPE and the K/V store as torch ops) and on
   (the kernel; RoPE and the store in one kernel, as the attention then all reads the pool in
   place), alternated three times.
5. `--layers`: the in-place kernel alone per layer, cold and warm: a pool of 30 layers called
   layer after layer (what a decode step does: a layer's K/V were last read 30 calls ago, so at
   these sizes they come from memory), then the same layer again (from cache where it fits);
   1 x 1024 to 64 x 2048, bf16 (or `--dtype fp32`), with the K/V bytes read per second;
   `--block-sizes 16,32,64`: each shape with each KV block size (the engine's `block_size`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _status_mib(field: str) -> float:
    """VmRSS (now) or VmHWM (peak since start or the last reset) of this process, MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:   # "5": reset VmHWM to the current RSS (Linux)
        f.write("5")


def micro(threads: int) -> None:
    import torch

    from engine.attention import AttentionMetadata, DecodeBatch, paged_attention
    from engine.kernels import cpu_kernels
    torch.set_num_threads(threads)
    kernels = cpu_kernels()
    if kernels is None:
        print("the CPU kernel could not be built; nothing to compare")
        return
    layers, bs, n_kv, heads, dim = 30, 16, 3, 9, 64
    print(f"### Decode attention per layer, microseconds ({threads} thread(s); median of 15 calls)\n")
    print("| dtype | batch x context | torch (gather + sdpa) | cpu_paged (in place) | speed-up |")
    print("|---|---|---:|---:|---:|")
    for dtype in (torch.bfloat16, torch.float32):
        for batch, ctx in ((1, 64), (1, 1024), (8, 256), (32, 512), (64, 2048)):
            nb = -(-ctx // bs)
            pool = torch.zeros(batch * nb + 1, layers, 2, bs, n_kv, dim, dtype=dtype).normal_()
            tables = torch.randperm(batch * nb + 1)[:batch * nb].view(batch, nb)
            lens = torch.full((batch,), ctx)
            q = torch.randn(batch, heads, dim, dtype=dtype)
            k = v = torch.randn(batch, n_kv, dim, dtype=dtype)
            slots = tables[:, -1] * (layers * 2 * bs) + (ctx - 1) % bs
            k_rows = tables * (2 * layers)
            mask = (torch.arange(nb * bs)[None, :] < lens[:, None])[:, None, None, :]
            metas = {
                "torch": AttentionMetadata(pool, slots, DecodeBatch(torch.arange(batch), blocks=torch.stack(
                    (k_rows, k_rows + 1)).view(-1), mask=mask), [], True),
                "cpu_paged": AttentionMetadata(pool, slots, DecodeBatch(torch.arange(batch), tables=tables, lens=lens),
                                               [], True, kernels),
            }
            t = {}
            for name, meta in metas.items():
                ts = []
                for i in range(17):
                    t0 = time.perf_counter()
                    paged_attention(i % layers, q, k, v, meta, dim ** -0.5)
                    ts.append(time.perf_counter() - t0)
                t[name] = statistics.median(ts[2:]) * 1e6
            print(f"| {str(dtype).split('.')[1]} | {batch} x {ctx} | {t['torch']:.0f} | {t['cpu_paged']:.0f} | "
                  f"{t['torch'] / t['cpu_paged']:.1f}x |")
            del pool
    print()


def chunks(threads: int) -> None:
    import torch
    import torch.nn.functional as F

    from engine.attention import token_slots
    from engine.kernels import cpu_kernels
    from engine.backends import KERNEL_CHUNK_ROWS
    torch.set_num_threads(threads)
    kernels = cpu_kernels()
    if kernels is None:
        print("the CPU kernel could not be built; nothing to compare")
        return
    layers, bs, n_kv, heads, dim, layer = 30, 16, 3, 9, 64, 7
    prefill = kernels.prefill_attention_supported(dim)
    print(f"### A prompt chunk after a past, per layer, microseconds ({threads} thread(s); median of 15 calls; "
          f"the engine uses the decode kernel's rows up to {KERNEL_CHUNK_ROWS} tokens, then in bf16 the prefill "
          f"kernel{'' if prefill else ' (not built here)'}, in fp32 gather + sdpa)\n")
    print("| dtype | past | chunk tokens | gather + sdpa | kernel rows | prefill kernel | rows speed-up | prefill speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for dtype in (torch.bfloat16, torch.float32):
        for past in (0, 32, 256, 2048):
            for n in ((16, 128, 512, 2048) if past == 0 else (2, 3, 4, 6, 8, 16, 64, 256)):
                ctx, nb = past + n, -(-(past + n) // bs)
                pool = torch.randn(nb + 8, layers, 2, bs, n_kv, dim).to(dtype)
                table = torch.randperm(nb + 8)[:nb]
                slots = token_slots(table, bs, layers)[:ctx] + 2 * layer * bs
                flat = pool.view(-1, n_kv, dim)
                q = torch.randn(n, heads, dim).to(dtype)
                mask = (torch.arange(ctx)[None, :] <= torch.arange(past, ctx)[:, None])[None, None]
                lens = torch.arange(past + 1, ctx + 1)

                k_new, v_new = flat[slots[past:]], flat[slots[past:] + bs]     # a fresh prompt's own K/V

                def gather():
                    if past == 0:           # no past: the engine's sdpa runs on the chunk's K/V, is_causal
                        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_new.transpose(0, 1)[None],
                                                              v_new.transpose(0, 1)[None], is_causal=True,
                                                              scale=dim ** -0.5, enable_gqa=True)
                    k, v = flat[slots], flat[slots + bs]
                    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                          v.transpose(0, 1)[None], attn_mask=mask,
                                                          scale=dim ** -0.5, enable_gqa=True)

                def rows():
                    return kernels.paged_decode_attention(q, pool, table[None].expand(n, -1).contiguous(), lens,
                                                          layer, dim ** -0.5)

                def prefill_kernel():
                    return kernels.paged_prefill_attention(q, pool, table, past, layer, dim ** -0.5)
                t = {}
                contenders = [("gather", gather)] + ([("rows", rows)] if past or n <= 16 else [])
                if prefill and dtype == torch.bfloat16:
                    contenders.append(("prefill", prefill_kernel))
                for name, fn in contenders:
                    ts = []
                    for _ in range(17 if n < 1024 else 7):
                        t0 = time.perf_counter()
                        fn()
                        ts.append(time.perf_counter() - t0)
                    t[name] = statistics.median(ts[2:]) * 1e6
                cell = lambda name: f"{t[name]:.0f}" if name in t else "—"                    # noqa: E731
                speed = lambda name: f"{t['gather'] / t[name]:.2f}x" if name in t else "—"    # noqa: E731
                print(f"| {str(dtype).split('.')[1]} | {past} | {n} | {t['gather']:.0f} | {cell('rows')} | "
                      f"{cell('prefill')} | {speed('rows')} | {speed('prefill')} |")
    print()


def prefills(args) -> None:
    import random

    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    eng = LLMEngine(EngineConfig(model=args.model, num_threads=args.threads, dtype="bfloat16",
                                 enable_prefix_caching=False, max_num_batched_tokens=2048))
    if not eng.runner.prefill_kernel:
        print("the prefill kernel does not run here (it needs the CPU kernels with AVX512-BF16); nothing to compare")
        return
    default_sdpa_from = eng.runner.sdpa_from
    eng.runner.sdpa_from = None            # "on": the kernel at every length (the engine's own choice below)
    rng, sizes, times = random.Random(0), (128, 256, 512, 1024, 2048), {}
    params = SamplingParams(max_tokens=1, temperature=0)
    for _ in range(3):
        for n in sizes:
            for on in (False, True):
                eng.runner.prefill_kernel = on
                best = float("inf")
                for _ in range(4 if n < 1024 else 2):
                    prompt = [rng.randrange(100, 30000) for _ in range(n)]   # fresh: no prefix-cache hit
                    t0 = time.perf_counter()
                    eng.generate([prompt], params)
                    best = min(best, time.perf_counter() - t0)
                times.setdefault((n, on), []).append(best)
    print(f"### Whole prefills, bf16, {torch.get_num_threads()} thread(s): the prefill kernel off (sdpa) and on, "
          "medians of 3 alternations (each the best of 2-4)\n")
    print("| prompt tokens | sdpa | prefill kernel | speed-up |\n|---:|---:|---:|---:|")
    for n in sizes:
        off, on = statistics.median(times[(n, False)]), statistics.median(times[(n, True)])
        print(f"| {n} | {1e3 * off:.0f} ms | {1e3 * on:.0f} ms | {off / on:.2f}x |")
    if default_sdpa_from is not None:
        print(f"\nThe engine runs prompt chunks of {default_sdpa_from} tokens and more through sdpa on this CPU "
              "(AMX: engine.backends.AMX_SDPA_FROM), the kernel below that.")
    print()


def rss_child(args) -> None:
    """One backend's decode steps at batch x context; prints one JSON line."""
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.outputs import Rejected
    from engine.sampling_params import SamplingParams
    torch.set_num_threads(args.threads)
    batch, ctx = args.rss_batch, args.rss_context
    tokens = batch * (ctx + 2 * args.steps + 16)
    eng = LLMEngine(EngineConfig(model=args.model, attention_backend=args.backend, device="cpu",
                                 kv_cache_memory=tokens // 16 * eng_bytes_per_block(args.model, 16) + 2**20,
                                 max_num_seqs=batch, max_model_len=ctx + 4 * args.steps + 64))
    params = SamplingParams(temperature=0.0, max_tokens=4 * args.steps, ignore_eos=True)
    for i in range(batch):
        blocks = eng.reserve(ctx)
        assert blocks is not None, "pool too small"
        out = eng.add_prefilled(f"r{i}", [100 + (i + j) % 1000 for j in range(ctx)], 5, params, blocks)
        assert not isinstance(out, Rejected), out
    eng.step()
    base = _status_mib("VmRSS")
    _reset_peak_rss()
    ts = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        assert len(eng.step()) == batch
        ts.append(time.perf_counter() - t0)
    peak = _status_mib("VmHWM")
    print(json.dumps({"backend": eng.runner.attention_backend, "dtype": eng.runner.kv_shape.dtype,
                      "step_ms": statistics.median(ts) * 1e3, "rss_before_steps_mib": base,
                      "peak_rss_mib": peak, "steps_added_mib": peak - base,
                      "pool_mib": eng.runner.kv_pool.numel() * eng.runner.kv_pool.element_size() / 2**20}))


def eng_bytes_per_block(model: str, block_size: int) -> int:
    from transformers import AutoConfig

    from engine.model_dims import Dims
    d = Dims.of_config(AutoConfig.from_pretrained(model))
    return d.num_layers * 2 * block_size * d.num_kv_heads * d.head_dim * 2


def rss(args) -> None:
    print(f"### Decode steps at batch {args.rss_batch} x {args.rss_context} context, real model, "
          f"{args.threads} thread(s), each backend in a fresh process\n")
    print("| backend | KV dtype | step ms | KV pool MiB | RSS before steps MiB | peak RSS during steps MiB | peak - before MiB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for backend in ("torch", "paged"):
        cmd = [sys.executable, __file__, "--child", "--backend", backend, "--model", args.model,
               "--threads", str(args.threads), "--rss-batch", str(args.rss_batch),
               "--rss-context", str(args.rss_context), "--steps", str(args.steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = next((l for l in proc.stdout.splitlines() if l.startswith("{")), None)
        if line is None:
            print(f"| {backend} | failed: {proc.stderr.strip().splitlines()[-1:]} |")
            continue
        r = json.loads(line)
        print(f"| {r['backend']} | {r['dtype']} | {r['step_ms']:.0f} | {r['pool_mib']:.0f} | "
              f"{r['rss_before_steps_mib']:.0f} | {r['peak_rss_mib']:.0f} | {r['steps_added_mib']:.0f} |")
    print()


def layers(threads: int, dtype_name: str, block_sizes: list[int]) -> None:
    import torch

    from engine.kernels import cpu_kernels
    torch.set_num_threads(threads)
    kernels = cpu_kernels()
    if kernels is None:
        print("the CPU kernel could not be built; nothing to measure")
        return
    dtype = getattr(torch, dtype_name)
    n_layers, n_kv, heads, dim = 30, 3, 9, 64
    print(f"### The in-place decode kernel per layer, {dtype_name}, {threads} thread(s): microseconds "
          f"(GB/s of K/V), medians of 30 calls layer after layer (cold) and 10 of one layer (warm)\n")
    print("| batch x context | block size | K/V MB | cold | warm |")
    print("|---|---:|---:|---:|---:|")
    for (batch, ctx), bs in itertools.product(((1, 1024), (8, 256), (32, 256), (32, 512), (64, 2048)), block_sizes):
        nb = -(-ctx // bs)
        pool = torch.zeros(batch * nb + 1, n_layers, 2, bs, n_kv, dim, dtype=dtype).normal_()
        tables = torch.randperm(batch * nb + 1)[:batch * nb].view(batch, nb).contiguous()
        lens = torch.full((batch,), ctx)
        q = torch.randn(batch, heads, dim, dtype=dtype)

        def timed(layer_of, n):
            ts = []
            for i in range(n):
                t0 = time.perf_counter()
                kernels.paged_decode_attention(q, pool, tables, lens, layer_of(i), dim ** -0.5)
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts[2:]) * 1e6

        cold, warm = timed(lambda i: i % n_layers, 32), timed(lambda i: 5, 12)
        mb = batch * ctx * n_kv * dim * 2 * pool.element_size() / 1e6
        print(f"| {batch} x {ctx} | {bs} | {mb:.1f} | {cold:.0f} ({mb / cold * 1e3:.1f}) | {warm:.0f} ({mb / warm * 1e3:.1f}) |")
        del pool
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / ".cache/models/SmolLM2-135M-Instruct"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rss-batch", type=int, default=64)
    ap.add_argument("--rss-context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--skip-micro", action="store_true")
    ap.add_argument("--chunks", action="store_true", help="only the prompt-chunk comparison (3.)")
    ap.add_argument("--prefills", action="store_true", help="only the whole-prefill comparison (4.)")
    ap.add_argument("--layers", action="store_true", help="only the kernel per layer, cold and warm (5.)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="for --layers")
    ap.add_argument("--block-sizes", default="16", help="for --layers: KV block sizes, comma-separated "
                    "(the engine's default is 16)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="auto", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        rss_child(args)
        return
    print(f"$ {' '.join([Path(sys.executable).name, *sys.argv])}\n")
    if args.chunks or args.prefills or args.layers:
        if args.chunks:
            chunks(args.threads)
        elif args.layers:
            layers(args.threads, args.dtype, [int(b) for b in args.block_sizes.split(",")])
        else:
            prefills(args)
        print(f"(1-minute load average at end {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs)")
        return
    if not args.skip_micro:
        micro(args.threads)
    rss(args)
    print(f"(1-minute load average at end {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
