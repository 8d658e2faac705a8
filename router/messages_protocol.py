"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): the request, and
the chat completion it becomes (router/messages_api.py runs it; router/messages_output.py turns the
answer into a Message or its stream's events).

Content blocks, in order, become chat messages:
  - `system` (text, or text blocks): a system message first
  - a user turn's text blocks: one user message (its text parts), after the tool messages its
    `tool_result` blocks become (one each, answering `tool_use_id`; an `is_error` result's text
    is marked as an error)
  - an assistant turn's `thinking` blocks: its `reasoning`; its text blocks: its content; its
    `tool_use` blocks: its tool calls (`input` as the arguments' JSON). `redacted_thinking` is
    left out (nothing here can read it)
Images, documents and server tools are refused (a text-only model; no tools run here). `tools`
are the client's functions (`input_schema` the parameters' schema); `tool_choice` any -> required,
tool -> that function, `disable_parallel_tool_use` -> parallel_tool_calls false. `stop_sequences`
are stop strings, `metadata.user_id` the user. `thinking` sets the template variable
`enable_thinking` (Qwen3's templates read it; a model without reasoning ignores it);
`output_config.effort` is the chat's `reasoning_effort`, `output_config.format` (a JSON schema)
its `response_format`. A last message of the assistant's is a prefill: the model continues it
(`continue_final_message`), and the answer is the continuation. temperature, top_p and top_k
(which Anthropic's newer clients no longer send) sample as the chat endpoint's do.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from router.chat_protocol import ChatCompletionRequest
from router.openai_protocol import GREEDY_BELOW_TEMPERATURE, MAX_STOPS, MAX_TOP_K
from router.protocol_types import (MODEL_FIELD, REASONING_EFFORT, Int, NonEmptyText, Strict, StrictOpen, Text,
                                   implies)
from router.tools import MAX_TOOLS, FunctionName

MAX_MESSAGES = 1024
MAX_BLOCKS = 1024
TEXT_ONLY = ("image", "document", "search_result", "container_upload")   # blocks a text-only model cannot read


class TextBlock(StrictOpen):
    """Text (its cache_control and citations are ignored)."""
    type: Literal["text"]
    text: Text


class ToolUseBlock(StrictOpen):
    """A call an earlier assistant turn made."""
    type: Literal["tool_use"]
    id: NonEmptyText
    name: FunctionName
    input: dict[str, Any]


class ToolResultBlock(StrictOpen):
    """The client's answer to a call (`tool_use_id`): text, or text blocks."""
    type: Literal["tool_result"]
    tool_use_id: NonEmptyText
    content: Text | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str | None) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else (text or "")


class ThinkingBlock(StrictOpen):
    """An earlier answer's reasoning (its signature is not checked: this server signs nothing)."""
    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None


class RedactedThinkingBlock(StrictOpen):
    type: Literal["redacted_thinking"]
    data: Text


def _readable(theirs: tuple[str, ...], owner: str):
    """Refuse an image or document block as such, and a block of the other role's (`theirs`, the
    `owner`'s) as that, not as unknown tags."""
    def check(value):
        if isinstance(value, dict) and value.get("type") in TEXT_ONLY:
            raise PydanticCustomError("text_only", "this server's model reads text only, not {got} blocks",
                                      {"got": repr(value["type"])})
        if isinstance(value, dict) and value.get("type") in theirs:
            raise PydanticCustomError("other_role", "{got} blocks come in {owner} turns only",
                                      {"got": repr(value["type"]), "owner": owner})
        return value
    return BeforeValidator(check)


UserBlock = Annotated[TextBlock | ToolResultBlock, Field(discriminator="type"),
                      _readable(("tool_use", "thinking", "redacted_thinking"), "assistant")]
AssistantBlock = Annotated[TextBlock | ToolUseBlock | ThinkingBlock | RedactedThinkingBlock,
                           Field(discriminator="type"), _readable(("tool_result",), "user")]


class UserTurn(Strict):
    """A user's turn: text, or text and tool_result blocks."""
    role: Literal["user"]
    content: Text | Annotated[list[UserBlock], Field(max_length=MAX_BLOCKS)]


class AssistantTurn(Strict):
    """An assistant's turn: text, or text, tool_use and thinking blocks."""
    role: Literal["assistant"]
    content: Text | Annotated[list[AssistantBlock], Field(max_length=MAX_BLOCKS)]


Message = Annotated[UserTurn | AssistantTurn, Field(discriminator="role")]


class Tool(StrictOpen):
    """A client tool (its cache_control is ignored). Server tools (web search, code execution, ...,
    whose `type` is theirs) do not run here."""
    type: Literal["custom"] | None = None
    name: FunctionName
    description: Text | None = None
    input_schema: dict[str, Any]


class ToolChoice(Strict):
    """Across fields: a name goes with type tool, and only with it."""
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"allOf": [
        implies("type", {"const": "tool"}, {"properties": {"name": {"type": "string"}}, "required": ["name"]}),
        implies("name", {"type": "string"}, {"properties": {"type": {"const": "tool"}}})]})
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice: a name goes with type 'tool', and only with it")
        return self


class ThinkingConfig(Strict):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Int(ge=1) | None = Field(None, description="Accepted; the template decides how the model "
                                            "reasons, and max_tokens bounds all of it.")


class Metadata(StrictOpen):
    user_id: Text | None = None


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema the output is a value of.")


class OutputConfig(Strict):
    effort: REASONING_EFFORT | None = Field(None, description="The chat template's `reasoning_effort`.")
    format: OutputFormat | None = None


IGNORED = "Accepted; ignored."


# an object: the `if` of a null tool_choice (none given) must not hold
FORCED = {"type": "object", "properties": {"type": {"enum": ["any", "tool"]}}, "required": ["type"]}


def _refusals(schema: dict) -> None:
    """What the chat completion refuses, in the JSON schema: a forced call needs tools and takes
    no output format."""
    schema["allOf"] = [
        implies("tool_choice", FORCED, {"properties": {"tools": {"type": "array", "minItems": 1}},
                                        "required": ["tools"]}),
        implies("tool_choice", FORCED, {"properties": {"output_config": {"anyOf": [
            {"type": "null"}, {"properties": {"format": {"type": "null"}}}]}}})]


class MessagesRequest(Strict):
    """A message (Anthropic's Messages API: see the module's docstring). Across fields: a
    tool_choice of any or tool needs tools, tool a tool among them, and takes no output format."""
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_refusals)
    model: str | None = Field(None, description=MODEL_FIELD)
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: Int(ge=1) = Field(description="Output tokens at most.")
    system: Text | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    stop_sequences: Annotated[list[NonEmptyText], Field(max_length=MAX_STOPS)] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0, description=f"Default 1; 0 (or below "
                                      f"{GREEDY_BELOW_TEMPERATURE:g}) is greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int(ge=0, le=MAX_TOP_K) | None = Field(None, description="0: off.")
    stream: bool = Field(False, description="Server-sent events (message_start, content_block_*, message_delta, "
                         "message_stop).")
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    service_tier: Literal["auto", "standard_only"] | None = Field(None, description="Accepted; one tier here.")
    cache_control: dict[str, Any] | None = Field(None, description="Accepted; prompts share a prefix cache anyway.")
    speed: Literal["standard", "fast"] | None = Field(None, description=IGNORED)
    inference_geo: Text | None = Field(None, description=IGNORED)
    diagnostics: dict[str, Any] | None = Field(None, description=IGNORED)
    user_profile_id: Text | None = Field(None, description=IGNORED)
    workspace_id: Text | None = Field(None, description=IGNORED)

    def chat(self) -> ChatCompletionRequest:
        """The chat completion this message is (ValidationError where the two disagree, e.g. a
        tool_choice naming a tool not among the tools)."""
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), "max_tokens": self.max_tokens,
                                "stream": self.stream}
        if self.stream:       # message_start's input tokens come with the first chunk
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        for name, value in (("stop", self.stop_sequences), ("temperature", self.temperature),
                            ("top_p", self.top_p), ("top_k", self.top_k),
                            ("user", self.metadata and self.metadata.user_id)):
            if value is not None:
                body[name] = value
        if self.tools:
            body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                               **({"description": t.description}
                                                                  if t.description is not None else {})}}
                             for t in self.tools]
        choice = self.tool_choice
        if choice is not None and (self.tools or choice.type in ("any", "tool")):
            body["tool_choice"] = {"auto": "auto", "none": "none", "any": "required"}.get(
                choice.type, {"type": "function", "function": {"name": choice.name}})
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        if self.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
        config = self.output_config
        if config is not None and config.effort is not None:
            body["reasoning_effort"] = config.effort
        if config is not None and config.format is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                              "schema": config.format.schema_}}
        if self.messages[-1].role == "assistant":      # a prefill: continued, not answered
            body.update(continue_final_message=True, add_generation_prompt=False)
        return ChatCompletionRequest.model_validate(body)

    def _messages(self) -> list[dict]:
        out: list[dict] = []
        if self.system is not None:
            out.append({"role": "system", "content": self.system if isinstance(self.system, str)
                        else [{"type": "text", "text": b.text} for b in self.system]})
        for message in self.messages:
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
            elif message.role == "user":
                out += _user_turn(message.content)
            else:
                out.append(_assistant_turn(message.content))
        return out


def _user_turn(blocks: list) -> list[dict]:
    """A user turn's tool results (tool messages), then its text (one user message, if any)."""
    out = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
           for b in blocks if b.type == "tool_result"]
    texts = [{"type": "text", "text": b.text} for b in blocks if b.type == "text"]
    if texts or not out:
        out.append({"role": "user", "content": texts})
    return out


def _assistant_turn(blocks: list) -> dict:
    turn: dict[str, Any] = {"role": "assistant",
                            "content": [{"type": "text", "text": b.text} for b in blocks if b.type == "text"]}
    reasoning = "".join(b.thinking for b in blocks if b.type == "thinking")
    if reasoning:
        turn["reasoning"] = reasoning
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(
        b.input, ensure_ascii=False)}} for b in blocks if b.type == "tool_use"]
    if calls:
        turn["tool_calls"] = calls
        turn["content"] = turn["content"] or None
    return turn


class CountTokensRequest(MessagesRequest):
    """`/v1/messages/count_tokens`: a message's prompt, counted (max_tokens is not needed)."""
    max_tokens: Int(ge=1) | None = Field(None, description="Accepted; not needed to count.")
    stream: bool = Field(False, description="Accepted; ignored.")
