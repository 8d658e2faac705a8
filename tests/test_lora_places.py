"""engine/lora_places.py: which requests of LoRA adapters loaded at run time start, and which adapter is
drained when every place is in use (no torch: a real Scheduler and BlockManager, and `Places`, the few
lines of engine.lora.LoraSet's placement the policy calls: least recently used idle adapter evicted)."""

from engine.block_manager import BlockManager
from engine.lora_config import NO_ROOM
from engine.lora_places import LoraPlaces
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


class Places:
    def __init__(self, size: int, unreadable=()):
        self.size, self.unreadable, self.held, self.tick = size, set(unreadable), {}, 0

    def check(self, name, lora_id, path):
        return None

    def use(self, name, lora_id, path, busy):
        self.tick += 1
        key = (name, lora_id)
        if key not in self.held and len(self.held) >= self.size:
            idle = [k for k in self.held if k not in busy]
            if not idle:
                return NO_ROOM
            del self.held[min(idle, key=self.held.__getitem__)]
        if name in self.unreadable:
            return f"cannot read {name}"
        self.held[key] = self.tick
        return None

    def holds(self, key):
        return key in self.held

    def last_used(self, key):
        return self.held[key]


def seq(rid: str, lora: str | None) -> Sequence:
    params = SamplingParams(max_tokens=4) if lora is None else \
        SamplingParams(max_tokens=4, lora=lora, lora_id=1, lora_path=f"/adapters/{lora}")
    return Sequence(rid, [1, 2, 3], params)


def setup(size=2, unreadable=()):
    places = LoraPlaces(Places(size, unreadable))
    sched = Scheduler(BlockManager(64, 4), 8, 64, gate=places.gate)
    return places, sched


def start(places, sched, *seqs):
    for s in seqs:                                  # as LLMEngine admits them
        if s.params.lora_path is not None:
            assert places.admit(s.params, landed=False, scheduler=sched) is None
        sched.add(s)
    failed = places.place(sched, lambda s, why: RequestOutput(s.request_id, [], "", True, "abort", 3, 0, 0, 0.0))
    sched.schedule()
    return failed


def test_the_adapter_with_the_fewest_running_is_drained_for_a_request_finding_no_place():
    places, sched = setup()
    a1, a2, b1 = seq("a1", "a"), seq("a2", "a"), seq("b1", "b")
    assert start(places, sched, a1, a2, b1) == []
    assert set(sched.running) == {a1, a2, b1} and places.waiting(sched) == 0
    c1 = seq("c1", "c")
    start(places, sched, c1)
    assert c1 not in sched.running and places.waiting(sched) == 1
    # b (one running) is drained: a new b request waits, a new a request and the base model's go past
    b2, a3, base = seq("b2", "b"), seq("a3", "a"), seq("base", None)
    start(places, sched, b2, a3, base)
    assert places.gate(b2) is False and places.gate(a3) is True and places.gate(base) is None
    assert a3 in sched.running and base in sched.running and b2 not in sched.running
    assert places.waiting(sched) == 2
    sched.finish(b1, "stop")                        # b's last running request ends: its place goes to c
    start(places, sched)
    assert c1 in sched.running and not places.loras.holds(("b", 1))
    assert places.gate(b2) is False and places.waiting(sched) == 1    # b waits for a place in turn


def test_among_adapters_running_as_many_the_least_recently_used_is_drained():
    places, sched = setup()
    a1, b1 = seq("a1", "a"), seq("b1", "b")
    start(places, sched, a1)
    start(places, sched, b1)
    start(places, sched, seq("c1", "c"))
    assert places.gate(seq("a2", "a")) is False and places.gate(seq("b2", "b")) is True


def test_a_request_whose_adapter_cannot_be_read_fails_alone():
    places, sched = setup(unreadable={"x"})
    x1, a1 = seq("x1", "x"), seq("a1", "a")
    failed = start(places, sched, x1, a1)
    assert [out.request_id for out in failed] == ["x1"]
    assert a1 in sched.running


def test_nothing_to_place_before_a_run_time_adapter_is_admitted():
    places, sched = setup()
    start(places, sched, seq("base", None))
    assert not places.active and places.waiting(sched) == 0
    assert places.admit(seq("a1", "a").params, landed=False, scheduler=sched) is None and places.active
