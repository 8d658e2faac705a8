"""The rendezvous: store keys, connecting to a receiver, authenticating and judging handshakes.

The decode replica runs a `torch.distributed.TCPStore` server on a free port; its address
"host:port" is what it publishes. The store is the control plane of every pair it hosts:

    nonce                 random hex, set once by the receiver (input to the auth proof)
    pairs                 counter; a sender takes a pair id with add("pairs", 1)
    hello                 queue of Handshake messages, popped by the receiver's accept thread
    pair/<id>/reply       the HandshakeReply
    pair/<id>/frames      queue of TransferHeader / Abort / Bye frames, in send order
    pair/<id>/acks        queue of Acks, one per TransferHeader, in the same order
    pair/<id>/pg/...      the 2-rank process group's own rendezvous (receiver rank 0)

An empty value on a queue is a wake-up pushed by the receiver when it closes.

TCPStore client reads (the constructor, get, add, wait, queue_pop) block forever on a server
that is alive but frozen or unreachable, whatever timeout they were given; writes (set,
queue_push) return at once. The receiver only talks to its own in-process server; the sender
runs every read against a remote store through `in_thread` and bounds it by waiting on the
future (the stuck thread is abandoned; it ends when the connection does).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import socket
import threading
from concurrent.futures import Future
from typing import Callable

from torch.distributed import TCPStore

from kv_transfer.layout import choose_backend
from kv_transfer.protocol import DeviceInfo, Fingerprint, Handshake

NONCE_KEY = "nonce"
PAIRS_KEY = "pairs"
HELLO_QUEUE = "hello"
WAKE = b""


def reply_key(pair_id: int) -> str:
    return f"pair/{pair_id}/reply"


def frames_key(pair_id: int) -> str:
    return f"pair/{pair_id}/frames"


def acks_key(pair_id: int) -> str:
    return f"pair/{pair_id}/acks"


def group_prefix(pair_id: int) -> str:
    return f"pair/{pair_id}/pg/"


def seconds(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(s, 0.001))


def parse_address(address: str) -> tuple[str, int]:
    """('host', port) from 'host:port' or '[v6]:port'; ValueError when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad receiver address {address!r}; want 'host:port'")
    return host.strip("[]"), int(port)


def start_server(host: str, timeout_s: float) -> TCPStore:
    """A TCPStore server on a free port of `host` only (the receiver side). TCPStore given a host
    and port 0 listens on every interface; handed a socket already bound to `host`, it listens there
    (the store closes the socket when it stops)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(addr)
        sock.listen(128)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return TCPStore(host, port, None, True, seconds(timeout_s), wait_for_workers=False,
                    master_listen_fd=sock.detach())


def connect(address: str, timeout_s: float) -> TCPStore:
    """A client of the store at `address`. Raises (DistError, OSError, ValueError) when
    unreachable. A plain socket probe first makes a dead address fail at once (TCPStore
    itself keeps retrying a refused connection, with back-off, past its timeout)."""
    host, port = parse_address(address)
    socket.create_connection((host, port), timeout=timeout_s).close()
    return TCPStore(host, port, None, False, seconds(timeout_s))


def proof(secret: str, nonce: bytes, pair_id: int) -> str:
    """What a sender puts in Handshake.secret: HMAC-SHA256 keyed by the secret, '' if none."""
    if not secret:
        return ""
    msg = nonce + b"|" + str(pair_id).encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def judge(hs: Handshake, fingerprint: Fingerprint, secret: str, nonce: bytes,
          device: DeviceInfo) -> tuple[str, str]:
    """(reason, backend) for a handshake: reason '' means accept; backend is the pair's."""
    if secret and not hmac.compare_digest(hs.secret, proof(secret, nonce, hs.pair_id)):
        return "authentication failed: secret does not match", ""
    mismatch = fingerprint.mismatch(hs.fingerprint)
    if mismatch:
        return f"fingerprint mismatch (receiver != sender): {mismatch}", ""
    return "", choose_backend(device, hs.device)


def in_thread(fn: Callable[[], object], name: str) -> Future:
    """Run fn() in a new daemon thread; its result or exception arrives on the future."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as exc:  # handed to whoever waits on the future
            fut.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut
