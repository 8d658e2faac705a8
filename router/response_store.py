"""Stored responses of the Responses API: what `store` keeps and `previous_response_id` reads.

A stored response's life cycle:
  1. save    the router, when a response has completed (status completed or incomplete) and its
             request did not say `store: false`, sends it to the ResponseStore (`StoredResponse`:
             the Response object's JSON and its context's) before the response, or the stream's
             last event, goes out: a client that has the answer can chain from it at once
  2. chain   a request naming `previous_response_id` gets that response's context and output as
             the start of its own conversation (`instructions` and tools are not carried over, as
             OpenAI has it); its own context is that plus its input
  3. read    GET /v1/responses/{id} (the Response), GET /v1/responses/{id}/input_items (its
             context, paged), DELETE /v1/responses/{id}
  4. drop    past `responses.max_stored` responses or `max_stored_bytes`, the least recently
             saved or read go first; a restart of the store (any change to the app's `args`)
             loses them all
A background response (router/responses_api.py) is saved `queued` and `in_progress` with its
router's `owner` id, and that router renews its lease while it runs any (`renew`, every third of
`responses.background_lease_s`); one read after its owner was silent a whole lease (the router
failed or was replaced, and its task with it) is stored `failed` then, so a client polling it
gets an end. A background response created with `stream` also has its stream's events here
(`add_events`, as its router makes them): any router replica can replay them to a client that
comes back (`events`, waiting for the next while none is there), until the response is dropped;
they count in its bytes. The store also keeps the router's registry of LoRA adapters loaded at run time
(router/runtime_lora.py), for a router that restarts: the app's head-node state lives here.

`ResponseLog` is the bookkeeping (no Ray, unit-tested); `ResponseStore` is the one-replica Serve
deployment holding it on the head node, shared by every router replica; `StoredResponses` is the
router's side. Who frees what: nothing here holds KV or engine state, only JSON text and the
registry's message.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from ray import serve

from serving import messages
from serving.config import ResponsesOptions
from serving.placement import head_actor_options
from serving.ray_compat import direct_stream

log = logging.getLogger("pdserve.router")
MAX_PAGE = 100
STORE_TIMEOUT_S = 5.0     # a call to the store, at most (StoredResponses)
EVENT_PAGE_BYTES = 4 * 2**20    # a page of stream events (ResponseLog.events), at most (one event more)
RUNNING = ("queued", "in_progress")


ORPHANED = ("The server stopped running this background response before it ended (its router failed or was "
            "replaced); create the response again.")


class ResponseLog:
    """Responses by id, least recently used first out past `max_stored` entries or `max_bytes`
    characters (their JSON is ASCII: characters are bytes); background responses whose owner's
    lease (`lease_s` on `clock`) ran out are failed as they are read."""

    def __init__(self, max_stored: int, max_bytes: int, lease_s: float = 30.0, clock=time.monotonic):
        self.max_stored, self.max_bytes = max_stored, max_bytes
        self._entries: OrderedDict[str, messages.StoredResponse] = OrderedDict()
        self._streams: dict[str, _Stream] = {}   # a background stream's events, by its response's id
        self.bytes = 0
        self.lease_s, self._clock = lease_s, clock
        self._renewed: dict[str, float] = {}     # owner (a router instance) -> when it last renewed

    def renew(self, owner: str) -> None:
        """`owner` is alive: its background responses are not orphans for another `lease_s`."""
        self._renewed[owner] = self._clock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, stored: messages.StoredResponse) -> bool:
        """Keep `stored` (replacing one of the same id); False, keeping nothing, where it alone is
        larger than `max_bytes`. Saving one's owner renews it."""
        if stored.owner:
            self.renew(stored.owner)
        rid = stored.response_id
        if (old := self._entries.pop(rid, None)) is not None:
            self.bytes -= _size(old)
        size = _size(stored)
        if size > self.max_bytes:
            self.delete(rid)
            return False
        self._entries[rid] = stored
        self.bytes += size
        stream = self._streams.get(rid)
        if stream is not None and not stream.ended and json.loads(stored.response)["status"] not in RUNNING:
            stream.ended, stream.final = True, stored.response    # ended without its last event
        self._bound()
        return True

    def _bound(self) -> None:
        """Drop the least recently used responses (with their events) past either bound."""
        while len(self._entries) > self.max_stored or self.bytes > self.max_bytes:
            self.delete(next(iter(self._entries)))

    def get(self, response_id: str) -> messages.StoredResponse | None:
        stored = self._entries.get(response_id)
        if stored is None:
            return None
        self._entries.move_to_end(response_id)
        if stored.owner and self._clock() - self._renewed.get(stored.owner, -math.inf) > self.lease_s:
            stored = orphaned(stored)
            self.put(stored)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self._entries.pop(response_id, None)
        if stored is not None:
            self.bytes -= _size(stored)
        if (stream := self._streams.pop(response_id, None)) is not None:
            self.bytes -= stream.bytes
        return stored is not None

    def add_events(self, batch: messages.ResponseEventBatch) -> bool:
        """Append the next events of a stored response's stream (the last ones with the response
        as it ended, kept then); False (nothing kept) where the response is not kept (dropped,
        deleted), its stream ended, or `batch` does not start where the stream is (a lost batch:
        the rest would not follow on). A stream also ends, without its last event, where its
        response is saved as ended (cancelled, failed by the lease, or saved alone by a router
        whose events stopped reaching the store)."""
        rid = batch.response_id
        if rid not in self._entries:
            return False
        stream = self._streams.setdefault(rid, _Stream())
        if stream.ended or batch.first != len(stream.events):
            return False
        size = sum(len(event.encode()) for event in batch.events)
        stream.events += batch.events
        stream.ended, stream.bytes = batch.end, stream.bytes + size
        self.bytes += size
        self._entries.move_to_end(rid)
        self._bound()
        if batch.response and rid in self._entries:
            return self.put(messages.StoredResponse(rid, batch.response, batch.context))
        return rid in self._entries

    def events(self, response_id: str, after: int) -> messages.ResponseEventPage | None:
        """The stream's events after sequence number `after` (a page: at most EVENT_PAGE_BYTES but
        one event); None where the response or its stream is not kept. It has `ended` once no
        event follows them, and the stored Response where the stream ended without its last event
        (see `add_events`; a router that failed: `get` reads it as failed)."""
        stored, stream = self.get(response_id), self._streams.get(response_id)
        if stored is None or stream is None:
            return None
        out, size, first = [], 0, max(after + 1, 0)
        for event in itertools.islice(stream.events, first, None):
            if out and size + len(event) > EVENT_PAGE_BYTES:
                return messages.ResponseEventPage(tuple(out), False)
            out.append(event)
            size += len(event)
        return messages.ResponseEventPage(tuple(out), stream.ended, stream.final)


@dataclass
class _Stream:
    """A background response's stream events (server-sent event text), sequence number = index."""
    events: list[str] = field(default_factory=list)
    ended: bool = False
    bytes: int = 0
    final: str = ""       # the response as it ended, where the stream ended without its last event


def orphaned(stored: messages.StoredResponse) -> messages.StoredResponse:
    """A background response whose router stopped running it, as failed."""
    response = {**json.loads(stored.response), "status": "failed",
                "error": {"code": "server_error", "message": ORPHANED}}
    return messages.StoredResponse(stored.response_id, json.dumps(response), stored.context)


def _size(stored: messages.StoredResponse) -> int:
    return len(stored.response) + len(stored.context)


class ResponseKeeper:
    """The store's calls over a `ResponseLog` (the ResponseStore deployment below is this on the
    head node; tests call it directly). Each call is one message, no state outside the log and
    the registry. Methods are coroutines on one event loop: `events` may wait there for the next
    event (a long poll), woken by every save and every batch."""

    def __init__(self, log: ResponseLog):
        self._log = log
        self._runtime_loras: bytes | None = None
        self._changed = asyncio.Condition()

    async def _changed_now(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def put(self, data: bytes) -> bool:
        kept = self._log.put(messages.decode(data, expect=messages.StoredResponse))
        await self._changed_now()
        return kept

    async def add_events(self, data: bytes) -> bool:
        kept = self._log.add_events(messages.decode(data, expect=messages.ResponseEventBatch))
        await self._changed_now()
        return kept

    async def events(self, data: bytes) -> bytes | None:
        """`ResponseLog.events`, waiting up to the query's `wait_s` while there is no event after
        `after` and the stream has not ended."""
        query = messages.decode(data, expect=messages.ResponseEventQuery)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + query.wait_s
        async with self._changed:
            while True:
                page = self._log.events(query.response_id, query.after)
                if page is None or page.events or page.ended or loop.time() >= deadline:
                    break
                try:
                    await asyncio.wait_for(self._changed.wait(), deadline - loop.time())
                except asyncio.TimeoutError:
                    pass
        return None if page is None else messages.encode(page)

    async def get(self, response_id: str) -> bytes | None:
        stored = self._log.get(response_id)
        return None if stored is None else messages.encode(stored)

    async def delete(self, response_id: str) -> bool:
        deleted = self._log.delete(response_id)
        await self._changed_now()
        return deleted

    async def renew(self, owner: str) -> None:
        self._log.renew(owner)

    async def runtime_loras(self) -> bytes | None:
        """The routers' registry of LoRA adapters loaded at run time (router/runtime_lora.py), kept
        here, beside the responses and as long as they are, so that a router that restarts finds
        it; None before any load."""
        return self._runtime_loras

    async def keep_runtime_loras(self, data: bytes) -> None:
        messages.decode(data, expect=messages.RuntimeLoraRegistry)
        self._runtime_loras = data


@serve.deployment(num_replicas=1, max_ongoing_requests=1000, ray_actor_options=head_actor_options(),
                  logging_config={"enable_access_log": False})
class ResponseStore(ResponseKeeper):
    """The one store, called by router replicas only (StoredResponses)."""

    def __init__(self, options: dict):
        opts = ResponsesOptions.model_validate(options)
        super().__init__(ResponseLog(opts.max_stored, opts.max_stored_bytes, opts.background_lease_s))


class StoreUnavailable(RuntimeError):
    """The store did not answer (its replica is down or restarting)."""


@dataclass(frozen=True)
class Found:
    """A stored response as the store keeps it (JSON text: GET /v1/responses/{id} sends `response`
    as it is, and only what reads the items parses them)."""
    response: str          # the Response object
    context_json: str      # the input items before its output, a list

    def context(self) -> list[dict]:
        return json.loads(self.context_json)

    def history(self) -> list[dict]:
        """What a request chained to this response starts with: its context, then its output."""
        return self.context() + json.loads(self.response)["output"]


class StoredResponses:
    """The router's side of the store (`handle`: the ResponseStore deployment's handle, used over
    Serve's gRPC transport where the cluster allows: serving/ray_compat.py). Every call gives up
    after `timeout_s`: while the store's replica is being replaced, Serve holds calls for the new
    one, and a request must not wait on that for long."""

    def __init__(self, handle, timeout_s: float = STORE_TIMEOUT_S):
        self.handle, self.timeout_s = direct_stream(handle, messages.MAX_MESSAGE_BYTES), timeout_s

    async def _call(self, method: str, *args):
        try:
            return await asyncio.wait_for(getattr(self.handle, method).remote(*args), self.timeout_s)
        except asyncio.TimeoutError:
            raise StoreUnavailable(f"no answer in {self.timeout_s:g} s") from None
        except Exception as exc:  # noqa: BLE001 - one error for the caller to answer
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None

    async def save(self, response: dict, context: list[dict], owner: str = "") -> bool:
        """Keep `response` (its `store` already true; `owner`: the router instance running it in the
        background, while it runs); False where it was not kept (logged)."""
        stored = messages.StoredResponse(response["id"], json.dumps(response), json.dumps(context), owner)
        try:
            kept = await self._call("put", messages.encode(stored))
        except StoreUnavailable as exc:     # the answer goes out anyway, unstored
            log.warning("response %s not stored: %s", response["id"], exc)
            return False
        if not kept:
            log.warning("response %s not stored: larger than responses.max_stored_bytes", response["id"])
        return kept

    async def find(self, response_id: str) -> Found | None:
        data = await self._call("get", response_id)
        if data is None:
            return None
        stored = messages.decode(data, expect=messages.StoredResponse)
        return Found(stored.response, stored.context)

    async def delete(self, response_id: str) -> bool:
        return await self._call("delete", response_id)

    async def renew(self, owner: str) -> None:
        await self._call("renew", owner)

    async def add_events(self, response_id: str, first: int, events: list[str], end: bool = False,
                         response: dict | None = None, context: list[dict] | None = None) -> bool:
        """Append a background stream's events (`first`: the first one's sequence number; `end`:
        the last ones, with `response` and its `context` to keep in the same call); False where the
        store did not keep them (see ResponseLog.add_events)."""
        final = ("", "") if response is None else (json.dumps(response), json.dumps(context or []))
        batch = messages.ResponseEventBatch(response_id, first, tuple(events), end, *final)
        return await self._call("add_events", messages.encode(batch))

    async def events(self, response_id: str, after: int, wait_s: float = 0.0) -> messages.ResponseEventPage | None:
        """The stream's events after sequence number `after`, waiting up to `wait_s` (under the
        call's timeout) for one; None where the response or its stream is not kept."""
        data = await self._call("events", messages.encode(messages.ResponseEventQuery(response_id, after, wait_s)))
        return None if data is None else messages.decode(data, expect=messages.ResponseEventPage)

    async def runtime_loras(self) -> messages.RuntimeLoraRegistry | None:
        data = await self._call("runtime_loras")
        return None if data is None else messages.decode(data, expect=messages.RuntimeLoraRegistry)

    async def keep_runtime_loras(self, registry: messages.RuntimeLoraRegistry) -> None:
        await self._call("keep_runtime_loras", messages.encode(registry))


def unique_ids(items: list[dict]) -> list[dict]:
    """`items` with a new id for each whose id came earlier (a client may send an item it got
    back, as well as continuing the response that has it): the pages' cursor is an item's id."""
    seen, out = set(), []
    for item in items:
        if item["id"] in seen:
            item = {**item, "id": f"{item['id'].split('_', 1)[0]}_{uuid.uuid4().hex}"}
        seen.add(item["id"])
        out.append(item)
    return out


def page(items: list[dict], limit: int, order: str, after: str | None) -> dict:
    """One page of a response's input items (OpenAI's list object): `order` "asc" (as the
    conversation went) or "desc", the items after the one with id `after` (none where no item has it)."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item.get("id") for item in ordered]
        ordered = ordered[ids.index(after) + 1:] if after in ids else []
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}
