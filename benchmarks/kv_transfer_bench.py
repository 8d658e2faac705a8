"""KV transfer throughput: kv_transfer (gloo) vs a raw ProcessGroupGloo send of the same bytes.

Two processes: this one sends, a spawned one receives. For each prompt length, both paths move
the KV of that many tokens for the default model's KV shape (SmolLM2-135M: 30 layers, 3 KV
heads, head dim 64, float32, block size 16):

    raw:  one contiguous tensor, ProcessGroupGloo.send -> recv, then a 1-byte reply
    ours: KVSender.send into reserved blocks, timed the same way (until the Ack), for two
          block layouts on both sides:
            runs       one ascending run of block ids on each side (a fresh pool)
            scattered  random block ids on each side (a fragmented pool)
          Both go straight between pool and wire (a block-major pool holds each block
          contiguously), in messages of up to --chunk-kib (default: the gloo default, 4 MiB).

Each figure is the median of --repeats runs after one warm-up (pair set-up excluded). With
--model DIR it also times a float32 prefill forward of the same prompt lengths and prints
transfer time / prefill time.

    .venv/bin/python benchmarks/kv_transfer_bench.py [--model DIR] [--tokens 1024 4096]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kv_transfer import KVReceiver, KVSender, TransferConfig, fingerprint_for  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
TIMEOUT = datetime.timedelta(seconds=60)


def pool(num_blocks: int, fill: bool, device: str) -> torch.Tensor:
    shape = (num_blocks, LAYERS, 2, BLOCK, HEADS, HEAD_DIM)
    kv = torch.randn(shape) if fill else torch.zeros(shape)
    return kv.to(device)


def raw_group(store, rank: int):
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = TIMEOUT
    return dist.ProcessGroupGloo(dist.PrefixStore("raw/", store), rank, 2, opts)


def receiver_main(conn, num_blocks: int, max_bytes: int, chunk_bytes: int, device: str) -> None:
    """Receiver process: a KVReceiver plus a raw gloo rank 0, driven by commands on `conn`."""
    kv = pool(num_blocks, fill=False, device=device)
    cfg = TransferConfig(chunk_bytes=chunk_bytes, lease_s=120, transfer_timeout_s=60)
    receiver = KVReceiver(kv, fingerprint_for(kv, "bench"), cfg)
    raw_store = dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False)
    conn.send((receiver.address, raw_store.port))
    raw_pg = raw_group(raw_store, 0)
    buf, reply = torch.empty(max_bytes, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    futures = {}
    while True:
        cmd, *args = conn.recv()
        if cmd == "raw":
            raw_pg.recv([buf[: args[0]]], 1, 0).wait()
            raw_pg.send([reply], 1, 0).wait()
        elif cmd == "expect":
            futures[args[0]] = receiver.expect(args[0], args[1])
            conn.send(None)
        elif cmd == "result":
            res = futures.pop(args[0]).result(60)
            conn.send((res.ok, res.error, float(kv[args[1]].double().sum())))
        elif cmd == "stop":
            receiver.close()
            return


def block_ids(layout: str, n: int, num_blocks: int, gen: torch.Generator) -> list[int]:
    if layout == "runs":
        start = int(torch.randint(0, num_blocks - n + 1, (1,), generator=gen))
        return list(range(start, start + n))
    return torch.randperm(num_blocks, generator=gen)[:n].tolist()


def bench_transfers(tokens_list, layouts, repeats: int, chunk_bytes: int, device: str) -> dict:
    """{(tokens, layout): (raw seconds, ours seconds)} medians."""
    max_blocks = max(tokens_list) // BLOCK
    num_blocks = 2 * max_blocks + 7
    max_bytes = max_blocks * LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 4
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(child, num_blocks, max_bytes, chunk_bytes, device))
    proc.start()
    address, raw_port = conn.recv()
    raw_pg = raw_group(dist.TCPStore("127.0.0.1", raw_port, None, False, TIMEOUT), 1)
    kv = pool(num_blocks, fill=True, device=device)
    sender = KVSender(kv, fingerprint_for(kv, "bench"),
                      TransferConfig(chunk_bytes=chunk_bytes, transfer_timeout_s=60))
    data, reply = torch.randint(0, 255, (max_bytes,), dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for tokens, layout in [(t, lay) for t in tokens_list for lay in layouts]:
        n = tokens // BLOCK
        nbytes = n * LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 4
        raw_times, our_times = [], []
        for i in range(repeats + 1):  # first round is warm-up
            conn.send(("raw", nbytes))
            start = time.perf_counter()
            raw_pg.send([data[:nbytes]], 0, 0).wait()
            raw_pg.recv([reply], 0, 0).wait()
            raw_times.append(time.perf_counter() - start)

            src, dst = block_ids(layout, n, num_blocks, gen), block_ids(layout, n, num_blocks, gen)
            rid = f"{tokens}-{layout}-{i}"
            conn.send(("expect", rid, dst))
            conn.recv()
            start = time.perf_counter()
            res = sender.send(address, rid, src)
            our_times.append(time.perf_counter() - start)
            conn.send(("result", rid, dst))
            ok, error, checksum = conn.recv()
            assert res.ok and ok, (res.error, error)
            assert abs(checksum - float(kv[src].double().sum())) < 1e-3, "data mismatch"
        out[tokens, layout] = (statistics.median(raw_times[1:]), statistics.median(our_times[1:]))
    sender.close()
    conn.send(("stop",))
    proc.join(30)
    return out


def bench_prefill(model_dir: str, tokens_list, device: str) -> dict[int, float]:
    """{tokens: seconds} of one float32 forward over a random prompt on `device` (after a warm-up)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    vocab = model.config.vocab_size
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    out = {}
    with torch.inference_mode():
        model(torch.randint(0, vocab, (1, 128), device=device))
        for tokens in tokens_list:
            ids = torch.randint(0, vocab, (1, tokens), device=device)
            sync()
            start = time.perf_counter()
            model(ids)
            sync()
            out[tokens] = time.perf_counter() - start
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--layouts", nargs="+", default=["runs", "scattered"],
                        choices=["runs", "scattered"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--chunk-kib", type=int, default=0, help="largest message; 0 = the default")
    parser.add_argument("--model", help="HF model directory; adds prefill time and the ratio")
    parser.add_argument("--device", default="cpu",
                        help="where both pools live: cpu, or cuda (one GPU: both processes share it, so the "
                             "pair runs on gloo through pinned host staging; the raw baseline stays on host)")
    args = parser.parse_args()
    results = bench_transfers(args.tokens, args.layouts, args.repeats, args.chunk_kib << 10, args.device)
    prefill = bench_prefill(args.model, args.tokens, args.device) if args.model else {}
    chunk = f"{args.chunk_kib} KiB" if args.chunk_kib else "default"
    print(f"torch {torch.__version__}, pools on {args.device}, {torch.get_num_threads()} threads, chunk {chunk}, "
          f"median of {args.repeats}; KV {LAYERS}L x {HEADS}H x {HEAD_DIM}D fp32, block {BLOCK}")
    head = (f"{'tokens':>6} {'layout':>9} {'MB':>7} {'raw GB/s':>9} {'ours GB/s':>10} {'ours/raw':>9} "
            f"{'ours ms':>8}")
    print(head + (f" {'prefill ms':>11} {'xfer/prefill':>13}" if prefill else ""))
    for (tokens, layout), (raw_s, our_s) in results.items():
        mb = tokens * LAYERS * 2 * HEADS * HEAD_DIM * 4 / 1e6
        line = (f"{tokens:>6} {layout:>9} {mb:>7.1f} {mb / 1e3 / raw_s:>9.2f} {mb / 1e3 / our_s:>10.2f} "
                f"{raw_s / our_s:>8.0%} {our_s * 1e3:>8.1f}")
        if prefill:
            line += f" {prefill[tokens] * 1e3:>11.1f} {our_s / prefill[tokens]:>12.1%}"
        print(line)


if __name__ == "__main__":
    main()
