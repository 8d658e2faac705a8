"""Scheduler: token budget, chunked prefill, continuous batching, preemption (no torch).

A fake step stands in for the model: it marks scheduled tokens computed and appends
token 0 for every chunk that samples.
"""

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, max_seqs=8, budget=16):
    bm = BlockManager(num_blocks, block_size)
    return bm, Scheduler(bm, max_seqs, budget)


def seq(n, rid, max_tokens=4):
    return Sequence(rid, list(range(1000, 1000 + n)), SamplingParams(max_tokens=max_tokens))


def fake_step(sched, bm):
    chunks = sched.schedule()
    for ch in chunks:
        ch.seq.num_computed_tokens += ch.num_tokens
        bm.mark_computed(ch.seq)
    for ch in chunks:
        if ch.sample:
            ch.seq.token_ids.append(0)
            if ch.seq.num_output_tokens >= ch.seq.params.max_tokens:
                sched.finish(ch.seq, "length")
    return chunks


def test_token_budget_and_chunked_prefill():
    bm, sched = make(budget=16)
    a, b = seq(10, "a"), seq(10, "b")
    sched.add(a), sched.add(b)
    chunks = fake_step(sched, bm)
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in chunks] == [("a", 0, 10), ("b", 0, 6)]
    assert sum(c.num_tokens for c in chunks) <= 16
    chunks = fake_step(sched, bm)
    # a decodes (1 token) before b's remaining prompt chunk
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in chunks] == [("a", 10, 1), ("b", 6, 4)]
    assert chunks[1].sample


def test_sequences_join_and_leave_every_step():
    bm, sched = make(budget=64)
    a = seq(5, "a", max_tokens=2)
    sched.add(a)
    fake_step(sched, bm)
    b = seq(5, "b", max_tokens=3)
    sched.add(b)
    chunks = fake_step(sched, bm)
    assert {c.seq.request_id for c in chunks} == {"a", "b"}
    assert a.status is SequenceStatus.FINISHED
    while sched.has_work():
        fake_step(sched, bm)
    assert bm.all_free()


def test_max_num_seqs_caps_running():
    bm, sched = make(max_seqs=2, budget=100)
    for i in range(4):
        sched.add(seq(3, f"s{i}"))
    fake_step(sched, bm)
    assert len(sched.running) == 2 and len(sched.waiting) == 2
    while sched.has_work():
        fake_step(sched, bm)
    assert bm.all_free()


def test_preemption_by_recompute_frees_and_requeues():
    # 6 blocks of 4 tokens; three sequences of 7 tokens each take 2 blocks, then grow.
    bm, sched = make(num_blocks=6, block_size=4, budget=64)
    seqs = [seq(7, f"s{i}", max_tokens=6) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert all(s.first_scheduled_time is None for s in seqs)
    fake_step(sched, bm)        # all prefilled, each now 8 tokens in 2 blocks: pool full
    assert bm.num_free_blocks == 0
    admitted = [s.first_scheduled_time for s in seqs]
    assert None not in admitted
    fake_step(sched, bm)        # decode the 8th token; each now has 9 tokens
    assert sched.num_preemptions == 0
    fake_step(sched, bm)        # each needs a 3rd block: the newest is preempted
    assert sched.num_preemptions == 1
    victim = seqs[2]
    assert victim.status is SequenceStatus.WAITING and victim.block_table == []
    assert sched.waiting[0] is victim
    steps = 0
    fake_step(sched, bm)        # re-admission after a preemption keeps the first admission time
    steps += 1
    while sched.has_work():
        fake_step(sched, bm)
        steps += 1
        assert steps < 100
    assert all(s.num_output_tokens == 6 for s in seqs)
    assert [s.first_scheduled_time for s in seqs] == admitted
    assert bm.all_free()


def test_finish_keep_blocks_and_abort_waiting():
    bm, sched = make()
    a, b = seq(6, "a"), seq(6, "b")
    sched.add(a)
    fake_step(sched, bm)
    sched.finish(a, None, keep_blocks=True)
    assert a.block_table and not bm.all_free()
    bm.free(a)
    sched.add(b)
    sched.finish(b, "abort")  # still waiting
    assert not sched.has_work() and bm.all_free()


def test_waiting_prompt_tokens_counts_queued_and_partial_prefill():
    bm, sched = make(budget=8)
    sched.add(seq(10, "a")), sched.add(seq(5, "b"))
    assert sched.num_waiting_tokens == 15
    fake_step(sched, bm)  # a gets 8 of 10
    assert sched.num_waiting_tokens == 2 + 5

    bm, sched = make(budget=8)
    # a resumed request: 4 prompt tokens and 8 output tokens, all to compute before it samples
    sched.add(Sequence("c", list(range(1000, 1012)), SamplingParams(max_tokens=20), num_prompt_tokens=4))
    assert sched.num_waiting_tokens == 12
    fake_step(sched, bm)    # 8 of 12, mid-prefill among the running
    assert sched.num_waiting_tokens == 4
    fake_step(sched, bm)    # the rest, then a sampled token: decoding, no prefill load
    assert sched.running[0].num_output_tokens == 9 and sched.num_waiting_tokens == 0


def test_the_priority_policy_orders_the_queue_and_preempts_the_last_in_its_order():
    """vLLM's priority policy: waiting sequences by (priority, arrival), lower first; running ones
    fed in that order; the one last in it preempted (not the newest, as first come first served
    would), and queued back at its place."""
    bm = BlockManager(6, 4)
    sched = Scheduler(bm, 8, 8, policy="priority")

    def prio(n, rid, p, max_tokens=6):
        return Sequence(rid, list(range(2000, 2000 + n)), SamplingParams(max_tokens=max_tokens, priority=p))
    low, mid, high = prio(7, "low", 5), prio(7, "mid", 0), prio(7, "high", -3)
    for s in (low, mid, high):          # arriving lowest priority first
        sched.add(s)
    assert [s.request_id for s in sched.waiting] == ["high", "mid", "low"]
    chunks = fake_step(sched, bm)       # 8 tokens a step: high's prompt first, then mid's first token
    assert [(c.seq.request_id, c.num_tokens) for c in chunks] == [("high", 7), ("mid", 1)]
    sched.finish(high, "abort")
    while low.status is SequenceStatus.WAITING:
        fake_step(sched, bm)
    urgent = prio(7, "urgent", -9)      # arrives last, runs beside low and mid
    sched.add(urgent)
    while urgent.status is SequenceStatus.WAITING:
        fake_step(sched, bm)
    while not sched.num_preemptions:    # 6 blocks: the three outgrow them
        fake_step(sched, bm)
    assert low.status is SequenceStatus.WAITING and urgent.status is SequenceStatus.RUNNING
    late = prio(3, "late", 9)
    sched.add(late)
    assert list(sched.waiting).index(low) < list(sched.waiting).index(late)
    steps = 0
    while sched.has_work():
        fake_step(sched, bm)
        steps += 1
        assert steps < 200
    assert all(s.num_output_tokens == 6 for s in (low, mid, urgent)) and bm.all_free()


def _prio(n, rid, p, max_tokens=6):
    return Sequence(rid, list(range(3000 + 100 * p, 3000 + 100 * p + n)), SamplingParams(max_tokens=max_tokens,
                                                                                       priority=p))


def test_a_waiting_sequence_preempts_lower_priorities_for_blocks_and_seats():
    """The priority policy's admission: the first waiting sequence, short of free blocks or of a
    seat under max_num_seqs, preempts running sequences of a lower priority (the last in order
    first) until it fits, and none of its own or a higher priority; fcfs preempts no one for it."""
    for policy, max_seqs, blocks in (("priority", 8, 4), ("priority", 2, 64), ("fcfs", 8, 4), ("fcfs", 2, 64)):
        bm = BlockManager(blocks, 4)
        sched = Scheduler(bm, max_seqs, 16, policy=policy)
        by_priority = policy == "priority"
        low, lower = _prio(6, "low", 3 if by_priority else 0), _prio(6, "lower", 5 if by_priority else 0)
        for s in (lower, low):
            sched.add(s)
        fake_step(sched, bm)
        assert {s.request_id for s in sched.running} == {"low", "lower"}
        peer = _prio(6, "peer", lower.params.priority)    # no lower priority runs: it waits
        sched.add(peer)
        fake_step(sched, bm)
        assert peer.status is SequenceStatus.WAITING and sched.num_preemptions == 0
        urgent = _prio(6, "urgent", -1 if by_priority else 0)
        sched.add(urgent)
        fake_step(sched, bm)
        if not by_priority:
            assert urgent.status is SequenceStatus.WAITING and sched.num_preemptions == 0
            continue
        assert urgent.status is SequenceStatus.RUNNING and lower.status is SequenceStatus.WAITING
        assert low.status is SequenceStatus.RUNNING and sched.num_preemptions == 1
        assert [s.request_id for s in sched.waiting] == ["lower", "peer"]      # by (priority, arrival)
        while sched.has_work():
            fake_step(sched, bm)
        assert all(s.num_output_tokens == 6 for s in (low, lower, peer, urgent)) and bm.all_free()


def test_a_reservation_makes_room_by_priority():
    """A decode-role reservation (LLMEngine.reserve_cached) asks `make_room` the same way."""
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, 8, 16, policy="priority")
    running = _prio(14, "running", 2)
    sched.add(running)
    fake_step(sched, bm)
    tokens = list(range(500, 508))
    assert not bm.can_reserve(tokens) and not sched.make_room(2, lambda: bm.can_reserve(tokens))
    assert running.status is SequenceStatus.RUNNING
    assert sched.make_room(1, lambda: bm.can_reserve(tokens)) and running.status is SequenceStatus.WAITING
    blocks, cached = bm.reserve_cached(tokens)
    assert len(blocks) == 2 and cached == 0


def test_fcfs_ignores_priority():
    bm, sched = make(budget=8)
    a = Sequence("a", list(range(7)), SamplingParams(priority=5))
    b = Sequence("b", list(range(7)), SamplingParams(priority=-5))
    sched.add(a), sched.add(b)
    assert [c.seq.request_id for c in fake_step(sched, bm)] == ["a", "b"]


def test_the_gate_holds_a_sequence_back_and_the_others_go_past_it():
    """The gate (the engine's: a LoRA adapter placed) keeps "held" waiting in its place while
    "placed" and "b" behind it start; once the gate opens, it starts."""
    open_for: set[str] = set()
    gate = {"held": lambda: "held" in open_for, "placed": lambda: True}
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, 8, 64, gate=lambda s: gate[s.request_id]() if s.request_id in gate else None)
    a, held, placed, b = seq(5, "a"), seq(5, "held"), seq(5, "placed"), seq(5, "b")
    for s in (a, held, placed, b):
        sched.add(s)
    assert [c.seq.request_id for c in fake_step(sched, bm)] == ["a", "placed", "b"]
    assert list(sched.waiting) == [held] and not held.block_table
    open_for.add("held")
    assert [c.seq.request_id for c in fake_step(sched, bm)] == ["a", "placed", "b", "held"]
    while sched.has_work():
        fake_step(sched, bm)
    assert bm.all_free()


def test_a_sequence_with_its_kv_is_parked_while_the_gate_is_closed():
    """add_running (a decode replica's landed K/V): parked, first in first out, while the gate is
    closed to it; finishing a parked one frees its blocks."""
    placed: set[str] = set()
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, 8, 64, gate=lambda s: s.request_id in placed)
    landed = []
    for rid in ("x", "y"):
        s = seq(6, rid)
        blocks = bm.reserve(6)
        bm.adopt(s, blocks, 6)
        s.num_computed_tokens = 5           # the prefill computed all but the last (sampled) token
        sched.add_running(s)
        landed.append(s)
    assert list(sched.parked) == landed and sched.running == [] and sched.has_work()
    assert fake_step(sched, bm) == []
    placed.add("x")
    assert [c.seq.request_id for c in fake_step(sched, bm)] == ["x"] and list(sched.parked) == [landed[1]]
    sched.finish(landed[1], "abort")
    assert not sched.parked and landed[1].status is SequenceStatus.FINISHED
    while sched.has_work():
        fake_step(sched, bm)
    assert bm.all_free()
