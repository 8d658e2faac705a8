"""Structured output: a grammar a request's output must follow (torch-free).

`StructuredOutput` names what the output must be: a JSON value of a JSON schema
(`json_schema`), any JSON object (`json_object`), a match of a regular expression (`regex`),
one of a list of strings (`choice`), or a sentence of a Lark grammar (`lark`). llguidance
compiles it and, before each sampling step, says which tokens may come next (a bitmask over the
vocabulary); the engine masks the others, so the output is always a prefix of a sentence of the
grammar, and once the sentence is complete only EOS may follow it.

Who calls what
  - `StructuredOutput.problem` at both boundaries, through `SamplingParams.validate` (the router
    before it sends a request, the engine before it admits one): a schema, regex or grammar
    that does not compile is a 400, never a failed step.
  - `GrammarCompiler`: one per engine, made at the first request that asks (its view of the
    tokenizer takes ~0.3 s for a 49k vocabulary). It keeps the latest grammars it compiled
    (`CACHED_GRAMMARS`) and gives each request a copy (agents send the same tools every turn:
    a copy takes ~0.02 ms where compiling 32 tools' grammar takes ~30 ms). Thread-safe: a
    replica compiles a request's grammar on a worker thread before the engine thread admits it
    (`LLMEngine.prepare`).
  - `Matcher`: one per request, alive as long as the request: `bitmask` before each step that
    samples the request, `accept` with the token sampled. Its state is a function of the output
    tokens alone, so the decode engine rebuilds it from the prefill engine's first token (and a
    resumed request's tokens): only the spec crosses the wire.

A reasoning model thinks before it answers: a spec with `think` (the router sets it for a chat
template with <think> blocks whose tags are single tokens: Qwen3, QwQ, DeepSeek-R1's distills)
leaves the output free inside its <think> block, EOS excepted, and the grammar starts after
</think> (`ThinkFirst`), as vLLM applies a grammar after a reasoning parser's end.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
MAX_SPEC_CHARS = 64 * 1024     # a schema, regex, grammar or the choices as JSON
MAX_CHOICES = 256
CACHED_GRAMMARS = 32           # compiled grammars a GrammarCompiler keeps (each well under 1 MiB)
# JSON is written as json.dumps writes it: one space after ',' and ':', no other whitespace. With
# llguidance's default (any whitespace) SmolLM2-135M-Instruct indented its JSON and 1 of 6 chat
# prompts asking for JSON ended within 120 tokens (greedy, json_object or a two-field schema);
# written compactly, 4 of 6 did.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# JSON Schema's annotations: they document a value and never constrain it, so a grammar has no use
# for them (a tool set's parameter descriptions can be most of its schemas' text)
ANNOTATIONS = frozenset({"title", "description", "examples", "default", "$comment", "deprecated", "readOnly",
                         "writeOnly"})
_SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "contains", "not", "if", "then", "else",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties", "contentSchema")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def without_annotations(schema):
    """`schema` (a JSON schema) without its annotations, in it and in every subschema: the same
    values are valid. Keys are dropped only where they are keywords (a property named
    "description" stays), and values of other keywords (enum, const, ...) are left whole."""
    if not isinstance(schema, dict):
        return schema
    out = {k: v for k, v in schema.items() if k not in ANNOTATIONS}
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = without_annotations(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [without_annotations(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: without_annotations(s) for name, s in out[key].items()}
    return out


@dataclass(frozen=True)
class StructuredOutput:
    """`value`: the JSON schema as JSON text (json_schema), "" (json_object), the regex, the
    choices as a JSON list of strings (choice), or the Lark grammar."""

    kind: str
    value: str = ""
    # (the <think> token, the </think> token, whether the prompt left a <think> open): the
    # grammar starts after </think>; without an open block the first token may open one.
    think: tuple[int, int, bool] | None = None

    def problem(self) -> str | None:
        """Why this spec cannot be served, or None (compiles the grammar without a tokenizer; the
        answers for the latest specs are kept: a router checks a request's spec twice, and agents
        send the same tools every turn)."""
        return _problem(self)

    def grammar(self) -> str:
        """llguidance's grammar text; ValueError when the value is not of its kind's shape."""
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the schema is not JSON ({exc})") from None
            if not isinstance(schema, dict):
                raise ValueError("the schema must be a JSON object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(_choice_grammar(self.value))
        return llguidance.LLMatcher.grammar_from_lark(self.value)


@functools.lru_cache(maxsize=64)
def _problem(spec: StructuredOutput) -> str | None:
    if spec.kind not in KINDS:
        return f"structured output kind must be one of {', '.join(KINDS)}, got {spec.kind!r}"
    if len(spec.value) > MAX_SPEC_CHARS:
        return f"the {spec.kind} is longer than {MAX_SPEC_CHARS} characters"
    if spec.think is not None and not (
            len(spec.think) == 3 and all(type(t) is int and t >= 0 for t in spec.think[:2])
            and spec.think[0] != spec.think[1] and type(spec.think[2]) is bool):
        return "think: (the <think> token id, the </think> token id, whether the prompt left <think> open)"
    try:
        grammar = spec.grammar()
    except ValueError as exc:
        return f"invalid {spec.kind}: {exc}"
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return f"invalid {spec.kind}: {error.strip()}" if error else None


def _choice_grammar(value: str) -> str:
    try:
        choices = json.loads(value)
    except json.JSONDecodeError:
        choices = None
    if (not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES
            or not all(isinstance(c, str) and c for c in choices)):
        raise ValueError(f"choices are a list of 1 to {MAX_CHOICES} non-empty strings")
    # Lark's string literals take JSON's escapes
    return "start: " + " | ".join(json.dumps(c) for c in choices)


class GrammarCompiler:
    """The tokenizer as llguidance sees it, for the matchers of one engine. `vocab_size`: the
    model's (the logits' width; the bitmasks cover it); `eos_token_ids`: what may end a sentence."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]):
        # imported here: llguidance.hf imports transformers (~0.6 s of CPU), which the processes that
        # only read this module's dataclasses (serving.messages: the stats registry, the response
        # store) never need
        import llguidance.hf
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                      eos_token=sorted(eos_token_ids))
        # a thinking output's mask: every token but EOS (the bitmasks' length: whole 32-bit words)
        free = bytearray(b"\xff" * ((vocab_size + 31) // 32 * 4))
        for t in eos_token_ids:
            free[t // 8] &= ~(1 << t % 8)
        self._free = bytes(free)
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def has(self, spec: StructuredOutput) -> bool:
        """Whether `spec`'s grammar is in the cache. Any thread."""
        with self._lock:
            return (spec.kind, spec.value) in self._compiled

    def compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """The grammar's matcher at the output's start, its first mask computed (some grammars
        fail only then, e.g. a schema that refers to itself alone): from the cache, else compiled
        and kept when it did not fail. Any thread; never advance the matcher returned (copy it)."""
        key = (spec.kind, spec.value)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        compiled = llguidance.LLMatcher(self.tokenizer, spec.grammar(), log_level=0)
        compiled.compute_bitmask()
        if not compiled.is_error():
            with self._lock:
                self._compiled[key] = compiled
                while len(self._compiled) > CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutput) -> "Matcher | ThinkFirst":
        """A request's matcher at the output's start; its `problem` says whether the grammar
        could be built."""
        compiled = self.compile(spec)
        matcher = Matcher(compiled if compiled.is_error() else compiled.deep_copy())
        if spec.think is None:
            return matcher
        open_id, close_id, inside = spec.think
        return ThinkFirst(matcher, open_id, close_id, inside, self._free)


class Matcher:
    """Where one request's output stands in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._m = matcher

    def problem(self) -> str | None:
        """Why the grammar cannot go on (it failed to build, or a token was refused), or None."""
        return (self._m.get_error() or "error").splitlines()[0] if self._m.is_error() else None

    def bitmask(self) -> bytes:
        """The tokens that may come next: bit t % 8 of byte t // 8 is set for token t."""
        return self._m.compute_bitmask()

    def accept(self, token: int) -> bool:
        """Move past `token`; False (and the matcher is in error from then on) if it was not allowed."""
        return self._m.consume_token(token)


class ThinkFirst:
    """A matcher behind a <think> block: the output is free (EOS excepted: an answer must follow)
    until the </think> token, then follows the grammar. Where the prompt left no block open, the
    first token may open one (the <think> token) or start the grammar. Like the matcher's, its
    state is a function of the output tokens."""

    def __init__(self, matcher: Matcher, open_id: int, close_id: int, inside: bool, free: bytes):
        self._matcher, self._open, self._close, self._free = matcher, open_id, close_id, free
        self._state = "thinking" if inside else "start"      # start -> (thinking ->) grammar

    def problem(self) -> str | None:
        return self._matcher.problem()

    def bitmask(self) -> bytes:
        if self._state == "thinking":
            return self._free
        mask = self._matcher.bitmask()
        if self._state == "start":
            mask = bytearray(mask)
            mask[self._open // 8] |= 1 << self._open % 8
            mask = bytes(mask)
        return mask

    def accept(self, token: int) -> bool:
        if self._state == "thinking":
            if token == self._close:
                self._state = "grammar"
            return True
        if self._state == "start":
            if token == self._open:
                self._state = "thinking"
                return True
            self._state = "grammar"
        return self._matcher.accept(token)
