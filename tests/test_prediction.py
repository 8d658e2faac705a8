"""Predicted outputs (OpenAI's `prediction`): the index that drafts from one (torch-free), and the
engine keeping the drafts the model picks itself: the same tokens, text and logprobs with a
prediction as without, right or wrong, alone, batched and split across a prefill and a decode
engine, with no prompt-lookup speculation configured."""

from dataclasses import replace

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.prediction import PredictionIndex
from engine.sampling_params import SamplingParams
from engine_split import split_run


# ---- the index ----------------------------------------------------------------------------------
def propose(index: PredictionIndex, output: list[int], k: int) -> list[int]:
    return index.propose(output[-24:], len(output), k)


def test_the_prediction_is_followed_from_its_start():
    index = PredictionIndex((5, 6, 7, 8, 9))
    assert propose(index, [], 3) == [5, 6, 7]
    assert propose(index, [5], 3) == [6, 7, 8]
    assert propose(index, [5, 6, 7, 8], 3) == [9]
    assert propose(index, [5, 6, 7, 8, 9], 3) == []


def test_after_an_edit_the_output_finds_its_place_again():
    pred = (10, 11, 12, 13, 14, 15, 16, 17)
    index = PredictionIndex(pred)
    assert propose(index, [10, 11], 2) == [12, 13]
    assert propose(index, [10, 11, 99], 2) == []                      # inserted: nowhere in the prediction
    assert propose(index, [10, 11, 99, 12], 2) == [13, 14]            # back on it after the insertion
    assert propose(index, [10, 11, 99, 12, 13, 15], 2) == [16, 17]    # 14 left out


def test_a_repetitive_prediction_is_followed_where_the_output_is_not_where_its_tokens_first_occur():
    pred = (1, 2, 3, 50, 1, 2, 3, 60, 1, 2, 3, 70)
    index = PredictionIndex(pred)
    out = [1, 2, 3]
    assert propose(index, out, 1) == [50]
    out += [50, 1, 2, 3]
    assert propose(index, out, 1) == [60]         # went on from 50: at 6, then 60
    out += [60, 1, 2, 3]
    assert propose(index, out, 1) == [70]
    assert propose(PredictionIndex(pred), [4, 1, 2, 3], 1) == [50]     # fresh: the first occurrence
    same = PredictionIndex((9,) * 5 + (7,) + (9,) * 12)                # one token changed in a run
    out = [9]
    assert propose(same, out, 8) == [9, 9, 9, 9, 7, 9, 9, 9]
    out += [9, 9, 9, 9, 9]                        # 4 kept, then the model's 9 for the 7
    assert propose(same, out, 8) == [9] * 8       # past the 7, not back before it
    assert PredictionIndex(()).propose([1], 1, 4) == [] and PredictionIndex((1,)).propose([2], 1, 4) == []


# ---- the engine -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    """Two fp32 engines on the tiny model (rows independent of each other), neither speculating by
    prompt lookup: one ignoring predictions, one drafting up to 8 tokens a step from them."""
    def make(k):
        return LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                                      kv_cache_memory="16MiB", prediction_tokens=k))
    return make(0), make(8)


PROMPTS = [list(range(300, 340)), [1000, 1001, 1002] * 5, list(range(2000, 2010))]
PARAMS = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=40, min_tokens=30, presence_penalty=0.5, frequency_penalty=0.3)]


def _same(x, y):
    assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
    if x.logprobs is not None:
        assert [(lp.token_id, round(lp.logprob, 4)) for lp in x.logprobs] == \
            [(lp.token_id, round(lp.logprob, 4)) for lp in y.logprobs]


def _edited(tokens: list[int]) -> tuple[int, ...]:
    """The output with a token changed, one inserted and one left out: right in most places."""
    t = list(tokens)
    t[5] = 7
    del t[20]
    t.insert(12, 8)
    return tuple(t)


def test_a_prediction_changes_how_many_tokens_a_step_yields_never_which(pair):
    plain, pred = pair
    for params in PARAMS:
        refs = [plain.generate([p], params)[0] for p in PROMPTS]
        for guess in (lambda ref: tuple(ref.token_ids), lambda ref: _edited(ref.token_ids),
                      lambda ref: tuple(range(5000, 5040))):           # right, mostly right, all wrong
            drafted, accepted = pred.num_draft_tokens, pred.num_accepted_tokens
            with_pred = [replace(params, prediction=guess(ref)) for ref in refs]
            alone = [pred.generate([p], q)[0] for p, q in zip(PROMPTS, with_pred)]
            for ref, got in zip(refs, alone):
                _same(ref, got)
            for x, y in zip(alone, pred.generate(PROMPTS, with_pred)):        # batched
                _same(x, y)
            kept = pred.num_accepted_tokens - accepted
            if guess(refs[0])[0] != 5000:
                assert kept >= sum(len(r.token_ids) for r in refs), (kept, pred.num_draft_tokens - drafted)
    assert plain.num_draft_tokens == 0 and plain.block_manager.all_free() and pred.block_manager.all_free()


def _last_output(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    assert engine.add_request("last", prompt, params) is None
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert outs[-1].finished
    return outs[-1]


def test_the_whole_prediction_right_takes_a_few_steps(pair):
    plain, pred = pair
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = plain.generate([PROMPTS[0]], params)[0]
    drafted, accepted = pred.num_draft_tokens, pred.num_accepted_tokens
    got = pred.generate([PROMPTS[0]], replace(params, prediction=tuple(ref.token_ids)))[0]
    _same(ref, got)
    # every draft kept: 39 tokens after the first in 5 steps of up to 1 + 8 (the last one short)
    assert pred.num_accepted_tokens - accepted == pred.num_draft_tokens - drafted == 8 * 4 + 2
    last = _last_output(pred, PROMPTS[0], replace(params, prediction=tuple(ref.token_ids)))
    assert (last.accepted_prediction_tokens, last.rejected_prediction_tokens) == (8 * 4 + 2, 0)
    last = _last_output(pred, PROMPTS[0], replace(params, prediction=_edited(ref.token_ids)))
    assert last.accepted_prediction_tokens >= 25 and 0 < last.rejected_prediction_tokens <= 16
    last = _last_output(plain, PROMPTS[0], replace(params, prediction=tuple(ref.token_ids)))   # ignored there
    assert (last.accepted_prediction_tokens, last.rejected_prediction_tokens) == (0, 0)


def test_a_prediction_outside_the_vocabulary_is_refused_at_admission(pair):
    _, pred = pair
    params = SamplingParams(max_tokens=4, prediction=(5, pred.runner.vocab_size))
    rejected = pred.add_request("outside", PROMPTS[0], params)
    assert rejected is not None and "prediction: token id out of range" in rejected.reason
    assert pred.add_request("negative", PROMPTS[0], replace(params, prediction=(-1,))).reason == \
        "prediction must be token ids"
    assert not pred.has_work() and pred.block_manager.all_free()


def test_a_decode_engine_drafts_from_the_prediction_of_a_prefilled_request(pair, tiny_llama_dir):
    plain, pred = pair
    prefill = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                                     kv_cache_memory="16MiB"))
    for params in PARAMS[:2]:
        ref = plain.generate([PROMPTS[1]], params)[0]
        accepted = pred.num_accepted_tokens
        guessed = replace(params, prediction=_edited(ref.token_ids))
        got = split_run(prefill, pred, f"split-{params.temperature}", PROMPTS[1], guessed)[0]
        assert got.token_ids == ref.token_ids and got.text == ref.text
        assert pred.num_accepted_tokens - accepted >= 20
    assert prefill.block_manager.all_free() and pred.block_manager.all_free()


# ---- over HTTP ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_openai_clients_prediction_gives_the_same_reply_drafted_from_it(disagg, colocated):
    """The colocated fixture does not speculate by prompt lookup, so the drafts it keeps (counted on
    /metrics) come from the prediction; the disaggregated one drafts in its decode replicas."""
    import json

    import openai

    from conftest import SERVED
    from service_util import http, metrics, pools_all_free, wait_until

    def kept():
        return sum(v for (n, p, _), v in metrics(colocated).items() if n == "pdserve_spec_accepted_tokens"
                   and p == "colocated")
    ask = dict(model=SERVED, messages=[{"role": "user", "content": "Write a short poem about the sea."}],
               max_tokens=32, temperature=0)
    ref = openai.OpenAI(base_url=colocated + "/v1", api_key="unused").chat.completions.create(**ask)
    text = ref.choices[0].message.content
    assert ref.usage.completion_tokens_details is None           # no prediction, no details
    assert wait_until(lambda: kept() == 0, 5), "the colocated replica drafted without a prediction"
    for base in (colocated, disagg):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
        got = client.chat.completions.create(**ask, prediction={"type": "content", "content": text})
        assert got.choices[0].message.content == text and got.usage.completion_tokens == ref.usage.completion_tokens
        details = got.usage.completion_tokens_details
        assert details.accepted_prediction_tokens >= ref.usage.completion_tokens - 8, details
        assert details.rejected_prediction_tokens <= 8, details
    assert wait_until(lambda: kept() >= ref.usage.completion_tokens - 8, 10), kept()
    parts = [{"type": "text", "text": text[:20]}, {"type": "text", "text": text[20:]}]    # streamed, in parts
    chunks = client.chat.completions.create(**ask, prediction={"type": "content", "content": parts}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    wrong = client.chat.completions.create(**ask, prediction={"type": "content", "content": "Roses are red."})
    assert wrong.choices[0].message.content == text
    assert wrong.usage.completion_tokens_details.accepted_prediction_tokens < 8
    status, body = http(disagg, "/v1/chat/completions", {**ask, "prediction": {"type": "file", "content": text}})
    assert status == 400 and json.loads(body)["error"]["param"] == "prediction.type", body
    context = client.models.retrieve(SERVED).model_extra["max_model_len"]
    status, body = http(disagg, "/v1/chat/completions", {**ask, "prediction": {"type": "content",
                                                                             "content": " sea" * (context + 1)}})
    assert status == 400 and json.loads(body)["error"]["param"] == "prediction", body
    assert pools_all_free(disagg, {"prefill", "decode"}) and pools_all_free(colocated, {"colocated"})
