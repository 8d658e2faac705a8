"""The Responses API's endpoints behind the router's routes (router/app.py): create, retrieve (or
stream again), list input items, delete, cancel.

A response's life cycle here:
  1. chain    with `previous_response_id`, the stored response (router/response_store.py) gives
              the conversation so far (404 where it is not kept)
  2. run      the request becomes a chat completion (router/responses_protocol.py) and runs the
              chat endpoint's whole path; a refusal there is this request's answer. With
              `truncation: auto` the conversation's oldest items are left out first, as few as
              let it fit the context with max_output_tokens (`_fitting`, off the event loop)
  3. answer   the chat answer as a Response, or the chat stream as the Responses stream
              (router/responses_output.py)
  4. keep     a response that completed, its request not saying `store: false`, is stored before
              the Response (or the stream's last event) goes out; where the store does not take
              it, the answer says `store: false`
With `background` the request is first checked as the chat endpoint would check it (a prompt
beyond the context, an unknown model: that refusal is the answer, nothing is stored); then the
answer comes first: the response is stored `queued` and answered, and a task of this router runs
steps 2-4 (stored `in_progress`, then as it ended: completed, incomplete, or failed with the
error the chat path answered, e.g. a replica out of KV blocks). With `stream` too, the task turns
the chat stream into the Responses events, kept in this router and sent on to the store
(router/background_stream.py: response.created and response.queued before the answer; the last
events in the same call as the response as it ended), and the answer is those events as they come (`_tail`); a
client that leaves stops reading, not the response, and GET
/v1/responses/{id}?stream=true&starting_after=N reads them again, from sequence number N + 1, live
to the end: from the writer in this router, from the store in any other.
`cancel` cancels the task (its requests are aborted in the pools, as a client that leaves, which
frees their blocks) and stores the response `cancelled`; `delete` cancels it too. The tasks live
in this router, which renews its lease in the store while it runs any: after one that failed or was
replaced, its background responses read as `failed` once the lease runs out
(`responses.background_lease_s`; router/response_store.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import ValidationError

from router.background_stream import EventWriter
from router.chat_protocol import ChatCompletionRequest
from router.openai_responses import above_limit, error_response, refused
from router.reply import chunks
from router.response_store import Found, StoredResponses, StoreUnavailable, page, unique_ids
from router.responses_output import ResponseEvents, ResponseShape, new_id, response_from_chat, sse_event
from router.responses_protocol import ResponsesRequest

log = logging.getLogger("pdserve.router")
TAIL_WAIT_S = 2.0         # a stream's reader waits this long in the store for the next event, per call


class ResponsesApi:
    """`store`: the ResponseStore deployment's handle (None: responses.store is off); `chat`: the
    router's chat endpoint (a chat completion, its stream, or an error response); `saved(kept)`
    is told of every save (router/metrics.py); `prompt_tokens(chat)`: the tokens of a chat
    completion's prompt (its template's errors raised), for `truncation: auto` within
    `max_model_len`; `lease_s`: the store's lease on this router's background responses;
    `refusal(chat)`: what the chat endpoint would refuse a chat completion with before running it
    (None: nothing), checked before a background response is answered."""

    def __init__(self, store, max_tokens_limit: int, model_name: str,
                 chat: Callable[[ChatCompletionRequest], Awaitable], saved: Callable[[bool], None],
                 prompt_tokens: Callable[[ChatCompletionRequest], int], max_model_len: int,
                 lease_s: float = 30.0, refusal: Callable[[ChatCompletionRequest], Awaitable] | None = None):
        self.stored = None if store is None else StoredResponses(store)
        self.max_tokens_limit, self.model_name, self.chat, self.saved = max_tokens_limit, model_name, chat, saved
        self.prompt_tokens, self.max_model_len, self.refusal = prompt_tokens, max_model_len, refusal
        self.background: dict[str, Background] = {}       # running background responses, by id
        self.owner, self.lease_s = uuid.uuid4().hex, lease_s  # this router instance, in the store's leases
        self._renewing: asyncio.Task | None = None

    async def create(self, body: ResponsesRequest):
        if (body.max_output_tokens or 0) > self.max_tokens_limit:
            return above_limit("max_output_tokens", body.max_output_tokens, self.max_tokens_limit)
        history = []
        if body.previous_response_id is not None:                 # 1. chain
            found = await self._find(body.previous_response_id, previous=True)
            if isinstance(found, JSONResponse):
                return found
            history = found.history()
        try:                                                       # 2. run
            chat = body.chat(history)
        except ValidationError as exc:
            return refused(exc)
        if body.background:
            return await self._start(body, history, chat)
        if body.truncation == "auto":
            chat = await asyncio.to_thread(self._fitting, body, history, chat)
        result = await self.chat(chat)
        if isinstance(result, JSONResponse):
            return result
        keep = self.stored is not None and body.store is not False
        shape = ResponseShape(body, new_id("resp"), body.model or self.model_name, store=keep)
        context = unique_ids(history + body.input_items()) if keep else None
        if body.stream:                                            # 3. answer (4. in the stream)
            return StreamingResponse(self._events(shape, result.body_iterator, context),
                                     media_type="text/event-stream")
        response = response_from_chat(shape, result)
        if keep:                                                   # 4. keep
            await self._save(response, context)
        return response

    def _fitting(self, body: ResponsesRequest, history: list[dict], whole: ChatCompletionRequest):
        """`whole` if its prompt and max_output_tokens fit the context, else the chat completion
        without the fewest of the conversation's first items that fits (a binary search: the
        prompt shrinks as more are left out), or without all but the last one (the chat endpoint
        then says what does not fit). A template that refuses a shortened conversation counts as
        not fitting; one that refuses the whole one is the chat endpoint's to report."""
        room = self.max_model_len - (body.max_output_tokens or 1)

        def fits(chat: ChatCompletionRequest) -> bool:
            try:
                return self.prompt_tokens(chat) <= room
            except (ValueError, TemplateError):
                return chat is whole
        if fits(whole):
            return whole
        lo, hi = 1, body.item_count(history) - 1        # the least `skip` that fits lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(body.chat(history, skip=mid)):
                hi = mid
            else:
                lo = mid + 1
        return body.chat(history, skip=lo)

    async def _save(self, response: dict, context: list[dict], final: bool = True) -> None:
        """Store `response`; `final`: its last save, counted (a background response is saved as
        it starts too, owned by this router)."""
        kept = await self.stored.save(response, context, owner="" if final else self.owner)
        response["store"] = kept
        if final:
            self.saved(kept)

    # ---- background responses ---------------------------------------------------------------
    async def _start(self, body: ResponsesRequest, history: list[dict], chat: ChatCompletionRequest):
        """Check the request, store the response `queued`, start its task, answer it."""
        if self.stored is None:
            return error_response(400, "background: this server keeps no responses (its responses.store is off), "
                                  "and a background response is polled from the store", param="background")
        if body.truncation == "auto":
            chat = await asyncio.to_thread(self._fitting, body, history, chat)
        if self.refusal is not None and (refused := await self.refusal(chat)) is not None:
            return refused
        shape = ResponseShape(body, new_id("resp"), body.model or self.model_name, store=True)
        context = unique_ids(history + body.input_items())
        queued = shape.body([], "queued")
        await self._save(queued, context, final=False)
        if not queued["store"]:              # nowhere to poll it from
            return _unavailable(RuntimeError("it did not keep the background response"))
        events = writer = None
        if body.stream:
            events, writer = ResponseEvents(shape), EventWriter(self.stored, shape.rid)
            writer.add(events.queued())
            if not await writer.sent_all():          # nowhere to read it again from
                return _unavailable(RuntimeError("it did not keep the background response's events"))
            task = _detached(self._run_streamed(chat, shape, context, events, writer))
        else:
            task = _detached(self._run(chat, shape, context))
        self.background[shape.rid] = Background(task, shape, context, writer)
        task.add_done_callback(lambda _: self.background.pop(shape.rid, None))
        if self._renewing is None or self._renewing.done():
            self._renewing = _detached(self._renew())
        if writer is not None:
            return StreamingResponse(self._tail(shape.rid, -1), media_type="text/event-stream")
        return queued

    async def _renew(self) -> None:
        """While this router runs background responses, renew its lease every third of it (a
        store that does not answer is tried again at the next)."""
        while self.background:
            await asyncio.sleep(self.lease_s / 3)
            with contextlib.suppress(StoreUnavailable):
                await self.stored.renew(self.owner)

    async def _run(self, chat: ChatCompletionRequest, shape: ResponseShape, context: list[dict]) -> dict:
        """A background response's steps 2-4 (`chat`: its chat completion, checked); the response as
        stored last."""
        try:
            await self._save(shape.body([], "in_progress"), context, final=False)
            result = await self.chat(chat)
            if isinstance(result, JSONResponse):          # refused: the error the answer would have been
                error = json.loads(result.body)["error"]
                response = shape.body([], "failed", error={"code": error.get("code") or error["type"],
                                                           "message": error["message"]})
            else:
                response = response_from_chat(shape, result)
            await self._save(response, context)
            return response
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the store gone, or a bug: logged, stored failed where it can be
            return await self._failed(shape, context, exc)

    async def _run_streamed(self, chat: ChatCompletionRequest, shape: ResponseShape, context: list[dict],
                            events: ResponseEvents, writer: EventWriter) -> dict:
        """`_run` with the Responses events of its chat stream written as they come (`events`: its
        stream so far, response.created and response.queued written); the last ones go to the
        store in the same call as the response as it ended, so no reader has the one without the
        other (here or on another router)."""
        try:
            await self._save(shape.body([], "in_progress"), context, final=False)
            writer.add(events.running())
            result = await self.chat(chat)
            if isinstance(result, JSONResponse):          # refused: the error the answer would have been
                writer.add(events.chunk({"error": json.loads(result.body)["error"]}))
            else:
                async for batch in self._converted(events, result.body_iterator):
                    writer.add(batch)
            if events.failed is None:
                closing = events.closing()
                response = events.result()
                last = [*closing, events.last(response)]
            else:
                response, last = events.failed, []
            if await writer.end(last, response, context):     # kept with its last event
                self.saved(True)
            else:                                             # the response alone, where it can be
                await self._save(response, context)
            return response
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - as in _run, its stream ended with response.failed
            if not writer.ended:
                error = {"type": "server_error", "message": f"internal error: {type(exc).__name__}"}
                with contextlib.suppress(Exception):
                    await writer.end(events.chunk({"error": error}))
            return await self._failed(shape, context, exc)

    async def _failed(self, shape: ResponseShape, context: list[dict], exc: Exception) -> dict:
        """A background response's task failed (the store gone, or a bug): logged, stored failed
        where it can be."""
        log.error("background response %s failed", shape.rid, exc_info=exc)
        response = shape.body([], "failed", error={"code": "server_error",
                                                   "message": f"internal error: {type(exc).__name__}"})
        with contextlib.suppress(Exception):
            await self._save(response, context)
        return response

    async def cancel(self, response_id: str):
        """Cancel a background response: the response `cancelled` (as stored), or as it ended
        where it ended before; a 400 for a response that did not run in the background."""
        running = self.background.get(response_id)
        if running is None:
            found = await self._find(response_id)
            if isinstance(found, JSONResponse):
                return found
            if not json.loads(found.response).get("background"):
                return error_response(400, f"Response {response_id!r} did not run in the background: only a "
                                      "background response can be cancelled.")
            return Response(found.response, media_type="application/json")
        running.task.cancel()
        try:
            return await running.task          # it ended before the cancel reached it
        except asyncio.CancelledError:
            pass
        response = running.shape.body([], "cancelled")
        await self._save(response, running.context)
        if running.writer is not None:              # its readers end (with no event: none is cancelled)
            await running.writer.end([])
        return response

    async def _events(self, shape: ResponseShape, chat_events, context: list[dict] | None):
        """The chat stream's chunks (text/event-stream lines) as the Responses stream's events; a
        response that completes is stored (with `context`, unless None) before its last event."""
        events = ResponseEvents(shape)
        for event in events.start():
            yield event
        async for batch in self._converted(events, chat_events):
            for event in batch:
                yield event
        if events.failed is not None:          # response.failed went out: nothing to keep
            return
        for event in events.closing():
            yield event
        response = events.result()
        if context is not None:
            await self._save(response, context)
        yield events.last(response)

    @staticmethod
    async def _converted(events: ResponseEvents, chat_events):
        """The Responses events of each of the chat stream's chunks (text/event-stream lines), a
        list per chunk, to the stream's end or its error (response.failed, `events.failed` set)."""
        async with contextlib.aclosing(chunks(chat_events)) as parsed:
            async for chunk in parsed:
                yield events.chunk(chunk)
                if "error" in chunk:
                    return

    async def stream_again(self, response_id: str, starting_after: int | None):
        """GET /v1/responses/{id}?stream=true: a background stream's events after sequence number
        `starting_after` (all where None), those to come as they come."""
        after, running = -1 if starting_after is None else starting_after, self.background.get(response_id)
        if running is not None and running.writer is not None:          # running here: read here
            return StreamingResponse(self._tail(response_id, after), media_type="text/event-stream")
        found = await self._find(response_id)
        if isinstance(found, JSONResponse):
            return found
        try:
            first = await self.stored.events(response_id, after)
        except StoreUnavailable as exc:
            return _unavailable(exc)
        if first is None:
            return error_response(400, f"Response {response_id!r} was not created with background and stream: only "
                                  "such a response's events can be streamed again; GET it without stream.",
                                  param="stream")
        return StreamingResponse(self._tail(response_id, after, first), media_type="text/event-stream")

    async def _tail(self, response_id: str, after: int, page=None):
        """The stream's events after sequence number `after` as they come, to its end: from its
        writer where it runs in this router, else from the store (`page`: the first, read already).
        One that ended without its last event ends with response.failed where it failed (its router
        stopped), or just ends (cancelled); where the store stops answering, or drops the response,
        the stream ends (an `error` event first for the former)."""
        running = self.background.get(response_id)
        if running is not None and running.writer is not None:
            async for batch in running.writer.read(after):
                for event in batch:
                    yield event
            return
        while True:
            if page is None:
                try:
                    page = await self.stored.events(response_id, after, TAIL_WAIT_S)
                except StoreUnavailable as exc:
                    yield sse_event("error", after + 1, code="unavailable", param=None,
                                    message=f"the response store is unavailable: {exc}")
                    return
                if page is None:                        # deleted, or dropped past the store's bounds
                    return
            for event in page.events:
                yield event
            after += len(page.events)
            if page.ended:
                if page.response and (response := json.loads(page.response))["status"] == "failed":
                    yield sse_event("response.failed", after + 1, response=response)
                return
            page = None

    async def retrieve(self, response_id: str):
        found = await self._find(response_id)
        return found if isinstance(found, JSONResponse) else Response(found.response, media_type="application/json")

    async def input_items(self, response_id: str, limit: int, order: str, after: str | None):
        found = await self._find(response_id)
        return found if isinstance(found, JSONResponse) else page(found.context(), limit, order, after)

    async def delete(self, response_id: str):
        if (running := self.background.get(response_id)) is not None:
            running.task.cancel()       # its requests leave the pools; nothing is stored after
            await asyncio.gather(running.task, return_exceptions=True)
            if running.writer is not None:          # its readers end
                await running.writer.end([])
        try:
            deleted = self.stored is not None and await self.stored.delete(response_id)
        except StoreUnavailable as exc:
            return _unavailable(exc)
        if not deleted:
            return self._not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def _find(self, response_id: str, previous: bool = False) -> Found | JSONResponse:
        """The stored response `response_id`, or the error to answer (`previous`: the request's
        previous_response_id names it)."""
        if self.stored is None and previous:
            return error_response(400, "previous_response_id: this server keeps no responses (its "
                                  "responses.store is off); send the whole conversation as input",
                                  param="previous_response_id")
        try:
            found = None if self.stored is None else await self.stored.find(response_id)
        except StoreUnavailable as exc:
            return _unavailable(exc)
        return self._not_found(response_id, previous) if found is None else found

    def _not_found(self, response_id: str, previous: bool = False) -> JSONResponse:
        if previous:
            return error_response(404, f"Previous response with id {response_id!r} not found.",
                                  param="previous_response_id", code="previous_response_not_found")
        why = "" if self.stored is not None else " (this server keeps no responses: its responses.store is off)"
        return error_response(404, f"Response with id {response_id!r} not found.{why}")


@dataclass
class Background:
    """A background response running: its task, what its cancelled body is built from, and its
    stream's writer (with `stream`)."""
    task: asyncio.Future
    shape: ResponseShape
    context: list[dict]
    writer: EventWriter | None = None


def _detached(coro) -> asyncio.Task:
    """A task outside the calling request's context: Serve cancels the calls a request made to
    other deployments when that request is cancelled (its client left), and a background response,
    or the lease renewal, must outlive the request that started it."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())


def _unavailable(exc: Exception) -> JSONResponse:
    return error_response(503, f"the response store is unavailable: {exc}", "unavailable", headers={"Retry-After": "1"})
