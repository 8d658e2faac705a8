"""A grammar after the reasoning (engine/structured_output.py's `ThinkFirst`, router/reasoning.py's
`grammar_think`): a reasoning model's output is free inside its <think> block, EOS excepted, and
follows the grammar from the token after </think>; where the prompt left no block open the first
token may open one. A tiny random model with <think> and </think> as single tokens; logit_bias on
</think> makes it close the block after a few tokens (per seed: some at once, some never within
max_tokens), so every branch is seen. Over HTTP in tests/test_reasoning.py."""

import json
import re

import numpy as np
import pytest
from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarCompiler, StructuredOutput
from engine_split import split_run
from router.reasoning import grammar_think, think_tokens
from serving.messages import WireSamplingParams

REGEX = "[a-z]{2,8}( [a-z]{2,8}){1,3}"
PROMPT = list(range(200, 230))


@pytest.fixture(scope="module")
def tags(thinking_model_dir):
    return think_tokens(AutoTokenizer.from_pretrained(thinking_model_dir))


@pytest.fixture(scope="module")
def engine(thinking_model_dir):
    return LLMEngine(EngineConfig(model=str(thinking_model_dir), device="cpu", kv_cache_memory="16MiB"))


def _params(tags, inside: bool, seed: int, bias=((1, 7.0),), max_tokens=60) -> SamplingParams:
    """`bias`: (0 for <think> / 1 for </think>, bias) pairs."""
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          logit_bias=tuple((tags[i], b) for i, b in bias),
                          structured=StructuredOutput("regex", REGEX, (*tags, inside)))


def test_the_tags_are_single_tokens_only_in_a_reasoning_vocabulary(tags, default_model_dir):
    assert tags is not None and tags[0] != tags[1]
    assert think_tokens(AutoTokenizer.from_pretrained(default_model_dir)) is None    # SmolLM2: several tokens each


def test_where_the_grammar_starts_is_read_from_the_prompt():
    assert grammar_think((5, 6), "<|im_start|>assistant\n<think>\n") == (5, 6, True)         # R1: inside
    assert grammar_think((5, 6), "<|im_start|>assistant\n") == (5, 6, False)                # Qwen3: may open
    assert grammar_think((5, 6), "assistant\n<think>\n\n</think>\n\n") is None              # thinking off
    assert grammar_think(None, "<|im_start|>assistant\n<think>\n") is None


def _bits(mask: bytes) -> np.ndarray:
    return np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")


def test_the_mask_is_free_but_eos_while_thinking_then_the_grammars(engine, tags):
    compiler = GrammarCompiler(engine.tokenizer, engine.runner.vocab_size, sorted(engine.eos_token_ids))
    grammar = _bits(compiler.matcher(StructuredOutput("regex", REGEX)).bitmask())
    opened, closed = tags
    start = compiler.matcher(StructuredOutput("regex", REGEX, (*tags, False)))
    first = _bits(start.bitmask())           # the grammar's first tokens, or <think>
    assert first[opened] and not grammar[opened] and (first ^ grammar).sum() == 1
    assert start.accept(opened)
    free = _bits(start.bitmask())[:engine.runner.vocab_size]
    eos = sorted(engine.eos_token_ids)
    assert not free[eos].any() and free.sum() == engine.runner.vocab_size - len(eos)
    assert start.accept(engine.tokenizer.encode("!?")[0]) and start.accept(closed)
    assert (_bits(start.bitmask()) == grammar).all()
    assert not start.accept(closed)            # the grammar's turn: </think> is not [a-z]
    plain = compiler.matcher(StructuredOutput("regex", REGEX, (*tags, False)))
    assert plain.accept(engine.tokenizer.encode("ab")[0]) and not _bits(plain.bitmask())[opened]


def _parts(engine, tags, token_ids):
    """(reasoning tokens, answer text) of an output that thinks first; None when it never closed."""
    if tags[1] not in token_ids:
        return None
    k = token_ids.index(tags[1])
    return token_ids[:k], engine.tokenizer.decode(token_ids[k + 1:], skip_special_tokens=True)


def test_the_output_thinks_freely_then_follows_the_grammar(engine, tags):
    seen = {"thought": 0, "never closed": 0}
    for seed in range(10):
        out = engine.generate([PROMPT], _params(tags, True, seed))[0]
        parts = _parts(engine, tags, out.token_ids)
        if parts is None:        # cut inside the block: no EOS there
            assert out.finish_reason == "length" and not set(out.token_ids) & engine.eos_token_ids
            seen["never closed"] += 1
            continue
        reasoning, answer = parts
        assert out.finish_reason == "stop" and out.token_ids[-1] in engine.eos_token_ids, out
        assert re.fullmatch(REGEX, answer), answer
        assert not set(reasoning) & engine.eos_token_ids
        if len(reasoning) >= 3:
            thought = engine.tokenizer.decode(reasoning)
            assert not re.fullmatch("[a-z ]*", thought), thought       # not held to the grammar
            seen["thought"] += 1
    assert seen["thought"] and seen["never closed"], seen
    assert engine.block_manager.all_free()


def test_without_an_open_block_the_first_token_may_open_one(engine, tags):
    """`<think>` favoured (bias 9; </think> 7): per seed the output opens a block or answers at once."""
    kinds = set()
    for seed in range(8):
        out = engine.generate([PROMPT], _params(tags, False, seed, bias=((0, 9.0), (1, 7.0))))[0]
        if out.token_ids[0] == tags[0]:
            parts = _parts(engine, tags, out.token_ids[1:])
            kinds.add("opened")
            assert parts is None or re.fullmatch(REGEX, parts[1]), out.text
        else:
            kinds.add("answered")
            assert tags[0] not in out.token_ids and tags[1] not in out.token_ids
            assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text
    assert kinds == {"opened", "answered"}


def test_split_and_resumed_requests_think_as_one_engine_does(engine, thinking_model_dir, tags):
    """The decode engine's matcher is rebuilt from the output tokens: inside the block, at </think>
    and after it, a split or resumed request gives one engine's tokens."""
    make = lambda: LLMEngine(EngineConfig(model=str(thinking_model_dir), device="cpu", kv_cache_memory="16MiB"))
    prefill, decode = make(), make()
    params = _params(tags, True, 5)
    whole = engine.generate([PROMPT], params)[0].token_ids
    k = whole.index(tags[1])
    assert split_run(prefill, decode, "s", PROMPT, params)[0].token_ids == whole
    for cut in (2, k, k + 1, k + 3):
        again = split_run(prefill, decode, f"r{cut}", PROMPT, params, whole[:cut])[0]
        assert whole[:cut] + again.token_ids == whole
    assert all(e.block_manager.all_free() for e in (engine, prefill, decode))


def test_bad_think_values_are_refused(engine, tags):
    assert "think" in StructuredOutput("regex", REGEX, (3, 3, True)).problem()
    assert "think" in StructuredOutput("regex", REGEX, (3, -1, True)).problem()
    assert "think" in StructuredOutput("regex", REGEX, (3, 4, 1)).problem()
    far = StructuredOutput("regex", REGEX, (tags[0], engine.runner.vocab_size, True))
    rejected = engine.add_request("far", PROMPT, SamplingParams(structured=far))
    assert rejected is not None and "out of range" in rejected.reason


def test_think_crosses_the_wire():
    params = SamplingParams(structured=StructuredOutput("json_object", "", (7, 8, True)))
    wire = WireSamplingParams.from_body(json.loads(json.dumps(WireSamplingParams.of(params).__dict__)))
    assert wire.to_params().structured == params.structured
    with pytest.raises(ValueError, match="think"):
        WireSamplingParams.from_body({**WireSamplingParams.of(params).__dict__, "structured": ["regex", "a", [1, 2]]})
