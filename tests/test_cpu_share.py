"""Idle replicas lend their CPU threads to busy ones (serving/cpu_share.py, engine/async_engine.py).

- The policy: a busy replica alone keeps its own threads; beside idle ones it takes their threads
  in proportion to the busy replicas' own, never past the machine's CPUs for all busy ones together.
- The board: two slots on one file see each other's state (busy, idle, gone), a slot whose process
  is dead is taken back by the next registration, a full board is refused (and `open` then gives
  None), and the last one out removes the file.
- The engine thread asks for its threads before every step and steps on them, and says it is idle
  when it runs out of work; the engine is built on that thread.
- A served app's CPU replicas hold slots on their node's board, each with its own threads.
"""

import asyncio
import subprocess
import threading
import time

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams
from serving import cpu_share
from serving.cpu_share import CpuShare, threads_for
from test_engine_failures import tiny_engine


@pytest.mark.parametrize("own,others,limit,expected", [
    (1, [], 2, 1),                                   # alone
    (1, [(1, False)], 2, 2),                         # one idle neighbour: both cores
    (1, [(1, True)], 2, 1),                          # both busy: each its own
    (1, [(1, True), (1, False)], 4, 1),              # one idle thread for two busy: floor(1 / 2)
    (1, [(3, True), (4, False)], 8, 2),              # idle 4 shared 1 : 3
    (3, [(1, True), (4, False)], 8, 6),
    (1, [(1, False)] * 6, 2, 2),                     # many idle lenders: the machine's 2 CPUs at most
    (1, [(1, True)] + [(1, False)] * 6, 2, 1),       # two busy on 2 CPUs: nothing to lend
    (2, [(1, False)], 2, 2),                         # own threads are kept even past the machine
    (4, [(1, False)], 2, 4),
])
def test_busy_replicas_share_the_idle_ones_threads_within_the_machine(own, others, limit, expected):
    assert threads_for(own, others, limit) == expected


def test_slots_on_one_board_see_each_other_and_dead_slots_are_taken_back(tmp_path):
    path = tmp_path / "board"
    a, b = CpuShare(path, 1, limit=8), CpuShare(path, 1, limit=8)
    assert a.slot != b.slot
    assert a.busy() == 2                             # b registered idle
    assert b.busy() == 1 and a.busy() == 1           # both busy
    b.idle()
    assert a.busy() == 2
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    ghost = CpuShare(path, 3, limit=8, pid=procs[0].pid)    # replicas that then die while idle
    ghost2 = CpuShare(path, 2, limit=8, pid=procs[1].pid)
    for proc in procs:
        proc.kill()
        proc.wait()
    assert a.busy() == 7                             # their threads still count until a registration
    c = CpuShare(path, 1, limit=8)                   # ... sweeps every dead slot and takes the first
    assert c.slot == ghost.slot and a.busy() == 3    # b and c idle: 1 + 2
    d = CpuShare(path, 1, limit=8)
    assert d.slot == ghost2.slot                     # swept: free again
    b.close()
    c.close()
    d.close()
    assert a.busy() == 1                             # alone
    a.close()
    a.close()                                        # twice: no error
    assert a.busy() == 1                             # closed (an engine thread outliving shutdown): its own
    a.idle()
    assert not path.exists()                         # the last one out removed the board


def test_a_full_board_is_refused_and_open_then_shares_nothing(tmp_path, monkeypatch):
    path = tmp_path / "board"
    slots = [CpuShare(path, 1) for _ in range(cpu_share.SLOTS)]
    with pytest.raises(RuntimeError, match="full"):
        CpuShare(path, 1)
    monkeypatch.setattr(cpu_share, "board_path", lambda key: path)
    assert CpuShare.open("node", 1) is None
    slots[0].close()
    share = CpuShare.open("node", 1)
    assert share is not None and share.slot == 0
    for s in [share, *slots[1:]]:
        s.close()


class _Recording:
    """A share that grants `n` threads and records the engine thread's calls."""

    def __init__(self, n: int):
        self.n, self.events, self.threads = n, [], set()

    def busy(self) -> int:
        self.events.append("busy")
        self.threads.add(threading.get_ident())
        return self.n

    def idle(self) -> None:
        self.events.append("idle")
        self.threads.add(threading.get_ident())


def test_the_engine_steps_on_the_threads_the_share_grants_and_lends_them_when_idle(tiny_llama_dir):
    granted = torch.get_num_threads() + 1          # not what the engine starts with
    share = _Recording(granted)
    built_on = []

    def make():
        built_on.append(threading.get_ident())
        return tiny_engine(tiny_llama_dir)

    aengine = AsyncEngine(make, share)
    try:
        engine_thread = aengine.submit(lambda e: threading.get_ident()).result()
        assert built_on == [engine_thread] and engine_thread != threading.get_ident()
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

        async def run():
            return [o async for o in aengine.stream("r", lambda e: e.add_request("r", [5, 6, 7], params))]
        outs = asyncio.run(run())
        assert outs[-1].finished
        assert aengine.submit(lambda e: torch.get_num_threads()).result() == granted   # the engine thread's
        assert share.threads == {engine_thread}
        events = share.events
        first_busy = events.index("busy")
        assert "idle" in events[:first_busy]                      # idle while it waited for the request
        steps = events.count("busy")
        assert steps >= 4                                         # a prefill and 3 decode steps at least
        last_busy = len(events) - 1 - events[::-1].index("busy")
        # the loop may go idle after its last step only once the output is out
        deadline = 50
        while "idle" not in events[last_busy:] and deadline:
            time.sleep(0.02)
            deadline -= 1
        assert "idle" in events[last_busy:]
    finally:
        aengine.shutdown()


def test_an_engine_that_fails_to_build_raises_in_the_caller():
    def make():
        raise ValueError("no such model")
    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(make)


def test_a_served_apps_replicas_hold_slots_on_their_nodes_board(disagg):
    import ray
    slots = cpu_share.read_board(cpu_share.board_path(ray.get_runtime_context().get_node_id()))
    pids = {pid for pid, _, _ in slots}
    assert len(pids) == len(slots)               # one slot a replica process
    # this app's 1 prefill and 2 decode replicas (and any other app's alive now), each with
    # SERVICE_ENGINE's num_threads
    assert sum(threads == 1 for _, threads, _ in slots) >= 3
