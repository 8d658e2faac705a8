"""Prefill side of the gloo/NCCL backend.

Life cycle of one send(address, request_id, block_ids, meta), in the caller's thread:

    1. pair     take an idle pair to `address`, or build one while the address has fewer than
                max_pairs_per_peer (connect to the receiver's store, take a pair id, push a
                Handshake, wait for the HandshakeReply, join the 2-rank group as rank 1, all
                within connect_timeout_s), else wait for one to come back (at most
                transfer_timeout_s). State PENDING; cancel() ends the send here.
    2. header   push the TransferHeader (with `meta`) onto the pair's frame queue. TRANSFERRING.
    3. data     send the blocks segment by segment: straight from the pool (CPU pools on
                gloo, any block layout), else gathered into staging first (pipeline.py).
    4. ack      wait for the receiver's Ack (steps 2-4 within transfer_timeout_s).
    5. result   give the pair back (a broken one is dropped) and return a TransferResult;
                nothing is raised for peer or network faults.

Each pair carries one transfer at a time, and several pairs to one address carry several at
once: a slow or stalled transfer holds only its own pair, never the hand-offs behind it.

Block ownership: the caller keeps `block_ids` allocated during send() and frees them when it
returns, whatever the result. send() only reads them (step 3), and never after returning.

A fault tears its pair down (closing its group; NCCL is aborted); the other pairs to that
address go on. A fault before the deadline on a pair that had already carried a transfer is
retried once on another pair, because the receiver may have dropped the idle pair meanwhile;
a timeout is not retried.
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
    client: object  # TCPStore client: frames and acks; used only by the send holding the pair
    channel: Channel
    staging: Staging
    chunk_blocks: int
    seq: int = 0
    broken: bool = False


@dataclass
class _Peer:
    """The pairs to one receiver address: the idle ones, and how many exist (idle, busy or
    being built), at most max_pairs_per_peer."""
    idle: list[_Pair] = field(default_factory=list)
    count: int = 0


class KVSender(KVSenderBase):
    """Sends KV blocks of one local pool to KVReceivers. Thread-safe; see KVSenderBase."""

    def __init__(self, kv: torch.Tensor, fingerprint: Fingerprint, config: TransferConfig) -> None:
        check_pool(kv, fingerprint)
        self.kv, self.fingerprint, self.config = kv, fingerprint, config
        self._cond = threading.Condition()   # guards _peers, _cancelled, _closed
        self._peers: dict[str, _Peer] = {}
        self._cancelled: set[str] = set()    # in-flight sends told to stop before their data
        self._inflight = InFlight()
        self._closed = False

    def send(self, address: str, request_id: str, block_ids: Sequence[int],
             meta: bytes = b"") -> TransferResult:
        ids = check_block_ids(block_ids, self.kv.shape[0])
        start = time.monotonic()
        self._inflight.set(request_id, TransferState.PENDING)
        try:
            for attempt in range(2):
                pair = self._acquire(address, request_id, start + self.config.transfer_timeout_s)
                if isinstance(pair, str):
                    return TransferResult.failure(request_id, pair, time.monotonic() - start)
                try:
                    result, retry = self._transfer(pair, request_id, ids, meta, start)
                finally:
                    self._give_back(pair)
                if not retry or attempt:
                    return result
                self._drop_idle(address)   # they idled as long: the receiver may have dropped them too
            raise AssertionError("unreachable")
        finally:
            with self._cond:
                self._inflight.clear(request_id)
                self._cancelled.discard(request_id)

    def cancel(self, request_id: str) -> bool:
        with self._cond:
            if self._inflight.get(request_id) is not TransferState.PENDING:
                return False
            self._cancelled.add(request_id)
            self._cond.notify_all()
            return True

    def abort(self, address: str, request_id: str, reason: str) -> TransferResult:
        pair = self._acquire(address, "", time.monotonic() + self.config.transfer_timeout_s)
        if isinstance(pair, str):
            return TransferResult.failure(request_id, pair)
        try:
            pair.client.queue_push(rv.frames_key(pair.pair_id), encode(Abort(request_id, clip(reason))))
            return TransferResult(request_id, True)
        except Exception as exc:
            self._drop(pair)
            return TransferResult.failure(request_id, f"abort not delivered: {clip(repr(exc))}")
        finally:
            self._give_back(pair)

    def state(self, request_id: str) -> TransferState | None:
        return self._inflight.get(request_id)

    def close(self) -> None:
        """Wait for the transfers in flight (each bounded by its own deadline), then say Bye on
        every pair and close it. Idempotent."""
        deadline = time.monotonic() + self.config.connect_timeout_s + self.config.transfer_timeout_s
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while any(p.count > len(p.idle) for p in self._peers.values()):
                if not self._cond.wait(max(deadline - time.monotonic(), 0)) and time.monotonic() >= deadline:
                    break
            pairs = [pair for peer in self._peers.values() for pair in peer.idle]
            for peer in self._peers.values():
                peer.count -= len(peer.idle)
                peer.idle.clear()
        for pair in pairs:
            try:
                pair.client.queue_push(rv.frames_key(pair.pair_id), encode(Bye("sender closed")))
            except Exception:
                pass  # the receiver reclaims the pair at its idle timeout instead
            pair.broken = True
            pair.channel.close(failed=False)
            pair.staging.release()

    def _acquire(self, address: str, request_id: str, deadline: float) -> _Pair | str:
        """An idle pair to `address`, a new one while the address has fewer than
        max_pairs_per_peer, else the first one given back before `deadline`; a string says
        why none (cancelled, closed, timed out, cannot pair)."""
        with self._cond:
            while True:
                if self._closed:
                    return "sender closed"
                if request_id in self._cancelled:
                    return "cancelled before its data moved"
                peer = self._peers.setdefault(address, _Peer())
                if peer.idle:
                    return peer.idle.pop()
                if peer.count < self.config.max_pairs_per_peer:
                    peer.count += 1
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return f"timed out waiting for a free pair to {address}"
                self._cond.wait(remaining)
        pair = self._build(address)  # outside the lock: other sends go on meanwhile
        if isinstance(pair, str):
            with self._cond:
                peer.count -= 1
                self._cond.notify_all()
        return pair

    def _give_back(self, pair: _Pair) -> None:
        with self._cond:
            peer = self._peers[pair.address]
            if pair.broken:
                peer.count -= 1
            else:
                peer.idle.append(pair)
            self._cond.notify_all()

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

    def _transfer(self, pair: _Pair, request_id: str, ids: tuple[int, ...], meta: bytes,
                  start: float) -> tuple[TransferResult, bool]:
        """Steps 2-4 on a pair this send holds. Returns (result, worth retrying on another pair)."""
        with self._cond:
            if request_id in self._cancelled:
                return TransferResult.failure(request_id, "cancelled before its data moved"), False
            self._inflight.set(request_id, TransferState.TRANSFERRING)
        reused = pair.seq > 0
        pair.seq += 1
        deadline = time.monotonic() + self.config.transfer_timeout_s
        try:
            return self._run(pair, request_id, ids, meta, start, deadline), False
        except AssertionError:
            raise
        except Exception as exc:  # boundary: every peer/network fault becomes a value
            self._drop(pair)
            error = f"transfer to {pair.address} failed: {clip(repr(exc))}"
            # A reused pair that failed fast (closed, e.g. dropped as idle) is worth a fresh
            # one; one that ran into its deadline (hung receiver) is not.
            retry = reused and time.monotonic() < deadline
            return TransferResult.failure(request_id, error, time.monotonic() - start), retry

    def _run(self, pair: _Pair, request_id: str, ids: tuple[int, ...], meta: bytes, start: float,
             deadline: float) -> TransferResult:
        counts = plan_segments(self.kv, pair.staging, ids, pair.chunk_blocks)
        header = TransferHeader(
            request_id=request_id, seq=pair.seq, num_blocks=len(ids),
            shape=transfer_shape(self.kv, len(ids)), dtype=DTYPE_NAMES[self.kv.dtype],
            nbytes=len(ids) * block_bytes(self.kv), chunk_blocks=pair.chunk_blocks,
            segments=group_segments(counts), meta=meta,
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

    def _drop_idle(self, address: str) -> None:
        with self._cond:
            peer = self._peers.get(address)
            stale = list(peer.idle) if peer is not None else []
            if peer is not None:
                peer.count -= len(stale)
                peer.idle.clear()
        for pair in stale:
            self._drop(pair)

    def _drop(self, pair: _Pair) -> None:
        """Tear `pair` down after a fault (by the send holding it; _give_back forgets it)."""
        pair.broken = True
        pair.channel.close(failed=True)
        pair.staging.release()


def _discard_late_pair(fut) -> None:
    """A pair that finished building after its caller gave up: nobody will use it."""
    pair = fut.result() if fut.exception() is None else None
    if isinstance(pair, _Pair):
        pair.channel.close(failed=True)
