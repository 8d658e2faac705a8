"""Anthropic's Messages API's answer (router/messages_protocol.py has the request): a chat
completion turned into a Message, a chat completion's stream into the Messages stream's events,
and errors in Anthropic's format.

A message's `content` is its blocks in order: a `thinking` block (the chat message's `reasoning`),
a `text` block (its content; an empty one where there is nothing else), then one `tool_use` block
per tool call (`input`: the arguments' JSON object). `stop_reason`: max_tokens (the limit),
tool_use (calls), stop_sequence (one of the request's `stop_sequences`, in `stop_sequence`), else
end_turn. `usage` counts the prompt tokens the prefix cache held as `cache_read_input_tokens`,
the rest as `input_tokens` (Anthropic's reading: their sum is the prompt).

The stream (`MessageEvents`, fed the chat stream's chunks as they come): message_start (the
message with no content, its usage so far) at the first chunk; each block opens with
content_block_start, its text comes as content_block_delta events (text_delta, thinking_delta, a
tool call's arguments as input_json_delta), and it closes with content_block_stop before the next
opens; then message_delta (stop_reason, stop_sequence, the usage) and message_stop. A request that
fails after its first event ends with an `error` event. The same builders make both, so the events
add up to the message.
"""

from __future__ import annotations

import json
import uuid
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 504: "timeout_error"}


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def anthropic_path(path: str) -> bool:
    """Whether `path` (with or without the app's route prefix) is the Messages API's: its errors
    are Anthropic's."""
    return path.rstrip("/").endswith(MESSAGES_PATHS)


def error_object(status: int, message: str) -> dict:
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error" if status >= 500
                                                                else "invalid_request_error"), "message": message}}


def anthropic_error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers, content=error_object(status, message))


def from_openai_error(response: JSONResponse) -> JSONResponse:
    """The chat path's refusal (an OpenAI error object) in Anthropic's format, its status and
    headers (Retry-After) kept."""
    message = json.loads(response.body)["error"]["message"]
    headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
    return anthropic_error(response.status_code, message, headers or None)


def message_usage(chat_usage: dict | None) -> dict:
    """A chat completion's usage as the Messages API counts it."""
    chat_usage = chat_usage or {"prompt_tokens": 0, "completion_tokens": 0}
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"] - cached, "output_tokens": chat_usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def stop_of(finish: str | None, stop_reason, stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice that ended with `finish` and vLLM's
    `stop_reason` (the stop string or token that ended it)."""
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    if isinstance(stop_reason, str) and stop_reason in (stop_sequences or ()):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _input(arguments: str) -> dict:
    """A call's arguments as tool_use's `input` (an object; another JSON value goes under "value")."""
    value = json.loads(arguments) if arguments else {}
    return value if isinstance(value, dict) else {"value": value}


class MessageShape:
    """What a message states besides its content: its id and model, the request's stop sequences."""

    def __init__(self, model: str, stop_sequences: list[str] | None):
        self.mid, self.model, self.stop_sequences = new_id(), model, stop_sequences

    def body(self, content: list[dict], stop: tuple[str | None, str | None], usage: dict) -> dict:
        return {"id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


def message_from_chat(shape: MessageShape, completion: dict) -> dict:
    """The Message of a (non-streamed) chat completion of one choice."""
    choice = completion["choices"][0]
    message, calls = choice["message"], choice["message"].get("tool_calls") or []
    content = []
    if message.get("reasoning"):
        content.append({"type": "thinking", "thinking": message["reasoning"], "signature": ""})
    if message.get("content") or not (content or calls):
        content.append({"type": "text", "text": message.get("content") or ""})
    content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": _input(c["function"]["arguments"])} for c in calls]
    stop = stop_of(choice["finish_reason"], choice.get("stop_reason"), shape.stop_sequences)
    return shape.body(content, stop, message_usage(completion.get("usage")))


def sse(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


class MessageEvents:
    """One message's stream: `chunk` per chat chunk (parsed), then `closing`; each returns
    server-sent events (text) to send. `failed`: the stream ended with an error event."""

    def __init__(self, shape: MessageShape):
        self.shape, self.blocks = shape, 0
        self.open: str | None = None       # the kind of the block now open: "thinking", "text" or "tool_use"
        self.started, self.failed = False, False
        self.finish = self.stop_reason = None
        self.usage: dict | None = None

    def chunk(self, chunk: dict) -> list[str]:
        if "error" in chunk:
            self.failed = True
            return [sse("error", error=error_object(_status(chunk["error"]), chunk["error"]["message"])["error"])]
        if chunk.get("usage"):
            self.usage = message_usage(chunk["usage"])
        events = [] if self.started else self._start()
        for choice in chunk["choices"]:       # a message has one
            delta = choice["delta"]
            if delta.get("reasoning"):
                events += self._text("thinking", delta["reasoning"])
            if delta.get("content"):
                events += self._text("text", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            if choice["finish_reason"] is not None:
                self.finish, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")
        return events

    def closing(self) -> list[str]:
        """After the chat stream's last chunk: the open block closed, message_delta, message_stop."""
        events = ([] if self.started else self._start()) + self._close()
        if not self.blocks:        # nothing at all: an empty text block, as the non-streamed message has
            events += self._text("text", "") + self._close()
        stop_reason, stop_sequence = stop_of(self.finish, self.stop_reason, self.shape.stop_sequences)
        usage = self.usage or message_usage(None)
        return events + [sse("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                             usage=usage), sse("message_stop")]

    def _start(self) -> list[str]:
        self.started = True
        return [sse("message_start", message=self.shape.body([], (None, None), self.usage or message_usage(None)))]

    def _open(self, block: dict) -> str:
        self.open, self.blocks = block["type"], self.blocks + 1
        return sse("content_block_start", index=self.blocks - 1, content_block=block)

    def _text(self, kind: str, text: str) -> list[str]:
        events = []
        if self.open != kind:
            events += self._close()
            events.append(self._open({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                     else {"type": "text", "text": ""}))
        if text:
            delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                             "text": text}
            events.append(sse("content_block_delta", index=self.blocks - 1, delta=delta))
        return events

    def _call(self, delta: dict) -> list[str]:
        """A chat stream's tool call delta: the first of a call opens its block, and every one's
        arguments text goes out as an input_json_delta."""
        events = []
        if "id" in delta:
            events += self._close()
            events.append(self._open({"type": "tool_use", "id": delta["id"], "name": delta["function"]["name"],
                                      "input": {}}))
        if arguments := delta["function"].get("arguments"):
            events.append(sse("content_block_delta", index=self.blocks - 1,
                              delta={"type": "input_json_delta", "partial_json": arguments}))
        return events

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", index=self.blocks - 1)]


def _status(error: dict) -> int:
    """The HTTP status an OpenAI error object of a stream stands for (its `code` where numeric)."""
    code = error.get("code")
    return code if isinstance(code, int) else 500 if error.get("type") == "server_error" else 400


# ---- models (documentation: router/contract.py) -------------------------------------------------
class ContentBlock(BaseModel):
    """A text, thinking or tool_use block (see the module's docstring)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "thinking", "tool_use"]


class MessageUsage(BaseModel):
    model_config = ConfigDict(extra="allow")
    input_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)
    cache_read_input_tokens: int = Field(ge=0)


class MessageObject(BaseModel):
    """A message (Anthropic's Messages API)."""
    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessageUsage


class MessageEvent(BaseModel):
    """One event of a streamed message: `type` names it (message_start, content_block_start, ...,
    error), the rest is its own (see the module's docstring)."""
    model_config = ConfigDict(extra="allow")
    type: str


class TokenCount(BaseModel):
    """`/v1/messages/count_tokens`' answer: the prompt's tokens."""
    input_tokens: int = Field(ge=0)


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error object (the Messages API's routes answer their errors in it)."""
    type: Literal["error"]
    error: AnthropicErrorDetail
