"""Sampling parameters end to end through the engine (tiny random model, real tokenizer), and
the incremental detokenizer on its own."""

import pytest
import torch
from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.llm_engine import LLMEngine
from engine.sampler import _filter_top_k_top_p
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
    # min_tokens forbids the stop token until enough tokens are out
    held = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 2,
                                                    stop_token_ids=(stop_at,)))[0]
    assert stop_at not in held.token_ids[:first + 2] and len(held.token_ids) >= first + 2


def test_stop_string_cuts_the_text(default_model_dir):
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), device="cpu", kv_cache_memory="16MiB"))
    prompt = engine.tokenizer.encode("The three primary colors are")
    greedy = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert len(greedy.text) > 8
    stop = greedy.text[5:8]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop=(stop,), ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.text == greedy.text[:greedy.text.index(stop)]
    assert stop not in out.text


def test_top_k_and_top_p_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0]])
    out = _filter_top_k_top_p(logits.clone(), torch.tensor([2, 0]), torch.tensor([1.0, 0.5]))
    assert torch.isinf(out[0, 2:]).all() and not torch.isinf(out[0, :2]).any()
    # the top token alone holds > 50 % of the mass: nucleus 0.5 keeps only it
    assert not torch.isinf(out[1, 0]) and torch.isinf(out[1, 1:]).all()


def test_invalid_params_are_reported_not_raised():
    assert "temperature" in SamplingParams(temperature=-1).validate()
    assert "top_p" in SamplingParams(top_p=0).validate()
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
