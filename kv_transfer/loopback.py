"""In-process backend: the same API as the gloo/NCCL one, copying pool to pool directly.

For unit tests and for a colocated prefill+decode mode in one process. A `LoopbackReceiver`
registers itself under an address "loopback:<n>" in a process-local table; a `LoopbackSender`
looks the address up. Life cycle and block ownership are the network backend's (see the
package docstring): the receiver's reservations go PENDING -> TRANSFERRING -> DONE/FAILED in
the same `Reservations` table, the copy runs in the sender's thread, chunk by chunk (at most
`chunk_bytes` of temporary memory), and stops writing once a reservation is cancelled or
expires.
"""

from __future__ import annotations

import hmac
import itertools
import threading
import time
from typing import Sequence

import torch

from kv_transfer.base import InFlight, KVSenderBase, TransferResult, TransferState
from kv_transfer.config import TransferConfig, negotiate_chunk_bytes
from kv_transfer.layout import block_bytes, check_pool, chunk_blocks_for, chunk_plan
from kv_transfer.protocol import Fingerprint
from kv_transfer.reservations import Reservations, ReservingReceiver, check_block_ids
from kv_transfer.staging import copy_blocks

_registry: dict[str, LoopbackReceiver] = {}
_registry_lock = threading.Lock()
_ids = itertools.count(1)


class LoopbackReceiver(ReservingReceiver):
    """Decode side of the loopback backend. See KVReceiverBase for the contract."""

    def __init__(self, kv: torch.Tensor, fingerprint: Fingerprint, config: TransferConfig) -> None:
        check_pool(kv, fingerprint)
        self.kv, self.fingerprint, self.config = kv, fingerprint, config
        self.reservations = Reservations(config.lease_s, kv.shape[0])
        self.address = f"loopback:{next(_ids)}"
        with _registry_lock:
            _registry[self.address] = self

    def close(self) -> None:
        with _registry_lock:
            _registry.pop(self.address, None)
        self.reservations.close()

    def land(self, src: torch.Tensor, request_id: str, src_ids: tuple[int, ...],
             chunk_bytes: int, meta: bytes = b"") -> TransferResult:
        """Copy `src[src_ids]` into the blocks reserved for `request_id` (sender's thread)."""
        dst_ids = self.reservations.begin(request_id, len(src_ids))
        if isinstance(dst_ids, str):
            return TransferResult.failure(request_id, f"receiver: {dst_ids}")
        backend = "nccl" if self.kv.device.type == "cuda" else "gloo"  # for the default size only
        chunk = negotiate_chunk_bytes(self.config.chunk_bytes, chunk_bytes, backend)
        per_chunk = chunk_blocks_for(chunk, block_bytes(src))
        nbytes = 0
        try:
            for start, count in chunk_plan(len(src_ids), per_chunk):
                if not self.reservations.wanted(request_id):
                    break
                copy_blocks(src, src_ids[start:start + count], self.kv, dst_ids[start:start + count])
                nbytes += count * block_bytes(src)
        except Exception as exc:  # a copy fault must still resolve the reservation
            return self.reservations.finish(request_id, False, f"copy failed: {exc!r}")
        if self.kv.device.type == "cuda":
            torch.cuda.synchronize(self.kv.device)
        return self.reservations.finish(request_id, True, nbytes=nbytes, meta=meta)


class LoopbackSender(KVSenderBase):
    """Prefill side of the loopback backend. See KVSenderBase for the contract."""

    def __init__(self, kv: torch.Tensor, fingerprint: Fingerprint, config: TransferConfig) -> None:
        check_pool(kv, fingerprint)
        self.kv, self.fingerprint, self.config = kv, fingerprint, config
        self._inflight = InFlight()
        self._closed = False

    def _peer(self, address: str) -> LoopbackReceiver | str:
        if self._closed:
            raise RuntimeError("sender is closed")
        with _registry_lock:
            peer = _registry.get(address)
        if peer is None:
            return f"no loopback receiver at {address!r}"
        if peer.config.secret and not hmac.compare_digest(peer.config.secret, self.config.secret):
            return "handshake rejected: authentication failed"
        mismatch = peer.fingerprint.mismatch(self.fingerprint)
        return f"handshake rejected: fingerprint mismatch: {mismatch}" if mismatch else peer

    def send(self, address: str, request_id: str, block_ids: Sequence[int],
             meta: bytes = b"") -> TransferResult:
        ids = check_block_ids(block_ids, self.kv.shape[0])
        start = time.monotonic()
        peer = self._peer(address)
        if isinstance(peer, str):
            return TransferResult.failure(request_id, peer)
        self._inflight.set(request_id, TransferState.TRANSFERRING)
        try:
            result = peer.land(self.kv, request_id, ids, self.config.chunk_bytes, meta)
        finally:
            self._inflight.clear(request_id)
        return TransferResult(request_id, result.ok, result.error, result.nbytes,
                              time.monotonic() - start)

    def cancel(self, request_id: str) -> bool:
        return False   # a loopback send moves its data as soon as it starts: nothing waits

    def abort(self, address: str, request_id: str, reason: str) -> TransferResult:
        peer = self._peer(address)
        if isinstance(peer, str):
            return TransferResult.failure(request_id, peer)
        peer.reservations.fail(request_id, f"aborted by the sender: {reason}")
        return TransferResult(request_id, True)

    def state(self, request_id: str) -> TransferState | None:
        return self._inflight.get(request_id)

    def close(self) -> None:
        self._closed = True
