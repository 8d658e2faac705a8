"""One admission call: the engine checks and admits a request in one call and hands a bad one
back as a `Rejected` value (nothing allocated); `AsyncEngine.stream` makes it one engine round
trip and never touches another live request that has the same id."""

import asyncio
import dataclasses
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import Rejected
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", kv_cache_memory="16MiB"))


def too_long(engine) -> list[int]:
    return [5] * engine.max_model_len


def test_add_request_returns_rejected_and_queues_nothing(engine):
    free = engine.block_manager.num_free_blocks
    out = engine.add_request("long", too_long(engine), GREEDY)
    assert isinstance(out, Rejected) and out.request_id == "long" and "maximum context length" in out.reason
    assert isinstance(engine.add_request("empty", [], GREEDY), Rejected)
    assert not engine.has_work() and engine.live_request_ids() == []
    assert engine.block_manager.num_free_blocks == free
    with pytest.raises(ValueError, match="maximum context length"):
        engine.generate([too_long(engine)], GREEDY)
    assert engine.live_request_ids() == []


def test_add_prefilled_rejected_leaves_the_reservation_with_the_caller(engine):
    prompt = too_long(engine)
    blocks = engine.reserve(16)
    out = engine.add_prefilled("pf", prompt, 7, GREEDY, blocks)
    assert isinstance(out, Rejected) and engine.live_request_ids() == []
    engine.release_reservation(blocks)       # still the caller's to release


def test_stream_checks_and_admits_in_one_engine_call(engine):
    aengine = AsyncEngine(lambda: engine)
    calls = []
    submit = aengine.submit
    aengine.submit = lambda fn: calls.append(fn) or submit(fn)

    async def run(rid, ids):
        return [out async for out in aengine.stream(rid, lambda e: e.add_request(rid, ids, GREEDY))]

    try:
        bad = asyncio.run(run("bad", too_long(engine)))
        assert len(bad) == 1 and isinstance(bad[0], Rejected) and len(calls) == 1
        calls.clear()
        good = asyncio.run(run("good", [5, 6, 7]))
        assert good[-1].finished and sum(len(o.new_token_ids) for o in good) == 4 and len(calls) == 1
    finally:
        aengine.shutdown()


def test_a_duplicate_id_is_rejected_without_touching_the_live_request(engine):
    aengine = AsyncEngine(lambda: engine)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def run():
        first = aengine.stream("dup", lambda e: e.add_request("dup", [5, 6, 7], params))
        outs = [await first.__anext__()]
        second = [out async for out in aengine.stream("dup", lambda e: e.add_request("dup", [8, 9], params))]
        outs += [out async for out in first]
        return outs, second

    try:
        outs, second = asyncio.run(run())
        assert len(second) == 1 and isinstance(second[0], Rejected) and "already in use" in second[0].reason
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert sum(len(o.new_token_ids) for o in outs) == 24
    finally:
        aengine.shutdown()


def test_a_reader_that_falls_behind_gets_the_ready_outputs_merged(engine):
    """A stream read slowly hands on several steps' tokens per output (one message instead of one
    per step), and the tokens, text and logprobs are the same as read at once."""
    aengine = AsyncEngine(lambda: engine)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)

    async def run(rid, pause):
        outs = []
        async for out in aengine.stream(rid, lambda e: e.add_request(rid, [5, 6, 7], params)):
            outs.append(out)
            await asyncio.sleep(pause)     # the engine steps on meanwhile
        return outs

    try:
        fast, slow = asyncio.run(run("fast", 0)), asyncio.run(run("slow", 0.05))
    finally:
        aengine.shutdown()
    assert len(slow) < len(fast) and slow[-1].finished and slow[-1].finish_reason == "length"
    assert any(len(o.new_token_ids) > 1 for o in slow)

    def joined(outs):
        return ([t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs),
                [(lp.token_id, round(lp.logprob, 4)) for o in outs for lp in o.logprobs or ()])
    assert joined(slow) == joined(fast) and len(joined(slow)[0]) == 12 == len(joined(slow)[2])
    assert slow[-1].num_output_tokens == 12


def test_a_paced_stream_sends_at_most_one_message_per_interval(engine):
    """`min_interval_s` holds outputs that come sooner than the interval after the last message
    and sends them as one; the first output (unless `hold_first`) and a finishing one are never
    held. The tokens, text and logprobs are those of the unpaced stream."""
    aengine = AsyncEngine(lambda: engine)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)

    async def run(rid, interval, hold_first=False):
        outs, times = [], []
        async for out in aengine.stream(rid, lambda e: e.add_request(rid, [5, 6, 7], params), interval,
                                        hold_first):
            outs.append(out)
            times.append(asyncio.get_running_loop().time())
        return outs, times

    def joined(outs):
        return ([t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs),
                [(lp.token_id, round(lp.logprob, 4)) for o in outs for lp in o.logprobs or ()])

    try:
        plain, _ = asyncio.run(run("plain", 0.0))
        paced, times = asyncio.run(run("paced", 0.02))
        start = time.monotonic()
        held, _ = asyncio.run(run("held", 60.0))
        waited = time.monotonic() - start
        held_first, _ = asyncio.run(run("held_first", 60.0, hold_first=True))
    finally:
        aengine.shutdown()
    assert joined(paced) == joined(plain) == joined(held) == joined(held_first) and len(joined(plain)[0]) == 40
    assert len(paced) < len(plain) and paced[-1].finished and paced[-1].num_output_tokens == 40
    gaps = [b - a for a, b in zip(times, times[1:-1])]     # the last message may come sooner
    assert all(g >= 0.02 - 1e-3 for g in gaps), gaps
    # a 60 s interval: the first token at once, then everything else when it finishes, not 60 s later
    assert [len(o.new_token_ids) for o in held] == [1, 39] and held[-1].finished and waited < 30
    # `hold_first` (a decode replica's stream): the first output waits too, here for the finish
    assert [len(o.new_token_ids) for o in held_first] == [40] and held_first[0].finished


def test_the_prefill_backlog_counts_what_the_cache_lacks_and_what_is_queued(engine):
    """`cached_prompt_tokens` and `prefill_backlog` (a decode replica's test for prefilling a prompt
    itself): the leading full blocks its prefix cache holds (none for prompt logprobs), the tokens
    after them plus the prompt tokens already queued; they change nothing."""
    bs = engine.config.block_size
    turn1 = list(range(100, 100 + 3 * bs + 5))
    out = engine.generate([turn1], GREEDY)[0].token_ids            # computed, then cached
    turn2 = turn1 + out + [7] * 9
    held = (len(turn1) + len(out) - 1) // bs * bs                   # the last token is never computed
    free = engine.block_manager.num_free_blocks
    assert engine.cached_prompt_tokens(turn2, GREEDY) == held
    assert engine.prefill_backlog(turn2, GREEDY) == len(turn2) - held
    assert engine.cached_prompt_tokens(turn2, dataclasses.replace(GREEDY, prompt_logprobs=0)) == 0
    assert engine.prefill_backlog(turn2, dataclasses.replace(GREEDY, prompt_logprobs=0)) == len(turn2)
    assert engine.cached_prompt_tokens([9] * 20, GREEDY) == 0
    assert engine.prefill_backlog([9] * 20, GREEDY) == 20          # nothing cached
    assert engine.add_request("queued", [8] * 30, GREEDY) is None
    assert engine.prefill_backlog(turn2, GREEDY) == len(turn2) - held + 30
    assert engine.block_manager.num_free_blocks == free
    engine.abort("queued")
    assert engine.live_request_ids() == []
