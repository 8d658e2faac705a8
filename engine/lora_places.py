"""Which requests of LoRA adapters loaded at run time may start: the engine's policy over the
`max_loras` places its LoraSet (engine/lora.py) holds for such adapters. Torch-free.

Contract
  * Only the engine's thread calls it (LLMEngine): `admit` when it admits a request naming an
    adapter loaded at run time, `place` before each step's scheduling, `gate` as the scheduler's
    gate (engine/scheduler.py: None, the sequence needs no place; True, it may start; False, not
    yet), `waiting` for the engine's stats.
  * The places themselves (reading an adapter, evicting the least recently used idle one) are the
    LoraSet's (`check`, `use`, `holds`, `last_used`); this class decides in which order requests
    take them, and which adapter is drained when none is free: it takes no new request until its
    running ones end and its place goes to the request waiting, so requests of the adapters held
    cannot keep every place busy for good.
  * It holds no blocks: a request whose adapter can no longer be read is ended by the engine's
    `fail` callback (a 400, its blocks freed) and its output returned by `place`.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Callable, Protocol

from engine.lora_config import NO_ROOM
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


class Places(Protocol):
    """The part of engine.lora.LoraSet this policy uses."""

    def check(self, name: str, lora_id: int, path: str) -> str | None: ...

    def use(self, name: str, lora_id: int, path: str, busy: set) -> str | None: ...

    def holds(self, key: tuple[str, int]) -> bool: ...

    def last_used(self, key: tuple[str, int]) -> int: ...


class LoraPlaces:
    def __init__(self, loras: Places):
        self.loras = loras
        self.active = False     # a request ran a LoRA adapter loaded at run time (until then: no work)
        self._draining: tuple[Sequence, tuple[str, int]] | None = None   # (waiting for a place, adapter)

    def admit(self, params: SamplingParams, landed: bool, scheduler: Scheduler) -> str | None:
        """A request of run-time adapter `params.lora` is admitted: None, or why it cannot be
        served (a 400), or NO_ROOM. Its adapter is read (`LoraSet.check`); `landed` (decode role:
        its K/V is here already): placed now where a place is free and none is parked (else the
        request parks, Scheduler.add_running, behind those parked first)."""
        self.active = True
        p = params
        why = self.loras.check(p.lora, p.lora_id, p.lora_path)
        if why is None and landed and not scheduler.parked:
            why = self.loras.use(p.lora, p.lora_id, p.lora_path, self.running(scheduler))
        return why

    def place(self, scheduler: Scheduler, fail: Callable[[Sequence, str], RequestOutput]) -> list[RequestOutput]:
        """Before scheduling: place the run-time adapters of the parked sequences (decode role),
        then of the waiting ones the step may start (as many as `max_num_seqs` leaves seats), in
        order, until one finds every place in use (NO_ROOM): it waits, and one adapter is drained
        for it. Returns the outputs of the requests `fail` ended (their adapter can no longer be
        read)."""
        seats = scheduler.max_num_seqs - len(scheduler.running)
        if not self.active or not (scheduler.waiting and seats > 0 or scheduler.parked):
            self._draining = None
            return []
        busy, failed = self.running(scheduler), []
        for seq in list(scheduler.parked) + list(itertools.islice(scheduler.waiting, seats)):
            p = seq.params
            if p.lora_path is None:
                continue
            why = self.loras.use(p.lora, p.lora_id, p.lora_path, busy)
            if why is NO_ROOM:
                self._drain_for(seq, scheduler)
                return failed
            if why is not None:
                failed.append(fail(seq, why))
                continue
            busy.add(p.lora_key)
        self._draining = None
        return failed

    def gate(self, seq: Sequence) -> bool | None:
        """The scheduler's gate: None where `seq` runs no adapter loaded at run time, else whether it
        may start: its adapter placed, and not the one drained for a request waiting for a place."""
        if seq.params.lora_path is None:
            return None
        key = seq.params.lora_key
        return self.loras.holds(key) and (self._draining is None or self._draining[1] != key)

    def waiting(self, scheduler: Scheduler) -> int:
        """Queued requests whose adapter has no place yet."""
        if not self.active:
            return 0
        return sum(1 for seq in (*scheduler.parked, *scheduler.waiting) if self.gate(seq) is False)

    @staticmethod
    def running(scheduler: Scheduler) -> set:
        """The run-time adapters the running sequences run."""
        return set(_running_keys(scheduler))

    def _drain_for(self, blocked: Sequence, scheduler: Scheduler) -> None:
        """`blocked` found every place in use: drain the adapter with the fewest running sequences,
        least recently used first, and the same one while `blocked` waits."""
        running = Counter(_running_keys(scheduler))
        if self._draining is not None and self._draining[0] is blocked and self._draining[1] in running:
            return
        victim = min(running, key=lambda key: (running[key], self.loras.last_used(key)), default=None)
        self._draining = None if victim is None else (blocked, victim)


def _running_keys(scheduler: Scheduler):
    """The run-time adapter of each running sequence that runs one."""
    return (seq.params.lora_key for seq in scheduler.running if seq.params.lora_path is not None)
