"""OpenAI's Responses API (`POST /v1/responses`): the request, and the chat completion it becomes.

A request carries its conversation as `input` (messages, earlier function calls and their outputs,
reasoning items), as a client does with `store: false`, or continues a stored response
(`previous_response_id`: router/response_store.py finds it; its context and output come first).
With `background` the response runs after the answer (router/responses_api.py: poll it, cancel
it, or with `stream` follow its events and come back to them), which needs it stored. The request
becomes a `ChatCompletionRequest` (`chat`) and runs the chat endpoint's whole path (template,
tools, reasoning, grammar, pools);
router/responses_output.py turns its answer into a Response object or the Responses stream's events.

Input items, in order, become chat messages:
  - a message (`type` "message" or none): its role and its text (string, or input_text /
    output_text parts joined); images, audio and files are refused (a text-only server)
  - a `reasoning` item: its text goes with the next assistant turn, as its `reasoning`
  - `function_call` items: the calls of one assistant turn (joined to the assistant message
    right before them, if any)
  - a `function_call_output`: a tool turn answering `call_id`
`instructions` come first, as a system message. Tools are function tools only; `text.format`
is `response_format`; `max_output_tokens` is `max_completion_tokens`. A stored response keeps its
input as items in OpenAI's output form (`stored`: each with an id, messages' text as parts).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, model_validator

from router.chat_protocol import FORCED_TOOL, ChatCompletionRequest
from router.openai_protocol import GREEDY_BELOW_TEMPERATURE
from router.protocol_types import (METADATA, MODEL_FIELD, REASONING_EFFORT, SERVICE_TIER, Int, Strict, StrictOpen, Text,
                                   TextPartType, implies)
from router.responses_output import new_id
from router.structured_protocol import JsonSchemaFormat
from router.tools import MAX_TOOLS, FunctionName

MAX_ITEMS = 1024


class TextPart(StrictOpen):
    """Text in a message: the client's (input_text) or an earlier answer's (output_text)."""
    type: TextPartType("input_text", "output_text")
    text: Text


class MessageItem(StrictOpen):
    type: Literal["message"] = "message"
    id: Text | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_ITEMS)]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def stored(self) -> dict:
        kind = "output_text" if self.role == "assistant" else "input_text"
        parts = ([{"type": kind, "text": self.content}] if isinstance(self.content, str)
                 else [p.model_dump() for p in self.content])
        return {"type": "message", "id": self.id or new_id("msg"), "role": self.role, "content": parts,
                "status": "completed"}


class ReasoningText(StrictOpen):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(StrictOpen):
    """An earlier answer's reasoning (its `content`, else its `summary`)."""
    type: Literal["reasoning"]
    id: Text | None = None
    content: list[ReasoningText] | None = None
    summary: list[ReasoningText] = Field(default_factory=list)

    def text(self) -> str:
        return "".join(p.text for p in (self.content if self.content else self.summary))

    def stored(self) -> dict:
        return {**self.model_dump(exclude_none=True), "id": self.id or new_id("rs")}


class FunctionCallItem(StrictOpen):
    type: Literal["function_call"]
    id: Text | None = None
    call_id: Text
    name: FunctionName
    arguments: Text

    def stored(self) -> dict:
        return {**self.model_dump(), "id": self.id or new_id("fc"), "status": "completed"}


class FunctionCallOutputItem(StrictOpen):
    type: Literal["function_call_output"]
    id: Text | None = None
    call_id: Text
    output: Text | list[TextPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)

    def stored(self) -> dict:
        return {**self.model_dump(), "id": self.id or new_id("fco"), "status": "completed"}


InputItem = MessageItem | ReasoningItem | FunctionCallItem | FunctionCallOutputItem
_HISTORY = TypeAdapter(list[InputItem])      # a stored conversation: no bound on its length


class FunctionTool(StrictOpen):
    type: Literal["function"]
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="Accepted; a forced call's arguments always follow the schema.")


class FunctionChoice(Strict):
    type: Literal["function"]
    name: FunctionName


class TextFormat(StrictOpen):
    """`text.format`: plain text, any JSON object, or a value of a JSON schema (named)."""
    model_config = ConfigDict(json_schema_extra=implies("type", {"const": "json_schema"}, {
        "properties": {"name": {"type": "string"}}, "required": ["name"]}))
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictOpen):
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))


class ReasoningConfig(StrictOpen):
    """`effort` is the chat's `reasoning_effort` (a variable for the chat template); the model
    reasons (or not) as its template has it."""
    effort: REASONING_EFFORT | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


def _refusals(schema: dict) -> None:
    """What the validators refuse, in the JSON schema: background without store; a forced call needs
    tools and takes no JSON text format."""
    schema["allOf"] = [
        implies("background", {"const": True}, {"properties": {"store": {"not": {"const": False}}}}),
        implies("tool_choice", FORCED_TOOL, {"properties": {"tools": {"type": "array", "minItems": 1}},
                                              "required": ["tools"]}),
        implies("tool_choice", FORCED_TOOL, {"properties": {"text": {"anyOf": [{"type": "null"}, {
            "properties": {"format": {"properties": {"type": {"const": "text"}}}}}]}}})]


class ResponsesRequest(Strict):
    """A response (OpenAI's Responses API: see the module's docstring). Across fields:
    a forced call (tool_choice "required" or a function) needs tools, a named one a function
    among them, and takes no JSON text format."""
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_refusals)
    model: str | None = Field(None, description=MODEL_FIELD)
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_ITEMS)] = Field(
        description="A user message, or the conversation's items.")
    instructions: Text | None = Field(None, description="A system message before the input.")
    max_output_tokens: Int(ge=1) | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0, description=f"Default 1; 0 (or below "
                                      f"{GREEDY_BELOW_TEMPERATURE:g}) is greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = Field(False, description="Server-sent events, one per Responses event.")
    store: bool | None = Field(None, description="Keep the response (default true) for GET /v1/responses/{id} "
                               "and `previous_response_id`, unless the server's responses.store is off (the "
                               "response says whether it was kept).")
    previous_response_id: Text | None = Field(None, description="A stored response this one continues: its "
                                              "input and output come before this input (its instructions and "
                                              "tools do not).")
    background: bool | None = Field(None, description="Answer at once with the response `queued` and run it after: "
                                    "GET /v1/responses/{id} shows it (in_progress, then completed, incomplete or "
                                    "failed), POST /v1/responses/{id}/cancel cancels it. With stream, the answer is "
                                    "its events as they come, and GET /v1/responses/{id}?stream=true&starting_after=N"
                                    " sends them again from the one after N (a client that lost its stream). Needs "
                                    "store (not false, and the server's responses.store on).")
    metadata: METADATA | None = None
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = Field(None, description="Accepted; prompts share a prefix cache anyway.")
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        None, description="Accepted; the prefix cache is in memory, its blocks reused until others need them.")
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled", "auto"] | None = Field(
        None, description="disabled (the default): a conversation beyond the context is a 400; auto: its "
                          "oldest items (after the instructions) are left out until it fits with "
                          "max_output_tokens (the stored conversation keeps them).")
    include: Annotated[list[Text], Field(max_length=16)] | None = Field(None, description="Accepted; ignored.")
    service_tier: SERVICE_TIER | None = Field(None, description="Accepted; one tier here.")
    stream_options: dict[str, Any] | None = Field(None, description="Accepted; ignored.")

    @model_validator(mode="after")
    def _supported(self):
        if self.background and self.store is False:
            raise ValueError("background: a background response is stored to be polled (not with store: false)")
        if self.text is not None and self.text.format.type == "json_schema" and self.text.format.name is None:
            raise ValueError("text.format: a json_schema format needs a name")
        return self

    def input_items(self) -> list[dict]:
        """The request's input as stored items (a string: one user message)."""
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        return [item.stored() for item in items]

    def item_count(self, history: list[dict] = ()) -> int:
        """The conversation's items: `history`'s and the input's."""
        return len(history) + (1 if isinstance(self.input, str) else len(self.input))

    def chat(self, history: list[dict] = (), skip: int = 0) -> ChatCompletionRequest:
        """The chat completion this response is, after `history` (a stored response's items:
        router/response_store.py) (ValidationError where the two disagree, e.g. a tool_choice
        without tools). `skip`: leave out the conversation's first `skip` items (truncation
        auto), and with them the outputs of the calls left out; the last item always stays."""
        items = _HISTORY.validate_python(list(history)) if history else []
        items += [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        if skip:
            items = items[min(skip, len(items) - 1):]
            calls = {item.call_id for item in items if isinstance(item, FunctionCallItem)}
            items = [item for item in items[:-1]
                     if not isinstance(item, FunctionCallOutputItem) or item.call_id in calls] + items[-1:]
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(items), "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}     # for response.completed's usage
        for name, value in (("max_completion_tokens", self.max_output_tokens), ("temperature", self.temperature),
                            ("top_p", self.top_p), ("parallel_tool_calls", self.parallel_tool_calls),
                            ("user", self.user), ("reasoning_effort", self.reasoning and self.reasoning.effort)):
            if value is not None:
                body[name] = value
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                             for t in self.tools]
        if self.tool_choice is not None and (self.tools or self.tool_choice not in ("auto", "none")):
            body["tool_choice"] = (self.tool_choice if isinstance(self.tool_choice, str) else
                                   {"type": "function", "function": {"name": self.tool_choice.name}})
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type != "text":
            body["response_format"] = {"type": fmt.type}
            if fmt.type == "json_schema":
                body["response_format"]["json_schema"] = JsonSchemaFormat.model_validate(
                    fmt.model_dump(by_alias=True, exclude_none=True, exclude={"type"})).model_dump(
                    by_alias=True, exclude_none=True)
        return ChatCompletionRequest.model_validate(body)

    def _messages(self, items: list[InputItem]) -> list[dict]:
        out: list[dict] = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        reasoning = None
        for item in items:
            if isinstance(item, ReasoningItem):
                reasoning = (reasoning or "") + item.text()
            elif isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
                if item.role == "assistant" and reasoning is not None:
                    out[-1]["reasoning"], reasoning = reasoning, None
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if not (out and out[-1]["role"] == "assistant"):
                    out.append({"role": "assistant", "content": None})
                    if reasoning is not None:
                        out[-1]["reasoning"], reasoning = reasoning, None
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return out
