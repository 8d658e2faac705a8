"""Prefix-cache affinity bookkeeping of the prefill router (router/prefix_affinity.py)."""

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from router.prefix_affinity import OWNERS_PER_BLOCK, AffinityTable, Candidate, block_hashes, choose


def test_block_hashes_are_the_engines_prefix_cache_keys():
    prompt = list(range(1000, 1075))                 # 4 full blocks of 16 and 11 tokens
    bm = BlockManager(num_blocks=8, block_size=16)
    seq = Sequence("r", prompt, SamplingParams())
    assert bm.allocate(seq)
    seq.num_computed_tokens = len(prompt)
    bm.mark_computed(seq)
    assert block_hashes(prompt, 16) == seq.block_hashes and len(seq.block_hashes) == 4
    assert block_hashes(prompt[:15], 16) == []


def test_matches_count_leading_blocks_per_replica():
    t = AffinityTable(block_size=4, max_blocks=100)
    system = list(range(12))                          # 3 shared blocks
    t.record("a", block_hashes(system + [50, 51, 52, 53], 4))
    t.record("b", block_hashes(system[:8] + [60, 61, 62, 63], 4))
    ask = block_hashes(system + [70, 71, 72, 73, 74], 4)
    assert t.matches(ask, ["a", "b", "c"]) == {"a": 3, "b": 2}
    assert t.matches(ask, ["b"]) == {"b": 2}
    assert t.matches(block_hashes([99] * 8, 4), ["a", "b"]) == {}
    # a block is not matched when an earlier one was not: only leading runs count
    assert t.matches(block_hashes([5, 5, 5, 5] + system[4:], 4), ["a"]) == {}


def test_owners_are_capped_and_old_blocks_evicted():
    t = AffinityTable(block_size=2, max_blocks=3)
    h = block_hashes([1, 2, 3, 4], 2)
    for r in range(OWNERS_PER_BLOCK + 1):
        t.record(r, h)
    assert t.matches(h, list(range(OWNERS_PER_BLOCK + 1))) == {r: 2 for r in range(1, OWNERS_PER_BLOCK + 1)}
    t.record("x", block_hashes([7, 7, 8, 8], 2))      # 4 entries > 3: the least recently used goes
    assert len(t) == 3
    assert t.matches(h, [1]) == {1: 1}                # its first block survived, its second did not
    t.forget(1)
    assert t.matches(h, [1, 2]) == {2: 1}
    t.forget("x")
    assert len(t) == 1


def test_choose_prefers_the_match_only_within_the_imbalance():
    cands = [Candidate("idle", 0, (0,)), Candidate("warm", 500, (500,)), Candidate("busy", 5000, (5000,))]
    assert choose(cands, {}, 2048) == (["idle", "warm", "busy"], "no_match")
    assert choose(cands, {"warm": 3}, 2048) == (["warm", "idle", "busy"], "affinity")
    assert choose(cands, {"warm": 3, "busy": 9}, 2048) == (["warm", "idle", "busy"], "affinity")  # busy: too far
    assert choose(cands, {"busy": 9}, 2048) == (["idle", "warm", "busy"], "imbalanced")
    assert choose(cands, {"busy": 9}, 10_000) == (["busy", "idle", "warm"], "affinity")
    assert choose(cands, {"warm": 2, "idle": 2}, 2048) == (["idle", "warm", "busy"], "affinity")  # tie: ranking
    assert choose([], {"x": 1}, 0) == ([], "no_match")
    # a credit per matched block (decode: the matched K/V is shared there, not added)
    assert choose(cands, {"busy": 9}, 2048, credit_per_block=350) == (["busy", "idle", "warm"], "affinity")
    assert choose(cands, {"busy": 9}, 2048, credit_per_block=300) == (["idle", "warm", "busy"], "imbalanced")


def test_the_routers_match_a_resumed_requests_prompt_and_resumed_tokens():
    """A resumed request (router/orchestrator.py, migration) is computed, and then cached, as its
    prompt followed by the tokens already out: affinity matches and records all of them, under the
    request's cache key, its LoRA adapter's and cache salt's (their blocks are their own: their hashes
    start from it)."""
    from types import SimpleNamespace

    from router.routing import ColocatedRouter, DecodeRouter, QueuedPromptTokensRouter
    from serving import messages
    for lora, salt, key in ((None, None, None), ("sql", None, (("sql", 0), None)), ("sql", None, (("sql", 7), None)),
                            (None, "s1", (None, "s1")), ("sql", "s1", (("sql", 0), "s1"))):
        lora_id = key[0][1] if key and key[0] else 0
        wire = messages.WireSamplingParams.of(SamplingParams(lora=lora, lora_id=lora_id, cache_salt=salt,
                                                             lora_path="/a" if lora_id else None))
        for cls, req in ((QueuedPromptTokensRouter, messages.PrefillRequest("r", (1, 2, 3), wire, "a:1", (7, 8), 4)),
                         (ColocatedRouter, messages.GenerateRequest("r", (1, 2, 3), wire, (7, 8), 4)),
                         (DecodeRouter, messages.DecodeRequest("r", (1, 2, 3), wire, (7, 8)))):
            router = object.__new__(cls)
            router.initialize_state()
            assert router._prompt(SimpleNamespace(args=[messages.encode(req)])) == ((1, 2, 3, 7, 8), key)
    keys = (None, (("sql", 0), None), (("x", 0), None), (("sql", 7), None), (("sql", 8), None), (None, "s1"),
            (None, "s2"), (("sql", 0), "s1"))
    hashes = [block_hashes([1, 2, 3, 4], 2, key) for key in keys]
    assert len({tuple(h) for h in hashes}) == len(keys)


def test_the_decode_router_sends_a_conversation_back_while_the_kv_it_holds_allows():
    """A decode replica's load is the KV it holds (used blocks, in tokens): the replica that
    received the conversation's earlier turn goes first within `max_imbalance_tokens` of the
    least loaded one plus the tokens matched (K/V shared there, not added), and the ranking (most
    free KV first) stands beyond it."""
    import asyncio
    from types import SimpleNamespace

    from router.routing import DecodeRouter
    from serving import messages
    from serving.ray_compat import PendingRequest
    wire = messages.WireSamplingParams.of(SamplingParams())
    router = object.__new__(DecodeRouter)
    router.initialize_state(block_size=4, max_imbalance_tokens=100)
    turn1 = tuple(range(20))
    turn2 = turn1 + (5, 6, 7, 8, 9)

    def replica(name, used):
        return SimpleNamespace(replica_id=name, max_ongoing_requests=8,
                               routing_stats={"kv_blocks_total": 1000, "kv_blocks_free": 1000 - used, "running": 1})

    async def order(replicas, prompt):
        pending = PendingRequest(args=[messages.encode(messages.DecodeRequest("r", prompt, wire))], kwargs={},
                                 metadata=None)
        return [r[0].replica_id for r in await router.choose_replicas(replicas, pending)]

    router.on_request_routed(SimpleNamespace(args=[messages.encode(messages.DecodeRequest("r", turn1, wire))]),
                             "warm", None)
    # turn 2 matches turn 1's 5 full blocks (20 tokens): up to 100 + 20 tokens more KV held is allowed
    assert asyncio.run(order([replica("idle", 0), replica("warm", 30)], turn2)) == ["warm", "idle"]  # 120 tokens
    assert asyncio.run(order([replica("idle", 0), replica("warm", 31)], turn2)) == ["idle", "warm"]  # 124
    assert asyncio.run(order([replica("idle", 0), replica("warm", 20)], (9,) * 25)) == ["idle", "warm"]
