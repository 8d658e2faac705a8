"""Simulated replicas: the engine step loop of each pool, priced by `serving.slo_model.StepModel`.

Every replica is a small state machine driven by the event loop (pdserve/plan/simulator.py):
  `start(now)`  -> the end time of the step it starts now, or None when it has nothing to do
                   (called only when the replica is idle);
  `end(now)`    -> what the finished step completed (prompts done / sequences done); the replica is idle.
KV is reserved by the router when it routes a request (prompt + output tokens, less a prefix every
replica holds, `Request.kv_tokens`; where every layer has a sliding window, about the window, or the
prompt if longer: `StepModel.held_tokens`; released when the sequence ends), as pdserve's decode
replicas reserve blocks before the transfer. A prefill computes `Request.new_tokens`; a decode step
reads the whole context (a windowed layer: its window's keys).

  PrefillReplica    FIFO of prompts; each step takes up to `max_batched_tokens` prompt tokens from the
                    head (chunked prefill: a long prompt spans steps, short ones share a step).
  ColocatedReplica  continuous batching: decode sequences first, the rest of the token budget to
                    prompt chunks (none while `max_num_seqs` sequences decode); a prompt done joins
                    the batch. O(log B) per step: a sequence is kept as the step index at which it
                    finishes, and the batch's total context grows by B per step.
  DecodeReplica     a colocated replica whose sequences mostly come with their KV (`add`: they join
                    at the next step, up to `max_num_seqs`); the prompts it computes itself are local
                    prefills (`add_local`: a conversation's next turn, `routing.local_prefill_tokens`).
"""

from __future__ import annotations

import heapq
from collections import deque

from pdserve.plan.sim_load import Request
from serving.slo_model import StepModel


class _Replica:
    __slots__ = ("id", "m", "kv_reserved", "busy", "draining", "ready_at", "created", "removed")

    def __init__(self, rid: int, m: StepModel, created: float, ready_at: float):
        self.id, self.m = rid, m
        self.kv_reserved = 0
        self.busy = self.draining = False
        self.created, self.ready_at, self.removed = created, ready_at, -1.0

    def kv_free(self) -> int:
        return self.m.kv_tokens - self.kv_reserved

    def idle(self) -> bool:
        raise NotImplementedError


class _Batch:
    """The running decode batch: sequences as (finish step, id, request), total context tokens, and
    with a sliding window of `window` keys the sum of min(context, window) (`windowed`): the
    sequences still short of the window (`growing`, each with the step at which it reaches it in
    `reach`) add one each per step."""
    __slots__ = ("heap", "step", "context", "window", "windowed", "growing", "reach")

    def __init__(self, window: int = 0):
        self.heap: list = []
        self.step = 0
        self.context = 0
        self.window, self.windowed = window, 0
        self.growing: dict[int, int] = {}    # request id -> the step its context reaches the window
        self.reach: list = []                # (that step, request id), a heap; entries of ended ones stay

    def add(self, r: Request) -> None:
        heapq.heappush(self.heap, (self.step + r.output_len - 1, r.id, r))
        self.context += r.input_len + 1
        if self.window:
            self.windowed += min(r.input_len + 1, self.window)
            if r.input_len + 1 < self.window:
                self.growing[r.id] = self.step + self.window - r.input_len - 1
                heapq.heappush(self.reach, (self.growing[r.id], r.id))

    def advance(self, batch: int, now: float) -> list[Request]:
        """One step done: every sequence got a token; returns those that finished now."""
        self.step += 1
        self.context += batch
        self.windowed += len(self.growing)
        while self.reach and self.reach[0][0] <= self.step:
            at, rid = heapq.heappop(self.reach)
            if self.growing.get(rid) == at:
                del self.growing[rid]
        done = []
        while self.heap and self.heap[0][0] <= self.step:
            r = heapq.heappop(self.heap)[2]
            r.end = now
            self.context -= r.input_len + r.output_len
            if self.window:
                self.windowed -= min(r.input_len + r.output_len, self.window)
                self.growing.pop(r.id, None)
            done.append(r)
        return done


class PrefillReplica(_Replica):
    __slots__ = ("queue", "queued_tokens", "chunk")

    def __init__(self, *a):
        super().__init__(*a)
        self.queue: deque = deque()        # [request, prompt tokens left]
        self.queued_tokens = 0
        self.chunk: list = []

    def add(self, r: Request) -> None:
        self.queue.append([r, r.new_tokens])
        self.queued_tokens += r.new_tokens

    def idle(self) -> bool:
        return not self.busy and not self.queue

    def take_chunk(self, budget: int) -> tuple[list, int]:
        """Prompt chunks from the head of the queue within `budget` tokens: ([(entry, tokens)], total)."""
        chunk, total = [], 0
        for entry in self.queue:
            if total >= budget:
                break
            take = min(budget - total, entry[1])
            chunk.append((entry, take))
            total += take
        return chunk, total

    def start(self, now: float) -> float | None:
        chunk, tokens = self.take_chunk(self.m.max_batched_tokens)
        if not chunk:
            return None
        self.chunk, self.busy = chunk, True
        return now + self.m.step_time(tokens)

    def end(self, now: float) -> list[Request]:
        done = []
        for entry, take in self.chunk:
            entry[1] -= take
            self.queued_tokens -= take
            if entry[1] == 0:
                done.append(entry[0])
        while self.queue and self.queue[0][1] == 0:
            self.queue.popleft()
        self.chunk, self.busy = [], False
        for r in done:
            r.first = now
        return done


class ColocatedReplica(PrefillReplica):
    __slots__ = ("batch", "stepping")

    def __init__(self, *a):
        super().__init__(*a)
        self.batch = _Batch(self.m.window)
        self.stepping = 0

    @property
    def running(self) -> int:
        return len(self.batch.heap)

    def idle(self) -> bool:
        return not self.busy and not self.queue and not self.batch.heap

    def start(self, now: float) -> float | None:
        self.stepping = len(self.batch.heap)     # decode first; prompts get the rest of the budget
        room = self.m.max_batched_tokens - self.stepping if self.stepping < self.m.max_num_seqs else 0
        chunk, tokens = self.take_chunk(room)
        if not chunk and not self.stepping:
            return None
        self.chunk, self.busy = chunk, True
        return now + self.m.step_time(tokens, self.stepping,
                                      self.m.decode_read(self.batch.context, self.batch.windowed))

    def end(self, now: float) -> list[Request]:
        """Returns the sequences that finished; prompts that completed join the batch (first token now)."""
        done = self.batch.advance(self.stepping, now) if self.stepping else []
        for r in done:
            self.kv_reserved -= r.reserved
        for r in PrefillReplica.end(self, now):
            if r.output_len > 1:
                self.batch.add(r)
            else:
                r.end = now
                self.kv_reserved -= r.reserved
                done.append(r)
        return done


class DecodeReplica(ColocatedReplica):
    __slots__ = ("pending",)

    def __init__(self, *a):
        super().__init__(*a)
        self.pending: deque = deque()      # KV arrived, waiting for a batch slot

    def add(self, r: Request) -> None:
        self.pending.append(r)

    def add_local(self, r: Request) -> None:
        PrefillReplica.add(self, r)

    def idle(self) -> bool:
        return super().idle() and not self.pending

    def start(self, now: float) -> float | None:
        while self.pending and len(self.batch.heap) < self.m.max_num_seqs:
            self.batch.add(self.pending.popleft())
        return super().start(now)
