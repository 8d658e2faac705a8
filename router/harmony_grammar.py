"""What a request constrains in a harmony model's output (gpt-oss; router/harmony.py reads it):
the message that answers, after an analysis message the model writes freely, as vLLM applies a
grammar after a reasoning parser's end.

    start: analysis? answer
    analysis: <|channel|> "analysis" <|message|> TEXT <|end|> <|start|> "assistant"
    answer: <|channel|> "final" <|message|> VALUE                      (response_format)
          | <|channel|> "commentary to=functions.NAME " <|constrain|> "json" <|message|> ARGUMENTS
                                                                      (a forced call, router/tools.py)

TEXT is any text (a special token ends it: the grammar's tags are tokens, by id), VALUE a value of
the request's JSON schema, any JSON object, or one of its choices; a regex or a Lark grammar has
no place in the answer here and constrains the output from its first token, as for any model.
EOS follows the answer (gpt-oss's <|return|> or <|call|>).
"""

from __future__ import annotations

import json

from engine.structured_output import JSON_OPTIONS, StructuredOutput

# the tags a grammar writes, in the order of `CallSyntax.tokens` (router/tools.py HARMONY)
TAGS = ("<|channel|>", "<|constrain|>", "<|message|>", "<|start|>", "<|end|>")


def final_grammar(spec: StructuredOutput, tokens: tuple[int, ...]) -> StructuredOutput:
    """`spec` as the body of the output's final message (`tokens`: the ids of TAGS); a regex or
    grammar as it is."""
    if spec.kind == "choice":
        try:
            value = " | ".join(json.dumps(choice) for choice in json.loads(spec.value))
        except (json.JSONDecodeError, TypeError):
            return spec                                  # its problem() says why
    elif spec.kind in ("json_schema", "json_object"):
        try:
            schema = json.loads(spec.value) if spec.kind == "json_schema" else {"type": "object"}
        except json.JSONDecodeError:
            return spec
        if not isinstance(schema, dict):
            return spec
        value = _json(schema)
    else:
        return spec
    channel, _, message = (f"<[{i}]>" for i in tokens[:3])
    return _grammar(tokens, [f'answer: {channel} "final" {message} value', f"value: {value}"])


def call_grammar(tokens: tuple[int, ...], calls: list[tuple[str, dict]]) -> StructuredOutput:
    """One call of one of `calls` (function name, its parameters' schema without annotations) as
    a commentary message to the function."""
    channel, constrain, message = (f"<[{i}]>" for i in tokens[:3])
    lines = ["answer: " + " | ".join(f"f{i}" for i in range(len(calls)))]
    for i, (name, schema) in enumerate(calls):
        head = json.dumps(f"commentary to=functions.{name} ")
        lines += [f'f{i}: {channel} {head} {constrain} "json" {message} a{i}',
                  f"a{i}: {_json(schema)}"]
    return _grammar(tokens, lines)


def _json(schema: dict) -> str:
    """A value of `schema`, compact JSON as response_format's (router/tools.py's forced calls too)."""
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"


def _grammar(tokens: tuple[int, ...], answer: list[str]) -> StructuredOutput:
    channel, _, message, start, end = (f"<[{i}]>" for i in tokens)
    return StructuredOutput("lark", "\n".join([
        "%llguidance {}", "start: analysis? answer",
        f'analysis: {channel} "analysis" {message} TEXT {end} {start} "assistant"',
        "TEXT: /(?s:.*)/", *answer]))
