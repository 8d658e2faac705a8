"""The chat completions request: its messages, tools and template options, on the sampling fields
every completion request shares (router/openai_protocol.py's `Sampling`). The rules that span
fields are model validators, stated in the model's description and, as if/then, in its JSON schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from engine.sampling_params import MAX_LOGPROBS
from engine.structured_output import StructuredOutput
from router.chat_prompt import RESERVED_TEMPLATE_KWARGS
from router.harmony_grammar import final_grammar
from router.openai_protocol import MAX_STOPS, ONE_STRUCTURE, Sampling
from router.protocol_types import (METADATA, REASONING_EFFORT, SERVICE_TIER, Int, Strict, StrictOpen, Text,
                                   TextPartType, implies, present)
from router.tools import CLOSE as TOOL_CALL_END
from router.tools import (GLM45, HARMONY, HERMES, MAX_TOOLS, CallSyntax, MessageToolCall, NamedToolChoice, Tool,
                          ToolChoice, forced_tools, in_blocks, parameters_problem, render_conversation, tool_grammar)


class TextPart(StrictOpen):
    """A text content part; other keys are ignored."""
    type: TextPartType("text")
    text: Text


class Prediction(Strict):
    """OpenAI's predicted output: text most of the output is expected to repeat (a file to edit)."""
    type: Literal["content"]
    content: Text | Annotated[list[TextPart], Field(min_length=1)]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


# content may be left out (or null) by an assistant turn that made calls; calls are an assistant's,
# tool_call_id a tool result's
MESSAGE_CROSS_FIELD = {"allOf": [
    {"if": {"not": present("content")}, "then": {"properties": {"role": {"const": "assistant"}, "tool_calls": {
        "type": "array", "minItems": 1}}, "required": ["role", "tool_calls"]}},
    {"if": present("tool_calls"), "then": {"properties": {"role": {"const": "assistant"}}}},
    {"if": present("tool_call_id"), "then": {"properties": {"role": {"const": "tool"}}}}]}


class ChatMessage(Strict):
    """A turn of the conversation. Across fields: content may be left out only by an assistant
    turn with tool_calls; tool_calls only on assistant turns, tool_call_id only on tool turns."""
    model_config = ConfigDict(json_schema_extra=MESSAGE_CROSS_FIELD)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = Field(None, description="Text, or text parts (no images or audio).")
    name: Text | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="The calls an assistant turn made.")
    tool_call_id: Text | None = Field(None, description="The call a tool turn answers.")
    reasoning: Text | None = Field(None, description="An assistant turn's reasoning, as this server returned it "
                                   "(templates that show past reasoning get it as reasoning_content).")
    reasoning_content: Text | None = Field(None, description="The same, by its older name.")
    refusal: Text | None = Field(None, description="Accepted; not shown to the model.")

    @model_validator(mode="after")
    def _roles(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("a message needs content (only an assistant turn with tool_calls may leave it out)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only tool messages carry tool_call_id")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


MAX_DOCUMENTS = 64
# a template's `documents` (retrieval-augmented generation): each a dict of strings such as title and text
Documents = Annotated[list[Annotated[dict[str, Text], Field(max_length=16)]],
                      Field(min_length=1, max_length=MAX_DOCUMENTS)]


def _no_request_template(value):
    if value is not None:
        raise PydanticCustomError("request_chat_template", "a request's own chat template is not accepted (as vLLM "
                                  "without --trust-request-chat-template): the server's applies (pdserve's "
                                  "`chat_template` setting)")
    return value


FORCED_TOOL = {"anyOf": [{"const": "required"}, {"type": "object"}]}
CHAT_CROSS_FIELD = {"allOf": [
    implies("top_logprobs", {"type": "integer", "minimum": 1},
            {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}),
    ONE_STRUCTURE,
    implies("continue_final_message", {"const": True}, {"properties": {"add_generation_prompt": {"const": False}},
                                                         "required": ["add_generation_prompt"]}),
    implies("tool_choice", {"anyOf": [{"enum": ["auto", "required"]}, {"type": "object"}]}, present("tools")),
    implies("tool_choice", FORCED_TOOL, {"properties": {"response_format": {"type": "null"},
                                                         "structured_outputs": {"type": "null"}}})]}


class ChatCompletionRequest(Sampling):
    """A chat completion. Across fields: top_logprobs above 0 needs logprobs true; a tool_choice
    other than "none" needs tools, a named one a function among them; a forced call ("required"
    or named) takes no response_format, structured_outputs, allowed_token_ids or bad_words (each
    would shape the output); allowed_token_ids and bad_words take no response_format or
    structured_outputs;
    continue_final_message needs add_generation_prompt false and an assistant's last message."""
    model_config = ConfigDict(json_schema_extra=CHAT_CROSS_FIELD)
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Int(ge=1) | None = Field(None, description="Default: as many as the context allows.")
    max_completion_tokens: Int(ge=1) | None = Field(None, description="Overrides max_tokens.")
    logprobs: bool | None = None
    top_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = Field(None, description="Alternatives per token (with logprobs).")
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = Field(
        None, description="Functions the model may call (distinct names).")
    tool_choice: ToolChoice | None = Field(None, description='"none": no calls (the tools are not shown); "auto" '
                                           '(the default with tools): the model chooses; "required": at least one '
                                           "call; a named function: one call of it. Forced calls follow the "
                                           "functions' schemas.")
    parallel_tool_calls: bool = Field(True, description='With "required": one call or several (else exactly one).')
    include_reasoning: bool = Field(True, description="vLLM's: with a template that has <think> blocks, return "
                                    "their text as `reasoning` (false: drop it).")
    add_generation_prompt: bool = Field(True, description="vLLM's: open the assistant's turn after the messages.")
    continue_final_message: bool = Field(False, description="vLLM's: leave the last message (an assistant's) open "
                                         "and continue it; needs add_generation_prompt false.")
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=32, json_schema_extra={
        "propertyNames": {"not": {"enum": list(RESERVED_TEMPLATE_KWARGS)}}})] | None = Field(
        None, description="vLLM's: more variables for the chat template (e.g. enable_thinking), not named "
                          "as apply_chat_template's own arguments.")
    documents: Documents | None = Field(
        None, description="vLLM's: documents for a template that reads them (retrieval-augmented generation: "
                          "Command R's, Granite's), each a dict of strings such as title and text; templates "
                          "that do not read them ignore them.")
    chat_template: Annotated[None, BeforeValidator(_no_request_template)] = Field(
        None, description="vLLM's per-request template: not accepted (the server's `chat_template` applies), as "
                          "vLLM refuses it without --trust-request-chat-template.")
    echo: bool = Field(False, description="vLLM's: where the last message is an assistant's (a prefilled answer "
                       "continued with continue_final_message), the answer's content starts with its text "
                       "(streamed: a chunk of its own after the role's).")
    add_special_tokens: bool = Field(False, description="vLLM's: tokenize the templated prompt with the tokenizer's "
                                     "special tokens (e.g. a BOS) on top of those the template writes; the "
                                     "default false suits templates that write their own, as most do.")
    reasoning_effort: REASONING_EFFORT | None = Field(None, description="The chat template's `reasoning_effort` "
                                                      "(templates that read it act on it; chat_template_kwargs "
                                                      "may set it too).")
    store: bool | None = Field(None, description="Accepted; chat completions are not kept (Responses are).")
    metadata: METADATA | None = Field(None, description="Accepted; ignored.")
    service_tier: SERVICE_TIER | None = Field(None, description="Accepted; one tier here.")
    modalities: list[Literal["text"]] | None = Field(None, description="Text only.")
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = Field(None, description="Accepted; prompts share a prefix cache anyway.")
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        None, description="Accepted; the prefix cache is in memory, its blocks reused until others need them.")
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="Accepted; ignored.")
    prediction: Prediction | None = Field(
        None, description="OpenAI's predicted output: the decode steps draft tokens from it (the server's "
                          "engine.prediction_tokens) and keep those the model picks itself, so the output comes "
                          "faster where it repeats the prediction and is the same either way.")

    def echoed(self) -> str:
        """What `echo` puts before each choice's content: the last message's text, an assistant's."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _prompt_shape(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        reserved = sorted(set(self.chat_template_kwargs or ()) & set(RESERVED_TEMPLATE_KWARGS))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        return self

    @model_validator(mode="after")
    def _tools_agree(self):
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise ValueError("tools: function names must be distinct")
        if self.tool_choice not in (None, "none") and not self.tools:
            choice = repr(self.tool_choice) if isinstance(self.tool_choice, str) else "of a function"
            raise ValueError(f"tool_choice {choice} needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        if self.chosen_tools == "auto" and not self.parallel_tool_calls and len(super().stop_list()) >= MAX_STOPS:
            raise ValueError(f"with parallel_tool_calls false, at most {MAX_STOPS - 1} stop strings (the first "
                             "call ends the output through one more)")
        if self.forces_call and (super().structured() is not None or self.allowed_token_ids is not None
                                 or self.bad_words is not None):
            raise ValueError("a forced tool call (tool_choice required or a function) takes no response_format, "
                             "structured_outputs, allowed_token_ids or bad_words")
        return self

    @property
    def forces_call(self) -> bool:
        """tool_choice "required" or a function."""
        return bool(forced_tools(self.tools or [], self.chosen_tools))

    def tools_problem(self, syntax: CallSyntax = HERMES) -> str | None:
        """Why a forced call cannot be shaped (a forced function's parameters, or the grammar of
        them all in the template's `syntax`, do not compile), or None. It compiles grammars (up to
        tens of ms for a new tool set): the router runs it off its event loop."""
        for tool in forced_tools(self.tools or [], self.chosen_tools):
            if problem := parameters_problem(tool):
                return f"tools: {problem}"
        forced = tool_grammar(self.tools or [], self.chosen_tools, self.parallel_tool_calls, syntax)
        problem = forced and forced.problem()
        return problem and f"tools: {problem.splitlines()[0]}"

    @property
    def chosen_tools(self):
        """tool_choice, its default filled in."""
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def parses_tool_calls(self) -> bool:
        return self.chosen_tools != "none"

    def structured(self, syntax: CallSyntax = HERMES) -> StructuredOutput | None:
        """A forced call's grammar, else response_format's / structured_outputs' (a harmony model's:
        its final message's, router/harmony_grammar.py)."""
        forced = tool_grammar(self.tools, self.chosen_tools, self.parallel_tool_calls, syntax) if self.tools else None
        spec = forced or super().structured()
        return final_grammar(spec, syntax.tokens) if spec and not forced and syntax.name == HARMONY.name else spec

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def stop_list(self, syntax: CallSyntax = HERMES) -> tuple[str, ...]:
        """The client's stop strings; with "auto", parallel_tool_calls false and the Hermes syntax
        also </tool_call>: the output ends with its first call (the parser reads a block cut there
        as a call). Llama 3's JSON parser keeps the first call itself."""
        if self.chosen_tools == "auto" and not self.parallel_tool_calls and in_blocks(syntax):
            return (*super().stop_list(), TOOL_CALL_END)
        return super().stop_list()

    def skips_special_tokens(self, syntax: CallSyntax) -> bool:
        """False where calls open with a special token (GLM-4.5's tags may be), and always for a
        harmony model (gpt-oss: its channels are special tokens, router/harmony.py)."""
        marked = syntax.marker_id is not None or syntax.name == GLM45.name
        return self.skip_special_tokens and not (self.parses_tool_calls and marked) and syntax.name != HARMONY.name

    def conversation(self, native_tools: CallSyntax | None) -> tuple[list[dict], list[dict] | None]:
        """The chat template's messages and tools (router/tools.py): `native_tools`, the syntax of a
        template that writes tool calls itself (None: it does not)."""
        return render_conversation(self.messages, self.tools if self.parses_tool_calls else None, native_tools)
