"""Segmented, windowed movement of KV blocks over a Channel.

One transfer of n blocks travels as consecutive segments of whole blocks, one message each,
in block-list order. The sender chooses the segments and announces their sizes in the header
(plan_segments):

    runs     the pool lives where the backend moves memory (CPU pool on gloo, CUDA pool on
             NCCL): each maximal ascending run of source ids (b, b+1, ...), cut at chunk_blocks,
             is one segment, sent straight from the pool (a block-major pool holds a run as
             one contiguous piece): no copy, whatever the layout. On CUDA this is used only
             while the runs are few; otherwise a gather on the device is cheaper than many
             small NCCL messages.
    chunks   otherwise: segments of chunk_blocks blocks, each gathered into a staging slot
             (pinned host memory for a CUDA pool on gloo) and sent from there.

The receiver lands a segment straight in the pool when its destination ids form one ascending
run there, and otherwise receives it into a staging slot and scatters it. Both sides keep up to
WINDOW messages posted so the wire never idles, and at most two staging slots in use (double
buffering): a slot is refilled only after the message that used it completed.

    sender:   [gather segment i into a free slot] | post send i | retire sends beyond WINDOW
    receiver: post receives up to WINDOW ahead | wait for segment i | scatter it (if staged)
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from kv_transfer.channel import Channel
from kv_transfer.layout import chunk_plan, run_segments, segment_slices
from kv_transfer.protocol import MAX_SEGMENT_GROUPS, group_segments
from kv_transfer.staging import Staging, gather, pool_view, scatter

WINDOW = 8  # messages posted and not yet completed, per side


def plan_segments(kv: torch.Tensor, staging: Staging, ids: tuple[int, ...],
                  chunk_blocks: int) -> list[int]:
    """The sender's segmentation of `ids` (block counts, in order); see the module docstring."""
    chunks = [count for _, count in chunk_plan(len(ids), chunk_blocks)]
    if staging.device != kv.device:
        return chunks
    runs = run_segments(ids, chunk_blocks)
    few = kv.device.type == "cpu" or len(runs) <= 2 * len(chunks)
    if few and len(group_segments(runs)) <= 2 * MAX_SEGMENT_GROUPS:
        return runs
    return chunks


class _Slots:
    """Which of the two staging slots is free, and which message last used each."""

    def __init__(self) -> None:
        self.user: list[int | None] = [None, None]  # message index holding the slot

    def free(self) -> int | None:
        return next((s for s in (0, 1) if self.user[s] is None), None)


def send_segments(ch: Channel, staging: Staging, kv: torch.Tensor, ids: tuple[int, ...],
                  counts: list[int], deadline: float) -> int:
    """Send `kv[ids]` as the segments `counts`; returns the bytes sent. Raises on timeout or
    fault, after which the channel is unusable."""
    pending: deque[tuple[int, object]] = deque()  # (message index, work), in posting order
    slots = _Slots()
    nbytes = 0

    def retire_oldest() -> None:
        i, work = pending.popleft()
        ch.wait(work, deadline)
        slots.user = [None if u == i else u for u in slots.user]

    for i, (start, count) in enumerate(segment_slices(counts)):
        seg = ids[start:start + count]
        message = pool_view(kv, seg) if staging.device == kv.device else None
        if message is None:
            while slots.free() is None:
                retire_oldest()
            slot = slots.free()
            message = staging.view(slot, count)
            gather(kv, seg, message)
            slots.user[slot] = i
        pending.append((i, ch.post_send(message)))
        nbytes += message.numel() * message.element_size()
        while len(pending) > WINDOW:
            retire_oldest()
    while pending:
        retire_oldest()
    return nbytes


def recv_segments(ch: Channel, staging: Staging, kv: torch.Tensor, counts: list[int],
                  deadline: float, dst_ids: tuple[int, ...] | None,
                  keep_writing: Callable[[], bool]) -> tuple[int, bool]:
    """Receive a transfer sent as the segments `counts` into `kv[dst_ids]`.

    Segments are written while `keep_writing()` holds; once it fails, or when `dst_ids` is None,
    the rest is drained into staging and discarded. keep_writing() is checked when a direct
    receive is posted and just before a staged segment is scattered, so writing stops at most
    WINDOW messages after it turns false, and every write lands in `dst_ids`.

    Returns (bytes received, whether every segment was written). Raises on timeout or fault,
    after which the channel is unusable: the caller must close it before it hands the blocks
    back (a posted receive may still be writing until then)."""
    plan = segment_slices(counts)
    posted: deque[tuple[int, object, int | None]] = deque()  # (index, work, staging slot)
    slots = _Slots()
    nbytes, wrote_all, nxt = 0, True, 0

    def post(i: int) -> bool:
        """Post segment i's receive; False when it needs a staging slot and none is free."""
        start, count = plan[i]
        seg = dst_ids[start:start + count] if dst_ids is not None else None
        direct = None
        if seg is not None and staging.device == kv.device and keep_writing():
            direct = pool_view(kv, seg)
        slot = None
        if direct is None:
            slot = slots.free()
            if slot is None:
                return False
            slots.user[slot] = i
        target = direct if direct is not None else staging.view(slot, count)
        posted.append((i, ch.post_recv(target), slot))
        return True

    for i, (start, count) in enumerate(plan):
        while nxt < len(plan) and len(posted) < WINDOW and post(nxt):
            nxt += 1
        j, work, slot = posted.popleft()
        assert j == i
        ch.wait(work, deadline)
        nbytes += count * staging.block_bytes
        if slot is None:
            continue  # landed directly in the pool
        written = wrote_all and dst_ids is not None and keep_writing()
        if written:
            scatter(kv, dst_ids[start:start + count], staging.view(slot, count))
        wrote_all = written
        slots.user[slot] = None
    return nbytes, wrote_all
