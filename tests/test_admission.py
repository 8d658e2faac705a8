"""One admission call: the engine checks and admits a request in one call and hands a bad one
back as a `Rejected` value (nothing allocated); `AsyncEngine.stream` makes it one engine round
trip and never touches another live request that has the same id."""

import asyncio

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
    aengine = AsyncEngine(engine)
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
    aengine = AsyncEngine(engine)
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
