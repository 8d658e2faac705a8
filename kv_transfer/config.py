"""Transfer configuration: one frozen dataclass that validates itself on creation.

Every wait in `kv_transfer` is bounded by one of these fields; nothing is read from the
environment. Both sides of a pair build their own `TransferConfig`; only `chunk_bytes` is
negotiated (the pair uses the smaller of the two that are set, else the backend's default).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MiB = 1 << 20
AUTO_CHUNK_BYTES = {"gloo": 4 * MiB, "nccl": 32 * MiB}


def negotiate_chunk_bytes(mine: int, theirs: int, backend: str) -> int:
    """The pair's chunk_bytes: the smaller of the two that are set (non-zero), else the
    backend's default."""
    chosen = [b for b in (mine, theirs) if b]
    return min(chosen) if chosen else AUTO_CHUNK_BYTES[backend]


@dataclass(frozen=True)
class TransferConfig:
    """Timeouts and sizes for KV transfer. All times are in seconds.

    Attributes:
        connect_timeout_s: bound on building a pair: connecting to the receiver's rendezvous,
            the handshake reply, and the 2-rank process group rendezvous. Default 10 s.
        transfer_timeout_s: bound on one transfer once it has its pair: sending or receiving
            every chunk plus waiting for the Ack. The sender also waits at most this long for
            its turn on a busy pair. Default 30 s.
        lease_s: how long a receiver reservation (`expect`) may wait for its transfer to
            complete. When it runs out, the reservation's future resolves with a timeout error
            and the engine may free the blocks. A transfer already running when the lease ends
            is drained, not written, so the future resolves at worst `lease_s +
            transfer_timeout_s` after `expect`. Default 60 s. A transfer whose reservation does
            not exist (never made, cancelled, expired) is refused at once: its data is drained
            and nacked, nothing waits for a reservation.
        chunk_bytes: largest single message of KV data, hence the size of one staging buffer;
            0 (the default) lets the pair choose by backend: 4 MiB on gloo (measured best of
            1/4/16 MiB on loopback TCP, benchmarks/kv_transfer_bench.py), 32 MiB on NCCL. A message always
            holds at least one whole block, so a block larger than this travels alone. Each
            pair keeps two staging buffers (double buffering), so staging memory is at most two
            messages per pair and side, allocated on first need; CPU pools on gloo mostly send
            and receive straight from the pool and need none.
        pair_idle_timeout_s: the receiver tears down a pair that carried nothing for this long
            (how a crashed sender's pair is reclaimed); the sender rebuilds it transparently on
            its next send. Default 600 s.
        max_pairs: most concurrent pairs a receiver accepts; further handshakes are rejected.
            Default 64.
        max_pairs_per_peer: most pairs a sender keeps to one receiver address: up to this many
            transfers to one receiver move at once, each on its own pair (own frame queue,
            process group and receiver thread), so a slow or stalled one holds only its own
            pair. A send that finds them all busy waits for one (at most transfer_timeout_s).
            Default 4.
        secret: optional shared secret. When the receiver has one, a sender must prove it
            knows the same secret (HMAC over a receiver nonce and the pair id; the secret itself
            never travels). Empty means no authentication. Not shown in repr.
    """

    connect_timeout_s: float = 10.0
    transfer_timeout_s: float = 30.0
    lease_s: float = 60.0
    chunk_bytes: int = 0
    pair_idle_timeout_s: float = 600.0
    max_pairs: int = 64
    max_pairs_per_peer: int = 4
    secret: str = field(default="", repr=False)

    @property
    def op_timeout_s(self) -> float:
        """NCCL watchdog limit on one posted operation: a backstop above every deadline the
        transfer code sets itself (a whole transfer is bounded by transfer_timeout_s), so only a wait that escaped its own bound trips it."""
        return self.transfer_timeout_s + self.connect_timeout_s

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "transfer_timeout_s", "lease_s", "pair_idle_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"TransferConfig.{name} must be a positive number, got {value!r}")
        if isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int):
            raise ValueError(f"TransferConfig.chunk_bytes must be an int, got {self.chunk_bytes!r}")
        if self.chunk_bytes != 0 and not 1024 <= self.chunk_bytes <= 1 << 31:
            raise ValueError(
                f"TransferConfig.chunk_bytes must be 0 (auto) or in [1 KiB, 2 GiB], got {self.chunk_bytes}"
            )
        for name in ("max_pairs", "max_pairs_per_peer"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TransferConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.secret, str):
            raise ValueError("TransferConfig.secret must be a str")
