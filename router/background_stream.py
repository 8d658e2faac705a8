"""A background response's stream (router/responses_api.py, `background` with `stream`): its
Responses events kept in the router that runs it, for the readers there, and sent on to the
ResponseStore (router/response_store.py) for the readers on any other router, or after this one
is gone.

Contract (all on the router's event loop): `add` is called by the create call (the first events,
before its answer) and then by the response's task; `end` by the task as the response ends, or by
`cancel` or `delete` (the first call ends the stream; later ones, and `add` after it, do nothing);
any number of readers call `read`. One call to the store is out at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math

from router.response_store import StoredResponses, StoreUnavailable

log = logging.getLogger("pdserve.router")
SEND_INTERVAL_S = 0.25    # a background stream's events go to the store at most this often


class EventWriter:
    """A background response's stream: its events in order, kept here for the readers on this
    router (`read`) and sent to the store for those on any other (or after this router is gone):
    one call at a time, at most every SEND_INTERVAL_S, sends all that came meanwhile (the readers
    here do not wait for it). `end` adds the last ones and sends the rest at once.
    A batch the store did not keep (unavailable, or the response dropped) stops the sending
    (logged): the readers here still get every event, those reading the store end where the
    response ends (ResponseLog.events)."""

    def __init__(self, stored: StoredResponses, response_id: str):
        self.stored, self.rid = stored, response_id
        self.events: list[str] = []
        self.ended = self.done = False      # ended: nothing more is added; done: the last events are in
        self.sent, self.broken = 0, False
        self._sending: asyncio.Future | None = None
        self._changed, self._hurry = asyncio.Event(), asyncio.Event()
        self._last_send = -math.inf

    def add(self, events: list[str]) -> None:
        if self.ended or not events:
            return
        self.events += events
        self._changed.set()
        self._send_soon()

    async def end(self, events: list[str], response: dict | None = None, context: list[dict] | None = None) -> bool:
        """Add `events`, the stream's last, with `response` (as it ended, and its `context`) kept in
        the store in the same call; the readers here get them after that call. Whether the store
        kept them (False: it did not, or the stream had ended)."""
        if self.ended:
            return False
        self.ended = True          # nothing is added after this; the sender stops (or ends its call)
        self._hurry.set()
        kept, last = False, []
        try:
            if await self.sent_all():
                kept = await self.stored.add_events(self.rid, self.sent, self.events[self.sent:] + events, True,
                                                    response, context)
            last = events
        except StoreUnavailable as exc:
            log.warning("background response %s: its stream's end not stored: %s", self.rid, exc)
            last = events
        finally:                   # cancelled meanwhile: the readers here end without the last events
            self.broken, self.done = True, True
            self.events += last
            self._changed.set()
        return kept

    async def sent_all(self) -> bool:
        """Whether every event so far reached the store (waits for the call out)."""
        if self._sending is not None:
            await asyncio.shield(self._sending)
        return not self.broken

    async def read(self, after: int):
        """The events after sequence number `after`, a list at a time as they come, to the end."""
        i = after + 1
        while True:
            if i < len(self.events):
                batch = self.events[i:]
                i += len(batch)
                yield batch
            elif self.done:
                return
            else:
                self._changed.clear()
                await self._changed.wait()

    def _send_soon(self) -> None:
        if not self.broken and (self._sending is None or self._sending.done()):
            self._sending = asyncio.ensure_future(self._send())

    async def _send(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.broken and self.sent < len(self.events):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._hurry.wait(), self._last_send + SEND_INTERVAL_S - loop.time())
            if self.ended:                  # `end` sends the rest with the last events
                return
            self._last_send = loop.time()
            batch = self.events[self.sent:]
            try:
                kept = await self.stored.add_events(self.rid, self.sent, batch)
            except StoreUnavailable as exc:
                kept = False
                log.warning("background response %s: its stream's events not stored: %s", self.rid, exc)
            self.sent += len(batch)
            self.broken = not kept
