"""The receiver's reservation table: every path that ends a reservation resolves its future
exactly once, and never while its blocks may still be written."""

import threading
import time

import pytest

from kv_transfer.base import TransferState
from kv_transfer.reservations import Reservations


@pytest.fixture
def table():
    t = Reservations(lease_s=0.3, num_blocks=16)
    yield t
    t.close()


def test_land(table):
    fut = table.add("r", (4, 2))
    assert table.state("r") is TransferState.PENDING
    assert table.begin("r", 2) == (4, 2)
    assert table.state("r") is TransferState.TRANSFERRING and table.wanted("r")
    assert not fut.done()
    res = table.finish("r", True, nbytes=64)
    assert fut.result(0) == res and res.ok and res.nbytes == 64
    assert table.state("r") is TransferState.DONE and table.open_count() == 0


def test_unknown_mismatch_and_duplicate(table):
    assert "unknown" in table.begin("nope", 1)
    fut = table.add("r", (1, 2, 3))
    with pytest.raises(ValueError):
        table.add("r", (5,))
    assert "reserved 3" in table.begin("r", 2)  # count mismatch fails the reservation
    assert fut.result(0).ok is False and table.state("r") is TransferState.FAILED


def test_lease_expiry_resolves_pending(table):
    fut = table.add("r", (1,))
    res = fut.result(timeout=2)
    assert not res.ok and "lease" in res.error
    assert "unknown" in table.begin("r", 1)  # a late transfer is drained


def test_cancel_pending_and_transferring(table):
    fut = table.add("a", (1,))
    assert table.cancel("a") and fut.result(0).error == "cancelled by the receiver"
    assert not table.cancel("a")
    fut = table.add("b", (2,))
    table.begin("b", 1)
    assert table.cancel("b")
    assert not fut.done() and not table.wanted("b")  # writer must stop first
    res = table.finish("b", True, nbytes=8)  # even complete data fails once cancelled
    assert fut.result(0) == res and not res.ok and "cancelled" in res.error


def test_lease_while_transferring_waits_for_writer(table):
    fut = table.add("r", (1,))
    table.begin("r", 1)
    time.sleep(0.5)
    assert not fut.done() and not table.wanted("r")
    assert "lease" in table.finish("r", False).error


def test_close_fails_everything():
    t = Reservations(lease_s=60, num_blocks=16)
    pending, moving = t.add("p", (1,)), t.add("m", (2,))
    t.begin("m", 1)
    t.close()
    assert "closed" in pending.result(0).error and not moving.done()
    assert "closed" in t.finish("m", True).error
    with pytest.raises(RuntimeError):
        t.add("x", (3,))


def test_transfer_nobody_reserved_is_refused_at_once(table):
    """Reservations come before transfers: an unknown, resolved or cancelled id is refused
    without waiting, so its data is drained and the pair moves on."""
    assert "unknown" in table.begin("never", 1)
    table.add("done", (7,))
    table.begin("done", 1)
    table.finish("done", True)
    assert "unknown" in table.begin("done", 1)          # already resolved
    fut = table.add("gone", (3,))
    table.cancel("gone")
    assert not fut.result(0).ok and "unknown" in table.begin("gone", 1)


def test_meta_travels_with_a_landed_transfer_only(table):
    ok, bad = table.add("ok", (1,)), table.add("bad", (2,))
    table.begin("ok", 1)
    table.begin("bad", 1)
    table.finish("ok", True, nbytes=8, meta=b"first-token")
    table.finish("bad", False, "boom", meta=b"first-token")
    assert ok.result(0).meta == b"first-token" and bad.result(0).meta == b""
