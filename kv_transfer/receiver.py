"""Decode side of the gloo/NCCL backend: the rendezvous host and its pairs.

Life cycle of a receiver:

    1. start    a TCPStore server on a free port of `host`; `address` ("host:port") is what the
                decode replica publishes. Threads: accept, lease reaper.
    2. accept   pop Handshakes from the "hello" queue in arrival order; judge each (secret,
                fingerprint, pair limit), write the HandshakeReply, and start a ReceiverPair
                thread (rank 0 of the pair's group) for each accepted one. Garbage is rejected
                and logged; it never stops the accept loop.
    3. serve    each pair thread lands transfers into reserved blocks (receiver_pair.py).
    4. close    fail open reservations, wake and join every thread, stop the store server.

Block ownership is tracked by `Reservations` (reservations.py): expect() hands blocks to the
receiver; the future's resolution hands them back to the engine.
"""

from __future__ import annotations

import logging
import secrets
import threading

import torch

from kv_transfer import rendezvous as rv
from kv_transfer.config import TransferConfig, negotiate_chunk_bytes
from kv_transfer.layout import block_bytes, check_pool, chunk_blocks_for, device_info
from kv_transfer.protocol import Fingerprint, Handshake, HandshakeReply, ProtocolError, clip, decode, encode
from kv_transfer.receiver_pair import ReceiverPair
from kv_transfer.reservations import Reservations, ReservingReceiver

log = logging.getLogger(__name__)


class KVReceiver(ReservingReceiver):
    """Receives KV into one local pool from any number of KVSenders. See KVReceiverBase.

    `host` must be an address senders can reach (the store and the pair groups bind to it).
    """

    def __init__(self, kv: torch.Tensor, fingerprint: Fingerprint, config: TransferConfig,
                 host: str = "127.0.0.1") -> None:
        check_pool(kv, fingerprint)
        self.kv, self.fingerprint, self.config, self.host = kv, fingerprint, config, host
        self.reservations = Reservations(config.lease_s, kv.shape[0])
        self._device = device_info(kv, host)
        self._server = rv.start_server(host, config.connect_timeout_s)
        self.address = f"[{host}]:{self._server.port}" if ":" in host else f"{host}:{self._server.port}"
        self._nonce = secrets.token_hex(16).encode()
        self._server.set(rv.NONCE_KEY, self._nonce)
        self._lock = threading.Lock()
        self._pairs: dict[int, ReceiverPair] = {}
        self._seen: set[int] = set()
        self._closed = False
        self._accept = threading.Thread(target=self._accept_loop, name="kvt-accept", daemon=True)
        self._accept.start()

    def health(self) -> str:
        """'' while this receiver can take transfers, else why not (closed, its accept thread
        or its lease reaper died, its store server gone)."""
        if self._closed or self._server is None:
            return "the KV receiver is closed"
        if not self._accept.is_alive():
            return "the KV receiver's accept thread died"
        return super().health()

    def pair_count(self) -> int:
        with self._lock:
            return len(self._pairs)

    def close(self) -> None:
        """Fail open reservations, stop every thread (a pair mid-transfer drains for at most
        transfer_timeout_s first), and stop the store server. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pairs = list(self._pairs.values())
        self.reservations.close()
        self._server.queue_push(rv.HELLO_QUEUE, rv.WAKE)
        for pair in pairs:
            pair.stop(self._server)
        self._accept.join(timeout=self.config.connect_timeout_s)
        for pair in pairs:
            pair.thread.join(timeout=self.config.connect_timeout_s + self.config.transfer_timeout_s)
        self._server = None  # stops the store server

    def _accept_loop(self) -> None:
        client = self._server.clone()
        client.set_timeout(rv.seconds(self.config.pair_idle_timeout_s))
        while True:
            try:
                raw = client.queue_pop(rv.HELLO_QUEUE)
            except Exception as exc:  # idle timeout: keep going; store gone: we are closing
                if self._closed:
                    return
                log.debug("kv accept: %s", clip(repr(exc)))
                continue
            if self._closed:
                return
            if raw == rv.WAKE:
                continue
            try:
                self._on_hello(client, raw)
            except Exception as exc:  # never let one peer stop the accept loop
                log.warning("kv handshake rejected: %s", clip(repr(exc)))

    def _on_hello(self, client, raw: bytes) -> None:
        hs = decode(raw, (Handshake,))  # ProtocolError: no pair id to answer; logged by caller
        allocated = int(client.add(rv.PAIRS_KEY, 0))
        with self._lock:
            if not 0 < hs.pair_id <= allocated or hs.pair_id in self._seen:
                raise ProtocolError(f"pair id {hs.pair_id} not allocated or reused")
            self._seen.add(hs.pair_id)
            full = len(self._pairs) >= self.config.max_pairs
        reason, backend = rv.judge(hs, self.fingerprint, self.config.secret, self._nonce, self._device)
        chunk_bytes = negotiate_chunk_bytes(self.config.chunk_bytes, hs.chunk_bytes, backend or "gloo")
        if not reason and full:
            reason = f"receiver has its maximum of {self.config.max_pairs} pairs"
        reply = HandshakeReply(hs.pair_id, not reason, reason, backend, chunk_bytes, self._device)
        if reason:
            log.warning("kv pair %d rejected: %s", hs.pair_id, reason)
            client.set(rv.reply_key(hs.pair_id), encode(reply))
            return
        pair = ReceiverPair(
            self.kv, self.reservations, self.config, self.address, self.host, hs.pair_id,
            backend, chunk_blocks_for(chunk_bytes, block_bytes(self.kv)), self._forget,
        )
        with self._lock:
            if self._closed:
                return
            self._pairs[hs.pair_id] = pair
        pair.start()
        client.set(rv.reply_key(hs.pair_id), encode(reply))

    def _forget(self, pair_id: int) -> None:
        with self._lock:
            self._pairs.pop(pair_id, None)
