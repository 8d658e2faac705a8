"""Greedy output of the paged engine is token-identical to Hugging Face `generate`.

Default model, fp32, sixteen chat and raw prompts of about 10 to 1,000 tokens, each with
its own max_tokens; several chunk sizes, sequences joining late, and KV exported from one
engine and imported into a second one. Penalties match `generate` with Hugging Face's
repetition penalty and a reference processor written from OpenAI's presence/frequency formula,
and logprobs match the log-softmax of `generate`'s raw logits, in one engine and split across a
prefill and a decode engine. Every test ends with the KV pool all free.
"""

from collections import Counter

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import Completion
from engine.sampling_params import SamplingParams
from engine_prompts import max_tokens_for
from engine_split import split_run

pytestmark = pytest.mark.slow


def greedy(i):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens_for(i))


@pytest.fixture(scope="module")
def engine_maker(default_model_dir):
    def make(**kw):
        kw.setdefault("kv_cache_memory", "256MiB")
        return LLMEngine(EngineConfig(model=str(default_model_dir), dtype="float32", device="cpu", **kw))
    return make


@pytest.fixture(scope="module")
def trio(engine_maker):
    """One engine, and a prefill and a decode engine to split a request across (chunks of 256
    tokens), shared by the tests that compare the two ways: each test ends with all three pools
    free, so the next starts from free pools; the earlier prompts' blocks stay in the prefix
    cache, which must not change an output either. Request ids carry the test's own prefix."""
    return tuple(engine_maker(max_num_batched_tokens=256) for _ in range(3))


def run_all(engine, prompts, late_from=None, steps_before_late=3):
    """Add prompts (those from `late_from` on only after a few steps) and run to the end."""
    results = {}
    late_from = len(prompts) if late_from is None else late_from
    for i, p in enumerate(prompts[:late_from]):
        results[f"r{i}"] = Completion(f"r{i}", p)
        engine.add_request(f"r{i}", p, greedy(i))
    steps = 0
    while engine.has_work() or len(results) < len(prompts):
        if steps == steps_before_late:
            for i in range(late_from, len(prompts)):
                results[f"r{i}"] = Completion(f"r{i}", prompts[i])
                engine.add_request(f"r{i}", prompts[i], greedy(i))
        for out in engine.step():
            results[out.request_id].add(out)
        steps += 1
    return [results[f"r{i}"].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("chunk", [512, 61])
def test_greedy_matches_hf_generate(engine_maker, prompts, hf_greedy, chunk):
    engine = engine_maker(max_num_batched_tokens=chunk)
    assert run_all(engine, prompts) == hf_greedy
    assert engine.block_manager.all_free()


def test_late_joiners_and_prefix_cache(engine_maker, prompts, hf_greedy):
    engine = engine_maker(max_num_batched_tokens=128, max_num_seqs=6)
    assert run_all(engine, prompts, late_from=8) == hf_greedy
    # the same prompts again: their full blocks come from the prefix cache, output unchanged
    assert run_all(engine, prompts) == hf_greedy
    assert engine.block_manager.prefix_hits > 0
    assert engine.block_manager.all_free()


def test_preemption_keeps_output_exact(engine_maker, prompts, hf_greedy):
    # a pool of ~1,300 tokens cannot hold all sequences at once: some are preempted and recomputed
    engine = engine_maker(kv_cache_memory=1300 * 30 * 2 * 3 * 64 * 4, max_num_batched_tokens=256)
    assert run_all(engine, prompts) == hf_greedy
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.all_free()


def test_export_import_into_second_engine(engine_maker, prompts, hf_greedy):
    prefill = engine_maker(max_num_batched_tokens=256)
    decode = engine_maker(max_num_batched_tokens=256)
    first = {}
    for i, p in enumerate(prompts):
        prefill.add_request(f"r{i}", p, greedy(i), hold_blocks=True)
    while prefill.has_work():
        for out in prefill.step():
            assert out.finished
            first[out.request_id] = out
    results = {}
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        kv = prefill.export_kv(rid)
        prefill.release(rid)
        blocks = decode.reserve(len(p))
        decode.import_kv(blocks, kv)
        results[rid] = Completion(rid, p)
        results[rid].add(decode.add_prefilled(rid, p, first[rid].new_token_ids[0], greedy(i), blocks))
    assert prefill.block_manager.all_free()
    while decode.has_work():
        for out in decode.step():
            results[out.request_id].add(out)
    assert [results[f"r{i}"].token_ids for i in range(len(prompts))] == hf_greedy
    assert decode.block_manager.all_free()


def test_abort_frees_blocks_at_every_stage(engine_maker, prompts):
    engine = engine_maker(max_num_batched_tokens=64)
    for i, p in enumerate(prompts[:6]):
        engine.add_request(f"r{i}", p, greedy(i), hold_blocks=(i == 5))
    engine.step()                      # some prefilled, some mid-prefill, some waiting
    assert engine.abort("r0").finish_reason == "abort"
    while engine.has_work():
        engine.step()
    engine.abort("r5")                 # held for export, never released
    for i in range(1, 5):
        assert engine.abort(f"r{i}") is None   # already finished
    assert engine.block_manager.all_free()
    assert engine.live_request_ids() == []


def _split_run(prefill, decode, rid, prompt, params) -> Completion:
    """What a client gets when `prompt` is prefilled in one engine and decoded in another: the
    prefill's first token (text and logprobs) at once, then the decode engine's output after it
    (its first output repeats the first token: only its text is new)."""
    return split_run(prefill, decode, rid, prompt, params)[0]


def test_split_text_equals_single_engine_text_even_with_stop_strings(trio, prompts):
    """The first token's text is shown straight from the prefill engine; with the decode engine
    told how much was shown, the client's text equals one engine's, also when a stop string
    starts in the first token's text (the prefill engine must hold that tail back)."""
    single, prefill, decode = trio
    for i, p in enumerate(prompts[:4]):
        plain = SamplingParams(temperature=0.0, max_tokens=12)
        ref = "".join(o.new_text for o in _run_one(single, f"text-s{i}", p, plain))
        assert _split_run(prefill, decode, f"text-p{i}", p, plain).text == ref
        first_len = len(_run_one(single, f"text-f{i}", p, SamplingParams(temperature=0.0, max_tokens=1))[0].new_text)
        if first_len == 0 or len(ref) < first_len + 2:
            continue
        stop = ref[first_len - 1:first_len + 1]          # the first token's last character onward
        cut = SamplingParams(temperature=0.0, max_tokens=12, stop=(stop,))
        ref_cut = "".join(o.new_text for o in _run_one(single, f"text-c{i}", p, cut))
        assert ref_cut == ref[:ref.index(stop)]
        assert _split_run(prefill, decode, f"text-q{i}", p, cut).text == ref_cut
    assert all(e.block_manager.all_free() for e in (single, prefill, decode))


def test_a_conversations_next_turn_reuses_the_decode_engines_kv_and_stays_exact(trio, prompts, hf_model):
    """Turn 2 = turn 1's prompt, its reply and a new message: the decode engine still holds the
    K/V of turn 1's full blocks (the prompt's received, the reply's decoded), so only the rest is
    sent (`split_run` reserves as the decode replica does), and the output is still token-identical
    to `generate` on the whole turn-2 prompt. The reply's blocks were computed by decode steps,
    the prompt's by the prefill engine: both are reused."""
    _, prefill, decode = trio
    for i in (2, 7):
        p = prompts[i]
        first, _ = split_run(prefill, decode, f"turn1-{i}", p, SamplingParams(temperature=0.0, max_tokens=40,
                                                                              ignore_eos=True))
        turn2 = p + first.token_ids + prompts[(i + 1) % len(prompts)][:30]
        reused = decode.reserve_cached(turn2)
        decode.release_reservation(reused[0])
        bs = decode.block_manager.block_size
        assert reused[1] == (len(p) + len(first.token_ids) - 1) // bs     # every full block computed there
        got, _ = split_run(prefill, decode, f"turn2-{i}", turn2, SamplingParams(temperature=0.0, max_tokens=16))
        assert got.token_ids == _hf_generate(hf_model, turn2, 16)[0][:len(got.token_ids)]
        assert len(got.token_ids) == 16 or got.finish_reason == "stop"
    assert all(e.block_manager.all_free() for e in trio)


def _run_one(engine, rid, prompt, params):
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_work():
        outs += engine.step()
    return outs


def _completion(outs, rid, prompt) -> Completion:
    got = Completion(rid, prompt)
    for out in outs:
        got.add(out)
    return got


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def _hf_generate(model, prompt, max_new_tokens, **kw):
    """Greedy `generate`: (new tokens, raw logits per step before any processor)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, return_dict_in_generate=True,
                             output_logits=True, **kw)
    return out.sequences[0, len(prompt):].tolist(), [step[0] for step in out.logits]


class _OpenAIPenalties(LogitsProcessor):
    """Reference: OpenAI's documented formula, logit -= count * frequency + (count > 0) * presence,
    counting the tokens generated so far."""

    def __init__(self, num_prompt: int, frequency: float, presence: float):
        self.num_prompt, self.frequency, self.presence = num_prompt, frequency, presence

    def __call__(self, input_ids, scores):
        for row in range(scores.shape[0]):
            for token, count in Counter(input_ids[row, self.num_prompt:].tolist()).items():
                scores[row, token] -= count * self.frequency + self.presence
        return scores


PENALTIES = [{"repetition_penalty": 1.3},
             {"frequency_penalty": 0.8, "presence_penalty": 0.5},
             {"repetition_penalty": 1.15, "frequency_penalty": -0.4, "presence_penalty": 0.7}]
PENALIZED = (0, 9)          # the prompts they run on


@pytest.fixture(scope="module")
def hf_plain(hf_model, prompts):
    """`generate`'s greedy 24 tokens without penalties for the penalties' prompts (computed once)."""
    return {i: _hf_generate(hf_model, prompts[i], 24)[0] for i in PENALIZED}


@pytest.mark.parametrize("penalties", PENALTIES)
def test_penalties_match_hf_generate_in_one_engine_and_split(trio, hf_model, hf_plain, prompts, penalties):
    single, prefill, decode = trio
    tag = f"pen{PENALTIES.index(penalties)}"
    changed = 0
    for i in PENALIZED:
        p = prompts[i]
        processors = LogitsProcessorList()
        if "frequency_penalty" in penalties:
            processors.append(_OpenAIPenalties(len(p), penalties["frequency_penalty"], penalties["presence_penalty"]))
        ref, _ = _hf_generate(hf_model, p, 24, repetition_penalty=penalties.get("repetition_penalty", 1.0),
                              logits_processor=processors)
        changed += ref != hf_plain[i]
        params = SamplingParams(temperature=0.0, max_tokens=24, **penalties)
        assert _completion(_run_one(single, f"{tag}-s{i}", p, params), f"{tag}-s{i}", p).token_ids == ref
        assert _split_run(prefill, decode, f"{tag}-p{i}", p, params).token_ids == ref
    assert changed, "the penalties changed no output: the test would not see them"
    assert all(e.block_manager.all_free() for e in (single, prefill, decode))


def test_seeded_sampling_split_draws_what_one_engine_draws(trio, prompts):
    """The decode engine continues the seed's random stream after the prefill engine's draw of
    the first token (instead of drawing token 2 with the numbers token 1 used)."""
    single, prefill, decode = trio
    for i in (2, 6):
        p = prompts[i]
        params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=1234 + i, ignore_eos=True)
        ref = _completion(_run_one(single, f"seed-s{i}", p, params), f"seed-s{i}", p)
        assert _split_run(prefill, decode, f"seed-p{i}", p, params).token_ids == ref.token_ids
        other = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=99, ignore_eos=True)
        assert _completion(_run_one(single, f"seed-o{i}", p, other), f"seed-o{i}", p).token_ids != ref.token_ids
    assert all(e.block_manager.all_free() for e in (single, prefill, decode))


def _resume_one(engine, rid, prompt, params, resumed, shown):
    engine.add_request(rid, prompt, params, resumed=resumed, shown_chars=shown)
    outs = []
    while engine.has_work():
        outs += engine.step()
    return _completion(outs, rid, prompt), outs[-1]


RESUMED = [dict(temperature=0.0, max_tokens=14),
           dict(temperature=0.0, max_tokens=14, frequency_penalty=0.8, presence_penalty=0.5, repetition_penalty=1.2),
           dict(temperature=0.9, top_p=0.95, max_tokens=14, seed=77, ignore_eos=True),
           dict(temperature=0.0, max_tokens=14, min_tokens=6, ignore_eos=False)]


@pytest.mark.parametrize("kwargs", RESUMED)
def test_a_resumed_request_goes_on_as_the_uninterrupted_one(trio, prompts, kwargs):
    """A request resumed after k output tokens (the prompt plus those tokens, and the characters
    of their text the client was shown: what the router sends when a replica died mid-stream)
    gives, in one engine and split across a prefill and a decode engine, the tokens and text the
    uninterrupted request gives after them: penalties and min_tokens count the resumed tokens as
    output, a seeded request draws on from where it was, a stop string that begins before the cut
    (text held back) still cuts, and the counts are the whole request's."""
    single, prefill, decode = trio
    tag = f"res{RESUMED.index(kwargs)}"
    i = (1, 4)[RESUMED.index(kwargs) % 2]            # the two prompts take turns over the cases
    p = prompts[i]
    params = SamplingParams(**kwargs)
    ref_outs = _run_one(single, f"{tag}-r{i}", p, params)
    ref = _completion(ref_outs, f"{tag}-r{i}", p)
    assert len(ref.token_ids) >= 8, ref
    stop_at = len("".join(o.new_text for o in ref_outs[:5]))
    cases = [(params, ref_outs, ref)]
    if len(ref.text) > stop_at + 1:       # a stop string starting in the text shown after 5 tokens
        stop = ref.text[stop_at - 1:stop_at + 1]
        cut = SamplingParams(**kwargs, stop=(stop,))
        cut_outs = _run_one(single, f"{tag}-c{i}", p, cut)
        cases.append((cut, cut_outs, _completion(cut_outs, f"{tag}-c{i}", p)))
    for n, (pp, outs, whole) in enumerate(cases):
        for k in (1, 5, len(whole.token_ids) - 1):
            if not 0 < k < len(whole.token_ids):
                continue
            resumed = whole.token_ids[:k]
            shown = "".join(o.new_text for o in outs[:k])
            for way, (got, last) in {
                    "one": _resume_one(single, f"{tag}-o{i}-{n}-{k}", p, pp, resumed, len(shown)),
                    "split": split_run(prefill, decode, f"{tag}-s{i}-{n}-{k}", p, pp, resumed, len(shown)),
            }.items():
                assert resumed + got.token_ids == whole.token_ids, (way, k, kwargs)
                assert shown + got.text == whole.text, (way, k, kwargs)
                assert got.finish_reason == whole.finish_reason, (way, k)
                assert (last.num_prompt_tokens, last.num_output_tokens) == (len(p), len(whole.token_ids))
    assert all(e.block_manager.all_free() for e in (single, prefill, decode))


def test_a_resumed_request_is_refused_when_nothing_is_left_to_generate(trio, prompts):
    single = trio[0]
    params = SamplingParams(temperature=0.0, max_tokens=3)
    rejected = single.add_request("res-full", prompts[0], params, resumed=[11, 12, 13])
    assert rejected is not None and "max_tokens" in rejected.reason
    assert single.live_request_ids() == [] and single.block_manager.all_free()


def test_logprobs_are_the_models_own_in_one_engine_and_split(trio, hf_model, prompts):
    single, prefill, decode = trio
    for i in (1, 7):
        p = prompts[i]
        ref, logits = _hf_generate(hf_model, p, 12)
        params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5)
        runs = (_completion(_run_one(single, f"lp-s{i}", p, params), f"lp-s{i}", p),
                _split_run(prefill, decode, f"lp-p{i}", p, params))
        for got in runs:
            assert got.token_ids == ref
            assert [lp.token_id for lp in got.logprobs] == ref
            for lp, step_logits in zip(got.logprobs, logits):
                hf = step_logits.float().log_softmax(-1)
                assert lp.logprob == pytest.approx(float(hf[lp.token_id]), abs=1e-3)
                assert len(lp.top) == 5
                assert [v for _, v in lp.top] == pytest.approx(hf.topk(5).values.tolist(), abs=1e-3)
                assert all(v == pytest.approx(float(hf[t]), abs=1e-3) for t, v in lp.top)
    assert all(e.block_manager.all_free() for e in (single, prefill, decode))


def test_prompt_logprobs_match_hf_forward_across_chunks_and_with_a_cached_prefix(engine_maker, hf_model, prompts):
    engine = engine_maker(max_num_batched_tokens=61)
    for i in (3, 11):
        p = prompts[i]
        with torch.inference_mode():
            ref = hf_model(torch.tensor([p])).logits[0].float().log_softmax(-1)
        params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
        for rid in (f"a{i}", f"b{i}"):     # the second time the prompt's blocks are cached: not used
            got = _completion(_run_one(engine, rid, p, params), rid, p)
            assert [lp.token_id for lp in got.prompt_logprobs] == p[1:]
            assert [lp.logprob for lp in got.prompt_logprobs] == pytest.approx(
                [float(ref[k, p[k + 1]]) for k in range(len(p) - 1)], abs=1e-3)
            top = ref[:-1].topk(3, dim=-1)
            assert [[t for t, _ in lp.top] for lp in got.prompt_logprobs[:5]] == top.indices[:5].tolist()
            assert [v for lp in got.prompt_logprobs for _, v in lp.top] == pytest.approx(
                top.values.flatten().tolist(), abs=1e-3)
            chosen = ref[torch.arange(len(p) - 1), torch.tensor(p[1:])][:, None]   # ranks: Hugging Face's, within 1e-3
            low = ((ref[:-1] > chosen + 1e-3).sum(-1) + 1).tolist()
            high = ((ref[:-1] > chosen - 1e-3).sum(-1) + 1).tolist()
            assert all(lo <= lp.rank <= hi for lo, lp, hi in zip(low, got.prompt_logprobs, high))
            assert len(set(low)) > 3, "every prompt token ranks alike: the test would not see a wrong rank"
            assert got.num_cached_tokens == 0
    assert engine.block_manager.all_free()
