"""Receiver-side reservation table: which blocks are promised to which request, and until when.

Block ownership on the decode side (the engine allocates and frees; this table only tracks):

    1. reserved     expect() -> PENDING. The engine has allocated the blocks and handed them to
                    the table; nothing writes them yet. Lease timer running.
    2. receiving    begin() -> TRANSFERRING. One pair thread writes the blocks, segment by segment,
                    checking wanted() between segments. A transfer for an id not PENDING here is
                    refused at once (drained and nacked): reservations come before transfers.
    3. landed       finish(ok=True) -> DONE. The future resolves ok: the blocks (now holding the
                    KV) belong to the engine again.
    4. failed       lease expiry, cancel(), fail() (sender Abort), close(), or finish(ok=False)
                    -> FAILED. The future resolves with an error: the engine frees the blocks.

A reservation that is TRANSFERRING when it is cancelled or its lease ends is only marked; its
pair thread stops writing, drains the rest, and resolves it. So a future resolves exactly once,
and only when nothing will write its blocks any more. Pure Python; no torch.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kv_transfer.base import KVReceiverBase, TransferResult, TransferState

_KEEP_FINISHED = 4096  # resolved request ids remembered for state()


def check_block_ids(block_ids: Sequence[int], num_blocks: int) -> tuple[int, ...]:
    """`block_ids` as a tuple; ValueError when empty, out of range, or repeated."""
    ids = tuple(int(b) for b in block_ids)
    if not ids:
        raise ValueError("block_ids must not be empty")
    if min(ids) < 0 or max(ids) >= num_blocks:
        raise ValueError(f"block ids must be in [0, {num_blocks})")
    if len(set(ids)) != len(ids):
        raise ValueError("block ids must be distinct")
    return ids


@dataclass
class _Reservation:
    block_ids: tuple[int, ...]
    deadline: float
    created: float
    future: Future = field(default_factory=Future)
    state: TransferState = TransferState.PENDING
    started: float = 0.0
    doomed: str = ""  # why a TRANSFERRING reservation must fail once its writer stops


class Reservations:
    """Thread-safe table of open reservations with a lease reaper thread.

    Called by: the engine side (add, cancel, state, close) and pair threads (begin, wanted,
    finish, fail). Futures are resolved outside the lock, so their callbacks may call back in.
    """

    def __init__(self, lease_s: float, num_blocks: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lease_s = lease_s
        self._num_blocks = num_blocks
        self._clock = clock
        self._cond = threading.Condition()
        self._open: dict[str, _Reservation] = {}
        self._finished: OrderedDict[str, TransferState] = OrderedDict()
        self._closed = ""
        self._reaper = threading.Thread(target=self._reap_loop, name="kvt-lease", daemon=True)
        self._reaper.start()

    def add(self, request_id: str, block_ids: Sequence[int]) -> Future:
        """Open a PENDING reservation. ValueError for bad block ids or an open `request_id`;
        RuntimeError if closed."""
        now = self._clock()
        ids = check_block_ids(block_ids, self._num_blocks)
        res = _Reservation(ids, deadline=now + self._lease_s, created=now)
        with self._cond:
            if self._closed:
                raise RuntimeError(f"receiver is closed: {self._closed}")
            if request_id in self._open:
                raise ValueError(f"request {request_id!r} is already expected")
            self._finished.pop(request_id, None)
            self._open[request_id] = res
            self._cond.notify_all()
        return res.future

    def begin(self, request_id: str, num_blocks: int) -> tuple[int, ...] | str:
        """PENDING -> TRANSFERRING for an incoming transfer of `num_blocks` blocks.

        The reservation exists before its transfer starts (the decode replica reserves before
        the prefill runs), so nothing waits here: returns the destination block ids, or a
        reason string when the data must be drained instead (unknown, cancelled or expired id,
        not PENDING, block-count mismatch; a mismatch also fails the reservation)."""
        with self._cond:
            res = self._open.get(request_id)
            if res is None:
                return f"unknown or expired request {request_id!r}"
            if res.state is not TransferState.PENDING:
                return f"request {request_id!r} is already {res.state.value}"
            if len(res.block_ids) != num_blocks:
                reason = f"sender has {num_blocks} blocks, receiver reserved {len(res.block_ids)}"
                resolved = self._resolve_locked(request_id, False, reason, 0)
            else:
                res.state, res.started = TransferState.TRANSFERRING, self._clock()
                return res.block_ids
        self._deliver(*resolved)
        return reason

    def wanted(self, request_id: str) -> bool:
        """Whether the writer of a TRANSFERRING reservation may keep writing its blocks."""
        with self._cond:
            res = self._open.get(request_id)
            return res is not None and not res.doomed

    def finish(self, request_id: str, ok: bool, error: str = "", nbytes: int = 0,
               meta: bytes = b"") -> TransferResult:
        """TRANSFERRING -> DONE/FAILED, called by the writer once it stopped writing. A doomed
        reservation fails with its doom reason even if all data landed. `meta`: the sender's
        bytes, handed to the future's result when ok."""
        with self._cond:
            res = self._open.get(request_id)
            assert res is not None and res.state is TransferState.TRANSFERRING, request_id
            if res.doomed:
                ok, error = False, res.doomed
            resolved = self._resolve_locked(request_id, ok, error, nbytes, meta)
        self._deliver(*resolved)
        return resolved[1]

    def fail(self, request_id: str, error: str) -> bool:
        """Fail reservation `request_id` now if PENDING, or mark it doomed if TRANSFERRING.
        False when it is not open."""
        with self._cond:
            res = self._open.get(request_id)
            if res is None:
                return False
            if res.state is TransferState.TRANSFERRING:
                res.doomed = res.doomed or error
                return True
            resolved = self._resolve_locked(request_id, False, error, 0)
        self._deliver(*resolved)
        return True

    def cancel(self, request_id: str) -> bool:
        return self.fail(request_id, "cancelled by the receiver")

    def state(self, request_id: str) -> TransferState | None:
        with self._cond:
            res = self._open.get(request_id)
            return res.state if res is not None else self._finished.get(request_id)

    def open_count(self) -> int:
        with self._cond:
            return len(self._open)

    def close(self, error: str = "receiver closed") -> None:
        """Fail every open reservation (TRANSFERRING ones when their writer stops). Idempotent."""
        with self._cond:
            self._closed = self._closed or error
            self._cond.notify_all()
            ids = list(self._open)
        for request_id in ids:
            self.fail(request_id, error)
        if self._reaper is not threading.current_thread():
            self._reaper.join(timeout=5)

    def alive(self) -> bool:
        """Whether the table takes reservations and its lease reaper runs."""
        with self._cond:
            return not self._closed and self._reaper.is_alive()

    def _resolve_locked(self, request_id: str, ok: bool, error: str, nbytes: int, meta: bytes = b""):
        res = self._open.pop(request_id)
        state = TransferState.DONE if ok else TransferState.FAILED
        self._finished[request_id] = state
        while len(self._finished) > _KEEP_FINISHED:
            self._finished.popitem(last=False)
        start = res.started or res.created
        result = TransferResult(request_id, ok, error, nbytes if ok else 0, self._clock() - start,
                                meta if ok else b"")
        return res.future, result

    @staticmethod
    def _deliver(future: Future, result: TransferResult) -> None:
        future.set_result(result)

    def _reap_loop(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = self._clock()
                due = [rid for rid, r in self._open.items() if r.deadline <= now and not r.doomed]
                if not due:
                    deadlines = [r.deadline for r in self._open.values() if not r.doomed]
                    wait = min(deadlines, default=now + 1.0) - now
                    self._cond.wait(timeout=min(max(wait, 0.001), 1.0))
                    continue
            for rid in due:
                self.fail(rid, f"lease of {self._lease_s:g}s expired before the transfer completed")


class ReservingReceiver(KVReceiverBase):
    """expect / cancel / state of every receiver backend: its `Reservations` table."""

    reservations: Reservations

    def expect(self, request_id: str, block_ids: Sequence[int]) -> Future:
        return self.reservations.add(request_id, block_ids)

    def cancel(self, request_id: str) -> bool:
        return self.reservations.cancel(request_id)

    def state(self, request_id: str) -> TransferState | None:
        return self.reservations.state(request_id)

    def health(self) -> str:
        return "" if self.reservations.alive() else "the receiver's reservation table is closed or its lease reaper died"
