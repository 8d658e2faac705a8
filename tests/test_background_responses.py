"""Background responses (router/responses_api.py) without Ray: a request the chat endpoint would
refuse is refused at once (nothing stored); else the answer is the response `queued`,
the store shows it `in_progress` while its chat completion runs and then as it ended (completed,
or failed with the error the chat path answered); a cancel cancels the running chat (the pools'
requests are aborted through that cancellation) and stores `cancelled`; a delete cancels too; a
response that ended keeps its end; one that did not run in the background cannot be cancelled;
without a store it is a 400. With `stream` too, the answer is the response's events read back from the
store: a client that stops reading does not stop it, and the events are read again from any
sequence number, live to the end (a cancel ends them; a router that stopped, with response.failed).
Over HTTP, with the pools, in tests/test_responses_service.py."""

import asyncio
import contextvars
import json
from types import SimpleNamespace

from fake_store import log_handle
from router.openai_responses import error_response
from router.response_store import ResponseLog
from router.responses_api import ResponsesApi
from router.responses_protocol import ResponsesRequest

USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
# stands for Serve's request context: the calls a request makes are cancelled with it
REQUEST = contextvars.ContextVar("request", default=None)


class Chat:
    """The router's chat endpoint, held at `gate`: answers "Paris." (or a 400 for a prompt that
    says "too long"), and records whether it was cancelled."""

    def __init__(self):
        self.gate, self.more, self.cancelled = asyncio.Event(), asyncio.Event(), 0
        self.requests = []          # the request context each chat ran in

    async def __call__(self, request):
        self.requests.append(REQUEST.get())
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if "too long" in request.messages[-1].content:
            return error_response(400, "this model's maximum context length is 8 tokens", param="messages")
        if request.stream:
            return SimpleNamespace(body_iterator=self._stream("fail" in request.messages[-1].content))
        return {"choices": [{"message": {"role": "assistant", "content": "Paris."}, "finish_reason": "stop"}],
                "usage": USAGE}

    async def _stream(self, fail: bool):
        """The chat stream of "Paris." in two pieces, the second once `more` is set (or, `fail`, an
        error event instead of the second)."""
        def line(chunk):
            return f"data: {json.dumps(chunk)}\n\n"
        yield line({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Par"}, "finish_reason": None}]})
        await self.more.wait()
        if fail:
            yield line({"error": {"message": "the decode replica failed", "type": "server_error"}})
            return
        yield line({"choices": [{"index": 0, "delta": {"content": "is."}, "finish_reason": "stop"}]})
        yield line({"choices": [], "usage": USAGE})
        yield "data: [DONE]\n\n"


def _api(chat, store=True, log=None, lease_s=30.0, refusal=None):
    log = log or ResponseLog(100, 10**6, lease_s=lease_s)
    saves = []
    api = ResponsesApi(log_handle(log) if store else None, 100, "m", chat, saves.append,
                       prompt_tokens=lambda _: 1, max_model_len=100, lease_s=lease_s, refusal=refusal)
    return api, log, saves


def _status(log: ResponseLog, rid: str) -> str:
    return json.loads(log.get(rid).response)["status"]


def _body(response) -> dict:
    return response if isinstance(response, dict) else json.loads(response.body)


def test_a_background_response_is_answered_queued_and_stored_as_it_ends():
    async def run():
        chat = Chat()
        api, log, saves = _api(chat)
        queued = await api.create(ResponsesRequest(input="The capital of France?", background=True))
        assert queued["status"] == "queued" and queued["background"] and queued["output"] == [] and queued["store"]
        await asyncio.sleep(0.01)
        assert _status(log, queued["id"]) == "in_progress" and saves == []    # not counted until its end
        refused = await api.create(ResponsesRequest(input="too long", background=True))
        chat.gate.set()
        await asyncio.sleep(0.01)
        done = json.loads(log.get(queued["id"]).response)
        assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "Paris."
        assert done["usage"]["output_tokens"] == 2 and saves == [True, True] and not api.background
        failed = json.loads(log.get(refused["id"]).response)
        assert failed["status"] == "failed" and "maximum context length" in failed["error"]["message"]
        assert _body(await api.cancel(queued["id"]))["status"] == "completed"      # it ended: as it ended
        plain = await api.create(ResponsesRequest(input="The capital of France?"))
        cancel = await api.cancel(plain["id"])
        assert cancel.status_code == 400 and "background" in _body(cancel)["error"]["message"]
        assert (await api.cancel("resp_nope")).status_code == 404
    asyncio.run(run())


def test_cancel_and_delete_cancel_the_running_chat():
    async def run():
        chat = Chat()
        api, log, saves = _api(chat)
        first = await api.create(ResponsesRequest(input="Hi", background=True))
        second = await api.create(ResponsesRequest(input="Hi", background=True))
        await asyncio.sleep(0.01)
        cancelled = await api.cancel(first["id"])
        assert cancelled["status"] == "cancelled" and _status(log, first["id"]) == "cancelled"
        assert chat.cancelled == 1 and saves == [True]
        deleted = await api.delete(second["id"])
        assert deleted["deleted"] and chat.cancelled == 2 and log.get(second["id"]) is None
        await asyncio.sleep(0.01)
        assert log.get(second["id"]) is None and not api.background     # nothing stored after the delete
    asyncio.run(run())


def test_a_router_that_stops_leaves_its_background_responses_failed_not_in_progress():
    """A router renews its lease while it runs background responses; when it stops (its task and
    renewals gone with it), a new router reading the response after a lease finds it failed."""
    async def run():
        api, log, _ = _api(Chat(), lease_s=0.3)
        running = await api.create(ResponsesRequest(input="Hi", background=True))
        await asyncio.sleep(0.6)                       # two leases: renewed all along
        assert _status(log, running["id"]) == "in_progress"
        for task in (api.background[running["id"]].task, api._renewing):       # the router dies
            task.cancel()
        await asyncio.sleep(0.4)
        after, _, _ = _api(Chat(), log=log, lease_s=0.3)
        failed = _body(await after.retrieve(running["id"]))
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        assert _body(await after.cancel(running["id"]))["status"] == "failed"        # it ended
    asyncio.run(run())


def test_a_request_the_chat_endpoint_would_refuse_is_refused_before_it_is_queued():
    """The refusal (here a prompt beyond the context) is the create call's answer; nothing stored."""
    async def refusal(chat):
        if "too long" in chat.messages[-1].content:
            return error_response(400, "this model's maximum context length is 8 tokens", param="messages")
        return None

    async def run():
        chat = Chat()
        api, log, _ = _api(chat, refusal=refusal)
        refused = await api.create(ResponsesRequest(input="too long", background=True))
        assert refused.status_code == 400 and "maximum context length" in _body(refused)["error"]["message"]
        assert len(log) == 0 and not api.background
        queued = await api.create(ResponsesRequest(input="Hi", background=True))
        chat.gate.set()
        await asyncio.sleep(0.01)
        assert queued["status"] == "queued" and _status(log, queued["id"]) == "completed"
    asyncio.run(run())


def test_without_a_store_background_is_a_400():
    async def run():
        api, _, _ = _api(Chat(), store=False)
        refused = await api.create(ResponsesRequest(input="Hi", background=True))
        assert refused.status_code == 400 and "responses.store is off" in _body(refused)["error"]["message"]
    asyncio.run(run())


async def _read(stream, until: str | None = None) -> list[dict]:
    """The events of a Responses stream (its body), all, or up to the first of type `until` (the
    reader then leaves)."""
    events = []
    async for text in stream.body_iterator:
        events.append(json.loads(text.split("data: ", 1)[1]))
        if events[-1]["type"] == until:
            break
    await stream.body_iterator.aclose()
    return events


def test_a_background_stream_goes_on_without_its_reader_and_is_read_again_from_any_event():
    async def run():
        chat = Chat()
        api, log, saves = _api(chat)
        chat.gate.set()
        REQUEST.set("the create call's")
        stream = await api.create(ResponsesRequest(input="The capital of France?", background=True, stream=True))
        first = await _read(stream, until="response.output_text.delta")      # then the client leaves
        assert chat.requests == [None]      # the task runs outside the create call's context (Serve's
        #                                     cancels that call's own calls when the client leaves)
        assert [e["type"] for e in first[:3]] == ["response.created", "response.queued", "response.in_progress"]
        assert first[0]["response"]["status"] == "queued" and first[-1]["delta"] == "Par"
        rid = first[0]["response"]["id"]
        await asyncio.sleep(0.05)
        assert _status(log, rid) == "in_progress" and rid in api.background       # it goes on without a reader
        # the client comes back through another router replica: it reads the store, live
        other, _, _ = _api(Chat(), log=log)
        reading = asyncio.ensure_future(_read(await other.stream_again(rid, first[-1]["sequence_number"])))
        await asyncio.sleep(0.05)
        chat.more.set()
        rest = await asyncio.wait_for(reading, 5)
        events = first + rest
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Paris."
        assert events[-1]["type"] == "response.completed" and events[-1]["response"]["usage"]["output_tokens"] == 2
        stored = json.loads(log.get(rid).response)
        assert stored["status"] == "completed" and stored["output"] == events[-1]["response"]["output"]
        await asyncio.sleep(0.01)              # the last event reached the store before the final save
        assert saves == [True] and not api.background
        # read again after its end: every event, the same; from the last one on: nothing
        assert await _read(await api.stream_again(rid, None)) == events
        assert await _read(await api.stream_again(rid, len(events) - 1)) == []
        # one not streamed cannot be streamed again
        polled = await api.create(ResponsesRequest(input="Hi", background=True))
        refused = await api.stream_again(polled["id"], None)
        assert refused.status_code == 400 and "background and stream" in _body(refused)["error"]["message"]
        assert (await api.stream_again("resp_nope", None)).status_code == 404
    asyncio.run(run())


def test_a_background_stream_ends_for_its_readers_when_cancelled_deleted_or_orphaned():
    async def run():
        chat = Chat()
        api, log, _ = _api(chat, lease_s=0.3)
        chat.gate.set()
        ids, last = [], 0
        for _ in range(3):
            stream = await api.create(ResponsesRequest(input="Hi", background=True, stream=True))
            events = await _read(stream, until="response.output_text.delta")
            ids.append(events[0]["response"]["id"])
            last = events[-1]["sequence_number"]
        cancelled, deleted, orphan = ids
        # readers on this router (reading its writers) and on another one (reading the store)
        other, _, _ = _api(Chat(), log=log, lease_s=0.3)
        readers = [asyncio.ensure_future(_read(await router.stream_again(rid, last)))
                   for rid in ids for router in (api, other)]
        await asyncio.sleep(0.05)
        assert (await api.cancel(cancelled))["status"] == "cancelled"
        for reader in readers[:2]:                     # it ends: no event says cancelled
            assert (await asyncio.wait_for(reader, 1)) == []
        assert (await api.delete(deleted))["deleted"]
        for reader in readers[2:4]:
            assert (await asyncio.wait_for(reader, 1)) == []
        for task in (api.background[orphan].task, api._renewing):      # the router dies (its readers too)
            task.cancel()
        readers[4].cancel()
        failed = await asyncio.wait_for(readers[5], 5)                 # within a lease and a poll
        assert [e["type"] for e in failed] == ["response.failed"] and failed[0]["sequence_number"] == last + 1
        assert failed[0]["response"]["error"]["code"] == "server_error" and chat.cancelled == 0
    asyncio.run(run())


def test_a_background_stream_that_fails_ends_with_response_failed_and_is_stored_failed():
    """Refused when it runs (here a prompt beyond the context), or failed mid-stream: its last event
    is response.failed, with the response as stored."""
    async def run():
        chat = Chat()
        api, log, saves = _api(chat)
        chat.gate.set()
        chat.more.set()
        for prompt, words in (("too long", "maximum context length"), ("fail mid-way", "decode replica failed")):
            events = await _read(await api.create(ResponsesRequest(input=prompt, background=True, stream=True)))
            assert events[-1]["type"] == "response.failed" and words in events[-1]["response"]["error"]["message"]
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            rid = events[0]["response"]["id"]
            await asyncio.sleep(0.01)
            assert json.loads(log.get(rid).response) == events[-1]["response"]
            assert await _read(await api.stream_again(rid, None)) == events       # the same from the store
        assert saves == [True, True]
    asyncio.run(run())
