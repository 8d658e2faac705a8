"""The in-process backend: same contract as the network one."""

import pytest
import torch

from kv_transfer import LoopbackReceiver, LoopbackSender, TransferConfig, TransferState, fingerprint_for

SHAPE = (32, 3, 2, 4, 2, 8)  # one block = 3*2*4*2*8*4 B = 1536 B
CFG = TransferConfig(lease_s=0.5, chunk_bytes=4096)  # 2 blocks per chunk


@pytest.fixture
def pair():
    torch.manual_seed(0)
    src, dst = torch.randn(SHAPE), torch.zeros(SHAPE)
    fp = fingerprint_for(src, "m")
    rx, tx = LoopbackReceiver(dst, fp, CFG), LoopbackSender(src, fp, CFG)
    yield src, dst, rx, tx
    tx.close()
    rx.close()


def test_bit_exact_into_non_contiguous_blocks(pair):
    src, dst, rx, tx = pair
    dst_ids, src_ids = [17, 3, 30, 4, 9], [0, 1, 2, 10, 11]
    fut = rx.expect("r", dst_ids)
    res = tx.send(rx.address, "r", src_ids)
    assert res.ok and res.nbytes == 5 * 1536
    assert fut.result(0).ok and rx.state("r") is TransferState.DONE
    assert torch.equal(dst[dst_ids], src[src_ids])
    untouched = [b for b in range(32) if b not in dst_ids]
    assert dst[untouched].abs().sum() == 0


def test_unknown_request_and_mismatch(pair):
    _, _, rx, tx = pair
    res = tx.send(rx.address, "ghost", [1])
    assert not res.ok and "unknown" in res.error
    fut = rx.expect("r", [1, 2])
    assert "reserved 2" in tx.send(rx.address, "r", [1]).error
    assert not fut.result(0).ok


def test_lease_expiry(pair):
    _, _, rx, _ = pair
    res = rx.expect("late", [5]).result(timeout=3)
    assert not res.ok and "lease" in res.error


def test_abort_cancel_and_close(pair):
    _, _, rx, tx = pair
    fut = rx.expect("a", [1])
    assert tx.abort(rx.address, "a", "prefill failed").ok
    assert "prefill failed" in fut.result(0).error
    fut = rx.expect("c", [2])
    assert rx.cancel("c") and "cancelled" in fut.result(0).error
    fut = rx.expect("z", [3])
    rx.close()
    assert "closed" in fut.result(0).error
    assert "no loopback receiver" in tx.send(rx.address, "z", [3]).error


def test_fingerprint_and_secret_rejected():
    kv = torch.zeros(SHAPE)
    rx = LoopbackReceiver(kv, fingerprint_for(kv, "m"), TransferConfig(secret="s"))
    try:
        wrong_model = LoopbackSender(kv, fingerprint_for(kv, "other"), TransferConfig(secret="s"))
        assert "fingerprint mismatch" in wrong_model.send(rx.address, "r", [1]).error
        no_secret = LoopbackSender(kv, fingerprint_for(kv, "m"), TransferConfig())
        assert "authentication" in no_secret.send(rx.address, "r", [1]).error
    finally:
        rx.close()


def test_bad_block_ids_are_caller_errors(pair):
    _, _, rx, tx = pair
    with pytest.raises(ValueError):
        rx.expect("r", [32])
    with pytest.raises(ValueError):
        tx.send(rx.address, "r", [1, 1])
