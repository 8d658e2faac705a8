"""Sampling parameters end to end through the engine (tiny random model, real tokenizer), and
the incremental detokenizer on its own."""

import collections
import dataclasses
import math

import pytest
import torch
from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, fast_decoder
from engine.llm_engine import LLMEngine
from engine import sampler
from engine.sampler import PenaltyState, SampleRow, _apply_penalties, _filter_min_p, sample
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", kv_cache_memory="16MiB"))


PROMPT = list(range(200, 230))


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=20, seed=1234, ignore_eos=True)
    alone = engine.generate([PROMPT], p)[0].token_ids
    mixed = engine.generate([list(range(300, 340)), PROMPT, list(range(5, 9))],
                            [SamplingParams(temperature=0.7, max_tokens=25), p, SamplingParams(temperature=0)])
    assert mixed[1].token_ids == alone
    other_seed = engine.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=20, seed=99, ignore_eos=True))
    assert other_seed[0].token_ids != alone
    assert engine.block_manager.all_free()


def test_max_tokens_min_tokens_and_stop_token_ids(engine):
    greedy = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert len(greedy.token_ids) == 12 and greedy.finish_reason == "length"
    stop_at = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_at)
    out = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop_at,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy.token_ids[:first + 1]
    assert out.stop_reason == stop_at and greedy.stop_reason is None       # vLLM's: the stop token's id
    eos = min(engine.eos_token_ids)                                         # EOS ends with none, as vLLM's
    ended = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=(eos,),
                                                     stop_token_ids=(eos,)))[0]
    assert ended.finish_reason == "stop" and ended.stop_reason is None
    # min_tokens forbids the stop token until enough tokens are out
    held = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 2,
                                                    stop_token_ids=(stop_at,)))[0]
    assert stop_at not in held.token_ids[:first + 2] and len(held.token_ids) >= first + 2


def test_the_stop_token_s_text_is_left_out_unless_asked_for(engine):
    # vLLM's semantics: the stop token ends the token ids, not the text, unless include_stop_str_in_output
    decode = lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    greedy = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_at = next(t for t in greedy.token_ids[2:] if decode([t]).strip())       # a token with visible text
    first = greedy.token_ids.index(stop_at)
    for include, shown in ((False, first), (True, first + 1)):
        out = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop_at,),
                                                       include_stop_str_in_output=include))[0]
        assert out.token_ids == greedy.token_ids[:first + 1] and out.finish_reason == "stop"
        assert out.text == decode(greedy.token_ids[:shown])
    assert decode(greedy.token_ids[:first]) != decode(greedy.token_ids[:first + 1])


def test_allowed_token_ids_are_all_the_output_holds(engine):
    allowed = (300, 301, 5000)
    for params in (SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.5, seed=3, max_tokens=30, ignore_eos=True, allowed_token_ids=allowed,
                                  logit_bias=((7, 100.0),))):
        out = engine.generate([PROMPT], params)[0]
        assert set(out.token_ids) <= set(allowed) and len(out.token_ids) == params.max_tokens
    sampled = engine.generate([PROMPT], SamplingParams(temperature=1.5, seed=3, max_tokens=30, ignore_eos=True,
                                                       allowed_token_ids=allowed))[0]
    assert len(set(sampled.token_ids)) > 1            # sampled among them, not one forced token
    # the greedy pick is the likeliest allowed token: biasing one up makes it the whole output
    biased = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                      allowed_token_ids=allowed, logit_bias=((5000, 100.0),)))[0]
    assert biased.token_ids == [5000] * 5
    assert engine.block_manager.all_free()


def test_allowed_token_ids_that_only_end_the_output_before_min_tokens_are_refused(engine):
    eos = min(engine.eos_token_ids)
    for params, problem in ((SamplingParams(min_tokens=2, allowed_token_ids=(eos,)), "min_tokens"),
                            (SamplingParams(min_tokens=2, allowed_token_ids=(9,), stop_token_ids=(9,)), "min_tokens"),
                            (SamplingParams(allowed_token_ids=(10**6,)), "out of range")):
        rejected = engine.add_request("r", PROMPT, params)
        assert problem in rejected.reason, rejected
    # EOS under ignore_eos does not end it: then it may be the only one
    out = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, min_tokens=2, ignore_eos=True,
                                                   allowed_token_ids=(eos,)))[0]
    assert out.token_ids == [eos] * 4
    assert engine.block_manager.all_free()


def test_bad_words_ban_a_sequence_s_last_token_where_the_rest_ends_the_output(engine):
    # seeded sampling (the tiny model's greedy output repeats one token): the same draws until a ban bites
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    run = lambda bad: engine.generate([PROMPT], dataclasses.replace(params, bad_words=bad))[0].token_ids
    free = run(())
    i = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    a, b = free[i - 1], free[i]
    one = run(((b,),))
    assert b not in one and one[:i] == free[:i]
    pair = run(((a, b),))
    assert pair[:i] == free[:i] and pair[i] != b
    assert all((x, y) != (a, b) for x, y in zip(pair, pair[1:]))
    # a sequence the prompt ends with bans nothing: bad words look at the output only
    assert run(((PROMPT[-1], free[0]),)) == free


def test_bad_words_that_leave_no_allowed_token_end_the_request_with_an_error(engine):
    t = 300
    assert "banned at first" in engine.add_request("r", PROMPT, SamplingParams(
        allowed_token_ids=(t,), bad_words=((t,),))).reason
    engine.add_request("r2", PROMPT, SamplingParams(temperature=0, max_tokens=5, allowed_token_ids=(t,),
                                                    bad_words=((t, t),)))
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    assert [o.new_token_ids for o in outputs if o.new_token_ids] == [[t]]
    last = outputs[-1]
    assert last.finished and last.error_code == 400 and "bad_words" in last.error
    assert engine.block_manager.all_free()


def test_special_tokens_show_in_the_text_when_not_skipped(engine):
    tok = engine.tokenizer
    special = tok.convert_tokens_to_ids("<|im_start|>")
    assert special in tok.all_special_ids and special not in engine.eos_token_ids
    texts = {skip: engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=(special,),
                                                            skip_special_tokens=skip))[0].text
             for skip in (True, False)}
    assert texts == {True: "", False: "<|im_start|>" * 3}
    # vLLM's spaces_between_special_tokens is accepted (either value) and, as vLLM V1 with a fast
    # tokenizer, not applied: the text is written as the tokenizer decodes it, no spaces between
    from router.openai_protocol import CompletionRequest
    for spaces in (True, False):
        assert CompletionRequest(prompt="x", skip_special_tokens=False, spaces_between_special_tokens=spaces)
    assert tok.decode([special] * 3, skip_special_tokens=False, spaces_between_special_tokens=True) == texts[False]


def test_stop_string_cuts_the_text(default_model_dir):
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), device="cpu", kv_cache_memory="16MiB"))
    prompt = engine.tokenizer.encode("The three primary colors are")
    greedy = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert len(greedy.text) > 8
    stop = greedy.text[5:8]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop=(stop,), ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.text == greedy.text[:greedy.text.index(stop)]
    assert stop not in out.text and out.stop_reason == stop          # vLLM's stop_reason: the stop string
    kept = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop=(stop,), ignore_eos=True,
                                                    include_stop_str_in_output=True))[0]
    assert kept.finish_reason == "stop" and kept.text == greedy.text[:greedy.text.index(stop) + len(stop)]
    assert kept.token_ids == out.token_ids


def top_filter(logits, top_k, top_p):
    """`logits` with -inf outside each row's top-k / nucleus: the candidates sample draws from
    (sampler._candidate_groups), as whole rows."""
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p) for k, p in zip(top_k, top_p)]
    out = torch.full_like(logits, float("-inf"))
    for rows, values, ids in sampler._candidate_groups(logits, params):
        out[rows] = values if ids is None else torch.full_like(out[rows], float("-inf")).scatter(-1, ids, values)
    return out


def test_top_k_and_top_p_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0]])
    out = top_filter(logits.clone(), [2, 0], [1.0, 0.5])
    assert torch.isinf(out[0, 2:]).all() and not torch.isinf(out[0, :2]).any()
    # the top token alone holds > 50 % of the mass: nucleus 0.5 keeps only it
    assert not torch.isinf(out[1, 0]) and torch.isinf(out[1, 1:]).all()


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "torch"])
def test_top_k_and_top_p_mask_what_hugging_faces_warpers_mask(kernel, monkeypatch):
    """The candidates sample draws from against transformers' TopK then TopP warpers: peaked rows
    (nucleus within the first topk), flat ones (sorted whole), top-k wider than NUCLEUS_WIDTH, and
    rows of each kind in one batch; found by the CPU kernel and by the torch ops it replaces."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper
    if not kernel:
        monkeypatch.setattr(sampler, "cpu_kernels", lambda: None)
    elif sampler.cpu_kernels() is None:
        pytest.skip("the CPU kernels could not be built here")
    torch.manual_seed(0)
    vocab = 5000
    logits = torch.cat([torch.randn(6, vocab) * 6, torch.randn(6, vocab) * 0.5])      # peaked, flat
    for top_k in (0, 1, 40, 300, vocab - 1):
        for top_p in (1.0, 0.9, 0.5):
            ours = top_filter(logits.clone(), [top_k] * 12, [top_p] * 12)
            theirs = logits.clone()
            if top_k:
                theirs = TopKLogitsWarper(top_k)(None, theirs)
            if top_p < 1:
                theirs = TopPLogitsWarper(top_p)(None, theirs)
            assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), (top_k, top_p)
            assert torch.equal(ours[~ours.isinf()], logits[~ours.isinf()])
    groups = sampler._candidate_groups(logits, [SamplingParams(temperature=1.0, top_p=0.9)] * 12)
    assert sorted((rows, v.shape[1]) for rows, v, _ in groups) == [([0, 1, 2, 3, 4, 5], sampler.NUCLEUS_WIDTH),
                                                                   ([6, 7, 8, 9, 10, 11], vocab)]
    mixed = top_filter(logits[:4].clone(), [0, 2, 400, 0], [0.5, 1.0, 1.0, 1.0])
    assert (~mixed.isinf()).sum(dim=-1)[1:].tolist() == [2, 400, vocab]


def _rows(params, seeds):
    return [SampleRow(params, sampler.make_generator(s, torch.device("cpu")), []) for s in seeds]


def test_a_top_k_draw_follows_the_distribution_and_never_picks_a_masked_token():
    """The Gumbel-max draw over candidates: each candidate as often as its probability (candidates
    in any order, ids anywhere in the vocabulary), a -inf one never."""
    probs = torch.tensor([0.2, 0.1, 0.15, 0.0, 0.15, 0.4])
    ids = torch.tensor([[40000, 5, 1023, 7, 1024, 48000], [48000, 1024, 7, 1023, 5, 40000]])
    values = torch.stack([probs.log(), probs.log().flip(0)])
    rows = _rows(SamplingParams(temperature=1.0, top_k=6), [1, 2])
    n = 20000
    seen = [collections.Counter(), collections.Counter()]
    for _ in range(n):
        for row, token in enumerate(sampler._draw_from(values.clone(), ids, rows)):
            seen[row][token] += 1
    for row in range(2):
        expected = {int(t): float(q) for t, q in zip(ids[0], probs)}
        assert seen[row][7] == 0 and set(seen[row]) == {t for t, q in expected.items() if q}
        assert all(abs(seen[row][t] - q * n) <= 4 * (q * (1 - q) * n) ** 0.5 for t, q in expected.items()), seen
    with pytest.raises(RuntimeError, match="no candidate"):
        sampler._draw_from(torch.full((1, 3), float("-inf")), ids[:1, :3], rows[:1])


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "torch"])
def test_a_whole_row_draw_follows_the_softmax_and_never_picks_a_masked_token(kernel, monkeypatch):
    """Rows without top-k / top-p: the Gumbel-max over every token (the CPU kernel, and the torch ops
    it replaces elsewhere), each token as often as its probability; a -inf one never."""
    if not kernel:
        monkeypatch.setattr(sampler, "cpu_kernels", lambda: None)
    elif sampler.cpu_kernels() is None:
        pytest.skip("the CPU kernels could not be built here")
    probs = torch.zeros(2, 3000)
    probs[0, [5, 1023, 1024, 2999]] = torch.tensor([0.2, 0.1, 0.3, 0.4])
    probs[1] = torch.rand(3000, generator=torch.Generator().manual_seed(0)) ** 4
    probs[1, 17] = 0.0
    probs /= probs.sum(dim=-1, keepdim=True)
    values = probs.log()
    rows = _rows(SamplingParams(temperature=1.0), [1, 2])
    n = 4000 if kernel else 1500
    seen = [collections.Counter(), collections.Counter()]
    for _ in range(n):
        for row, token in enumerate(sampler._draw_from(values, None, rows)):
            seen[row][token] += 1
    assert set(seen[0]) == {5, 1023, 1024, 2999} and seen[1][17] == 0
    for t, q in ((5, 0.2), (1023, 0.1), (1024, 0.3), (2999, 0.4)):
        assert abs(seen[0][t] - q * n) <= 4 * (q * (1 - q) * n) ** 0.5, seen[0]
    # the flat row: counts of tokens binned by probability match the bins' mass
    bins = torch.bucketize(probs[1], torch.quantile(probs[1], torch.tensor([0.5, 0.8, 0.95])))
    mass = [float(probs[1][bins == b].sum()) for b in range(4)]
    counts = collections.Counter(int(bins[t]) for t in seen[1].elements())
    assert all(abs(counts[b] - q * n) <= 4 * (q * (1 - q) * n) ** 0.5 for b, q in enumerate(mass)), (counts, mass)
    with pytest.raises(RuntimeError, match="no candidate"):
        sampler._draw_from(torch.full((1, 30), float("-inf")), None, rows[:1])


def test_sample_draws_at_each_rows_temperature():
    """`sample` draws each token as often as softmax(logits / T) of its row's temperature: 0.5 and 2
    (the rows divided), 1 (left as they are), mixed in one batch with a greedy row."""
    ids, base = [5, 1023, 1024, 2999], torch.tensor([0.0, 1.0, 2.0, 0.5])
    temperatures = (0.5, 1.0, 2.0)
    rows = [*(_rows(SamplingParams(temperature=t), [i + 1])[0] for i, t in enumerate(temperatures)),
            SampleRow(SamplingParams(temperature=0), None, [])]
    n = 3000
    seen = [collections.Counter() for _ in temperatures]
    for _ in range(n):
        logits = torch.full((len(rows), 3000), float("-inf"))
        logits[:, ids] = base
        tokens, _ = sampler.sample(logits, rows)
        assert tokens[-1] == 1024
        for counter, token in zip(seen, tokens):
            counter[token] += 1
    for counter, t in zip(seen, temperatures):
        probs = torch.softmax(base / t, dim=0)
        assert set(counter) <= set(ids)
        assert all(abs(counter[i] - float(q) * n) <= 4 * (float(q) * (1 - float(q)) * n) ** 0.5
                   for i, q in zip(ids, probs)), (t, counter)


def test_a_tokens_noise_depends_on_the_token_not_on_the_other_candidates():
    keys = torch.tensor([7, -3])
    ids = torch.tensor([[3, 900, 48000, 12], [3, 900, 48000, 12]])
    noise = sampler._noise(keys, ids)
    assert not torch.equal(noise[0], noise[1])                               # another key
    order = torch.tensor([2, 0, 3, 1])
    assert torch.equal(sampler._noise(keys, ids[:, order]), noise[:, order])
    assert torch.equal(sampler._noise(keys, ids[:, :2]), noise[:, :2])
    # splitmix64's outputs: token t of key k is the (t + 1)-th from state k
    mask = 2**64 - 1

    def splitmix(k, t):
        z = (k + (t + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)
    u = ((splitmix(7, 48000) >> 11) + 0.5) * 2.0 ** -53
    assert noise[0, 2].item() == -math.log(-math.log(u))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9),
                                    SamplingParams(temperature=0.8, top_k=40, min_p=0.05)])
def test_skipping_a_draw_lines_a_generator_up_with_one_that_drew(params):
    torch.manual_seed(0)
    logits = torch.randn(4, 49152) * 3
    first, second = _rows(params, [11, 11])
    sample(logits[:1].clone(), [first])               # the draw the prefill engine made
    sampler.skip_draw(second.generator)
    assert [sample(logits[i:i + 1].clone(), [first])[0] for i in range(1, 4)] == \
        [sample(logits[i:i + 1].clone(), [second])[0] for i in range(1, 4)]


def test_logits_a_rounding_error_apart_draw_the_same_tokens():
    """What lets a split request (prefill and decode engines computing the same logits differently)
    draw as one engine: a flat distribution (a tiny random model's), nudged by 1e-6."""
    torch.manual_seed(0)
    logits = torch.randn(200, 49152) * 0.3
    nudged = logits + torch.randn(200, 49152) * 1e-6
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.95)):
        tokens = [sample(x.clone(), _rows(params, range(200)))[0] for x in (logits, nudged)]
        assert tokens[0] == tokens[1]


def test_min_p_masks_what_hugging_faces_warper_masks():
    from transformers.generation.logits_process import MinPLogitsWarper
    torch.manual_seed(0)
    logits = torch.randn(3, 500) * 3
    for min_p in (0.01, 0.1, 0.5, 1.0):
        ours = _filter_min_p(logits.clone(), torch.full((3,), min_p))
        theirs = MinPLogitsWarper(min_p, min_tokens_to_keep=1)(None, logits.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), min_p
        assert (~torch.isinf(ours)).sum(dim=-1).min() >= 1
    mixed = _filter_min_p(logits.clone(), torch.tensor([0.0, 0.3, 1.0]))
    assert not torch.isinf(mixed[0]).any()                        # 0: off for that row
    assert torch.equal(mixed[2].isinf(), logits[2] < logits[2].max())  # 1: the likeliest token alone


def test_min_p_one_samples_the_greedy_token(engine):
    greedy = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    sampled = engine.generate([PROMPT], SamplingParams(temperature=1.5, min_p=1.0, seed=7, max_tokens=8,
                                                       ignore_eos=True))[0]
    assert sampled.token_ids == greedy.token_ids


def test_invalid_params_are_reported_not_raised():
    assert "temperature" in SamplingParams(temperature=-1).validate()
    assert "top_p" in SamplingParams(top_p=0).validate()
    assert "min_p" in SamplingParams(min_p=1.5).validate() and "min_p" in SamplingParams(min_p=-0.1).validate()
    assert "max_tokens" in SamplingParams(max_tokens=0).validate()
    assert "min_tokens" in SamplingParams(max_tokens=2, min_tokens=3).validate()
    assert SamplingParams(stop=("",)).validate()
    assert SamplingParams().validate() is None


def test_detokenizer_is_utf8_safe_and_holds_back_stop_prefixes(default_model_dir):
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    text = "Voilà: 🙂 naïve café — 東京"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [], stop=())
    pieces = []
    for i in ids:
        d.add(i)
        piece = d.take(final=False)
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(d.take(final=True))
    assert "".join(pieces) == text
    d = IncrementalDetokenizer(tok, [], stop=("café",))
    shown = ""
    for i in ids:
        d.add(i)
        shown += d.take(final=False)
        assert "caf" not in shown or d.stopped
    assert d.stopped and shown + d.take(final=True) == "Voilà: 🙂 naïve "
    # a stop string the text held before min_tokens (check_stop off) does not stop it later, with a
    # longer stop string beside it (the search looks back only as far as each stop string needs)
    early = next(n for n in range(1, len(ids)) if "Vo" in tok.decode(ids[:n]))
    d = IncrementalDetokenizer(tok, [], stop=("Vo", "a longer stop string"))
    d.check_stop = False
    for k, i in enumerate(ids):
        d.check_stop = k >= early
        d.add(i)
    assert not d.stopped and d.take(final=True) == text
    # include_stop: the text runs to the stop string's end, and nothing is held back meanwhile
    d = IncrementalDetokenizer(tok, [], stop=("café",), include_stop=True)
    shown = ""
    for i in ids:
        d.add(i)
        shown += d.take(final=False)
        assert shown == d.text
    assert d.stopped and shown + d.take(final=True) == "Voilà: 🙂 naïve café"
    # output cut inside a character (max_tokens): the end shows what the whole output decodes to
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    d = IncrementalDetokenizer(tok, [], stop=())
    shown = ""
    for i in ids[:cut]:
        d.add(i)
        shown += d.take(final=False)
    assert "\ufffd" not in shown
    assert shown + d.take(final=True) == tok.decode(ids[:cut]) and d.take(final=True) == ""


def test_fast_decoder_gives_what_the_tokenizers_decode_gives(default_model_dir):
    # the default model's tokenizer takes the Rust decode directly; every window of a text with
    # special tokens, multi-byte characters split across tokens and spaces decodes the same
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    fast = fast_decoder(tok)
    assert fast is not None
    text = tok.apply_chat_template([{"role": "user", "content": "Voilà:  🙂 naïve café — 東京 ,  x ."}], tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    assert set(ids) & set(tok.all_special_ids)
    shown = fast_decoder(tok, skip_special_tokens=False)
    for a in range(len(ids)):
        for b in range(a, min(len(ids), a + 7) + 1):
            assert fast(ids[a:b]) == tok.decode(ids[a:b], skip_special_tokens=True,
                                                clean_up_tokenization_spaces=False), (a, b)
            assert shown(ids[a:b]) == tok.decode(ids[a:b], skip_special_tokens=False,
                                                 clean_up_tokenization_spaces=False), (a, b)
    assert "<|im_start|>" in shown(ids) and "<|im_start|>" not in fast(ids)

    class Custom(type(tok)):                 # a tokenizer that adds to decode keeps its own
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()
    custom = Custom.from_pretrained(default_model_dir)
    assert fast_decoder(custom) is None
    d = IncrementalDetokenizer(custom, [])
    for i in tok.encode("abc def"):
        d.add(i)
    assert d.take(final=True) == "ABC DEF"


def _row(params, token_ids, num_prompt, banned=()):
    gen = torch.Generator().manual_seed(0) if not params.greedy else None
    state = PenaltyState(list(token_ids), num_prompt, 5, torch.device("cpu")) if params.penalized else None
    return SampleRow(params, gen, list(banned), state)


def test_penalty_arithmetic():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]] * 3)
    rows = [_row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [4, 0, 3, 3, 0], 2),
            _row(SamplingParams(repetition_penalty=2.0), [1, 2, 0, 1], 3),
            _row(SamplingParams(), [0, 1, 2], 1)]
    _apply_penalties(logits, rows)
    # output [3, 3, 0]: token 3 twice, token 0 once; the prompt (4, 0) does not count
    assert logits[0].tolist() == [2.0 - 0.5 - 0.25, -1.0, 0.5, 3.0 - 1.0 - 0.25, 1.0]
    # prompt and output {0, 1, 2}: positive logits divided, negative multiplied
    assert logits[1].tolist() == [1.0, -2.0, 0.25, 3.0, 1.0]
    assert logits[2].tolist() == [2.0, -1.0, 0.5, 3.0, 1.0]


def test_logprobs_come_from_the_raw_logits_and_bans_still_hold():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]] * 2)
    raw = logits[0].log_softmax(-1)
    rows = [_row(SamplingParams(temperature=0, repetition_penalty=3.0, logprobs=2), [3, 3], 1),
            _row(SamplingParams(temperature=0.5, seed=1, logprobs=0), [1], 1, banned=[3])]
    tokens, logprobs = sample(logits.clone(), rows)
    assert tokens[0] == 0          # 3.0 / 3 = 1.0 < 2.0: the penalty moved the argmax
    assert tokens[1] != 3
    assert logprobs[0].token_id == 0 and logprobs[0].logprob == pytest.approx(float(raw[0]))
    assert [t for t, _ in logprobs[0].top] == [3, 0]
    assert [v for _, v in logprobs[0].top] == pytest.approx([float(raw[3]), float(raw[0])])
    assert logprobs[1].top == () and logprobs[1].logprob == pytest.approx(float(raw[tokens[1]]))
    assert sample(logits.clone(), [_row(SamplingParams(temperature=0), [0], 1)] * 2)[1] == [None, None]


def test_penalty_and_logprobs_params_are_validated():
    assert "presence_penalty" in SamplingParams(presence_penalty=2.5).validate()
    assert "frequency_penalty" in SamplingParams(frequency_penalty=float("nan")).validate()
    assert "repetition_penalty" in SamplingParams(repetition_penalty=0).validate()
    assert "logprobs" in SamplingParams(logprobs=21).validate()
    assert SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1.5, logprobs=20).validate() is None


def test_penalty_state_kept_up_by_sample_equals_one_rebuilt_from_the_tokens():
    history = [1, 4, 4, 2]
    row = _row(SamplingParams(temperature=0, frequency_penalty=0.5, repetition_penalty=1.5), history, 2)
    token, _ = sample(torch.tensor([[0.0, 0.1, 0.2, 5.0, 0.3]]), [row])
    rebuilt = PenaltyState(history + token, 2, 5, torch.device("cpu"))
    assert token == [3]
    assert torch.equal(row.penalty.seen, rebuilt.seen) and torch.equal(row.penalty.counts, rebuilt.counts)


def test_bad_words_are_banned_as_they_tokenize_alone_and_after_a_space(default_model_dir):
    from router.openai_protocol import CompletionRequest
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    encode = lambda text: tok.encode(text, add_special_tokens=False)
    body = CompletionRequest(prompt="x", bad_words=["Paris", " Paris", "hello world"])
    assert body.bad_word_ids(encode) == (tuple(encode("Paris")), tuple(encode(" Paris")), tuple(encode("hello world")),
                                         tuple(encode(" hello world")))
    assert encode("Paris") != encode(" Paris")
    assert CompletionRequest(prompt="x").bad_word_ids(encode) == ()


def test_prompt_logprobs_give_each_token_its_rank_across_slices(monkeypatch):
    """The rank is 1 + the tokens more likely than the prompt token (1: it is the likeliest), in
    every slice of rows the LM head sees."""
    monkeypatch.setattr(sampler, "PROMPT_LOGPROB_SLICE", 3)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 4 + [[5.0, 1.0, 1.0, 0.0]] * 3)
    targets = [1, 3, 2, 0, 0, 2, 3]
    got = sampler.prompt_logprobs(lambda h: h, logits, targets, 2)
    assert [e.rank for e in got] == [1, 2, 3, 4, 1, 2, 4]      # tokens 1 and 2 tie at row 5: rank 2
    ref = logits.log_softmax(-1)
    assert [e.logprob for e in got] == pytest.approx([float(ref[i, t]) for i, t in enumerate(targets)])
    assert [[t for t, _ in e.top] for e in got[:4]] == [[1, 3]] * 4 and all(e.top[0][0] == 0 for e in got[4:])
