"""Chunked, double-buffered movement of KV blocks over a Channel.

One transfer of n blocks is ceil(n / chunk_blocks) chunks, in block-list order. The sender
picks one of two wire layouts for the whole transfer and announces it in the header (`rows`):

    rows     every chunk's source ids are one ascending run and the pool lives where the
             backend moves memory (CPU pool on gloo, CUDA pool on NCCL). A chunk of k blocks
             travels as L*2 messages, one per (layer, K/V) row of the chunk viewed as
             [L*2, k, bs*H*D], straight from the pool: no copy on the sender.
    packed   otherwise. The sender gathers each chunk into a staging slot and sends it as one
             message (fewer, larger messages; one copy).

The receiver follows the layout. A `rows` chunk whose destination ids are one ascending run
is received straight into the pool's rows (no copy); any other chunk is received into a
staging slot and scattered into the pool. Two staging slots overlap the copy of one chunk with
the wire time of the next:

    sender:   fill chunk i (slot i%2) | wait for chunk i-1 | post chunk i
    receiver: post chunk i+1 | wait for chunk i | scatter chunk i (if staged)
"""

from __future__ import annotations

from typing import Callable

import torch

from kv_transfer.channel import Channel
from kv_transfer.layout import chunk_plan
from kv_transfer.staging import Staging, gather, rows_view, scatter


def run_start(ids: tuple[int, ...]) -> int | None:
    """ids[0] when `ids` is the run ids[0], ids[0]+1, ...; else None."""
    first = ids[0]
    return first if all(b == first + j for j, b in enumerate(ids)) else None


def _pool_rows(kv: torch.Tensor, staging: Staging, ids: tuple[int, ...]) -> torch.Tensor | None:
    """The pool's own [L*2, k, E] rows for `ids` when they can go on the wire directly."""
    first = run_start(ids) if staging.device == kv.device else None
    return None if first is None else rows_view(kv)[:, first:first + len(ids)]


def sends_rows(kv: torch.Tensor, staging: Staging, ids: tuple[int, ...], chunk_blocks: int) -> bool:
    """The sender's layout choice: True (rows) when every chunk can leave the pool directly."""
    return all(_pool_rows(kv, staging, ids[s:s + c]) is not None
               for s, c in chunk_plan(len(ids), chunk_blocks))


def send_chunks(ch: Channel, staging: Staging, kv: torch.Tensor, ids: tuple[int, ...],
                chunk_blocks: int, rows: bool, deadline: float) -> int:
    """Send `kv[:, :, ids]` to the peer in layout `rows` (see sends_rows); returns the bytes
    sent. Raises on timeout or fault, after which the channel is unusable."""
    pending: list = []
    nbytes = 0
    for i, (start, count) in enumerate(chunk_plan(len(ids), chunk_blocks)):
        chunk_ids = ids[start:start + count]
        if rows:
            messages = list(_pool_rows(kv, staging, chunk_ids))
        else:
            buf = staging.view(i % 2, count)
            gather(kv, chunk_ids, buf)  # slot i%2 is free: chunk i-2 was waited for below
            messages = [buf]
        for work in pending:
            ch.wait(work, deadline)
        pending = [ch.post_send(m) for m in messages]
        nbytes += sum(m.numel() * m.element_size() for m in messages)
    for work in pending:
        ch.wait(work, deadline)
    return nbytes


def recv_chunks(ch: Channel, staging: Staging, kv: torch.Tensor, num_blocks: int,
                chunk_blocks: int, rows: bool, deadline: float, dst_ids: tuple[int, ...] | None,
                keep_writing: Callable[[], bool]) -> tuple[int, bool]:
    """Receive a transfer of `num_blocks` blocks sent in layout `rows` into `kv[:, :, dst_ids]`.

    Chunks are written while `keep_writing()` holds; once it fails, or when `dst_ids` is None,
    the rest is drained into staging and discarded. A staged chunk checks keep_writing() just
    before its scatter; a direct chunk when its receives are posted (one chunk ahead), so
    writing stops at most one chunk after keep_writing() turns false. Every write lands in
    `dst_ids`.

    Returns (bytes received, whether every chunk was written). Raises on timeout or fault,
    after which the channel is unusable; nothing is written after it returns or raises."""
    plan = chunk_plan(num_blocks, chunk_blocks)

    def post(i: int):
        start, count = plan[i]
        chunk_ids = dst_ids[start:start + count] if dst_ids is not None else None
        direct = _pool_rows(kv, staging, chunk_ids) if rows and chunk_ids and keep_writing() else None
        stage = None if direct is not None else staging.view(i % 2, count)
        messages = list(direct if direct is not None else rows_view(stage) if rows else [stage])
        size = sum(m.numel() * m.element_size() for m in messages)
        return [ch.post_recv(m) for m in messages], stage, chunk_ids, size

    nbytes, wrote_all = 0, True
    nxt = post(0)
    for i in range(len(plan)):
        works, stage, chunk_ids, size = nxt
        if i + 1 < len(plan):
            nxt = post(i + 1)  # slot (i+1)%2 is free: chunk i-1 was scattered last round
        for work in works:
            ch.wait(work, deadline)
        nbytes += size
        if stage is None:
            continue  # landed directly in the pool
        written = wrote_all and chunk_ids is not None and keep_writing()
        if written:
            scatter(kv, chunk_ids, stage)
        wrote_all = written
    return nbytes, wrote_all
