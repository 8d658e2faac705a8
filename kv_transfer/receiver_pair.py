"""Receiver side of one pair: a thread that serves one sender's frames in order.

Loop (one iteration per frame popped from the pair's frame queue):

    1. wait     pop the next frame (at most pair_idle_timeout_s; then the pair is torn down)
    2. parse    TransferHeader, Abort or Bye; anything else is a protocol violation -> teardown
    3. reserve  begin() moves the reservation PENDING -> TRANSFERRING, or says at once why the
                data must be drained (unknown, cancelled or expired id, wrong block count)
    4. receive  segments land in the reserved blocks while the reservation is wanted; otherwise
                they are drained through staging (the pair stays in sync)
    5. resolve  finish() resolves the reservation's future; then the Ack is written

A channel fault or timeout in step 4 fails the reservation (its blocks go back to the engine)
and tears the pair down; the sender builds a new pair for its next transfer.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from kv_transfer import rendezvous as rv
from kv_transfer.channel import RECEIVER_RANK, Channel
from kv_transfer.config import TransferConfig
from kv_transfer.layout import DTYPE_NAMES, block_bytes, transfer_shape
from kv_transfer.pipeline import recv_segments
from kv_transfer.protocol import Abort, Ack, Bye, ProtocolError, TransferHeader, clip, decode, encode
from kv_transfer.reservations import Reservations
from kv_transfer.staging import Staging

log = logging.getLogger(__name__)


class ReceiverPair:
    """Serves pair `pair_id` in its own daemon thread until the sender leaves, a fault, an idle
    timeout, or stop(). Calls `on_exit(pair_id)` when done."""

    def __init__(self, kv: torch.Tensor, reservations: Reservations, config: TransferConfig,
                 address: str, host: str, pair_id: int, backend: str, chunk_blocks: int,
                 on_exit: Callable[[int], None]) -> None:
        self.kv, self.reservations, self.config = kv, reservations, config
        self.address, self.host, self.pair_id = address, host, pair_id
        self.backend, self.chunk_blocks = backend, chunk_blocks
        self._on_exit = on_exit
        self._stopping = False
        self.thread = threading.Thread(target=self._run, name=f"kvt-pair-{pair_id}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, wake_client) -> None:
        """Ask the thread to exit; `wake_client` (a store client) pushes the wake-up."""
        self._stopping = True
        try:
            wake_client.queue_push(rv.frames_key(self.pair_id), rv.WAKE)
        except Exception:
            pass  # the store is going away; the pop fails and the thread exits anyway

    def _run(self) -> None:
        failed = True
        channel = None
        try:
            client = rv.connect(self.address, self.config.connect_timeout_s)
            channel = Channel(self.backend, client, self.pair_id, RECEIVER_RANK,
                              self.config.connect_timeout_s, self.host, self.config.op_timeout_s)
            client.set_timeout(rv.seconds(self.config.pair_idle_timeout_s))
            staging = Staging(self.kv, self.backend, self.chunk_blocks)
            failed = self._serve(client, channel, staging)
        except Exception as exc:  # channel faults, store gone, protocol violations
            log.warning("kv pair %d closed: %s", self.pair_id, clip(repr(exc)))
        finally:
            if channel is not None:
                channel.close(failed=failed)
            self._on_exit(self.pair_id)

    def _serve(self, client, channel: Channel, staging: Staging) -> bool:
        """Steps 1-5 until a clean end (returns False) or a fault (raises)."""
        while True:
            raw = client.queue_pop(rv.frames_key(self.pair_id))
            if self._stopping:
                return False
            frame = decode(raw, (TransferHeader, Abort, Bye))
            if isinstance(frame, Bye):
                return False
            if isinstance(frame, Abort):
                self.reservations.fail(frame.request_id, f"aborted by the sender: {frame.reason}")
                continue
            ack = self._receive(frame, channel, staging)
            client.queue_push(rv.acks_key(self.pair_id), encode(ack))

    def _check(self, hdr: TransferHeader) -> None:
        """A header this pool cannot take is a protocol violation (we cannot even drain it)."""
        expected = transfer_shape(self.kv, hdr.num_blocks)
        if (hdr.num_blocks > self.kv.shape[0]  # no reservation can be larger than the pool
                or hdr.shape != expected or hdr.dtype != DTYPE_NAMES[self.kv.dtype]
                or hdr.nbytes != hdr.num_blocks * block_bytes(self.kv)
                or hdr.chunk_blocks > self.chunk_blocks):
            raise ProtocolError(f"header does not fit this pool: {hdr}")

    def _receive(self, hdr: TransferHeader, channel: Channel, staging: Staging) -> Ack:
        self._check(hdr)
        deadline = time.monotonic() + self.config.transfer_timeout_s
        rid = hdr.request_id
        dst = self.reservations.begin(rid, hdr.num_blocks)
        landing = not isinstance(dst, str)
        try:
            with channel.device_stream(self.kv):
                nbytes, complete = recv_segments(
                    channel, staging, self.kv, hdr.segment_counts(), deadline,
                    dst if landing else None, lambda: self.reservations.wanted(rid),
                )
        except BaseException as exc:
            channel.close(failed=True)  # no posted receive may write the blocks once freed
            if landing:
                self.reservations.finish(rid, False, f"transfer failed: {clip(repr(exc))}")
            raise
        if not landing:
            return Ack(rid, hdr.seq, False, dst, 0)
        result = self.reservations.finish(rid, complete, "", nbytes, hdr.meta)
        return Ack(rid, hdr.seq, result.ok, result.error, result.nbytes)
