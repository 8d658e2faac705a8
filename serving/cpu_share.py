"""Idle replicas lend their CPU threads to busy ones on the same machine.

Each replica runs `engine.num_threads` torch threads on the CPUs it reserved, and while its engine
has nothing to do those CPUs sit idle: on one machine a decode replica streaming one request runs
its step on one thread while the prefill replica's core waits for a prompt. With sharing, each
replica process holds a slot on a small board in shared memory, one board a Ray node: its own
thread count and whether its engine is busy. Before every step a busy engine takes its own threads
plus its share of the idle replicas' (`threads_for`), and it marks itself idle when its engine runs
out of work, so a prompt arriving at an idle prefill replica is answered on its own threads again
from the decode replica's next step on (a step already running keeps its threads: one step of
oversubscription at most).

Contract
  * `CpuShare.open(node, own)` registers this process on Ray node `node`'s board (one slot a
    replica; slots whose process is gone are taken back first), `close()` frees it (the last one
    out removes the board's file); the engine thread alone calls `busy()` (before each step: the
    thread count to step with) and `idle()` (when it has no work); after `close()` they give the
    replica's own threads and do nothing.
  * The board is advisory: no locks on the hot path (a slot is written by its owner only; a
    reader may see a neighbour's state one step late), the board file's lock only around
    registering and closing.
  * Nothing here touches torch: the engine sets its threads (`AsyncEngine`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import struct
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SLOTS = 64
_SLOT = struct.Struct("<iHH")          # pid (0: free), own threads, busy
_SIZE = SLOTS * _SLOT.size


def threads_for(own: int, others: list[tuple[int, bool]], limit: int) -> int:
    """Threads for a busy replica with `own` threads, beside `others` ((threads, busy) of the other
    replicas on the machine): its own plus a share of the idle ones' threads, in proportion to the
    busy replicas' own, rounded down; what is lent never takes the busy replicas together past
    `limit` (the machine's CPUs; more replicas than CPUs lend nothing)."""
    assert own >= 1 and limit >= 1
    idle = sum(t for t, busy in others if not busy)
    busy = own + sum(t for t, b in others if b)
    lent = max(0, min(idle, limit - busy))
    return own + lent * own // busy


def board_path(key: str) -> Path:
    """The board of Ray node `key` on this machine (shared memory where Linux has it)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"pdserve-cpu-{key}"


def _taken(board) -> list[tuple[int, int, int, bool]]:
    """(slot, pid, own threads, busy) of every taken slot of a board's bytes."""
    return [(i, pid, threads, bool(busy)) for i, (pid, threads, busy) in enumerate(_SLOT.iter_unpack(board)) if pid]


def read_board(path: Path) -> list[tuple[int, int, bool]]:
    """(pid, own threads, busy) of every taken slot of the board at `path` (diagnostics, tests)."""
    data = path.read_bytes()[:_SIZE] if path.exists() else b""
    return [(pid, threads, busy) for _, pid, threads, busy in _taken(data)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:            # someone else's process: alive
        return True
    return True


class CpuShare:
    def __init__(self, path: Path, own: int, limit: int | None = None, pid: int | None = None):
        assert own >= 1
        self.own = own
        self.limit = limit or len(os.sched_getaffinity(0))
        self.path = path
        self.pid = pid or os.getpid()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_size < _SIZE:
                os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
            self._register()
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self._busy = False

    @classmethod
    def open(cls, key: str, own: int) -> CpuShare | None:
        """This process's slot on node `key`'s board; None (and a log line) where the board
        cannot be made or is full: the replica then keeps its own threads."""
        try:
            return cls(board_path(key), own)
        except (OSError, RuntimeError) as exc:
            log.warning("CPU sharing off for this replica: %s", exc)
            return None

    def _register(self) -> None:
        """Take the first free slot, after freeing those whose process is gone (`self.slot`)."""
        for i, pid, _, _ in _taken(self._map):
            if not _alive(pid):                        # its process is gone: its slot is free
                _SLOT.pack_into(self._map, i * _SLOT.size, 0, 0, 0)
        taken = {i for i, *_ in _taken(self._map)}
        free = next((i for i in range(SLOTS) if i not in taken), None)
        if free is None:
            raise RuntimeError(f"the CPU board {self.path} is full ({SLOTS} replicas)")
        self.slot = free
        self._write(busy=False)

    def _write(self, busy: bool) -> None:
        """This replica's slot (written by its owner only)."""
        _SLOT.pack_into(self._map, self.slot * _SLOT.size, self.pid, self.own, int(busy))

    def busy(self) -> int:
        """Mark this replica busy; the threads to run its next step with (its own once closed)."""
        if self._map.closed:
            return self.own
        if not self._busy:
            self._busy = True
            self._write(busy=True)
        others = [(threads, b) for i, _, threads, b in _taken(self._map) if i != self.slot]
        return threads_for(self.own, others, self.limit)

    def idle(self) -> None:
        """Mark this replica idle: its threads are lent until its next `busy()`."""
        if self._busy and not self._map.closed:
            self._busy = False
            self._write(busy=False)

    def close(self) -> None:
        """Free this slot; the last replica out removes the board's file."""
        if self._map.closed:
            return
        _SLOT.pack_into(self._map, self.slot * _SLOT.size, 0, 0, 0)
        with contextlib.suppress(OSError), open(self.path, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX)          # no registration in between
            if not _taken(self._map):
                self.path.unlink()
        self._map.close()
