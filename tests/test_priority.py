"""Priority scheduling (vLLM's `priority` with `scheduling_policy: priority`) in an engine: a
request of higher priority (a lower value) that arrives behind others is prefilled first; with
first come, first served a priority other than 0 is refused at admission (the router's 400 is in
tests/test_bad_input.py, the queue's order and preemption in tests/test_scheduler.py); a decode
reservation of a higher priority preempts running requests of a lower one when the pool is full,
and the preempted request still ends as it would have."""

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tiny_models import tiny_model_dir


def _first_token_order(eng: LLMEngine, priorities: dict[str, int]) -> list[str]:
    for i, (rid, p) in enumerate(priorities.items()):
        prompt = [10 + i * 7 + k for k in range(40)]
        assert eng.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=2, priority=p)) is None
    order = []
    while eng.has_work():
        for out in eng.step():
            if out.request_id not in order and out.new_token_ids:
                order.append(out.request_id)
    return order


def test_a_later_request_of_higher_priority_is_prefilled_first(tmp_path):
    path = tiny_model_dir(tmp_path / "llama", "llama", seed=1)
    common = dict(model=str(path), dtype="float32", device="cpu", kv_cache_memory="16MiB",
                  max_num_batched_tokens=40)      # one prompt a step
    eng = LLMEngine(EngineConfig(**common, scheduling_policy="priority"))
    assert _first_token_order(eng, {"a": 0, "b": 5, "c": 0, "urgent": -2}) == ["urgent", "a", "c", "b"]
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    fcfs = LLMEngine(EngineConfig(**common))
    assert _first_token_order(fcfs, {"a": 0, "b": 0, "c": 0}) == ["a", "b", "c"]
    rejected = fcfs.add_request("x", [1, 2, 3], SamplingParams(priority=1))
    assert rejected is not None and "scheduling_policy priority" in rejected.reason


def test_a_decode_reservation_preempts_lower_priorities_when_the_pool_is_full(tmp_path):
    path = tiny_model_dir(tmp_path / "llama", "llama", seed=1)
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", kv_cache_memory="48KiB",
                                 block_size=4, scheduling_policy="priority"))
    bm = eng.block_manager
    assert 16 <= bm.num_blocks <= 32
    prompt = [7 + k for k in range(4 * bm.num_blocks - 6)]
    greedy = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = eng.generate([prompt], SamplingParams(**greedy))[0].token_ids
    assert eng.add_request("low", prompt, SamplingParams(**greedy, priority=3)) is None
    outs = {out.request_id: out for out in eng.step()}          # prefilled: one block left free
    assert bm.num_free_blocks <= 1
    incoming = list(range(300, 316))                            # 4 blocks
    assert eng.reserve_cached(incoming, priority=3) is None     # the same priority: no room
    blocks, cached = eng.reserve_cached(incoming, priority=0)
    assert len(blocks) == 4 and cached == 0 and eng.scheduler.num_preemptions == 1
    eng.release_reservation(blocks)
    tokens = list(outs["low"].new_token_ids)
    while eng.has_work():
        tokens += [t for out in eng.step() for t in out.new_token_ids]
    assert tokens == expected and bm.all_free()          # recomputed after the preemption


def test_the_flag_sets_the_policy_of_every_pools_engine(tmp_path):
    """`--scheduling-policy priority` (vLLM's flag): every pool's engine schedules by priority."""
    from pdserve import cli
    path = tiny_model_dir(tmp_path / "llama", "llama", seed=1)
    (tmp_path / "s.yaml").write_text(f"model: {path}\n")
    for flags, policy in (([], "fcfs"), (["--scheduling-policy", "priority"], "priority")):
        cfg = cli._app_config(cli.build_parser().parse_args(["serve", "--config", str(tmp_path / "s.yaml"), *flags]))
        assert cfg.scheduling_policy == policy
        assert {cfg.engine_config(pool, str(path)).scheduling_policy for pool in ("prefill", "decode", "colocated")} \
            == {policy}
