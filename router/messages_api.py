"""Anthropic's Messages API behind the router's routes (router/app.py): create a message, count
a message's tokens.

A message's life cycle here:
  1. check   the request becomes a chat completion (router/messages_protocol.py), which may
             refuse it (a tool_choice naming no tool, ...)
  2. run     the chat endpoint's whole path (template, tools, reasoning, grammar, the checks of
             every request, pools); its refusal (max_tokens above the server's
             `max_tokens_limit`, an unknown model, ...) is this request's answer, in Anthropic's
             error format
  3. answer  the chat answer as a Message, or the chat stream as the Messages stream
             (router/messages_output.py); a client that leaves closes the chat stream, which
             aborts the request in the pools
count_tokens renders the same prompt (off the event loop) and counts it; nothing runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from pydantic import ValidationError

from router.chat_protocol import ChatCompletionRequest
from router.messages_output import MessageEvents, MessageShape, anthropic_error, from_openai_error, message_from_chat
from router.messages_protocol import CountTokensRequest, MessagesRequest
from router.reply import chunks


class MessagesApi:
    """`chat`: the router's chat endpoint (a chat completion, its stream, or an error response);
    `prompt_tokens(chat)`: the tokens of a chat completion's prompt (its template's errors raised);
    `model_problem(model)`: the 404 (OpenAI's error) for a `model` this server does not serve, or None."""

    def __init__(self, chat: Callable[[ChatCompletionRequest], Awaitable],
                 prompt_tokens: Callable[[ChatCompletionRequest], int],
                 model_problem: Callable[[str | None], JSONResponse | None], model_name: str):
        self.chat, self.prompt_tokens, self.model_problem = chat, prompt_tokens, model_problem
        self.model_name = model_name

    async def create(self, body: MessagesRequest):
        chat = _chat(body)                                           # 1. check
        if isinstance(chat, JSONResponse):
            return chat
        result = await self.chat(chat)                               # 2. run
        if isinstance(result, JSONResponse):
            return from_openai_error(result)
        shape = MessageShape(body.model or self.model_name, body.stop_sequences)
        if body.stream:                                              # 3. answer
            return StreamingResponse(_events(shape, result.body_iterator), media_type="text/event-stream")
        return message_from_chat(shape, result)

    async def count_tokens(self, body: CountTokensRequest):
        chat = _chat(body)
        if isinstance(chat, JSONResponse):
            return chat
        if (problem := self.model_problem(body.model)) is not None:
            return from_openai_error(problem)
        try:
            return {"input_tokens": await asyncio.to_thread(self.prompt_tokens, chat)}
        except (ValueError, TemplateError) as exc:
            return anthropic_error(400, str(exc))


def _chat(body: MessagesRequest) -> ChatCompletionRequest | JSONResponse:
    try:
        return body.chat()
    except ValidationError as exc:
        return anthropic_error(400, "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors()[:5]))


async def _events(shape: MessageShape, chat_events):
    """The chat stream's chunks (text/event-stream lines) as the Messages stream's events."""
    events = MessageEvents(shape)
    async with contextlib.aclosing(chunks(chat_events)) as parsed:
        async for chunk in parsed:
            for event in events.chunk(chunk):
                yield event
            if events.failed:
                return
    for event in events.closing():
        yield event
