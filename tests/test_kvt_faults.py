"""Fault paths of the gloo backend: peer death mid-transfer on either side, garbage at the
rendezvous, broken and idle pairs, cancel mid-transfer, receiver shutdown. Each checks that
every block on the surviving side goes back to its free-list."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import threading
import time

import pytest
import torch
from torch.distributed import TCPStore

from kv_transfer import KVReceiver, KVSender, TransferConfig, fingerprint_for
from kv_transfer.channel import Channel
from kv_transfer import rendezvous as rv
from kv_transfer.layout import device_info
from kv_transfer.protocol import Handshake, HandshakeReply, decode, encode
from test_kvt_workers import (
    BASE_CFG, MODEL, NUM_BLOCKS, SHAPE, FreeList, Worker, expect_and_free_on_resolve, send_and_free,
)

TRANSFER_TIMEOUT = BASE_CFG["transfer_timeout_s"]


def _local(role: str, seed: int = 5, **cfg):
    """A receiver or sender in this process, with a free-list attached."""
    torch.manual_seed(seed)
    kv = torch.randn(SHAPE) if role == "sender" else torch.zeros(SHAPE)
    cls = KVSender if role == "sender" else KVReceiver
    end = cls(kv, fingerprint_for(kv, MODEL), TransferConfig(**{**BASE_CFG, **cfg}))
    end.free = FreeList(NUM_BLOCKS, seed)
    return end


def pairs(tx) -> list[int]:
    """The ids of the sender's idle pairs (with no send running, every pair it has)."""
    return [pair.pair_id for peer in tx._peers.values() for pair in peer.idle]


def test_receiver_killed_mid_transfer():
    rx = Worker("receiver", slow_s=0.3)  # 0.3 s per chunk: 16 blocks take > 1 s
    tx = _local("sender")
    try:
        rx.call("expect", "doomed", 16)
        out = {}
        sender = threading.Thread(target=lambda: out.update(
            res=send_and_free(tx, tx.free, rx.address, "doomed", 16)[0]))
        sender.start()
        assert rx.started.wait(30), "transfer never started"
        killed_at = time.monotonic()
        rx.kill()
        sender.join(TRANSFER_TIMEOUT + 5)
        waited = time.monotonic() - killed_at
        assert not sender.is_alive() and not out["res"].ok
        assert waited < TRANSFER_TIMEOUT, f"sender noticed only after {waited:.1f}s"
        assert tx.free.count == NUM_BLOCKS and tx.state("doomed") is None
        assert pairs(tx) == []  # the broken pair was torn down
    finally:
        tx.close()
        rx.kill()


def test_hung_receiver_times_out_instead_of_hanging():
    rx = Worker("receiver")
    tx = _local("sender", transfer_timeout_s=2.0)
    try:
        rx.call("expect", "warm", 2)
        assert send_and_free(tx, tx.free, rx.address, "warm", 2)[0].ok  # the pair exists
        os.kill(rx.proc.pid, signal.SIGSTOP)  # alive, but answers nothing
        start = time.monotonic()
        res, _ = send_and_free(tx, tx.free, rx.address, "hung", 40)
        waited = time.monotonic() - start
        assert not res.ok and waited < 2.0 + 3, (waited, res.error)  # a timeout: no retry
        assert tx.free.count == NUM_BLOCKS and pairs(tx) == []
        fresh = _local("sender", connect_timeout_s=2.0)  # must build a pair: the store is frozen
        start = time.monotonic()
        res, _ = send_and_free(fresh, fresh.free, rx.address, "hung-2", 4)
        waited = time.monotonic() - start
        assert not res.ok and "no answer" in res.error and waited < 2.0 + 1 + 2, waited
        assert fresh.free.count == NUM_BLOCKS
        fresh.close()
    finally:
        os.kill(rx.proc.pid, signal.SIGCONT)
        tx.close()
        rx.kill()


def test_sender_killed_mid_transfer():
    receiver = _local("receiver")
    tx = Worker("sender", slow_s=0.3)
    try:
        _, fut = expect_and_free_on_resolve(receiver, receiver.free, "orphan", 16)
        tx.post("send", receiver.address, "orphan", 16)
        assert tx.started.wait(30), "transfer never started"
        killed_at = time.monotonic()
        tx.kill()
        res = fut.result(timeout=TRANSFER_TIMEOUT + 5)
        assert not res.ok and "transfer failed" in res.error
        assert time.monotonic() - killed_at < TRANSFER_TIMEOUT  # before any timeout fired
        assert receiver.free.count == NUM_BLOCKS
        for _ in range(50):  # the pair thread exits right after resolving
            if receiver.pair_count() == 0:
                break
            time.sleep(0.1)
        assert receiver.pair_count() == 0
    finally:
        tx.kill()
        receiver.close()


def _store_client(address: str) -> TCPStore:
    host, port = rv.parse_address(address)
    return TCPStore(host, port, None, False, datetime.timedelta(seconds=15))


def test_garbage_at_the_rendezvous_is_rejected_and_service_continues():
    rx = Worker("receiver")
    tx = _local("sender")
    try:
        host, port = rv.parse_address(rx.address)
        for junk in (os.urandom(4096), b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", b"\xff" * 9):
            with socket.create_connection((host, port), timeout=5) as s:
                s.sendall(junk)
        client = _store_client(rx.address)
        client.queue_push(rv.HELLO_QUEUE, b"\x93garbage handshake \x00\xff")
        kv = torch.zeros(SHAPE)
        fp, dev = fingerprint_for(kv, MODEL), device_info(kv, host)
        client.queue_push(rv.HELLO_QUEUE, encode(Handshake(10**6, fp, dev, 4096, "")))
        pair_id = int(client.add(rv.PAIRS_KEY, 1))  # a real id, but a forged secret
        client.queue_push(rv.HELLO_QUEUE, encode(Handshake(pair_id, fp, dev, 4096, "forged")))
        client.wait([rv.reply_key(pair_id)], datetime.timedelta(seconds=5))
        reply = decode(client.get(rv.reply_key(pair_id)), (HandshakeReply,))
        assert not reply.accepted and "authentication failed" in reply.reason

        ids = rx.call("expect", "good", 7)
        res, sent = send_and_free(tx, tx.free, rx.address, "good", 7)
        assert res.ok, res.error
        assert rx.call("result", "good", 10).ok and torch.equal(rx.call("read", ids), sent)

        # garbage on an established pair's frame queue: the receiver drops that pair, and
        # the sender's next transfer rebuilds it transparently
        [old_pair] = pairs(tx)
        client.queue_push(rv.frames_key(old_pair), b"not a frame")
        time.sleep(0.5)
        ids = rx.call("expect", "rebuilt", 5)
        res, sent = send_and_free(tx, tx.free, rx.address, "rebuilt", 5)
        assert res.ok, res.error
        assert pairs(tx) and old_pair not in pairs(tx)
        assert rx.call("result", "rebuilt", 10).ok and torch.equal(rx.call("read", ids), sent)
        assert tx.free.count == NUM_BLOCKS and rx.call("free_count") == NUM_BLOCKS
    finally:
        tx.close()
        rx.stop()


def test_idle_pair_is_dropped_and_rebuilt():
    receiver = _local("receiver", pair_idle_timeout_s=0.5)
    tx = _local("sender")
    try:
        for rid in ("before-idle", "after-idle"):
            _, fut = expect_and_free_on_resolve(receiver, receiver.free, rid, 3)
            res, _ = send_and_free(tx, tx.free, receiver.address, rid, 3)
            assert res.ok and fut.result(5).ok, res.error
            time.sleep(1.5)
            assert receiver.pair_count() == 0  # idle pair reclaimed
        assert receiver.free.count == NUM_BLOCKS and tx.free.count == NUM_BLOCKS
    finally:
        tx.close()
        receiver.close()


def test_cancel_mid_transfer_drains_without_writing(monkeypatch):
    started = threading.Event()
    real_post_recv = Channel.post_recv

    def slow_post_recv(self, tensor):
        started.set()
        time.sleep(0.2)  # the cancel below lands while the first segment's receive is posted
        return real_post_recv(self, tensor)

    monkeypatch.setattr(Channel, "post_recv", slow_post_recv)
    receiver, tx = _local("receiver"), _local("sender")
    try:
        ids, fut = expect_and_free_on_resolve(receiver, receiver.free, "cancelled", 12)
        out = {}
        sender = threading.Thread(target=lambda: out.update(
            res=send_and_free(tx, tx.free, receiver.address, "cancelled", 12)[0]))
        sender.start()
        assert started.wait(30)
        assert receiver.cancel("cancelled")
        sender.join(10)
        res = fut.result(5)
        assert not res.ok and "cancelled" in res.error and "cancelled" in out["res"].error
        # wanted() is checked as each receive is posted: only the first segment was written
        assert receiver.kv[ids[1:]].abs().sum() == 0 and receiver.kv[ids[0]].abs().sum() > 0
        assert receiver.free.count == NUM_BLOCKS and tx.free.count == NUM_BLOCKS
        _, fut = expect_and_free_on_resolve(receiver, receiver.free, "next", 2)
        assert send_and_free(tx, tx.free, receiver.address, "next", 2)[0].ok  # pair in sync
    finally:
        tx.close()
        receiver.close()


def test_receiver_close_fails_reservations_and_senders_fast():
    receiver, tx = _local("receiver"), _local("sender")
    _, fut = expect_and_free_on_resolve(receiver, receiver.free, "warmup", 2)
    assert send_and_free(tx, tx.free, receiver.address, "warmup", 2)[0].ok
    _, fut = expect_and_free_on_resolve(receiver, receiver.free, "open", 4)
    receiver.close()
    assert "closed" in fut.result(1).error and receiver.free.count == NUM_BLOCKS
    start = time.monotonic()
    res, _ = send_and_free(tx, tx.free, receiver.address, "late", 2)
    assert not res.ok and time.monotonic() - start < 2
    with pytest.raises(RuntimeError):
        receiver.expect("after-close", [1])
    tx.close()


def _stall_first_receive(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """The first segment receive posted in this process waits for `release` (set by the test);
    `stalled` says it is waiting. Later receives run normally."""
    stalled, release = threading.Event(), threading.Event()
    real_post_recv, calls = Channel.post_recv, []

    def post_recv(self, tensor):
        calls.append(1)
        if len(calls) == 1:
            stalled.set()
            release.wait(30)
        return real_post_recv(self, tensor)

    monkeypatch.setattr(Channel, "post_recv", post_recv)
    return stalled, release


def _send_in_thread(tx, address: str, rid: str, n: int, out: dict) -> threading.Thread:
    thread = threading.Thread(target=lambda: out.update({rid: send_and_free(tx, tx.free, address, rid, n)[0]}))
    thread.start()
    return thread


def _start_stalled(stalled, receiver, tx, rid: str, n: int, out: dict):
    """Reserve and send `rid` (n blocks) from a thread until its data is stalled; (thread, future)."""
    _, fut = expect_and_free_on_resolve(receiver, receiver.free, rid, n)
    thread = _send_in_thread(tx, receiver.address, rid, n, out)
    assert stalled.wait(30)
    return thread, fut


def _release_and_land(release, thread, out: dict, rid: str, fut, receiver, tx) -> None:
    """Let the stalled transfer `rid` go on: it lands, and both free-lists are full again."""
    release.set()
    thread.join(30)
    assert out[rid].ok and fut.result(10).ok
    assert receiver.free.count == NUM_BLOCKS and tx.free.count == NUM_BLOCKS


def test_a_stalled_transfer_does_not_hold_the_next_one_to_the_same_receiver(monkeypatch):
    """No head-of-line blocking: while one transfer's data is stuck, the next one to the same
    receiver goes on its own pair and lands (with its meta), bit-exact."""
    stalled, release = _stall_first_receive(monkeypatch)
    receiver, tx = _local("receiver"), _local("sender")
    try:
        out = {}
        slow, slow_fut = _start_stalled(stalled, receiver, tx, "stuck", 6, out)
        fast_ids, fast_fut = expect_and_free_on_resolve(receiver, receiver.free, "behind", 5)
        src_ids = tx.free.allocate(5)
        res = tx.send(receiver.address, "behind", src_ids, meta=b"first token 7")
        landed = fast_fut.result(10)
        assert res.ok and landed.ok and landed.meta == b"first token 7", (res, landed)
        assert torch.equal(receiver.kv[fast_ids], tx.kv[src_ids])
        tx.free.free(src_ids)
        assert not slow_fut.done()            # the stuck one is still in flight meanwhile
        _release_and_land(release, slow, out, "stuck", slow_fut, receiver, tx)
    finally:
        release.set()
        tx.close()
        receiver.close()


def test_a_send_waiting_for_a_pair_is_cancelled_at_once(monkeypatch):
    """With every pair to a receiver busy, a queued send waits; cancel() ends it at once, before
    any of its data moves (the router tells the prefill side that the hand-off is abandoned)."""
    stalled, release = _stall_first_receive(monkeypatch)
    receiver, tx = _local("receiver"), _local("sender", max_pairs_per_peer=1)
    try:
        out = {}
        busy, busy_fut = _start_stalled(stalled, receiver, tx, "busy", 3, out)
        _, queued_fut = expect_and_free_on_resolve(receiver, receiver.free, "queued", 3)
        queued = _send_in_thread(tx, receiver.address, "queued", 3, out)
        assert wait_for(lambda: tx.state("queued") is not None)
        assert tx.cancel("queued")
        queued.join(10)
        assert not out["queued"].ok and "cancelled" in out["queued"].error
        assert not tx.cancel("busy")          # its data is moving: it runs to its end
        receiver.cancel("queued")
        assert not queued_fut.result(5).ok
        _release_and_land(release, busy, out, "busy", busy_fut, receiver, tx)
    finally:
        release.set()
        tx.close()
        receiver.close()


def wait_for(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False
