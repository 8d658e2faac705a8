"""Tools (function calling) in chat completions: the request's tools, the prompt that shows them
to the model, and the grammar that makes it call one. (Finding the calls in the output:
router/tool_parser.py and a parser per syntax.)

Calls are written in one of seven syntaxes (`CallSyntax`), read from the chat template
(`template_tools`):
  - HERMES, which Qwen2.5, Qwen3 and Hermes models are trained on, and the one pdserve shows
    models whose template has no tools:
        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>
  - GLM45, GLM-4.5's (and 4.6's, 4.7's): a <tool_call> block of the function's name and its
    arguments as key / value pairs, a value the text itself for a string parameter, else JSON
    (router/hermes_calls.py reads these blocks beside Hermes' JSON ones, which a forced call writes):
        <tool_call>get_weather
        <arg_key>city</arg_key>
        <arg_value>Paris</arg_value>
        </tool_call>
  - LLAMA3_JSON, Llama 3.1-3.3's: the whole output is the call, "parameters" for the arguments,
    one call per turn (their templates refuse a history turn of several):
        {"name": "get_weather", "parameters": {"city": "Paris"}}
  - MISTRAL, Mistral's (7B-Instruct v0.3, Nemo, Small): the special token [TOOL_CALLS], then a
    JSON array of calls, content allowed before it; call ids of 9 letters and digits (the
    templates refuse others):
        [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]
  - GRANITE, IBM Granite 3.1-3.3's: the special token <|tool_call|>, then a JSON array of calls.
    Their templates show the tools and ask for this syntax but write a history turn's content
    only (no `tool_calls`), so pdserve writes a turn's calls into its content, as the model wrote
    them:
        <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]
  - PYTHONIC, a Python list of calls with keyword arguments (vLLM's pythonic templates for Llama
    3.2, Llama 4 and Gemma 3, given by the config's `chat_template`; router/pythonic_calls.py):
        [get_weather(city="Paris")]
  - HARMONY, gpt-oss's: a message to the function on the commentary channel, one call a turn,
    its template showing the tools and writing the history's calls itself (router/harmony.py; a
    forced call may follow the model's analysis, router/harmony_grammar.py):
        <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}
Life of a chat request with tools (router/app.py's chat endpoint)
  1. render     `render_conversation`: a chat template that writes calls itself ("native": it
                mentions <tool_call>, [TOOL_CALLS] or <|tool_call|>, asks for "[func_name1(", or
                writes Llama 3's {"name": ..., "parameters": ...}) receives the tools and the
                history's calls and results as transformers passes them to templates (Mistral's:
                each call id as 9 letters and digits, `CallSyntax.history_id`; Granite's: the
                calls in the turn's content). Any other template gets pdserve's own system text
                listing the tools (Qwen2.5's words), the history's calls written out in the Hermes
                syntax and tool results as a user turn of <tool_response> blocks, as Qwen2.5's
                template writes them. tool_choice "none" shows no tools (the output is all content).
  2. constrain  `tool_grammar`: tool_choice "required" or a named function is a Lark grammar
                (llguidance, engine/structured_output.py) in the template's syntax: the output is
                one call (or, with parallel_tool_calls and a syntax that has them, several) of the
                allowed functions, each arguments object a value of its function's JSON schema,
                then EOS. "auto": nothing is forced.
  3. parse      as the output streams or whole, one parser per syntax: router/hermes_calls.py,
                llama3_calls.py, array_calls.py (Mistral, Granite), pythonic_calls.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from engine.structured_output import JSON_OPTIONS, StructuredOutput, without_annotations
from router.chat_prompt import template_text
from router.harmony_grammar import TAGS as HARMONY_TAGS
from router.harmony_grammar import call_grammar
from router.protocol_types import Strict, StrictOpen, Text
from router.pythonic_grammar import pythonic_lines

MAX_TOOLS = 128
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
# An omitted `parameters` is an empty parameter list (OpenAI's reading): the arguments are {}.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class CallSyntax:
    """How a model family writes calls: each call's text is `open` + {"name": ..., <arguments_key>:
    {...}} + `close`, several joined by `separator` where `parallel` (else one per turn); the
    calls of a turn are `marker` + `prefix` ... `suffix`. `marker` is a special token where the
    tokenizer has it as one (`marker_id`, filled in by `template_tools`), else text. Call ids
    have `id_length` letters and digits where the template insists (0: OpenAI's call_...).
    `calls_in_content`: the template writes a history turn's content only, so its calls go into
    the content in this syntax. `tokens`: the ids of special tokens its grammars write (HARMONY's
    router/harmony_grammar.py TAGS)."""
    name: str
    arguments_key: str
    open: str
    close: str
    separator: str
    parallel: bool
    marker: str = ""
    marker_id: int | None = None
    prefix: str = ""
    suffix: str = ""
    id_length: int = 0
    calls_in_content: bool = False
    tokens: tuple[int, ...] = ()

    def new_id(self) -> str:
        """A new call's id."""
        return uuid.uuid4().hex[:self.id_length] if self.id_length else f"call_{uuid.uuid4().hex[:24]}"

    def lark_before(self) -> list[str]:
        """A forced turn's Lark terms before its first call: the marker (a special token by its
        id) and the prefix."""
        if self.marker_id is not None:
            return [f"<[{self.marker_id}]>", *[json.dumps(self.prefix)] * bool(self.prefix)]
        text = self.marker + self.prefix
        return [json.dumps(text)] if text else []

    def history_id(self, call_id: str) -> str:
        """A history call's id (and its result's tool_call_id) as the template takes it: the
        same id always maps to the same one, so a call and its result stay paired."""
        if not self.id_length or (len(call_id) == self.id_length and call_id.isalnum()):
            return call_id
        return hashlib.sha256(call_id.encode()).hexdigest()[:self.id_length]


HERMES = CallSyntax("hermes", "arguments", OPEN + "\n", "\n" + CLOSE, "\n", True)
GLM45 = dataclasses.replace(HERMES, name="glm45")       # its grammar: Hermes' (JSON in a block)
LLAMA3_JSON = CallSyntax("llama3_json", "parameters", "", "", "; ", False)
MISTRAL = CallSyntax("mistral", "arguments", "", "", ", ", True, marker="[TOOL_CALLS]", prefix=" [", suffix="]",
                     id_length=9)
PYTHONIC = CallSyntax("pythonic", "arguments", "", "", ", ", True, prefix="[", suffix="]")
GRANITE = CallSyntax("granite", "arguments", "", "", ", ", True, marker="<|tool_call|>", prefix="[", suffix="]",
                     calls_in_content=True)
HARMONY = CallSyntax("harmony", "arguments", "", "", "", False)


class FunctionDef(StrictOpen):
    """A function the model may call; other keys are ignored."""
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments object; "
                                              "none: no arguments.")
    strict: bool | None = Field(None, description="Accepted; a forced call's arguments always follow the schema.")


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionRef(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionRef


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(StrictOpen):
    name: Text = Field(description="As the model wrote it.")
    arguments: Text = Field(description="The arguments as JSON text.")


class MessageToolCall(StrictOpen):
    """A call an earlier assistant turn made (the conversation's history); other keys are ignored."""
    id: Text
    type: Literal["function"]
    function: CalledFunction


# ---- 1. render ---------------------------------------------------------------------------------
def template_tools(tokenizer) -> tuple[CallSyntax, bool]:
    """The syntax the model writes calls in, and whether its chat template shows tools and writes
    calls itself (native; else pdserve's Hermes text is shown)."""
    text = template_text(tokenizer)
    vocab = tokenizer.get_vocab()
    if HARMONY_TAGS[0] in text and all(tag in vocab for tag in HARMONY_TAGS):     # gpt-oss
        return dataclasses.replace(HARMONY, tokens=tuple(vocab[tag] for tag in HARMONY_TAGS)), True
    if "tools" in text and MISTRAL.marker in text:        # v0.3 writes "[TOOL_CALLS] [", Nemo "[TOOL_CALLS]["
        prefix = "[" if MISTRAL.marker + "[" in text else MISTRAL.prefix
        return dataclasses.replace(MISTRAL, marker_id=tokenizer.get_vocab().get(MISTRAL.marker), prefix=prefix), True
    if "tools" in text and GRANITE.marker in text:        # Granite 3.1-3.3: "respond with <|tool_call|> ..."
        return dataclasses.replace(GRANITE, marker_id=tokenizer.get_vocab().get(GRANITE.marker)), True
    if "tools" in text and "[func_name1(" in text:       # vLLM's pythonic templates: "[func_name1(params_name1=..."
        return PYTHONIC, True
    if "tools" in text and OPEN in text and "<arg_key>" in text:     # GLM-4.5's key / value pairs
        return GLM45, True
    if "tools" in text and OPEN in text:
        return HERMES, True
    if "tools" in text and '{"name": ' in text and '"parameters": ' in text:     # Llama 3.1-3.3
        return LLAMA3_JSON, True
    return HERMES, False


def in_blocks(syntax: CallSyntax | None) -> bool:
    """Whether calls are <tool_call> blocks (Hermes' JSON, GLM-4.5's key / value pairs)."""
    return syntax is not None and syntax.name in (HERMES.name, GLM45.name)


def string_parameters(tools: list[Tool] | None) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(function name, its parameters whose schema's type is string) of each tool: GLM-4.5 writes
    their values as the text itself, every other value as JSON."""
    def is_string(schema) -> bool:
        kind = schema.get("type") if isinstance(schema, dict) else None
        return kind == "string" or (isinstance(kind, list) and "string" in kind and set(kind) <= {"string", "null"})
    return tuple((t.function.name, tuple(k for k, v in ((t.function.parameters or {}).get("properties") or {}).items()
                                         if is_string(v))) for t in tools or ())


def tools_system_text(tools: list[Tool]) -> str:
    """pdserve's description of the tools, for templates that have none (Qwen2.5's own words)."""
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _arguments(text: str):
    """A history call's arguments as templates want them: the object, or the text if it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _call_text(call: MessageToolCall) -> str:
    body = {"name": call.function.name, "arguments": _arguments(call.function.arguments)}
    return f"{OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CLOSE}"


def render_conversation(messages, tools: list[Tool] | None,
                        native: CallSyntax | None) -> tuple[list[dict], list[dict] | None]:
    """The chat template's `messages` and `tools` arguments for a request's messages (ChatMessage,
    router/chat_protocol.py) and the tools to show (None: none); `native`: the syntax of a
    template that writes calls itself, None for pdserve's Hermes text."""
    if native is not None:
        return ([_native_message(m, native) for m in messages],
                [t.model_dump(exclude_none=True) for t in tools or ()] or None)
    out: list[dict] = []
    after_tool = False      # consecutive tool results share one user turn
    for m in messages:
        role, text = ("system" if m.role == "developer" else m.role), m.text()
        if m.tool_calls:
            text = "\n".join([text] * bool(text) + [_call_text(c) for c in m.tool_calls])
        if role == "tool":
            text = f"<tool_response>\n{text}\n</tool_response>"
            if after_tool:
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text})
            after_tool = True
            continue
        after_tool = False
        out.append(_with_reasoning({"role": role, "content": text}, m))
    if tools:
        if out[0]["role"] == "system":
            out[0]["content"] += "\n\n" + tools_system_text(tools)
        else:
            out.insert(0, {"role": "system", "content": tools_system_text(tools)})
    return out, None


def _native_message(m, syntax: CallSyntax) -> dict:
    out = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls and syntax.calls_in_content:
        calls = [{"name": c.function.name, syntax.arguments_key: _arguments(c.function.arguments)}
                 for c in m.tool_calls]
        out["content"] += syntax.marker + json.dumps(calls, ensure_ascii=False)
    elif m.tool_calls:
        out["tool_calls"] = [{"id": syntax.history_id(c.id), "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = syntax.history_id(m.tool_call_id)
    if m.name is not None:
        out["name"] = m.name
    return _with_reasoning(out, m)


def _with_reasoning(message: dict, m) -> dict:
    """An assistant turn's reasoning, under the names templates read (Qwen3's: reasoning_content;
    gpt-oss's: thinking)."""
    reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
    if reasoning is not None:
        message["reasoning_content"] = message["thinking"] = reasoning
    return message


# ---- 2. constrain ------------------------------------------------------------------------------
def forced_tools(tools: list[Tool], choice: ToolChoice) -> list[Tool]:
    """The functions a forced call may call: all ("required"), the named one, or none ("none", "auto")."""
    if isinstance(choice, NamedToolChoice):
        return [t for t in tools if t.function.name == choice.function.name]
    return list(tools) if choice == "required" else []


def parameters_problem(tool: Tool) -> str | None:
    """Why a function's parameters cannot shape a forced call's arguments, or None."""
    schema = tool.function.parameters
    problem = schema and StructuredOutput("json_schema", json.dumps(without_annotations(schema))).problem()
    return problem and f"function {tool.function.name!r}: parameters: {problem.removeprefix('invalid json_schema: ')}"


def tool_grammar(tools: list[Tool], choice: ToolChoice, parallel: bool,
                 syntax: CallSyntax = HERMES) -> StructuredOutput | None:
    """The grammar a forced call follows ("required" or a named function) in `syntax`, else None.
    Each function has its own rule, its arguments a `%json` value of its schema on its own (so
    the schema's "#/..." references hold), without its annotations (descriptions: the model reads
    them in the prompt); JSON is compact, as response_format's. Several calls only with
    "required", `parallel` and a syntax that has them."""
    tools = forced_tools(tools, choice)
    if not tools:
        return None
    several = parallel and choice == "required" and syntax.parallel
    if syntax.name == HARMONY.name:       # a message to the function, after any analysis, then EOS (<|call|>)
        return call_grammar(syntax.tokens, [(t.function.name, without_annotations(t.function.parameters or
                                                                                  NO_PARAMETERS)) for t in tools])
    if syntax.name == PYTHONIC.name:
        lines = ["%llguidance {}", "start: \"[\" call" + ' (", " call)*' * several + ' "]"',
                 "call: " + " | ".join(f"f{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            lines += pythonic_lines(i, tool.function.name, tool.function.parameters or NO_PARAMETERS)
        return StructuredOutput("lark", "\n".join(lines))
    functions = " | ".join(f"f{i}" for i in range(len(tools)))
    calls = "call" + f" ({json.dumps(syntax.separator)} call)*" * several
    lines = ["%llguidance {}", " ".join(["start:", *syntax.lark_before(), calls,
                                         *[json.dumps(syntax.suffix)] * bool(syntax.suffix)]),
             " ".join(["call:", *[json.dumps(syntax.open)] * bool(syntax.open), f"({functions})",
                       *[json.dumps(syntax.close)] * bool(syntax.close)])]
    for i, tool in enumerate(tools):
        schema = {**without_annotations(tool.function.parameters or NO_PARAMETERS), "x-guidance": JSON_OPTIONS}
        head = json.dumps(f'{{"name": "{tool.function.name}", "{syntax.arguments_key}": ')
        lines += [f'f{i}: {head} a{i} "}}"', f"a{i}: %json {json.dumps(schema)}"]
    return StructuredOutput("lark", "\n".join(lines))
