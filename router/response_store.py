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
gets an end. The store also keeps the router's registry of LoRA adapters loaded at run time
(router/runtime_lora.py), for a router that restarts: the app's head-node state lives here.

`ResponseLog` is the bookkeeping (no Ray, unit-tested); `ResponseStore` is the one-replica Serve
deployment holding it on the head node, shared by every router replica; `StoredResponses` is the
router's side. Who frees what: nothing here holds KV or engine state, only JSON text and the
registry's message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from ray import serve

from serving import messages
from serving.config import ResponsesOptions
from serving.placement import head_actor_options
from serving.ray_compat import direct_stream

log = logging.getLogger("pdserve.router")
MAX_PAGE = 100
STORE_TIMEOUT_S = 5.0     # a call to the store, at most (StoredResponses)


ORPHANED = ("The server stopped running this background response before it ended (its router failed or was "
            "replaced); create the response again.")


class ResponseLog:
    """Responses by id, least recently used first out past `max_stored` entries or `max_bytes`
    characters (their JSON is ASCII: characters are bytes); background responses whose owner's
    lease (`lease_s` on `clock`) ran out are failed as they are read."""

    def __init__(self, max_stored: int, max_bytes: int, lease_s: float = 30.0, clock=time.monotonic):
        self.max_stored, self.max_bytes = max_stored, max_bytes
        self._entries: OrderedDict[str, messages.StoredResponse] = OrderedDict()
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
        self.delete(stored.response_id)
        size = _size(stored)
        if size > self.max_bytes:
            return False
        self._entries[stored.response_id] = stored
        self.bytes += size
        while len(self._entries) > self.max_stored or self.bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= _size(dropped)
        return True

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
        return stored is not None


def orphaned(stored: messages.StoredResponse) -> messages.StoredResponse:
    """A background response whose router stopped running it, as failed."""
    response = {**json.loads(stored.response), "status": "failed",
                "error": {"code": "server_error", "message": ORPHANED}}
    return messages.StoredResponse(stored.response_id, json.dumps(response), stored.context)


def _size(stored: messages.StoredResponse) -> int:
    return len(stored.response) + len(stored.context)


@serve.deployment(num_replicas=1, max_ongoing_requests=1000, ray_actor_options=head_actor_options(),
                  logging_config={"enable_access_log": False})
class ResponseStore:
    """Called by router replicas only (StoredResponses); each call is one message, no state
    outside the log. Methods are coroutines: they run on the replica's loop, one at a time."""

    def __init__(self, options: dict):
        opts = ResponsesOptions.model_validate(options)
        self._log = ResponseLog(opts.max_stored, opts.max_stored_bytes, opts.background_lease_s)
        self._runtime_loras: bytes | None = None

    async def put(self, data: bytes) -> bool:
        return self._log.put(messages.decode(data, expect=messages.StoredResponse))

    async def get(self, response_id: str) -> bytes | None:
        stored = self._log.get(response_id)
        return None if stored is None else messages.encode(stored)

    async def delete(self, response_id: str) -> bool:
        return self._log.delete(response_id)

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
