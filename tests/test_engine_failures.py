"""An engine step that fails ends the requests it was stepping, never the blocks under a running
KV push; a replica whose engine keeps failing (or whose engine thread or KV receiver is gone)
fails its health check. Real engines (tiny model), a real gloo pair in this process, and the
real DecodeServer replica class outside Serve; the step failure is injected into the runner."""

import asyncio
import threading

import pytest
import torch

from engine.async_engine import MAX_STEP_FAILURES, AsyncEngine, EngineDeadError
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kv_transfer import KVReceiver, KVSender, TransferConfig, fingerprint_for
from kv_transfer.channel import Channel

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = list(range(100, 150))      # 50 tokens: 4 blocks of 16
CFG = TransferConfig(connect_timeout_s=15, transfer_timeout_s=20, lease_s=30)


def tiny_engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", kv_cache_memory="16MiB"))


def fail_steps(engine: LLMEngine, count: int) -> None:
    """The engine's next `count` forwards raise (an injected step failure)."""
    real_run, left = engine.runner.run, [count]

    def run(*args, **kwargs):
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("injected step failure")
        return real_run(*args, **kwargs)
    engine.runner.run = run


async def first_output(aengine: AsyncEngine, rid: str, prompt, params, hold: bool):
    out = None
    async for out in aengine.stream(rid, lambda e: e.add_request(rid, prompt, params, hold_blocks=hold)):
        pass
    return out


def test_a_failed_step_during_a_push_leaves_the_pushed_blocks_alone(tiny_llama_dir, monkeypatch):
    decode = tiny_engine(tiny_llama_dir)
    expected = decode.generate([PROMPT], GREEDY)[0].token_ids
    prefill = AsyncEngine(lambda: tiny_engine(tiny_llama_dir))
    pool_p, pool_d = prefill.engine.runner.kv_pool, decode.runner.kv_pool
    fp = fingerprint_for(pool_p, "tiny")
    stalled, release = threading.Event(), threading.Event()
    real_post_recv = Channel.post_recv

    def post_recv(self, tensor):            # the push's data waits until the failed step is over
        stalled.set()
        release.wait(30)
        return real_post_recv(self, tensor)
    monkeypatch.setattr(Channel, "post_recv", post_recv)
    try:
        with KVReceiver(pool_d, fp, CFG) as receiver, KVSender(pool_p, fp, CFG) as sender:
            first = asyncio.run(first_output(prefill, "a", PROMPT, GREEDY, hold=True))
            held = prefill.submit(lambda e: e.held_blocks("a")).result(10)
            reserved = decode.reserve(len(PROMPT))
            landed = receiver.expect("a", reserved)
            result = {}
            push = threading.Thread(target=lambda: result.update(r=sender.send(receiver.address, "a", held)))
            push.start()
            assert stalled.wait(30)           # the push is reading the held blocks now
            fail_steps(prefill.engine, 1)
            with pytest.raises(EngineDeadError):   # the failed step fails the request it stepped
                asyncio.run(first_output(prefill, "b", list(range(200, 260)), GREEDY, hold=False))
            bm = prefill.engine.block_manager
            assert all(bm.blocks[b].ref_count > 0 for b in held)   # still held for the push
            other = asyncio.run(first_output(prefill, "c", list(range(300, 364)), GREEDY, hold=False))
            assert other.finished                          # the engine steps on
            release.set()
            push.join(30)
            assert result["r"].ok and landed.result(10).ok, result
            prefill.submit(lambda e: e.release("a")).result(10)
            assert prefill.submit(lambda e: e.block_manager.all_free()).result(10)
        out = decode.add_prefilled("a", PROMPT, first.new_token_ids[0], GREEDY, reserved)
        tokens = list(out.new_token_ids)
        while decode.has_work():
            tokens += [t for o in decode.step() for t in o.new_token_ids]
        assert tokens == expected             # greedy output as one engine's: no corrupted KV
        assert decode.block_manager.all_free()
    finally:
        release.set()
        prefill.shutdown()


def test_repeated_step_failures_make_the_engine_unhealthy_and_a_good_step_heals_it(tiny_llama_dir):
    aengine = AsyncEngine(lambda: tiny_engine(tiny_llama_dir))
    try:
        assert aengine.health() == ""
        fail_steps(aengine.engine, MAX_STEP_FAILURES)
        for i in range(MAX_STEP_FAILURES):
            assert aengine.health() == ""
            with pytest.raises(EngineDeadError):
                asyncio.run(first_output(aengine, f"f{i}", PROMPT, GREEDY, hold=False))
        assert "steps all failed" in aengine.health()
        assert asyncio.run(first_output(aengine, "ok", PROMPT, GREEDY, hold=False)).finished
        assert aengine.health() == ""
        assert aengine.submit(lambda e: e.block_manager.all_free()).result(10)
    finally:
        aengine.shutdown()
    assert "dead or stopped" in aengine.health()


def test_a_decode_replica_fails_its_health_check_when_it_cannot_serve(tiny_llama_dir):
    """The real DecodeServer replica class, built outside Serve: healthy, then unhealthy after
    repeated step failures (Serve replaces a replica whose check_health raises), healthy again
    after a good step, and unhealthy for good once its KV receiver is broken."""
    from decode_service.server import DecodeServer
    from serving.config import AppConfig

    cfg = AppConfig(model=str(tiny_llama_dir), served_model_name="tiny", transfer={"host": "127.0.0.1"},
                    engine={"kv_cache_memory": "16MiB", "dtype": "float32", "device": "cpu"})
    replica = DecodeServer.func_or_class(cfg.model_dump())
    try:
        asyncio.run(replica.check_health())
        fail_steps(replica.host.engine, MAX_STEP_FAILURES)
        for i in range(MAX_STEP_FAILURES):
            with pytest.raises(EngineDeadError):
                asyncio.run(first_output(replica.host.aengine, f"f{i}", PROMPT, GREEDY, hold=False))
        with pytest.raises(RuntimeError, match="steps all failed"):
            asyncio.run(replica.check_health())
        asyncio.run(first_output(replica.host.aengine, "ok", PROMPT, GREEDY, hold=False))
        asyncio.run(replica.check_health())
        replica.receiver.close()
        with pytest.raises(RuntimeError, match="KV receiver is closed"):
            asyncio.run(replica.check_health())
    finally:
        replica.__del__()
    with pytest.raises(RuntimeError, match="dead or stopped"):
        asyncio.run(replica.check_health())
