"""Pure pieces of kv_transfer: config validation, layout helpers, backend choice, rendezvous."""

import dataclasses

import pytest
import torch

from kv_transfer import TransferConfig, choose_backend, fingerprint_for
from kv_transfer.layout import (
    block_bytes, check_pool, chunk_blocks_for, chunk_plan, device_info, local_host_towards,
)
from kv_transfer import rendezvous as rv
from kv_transfer.reservations import check_block_ids
from kv_transfer.protocol import DeviceInfo, Handshake


def test_config_defaults_documented_values():
    cfg = TransferConfig()
    assert (cfg.connect_timeout_s, cfg.transfer_timeout_s, cfg.lease_s) == (10.0, 30.0, 60.0)
    assert cfg.chunk_bytes == 0 and cfg.pair_idle_timeout_s == 600.0
    assert cfg.max_pairs == 64 and cfg.secret == "" and cfg.max_pairs_per_peer == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lease_s = 1.0


@pytest.mark.parametrize("kwargs", [
    {"connect_timeout_s": 0}, {"transfer_timeout_s": -1}, {"lease_s": "60"},
    {"pair_idle_timeout_s": True}, {"chunk_bytes": 100}, {"chunk_bytes": 1.5e6},
    {"chunk_bytes": 1 << 40}, {"max_pairs": 0}, {"secret": None}, {"max_pairs_per_peer": 0},
    {"max_pairs_per_peer": 2.0},
])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        TransferConfig(**kwargs)


def test_config_hides_secret():
    assert "hunter2" not in repr(TransferConfig(secret="hunter2"))


def _dev(kind="cuda", host="a", index=0, uuid="", nccl=True):
    return DeviceInfo(kind, host, index, uuid, nccl)


@pytest.mark.parametrize("local,peer,expected", [
    (_dev("cpu"), _dev("cpu"), "gloo"),
    (_dev("cuda"), _dev("cpu"), "gloo"),
    (_dev("cpu"), _dev("cuda"), "gloo"),
    (_dev(host="a", index=0), _dev(host="a", index=1), "nccl"),
    (_dev(host="a", index=0), _dev(host="b", index=0), "nccl"),
    (_dev(host="a", index=0), _dev(host="a", index=0), "gloo"),  # same GPU: NCCL can't
    (_dev(uuid="GPU-1", index=0), _dev(uuid="GPU-1", index=3), "gloo"),  # uuid wins
    (_dev(uuid="GPU-1"), _dev(uuid="GPU-2"), "nccl"),
    (_dev(index=0, nccl=False), _dev(index=1), "gloo"),
    (_dev(index=0), _dev(index=1, nccl=False), "gloo"),
])
def test_choose_backend(local, peer, expected):
    assert choose_backend(local, peer) == expected
    assert choose_backend(peer, local) == expected  # both ends agree


def test_nccl_group_on_a_build_without_nccl_is_a_clear_error():
    from kv_transfer.channel import _nccl_group

    if torch.distributed.is_nccl_available():
        pytest.skip("this torch has NCCL")
    with pytest.raises(RuntimeError, match="no NCCL"):
        _nccl_group(None, 0, 1.0)


def test_staging_lives_where_the_backend_moves_memory():
    from kv_transfer.staging import staging_device

    kv = torch.zeros(1, 2, 2, 2, 1, 2)
    assert staging_device(kv, "gloo").type == "cpu" and staging_device(kv, "nccl").type == "cpu"


def test_cpu_pool_device_info_selects_gloo():
    kv = torch.zeros(1, 2, 2, 2, 1, 2)
    info = device_info(kv, "127.0.0.1")
    assert info.kind == "cpu" and choose_backend(info, info) == "gloo"


def test_fingerprint_and_pool_checks():
    kv = torch.zeros(8, 30, 2, 16, 3, 64)
    fp = fingerprint_for(kv, "m")
    assert (fp.num_layers, fp.block_size, fp.num_kv_heads, fp.head_dim) == (30, 16, 3, 64)
    assert fp.dtype == "float32" and block_bytes(kv) == 30 * 2 * 16 * 3 * 64 * 4
    check_pool(kv, fp)
    with pytest.raises(ValueError, match="dtype"):
        check_pool(kv.to(torch.bfloat16), fp)
    with pytest.raises(ValueError):
        fingerprint_for(torch.zeros(8, 30, 3, 16, 3, 64), "m")  # dim 2 must be K/V
    with pytest.raises(ValueError):
        fingerprint_for(torch.zeros(4, 4, dtype=torch.int8), "m")


def test_block_ids_and_chunk_plan():
    assert check_block_ids([3, 1, 2], 4) == (3, 1, 2)
    for bad in ([], [4], [-1], [1, 1]):
        with pytest.raises(ValueError):
            check_block_ids(bad, 4)
    assert chunk_plan(5, 2) == [(0, 2), (2, 2), (4, 1)]
    assert chunk_plan(1, 8) == [(0, 1)]
    assert chunk_blocks_for(4096, 1000) == 4
    assert chunk_blocks_for(1024, 2048) == 1  # a block larger than a chunk travels alone


def test_parse_address():
    assert rv.parse_address("10.0.0.1:5000") == ("10.0.0.1", 5000)
    assert rv.parse_address("[::1]:80") == ("::1", 80)
    for bad in ("nohost", ":80", "h:", "h:x", "h:70000"):
        with pytest.raises(ValueError):
            rv.parse_address(bad)


def test_local_host_towards_a_peer_or_no_route():
    assert local_host_towards("127.0.0.1") == "127.0.0.1"
    with pytest.raises(OSError):            # not reachable: an error, not a 127.0.0.1 the peer cannot reach
        local_host_towards("0.0.0.0.1")


def test_store_server_listens_on_its_host_only():
    """The rendezvous binds the address it publishes, not every interface (TCPStore's default)."""
    import psutil

    def listening(port):
        return {c.laddr.ip for c in psutil.Process().net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port}

    server = rv.start_server("127.0.0.1", 5.0)
    port = server.port
    assert listening(port) == {"127.0.0.1"}
    server.set("k", b"v")
    assert rv.connect(f"127.0.0.1:{port}", 5.0).get("k") == b"v"
    del server
    assert listening(port) == set()


def test_judge_handshake():
    kv = torch.zeros(4, 2, 2, 4, 1, 8)
    fp, dev = fingerprint_for(kv, "m"), _dev("cpu")
    nonce = b"abc"
    good = Handshake(3, fp, dev, 4096, rv.proof("s3cret", nonce, 3))
    assert rv.judge(good, fp, "s3cret", nonce, dev) == ("", "gloo")
    assert rv.judge(good, fp, "", nonce, dev) == ("", "gloo")  # no secret configured
    replayed = dataclasses.replace(good, pair_id=4)  # proof is bound to the pair id
    assert "authentication" in rv.judge(replayed, fp, "s3cret", nonce, dev)[0]
    unauth = dataclasses.replace(good, secret="")
    assert "authentication" in rv.judge(unauth, fp, "s3cret", nonce, dev)[0]
    other = fingerprint_for(kv.to(torch.float16), "m")
    assert "fingerprint mismatch" in rv.judge(good, other, "", nonce, dev)[0]


def test_run_segments_and_sender_plan():
    from types import SimpleNamespace

    from kv_transfer.layout import run_segments, segment_slices
    from kv_transfer.pipeline import plan_segments

    ids = (4, 5, 6, 7, 8, 2, 9, 10, 3)
    assert run_segments(ids, 3) == [3, 2, 1, 2, 1]        # 4-6 | 7-8 | 2 | 9-10 | 3
    assert segment_slices([3, 2, 1]) == [(0, 3), (3, 2), (5, 1)]
    assert run_segments((7,), 4) == [1]
    cpu = torch.zeros(16, 1, 2, 1, 1, 1)
    on = lambda device: SimpleNamespace(device=torch.device(device))  # noqa: E731
    # a CPU pool on gloo sends its runs, however many
    assert plan_segments(cpu, on("cpu"), ids, 3) == [3, 2, 1, 2, 1]
    assert plan_segments(cpu, on("cpu"), (9, 7, 5, 3, 1), 4) == [1] * 5
    # a pool staged to another device (a CUDA pool on gloo) is gathered in chunks
    assert plan_segments(cpu, on("cuda"), ids, 4) == [4, 4, 1]
