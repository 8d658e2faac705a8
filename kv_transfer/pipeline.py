"""Chunked, double-buffered movement of KV blocks over a Channel.

One transfer of n blocks is ceil(n / chunk_blocks) messages of at most chunk_blocks blocks
each, sent and received in block-list order. Both sides use two staging slots so that copying
one chunk between the pool and staging overlaps the wire time of the next:

    sender:   gather chunk i into slot i%2 | wait for send i-1 | post send i
    receiver: post recv i+1 into slot (i+1)%2 | wait for recv i | scatter chunk i from slot i%2
"""

from __future__ import annotations

from typing import Callable

import torch

from kv_transfer.channel import Channel
from kv_transfer.layout import chunk_plan
from kv_transfer.staging import Staging, gather, scatter


def send_chunks(ch: Channel, staging: Staging, kv: torch.Tensor, ids: tuple[int, ...],
                chunk_blocks: int, deadline: float) -> int:
    """Send `kv[:, :, ids]` to the peer; returns the bytes sent. Raises on timeout or fault,
    after which the channel is unusable."""
    pending = None
    nbytes = 0
    for i, (start, count) in enumerate(chunk_plan(len(ids), chunk_blocks)):
        buf = staging.view(i % 2, count)
        gather(kv, ids[start:start + count], buf)
        if pending is not None:
            ch.wait(pending, deadline)
        pending = ch.post_send(buf)
        nbytes += buf.numel() * buf.element_size()
    ch.wait(pending, deadline)
    return nbytes


def recv_chunks(ch: Channel, staging: Staging, kv: torch.Tensor, num_blocks: int,
                chunk_blocks: int, deadline: float, dst_ids: tuple[int, ...] | None,
                keep_writing: Callable[[], bool]) -> tuple[int, bool]:
    """Receive a transfer of `num_blocks` blocks. Chunks are written into `kv[:, :, dst_ids]`
    while `keep_writing()` holds (checked before each chunk); once it fails, or when `dst_ids`
    is None, the rest is drained into staging and discarded.

    Returns (bytes received, whether every chunk was written). Raises on timeout or fault,
    after which the channel is unusable; nothing is written after it returns or raises."""
    plan = chunk_plan(num_blocks, chunk_blocks)
    bufs = [staging.view(0, plan[0][1]), None]
    works = [ch.post_recv(bufs[0]), None]
    writing = dst_ids is not None
    nbytes = 0
    for i, (start, count) in enumerate(plan):
        slot = i % 2
        if i + 1 < len(plan):
            nxt = 1 - slot
            bufs[nxt] = staging.view(nxt, plan[i + 1][1])
            works[nxt] = ch.post_recv(bufs[nxt])
        ch.wait(works[slot], deadline)
        nbytes += bufs[slot].numel() * bufs[slot].element_size()
        writing = writing and keep_writing()
        if writing:
            scatter(kv, dst_ids[start:start + count], bufs[slot])
    return nbytes, writing
