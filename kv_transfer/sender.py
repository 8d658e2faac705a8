"""Prefill side of the gloo/NCCL backend.

Life cycle of one send(address, request_id, block_ids), in the caller's thread:

    1. pair     reuse the cached pair for `address`, or build one: connect to the receiver's
                store, take a pair id, push a Handshake, wait for the HandshakeReply, join the
                2-rank group as rank 1 (all within connect_timeout_s).
    2. queue    wait for the pair's lock: transfers on one pair are ordered (at most
                transfer_timeout_s). State PENDING.
    3. header   push the TransferHeader onto the pair's frame queue. State TRANSFERRING.
    4. data     send the blocks segment by segment: straight from the pool (CPU pools on
                gloo, any block layout), else gathered into staging first (pipeline.py).
    5. ack      wait for the receiver's Ack (steps 3-5 within transfer_timeout_s).
    6. result   return a TransferResult; nothing is raised for peer or network faults.

Block ownership: the caller keeps `block_ids` allocated during send() and frees them when it
returns, whatever the result. send() only reads them (step 4), and never after returning.

A fault tears the pair down (closing its group; NCCL is aborted) and the next send to that
address builds a fresh one. A fault before the deadline on a pair that had already carried a
transfer is retried once on a fresh pair, because the receiver may have dropped the idle pair
meanwhile; a timeout is not retried.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from kv_transfer import rendezvous as rv
from kv_transfer.base import InFlight, KVSenderBase, TransferResult, TransferState
from kv_transfer.channel import SENDER_RANK, Channel
from kv_transfer.config import TransferConfig
from kv_transfer.layout import (
    DTYPE_NAMES, block_bytes, check_pool, choose_backend, chunk_blocks_for,
    device_info, local_host_towards, transfer_shape,
)
from kv_transfer.pipeline import plan_segments, send_segments
from kv_transfer.protocol import (
    Abort, Ack, Bye, Fingerprint, Handshake, HandshakeReply, TransferHeader, clip, decode, encode,
    group_segments,
)
from kv_transfer.reservations import check_block_ids
from kv_transfer.staging import Staging


@dataclass
class _Pair:
    address: str
    pair_id: int
    client: object  # TCPStore client: frames and acks; used only under `lock`
    channel: Channel
    staging: Staging
    chunk_blocks: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    seq: int = 0
    broken: bool = False


class KVSender(KVSenderBase):
    """Sends KV blocks of one local pool to KVReceivers. Thread-safe; see KVSenderBase."""

    def __init__(self, kv: torch.Tensor, fingerprint: Fingerprint, config: TransferConfig) -> None:
        check_pool(kv, fingerprint)
        self.kv, self.fingerprint, self.config = kv, fingerprint, config
        self._lock = threading.Lock()
        self._pairs: dict[str, _Pair] = {}
        self._build_locks: dict[str, threading.Lock] = {}
        self._inflight = InFlight()
        self._closed = False

    def send(self, address: str, request_id: str, block_ids: Sequence[int]) -> TransferResult:
        ids = check_block_ids(block_ids, self.kv.shape[0])
        start = time.monotonic()
        self._inflight.set(request_id, TransferState.PENDING)
        try:
            for attempt in range(2):
                pair = self._pair(address)
                if isinstance(pair, str):
                    return TransferResult.failure(request_id, pair, time.monotonic() - start)
                result, retry = self._transfer(pair, request_id, ids, start)
                if not retry or attempt:
                    return result
            raise AssertionError("unreachable")
        finally:
            self._inflight.clear(request_id)

    def abort(self, address: str, request_id: str, reason: str) -> TransferResult:
        pair = self._pair(address)
        if isinstance(pair, str):
            return TransferResult.failure(request_id, pair)
        frame = encode(Abort(request_id, clip(reason)))
        if not pair.lock.acquire(timeout=self.config.transfer_timeout_s):
            return TransferResult.failure(request_id, "timed out waiting for the pair")
        try:
            pair.client.queue_push(rv.frames_key(pair.pair_id), frame)
            return TransferResult(request_id, True)
        except Exception as exc:
            self._drop(pair)
            return TransferResult.failure(request_id, f"abort not delivered: {clip(repr(exc))}")
        finally:
            pair.lock.release()

    def state(self, request_id: str) -> TransferState | None:
        return self._inflight.get(request_id)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pairs = list(self._pairs.values())
            self._pairs.clear()
        for pair in pairs:
            if pair.lock.acquire(timeout=self.config.transfer_timeout_s):
                try:
                    pair.client.queue_push(rv.frames_key(pair.pair_id), encode(Bye("sender closed")))
                except Exception:
                    pass  # the receiver reclaims the pair at its idle timeout instead
                finally:
                    pair.broken = True
                    pair.channel.close(failed=False)
                    pair.staging.release()
                    pair.lock.release()

    def _pair(self, address: str) -> _Pair | str:
        """The cached pair for `address`, else a newly built one; a string says why none."""
        with self._lock:
            if self._closed:
                raise RuntimeError("sender is closed")
            build_lock = self._build_locks.setdefault(address, threading.Lock())
        with build_lock:  # concurrent first sends to one address build one pair
            with self._lock:
                pair = self._pairs.get(address)
            if pair is not None:
                return pair
            pair = self._build(address)
            if isinstance(pair, _Pair):
                with self._lock:
                    closed = self._closed
                    if not closed:
                        self._pairs[address] = pair
                if closed:  # close() ran while we built it; it never saw this pair
                    self._drop(pair)
                    return "sender closed"
            return pair

    def _build(self, address: str) -> _Pair | str:
        """_connect() bounded by connect_timeout_s even if the receiver's store is frozen."""
        fut = rv.in_thread(lambda: self._connect(address), "kvt-connect")
        try:
            return fut.result(timeout=self.config.connect_timeout_s + 1.0)
        except TimeoutError:
            fut.add_done_callback(_discard_late_pair)
            return f"cannot pair with {address}: no answer in {self.config.connect_timeout_s:g}s"

    def _connect(self, address: str) -> _Pair | str:
        cfg = self.config
        deadline = time.monotonic() + cfg.connect_timeout_s
        try:
            client = rv.connect(address, cfg.connect_timeout_s)
            pair_id = int(client.add(rv.PAIRS_KEY, 1))
            local_host = local_host_towards(rv.parse_address(address)[0])
            device = device_info(self.kv, local_host)
            proof = rv.proof(cfg.secret, client.get(rv.NONCE_KEY), pair_id)
            hs = Handshake(pair_id, self.fingerprint, device, cfg.chunk_bytes, proof)
            client.queue_push(rv.HELLO_QUEUE, encode(hs))
            client.wait([rv.reply_key(pair_id)], rv.seconds(deadline - time.monotonic()))
            reply = decode(client.get(rv.reply_key(pair_id)), (HandshakeReply,))
            if not reply.accepted:
                return f"handshake rejected: {reply.reason}"
            if reply.pair_id != pair_id or reply.backend != choose_backend(device, reply.device):
                return f"bad handshake reply from {address}: {reply}"
            chunk_blocks = chunk_blocks_for(reply.chunk_bytes, block_bytes(self.kv))
            channel = Channel(reply.backend, client, pair_id, SENDER_RANK,
                              deadline - time.monotonic(), local_host, cfg.op_timeout_s)
        except AssertionError:
            raise
        except Exception as exc:  # boundary: every peer/network fault becomes a value
            return f"cannot pair with {address}: {clip(repr(exc))}"
        client.set_timeout(rv.seconds(cfg.transfer_timeout_s))  # bounds a live server's replies
        staging = Staging(self.kv, reply.backend, chunk_blocks)
        return _Pair(address, pair_id, client, channel, staging, chunk_blocks)

    def _transfer(self, pair: _Pair, request_id: str, ids: tuple[int, ...],
                  start: float) -> tuple[TransferResult, bool]:
        """Steps 2-6 on `pair`. Returns (result, whether a fresh pair is worth one retry)."""
        if not pair.lock.acquire(timeout=self.config.transfer_timeout_s):
            return TransferResult.failure(request_id, "timed out waiting for the pair",
                                          time.monotonic() - start), False
        try:
            if pair.broken:  # a send before us broke it while we waited
                return TransferResult.failure(request_id, "pair broke"), True
            reused = pair.seq > 0
            pair.seq += 1
            self._inflight.set(request_id, TransferState.TRANSFERRING)
            deadline = time.monotonic() + self.config.transfer_timeout_s
            try:
                return self._run(pair, request_id, ids, start, deadline), False
            except AssertionError:
                raise
            except Exception as exc:  # boundary: every peer/network fault becomes a value
                self._drop(pair)
                error = f"transfer to {pair.address} failed: {clip(repr(exc))}"
                # A reused pair that failed fast (closed, e.g. dropped as idle) is worth a fresh
                # one; one that ran into its deadline (hung receiver) is not.
                retry = reused and time.monotonic() < deadline
                return TransferResult.failure(request_id, error, time.monotonic() - start), retry
        finally:
            pair.lock.release()

    def _run(self, pair: _Pair, request_id: str, ids: tuple[int, ...], start: float,
             deadline: float) -> TransferResult:
        counts = plan_segments(self.kv, pair.staging, ids, pair.chunk_blocks)
        header = TransferHeader(
            request_id=request_id, seq=pair.seq, num_blocks=len(ids),
            shape=transfer_shape(self.kv, len(ids)), dtype=DTYPE_NAMES[self.kv.dtype],
            nbytes=len(ids) * block_bytes(self.kv), chunk_blocks=pair.chunk_blocks,
            segments=group_segments(counts),
        )
        pair.client.queue_push(rv.frames_key(pair.pair_id), encode(header))
        with pair.channel.device_stream(self.kv):
            sent = send_segments(pair.channel, pair.staging, self.kv, ids, counts, deadline)
        pop = rv.in_thread(lambda: pair.client.queue_pop(rv.acks_key(pair.pair_id)), "kvt-ack")
        ack = decode(pop.result(timeout=max(deadline - time.monotonic(), 0.001)), (Ack,))
        if (ack.request_id, ack.seq) != (request_id, pair.seq):
            raise RuntimeError(f"ack for {ack.request_id!r}/{ack.seq} out of order")
        elapsed = time.monotonic() - start
        if not ack.ok:
            return TransferResult.failure(request_id, f"receiver: {ack.error}", elapsed)
        return TransferResult(request_id, True, "", sent, elapsed)

    def _drop(self, pair: _Pair) -> None:
        """Tear `pair` down after a fault (caller holds pair.lock)."""
        with self._lock:
            if self._pairs.get(pair.address) is pair:
                del self._pairs[pair.address]
        pair.broken = True
        pair.channel.close(failed=True)
        pair.staging.release()


def _discard_late_pair(fut) -> None:
    """A pair that finished building after its caller gave up: nobody will use it."""
    pair = fut.result() if fut.exception() is None else None
    if isinstance(pair, _Pair):
        pair.channel.close(failed=True)
