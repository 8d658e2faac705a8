"""The Responses API's answer (router/responses_protocol.py has the request): a chat completion
turned into a Response object, and a chat completion's stream into the Responses stream's events.

A response's `output` is its items in order: a `reasoning` item (the text the chat message has
as `reasoning`), a `message` item (its content, one output_text part), then one `function_call`
item per tool call. `status` is "completed", or "incomplete" (reason max_output_tokens) where the
chat choice ended by length.

The stream (`ResponseEvents`, fed the chat stream's chunks as they come): response.created and
response.in_progress first; each item opens with response.output_item.added, its text arrives as
deltas (response.reasoning_text.delta in a reasoning_text part, response.output_text.delta in an
output_text part: each opened by response.content_part.added and closed by its .done events),
a function call's arguments as response.function_call_arguments.delta events (as the chat
stream's tool call deltas bring them), and the item closes with response.output_item.done before
the next opens; the stream ends with response.completed or response.incomplete, carrying the
whole response (usage included), or with response.failed where the request failed after it
started. Every event has a `sequence_number` from 0. The same builders make both, so the events
add up to the response. A background response's stream opens with response.created and
response.queued (status queued), then response.in_progress as its run starts.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse_event(kind: str, seq: int, **fields) -> str:
    """One event of the Responses stream as server-sent event text."""
    event = {"type": kind, "sequence_number": seq, **fields}
    return f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class ResponseShape:
    """What a response states besides its output: its id, and the request's settings echoed
    (`store`: whether the router will keep it)."""

    def __init__(self, request, rid: str, model: str, store: bool = False):
        self.rid, self.model, self.created = rid, model, int(time.time())
        self.echo = {
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {}, "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id, "store": store,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "text": {"format": (request.text.format.model_dump(by_alias=True, exclude_none=True)
                                if request.text else {"type": "text"})},
            "tool_choice": (request.tool_choice or "auto") if isinstance(request.tool_choice, str | None)
            else request.tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in request.tools or ()],
            "truncation": request.truncation or "disabled", "user": request.user,
            "background": bool(request.background),
            "reasoning": {"effort": None, "summary": None} if request.reasoning is None
            else request.reasoning.model_dump(),
        }

    def body(self, output: list[dict], status: str, usage: dict | None = None, finish: str | None = None,
             error: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
        return {"id": self.rid, "object": "response", "created_at": self.created, "model": self.model,
                "status": "incomplete" if incomplete and status == "completed" else status,
                "error": error, "incomplete_details": incomplete, "output": output, "usage": usage, **self.echo}


def response_usage(chat_usage: dict | None) -> dict | None:
    """A chat completion's usage as the Responses API counts it."""
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def _reasoning_item(text: str, status: str) -> dict:
    return {"type": "reasoning", "id": new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [], "status": status}


def _message_item(text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": new_id("msg"), "role": "assistant", "status": status, "content": content}


def _call_item(call: dict, status: str, arguments: str | None = None) -> dict:
    return {"type": "function_call", "id": new_id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if arguments is None else arguments, "status": status}


def response_from_chat(shape: ResponseShape, completion: dict) -> dict:
    """The Response of a (non-streamed) chat completion of one choice."""
    choice = completion["choices"][0]
    message, calls = choice["message"], choice["message"].get("tool_calls") or []
    texts = []
    if message.get("reasoning"):
        texts.append(_reasoning_item(message["reasoning"], "completed"))
    if message.get("content") or not (texts or calls):
        texts.append(_message_item(message.get("content") or "", "completed"))
    if choice["finish_reason"] == "length" and texts and not calls:   # the text the limit cut
        texts[-1]["status"] = "incomplete"
    output = texts + [_call_item(call, "completed") for call in calls]
    return shape.body(output, "completed", response_usage(completion.get("usage")), choice["finish_reason"])


class ResponseEvents:
    """One response's stream: `start`, then `chunk` per chat chunk (parsed), then `closing`, and
    `last` with the whole response (`result`, once its `store` is known); each returns server-sent
    events (text) to send."""

    def __init__(self, shape: ResponseShape):
        self.shape, self.output, self.seq = shape, [], 0
        self.open: str | None = None        # the kind of the item now open: "reasoning", "message" or "call"
        self.finish: str | None = None
        self.usage: dict | None = None
        self.failed: dict | None = None     # the response as response.failed carried it

    def _event(self, kind: str, **fields) -> str:
        self.seq += 1
        return sse_event(kind, self.seq - 1, **fields)

    def start(self) -> list[str]:
        """The stream's first events: response.created and response.in_progress."""
        return [self._event("response.created", response=self.shape.body([], "in_progress")), *self.running()]

    def queued(self) -> list[str]:
        """A background response's first events: response.created and response.queued."""
        return [self._event(kind, response=self.shape.body([], "queued"))
                for kind in ("response.created", "response.queued")]

    def running(self) -> list[str]:
        """response.in_progress: the run started."""
        return [self._event("response.in_progress", response=self.shape.body([], "in_progress"))]

    def chunk(self, chunk: dict) -> list[str]:
        if "error" in chunk:
            events = self._close()
            self.failed = self.shape.body(self.output, "failed", error={"code": chunk["error"].get("type"),
                                                                        "message": chunk["error"]["message"]})
            return events + [self._event("response.failed", response=self.failed)]
        if not chunk["choices"]:
            self.usage = response_usage(chunk.get("usage"))
            return []
        events = []
        for choice in chunk["choices"]:       # a response has one
            delta = choice["delta"]
            if delta.get("reasoning"):
                events += self._text("reasoning", delta["reasoning"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            self.finish = choice["finish_reason"] or self.finish
        return events

    def closing(self) -> list[str]:
        """After the chat stream's last chunk: every item closed."""
        events = self._close()
        if not self.output:           # nothing at all: an empty message, as the non-streamed response has
            events += self._text("message", "") + self._close()
        return events

    def result(self) -> dict:
        """The whole response, after `closing`."""
        return self.shape.body(self.output, "completed", self.usage, self.finish)

    def last(self, body: dict) -> str:
        """The stream's last event: response.completed or response.incomplete, carrying `body`."""
        return self._event(f"response.{body['status']}", response=body)

    # ---- items -----------------------------------------------------------------------------------
    def _text(self, kind: str, delta: str) -> list[str]:
        events = []
        if self.open != kind:
            events += self._close()
            item = _reasoning_item("", "in_progress") if kind == "reasoning" else _message_item(None, "in_progress")
            self.output.append(item)
            self.open = kind
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else {
                "type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += [self._event("response.output_item.added", output_index=len(self.output) - 1, item=item),
                       self._event("response.content_part.added", item_id=item["id"],
                                   output_index=len(self.output) - 1, content_index=0, part=part)]
            item["content"] = [dict(part)]
        item = self.output[-1]
        item["content"][0]["text"] += delta
        where = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
        if kind == "reasoning":
            return events + [self._event("response.reasoning_text.delta", **where, delta=delta)]
        return events + [self._event("response.output_text.delta", **where, delta=delta, logprobs=[])]

    def _call(self, delta: dict) -> list[str]:
        """A chat stream's tool call delta: the first of a call opens its item, and every one's
        arguments text goes out as a delta."""
        events = []
        if "id" in delta:
            events += self._close()
            item = _call_item(delta, "in_progress", arguments="")
            self.output.append(item)
            self.open = "call"
            events.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
        item, index, arguments = self.output[-1], len(self.output) - 1, delta["function"]["arguments"]
        if arguments:
            item["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                      delta=arguments))
        return events

    def _close(self) -> list[str]:
        """Close the open item (its text or arguments complete)."""
        if self.open is None:
            return []
        item, index, self.open = self.output[-1], len(self.output) - 1, None
        if item["type"] == "function_call":      # completed, as response_from_chat has it
            item["status"] = "completed"
            return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                name=item["name"], arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=index, item=item)]
        status = "incomplete" if self.finish == "length" else "completed"
        part, where = item["content"][0], {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            events = [self._event("response.reasoning_text.done", **where, text=part["text"])]
        else:
            events = [self._event("response.output_text.done", **where, text=part["text"], logprobs=[])]
        item["status"] = status
        return events + [self._event("response.content_part.done", **where, part=part),
                         self._event("response.output_item.done", output_index=index, item=item)]


# ---- models (documentation: router/contract.py) -------------------------------------------------
class OutputItem(BaseModel):
    """A reasoning, message or function_call item (see the module's docstring)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning", "message", "function_call"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseUsage(BaseModel):
    model_config = ConfigDict(extra="allow")
    input_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


class ResponseObject(BaseModel):
    """A response (OpenAI's Responses API); the request's settings are echoed beside the output."""
    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    output: list[OutputItem]
    usage: ResponseUsage | None


class ResponseDeleted(BaseModel):
    """DELETE /v1/responses/{id}'s answer."""
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class ResponseItemList(BaseModel):
    """GET /v1/responses/{id}/input_items: a page of the items the model saw before the
    response's output (router/response_store.py `page`)."""
    object: Literal["list"]
    data: list[dict[str, Any]] = Field(description="Items in OpenAI's form (message, reasoning, function_call, "
                                       "function_call_output), each with an `id`.")
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseEvent(BaseModel):
    """One event of a streamed response: `type` names it (response.created, ...), the rest is its
    own (see the module's docstring)."""
    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int = Field(ge=0)
