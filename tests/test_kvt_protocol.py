"""Round trip of every kv_transfer wire message, and rejection of bad bytes."""

import msgpack
import pytest

from kv_transfer.protocol import (
    MAX_MESSAGE_BYTES, PROTOCOL_VERSION, Abort, Ack, Bye, DeviceInfo, Fingerprint, Handshake,
    HandshakeReply, ProtocolError, TransferHeader, decode, encode, group_segments,
)

FP = Fingerprint(PROTOCOL_VERSION, "HuggingFaceTB/SmolLM2-135M", "float32", 16, 30, 3, 64)
DEV = DeviceInfo("cuda", "10.0.0.2", 1, "GPU-1234", True)

MESSAGES = [
    Handshake(7, FP, DEV, 32 << 20, "ab" * 32),
    HandshakeReply(7, True, "", "gloo", 1 << 20, DeviceInfo("cpu", "h", 0, "", False)),
    HandshakeReply(8, False, "fingerprint mismatch", "", 0, DEV),
    TransferHeader("req-1", 3, 5, (5, 30, 2, 16, 3, 64), "bfloat16", 5 * 368640, 2, (2, 2, 1, 1)),
    TransferHeader("req-2", 0, 1, (1, 30, 2, 16, 3, 64), "float32", 368640, 1, (1, 1), b"\x93\x01meta"),
    Ack("req-1", 3, True, "", 1843200),
    Ack("req-2", 4, False, "unknown or expired request", 0),
    Abort("req-3", "prefill failed"),
    Bye("sender closed"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    assert isinstance(data, bytes) and len(data) <= MAX_MESSAGE_BYTES
    assert decode(data) == msg
    assert decode(data, (type(msg),)) == msg


def test_decode_rejects_unexpected_kind():
    with pytest.raises(ProtocolError, match="unexpected Ack"):
        decode(encode(Ack("r", 1, True, "", 0)), (TransferHeader,))


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"garbage bytes \x00\xff", b"\x93\x01",  # truncated array
    msgpack.packb({"not": "a list"}), msgpack.packb([1, "Ack"]),
    msgpack.packb([1, "Ack", {"request_id": "r"}]) + b"trailing",
])
def test_malformed_bytes_rejected(data):
    with pytest.raises(ProtocolError):
        decode(data)


def test_unknown_version_and_kind_rejected():
    fields = {"reason": "x"}
    with pytest.raises(ProtocolError, match="version"):
        decode(msgpack.packb([PROTOCOL_VERSION + 1, "Bye", fields]))
    with pytest.raises(ProtocolError, match="version"):
        decode(msgpack.packb([True, "Bye", fields]))  # bool is not the int 1
    with pytest.raises(ProtocolError, match="unknown message kind"):
        decode(msgpack.packb([PROTOCOL_VERSION, "Pickle", fields]))


def test_oversized_rejected():
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))
    huge_str = msgpack.packb([PROTOCOL_VERSION, "Bye", {"reason": "x" * 10000}])
    with pytest.raises(ProtocolError):
        decode(huge_str)
    huge_array = msgpack.packb([PROTOCOL_VERSION, "Bye", {"reason": "x"}, *range(100)])
    with pytest.raises(ProtocolError):
        decode(huge_array)
    with pytest.raises(ProtocolError, match="longer than"):  # cannot be built to send, either
        Bye("z" * 5000)


@pytest.mark.parametrize("fields", [
    {"request_id": "r", "seq": 1, "ok": True, "error": ""},  # missing nbytes
    {"request_id": "r", "seq": 1, "ok": True, "error": "", "nbytes": 0, "extra": 1},
    {"request_id": "r", "seq": "1", "ok": True, "error": "", "nbytes": 0},  # str for int
    {"request_id": "r", "seq": 1, "ok": 1, "error": "", "nbytes": 0},  # int for bool
    {"request_id": "r", "seq": True, "ok": True, "error": "", "nbytes": 0},  # bool for int
    {"request_id": "", "seq": 1, "ok": True, "error": "", "nbytes": 0},  # empty id
    {"request_id": "r", "seq": -1, "ok": True, "error": "", "nbytes": 0},  # negative
    {"request_id": b"r", "seq": 1, "ok": True, "error": "", "nbytes": 0},  # bin for str
])
def test_bad_fields_rejected(fields):
    with pytest.raises(ProtocolError):
        decode(msgpack.packb([PROTOCOL_VERSION, "Ack", fields], use_bin_type=True))


def test_bad_nested_and_shapes_rejected():
    hs = msgpack.unpackb(encode(MESSAGES[0]))
    hs[2]["fingerprint"]["dtype"] = "int8"
    with pytest.raises(ProtocolError, match="dtype"):
        decode(msgpack.packb(hs))
    hs[2]["fingerprint"] = "not a map"
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(hs))
    with pytest.raises(ProtocolError):  # shape disagrees with num_blocks
        TransferHeader("r", 1, 4, (5, 30, 2, 16, 3, 64), "float32", 1, 1, (1, 4))
    with pytest.raises(ProtocolError):  # not 6 dims
        TransferHeader("r", 1, 5, (5, 30, 2, 16), "float32", 1, 1, (1, 5))


@pytest.mark.parametrize("segments", [
    (), (2, 2), (1, 4, 1), (3, 1, 2, 1),  # empty, short of 5 blocks, odd length, count > chunk_blocks
    (0, 5, 1, 5), (1, 0, 1, 5), (1, 6),   # zero count, zero repeat, too many blocks
    tuple([1, 1] * 1024 + [1, 1]),        # more (count, repeat) groups than allowed
])
def test_bad_segments_rejected(segments):
    with pytest.raises(ProtocolError, match="segments"):
        TransferHeader("r", 1, 5, (5, 30, 2, 16, 3, 64), "float32", 1, 2, segments)


def test_segments_run_length_round_trip():
    counts = [2, 2, 2, 1, 2, 1, 1]
    grouped = group_segments(counts)
    assert grouped == (2, 3, 1, 1, 2, 1, 1, 2)
    hdr = TransferHeader("r", 1, 11, (11, 30, 2, 16, 3, 64), "float32", 1, 2, grouped)
    assert decode(encode(hdr)).segment_counts() == counts


def test_encode_rejects_non_messages():
    with pytest.raises(ProtocolError):
        encode(FP)  # nested type, not a message
    with pytest.raises(ProtocolError):
        encode({"kind": "Ack"})


def test_fingerprint_mismatch_names_fields():
    other = Fingerprint(PROTOCOL_VERSION, "other", "bfloat16", 16, 30, 3, 64)
    text = FP.mismatch(other)
    assert "model_id" in text and "dtype 'float32' != 'bfloat16'" in text
    assert FP.mismatch(FP) == ""
