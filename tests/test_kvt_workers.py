"""Support for the two-process kv_transfer tests (no tests here): a tiny block free-list that
plays the engine's part, and a worker process hosting a KVReceiver or a KVSender, driven over a
pipe. The pipe is test plumbing between our own processes, not the transfer wire."""

from __future__ import annotations

import multiprocessing as mp
import random
import threading
import time

import torch

SHAPE = (64, 2, 2, 4, 2, 8)  # blocks, layers, K/V, block size, heads, head dim: 1 KiB per block
NUM_BLOCKS = SHAPE[0]
MODEL = "test-model"
# connect_timeout_s and lease_s leave room for a TCPStore connection that stalls 5 s on a
# dropped reverse-DNS query (torch looks up the peer's name on every store connection; this
# sandbox's resolver drops a few percent of those queries).
BASE_CFG = dict(connect_timeout_s=15.0, transfer_timeout_s=5.0, lease_s=20.0,
                chunk_bytes=4096, secret="s3cret")  # 4 blocks per chunk, so most transfers are multi-chunk


class FreeList:
    """The engine's block bookkeeping, reduced to a free set. Thread-safe."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self._free = set(range(n))
        self._lock = threading.Lock()
        self._rng = random.Random(seed)

    def allocate(self, n: int) -> list[int]:
        """n free blocks in a random order (so never contiguous in practice)."""
        with self._lock:
            ids = self._rng.sample(sorted(self._free), n)
            self._free.difference_update(ids)
            return ids

    def free(self, ids) -> None:
        with self._lock:
            assert not self._free.intersection(ids), "double free"
            self._free.update(ids)

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._free)


def expect_and_free_on_resolve(receiver, free: FreeList, request_id: str, n: int):
    """Reserve n blocks the way the decode engine would: free them when the future resolves
    with an error. (Landed blocks would go to the running request; the tests free them too so
    that a full free-list means nothing leaked.)"""
    ids = free.allocate(n)
    fut = receiver.expect(request_id, ids)
    fut.add_done_callback(lambda _: free.free(ids))
    return ids, fut


def send_and_free(sender, free: FreeList, address: str, request_id: str, n: int):
    """Send n freshly allocated blocks the way the prefill engine would: free them once send()
    returns, whatever the result. Returns (result, the data that was sent)."""
    ids = free.allocate(n)
    data = sender.kv[ids].clone()
    try:
        return sender.send(address, request_id, ids), data
    finally:
        free.free(ids)


def _slow(fn, delay_s: float, started):
    def wrapper(*args, **kwargs):
        started.set()
        time.sleep(delay_s)
        return fn(*args, **kwargs)
    return wrapper


def worker_main(conn, role: str, seed: int, cfg_kwargs: dict, model: str, slow_s: float,
                started) -> None:
    """Host a KVReceiver ('receiver') or KVSender ('sender') over a pool of SHAPE and serve
    commands from `conn` until 'stop'. slow_s > 0 slows every message and sets `started`
    at the first one (to kill the process mid-transfer)."""
    from kv_transfer import KVReceiver, KVSender, TransferConfig, fingerprint_for
    from kv_transfer.channel import Channel

    torch.manual_seed(seed)
    kv = torch.randn(SHAPE) if role == "sender" else torch.zeros(SHAPE)
    if slow_s:  # every message posted on a pair of this process waits slow_s first
        Channel.post_send = _slow(Channel.post_send, slow_s, started)
        Channel.post_recv = _slow(Channel.post_recv, slow_s, started)
    cfg, fp, free = TransferConfig(**cfg_kwargs), fingerprint_for(kv, model), FreeList(NUM_BLOCKS, seed)
    end = KVReceiver(kv, fp, cfg) if role == "receiver" else KVSender(kv, fp, cfg)
    futures = {}
    conn.send(getattr(end, "address", None))
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            end.close()
            conn.send(None)
            return
        if cmd == "expect":
            ids, futures[args[0]] = expect_and_free_on_resolve(end, free, *args)
            conn.send(ids)
        elif cmd == "result":
            conn.send(futures.pop(args[0]).result(timeout=args[1]))
        elif cmd == "read":
            conn.send(kv[args[0]].clone())
        elif cmd == "send":
            conn.send(send_and_free(end, free, *args))
        elif cmd == "free_count":
            conn.send(free.count)


class Worker:
    """A spawned worker process and its command pipe."""

    def __init__(self, role: str, seed: int = 1, model: str = MODEL, slow_s: float = 0.0,
                 **cfg) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.started = ctx.Event()
        self.proc = ctx.Process(target=worker_main, daemon=True, args=(
            child, role, seed, {**BASE_CFG, **cfg}, model, slow_s, self.started))
        self.proc.start()
        self.address = self._recv(60)

    def _recv(self, timeout: float):
        if not self._conn.poll(timeout):
            raise TimeoutError("worker did not answer")
        return self._conn.recv()

    def call(self, *cmd, timeout: float = 30):
        self._conn.send(cmd)
        return self._recv(timeout)

    def post(self, *cmd) -> None:
        """Send a command now; collect its answer later with answer()."""
        self._conn.send(cmd)

    def answer(self, timeout: float = 30):
        return self._recv(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=20)
            finally:
                self.proc.join(10)
        if self.proc.is_alive():
            self.kill()
