"""Transfers over gloo between two real processes: the receiver in a spawned worker process,
senders in this process (and, for the concurrent-senders case, in a second worker)."""

from __future__ import annotations

import threading

import pytest
import torch

from kv_transfer import KVReceiver, KVSender, TransferConfig, fingerprint_for
from test_kvt_workers import BASE_CFG, MODEL, NUM_BLOCKS, SHAPE, FreeList, Worker, send_and_free


@pytest.fixture(scope="module")
def rx():
    worker = Worker("receiver")
    yield worker
    worker.stop()


@pytest.fixture
def tx():
    torch.manual_seed(7)
    kv = torch.randn(SHAPE)
    sender = KVSender(kv, fingerprint_for(kv, MODEL), TransferConfig(**BASE_CFG))
    sender.free = FreeList(NUM_BLOCKS, seed=7)
    yield sender
    sender.close()
    assert sender.free.count == NUM_BLOCKS  # every sent block was freed


def _transfer(rx, tx, request_id: str, n: int):
    """One reserved transfer; asserts it landed bit-exactly. Returns the sender's result."""
    dst_ids = rx.call("expect", request_id, n)
    res, sent = send_and_free(tx, tx.free, rx.address, request_id, n)
    assert res.ok, res.error
    assert rx.call("result", request_id, 30).ok
    assert torch.equal(rx.call("read", dst_ids), sent)
    return res


def test_bit_exact_into_non_contiguous_blocks(rx, tx):
    res = _transfer(rx, tx, "exact", 11)  # 3 chunks of <= 4 blocks
    assert res.nbytes == 11 * 1024
    res = _transfer(rx, tx, "one-block", 1)
    assert rx.call("free_count") == NUM_BLOCKS


def test_bfloat16_pools_bit_exact_in_one_process():
    """gloo moves raw bytes, so a bf16 pool round-trips exactly (both ends here, for speed)."""
    src = torch.randn(SHAPE).to(torch.bfloat16)
    dst = torch.zeros(SHAPE, dtype=torch.bfloat16)
    fp, cfg = fingerprint_for(src, MODEL), TransferConfig(**BASE_CFG)
    with KVReceiver(dst, fp, cfg) as receiver, KVSender(src, fp, cfg) as sender:
        fut = receiver.expect("bf16", [9, 3, 40, 41, 7])
        assert sender.send(receiver.address, "bf16", [0, 1, 2, 3, 4]).ok
        assert fut.result(5).ok
    assert torch.equal(dst[[9, 3, 40, 41, 7]], src[:5])


def test_unknown_request_is_drained_and_pair_stays_usable(rx, tx):
    res, _ = send_and_free(tx, tx.free, rx.address, "never-expected", 9)
    assert not res.ok and "unknown or expired request" in res.error
    _transfer(rx, tx, "after-drain", 9)  # same pair, still in sync


def test_many_transfers_in_flight_to_one_receiver(rx, tx):
    n_requests = 8
    dst = {f"many-{i}": rx.call("expect", f"many-{i}", 3 + i % 4) for i in range(n_requests)}
    results, sent = {}, {}

    def send(rid):
        results[rid], sent[rid] = send_and_free(tx, tx.free, rx.address, rid, len(dst[rid]))

    threads = [threading.Thread(target=send, args=(rid,)) for rid in dst]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(r.ok for r in results.values()), results
    for rid, ids in dst.items():
        assert rx.call("result", rid, 10).ok
        assert torch.equal(rx.call("read", ids), sent[rid])
    peers = list(tx._peers.values())   # all to one address, on at most max_pairs_per_peer pairs
    assert len(peers) == 1 and 1 <= peers[0].count <= tx.config.max_pairs_per_peer


def test_two_senders_into_one_receiver_at_once(rx, tx):
    other = Worker("sender", seed=3)  # a second sender process
    try:
        ids_a = rx.call("expect", "from-worker", 20)
        ids_b = rx.call("expect", "from-here", 20)
        other.post("send", rx.address, "from-worker", 20)
        res_b, sent_b = send_and_free(tx, tx.free, rx.address, "from-here", 20)
        res_a, sent_a = other.answer()
        assert res_a.ok and res_b.ok, (res_a, res_b)
        assert rx.call("result", "from-worker", 10).ok and rx.call("result", "from-here", 10).ok
        assert torch.equal(rx.call("read", ids_a), sent_a)
        assert torch.equal(rx.call("read", ids_b), sent_b)
        assert other.call("free_count") == NUM_BLOCKS
    finally:
        other.stop()


def test_abort_frees_reservation_before_lease(rx, tx):
    rx.call("expect", "aborted", 4)
    assert tx.abort(rx.address, "aborted", "prefill failed").ok
    res = rx.call("result", "aborted", 5)  # well before the 20 s lease
    assert not res.ok and "aborted by the sender: prefill failed" in res.error
    assert rx.call("free_count") == NUM_BLOCKS


def test_lease_expiry_when_transfer_never_arrives(tx):
    short = Worker("receiver", seed=4, lease_s=1.5)
    try:
        short.call("expect", "never-sent", 6)
        assert short.call("free_count") == NUM_BLOCKS - 6
        res = short.call("result", "never-sent", 10)
        assert not res.ok and "lease of 1.5s expired" in res.error
        assert short.call("free_count") == NUM_BLOCKS
        late, _ = send_and_free(tx, tx.free, short.address, "never-sent", 6)  # arrives too late
        assert not late.ok and "unknown or expired request" in late.error
        assert short.call("free_count") == NUM_BLOCKS
    finally:
        short.stop()


def test_wrong_secret_and_fingerprint_rejected(rx):
    kv = torch.randn(SHAPE)
    cases = [
        (fingerprint_for(kv, MODEL), {**BASE_CFG, "secret": "wrong"}, "authentication failed"),
        (fingerprint_for(kv, "another-model"), BASE_CFG, "fingerprint mismatch"),
    ]
    for fp, cfg, expected in cases:
        sender = KVSender(kv, fp, TransferConfig(**cfg))
        res = sender.send(rx.address, "rejected", [0, 1])
        assert not res.ok and "handshake rejected" in res.error and expected in res.error
        sender.close()


@pytest.mark.parametrize("src_ids,dst_ids,copies", [
    # runs on both sides: segments of 4 blocks, straight from pool to pool
    (list(range(8, 20)), list(range(40, 52)), 0),
    # sender runs -> segments 8-11, 12-15, 16-19; the receiver lands the second directly
    # (60..63 is a run) and stages + scatters the other two
    (list(range(8, 20)), [50, 3, 7, 9, 60, 61, 62, 63, 1, 2, 0, 5], 2),
    # a scattered sender sends each run (here mostly single blocks) straight from its pool
    ([50, 3, 7, 9, 60, 61, 62, 63, 1, 2, 0, 5], list(range(40, 52)), 0),
    # segments 0-3 | 9 | 7 | 5 | 33-36 | 37: only 33-36 -> [11, 60, 1, 30] is staged
    ([0, 1, 2, 3, 9, 7, 5, 33, 34, 35, 36, 37], [4, 5, 6, 7, 8, 9, 10, 11, 60, 1, 30, 2], 1),
])
def test_direct_and_staged_segments_bit_exact(monkeypatch, src_ids, dst_ids, copies):
    """CPU pools move every segment straight between pool and wire, except a segment whose
    destination is not one run: it is received into staging and scattered."""
    from kv_transfer import pipeline

    calls = []
    for name in ("gather", "scatter"):
        real = getattr(pipeline, name)
        monkeypatch.setattr(pipeline, name, lambda *a, real=real, name=name: (calls.append(name), real(*a)))
    src, dst = torch.randn(SHAPE), torch.zeros(SHAPE)
    fp, cfg = fingerprint_for(src, MODEL), TransferConfig(**BASE_CFG)  # 4 blocks per chunk
    with KVReceiver(dst, fp, cfg) as receiver, KVSender(src, fp, cfg) as sender:
        fut = receiver.expect("runs", dst_ids)
        assert sender.send(receiver.address, "runs", src_ids).ok
        assert fut.result(5).ok
    assert torch.equal(dst[dst_ids], src[src_ids])
    assert len(calls) == copies
