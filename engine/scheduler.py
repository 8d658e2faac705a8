"""Continuous-batching scheduler (torch-free).

Each step, in this order:
  1. running sequences, oldest first: one token each when decoding, the next prompt chunk
     when a prefill is still in progress; a sequence that needs a new block and finds none
     preempts the newest running sequence (its blocks are freed, it is recomputed later);
  2. waiting sequences, first come first served, while the token budget, the sequence cap
     and the free blocks allow; each gets blocks for all its tokens (prefix-cache hits
     included) and its first chunk.
With the `priority` policy (vLLM's), "oldest" and "first come" read "by (priority, arrival)"
(`SamplingParams.priority`, lower first) and the victim of a preemption is the running sequence
last in that order; and before step 1 the first waiting sequence, when it cannot be admitted (too
few free blocks, or `max_num_seqs` running), preempts running sequences of a lower priority (a
larger value), the last in that order first, until it can (`make_room`; as vLLM's V0 priority
preemption). A decode-role engine's reservation makes room the same way (LLMEngine.reserve_cached).
Batching decisions count tokens: a step never feeds more than `max_num_batched_tokens`.
A waiting sequence may also have to wait for something outside the blocks, a place for its LoRA
adapter loaded at run time (the engine's `gate(seq)`: None, it needs none; True, it may start;
False, not yet): one the gate holds back keeps its place in the queue and those behind it may go
past it (at most `max_num_seqs` are passed over in a step). A sequence admitted with its K/V
computed (`add_running`, a decode replica's) that the gate holds back is parked, holding its
blocks, and joins the running batch, first parked first, once the gate lets it.
A decoding sequence may carry proposed tokens (speculative decoding, `Sequence.num_draft`): they
are fed with its token when the budget and the free blocks allow, and dropped (not preempting
anyone) when they do not.
The engine calls `schedule`, then after running the step `finish` for each ended sequence.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable

from engine.block_manager import BlockManager
from engine.sequence import ScheduledChunk, Sequence, SequenceStatus


POLICIES = ("fcfs", "priority")


def _order(seq: Sequence) -> tuple[int, int]:
    return seq.params.priority, seq.arrival


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", gate: Callable[[Sequence], bool | None] | None = None):
        assert max_num_seqs > 0 and max_num_batched_tokens > 0 and policy in POLICIES
        self.bm = block_manager
        self.gate = gate
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.by_priority = policy == "priority"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: deque[Sequence] = deque()      # K/V computed, waiting for the gate (add_running)
        self.num_preemptions = 0

    # ---- admission -----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
        if self.by_priority:
            self._queue(seq)
        else:
            self.waiting.append(seq)

    def _queue(self, seq: Sequence) -> None:
        """Into the waiting queue at its place by (priority, arrival)."""
        self.waiting.insert(bisect.bisect(self.waiting, _order(seq), key=_order), seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose blocks already hold its computed K/V (imported KV): running, or
        parked while the gate is closed to it."""
        assert seq.block_table and seq.num_uncomputed_tokens >= 1
        seq.status = SequenceStatus.RUNNING
        (self.parked if self.gate is not None and self.gate(seq) is False else self.running).append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens still to prefill, queued or mid-prefill (the prefill load signal): a running
        sequence's uncomputed tokens unless only its last sampled one is left (decoding). A
        resumed or preempted sequence's output tokens to recompute count too."""
        return (sum(s.num_uncomputed_tokens for s in self.waiting)
                + sum(s.num_uncomputed_tokens for s in self.running if s.num_uncomputed_tokens - s.num_draft > 1))

    def make_room(self, priority: int, fits: Callable[[], bool]) -> bool:
        """Whether a request of `priority` fits (`fits()`), once the `priority` policy has
        preempted running sequences of a lower priority (a larger value), the last in (priority,
        arrival) order first, until it does; with fcfs nothing is preempted. The caller admits it
        (a waiting sequence in `schedule`, a decode reservation in LLMEngine.reserve_cached)."""
        while not fits():
            if not self._outranked_by(priority):
                return False
            self._preempt(self._last_running())
        return True

    def _last_running(self) -> Sequence | None:
        """The running sequence a preemption takes: the last in (priority, arrival) order with the
        priority policy, the newest with fcfs."""
        if not self.running:
            return None
        return max(self.running, key=_order) if self.by_priority else self.running[-1]

    def _outranked_by(self, priority: int) -> bool:
        """Whether the priority policy would preempt a running sequence for one of `priority`."""
        return self.by_priority and bool(self.running) and self._last_running().params.priority > priority

    # ---- the step ------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        while self.parked and self.gate(self.parked[0]):        # parked, first in first: the gate opened
            self.running.append(self.parked.popleft())
        # 0. room for the first waiting sequence (its prefix hits are looked up only where a lower
        # priority runs: this is on every step)
        if self.waiting and self._outranked_by(self.waiting[0].params.priority) and self._may_start(self.waiting[0]):
            head = self.waiting[0]
            self.make_room(head.params.priority,
                           lambda: len(self.running) < self.max_num_seqs and self.bm.can_allocate(head))
        # 1. running sequences, oldest first
        for seq in sorted(self.running, key=_order) if self.by_priority else list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            while not self.bm.append_slots(seq):
                if seq.num_draft:
                    seq.take_draft()
                    continue
                victim = self._last_running()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            chunks.append(ScheduledChunk.next_for(seq, budget))
            budget -= chunks[-1].num_tokens
        # 2. waiting sequences, first come first served (past those the gate holds back)
        held_back = 0
        while (len(self.waiting) > held_back and budget > 0 and not preempted
               and len(self.running) < self.max_num_seqs and held_back < self.max_num_seqs):
            seq = self.waiting[held_back]
            if not self._may_start(seq):
                held_back += 1
                continue
            if not self.bm.allocate(seq):
                break
            del self.waiting[held_back]
            if seq.first_scheduled_time is None:  # not again after a preemption: queue time
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk.next_for(seq, budget))
            budget -= chunks[-1].num_tokens
        return chunks

    def _may_start(self, seq: Sequence) -> bool:
        return self.gate is None or self.gate(seq) is not False

    # ---- leaving ---------------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: str | None, keep_blocks: bool = False) -> None:
        """End a sequence (finished or aborted) and free its blocks, unless `keep_blocks`
        (the prefill role keeps them for export; the engine frees them on `release`)."""
        if seq.status is SequenceStatus.RUNNING:
            (self.parked if seq in self.parked else self.running).remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if not keep_blocks and seq.block_table:
            self.bm.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop the blocks; the sequence re-runs all its tokens."""
        self.running.remove(seq)
        seq.take_draft()
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        if self.by_priority:
            self._queue(seq)
        else:
            self.waiting.appendleft(seq)
