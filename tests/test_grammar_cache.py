"""Grammars compiled once and off the engine thread: `GrammarCompiler` keeps the latest compiled
grammars and hands each request a copy; `LLMEngine.prepare` (any thread) fills that cache, and
`AsyncEngine.prepare` runs it on its grammar thread, so admission on the engine thread only
copies (tiny random model, the default model's tokenizer)."""

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.structured_output import CACHED_GRAMMARS, GrammarCompiler, StructuredOutput

PROMPT = list(range(200, 230))
SELF_REFERENCE = StructuredOutput("json_schema", json.dumps({"$ref": "#"}))   # compiles; fails at its first mask


def schema(i: int) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps({
        "type": "object", "required": [f"k{i}", "n"], "additionalProperties": False,
        "properties": {f"k{i}": {"enum": ["red", "green", "blue"]},
                       "n": {"type": "integer", "minimum": 0, "maximum": 99}}}))


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", kv_cache_memory="16MiB"))


@pytest.fixture()
def compiler(engine):
    return GrammarCompiler(engine.tokenizer, engine.runner.vocab_size, list(engine.eos_token_ids))


def test_a_grammar_is_compiled_once_and_each_request_gets_its_own_copy(engine, compiler):
    spec = schema(0)
    assert not compiler.has(spec)
    assert compiler.compile(spec) is compiler.compile(spec) and compiler.has(spec)
    a, b = compiler.matcher(spec), compiler.matcher(spec)
    start = a.bitmask()
    assert b.bitmask() == start and compiler.compile(spec).compute_bitmask() == start
    for token in engine.tokenizer.encode('{"k0": "'):
        assert a.accept(token)
    assert a.bitmask() != start                       # a moved on; b and the cached one did not
    assert b.bitmask() == start and compiler.compile(spec).compute_bitmask() == start
    # the same grammar behind a <think> block shares the compiled grammar too
    think = StructuredOutput(spec.kind, spec.value, think=(5, 6, False))
    assert compiler.matcher(think).problem() is None and compiler.compile(think) is compiler.compile(spec)


def test_the_cache_keeps_the_latest_grammars_and_never_a_failed_one(compiler):
    first = compiler.compile(schema(0))
    for i in range(1, CACHED_GRAMMARS):
        compiler.compile(schema(i))
    assert compiler.compile(schema(0)) is first        # a hit: now the most recent
    compiler.compile(schema(CACHED_GRAMMARS))          # evicts schema(1), the least recent
    assert compiler.compile(schema(0)) is first
    assert len(compiler._compiled) == CACHED_GRAMMARS
    assert ("json_schema", schema(1).value) not in compiler._compiled
    failed = compiler.compile(SELF_REFERENCE)
    assert failed.is_error() and compiler.compile(SELF_REFERENCE) is not failed
    assert compiler.matcher(SELF_REFERENCE).problem() is not None


def test_threads_compiling_and_copying_at_once_agree_with_one_thread(engine, compiler):
    specs = [schema(i % 6) for i in range(48)]
    alone = GrammarCompiler(engine.tokenizer, engine.runner.vocab_size, list(engine.eos_token_ids))
    expected = {s.value: alone.matcher(s).bitmask() for s in specs}
    with ThreadPoolExecutor(8) as pool:
        masks = list(pool.map(lambda s: (s.value, compiler.matcher(s).bitmask()), specs))
    assert all(mask == expected[value] for value, mask in masks)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_precompiled_grammar_gives_what_compiling_at_admission_gives(engine, seed):
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=40, structured=schema(100 + seed))
    engine.admission.grammars = None               # a fresh compiler: admission compiles the grammar itself
    inline = engine.generate([PROMPT], params)[0]
    engine.admission.grammars = None
    worker = threading.Thread(target=engine.prepare, args=(params,))
    worker.start()
    worker.join()
    key = ("json_schema", params.structured.value)
    cached = engine.admission.grammars._compiled[key]
    ahead = engine.generate([PROMPT], params)[0]
    assert engine.admission.grammars._compiled[key] is cached      # admission copied, did not compile
    assert ahead.token_ids == inline.token_ids and ahead.text == inline.text
    assert 0 <= json.loads(ahead.text)["n"] <= 99 and engine.block_manager.all_free()


def test_a_bad_spec_precompiled_is_still_rejected_at_admission(engine):
    engine.prepare(SamplingParams(max_tokens=8, structured=SELF_REFERENCE))
    engine.prepare(SamplingParams(max_tokens=8, structured=StructuredOutput("regex", "a(b")))
    for spec, words in ((SELF_REFERENCE, "structured output"), (StructuredOutput("regex", "a(b"), "invalid regex")):
        rejected = engine.add_request("bad", PROMPT, SamplingParams(max_tokens=8, structured=spec))
        assert rejected is not None and words in rejected.reason
    assert engine.live_request_ids() == []


def test_the_async_engine_compiles_on_its_worker_thread(tiny_llama_dir, monkeypatch):
    """The compile (a cache miss) happens on the worker thread; the engine thread's admission
    finds the grammar compiled."""
    misses: list[str] = []
    real = GrammarCompiler.compile

    def compile_and_record(self, spec):
        if (spec.kind, spec.value) not in self._compiled:
            misses.append(threading.current_thread().name)
        return real(self, spec)

    monkeypatch.setattr(GrammarCompiler, "compile", compile_and_record)
    aengine = AsyncEngine(lambda: LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu",
                                                         kv_cache_memory="16MiB")))
    params = SamplingParams(temperature=0, max_tokens=30, structured=schema(7))

    async def run():
        await aengine.prepare(params)
        await aengine.prepare(SamplingParams(max_tokens=4))     # no grammar: nothing to do
        return [out async for out in aengine.stream("r", lambda e: e.add_request("r", PROMPT, params))]

    try:
        outs = asyncio.run(run())
    finally:
        aengine.shutdown()
    assert outs[-1].finished and outs[-1].error is None
    assert len(misses) == 1 and misses[0].startswith("pdserve-prepare"), misses
    assert not aengine.engine.needs_prepare(params) and aengine.engine.needs_prepare(
        SamplingParams(structured=schema(8))) and not aengine.engine.needs_prepare(SamplingParams())
