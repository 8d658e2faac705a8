"""The transport interface both backends (loopback, gloo/NCCL) implement.

Sender side (prefill replica), called from the engine's or a service's threads:
    send(address, request_id, block_ids, meta=b"") -> TransferResult   blocking, thread-safe
    cancel(request_id) -> bool                               drop a send that moved no data yet
    abort(address, request_id, reason)  -> TransferResult    tell the receiver to give up
    state(request_id) -> TransferState | None                in-flight sends only
    close()

Receiver side (decode replica):
    address                                                  what the sender passes to send()
    expect(request_id, block_ids) -> Future[TransferResult]  reserve blocks for one transfer
    cancel(request_id) -> bool
    state(request_id) -> TransferState | None
    health() -> str                                          '' while it can receive, else why not
    close()

Errors caused by the peer or the network are values (`TransferResult.ok is False`), never
exceptions. Exceptions are raised only for the caller's own bugs (bad block ids, a request id
expected twice, a closed object): ValueError / RuntimeError.
"""

from __future__ import annotations

import abc
import enum
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Sequence


class TransferState(enum.Enum):
    """Where one transfer stands.

    PENDING: reserved (receiver) or queued for its pair (sender); no data moved yet.
    TRANSFERRING: data is moving; on the receiver, the reserved blocks are being written.
    DONE: the data landed in the reserved blocks (receiver) / was acknowledged (sender).
    FAILED: it ended any other way (timeout, cancel, abort, peer death, mismatch).
    """

    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class TransferResult:
    """The outcome of one transfer, on either side.

    ok: the KV landed in the receiver's reserved blocks. error: '' when ok, else why not.
    nbytes: KV bytes moved. seconds: time from the start of the transfer to its end.
    meta: on the receiver, the sender's `meta` bytes of a landed transfer (else b"").
    """

    request_id: str
    ok: bool
    error: str = ""
    nbytes: int = 0
    seconds: float = 0.0
    meta: bytes = b""

    @classmethod
    def failure(cls, request_id: str, error: str, seconds: float = 0.0) -> TransferResult:
        return cls(request_id=request_id, ok=False, error=error, seconds=seconds)


class _Closing(abc.ABC):
    """`with` support: close() on exit."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class KVSenderBase(_Closing):
    """Prefill side. Owns no blocks: the caller holds `block_ids` until send() returns (with
    any result), then frees them. send() never writes the caller's pool."""

    @abc.abstractmethod
    def send(self, address: str, request_id: str, block_ids: Sequence[int],
             meta: bytes = b"") -> TransferResult:
        """Copy blocks `block_ids` of the local pool into the blocks the receiver at `address`
        reserved for `request_id` (the reservation must exist already: a transfer nobody
        expects is refused at once, its data drained), and hand `meta` (at most 4 KiB) to the
        receiver with it. Blocks until the receiver acknowledges or a timeout or fault ends
        the transfer. At most two attempts (the second only after a fast fault, not a
        timeout, on a pair that had carried earlier transfers, e.g. one the receiver dropped
        as idle), each within
        transfer_timeout_s (a free pair to that address) + connect_timeout_s (building one)
        + transfer_timeout_s (data and Ack)."""

    @abc.abstractmethod
    def cancel(self, request_id: str) -> bool:
        """Drop the in-flight send of `request_id` if it has not started moving data (it is
        waiting for a pair): send() returns a failure at once. False when no such send waits
        (none in flight, or its data is already moving: that one runs to its end)."""

    @abc.abstractmethod
    def abort(self, address: str, request_id: str, reason: str) -> TransferResult:
        """Tell the receiver that `request_id` will not be sent, so it frees the reservation now
        instead of at lease expiry. ok means the notice was delivered to the pair."""

    @abc.abstractmethod
    def state(self, request_id: str) -> TransferState | None:
        """The state of an in-flight send of `request_id`, None when none is in flight."""

    @abc.abstractmethod
    def close(self) -> None:
        """Leave every pair. Idempotent."""


class KVReceiverBase(_Closing):
    """Decode side. Writes only into blocks reserved with expect(), and only until that
    reservation's future resolves."""

    address: str

    @abc.abstractmethod
    def expect(self, request_id: str, block_ids: Sequence[int]) -> Future:
        """Reserve `block_ids` (already allocated by the engine) for `request_id`'s KV, in token
        order. Call once per request, before the sender sends. The returned future resolves
        exactly once with a TransferResult: ok when the data landed; otherwise (lease expiry,
        cancel, sender abort, pair failure, close) an error. The engine keeps the blocks
        allocated until the future resolves, then owns them again: on ok it uses them, on
        error it frees them. After resolution the receiver never touches them again."""

    @abc.abstractmethod
    def cancel(self, request_id: str) -> bool:
        """Give up `request_id` (e.g. the client left). False if unknown or already resolved.
        The future resolves with an error now (PENDING) or as soon as the data in flight is
        drained (TRANSFERRING); the blocks are free to reuse only then."""

    @abc.abstractmethod
    def state(self, request_id: str) -> TransferState | None:
        """The state of reservation `request_id`; None when unknown or forgotten."""

    @abc.abstractmethod
    def health(self) -> str:
        """'' while the receiver can take transfers; else why it cannot (closed, a thread it
        needs is dead). Cheap; for a replica's health check."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop accepting; resolve every open reservation with an error. Idempotent."""


class InFlight:
    """request_id -> TransferState of the sends in progress in one sender (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[str, TransferState] = {}

    def set(self, request_id: str, state: TransferState) -> None:
        with self._lock:
            self._states[request_id] = state

    def clear(self, request_id: str) -> None:
        with self._lock:
            self._states.pop(request_id, None)

    def get(self, request_id: str) -> TransferState | None:
        with self._lock:
            return self._states.get(request_id)
