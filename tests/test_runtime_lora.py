"""LoRA adapters loaded at run time, without Ray: an engine loads one at the first request that
brings its path (the output is the configured adapter's), holds at most `max_loras` of them (the
least recently used idle one goes; a request finding every slot in use waits in the queue, and so
do requests of run-time adapters behind it; one whose K/V has landed in a decode engine waits
parked with its blocks), treats a name loaded again as a new adapter (its own output, none of the old
one's cached K/V), reads the adapter ahead on the async engine's worker thread (admission only
finds it read), and refuses an adapter it cannot serve with the reason and keeps serving; the router's
side checks an adapter's tensors against the model from the safetensors header alone."""

import asyncio
import json
import os
import shutil
import threading

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import engine.lora
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import Rejected
from engine.lora_config import check_adapter, safetensors_shapes
from engine.model_dims import Dims
from engine.sampling_params import SamplingParams
from lora_adapters import ATTENTION, write_adapter
from router.runtime_lora import LoadLoraAdapterRequest, RuntimeLoras
from serving import messages
from tiny_models import tiny_model_dir

PROMPT = list(range(100, 140))
GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime-lora")
    path = tiny_model_dir(root / "llama", "llama", seed=5)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, {name: write_adapter(root / name, hf, seed=seed) for name, seed in (("a", 1), ("b", 2), ("c", 3))}


def _engine(path, adapters=None, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", kv_cache_memory="16MiB",
                                  block_size=4, lora_modules={k: str(v) for k, v in (adapters or {}).items()}, **kw))


def _runtime(name, directory, lora_id, **kw) -> SamplingParams:
    return SamplingParams(**GREEDY, lora=name, lora_path=str(directory), lora_id=lora_id, **kw)


def _finish(eng: LLMEngine) -> None:
    while eng.has_work():
        eng.step()


def test_an_adapter_loaded_at_the_first_request_runs_as_a_configured_one(tiny):
    path, adapters = tiny
    configured = _engine(path, adapters)
    expected = {name: configured.generate([PROMPT], SamplingParams(**GREEDY, lora=name))[0].token_ids
                for name in (None, "a", "b")}
    eng = _engine(path)
    assert eng.runner.loras.empty
    outs = eng.generate([PROMPT] * 3, [SamplingParams(**GREEDY), _runtime("a", adapters["a"], 11),
                                       _runtime("b", adapters["b"], 12)])      # one batch: base and two adapters
    assert [out.token_ids for out in outs] == [expected[None], expected["a"], expected["b"]]
    assert eng.runner.loras.held() == [("a", 11), ("b", 12)] and eng.block_manager.all_free()


def _run(eng: LLMEngine, arrivals: dict[int, list] = None) -> tuple[dict, dict]:
    """Step `eng` to the end, adding `arrivals[step]` (request id, params) before that step: each
    request's first step with output and its tokens."""
    first, tokens, step = {}, {}, 0
    while eng.has_work() or step < max(arrivals or [0]):
        step += 1
        for rid, params in (arrivals or {}).get(step, []):
            assert eng.add_request(rid, PROMPT, params) is None
        for out in eng.step():
            assert out.error is None
            first.setdefault(out.request_id, step)
            tokens[out.request_id] = tokens.get(out.request_id, []) + out.new_token_ids
    return first, tokens


def test_max_loras_evicts_the_least_recently_used_idle_adapter_and_queues_when_all_are_busy(tiny):
    """c finds max_loras 2 adapters running (a, b): it waits, while a2 behind it (a is placed) and
    the base model's request go past; c starts in a's place once a and b are done."""
    path, adapters = tiny
    configured = _engine(path, adapters)
    expected = {name: configured.generate([PROMPT], SamplingParams(**GREEDY, lora=name))[0].token_ids
                for name in ("a", "b", "c")}
    eng = _engine(path, max_loras=2)
    for rid, name, lora_id in (("a", "a", 1), ("b", "b", 2), ("c", "c", 3), ("a2", "a", 1)):
        assert eng.add_request(rid, PROMPT, _runtime(name, adapters[name], lora_id)) is None
    assert eng.add_request("base", PROMPT, SamplingParams(**GREEDY)) is None
    eng.step()
    assert (eng.stats()["running"], eng.stats()["waiting"], eng.stats()["lora_waiting"]) == (4, 1, 1)
    first, tokens = _run(eng)
    assert eng.stats()["lora_waiting"] == 0 and first["c"] == GREEDY["max_tokens"]   # after the first step's 1
    assert {name: tokens[name] for name in expected} == {name: expected[name][1:] for name in ("a", "b")} | \
        {"c": expected["c"]} and tokens["a2"] == expected["a"][1:]
    assert eng.runner.loras.held() == [("b", 2), ("c", 3)]      # c took the place of a, the least recently used
    assert (eng.stats()["lora_loads"], eng.stats()["lora_evictions"]) == (3, 1)
    assert eng.block_manager.all_free()


def test_a_request_waiting_for_a_place_is_not_starved_by_new_requests_of_the_adapters_held(tiny):
    """max_loras 1: a1 runs, c waits; a2 and a3 arrive while a1 runs. a is drained for c (a2 and a3
    wait), so c starts when a1 ends, and a2 and a3 after c."""
    path, adapters = tiny
    eng = _engine(path, max_loras=1)
    a = _runtime("a", adapters["a"], 1)
    first, _ = _run(eng, {1: [("a1", a), ("c", _runtime("c", adapters["c"], 3))], 2: [("a2", a)], 4: [("a3", a)]})
    n = GREEDY["max_tokens"]
    assert first == {"a1": 1, "c": 1 + n, "a2": 1 + 2 * n, "a3": 1 + 2 * n}, first
    assert eng.block_manager.all_free()


def test_a_waiting_request_whose_adapter_is_gone_when_placed_fails_alone(tiny, tmp_path):
    """Read at admission, c is not kept read while it waits (more adapters waiting than max_loras
    read ahead): its directory gone by the time it is placed, it fails with a 400 and frees its
    blocks; the rest run on."""
    path, adapters = tiny
    gone = shutil.copytree(adapters["c"], tmp_path / "c")
    eng = _engine(path, max_loras=1)
    assert eng.add_request("a", PROMPT, _runtime("a", adapters["a"], 1)) is None
    eng.step()                                       # a runs: c waits for its place
    assert eng.add_request("c", PROMPT, _runtime("c", gone, 3)) is None
    assert eng.add_request("b", PROMPT, _runtime("b", adapters["b"], 2)) is None     # read last: c's dropped
    shutil.rmtree(gone)
    outs = [out for _ in iter(eng.has_work, False) for out in eng.step()]
    failed = [out for out in outs if out.error is not None]
    assert [(out.request_id, out.error_code) for out in failed] == [("c", 400)]
    assert "LoRA adapter 'c'" in failed[0].error
    assert {out.request_id for out in outs if out.finish_reason == "length"} == {"a", "b"}
    assert eng.runner.loras.held() == [("b", 2)] and eng.block_manager.all_free()


def test_a_decode_engine_parks_a_landed_request_until_its_adapter_has_a_place(tiny):
    """Landed in a decode engine of max_loras 1 while a runs: b and c are parked with their blocks
    (their first tokens out); c, aborted there, frees them; b decodes once a is done, before d,
    which lands between a's end and the next step (it parks behind b rather than take the place)."""
    path, adapters = tiny
    prefill, decode = _engine(path), _engine(path, max_loras=1)
    expected = {name: _engine(path, {name: adapters[name]}).generate(
        [PROMPT], SamplingParams(**GREEDY, lora=name))[0].token_ids for name in ("a", "b", "c")}
    tokens = {}

    def land(rid, name, lora_id):
        params = _runtime(name, adapters[name], lora_id)
        prefill.add_request(rid, PROMPT, params, hold_blocks=True)
        first = [t for _ in iter(prefill.has_work, False) for out in prefill.step() for t in out.new_token_ids]
        blocks, cached = decode.reserve_cached(PROMPT, params.cache_key)
        assert cached == 0 and len(first) == 1
        decode.import_kv(blocks, prefill.runner.export_blocks(prefill.held_blocks(rid)))
        prefill.release(rid)
        out = decode.add_prefilled(rid, PROMPT, first[0], params, blocks)
        assert not isinstance(out, Rejected) and out.new_token_ids == first, out
        tokens[rid] = first

    for lora_id, name in enumerate(("a", "b", "c"), 1):
        land(name, name, lora_id)
    assert decode.runner.loras.held() == [("a", 1)] and [s.request_id for s in decode.scheduler.parked] == ["b", "c"]
    assert (decode.stats()["waiting"], decode.stats()["lora_waiting"]) == (2, 2)
    free = decode.block_manager.num_free_blocks
    assert decode.abort("c").finish_reason == "abort" and decode.block_manager.num_free_blocks > free
    last_step, step = {}, 0
    while decode.has_work():
        step += 1
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
            last_step[out.request_id] = step
            if out.request_id == "a" and out.finished:
                land("d", "c", 4)      # a new load id: none of c's cached K/V
    assert {name: tokens[name] for name in ("a", "b")} == {name: expected[name] for name in ("a", "b")}
    assert tokens["d"] == expected["c"]
    n = GREEDY["max_tokens"]
    assert last_step["b"] - last_step["a"] == n - 1 and last_step["d"] - last_step["b"] == n - 1    # one after another
    assert decode.runner.loras.held() == [("c", 4)] and decode.stats()["lora_evictions"] == 2
    assert decode.block_manager.all_free()


def test_a_name_loaded_again_is_a_new_adapter(tiny):
    """The router gives every load a new id: same name, other weights, none of the old K/V."""
    path, adapters = tiny
    eng = _engine(path)
    first = eng.generate([PROMPT], _runtime("x", adapters["a"], 1))[0]
    again = eng.generate([PROMPT], _runtime("x", adapters["a"], 1))[0]
    reloaded = eng.generate([PROMPT], _runtime("x", adapters["b"], 2))[0]
    assert again.num_cached_tokens == 36 and again.token_ids == first.token_ids       # a prefix hit
    assert reloaded.num_cached_tokens == 0 and reloaded.token_ids != first.token_ids
    assert reloaded.token_ids == eng.generate([PROMPT], _runtime("b", adapters["b"], 3))[0].token_ids


def test_the_async_engine_reads_the_adapter_on_its_worker_thread(tiny, monkeypatch):
    path, adapters = tiny
    reads: list[str] = []
    real = engine.lora._load_one

    def load_and_record(*args):
        reads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(engine.lora, "_load_one", load_and_record)
    aengine = AsyncEngine(lambda: _engine(path))
    params = _runtime("a", adapters["a"], 5)

    async def run():
        await aengine.prepare(params)
        return [out async for out in aengine.stream("r", lambda e: e.add_request("r", PROMPT, params))]

    try:
        outs = asyncio.run(run())
        assert not aengine.engine.needs_prepare(params) and aengine.engine.needs_prepare(
            _runtime("a", adapters["a"], 6))        # another load id: another adapter
    finally:
        aengine.shutdown()
    assert outs[-1].finished and outs[-1].error is None
    assert len(reads) == 1 and reads[0].startswith("pdserve-prepare"), reads
    assert aengine.engine.runner.loras.held() == [("a", 5)]


def test_an_adapter_it_cannot_serve_is_refused_and_the_engine_serves_on(tiny, tmp_path):
    path, adapters = tiny
    eng = _engine(path)
    missing = eng.add_request("r1", PROMPT, _runtime("m", tmp_path / "nowhere", 1))
    assert missing.code == 400 and "no adapter_config.json" in missing.reason
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((adapters["a"] / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    bad = eng.add_request("r2", PROMPT, _runtime("b", broken, 2))
    assert bad.code == 400 and "LoRA adapter 'b'" in bad.reason
    assert eng.runner.loras.empty and not eng.has_work()
    assert eng.generate([PROMPT], _runtime("a", adapters["a"], 3))[0].finish_reason == "length"
    assert SamplingParams(lora="a", lora_id=3).validate() is not None     # an id needs its path
    assert SamplingParams(lora_path="/x").validate() is not None          # a path needs its name and id


def test_the_router_checks_tensors_from_the_header_alone(tiny, tmp_path):
    path, adapters = tiny
    dims = Dims.of_config(AutoConfig.from_pretrained(path))
    runner = _engine(path).runner
    assert dims == runner.loras.dims
    assert check_adapter(str(adapters["a"]), dims).path == str(adapters["a"])
    shapes = safetensors_shapes(str(adapters["a"] / "adapter_model.safetensors"))
    assert len(shapes) == 2 * 7 * runner.hf_config.num_hidden_layers and all(len(s) == 2 for s in shapes.values())
    other = tiny_model_dir(tmp_path / "wide", "qwen2", seed=1, head_dim=32)
    wide = write_adapter(tmp_path / "wide-adapter", AutoModelForCausalLM.from_pretrained(other), ATTENTION)
    assert "do not fit the model" in check_adapter(str(wide), dims)
    config = json.loads((adapters["a"] / "adapter_config.json").read_text())
    (wide / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    assert "DoRA is not supported" in check_adapter(str(wide), dims)


def test_a_restarted_router_restores_its_predecessors_memory():
    before = RuntimeLoras(Dims(8, 16, 2, 1, 4, 2), ("model",))
    before.add("x", "/a")
    before.add("y", "/b")
    kept = messages.encode(before.registry())          # in the ResponseStore
    after = RuntimeLoras(Dims(8, 16, 2, 1, 4, 2), ("model", "y"))      # y is in the configuration now
    after.restore(messages.decode(kept, expect=messages.RuntimeLoraRegistry))
    assert after.loaded == {"x": before.loaded["x"]}   # the same load id: the replicas' copies stay good


def test_the_routers_memory_of_loaded_adapters():
    loras = RuntimeLoras(Dims(8, 16, 2, 1, 4, 2), ("model", "configured"))
    assert "served already" in loras.name_problem("model", False)
    assert "served already" in loras.name_problem("configured", True)
    loras.add("x", "/a")
    first = loras.loaded["x"].lora_id
    assert "already been loaded" in loras.name_problem("x", False) and loras.name_problem("x", True) is None
    loras.add("x", "/b")
    assert loras.loaded["x"].path == "/b" and loras.loaded["x"].lora_id not in (0, first)
    assert loras.remove("configured")[0] == 400 and loras.remove("nope")[0] == 404
    assert loras.remove("x") is None and loras.names == ()
    with pytest.raises(ValueError):
        LoadLoraAdapterRequest(lora_name=" padded", lora_path="/a")
    assert loras.check_path("~/nowhere").startswith(os.path.expanduser("~/nowhere") + ":")    # as the config reads it
