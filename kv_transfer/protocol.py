"""Every control message of KV transfer, and their one (msgpack) serialization.

Messages (one frozen dataclass each; all validate their fields in `__post_init__`):

    Handshake       sender -> receiver, once per pair, on the rendezvous "hello" queue
    HandshakeReply  receiver -> sender, once per pair, at the pair's reply key
    TransferHeader  sender -> receiver, on the pair's frame queue, before the tensor data
    Abort           sender -> receiver, on the pair's frame queue: give up a reservation
    Bye             sender -> receiver, on the pair's frame queue: the sender leaves the pair
    Ack             receiver -> sender, at the pair's ack key for one transfer

Wire format: msgpack array `[PROTOCOL_VERSION, kind, {field: value}]`, nested dataclasses as
maps, tuples as arrays. `decode` accepts at most `MAX_MESSAGE_BYTES` and applies msgpack's
per-object limits, then checks the version, the kind, the exact field set and every field's
type; anything else raises `ProtocolError`. Nothing is ever pickled.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

import msgpack

PROTOCOL_VERSION = 3  # 2: block-major pools, segmented transfers; 3: a header carries `meta`
MAX_MESSAGE_BYTES = 64 * 1024
MAX_SEGMENT_GROUPS = 1024  # (count, repeat) pairs in a TransferHeader
MAX_STR_LEN = 4096
MAX_REQUEST_ID_LEN = 256
KV_DTYPES = ("float32", "bfloat16", "float16")
BACKENDS = ("gloo", "nccl")


class ProtocolError(ValueError):
    """Bytes or fields that do not form a valid message of this protocol version."""


def clip(text: str, limit: int = 1024) -> str:
    """`text` shortened to `limit` characters, for error strings built from exceptions."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _conforms(value: object, tp: object) -> bool:
    if tp in (int, str, bool, bytes):
        return type(value) is tp
    if typing.get_origin(tp) is tuple:
        return isinstance(value, tuple) and all(type(v) is int for v in value)
    return isinstance(value, tp)  # nested message dataclass


def _check_types(msg: object) -> None:
    for name, tp in typing.get_type_hints(type(msg)).items():
        value = getattr(msg, name)
        if not _conforms(value, tp):
            raise ProtocolError(f"{type(msg).__name__}.{name}: bad type {type(value).__name__}")
        if type(value) in (str, bytes) and len(value) > MAX_STR_LEN:
            raise ProtocolError(f"{type(msg).__name__}.{name}: longer than {MAX_STR_LEN}")


def _check_request_id(request_id: str) -> None:
    if not 0 < len(request_id) <= MAX_REQUEST_ID_LEN:
        raise ProtocolError(f"request_id must have 1..{MAX_REQUEST_ID_LEN} characters")


def _check_nonnegative(msg: object, *names: str) -> None:
    for name in names:
        if getattr(msg, name) < 0:
            raise ProtocolError(f"{type(msg).__name__}.{name} must be >= 0")


@dataclass(frozen=True)
class Fingerprint:
    """What must match for two KV pools to exchange blocks."""

    protocol_version: int
    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        _check_types(self)
        if self.dtype not in KV_DTYPES:
            raise ProtocolError(f"Fingerprint.dtype must be one of {KV_DTYPES}, got {self.dtype!r}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ProtocolError(f"Fingerprint.{name} must be >= 1")

    def mismatch(self, other: Fingerprint) -> str:
        """'' when compatible, else which fields differ (mine != theirs)."""
        diffs = [
            f"{f.name} {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        return "; ".join(diffs)


@dataclass(frozen=True)
class DeviceInfo:
    """Where a KV pool lives. kind is 'cpu' or 'cuda'; uuid is '' when unknown."""

    kind: str
    host: str
    index: int
    uuid: str
    nccl: bool

    def __post_init__(self) -> None:
        _check_types(self)
        if self.kind not in ("cpu", "cuda"):
            raise ProtocolError(f"DeviceInfo.kind must be 'cpu' or 'cuda', got {self.kind!r}")


@dataclass(frozen=True)
class Handshake:
    """A sender asks to form pair `pair_id`. `secret` is the HMAC proof (see `auth.py`), not
    the secret itself; '' when the sender has no secret."""

    pair_id: int
    fingerprint: Fingerprint
    device: DeviceInfo
    chunk_bytes: int
    secret: str

    def __post_init__(self) -> None:
        _check_types(self)
        _check_nonnegative(self, "pair_id", "chunk_bytes")


@dataclass(frozen=True)
class HandshakeReply:
    """The receiver's answer. When accepted, `backend` and `chunk_bytes` are what the pair uses."""

    pair_id: int
    accepted: bool
    reason: str
    backend: str
    chunk_bytes: int
    device: DeviceInfo

    def __post_init__(self) -> None:
        _check_types(self)
        _check_nonnegative(self, "pair_id", "chunk_bytes")
        if self.accepted and self.backend not in BACKENDS:
            raise ProtocolError(f"HandshakeReply.backend must be one of {BACKENDS}")


def group_segments(counts: typing.Sequence[int]) -> tuple[int, ...]:
    """Segment block counts run-length encoded as a flat (count, repeat, ...) tuple."""
    out: list[int] = []
    for count in counts:
        if out and out[-2] == count:
            out[-1] += 1
        else:
            out += [count, 1]
    return tuple(out)


@dataclass(frozen=True)
class TransferHeader:
    """Announces one transfer: `nbytes` of `dtype` data, the blocks `shape` = [n, L, 2, bs, H, D]
    in the sender's block-list order, sent as consecutive segments of whole blocks, one
    message each. `segments` lists the segments' block counts run-length encoded as
    (count, repeat) pairs (see group_segments); no segment is larger than `chunk_blocks`
    (see pipeline.py). `meta`: the caller's bytes for the receiver's caller (at most
    MAX_STR_LEN; kv_transfer never reads them), delivered with the landed transfer's result."""

    request_id: str
    seq: int
    num_blocks: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    chunk_blocks: int
    segments: tuple[int, ...]
    meta: bytes = b""

    def __post_init__(self) -> None:
        _check_types(self)
        _check_request_id(self.request_id)
        _check_nonnegative(self, "seq", "nbytes")
        if len(self.shape) != 6 or any(d < 1 for d in self.shape):
            raise ProtocolError("TransferHeader.shape must be 6 positive dims [n, L, 2, bs, H, D]")
        if self.shape[0] != self.num_blocks or self.shape[2] != 2:
            raise ProtocolError("TransferHeader.shape disagrees with num_blocks or K/V dim")
        if self.dtype not in KV_DTYPES or self.chunk_blocks < 1:
            raise ProtocolError("TransferHeader: bad dtype or chunk_blocks")
        pairs = list(zip(self.segments[::2], self.segments[1::2]))
        if (len(self.segments) % 2 or not 0 < len(pairs) <= MAX_SEGMENT_GROUPS
                or any(not 1 <= c <= self.chunk_blocks or r < 1 for c, r in pairs)
                or sum(c * r for c, r in pairs) != self.num_blocks):
            raise ProtocolError("TransferHeader.segments must be (count, repeat) pairs, counts in "
                                "[1, chunk_blocks], covering num_blocks")

    def segment_counts(self) -> list[int]:
        """The block count of every segment, in order."""
        return [c for c, r in zip(self.segments[::2], self.segments[1::2]) for _ in range(r)]


@dataclass(frozen=True)
class Ack:
    """The receiver's verdict on transfer `seq`: ok means the data landed in reserved blocks."""

    request_id: str
    seq: int
    ok: bool
    error: str
    nbytes: int

    def __post_init__(self) -> None:
        _check_types(self)
        _check_request_id(self.request_id)
        _check_nonnegative(self, "seq", "nbytes")


@dataclass(frozen=True)
class Abort:
    """The sender will not send `request_id`; the receiver fails that reservation now."""

    request_id: str
    reason: str

    def __post_init__(self) -> None:
        _check_types(self)
        _check_request_id(self.request_id)


@dataclass(frozen=True)
class Bye:
    """The sender is leaving this pair; the receiver tears it down."""

    reason: str

    def __post_init__(self) -> None:
        _check_types(self)


Message = typing.Union[Handshake, HandshakeReply, TransferHeader, Ack, Abort, Bye]
_KINDS: dict[str, type] = {
    cls.__name__: cls for cls in (Handshake, HandshakeReply, TransferHeader, Ack, Abort, Bye)
}
_NESTED = (Fingerprint, DeviceInfo)


def _to_wire(msg: object) -> dict:
    out = {}
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        out[f.name] = _to_wire(value) if isinstance(value, _NESTED) else value
    return out


def _from_wire(cls: type, obj: object) -> object:
    if not isinstance(obj, dict):
        raise ProtocolError(f"{cls.__name__}: expected a map")
    hints = typing.get_type_hints(cls)
    if set(obj) != set(hints):
        raise ProtocolError(f"{cls.__name__}: fields {sorted(map(str, obj))} != {sorted(hints)}")
    kwargs = {}
    for name, tp in hints.items():
        value = obj[name]
        if tp in _NESTED:
            value = _from_wire(tp, value)
        elif typing.get_origin(tp) is tuple and isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    return cls(**kwargs)  # __post_init__ checks every type and range


def encode(msg: Message) -> bytes:
    """Serialize one message. Raises ProtocolError for a non-message or an oversized result."""
    kind = type(msg).__name__
    if _KINDS.get(kind) is not type(msg):
        raise ProtocolError(f"not a protocol message: {type(msg).__name__}")
    data = msgpack.packb([PROTOCOL_VERSION, kind, _to_wire(msg)], use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{kind} encodes to {len(data)} bytes > {MAX_MESSAGE_BYTES}")
    return data


def decode(data: bytes, expect: tuple[type, ...] = tuple(_KINDS.values())) -> Message:
    """Parse one message whose type is in `expect`; raise ProtocolError on anything else."""
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError("message must be bytes")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(
            bytes(data), raw=False, strict_map_key=True, use_list=True,
            max_str_len=MAX_STR_LEN, max_bin_len=MAX_STR_LEN, max_array_len=2 * MAX_SEGMENT_GROUPS,
            max_map_len=64, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several types for malformed input
        raise ProtocolError(f"malformed message: {clip(repr(exc), 200)}") from None
    if not (isinstance(obj, list) and len(obj) == 3):
        raise ProtocolError("message must be [version, kind, fields]")
    version, kind, fields = obj
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {clip(repr(version), 40)}")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {clip(repr(kind), 40)}")
    if cls not in expect:
        raise ProtocolError(f"unexpected {kind}; wanted one of {[c.__name__ for c in expect]}")
    try:
        return _from_wire(cls, fields)
    except TypeError as exc:
        raise ProtocolError(f"{kind}: {exc}") from None
