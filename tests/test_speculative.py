"""Speculative decoding by prompt lookup: the n-gram index, the scheduler's handling of draft
tokens (torch-free), and the engine giving the same tokens, text, logprobs and finish reasons with
drafts as without, for every kind of request, alone, batched and split across a prefill and a
decode engine; its prefix cache holds only tokens that were kept, and every block ends free."""

import json

import pytest

from engine.block_manager import BlockManager, chain_hash
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.ngram import NgramIndex
from engine.outputs import Completion
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.structured_output import StructuredOutput
from engine_split import split_run


# ---- the index --------------------------------------------------------------------------------
def test_the_longest_suffix_seen_before_proposes_what_followed_its_latest_occurrence():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    index = NgramIndex(tokens)
    assert index.propose(2) == [7, 5]            # "1 2 3" last seen before at 4..6, then 7 5
    assert index.propose(9) == [7, 5, 1, 2, 3]   # up to the end
    tokens.append(4)                             # "2 3 4" / "3 4" never seen: no draft
    index.extend(tokens)
    assert index.propose(3) == []
    assert NgramIndex([5, 6, 7]).propose(3) == [] and NgramIndex([8]).propose(3) == []


def test_extending_the_index_equals_building_it_afresh():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    grown = NgramIndex(tokens[:3])
    seq = tokens[:3]
    for t in tokens[3:]:
        seq.append(t)
        grown.extend(seq)
        assert grown.propose(4) == NgramIndex(list(seq)).propose(4)


# ---- the scheduler --------------------------------------------------------------------------------
def _decoding(bm: BlockManager, rid: str, n: int) -> Sequence:
    seq = Sequence(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=50))
    assert bm.allocate(seq)
    seq.num_computed_tokens = n - 1
    return seq


def test_drafts_are_fed_whole_or_trimmed_to_the_budget_and_do_not_count_as_prompt_tokens():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=6)
    a, b = _decoding(bm, "a", 5), _decoding(bm, "b", 5)
    for seq in (a, b):
        seq.status = seq.status.RUNNING
        sched.running.append(seq)
        seq.add_draft([7, 8, 9])
    assert sched.num_waiting_tokens == 0
    chunks = sched.schedule()
    assert [(c.num_tokens, c.num_draft, c.num_logits, c.sample) for c in chunks] == [(4, 3, 4, True), (2, 1, 2, True)]
    assert b.token_ids[-2:] == [104, 7] and b.num_draft == 1      # the rest of its draft was taken back
    assert a.take_draft() == [7, 8, 9] and a.token_ids[-1] == 104 and a.num_computed_tokens == 4


def test_a_draft_is_dropped_rather_than_preempting_anyone():
    bm = BlockManager(3, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _decoding(bm, "a", 4), _decoding(bm, "b", 4)      # a block each, both full
    for seq in (a, b):
        seq.status = seq.status.RUNNING
        sched.running.append(seq)
    a.add_draft([1, 2, 3, 4, 5])          # would need two more blocks; one is free
    chunks = sched.schedule()
    assert sched.num_preemptions == 0 and a.num_draft == 0
    assert [c.num_tokens for c in chunks] == [1, 1] and len(a.block_table) == 2


# ---- the engine -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    """Two engines on the tiny model, fp32 (rows independent of each other): without and with drafts."""
    def make(k):
        return LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                                      kv_cache_memory="16MiB", speculative_tokens=k))
    return make(0), make(4)


LOOP = [1000, 1001, 1002, 1003, 1004, 1005] * 6          # a prompt whose n-grams repeat: drafts at every step
SCHEMA = StructuredOutput("json_schema", json.dumps({"type": "object", "required": ["a"], "properties": {
    "a": {"type": "array", "items": {"type": "integer"}, "maxItems": 6}}}))
PARAMS = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=40, min_tokens=30, presence_penalty=0.5, frequency_penalty=0.3,
                         repetition_penalty=1.1),
          SamplingParams(temperature=0, max_tokens=40, logprobs=2, logit_bias=((1003, 3.0), (500, -5.0))),
          SamplingParams(temperature=0.7, seed=9, max_tokens=40, structured=SCHEMA)]


def _same(x: Completion, y: Completion) -> None:
    assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
    if x.logprobs is not None:
        assert [(lp.token_id, round(lp.logprob, 4)) for lp in x.logprobs] == \
            [(lp.token_id, round(lp.logprob, 4)) for lp in y.logprobs]


def test_drafts_change_how_many_tokens_a_step_yields_never_which(pair):
    plain, spec = pair
    prompts = [LOOP, LOOP[3:] + [40, 41], list(range(300, 340)), LOOP[:20]]
    for params in PARAMS:
        accepted = spec.num_accepted_tokens
        alone = [spec.generate([p], params)[0] for p in prompts]
        for p, got in zip(prompts, alone):
            _same(plain.generate([p], params)[0], got)
        batched = spec.generate(prompts, params)                    # drafts for some rows, not others
        for x, y in zip(alone, batched):
            _same(x, y)
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0
    assert plain.block_manager.all_free() and spec.block_manager.all_free()


def test_wrong_drafts_are_dropped_and_the_right_ones_kept(pair):
    """A grammar makes the output repeat the prompt's phrases with a choice of colour the model
    makes: drafts from the prompt are right up to the colour and then right or wrong."""
    plain, spec = pair
    prompt = spec.tokenizer.encode(" red green blue red green yellow red green blue red green black")
    colours = StructuredOutput("regex", "( red green (blue|yellow|black)){8}")
    for params in (SamplingParams(temperature=0, max_tokens=40, structured=colours),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured=colours)):
        drafted, accepted = spec.num_draft_tokens, spec.num_accepted_tokens
        _same(plain.generate([prompt], params)[0], spec.generate([prompt], params)[0])
        assert spec.num_draft_tokens - drafted > spec.num_accepted_tokens - accepted > 0
    assert spec.block_manager.all_free()


def test_a_stop_string_inside_accepted_drafts_cuts_where_it_would_have(pair):
    plain, spec = pair
    whole = plain.generate([LOOP], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    stop = whole.text[len(whole.text) // 2:len(whole.text) // 2 + 2]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=(stop,))
    _same(plain.generate([LOOP], params)[0], spec.generate([LOOP], params)[0])
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)       # room for fewer drafts
    _same(plain.generate([LOOP], short)[0], spec.generate([LOOP], short)[0])


def test_the_prefix_cache_holds_only_kept_tokens(pair):
    _, spec = pair
    out = spec.generate([LOOP], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    bm, bs = spec.block_manager, spec.config.block_size
    kept, prev = set(), -1
    tokens = LOOP + out.token_ids
    for i in range(len(tokens) // bs):
        prev = chain_hash(prev, tuple(tokens[i * bs:(i + 1) * bs]))
        kept.add(prev)
    ours = {h for h, b in bm._hash_to_block.items() if bm.blocks[b].token_ids[:6] == tuple(tokens[:6])}
    assert ours and ours <= kept


def test_a_decode_engine_with_drafts_continues_a_prefilled_request_as_one_engine(pair, tiny_llama_dir):
    plain, spec = pair
    prefill = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", kv_cache_memory="16MiB"))
    for params in PARAMS[:2]:
        ref = plain.generate([LOOP], params)[0]
        got = split_run(prefill, spec, f"split-{params.temperature}", LOOP, params)[0]
        assert got.token_ids == ref.token_ids and got.text == ref.text
    assert prefill.block_manager.all_free() and spec.block_manager.all_free()


@pytest.mark.slow
def test_the_real_model_copying_its_prompt_keeps_most_drafts_and_the_same_output(default_model_dir):
    def make(k):
        return LLMEngine(EngineConfig(model=str(default_model_dir), device="cpu", dtype="float32",
                                      kv_cache_memory="64MiB", speculative_tokens=k))
    plain, spec = make(0), make(4)
    text = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
            "How vexingly quick daft zebras jump!")
    ids = plain.tokenizer.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly: {text}"}],
                                              add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    params = SamplingParams(temperature=0, max_tokens=48)
    ref = plain.generate([ids], params)[0]
    got = spec.generate([ids], params)[0]
    assert got.token_ids == ref.token_ids and got.text == ref.text
    assert spec.num_accepted_tokens >= len(got.token_ids) // 2, (spec.num_draft_tokens, spec.num_accepted_tokens)
    assert spec.block_manager.all_free()
